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

    # Its float8 conversions truncate the mantissa and flush subnormals, where a GPU (and
    # torch) rounds to nearest even and keeps them: an 8-bit KV cache's values would differ from
    # the reference's by design. Conversions to and from the float8 types go through torch
    # instead.
    import numpy as np
    import triton.language as tl

    _convert_float = interpreter._convert_float
    _TORCH_FLOATS = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16,
                     tl.float16: torch.float16, tl.float8e4nv: torch.float8_e4m3fn,
                     tl.float8e5: torch.float8_e5m2}
    _FLOAT8 = {tl.float8e4nv, tl.float8e5}

    def _convert_float_as_torch_does(input, input_dtype, output_dtype, rounding_mode):
        if _FLOAT8 & {input_dtype, output_dtype} and {
                input_dtype, output_dtype} <= _TORCH_FLOATS.keys():
            bits = np.frombuffer(input.tobytes(), dtype=f"uint{input_dtype.primitive_bitwidth}")
            source = torch.from_numpy(bits.copy()).view(_TORCH_FLOATS[input_dtype])
            converted = source.to(_TORCH_FLOATS[output_dtype])
            width = output_dtype.primitive_bitwidth
            unsigned = {8: torch.uint8, 16: torch.uint16, 32: torch.uint32}[width]
            return converted.view(unsigned).numpy().reshape(np.shape(input))
        return _convert_float(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = _convert_float_as_torch_does

    # A launch patches triton.language for the interpreter (its builtins bound to the
    # interpreter's semantic) and restores it at the end; each call of a nested @triton.jit
    # function inside the launch patches the same modules again, to the same effect, and that
    # re-patching (inspect.getmembers over triton.language, for every call of every program)
    # was about an eighth of a kernel test's time (6.5 -> 5.7 s for one qk_norm_rope case).
    # A nested call whose modules the running launch has already patched now skips it.
    import inspect

    _patch_lang = interpreter._patch_lang
    _patched_by_launch: list[frozenset[int]] = []

    class _NothingPatched:
        def restore(self) -> None:
            pass

    def _lang_modules(fn) -> frozenset[int]:
        return frozenset(id(value) for value in fn.__globals__.values()
                         if inspect.ismodule(value) and value in (tl, tl.core))

    def _patch_lang_once_per_launch(fn):
        langs = _lang_modules(fn)
        if _patched_by_launch:  # a nested call inside a launch
            if langs <= _patched_by_launch[-1]:
                return _NothingPatched()
            return _patch_lang(fn)  # never restored, as before (the launch's restore undoes it)
        scope = _patch_lang(fn)  # a launch: restored when it ends
        _patched_by_launch.append(langs)
        restore = scope.restore

        def restore_and_forget() -> None:
            _patched_by_launch.pop()
            restore()

        scope.restore = restore_and_forget
        return scope

    interpreter._patch_lang = _patch_lang_once_per_launch
