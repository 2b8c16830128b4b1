"""KV connectors through the whole engine, with a real tiny model: the CPU tier
(OffloadingConnector) and the connector contract under injected faults (tests/connectors.py).
Every test compares greedy token ids with an engine that has no connector, and checks that
every block comes back."""

from __future__ import annotations

import random
import time

import pytest

from sluice import LLM, SamplingParams
from tests.connectors import count_computed_tokens

pytestmark = pytest.mark.serial

BLOCK = 16
PROMPT_LEN = 160  # 10 blocks
# 12 usable blocks: one long request's 11 at a time, so each evicts the other from the GPU.
ENGINE = dict(dtype="float32", block_size=BLOCK, max_model_len=176, seed=0,
              num_gpu_blocks_override=13)
TIER_BYTES = 64 << 20


def prompts(seed: int, count: int = 2, length: int = PROMPT_LEN) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(10, 400) for _ in range(length)]}
            for _ in range(count)]


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(qwen3_dir: str) -> LLM:
    return LLM(model=qwen3_dir, **ENGINE)


def injecting(**extra: object) -> dict:
    return {"kv_connector": "InjectingConnector", "kv_connector_module_path": "tests.connectors",
            "kv_connector_extra_config": {"cpu_bytes_to_use": TIER_BYTES, **extra}}


def drain(llm: LLM, timeout_s: float = 10.0) -> None:
    """Step until no KV transfer holds blocks any more (delayed frees, aborted loads)."""
    core = llm.llm_engine.engine_core
    deadline = time.monotonic() + timeout_s
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "KV transfers never finished"
        core.step()
        time.sleep(0.005)


def assert_all_blocks_back(llm: LLM) -> None:
    drain(llm)
    manager = llm.llm_engine.kv_cache_manager
    manager.check_integrity()
    assert manager.get_num_free_blocks() == manager.block_pool.num_blocks - 1
    connector = llm.llm_engine.scheduler.connector
    if connector is not None and hasattr(connector, "check_integrity"):
        connector.check_integrity()


def alternate(llm: LLM, batch: list[dict], rounds: int = 2) -> list[list]:
    """Each prompt alone, in turn, `rounds` times: each evicts the other from the GPU."""
    return [[llm.generate([p], greedy(), use_tqdm=False)[0] for p in batch]
            for _ in range(rounds)]


def test_cpu_tier_serves_prefixes_evicted_from_the_gpu(qwen3_dir: str, reference: LLM) -> None:
    batch = prompts(seed=1)
    expected = token_ids(reference.generate(batch, greedy(), use_tqdm=False))
    # Without the tier, the second round finds little of its prefix left on the GPU.
    no_tier = alternate(reference, batch)
    assert all(o.num_cached_tokens < PROMPT_LEN // 2 for o in no_tier[1])

    llm = LLM(model=qwen3_dir, kv_offloading_size=TIER_BYTES / 2**30, **ENGINE)
    computed = count_computed_tokens(llm)
    rounds = alternate(llm, batch)
    full_blocks = (PROMPT_LEN - 1) // BLOCK * BLOCK
    for first, second in zip(rounds[0], rounds[1]):
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == full_blocks  # from the CPU tier
        assert second.outputs[0].token_ids == first.outputs[0].token_ids
        # It computed that many fewer tokens: the prompt's rest, then one per decode step.
        assert computed[second.request_id] == PROMPT_LEN - full_blocks + 8 - 1
        assert computed[first.request_id] == PROMPT_LEN + 8 - 1
    assert token_ids(rounds[1]) == expected
    # Each hit is partly on the GPU (what the other prompt left), the rest from the CPU tier.
    stats = llm.llm_engine.scheduler.connector.get_stats()
    local_hits = llm.llm_engine.kv_cache_manager.prefix_cache_hits
    assert stats["hit_blocks"] * BLOCK + local_hits == 2 * full_blocks
    assert stats["hit_blocks"] >= 2 * (full_blocks // BLOCK - 1)
    assert_all_blocks_back(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_cpu_tier_with_chunked_prefill_and_preemption_keeps_greedy_output(
        qwen3_dir: str, reference: LLM, kv_cache_dtype: str) -> None:
    """Also with 8-bit caches, which the tier holds as bytes (against an engine of the same
    cache dtype)."""
    batch = prompts(seed=2, count=4)
    if kv_cache_dtype != "auto":
        reference = LLM(model=qwen3_dir, kv_cache_dtype=kv_cache_dtype, **ENGINE)
    expected = token_ids(reference.generate(batch, greedy(24), use_tqdm=False))
    llm = LLM(model=qwen3_dir, kv_offloading_size=TIER_BYTES / 2**30,
              max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype, **ENGINE)
    for _ in range(2):  # all four at once: chunked, and preempting for blocks
        assert token_ids(llm.generate(batch, greedy(24), use_tqdm=False)) == expected
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert llm.llm_engine.scheduler.connector.get_stats()["hit_blocks"] > 0
    assert_all_blocks_back(llm)


def test_connector_that_cannot_answer_yet_holds_up_no_other_request(
        qwen3_dir: str, reference: LLM) -> None:
    batch = prompts(seed=3)
    expected = token_ids(reference.generate(batch, greedy(), use_tqdm=False))
    llm = LLM(model=qwen3_dir, kv_transfer_config=injecting(defer_lookups={"slow": 4}), **ENGINE)
    engine = llm.llm_engine
    engine.add_request("slow", batch[0], greedy())
    engine.add_request("fast", batch[1], greedy())
    finished_order = []
    while engine.has_unfinished_requests():
        finished_order += [o.request_id for o in engine.step() if o.finished]
    assert finished_order == ["fast", "slow"]
    assert_all_blocks_back(llm)
    assert token_ids(llm.generate(batch, greedy(), use_tqdm=False)) == expected


def test_slow_async_loads_park_the_request_and_keep_greedy_output(
        qwen3_dir: str, reference: LLM) -> None:
    batch = prompts(seed=4)
    expected = token_ids(reference.generate(batch, greedy(), use_tqdm=False))
    llm = LLM(model=qwen3_dir, kv_transfer_config=injecting(load_async=True, load_delay_s=0.3),
              **ENGINE)
    first = alternate(llm, batch, rounds=1)[0]  # saves both prefixes in the tier
    engine = llm.llm_engine
    engine.add_request("loading", batch[0], greedy())
    engine.add_request("other", prompts(seed=40, count=1, length=20)[0], greedy())
    statuses, finished_order, outputs = set(), [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished_order.append(out.request_id)
                outputs[out.request_id] = out
        request = engine.scheduler.requests.get("loading")
        if request is not None:
            statuses.add(request.status.name)
    assert "WAITING_FOR_REMOTE_KVS" in statuses
    assert finished_order[0] == "other"  # ran while "loading" waited for its KV
    assert outputs["loading"].num_cached_tokens == (PROMPT_LEN - 1) // BLOCK * BLOCK
    assert outputs["loading"].outputs[0].token_ids == expected[0] == token_ids(first)[0]
    assert_all_blocks_back(llm)


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_failed_block_load_is_recomputed_and_output_unchanged(
        qwen3_dir: str, reference: LLM, load_async: bool) -> None:
    batch = prompts(seed=5)
    expected = token_ids(reference.generate(batch, greedy(), use_tqdm=False))
    llm = LLM(model=qwen3_dir, kv_transfer_config=injecting(
        fail_blocks=[3], load_async=load_async, load_delay_s=0.05), **ENGINE)
    rounds = alternate(llm, batch)
    for output in rounds[1]:
        # Loaded blocks 0-2 count; block 3 failed and everything after it was recomputed.
        assert output.num_cached_tokens == 3 * BLOCK
    assert token_ids(rounds[1]) == expected
    assert_all_blocks_back(llm)


def test_failed_block_load_with_policy_fail_is_a_clear_error(qwen3_dir: str) -> None:
    config = injecting(fail_blocks=[5])
    config["kv_load_failure_policy"] = "fail"
    llm = LLM(model=qwen3_dir, kv_transfer_config=config, **ENGINE)
    first, second = alternate(llm, prompts(seed=6))
    # Nothing to load the first time; then every load fails at block 5.
    assert [o.outputs[0].finish_reason for o in first] == ["length", "length"]
    assert [o.outputs[0].finish_reason for o in second] == ["error", "error"]
    second = second[0]
    assert "KV load failed for blocks" in second.outputs[0].stop_reason
    assert "kv_load_failure_policy 'fail'" in second.outputs[0].stop_reason
    assert_all_blocks_back(llm)


def test_abort_during_an_async_load_leaks_nothing_and_reuses_no_block_in_flight(
        qwen3_dir: str, reference: LLM) -> None:
    batch = prompts(seed=7)
    llm = LLM(model=qwen3_dir, kv_transfer_config=injecting(load_async=True, load_delay_s=0.4),
              **ENGINE)
    alternate(llm, batch, rounds=1)
    engine = llm.llm_engine
    engine.add_request("doomed", batch[0], greedy())
    engine.step()
    assert engine.scheduler.requests["doomed"].status.name == "WAITING_FOR_REMOTE_KVS"
    held = set(engine.scheduler.get_block_ids("doomed"))
    engine.abort_request("doomed")
    # While the load still writes "doomed"'s blocks, a new request must get other blocks.
    other = prompts(seed=70, count=1, length=100)[0]
    expected = token_ids(reference.generate([other], greedy(), use_tqdm=False))
    engine.add_request("other", other, greedy())
    engine.step()
    assert not held & set(engine.scheduler.get_block_ids("other"))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outputs["other"].outputs[0].token_ids == expected[0]
    assert_all_blocks_back(llm)


def test_delayed_free_holds_blocks_until_the_send_ends_even_when_aborted(
        qwen3_dir: str, reference: LLM) -> None:
    batch = prompts(seed=8, count=3)
    expected = token_ids(reference.generate(batch, greedy(), use_tqdm=False))
    llm = LLM(model=qwen3_dir, kv_transfer_config=injecting(delay_free_s=0.3), **ENGINE)
    engine = llm.llm_engine

    def run(tag: str) -> dict:
        for i, prompt in enumerate(batch):
            engine.add_request(f"{tag}{i}", prompt, greedy())
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
        return outputs

    first = run("a")  # each holds its blocks a while after it finished
    assert [first[f"a{i}"].outputs[0].token_ids for i in range(3)] == expected
    assert all(o.kv_transfer_params["held_blocks"] for o in first.values())
    assert engine.scheduler.has_pending_kv_transfers()
    engine.abort_request(list(first))  # too late to matter: no effect
    # Meanwhile more requests run in whatever blocks are free; none may take a held one.
    second = run("b")
    assert [second[f"b{i}"].outputs[0].token_ids for i in range(3)] == expected
    assert_all_blocks_back(llm)
    assert engine.scheduler.connector.worker_stats.get("held_block_overwritten", 0) == 0
