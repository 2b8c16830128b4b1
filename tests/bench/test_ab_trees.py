"""benchmarks/tools/ab_trees.py: two trees' `sluice bench` runs alternated, a metric read from
each."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from sluice.model.tiny import make_tiny_model

pytestmark = pytest.mark.one_worker

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ab_trees",
                                               REPO / "benchmarks" / "tools" / "ab_trees.py")
ab_trees = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_trees)


def test_metric_paths_read_lists_by_key_and_nested_fields() -> None:
    record = {"decode": [{"batch_size": 1, "itl_ms": 0.9}, {"batch_size": 64, "itl_ms": 1.5}],
              "timeline": {"span_s": 0.48}, "output_tok_s": 27000}
    assert ab_trees.read_metric(record, "decode[batch_size].itl_ms") == {"1": 0.9, "64": 1.5}
    assert ab_trees.read_metric(record, "timeline.span_s") == {"timeline.span_s": 0.48}
    assert ab_trees.read_metric(record, "output_tok_s") == {"output_tok_s": 27000.0}
    with pytest.raises(ValueError, match="'decode.itl_ms': no 'itl_ms'"):
        ab_trees.read_metric(record, "decode.itl_ms")
    with pytest.raises(ValueError, match="'output_tok_s' is not a list"):
        ab_trees.read_metric(record, "output_tok_s[batch_size].x")


def test_two_trees_alternate_and_their_ratios_are_written(tmp_path: Path) -> None:
    model = make_tiny_model(str(tmp_path / "model"))
    base = tmp_path / "base"
    shutil.copytree(REPO / "sluice", base / "sluice",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "ab.json"
    command = ["--", "bench", "latency", "--model", model, "--device", "cpu", "--batch-sizes",
               "1,2", "--input-len", "8", "--output-len", "4", "--prefill-lens", "16",
               "--num-iters", "1"]
    assert ab_trees.main(["--base", str(base), "--new", str(REPO), "--pairs", "2",
                          "--output", str(out), *command]) == 0
    record = json.loads(out.read_text())
    assert record["schema"] == "sluice.bench/1" and record["bench"] == "ab-trees"
    assert record["machine"]["device"] == "cpu"  # the runs' machine, from their records
    report = record["results"]
    assert [(r["pair"], r["tree"]) for r in report["runs"]] == [
        (0, "new"), (0, "base"), (1, "base"), (1, "new")]
    assert all(set(r["values"]) == {"1", "2"} and min(r["values"].values()) > 0
               for r in report["runs"])
    assert len(report["ratios_new_over_base"]) == 2 and set(report["median_ratio"]) == {"1", "2"}
    assert report["trees"]["base"]["path"] == str(base.resolve())
    assert report["sluice_command"][:3] == ["sluice", "bench", "latency"]

    # A run that fails names its tree and shows the command's error.
    with pytest.raises(RuntimeError, match=f"{base.resolve()}: sluice bench latency .*status 2"):
        ab_trees.main(["--base", str(base), "--new", str(base), "--pairs", "1", "--",
                       "bench", "latency", "--batch-sizes", "x"])


def test_a_base_tree_from_before_the_record_schema_is_read_whole() -> None:
    latency = {"decode": [{"batch_size": 1, "itl_ms": 0.9}]}
    assert ab_trees.results_of(latency) is latency
    record = {"schema": "sluice.bench/1", "results": latency}
    assert ab_trees.read_metric(ab_trees.results_of(record), "decode[batch_size].itl_ms") == {
        "1": 0.9}


def test_a_tree_without_the_package_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        ab_trees.main(["--base", str(tmp_path), "--new", str(REPO), "--", "bench", "latency"])
