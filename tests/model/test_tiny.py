"""The built-in tiny model folder: loads in Hugging Face transformers tensor for tensor, has a
reversible tokenizer with a ChatML template, is deterministic in its seed, and is cached once."""

from __future__ import annotations

import json
import threading
import unicodedata
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from sluice.model import tiny

ARCHS = ("qwen3", "llama", "qwen2")
HF_CLASSES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

TEXTS = [
    "Hello, world! It's 2024-01-31 and the price is $19.99.",
    "Café, naïve façade, Straße, Ångström, ¿dónde?",
    "中文：你好，世界。日本語：こんにちは。한국어: 안녕하세요",
    "emoji 😀🚀 ❤️ and a family 👨‍👩‍👧",
    "  leading spaces, trailing tab\t, a blank line\n\n and \r\n end ",
    "text , spaced . like it 's written ; never seen: qzxjv ψῷ 𝔘𝔫𝔦",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {arch: tiny.make_tiny_model(str(tmp_path_factory.mktemp(arch)), arch=arch)
            for arch in ARCHS}


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_loads_every_tensor_with_nothing_missing_or_unexpected(
    model_dirs: dict[str, str], arch: str
) -> None:
    model_dir = model_dirs[arch]
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == HF_CLASSES[arch]
    assert {k: v for k, v in info.items() if v} == {}

    saved = load_file(str(Path(model_dir) / "model.safetensors"))
    state = model.state_dict()
    tied = arch != "llama"
    assert model.config.tie_word_embeddings is tied
    expected_keys = set(state) - ({"lm_head.weight"} if tied else set())
    assert set(saved) == expected_keys
    for name, tensor in saved.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(state[name], tensor), name
    if tied:
        assert torch.equal(state["lm_head.weight"], saved["model.embed_tokens.weight"])
    else:
        assert not torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])


@pytest.mark.parametrize("arch", ARCHS)
def test_config_json_matches_the_tiny_preset_and_tokenizer(
    model_dirs: dict[str, str], arch: str
) -> None:
    model_dir = model_dirs[arch]
    config = read_json(Path(model_dir) / "config.json")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config["architectures"] == [HF_CLASSES[arch]]
    assert config["model_type"] == arch
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size",
                                   "max_position_embeddings")} == {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "max_position_embeddings": 2048}
    assert config["vocab_size"] == len(tokenizer)
    assert config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] is (arch != "llama")
    assert (config["bos_token_id"], config["eos_token_id"]) == (endoftext, im_end)
    assert read_json(Path(model_dir) / "generation_config.json")["eos_token_id"] == [
        im_end, endoftext]

    hf_config = transformers.AutoConfig.from_pretrained(model_dir)
    assert hf_config.rope_parameters["rope_theta"] == config["rope_theta"]
    assert hf_config.rms_norm_eps == config["rms_norm_eps"]


def test_weights_are_arch_specific_and_norms_are_one(model_dirs: dict[str, str]) -> None:
    weights = {arch: load_file(str(Path(d) / "model.safetensors"))
               for arch, d in model_dirs.items()}
    assert "model.layers.1.self_attn.q_norm.weight" in weights["qwen3"]
    assert "model.layers.1.self_attn.k_proj.bias" in weights["qwen2"]
    assert not any("bias" in k or "q_norm" in k for k in weights["llama"])
    assert not any("bias" in k for k in weights["qwen3"])
    for arch, tensors in weights.items():
        for name, tensor in tensors.items():
            if name.endswith("norm.weight"):
                assert torch.equal(tensor, torch.ones_like(tensor)), (arch, name)
            else:
                std = tensor.std().item()
                assert abs(std - tiny.PRESETS["tiny"]["weight_std"]) < 0.05, (arch, name, std)
    # The same seed draws the same tensors for names the archs share.
    assert torch.equal(weights["qwen3"]["model.embed_tokens.weight"],
                       weights["llama"]["model.embed_tokens.weight"])


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_logits_are_rarely_near_ties(model_dirs: dict[str, str], arch: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32)
    vocab_size = model.config.vocab_size
    input_ids = torch.randint(0, vocab_size, (16, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(input_ids).logits  # [16, 32, vocab]
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert (gaps < 1e-3).float().mean().item() < 0.01
    assert gaps.median().item() > 0.1


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips_utf8_exactly(model_dirs: dict[str, str], arch: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[arch])
    raw = Tokenizer.from_file(str(Path(model_dirs[arch]) / "tokenizer.json"))
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        # transformers 5 swaps in its own Qwen2Tokenizer for "qwen2": it must tokenize the same.
        assert raw.encode(text).ids == ids
    special = [tokenizer.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS]
    assert tokenizer.encode("<|im_start|>a<|im_end|>")[0] == special[1]
    assert tokenizer.encode("<|im_start|>a<|im_end|>")[-1] == special[2]
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")


def test_tokenizer_json_round_trips_unnormalised_and_unseen_bytes(
    model_dirs: dict[str, str],
) -> None:
    raw = Tokenizer.from_file(str(Path(model_dirs["qwen3"]) / "tokenizer.json"))
    nfd = unicodedata.normalize("NFD", "Café résumé Ångström")
    assert nfd != unicodedata.normalize("NFC", nfd)
    every_char = "".join(chr(c) for c in range(1, 0x800, 7)) + "\U0001f600\U0010fffd"
    for text in (nfd, every_char):
        ids = raw.encode(text).ids
        assert raw.decode(ids, skip_special_tokens=False) == text


def test_vocabulary_size_and_special_tokens(tmp_path: Path) -> None:
    tokenizer = tiny.build_tokenizer(str(tmp_path))
    assert isinstance(tokenizer, transformers.PreTrainedTokenizerFast)
    assert 512 <= len(tokenizer) <= 1024
    # The special tokens come last, as in Qwen's vocabulary.
    n = len(tokenizer)
    special_ids = [tokenizer.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS]
    assert special_ids == [n - 3, n - 2, n - 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.encode(TEXTS[2]) == tokenizer.encode(TEXTS[2])
    config = read_json(tmp_path / "tokenizer_config.json")
    assert config["chat_template"] == tiny.CHAT_TEMPLATE
    assert config["clean_up_tokenization_spaces"] is False


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_renders_chatml(model_dirs: dict[str, str], arch: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[arch])
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Où est la gare? 中文"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                        "<|im_start|>user\nOù est la gare? 中文<|im_end|>\n"
                        "<|im_start|>assistant\n")
    closed = tokenizer.apply_chat_template(messages, tokenize=False)
    assert closed == rendered.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer.encode(rendered)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3
    assert tokenizer.decode(ids) == rendered


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    first = Path(tiny.make_tiny_model(str(tmp_path / "a"), seed=7))
    again = Path(tiny.make_tiny_model(str(tmp_path / "b"), seed=7))
    other = Path(tiny.make_tiny_model(str(tmp_path / "c"), seed=8))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    a = load_file(str(first / "model.safetensors"))
    c = load_file(str(other / "model.safetensors"))
    assert a.keys() == c.keys()
    for name in a:
        if not name.endswith("norm.weight"):
            assert not torch.equal(a[name], c[name]), name


def test_dtype_sets_tensor_dtype_and_config(tmp_path: Path) -> None:
    model_dir = Path(tiny.make_tiny_model(str(tmp_path), arch="llama", dtype="bfloat16"))
    assert read_json(model_dir / "config.json")["torch_dtype"] == "bfloat16"
    tensors = load_file(str(model_dir / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


@pytest.mark.parametrize(("kwargs", "bad"), [
    ({"arch": "gpt2"}, "'gpt2'"),
    ({"preset": "huge"}, "'huge'"),
    ({"dtype": "int8"}, "'int8'"),
])
def test_bad_choices_raise_before_writing(tmp_path: Path, kwargs: dict, bad: str) -> None:
    out = tmp_path / "never"
    with pytest.raises(ValueError, match=bad) as excinfo:
        tiny.make_tiny_model(str(out), **kwargs)
    name = next(iter(kwargs))
    assert str(excinfo.value).startswith(f"{name} must be one of [")
    assert not out.exists()


def test_qwen3_0_6b_config_and_shapes_match_the_real_architecture() -> None:
    config = tiny._hf_config("qwen3", "qwen3-0.6b", vocab_size=643, dtype="bfloat16",
                             bos_id=640, eos_id=642)
    assert {k: config[k] for k in (
        "architectures", "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings",
        "rope_theta", "rms_norm_eps", "max_position_embeddings", "torch_dtype", "bos_token_id",
        "eos_token_id")} == {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 28,
        "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
        "rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16", "bos_token_id": 640, "eos_token_id": 642}
    assert tiny.PRESETS["qwen3-0.6b"]["dtype"] == "bfloat16"

    # The tensors we would write are exactly HF's parameters (built on the meta device: no memory).
    shapes = dict(tiny._weight_shapes(config, "qwen3"))
    hf_config = transformers.Qwen3Config(**{k: v for k, v in config.items()
                                            if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        hf_model = transformers.Qwen3ForCausalLM(hf_config)
    hf_shapes = {k: tuple(v.shape) for k, v in hf_model.state_dict().items()}
    hf_shapes.pop("lm_head.weight")  # tied to the embedding
    assert shapes == hf_shapes
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 596_049_920


@pytest.fixture
def build_counter(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = tiny.make_tiny_model

    def counting(out_dir: str, *args: object, **kwargs: object) -> str:
        calls.append(out_dir)
        return real(out_dir, *args, **kwargs)

    monkeypatch.setattr(tiny, "make_tiny_model", counting)
    return calls


def test_default_model_dir_honours_cache_dir_and_builds_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, build_counter: list[str]
) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny.default_model_dir()
    assert path == str(tmp_path / "cache" / "tiny-qwen3")
    assert tiny.default_model_dir() == path
    assert len(build_counter) == 1
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["tiny-qwen3"]
    assert read_json(Path(path) / "config.json")["architectures"] == ["Qwen3ForCausalLM"]

    # An incomplete folder (say, an interrupted copy) is rebuilt.
    (Path(path) / "model.safetensors").unlink()
    assert tiny.default_model_dir() == path
    assert len(build_counter) == 2
    assert (Path(path) / "model.safetensors").is_file()


def test_default_model_dir_falls_back_to_xdg_then_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, build_counter: list[str]
) -> None:
    monkeypatch.delenv("SLUICE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tiny.default_model_dir() == str(tmp_path / "xdg" / "sluice" / "tiny-qwen3")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tiny.default_model_dir() == str(tmp_path / "home" / ".cache" / "sluice" / "tiny-qwen3")
    assert len(build_counter) == 2


def test_concurrent_default_model_dir_callers_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    results: list[str] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            results.append(tiny.default_model_dir())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert results == [str(tmp_path / "tiny-qwen3")] * 3
    # No staging folder is left behind.
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-qwen3"]
