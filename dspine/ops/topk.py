"""The top-k token ids of a sampling step in sampling order, in one pass over the vocabulary.

Op: for logits ``x [R, V]`` (bf16, fp16 or fp32), a temperature T > 0 and 1 <= k <= V, the ids of the k
largest ``s = fp32(x) * fp32(1 / T)`` per row, in sampling order: higher score first, the lower id among
equal scores (``dspine.sampling``: top-k keeps exactly k tokens, ties at the k-th score going to the lower
ids). Returns ``ids [R, k]`` int64, exactly ``dspine.sampling``'s torch path: ``topk`` over int64 keys
``monotone(bits(s)) · 2^32 + (2^32 - 1 - id)``, all distinct, so the set and its order are unique.

Why: at T > 0 every verified row goes through this cut (the target's ``B·W`` rows of a chain step, the draft's
``B·(W - 1)``, the B rows of an AR step). ``torch.topk`` over the int64 keys is a radix select of 2-bit digits,
32 passes over the row's 8-byte keys, after the passes that build them (the H100 times per row and per chain step:
docs/status.md, "The top-k cut at T > 0 in one kernel"; ``results/topk-h100.json``).

Kernel: grid (R, C), C = ceil(V / CHUNK). Program (r, c) loads chunk c of row r once, makes the keys in
registers and takes its k largest in k rounds (a max over the chunk, stored, then masked out; the keys are
distinct, so one lane leaves per round); padded lanes hold the smallest int64. The row's k largest keys are
among the C·k stored (each is among the k largest of its own chunk), so a ``topk`` over those ``[R, C·k]`` keys
(a few KB per row instead of V·8 bytes) gives the answer, largest first, and the ids are the keys' low 32 bits
complemented. Work: R·V·k compare-selects in registers, one read of the logits.

The temperature: ``s = fp32(x) * fp32(1 / T)`` on every device and path (``dspine.sampling.scaled_scores``):
CUDA's torch computes ``x / T`` for a Python-float T as that product, the CPU as an IEEE division, which can
part in the last bit.
"""

from __future__ import annotations

import functools
import math
import struct

import torch

from ._common import pick_impl, tl, triton

__all__ = ["topk_ids", "order_keys", "inv_temperature"]

CHUNK = 2048  # vocabulary entries per program
TOPK_MAX = 256  # largest k the kernel takes (k rounds per chunk: dspine.sampling.TOP_K_FAST_MAX)


@functools.lru_cache(maxsize=64)
def inv_temperature(temperature: float) -> float:
    """``fp32(1 / fp32(T))`` as a Python float: the factor every sampling path scales fp32 logits by (the
    division in double, then rounded to fp32: the correctly rounded fp32 quotient, since 53 >= 2 · 24 + 2)."""
    t = _f32(float(temperature))
    return _f32(1.0 / t)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@triton.jit
def _chunk_topk_kernel(X, Out, V, stride_x, inv_t, k, n_chunks, CHUNK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    v = c.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    ok = v < V
    s = tl.load(X + r * stride_x + v, mask=ok, other=0.0).to(tl.float32) * inv_t + 0.0  # + 0.0: -0 -> +0
    bits = s.to(tl.int32, bitcast=True)
    mono = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int32 order = float order
    key = mono.to(tl.int64) * 4294967296 + (4294967295 - v)
    lowest = -9223372036854775807 - 1
    key = tl.where(ok, key, lowest)
    out = Out + (r * n_chunks + c) * k
    for i in range(0, k):  # the chunk's k largest, largest first (keys are distinct: one lane leaves per round)
        top = tl.max(key, axis=0)
        tl.store(out + i, top)
        key = tl.where(key == top, lowest, key)


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys ``[..., V]`` of fp32 ``scores`` in sampling order (higher score first, the lower id among
    equal scores; all distinct): the fp32 bits made monotone as for a radix sort of floats in the high 32 bits,
    the complemented id in the low 32."""
    bits = (scores + 0.0).view(torch.int32)  # + 0.0: -0 -> +0, equal scores get equal bits
    mono = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    ids = torch.arange(scores.shape[-1], device=scores.device)
    return mono.mul_(1 << 32).add_(0xFFFFFFFF - ids)  # in place: one int64 [..., V] buffer


def _topk_ids_torch(x: torch.Tensor, inv_t: float, k: int) -> torch.Tensor:
    return order_keys(x.float() * inv_t).topk(k, dim=-1).indices


def _topk_ids_triton(x: torch.Tensor, inv_t: float, k: int) -> torch.Tensor:
    R, V = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    if R == 0:
        return torch.empty(0, k, dtype=torch.int64, device=x.device)
    n_chunks = triton.cdiv(V, CHUNK)
    cand = torch.empty(R, n_chunks * k, dtype=torch.int64, device=x.device)
    _chunk_topk_kernel[(R, n_chunks)](x, cand, V, x.stride(0), inv_t, k, n_chunks, CHUNK=CHUNK, num_warps=8)
    keys = cand if n_chunks == 1 else cand.topk(k, dim=-1).values  # largest first: sampling order
    return 0xFFFFFFFF - (keys & 0xFFFFFFFF)


def topk_ids(logits: torch.Tensor, temperature: float, k: int, impl: str = "torch") -> torch.Tensor:
    """The k ids of ``logits [..., V]`` (bf16 / fp16 / fp32) with the largest ``fp32(logits) * fp32(1 / T)``,
    in sampling order (module docstring) -> ``[..., k]`` int64.

    Raises:
        ValueError: a 0-d input, V = 0, another dtype, T not finite and > 0 (with 1/T finite in fp32), k not an
            int in 1..V, or k > ``TOPK_MAX`` with ``impl="triton"``.
    """
    fn = pick_impl(impl, _topk_ids_triton, _topk_ids_torch)
    if logits.dim() < 1 or logits.shape[-1] == 0 or logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"topk_ids needs logits [..., V] with V >= 1 in bf16/fp16/fp32, got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    V = logits.shape[-1]
    try:
        inv = inv_temperature(temperature) if math.isfinite(temperature) and temperature > 0 else 0.0
    except (OverflowError, ZeroDivisionError):  # T beyond fp32's range, or below its smallest subnormal
        inv = 0.0
    if not (0.0 < inv < math.inf):
        raise ValueError(f"topk_ids: temperature {temperature} must be > 0 and finite, with 1/T finite in fp32")
    if isinstance(k, bool) or not 1 <= k <= V:
        raise ValueError(f"topk_ids: k = {k} outside 1..{V} (the vocabulary)")
    if impl == "triton" and k > TOPK_MAX:
        raise ValueError(f"topk_ids: k = {k} > {TOPK_MAX}, the kernel's largest (use impl='torch')")
    lead = logits.shape[:-1]
    return fn(logits.reshape(-1, V), inv, k).view(*lead, k)
