"""`sluice bench kv-pool-serve`: two `sluice serve` instances sharing a global KV pool against two
that share nothing, under the same shared-prefix serving load (issue 15's serving measurement).

    sluice bench kv-pool-serve --backend mooncake --num-prompts 200 --shared-prefix-len 4096 \\
        --shared-prefix-groups 10 --suffix-len 256 --output-len 64 --request-rate 4 \\
        --output benchmarks/results/kv-transfer/DATE-pool-serve-h200.json

The load is `sluice bench serve`'s shared-prefix dataset (groups of prompts sharing a long
prefix, as a system prompt and history are shared by the turns of many chats), each request sent
to one of the two instances at random, as a load balancer that knows nothing of prefixes does.
Without a pool each instance computes every prefix it meets once (its own prefix cache); with one,
a prefix computed by either is loaded by the other. Each setting starts its instances afresh
(and, with the pool, a fresh `redis-server` or `mooncake_master` with a process owning the
store's memory, on loopback); the workload, seed and instance flags are the same. It prints mean
and P99 TTFT, TPOT and the throughput of both settings with their ratio (pool / no pool), and the
instances' pool counters, and saves everything as JSON with the command and the machine.

With two or more GPUs visible, instance i runs on GPU i; with one, both share it
(`--gpu-memory-utilization` each, started one after the other). On a CPU with a tiny model it is a
smoke test: `--device cpu --model PATH --dtype float32` and small lengths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from sluice.bench.serve import add_served_model_args, machine_line, run_benchmark
from sluice.bench.shared_prefix_load import (
    add_load_args,
    check_load_args,
    instance_flags,
    load_config,
    num_gpus,
    reuse_table,
    ttft_by_reuse,
    workload,
)

_SUMMARY = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
            "request_throughput", "output_throughput", "total_token_throughput", "completed")


def _pool_config(ns: argparse.Namespace, stack: ExitStack, load_mode: str) -> dict[str, Any]:
    """The KVPoolConnector config of a fresh server of `ns.backend` (started here)."""
    from sluice.testing import servers

    extra: dict[str, Any] = {"backend": ns.backend, "staging_bytes": ns.staging_bytes,
                             "load_policy": ns.load_policy, "load_mode": load_mode}
    if ns.backend == "shm":
        extra["url"] = stack.enter_context(servers.start_shm_pool(
            capacity_bytes=ns.pool_bytes, slot_bytes=ns.shm_slot_bytes)).url
    elif ns.backend == "redis":
        if missing := servers.redis_missing():
            raise ValueError(f"cannot start the redis backend: {missing}")
        extra["url"] = stack.enter_context(servers.start_redis(
            maxmemory=str(ns.pool_bytes), maxmemory_policy="allkeys-lru")).url
    else:
        if missing := servers.mooncake_missing():
            raise ValueError(f"cannot start the mooncake backend: {missing}")
        master = stack.enter_context(servers.start_mooncake_master())
        stack.enter_context(servers.start_mooncake_segment_owner(master.address, ns.pool_bytes))
        extra.update(url=master.url, global_segment_size=0)
    return {"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


def _instances(ns: argparse.Namespace, flags: list[str], workdir: Path) -> list[Any]:
    from sluice.testing.pd_cluster import Instance, serve_argv
    from sluice.testing.servers import free_port

    own_gpus = num_gpus(ns.device) >= 2
    instances = []
    for i in range(2):
        port = free_port()
        env = {"CUDA_VISIBLE_DEVICES": str(i)} if own_gpus else {}
        instances.append(Instance(f"instance{i}", serve_argv(ns.model, port, *flags), port,
                                  workdir, env))
    return instances


def _run_setting(ns: argparse.Namespace, name: str, load_mode: str | None, workdir: Path
                 ) -> dict[str, Any]:
    """One setting: without the pool (`load_mode` None) or with it, loading in that mode."""
    from sluice.testing.pd_cluster import start_instances

    flags = instance_flags(ns)
    with ExitStack() as stack:
        if load_mode is not None:
            flags += ["--kv-transfer-config", json.dumps(_pool_config(ns, stack, load_mode))]
        instances = _instances(ns, flags, workdir / name)
        (workdir / name).mkdir(parents=True, exist_ok=True)
        # One after the other: instances sharing a GPU size their cache from what is free.
        for instance in instances:
            start_instances([instance], ns.start_timeout)
            stack.callback(instance.stop)
        print(f"--- {name}: {', '.join(i.url for i in instances)}", flush=True)
        config = load_config(ns, instances[0].url, (instances[1].url,))
        result = asyncio.run(run_benchmark(config))
        counters = [instance.engine_info()["scheduler"] for instance in instances]
    summary = {key: result.get(key, math.nan) for key in _SUMMARY}
    summary["ttft_by_reuse"] = ttft_by_reuse(result)
    summary["instances"] = [{key: c.get(key) for key in (
        "kv_connector", "prefix_cache_queries", "prefix_cache_hits", "num_scheduled_tokens_total",
        "num_preemptions_total")} for c in counters]
    return summary


def _table(base: dict[str, Any], pool: dict[str, Any]) -> str:
    lines = [f"{'metric':<26}{'no pool':>12}{'pool':>12}{'pool/no':>10}"]
    for key in _SUMMARY:
        a, b = base.get(key, math.nan), pool.get(key, math.nan)
        ratio = b / a if a and not math.isnan(a) else math.nan
        lines.append(f"{key:<26}{a:>12.2f}{b:>12.2f}{ratio:>10.3f}")
    return "\n".join(lines)


def main(ns: argparse.Namespace) -> int:
    check_load_args(ns)
    command = shlex.join(["sluice", "bench", "kv-pool-serve", *sys.argv[3:]])
    print(command)
    print(machine_line())
    workdir = Path(tempfile.mkdtemp(prefix="sluice-bench-kv-pool-serve-"))
    result: dict[str, Any] = {"model": ns.model, "backend": ns.backend,
                              "load_policy": ns.load_policy, "gpus": num_gpus(ns.device),
                              "workload": workload(ns)}
    # One pool setting is "pool"; with both load modes, "pool" (async) and "pool_sync".
    pooled = {("pool" if i == 0 else f"pool_{mode}"): mode
              for i, mode in enumerate(dict.fromkeys(ns.load_mode))}
    result["load_modes"] = pooled
    result["no_pool"] = _run_setting(ns, "no_pool", None, workdir)
    for name, mode in pooled.items():
        result[name] = _run_setting(ns, name, mode, workdir)
    settings = ["no_pool", *pooled]
    for name, mode in pooled.items():
        print(f"{name} (load_mode {mode}) against no_pool:")
        print(_table(result["no_pool"], result[name]))
    print(reuse_table({s: result[s]["ttft_by_reuse"] for s in settings}))
    for setting in settings:
        for i, counters in enumerate(result[setting]["instances"]):
            pool = counters["kv_connector"] or {}
            print(f"{setting} instance{i}: tokens computed "
                  f"{counters['num_scheduled_tokens_total']}, local prefix hits "
                  f"{counters['prefix_cache_hits']} of {counters['prefix_cache_queries']} "
                  f"tokens, pool lookups {pool.get('pool_lookups', 0):.0f}, pool hit blocks "
                  f"{pool.get('pool_hit_blocks', 0):.0f}")
    if ns.output:
        from sluice.bench.record import make_record, write_record

        write_record(ns.output, make_record("kv-pool-serve", result, device=ns.device,
                                            command=shlex.split(command)))
        print(f"results saved to {ns.output}")
    complete = all(result[s]["completed"] == ns.num_prompts for s in settings)
    return 0 if complete else 1


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "kv-pool-serve", help="two instances sharing a global KV pool vs two without, serving",
        description=__doc__.split("\n\n")[0])
    add_served_model_args(parser, max_model_len=8192, gpu_memory_utilization=0.4,
                          gpu_memory_help="each instance's share of its GPU (default: 0.4, so "
                                          "two fit one)")
    parser.add_argument("--engine-args", default="", help="more `sluice serve` flags, quoted")
    parser.add_argument("--backend", default="mooncake", choices=("mooncake", "redis", "shm"))
    parser.add_argument("--load-policy", default="auto", choices=("auto", "always", "never"),
                        help="the connector's load_policy (default: auto, load a hit only when "
                             "expected faster than recomputing it)")
    parser.add_argument("--load-mode", nargs="+", default=["async"], choices=("async", "sync"),
                        help="the connector's load_mode (default: async); two modes run the "
                             "pool twice, 'pool' in the first and 'pool_<mode>' in the second")
    parser.add_argument("--shm-slot-bytes", type=int, default=4 << 20,
                        help="shm: the pool server's slot, at least one block's KV over every "
                             "layer plus 8 bytes (default: 4 MiB)")
    parser.add_argument("--pool-bytes", type=int, default=16 << 30,
                        help="the started store's memory (default: 16 GiB)")
    parser.add_argument("--staging-bytes", type=int, default=4 << 30,
                        help="each instance's host staging buffer (default: 4 GiB; its save "
                             "half must hold the saves of the steps whose puts are in flight)")
    add_load_args(parser, num_prompts=200, shared_prefix_len=4096, shared_prefix_groups=10,
                  suffix_len=256, output_len=64, request_rate=4.0)
    parser.set_defaults(func=main)
    return parser
