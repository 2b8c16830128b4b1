"""FP8 checkpoints (sluice.model.quantization): config.json's quantization_config read for
quant_method "fp8" (per block) and compressed-tensors (per channel, per tensor with static input
scales); the weights dequantized at load, a tensor-parallel rank reading its rows or columns and
their scales. Greedy ids equal transformers' on the same checkpoint: its own FP8 loader
(FineGrainedFP8Config(dequantize=True)) for quant_method "fp8", and for every format a float32
folder dequantized here by plain torch (no sluice code), which transformers runs. Methods and
tensors sluice does not read are refused by name."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sluice import LLM, SamplingParams
from sluice.model.hf_config import parse_hf_config
from sluice.model.quantization import (
    Fp8CheckpointTensor,
    parse_quantization_config,
    quantize_fp8,
)
from sluice.model.tiny import make_tiny_model

BASE = dict(dtype="float32", block_size=8, max_model_len=152, max_num_batched_tokens=32, seed=0)
PREEMPTING = dict(num_gpu_blocks_override=20)
MAX_TOKENS = 16


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    out = [[rng.randrange(3, 643) for _ in range(n)] for n in (5, 17, 40, 77, 120)]
    return out + [out[-1][:96] + [7, 8, 9]]  # shares 12 blocks with the one before


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_tp2_greedy(folder: str, want: list[list[int]], **engine: object) -> None:
    """The folder at TP 2 (with preemption) gives `want`'s greedy ids."""
    llm = LLM(model=folder, tensor_parallel_size=2, **BASE, **PREEMPTING, **engine)
    try:
        assert greedy(llm) == want
    finally:
        llm.shutdown()


def hf_greedy(model) -> list[list[int]]:
    ids = []
    for prompt in prompts():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             min_new_tokens=MAX_TOKENS, pad_token_id=0)
        ids.append(out[0, len(prompt):].tolist())
    return ids


def dequantized_folder(fp8_dir: str, out_dir: str) -> str:
    """The checkpoint with every FP8 weight multiplied out by its scale (broadcast per tensor,
    per row, or per block by index arithmetic), scales dropped, no quantization_config."""
    out = Path(out_dir)
    out.mkdir(parents=True)
    config = json.loads((Path(fp8_dir) / "config.json").read_text())
    quant = config.pop("quantization_config")
    block = quant.get("weight_block_size")
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(fp8_dir) / name).exists():
            (out / name).write_bytes((Path(fp8_dir) / name).read_bytes())
    tensors = {}
    with safe_open(str(Path(fp8_dir) / "model.safetensors"), "pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}
    for name, tensor in stored.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if tensor.dtype != torch.float8_e4m3fn:
            tensors[name] = tensor
            continue
        module = name.removesuffix(".weight")
        scale = stored.get(module + ".weight_scale_inv", stored.get(module + ".weight_scale"))
        w = tensor.float()
        if block:
            rows = torch.arange(w.shape[0]) // block[0]
            cols = torch.arange(w.shape[1]) // block[1]
            w = w * scale[rows][:, cols]
        else:
            w = w * scale.reshape(-1, 1) if scale.numel() > 1 else w * scale.reshape(())
        tensors[name] = w
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def transformers_float32(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_block_fp8_checkpoint_equals_transformers(arch: str, tmp_path: Path) -> None:
    """quant_method "fp8" in 16 x 16 blocks (4-8 blocks a weight at the tiny sizes), with
    prefix caching, 32-token chunks and preemption."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    folder = make_tiny_model(str(tmp_path / "fp8"), arch=arch, quantize="fp8-block",
                             block_size=(16, 16))
    got = greedy(LLM(model=folder, **BASE, **PREEMPTING))
    theirs = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32,
        quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    assert got == hf_greedy(theirs)
    assert got == hf_greedy(transformers_float32(
        dequantized_folder(folder, str(tmp_path / "float"))))


def test_a_channel_fp8_checkpoint_equals_transformers_on_its_dequantized_weights(
        tmp_path: Path) -> None:
    """compressed-tensors float-quantized, per-channel weight scales, dynamic per-token
    activations (the FP8-dynamic checkpoints)."""
    folder = make_tiny_model(str(tmp_path / "fp8"), quantize="fp8-channel")
    config = json.loads((Path(folder) / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    got = greedy(LLM(model=folder, **BASE, **PREEMPTING))
    assert got == hf_greedy(transformers_float32(
        dequantized_folder(folder, str(tmp_path / "float"))))


def _per_tensor_static_folder(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A qwen2 folder rewritten as compressed-tensors per-tensor FP8 with static input scales;
    and its tensors."""
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        tensors[name], tensors[name.replace(".weight", ".weight_scale")] = quantize_fp8(
            tensors[name], "tensor")
        tensors[name.replace(".weight", ".input_scale")] = torch.tensor([0.05])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                        "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                  "dynamic": False}}}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, tensors


def test_a_per_tensor_static_checkpoint_loads_its_weights(tmp_path: Path) -> None:
    """compressed-tensors per-tensor weights with static input scales (read, not needed by
    the dequantized matmuls), and the lm_head in `ignore` left in float32."""
    folder, tensors = _per_tensor_static_folder(Path(make_tiny_model(str(tmp_path / "fp8"),
                                                                     arch="qwen2")))
    got = greedy(LLM(model=str(folder), **BASE))
    dequantized = dequantized_folder(str(folder), str(tmp_path / "float"))
    assert got == greedy(LLM(model=dequantized, **BASE))
    assert got == hf_greedy(transformers_float32(dequantized))
    # static activations need their scales
    del tensors["model.layers.1.mlp.up_proj.input_scale"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' has no "
                                         r"'model\.layers\.1\.mlp\.up_proj\.input_scale'"):
        LLM(model=str(folder), **BASE)


@pytest.mark.parametrize("scheme,block", [("block", (24, 40)), ("block", (16, 16)),
                                          ("channel", None), ("tensor", None)])
def test_a_rank_s_rows_and_columns_equal_the_whole_tensor_s(scheme: str,
                                                            block: tuple | None) -> None:
    """narrow() reads the weight (and a block scale) from the file alone, widening to whole
    blocks where a slice starts or ends inside one, and cuts: every slice equals the slice of
    the whole dequantized tensor."""
    torch.manual_seed(0)
    weight = torch.randn(72, 120) * torch.rand(72, 1)
    stored, scale = quantize_fp8(weight, scheme, block or (128, 128))
    kind = {"block": "fp8-block", "channel": "fp8-channel", "tensor": "fp8-channel"}[scheme]
    config = parse_quantization_config(_config(kind, block or (128, 128)))
    config = type(config)(config.method, scheme, block, config.activations, config.ignored)
    tensor = Fp8CheckpointTensor("w", stored, scale, config, torch.float32)
    whole = tensor.read()
    torch.testing.assert_close(whole, weight, rtol=0.07, atol=0.07 * float(weight.abs().max()))
    for dim in (0, 1):
        for start, length in ((0, 36), (36, 36), (5, 31), (24, 16), (50, 22)):
            assert torch.equal(tensor.narrow(dim, start, length), whole.narrow(dim, start, length))


def _config(kind: str, block: tuple[int, int]) -> dict:
    from sluice.model.quantization import quantization_config_for

    return quantization_config_for(kind, block)[1]


@pytest.mark.one_worker
def test_a_block_fp8_checkpoint_at_tp2_gives_tp1_s_greedy_ids(tmp_path: Path) -> None:
    """Blocks of 24 x 40 do not line up with the ranks' rows (q: 32 of 64, k/v: 16 of 32) nor
    columns (o / down: 32 of 64, 64 of 128): each rank dequantizes whole blocks and cuts."""
    folder = make_tiny_model(str(tmp_path / "fp8"), quantize="fp8-block", block_size=(24, 40))
    want = greedy(LLM(model=folder, **BASE))
    assert_tp2_greedy(folder, want)


@pytest.mark.parametrize("quantization_config,message", [
    ({"quant_method": "awq", "bits": 4}, r"'awq' \(int4 AWQ\) is not supported"),
    ({"quant_method": "gptq", "bits": 4}, r"'gptq' \(int4/int8 GPTQ\) is not supported"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
    ({"quant_method": "modelopt_fp4"}, r"NVFP4"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}},
     "format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float"}}}},
     "4-bit float weights: not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                 "strategy": "group"}}}},
     "weight strategy 'group' is not supported"),
])
def test_methods_not_read_are_refused_by_name(quantization_config: dict, message: str,
                                              tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(quantization_config)
    folder = Path(make_tiny_model(str(tmp_path / "m")))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(model=str(folder), **BASE)


def _rewrite(folder: Path, edit) -> None:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_bad_fp8_tensors_are_errors_naming_them(tmp_path: Path) -> None:
    folder = Path(make_tiny_model(str(tmp_path / "m"), quantize="fp8-block",
                                  block_size=(16, 16)))
    name = "model.layers.0.mlp.up_proj"
    scale = f"{name}.weight_scale_inv"
    saved = {}
    _rewrite(folder, lambda t: saved.update(scale=t.pop(scale)))
    with pytest.raises(ValueError, match=rf"FP8 weight '{name}\.weight' has no scale: "
                                         rf"'{scale}' is not in the checkpoint"):
        LLM(model=str(folder), **BASE)
    _rewrite(folder, lambda t: t.update({scale: saved["scale"][:, :2].contiguous()}))
    with pytest.raises(ValueError, match=rf"scale of FP8 weight '{name}\.weight' has shape "
                                         r"\[8, 2\]; per block a \[128, 64\] weight needs "
                                         r"\[8, 4\]"):
        LLM(model=str(folder), **BASE)
    _rewrite(folder, lambda t: t.update({scale: saved["scale"],
                                         "model.layers.0.mlp.extra.weight_scale_inv":
                                             saved["scale"].clone()}))
    with pytest.raises(ValueError, match="'model.layers.0.mlp.extra.weight_scale_inv' scales "
                                         "no weight"):
        LLM(model=str(folder), **BASE)
    _rewrite(folder, lambda t: t.pop("model.layers.0.mlp.extra.weight_scale_inv"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] = ["lm_head", name]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"'{name}' is left unquantized .* but its weight "
                                         rf"'{name}\.weight' is FP8"):
        LLM(model=str(folder), **BASE)
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight' is FP8 but "
                                         "config.json has no quantization_config"):
        LLM(model=str(folder), **BASE)


def test_the_config_says_what_it_read() -> None:
    raw = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
           "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128],
                                   "modules_to_not_convert": ["lm_head"]}}
    quant = parse_hf_config(raw).quantization
    assert (quant.scheme, quant.block_size, quant.scale_name) == ("block", (128, 128),
                                                                  "weight_scale_inv")
    assert quant.is_ignored("lm_head") and not quant.is_ignored("model.layers.0.mlp.up_proj")
    ct = parse_quantization_config(_config("fp8-channel", (128, 128)) | {
        "ignore": ["lm_head", "re:.*layers\\.1\\..*"]})
    assert (ct.scheme, ct.activations, ct.scale_name) == ("channel", "dynamic", "weight_scale")
    assert ct.is_ignored("model.layers.1.mlp.down_proj")
    assert not ct.is_ignored("model.layers.0.mlp.down_proj")
    assert parse_hf_config({k: v for k, v in raw.items()
                            if k != "quantization_config"}).quantization is None


def _loaded(folder: str, keep: bool):
    from sluice.attention.backend import get_attention_backend
    from sluice.model.hf_config import load_hf_config
    from sluice.model.loader import load_model

    return load_model(folder, load_hf_config(folder), torch.float32, torch.device("cpu"),
                      get_attention_backend("torch_ref"), fp8_weights=keep)


@pytest.mark.parametrize("kind", ["block", "channel", "tensor"])
def test_layers_that_keep_fp8_weights_give_the_dequantized_model_s_greedy_ids(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SLUICE_FP8_WEIGHTS=keep (what a GPU with FP8 tensor cores does by default): every
    projection holds its FP8 weight and float32 scales (per 16 x 32 block; per row, a per-tensor
    scale repeated over q, k and v's rows) and multiplies through the CPU's fp8_op, which
    dequantizes as the load-time path does: the same greedy ids."""
    if kind == "tensor":
        folder = str(_per_tensor_static_folder(Path(make_tiny_model(str(tmp_path / "m"),
                                                                    arch="qwen2")))[0])
    else:
        folder = make_tiny_model(str(tmp_path / "m"), arch="llama" if kind == "channel"
                                 else "qwen3", quantize=f"fp8-{kind}", block_size=(16, 32))
    model = _loaded(folder, keep=True)
    layer = model.model.layers[1]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
               layer.mlp.down_proj]
    assert all(linear.is_fp8 and linear.weight.dtype == torch.float8_e4m3fn
               for linear in linears)
    qkv = layer.self_attn.qkv_proj
    n, k = qkv.weight.shape
    assert qkv.weight_scale.shape == ((n // 16, k // 32) if kind == "block" else (n,))
    assert model.lm_head.weight.dtype == torch.float32
    dequantized = _loaded(folder, keep=False)
    assert not dequantized.model.layers[1].self_attn.qkv_proj.is_fp8
    # the layers' products equal the dequantized layers' exactly
    x = torch.randn(7, k)
    assert torch.equal(qkv(x), dequantized.model.layers[1].self_attn.qkv_proj(x))
    want = greedy(LLM(model=folder, **BASE))
    monkeypatch.setenv("SLUICE_FP8_WEIGHTS", "keep")
    assert greedy(LLM(model=folder, **BASE, **PREEMPTING)) == want


def test_blocks_the_ranks_pieces_do_not_fall_on_are_dequantized(tmp_path: Path) -> None:
    """24 x 40 blocks (40 is no multiple of the FP8 tensor cores' 32 of K, and q/k/v's rows end
    inside a block): those layers load dequantized even when FP8 weights are kept."""
    folder = make_tiny_model(str(tmp_path / "m"), quantize="fp8-block", block_size=(24, 40))
    model = _loaded(folder, keep=True)
    assert not any(getattr(m, "is_fp8", False) for m in model.modules())


@pytest.mark.one_worker
def test_kept_fp8_weights_at_tp2_give_tp1_s_greedy_ids(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank loads its rows (q/k/v, gate/up) or columns (o, down) of the FP8 weights with
    their block scales: 16 x 32 blocks, q 32 of 64 rows, k/v 16 of 32, o/down 32 / 64 columns;
    SLUICE_FP8_WEIGHTS takes three values."""
    folder = make_tiny_model(str(tmp_path / "fp8"), quantize="fp8-block", block_size=(16, 32))
    want = greedy(LLM(model=folder, **BASE))
    monkeypatch.setenv("SLUICE_FP8_WEIGHTS", "keep")
    assert_tp2_greedy(folder, want)
    monkeypatch.setenv("SLUICE_FP8_WEIGHTS", "always")
    with pytest.raises(ValueError, match="SLUICE_FP8_WEIGHTS must be 'auto', 'keep' or "
                                         "'dequantize', got 'always'"):
        LLM(model=folder, **BASE)
