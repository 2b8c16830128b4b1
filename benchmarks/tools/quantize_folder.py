"""Write an FP8 copy of a bf16 safetensors model folder, the decoder's projections quantized as
`sluice make-model --quantize` does (sluice.model.quantization.quantize_weights), on the GPU
when there is one: for benchmarking FP8 on the same random weights as a bf16 folder (e.g.
shared/peer's Qwen3-8B), in seconds rather than the CPU's minutes.

    PYTHONPATH=. python benchmarks/tools/quantize_folder.py SRC DST fp8-block|fp8-channel
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sluice.model.quantization import quantize_weights


def main() -> None:
    src, dst, choice = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    dst.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name not in ("config.json",
                                                              "model.safetensors.index.json"):
            shutil.copy(path, dst / path.name)
    weight_map: dict[str, str] = {}
    quantization_config = None
    for shard in sorted(src.glob("*.safetensors")):
        tensors = {name: t.to(device) for name, t in load_file(str(shard)).items()}
        quantized, quantization_config = quantize_weights(tensors, choice)
        save_file({name: t.contiguous().cpu() for name, t in quantized.items()},
                  str(dst / shard.name), metadata={"format": "pt"})
        weight_map.update((name, shard.name) for name in quantized)
        print(f"{shard.name}: {len(quantized)} tensors", flush=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    if (src / "model.safetensors.index.json").exists():
        (dst / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


if __name__ == "__main__":
    main()
