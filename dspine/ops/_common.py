"""Small helpers shared by the kernel files: optional Triton import and block-size choices.

Triton is optional: every op has an ``impl="torch"`` path that must run on a CPU-only install.
When Triton is missing, ``triton.jit`` becomes the identity and ``tl.constexpr`` a placeholder, so
the kernel files still import; calling ``impl="triton"`` then raises.
"""

from __future__ import annotations

import functools
import types

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install: the torch references still work
    HAS_TRITON = False
    triton = types.SimpleNamespace(jit=lambda fn=None, **_: fn if fn is not None else (lambda f: f))
    tl = types.SimpleNamespace(constexpr=object)

__all__ = ["HAS_TRITON", "triton", "tl", "next_pow2", "block_d", "num_sms", "dot_precision", "check_impl"]


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def block_d(head_dim: int) -> int:
    """Padded head dim for tl.dot: a power of two and >= 16 (D = 8, 80, 96 are masked)."""
    return max(16, next_pow2(head_dim))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (host-side property, no sync); 4 for the interpreter."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 products for fp32 inputs (Triton's default is TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_impl(impl: str) -> None:
    if impl not in ("triton", "torch"):
        raise ValueError(f"impl must be 'triton' or 'torch', got {impl!r}")
    if impl == "triton" and not HAS_TRITON:
        raise RuntimeError("impl='triton' needs the triton package; use impl='torch'")
