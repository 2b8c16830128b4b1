"""The built-in tiny model: a random-weight Hugging Face folder with a real byte-level tokenizer.

`make_tiny_model` writes config.json, generation_config.json, tokenizer.json, tokenizer_config.json
and model.safetensors the way a published Qwen3 / Llama / Qwen2 checkpoint lays them out, so the
whole engine runs end to end with no download. Everything is deterministic in `seed`: the same
arguments give the same bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from sluice.model.quantization import quantization_config_for, quantize_weights

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen's pre-tokenizer split (single digits, letters with one leading mark, punctuation runs).
# transformers 5 rebuilds a "qwen2" folder's tokenizer with this split (plus NFC), so using it here
# keeps AutoTokenizer and tokenizer.json in agreement for every arch on NFC text.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# BPE merges learned from the corpus; the trainer stops earlier if the corpus runs out of pairs.
_NUM_BPE_TOKENS = 640
# Qwen's tokenizer value; the usable context comes from config.json's max_position_embeddings.
_MODEL_MAX_LENGTH = 131072

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# weight_std is not a config.json field: the std of the random weights, chosen so that greedy
# top-1 / top-2 logit gaps are rarely below 1e-3 (see tests/model/test_tiny.py).
PRESETS: dict[str, dict] = {
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "max_position_embeddings": 2048,
        "weight_std": 0.2,
    },
    "qwen3-0.6b": {
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "dtype": "bfloat16",
        "weight_std": 0.04,
    },
    # The Qwen3-8B architecture (tensor-parallel scaling runs: a model big enough to split).
    "qwen3-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "dtype": "bfloat16",
        "weight_std": 0.02,
    },
    # The Qwen3-30B-A3B architecture (for --arch qwen3_moe: 128 experts of 768, 8 a token;
    # ~61 GB in bf16).
    "qwen3-30b-a3b": {
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "max_position_embeddings": 40960,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "dtype": "bfloat16",
        "weight_std": 0.02,
    },
}
# MoE sizes a preset without them takes (--arch qwen3_moe --preset tiny: 8 experts of 32, 2 a
# token, the last layer dense).
_TINY_MOE = {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}

# Per-architecture config.json fields beyond the sizes, as the published checkpoints carry them.
_ARCH_FIELDS: dict[str, dict] = {
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
    },
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
    },
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
)

# A few KB of varied text: prose, dialogue, numbers, code, markup, and multi-byte scripts, so the
# merges cover common English while every other byte still has its own token.
CORPUS = """\
The river ran low that autumn, and the old mill by the bridge stood quiet for the first time.
Children walked along the dry bed, picking up smooth stones and counting fish in shallow pools.
"We should tell someone," said Mara, but her brother was already running back to the village.
By evening the whole town had gathered at the water's edge, talking about rain and about luck.
An inference engine turns a prompt into tokens, runs the model one step at a time, and streams
text back. Each request keeps its own cache of keys and values, split into fixed-size blocks.
When two prompts begin with the same words, the second reuses the blocks the first one filled.
The scheduler decides, at every step, how many tokens each running request may compute.
Q: What is the capital of France? A: Paris. Q: How many days are in a week? A: Seven.
Q: Who wrote the letter? A: Nobody knows; it was unsigned, dated 12 March 1904, sealed with wax.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 65536 3.14159 2.71828 -17 +8 1e-6 50%.
Dates and times: 2024-01-31, 09:30, 23:59:59, Monday, Tuesday, Wednesday, Thursday, Friday.
Prices went from $19.99 to $24.50, while the index fell 3.2% and the bond yield rose to 4.75%.
def add(a: int, b: int) -> int:
    return a + b

for i in range(10):
    print(f"step {i}: {add(i, i)}")

if x is not None and len(items) > 0:
    result = {"name": name, "count": count, "ok": True}
    return json.dumps(result)
SELECT id, name FROM users WHERE age >= 18 ORDER BY name LIMIT 5;
<html><body><p class="note">Hello, world!</p></body></html>
https://example.com/path/to/page?query=value&lang=en#section-2
user@example.org, (555) 010-2030, #hashtag, @mention, [link](url), *bold*, _italic_, ~tilde~.
Mathematics: x^2 + y^2 = z^2; sum(i for i in 1..n) = n(n+1)/2; a != b; c <= d; e >= f; g == h.
She asked whether the train would be late again, and he said it probably would, as it always was.
They planted tomatoes, beans, carrots and onions in spring, then waited through a long summer.
The committee met on Thursday to review the budget, discuss the new library, and elect a chair.
Please remember to close the window before you leave; the cat likes to climb onto the roof.
I can't, you won't, they're here, we've been, she'd go, it's fine, that's all, who's there?
Le café est très chaud ; l'élève étudie à la bibliothèque près de la forêt. Où est la gare ?
El niño comió una manzana en el jardín. ¿Dónde está la estación? ¡Qué día tan bonito, señor!
Die Straße ist schön, und die Bäume blühen früh. Über den Flüssen fliegen Vögel. Grüße aus Köln.
Ação, coração, informação; São Paulo fica no Brasil. Naïve façade, résumé, Zürich, Ångström.
Ελληνικά: καλημέρα κόσμε. Русский: привет, мир, как дела? Polski: zażółć gęślą jaźń.
中文：你好，世界。今天天气很好，我们去公园散步吧。机器学习模型需要大量的数据。
日本語：こんにちは、世界。東京は大きな都市です。ありがとうございます。
한국어: 안녕하세요, 세계. 오늘은 좋은 날입니다.
العربية: مرحبا بالعالم. हिन्दी: नमस्ते दुनिया।
Emoji: 😀 🎉 🚀 ❤️ 👍 🌍 🐍 ☕ ✨ and symbols: © ® ™ € £ ¥ ° ± × ÷ → ← ↑ ↓ … “quoted” ‘single’.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
Once upon a time there was a small robot who wanted to learn how to paint the sea.
Every morning it rolled down to the harbour, watched the boats, and mixed blue with a little grey.
The other robots laughed, but the painter kept going, one stroke at a time, until it was done.
In the end the harbour master hung it above his desk, and sailors stopped to look at it.
Tokens are pieces of text: whole words, parts of words, single letters, or raw bytes.
A tokenizer must be reversible: decoding the tokens of any text gives back exactly that text.
"""


def _check_choice(name: str, value: str, allowed: list[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # No normalizer: the bytes of any UTF-8 text come back unchanged.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # The full 256-byte alphabet makes every UTF-8 string encodable, seen in the corpus or not.
    trainer = trainers.BpeTrainer(
        vocab_size=_NUM_BPE_TOKENS,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    # Added after training so they get the last ids, as in Qwen's vocabulary.
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    return tokenizer


def _tokenizer_config(tokenizer: Tokenizer) -> dict:
    added_tokens_decoder = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        # HF's default cleanup rewrites " ." to "." and would break the byte-exact round trip.
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": _MODEL_MAX_LENGTH,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def build_tokenizer(out_dir: str) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer and save tokenizer.json + tokenizer_config.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    # Written by hand rather than by save_pretrained so the file loads in transformers 4.x and 5.x
    # alike and keeps the chat template inline, where Qwen's tokenizer_config.json has it.
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tokenizer))
    return PreTrainedTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=_MODEL_MAX_LENGTH,
    )


def _hf_config(
    arch: str, preset: str, vocab_size: int, dtype: str, bos_id: int, eos_id: int
) -> dict:
    """config.json as the published checkpoints of `arch` write it (transformers 4.5x layout)."""
    sizes = PRESETS[preset]
    config = {
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "head_dim": sizes["head_dim"],
        "hidden_act": "silu",
        "hidden_size": sizes["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": sizes["intermediate_size"],
        "max_position_embeddings": sizes["max_position_embeddings"],
        "num_attention_heads": sizes["num_attention_heads"],
        "num_hidden_layers": sizes["num_hidden_layers"],
        "num_key_value_heads": sizes["num_key_value_heads"],
        "rope_scaling": None,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": sizes.get("vocab_size", vocab_size),
    }
    config.update(_ARCH_FIELDS[arch])
    for key in ("tie_word_embeddings", "rope_theta", "rms_norm_eps"):
        if key in sizes:
            config[key] = sizes[key]
    if arch in ("qwen3", "qwen2", "qwen3_moe"):
        config["max_window_layers"] = sizes["num_hidden_layers"]
    if arch == "qwen3_moe":
        for key, value in _TINY_MOE.items():
            config[key] = sizes.get(key, value)
        # the tiny preset's last layer dense, as mlp_only_layers allows
        config["mlp_only_layers"] = [] if "num_experts" in sizes else [
            sizes["num_hidden_layers"] - 1]
    return config


def _weight_shapes(config: dict, arch: str) -> list[tuple[str, tuple[int, ...]]]:
    """HF tensor names and shapes, in a fixed order (the order the generator draws them)."""
    hidden = config["hidden_size"]
    q_size = config["num_attention_heads"] * config["head_dim"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]
    inter = config["intermediate_size"]
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (config["vocab_size"], hidden))
    ]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (q_size, hidden)),
            (p + "self_attn.k_proj.weight", (kv_size, hidden)),
            (p + "self_attn.v_proj.weight", (kv_size, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, q_size)),
        ]
        if arch == "qwen2":
            shapes += [
                (p + "self_attn.q_proj.bias", (q_size,)),
                (p + "self_attn.k_proj.bias", (kv_size,)),
                (p + "self_attn.v_proj.bias", (kv_size,)),
            ]
        if arch in ("qwen3", "qwen3_moe"):
            # Per-head RMSNorm on q and k: weight over head_dim.
            shapes += [
                (p + "self_attn.q_norm.weight", (config["head_dim"],)),
                (p + "self_attn.k_norm.weight", (config["head_dim"],)),
            ]
        shapes.append((p + "post_attention_layernorm.weight", (hidden,)))
        if arch == "qwen3_moe" and i not in config["mlp_only_layers"]:
            experts, moe_inter = config["num_experts"], config["moe_intermediate_size"]
            shapes.append((p + "mlp.gate.weight", (experts, hidden)))
            for e in range(experts):
                q = f"{p}mlp.experts.{e}."
                shapes += [(q + "gate_proj.weight", (moe_inter, hidden)),
                           (q + "up_proj.weight", (moe_inter, hidden)),
                           (q + "down_proj.weight", (hidden, moe_inter))]
            continue
        shapes += [
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    if not config["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return shapes


def _random_weights(
    config: dict, arch: str, std: float, seed: int, num_tokens: int
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    dtype = _DTYPES[config["torch_dtype"]]
    weights: dict[str, torch.Tensor] = {}
    # One tensor at a time in fp32, cast at once: peak fp32 memory is the largest tensor.
    for name, shape in _weight_shapes(config, arch):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype)
            continue
        weight = torch.randn(shape, generator=generator) * std
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            # Rows past the tokenizer (a padded vocab, as in Qwen3) get logit 0, below the real
            # tokens' top logit, so greedy decoding stays on ids the tokenizer can decode.
            weight[num_tokens:] = 0
        weights[name] = weight.to(dtype)
    return weights


def make_tiny_model(
    out_dir: str,
    arch: str = "qwen3",
    preset: str = "tiny",
    seed: int = 0,
    dtype: str | None = None,
    quantize: str | None = None,
    block_size: tuple[int, int] = (128, 128),
) -> str:
    """Write a random-weight HF model folder; dtype None means the preset's (float32 for tiny).
    `quantize` "fp8-block" or "fp8-channel": the decoder's projections stored as FP8 with their
    scales, as Qwen's FP8 checkpoints (per `block_size` block) or compressed-tensors'
    FP8-dynamic ones (per output channel) store them (sluice.model.quantization)."""
    _check_choice("arch", arch, list(_ARCH_FIELDS))
    _check_choice("preset", preset, list(PRESETS))
    dtype = dtype if dtype is not None else PRESETS[preset].get("dtype", "float32")
    _check_choice("dtype", dtype, list(_DTYPES))

    out = Path(out_dir)
    tokenizer = build_tokenizer(str(out))
    bos_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    config = _hf_config(arch, preset, len(tokenizer), dtype, bos_id, eos_id)
    assert config["vocab_size"] >= len(tokenizer)
    if quantize is not None:  # refused before any weight is drawn
        config["quantization_config"] = quantization_config_for(quantize, block_size)[1]
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": [eos_id, bos_id], "pad_token_id": bos_id},
    )
    std = PRESETS[preset]["weight_std"]
    weights = _random_weights(config, arch, std, seed, len(tokenizer))
    if quantize is not None:  # the config as written for these weights (their routers)
        weights, config["quantization_config"] = quantize_weights(weights, quantize, block_size)
        _write_json(out / "config.json", config)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _MODEL_FILES)


def default_model_dir() -> str:
    """The cached built-in model folder, built on first use."""
    from sluice.model.hub import sluice_cache_dir

    target = Path(sluice_cache_dir()) / "tiny-qwen3"
    if _is_complete(target):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a concurrent reader never sees half a folder.
    staging = Path(tempfile.mkdtemp(prefix=".tiny-qwen3-", dir=target.parent))
    try:
        make_tiny_model(str(staging))
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(staging, target)
        except OSError:
            # Another process renamed its complete copy into place first.
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)
