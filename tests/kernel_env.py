"""Triton interpreter switch (and interpreter fixes) for the kernel tests.

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is decorated, i.e. when
``dspine.ops.*`` is first imported, so this module must be imported before any kernel module:
each ``tests/test_kernels_*.py`` imports it first, and ``tests/conftest.py`` should import it too
so that other test modules that import the kernels see the same setting.

Rule: with no CUDA device, Triton kernels run in the interpreter on CPU tensors; with a CUDA
device they are compiled for real (the CPU-interpreter tests then skip; ``-m gpu`` runs the CUDA
ones).

Triton 3.6's interpreter has three bugs that the compiled kernels do not have; they are patched
here, for the interpreter only:
  * a scalar used as a ``range`` bound goes through ``int(ndarray)``, which NumPy >= 2.4 refuses
    for the 1-element arrays that stand for scalars there;
  * fp32 -> bf16 casts truncate instead of rounding to nearest even (the GPU rounds);
  * ``tl.dot`` on bf16 operands multiplies their raw uint16 bit patterns.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _patch_interpreter() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_dspine_patched", False):
        return
    interpreter._dspine_patched = True

    # 1. scalars as loop bounds
    patch_lang_tensor = interpreter._patch_lang_tensor

    def patched_lang_tensor(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched_lang_tensor

    # 2. fp32 -> bf16 with round-to-nearest-even (bf16 is held as uint16 bit patterns)
    convert_float = interpreter._convert_float

    def patched_convert_float(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            f32 = np.ascontiguousarray(data).view(np.float32).copy()
            bits = torch.from_numpy(f32).to(torch.bfloat16).view(torch.int16).numpy()
            return bits.view(np.uint16).reshape(np.shape(data))
        return convert_float(data, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = patched_convert_float

    # 3. bf16 dot operands: decode the bit patterns to fp32 first (exact)
    create_dot = interpreter.InterpreterBuilder.create_dot

    def to_f32(h):
        if h.dtype == tl.bfloat16:
            data = convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return h

    def patched_create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, to_f32(a), to_f32(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = patched_create_dot


if INTERPRET:
    try:
        _patch_interpreter()
    except ImportError:  # no triton: only the impl="torch" tests run
        pass
