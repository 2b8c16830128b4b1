"""A random-weight model folder too large for `sluice make-model` (which draws every tensor on
the CPU and writes one safetensors file): the weights are drawn on the GPU and written in shards
of about 4 GB with an index, as published checkpoints are. For Qwen3-30B-A3B's shapes (~61 GB
in bf16), which both sluice and vLLM load from the same folder.

    python benchmarks/tools/make_big_folder.py OUT_DIR [--preset qwen3-30b-a3b] \
        [--arch qwen3_moe] [--tokenizer-from DIR]

--tokenizer-from copies a folder's tokenizer files and its eos/bos ids (the peer recipe's 8B
folder: a word-level tokenizer over the whole vocabulary, so every id detokenizes); without it,
sluice's small test tokenizer. Norms are ones, everything else normal(0, the preset's std); a
rerun with the folder complete does nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch
from safetensors.torch import save_file

from sluice.model import tiny

SHARD_BYTES = 4 << 30
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(tiny.PRESETS))
    ap.add_argument("--arch", default="qwen3_moe")
    ap.add_argument("--tokenizer-from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    if os.path.exists(os.path.join(a.out, "model.safetensors.index.json")):
        print(f"{a.out} exists")
        return
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    if a.tokenizer_from:
        for name in _TOKENIZER_FILES:
            src = os.path.join(a.tokenizer_from, name)
            if os.path.exists(src):
                shutil.copy(src, a.out)
        with open(os.path.join(a.tokenizer_from, "config.json")) as f:
            ref = json.load(f)
        bos_id, eos_id = ref.get("bos_token_id"), ref.get("eos_token_id")
        num_tokens = tiny.PRESETS[a.preset]["vocab_size"]
    else:
        tokenizer = tiny.build_tokenizer(a.out)
        bos_id = tokenizer.convert_tokens_to_ids(tiny.ENDOFTEXT)
        eos_id = tokenizer.convert_tokens_to_ids(tiny.IM_END)
        num_tokens = len(tokenizer)
    config = tiny._hf_config(a.arch, a.preset, num_tokens, "bfloat16", bos_id, eos_id)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    std = tiny.PRESETS[a.preset]["weight_std"]
    gen = torch.Generator(device=a.device).manual_seed(a.seed)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files: list[str] = []
    total = 0

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        files.append(name)
        save_file({k: v.cpu() for k, v in shard.items()}, os.path.join(a.out, name),
                  metadata={"format": "pt"})
        for key in shard:
            weight_map[key] = name
        shard.clear()

    size = 0
    for name, shape in tiny._weight_shapes(config, a.arch):
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16, device=a.device)
        else:
            t = (torch.randn(shape, generator=gen, device=a.device) * std).to(torch.bfloat16)
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                t[num_tokens:] = 0
        shard[name] = t
        size += t.numel() * 2
        total += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
            size = 0
    if shard:
        flush()
    # shards are written as model-0000k.safetensors; rename to the -of-N form the hub uses
    n = len(files)
    renamed = {}
    for i, name in enumerate(files, 1):
        new = f"model-{i:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(a.out, name), os.path.join(a.out, new))
        renamed[name] = new
    index = {"metadata": {"total_size": total},
             "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    print(f"{a.out}: {total / 1e9:.1f} GB in {n} shards, {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
