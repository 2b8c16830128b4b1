"""Write an FP8 copy of a bf16 safetensors model folder, the decoder's projections and the
experts of a mixture of experts quantized as `sluice make-model --quantize` does
(sluice.model.quantization.quantize_folder), on the GPU when there is one: for benchmarking FP8
on the same random weights as a bf16 folder (e.g. shared/peer's Qwen3-8B, or the Qwen3-30B-A3B
folder of make_big_folder.py), in seconds rather than the CPU's minutes.

    PYTHONPATH=. python benchmarks/tools/quantize_folder.py SRC DST fp8-block|fp8-channel
"""

from __future__ import annotations

import sys

import torch

from sluice.model.quantization import quantize_folder


def main() -> None:
    src, dst, choice = sys.argv[1], sys.argv[2], sys.argv[3]
    quantize_folder(src, dst, choice, device="cuda" if torch.cuda.is_available() else "cpu")
    print(f"{dst}: {choice}", flush=True)


if __name__ == "__main__":
    main()
