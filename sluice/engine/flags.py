"""The engine's command-line flags, shared by every command that builds an engine (`sluice
generate`, `sluice serve`, the offline benchmarks): one flag per EngineArgs field, and the
namespace parsed back into EngineArgs. Free of PyTorch (EngineArgs is imported where used), so
that building a parser stays cheap."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any

from sluice.config import KVTransferConfig
from sluice.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:  # imported where used: it imports PyTorch, which `sluice router` never needs
    from sluice.engine.arg_utils import EngineArgs


def speculative_config_arg(text: str) -> dict[str, Any] | None:
    """--speculative-config JSON, validated while parsing (so a bad value is a usage error naming
    the flag, not a traceback); returns the dict of the config's fields, or None for `null`."""
    try:
        config = SpeculativeConfig.from_dict(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return None if config is None else asdict(config)


def kv_transfer_config_arg(text: str) -> dict[str, Any] | None:
    """--kv-transfer-config JSON, validated while parsing, as the dict of the config's fields
    (None for `null`)."""
    try:
        config = KVTransferConfig.from_dict(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return None if config is None else config.to_dict()


# flag name -> (EngineArgs field, type); booleans get --flag / --no-flag.
ENGINE_FLAGS: list[tuple[str, type | Callable[[str], Any], str]] = [
    ("model", str, "Hugging Face model folder, hub id (e.g. Qwen/Qwen3-0.6B) or .gguf file "
                   "(default: the built-in model)"),
    ("tokenizer", str, "tokenizer folder (default: the model folder, or a .gguf file's own)"),
    ("hf-config-path", str, "folder whose config.json a .gguf model uses instead of its "
                            "metadata"),
    ("dtype", str, "auto | float32 | bfloat16 | float16"),
    ("seed", int, "random seed"),
    ("max-model-len", int, "context length (default: from config.json)"),
    ("block-size", int, "tokens per KV cache block"),
    ("enable-prefix-caching", bool, "reuse KV of shared prefixes"),
    ("enable-chunked-prefill", bool, "split long prompts over steps"),
    ("max-num-batched-tokens", int, "token budget of one step"),
    ("max-num-seqs", int, "most sequences in one step"),
    ("max-num-partial-prefills", int, "prompts prefilled in chunks at once"),
    ("long-prefill-token-threshold", int, "chunk size cap for long prompts (0: none)"),
    ("num-gpu-blocks-override", int, "number of KV cache blocks"),
    ("gpu-memory-utilization", float, "fraction of GPU memory to use"),
    ("kv-cache-dtype", str, "auto (the model's dtype) | fp8 = fp8_e4m3 (float8_e4m3fn, "
                            "saturating, no scales: half a 16-bit model's KV bytes; changes the "
                            "output) | fp8_e5m2 (float8_e5m2, likewise)"),
    ("device", str, "auto | cpu | cuda"),
    ("enforce-eager", bool, "no CUDA graphs and no torch.compile (GPU)"),
    ("dense-prefill", bool, "cuDNN's dense attention for a lone prompt and a long prompt's "
                            "middle chunks where it runs (GPU, 16-bit; default: on)"),
    ("async-scheduling", bool, "schedule the next step while the GPU runs this one "
                               "(default: on with a GPU)"),
    ("speculative-config", speculative_config_arg,
     'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
     "(methods: ngram | draft_model | eagle; drafting policy: disable_by_batch_size, "
     "min_accepted_tokens_per_step, probe_interval)"),
    ("tensor-parallel-size", int, "ranks (worker processes, one GPU each) the model is split over"),
    ("enable-expert-parallel", bool, "a mixture of experts' experts split whole over the "
                                     "tensor-parallel ranks (E / N each) instead of each "
                                     "expert sliced; the attention stays tensor-parallel"),
    ("distributed-executor-backend", str, "uni (the model in the engine's process) | mp (a "
                                          "worker process per rank); default: uni at TP 1"),
    ("kv-transfer-config", kv_transfer_config_arg,
     'a KV connector as JSON, vLLM\'s shape: \'{"kv_connector": "OffloadingConnector", '
     '"kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000}}\''),
    ("kv-offloading-size", float, "GiB of host memory for a CPU tier of the KV cache (the "
                                  "OffloadingConnector)"),
    ("disaggregation-mode", str, "prefill | decode: this instance's half of prefill/decode "
                                 "disaggregation (the PDConnector; a router pairs them)"),
    ("disaggregation-bootstrap-port", int, "a prefill instance's bootstrap server port "
                                           "(0: a free one, logged)"),
    ("disaggregation-transfer-backend", str, "auto (the default: shm with a peer on this "
                                             "host, else mooncake) | shm (same host: shared "
                                             "memory, CUDA IPC) | mooncake (Mooncake Transfer "
                                             "Engine) | fake (loopback ZMQ, for tests)"),
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from sluice.engine.arg_utils import EngineArgs

    defaults = EngineArgs()
    group = parser.add_argument_group("engine")
    for flag, kind, help_text in ENGINE_FLAGS:
        dest = flag.replace("-", "_")
        default = getattr(defaults, dest)
        if kind is bool:
            group.add_argument(f"--{flag}", dest=dest, default=default,
                               action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument(f"--{flag}", dest=dest, type=kind, default=default,
                               help=f"{help_text} (default: {default})")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    from sluice.engine.arg_utils import EngineArgs

    names = {f.name for f in fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})
