"""Mistral and Phi-3 (sluice/model/models/mistral.py, phi3.py): what their configs add to the
Llama decoder. Greedy ids against transformers with the engine's optimisations:
tests/engine/test_generate_matches_hf.py; at TP 2: tests/distributed/test_tp_engine.py; logits
through the paged cache: tests/model/test_models_match_hf.py.

- A sliding window no longer holds max_model_len: up to max_position_embeddings, as for any
  model, and greedy ids equal transformers' past the window (the window's tests:
  tests/engine/test_sliding_window.py, tests/kernels/test_sliding_window_attention.py).
- Phi-3's fused weights must have the rows the config gives; partial RoPE is refused."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from sluice import LLM, SamplingParams
from sluice.model.hf_config import parse_hf_config
from tests.engine.test_generate_matches_hf import hf_greedy as reference_greedy
from tests.tiny_models import save_hf_model


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def hf_greedy(folder: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return [reference_greedy(folder, tuple(p), max_tokens) for p in prompts]


@pytest.mark.parametrize("arch", ["mistral", "phi3"])
def test_a_sliding_window_no_longer_holds_max_model_len(arch: str, tmp_path: Path) -> None:
    folder = save_hf_model(str(tmp_path / arch), arch, sliding_window=48)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 600) for _ in range(n)] for n in (5, 20, 60)]
    llm = LLM(model=folder, dtype="float32", block_size=8, max_num_batched_tokens=16,
              max_model_len=128)
    assert llm.llm_engine.scheduler_config.max_model_len == 128
    assert greedy(llm, prompts, 12) == hf_greedy(folder, prompts, 12)  # 72 > 48 tokens
    llm.shutdown()
    llm = LLM(model=folder, dtype="float32")
    assert llm.llm_engine.scheduler_config.max_model_len == 1024  # max_position_embeddings
    llm.shutdown()
    with pytest.raises(ValueError, match=r"max_model_len \(2048\) must be <= the model's "
                                         r"max_position_embeddings \(1024\)"):
        LLM(model=folder, dtype="float32", max_model_len=2048)


def test_mistral_s_window_defaults_as_transformers_and_null_means_none() -> None:
    base = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    assert parse_hf_config(base).sliding_window == 4096  # MistralConfig's default
    assert parse_hf_config({**base, "sliding_window": None}).sliding_window is None
    assert parse_hf_config({**base, "sliding_window": 8192}).sliding_window == 8192
    with pytest.raises(ValueError, match="sliding_window must be a positive integer or null, "
                                         "got 0"):
        parse_hf_config({**base, "sliding_window": 0})
    # Qwen2 / Qwen3 configs carry a window they do not use (use_sliding_window false)
    qwen = {**base, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "sliding_window": 4096, "use_sliding_window": False}
    assert parse_hf_config(qwen).sliding_window is None


def test_phi3_s_fused_weights_must_fit_the_config(tmp_path: Path) -> None:
    folder = Path(save_hf_model(str(tmp_path / "phi3"), "phi3"))
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16].contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.qkv_proj\.weight' has "
                                         r"112 rows; the config's heads and sizes make 128"):
        LLM(model=str(folder), dtype="float32")


def test_partial_rotary_embeddings_are_refused(tmp_path: Path) -> None:
    folder = Path(save_hf_model(str(tmp_path / "phi3"), "phi3"))
    config = json.loads((folder / "config.json").read_text())
    config["partial_rotary_factor"] = 0.75  # Phi-3.5 / Phi-4-mini
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.75 is not supported"):
        LLM(model=str(folder), dtype="float32")
