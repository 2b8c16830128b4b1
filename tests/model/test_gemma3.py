"""Gemma 3's config as sluice reads it (sluice.model.hf_config._parse_gemma3); its outputs against
transformers: tests/model/test_models_match_hf.py (logits through the paged cache, soft-capped),
tests/engine/test_generate_matches_hf.py (greedy ids), tests/distributed/test_tp_engine.py
(TP 2 with preemption)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice import LLM
from sluice.model.hf_config import parse_hf_config
from tests.tiny_models import save_hf_model

BASE = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 512}


def test_both_config_styles_give_the_layer_types_and_rope_bases() -> None:
    # transformers 4: rope_theta, rope_local_base_freq, sliding_window_pattern
    old = parse_hf_config({**BASE, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                           "sliding_window_pattern": 3})
    assert old.gemma.sliding_layers == (True, True, False, True, True, False)
    assert (old.rope_theta, old.gemma.local_rope_theta) == (1e6, 1e4)
    assert old.tie_word_embeddings and old.gemma.query_pre_attn_scalar == 256
    # transformers 5: layer_types and rope_parameters per layer type
    new = parse_hf_config({**BASE, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                           "rope_parameters": {
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                               "full_attention": {"rope_type": "default", "rope_theta": 1e6}}})
    assert new.gemma.sliding_layers == (True,) * 5 + (False,)
    assert new.sliding_window == 512
    everywhere = parse_hf_config({**BASE, "layer_types": ["full_attention"] * 6})
    assert everywhere.sliding_window is None  # no layer slides: no bound


@pytest.mark.parametrize("fields,message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}},
     "full_attention rope_type 'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "linear"}}, "linear RoPE scaling needs a positive factor"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                          "full_attention": {"rope_type": "default"}}},
     "sliding_attention rope_type 'linear' is not supported"),
    ({"hidden_activation": "gelu"}, "hidden_activation must be 'gelu_pytorch_tanh', got 'gelu'"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is not supported"),
    ({"layer_types": ["full_attention"] * 5}, "for each of the 6 layers"),
])
def test_what_is_not_read_is_refused_naming_it(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_hf_config({**BASE, **fields})


def test_the_window_no_longer_holds_max_model_len(tmp_path: Path) -> None:
    """Up to max_position_embeddings, as any model; the windowed and global layers are KV
    cache groups of their own, the global one keeping every block
    (tests/engine/test_hybrid_kv_cache.py)."""
    folder = save_hf_model(str(tmp_path / "g"), "gemma3", sliding_window=96)
    llm = LLM(model=folder, dtype="float32")
    assert llm.llm_engine.scheduler_config.max_model_len == 1024  # max_position_embeddings
    assert llm.llm_engine.kv_cache_manager.groups.windows == (None, 96)
    llm.shutdown()


def _multimodal_folder(path: Path) -> str:
    """A tiny Gemma3ForConditionalGeneration (the 4B-27B models' layout: the text model under
    language_model., a vision tower and projector beside it), its global layers' RoPE
    linearly scaled by 8, a window of 24 on its sliding layers; saved by transformers."""
    import torch
    import transformers

    from sluice.model.tiny import build_tokenizer

    tokenizer = build_tokenizer(str(path))
    vocab = len(tokenizer)
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=24,
                query_pre_attn_scalar=16, max_position_embeddings=1024, pad_token_id=None,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                       "rope_theta": 1e6}},
                initializer_range=0.1)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4,
        image_token_index=vocab - 1, boi_token_index=vocab - 3, eoi_token_index=vocab - 2,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.save_pretrained(str(path))
    return str(path)


def test_a_conditional_generation_checkpoint_runs_its_text_model_as_transformers_does(
        tmp_path: Path) -> None:
    """Gemma3ForConditionalGeneration (text prompts): greedy ids equal transformers' own
    class on the same folder, past the sliding window (prompts of 30-50 tokens, 24 more
    generated), with prefix caching and chunks; the vision weights are not read."""
    import torch
    import transformers

    from sluice import SamplingParams

    folder = _multimodal_folder(tmp_path / "g3")
    config = parse_hf_config(__import__("json").load(open(f"{folder}/config.json")))
    assert config.model_type == "gemma3_text" and config.gemma.global_rope_factor == 8.0
    assert config.sliding_window == 24 and config.tie_word_embeddings
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (n,), generator=generator).tolist() for n in (30, 41, 50)]
    want = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=24, min_new_tokens=24, eos_token_id=1 << 30,
                              pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    llm = LLM(model=folder, dtype="float32", max_num_batched_tokens=32, block_size=8,
              enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for _ in range(2):  # the second pass over cached prefixes
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == want
    llm.shutdown()
