"""Fused q/k RMSNorm + rotary embedding + KV-cache write for one batch of new tokens.

Op, per token n (RoPE position p = positions[n]) and head:
  k' = rope(k_norm(k)), written to k_cache[batch_idx[n], :, cache_pos[n], :];
  v written unchanged to v_cache at the same place;
  q' = rope(q_norm(q)) returned (q may be None: draft context cache).
k_norm/q_norm are the per-head RMSNorm over D of Qwen3 (skipped when the weight is None, as for
Llama), with the HF numerics of ``rmsnorm.py``. rope is HF's "rotate_half" convention, pairs
(i, i + D/2): ``x·cos + rotate_half(x)·sin`` with cos/sin rounded to the input dtype first and each
product and the sum rounded to the input dtype, exactly HF's bf16 op sequence
[transformers modeling_qwen3.apply_rotary_pos_emb; Su et al. 2021, RoFormer].

Layouts: q [N, Hq, D] (or None), k, v [N, Hkv, D] (last dim contiguous); q_norm_weight,
k_norm_weight [D] or None; cos, sin [P, D/2] fp32 (``rope_tables``); positions, batch_idx,
cache_pos [N] int32/int64 on the device; k_cache, v_cache [B, Hkv, S, D] (last dim contiguous).
Returns q_out [N, Hq, D] in q's dtype (or None).
Constraints: D even; positions < P and cache indices in range are the caller's duty (not checked:
no host reads). One program per token, all its heads in one tile. Compiled without FMA
contraction, which would skip the rounding of x·cos before the add (seen on an H200).
Memory traffic: reads q, k, v and two table rows, writes q_out and the two cache rows.
"""

from __future__ import annotations

import torch

from ._common import next_pow2, pdl_enter, pdl_kwargs, pick_impl, tl, triton

__all__ = ["qk_norm_rope_cache", "qk_norm_rope_cache_torch", "rope_tables"]


def rope_tables(head_dim: int, max_positions: int, base: float, device=None):
    """(cos, sin) [max_positions, head_dim // 2] fp32, cos[p, i] = cos(p · base^(−2i/D)).

    Same arithmetic as HF's default rope: inv_freq built in fp32 on the CPU (as HF does at init,
    before the model moves to the GPU; CPU and GPU pow can differ in the last bit), then the fp32
    product and fp32 cos/sin on `device`.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = (1.0 / (base ** exponent)).to(device)
    pos = torch.arange(max_positions, dtype=torch.int64, device=device).float()
    freqs = pos[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


@triton.jit
def _norm_rope_heads(x1, x2, W, cos, sin, half, ok_i, eps, D: tl.constexpr, HAS_NORM: tl.constexpr):
    """x1, x2: [BLOCK_HEADS, BLOCK_HALF] halves (i, i + D/2) in the input dtype."""
    OUT_DTYPE = x1.dtype
    if HAS_NORM:
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        var = (tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / D
        rs = tl.math.rsqrt(var + eps)[:, None]
        w1 = tl.load(W + half, mask=ok_i, other=0.0).to(tl.float32)
        w2 = tl.load(W + half + D // 2, mask=ok_i, other=0.0).to(tl.float32)
        x1 = ((f1 * rs).to(OUT_DTYPE).to(tl.float32) * w1[None, :]).to(OUT_DTYPE)
        x2 = ((f2 * rs).to(OUT_DTYPE).to(tl.float32) * w2[None, :]).to(OUT_DTYPE)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    # out1 = x1·c − x2·s, out2 = x2·c + x1·s; each product and the sum rounded (HF in bf16)
    o1 = ((f1 * c).to(OUT_DTYPE).to(tl.float32) - (f2 * s).to(OUT_DTYPE).to(tl.float32)).to(OUT_DTYPE)
    o2 = ((f2 * c).to(OUT_DTYPE).to(tl.float32) + (f1 * s).to(OUT_DTYPE).to(tl.float32)).to(OUT_DTYPE)
    return o1, o2


@triton.jit
def _qk_norm_rope_cache_kernel(
    Q, K, V, QW, KW, Cos, Sin, Pos, KC, VC, BIdx, CPos, QOut, eps,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_cos, stride_sin,
    stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs,
    stride_on, stride_oh, Hq, Hkv,
    D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_Q: tl.constexpr, HAS_QNORM: tl.constexpr, HAS_KNORM: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)
    ok_i = half < D // 2
    pos = tl.load(Pos + n).to(tl.int64)
    dt = K.dtype.element_ty
    # the tables are fp32; HF casts cos/sin to the activation dtype before multiplying
    cos = tl.load(Cos + pos * stride_cos + half, mask=ok_i, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(Sin + pos * stride_sin + half, mask=ok_i, other=0.0).to(dt).to(tl.float32)

    hk = tl.arange(0, BLOCK_HKV)
    ok_k = (hk < Hkv)[:, None] & ok_i[None, :]
    k_ptr = K + n * stride_kn + hk[:, None] * stride_kh + half[None, :]
    k1 = tl.load(k_ptr, mask=ok_k, other=0.0)
    k2 = tl.load(k_ptr + D // 2, mask=ok_k, other=0.0)
    k1, k2 = _norm_rope_heads(k1, k2, KW, cos, sin, half, ok_i, eps, D, HAS_KNORM)
    bi = tl.load(BIdx + n).to(tl.int64)
    cp = tl.load(CPos + n).to(tl.int64)
    kc_ptr = KC + bi * stride_kcb + cp * stride_kcs + hk[:, None] * stride_kch + half[None, :]
    tl.store(kc_ptr, k1.to(KC.dtype.element_ty), mask=ok_k)
    tl.store(kc_ptr + D // 2, k2.to(KC.dtype.element_ty), mask=ok_k)
    v_ptr = V + n * stride_vn + hk[:, None] * stride_vh + half[None, :]
    vc_ptr = VC + bi * stride_vcb + cp * stride_vcs + hk[:, None] * stride_vch + half[None, :]
    tl.store(vc_ptr, tl.load(v_ptr, mask=ok_k, other=0.0).to(VC.dtype.element_ty), mask=ok_k)
    tl.store(vc_ptr + D // 2, tl.load(v_ptr + D // 2, mask=ok_k, other=0.0).to(VC.dtype.element_ty),
             mask=ok_k)

    if HAS_Q:
        hq = tl.arange(0, BLOCK_HQ)
        ok_q = (hq < Hq)[:, None] & ok_i[None, :]
        q_ptr = Q + n * stride_qn + hq[:, None] * stride_qh + half[None, :]
        q1 = tl.load(q_ptr, mask=ok_q, other=0.0)
        q2 = tl.load(q_ptr + D // 2, mask=ok_q, other=0.0)
        q1, q2 = _norm_rope_heads(q1, q2, QW, cos, sin, half, ok_i, eps, D, HAS_QNORM)
        o_ptr = QOut + n * stride_on + hq[:, None] * stride_oh + half[None, :]
        tl.store(o_ptr, q1, mask=ok_q)
        tl.store(o_ptr + D // 2, q2, mask=ok_q)


def _check(q, k, v, cos, k_cache, v_cache) -> tuple[int, int, int]:
    """k's ``(N, Hkv, D)``, checked against v, the tables, the caches and q; raises ValueError."""
    N, Hkv, D = k.shape
    if D % 2 or v.shape != k.shape or cos.shape[-1] != D // 2:
        raise ValueError(f"bad shapes k {tuple(k.shape)}, v {tuple(v.shape)}, cos {tuple(cos.shape)}")
    if k_cache.shape[1] != Hkv or k_cache.shape[3] != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not match k {tuple(k.shape)}")
    if q is not None and (q.shape[0] != N or q.shape[2] != D or q.dtype != k.dtype):
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not match k {tuple(k.shape)} {k.dtype}")
    return N, Hkv, D


def qk_norm_rope_cache_triton(q, k, v, q_norm_weight, k_norm_weight, eps, cos, sin, positions,
                              k_cache, v_cache, batch_idx, cache_pos, *, q_out=None):
    N, Hkv, D = _check(q, k, v, cos, k_cache, v_cache)
    tensors = [k, v, k_cache, v_cache, cos, sin] + ([q] if q is not None else [])
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("q, k, v, caches and tables need a contiguous last dim")
    # the kernel reads positions / batch_idx / cache_pos as packed vectors (index n): a stride-0 view (expand)
    # or a strided slice would read past its storage
    positions, batch_idx, cache_pos = (t.contiguous() for t in (positions, batch_idx, cache_pos))
    has_q = q is not None
    if has_q:
        Hq = q.shape[1]
        q_out = torch.empty_like(q) if q_out is None else q_out
    else:
        Hq = 1
    qq, qo = (q, q_out) if has_q else (k, k)  # dummies when unused
    qw = q_norm_weight if q_norm_weight is not None else cos
    kw = k_norm_weight if k_norm_weight is not None else cos
    if N > 0:
        heads = max(Hkv, Hq if has_q else 1)
        warps = 4 if next_pow2(heads) * D <= 4096 else 8
        _qk_norm_rope_cache_kernel[(N,)](
            qq, k, v, qw, kw, cos, sin, positions, k_cache, v_cache, batch_idx, cache_pos, qo,
            float(eps),
            qq.stride(0), qq.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), sin.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            qo.stride(0), qo.stride(1), Hq, Hkv,
            D=D, BLOCK_HQ=max(2, next_pow2(Hq)), BLOCK_HKV=max(2, next_pow2(Hkv)),
            BLOCK_HALF=max(2, next_pow2(D // 2)),
            HAS_Q=has_q, HAS_QNORM=has_q and q_norm_weight is not None,
            HAS_KNORM=k_norm_weight is not None, num_warps=warps, **pdl_kwargs(k.device, N),
            enable_fp_fusion=False,  # no mul+add -> FMA: keep HF's rounding of each product
        )
    return q_out if has_q else None


def _norm_rope_torch(x, w, eps, cos, sin):
    dt = x.dtype
    if w is not None:
        xf = x.float()
        x = ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt).float() * w.float()).to(dt)
    c = torch.cat([cos, cos], dim=-1).to(dt)[:, None, :]  # [N, 1, D]
    s = torch.cat([sin, sin], dim=-1).to(dt)[:, None, :]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * c + rot * s  # in dt: each op rounds, as HF


def qk_norm_rope_cache_torch(q, k, v, q_norm_weight, k_norm_weight, eps, cos, sin, positions,
                             k_cache, v_cache, batch_idx, cache_pos, *, q_out=None):
    """Reference: HF's q_norm/k_norm + apply_rotary_pos_emb, then index_put into the caches."""
    N, Hkv, D = _check(q, k, v, cos, k_cache, v_cache)
    pos = positions.long()
    c, s = cos[pos], sin[pos]
    k_rot = _norm_rope_torch(k, k_norm_weight, eps, c, s)
    bi = batch_idx.long()[:, None]
    cp = cache_pos.long()[:, None]
    h = torch.arange(Hkv, device=k.device)[None, :]
    k_cache[bi, h, cp] = k_rot.to(k_cache.dtype)
    v_cache[bi, h, cp] = v.to(v_cache.dtype)
    if q is None:
        return None
    q_rot = _norm_rope_torch(q, q_norm_weight, eps, c, s)
    return q_rot if q_out is None else q_out.copy_(q_rot)


def qk_norm_rope_cache(q, k, v, q_norm_weight, k_norm_weight, eps, cos, sin, positions,
                       k_cache, v_cache, batch_idx, cache_pos, impl: str = "triton", *, q_out=None):
    """Norm + RoPE q and k, write k and v into the caches; return q_out [N, Hq, D] (or None).

    See the module docstring for layouts and numerics. ``q_out`` may be given (static buffer).
    Raises ValueError on inconsistent shapes.
    """
    fn = pick_impl(impl, qk_norm_rope_cache_triton, qk_norm_rope_cache_torch)
    return fn(q, k, v, q_norm_weight, k_norm_weight, eps, cos, sin, positions, k_cache, v_cache,
              batch_idx, cache_pos, q_out=q_out)
