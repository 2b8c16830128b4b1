"""The offline benchmarks: nano-vllm's workload, the roofline, `sluice bench throughput|latency`
end to end on the CPU, and transformers' continuous-batching baseline."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from sluice.bench.hf_baseline import (
    HFBaselineResult,
    continuous_batching_config,
    measure_hf_baseline,
    unavailable_reason,
)
from sluice.bench.latency import parse_sizes
from sluice.bench.roofline import (
    GPU_SPECS,
    GpuSpec,
    ModelCost,
    gpu_spec_for,
    offline_roofline,
)
from sluice.bench.throughput import format_throughput
from sluice.bench.workloads import nano_vllm_workload
from sluice.model.hf_config import parse_hf_config
from sluice.model.tiny import _hf_config, make_tiny_model

pytestmark = pytest.mark.one_worker

THROUGHPUT_KEYS = {"model", "num_requests", "prompt_tokens", "output_tokens", "seconds",
                   "output_tok_s", "total_tok_s", "roofline_tok_s", "roofline_fraction",
                   "hf_tok_s", "ratio_vs_hf"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("bench") / "tiny-qwen3"))


def run_sluice(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluice", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ})


def read_record(path: Path, bench: str) -> dict:
    """The record a benchmark wrote (schema sluice.bench/1), its envelope checked."""
    record = json.loads(path.read_text())
    assert record["schema"] == "sluice.bench/1" and record["bench"] == bench
    assert record["command"][:3] == ["sluice", "bench", bench]
    assert record["machine"]["device"] == "cpu" and record["machine"]["gpu"] is None
    assert record["date"] and record["sluice_version"]
    return record


def qwen3_0_6b_cost() -> ModelCost:
    config = parse_hf_config(_hf_config("qwen3", "qwen3-0.6b", 643, "bfloat16", 0, 1))
    return ModelCost.from_hf_config(config, dtype_bytes=2)


def test_default_workload_is_nano_vllms_bench_exactly() -> None:
    workload = nano_vllm_workload()
    assert workload.num_requests == 256
    assert workload.prompt_tokens == 142_827
    assert workload.output_tokens == 133_966
    # nano-vllm's own lines, on the global generator (restored afterwards).
    state = random.getstate()
    try:
        random.seed(0)
        prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
                   for _ in range(256)]
        max_tokens = [random.randint(100, 1024) for _ in range(256)]
    finally:
        random.setstate(state)
    assert workload.prompts == prompts
    assert workload.max_tokens == max_tokens


def test_scaled_workload_keeps_bounds_and_is_deterministic() -> None:
    workload = nano_vllm_workload(num_requests=20, max_input_len=64, max_output_len=32)
    assert workload == nano_vllm_workload(num_requests=20, max_input_len=64, max_output_len=32)
    assert workload.num_requests == 20
    # Lower bounds scale as 100/1024: 64 -> 6, 32 -> 3.
    assert all(6 <= len(p) <= 64 for p in workload.prompts)
    assert all(3 <= m <= 32 for m in workload.max_tokens)
    assert len({len(p) for p in workload.prompts}) > 5
    folded = workload.fold_token_ids(50)
    assert [len(p) for p in folded.prompts] == [len(p) for p in workload.prompts]
    assert max(max(p) for p in folded.prompts) < 50
    assert folded.prompts[0] == [t % 50 for t in workload.prompts[0]]
    with pytest.raises(ValueError, match="num_requests"):
        nano_vllm_workload(num_requests=0)


def test_roofline_reproduces_benchmarks_md_for_qwen3_0_6b_on_h200() -> None:
    cost = qwen3_0_6b_cost()
    assert cost.weight_bytes == pytest.approx(1.19e9, rel=0.01)
    assert cost.kv_bytes_per_token == 114_688  # 2 x 28 layers x 8 heads x 128 x 2 bytes
    workload = nano_vllm_workload()
    roofline = offline_roofline(cost, [len(p) for p in workload.prompts], workload.max_tokens,
                                GPU_SPECS["h200"])
    assert roofline.decode_steps == 1024
    assert roofline.decode_bytes == pytest.approx(15.1e12, rel=0.005)
    assert roofline.decode_seconds == pytest.approx(3.14, abs=0.01)
    assert roofline.prefill_seconds == pytest.approx(0.14, abs=0.005)
    assert roofline.output_tokens == 133_966
    assert roofline.output_tok_s == pytest.approx(40_812, rel=0.01)


def test_an_8_bit_kv_cache_halves_the_kv_bytes_of_the_roofline() -> None:
    config = parse_hf_config(_hf_config("qwen3", "qwen3-0.6b", 643, "bfloat16", 0, 1))
    fp8 = ModelCost.from_hf_config(config, dtype_bytes=2, kv_dtype_bytes=1)
    assert fp8.kv_bytes_per_token == qwen3_0_6b_cost().kv_bytes_per_token // 2
    assert fp8.weight_bytes == qwen3_0_6b_cost().weight_bytes


def test_roofline_counts_each_tokens_context_and_each_prompts_causal_pairs() -> None:
    cost = ModelCost(weight_bytes=1000, kv_bytes_per_token=10, linear_flops_per_token=100,
                     attention_flops_per_pair=7, lm_head_flops=50)
    spec = GpuSpec("test", hbm_bytes_per_s=1e4, dense_flops_per_s=1e3)
    # Prompt 2 tokens, 3 outputs: contexts 2, 3, 4. Prompt 5, 1 output: context 5.
    roofline = offline_roofline(cost, [2, 5], [3, 1], spec)
    assert roofline.decode_steps == 3
    assert roofline.decode_bytes == 3 * 1000 + (2 + 3 + 4 + 5) * 10
    # Linear: 7 prompt tokens; causal pairs: 2*3/2 + 5*6/2 = 18; one logit row per prompt.
    assert roofline.prefill_flops == 7 * 100 + 18 * 7 + 2 * 50
    assert roofline.seconds == pytest.approx(3140 / 1e4 + 926 / 1e3)
    assert roofline.output_tok_s == pytest.approx(4 / roofline.seconds)
    with pytest.raises(ValueError, match="max_tokens"):
        offline_roofline(cost, [2, 5], [3], spec)


def test_gpu_spec_lookup() -> None:
    assert gpu_spec_for("auto", "NVIDIA H100 80GB HBM3") is GPU_SPECS["h100"]
    assert gpu_spec_for("auto", "NVIDIA H200") is GPU_SPECS["h200"]
    assert gpu_spec_for("auto", "cpu") is GPU_SPECS["h200"]
    assert gpu_spec_for("a100").hbm_bytes_per_s == pytest.approx(2.039e12)
    with pytest.raises(ValueError, match="b200"):
        gpu_spec_for("b200")


def test_bench_throughput_end_to_end_on_cpu(tiny_dir: str, tmp_path: Path) -> None:
    out_json = tmp_path / "throughput.json"
    result = run_sluice("bench", "throughput", "--model", tiny_dir, "--device", "cpu",
                        "--num-requests", "5", "--max-input-len", "40", "--max-output-len", "12",
                        "--repeat-cached", "1", "--output", str(out_json))
    assert result.returncode == 0, result.stderr
    envelope = read_record(out_json, "throughput")
    record = envelope["results"]
    assert THROUGHPUT_KEYS <= set(record)
    # The second run of the same prompts, cache kept, is served their full blocks.
    first, second = record["runs"]
    assert first["prefix_cache"] == "reset" and first["cached_prompt_tokens"] == 0
    assert first["output_tok_s"] == pytest.approx(record["output_tok_s"])
    assert second["prefix_cache"] == "kept" and second["cached_prompt_tokens"] > 0
    assert "run 2 (prefix cache kept)" in result.stdout
    workload = nano_vllm_workload(5, 40, 12)
    assert record["num_requests"] == 5
    assert record["prompt_tokens"] == workload.prompt_tokens
    assert record["output_tokens"] == workload.output_tokens
    assert record["device"] == "cpu" and record["model"] == tiny_dir
    assert record["seconds"] > 0 and record["output_tok_s"] > 0
    assert record["output_tok_s"] == pytest.approx(record["output_tokens"] / record["seconds"])
    assert record["total_tok_s"] == pytest.approx(
        (workload.prompt_tokens + workload.output_tokens) / record["seconds"])
    assert record["roofline_tok_s"] > 0
    assert record["roofline_fraction"] == pytest.approx(
        record["output_tok_s"] / record["roofline_tok_s"])
    assert record["hf_tok_s"] is None and record["ratio_vs_hf"] is None
    assert envelope["command"][3:5] == ["--model", tiny_dir]
    assert "output tok/s" in result.stdout and "roofline (NVIDIA H200 spec" in result.stdout


def test_bench_latency_end_to_end_on_cpu(tiny_dir: str, tmp_path: Path) -> None:
    out_json = tmp_path / "latency.json"
    result = run_sluice("bench", "latency", "--model", tiny_dir, "--device", "cpu",
                        "--batch-sizes", "1,3", "--input-len", "8", "--output-len", "5",
                        "--prefill-lens", "16,40", "--num-iters", "2", "--output", str(out_json))
    assert result.returncode == 0, result.stderr
    record = read_record(out_json, "latency")["results"]
    assert [d["batch_size"] for d in record["decode"]] == [1, 3]
    for d in record["decode"]:
        assert d["itl_ms"] > 0 and d["t_out_s"] > 0 and d["t_1_s"] > 0
        step_s = max(d["t_out_s"] - d["t_1_s"], 1e-9) / 4
        assert d["itl_ms"] == pytest.approx(1e3 * step_s)
        assert d["output_tok_s"] == pytest.approx(d["batch_size"] / step_s)
    assert [p["prefill_len"] for p in record["prefill"]] == [16, 40]
    assert all(p["ttft_ms"] > 0 for p in record["prefill"])
    assert record["device"] == "cpu" and record["num_iters"] == 2
    assert "ITL (ms/token)" in result.stdout and "TTFT (ms)" in result.stdout


def test_bench_profile_of_one_request_on_cpu(tiny_dir: str, tmp_path: Path) -> None:
    # One request: fewer than the four of the warm-up.
    out_json = tmp_path / "profile.json"
    result = run_sluice("bench", "profile", "--model", tiny_dir, "--device", "cpu",
                        "--num-requests", "1", "--max-input-len", "12", "--max-output-len", "6",
                        "--profile-steps", "2", "--profile-at", "1", "--output", str(out_json))
    assert result.returncode == 0, result.stderr
    record = read_record(out_json, "profile")["results"]
    assert record["phases_s"]["engine_step_total"] > 0
    [window] = record["profiler_windows"]  # the worker's torch.profiler over steps 1 and 2
    assert window["first_step"] == 1 and window["steps"] == 2
    assert window["top_host_ops"] and "ranks" not in window


def test_bench_profile_of_fixed_lengths_with_the_host_profile(tiny_dir: str,
                                                              tmp_path: Path) -> None:
    out_json = tmp_path / "profile.json"
    result = run_sluice("bench", "profile", "--model", tiny_dir, "--device", "cpu",
                        "--num-requests", "2", "--max-input-len", "10", "--max-output-len", "5",
                        "--fixed-lengths", "--profile-steps", "0", "--host-profile", "5",
                        "--output", str(out_json))
    assert result.returncode == 0, result.stderr
    record = read_record(out_json, "profile")["results"]
    assert record["output_tokens"] == 10 and record["steps"] == 5  # one prefill, four decodes
    assert {"launch.prepare", "launch.sample"} <= set(record["phases_s"])
    functions = record["host_functions"]
    assert len(functions["by_own_time"]) == 5
    assert functions["by_cumulative_time"][0]["cum_ms_per_step"] > 0


def test_bench_latency_rejects_bad_arguments(tiny_dir: str) -> None:
    result = run_sluice("bench", "latency", "--model", tiny_dir, "--device", "cpu",
                        "--output-len", "1")
    assert result.returncode == 2
    assert "output_len" in result.stderr and "Traceback" not in result.stderr
    with pytest.raises(ValueError, match="batch_sizes"):
        parse_sizes("batch_sizes", "1,0")
    with pytest.raises(ValueError, match="prefill_lens"):
        parse_sizes("prefill_lens", "a")
    assert parse_sizes("batch_sizes", "1, 64") == [1, 64]


@pytest.mark.parametrize("workload", ["continue", "repeat", "random"])
def test_bench_spec_end_to_end_on_cpu(tiny_dir: str, tmp_path: Path, workload: str) -> None:
    out_json = tmp_path / "spec.json"
    result = run_sluice("bench", "spec", "--model", tiny_dir, "--device", "cpu",
                        "--dtype", "float32", "--workload", workload, "--batch-sizes", "1,2",
                        "--input-len", "48", "--segment-len", "12", "--output-len", "12",
                        "--num-iters", "1", "--output", str(out_json))
    assert result.returncode == 0, result.stderr
    record = read_record(out_json, "spec")["results"]
    assert record["speculative_config"]["method"] == "ngram"
    # The drafting policy's defaults, filled in: what the engine ran.
    assert record["speculative_config"]["disable_by_batch_size"] == 2
    assert [p["batch_size"] for p in record["points"]] == [1, 2]
    for p in record["points"]:
        assert p["speedup"] == pytest.approx(p["decode_tok_s"] / p["baseline_decode_tok_s"])
        assert p["tokens_equal"] == 1.0  # float32 greedy: speculation changes nothing
        assert 0 <= p["num_accepted_tokens"] <= p["num_draft_tokens"]
        assert p["num_draft_tokens"] <= 4 * p["num_drafts"]
        assert p["acceptance_rate"] == pytest.approx(
            p["num_accepted_tokens"] / p["num_draft_tokens"] if p["num_draft_tokens"] else 0)
        num_steps = (p["num_steps_drafting"] + p["num_steps_off_batch_size"]
                     + p["num_steps_off_acceptance"])
        assert num_steps >= p["num_drafts"] / p["batch_size"] and num_steps > 0
        assert p["drafting_step_fraction"] == pytest.approx(p["num_steps_drafting"] / num_steps)
        assert p["tokens_per_step"] == pytest.approx(11 / num_steps)  # one run of 12 tokens
    # Batch 2 reaches disable_by_batch_size: no drafts, every step off for the batch size.
    two = record["points"][1]
    assert two["num_draft_tokens"] == 0 and two["num_steps_drafting"] == 0
    assert two["num_steps_off_batch_size"] == 11  # one token a step after the prefill's
    assert two["tokens_per_step"] == 1.0
    assert "speed-up" in result.stdout and "speculative:" in result.stdout
    assert "drafted" in result.stdout


@pytest.mark.parametrize("workload", ["copy", "chat"])
def test_bench_spec_on_real_text_prompts(tiny_dir: str, tmp_path: Path, workload: str) -> None:
    """The text workloads render their conversations with the model's chat template and let
    replies end at EOS: the figures count the tokens the replies have."""
    from sluice.bench.text_prompts import conversations

    out_json = tmp_path / "spec.json"
    result = run_sluice("bench", "spec", "--model", tiny_dir, "--device", "cpu",
                        "--dtype", "float32", "--workload", workload, "--batch-sizes", "1,3",
                        "--output-len", "12", "--num-iters", "1", "--output", str(out_json))
    assert result.returncode == 0, result.stderr
    record = read_record(out_json, "spec")["results"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    for point in record["points"]:
        batch = conversations(workload, point["batch_size"])
        prompt_lens = [len(tokenizer.apply_chat_template(c, add_generation_prompt=True,
                                                         tokenize=True, return_dict=False))
                       for c in batch]
        assert point["mean_prompt_len"] == pytest.approx(sum(prompt_lens) / len(batch))
        assert 1 <= point["mean_output_len"] <= 12 and point["tokens_equal"] == 1.0
        assert point["speedup"] == pytest.approx(point["decode_tok_s"]
                                                 / point["baseline_decode_tok_s"])
    assert f"workload {workload}: chat prompts of" in result.stdout


def test_bench_spec_none_measures_two_engines_without_speculation(tiny_dir: str,
                                                                   tmp_path: Path) -> None:
    """The A/A run: the benchmark's noise floor, the same alternation as a real comparison.
    24 output tokens: with 6, a loaded 2-core CI machine once timed a run to 6 tokens no longer
    than its run to 1 token, and the clamped decode time broke the ratio."""
    out_json = tmp_path / "spec.json"
    result = run_sluice("bench", "spec", "--model", tiny_dir, "--device", "cpu",
                        "--dtype", "float32", "--workload", "random", "--batch-sizes", "2",
                        "--input-len", "16", "--output-len", "24", "--num-iters", "2",
                        "--bench-speculative-config", "none", "--output", str(out_json))
    assert result.returncode == 0, result.stderr
    record = read_record(out_json, "spec")["results"]
    assert record["speculative_config"] is None
    (point,) = record["points"]
    assert point["tokens_equal"] == 1.0 and "num_drafts" not in point
    assert point["speedup"] == pytest.approx(point["decode_tok_s"]
                                             / point["baseline_decode_tok_s"])


def test_bench_spec_rejects_a_bad_speculative_config(tiny_dir: str) -> None:
    result = run_sluice("bench", "spec", "--model", tiny_dir, "--device", "cpu",
                        "--bench-speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 4, '
                        '"disable_by_batch_size": 1}')
    assert result.returncode == 2
    assert "speculative_config.disable_by_batch_size must be an integer >= 2" in result.stderr
    assert "Traceback" not in result.stderr


def test_bench_spec_rejects_a_segment_longer_than_the_prompt(tiny_dir: str) -> None:
    result = run_sluice("bench", "spec", "--model", tiny_dir, "--device", "cpu",
                        "--input-len", "16", "--segment-len", "16")
    assert result.returncode == 2
    assert "segment_len must be in [1, input_len)" in result.stderr
    assert "Traceback" not in result.stderr


def test_hf_continuous_batching_config_is_benchmarks_md() -> None:
    assert unavailable_reason() is None  # transformers 5 here
    config = continuous_batching_config()
    page_size = getattr(config, "page_size", None) or config.block_size
    assert page_size == 256
    assert config.max_batch_tokens == 16384
    assert config.use_cuda_graph is True


def test_hf_baseline_generates_every_requested_token_on_cpu(tiny_dir: str) -> None:
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    max_tokens = [7, 12]
    # A small cache and batch: the default's [16384, 16384 + N] attention masks cost GBs on CPU.
    result = measure_hf_baseline(tiny_dir, prompts, max_tokens, torch.float32,
                                 torch.device("cpu"), max_batch_tokens=256, num_blocks=4)
    assert result.unavailable_reason is None
    assert result.output_tokens == 19
    assert result.seconds > 0 and result.output_tok_s == pytest.approx(19 / result.seconds)
    assert "sdpa" in result.attn_implementation


def test_unavailable_hf_baseline_is_reported_not_raised() -> None:
    result = HFBaselineResult("4.40.0", unavailable_reason="transformers 4.40.0 has no "
                              "continuous batching API")
    assert result.output_tok_s is None
    results = {
        "model": "m", "architecture": "Qwen3ForCausalLM", "dtype": "bfloat16", "device": "cpu",
        "num_requests": 1, "prompt_tokens": 10, "output_tokens": 5, "seconds": 1.0,
        "output_tok_s": 5.0, "total_tok_s": 15.0,
        "gpu_spec": {"name": "NVIDIA H200", "hbm_bytes_per_s": 4.8e12,
                     "dense_flops_per_s": 989e12},
        "roofline_tok_s": 100.0, "roofline_seconds": 0.05, "roofline_fraction": 0.05,
        "hf_tok_s": result.output_tok_s, "hf_unavailable_reason": result.unavailable_reason,
    }
    record = {"command": ["sluice", "bench", "throughput"],
              "machine": {"hostname": "h", "gpu": None, "cpus": 2, "torch": "2"},
              "results": results}
    text = format_throughput(record, hf_requested=True)
    assert "HF baseline unavailable: transformers 4.40.0 has no continuous batching API" in text
    assert "reached 5.0%" in text


def test_bench_structured_end_to_end_on_cpu(tiny_dir: str, tmp_path: Path) -> None:
    from sluice.bench.structured import constrained_rows, parse_fractions

    assert constrained_rows(10, 0.5) == {0, 2, 4, 6, 8}
    assert constrained_rows(10, 0.0) == set() and len(constrained_rows(7, 1.0)) == 7
    assert parse_fractions("0.5") == [0.0, 0.5]
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        parse_fractions("1.5")
    out_json = tmp_path / "structured.json"
    result = run_sluice("bench", "structured", "--model", tiny_dir, "--device", "cpu",
                        "--num-requests", "6", "--max-input-len", "40", "--max-output-len", "16",
                        "--output", str(out_json))
    assert result.returncode == 0, result.stderr
    record = read_record(out_json, "structured")["results"]
    first, half = record["runs"]
    assert (first["fraction"], first["num_constrained"], first["ratio_vs_unconstrained"]) == (
        0.0, 0, 1.0)
    assert (half["fraction"], half["num_constrained"]) == (0.5, 3)
    assert half["constrained_valid_prefixes"] == 3
    assert half["ratio_vs_unconstrained"] == pytest.approx(
        half["output_tok_s"] / first["output_tok_s"])
    assert first["output_tokens"] == nano_vllm_workload(6, 40, 16).output_tokens
    assert "50% json_schema (3 requests" in result.stdout and "x of 0%" in result.stdout
