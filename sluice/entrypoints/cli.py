"""The `sluice` command: generate, serve, router, make-model, bench."""

from __future__ import annotations

import argparse
import json
import sys
import time

from sluice.engine.flags import add_engine_args, engine_args_from
from sluice.version import __version__


def _cmd_generate(ns: argparse.Namespace) -> int:
    from sluice.sampling_params import SamplingParams

    check_device(ns.device)
    prompts = ns.prompt or ["The quick brown fox"]
    params = SamplingParams(n=ns.n, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                            max_tokens=ns.max_tokens, seed=ns.sampling_seed,
                            ignore_eos=ns.ignore_eos)
    engine_args = engine_args_from(ns)
    engine_args.create_engine_config()  # bad arguments fail here, before PyTorch loads

    from sluice.entrypoints.llm import LLM

    llm = LLM(**vars(engine_args))
    start = time.perf_counter()
    if ns.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                           use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_generated = 0
    for prompt, output in zip(prompts, outputs):
        for completion in output.outputs:
            num_generated += len(completion.token_ids)
            if ns.json:
                print(json.dumps({"prompt": prompt, "text": completion.text,
                                  "token_ids": completion.token_ids,
                                  "finish_reason": completion.finish_reason}))
            else:
                print(f"prompt: {prompt!r}\noutput: {completion.text!r} "
                      f"({len(completion.token_ids)} tokens, {completion.finish_reason})")
    print(f"model: {llm.llm_engine.model_config.name or llm.llm_engine.model_config.model} | "
          f"{num_generated} tokens in {elapsed:.2f} s", file=sys.stderr)
    return 0


def check_device(device: str) -> None:
    """A clear error for a CUDA device this PyTorch cannot use (instead of a traceback from
    deep in the model runner)."""
    if not device.startswith("cuda"):
        return
    import torch

    if torch.version.cuda is None:
        raise ValueError(
            f"--device {device} needs a CUDA build of PyTorch, but this one ({torch.__version__}) "
            "is CPU-only. Install a CUDA build into this environment, e.g. "
            "'.venv/bin/python -m pip install torch --index-url "
            "https://download.pytorch.org/whl/cu128' (see the README), or use --device cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: PyTorch {torch.__version__} is built for CUDA "
                         f"{torch.version.cuda} but sees no GPU (check the driver and "
                         "CUDA_VISIBLE_DEVICES), or use --device cpu")


def _cmd_serve(ns: argparse.Namespace) -> int:
    from sluice.entrypoints.openai.api_server import ServerArgs, run_server

    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ValueError(f"the model is given twice: {ns.model_tag!r} and --model "
                             f"{ns.model!r}")
        ns.model = ns.model_tag
    check_device(ns.device)
    if ns.model is None and ns.tool_call_parser is None:
        from sluice.model.builtin import SMOLLM2_TOOL_PARSER

        ns.tool_call_parser = SMOLLM2_TOOL_PARSER  # the built-in model's format
    server_args = ServerArgs(
        host=ns.host, port=ns.port, api_key=ns.api_key,
        served_model_name=tuple(ns.served_model_name or ()),
        disable_log_stats=ns.disable_log_stats, enable_log_requests=ns.enable_log_requests,
        max_log_len=ns.max_log_len, uvicorn_log_level=ns.uvicorn_log_level,
        max_request_body_bytes=ns.max_request_body_bytes,
        shutdown_timeout_s=ns.shutdown_timeout,
        trust_request_chat_template=ns.trust_request_chat_template,
        chat_template=ns.chat_template, chat_template_timeout_s=ns.chat_template_timeout,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        tool_call_parser=ns.tool_call_parser, reasoning_parser=ns.reasoning_parser)
    if ns.api_server_count != 1:
        from sluice.entrypoints.openai.multi_server import run_multi_server

        return run_multi_server(server_args, engine_args_from(ns), ns.api_server_count,
                                model_name=ns.model)
    return run_server(server_args, engine_args_from(ns), model_name=ns.model)


def _cmd_make_model(ns: argparse.Namespace) -> int:
    from sluice.model.tiny import make_tiny_model

    kwargs = {} if ns.dtype is None else {"dtype": ns.dtype}
    path = make_tiny_model(ns.dir, arch=ns.arch, preset=ns.preset, seed=ns.seed,
                           quantize=ns.quantize, **kwargs)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="LLM inference engine")
    parser.add_argument("--version", action="version", version=f"sluice {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline")
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON line per completion")
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="model folder, Hugging Face hub id or .gguf file (as --model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0: a free port (logged)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="names clients use (default: the model as named, or the "
                            "built-in model's name)")
    serve.add_argument("--disable-log-stats", action="store_true")
    serve.add_argument("--enable-log-requests", action="store_true")
    serve.add_argument("--max-log-len", type=int, default=None)
    serve.add_argument("--uvicorn-log-level", default="info")
    serve.add_argument("--api-server-count", type=int, default=1,
                       help="API-server processes sharing the port and one engine core "
                            "(tokenizing, detokenizing and HTTP on N cores)")
    serve.add_argument("--max-request-body-bytes", type=int, default=32 << 20,
                       help="larger request bodies get a 413, unread (default: 32 MiB)")
    serve.add_argument("--shutdown-timeout", type=float, default=25.0,
                       help="seconds SIGTERM waits for requests in flight before aborting "
                            "them (default: 25)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="run chat templates sent in requests (chat_template, "
                            "chat_template_kwargs.chat_template); refused otherwise")
    serve.add_argument("--chat-template-timeout", type=float, default=10.0,
                       help="seconds a chat template may render (default: 10)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="parse tool calls out of replies to requests with tools "
                            "(tool_choice auto); needs --tool-call-parser")
    serve.add_argument("--chat-template", default=None,
                       help="the chat template to render messages with: a file, or the "
                            "template itself (default: the model's)")
    serve.add_argument("--tool-call-parser", default=None,
                       choices=["hermes", "smollm2", "llama3_json", "pythonic", "mistral"],
                       help="the model's tool-call format, for tool_choice auto and the format "
                            "required / named calls are held to (hermes: Qwen, Hermes; "
                            "smollm2: SmolLM2; llama3_json, pythonic: Llama 3.x / 4; mistral; "
                            "default: hermes, smollm2 for the built-in model)")
    serve.add_argument("--reasoning-parser", default=None, choices=["qwen3"],
                       help="split <think>...</think> into reasoning_content")
    add_engine_args(serve)
    serve.set_defaults(func=_cmd_serve)

    from sluice.router import cli as router_cli

    router_cli.add_parser(sub)
    from sluice.kv_transfer.pool import shm_server

    shm_server.add_parser(sub)

    make = sub.add_parser("make-model", help="write a random-weight model folder")
    make.add_argument("dir")
    make.add_argument("--arch", default="qwen3", help="qwen3 | llama | qwen2 | qwen3_moe")
    make.add_argument("--preset", default="tiny",
                      help="tiny | qwen3-0.6b | qwen3-8b | qwen3-30b-a3b (with --arch qwen3_moe)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: preset's)")
    make.add_argument("--quantize", default=None, choices=["fp8-block", "fp8-channel"],
                      help="store the decoder's projections and experts as FP8: per "
                      "128x128 block (quant_method fp8, as Qwen3-*-FP8) or per output "
                      "channel (compressed-tensors FP8-dynamic)")
    make.set_defaults(func=_cmd_make_model)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    # Each benchmark module adds its own subcommand: module.add_parser(bench_sub).
    from sluice.bench import (
        kv_pool,
        kv_pool_serve,
        kv_tier,
        latency,
        profile_steps,
        serve_offline,
        spec_decode,
        structured,
        throughput,
    )
    from sluice.bench import pd as bench_pd
    from sluice.bench import router as bench_router
    from sluice.bench import serve as bench_serve

    bench_serve.add_parser(bench_sub)
    serve_offline.add_parser(bench_sub)
    bench_pd.add_parser(bench_sub)
    bench_router.add_parser(bench_sub)
    throughput.add_parser(bench_sub)
    latency.add_parser(bench_sub)
    profile_steps.add_parser(bench_sub)
    spec_decode.add_parser(bench_sub)
    kv_tier.add_parser(bench_sub)
    kv_pool.add_parser(bench_sub)
    kv_pool_serve.add_parser(bench_sub)
    structured.add_parser(bench_sub)
    return parser


def build_router_parser() -> argparse.ArgumentParser:
    """`sluice router` alone: the router runs no model, and building the other commands'
    parsers imports PyTorch (3 of the 4 s a router took to start on a 2-core CPU)."""
    from sluice.router import cli as router_cli

    parser = argparse.ArgumentParser(prog="sluice", description="LLM inference engine")
    router_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def build_pool_server_parser() -> argparse.ArgumentParser:
    """`sluice pool-server` alone (no PyTorch either: it only keeps an index)."""
    from sluice.kv_transfer.pool import shm_server

    parser = argparse.ArgumentParser(prog="sluice", description="LLM inference engine")
    shm_server.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["router"]:
        parser = build_router_parser()
    elif args[:1] == ["pool-server"]:
        parser = build_pool_server_parser()
    else:
        parser = build_parser()
    ns = parser.parse_args(args)
    ns.sluice_argv = ["sluice", *args]  # the command as typed, for benchmark records
    try:
        return ns.func(ns)
    except ValueError as e:
        print(f"sluice: error: {e}", file=sys.stderr)
        return 2

