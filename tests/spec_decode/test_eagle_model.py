"""The EAGLE-1 head computes what Hugging Face's own decoder layer computes on the same weights,
through sluice's paged KV cache, and loads every checkpoint layout EAGLE heads come in.

Reference: fc(cat([embed, target_hidden])) through transformers' LlamaDecoderLayer /
Qwen2DecoderLayer / Qwen3DecoderLayer with input_layernorm replaced by Identity, causal attention
over the whole sequence, rotary from transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from sluice.attention.metadata import AttentionMetadata
from sluice.attention.torch_ref import TorchRefBackend
from sluice.model.attention import bind_kv_caches
from sluice.model.hf_config import HFModelConfig, load_hf_config
from sluice.model.loader import load_model
from sluice.spec_decode.eagle_model import EagleHead, load_eagle_head, make_tiny_eagle

CPU = torch.device("cpu")
BLOCK_SIZE = 4
SEQ_LEN = 13
HF_LAYERS = {
    "llama": (modeling_llama.LlamaDecoderLayer, modeling_llama.LlamaRotaryEmbedding),
    "qwen2": (modeling_qwen2.Qwen2DecoderLayer, modeling_qwen2.Qwen2RotaryEmbedding),
    "qwen3": (modeling_qwen3.Qwen3DecoderLayer, modeling_qwen3.Qwen3RotaryEmbedding),
}


@pytest.fixture(scope="module")
def targets(hf_model_dirs: dict[str, str]) -> dict[str, tuple[str, HFModelConfig, nn.Module]]:
    loaded = {}
    for arch, model_dir in hf_model_dirs.items():
        config = load_hf_config(model_dir)
        model = load_model(model_dir, config, torch.float32, CPU, TorchRefBackend())
        loaded[arch] = (model_dir, config, model)
    return loaded


def load_head(eagle_dir: str | Path, target: tuple[str, HFModelConfig, nn.Module]) -> EagleHead:
    _, config, model = target
    return load_eagle_head(str(eagle_dir), model, config, torch.float32, CPU, TorchRefBackend())


def hf_reference(
    eagle_dir: str, embed_weight: torch.Tensor, input_ids: torch.Tensor, hidden: torch.Tensor
) -> torch.Tensor:
    """The head over a whole sequence, by transformers: ids [T], hidden [T, H] -> [T, H]."""
    config = transformers.AutoConfig.from_pretrained(eagle_dir)
    config._attn_implementation = "eager"
    tensors = load_file(str(Path(eagle_dir) / "model.safetensors"))
    layer_class, rotary_class = HF_LAYERS[config.model_type]
    layer = layer_class(config, layer_idx=0).eval()
    layer.input_layernorm = nn.Identity()
    prefix = "layers.0."
    layer.load_state_dict(
        {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    )
    x = F.linear(torch.cat([embed_weight[input_ids], hidden], -1), tensors["fc.weight"],
                 tensors.get("fc.bias"))[None]  # [1, T, hidden]
    positions = torch.arange(len(input_ids))[None]
    mask = torch.full((len(input_ids),) * 2, float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out = layer(x, attention_mask=mask, position_ids=positions,
                    position_embeddings=rotary_class(config)(x, positions))
    return (out[0] if isinstance(out, tuple) else out)[0]


def metadata(block_table: list[int], start: int, end: int) -> AttentionMetadata:
    """One request computing positions [start, end) over a context of `end` tokens."""
    slots = [block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
    query_start_loc = torch.tensor([0, end - start], dtype=torch.int32)
    seq_lens = torch.tensor([end], dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=end - start, max_query_len=end - start, max_seq_len=end,
        query_start_loc=query_start_loc, seq_lens=seq_lens,
        block_tables=torch.tensor([block_table], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens,
    )


def run_paged(head: EagleHead, input_ids: torch.Tensor, hidden: torch.Tensor,
              chunks: list[tuple[int, int]]) -> torch.Tensor:
    """The head over `chunks` ([start, end) steps) on a fresh cache with scattered blocks."""
    cache_shape = (2, 8, BLOCK_SIZE, head.config.num_key_value_heads, head.config.head_dim)
    bind_kv_caches(head, {"layers.0.self_attn.attn": torch.zeros(cache_shape)})
    block_table = [5, 2, 7, 0]
    outputs = []
    with torch.no_grad():
        for start, end in chunks:
            positions = torch.arange(start, end)
            outputs.append(head(input_ids[start:end], hidden[start:end], positions,
                                metadata(block_table, start, end)))
    return torch.cat(outputs)


@pytest.mark.parametrize(
    "arch, with_embeddings, fc_bias",
    [("qwen3", False, True), ("llama", True, False), ("qwen2", False, True)],
)
def test_head_matches_hf_decoder_layer(targets, tmp_path, arch, with_embeddings, fc_bias):
    eagle_dir = make_tiny_eagle(targets[arch][0], str(tmp_path), seed=1,
                                with_embeddings=with_embeddings, fc_bias=fc_bias)
    head = load_head(eagle_dir, targets[arch])
    assert head.shares_embed_tokens != with_embeddings
    assert (head.fc.bias is not None) == fc_bias
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, head.config.vocab_size, (SEQ_LEN,), generator=generator)
    hidden = torch.randn(SEQ_LEN, head.config.hidden_size, generator=generator)
    expected = hf_reference(eagle_dir, head.embed_tokens.weight, input_ids, hidden)
    assert expected.abs().max() < 50  # activations stay sane

    prefill = run_paged(head, input_ids, hidden, [(0, SEQ_LEN)])
    torch.testing.assert_close(prefill, expected, atol=1e-5, rtol=1e-5)
    # Prefill 7 tokens (ending mid-block), then one token per step.
    steps = [(0, 7)] + [(p, p + 1) for p in range(7, SEQ_LEN)]
    decoded = run_paged(head, input_ids, hidden, steps)
    torch.testing.assert_close(decoded, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture
def llama_eagle(targets, tmp_path) -> Path:
    return Path(make_tiny_eagle(targets["llama"][0], str(tmp_path / "eagle"), seed=2))


def rewrite_tensors(eagle_dir: Path, edit) -> None:
    """Replace the head's tensors by `edit(tensors)`."""
    path = eagle_dir / "model.safetensors"
    save_file(edit(load_file(str(path))), str(path), metadata={"format": "pt"})


def test_head_without_embeddings_shares_target_table(targets, llama_eagle):
    head = load_head(llama_eagle, targets["llama"])
    target_table = targets["llama"][2].model.embed_tokens.weight
    assert head.embed_tokens.weight is target_table
    assert head.embed_tokens.weight.data_ptr() == target_table.data_ptr()


def test_head_with_embeddings_loads_its_own_table(targets, tmp_path):
    eagle_dir = make_tiny_eagle(targets["llama"][0], str(tmp_path), with_embeddings=True)
    head = load_head(eagle_dir, targets["llama"])
    checkpoint = load_file(str(Path(eagle_dir) / "model.safetensors"))
    assert not head.shares_embed_tokens
    assert torch.equal(head.embed_tokens.weight, checkpoint["embed_tokens.weight"])
    target_table = targets["llama"][2].model.embed_tokens.weight
    assert head.embed_tokens.weight.data_ptr() != target_table.data_ptr()


def test_model_prefix_and_lm_head_are_accepted(targets, llama_eagle, tmp_path):
    plain = load_head(llama_eagle, targets["llama"]).state_dict()
    lm_head = torch.randn(targets["llama"][1].vocab_size, 64)
    rewrite_tensors(llama_eagle, lambda t: {"lm_head.weight": lm_head}
                    | {f"model.{k}": v for k, v in t.items()})
    prefixed = load_head(llama_eagle, targets["llama"]).state_dict()
    assert plain.keys() == prefixed.keys()
    for name, tensor in plain.items():
        assert torch.equal(prefixed[name], tensor), name


def test_fc_bias_follows_checkpoint(targets, tmp_path):
    for fc_bias in (True, False):
        eagle_dir = make_tiny_eagle(targets["qwen3"][0], str(tmp_path / str(fc_bias)),
                                    fc_bias=fc_bias)
        head = load_head(eagle_dir, targets["qwen3"])
        checkpoint = load_file(str(Path(eagle_dir) / "model.safetensors"))
        assert torch.equal(head.fc.weight, checkpoint["fc.weight"])
        if fc_bias:
            assert torch.equal(head.fc.bias, checkpoint["fc.bias"])
        else:
            assert head.fc.bias is None and "fc.bias" not in checkpoint


def test_sharded_checkpoint_loads(targets, llama_eagle):
    plain = load_head(llama_eagle, targets["llama"]).state_dict()
    tensors = load_file(str(llama_eagle / "model.safetensors"))
    (llama_eagle / "model.safetensors").unlink()
    weight_map = {}
    for i, shard in enumerate([["fc.weight", "fc.bias"], [n for n in tensors if "layers" in n]]):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in shard}, str(llama_eagle / name))
        weight_map |= dict.fromkeys(shard, name)
    index = json.dumps({"weight_map": weight_map})
    (llama_eagle / "model.safetensors.index.json").write_text(index)
    sharded = load_head(llama_eagle, targets["llama"]).state_dict()
    assert all(torch.equal(sharded[name], tensor) for name, tensor in plain.items())


def test_hidden_size_mismatch_names_both_values(targets, llama_eagle):
    config_path = llama_eagle / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"hidden_size": 32}))
    with pytest.raises(ValueError, match=r"hidden_size \(32\) must equal the target's \(64\)"):
        load_head(llama_eagle, targets["llama"])


def test_more_than_one_layer_is_refused(targets, llama_eagle):
    config_path = llama_eagle / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text())
                                      | {"num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="num_hidden_layers 1, .* has 2"):
        load_head(llama_eagle, targets["llama"])


def test_missing_tensor_is_named(targets, llama_eagle):
    missing = "layers.0.mlp.down_proj.weight"
    rewrite_tensors(llama_eagle, lambda t: {k: v for k, v in t.items() if k != missing})
    with pytest.raises(ValueError, match="not in the checkpoint: layers.0.mlp.down_proj.weight"):
        load_head(llama_eagle, targets["llama"])


def test_input_layernorm_is_not_an_eagle1_tensor(targets, llama_eagle):
    rewrite_tensors(llama_eagle, lambda t: t | {"layers.0.input_layernorm.weight": torch.ones(64)})
    with pytest.raises(ValueError, match="'layers.0.input_layernorm.weight' has no destination"):
        load_head(llama_eagle, targets["llama"])


def test_pickled_checkpoint_is_refused(targets, llama_eagle):
    (llama_eagle / "model.safetensors").unlink()
    (llama_eagle / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="only pytorch_model.bin: safetensors weights are requ"):
        load_head(llama_eagle, targets["llama"])


def test_rotary_table_covers_target_positions(targets, llama_eagle):
    # EAGLE-LLaMA3 heads say 2048 positions for an 8192-position target.
    config_path = llama_eagle / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text())
                                      | {"max_position_embeddings": 16}))
    head = load_head(llama_eagle, targets["llama"])
    assert head.config.max_position_embeddings == targets["llama"][1].max_position_embeddings
    assert head.layers[0].self_attn.rotary_emb.cos_sin_cache.shape[0] == 1024
