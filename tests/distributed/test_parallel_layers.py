"""The parallel layers: every rank loads exactly its share of each checkpoint tensor (query heads
split, KV heads split or replicated, the MLP's intermediate features split, the vocabulary split
and padded), and N ranks in a gloo group compute the logits of one rank, on the plain path, with
the down projection fused with SiLU-and-mul, and with the norms folded (the all-reduce inside
the residual accumulate), all ranks bit-equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import sluice
from sluice.attention.torch_ref import TorchRefBackend
from sluice.distributed.tp import SINGLE_RANK, TPGroup, host_store
from sluice.model.hf_config import load_hf_config
from sluice.model.loader import load_model
from tests.distributed.tp_rank import run_model

PROMPT = [5, 9, 200, 17, 33, 600, 2, 71, 71, 71, 3, 450, 12, 98]
MODELS = ("qwen3", "llama", "qwen2", "qwen2_mqa")


def load(model_dir: str, tp: TPGroup) -> torch.nn.Module:
    config = load_hf_config(model_dir)
    return load_model(model_dir, config, torch.float32, torch.device("cpu"), TorchRefBackend(),
                      tp)


@pytest.mark.parametrize("model", ["qwen3", "qwen2_mqa"])
@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_holds_its_share_of_every_weight(tp_model_dirs: dict[str, str], model: str,
                                                   size: int) -> None:
    model_dir = tp_model_dirs[model]
    config = load_hf_config(model_dir)
    full = load(model_dir, SINGLE_RANK)
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q_size, kv_size = heads * dim, kv_heads * dim
    vocab, rows = config.vocab_size, -(-config.vocab_size // size)
    full_attn, full_mlp = full.model.layers[1].self_attn, full.model.layers[1].mlp
    full_qkv = full_attn.qkv_proj.weight
    q_rows, kv_rows = q_size // size, max(1, kv_heads // size) * dim
    for rank in range(size):
        shard = load(model_dir, TPGroup(rank=rank, size=size))
        attn, mlp = shard.model.layers[1].self_attn, shard.model.layers[1].mlp
        assert (attn.num_heads, attn.num_kv_heads) == (heads // size, max(1, kv_heads // size))
        kv_head = rank * kv_heads // size  # the KV head this rank's query heads read
        qkv = attn.qkv_proj.weight
        assert torch.equal(qkv[:q_rows], full_qkv[rank * q_rows:(rank + 1) * q_rows])
        for part in (0, 1):  # k, then v
            start = q_size + part * kv_size + kv_head * dim
            assert torch.equal(qkv[q_rows + part * kv_rows:q_rows + (part + 1) * kv_rows],
                               full_qkv[start:start + kv_rows])
        if attn.qkv_proj.bias is not None:
            start = q_size + kv_head * dim
            assert torch.equal(attn.qkv_proj.bias[q_rows:q_rows + kv_rows],
                               full_attn.qkv_proj.bias[start:start + kv_rows])
        q_cols = slice(rank * q_rows, (rank + 1) * q_rows)
        assert torch.equal(attn.o_proj.weight, full_attn.o_proj.weight[:, q_cols])
        inter = config.intermediate_size // size
        gate_up = mlp.gate_up_proj.weight
        for part in (0, 1):  # gate, then up
            start = part * config.intermediate_size + rank * inter
            assert torch.equal(gate_up[part * inter:(part + 1) * inter],
                               full_mlp.gate_up_proj.weight[start:start + inter])
        assert torch.equal(mlp.down_proj.weight,
                           full_mlp.down_proj.weight[:, rank * inter:(rank + 1) * inter])
        embed = shard.model.embed_tokens.weight
        held = min(rows, vocab - rank * rows)
        assert embed.shape[0] == rows
        assert torch.equal(embed[:held], full.model.embed_tokens.weight[rank * rows:][:held])
        assert not embed[held:].any()  # the last rank's padding rows
        if config.tie_word_embeddings:
            assert shard.lm_head.weight is embed
        else:
            assert torch.equal(shard.lm_head.weight[:held],
                               full.lm_head.weight[rank * rows:][:held])
        assert torch.equal(shard.model.norm.weight, full.model.norm.weight)  # replicated


def test_a_size_that_does_not_divide_the_heads_is_a_value_error(qwen3_dir: str) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide the model's "
                                         r"num_attention_heads \(4\)"):
        load(qwen3_dir, TPGroup(rank=0, size=3))


def reference_logits(model_dir: str) -> dict[str, torch.Tensor]:
    return run_model(model_dir, SINGLE_RANK, PROMPT)


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_compute_the_logits_of_one_rank_on_every_path(
        tp_model_dirs: dict[str, str], tmp_path: pytest.TempPathFactory, size: int) -> None:
    dirs = [tp_model_dirs[m] for m in MODELS]
    store = host_store(size)
    root = os.path.dirname(os.path.dirname(os.path.abspath(sluice.__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    ranks = [subprocess.Popen(
        [sys.executable, "-m", "tests.distributed.tp_rank", json.dumps(dict(
            model_dirs=dirs, rank=rank, size=size, port=store.port, out_dir=str(tmp_path),
            prompt=PROMPT))], env=env) for rank in range(size)]
    try:
        for rank in ranks:
            assert rank.wait(120) == 0
    finally:
        for rank in ranks:
            rank.kill()
    for i, model in enumerate(MODELS):
        want = reference_logits(dirs[i])["plain"]
        outputs = [load_file(str(tmp_path / f"rank{r}-{i}.safetensors")) for r in range(size)]
        for path in ("plain", "act_down", "folded"):
            torch.testing.assert_close(outputs[0][path], want, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, p=path, n=model: f"{n} {p}: {m}")
            for rank in range(1, size):  # the same bits on every rank: they sample alike
                assert torch.equal(outputs[rank][path], outputs[0][path]), (model, path, rank)
        # Norms fold only without biases (Qwen2's q/k/v have one).
        assert bool(outputs[0]["did_fold"]) == (not model.startswith("qwen2")), model
