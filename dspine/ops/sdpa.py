"""``F.scaled_dot_product_attention`` without PyTorch's cuDNN backend.

On an H200 with torch 2.11, SDPA picks the cuDNN backend for bf16 attention, and cuDNN builds an
execution plan for every new (batch, heads, query length, key length) shape: about 2 ms of host time
per call, 30 such calls for one prefill of a 30-layer target: a new length took 4.8 × a repeated one's prefill
time, 1.4 × with cuDNN left out (flash, memory-efficient or math, in torch's order; docs/status.md,
results/prefill-h200.json, ``benchmarks/engine/bench_prefill.py``). Every request of a server has a new length,
and so had every first pass of ``infer.bench`` over a task (its order effect, docs/status.md, the benchmark order bias).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

#: SDPBackend names :func:`sdpa` allows on CUDA, in torch's priority order; None = torch's own choice
#: (cuDNN included). Benchmarks switch it (benchmarks/engine/bench_prefill.py); code should not.
BACKENDS: tuple[str, ...] | None = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def backends_context(device: torch.device):
    """A context that limits SDPA (and torch's attention ops that follow its backend flags) to
    :data:`BACKENDS` on a CUDA ``device``; a no-op context on the CPU or with ``BACKENDS = None``.

    It switches torch's process-wide backend flags for its duration (``torch.nn.attention.sdpa_kernel``)
    and restores them on exit, about 12 µs of host time each way: enter it once around a prefill, not per
    call. Not thread-safe (neither is the engine): another thread's SDPA inside it sees the same flags."""
    if device.type != "cuda" or BACKENDS is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, b) for b in BACKENDS])


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)`` (same shapes, dtypes and result), limited to
    the :data:`BACKENDS` on CUDA tensors (cuDNN left out); on the CPU the call is unchanged.

    Raises what SDPA raises (e.g. RuntimeError when none of the allowed backends takes the inputs)."""
    with backends_context(q.device):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
