"""Draft-block attention: T block queries over a context cache, the block's own keys and an
optional per-query extra key (DSpine's "kv" injection, docs/method.md §3).

Op: query t of batch b (absolute position ``P = ctx_len[b] + t``) and head h (kv head h // G)
attends, with one softmax over all of them:
  * context positions j < ctx_len[b]; if ``window`` is set, only those with P − j < window;
  * block keys s = 0..T−1 (bidirectional) or s ≤ t (``causal``);
  * if ``k_extra`` is given and t ≥ 1: the single key/value row t of k_extra/v_extra.
``out = softmax(scale · q·kᵀ) · v``.

Layouts: q [B, T, Hq, D]; k_ctx, v_ctx [B, Hkv, C, D] — position j at index j (window None,
C ≥ max ctx_len) or at j % C (ring, window ≤ C); ctx_len [B] int32 on the device (0 allowed);
k_blk, v_blk, k_extra, v_extra [B, T, Hkv, D]; out [B, T, Hq, D] in q's dtype. Last dims
contiguous, other strides free.
Constraints: Hq = G·Hkv, D ≤ 256 (padded to a power of two ≥ 16 and masked), T ≤ 64 intended.

Kernel: grid (B·Hkv·row_blocks, splits) with the G·T rows of a kv head packed in tl.dot's M
(row r = t·G + g). The context span [lo, ctx_len) — lo = max(0, ctx_len − window + 1) with a
window — is cut into equal chunks sized from the capacity (C, or window − 1), one per split;
split 0 also takes the block keys and the extra key. Partials are merged by ``attn_combine``
(one split: direct write). Launches read no device tensor on the host (CUDA-graph safe).
Memory traffic: K/V of the visible context once per kv head, the block's and extra K/V once per
kv head, q and out once.
Numerics: as verify_attention (fp32 scores and statistics, P rounded to the input dtype before
P·V, exact fp32 dots for fp32 inputs); the extra key's score and P·V are computed in fp32.
"""

from __future__ import annotations

import math

import torch

from ._common import dot_precision, next_pow2, pick_impl, tl, triton
from .attn_combine import combine_partials_triton
from .verify_attention import _LOG2E, _attend_tile, _launch_plan, _packed_rows, _store_rows

__all__ = ["draft_attention", "draft_attention_torch"]


@triton.jit
def _draft_attn_kernel(
    Q, KC, VC, CtxLen, KB, VB, KE, VE, Out, PartAcc, PartM, PartL,
    qk_scale, window,
    stride_qb, stride_qt, stride_qh,
    stride_kcb, stride_kch, stride_kcs,
    stride_vcb, stride_vch, stride_vcs,
    stride_kbb, stride_kbt, stride_kbh,
    stride_vbb, stride_vbt, stride_vbh,
    stride_keb, stride_ket, stride_keh,
    stride_veb, stride_vet, stride_veh,
    stride_ob, stride_ot, stride_oh,
    Hkv, C, T, chunk, num_splits,
    G: tl.constexpr, D: tl.constexpr, NUM_MB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_WINDOW: tl.constexpr, CAUSAL: tl.constexpr, HAS_EXTRA: tl.constexpr,
    SPLIT: tl.constexpr, PREC: tl.constexpr,
):
    pid_s = tl.program_id(1)
    bh, b, kvh, rows, row_ok, t, h, d, d_ok, q, clen = _packed_rows(
        Q, CtxLen, stride_qb, stride_qt, stride_qh, Hkv, T, G, D, NUM_MB, BLOCK_M, BLOCK_D)
    q_pos = clen + t

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    if pid_s == 0:
        # the block's own keys, token-major [B, T, Hkv, D]
        sb = tl.arange(0, BLOCK_T)
        sb_ok = sb < T
        kbt = tl.load(KB + b * stride_kbb + sb[None, :] * stride_kbt + kvh * stride_kbh + d[:, None],
                      mask=sb_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_T]
        vis = sb_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            vis = vis & (sb[None, :] <= t[:, None])
        vb_ptrs = VB + b * stride_vbb + sb[:, None] * stride_vbt + kvh * stride_vbh + d[None, :]  # [BLOCK_T, BLOCK_D]
        m_i, l_i, acc = _attend_tile(q, kbt, vb_ptrs, sb_ok[:, None] & d_ok[None, :], vis, m_i, l_i, acc, qk_scale,
                                     PREC)
        if HAS_EXTRA:
            # one extra key per query row: row t of k_extra (t >= 1); a row-wise dot, not a GEMM
            e_ok = row_ok & (t >= 1)
            ke = tl.load(KE + b * stride_keb + t[:, None] * stride_ket + kvh * stride_keh + d[None, :],
                         mask=e_ok[:, None] & d_ok[None, :], other=0.0)
            se = tl.sum(q.to(tl.float32) * ke.to(tl.float32), axis=1) * qk_scale
            se = tl.where(e_ok, se, float("-inf"))
            m_new = tl.maximum(m_i, se)
            alpha = tl.exp2(m_i - m_new)
            pe = tl.exp2(se - m_new)
            ve = tl.load(VE + b * stride_veb + t[:, None] * stride_vet + kvh * stride_veh + d[None, :],
                         mask=e_ok[:, None] & d_ok[None, :], other=0.0)
            l_i = l_i * alpha + pe
            acc = acc * alpha[:, None] + pe[:, None] * ve.to(tl.float32)
            m_i = m_new

    if HAS_WINDOW:
        span_lo = tl.maximum(clen - window + 1, 0)
    else:
        span_lo = clen * 0
    lo = span_lo + pid_s * chunk
    hi = tl.minimum(lo + chunk, clen)
    kc_base = KC + b * stride_kcb + kvh * stride_kch
    vc_base = VC + b * stride_vcb + kvh * stride_vch
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        p_ok = pos < hi
        if HAS_WINDOW:
            idx = pos % C
        else:
            idx = pos
        kt = tl.load(kc_base + idx[None, :] * stride_kcs + d[:, None],
                     mask=p_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        vis = p_ok[None, :]
        if HAS_WINDOW:
            vis = vis & ((q_pos[:, None] - pos[None, :]) < window)
        m_i, l_i, acc = _attend_tile(q, kt, vc_base + idx[:, None] * stride_vcs + d[None, :],
                                     p_ok[:, None] & d_ok[None, :], vis, m_i, l_i, acc, qk_scale, PREC)

    _store_rows(Out, PartAcc, PartM, PartL, m_i, l_i, acc, (bh * num_splits + pid_s) * (T * G) + rows, row_ok,
                b * stride_ob + t * stride_ot + h * stride_oh, d, d_ok, D, SPLIT)


def _check(q, k_ctx, v_ctx, k_blk, v_blk, window, causal, k_extra, v_extra) -> tuple[int, ...]:
    """(B, T, Hq, D, Hkv, C, G) of checked arguments (G = Hq / Hkv query heads per kv head); raises ValueError."""
    B, T, Hq, D = q.shape
    _, Hkv, C, _ = k_ctx.shape
    if Hq % Hkv or v_ctx.shape != k_ctx.shape or k_ctx.shape[0] != B or k_ctx.shape[3] != D:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k_ctx {tuple(k_ctx.shape)}")
    if tuple(k_blk.shape) != (B, T, Hkv, D) or v_blk.shape != k_blk.shape:
        raise ValueError(f"k_blk/v_blk must be {(B, T, Hkv, D)}, got {tuple(k_blk.shape)}")
    if (k_extra is None) != (v_extra is None):
        raise ValueError("k_extra and v_extra go together")
    if k_extra is not None and (k_extra.shape != k_blk.shape or v_extra.shape != k_blk.shape):
        raise ValueError("k_extra/v_extra must have k_blk's shape")
    if window is not None and not (1 <= int(window) <= C):
        raise ValueError(f"window {window} must be in [1, C={C}] (ring cache)")
    if D > 256:
        raise ValueError(f"head_dim {D} > 256 is not supported")
    for x in (q, k_ctx, v_ctx, k_blk, v_blk) + ((k_extra, v_extra) if k_extra is not None else ()):
        if x.stride(-1) != 1:
            raise ValueError("all tensors need a contiguous last dim")
    return B, T, Hq, D, Hkv, C, Hq // Hkv


def draft_attention_triton(q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, scale, window=None, causal=False,
                           k_extra=None, v_extra=None, *, out=None, num_splits=None):
    B, T, Hq, D, Hkv, C, G = _check(q, k_ctx, v_ctx, k_blk, v_blk, window, causal, k_extra, v_extra)
    out = torch.empty_like(q) if out is None else out
    span = C if window is None else min(C, int(window) - 1)  # the context keys one row can see
    (bm, bn, bd, warps, stages), num_mb, ns, chunk, (part_acc, part_m, part_l) = _launch_plan(
        q, Hkv, span, num_splits, out)
    split = ns > 1
    has_extra = k_extra is not None
    ke, ve = (k_extra, v_extra) if has_extra else (k_blk, v_blk)  # dummies when unused
    _draft_attn_kernel[(B * Hkv * num_mb, ns)](
        q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, ke, ve, out, part_acc, part_m, part_l,
        float(scale) * _LOG2E, int(window) if window is not None else 0,
        q.stride(0), q.stride(1), q.stride(2),
        k_ctx.stride(0), k_ctx.stride(1), k_ctx.stride(2),
        v_ctx.stride(0), v_ctx.stride(1), v_ctx.stride(2),
        k_blk.stride(0), k_blk.stride(1), k_blk.stride(2),
        v_blk.stride(0), v_blk.stride(1), v_blk.stride(2),
        ke.stride(0), ke.stride(1), ke.stride(2),
        ve.stride(0), ve.stride(1), ve.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        Hkv, C, T, chunk, ns,
        G=G, D=D, NUM_MB=num_mb, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, BLOCK_T=max(16, next_pow2(T)),
        HAS_WINDOW=window is not None, CAUSAL=bool(causal), HAS_EXTRA=has_extra,
        SPLIT=split, PREC=dot_precision(q.dtype),
        num_warps=warps, num_stages=stages,
    )
    if split:
        combine_partials_triton(part_acc, part_m, part_l, out)
    return out


def draft_attention_torch(q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, scale, window=None, causal=False,
                          k_extra=None, v_extra=None, *, out=None, num_splits=None):
    """Reference: one masked softmax in fp32 over [context slots, block keys, extra key]."""
    del num_splits
    B, T, Hq, D, Hkv, C, G = _check(q, k_ctx, v_ctx, k_blk, v_blk, window, causal, k_extra, v_extra)
    dev = q.device
    qr = q.float().view(B, T, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, T * G, D)
    t = torch.arange(T, device=dev).repeat_interleave(G)  # row r -> t
    clen = ctx_len.to(torch.long)
    i = torch.arange(C, device=dev)
    if window is None:
        slot_pos = i[None, :].expand(B, C)
    else:  # ring: slot i holds the latest position ≡ i (mod C) below ctx_len
        slot_pos = clen[:, None] - 1 - torch.remainder(clen[:, None] - 1 - i[None, :], C)
    slot_ok = (slot_pos >= 0) & (slot_pos < clen[:, None])  # [B, C]
    vis_c = slot_ok[:, None, :].expand(B, T * G, C)
    if window is not None:
        vis_c = vis_c & ((clen[:, None, None] + t[None, :, None] - slot_pos[:, None, :]) < int(window))
    kc = k_ctx.float().masked_fill(~slot_ok[:, None, :, None], 0.0)
    vc = v_ctx.float().masked_fill(~slot_ok[:, None, :, None], 0.0)
    kb = k_blk.float().transpose(1, 2)  # [B, Hkv, T, D]
    vb = v_blk.float().transpose(1, 2)
    s_c = (qr @ kc.transpose(-1, -2)).masked_fill(~vis_c[:, None], float("-inf"))
    s_b = qr @ kb.transpose(-1, -2)
    if causal:
        s_b = s_b.masked_fill(torch.arange(T, device=dev)[None, :] > t[:, None], float("-inf"))
    parts_s = [s_c, s_b]
    if k_extra is not None:
        ke = k_extra.float().transpose(1, 2).repeat_interleave(G, dim=2)  # [B, Hkv, TG, D]
        # row 0 has no extra key: its slot may be unwritten memory (the fused kv path never writes it),
        # and a masked NaN would still reach the output through 0 · NaN
        ve = v_extra.float().transpose(1, 2).repeat_interleave(G, dim=2).masked_fill((t == 0)[:, None], 0.0)
        s_e = (qr * ke).sum(-1, keepdim=True).masked_fill((t == 0)[:, None], float("-inf"))
        parts_s.append(s_e)
    p = torch.softmax(torch.cat(parts_s, dim=-1) * scale, dim=-1)
    o = p[..., :C] @ vc + p[..., C:C + T] @ vb
    if k_extra is not None:
        o = o + p[..., C + T:] * ve
    o = o.view(B, Hkv, T, G, D).permute(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
    return o.to(q.dtype) if out is None else out.copy_(o)


def draft_attention(q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, scale, window=None, causal=False,
                    k_extra=None, v_extra=None, impl: str = "triton", *, out=None, num_splits=None):
    """Attention of the draft block q [B, T, Hq, D] over context cache + block (+ extra key).

    Returns out [B, T, Hq, D] in q's dtype (into ``out`` if given). ``window`` selects the ring
    layout and sliding-window visibility; ``causal`` the in-block mask; ``num_splits`` overrides
    the split count (tests). Raises ValueError on inconsistent shapes. See the module docstring.
    """
    fn = pick_impl(impl, draft_attention_triton, draft_attention_torch)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return fn(q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, scale, window, causal, k_extra, v_extra,
              out=out, num_splits=num_splits)
