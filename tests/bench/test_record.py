"""sluice.bench.record: the one JSON layout every benchmark writes (benchmarks/README.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.bench import record

REPO = Path(__file__).resolve().parents[2]


def test_a_record_wraps_the_results_in_the_envelope_and_reads_back(tmp_path: Path) -> None:
    results = {"decode": [{"batch_size": 1, "itl_ms": 0.88}]}
    made = record.make_record("latency", results, device="cpu",
                              command=["sluice", "bench", "latency", "--batch-sizes", "1"])
    assert list(made) == ["schema", "bench", "command", "date", "git", "sluice_version",
                          "machine", "results"]
    assert made["schema"] == record.SCHEMA == "sluice.bench/1"
    assert made["bench"] == "latency" and made["results"] is results
    assert made["date"].endswith("+00:00")  # UTC
    assert made["machine"]["device"] == "cpu" and made["machine"]["gpu"] is None
    assert record.command_text(made) == "sluice bench latency --batch-sizes 1"
    path = tmp_path / "nested" / "latency.json"
    record.write_record(path, made)
    assert json.loads(path.read_text()) == made
    assert record.read_results(path) == results


def test_a_file_from_before_the_schema_is_read_whole_and_a_bare_dict_is_not_written(
        tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"command": "sluice bench throughput", "output_tok_s": 26755}))
    assert record.read_results(old)["output_tok_s"] == 26755
    with pytest.raises(ValueError, match="not a sluice.bench/1 record"):
        record.write_record(tmp_path / "bare.json", {"output_tok_s": 1.0})
    with pytest.raises(ValueError, match="name of its benchmark"):
        record.make_record("", {})


def test_the_command_is_written_as_it_is_typed() -> None:
    package = REPO / "sluice"
    assert record.command_line([str(package / "__main__.py"), "bench", "spec"]) == [
        "sluice", "bench", "spec"]
    assert record.command_line(["/venv/bin/sluice", "serve"]) == ["sluice", "serve"]
    assert record.command_line([str(package / "bench" / "kernels.py"), "--sweep"]) == [
        "python", "-m", "sluice.bench.kernels", "--sweep"]
    assert record.command_line(["scripts/gpu_check.py", "OUT", "--only", "default"]) == [
        "python", "scripts/gpu_check.py", "OUT", "--only", "default"]


def test_git_revision_names_the_commit_and_a_dirty_tree(tmp_path: Path) -> None:
    assert record.git_revision(tmp_path) is None  # not a checkout
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f.txt").write_text("a\n")
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    assert record.git_revision(tmp_path) == head
    (tmp_path / "f.txt").write_text("b\n")
    assert record.git_revision(tmp_path) == head + "-dirty"


def test_the_record_module_imports_no_torch() -> None:
    """The HTTP load generators write records too, and must start without PyTorch."""
    code = ("import sys; from sluice.bench.record import machine; m = machine('cuda'); "
            "print('torch' in sys.modules, 'torch' in m, sorted(m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout.split(maxsplit=2)
    assert out[:2] == ["False", "False"]
    assert all(key in out[2] for key in ("hostname", "platform", "python", "cpus", "gpu"))


def test_the_machine_names_the_gpu_of_a_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    names: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name",
                        lambda device: names.append(device) or "NVIDIA H200")
    info = record.machine(torch.device("cuda", 1))
    assert (info["device"], info["gpu"], info["num_gpus"]) == ("cuda:1", "NVIDIA H200", 2)
    assert names == [torch.device("cuda", 1)] and info["torch"] == torch.__version__
    assert record.machine("cpu")["gpu"] is None  # the CPU names no GPU
