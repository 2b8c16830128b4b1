"""A sliding-window model behind `sluice serve`: /debug/engine shows the blocks the window let
the KV cache manager free (its scheduler counters), the cache intact and every block back, and
the completion is the offline engine's. Mistral (every layer windowed) and Gemma 3 (a windowed
layer and a global one: the hybrid KV cache, whose windowed group frees and global group keeps
every block)."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest

from sluice import LLM, SamplingParams
from tests.server.conftest import ENGINE_KWARGS, launch_server
from tests.server.test_openai_server import wait_for_idle_engine
from tests.tiny_models import save_hf_model

pytestmark = pytest.mark.one_worker

WINDOW, BLOCK = 20, 8


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_debug_engine_shows_the_blocks_a_window_frees(tmp_path: Path, arch: str) -> None:
    folder = save_hf_model(str(tmp_path / arch), arch, sliding_window=WINDOW)
    prompt = [random.Random(0).randrange(3, 600) for _ in range(90)]
    max_tokens = 60
    llm = LLM(model=folder, **ENGINE_KWARGS, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    [want] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    llm.shutdown()

    server = launch_server(folder, tmp_path / "server.log", "--max-num-batched-tokens", "16")
    try:
        body = {"model": folder, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == want.outputs[0].text
        scheduler = wait_for_idle_engine(server)
        info = server.engine_info()
        assert info["integrity"] == "ok"
        assert scheduler["num_free_blocks"] == scheduler["num_blocks"]
        full_context = -(-(len(prompt) + max_tokens) // BLOCK)  # 19 blocks of 8
        # The window before a 16-token chunk, the chunk, a block boundary either side: 6;
        # Gemma 3's global group keeps all 19 beside them.
        kept = full_context if arch == "gemma3" else 0
        assert scheduler["peak_blocks_per_request"] <= kept + -(-(WINDOW - 1 + 16) // BLOCK) + 1
        assert scheduler["num_window_freed_blocks"] >= full_context - 6
    finally:
        # a loaded 2-core box can take more than the default 5 s to end the engine process
        assert server.stop(grace_s=30) == 0, server.log()[-4000:]
