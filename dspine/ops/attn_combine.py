"""Combine split-K attention partials (flash-decoding's second pass).

Op: an attention row whose keys were split over NS programs has, per split s, a running max
``m_s`` (log2 domain, i.e. of scores already multiplied by scale·log2 e), a sum ``l_s = Σ 2^(x−m_s)``
and an unnormalised ``acc_s = Σ 2^(x−m_s) v``. The exact result is
``Σ_s 2^(m_s−M) acc_s / Σ_s 2^(m_s−M) l_s`` with ``M = max_s m_s``. A split that saw no visible
key stores ``m = −1e30, l = 0, acc = 0`` and so weighs 0. [Dao et al., "Flash-Decoding", 2023]

Layouts: part_acc [B·Hkv, NS, G·T, D] fp32; part_m, part_l [B·Hkv, NS, G·T] fp32; packed row
r = t·G + g (query head h = kvh·G + g). out [B, T, Hq, D] (any strides, last dim contiguous),
written in its own dtype.
Constraints: every row must have at least one visible key in some split (true for the callers).

``ordered=True`` (exact mode): the splits are merged one after the other in split order with the
online-softmax update ``M' = max(M, m_s)``, ``L' = L·2^(M−M') + l_s·2^(m_s−M')``, same for acc,
starting from (−1e30, 0, 0). A split with no visible key is then an exact no-op (factors 1 and 0)
and a row's result depends only on its own splits, not on NS or on which program merged it.
Memory traffic: reads NS·(D+2)·4 bytes and writes D·sizeof(out) bytes per row; one program per
(b, kv head, row).
"""

from __future__ import annotations

import torch

from ._common import check_impl, next_pow2, tl, triton

__all__ = ["combine_partials"]


@triton.jit
def _combine_ordered_kernel(
    Acc, M, L, Out,
    stride_ob, stride_ot, stride_oh,
    Hkv, NS, TG,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = pid // TG
    r = pid % TG
    b = (bh // Hkv).to(tl.int64)
    kvh = bh % Hkv
    t = r // G
    g = r % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    m_run = -1.0e30
    l_run = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, NS):  # fixed order: split 0, 1, ...
        off = (bh * NS + s) * TG + r
        m_s = tl.load(M + off)
        l_s = tl.load(L + off)
        a_s = tl.load(Acc + off * D + d, mask=d_ok, other=0.0)
        m_new = tl.maximum(m_run, m_s)
        alpha = tl.exp2(m_run - m_new)
        beta = tl.exp2(m_s - m_new)
        l_run = l_run * alpha + l_s * beta
        acc = acc * alpha + a_s * beta
        m_run = m_new
    out_ptr = Out + b * stride_ob + t * stride_ot + (kvh * G + g) * stride_oh + d
    tl.store(out_ptr, (acc / l_run).to(Out.dtype.element_ty), mask=d_ok)


@triton.jit
def _combine_kernel(
    Acc, M, L, Out,
    stride_ob, stride_ot, stride_oh,
    Hkv, NS, TG,
    G: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    bh = pid // TG
    r = pid % TG
    b = (bh // Hkv).to(tl.int64)  # batch offsets can pass 2^31 elements
    kvh = bh % Hkv
    t = r // G
    g = r % G
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < NS
    d_ok = d < D
    ml_off = (bh * NS + s) * TG + r
    m = tl.load(M + ml_off, mask=s_ok, other=-1.0e30)
    l_part = tl.load(L + ml_off, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - m_max)
    w = tl.where(s_ok, w, 0.0)
    acc_off = ((bh * NS + s[:, None]) * TG + r) * D + d[None, :]
    acc = tl.load(Acc + acc_off, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l_part * w, axis=0)
    o = num / den
    out_ptr = Out + b * stride_ob + t * stride_ot + (kvh * G + g) * stride_oh + d
    tl.store(out_ptr, o.to(Out.dtype.element_ty), mask=d_ok)


def combine_partials_triton(part_acc, part_m, part_l, out, ordered: bool = False):
    BH, NS, TG, D = part_acc.shape
    B, T, Hq, _ = out.shape
    Hkv = BH // B
    G = Hq // Hkv
    if out.stride(-1) != 1:
        raise ValueError("out must have a contiguous last dim")
    if ordered:
        _combine_ordered_kernel[(BH * TG,)](
            part_acc, part_m, part_l, out,
            out.stride(0), out.stride(1), out.stride(2),
            Hkv, NS, TG,
            G=G, D=D, BLOCK_D=max(16, next_pow2(D)),
            num_warps=1, enable_fp_fusion=False,  # the torch reference's separate products and sums
        )
        return out
    _combine_kernel[(BH * TG,)](
        part_acc, part_m, part_l, out,
        out.stride(0), out.stride(1), out.stride(2),
        Hkv, NS, TG,
        G=G, D=D, BLOCK_S=max(2, next_pow2(NS)), BLOCK_D=max(16, next_pow2(D)),
        num_warps=4,
    )
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
        o = (acc / l_run[..., None]).view(B, Hkv, T, G, D).permute(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
        out.copy_(o)
        return out
    w = torch.exp2(part_m - part_m.amax(dim=1, keepdim=True))  # [BH, NS, TG]
    num = (part_acc * w[..., None]).sum(dim=1)  # [BH, TG, D]
    den = (part_l * w).sum(dim=1)
    o = (num / den[..., None]).view(B, Hkv, T, G, D).permute(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
    out.copy_(o)
    return out


def combine_partials(part_acc, part_m, part_l, out, impl: str = "triton", ordered: bool = False):
    """Write the combined attention rows of the split partials into ``out`` (see module doc);
    ``ordered``: the split-by-split merge of exact mode."""
    check_impl(impl)
    fn = combine_partials_triton if impl == "triton" else combine_partials_torch
    return fn(part_acc, part_m, part_l, out, ordered=ordered)
