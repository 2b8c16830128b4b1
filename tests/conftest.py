"""Shared fixtures: tiny random models saved by Hugging Face transformers (float32), with the
built-in byte-level BPE tokenizer, loaded by sluice through the same loader as real folders."""

from __future__ import annotations

import os

import pytest
import torch

# Keep tests on the CPU and deterministic whatever machine runs them.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One pytest-xdist worker of N (scripts/test.sh) gets its share of the cores: more threads than
# cores would only make the workers take turns.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

ARCHS = ("qwen3", "llama", "qwen2")

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


def save_hf_model(out_dir: str, arch: str, seed: int = 0, **overrides: object) -> str:
    """Build a tiny transformers model of `arch`, save it with its tokenizer, return the folder."""
    import transformers

    from sluice.model.tiny import build_tokenizer

    tokenizer = build_tokenizer(out_dir)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    if arch == "qwen3":
        config = transformers.Qwen3Config(**common, tie_word_embeddings=True)
        model_cls = transformers.Qwen3ForCausalLM
    elif arch == "llama":
        config = transformers.LlamaConfig(
            **common, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
        model_cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=False)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def hf_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {arch: save_hf_model(str(tmp_path_factory.mktemp(f"hf-{arch}")), arch)
            for arch in ARCHS}


@pytest.fixture(scope="session")
def qwen3_dir(hf_model_dirs: dict[str, str]) -> str:
    return hf_model_dirs["qwen3"]
