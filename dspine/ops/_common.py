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

__all__ = ["HAS_TRITON", "triton", "tl", "next_pow2", "block_d", "num_sms", "dot_precision", "check_impl",
           "tile_counters"]


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


# Arrival counters of the kernels whose last program of a tile finishes what the tile's split programs began
# (``linear``'s fused reduce): one int32 per tile, zero between launches (the last program resets its tile's),
# one buffer per (device, stream), since launches on one stream never overlap. Buffers are never freed: a CUDA
# graph captured with one keeps its address.
_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []
_MIN_COUNTERS = 1 << 14


def tile_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """A zeroed int32 buffer of at least ``n`` tile counters for launches on ``device``'s current stream, or
    None where none can be made now (a CUDA graph is being captured on a stream that has none or too few:
    the caller then takes its unfused path). Grown to the next power of two (at least 16,384) when too small;
    the old buffer is kept alive for graphs that hold its address."""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        key = ("cuda", idx, torch.cuda.current_stream(idx).cuda_stream)
    else:
        key = (device.type, device.index, 0)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if buf is not None:
        _RETIRED.append(buf)
    buf = torch.zeros(max(_MIN_COUNTERS, next_pow2(n)), dtype=torch.int32, device=device)
    _COUNTERS[key] = buf
    return buf
