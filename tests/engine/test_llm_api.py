"""The offline API as users call it: sampling, stops, logprobs, n > 1, chat, errors, aborts."""

from __future__ import annotations

import random

import pytest
import torch

from sluice import LLM, SamplingParams
from sluice.engine.processors import RequestOutputKind
from tests.engine.test_generate_matches_hf import _hf_model, assert_integrity_and_all_free


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async_scheduling"])
def llm(qwen3_dir: str, request: pytest.FixtureRequest) -> LLM:
    return LLM(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=256, seed=0,
               async_scheduling=request.param)


def ids_prompt(tokens: list[int]) -> dict:
    return {"prompt_token_ids": tokens}


def greedy(max_tokens: int = 12, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_outputs_come_back_in_input_order_with_prompts(llm: LLM) -> None:
    prompts = ["Hello world", "The quick brown fox", "a"]
    outputs = llm.generate(prompts, greedy(4, ignore_eos=True))
    assert [o.prompt for o in outputs] == prompts
    tok = llm.get_tokenizer()
    assert [o.prompt_token_ids for o in outputs] == [tok.encode(p) for p in prompts]
    for o in outputs:
        assert o.finished and len(o.outputs) == 1
        assert o.outputs[0].finish_reason == "length"
        assert len(o.outputs[0].token_ids) == 4
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    target = ids_prompt(list(range(20, 45)))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16,
                            ignore_eos=True)
    alone = llm.generate([target], params)[0].outputs[0].token_ids
    others = [ids_prompt(list(range(50, 50 + n))) for n in (3, 30, 9)]
    mixed_params = [SamplingParams(temperature=1.0, seed=7, max_tokens=16),
                    params,
                    SamplingParams(temperature=0.8, max_tokens=20),
                    SamplingParams(temperature=1.0, max_tokens=5)]
    batched = llm.generate([others[0], target, others[1], others[2]], mixed_params)
    assert batched[1].outputs[0].token_ids == alone
    different_seed = llm.generate([target], params.clone(seed=99))[0].outputs[0].token_ids
    assert different_seed != alone


def test_n_samples_share_the_prompt_blocks(llm: LLM) -> None:
    manager = llm.llm_engine.kv_cache_manager
    hits_before = manager.prefix_cache_hits
    prompt = ids_prompt(list(range(100, 141)))  # 41 tokens: five full blocks of 8
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8,
                                                ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different samples
    # The second and third sample found the first one's five full prompt blocks.
    assert manager.prefix_cache_hits - hits_before == 2 * 40
    greedy_out = llm.generate([prompt], greedy(6, n=2, ignore_eos=True))[0]
    assert greedy_out.outputs[0].token_ids == greedy_out.outputs[1].token_ids
    assert_integrity_and_all_free(llm)


def test_stop_string_across_token_boundary_is_cut_from_the_text(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prompt = ids_prompt(list(range(60, 90)))
    full = llm.generate([prompt], greedy(24, ignore_eos=True))[0].outputs[0]
    pieces = [tok.decode([t]) for t in full.token_ids]
    # A stop string made of the end of one token and the start of the next.
    for i in range(2, len(pieces) - 1):
        if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2:
            break
    else:
        pytest.skip("no two consecutive multi-character tokens in this output")
    stop = pieces[i][-1] + pieces[i + 1][:1]
    start = full.text.index(stop)
    out = llm.generate([prompt], greedy(24, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.text == full.text[:start]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    with_stop = llm.generate([prompt], greedy(24, ignore_eos=True, stop=[stop],
                                              include_stop_str_in_output=True))[0].outputs[0]
    assert with_stop.text == full.text[:start + len(stop)]
    assert_integrity_and_all_free(llm)


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    prompt = ids_prompt(list(range(70, 95)))
    full = llm.generate([prompt], greedy(10, ignore_eos=True))[0].outputs[0].token_ids
    stop_id = full[3]
    first = full.index(stop_id)
    out = llm.generate([prompt], greedy(10, ignore_eos=True,
                                        stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == full[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens: the stop token cannot be sampled before 8 tokens exist.
    out = llm.generate([prompt], greedy(10, ignore_eos=True, stop_token_ids=[stop_id],
                                        min_tokens=8))[0].outputs[0]
    assert stop_id not in out.token_ids[:8]
    assert len(out.token_ids) >= 8


def test_logprobs_equal_log_softmax_of_reference_logits(llm: LLM, qwen3_dir: str) -> None:
    prompt = list(range(30, 52))
    out = llm.generate([ids_prompt(prompt)], greedy(6, ignore_eos=True, logprobs=5,
                                                    prompt_logprobs=3))[0]
    completion = out.outputs[0]
    model = _hf_model(qwen3_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion.token_ids])).logits[0]
    ref = torch.log_softmax(logits.float(), dim=-1)

    assert len(completion.logprobs) == 6
    total = 0.0
    for step, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + step]
        assert entry[token_id].rank == 1  # greedy picks the top token
        top = torch.topk(row, 5)
        assert set(top.indices.tolist()) <= set(entry)
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=1e-4)
        total += entry[token_id].logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)

    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        row = ref[pos - 1]
        assert entry[prompt[pos]].logprob == pytest.approx(row[prompt[pos]].item(), abs=1e-4)
        assert entry[prompt[pos]].rank == int((row > row[prompt[pos]]).sum()) + 1
        assert len(entry) in (3, 4)


def test_chat_applies_the_tokenizer_chat_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi there<|im_end|>" in rendered
    chat = llm.chat(messages, greedy(6))[0]
    plain = llm.generate([ids_prompt(tok.encode(rendered, add_special_tokens=False))],
                         greedy(6))[0]
    assert chat.prompt_token_ids == plain.prompt_token_ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids


@pytest.mark.parametrize(("make", "field"), [
    (lambda llm: llm.generate([""]), "prompt"),
    (lambda llm: llm.generate([{"prompt_token_ids": []}]), "prompt_token_ids"),
    (lambda llm: llm.generate([{"prompt_token_ids": [10**9]}]), "prompt_token_ids"),
    (lambda llm: llm.generate([{"prompt_token_ids": [5] * 300}]), "max_model_len"),
    (lambda llm: SamplingParams(max_tokens=0), "max_tokens"),
    (lambda llm: SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (lambda llm: SamplingParams(top_p=7), r"top_p must be in \(0, 1\]"),
    (lambda llm: SamplingParams(temperature=-1), "temperature"),
    (lambda llm: SamplingParams(logprobs=1000), "logprobs"),
    (lambda llm: llm.generate(["a", "b"], [greedy(), greedy(), greedy()]), "sampling_params"),
])
def test_bad_input_raises_value_error_naming_the_field(llm: LLM, make, field: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=field):
        make(llm)
    assert_integrity_and_all_free(llm)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_bad_prompt_in_a_batch_queues_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["fine", {"prompt_token_ids": [5] * 300}], greedy())
    assert not llm.llm_engine.has_unfinished_requests()
    assert_integrity_and_all_free(llm)


def test_unknown_model_folder_and_engine_arguments(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM(model=str(tmp_path / "does-not-exist"))
    with pytest.raises(TypeError, match="not_an_arg"):
        LLM(model=str(tmp_path), not_an_arg=1)


def test_engine_args_are_validated(qwen3_dir: str) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=qwen3_dir, max_model_len=10**6)
    with pytest.raises(ValueError, match="block_size"):
        LLM(model=qwen3_dir, block_size=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(model=qwen3_dir, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(model=qwen3_dir, enable_chunked_prefill=False, max_num_batched_tokens=16,
            max_model_len=64)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_random_workload_with_aborts_and_preemption_returns_every_block(
        qwen3_dir: str, async_scheduling: bool) -> None:
    llm = LLM(model=qwen3_dir, dtype="float32", block_size=4, max_model_len=96,
              num_gpu_blocks_override=40, max_num_batched_tokens=48, max_num_seqs=6,
              async_scheduling=async_scheduling)
    engine = llm.llm_engine
    rng = random.Random(0)
    shared = [rng.randrange(3, 600) for _ in range(24)]
    live: set[str] = set()
    finished = 0
    for i in range(60):
        if rng.random() < 0.6:
            tokens = (shared[:rng.randrange(0, 24)]
                      + [rng.randrange(3, 600) for _ in range(rng.randrange(1, 30))])
            params = SamplingParams(temperature=rng.choice([0.0, 1.0]), n=rng.choice([1, 1, 2]),
                                    max_tokens=rng.randrange(1, 30), ignore_eos=True,
                                    seed=rng.randrange(100))
            live.add(engine.add_request(f"r{i}", ids_prompt(tokens), params,
                                        RequestOutputKind.DELTA))
        if live and rng.random() < 0.15:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                finished += 1
        engine.kv_cache_manager.check_integrity()
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished += out.finished
    assert finished > 10
    assert engine.scheduler.num_preemptions_total > 0
    assert_integrity_and_all_free(llm)
    # The runner forgets every ended request (by the next schedule at the latest): one more
    # request leaves at most its own state behind, and one block-table row per state.
    llm.generate([ids_prompt([3, 4, 5])], greedy(2))
    runner = engine.engine_core.executor.model_runner
    assert len(runner.requests) <= 1
    rows = runner.block_tables
    assert rows.table.shape[0] - len(rows.free_rows) == len(runner.requests)


def test_penalties_and_min_tokens_give_the_same_output_with_async_scheduling(
        qwen3_dir: str) -> None:
    # Penalties and min_tokens count generated tokens on the host: with a token in flight the
    # runner must settle it first, or the counts would be one short.
    prompts = [ids_prompt(list(range(40, 40 + n))) for n in (7, 19, 33)]
    params = [greedy(16, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
              greedy(16, ignore_eos=True, repetition_penalty=1.8),
              greedy(16, min_tokens=12, stop_token_ids=list(range(0, 643, 2)))]
    outputs = {}
    for async_scheduling in (False, True):
        llm = LLM(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=256,
                  async_scheduling=async_scheduling)
        outputs[async_scheduling] = [o.outputs[0].token_ids
                                     for o in llm.generate(prompts, params)]
        assert_integrity_and_all_free(llm)
    assert outputs[True] == outputs[False]
    plain = LLM(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=256)
    unpenalised = plain.generate(prompts[:1], greedy(16, ignore_eos=True))[0].outputs[0]
    assert outputs[False][0] != unpenalised.token_ids
    # min_tokens: no even id (stop ids) among the first 12; then the first even id ends it.
    third = outputs[False][2]
    assert all(t % 2 for t in third[:12])
    assert len(third) == 16 or third[-1] % 2 == 0


def test_shutdown_frees_the_kv_cache_and_model_at_once(qwen3_dir: str) -> None:
    import gc
    import weakref

    llm = LLM(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=256)
    llm.generate([ids_prompt([5, 6, 7])], greedy(2))
    runner = llm.llm_engine.engine_core.executor.model_runner
    kv_cache = weakref.ref(runner.kv_caches["model.layers.0.self_attn.attn"])
    model = weakref.ref(runner.model)
    llm.shutdown()
    gc.collect()
    # Engines freeze their objects out of the cyclic collector: without shutdown() a dropped
    # engine would keep its (GPU) memory for the life of the process.
    assert kv_cache() is None and model() is None


def test_async_engine_forgets_a_request_aborted_while_the_schedule_is_empty(
        qwen3_dir: str) -> None:
    # A needs 2 tokens: after two steps both are scheduled (one still in flight), so the next
    # schedule is empty. B is aborted just before it: the runner must still hear of it.
    llm = LLM(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=256,
              async_scheduling=True)
    engine = llm.llm_engine
    engine.add_request("A", ids_prompt([5, 6, 7]), greedy(2, ignore_eos=True))
    engine.add_request("B", ids_prompt([8, 9, 10]), greedy(50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("B")
    while engine.has_unfinished_requests():
        engine.step()
    assert "B" not in engine.engine_core.executor.model_runner.requests
    assert_integrity_and_all_free(llm)
