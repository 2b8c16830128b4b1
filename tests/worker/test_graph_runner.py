"""The GraphRunner's choice of graph and its padding keep greedy outputs, tested on a CPU by
emulating CUDA graphs: 'capture' keeps each size's (input_ids, positions, metadata), views of the
InputBuilder's persistent buffers as a captured graph reads them, and 'replay' runs the model on
them. Padding requests and tokens then go through the model as they would in a graph (torch_ref
attention), so a wrong padding row, layout or graph size changes tokens or fails."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest
import torch

from sluice import LLM, SamplingParams
from sluice.engine.flags import add_engine_args, engine_args_from
from sluice.worker import graph_runner
from sluice.worker.cuda_graphs import DecodeGraphs

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": None,
         "min_accepted_tokens_per_step": 0}


class EmulatedGraphs(DecodeGraphs):
    def capture(self, forward: Callable, make_inputs: Callable) -> None:
        self.forward = forward
        self.inputs = {size: make_inputs(size) for size in reversed(self.sizes)}

    def replay(self, size: int) -> torch.Tensor:
        self.num_replays += 1
        return self.forward(*self.inputs[size])


def llm_with_emulated_graphs(kwargs: dict, monkeypatch: pytest.MonkeyPatch
                             ) -> tuple[LLM, graph_runner.GraphRunner]:
    """An LLM whose runner has captured emulated graphs of every set (and its graph runner)."""
    monkeypatch.setattr(graph_runner, "DecodeGraphs", EmulatedGraphs)
    llm = LLM(**kwargs)
    runner = llm.llm_engine.engine_core.executor.model_runner
    builder, graphs = runner.input_builder, runner.graph_runner
    builder.graph_block_tables = torch.zeros_like(
        builder.buf_block_tables.cpu.view(kwargs["max_num_seqs"], -1))
    graphs.capture(runner.model)
    return llm, graphs


def greedy_ids(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kwargs", [
    {"max_num_batched_tokens": 64, "async_scheduling": True},
    {"max_num_batched_tokens": 64, "speculative_config": NGRAM},
    # Drafting off while 3 requests or more run: decode graphs overlapped, then verification.
    {"max_num_batched_tokens": 64, "async_scheduling": True,
     "speculative_config": {**NGRAM, "disable_by_batch_size": 3}},
], ids=["async_chunks_of_64", "ngram", "ngram_async_switching"])
def test_emulated_graph_replays_give_eager_greedy_ids(qwen3_dir: str, kwargs: dict,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    common = dict(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=256,
                  max_num_seqs=8, **kwargs)
    prompts = [{"prompt_token_ids": list(range(40 + n, 40 + 2 * n))} for n in (5, 40, 70, 17)]
    prompts.append({"prompt_token_ids": [7, 8, 9, 10] * 10})  # n-gram drafts get accepted
    reference = greedy_ids(LLM(**common), prompts)

    llm, graphs = llm_with_emulated_graphs(common, monkeypatch)
    assert greedy_ids(llm, prompts) == reference
    # A lone prompt, then again over its cached prefix: the prefill graphs.
    for prompt, expected in zip(prompts[:2], reference[:2]):
        for _ in range(2):
            assert greedy_ids(llm, [prompt]) == [expected]
    sets = [graphs.graphs, graphs.prefill_graphs, graphs.mixed_graphs]
    if "speculative_config" in kwargs:
        sets.append(graphs.verify_graphs)
    assert all(s is not None and s.num_replays > 0 for s in sets)


def test_speculation_captures_the_graphs_of_an_engine_without_first_then_verification(
        qwen3_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With drafting off the two engines replay the same graphs: captured in the same order
    (sharing one pool, each capture may reuse what the one before freed), the verification
    graphs only after them."""
    captured: list[DecodeGraphs] = []

    class RecordedGraphs(EmulatedGraphs):
        def capture(self, forward: Callable, make_inputs: Callable) -> None:
            captured.append(self)
            super().capture(forward, make_inputs)

    monkeypatch.setattr(graph_runner, "DecodeGraphs", RecordedGraphs)
    orders = []
    for spec in (None, NGRAM):
        captured.clear()
        llm = LLM(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=256,
                  max_num_seqs=8, max_num_batched_tokens=64, speculative_config=spec)
        runner = llm.llm_engine.engine_core.executor.model_runner
        builder, graphs = runner.input_builder, runner.graph_runner
        builder.graph_block_tables = torch.zeros_like(builder.buf_block_tables.cpu.view(8, -1))
        graphs.capture(runner.model)
        names = {id(graphs.graphs): "decode", id(graphs.prefill_graphs): "prefill",
                 id(graphs.mixed_graphs): "mixed", id(graphs.verify_graphs): "verify"}
        orders.append([(names[id(s)], s.sizes) for s in captured])
        llm.shutdown()
    without, with_spec = orders
    assert [name for name, _ in without] == ["decode", "prefill", "mixed"]
    assert with_spec[:3] == without
    assert with_spec[3][0] == "verify"


def test_short_contexts_replay_the_decode_graphs_captured_for_them(
        qwen3_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the attention backend's plan for a decode batch differs between contexts under
    SHORT_CONTEXT_TOKENS and max_model_len (split-KV only for long contexts), those sizes are
    captured a second time for short contexts; a decode step replays them while its longest
    context is under the bound, and the main set from there on; greedy ids stay the eager
    ones."""
    common = dict(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=1024,
                  max_num_seqs=4, async_scheduling=True)
    short = [{"prompt_token_ids": list(range(40 + n, 40 + 2 * n))} for n in (5, 17)]
    long_len = graph_runner.SHORT_CONTEXT_TOKENS - 4
    long = {"prompt_token_ids": [(7 * i) % 500 + 3 for i in range(long_len)]}
    reference = greedy_ids(LLM(**common), short + [long])

    monkeypatch.setattr(graph_runner, "DecodeGraphs", EmulatedGraphs)
    llm = LLM(**common)
    runner = llm.llm_engine.engine_core.executor.model_runner
    builder, graphs = runner.input_builder, runner.graph_runner
    builder.graph_block_tables = torch.zeros_like(builder.buf_block_tables.cpu.view(4, -1))
    plans = []

    def decode_plan(num_reqs: int, num_kv_heads: int, max_seq_len: int, device,
                    cache_dtype) -> str:
        plans.append((num_reqs, max_seq_len))
        long_context = max_seq_len >= graph_runner.SHORT_CONTEXT_TOKENS
        return "split" if num_reqs <= 2 and long_context else "unified"

    monkeypatch.setattr(runner.attn_backend, "decode_plan", decode_plan, raising=False)
    graphs.capture(runner.model)
    assert graphs.graphs.sizes[:3] == [1, 2, 4]
    assert graphs.short_graphs.sizes == [1, 2]  # 4 requests: the same plan either way
    assert (1, graph_runner.SHORT_CONTEXT_TOKENS - 1) in plans and (1, 1024) in plans

    assert greedy_ids(llm, short) == reference[:2]
    assert graphs.short_graphs.num_replays > 0 and graphs.graphs.num_replays == 0
    short_replays = graphs.short_graphs.num_replays
    # The long prompt's decode steps start at 508 + 1 keys and cross 512 within 12 tokens:
    # the short set until then, the main set after.
    assert greedy_ids(llm, [long]) == reference[2:]
    assert graphs.short_graphs.num_replays > short_replays and graphs.graphs.num_replays > 0


def test_fresh_prompts_replay_the_dense_prefill_graphs(qwen3_dir: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the backend offers dense attention for a step that is one fresh prompt, those
    sizes are captured a second time with it; a lone prompt over no cached context replays them
    when it fills enough of its padded size (else, and over a cached prefix, the paged prompt
    graphs); eager steps of one fresh prompt take the paged kernel (cuDNN would plan each new
    length); greedy ids stay the paged ones."""
    from sluice.attention import dense, torch_ref

    common = dict(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=256,
                  max_num_seqs=4)
    # Of the 64-token graph: 94% and 58%; no prefix in common.
    full = {"prompt_token_ids": [(7 * i) % 300 + 3 for i in range(60)]}
    sparse = {"prompt_token_ids": [(11 * i) % 300 + 5 for i in range(37)]}
    reference = greedy_ids(LLM(**common), [full, sparse])

    dense_calls = []

    def counted(*args: object) -> torch.Tensor:
        dense_calls.append(args[0].shape[0])
        return dense_attention(*args)

    dense_attention = dense.dense_causal_attention
    monkeypatch.setattr(dense, "dense_causal_attention", counted)
    monkeypatch.setattr(torch_ref.TorchRefBackend, "dense_prefill", True)
    eager = LLM(**common)
    assert [greedy_ids(eager, [p])[0] for p in (full, sparse)] == reference
    assert not dense_calls

    # `--no-dense-prefill` (EngineArgs.dense_prefill, parsed by the CLI) turns it off.
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--model", qwen3_dir, "--no-dense-prefill"]))
    assert args.dense_prefill is False
    _, off = llm_with_emulated_graphs({**common, "dense_prefill": False}, monkeypatch)
    assert off.dense_prefill_graphs is None and not off.inputs.dense_prefix

    monkeypatch.setattr(graph_runner, "DENSE_ALWAYS_UP_TO", 0)  # the fill rule alone decides
    llm, graphs = llm_with_emulated_graphs(common, monkeypatch)
    assert graphs.dense_prefill_graphs.sizes == graphs.prefill_graphs.sizes
    dense_calls.clear()
    assert greedy_ids(llm, [full]) == reference[:1]
    assert graphs.dense_prefill_graphs.num_replays == 1 and graphs.prefill_graphs.num_replays == 0
    assert set(dense_calls) == {64}  # the padded graph's rows
    assert greedy_ids(llm, [sparse]) == reference[1:]  # 37 of 64: the paged graph
    assert graphs.dense_prefill_graphs.num_replays == 1 and graphs.prefill_graphs.num_replays == 1
    assert greedy_ids(llm, [full]) == reference[:1]  # 56 tokens cached: 4 over a prefix
    assert graphs.dense_prefill_graphs.num_replays == 1 and graphs.prefill_graphs.num_replays == 2


def test_long_prompt_chunks_over_a_prefix_run_dense_attention_eagerly(
        qwen3_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone prompt in chunks: the first (no cached context) replays a dense-prefill graph,
    later chunks of the whole token budget (of DENSE_OVER_PREFIX_MIN_TOKENS or more) over whole
    budgets, whose shapes the warm-up planned, run eagerly with dense attention over the prefix
    gathered from the cache; a shorter last chunk, and a chunk over a prefix-cache hit of
    another length, replay the paged prompt graph; greedy ids stay the paged ones."""
    from sluice.attention import dense, torch_ref

    common = dict(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=256,
                  max_num_seqs=4, max_num_batched_tokens=64)
    prompt = {"prompt_token_ids": [(13 * i) % 400 + 3 for i in range(200)]}  # 64+64+64+8
    # Its first 9 blocks cached, then 64 + 64 over 72 and 136 tokens.
    hit = {"prompt_token_ids": prompt["prompt_token_ids"][:75] + [5] * 125}
    reference = greedy_ids(LLM(**common), [prompt, hit])

    over_prefix = []

    def counted(*args: object) -> torch.Tensor:
        over_prefix.append((args[0].shape[0], args[6]))  # (queries, context_len)
        return attention_over_prefix(*args)

    attention_over_prefix = dense.dense_attention_over_prefix
    monkeypatch.setattr(dense, "dense_attention_over_prefix", counted)
    monkeypatch.setattr(torch_ref.TorchRefBackend, "dense_prefill", True)
    monkeypatch.setattr(graph_runner, "DENSE_OVER_PREFIX_MIN_TOKENS", 32)
    llm, graphs = llm_with_emulated_graphs(common, monkeypatch)
    model = llm.llm_engine.engine_core.executor.model_runner.model
    num_layers = len(graph_runner.attention_layers(model))
    assert graphs.dense_prefix_contexts == frozenset()  # nothing planned: never dense
    # The gathered and repeated prefix K/V of at most 128 context tokens fit the cap.
    layer = next(iter(graph_runner.attention_layers(model).values()))
    context_bytes = 2 * (layer.num_heads + layer.num_kv_heads) * layer.head_dim * 4
    with monkeypatch.context() as patch:
        patch.setattr(graph_runner, "DENSE_PREFIX_MAX_BYTES", 128 * context_bytes + 1)
        graphs._plan_dense_prefix(model)
    assert graphs.dense_prefix_contexts == {64, 128}
    over_prefix.clear()
    graphs._plan_dense_prefix(model)  # the CUDA warm-up's part (a chunk of 64 over 64 to 192)
    assert graphs.dense_prefix_contexts == {64, 128, 192}
    assert over_prefix == [(64, c) for c in (64, 128, 192) for _ in range(num_layers)]
    over_prefix.clear()
    assert greedy_ids(llm, [prompt]) == reference[:1]
    assert over_prefix == [(64, 64)] * num_layers + [(64, 128)] * num_layers
    assert graphs.dense_prefill_graphs.num_replays == 1  # the first chunk
    assert graphs.prefill_graphs.num_replays == 1  # the last 8 tokens over 192
    over_prefix.clear()
    assert greedy_ids(llm, [hit]) == reference[1:]
    assert not over_prefix
    assert graphs.prefill_graphs.num_replays == 3



def test_every_admitted_prompt_length_has_a_prefill_graph() -> None:
    """The largest one-prompt graph ends at the longest prompt the engine admits, bucket or not."""
    assert graph_runner.prefill_graph_sizes(3064)[-2:] == [2560, 3064]
    assert graph_runner.prefill_graph_sizes(4096)[-1] == 4096
    assert 4096 not in graph_runner.prefill_graph_sizes(3064)
    assert graph_runner.prefill_graph_sizes(100) == [64, 100]
    assert graph_runner.prefill_graph_sizes(32) == [32]
    assert graph_runner.prefill_graph_sizes(20000)[-1] == 8192  # longer prompts run eagerly


def test_a_prompt_past_the_last_bucket_replays_the_max_model_len_graph(
        qwen3_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """max_model_len 200 (buckets 64, 128, then 200): a 150-token prompt replays the 200-token
    graph, its greedy ids those of an eager engine."""
    common = dict(model=qwen3_dir, dtype="float32", block_size=8, max_model_len=200,
                  max_num_seqs=4, max_num_batched_tokens=256)
    prompt = [{"prompt_token_ids": list(range(30, 180))}]
    reference = greedy_ids(LLM(**common), prompt)
    llm, graphs = llm_with_emulated_graphs(common, monkeypatch)
    assert graphs.prefill_graphs.sizes[-1] == 200
    before = graphs.prefill_graphs.num_replays + (graphs.dense_prefill_graphs.num_replays
                                                  if graphs.dense_prefill_graphs else 0)
    assert greedy_ids(llm, prompt) == reference
    after = graphs.prefill_graphs.num_replays + (graphs.dense_prefill_graphs.num_replays
                                                 if graphs.dense_prefill_graphs else 0)
    assert after == before + 1
