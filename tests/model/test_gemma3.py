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
    ({"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
     "full_attention rope_type 'linear' is not supported"),
    ({"hidden_activation": "gelu"}, "hidden_activation must be 'gelu_pytorch_tanh', got 'gelu'"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is not supported"),
    ({"layer_types": ["full_attention"] * 5}, "for each of the 6 layers"),
])
def test_what_is_not_read_is_refused_naming_it(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_hf_config({**BASE, **fields})


def test_the_window_no_longer_holds_max_model_len(tmp_path: Path) -> None:
    """Up to max_position_embeddings, as any model; the global layers keep every block, so
    nothing is freed behind the window (tests/engine/test_sliding_window.py)."""
    folder = save_hf_model(str(tmp_path / "g"), "gemma3", sliding_window=96)
    llm = LLM(model=folder, dtype="float32")
    assert llm.llm_engine.scheduler_config.max_model_len == 1024  # max_position_embeddings
    assert llm.llm_engine.kv_cache_manager.sliding_window is None
    llm.shutdown()
