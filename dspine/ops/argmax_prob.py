"""Argmax and its softmax probability in one pass over the vocabulary: the planner's greedy confidence.

Op: for logits ``x [R, V]`` (bf16, fp16 or fp32), ``idx[r] = argmax_v x[r, v]`` (the lowest v among
equal maxima, as ``torch.argmax``) and ``p[r] = softmax(x[r])[idx[r]] = 1 / Σ_v exp(x[r, v] - max_v x[r, v])``
in fp32 (the online-softmax recurrence of Milakov & Gimelshein 2018: a running max and a sum rescaled
whenever the max grows).

Why: with ``--budget auto`` at T = 0 the engine needs the draft's argmax (its tokens) and that token's
probability (``dspine.ops.plan_stats.chain_confidence``) at every draft slot, ``R = B·15`` rows of V = 49,152 (SmolLM2) to
151,936 (Qwen3). The torch path, ``argmax`` plus ``softmax(x, dtype=float32).amax``, reads the bf16 logits
three to four times and writes and reads an fp32 copy, about 7 passes of R·V·2 bytes; the kernel reads
them once. On the H200 the planner's greedy chain step ran 0.86 × the fixed chain's at batch 64 with the
torch path (results/planner-loop-h200.json), the fixed chain computing the argmax only.

Layouts: x ``[R, V]`` with unit stride over V; returns ``(idx [R] int64, p [R] fp32)``. Grid (R, S): program
(r, c) loops over chunk c of V (``CHUNK`` tiles of BLOCK) with per-lane max, sum and index, reduced across lanes;
with S = 1 it stores the row's result, else its chunk's (max, sum at that max, lowest index of that max) and a
second launch, one program per row, combines the S chunks the same way. S is chosen so that R·S reaches
``PROGRAMS`` (a few per SM of an H100/H200) when V has that many tiles: with one program per row, the B·15
rows of a greedy chain step at batch 1-8 kept 15-120 SMs walking 24 tiles of SmolLM2's vocabulary one after
the other (device times per row count, split and unsplit: results/argmax-prob-h100.json; docs/status.md).
Numerics: fp32 accumulation; ``p`` equals the torch path's up to fp32 rounding of the sum (summation
order), ``idx`` equals ``torch.argmax`` exactly for rows without NaN. A NaN never wins here (torch's
argmax returns it); the engine raises on non-finite draft logits anyway (``nonfinite``).
"""

from __future__ import annotations

import torch

from ._common import pick_impl, tl, triton

__all__ = ["argmax_prob"]

BLOCK = 2048
PROGRAMS = 512  # programs a launch aims at (R·S), when the vocabulary has enough tiles to split


@triton.jit
def _argmax_prob_kernel(X, Idx, P, PM, PS, V, stride_x, CHUNK, S, BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    lo = c.to(tl.int64) * CHUNK * BLOCK
    hi = tl.minimum(lo + CHUNK * BLOCK, V)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # per-lane running max
    s = tl.zeros([BLOCK], tl.float32)  # per-lane Σ exp(x - m)
    best_i = tl.zeros([BLOCK], tl.int64)
    for t in range(0, CHUNK):
        v = lo + t * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        x = tl.load(X + r * stride_x + v, mask=v < hi, other=float("-inf")).to(tl.float32)
        better = x > m  # strict: within a lane the lower id keeps a tie
        new_m = tl.where(better, x, m)
        ref = tl.where(new_m == float("-inf"), 0.0, new_m)  # no -inf - -inf: a lane still all -inf adds exp(-inf) = 0
        s = s * tl.exp(m - ref) + tl.exp(x - ref)
        best_i = tl.where(better, v, best_i)
        m = new_m
    top = tl.max(m, axis=0)
    idx = tl.min(tl.where(m == top, best_i, V), axis=0)  # across lanes: the lowest id of the maxima
    total = tl.sum(s * tl.exp(m - tl.where(top == float("-inf"), 0.0, top)), axis=0)
    if SPLIT:  # chunk c's max, its sum at that max and its lowest argmax, for _argmax_prob_combine
        tl.store(PM + r * S + c, top)
        tl.store(PS + r * S + c, total)
        tl.store(Idx + r * S + c, idx)
    else:
        tl.store(Idx + r, tl.minimum(idx, V - 1))  # an all--inf or NaN row: a valid id
        tl.store(P + r, 1.0 / total)


@triton.jit
def _argmax_prob_combine(PM, PS, PI, Idx, P, V, S, SB: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, SB)
    ok = j < S
    m = tl.load(PM + r * S + j, mask=ok, other=float("-inf"))
    s = tl.load(PS + r * S + j, mask=ok, other=0.0)
    i = tl.load(PI + r * S + j, mask=ok, other=V)
    top = tl.max(m, axis=0)
    idx = tl.min(tl.where(m == top, i, V), axis=0)  # the lowest id among the chunks holding the maximum
    total = tl.sum(s * tl.exp(m - tl.where(top == float("-inf"), 0.0, top)), axis=0)
    tl.store(Idx + r, tl.minimum(idx, V - 1))
    tl.store(P + r, 1.0 / total)


def _argmax_prob_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    R, V = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    idx = torch.empty(R, dtype=torch.int64, device=x.device)
    p = torch.empty(R, dtype=torch.float32, device=x.device)
    if R == 0:
        return idx, p
    tiles = triton.cdiv(V, BLOCK)
    chunk = triton.cdiv(tiles, min(tiles, max(1, triton.cdiv(PROGRAMS, R))))  # tiles per program
    S = triton.cdiv(tiles, chunk)
    if S == 1:
        _argmax_prob_kernel[(R, 1)](x, idx, p, p, p, V, x.stride(0), chunk, 1, BLOCK=BLOCK, SPLIT=False, num_warps=8)
        return idx, p
    pm = torch.empty(R * S, dtype=torch.float32, device=x.device)
    ps = torch.empty(R * S, dtype=torch.float32, device=x.device)
    pi = torch.empty(R * S, dtype=torch.int64, device=x.device)
    _argmax_prob_kernel[(R, S)](x, pi, p, pm, ps, V, x.stride(0), chunk, S, BLOCK=BLOCK, SPLIT=True, num_warps=8)
    _argmax_prob_combine[(R,)](pm, ps, pi, idx, p, V, S, SB=triton.next_power_of_2(S), num_warps=1)
    return idx, p


def _argmax_prob_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.argmax(-1), torch.softmax(x, -1, dtype=torch.float32).amax(-1)


def argmax_prob(logits: torch.Tensor, impl: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """``(argmax, its softmax probability)`` over the last dim (module docstring): logits ``[..., V]`` bf16 /
    fp16 / fp32 -> ``(idx [...] int64, p [...] fp32)``. Raises ValueError on a 0-d input, V = 0 or another
    dtype."""
    fn = pick_impl(impl, _argmax_prob_triton, _argmax_prob_torch)
    if logits.dim() < 1 or logits.shape[-1] == 0 or logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"argmax_prob needs logits [..., V] with V >= 1 in bf16/fp16/fp32, got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    lead = logits.shape[:-1]
    idx, p = fn(logits.reshape(-1, logits.shape[-1]))
    return idx.view(lead), p.view(lead)
