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
    import functools
    import inspect

    _patch_lang = interpreter._patch_lang
    _patched_by_launch: list[set[int]] = []

    class _NothingPatched:
        def restore(self) -> None:
            pass

    @functools.cache
    def _lang_module_ids(fn) -> frozenset[int]:
        return frozenset(id(value) for value in fn.__globals__.values()
                         if inspect.ismodule(value) and value in (tl, tl.core))

    def _lang_modules(fn) -> set[int]:
        return set(_lang_module_ids(fn))

    def _patch_lang_once_per_launch(fn):
        langs = _lang_modules(fn)
        if _patched_by_launch:  # a nested call inside a launch
            if langs <= _patched_by_launch[-1]:
                return _NothingPatched()
            # A module the launch's kernel does not name (tl.core, seen from a helper's module):
            # patched once, then counted as patched (never restored, as before).
            _patched_by_launch[-1].update(langs)
            return _patch_lang(fn)
        scope = _patch_lang(fn)  # a launch: restored when it ends
        _patched_by_launch.append(langs)
        restore = scope.restore

        def restore_and_forget() -> None:
            _patched_by_launch.pop()
            restore()

        scope.restore = restore_and_forget
        return scope

    interpreter._patch_lang = _patch_lang_once_per_launch

    # The interpreter maps a Triton dtype to a numpy one by building a dict of 17 entries at
    # every call (143,000 calls in one qk_norm_rope test); the map never changes.
    # (Block and pointer types are unhashable: the cache is of the scalar element types.)
    _np_dtype_of_scalar = functools.cache(interpreter._get_np_dtype)
    _POINTER_NP_DTYPE = np.dtype(np.uint64)

    def _get_np_dtype_cached(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return _POINTER_NP_DTYPE
        return _np_dtype_of_scalar(tt_dtype)

    interpreter._get_np_dtype = _get_np_dtype_cached

    # Every tl.tuple (a shape, a program's arguments: about a million in one qk_norm_rope test)
    # builds its type's printed name, which only error messages and the compiler's mangling
    # read: built when read instead.
    def _tuple_type_init(self, types, fields=None):
        self.types = types
        self.fields = fields or [""] * len(types)

    def _tuple_type_name(self) -> str:
        return "[" + ",".join(f"{k}:{v}" for k, v in zip(self.fields, self.types)) + "]"

    tl.core.tuple_type.__init__ = _tuple_type_init
    tl.core.tuple_type.name = property(_tuple_type_name)
