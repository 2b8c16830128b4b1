"""GGUF checkpoints (sluice/model/gguf_loader.py): greedy output from a .gguf of every supported
architecture, its matrices in every supported tensor type, equals transformers' reading of the
same file; an all-F32 file holds exactly the Hugging Face weights it was made from (llama's q/k
rows, Llama 3.1's RoPE scaling recovered); a tensor-parallel rank's rows are the rows of the
whole tensor; bad files are clear errors naming the file and the tensor or key."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from sluice import LLM, SamplingParams
from sluice.model.gguf_loader import (
    SUPPORTED_TENSOR_TYPES,
    GGUFTensor,
    open_reader,
    prepare_gguf_folder,
)
from tests.conftest import save_hf_model
from tests.model.gguf_files import write_gguf

ARCHS = ("llama", "qwen2", "qwen3")
MATRIX_TYPES = [t for t in SUPPORTED_TENSOR_TYPES if t != "F32"] + ["F32"]
PROMPTS = [[5, 17, 40, 77, 33, 120, 9, 11], [300, 301, 302, 7, 7, 7], list(range(100, 140))]
ENGINE = dict(dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=64)


def hf_model(root: Path, arch: str) -> str:
    """A tiny model whose rows fit the K-quants' 256-element blocks (transformers reads a
    qwen3 GGUF with head_dim 128, Qwen3's default, whatever the file says)."""
    return save_hf_model(str(root / f"hf-{arch}"), arch, hidden_size=256, intermediate_size=512,
                         head_dim=128 if arch == "qwen3" else 64)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gguf")
    return {arch: hf_model(root, arch) for arch in ARCHS}


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))


def sluice_greedy(model: str, max_tokens: int = 12, **kwargs: object) -> list[list[int]]:
    llm = LLM(model=model, **{**ENGINE, **kwargs})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def transformers_greedy(gguf_path: str, max_tokens: int = 12) -> list[list[int]]:
    import transformers

    folder, name = os.path.split(gguf_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=max_tokens, min_new_tokens=max_tokens)
        out.append(generated[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_from_a_gguf_of_every_tensor_type_equals_transformers(
        models: dict[str, str], arch: str, tmp_path: Path) -> None:
    # transformers ignores llama.cpp's rope_freqs: this file has none (see the F32 test).
    path = write_gguf(models[arch], str(tmp_path / f"{arch}.gguf"), MATRIX_TYPES,
                      drop=("rope_freqs.weight",))
    types = {t.tensor_type.name for t in open_reader(path).tensors}
    assert types == set(SUPPORTED_TENSOR_TYPES)
    assert sluice_greedy(path, tokenizer=models[arch]) == transformers_greedy(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_an_f32_gguf_holds_the_hugging_face_weights(models: dict[str, str], arch: str,
                                                    tmp_path: Path) -> None:
    path = write_gguf(models[arch], str(tmp_path / f"{arch}.gguf"))
    from_gguf = LLM(model=path, tokenizer=models[arch], **ENGINE)
    from_folder = LLM(model=models[arch], **ENGINE)
    config, want = (dataclasses.asdict(llm.llm_engine.hf_config) for llm in (from_gguf,
                                                                             from_folder))
    # GGUF keeps rms_norm_eps as a float32 (transformers reads it so too).
    assert config.pop("rms_norm_eps") == pytest.approx(want.pop("rms_norm_eps"), rel=1e-6)
    assert {**config, "torch_dtype": None} == {**want, "torch_dtype": None}
    a = dict(from_gguf.llm_engine.engine_core.executor.model_runner.model.named_parameters())
    b = dict(from_folder.llm_engine.engine_core.executor.model_runner.model.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_llama_3_rope_scaling_is_read_from_rope_freqs(models: dict[str, str],
                                                      tmp_path: Path) -> None:
    path = write_gguf(models["llama"], str(tmp_path / "llama.gguf"), ["Q8_0"])
    llm = LLM(model=path, tokenizer=models["llama"], **ENGINE)
    assert llm.llm_engine.hf_config.rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}


@pytest.mark.parametrize("type_name", SUPPORTED_TENSOR_TYPES)
@pytest.mark.parametrize("heads", [None, 4])
def test_a_ranks_rows_and_columns_are_those_of_the_whole_tensor(type_name: str,
                                                               heads: int | None,
                                                               tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    from tests.model.gguf_files import _encode

    data, qtype = _encode(rng.standard_normal((256, 512)).astype(np.float32), type_name, rng)
    writer.add_tensor("blk.0.attn_q.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (reader_tensor,) = open_reader(str(tmp_path / "t.gguf")).tensors
    tensor = GGUFTensor(reader_tensor, torch.float32, heads)
    whole = tensor.read()
    assert whole.shape == (256, 512) and tensor.shape == (256, 512)
    plain = torch.from_numpy(gguf.quants.dequantize(reader_tensor.data, qtype).copy())
    if heads is None:
        assert torch.equal(whole, plain)
    else:  # de-interleaved within each head of 64 rows
        assert torch.equal(whole[:32], plain[0:64:2]) and torch.equal(whole[32:64], plain[1:64:2])
    for start, length in ((0, 128), (128, 128), (64, 64)):
        assert torch.equal(tensor.narrow(0, start, length), whole[start:start + length])
    assert torch.equal(tensor.narrow(1, 256, 256), whole[:, 256:])


def test_hf_config_path_replaces_the_metadata(models: dict[str, str], tmp_path: Path) -> None:
    path = write_gguf(models["qwen2"], str(tmp_path / "qwen2.gguf"),
                      metadata={"qwen2.context_length": 64})
    assert LLM(model=path, tokenizer=models["qwen2"], **{**ENGINE, "max_model_len": None}
               ).llm_engine.scheduler_config.max_model_len == 64
    llm = LLM(model=path, tokenizer=models["qwen2"], hf_config_path=models["qwen2"],
              **{**ENGINE, "max_model_len": None, "num_gpu_blocks_override": 80})
    assert llm.llm_engine.scheduler_config.max_model_len == 1024  # config.json's
    with pytest.raises(ValueError, match="hf_config_path .* is for a .gguf model"):
        LLM(model=models["qwen2"], hf_config_path=models["qwen2"], **ENGINE)


def test_the_folder_made_of_a_file_is_made_once(models: dict[str, str], tmp_path: Path) -> None:
    path = write_gguf(models["qwen3"], str(tmp_path / "qwen3.gguf"))
    cache = str(tmp_path / "c")
    folder = prepare_gguf_folder(path, cache, tokenizer=models["qwen3"])
    made = os.stat(os.path.join(folder, "config.json")).st_mtime_ns
    assert prepare_gguf_folder(path, cache, tokenizer=models["qwen3"]) == folder
    assert os.stat(os.path.join(folder, "config.json")).st_mtime_ns == made
    assert os.path.realpath(os.path.join(folder, "model.gguf")) == os.path.realpath(path)
    assert sorted(os.listdir(os.path.join(cache, "gguf"))) == [os.path.basename(folder)]


def _tensor_type_offset(path: str, name: str) -> int:
    """The file offset of tensor `name`'s type field."""
    reader = open_reader(path)
    (tensor,) = [t for t in reader.tensors if t.name == name]
    field = tensor.field
    return field.offset + sum(int(part.nbytes) for part in field.parts[:4])


def expect_error(model: str, tokenizer: str | None, *fragments: str) -> None:
    with pytest.raises(ValueError) as info:
        LLM(model=model, tokenizer=tokenizer, **ENGINE)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_bad_files_are_clear_errors(models: dict[str, str], tmp_path: Path) -> None:
    hf = models["llama"]
    good = write_gguf(hf, str(tmp_path / "good.gguf"), ["Q4_0"])
    data = Path(good).read_bytes()

    truncated = tmp_path / "truncated.gguf"
    size = len(data) - 5000
    truncated.write_bytes(data[:size])
    cut = next(t.name for t in open_reader(good).tensors if t.data_offset + t.n_bytes > size)
    expect_error(str(truncated), hf, "truncated", f"tensor {cut!r}")

    unknown = tmp_path / "unknown.gguf"
    patched = bytearray(data)
    offset = _tensor_type_offset(good, "blk.1.ffn_up.weight")
    patched[offset:offset + 4] = (99).to_bytes(4, "little")
    unknown.write_bytes(bytes(patched))
    expect_error(str(unknown), hf, "'blk.1.ffn_up.weight'", "unknown type 99")

    unsupported = tmp_path / "iq.gguf"
    patched[offset:offset + 4] = int(gguf.GGMLQuantizationType.IQ4_NL).to_bytes(4, "little")
    unsupported.write_bytes(bytes(patched))
    expect_error(str(unsupported), hf, "'blk.1.ffn_up.weight'", "IQ4_NL", "Q4_K")

    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    expect_error(str(not_gguf), hf, "cannot be read")

    expect_error(str(tmp_path / "missing.gguf"), hf, "no such GGUF file")
    no_key = write_gguf(hf, str(tmp_path / "no-key.gguf"), metadata={"llama.block_count": None})
    expect_error(no_key, hf, "no metadata key 'llama.block_count'")
    wrong_shape = write_gguf(hf, str(tmp_path / "shape.gguf"),
                             metadata={"llama.feed_forward_length": 384})
    expect_error(wrong_shape, hf, "'model.layers.0.mlp.down_proj.weight' (stored as "
                 "'blk.0.ffn_down.weight')", "expects [256, 384], checkpoint has [256, 512]")
    missing = write_gguf(hf, str(tmp_path / "partial.gguf"), drop=("blk.1.ffn_up.weight",))
    expect_error(missing, hf, "not in the checkpoint", "model.layers.1.mlp.gate_up_proj")
    expect_error(good, None, "has no tokenizer", "--tokenizer")
    other_arch = write_gguf(hf, str(tmp_path / "gpt2.gguf"))
    arch_patched = Path(other_arch).read_bytes().replace(b"llama", b"gpt2_", 1)
    Path(other_arch).write_bytes(arch_patched)
    expect_error(other_arch, hf, "general.architecture 'gpt2_'", "qwen3")
