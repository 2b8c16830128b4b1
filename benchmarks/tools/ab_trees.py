"""A/B two source trees of sluice with one `sluice bench` command, runs alternated.

    python benchmarks/tools/ab_trees.py --base DIR --new DIR [--pairs 3]
        [--metric decode[batch_size].itl_ms] [--output JSON] -- bench latency --batch-sizes 1,4

Each run is `python -m sluice <command> --output <tmp>.json` started in the tree's own folder
(so `sluice` is that tree's package: `python -m` puts the working folder first on the path),
one after the other: pair i runs new then base when i is even, base then new when it is odd, so
that a drift of the machine's speed lands on both alike. The metric is read from each run's
results (a record's `results`, or the whole file of a tree from before the record schema):
`FIELD`, `A.B` (nested), or `LIST[KEY].FIELD` (one value per element of LIST, labelled by its
KEY: `decode[batch_size].itl_ms` gives `bench latency`'s ITL per batch size). Prints each pair's
new / base ratio per label and their median; `--output` writes a record (sluice.bench.record)
of every run's values, the ratios and both trees' git revisions.

A CUDA machine's engines differ from start to start by a few percent, so compare trees within
one call (one start), never across calls. Only for speed, never for output: the trees' greedy
outputs are checked by the tests and `scripts/gpu_check.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_LIST_PATH = re.compile(r"^(?P<list>\w+)\[(?P<key>\w+)\]\.(?P<field>[\w.]+)$")


def read_metric(record: dict[str, Any], metric: str) -> dict[str, float]:
    """{label: value} of `metric` in a bench JSON record (see the module)."""
    match = _LIST_PATH.match(metric)
    if match:
        items = record.get(match["list"])
        if not isinstance(items, list):
            raise ValueError(f"metric {metric!r}: {match['list']!r} is not a list in the record")
        return {str(item[match["key"]]): float(_dig(item, match["field"], metric))
                for item in items}
    return {metric: float(_dig(record, metric, metric))}


def _dig(obj: Any, path: str, metric: str) -> Any:
    for part in path.split("."):
        if not isinstance(obj, dict) or part not in obj:
            raise ValueError(f"metric {metric!r}: no {part!r} in the record")
        obj = obj[part]
    return obj


def git_revision(tree: Path) -> str | None:
    result = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                            text=True)
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None


def run_once(tree: Path, command: list[str], timeout_s: float) -> dict[str, Any]:
    """One `python -m sluice <command>` from `tree`; the JSON it wrote."""
    with tempfile.TemporaryDirectory(prefix="sluice-ab-") as tmp:
        out = os.path.join(tmp, "record.json")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
        result = subprocess.run([sys.executable, "-m", "sluice", *command, "--output", out],
                                cwd=tree, env=env, capture_output=True, text=True,
                                timeout=timeout_s)
        if result.returncode != 0 or not os.path.exists(out):
            tail = (result.stderr or result.stdout)[-2000:]
            raise RuntimeError(f"{tree}: sluice {' '.join(command)} exited with status "
                               f"{result.returncode}:\n{tail}")
        with open(out) as f:
            return json.load(f)


def results_of(data: dict[str, Any]) -> dict[str, Any]:
    """A record's results; a tree from before the record schema wrote its results bare."""
    return data["results"] if str(data.get("schema", "")).startswith("sluice.bench/") else data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, type=Path, help="the tree to compare against")
    parser.add_argument("--new", required=True, type=Path, help="the tree under test")
    parser.add_argument("--pairs", type=int, default=2, help="runs of each tree (default 2)")
    parser.add_argument("--metric", default="decode[batch_size].itl_ms",
                        help="what to read from each run's JSON (see the module)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take")
    parser.add_argument("--output", help="write every value and ratio here (JSON)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="after --: the sluice command, e.g. bench latency --batch-sizes 1")
    ns = parser.parse_args(argv)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        parser.error("give the sluice command after --, e.g. -- bench latency")
    if ns.pairs < 1:
        parser.error(f"--pairs must be >= 1, got {ns.pairs}")
    trees = {"new": ns.new.resolve(), "base": ns.base.resolve()}
    for name, tree in trees.items():
        if not (tree / "sluice" / "__init__.py").is_file():
            parser.error(f"--{name} {tree} holds no sluice package")

    runs: list[dict[str, Any]] = []
    pairs: list[dict[str, float]] = []
    machine: dict[str, Any] | None = None  # the runs' machine, from the first record holding it
    for i in range(ns.pairs):
        order = ["new", "base"] if i % 2 == 0 else ["base", "new"]
        values: dict[str, dict[str, float]] = {}
        for name in order:
            data = run_once(trees[name], command, ns.timeout)
            if machine is None and "schema" in data:
                machine = data["machine"]
            values[name] = read_metric(results_of(data), ns.metric)
            runs.append({"pair": i, "tree": name, "values": values[name]})
            print(f"pair {i} {name:>4}: " + "  ".join(
                f"{label}={value:.4g}" for label, value in values[name].items()), flush=True)
        pairs.append({label: values["new"][label] / values["base"][label]
                      for label in values["new"] if values["base"].get(label)})
    labels = list(pairs[0])
    medians = {label: statistics.median(p[label] for p in pairs if label in p)
               for label in labels}
    print("new / base, per pair: " + "  ".join(
        f"{label}: " + "/".join(f"{p[label]:.3f}" for p in pairs if label in p)
        + f" (median {medians[label]:.3f})" for label in labels))
    if ns.output:
        from sluice.bench.record import make_record, write_record

        record = make_record("ab-trees", {
            "sluice_command": ["sluice", *command], "metric": ns.metric,
            "trees": {name: {"path": str(tree), "git": git_revision(tree)}
                      for name, tree in trees.items()},
            "runs": runs, "ratios_new_over_base": pairs, "median_ratio": medians},
            command=["python", "benchmarks/tools/ab_trees.py", *(sys.argv[1:] if argv is None
                                                                 else argv)])
        if machine:
            record["machine"] = machine
        write_record(ns.output, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
