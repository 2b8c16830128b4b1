"""The `sluice` command as a user runs it, in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


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


def test_generate_without_a_model_uses_the_built_in_tiny_model(tmp_path: Path) -> None:
    env = {"SLUICE_CACHE_DIR": str(tmp_path / "cache")}
    out = run_sluice("generate", "--max-tokens", "4", "--json", "--device", "cpu", env=env)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout.splitlines()[0])["token_ids"]) <= 4
    assert (tmp_path / "cache" / "tiny-qwen3" / "config.json").is_file()


def test_bad_arguments_exit_with_a_clear_error(tmp_path: Path) -> None:
    out = run_sluice("generate", "--model", str(tmp_path / "missing"))
    assert out.returncode == 2
    assert "missing" in out.stderr and "Traceback" not in out.stderr
    out = run_sluice("make-model", str(tmp_path / "m"), "--arch", "gpt9")
    assert out.returncode == 2
    assert "gpt9" in out.stderr
    out = run_sluice("generate", "--model", str(tmp_path / "missing"), "--top-p", "7")
    assert out.returncode == 2 and "top_p" in out.stderr
