"""Config parsing, dtype resolution and safetensors loading, including every way a folder can be
wrong: each error must name the thing that is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sluice.attention.torch_ref import TorchRefBackend
from sluice.model.hf_config import load_hf_config, parse_hf_config
from sluice.model.loader import load_model, resolve_dtype
from tests.model.test_models_match_hf import (
    PagedRunner,
    hf_logits,
    load_sluice_model,
    make_hf_model,
    make_prompts,
)


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> Path:
    model_dir = tmp_path_factory.mktemp("llama")
    make_hf_model("llama_llama3_rope", model_dir)
    return model_dir


@pytest.fixture
def llama_copy(saved_llama: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved_llama, tmp_path / "model"))


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def edit_tensors(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def load(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    config = load_hf_config(str(model_dir))
    return load_model(str(model_dir), config, dtype, torch.device("cpu"), TorchRefBackend())


def test_sharded_checkpoint_loads_and_matches_hf(tmp_path):
    hf_model = make_hf_model("qwen3", tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    model, config = load_sluice_model(tmp_path)
    prompts = make_prompts()
    got = PagedRunner(model, config, block_size=4).step(dict(enumerate(prompts)))
    for req, prompt in enumerate(prompts):
        torch.testing.assert_close(got[req], hf_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)


def test_missing_shard_is_named(tmp_path):
    make_hf_model("qwen3", tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / shard).unlink()
    with pytest.raises(ValueError, match=f"shard '{shard}'.*missing"):
        load(tmp_path)


def test_missing_folder_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=f"{missing}.*does not exist"):
        load_hf_config(str(missing))


def test_missing_config_json_is_named(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(ValueError, match=f"{llama_copy}.*config.json"):
        load_hf_config(str(llama_copy))


def test_folder_without_safetensors_is_named(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=f"{llama_copy}.*safetensors"):
        load(llama_copy)


def test_unsupported_architecture_lists_supported(llama_copy):
    edit_json(llama_copy / "config.json", architectures=["DeepseekV3ForCausalLM"])
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM") as excinfo:
        load_hf_config(str(llama_copy))
    for arch in ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM",
                 "MistralForCausalLM", "Phi3ForCausalLM"):
        assert arch in str(excinfo.value)


def test_wrong_shape_tensor_is_named_with_both_shapes(llama_copy):
    name = "model.layers.1.self_attn.k_proj.weight"  # [32, 64] in the tiny model
    edit_tensors(llama_copy, lambda t: t.update({name: t[name][:30]}))
    with pytest.raises(ValueError, match=rf"{name}.*\[32, 64\].*\[30, 64\]"):
        load(llama_copy)


def test_unexpected_tensor_is_named(llama_copy):
    name = "model.layers.0.mlp.extra_proj.weight"
    edit_tensors(llama_copy, lambda t: t.update({name: torch.zeros(2, 2)}))
    with pytest.raises(ValueError, match=f"{name}.*no destination"):
        load(llama_copy)


def test_missing_tensor_names_the_parameter_shard(llama_copy):
    edit_tensors(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.gate_up_proj.weight \(shard 1\)"):
        load(llama_copy)


def test_inv_freq_and_tied_lm_head_copies_are_skipped(tmp_path):
    hf_model = make_hf_model("llama_tied", tmp_path)
    embed = hf_model.model.embed_tokens.weight.detach()

    def add_extras(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        tensors["lm_head.weight"] = torch.zeros_like(embed)  # must not replace the embedding

    edit_tensors(tmp_path, add_extras)
    model = load(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, embed, atol=0, rtol=0)


def test_bfloat16_load_keeps_rope_table_float32_and_restores_default_dtype(saved_llama):
    model = load(saved_llama, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_resolve_dtype(saved_llama):
    config = load_hf_config(str(saved_llama))
    assert config.torch_dtype == "float32"
    bf16_config = parse_hf_config({**_raw(saved_llama), "dtype": "bfloat16"})
    assert resolve_dtype("auto", bf16_config) == torch.bfloat16
    old_style = {k: v for k, v in _raw(saved_llama).items() if k != "dtype"}
    assert resolve_dtype("auto", parse_hf_config({**old_style, "torch_dtype": "float16"})) == (
        torch.float16
    )
    assert resolve_dtype("auto", parse_hf_config(old_style)) == torch.float32
    assert resolve_dtype("float32", bf16_config) == torch.float32
    allowed = r"\['auto', 'float32', 'float16', 'bfloat16'\]"
    with pytest.raises(ValueError, match=rf"{allowed}, got 'fp8'"):
        resolve_dtype("fp8", config)


def _raw(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


TINY_RAW = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_config_defaults_follow_hf():
    config = parse_hf_config(TINY_RAW)
    assert (config.num_key_value_heads, config.head_dim) == (4, 16)
    assert (config.vocab_size, config.max_position_embeddings) == (32000, 2048)
    assert (config.rope_theta, config.rope_scaling) == (10000.0, None)
    assert (config.tie_word_embeddings, config.attention_bias, config.torch_dtype) == (
        False,
        False,
        None,
    )
    qwen3 = parse_hf_config(
        {**TINY_RAW, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    )
    assert qwen3.head_dim == 128  # Qwen3Config's default, not hidden / heads
    qwen2 = parse_hf_config(
        {**TINY_RAW, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    )
    assert qwen2.attention_bias


def test_transformers4_and_5_rope_styles_normalise_alike():
    llama3 = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    v4 = parse_hf_config(
        {**TINY_RAW, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **llama3}}
    )
    v5 = parse_hf_config(
        {**TINY_RAW, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3}}
    )
    assert v4.rope_theta == v5.rope_theta == 5e5
    assert v4.rope_scaling == v5.rope_scaling == {"rope_type": "llama3", **llama3}
    plain = parse_hf_config({**TINY_RAW, "rope_theta": 1e6, "rope_scaling": None})
    assert (plain.rope_theta, plain.rope_scaling) == (1e6, None)


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="'yarn'.*supported"):
        parse_hf_config({**TINY_RAW, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
