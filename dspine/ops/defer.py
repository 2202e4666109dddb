"""Deferred draft-context features: the planner's AR step keeps its target features for a later append.

Op (before the step's commit, so ``done`` says which rows the step serves): for every live row b
(``done[b] == 0``), ``pend_feats[b·F + pend_count[b]] = feats[b]`` while ``pend_count[b] < F`` (a row past
F writes nothing: the host flushes before that happens), then ``pend_count[b] += 1`` and ``lengths[b] += 1``.
Idle rows change nothing. ``infer.engine.Engine._ar_step`` and ``_flush_step`` describe the protocol.

Why: the torch path is 7 small kernels (the live mask, the bound, the row index, a ``where``, the
``index_copy`` and two increments), about 2.5 µs each inside a CUDA graph, which made the planner's AR step
slower than the plain AR step at SmolLM2 size; this one kernel closed the gap (results/planner-ar-h200.json).

Layouts: feats ``[B, D]`` (unit stride over D, any float dtype, that of pend_feats); done ``[B]`` int8/int32/bool;
pend_feats ``[B·F + 1, D]`` contiguous (the last row is the torch path's scratch row for idle rows);
pend_count, lengths ``[B]`` int32. Grid (B,), each program copies its row in BLOCK tiles.
Exactness: a copy; the Triton and torch paths leave identical ``pend_feats[:B·F]``, counts and lengths.
"""

from __future__ import annotations

import torch

from ._common import pick_impl, tl, triton

__all__ = ["defer_features"]

BLOCK = 1024


@triton.jit
def _defer_kernel(Feats, Done, Pend, Count, Lengths, D, F, stride_f, stride_p, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    live = tl.load(Done + b).to(tl.int32) == 0
    c = tl.load(Count + b)
    keep = live & (c < F)
    row = Pend + (b * F + c.to(tl.int64)) * stride_p
    n = tl.where(keep, D, 0)  # elements to copy: the row, or none
    for d0 in range(0, D, BLOCK):
        d = d0 + tl.arange(0, BLOCK)
        m = d < n
        tl.store(row + d, tl.load(Feats + b * stride_f + d, mask=m), mask=m)
    tl.store(Count + b, c + 1, mask=live)
    tl.store(Lengths + b, tl.load(Lengths + b) + 1, mask=live)


def _check(feats, done, pend_feats, pend_count, lengths, F):
    B = feats.shape[0] if feats.dim() == 2 else -1
    if feats.dim() != 2 or pend_feats.dim() != 2 or pend_feats.shape != (B * F + 1, feats.shape[1]):
        raise ValueError(f"defer_features: feats must be [B, D] and pend_feats [B·F + 1, D] (F = {F}), got "
                         f"{tuple(feats.shape)} and {tuple(pend_feats.shape)}")
    for name, t in (("done", done), ("pend_count", pend_count), ("lengths", lengths)):
        if tuple(t.shape) != (B,):
            raise ValueError(f"defer_features: {name} must be [{B}], got {tuple(t.shape)}")
    if pend_count.dtype != torch.int32 or lengths.dtype != torch.int32:
        raise ValueError(f"defer_features: pend_count and lengths must be int32, got {pend_count.dtype}, "
                         f"{lengths.dtype}")
    if feats.dtype != pend_feats.dtype:
        raise ValueError(f"defer_features: feats {feats.dtype} and pend_feats {pend_feats.dtype} differ")


def _defer_triton(feats, done, pend_feats, pend_count, lengths, F):
    B, D = feats.shape
    feats = feats if feats.stride(-1) == 1 else feats.contiguous()
    if B > 0:
        _defer_kernel[(B,)](feats, done, pend_feats, pend_count, lengths, D, F, feats.stride(0),
                            pend_feats.stride(0), BLOCK=BLOCK, num_warps=4)


def _defer_torch(feats, done, pend_feats, pend_count, lengths, F):
    B = feats.shape[0]
    live = done == 0
    base = torch.arange(B, dtype=torch.int64, device=feats.device) * F
    idx = torch.where(live & (pend_count < F), base + pend_count, pend_feats.shape[0] - 1)
    pend_feats.index_copy_(0, idx, feats)  # idle rows (and a row past F) into the scratch row
    pend_count.add_(live)
    lengths.add_(live)


def defer_features(feats: torch.Tensor, done: torch.Tensor, pend_feats: torch.Tensor, pend_count: torch.Tensor,
                   lengths: torch.Tensor, F: int, impl: str = "triton") -> None:
    """Keep one AR step's target features ``feats [B, D]`` for the rows that ``done [B]`` marks live, in place
    (module docstring): ``pend_feats [B·F + 1, D]`` row ``b·F + pend_count[b]`` (while ``pend_count[b] < F``),
    ``pend_count [B]`` and ``lengths [B]`` (int32) + 1. No host sync (CUDA-graph safe). Returns None; raises
    ValueError on shapes or dtypes."""
    fn = pick_impl(impl, _defer_triton, _defer_torch)
    _check(feats, done, pend_feats, pend_count, lengths, F)
    fn(feats, done, pend_feats, pend_count, lengths, F)
