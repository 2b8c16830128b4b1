"""`sluice bench kv-pool`: time to first token of a long prompt recomputed, served from the
local prefix cache, and loaded from the global KV pool (KVPoolConnector), per backend over TCP
loopback, with the bandwidth the loads reached.

Per backend, one engine with the pool connector; per prompt length and iteration, one fresh
random prompt is generated to one token three times: cold (every token computed; its full blocks
go to the pool meanwhile), again (a local prefix hit), and again after the local prefix cache is
emptied and the saves have landed (a pool hit: one lookup, the blocks fetched into the host
staging buffer and moved into the cache layer by layer while the last tokens compute). Medians
are reported, with each hit's ratio against the recompute measured in the same run; each case's
`num_cached_tokens` is checked, so the numbers are of the path they name. The load bandwidth is
the loaded bytes over the worker's load time (fetch, check, copy into the cache).

Servers: `--redis-url` / `--mooncake-url` / `--shm-url` use running ones; without them the
benchmark starts `redis-server`, `mooncake_master` (plus a process owning the Mooncake pool's
memory, so values cross a process boundary as between instances) and `sluice pool-server` (the
shared host tier, slots of one block's value) on free loopback ports, and stops them after.
`mooncake-dummy` is Mooncake Store with the engine as a dummy client of a standalone real client
on this host (`mooncake_client`, owning the pool's memory and sharing memory with the engine
instead of TCP): `--mooncake-real-client` names a running one (with `--mooncake-url`, its
master); without it the benchmark starts a master and a real client.

Save bandwidth: the saved bytes over the save thread's time (the exists check and the puts) of
every step of one prompt length.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import uuid
from contextlib import ExitStack
from typing import Any

_BACKENDS = ("local", "redis", "mooncake", "mooncake-dummy", "shm")


def add_parser(bench_sub: Any) -> None:
    from sluice.engine.flags import add_engine_args

    parser = bench_sub.add_parser(
        "kv-pool", help="TTFT recomputed vs local prefix hit vs global KV pool hit per backend")
    parser.add_argument("--prompt-lens", default="2048,8192,32768",
                        help="prompt lengths, comma-separated (default: 2048,8192,32768)")
    parser.add_argument("--num-iters", type=int, default=3, help="prompts per length (median)")
    parser.add_argument("--backends", default="redis,mooncake",
                        help=f"pool backends, comma-separated, of {', '.join(_BACKENDS)} "
                             "(default: redis,mooncake)")
    parser.add_argument("--redis-url", default=None,
                        help="a running redis-server (default: start one on loopback)")
    parser.add_argument("--mooncake-url", default=None,
                        help="a running mooncake_master whose pool has memory (default: start "
                             "one and a segment owner on loopback)")
    parser.add_argument("--mooncake-real-client", default=None,
                        help="HOST:PORT of a running mooncake_client for mooncake-dummy (with "
                             "--mooncake-url, its master; default: start both on loopback)")
    parser.add_argument("--shm-url", default=None,
                        help="a running `sluice pool-server` whose slots hold a block's value "
                             "(default: start one on loopback)")
    parser.add_argument("--staging-bytes", type=int, default=8 << 30,
                        help="the connector's host staging buffer (default: 8 GiB; its save "
                             "half must hold two steps of saves of 8,192 tokens)")
    parser.add_argument("--pool-timeout", type=float, default=60.0,
                        help="the connector's timeout_s for each worker call (default: 60)")
    parser.add_argument("--output", default=None, help="write the result as JSON here")
    add_engine_args(parser)
    parser.set_defaults(func=_cmd_kv_pool)


def _pool_memory_bytes(prompt_lens: list[int], bytes_per_token: int) -> int:
    """What a started server gets: every value of the longest prompt twice over, and more."""
    return max(256 << 20, 3 * max(prompt_lens) * bytes_per_token)


def _start_servers(stack: ExitStack, backends: list[str], ns: argparse.Namespace,
                   pool_bytes: int, value_bytes: int) -> dict[str, dict[str, Any]]:
    """{backend: extra config} with the URLs of running or started servers."""
    from sluice.testing import servers

    configs: dict[str, dict[str, Any]] = {}
    for backend in backends:
        if backend == "local":
            configs[backend] = {"backend": "local", "capacity_bytes": pool_bytes}
        elif backend == "redis":
            url = ns.redis_url
            if url is None:
                missing = servers.redis_missing()
                if missing:
                    raise ValueError(f"cannot start the redis backend: {missing}")
                url = stack.enter_context(servers.start_redis(
                    maxmemory=str(pool_bytes), maxmemory_policy="allkeys-lru")).url
            configs[backend] = {"backend": "redis", "url": url}
        elif backend == "mooncake":
            url = ns.mooncake_url
            if url is None:
                missing = servers.mooncake_missing()
                if missing:
                    raise ValueError(f"cannot start the mooncake backend: {missing}")
                master = stack.enter_context(servers.start_mooncake_master())
                stack.enter_context(servers.start_mooncake_segment_owner(
                    master.address, pool_bytes))
                url = master.url
            configs[backend] = {"backend": "mooncake", "url": url, "global_segment_size": 0}
        elif backend == "mooncake-dummy":
            url, real_client = ns.mooncake_url, ns.mooncake_real_client
            if real_client is None:
                missing = servers.mooncake_missing() or (
                    None if servers.mooncake_client_path() else "mooncake_client not found")
                if missing:
                    raise ValueError(f"cannot start the mooncake-dummy backend: {missing}")
                master = stack.enter_context(servers.start_mooncake_master())
                real_client = stack.enter_context(servers.start_mooncake_real_client(
                    master.address, pool_bytes)).address
                url = master.url
            elif url is None:
                raise ValueError("--mooncake-real-client needs --mooncake-url (its master)")
            configs[backend] = {"backend": "mooncake", "url": url, "client": "dummy",
                                "real_client": real_client}
        elif backend == "shm":
            url = ns.shm_url
            if url is None:
                slot = -(-value_bytes // 4096) * 4096
                url = stack.enter_context(servers.start_shm_pool(
                    capacity_bytes=max(pool_bytes, 8 * slot), slot_bytes=slot)).url
            configs[backend] = {"backend": "shm", "url": url}
        else:
            raise ValueError(f"--backends: unknown backend {backend!r}; known: "
                             f"{', '.join(_BACKENDS)}")
    return configs


def run_kv_pool(ns: argparse.Namespace) -> dict[str, Any]:
    from sluice import SamplingParams
    from sluice.bench.latency import parse_sizes
    from sluice.bench.record import make_record
    from sluice.bench.throughput import build_llm, release_device_memory
    from sluice.bench.workloads import benchmark_model_dir, cache_root, random_prompts
    from sluice.kv_transfer.pool import value_size

    if ns.kv_transfer_config is not None or ns.kv_offloading_size is not None:
        raise ValueError("kv-pool configures the pool connector itself: drop "
                         "--kv-transfer-config / --kv-offloading-size")
    if ns.num_iters < 1:
        raise ValueError(f"--num-iters must be >= 1, got {ns.num_iters}")
    prompt_lens = parse_sizes("prompt_lens", ns.prompt_lens)
    backends = [b.strip() for b in ns.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(_BACKENDS))
    if not backends or unknown:
        raise ValueError(f"--backends must name some of {', '.join(_BACKENDS)}, "
                         f"got {ns.backends!r}")
    if ns.model is None:
        import os

        ns.model = benchmark_model_dir(cache_root(dict(os.environ)))
    rng = random.Random(ns.seed)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    rows: list[dict[str, Any]] = []
    record: dict[str, Any] = {}
    device = None
    with ExitStack() as stack:
        per_token, block_size = _kv_layout(ns)
        configs = _start_servers(stack, backends, ns, _pool_memory_bytes(prompt_lens, per_token),
                                 value_size(per_token * block_size))
        for backend in backends:
            # A key namespace of this run's own: no hit from an earlier run.
            # timeout_s: one step's saves of a 32k-token prompt are ~4 GB (Qwen3-0.6B), longer
            # than the default 5 s over a slow TCP loopback; a timed-out put is a lost entry.
            # load_policy always: the pool hit is what is timed, even where it is slower.
            extra = {**configs[backend], "staging_bytes": ns.staging_bytes,
                     "load_policy": "always",
                     "timeout_s": ns.pool_timeout, "model_id": f"bench-{uuid.uuid4().hex}"}
            llm, device, dtype = _build(ns, build_llm, extra)
            try:
                rows += _measure(llm, backend, prompt_lens, ns.num_iters, params, rng, device,
                                 random_prompts)
                spec = llm.llm_engine.engine_core.executor.kv_cache_spec
                record.update(model=llm.llm_engine.model_config.model,
                              dtype=str(dtype).removeprefix("torch."), device=str(device),
                              block_size=spec.block_size, bytes_per_block=spec.bytes_per_block)
            finally:
                llm.llm_engine.engine_core.shutdown()
                del llm
                release_device_memory(device)
    return make_record("kv-pool", {**record, "num_iters": ns.num_iters, "backends": backends,
                                   "rows": rows},
                       device=device, command=getattr(ns, "sluice_argv", None))


def _kv_layout(ns: argparse.Namespace) -> tuple[int, int]:
    """(KV bytes of one token over every layer, block size), from the model's config (no
    engine yet)."""
    from sluice.engine.flags import engine_args_from
    from sluice.model.loader import resolve_dtype

    config = engine_args_from(ns).create_engine_config()
    hf = config.hf_config
    dtype = resolve_dtype(config.model_config.dtype, hf)
    return (2 * hf.num_hidden_layers * hf.num_key_value_heads * hf.head_dim * dtype.itemsize,
            config.cache_config.block_size)


def _build(ns: argparse.Namespace, build_llm: Any, extra: dict[str, Any]) -> tuple[Any, Any, Any]:
    ns.kv_transfer_config = json.dumps({"kv_connector": "KVPoolConnector",
                                        "kv_role": "kv_both",
                                        "kv_connector_extra_config": extra})
    try:
        return build_llm(ns)
    finally:
        ns.kv_transfer_config = None


def _measure(llm: Any, backend: str, prompt_lens: list[int], num_iters: int, params: Any,
             rng: random.Random, device: Any, random_prompts: Any) -> list[dict[str, Any]]:
    from sluice.bench import offline_report as report

    engine = llm.llm_engine
    max_model_len = engine.scheduler_config.max_model_len
    if max(prompt_lens) >= max_model_len:
        raise ValueError(f"prompt lengths must be < max_model_len ({max_model_len}), "
                         f"got {max(prompt_lens)}")
    worker = engine.engine_core.executor.worker.connector
    scheduler = engine.scheduler.connector
    block_size = engine.cache_config.block_size
    bytes_per_block = scheduler.kv_cache_spec.bytes_per_block
    vocab = engine.hf_config.vocab_size

    def ttft(prompt: list[int]) -> tuple[float, int]:
        report.synchronize(device)
        start = time.perf_counter()
        (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        report.synchronize(device)
        return time.perf_counter() - start, output.num_cached_tokens

    def pool_hit(prompt: list[int]) -> tuple[float, int]:
        if not worker.wait_for_pending_saves(600.0):
            raise RuntimeError("the pool's saves did not finish in 600 s")
        if not engine.kv_cache_manager.reset_prefix_cache():
            raise RuntimeError("the local prefix cache could not be emptied (blocks in use)")
        return ttft(prompt)

    # Warm-up: each path once at the shortest length.
    warm = random_prompts(1, min(prompt_lens), vocab, rng)[0]
    ttft(warm)
    ttft(warm)
    pool_hit(warm)

    rows = []
    for length in prompt_lens:
        full = (length - 1) // block_size * block_size
        cases: dict[str, list[float]] = {"recompute": [], "local_hit": [], "pool_hit": []}
        loads: list[tuple[float, float]] = []  # (bytes, seconds) of each pool hit's load
        partial: list[int] = []  # tokens of pool hits short of the whole prompt
        load_stages: list[dict[str, float]] = []  # each pool hit's host seconds by stage
        saves_before = scheduler.get_stats()
        for prompt in random_prompts(num_iters, length, vocab, rng):
            elapsed, cached = ttft(prompt)
            assert cached == 0, f"a fresh prompt hit {cached} tokens"
            cases["recompute"].append(elapsed)
            # The recompute's saves first: a local hit beside them measures their copies too.
            if not worker.wait_for_pending_saves(600.0):
                raise RuntimeError("the pool's saves did not finish in 600 s")
            elapsed, cached = ttft(prompt)
            assert cached == full, f"local hit of {cached} tokens, expected {full}"
            cases["local_hit"].append(elapsed)
            before = dict(scheduler.get_stats())
            elapsed, cached = pool_hit(prompt)
            after = scheduler.get_stats()
            if cached != full:  # recorded, not timed as a pool hit
                print(f"{backend} {length}: a pool hit of {cached} tokens, expected {full} "
                      f"(saves dropped? errors: {_errors(after)})", file=sys.stderr, flush=True)
                partial.append(cached)
                continue
            cases["pool_hit"].append(elapsed)
            loads.append((after.get("pool_load_bytes", 0.0) - before.get("pool_load_bytes", 0.0),
                          after.get("pool_load_seconds", 0.0)
                          - before.get("pool_load_seconds", 0.0)))
            load_stages.append({name: after.get(name, 0.0) - before.get(name, 0.0)
                                for name in _LOAD_STAGES})
        if not cases["pool_hit"]:
            raise RuntimeError(f"{backend} {length}: no pool hit of the whole prompt in "
                               f"{num_iters} tries (hits of {partial} tokens)")
        saves = {name: scheduler.get_stats().get(name, 0.0) - saves_before.get(name, 0.0)
                 for name in ("pool_save_bytes", "pool_save_seconds", *_SAVE_STAGES)}
        medians = {name: statistics.median(times) for name, times in cases.items()}
        load_bytes = full // block_size * bytes_per_block
        assert all(b == load_bytes for b, _ in loads), (loads, load_bytes)
        rows.append({
            "num_pool_hits": len(cases["pool_hit"]),
            "partial_pool_hit_tokens": partial,
            "backend": backend,
            "prompt_len": length,
            "ttft_ms": {name: 1e3 * t for name, t in medians.items()},
            "pool_hit_vs_recompute": medians["pool_hit"] / medians["recompute"],
            "local_hit_vs_recompute": medians["local_hit"] / medians["recompute"],
            "load_bytes": load_bytes,
            "load_gb_s": load_bytes / statistics.median(s for _, s in loads) / 1e9,
            # An upper bound of the load's time: the whole TTFT of the pool hit.
            "effective_load_gb_s": load_bytes / medians["pool_hit"] / 1e9,
            "save_gb_s": (saves["pool_save_bytes"] / saves["pool_save_seconds"] / 1e9
                          if saves["pool_save_seconds"] else 0.0),
            # Where a load's and the row's saves' time went (median load; saves summed).
            "load_stage_ms": {name.removeprefix("pool_load_").removesuffix("_seconds"):
                              1e3 * statistics.median(s[name] for s in load_stages)
                              for name in _LOAD_STAGES},
            "save_stage_ms": {name.removeprefix("pool_save_").removesuffix("_seconds"):
                              1e3 * saves[name] for name in _SAVE_STAGES},
        })
        t = rows[-1]["ttft_ms"]
        print(f"{backend} {length}: TTFT recompute {t['recompute']:.2f} ms, local hit "
              f"{t['local_hit']:.2f} ms, pool hit {t['pool_hit']:.2f} ms, load "
              f"{rows[-1]['load_gb_s']:.2f} GB/s, save {rows[-1]['save_gb_s']:.2f} GB/s",
              file=sys.stderr, flush=True)
    return rows


# The worker's host-side split of a load and of a save (worker.py, `stage_seconds`). A staged
# load: get_copy, get_checksum, dma_wait; a direct one from the shm arena also get_pin
# (GetBegin) and get_check_wait (the load thread waiting for the checks), its get_copy the
# copies out of the arena (CUDA: queued) and its dma_wait the wait for the DMA out of it.
_LOAD_STAGES = ("pool_load_get_copy_seconds", "pool_load_get_checksum_seconds",
                "pool_load_dma_wait_seconds", "pool_load_get_pin_seconds",
                "pool_load_get_check_wait_seconds")
_SAVE_STAGES = ("pool_save_put_checksum_seconds", "pool_save_put_copy_seconds")


def _errors(stats: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in stats.items() if k.startswith("pool_errors.")}


def format_kv_pool(record: dict[str, Any]) -> str:
    from sluice.bench.record import command_text, describe_machine

    results = record["results"]
    lines = [f"command: {command_text(record)}",
             f"machine: {describe_machine(record['machine'])}",
             f"model: {results['model']} ({results['dtype']}, {results['device']}), "
             f"{results['bytes_per_block']} bytes per block of {results['block_size']} tokens, "
             f"median of {results['num_iters']}; pools over TCP loopback (shm: index only)",
             f"{'backend':>14} {'prompt':>7} {'recompute':>10} {'local hit':>10} {'pool hit':>9} "
             f"{'pool/recomp':>11} {'local/recomp':>12} {'load GB/s':>9} {'TTFT GB/s':>9}"
             f" {'save GB/s':>9}  (TTFT ms)"]
    for row in results["rows"]:
        t = row["ttft_ms"]
        lines.append(f"{row['backend']:>14} {row['prompt_len']:>7} {t['recompute']:>10.2f} "
                     f"{t['local_hit']:>10.2f} {t['pool_hit']:>9.2f} "
                     f"{row['pool_hit_vs_recompute']:>11.2f} "
                     f"{row['local_hit_vs_recompute']:>12.2f} {row['load_gb_s']:>9.2f} "
                     f"{row['effective_load_gb_s']:>9.2f} {row.get('save_gb_s', 0.0):>9.2f}")
    for row in results["rows"]:
        if "load_stage_ms" in row:
            load = ", ".join(f"{k} {v:.1f}" for k, v in row["load_stage_ms"].items())
            save = ", ".join(f"{k} {v:.1f}" for k, v in row["save_stage_ms"].items())
            lines.append(f"{row['backend']:>14} {row['prompt_len']:>7} host ms: load (median) "
                         f"{load}; saves (sum) {save}")
    return "\n".join(lines)


def _cmd_kv_pool(ns: argparse.Namespace) -> int:
    from sluice.bench.record import write_record

    record = run_kv_pool(ns)
    print(format_kv_pool(record))
    if ns.output:
        write_record(ns.output, record)
    return 0
