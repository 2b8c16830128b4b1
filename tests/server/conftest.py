"""`sluice serve` as users run it (sluice/testing/instances.py): a subprocess on a free loopback
port (--port 0, read back from its log), on the CPU with the tiny float32 model of
tests/conftest.py, and an offline `LLM` reference with the same engine settings in the test
process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice import LLM
from sluice.testing.instances import Instance, ServerError, launch_serve

ENGINE_KWARGS: dict[str, Any] = dict(dtype="float32", max_model_len=1024, block_size=8, seed=0,
                                     device="cpu")
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "1024", "--block-size", "8", "--seed",
                "0", "--device", "cpu"]
START_TIMEOUT_S = 120.0
# The server tests' handle on a server: the one launcher's (sluice/testing/instances.py).
ServerProcess = Instance


def launch_server(model_dir: str | None, log_path: Path, *extra: str,
                  env: dict[str, str] | None = None) -> ServerProcess:
    """`sluice serve` of `model_dir` (None: the built-in model) with ENGINE_FLAGS and `extra`,
    up and healthy."""
    try:
        return launch_serve(model_dir, log_path, *ENGINE_FLAGS, *extra,
                            timeout_s=START_TIMEOUT_S, env=env)
    except ServerError as e:
        pytest.fail(f"sluice serve did not start: {e}")


@pytest.fixture(scope="session")
def server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the plain-API tests, shared across modules (tests read counter deltas)."""
    started = launch_server(qwen3_dir, tmp_path_factory.mktemp("server") / "server.log",
                            "--served-model-name", "tiny", "tiny-alias")
    yield started
    assert started.stop() == 0, started.log()[-4000:]


@pytest.fixture
def make_server(qwen3_dir: str, tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Servers a test may break; each is stopped when the test ends."""
    started: list[ServerProcess] = []

    def make(*extra: str) -> ServerProcess:
        started.append(launch_server(qwen3_dir, tmp_path / f"server-{len(started)}.log",
                                     *extra))
        return started[-1]

    yield make
    for s in started:
        s.stop(10.0)


@pytest.fixture(scope="session")
def reference(qwen3_dir: str) -> LLM:
    return LLM(model=qwen3_dir, **ENGINE_KWARGS)


# Qwen3's chat template in its parts that matter here (tools in the system turn, assistant
# tool_calls and reasoning in the history, tool results, enable_thinking), plus two test hooks:
# a tool result shows its tool_call_id, and `think_in_prompt` opens a <think> for the model (as
# templates of thinking-only models do), so a random model's reply is all reasoning.
TOOL_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou are provided with function signatures within <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object within '
    '<tool_call></tool_call> XML tags.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content %}
{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}
{%- endif %}
{{- message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}
{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response id="' + message.tool_call_id + '">\\n' }}
{{- message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- if think_in_prompt is defined and think_in_prompt %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""


@pytest.fixture(scope="session")
def tool_model_dir(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The test model with TOOL_TEMPLATE as its chat template."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("tool-model")
    shutil.copytree(qwen3_dir, out, dirs_exist_ok=True)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOL_TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(out)

