#!/usr/bin/env bash
# Wheels of sluice's runtime dependencies that a GPU image with PyTorch, transformers, numpy,
# safetensors, tokenizers, jinja2, tqdm, httpx, prometheus_client and xxhash usually lacks, for
# a machine with no network (CPython 3.12, x86-64 manylinux), at the versions this checkout's
# .venv holds:
#
#     bash benchmarks/tools/offline_wheels.sh DIR          # here, with the package registry
#     python3 -m pip install --no-index --no-deps --target /tmp/ssite DIR/*.whl   # there
#     PYTHONPATH=/tmp/ssite:$PWD python3 -m sluice serve ...
#
# fastapi >= 0.16x imports opentelemetry-api; aiohttp's own dependencies (multidict, yarl,
# frozenlist, aiosignal, propcache, aiohappyeyeballs, attrs) are left to the image.
set -euo pipefail
out="${1:?usage: offline_wheels.sh DIR}"
cd "$(dirname "$0")/../.."
names=(msgspec pyzmq fastapi starlette pydantic pydantic_core annotated-types annotated-doc
       typing-inspection uvicorn httptools xgrammar gguf aiohttp opentelemetry-api)
specs=()
for name in "${names[@]}"; do
  version=$(.venv/bin/python -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  specs+=("$name${version:+==$version}")
done
platforms=()
for p in manylinux_2_17 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 \
         manylinux_2_31 manylinux_2_34 manylinux_2_35 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" --platform any -d "$out" "${specs[@]}"
ls "$out"
