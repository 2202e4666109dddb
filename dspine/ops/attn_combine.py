"""Combine split-K attention partials (flash-decoding's second pass).

Op: an attention row whose keys were split over NS programs has, per split s, a running max
``m_s`` (log2 domain, i.e. of scores already multiplied by scale·log2 e), a sum ``l_s = Σ 2^(x−m_s)``
and an unnormalised ``acc_s = Σ 2^(x−m_s) v``. The exact result is
``Σ_s 2^(m_s−M) acc_s / Σ_s 2^(m_s−M) l_s`` with ``M = max_s m_s``. A split that saw no visible
key stores ``m = −1e30, l = 0, acc = 0`` and so weighs 0. [Dao et al., "Flash-Decoding", 2023]

Layouts: part_acc [B·Hkv, NS, G·T, D] fp32; part_m, part_l [B·Hkv, NS, G·T] fp32 (contiguous); packed
row r = t·G + g (query head h = kvh·G + g). out [B, T, Hq, D] (any strides, last dim contiguous),
written in its own dtype.
Constraints: every row must have at least one visible key in some split (true for the callers);
any D (padded to a power of two ≥ 16 and masked); any NS, though the unordered kernel holds all of
a row's splits at once (the callers' split plans give NS ≤ 64; exact mode, ordered, may give more).

Kernel: grid (B·Hkv·cdiv(G·T, BLOCK_R),); a program merges BLOCK_R consecutive packed rows of one
(b, kv head): m and l as [BLOCK_S, BLOCK_R] tiles, acc as one [BLOCK_S, BLOCK_R, BLOCK_D] tile in
the partials' memory order (BLOCK_S = next_pow2(NS); every load issued at once), reduced over the
split axis, stored as [BLOCK_R, BLOCK_D]. BLOCK_R: the largest power of two ≤ 16 and ≤ next_pow2(G·T)
whose acc tile holds ≤ 4096 fp32 (1 for wide tiles, e.g. NS > 16 at D = 128); one warp per 4096
elements of the tile (128 fp32 per thread). Why: the reduction over the split axis of a 3-D tile spread over
several warps is slow; one warp was the fastest at every shape of the H200 sweep (unordered kernel, rows per
program × warps: results/combine-sweep-h200.json; docs/status.md, "its warps").
Memory traffic: reads NS·(D+2)·4 bytes and writes D·sizeof(out) bytes per row (at Qwen3-8B's batch-8
speculative step, B·Hkv = 64, G·T = 64, NS = 3, D = 128: 6.4 MB read, 1.0 MB written).

``ordered=True`` (exact mode): the splits are merged one after the other in split order with the
online-softmax update ``M' = max(M, m_s)``, ``L' = L·2^(M−M') + l_s·2^(m_s−M')``, same for acc,
starting from (−1e30, 0, 0). A split with no visible key is then an exact no-op (factors 1 and 0)
and a row's result depends only on its own splits, not on NS or on which program merged it. Its
kernel loops over the splits with [BLOCK_R, BLOCK_D] tiles; every operation is elementwise per row
(no fp contraction), so a row's bits do not depend on BLOCK_R or on its neighbours. BLOCK_R: 4 rows (or
fewer where G·T is smaller), 4 warps. Measured in the same sweep: the previous 16 rows per program took 10.2 µs at
batch 1's shape (B·Hkv = 8: 32 programs for 132 SMs) against 4.8 µs with 4 rows (best 4.7 µs), and at the batch-8
shape 3.3 µs against 2.9 µs (best 2.8 µs); at the batch-8 decode shape (G·T = 4) every setting took 1.8 µs.
"""

from __future__ import annotations

import torch

from ._common import next_pow2, pdl_enter, pdl_kwargs, pick_impl, tl, triton

__all__ = ["combine_partials"]

_MAX_ROWS = 16  # rows per program
_TILE = 4096  # fp32 elements of the unordered kernel's acc tile per program, and per warp (128 per thread)
_ORDERED_ROWS = 4  # rows per program of the ordered kernel (4 warps; module docstring)


@triton.jit
def _combine_ordered_kernel(
    Acc, M, L, Out,
    stride_ob, stride_ot, stride_oh,
    Hkv, NS, TG, NUM_RB,
    G: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    bh = pid // NUM_RB
    b = (bh // Hkv).to(tl.int64)  # batch offsets can pass 2^31 elements
    kvh = bh % Hkv
    r = (pid % NUM_RB) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < TG
    d_ok = d < D
    rd_ok = r_ok[:, None] & d_ok[None, :]
    m_run = tl.full([BLOCK_R], -1.0e30, tl.float32)
    l_run = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s in range(0, NS):  # fixed order: split 0, 1, ...; each row on its own (elementwise)
        off = (bh * NS + s) * TG + r
        m_s = tl.load(M + off, mask=r_ok, other=-1.0e30)
        l_s = tl.load(L + off, mask=r_ok, other=0.0)
        a_s = tl.load(Acc + off[:, None] * D + d[None, :], mask=rd_ok, other=0.0)
        m_new = tl.maximum(m_run, m_s)
        alpha = tl.exp2(m_run - m_new)
        beta = tl.exp2(m_s - m_new)
        l_run = l_run * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m_run = m_new
    o = acc / tl.where(r_ok, l_run, 1.0)[:, None]  # padded rows: 0/0 otherwise
    t = r // G
    h = kvh * G + r % G
    out_ptr = Out + b * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr, o.to(Out.dtype.element_ty), mask=rd_ok)


@triton.jit
def _combine_kernel(
    Acc, M, L, Out,
    stride_ob, stride_ot, stride_oh,
    Hkv, NS, TG, NUM_RB,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    bh = pid // NUM_RB
    b = (bh // Hkv).to(tl.int64)  # batch offsets can pass 2^31 elements
    kvh = bh % Hkv
    r = (pid % NUM_RB) * BLOCK_R + tl.arange(0, BLOCK_R)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < TG
    s_ok = s < NS
    d_ok = d < D
    sr_ok = s_ok[:, None] & r_ok[None, :]
    ml_off = (bh * NS + s[:, None]) * TG + r[None, :]  # [BLOCK_S, BLOCK_R], the partials' memory order
    m = tl.load(M + ml_off, mask=sr_ok, other=-1.0e30)
    l_part = tl.load(L + ml_off, mask=sr_ok, other=0.0)
    acc = tl.load(Acc + ml_off[:, :, None] * D + d[None, None, :],
                  mask=sr_ok[:, :, None] & d_ok[None, None, :], other=0.0)  # [BLOCK_S, BLOCK_R, BLOCK_D]
    m_max = tl.max(m, axis=0)  # [BLOCK_R]
    w = tl.where(s_ok[:, None], tl.exp2(m - m_max[None, :]), 0.0)
    den = tl.sum(l_part * w, axis=0)
    num = tl.sum(acc * w[:, :, None], axis=0)  # [BLOCK_R, BLOCK_D]
    o = num / tl.where(r_ok, den, 1.0)[:, None]  # padded rows: 0/0 otherwise
    t = r // G
    h = kvh * G + r % G
    out_ptr = Out + b * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr, o.to(Out.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


def _combine_blocks(NS: int, TG: int, D: int, ordered: bool) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_S, BLOCK_D, num_warps): the most rows (≤ _MAX_ROWS, ≤ the rows there are) whose acc
    tile fits (unordered: [BLOCK_S, BLOCK_R, BLOCK_D] ≤ _TILE, one warp per _TILE elements; ordered loop:
    _ORDERED_ROWS rows, 4 warps)."""
    bs = max(2, next_pow2(NS))
    bd = max(16, next_pow2(D))
    if ordered:
        return max(1, min(_ORDERED_ROWS, next_pow2(TG))), bs, bd, 4
    br = max(1, min(_MAX_ROWS, next_pow2(TG), _TILE // (bs * bd)))
    return br, bs, bd, min(8, max(1, br * bs * bd // _TILE))  # ≤ 4 for the NS ≤ 64, D ≤ 256 of the callers


def combine_partials_triton(part_acc, part_m, part_l, out, ordered: bool = False, *, block_r: int | None = None,
                            num_warps: int | None = None):
    """The Triton launch; ``block_r`` (rows per program, a power of two) and ``num_warps`` override the
    defaults of :func:`_combine_blocks` (benchmarks/kernels/tune_attention.py sweeps them)."""
    BH, NS, TG, D = part_acc.shape
    B, T, Hq, _ = out.shape
    Hkv = BH // B
    G = Hq // Hkv
    if out.stride(-1) != 1:
        raise ValueError("out must have a contiguous last dim")
    br, bs, bd, warps = _combine_blocks(NS, TG, D, ordered)
    br, num_warps = block_r or br, num_warps or warps
    num_rb = triton.cdiv(TG, br)
    args = (part_acc, part_m, part_l, out, out.stride(0), out.stride(1), out.stride(2), Hkv, NS, TG, num_rb)
    if ordered:
        _combine_ordered_kernel[(BH * num_rb,)](
            *args, G=G, D=D, BLOCK_R=br, BLOCK_D=bd,
            num_warps=num_warps, enable_fp_fusion=False,  # the torch reference's separate products and sums
            **pdl_kwargs(out.device, B * T),
        )
        return out
    _combine_kernel[(BH * num_rb,)](*args, G=G, D=D, BLOCK_R=br, BLOCK_S=bs, BLOCK_D=bd, num_warps=num_warps,
                                    **pdl_kwargs(out.device, B * T))
    return out


def combine_partials_torch(part_acc, part_m, part_l, out, ordered: bool = False):
    BH, NS, TG, D = part_acc.shape
    B, T, Hq, _ = out.shape
    Hkv = BH // B
    G = Hq // Hkv
    if ordered:  # split by split, elementwise only: each row's result is independent of the others
        m_run = torch.full_like(part_m[:, 0], -1.0e30)
        l_run = torch.zeros_like(part_l[:, 0])
        acc = torch.zeros_like(part_acc[:, 0])
        for s in range(NS):
            m_new = torch.maximum(m_run, part_m[:, s])
            alpha, beta = torch.exp2(m_run - m_new), torch.exp2(part_m[:, s] - m_new)
            l_run = l_run * alpha + part_l[:, s] * beta
            acc = acc * alpha[..., None] + part_acc[:, s] * beta[..., None]
            m_run = m_new
        num, den = acc, l_run
    else:
        w = torch.exp2(part_m - part_m.amax(dim=1, keepdim=True))  # [BH, NS, TG]
        num = (part_acc * w[..., None]).sum(dim=1)  # [BH, TG, D]
        den = (part_l * w).sum(dim=1)
    o = (num / den[..., None]).view(B, Hkv, T, G, D).permute(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
    return out.copy_(o)


def combine_partials(part_acc, part_m, part_l, out, impl: str = "triton", ordered: bool = False):
    """Write the combined attention rows of the split partials into ``out`` (see module doc);
    ``ordered``: the split-by-split merge of exact mode."""
    fn = pick_impl(impl, combine_partials_triton, combine_partials_torch)
    return fn(part_acc, part_m, part_l, out, ordered=ordered)
