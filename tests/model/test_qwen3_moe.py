"""Qwen3-MoE's config and checkpoint as sluice reads them (sluice.model.moe); its outputs against
transformers: tests/model/test_models_match_hf.py (logits through the paged cache, a dense layer
among sparse ones, unnormalized top-k), tests/engine/test_generate_matches_hf.py (greedy ids
with chunked prefill and prefix caching), tests/distributed/test_tp_engine.py (TP 2 with
preemption); the fused kernel: tests/kernels/test_triton_moe.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from sluice import LLM
from sluice.model.hf_config import parse_hf_config
from sluice.model.moe import FusedMoE, expert_tensor
from tests.engine.test_generate_matches_hf import hf_greedy
from tests.tiny_models import save_hf_model

BASE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def test_the_config_names_the_sparse_layers() -> None:
    moe = parse_hf_config({**BASE, "decoder_sparse_step": 2, "mlp_only_layers": [3]}).moe
    assert moe.dense_layers == (0, 2, 3)  # odd steps dense, and layer 3 by name
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob) == (
        8, 2, 32, False)
    # transformers 5 writes num_local_experts
    raw = {k: v for k, v in BASE.items() if k != "num_experts"} | {"num_local_experts": 6}
    assert parse_hf_config(raw).moe.num_experts == 6
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) must be <= num_experts "
                                         r"\(8\)"):
        parse_hf_config({**BASE, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="moe_intermediate_size must be a positive integer, "
                                         "got 0"):
        parse_hf_config({**BASE, "moe_intermediate_size": 0})


def test_expert_tensor_names() -> None:
    assert expert_tensor("model.layers.3.mlp.experts.17.up_proj.weight") == (
        "model.layers.3.mlp", 17, "up")
    assert expert_tensor("model.layers.3.mlp.gate.weight") is None
    assert expert_tensor("model.layers.3.mlp.experts.x.up_proj.weight") is None


def test_a_missing_or_misshapen_expert_is_an_error_naming_it(tmp_path: Path) -> None:
    folder = Path(save_hf_model(str(tmp_path / "moe"), "qwen3_moe"))
    llm = LLM(model=str(folder), dtype="float32", max_model_len=64)
    layer = llm.llm_engine.engine_core.executor.model_runner.model.model.layers[0]
    assert isinstance(layer.mlp, FusedMoE) and layer.mlp.w13.shape == (8, 64, 64)
    llm.shutdown()
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.0.mlp.experts.5.down_proj.weight"
    down = tensors.pop(name)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"expert weights not in the checkpoint: "
                                         r"model\.layers\.0\.mlp\.experts\.5\.down_proj\.weight"):
        LLM(model=str(folder), dtype="float32", max_model_len=64)
    tensors[name] = down[:, :16].contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"cannot load checkpoint tensor 'model\.layers\.0\.mlp"
                                         r"\.experts\.5\.down_proj\.weight'.*\[64, 32\].*"
                                         r"\[64, 16\]"):
        LLM(model=str(folder), dtype="float32", max_model_len=64)
    tensors[name] = down
    tensors["model.layers.1.mlp.experts.0.up_proj.weight"] = down.clone()  # layer 1 is dense
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp' is not a mixture-of-experts "
                                         "layer"):
        LLM(model=str(folder), dtype="float32", max_model_len=64)


def test_make_model_writes_a_qwen3_moe_checkpoint_transformers_reads(tmp_path: Path) -> None:
    """sluice make-model --arch qwen3_moe: 8 experts of 32, 2 a token, the last layer dense;
    greedy ids equal transformers' on it."""
    import random

    from sluice import SamplingParams
    from sluice.model.tiny import make_tiny_model

    folder = make_tiny_model(str(tmp_path / "m"), arch="qwen3_moe")
    config = parse_hf_config(__import__("json").loads((Path(folder) / "config.json")
                                                      .read_text()))
    assert config.moe.dense_layers == (1,) and config.moe.num_experts == 8
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 600) for _ in range(n)] for n in (4, 30)]
    llm = LLM(model=folder, dtype="float32", max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    for prompt, ids in zip(prompts, got):
        assert hf_greedy(folder, tuple(prompt), 10) == ids
