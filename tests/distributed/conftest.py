"""Models for the tensor-parallel tests: the shared tiny ones (4 query heads, 2 KV heads, a vocab
of 643 that 2 and 4 do not divide), and one with a single KV head (multi-query attention: every
rank holds a copy of it), Qwen2-shaped so that its replicated k/v carry a bias."""

from __future__ import annotations

import pytest

from tests.tiny_models import save_hf_model


@pytest.fixture(scope="session")
def mqa_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_hf_model(str(tmp_path_factory.mktemp("hf-qwen2-mqa")), "qwen2", seed=1,
                         num_key_value_heads=1)


@pytest.fixture(scope="session")
def tp_model_dirs(hf_model_dirs: dict[str, str], mqa_dir: str) -> dict[str, str]:
    return {**hf_model_dirs, "qwen2_mqa": mqa_dir}
