"""One tensor-parallel rank for tests/distributed/test_parallel_layers.py, run as
`python -m tests.distributed.tp_rank JSON` (model folders, rank, size, the test's store port,
an output folder): loads each model's shard, joins the gloo group, and runs one prompt through
a paged cache three ways: plain; with the down projection fused with SiLU-and-mul
(`act_down_op`, as install_fused_ops sets it on CUDA: the row-parallel all-reduce after a fused
op); and with the norms folded (LlamaModel.fold_norms: o_proj and down_proj accumulate into the
residual, RowParallelLinear.add_to). Writes each way's logits to OUT/rank{r}-{i}.safetensors."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from sluice.attention.kv_layout import allocate_kv_caches
from sluice.attention.metadata import AttentionMetadata
from sluice.attention.torch_ref import TorchRefBackend
from sluice.distributed.head_split import kv_heads_per_rank
from sluice.distributed.tp import TPGroup, init_tp_group
from sluice.model.attention import attention_layers, bind_kv_caches
from sluice.model.hf_config import load_hf_config
from sluice.model.layers import silu_and_mul
from sluice.model.loader import load_model
from sluice.model.models.llama import LlamaMLP

BLOCK_SIZE = 4


def prompt_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] float32: one prefill over blocks 1, 2, ... of the bound cache."""
    num_tokens = len(prompt)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    positions = torch.arange(num_tokens)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens, max_query_len=num_tokens, max_seq_len=num_tokens,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.arange(1, num_blocks + 1, dtype=torch.int32).view(1, -1),
        slot_mapping=positions + BLOCK_SIZE,
        query_start_loc_cpu=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens_cpu=torch.tensor([num_tokens], dtype=torch.int32),
    )
    with torch.no_grad():
        hidden = model(torch.tensor(prompt), positions, metadata)
        return model.compute_logits(hidden).contiguous()  # padded vocab: a view


def fused_act_down(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The torch equivalent of triton_gemm.silu_mul_linear."""
    return F.linear(silu_and_mul(gate_up), weight)


def run_model(model_dir: str, tp: TPGroup, prompt: list[int]) -> dict[str, torch.Tensor]:
    config = load_hf_config(model_dir)
    model = load_model(model_dir, config, torch.float32, torch.device("cpu"), TorchRefBackend(),
                       tp)
    caches = allocate_kv_caches(list(attention_layers(model)), 64, BLOCK_SIZE,
                                kv_heads_per_rank(config.num_key_value_heads, tp.size),
                                config.head_dim, torch.float32, torch.device("cpu"))
    bind_kv_caches(model, caches)
    out = {"plain": prompt_logits(model, prompt)}
    for module in model.modules():
        if isinstance(module, LlamaMLP):
            module.act_down_op = fused_act_down
    out["act_down"] = prompt_logits(model, prompt)
    folded = model.model.fold_norms(above_tokens=0)
    out["folded"] = prompt_logits(model, prompt)
    out["did_fold"] = torch.tensor(folded)
    return out


def main(model_dirs: list[str], rank: int, size: int, port: int, out_dir: str,
         prompt: list[int]) -> None:
    torch.set_num_threads(1)
    tp = init_tp_group(rank, size, port, torch.device("cpu"), timeout_s=60)
    for i, model_dir in enumerate(model_dirs):
        save_file(run_model(model_dir, tp, prompt), f"{out_dir}/rank{rank}-{i}.safetensors")
    # Leave together, then without tearing gloo down: a rank exiting while gloo's threads
    # still serve its peer aborts ("terminate called without an active exception": a joinable
    # std::thread destroyed), which the barrier made rare but not impossible (seen once in a
    # CI run of 1,174 tests). The results are on disk; os._exit skips the C++ destructors.
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(**json.loads(sys.argv[1]))
