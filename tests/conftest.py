"""Shared fixtures: tiny random models saved by Hugging Face transformers (float32), with the
built-in byte-level BPE tokenizer, loaded by sluice through the same loader as real folders
(tests/tiny_models.py); and which tests may run beside others (the markers below)."""

from __future__ import annotations

import os

import pytest
import torch

# One factory of tiny models for every test (tests/tiny_models.py); named here too for the
# tests that take them from the conftest.
from tests.tiny_models import ARCHS, save_hf_model

# Keep tests on the CPU and deterministic whatever machine runs them.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One pytest-xdist worker of N (scripts/test.sh) gets its share of the cores: more threads than
# cores would only make the workers take turns.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

# Which tests may share the machine: scripts/test.sh runs every test not marked `serial` on two
# pytest-xdist workers at nice 19, and beside them the `serial` ones one at a time at normal
# priority (servers, clusters, kills and heartbeats, whose bounds assume the CPU when they need
# it; tests that must act while a PD transfer is under way hold it with
# SLUICE_PD_FAULT_SEND_HOLD_FILE rather than race a delay). A test file says so itself:
#   pytestmark = pytest.mark.serial      a time bound, a race window a busy CPU could close, a
#                                        fixed resource: its tests run alone
#   pytestmark = pytest.mark.one_worker  its tests start processes (commands, servers, ranks)
#                                        but have no time bound: they run on one worker (an
#                                        xdist_group), so its module-scoped servers start once
# and a test of a one_worker file that has a time bound is marked serial itself. Unmarked
# files (in-process tests with no time bound) run on either worker.


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    grouped = []
    for item in items:
        if item.get_closest_marker("serial") is None and item.get_closest_marker("one_worker"):
            item.add_marker(pytest.mark.xdist_group(item.path.relative_to(config.rootpath)
                                                    .as_posix()))
            grouped.append(item)
    # The files' groups are the longest units of work: handed out first, none is left to run
    # alone at the end while the other worker idles.
    first = set(grouped)
    items[:] = grouped + [item for item in items if item not in first]


@pytest.fixture(scope="session")
def hf_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {arch: save_hf_model(str(tmp_path_factory.mktemp(f"hf-{arch}")), arch)
            for arch in ARCHS}


@pytest.fixture(scope="session")
def qwen3_dir(hf_model_dirs: dict[str, str]) -> str:
    return hf_model_dirs["qwen3"]
