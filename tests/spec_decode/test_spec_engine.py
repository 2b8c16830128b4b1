"""Speculative decoding through the whole engine (CPU, float32, tiny models): greedy output is the
output without speculation, token for token, for every proposer and with chunked prefill,
preemption and the prefix cache, with drafting always on and with the drafting policy switching
it on and off under async scheduling (drafts proposed on the device, steps with drafts overlapping
others); max_tokens and stop tokens are never overrun; blocks balance."""

from __future__ import annotations

import random

import pytest
import torch

from sluice import LLM, SamplingParams
from sluice.spec_decode.eagle_model import make_tiny_eagle
from tests.tiny_models import save_hf_model

# Prompts that repeat themselves, so prompt lookup finds drafts, plus one that does not.
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [11, 12, 13, 14] * 6 + [11, 12],
    list(range(20, 70)),
    [3, 40, 41, 42, 3, 40, 41, 42, 3, 40, 41, 42, 3, 40, 41],
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# The drafting policy out of the way: every step drafts whatever the batch and acceptance.
ALWAYS_DRAFT = {"disable_by_batch_size": None, "min_accepted_tokens_per_step": 0}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, **ALWAYS_DRAFT}


def generate(model: str, params: SamplingParams = GREEDY, prompts=PROMPTS,
             **kwargs: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=model, dtype="float32", device="cpu", block_size=4, **kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], llm


def assert_blocks_balance(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    core.kv_cache_manager.check_integrity()
    pool = core.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1  # everything back but the null block


@pytest.fixture(scope="module")
def reference(qwen3_dir: str) -> list[list[int]]:
    tokens, llm = generate(qwen3_dir)
    llm.shutdown()
    return tokens


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Another tiny Qwen3 of the same vocabulary (other weights, one layer)."""
    return save_hf_model(str(tmp_path_factory.mktemp("draft")), "qwen3", seed=7,
                         num_hidden_layers=1, layer_types=["full_attention"])


@pytest.fixture(scope="module")
def eagle_dir(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_eagle(qwen3_dir, str(tmp_path_factory.mktemp("eagle")), seed=3)


def spec_configs(qwen3_dir: str, draft_dir: str, eagle_dir: str) -> dict[str, dict]:
    return {
        "ngram": NGRAM,
        "draft_model": {"method": "draft_model", "model": draft_dir,
                        "num_speculative_tokens": 3, **ALWAYS_DRAFT},
        "eagle": {"method": "eagle", "model": eagle_dir, "num_speculative_tokens": 2,
                  **ALWAYS_DRAFT},
    }


SETTINGS = {
    "default": {},
    # 16-token steps: prompts are prefilled in chunks and drafts get cut by the budget.
    "chunked_prefill": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    # 24 blocks of 4 tokens cannot hold four sequences of ~50 tokens: requests are preempted.
    "preemption": {"num_gpu_blocks_override": 24, "max_model_len": 80},
    "no_prefix_caching": {"enable_prefix_caching": False},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_greedy_output_is_unchanged_by_speculation(
        qwen3_dir: str, draft_dir: str, eagle_dir: str, reference: list[list[int]],
        method: str, setting: str) -> None:
    config = spec_configs(qwen3_dir, draft_dir, eagle_dir)[method]
    tokens, llm = generate(qwen3_dir, speculative_config=config, **SETTINGS[setting])
    stats = llm.get_spec_decoding_stats()
    assert tokens == reference
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
    if setting == "preemption":
        assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    assert_blocks_balance(llm)
    llm.shutdown()


def test_ngram_accepts_drafts_of_a_repeating_output(qwen3_dir: str,
                                                    reference: list[list[int]]) -> None:
    _, llm = generate(qwen3_dir, speculative_config=NGRAM)
    stats = llm.get_spec_decoding_stats()
    # Greedy tiny models fall into loops, which prompt lookup predicts.
    assert stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    per_pos = stats.num_accepted_tokens_per_pos
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # accepted only after accepted
    # Fewer steps than tokens: each verification emits 1 + accepted tokens.
    assert stats.mean_acceptance_length > 1.0
    llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_self_speculation_accepts_every_draft(qwen3_dir: str, reference: list[list[int]],
                                              async_scheduling: bool) -> None:
    """The model as its own draft: every draft is accepted, so the proposer's KV is the
    target's at every position it drafts from (async: its device pass after every step)."""
    config = {"method": "draft_model", "model": qwen3_dir, "num_speculative_tokens": 4,
              **ALWAYS_DRAFT}
    tokens, llm = generate(qwen3_dir, speculative_config=config,
                           async_scheduling=async_scheduling)
    stats = llm.get_spec_decoding_stats()
    assert tokens == reference
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    # Every verified draft is accepted at every position it has (max_tokens cuts the last).
    assert stats.num_accepted_tokens_per_pos[0] == stats.num_drafts
    llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("max_tokens", [1, 2, 5, 11])
def test_max_tokens_is_never_exceeded(qwen3_dir: str, reference: list[list[int]],
                                      max_tokens: int, async_scheduling: bool) -> None:
    config = {"method": "draft_model", "model": qwen3_dir, "num_speculative_tokens": 4,
              **ALWAYS_DRAFT}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens, llm = generate(qwen3_dir, params, speculative_config=config,
                           async_scheduling=async_scheduling)
    assert tokens == [t[:max_tokens] for t in reference]
    assert_blocks_balance(llm)
    llm.shutdown()


def test_stop_token_inside_accepted_drafts_ends_the_output(qwen3_dir: str,
                                                           reference: list[list[int]]) -> None:
    # Self-speculation accepts whole runs of drafts; stop at the 6th token of each output.
    config = {"method": "draft_model", "model": qwen3_dir, "num_speculative_tokens": 4,
              **ALWAYS_DRAFT}
    outputs = []
    for prompt, ref in zip(PROMPTS, reference):
        stop_id = ref[5]
        expected = ref[:ref.index(stop_id) + 1]
        params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_id])
        tokens, llm = generate(qwen3_dir, params, prompts=[prompt], speculative_config=config)
        outputs.append((tokens[0], expected))
        assert_blocks_balance(llm)
        llm.shutdown()
    for tokens, expected in outputs:
        assert tokens == expected


def test_max_model_len_caps_drafts(qwen3_dir: str) -> None:
    prompts = [p[:12] for p in PROMPTS]
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    ref, llm = generate(qwen3_dir, params, prompts=prompts, max_model_len=30)
    llm.shutdown()
    config = {"method": "draft_model", "model": qwen3_dir, "num_speculative_tokens": 4,
              **ALWAYS_DRAFT}
    tokens, llm = generate(qwen3_dir, params, prompts=prompts, max_model_len=30,
                           speculative_config=config)
    assert tokens == ref
    assert all(len(t) == 30 - 12 for t in tokens)
    assert_blocks_balance(llm)
    llm.shutdown()


def test_only_verified_blocks_enter_the_prefix_cache(qwen3_dir: str,
                                                     reference: list[list[int]]) -> None:
    """A second request whose prompt is the first one's prompt and output hits every full
    block of it and still generates the reference continuation."""
    llm = LLM(model=qwen3_dir, dtype="float32", device="cpu", block_size=4,
              speculative_config={"method": "draft_model", "model": qwen3_dir,
                                  "num_speculative_tokens": 4, **ALWAYS_DRAFT})
    prompt = PROMPTS[0]
    first = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    assert list(first.outputs[0].token_ids) == reference[0]
    extended = prompt + reference[0]
    second = llm.generate([{"prompt_token_ids": extended}], GREEDY, use_tqdm=False)[0]
    # The whole prompt and output but the last token were computed and cached (full blocks).
    assert second.num_cached_tokens == (len(extended) - 1) // 4 * 4
    ref, base = generate(qwen3_dir, prompts=[extended], enable_prefix_caching=False)
    base.shutdown()
    assert list(second.outputs[0].token_ids) == ref[0]
    assert_blocks_balance(llm)
    llm.shutdown()


def test_seeded_sampling_with_speculation_is_reproducible(qwen3_dir: str) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=1234,
                            ignore_eos=True)
    runs = []
    for _ in range(2):
        tokens, llm = generate(qwen3_dir, params, speculative_config=NGRAM)
        runs.append(tokens)
        assert all(len(t) == 20 for t in tokens)
        llm.shutdown()
    assert runs[0] == runs[1]


def test_n_greater_than_one_and_penalties_run_with_speculation(qwen3_dir: str) -> None:
    """n > 1 children speculate independently; a request with a penalty decodes without
    drafts (they could not be verified exactly) and equals its run without speculation."""
    llm = LLM(model=qwen3_dir, dtype="float32", device="cpu", block_size=4,
              speculative_config=NGRAM)
    params = SamplingParams(n=3, max_tokens=16, temperature=0.7, seed=5, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 16 for c in out.outputs)
    penalised = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3,
                               ignore_eos=True)
    drafted_before = llm.get_spec_decoding_stats().num_draft_tokens
    got = llm.generate([{"prompt_token_ids": PROMPTS[1]}], penalised, use_tqdm=False)[0]
    assert llm.get_spec_decoding_stats().num_draft_tokens == drafted_before
    assert_blocks_balance(llm)
    llm.shutdown()
    ref, base = generate(qwen3_dir, penalised, prompts=[PROMPTS[1]])
    base.shutdown()
    assert list(got.outputs[0].token_ids) == ref[0]


# ---- the drafting policy, with async scheduling ---------------------------------------------

# Drafting switches with the acceptance (on when a request's output repeats, off when not):
# probes every step, on from one accepted token per step, whatever the batch size.
BY_ACCEPTANCE = {"disable_by_batch_size": None, "min_accepted_tokens_per_step": 1.0,
                 "probe_interval": 1}
# Drafting switches with the batch size: off while 3 or more requests run; the outputs end at
# different lengths, so it turns on as the batch shrinks (then every step drafts).
BY_BATCH_SIZE = {"disable_by_batch_size": 3, "min_accepted_tokens_per_step": 0}
SHRINKING = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
             for n in (24, 6, 16, 10)]


def record_launches(llm: LLM) -> list[tuple[bool, bool]]:
    """(the step has drafts, a step was in flight when it launched) for every launched step."""
    core = llm.llm_engine.engine_core
    execute_model = core.executor.execute_model
    launches: list[tuple[bool, bool]] = []

    def recording(scheduler_output):  # noqa: ANN001, ANN202
        drafted = (bool(scheduler_output.scheduled_spec_decode_tokens)
                   or any(scheduler_output.scheduled_device_drafts.values()))
        launches.append((drafted, core.in_flight is not None))
        return execute_model(scheduler_output)

    core.executor.execute_model = recording
    return launches


# The step message to a worker process: drafts, and steps in flight, over the executor's wire.
# Preemption with a few blocks more than SETTINGS': a step that drafts on the device holds the
# blocks of its drafts in flight too, and with 24 blocks three requests never ran at once (so
# drafting never switched off for the batch size).
SWITCHING_SETTINGS = {**SETTINGS, "preemption": {"num_gpu_blocks_override": 30,
                                                 "max_model_len": 80},
                      "mp_executor": {"distributed_executor_backend": "mp"}}


@pytest.mark.parametrize("setting", list(SWITCHING_SETTINGS))
@pytest.mark.parametrize("policy", ["by_acceptance", "by_batch_size"])
def test_greedy_output_is_unchanged_when_drafting_switches_under_async_scheduling(
        qwen3_dir: str, reference: list[list[int]], policy: str, setting: str) -> None:
    """N-gram drafts are proposed on the device after the tokens of the step in flight, so
    steps with drafts overlap like steps without: the rows that follow a verification are fixed
    on the device (how many drafts it accepted is known there only), whether the next step
    drafts or not, in one process or in a worker process that takes results on its own."""
    ngram = {**NGRAM, **(BY_ACCEPTANCE if policy == "by_acceptance" else BY_BATCH_SIZE)}
    params = GREEDY if policy == "by_acceptance" else SHRINKING
    llm = LLM(model=qwen3_dir, dtype="float32", device="cpu", block_size=4,
              async_scheduling=True, speculative_config=ngram, **SWITCHING_SETTINGS[setting])
    launches = record_launches(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    expected = reference if policy == "by_acceptance" else [
        ref[:p.max_tokens] for ref, p in zip(reference, SHRINKING)]
    assert tokens == expected
    stats = llm.get_spec_decoding_stats()
    assert stats.num_draft_tokens > 0 and stats.num_steps_drafting > 0
    off = (stats.num_steps_off_acceptance if policy == "by_acceptance"
           else stats.num_steps_off_batch_size)
    assert off > 0
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
    assert any(drafted and overlapped for drafted, overlapped in launches)
    assert any(not drafted and overlapped for drafted, overlapped in launches)
    if setting == "preemption":
        assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    assert_blocks_balance(llm)
    llm.shutdown()


def record_steps(llm: LLM) -> list[tuple]:
    """Per launched step: its tokens, the blocks it gives each request, its drafts, and whether
    a step was in flight when it launched."""
    core = llm.llm_engine.engine_core
    execute_model = core.executor.execute_model
    steps: list[tuple] = []

    def recording(so):  # noqa: ANN001, ANN202
        steps.append((so.num_scheduled_tokens,
                      [(r.req_id, r.block_ids) for r in so.scheduled_new_reqs],
                      [(r.req_id, r.new_block_ids) for r in so.scheduled_cached_reqs],
                      so.scheduled_spec_decode_tokens, core.in_flight is not None))
        return execute_model(so)

    core.executor.execute_model = recording
    return steps


def test_off_for_the_batch_size_an_engine_does_the_work_of_one_without_speculation(
        qwen3_dir: str, reference: list[list[int]]) -> None:
    """While drafting is off for the batch size (the default policy: 2 requests and more), an
    n-gram engine schedules what an engine without speculation schedules, step for step (same
    tokens, same blocks: no lookahead slots), overlaps every step the same way, and never
    verifies."""
    steps = {}
    for name, spec in (("baseline", None), ("ngram", {**NGRAM, "disable_by_batch_size": 2})):
        llm = LLM(model=qwen3_dir, dtype="float32", device="cpu", block_size=4,
                  async_scheduling=True, speculative_config=spec)
        steps[name] = record_steps(llm)
        runner = llm.llm_engine.engine_core.executor.model_runner
        if runner.spec is not None:
            runner.spec.verify = None  # a call would fail the test
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                               use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == reference
        if spec is not None:
            stats = llm.get_spec_decoding_stats()
            assert stats.num_steps_off_batch_size > 0
            assert stats.num_steps_drafting == stats.num_steps_off_acceptance == 0
        llm.shutdown()
    assert steps["ngram"] == steps["baseline"]
    assert any(overlapped for *_, overlapped in steps["ngram"])


def test_drafts_counted_are_the_drafts_verified(qwen3_dir: str) -> None:
    """With the policy switching, the counters add up the drafts the device proposed and
    verified (never more than the slots the scheduler gave), and the policy's step counters
    the steps scheduled while a request could speculate."""
    llm = LLM(model=qwen3_dir, dtype="float32", device="cpu", block_size=4,
              async_scheduling=True, speculative_config={**NGRAM, **BY_ACCEPTANCE})
    core = llm.llm_engine.engine_core
    execute_model = core.executor.execute_model
    update_from_output = core.scheduler.update_from_output
    num_scheduled_steps = 0
    verified: list[int] = []

    def recording(scheduler_output):  # noqa: ANN001, ANN202
        nonlocal num_scheduled_steps
        num_scheduled_steps += bool(scheduler_output.total_num_scheduled_tokens)
        return execute_model(scheduler_output)

    def updating(scheduler_output, runner_output):  # noqa: ANN001, ANN202
        slots = scheduler_output.scheduled_device_drafts
        for req_id, num_drafts in runner_output.num_device_drafts.items():
            assert num_drafts <= slots.get(req_id, 0)
            verified.append(num_drafts)
        return update_from_output(scheduler_output, runner_output)

    core.executor.execute_model = recording
    core.scheduler.update_from_output = updating
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    stats = llm.get_spec_decoding_stats()
    assert stats.num_drafts == sum(1 for n in verified if n) > 0
    assert stats.num_draft_tokens == sum(verified)
    assert (stats.num_steps_drafting + stats.num_steps_off_acceptance
            + stats.num_steps_off_batch_size) == num_scheduled_steps
    llm.shutdown()


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_model_proposer_steps_overlap_with_the_default_policy(
        qwen3_dir: str, draft_dir: str, eagle_dir: str, reference: list[list[int]],
        method: str) -> None:
    """With async scheduling a model proposer writes its KV and drafts on the device after
    every step: its steps overlap like any other, drafting on or off (the default policy:
    off from 2 requests), and the output is the output without speculation."""
    config = dict(spec_configs(qwen3_dir, draft_dir, eagle_dir)[method])
    for field in ALWAYS_DRAFT:
        del config[field]
    llm = LLM(model=qwen3_dir, dtype="float32", device="cpu", block_size=4,
              async_scheduling=True, speculative_config=config)
    launches = record_launches(llm)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SHRINKING, use_tqdm=False)]
    assert tokens == [ref[:p.max_tokens] for ref, p in zip(reference, SHRINKING)]
    stats = llm.get_spec_decoding_stats()
    assert stats.num_steps_off_batch_size > 0 and stats.num_steps_drafting > 0
    assert stats.num_draft_tokens > 0
    assert any(drafted and overlapped for drafted, overlapped in launches)
    assert any(not drafted and overlapped for drafted, overlapped in launches)
    # While drafting was off its pass was skipped.
    assert llm.llm_engine.engine_core.executor.model_runner.spec.num_passes_skipped > 0
    assert_blocks_balance(llm)
    llm.shutdown()


def test_draft_model_of_another_vocabulary_is_refused(qwen3_dir: str,
                                                      tmp_path_factory) -> None:
    other = save_hf_model(str(tmp_path_factory.mktemp("other-vocab")), "qwen3",
                          vocab_size=300)
    with pytest.raises(ValueError, match=r"vocab_size \(300\) must equal the target's"):
        LLM(model=qwen3_dir, device="cpu", dtype="float32",
            speculative_config={"method": "draft_model", "model": other,
                                "num_speculative_tokens": 2})


def test_stop_string_inside_accepted_drafts_ends_the_output_as_without_speculation(
        qwen3_dir: str) -> None:
    """Several tokens arrive in one step; the text ends before the stop string and the token ids
    end with the token that completed it, exactly as when tokens come one at a time."""
    config = {"method": "draft_model", "model": qwen3_dir, "num_speculative_tokens": 4,
              **ALWAYS_DRAFT}
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    base = LLM(model=qwen3_dir, dtype="float32", device="cpu", block_size=4)
    texts = [o.outputs[0].text for o in base.generate(prompts, free, use_tqdm=False)]
    # A printable 3-character piece from the middle of each text (U+FFFD, a character still
    # incomplete, is no stop string to test with).
    stops = []
    for i, text in enumerate(texts):
        pieces = [text[j:j + 3] for j in range(len(text) // 3, len(text) - 3)
                  if text[j:j + 3].isascii() and text[j:j + 3].isprintable()]
        if pieces:
            stops.append((i, pieces[0]))
    assert len(stops) >= 2
    prompts = [prompts[i] for i, _ in stops]
    stops = [stop for _, stop in stops]
    expected = [base.generate([p], SamplingParams(max_tokens=24, temperature=0.0,
                                                  ignore_eos=True, stop=[stop]),
                              use_tqdm=False)[0].outputs[0]
                for p, stop in zip(prompts, stops)]
    base.shutdown()
    llm = LLM(model=qwen3_dir, dtype="float32", device="cpu", block_size=4,
              speculative_config=config)
    for p, stop, want in zip(prompts, stops, expected):
        got = llm.generate([p], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                               stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert (got.text, list(got.token_ids), got.finish_reason, got.stop_reason) == (
            want.text, list(want.token_ids), "stop", stop)
        assert stop not in got.text
    assert llm.get_spec_decoding_stats().num_accepted_tokens > 0
    assert_blocks_balance(llm)
    llm.shutdown()


# ---- n-gram drafts proposed on the device (async scheduling) ---------------------------------


def device_proposers(qwen3_dir: str, eagle_dir: str) -> dict[str, dict]:
    """Proposers whose drafts come from the device under async scheduling, drafting always
    on: prompt lookup, the model as its own draft (every draft accepted), an EAGLE head."""
    return {"ngram": NGRAM,
            "draft_model_self": {"method": "draft_model", "model": qwen3_dir,
                                 "num_speculative_tokens": 3, **ALWAYS_DRAFT},
            "eagle": {"method": "eagle", "model": eagle_dir, "num_speculative_tokens": 2,
                      **ALWAYS_DRAFT}}


@pytest.mark.parametrize("setting", list(SWITCHING_SETTINGS))
@pytest.mark.parametrize("proposer", ["ngram", "draft_model_self", "eagle"])
def test_device_drafts_leave_greedy_output_unchanged_and_overlap(
        qwen3_dir: str, eagle_dir: str, reference: list[list[int]], proposer: str,
        setting: str) -> None:
    """Drafting always on under async scheduling: every step drafts on the device after the
    tokens of the step in flight (a model proposer's device pass writes its KV and drafts after
    every step), steps with drafts launch while another is in flight, and the greedy output is
    the output without speculation; the model as its own draft gets every draft accepted
    (its KV is right through chunks, preemption and a worker process); blocks balance."""
    config = device_proposers(qwen3_dir, eagle_dir)[proposer]
    llm = LLM(model=qwen3_dir, dtype="float32", device="cpu", block_size=4,
              async_scheduling=True, speculative_config=config, **SWITCHING_SETTINGS[setting])
    launches = record_launches(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference
    stats = llm.get_spec_decoding_stats()
    assert stats.num_draft_tokens > 0
    if proposer != "eagle":  # a random head's drafts are rejected
        assert stats.num_accepted_tokens > 0
    if proposer == "draft_model_self":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
    if proposer != "ngram" and setting != "mp_executor":
        # Decode batches took the fixed-shape pass (a CUDA graph's on a GPU), the others
        # the general one.
        spec = llm.llm_engine.engine_core.executor.model_runner.spec
        assert spec.model_proposer.decode_batches.num_runs > 0
    assert sum(1 for drafted, overlapped in launches if drafted and overlapped) > 5
    if setting == "preemption":
        assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    assert_blocks_balance(llm)
    llm.shutdown()


@pytest.mark.parametrize("setting", list(SWITCHING_SETTINGS))
def test_model_proposer_passes_skipped_while_drafting_is_off_are_caught_up(
        qwen3_dir: str, reference: list[list[int]], setting: str) -> None:
    """While drafting is off (here for the batch size) a model proposer's device pass is
    skipped; when drafting comes back its first pass catches the request's missing positions
    up. The model as its own draft then still gets every draft accepted, which it only does
    when its KV is right at every position: through chunks, preemption, no prefix cache and a
    worker process. Then a request whose prompt hits blocks computed while the passes were
    skipped: the proposer's KV in them is caught up too."""
    config = {**device_proposers(qwen3_dir, "")["draft_model_self"], **BY_BATCH_SIZE}
    llm = LLM(model=qwen3_dir, dtype="float32", device="cpu", block_size=4,
              async_scheduling=True, speculative_config=config, **SWITCHING_SETTINGS[setting])
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SHRINKING,
                           use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [
        ref[:p.max_tokens] for ref, p in zip(reference, SHRINKING)]
    stats = llm.get_spec_decoding_stats()
    assert stats.num_steps_off_batch_size > 0 and stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    if setting != "mp_executor":
        spec = llm.llm_engine.engine_core.executor.model_runner.spec
        assert spec.num_passes_skipped > 0
    # A prompt again, alone (drafting on from its first step), whose request above ended
    # while drafting was off: its prompt's cached blocks never got the proposer's KV.
    before = stats.num_draft_tokens
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == reference[1]
    stats = llm.get_spec_decoding_stats()
    assert stats.num_draft_tokens > before
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    if setting == "preemption":
        assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    assert_blocks_balance(llm)
    llm.shutdown()


def test_model_proposer_catches_up_the_blocks_a_kv_connector_loaded(
        qwen3_dir: str, reference: list[list[int]]) -> None:
    """Blocks a KV connector loads (the CPU tier here) hold the target's KV only: the first
    pass over the request catches the proposer's KV up there, so the model as its own draft
    still gets every draft accepted, though the GPU blocks it loads into held other prompts'
    proposer KV."""
    config = device_proposers(qwen3_dir, "")["draft_model_self"]
    llm = LLM(model=qwen3_dir, dtype="float32", device="cpu", block_size=4,
              async_scheduling=True, speculative_config=config, kv_offloading_size=0.01,
              num_gpu_blocks_override=40, max_model_len=80)
    core = llm.llm_engine.engine_core
    prompt = [{"prompt_token_ids": PROMPTS[2]}]
    assert list(llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == (
        reference[2])  # its blocks saved to the CPU tier
    rng = random.Random(1)
    for _ in range(2):  # other prompts over every GPU block
        assert core.kv_cache_manager.reset_prefix_cache()
        others = [{"prompt_token_ids": [rng.randrange(3, 90) for _ in range(60)]}
                  for _ in range(2)]
        llm.generate(others, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
    assert core.kv_cache_manager.reset_prefix_cache()
    before = llm.get_spec_decoding_stats()
    drafted, accepted = before.num_draft_tokens, before.num_accepted_tokens
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == reference[2]
    assert core.scheduler.connector.get_stats()["loaded_blocks"] > 0
    stats = llm.get_spec_decoding_stats()
    assert stats.num_draft_tokens > drafted
    assert stats.num_accepted_tokens - accepted == stats.num_draft_tokens - drafted
    assert_blocks_balance(llm)
    llm.shutdown()


def proposer_kv(llm: LLM, req_id: str, snapshots: dict) -> torch.Tensor:
    """The model proposer's KV at a request's positions 0 .. n - 1, [layers, 2, n, ...]: its
    block-table row as last launched (snapshots[req_id] = (row table, n))."""
    spec = llm.llm_engine.engine_core.executor.model_runner.spec
    table, n = snapshots[req_id]
    positions = torch.arange(n)
    blocks = torch.as_tensor(table)[positions // 4].long()
    caches = spec.model_proposer.kv_caches.values()
    return torch.stack([cache[:, blocks, positions % 4] for cache in caches])


@pytest.mark.parametrize("proposer", ["eagle", "draft_model"])
def test_model_proposer_kv_after_a_catch_up_is_the_kv_of_a_pass_every_step(
        qwen3_dir: str, draft_dir: str, eagle_dir: str, reference: list[list[int]],
        proposer: str) -> None:
    """The proposer's KV of the longest request, which ran most of its steps with drafting off
    for the batch size (passes skipped, EAGLE's hidden states stored) and the rest alone with
    drafting on (caught up), equals its KV with drafting, and so the pass, on in every step."""
    kv = {}
    for name, policy in (("every_step", ALWAYS_DRAFT), ("caught_up", BY_BATCH_SIZE)):
        config = {**spec_configs(qwen3_dir, draft_dir, eagle_dir)[proposer], **policy}
        llm = LLM(model=qwen3_dir, dtype="float32", device="cpu", block_size=4,
                  async_scheduling=True, speculative_config=config)
        runner = llm.llm_engine.engine_core.executor.model_runner
        launch = runner.launch
        snapshots: dict = {}

        def recording(so, runner=runner, launch=launch, snapshots=snapshots):  # noqa: ANN001, ANN202
            handle = launch(so)
            for req_id, state in runner.requests.items():
                row = runner.block_tables
                snapshots[req_id] = (row.table[state.row, :row.num_blocks[state.row]].copy(),
                                     state.num_computed_tokens)
            return handle

        runner.launch = recording
        if name == "caught_up":
            # (What a GPU runs before the first request: every padded catch-up size, storing
            # nothing.)
            runner.spec.model_proposer.warm_up_catch_up(runner.block_tables.max_blocks_per_req)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SHRINKING,
                               use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == [
            ref[:p.max_tokens] for ref, p in zip(reference, SHRINKING)]
        if name == "caught_up":
            assert runner.spec.num_passes_skipped > 0
        kv[name] = proposer_kv(llm, "0", snapshots)
        assert_blocks_balance(llm)
        llm.shutdown()
    torch.testing.assert_close(kv["caught_up"], kv["every_step"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 11])
def test_device_drafts_never_exceed_max_tokens(qwen3_dir: str, reference: list[list[int]],
                                               max_tokens: int) -> None:
    """Draft slots are counted as accepted while in flight: a request near max_tokens gets
    fewer, and its output stops exactly at max_tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens, llm = generate(qwen3_dir, params, async_scheduling=True, speculative_config=NGRAM)
    assert tokens == [t[:max_tokens] for t in reference]
    assert_blocks_balance(llm)
    llm.shutdown()


def test_stop_token_inside_device_drafts_ends_the_output(qwen3_dir: str,
                                                         reference: list[list[int]]) -> None:
    """A stop token among a verification's accepted drafts ends the output there, though the
    next step (scheduled before it came back) computed past it."""
    llm = LLM(model=qwen3_dir, dtype="float32", device="cpu", block_size=4,
              async_scheduling=True, speculative_config=NGRAM)
    for prompt, ref in zip(PROMPTS, reference):
        stop_id = ref[9]
        expected = ref[:ref.index(stop_id) + 1]
        params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_id])
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == expected
    assert llm.get_spec_decoding_stats().num_accepted_tokens > 0
    assert_blocks_balance(llm)
    llm.shutdown()


def test_device_drafts_beside_a_request_that_cannot_speculate(
        qwen3_dir: str, reference: list[list[int]]) -> None:
    """A request with a penalty in the batch: steps with it draft nothing (the rejection
    sampler applies no penalties), the rows that follow a verification still take their
    tokens from the device, and every output equals its run without speculation."""
    penalised = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3,
                               ignore_eos=True)
    ref_penalised, base = generate(qwen3_dir, penalised, prompts=[PROMPTS[2]])
    base.shutdown()
    llm = LLM(model=qwen3_dir, dtype="float32", device="cpu", block_size=4,
              async_scheduling=True, speculative_config=NGRAM)
    engine = llm.llm_engine
    core = engine.engine_core
    execute_model = core.executor.execute_model
    drafted_with_penalised: list[bool] = []

    def recording(so):  # noqa: ANN001, ANN202
        if "p" in so.num_scheduled_tokens:
            drafted_with_penalised.append(any(so.scheduled_device_drafts.values()))
        return execute_model(so)

    core.executor.execute_model = recording
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"g{i}", {"prompt_token_ids": prompt}, GREEDY)
    tokens: dict[str, list[int]] = {}
    for _ in range(6):  # the greedy ones draft for a few steps first
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    engine.add_request("p", {"prompt_token_ids": PROMPTS[2]}, penalised)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    assert [tokens[f"g{i}"] for i in range(len(PROMPTS))] == reference
    assert tokens["p"] == ref_penalised[0]
    assert drafted_with_penalised and not any(drafted_with_penalised)
    assert llm.get_spec_decoding_stats().num_accepted_tokens > 0
    assert_blocks_balance(llm)
    llm.shutdown()


@pytest.mark.parametrize("proposer", ["ngram", "draft_model_self"])
def test_device_drafts_under_churn_with_aborts_and_preemption(
        qwen3_dir: str, eagle_dir: str, reference: list[list[int]], proposer: str) -> None:
    """Requests come and go (greedy, seeded sampling, a penalty, n > 1), some are aborted
    while their verification is in flight, the cache is small enough to preempt: the cache's
    integrity holds after every step, every block comes back, and the greedy requests that ran
    to the end equal their reference."""
    config = device_proposers(qwen3_dir, eagle_dir)[proposer]
    llm = LLM(model=qwen3_dir, dtype="float32", device="cpu", block_size=4,
              async_scheduling=True, speculative_config=config, num_gpu_blocks_override=40,
              max_model_len=80, max_num_batched_tokens=32, max_num_seqs=5)
    engine = llm.llm_engine
    rng = random.Random(0)
    live: set[str] = set()
    greedy_ids: dict[str, int] = {}
    finished: dict[str, list[int]] = {}
    for i in range(50):
        if rng.random() < 0.5:
            which = rng.randrange(len(PROMPTS))
            kind = rng.choice(["greedy", "greedy", "seeded", "penalty", "n2"])
            params = {
                "greedy": GREEDY,
                "seeded": SamplingParams(max_tokens=12, temperature=0.9, seed=i,
                                         ignore_eos=True),
                "penalty": SamplingParams(max_tokens=10, temperature=0.0,
                                          presence_penalty=0.5, ignore_eos=True),
                "n2": SamplingParams(n=2, max_tokens=8, temperature=0.7, ignore_eos=True),
            }[kind]
            req_id = engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[which]}, params)
            live.add(req_id)
            if kind == "greedy":
                greedy_ids[req_id] = which
        if live and rng.random() < 0.12:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
            greedy_ids.pop(victim, None)
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                finished[out.request_id] = list(out.outputs[0].token_ids)
        engine.kv_cache_manager.check_integrity()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        engine.kv_cache_manager.check_integrity()
    completed = [r for r in greedy_ids if r in finished]
    assert len(completed) >= 3
    assert all(finished[r] == reference[greedy_ids[r]] for r in completed)
    assert engine.scheduler.num_preemptions_total > 0
    assert llm.get_spec_decoding_stats().num_accepted_tokens > 0
    assert_blocks_balance(llm)
    llm.shutdown()


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_an_fp8_target_cache_keeps_its_greedy_output_under_speculation(
        qwen3_dir: str, draft_dir: str, eagle_dir: str, method: str) -> None:
    """The target's KV cache 8-bit, the proposer's in the model dtype: verification reads the
    target's cache as every decode does, so the output is the fp8 engine's without drafts."""
    want, llm = generate(qwen3_dir, kv_cache_dtype="fp8")
    llm.shutdown()
    config = spec_configs(qwen3_dir, draft_dir, eagle_dir)[method]
    tokens, llm = generate(qwen3_dir, speculative_config=config, kv_cache_dtype="fp8",
                           async_scheduling=True)
    runner = llm.llm_engine.engine_core.executor.model_runner
    assert {c.dtype for c in runner.kv_caches.values()} == {torch.float8_e4m3fn}
    assert tokens == want
    assert llm.get_spec_decoding_stats().num_draft_tokens > 0
    assert_blocks_balance(llm)
    llm.shutdown()
