"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter when no GPU is
present. `triton.jit` reads TRITON_INTERPRET when a kernel module is imported, so it is set here,
at conftest import, before any test module imports the kernels."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

    from triton.runtime import interpreter

    # Triton 3.6's interpreter turns a run-time loop bound into a python int with
    # int(1-element array), which numpy >= 2.4 refuses (triton-lang/triton#9171, fixed after
    # 3.6 by converting the single element instead). Same fix, applied around its patcher.
    _patch_lang_tensor = interpreter._patch_lang_tensor

    def _patch_lang_tensor_with_scalar_index(tensor, scope) -> None:
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_lang_tensor_with_scalar_index
