"""Causal attention of T new tokens over a KV cache (target verify, T = block size; decode, T = 1).

Op: for batch b, query token t (absolute position ``p = cache_len[b] + t``) and query head h,
``out[b, t, h] = softmax_j(scale · q[b, t, h] · k[b, h // G, j]) · v[b, h // G, j]`` over keys
``j = 0 .. p`` inclusive, or ``j = p − window + 1 .. p`` with a sliding ``window`` (transformers'
sliding-window mask: a query sees itself and the window − 1 keys before it; the cache stays
full-length and keys before the window are skipped, not evicted). The new tokens' own K/V must
already be in the cache at positions ``cache_len[b] .. cache_len[b] + T − 1``.

Layouts: q [B, T, Hq, D]; k_cache, v_cache [B, Hkv, S, D]; cache_len [B] int32 (or int64) on the
device; out [B, T, Hq, D] in q's dtype. Last dims contiguous; other strides are free.
Constraints: Hq = G·Hkv; D ≤ 256 (any value, padded to a power of two ≥ 16 and masked);
T ≤ 64 is the intended range (any T works, in several row blocks); cache_len[b] + T ≤ S.
Positions past ``cache_len[b] + T`` are never read, so stale or poisoned cache rows are harmless.

Kernel (flash-decoding): grid (B·Hkv·row_blocks, splits). The G·T query rows of one kv head are
packed into the M dimension of tl.dot (row r = t·G + g), so each K/V tile is read once per kv
head, not once per query head. The key range [0, S) is cut into ``splits`` equal chunks (chosen
from shapes only: about one program per SM, ≥ MIN_CHUNK keys per chunk); a chunk beyond a
row's length does no work. Partials (m, l, acc) in fp32 are merged by ``attn_combine``; with one
split the kernel writes ``out`` directly. No launcher reads a device tensor, so launches can be
captured in a CUDA graph.
Memory traffic: K and V of the visible prefix once per kv head (2·B·Hkv·(len + T)·D·bytes), q and
out once; with splits, plus 4·(D + 2) bytes per (row, split) for the partials.
Numerics: fp32 scores and softmax statistics; P is rounded to the input dtype before P·V (as in
FlashAttention), accumulation in fp32; fp32 inputs use exact (non-TF32) tl.dot.

Exact mode (``exact=True``, issue 13): each query's result is bitwise independent of T (the
block width), of B and of the cache size S. The kernel then uses one fixed tile configuration
(that of ``EXACT_ROWS`` packed rows, whatever G·T is), fixed ``EXACT_CHUNK``-key splits
(``cdiv(S, EXACT_CHUNK)`` programs per row tile; tiles aligned to absolute key index multiples of
BLOCK_N) and always writes partials, which ``attn_combine`` merges split by split in order
(``ordered=True``). Fully masked tiles and empty splits are exact no-ops (factors 1 and 0), so a
row's arithmetic is the same sequence in a 1-token step and in a verify block. The reference path
runs each (batch row, query) on its own with the same shapes.
"""

from __future__ import annotations

import math

import torch

from ._common import block_d, dot_precision, next_pow2, num_sms, pdl_enter, pdl_kwargs, pick_impl, tl, triton
from .attn_combine import combine_partials_triton

__all__ = ["verify_attention", "verify_attention_torch"]

_LOG2E = 1.4426950408889634
EXACT_ROWS = 64  # exact mode: tile configuration of this many packed rows, for every T
EXACT_CHUNK = 256  # exact mode: keys per split (a multiple of every BLOCK_N)


@triton.jit
def _attend_tile(q, kt, v_ptrs, v_mask, vis, m_i, l_i, acc, qk_scale, PREC: tl.constexpr):
    """One key tile of the flash-decoding loop, for every kernel of this module, ``tree_attention`` and
    ``draft_attention`` (one sequence of operations, so exact mode's kernels round alike): scores ``q · kt``
    (scaled to log2 units) masked to ``vis``, the online-softmax update of the running max ``m_i``, sum ``l_i`` and
    ``acc``, P rounded to V's dtype before P·V; V ([BLOCK_N, BLOCK_D] at ``v_ptrs``, ``v_mask``) is loaded after
    the softmax statistics.
    Returns the new ``(m_i, l_i, acc)``."""
    s = tl.dot(q, kt, input_precision=PREC) * qk_scale
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _packed_rows(Q, CacheLen, stride_qb, stride_qt, stride_qh, Hkv, T, G: tl.constexpr, D: tl.constexpr,
                 NUM_MB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Prologue of the packed-row kernels (this module's, ``tree_attention``'s, ``draft_attention``'s): grid axis 0's
    id → (kv-head program ``bh`` = b·Hkv + kvh, row tile); the tile's packed rows r = t·G + g ([BLOCK_M]: ``rows``,
    ``row_ok``, token ``t``, query head ``h``), the head-dim lanes ``d``/``d_ok`` ([BLOCK_D]), the queries
    ``q [BLOCK_M, BLOCK_D]`` (0 in padding) and row b's cache length (int32). ``b`` is int64: batch offsets can pass
    2^31 elements. Returns ``(bh, b, kvh, rows, row_ok, t, h, d, d_ok, q, clen)``."""
    pid = tl.program_id(0)
    bh = pid // NUM_MB
    b = (bh // Hkv).to(tl.int64)
    kvh = bh % Hkv
    rows = (pid % NUM_MB) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T * G
    t = rows // G
    h = kvh * G + rows % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + b * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    return bh, b, kvh, rows, row_ok, t, h, d, d_ok, q, tl.load(CacheLen + b).to(tl.int32)


@triton.jit
def _store_rows(Out, PartAcc, PartM, PartL, m_i, l_i, acc, part_row, ok, out_row, d, d_ok, D: tl.constexpr,
                SPLIT: tl.constexpr):
    """Epilogue of the flash-decoding kernels: with ``SPLIT`` the fp32 partials (m, l, acc) of rows ``ok`` at
    partial row ``part_row`` (= (bh·splits + split)·G·T + r, ``attn_combine``'s layout), else the normalized
    output ``acc / l`` in Out's dtype at element offset ``out_row`` (padded rows: l = 0, written as 0)."""
    if SPLIT:
        tl.store(PartM + part_row, m_i, mask=ok)
        tl.store(PartL + part_row, l_i, mask=ok)
        tl.store(PartAcc + part_row[:, None] * D + d[None, :], acc, mask=ok[:, None] & d_ok[None, :])
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + out_row[:, None] + d[None, :], o.to(Out.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])


@triton.jit
def _verify_attn_kernel(
    Q, K, V, CacheLen, Out, PartAcc, PartM, PartL,
    qk_scale,  # scale · log2(e)
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_ot, stride_oh,
    Hkv, S, T, chunk, num_splits,
    G: tl.constexpr, D: tl.constexpr, NUM_MB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, PREC: tl.constexpr, WINDOW: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid_s = tl.program_id(1)
    bh, b, kvh, rows, row_ok, t, h, d, d_ok, q, clen = _packed_rows(
        Q, CacheLen, stride_qb, stride_qt, stride_qh, Hkv, T, G, D, NUM_MB, BLOCK_M, BLOCK_D)
    q_pos = clen + t  # key j is visible to row r iff q_pos[r] - WINDOW < j <= q_pos[r] (WINDOW 0: no lower bound)

    lo = pid_s * chunk
    hi = tl.minimum(tl.minimum(lo + chunk, clen + T), S)
    if WINDOW > 0:  # skip the tiles before the first row's window
        lo = tl.maximum(lo, tl.maximum(clen - WINDOW + 1, 0) // BLOCK_N * BLOCK_N)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        kt = tl.load(k_base + n[None, :] * stride_ks + d[:, None],
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        vis = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            vis = vis & (n[None, :] > q_pos[:, None] - WINDOW)
        m_i, l_i, acc = _attend_tile(q, kt, v_base + n[:, None] * stride_vs + d[None, :],
                                     n_ok[:, None] & d_ok[None, :], vis, m_i, l_i, acc, qk_scale, PREC)

    _store_rows(Out, PartAcc, PartM, PartL, m_i, l_i, acc, (bh * num_splits + pid_s) * (T * G) + rows, row_ok,
                b * stride_ob + t * stride_ot + h * stride_oh, d, d_ok, D, SPLIT)


def _attn_blocks(D: int, dtype: torch.dtype, rows: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) from shapes.

    Measured on an H200 at Qwen3-8B shapes (benchmarks/kernels/tune_attention.py): BLOCK_N 64,
    4 warps, 3 stages and one program per SM beat 8 warps / 2 stages by up to 1.9× (T = 16).
    BLOCK_M at most 64 in bf16 (results/tune-tree-step-h200.json: 128 packed rows in one tile took
    11.2 µs against 8.0 in two of 64 at SmolLM2's heads, T = 32; 13.3 against 9.4 at Qwen3-8B's).
    fp32 and D = 256 use smaller tiles and 2 stages to stay inside shared memory.
    """
    bd = block_d(D)
    if dtype == torch.float32:
        cap_m, bn, stages = (32, 32, 2) if bd >= 256 else (64, 32, 2)
    else:
        cap_m, bn, stages = (64, 32, 2) if bd >= 256 else (64, 64, 3)
    bm = min(cap_m, max(16, next_pow2(rows)))
    warps = 8 if bm * bd > 8192 else 4
    return bm, bn, bd, warps, stages


MIN_CHUNK = 64  # keys per split at least (was 256 until results/tune-tree-step-h200.json, 2026-12-02: at batch 1
# a 600-token context split into chunks of 64 took 4.98 µs against 6.73 in chunks of 256 at SmolLM2's heads, T = 16,
# and 6.47 against 8.36 at Qwen3-8B's: few kv heads give few programs, and splits are the parallelism left)


def _split_plan(base_programs: int, keys: int, block_n: int, device, num_splits: int | None):
    """(splits, chunk): chunk is a multiple of block_n and splits·chunk ≥ keys. Default: about one program
    per SM (``base_programs`` = batch · kv heads · row tiles), at least ``MIN_CHUNK`` keys per split."""
    keys = max(keys, 1)
    if num_splits is None:
        target = num_sms(device)
        max_splits = min(64, triton.cdiv(keys, max(MIN_CHUNK, block_n)))
        num_splits = max(1, min(max_splits, triton.cdiv(target, base_programs)))
    num_splits = max(1, min(int(num_splits), 64))
    chunk = triton.cdiv(triton.cdiv(keys, num_splits), block_n) * block_n
    return triton.cdiv(keys, chunk), chunk


def _check_window(window):
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window={window!r}: expected None or an int >= 1")


def _launch_plan(q, Hkv: int, S: int, num_splits, out, exact: bool = False, blocks=None):
    """Block sizes, row-tile count, KV split plan and fp32 partial buffers of a verify-layout attention
    launch (q ``[B, T, Hq, D]``): shared by this op and ``dspine.ops.tree_attention``. The partials are
    ``out`` itself (unused) when the plan does not split. ``exact``: the fixed plan of exact mode
    (module docstring; ``num_splits`` ignored), always with partials. ``blocks`` = (BLOCK_M, BLOCK_N,
    num_warps, num_stages) replaces the shape rule (benchmarks/kernels/tune_tree_step.py sweeps it)."""
    B, T, Hq, D = q.shape
    G = Hq // Hkv
    if blocks is not None:
        ok = isinstance(blocks, (tuple, list)) and len(blocks) == 4 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in blocks)
        if not ok or blocks[0] < 16 or blocks[1] < 16 or blocks[0] & (blocks[0] - 1) or blocks[1] & (blocks[1] - 1) \
                or blocks[2] not in (1, 2, 4, 8, 16) or blocks[3] < 1:
            raise ValueError(f"blocks={blocks!r}: expected (BLOCK_M, BLOCK_N, num_warps, num_stages) ints, BLOCK_M "
                             f"and BLOCK_N powers of two >= 16, num_warps in 1, 2, 4, 8, 16, num_stages >= 1")
    if blocks is not None and not exact:
        bm, bn, warps, stages = blocks
        blocks = (bm, bn, block_d(D), warps, stages)
    else:
        blocks = _attn_blocks(D, q.dtype, EXACT_ROWS if exact else G * T)
    num_mb = triton.cdiv(G * T, blocks[0])
    if exact:
        ns, chunk = triton.cdiv(max(S, 1), EXACT_CHUNK), EXACT_CHUNK
    else:
        ns, chunk = _split_plan(B * Hkv * num_mb, S, blocks[1], q.device, num_splits)
    if ns > 1 or exact:
        part_acc = torch.empty(B * Hkv, ns, G * T, D, device=q.device, dtype=torch.float32)
        part_m = torch.empty(B * Hkv, ns, G * T, device=q.device, dtype=torch.float32)
        parts = (part_acc, part_m, torch.empty_like(part_m))
    else:
        parts = (out, out, out)
    return blocks, num_mb, ns, chunk, parts


def _cache_shapes(q, k_cache, v_cache) -> tuple[int, int, int, int, int, int]:
    """``(B, T, Hq, D, Hkv, S)`` of q ``[B, T, Hq, D]`` over k/v_cache ``[B, Hkv, S, D]`` (this op's and
    ``tree_attention``'s layout). Raises ValueError unless Hkv divides Hq and the caches match q and each other."""
    B, T, Hq, D = q.shape
    _, Hkv, S, _ = k_cache.shape
    if Hq % Hkv or v_cache.shape != k_cache.shape or k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    return B, T, Hq, D, Hkv, S


def verify_attention_triton(q, k_cache, v_cache, cache_len, scale, *, out=None, num_splits=None, window=None,
                            exact=False, blocks=None):
    _check_window(window)
    B, T, Hq, D, Hkv, S = _cache_shapes(q, k_cache, v_cache)
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache, v_cache need a contiguous last dim")
    if D > 256:
        raise ValueError(f"head_dim {D} > 256 is not supported")
    G = Hq // Hkv
    out = torch.empty_like(q) if out is None else out
    (bm, bn, bd, warps, stages), num_mb, ns, chunk, (part_acc, part_m, part_l) = _launch_plan(
        q, Hkv, S, num_splits, out, exact, blocks)
    split = ns > 1 or exact
    _verify_attn_kernel[(B * Hkv * num_mb, ns)](
        q, k_cache, v_cache, cache_len, out, part_acc, part_m, part_l,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        Hkv, S, T, chunk, ns,
        G=G, D=D, NUM_MB=num_mb, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
        SPLIT=split, PREC=dot_precision(q.dtype), WINDOW=window or 0,
        num_warps=warps, num_stages=stages, **pdl_kwargs(q.device, B * T),
    )
    if split:
        combine_partials_triton(part_acc, part_m, part_l, out, ordered=exact)
    return out


def verify_attention_torch(q, k_cache, v_cache, cache_len, scale, *, out=None, num_splits=None, window=None,
                           exact=False, blocks=None):
    """Reference: masked softmax in fp32 over the whole cache (no host sync, graph-capturable).
    ``exact``: every (batch row, query) computed alone, as a T = 1 query of a batch of 1 at position
    cache_len[b] + t, so every call has the same shapes whatever B and T are."""
    del num_splits, blocks
    _check_window(window)
    B, T, Hq, D = q.shape
    S = k_cache.shape[2]
    if exact:
        o = torch.empty(B, T, Hq, D, device=q.device, dtype=q.dtype)
        for b in range(B):
            for t in range(T):
                o[b, t] = verify_attention_torch(q[b : b + 1, t : t + 1].clone(), k_cache[b : b + 1],
                                                 v_cache[b : b + 1], cache_len[b : b + 1] + t, scale,
                                                 window=window)[0, 0]
        return o if out is None else out.copy_(o)
    j = torch.arange(S, device=q.device)
    pos = cache_len.to(torch.long)[:, None] + torch.arange(T, device=q.device)[None, :]  # [B, T]
    vis = j[None, None, :] <= pos[:, :, None]  # [B, T, S]
    if window is not None:
        vis = vis & (j[None, None, :] > pos[:, :, None] - window)
    return masked_attention_torch(q, k_cache, v_cache, cache_len, vis, scale, out)


def masked_attention_torch(q, k_cache, v_cache, cache_len, vis, scale, out=None):
    """fp32 reference of the verify-layout attentions (this op's and ``tree_attention``'s): token t of row b
    attends the cache keys j where ``vis [B, T, S]`` (bool) is set, with one softmax over them; rows at or past
    ``cache_len[b] + T`` are zeroed first (stale or poisoned cache rows never reach the output). Query rows of one
    kv head packed as r = t·G + g, like the kernels. Returns [B, T, Hq, D] in q's dtype (into ``out`` if given)."""
    B, T, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    qr = q.float().view(B, T, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, T * G, D)
    written = torch.arange(S, device=q.device)[None, :] < (cache_len.to(torch.long)[:, None] + T)  # [B, S]
    k = k_cache.float().masked_fill(~written[:, None, :, None], 0.0)
    v = v_cache.float().masked_fill(~written[:, None, :, None], 0.0)
    s = (qr @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~vis.repeat_interleave(G, dim=1)[:, None], float("-inf"))
    o = torch.softmax(s, dim=-1) @ v  # [B, Hkv, T·G, D]
    o = o.view(B, Hkv, T, G, D).permute(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
    return o.to(q.dtype) if out is None else out.copy_(o)


def verify_attention(q, k_cache, v_cache, cache_len, scale, impl: str = "triton", *, out=None,
                     num_splits=None, window: int | None = None, exact: bool = False, blocks=None):
    """Causal attention of q [B, T, Hq, D] over k/v_cache [B, Hkv, S, D] up to cache_len[b] + t.

    Returns out [B, T, Hq, D] in q's dtype (written into ``out`` if given). ``num_splits``
    overrides the split-K count (tests); by default it is chosen from shapes. ``window`` (tokens,
    None = full causal): a query at position p sees keys p − window + 1 .. p only. Raises
    ValueError on inconsistent shapes or a window that is not an int >= 1. ``exact``: each query's
    result bitwise independent of B, T and S (module docstring; ``num_splits`` is then ignored).
    ``blocks`` = (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the tile rule (tuning; ignored in
    exact mode and by the torch path). See the module docstring for layouts and numerics.
    """
    fn = pick_impl(impl, verify_attention_triton, verify_attention_torch)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return fn(q, k_cache, v_cache, cache_len, scale, out=out, num_splits=num_splits, window=window, exact=exact,
              blocks=blocks)
