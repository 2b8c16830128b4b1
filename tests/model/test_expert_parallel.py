"""Expert parallelism in one process (sluice.model.moe, TPGroup.expert_parallel): each of two
ranks built as rank r of 2 holds E / 2 whole experts of every MoE layer, read from a sharded
checkpoint (the second half's experts in a shard of their own), and never reads the other
rank's; the two ranks' outputs of a layer sum to the
whole layer's, for routing that sends tokens to both ranks' experts. The engine at TP 2 + EP
against transformers: tests/distributed/test_tp_engine.py; FP8 experts: tests/model/
test_fp8_moe.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sluice.attention.torch_ref import TorchRefBackend
from sluice.distributed.tp import SINGLE_RANK, TPGroup
from sluice.engine.arg_utils import EngineArgs
from sluice.model.hf_config import load_hf_config
from sluice.model.loader import load_model
from sluice.model.moe import FusedMoE
from sluice.model.weights import CheckpointTensor
from tests.tiny_models import save_hf_model


def expert_of(name: str) -> int | None:
    """'...experts.5.up_proj.weight' (Mixtral's '...experts.5.w3.weight') -> 5."""
    head, sep, tail = name.partition(".experts.")
    return int(tail.split(".")[0]) if sep else None


def shard_by_expert_half(folder: str, num_experts: int) -> None:
    """Rewrite the folder's model.safetensors as two shards and an index, the experts of the
    second half (rank 1's) alone in the second shard."""
    path = Path(folder) / "model.safetensors"
    tensors = load_file(str(path))
    path.unlink()
    shards: dict[str, dict[str, torch.Tensor]] = {"model-00001-of-00002.safetensors": {},
                                                  "model-00002-of-00002.safetensors": {}}
    for name, tensor in tensors.items():
        expert = expert_of(name)
        second = expert is not None and expert >= num_experts // 2
        shards[f"model-0000{1 + second}-of-00002.safetensors"][name] = tensor
    weight_map = {}
    for shard, part in shards.items():
        save_file(part, str(Path(folder) / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (Path(folder) / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


def moe_layers(model: torch.nn.Module) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def load(folder: str, tp: TPGroup) -> torch.nn.Module:
    return load_model(folder, load_hf_config(folder), torch.float32, torch.device("cpu"),
                      TorchRefBackend(), tp)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_each_rank_holds_its_whole_experts_and_the_ranks_sum_to_the_layer(
        arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = save_hf_model(str(tmp_path / arch), arch)
    shard_by_expert_half(folder, load_hf_config(folder).moe.num_experts)
    whole = moe_layers(load(folder, SINGLE_RANK))
    read: list[str] = []
    narrow = CheckpointTensor.narrow

    def reading(self: CheckpointTensor, dim: int, start: int, length: int) -> torch.Tensor:
        read.append(self._name)
        return narrow(self, dim, start, length)

    monkeypatch.setattr(CheckpointTensor, "narrow", reading)
    ranks = []
    for rank in range(2):
        read.clear()
        ranks.append(moe_layers(load(folder, TPGroup(rank=rank, size=2, expert_parallel=True))))
        experts = {expert_of(name) for name in read if expert_of(name) is not None}
        num_experts = whole[0].num_experts
        assert experts == set(range(rank * num_experts // 2, (rank + 1) * num_experts // 2))
    torch.manual_seed(0)
    x = torch.randn(12, whole[0].w13.shape[2])
    for layer, *shares in zip(whole, *ranks):
        half = layer.num_experts // 2
        ids = layer.route_op(layer.gate(x), layer.top_k, layer.renormalize)[1]
        assert layer.top_k >= 2 and len({tuple(sorted(t)) for t in ids.tolist()}) > 1
        assert (ids < half).any() and (ids >= half).any()  # both ranks' experts are used
        for rank, share in enumerate(shares):
            assert share.w13.shape == (half, *layer.w13.shape[1:])  # no intermediate slicing
            assert torch.equal(share.w13, layer.w13[rank * half:(rank + 1) * half])
            assert torch.equal(share.w2, layer.w2[rank * half:(rank + 1) * half])
            assert share.expert_map.tolist() == [
                e - rank * half if rank * half <= e < (rank + 1) * half else -1
                for e in range(layer.num_experts)]
        partial = sum(share.rank_output(x) for share in shares)
        torch.testing.assert_close(partial, layer.rank_output(x), rtol=1e-5, atol=1e-6)


def test_experts_the_ranks_cannot_share_evenly_are_refused_naming_both_numbers(
        tmp_path: Path) -> None:
    """Mixtral's 6 experts over 4 ranks; the same model without EP splits its experts'
    intermediate dimension as before."""
    folder = save_hf_model(str(tmp_path / "mixtral"), "mixtral")
    args = EngineArgs(model=folder, tensor_parallel_size=4, enable_expert_parallel=True,
                      device="cpu")
    with pytest.raises(ValueError, match=r"enable_expert_parallel: tensor_parallel_size \(4\) "
                                         r"must divide the model's num_experts \(6\)"):
        args.create_engine_config()
    config = EngineArgs(model=folder, tensor_parallel_size=4, device="cpu").create_engine_config()
    assert not config.parallel_config.enable_expert_parallel


def test_expert_parallel_is_reported_and_ignored_with_a_note_for_a_dense_model(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's choice: the flag is ignored where there are no experts (and at TP 1)."""
    dense = save_hf_model(str(tmp_path / "qwen3"), "qwen3")
    moe = save_hf_model(str(tmp_path / "qwen3_moe"), "qwen3_moe")
    with caplog.at_level(logging.INFO, logger="sluice"):
        config = EngineArgs(model=dense, tensor_parallel_size=2, enable_expert_parallel=True,
                            device="cpu").create_engine_config()
        assert not config.parallel_config.enable_expert_parallel
        assert "enable_expert_parallel ignored: the model has no experts" in caplog.text
        config = EngineArgs(model=moe, enable_expert_parallel=True,
                            device="cpu").create_engine_config()
        assert not config.parallel_config.enable_expert_parallel
        assert "enable_expert_parallel ignored: tensor_parallel_size is 1" in caplog.text
        config = EngineArgs(model=moe, tensor_parallel_size=2, enable_expert_parallel=True,
                            device="cpu").create_engine_config()
    assert config.parallel_config.enable_expert_parallel
    assert ("expert parallelism: 8 experts a layer over 2 ranks, 4 whole experts each"
            in caplog.text)
