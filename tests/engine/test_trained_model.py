"""The trained SmolLM2-135M-Instruct through the offline API (CPU, float32): greedy replies equal
transformers' `generate` from the .gguf and from the folder transformers made of it, prompt
logprobs equal its forward pass, EOS and stop strings end replies where transformers ends them,
and prefix caching, chunked prefill, preemption and every speculation method leave greedy
output unchanged; structured outputs are valid on real prompts."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from sluice import LLM, SamplingParams
from sluice.sampling_params import StructuredOutputsParams
from sluice.spec_decode.eagle_model import make_tiny_eagle
from tests.conftest import HFReference, TrainedModel

MAX_TOKENS = 24
EOS_ID = 2  # <|im_end|>
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "Explain what a CPU does in one sentence."}],
    [{"role": "system", "content": "You are a pirate. Answer like one."},
     {"role": "user", "content": "How are you today?"}],
    [{"role": "user", "content": "My name is Ada."},
     {"role": "assistant", "content": "Nice to meet you, Ada!"},
     {"role": "user", "content": "What is my name?"}],
    [{"role": "user", "content": "Repeat this sentence exactly: the quick brown fox jumps over "
                                 "the lazy dog."}],
]
ENGINE = dict(dtype="float32", device="cpu", max_model_len=1024, block_size=16,
              num_gpu_blocks_override=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
ALWAYS_DRAFT = {"disable_by_batch_size": None, "min_accepted_tokens_per_step": 0}


def chat_ids(llm: LLM, conversations: list[list[dict]] = CONVERSATIONS,
             params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.chat(conversations, params, use_tqdm=False)]


def reference_ids(ref: HFReference, conversations: list[list[dict]] = CONVERSATIONS
                  ) -> list[list[int]]:
    return [ref.greedy(ref.chat_ids(c), MAX_TOKENS) for c in conversations]


def assert_blocks_balance(llm: LLM) -> None:
    manager = llm.llm_engine.kv_cache_manager
    manager.check_integrity()
    assert manager.get_num_free_blocks() == manager.block_pool.num_blocks - 1


@pytest.fixture(scope="module")
def gguf_llm(smollm2: TrainedModel) -> LLM:
    return LLM(model=smollm2.gguf, **ENGINE)


@pytest.fixture(scope="module")
def folder_llm(smollm2: TrainedModel) -> LLM:
    return LLM(model=smollm2.hf_dir, **ENGINE)


@pytest.mark.parametrize("source", ["gguf", "folder"])
def test_greedy_chat_replies_equal_transformers(request: pytest.FixtureRequest, source: str,
                                                smollm2_reference: HFReference) -> None:
    llm = request.getfixturevalue(f"{source}_llm")
    want = reference_ids(smollm2_reference)
    assert chat_ids(llm) == want
    # The replies are real text that ends: most end with EOS inside the budget, as in
    # transformers, and the first is the right answer.
    assert sum(ids[-1] == EOS_ID for ids in want) >= 3
    first = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)[0].outputs[0]
    assert first.text == "The capital of France is Paris." and first.finish_reason == "stop"
    assert_blocks_balance(llm)


def test_the_gguf_and_the_folder_load_the_same_weights(gguf_llm: LLM, folder_llm: LLM) -> None:
    import torch

    def params(llm: LLM) -> dict[str, torch.Tensor]:
        return dict(llm.llm_engine.engine_core.executor.model_runner.model.named_parameters())

    a, b = params(gguf_llm), params(folder_llm)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_prompt_logprobs_equal_transformers(gguf_llm: LLM,
                                            smollm2_reference: HFReference) -> None:
    text = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
            "France. It is named after the engineer Gustave Eiffel.")
    token_ids = smollm2_reference.tokenizer.encode(text)
    out = gguf_llm.generate([{"prompt_token_ids": token_ids}],
                            SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None
    got = [position[token].logprob for position, token in zip(out.prompt_logprobs[1:],
                                                              token_ids[1:])]
    want = smollm2_reference.prompt_logprobs(token_ids)
    assert max(abs(g - w) for g, w in zip(got, want)) < 2e-3
    assert min(want) < -5  # real text: confident and surprised tokens both


@pytest.mark.parametrize("stop", [".", " the", "\n"])
def test_stop_strings_end_replies_where_transformers_does(gguf_llm: LLM, stop: str,
                                                          smollm2_reference: HFReference
                                                          ) -> None:
    prompts = CONVERSATIONS[1:5]
    outputs = gguf_llm.chat(prompts, SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                            use_tqdm=False)
    for conversation, out in zip(prompts, outputs):
        hf_text = smollm2_reference.generate_text(smollm2_reference.chat_ids(conversation), 40,
                                                  stop_strings=[stop])
        sample = out.outputs[0]
        if stop in hf_text:  # transformers keeps the stop string; sluice, as vLLM, does not
            assert sample.text == hf_text[:hf_text.index(stop)]
            assert sample.finish_reason == "stop" and sample.stop_reason == stop
        else:
            assert sample.text == hf_text


def test_prefix_caching_chunked_prefill_and_preemption_leave_greedy_unchanged(
        smollm2: TrainedModel, smollm2_reference: HFReference) -> None:
    # 16-token chunks, and 12 blocks of 16 tokens for eight requests of ~60: preempted; run
    # twice, the second run's prompts hit the prefix cache (SmolLM2's default system prompt
    # is a shared prefix of all but one).
    llm = LLM(model=smollm2.hf_dir, **{**ENGINE, "num_gpu_blocks_override": 12,
                                       "max_num_batched_tokens": 16, "max_model_len": 176})
    want = reference_ids(smollm2_reference)
    assert chat_ids(llm) == want
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    outputs = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == want
    assert sum(o.num_cached_tokens for o in outputs) > 0
    assert_blocks_balance(llm)


def random_draft(target_dir: str, out_dir: str) -> str:
    """A random one-layer Llama of SmolLM2's vocabulary and tokenizer: drafts mostly rejected."""
    import shutil

    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(target_dir)
    config.update(dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    torch.manual_seed(5)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{target_dir}/{name}", out_dir)
    return out_dir


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_speculation_leaves_greedy_unchanged_on_real_text(
        method: str, smollm2: TrainedModel, smollm2_reference: HFReference,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    config: dict = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                    "prompt_lookup_max": 4}
    if method == "draft_model":
        config = {"method": "draft_model", "num_speculative_tokens": 3,
                  "model": random_draft(smollm2.hf_dir, str(tmp_path_factory.mktemp("draft")))}
    elif method == "eagle":
        config = {"method": "eagle", "num_speculative_tokens": 2,
                  "model": make_tiny_eagle(smollm2.hf_dir, str(tmp_path_factory.mktemp("eagle")),
                                           seed=3)}
    # Async scheduling (the GPU default) with drafting always on.
    llm = LLM(model=smollm2.hf_dir, async_scheduling=True,
              speculative_config={**config, **ALWAYS_DRAFT}, **ENGINE)
    conversations = CONVERSATIONS[3:]
    assert chat_ids(llm, conversations) == reference_ids(smollm2_reference, conversations)
    stats = llm.get_spec_decoding_stats()
    assert stats.num_draft_tokens > 0
    if method == "ngram":  # the copy-heavy prompt's drafts are right
        assert stats.num_accepted_tokens > 0
    assert_blocks_balance(llm)


def test_structured_outputs_are_valid_on_real_prompts(gguf_llm: LLM) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    cases = [
        ("Describe a cat named Tom who is 3 years old as JSON.", {"json": schema}),
        ("Give me a US phone number.", {"regex": r"\d{3}-\d{3}-\d{4}"}),
        ("Is the review 'I loved this film' positive or negative?",
         {"choice": ["positive", "negative"]}),
    ]
    params = [SamplingParams(temperature=0, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(**kind))
              for _, kind in cases]
    outputs = gguf_llm.chat([[{"role": "user", "content": q}] for q, _ in cases], params,
                            use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs), texts
    value = json.loads(texts[0])
    jsonschema.validate(value, schema)
    assert value["age"] == 3
    assert re.fullmatch(r"\d{3}-\d{3}-\d{4}", texts[1])
    assert texts[2] == "positive"


def test_chat_renders_the_tools_given(gguf_llm: LLM, smollm2_reference: HFReference) -> None:
    from sluice.model.builtin import SMOLLM2_CHAT_TEMPLATE

    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    conversation = [{"role": "user", "content": "Weather in Paris?"}]
    out = gguf_llm.chat(conversation, SamplingParams(max_tokens=1), use_tqdm=False,
                        chat_template=SMOLLM2_CHAT_TEMPLATE, tools=tools)[0]
    want = smollm2_reference.chat_ids(conversation, tools=tools,
                                      chat_template=SMOLLM2_CHAT_TEMPLATE)
    assert out.prompt_token_ids == want
    assert '"name": "get_weather"' in smollm2_reference.tokenizer.decode(want)
