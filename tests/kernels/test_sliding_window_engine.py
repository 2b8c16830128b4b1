"""The engine with the Triton backend (under the interpreter on a CPU) over a windowed Mistral
whose blocks behind the window are freed and handed to other requests: the kernels read real
block tables with stale entries before each window, and the greedy ids are transformers'."""

from __future__ import annotations

from pathlib import Path

from sluice import LLM
from sluice.engine.core_proc import make_scheduler_stats
from tests.engine.test_sliding_window import PROMPTS, greedy, reference
from tests.tiny_models import save_hf_model


def test_triton_kernels_over_freed_blocks_give_transformers_ids(tmp_path: Path) -> None:
    folder = save_hf_model(str(tmp_path / "mistral-w20"), "mistral", sliding_window=20)
    prompts, max_tokens = [PROMPTS[1], PROMPTS[3][:64], PROMPTS[4][:60]], 24
    # 12 usable blocks of 8 for 3 requests of up to 11: the requests take each other's freed
    # blocks.
    llm = LLM(model=folder, dtype="float32", block_size=8, max_model_len=96,
              max_num_batched_tokens=16, attention_backend="triton",
              num_gpu_blocks_override=13)
    assert llm.llm_engine.engine_core.executor.model_runner.attn_backend.name == "triton"
    assert greedy(llm, prompts, max_tokens) == reference(folder, prompts, max_tokens)
    assert make_scheduler_stats(llm.llm_engine.engine_core).num_window_freed_blocks > 0
    manager = llm.llm_engine.kv_cache_manager
    manager.check_integrity()
    assert manager.get_num_free_blocks() == manager.block_pool.num_blocks - 1
    llm.shutdown()
