"""FP8 mixture-of-experts checkpoints (sluice.model.moe): Qwen3-MoE, Qwen2-MoE and Mixtral
folders quantized per 16 x 32 block (quant_method "fp8", `weight_scale_inv`) and per output
channel (compressed-tensors, `weight_scale`), named as the published checkpoints name their
tensors. With FP8 weights kept (SLUICE_FP8_WEIGHTS=keep, a GPU's default) every expert layer
holds float8 `w13`/`w2` and their scales and computes through the CPU's fp8_experts_op, which
dequantizes as the load-time path does: the same products, the same greedy ids as the model
dequantized at load, and as transformers' on the dequantized weights. A tensor-parallel rank
loads its slice of every expert with its scales; a slice that would split a scale block is
refused by name, and under expert parallelism (whole experts a rank) kept FP8. The kernels:
tests/kernels/test_triton_moe.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sluice import LLM
from sluice.attention.backend import get_attention_backend
from sluice.distributed.tp import TPGroup
from sluice.errors import EngineDeadError
from sluice.model.hf_config import load_hf_config
from sluice.model.loader import load_model
from sluice.model.moe import FusedMoE
from sluice.model.quantization import quantize_folder
from sluice.model.tiny import make_tiny_model
from tests.model.test_fp8_checkpoints import (
    BASE,
    PREEMPTING,
    _loaded,
    _per_tensor_static_folder,
    assert_tp2_greedy,
    dequantized_folder,
    greedy,
    hf_greedy,
    transformers_float32,
)
from tests.tiny_models import save_hf_model

# 32 columns: the dense FP8 layers' K step (Linear.fp8_fits), so the attention and Qwen2-MoE's
# shared expert keep FP8 weights too
BLOCK = (16, 32)


def fp8_moe_folder(tmp_path: Path, arch: str, kind: str, block: tuple[int, int] = BLOCK) -> str:
    """qwen3_moe: sluice make-model's folder (8 experts of 32, the last layer dense);
    qwen2_moe, mixtral: transformers' tiny model (tests.tiny_models) quantized by
    quantize_folder (benchmarks/tools/quantize_folder.py)."""
    if arch == "qwen3_moe":
        return make_tiny_model(str(tmp_path / "fp8"), arch=arch, quantize=f"fp8-{kind}",
                               block_size=block)
    source = save_hf_model(str(tmp_path / "float"), arch)
    quantize_folder(source, str(tmp_path / "fp8"), f"fp8-{kind}", block)
    return str(tmp_path / "fp8")


def tensors_of(folder: str) -> dict[str, torch.Tensor]:
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.parametrize("kind", ["block", "channel"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_written_moe_checkpoints_are_named_as_the_published_ones(arch: str, kind: str,
                                                                 tmp_path: Path) -> None:
    """Qwen3-30B-A3B-FP8: `mlp.experts.{e}.{gate,up,down}_proj.weight` float8_e4m3fn with a
    float32 `weight_scale_inv` per 128 x 128 block (16 x 32 here), the router `mlp.gate` in
    the checkpoint dtype; RedHat's FP8-dynamic: `weight_scale` [rows, 1] and the router named
    in `ignore`; Mixtral's `block_sparse_moe.experts.{e}.w1/w2/w3`; Qwen2-MoE's shared expert
    FP8 as a dense MLP, its gate not."""
    folder = fp8_moe_folder(tmp_path, arch, kind)
    tensors = tensors_of(folder)
    config = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]
    scale = "weight_scale_inv" if kind == "block" else "weight_scale"
    if arch == "mixtral":
        experts, router, inter = "model.layers.0.block_sparse_moe.experts.3", (
            "model.layers.0.block_sparse_moe.gate"), 128
        gate, down = f"{experts}.w1", f"{experts}.w2"
    else:
        experts, router, inter = "model.layers.0.mlp.experts.3", "model.layers.0.mlp.gate", 32
        gate, down = f"{experts}.gate_proj", f"{experts}.down_proj"
    assert tensors[f"{gate}.weight"].dtype == torch.float8_e4m3fn
    assert tensors[f"{gate}.weight"].shape == (inter, 64)
    assert tensors[f"{gate}.{scale}"].dtype == torch.float32
    assert tensors[f"{gate}.{scale}"].shape == ((inter // 16, 2) if kind == "block"
                                                else (inter, 1))
    assert tensors[f"{down}.{scale}"].shape == ((4, inter // 32) if kind == "block" else (64, 1))
    assert tensors[f"{router}.weight"].dtype == torch.float32
    assert not any(name.startswith(router + ".weight_scale") for name in tensors)
    if arch == "qwen2_moe":
        assert tensors["model.layers.0.mlp.shared_expert.up_proj.weight"].dtype == (
            torch.float8_e4m3fn)
        assert tensors["model.layers.0.mlp.shared_expert_gate.weight"].dtype == torch.float32
    if kind == "block":
        assert config["quant_method"] == "fp8" and config["weight_block_size"] == list(BLOCK)
    else:
        assert config["quant_method"] == "compressed-tensors"
        routers = [p for p in config["ignore"] if p.startswith("re:")]
        assert routers and all(re.match(p[3:], router) for p in routers[:1])
        assert not any(re.match(p[3:], gate) for p in routers)


def test_a_sharded_folder_is_quantized_shard_by_shard(tmp_path: Path) -> None:
    """quantize_folder on a folder of two shards and an index (as make_big_folder.py writes
    Qwen3-30B-A3B): each shard's experts quantized in place, every scale in the new index
    beside its weight, the routers of both shards in `ignore`; the same greedy ids as the
    folder quantized whole."""
    source = Path(save_hf_model(str(tmp_path / "float"), "mixtral"))
    whole = str(tmp_path / "whole")
    quantize_folder(str(source), whole, "fp8-channel")
    tensors = tensors_of(str(source))
    (source / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for name, tensor in tensors.items():
        # the last shard without a router: its config alone would miss them
        shard = "model-00002-of-00002.safetensors" if name.startswith(
            ("lm_head", "model.norm")) else "model-00001-of-00002.safetensors"
        shards[shard][name] = tensor
    weight_map = {}
    for shard, part in shards.items():
        save_file(part, str(source / shard), metadata={"format": "pt"})
        weight_map.update((name, shard) for name in part)
    (source / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    sharded = tmp_path / "sharded"
    quantize_folder(str(source), str(sharded), "fp8-channel")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    down = "model.layers.1.block_sparse_moe.experts.5.w2"
    assert index[f"{down}.weight_scale"] == index[f"{down}.weight"] == (
        "model-00001-of-00002.safetensors")
    assert index["lm_head.weight"] == "model-00002-of-00002.safetensors"
    config = json.loads((sharded / "config.json").read_text())["quantization_config"]
    assert config == json.loads((Path(whole) / "config.json").read_text())[
        "quantization_config"]
    assert greedy(LLM(model=str(sharded), **BASE)) == greedy(LLM(model=whole, **BASE))


def fp8_experts_of(model: torch.nn.Module) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("kind", ["block", "channel"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_fp8_experts_give_the_dequantized_model_s_greedy_ids(
        arch: str, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every expert layer keeps FP8 w13 [E, 2I, H] / w2 [E, H, I] and float32 scales (per
    block: [E, 2 I / 16, H / 32] and [E, H / 16, I / 32]; per row: [E, 2I], [E, H]); its
    product equals the dequantized layer's exactly; greedy ids equal the model dequantized at
    load, with preemption, and transformers' on the dequantized weights."""
    folder = fp8_moe_folder(tmp_path, arch, kind)
    model = _loaded(folder, keep=True)
    dequantized = _loaded(folder, keep=False)
    layers = fp8_experts_of(model)
    assert layers and all(m.is_fp8 and m.w13.dtype == m.w2.dtype == torch.float8_e4m3fn
                          for m in layers)
    moe = layers[0]
    e, two_inter, hidden = moe.w13.shape
    inter = two_inter // 2
    if kind == "block":
        assert moe.w13_scale.shape == (e, 2 * inter // 16, hidden // 32)
        assert moe.w2_scale.shape == (e, hidden // 16, inter // 32)
    else:
        assert moe.w13_scale.shape == (e, two_inter) and moe.w2_scale.shape == (e, hidden)
    assert not moe.gate.is_fp8  # the router stays in the checkpoint dtype
    if arch == "qwen2_moe":  # the shared expert is a dense MLP: FP8 projections
        assert moe.shared_expert.gate_up_proj.is_fp8 and moe.shared_expert.down_proj.is_fp8
    reference = fp8_experts_of(dequantized)[0]
    assert not reference.is_fp8 and reference.w13.dtype == torch.float32
    x = torch.randn(9, hidden)
    assert torch.equal(moe(x), reference(x))
    want = greedy(LLM(model=folder, **BASE))
    monkeypatch.setenv("SLUICE_FP8_WEIGHTS", "keep")
    assert greedy(LLM(model=folder, **BASE, **PREEMPTING)) == want
    assert want == hf_greedy(transformers_float32(
        dequantized_folder(folder, str(tmp_path / "dequantized"))))


def test_an_ignored_layer_s_experts_stay_unquantized(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """compressed-tensors' `ignore` naming layer 0's experts (stored in float32): that layer's
    experts load as they are, layer 1's keep FP8; the same greedy ids either way."""
    source = save_hf_model(str(tmp_path / "float"), "mixtral")
    folder = Path(tmp_path / "fp8")
    quantize_folder(source, str(folder), "fp8-channel")
    original = tensors_of(source)
    tensors = tensors_of(str(folder))
    prefix = "model.layers.0.block_sparse_moe.experts."
    for name in [n for n in tensors if n.startswith(prefix)]:
        if name.endswith(".weight_scale"):
            del tensors[name]
        else:
            tensors[name] = original[name]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["ignore"].append(r"re:.*layers\.0\.block_sparse_moe\.experts\.")
    (folder / "config.json").write_text(json.dumps(config))
    model = _loaded(str(folder), keep=True)
    first, second = fp8_experts_of(model)
    assert not first.is_fp8 and first.w13.dtype == torch.float32
    assert second.is_fp8
    want = greedy(LLM(model=str(folder), **BASE))
    monkeypatch.setenv("SLUICE_FP8_WEIGHTS", "keep")
    assert greedy(LLM(model=str(folder), **BASE)) == want


def test_per_tensor_static_experts_keep_fp8_with_their_scale_per_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """compressed-tensors per-tensor weights with static input scales (AutoFP8's Mixtral
    style): each expert's one scale repeated over its rows, the per-row layout."""
    folder, _ = _per_tensor_static_folder(Path(make_tiny_model(str(tmp_path / "m"),
                                                               arch="qwen3_moe")))
    tensors = tensors_of(str(folder))
    assert tensors["model.layers.0.mlp.experts.1.down_proj.weight_scale"].shape == (1,)
    moe = fp8_experts_of(_loaded(str(folder), keep=True))[0]
    assert moe.is_fp8 and moe.fp8_block is None
    up_scale = float(tensors["model.layers.0.mlp.experts.1.up_proj.weight_scale"])
    assert torch.equal(moe.w13_scale[1, 32:], torch.full((32,), up_scale))
    want = greedy(LLM(model=str(folder), **BASE))
    monkeypatch.setenv("SLUICE_FP8_WEIGHTS", "keep")
    assert greedy(LLM(model=str(folder), **BASE)) == want


def test_blocks_the_kernels_do_not_take_load_dequantized(tmp_path: Path) -> None:
    """16 x 40 blocks: 40 columns are no multiple of the grouped GEMM's K step of 16, so the
    experts load dequantized even when FP8 weights are kept, and give the same products."""
    folder = fp8_moe_folder(tmp_path, "qwen3_moe", "block", block=(16, 40))
    moe = fp8_experts_of(_loaded(folder, keep=True))[0]
    assert not moe.is_fp8 and moe.w13.dtype == torch.float32
    x = torch.randn(5, 64)
    assert torch.equal(moe(x), fp8_experts_of(_loaded(folder, keep=False))[0](x))


def test_bad_expert_scales_are_errors_naming_them(tmp_path: Path) -> None:
    folder = fp8_moe_folder(tmp_path, "qwen3_moe", "block")
    tensors = tensors_of(folder)
    scale = "model.layers.0.mlp.experts.2.up_proj.weight_scale_inv"
    tensors[scale] = tensors[scale][:, :1].contiguous()
    save_file(tensors, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"scale of FP8 weight 'model\.layers\.0\.mlp\.experts"
                                         r"\.2\.up_proj\.weight' has shape \[2, 1\]; per block "
                                         r"a \[32, 64\] weight needs \[2, 2\]"):
        LLM(model=folder, **BASE)


@pytest.mark.one_worker
@pytest.mark.parametrize("kind", ["block", "channel"])
def test_fp8_experts_at_tp2_give_tp1_s_greedy_ids(kind: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank holds 16 of every expert's 32 intermediate rows (gate/up) and columns (down)
    with their scales: per 16 x 16 block, one block row of each part, one block column of
    down."""
    folder = fp8_moe_folder(tmp_path, "qwen3_moe", kind, block=(16, 16))
    want = greedy(LLM(model=folder, **BASE))
    monkeypatch.setenv("SLUICE_FP8_WEIGHTS", "keep")
    assert_tp2_greedy(folder, want)


@pytest.mark.one_worker
def test_expert_blocks_a_rank_boundary_would_split_are_refused_and_kept_under_ep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixtral's experts of 128 in 128 x 128 blocks at TP 2: each rank's 64 rows would hold
    half of a block's scale. Kept FP8, that is an error naming the sizes; dequantized at load
    (each rank dequantizes whole blocks and cuts), the TP 1 greedy ids; with expert
    parallelism, FP8 experts (whole, 3 of 6 a rank) and the TP 1 greedy ids."""
    folder = fp8_moe_folder(tmp_path, "mixtral", "block", block=(128, 128))
    want = greedy(LLM(model=folder, **BASE))
    llm = LLM(model=folder, tensor_parallel_size=2, **BASE)
    try:
        assert greedy(llm) == want
    finally:
        llm.shutdown()
    monkeypatch.setenv("SLUICE_FP8_WEIGHTS", "keep")
    with pytest.raises(EngineDeadError, match=r"ValueError: FP8 experts scaled per 128x128 block "
                                              r"cannot be split over 2 tensor-parallel ranks: "
                                              r"each rank takes 64 of the 128 intermediate rows "
                                              r"of each expert's gate/up_proj, and 64 is not a "
                                              r"multiple of the 128-wide blocks"):
        LLM(model=folder, tensor_parallel_size=2, **BASE)

    # Expert parallelism: each rank takes 3 whole experts with their whole blocks' scales, so
    # they stay FP8, and the ids are TP 1's.
    whole = fp8_experts_of(_loaded(folder, keep=True))
    rank1 = fp8_experts_of(load_model(folder, load_hf_config(folder), torch.float32,
                                      torch.device("cpu"), get_attention_backend("torch_ref"),
                                      TPGroup(rank=1, size=2, expert_parallel=True),
                                      fp8_weights=True))
    assert len(rank1) == len(whole) == 2
    for share, layer in zip(rank1, whole):
        assert share.is_fp8 and share.w13.dtype == torch.float8_e4m3fn
        assert share.w13.shape == (3, 256, 64) and share.w13_scale.shape == (3, 2, 1)
        assert share.w2.shape == (3, 64, 128) and share.w2_scale.shape == (3, 1, 1)
        for ours, theirs in ((share.w13, layer.w13[3:]), (share.w2, layer.w2[3:]),
                             (share.w13_scale, layer.w13_scale[3:]),
                             (share.w2_scale, layer.w2_scale[3:])):
            assert torch.equal(ours.view(torch.uint8) if ours.dtype != torch.float32 else ours,
                               theirs.view(torch.uint8) if theirs.dtype != torch.float32
                               else theirs)
    assert_tp2_greedy(folder, want, enable_expert_parallel=True)


def test_the_gpu_check_s_fp8_moe_setting_passes_on_the_cpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/gpu_check.py's fp8_moe_check (`--only fp8_moe`) with the CPU in the GPU's place
    and FP8 experts kept: its folders (the whole model FP8; the experts alone) load with FP8
    experts and every comparison holds on the reference op, so on a GPU a false is the
    kernels'."""
    import importlib.util

    path = Path(__file__).parents[2] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setenv("SLUICE_FP8_WEIGHTS", "keep")
    result = gpu_check.fp8_moe_check(str(tmp_path), device="cpu")
    assert len(result) == 16 and all(value is True for value in result.values()), result
