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
The patches replace private functions of ``triton.runtime.interpreter``, so they are applied only to
the versions they were tested with (TESTED_TRITON, the range pinned in pyproject.toml) and only when
those functions exist; otherwise the interpreted kernel tests skip with the reason in
``TRITON_CPU_SKIP`` (the torch reference paths and the GPU tests still run).
"""

import os
import re

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
TESTED_TRITON = ((3, 6), (3, 9))  # inclusive: the GPU image has 3.6, CI installs the newest (3.9 today)
PATCHED = ("_patch_lang_tensor", "_convert_float", "InterpreterBuilder.create_dot", "TensorHandle")


def interpreter_problem() -> str | None:
    """Why the interpreter fixes cannot be applied to the installed triton (None: they can)."""
    try:
        import triton
        from triton.runtime import interpreter
    except ImportError as e:
        return f"triton is not importable ({e})"
    version = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
    lo, hi = TESTED_TRITON
    if not lo <= version <= hi:
        return (f"triton {triton.__version__} is outside the tested range {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}: the "
                "interpreter fixes in tests/kernel_env.py patch private functions of those versions")
    missing = [name for name in PATCHED if not _has(interpreter, name)]
    if missing:
        return f"triton {triton.__version__}'s interpreter lacks {missing}, which tests/kernel_env.py patches"
    return None


def _has(obj, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


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


# Triton kernels on the CPU (interpreter, patched): the reason they skip, or None when they run.
TRITON_CPU_SKIP = "needs TRITON_INTERPRET=1 (no CUDA GPU)" if not INTERPRET else interpreter_problem()
if INTERPRET and TRITON_CPU_SKIP is None:
    _patch_interpreter()
TRITON_CPU = TRITON_CPU_SKIP is None
