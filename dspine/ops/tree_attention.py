"""Attention of T tree nodes over a KV cache: the target's tree verify step (``dspine.tree``).

Op: for batch b, node t and query head h,
``out[b, t, h] = softmax_j(scale · q[b, t, h] · k[b, h // G, j]) · v[b, h // G, j]`` over the keys j
that are visible to node t: the committed prefix ``j < cache_len[b]``, and node i's key at
``j = cache_len[b] + i`` iff bit i of ``tree_bits[b, t]`` is set (node i is t or an ancestor of t,
``dspine.tree.ancestor_bits``). The nodes' own K/V must already be in the cache at positions
``cache_len[b] .. cache_len[b] + T − 1`` (node order, not depth: RoPE positions are the caller's).
With ``tree_bits[b, t] = 2^(t+1) − 1`` (every earlier node) it is ``verify_attention``.

Layouts: q [B, T, Hq, D]; k_cache, v_cache [B, Hkv, S, D]; cache_len [B] int32/int64; tree_bits
[B, T] int64; out [B, T, Hq, D] in q's dtype. Constraints: T ≤ 64 (one bit per node), Hq = G·Hkv,
D ≤ 256, cache_len[b] + T ≤ S. Rows past ``cache_len[b] + T`` are never read.

Kernel: ``verify_attention``'s flash-decoding layout (grid (B·Hkv·row_blocks, splits), the G·T rows
of one kv head packed as r = t·G + g, tile sizes and split plan from the same helpers, partials
merged by ``attn_combine``); only the visibility test differs: a key inside the tree tests one bit
of the row's mask. Memory traffic: as verify_attention plus 8·B·T bytes of masks. Graph-safe (no
launcher reads a device tensor). Numerics: fp32 scores and statistics, P rounded to the input dtype
before P·V, exact (non-TF32) tl.dot for fp32.

Exact mode (``exact=True``, issue 16 on top of issue 13's ``verify_attention(exact=True)``): node t's result is
bitwise what ``verify_attention(exact=True)`` of the same ``impl`` gives the same token as a 1-token step at position
``cache_len[b] + depth[b, t]`` once its ancestors' K/V sit, in depth order, at the positions after the prefix (the
chain of the accepted path, as the AR decode had it). The kernel reads key ``j`` of that logical sequence through the
node's path (:func:`tree_paths`: ``path[b, t, d]`` = the ancestor at depth d), so every key lands in the same lane
of the same ``EXACT_CHUNK``-aligned tile as in the 1-token step, and uses that step's tile configuration
(``EXACT_ROWS`` packed rows) and its ordered combine. Rows of a tile never mix in tl.dot or in the row reductions.
Two launches: the splits wholly below the first ``BLOCK_N`` tile that holds a tree key, where every key is visible to
every row, run as ``verify_attention`` runs them (packed rows, one read per row tile), with the empty splits past the
paths; the split holding that tile and the next one (a path is at most 64 keys, a split 256) run one program per
node, its G rows in a tile of ``EXACT_ROWS``, on its keys read through its path. Every row thus goes through the same
tiles in the same order with the same values as in the 1-token step, and the splits are merged in order.
"""

from __future__ import annotations

import math

import torch

from ._common import dot_precision, pick_impl, tl, triton
from .attn_combine import combine_partials_triton
from .verify_attention import (
    _attend_tile,
    _cache_shapes,
    _launch_plan,
    _packed_rows,
    _store_rows,
    masked_attention_torch,
    verify_attention_torch,
)

__all__ = ["tree_attention", "tree_attention_torch", "tree_paths"]

_LOG2E = 1.4426950408889634


@triton.jit
def _tree_attn_kernel(
    Q, K, V, CacheLen, Bits, Out, PartAcc, PartM, PartL,
    qk_scale,  # scale · log2(e)
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_ot, stride_oh,
    stride_bb,
    Hkv, S, T, chunk, num_splits,
    G: tl.constexpr, D: tl.constexpr, NUM_MB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid_s = tl.program_id(1)
    bh, b, kvh, rows, row_ok, t, h, d, d_ok, q, clen = _packed_rows(
        Q, CacheLen, stride_qb, stride_qt, stride_qh, Hkv, T, G, D, NUM_MB, BLOCK_M, BLOCK_D)
    bits = tl.load(Bits + b * stride_bb + t, mask=row_ok, other=0).to(tl.int64)  # [BLOCK_M]

    lo = pid_s * chunk
    hi = tl.minimum(tl.minimum(lo + chunk, clen + T), S)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        kt = tl.load(k_base + n[None, :] * stride_ks + d[:, None],
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # fmt: skip
        node = n - clen  # tree node of key n (negative: the committed prefix)
        shift = tl.where((node >= 0) & (node < 64), node, 0).to(tl.int64)
        in_tree = ((bits[:, None] >> shift[None, :]) & 1) != 0
        vis = n_ok[None, :] & ((node[None, :] < 0) | in_tree)
        m_i, l_i, acc = _attend_tile(q, kt, v_base + n[:, None] * stride_vs + d[None, :],
                                     n_ok[:, None] & d_ok[None, :], vis, m_i, l_i, acc, qk_scale, PREC)

    _store_rows(Out, PartAcc, PartM, PartL, m_i, l_i, acc, (bh * num_splits + pid_s) * (T * G) + rows, row_ok,
                b * stride_ob + t * stride_ot + h * stride_oh, d, d_ok, D, SPLIT)


@triton.jit
def _tree_attn_exact_prefix_kernel(
    Q, K, V, CacheLen, PartAcc, PartM, PartL,
    qk_scale,  # scale · log2(e)
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    Hkv, S, T, chunk, num_splits,
    G: tl.constexpr, D: tl.constexpr, NUM_MB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    # exact mode, the splits wholly below the first tile that holds a tree key (every key visible to every row: packed
    # rows, _verify_attn_kernel's arithmetic) and the empty splits past the paths; _tree_attn_exact_path_kernel writes
    # the two splits from that tile on
    pid_s = tl.program_id(1)
    bh, b, kvh, rows, row_ok, t, h, d, d_ok, q, clen = _packed_rows(
        Q, CacheLen, stride_qb, stride_qt, stride_qh, Hkv, T, G, D, NUM_MB, BLOCK_M, BLOCK_D)
    tree_split = (clen // BLOCK_N * BLOCK_N) // chunk  # the split holding the first tree tile
    lo = pid_s * chunk
    hi = tl.where(pid_s < tree_split, tl.minimum(lo + chunk, S), lo)  # below the tree split: every key visible
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        kt = tl.load(k_base + n[None, :] * stride_ks + d[:, None],
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # fmt: skip
        m_i, l_i, acc = _attend_tile(q, kt, v_base + n[:, None] * stride_vs + d[None, :],
                                     n_ok[:, None] & d_ok[None, :], n_ok[None, :], m_i, l_i, acc, qk_scale, PREC)

    split = rows * 0 + pid_s  # [BLOCK_M]: a vector mask (the interpreter refuses a scalar bool in one)
    ok = row_ok & ((split < tree_split) | (split > tree_split + 1))  # the path kernel writes the other two
    _store_rows(PartAcc, PartAcc, PartM, PartL, m_i, l_i, acc, (bh * num_splits + pid_s) * (T * G) + rows, ok, rows,
                d, d_ok, D, True)


@triton.jit
def _tree_attn_exact_path_kernel(
    Q, K, V, CacheLen, Path, Depth, PartAcc, PartM, PartL,
    qk_scale,  # scale · log2(e)
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_pb, stride_pt, stride_db,
    Hkv, S, T, chunk, num_splits,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    # exact mode, one node's G rows (in a tile of BLOCK_M, the 1-token step's configuration) over the split holding the
    # first tree tile (pid_s 0) or the next one (pid_s 1): its keys read through the node's path (module docstring)
    pid = tl.program_id(0)
    t = pid % T
    bh = pid // T
    b = (bh // Hkv).to(tl.int64)
    kvh = bh % Hkv

    g = tl.arange(0, BLOCK_M)
    row_ok = g < G
    h = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    q = tl.load(Q + b * stride_qb + t * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    clen = tl.load(CacheLen + b).to(tl.int32)
    q_pos = clen + tl.load(Depth + b * stride_db + t).to(tl.int32)  # the node's position: prefix + depth
    q_pos_r = q_pos + tl.zeros([BLOCK_M], tl.int32)
    split = (clen // BLOCK_N * BLOCK_N) // chunk + tl.program_id(1)
    valid = split < num_splits

    lo = split * chunk
    hi = tl.where(valid, tl.minimum(tl.minimum(lo + chunk, q_pos + 1), S), lo)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    p_base = Path + b * stride_pb + t * stride_pt

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # logical key: the prefix, then the path in depth order
        n_ok = n < hi
        on_path = n_ok & (n >= clen)
        node = tl.load(p_base + tl.where(on_path, n - clen, 0), mask=on_path, other=0)
        slot = tl.where(on_path, clen + node, n)
        kt = tl.load(k_base + slot[None, :] * stride_ks + d[:, None],
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # fmt: skip
        vis = n_ok[None, :] & (n[None, :] <= q_pos_r[:, None])
        m_i, l_i, acc = _attend_tile(q, kt, v_base + slot[:, None] * stride_vs + d[None, :],
                                     n_ok[:, None] & d_ok[None, :], vis, m_i, l_i, acc, qk_scale, PREC)

    ok = row_ok & (g * 0 + split < num_splits)
    _store_rows(PartAcc, PartAcc, PartM, PartL, m_i, l_i, acc, (bh * num_splits + split) * (T * G) + t * G + g, ok, g,
                d, d_ok, D, True)


def tree_paths(tree_bits: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """``path [B, T, T]`` int32: ``path[b, t, d]`` = the node at depth d on node t's path from the root (itself at
    ``d = depth[b, t]``; entries past its depth are 0 and never read). ``tree_bits [B, T]`` int64 ancestor bitmasks
    (self included, ``dspine.tree.ancestor_bits``), ``depth [B, T]`` int (root 0). No host sync (CUDA-graph safe).
    Assumes a node's ancestors have distinct depths (true of a tree)."""
    B, T = tree_bits.shape
    i = torch.arange(T, device=tree_bits.device)
    member = ((tree_bits[:, :, None] >> i) & 1) != 0  # [B, T, T]: node i on node t's path
    col = torch.where(member, depth.long()[:, None, :].expand(B, T, T), T)  # its depth, or the spill column T
    path = torch.zeros(B, T, T + 1, dtype=torch.int32, device=tree_bits.device)
    path.scatter_(2, col, i.to(torch.int32).expand(B, T, T).contiguous())
    return path[..., :T].contiguous()


def _check_exact(depth, path, B, T):
    """Shapes and dtypes of exact mode's ``depth`` and ``path`` (values are not checked: no host sync)."""
    if depth is None or tuple(depth.shape) != (B, T) or depth.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"exact=True needs depth [{B}, {T}] int32/int64 (the nodes' depths), got "
                         f"{None if depth is None else (depth.dtype, tuple(depth.shape))}")  # fmt: skip
    if path is not None and (tuple(path.shape) != (B, T, T) or path.dtype != torch.int32):
        raise ValueError(f"path must be int32 [{B}, {T}, {T}] (tree_paths), got {path.dtype} {tuple(path.shape)}")


def _check(q, k_cache, v_cache, tree_bits):
    B, T, Hq, D, Hkv, S = _cache_shapes(q, k_cache, v_cache)
    if tuple(tree_bits.shape) != (B, T) or tree_bits.dtype != torch.int64:
        raise ValueError(f"tree_bits must be int64 [{B}, {T}], got {tree_bits.dtype} {tuple(tree_bits.shape)}")
    if T > 64:
        raise ValueError(f"T={T} tree nodes: the bitmask holds at most 64")
    return B, T, Hq, D, Hkv, S


def tree_attention_triton(q, k_cache, v_cache, cache_len, tree_bits, scale, *, out=None, num_splits=None,
                          blocks=None, exact=False, depth=None, path=None):
    B, T, Hq, D, Hkv, S = _check(q, k_cache, v_cache, tree_bits)
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or tree_bits.stride(-1) != 1:
        raise ValueError("q, k_cache, v_cache, tree_bits need a contiguous last dim")
    if D > 256:
        raise ValueError(f"head_dim {D} > 256 is not supported")
    G = Hq // Hkv
    out = torch.empty_like(q) if out is None else out
    if exact:
        _check_exact(depth, path, B, T)
        # the kernels index depth and path with their leading strides only: contiguous copies (no-ops if already)
        depth = depth.contiguous()
        path = tree_paths(tree_bits, depth) if path is None else path.contiguous()
        (bm, bn, bd, warps, stages), num_mb, ns, chunk, (part_acc, part_m, part_l) = _launch_plan(
            q, Hkv, S, None, out, exact=True)
        if G > bm:
            raise ValueError(f"exact tree attention: {G} query heads per kv head; its per-node programs hold at most "
                             f"{bm} (one {bm}-row tile, the 1-token step's)")
        common = (float(scale) * _LOG2E, q.stride(0), q.stride(1), q.stride(2),
                  k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))  # fmt: skip
        blocks = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, PREC=dot_precision(q.dtype), num_warps=warps,
                      num_stages=stages)  # fmt: skip
        _tree_attn_exact_prefix_kernel[(B * Hkv * num_mb, ns)](
            q, k_cache, v_cache, cache_len, part_acc, part_m, part_l, *common,
            Hkv, S, T, chunk, ns, G=G, D=D, NUM_MB=num_mb, **blocks,
        )  # fmt: skip
        _tree_attn_exact_path_kernel[(B * Hkv * T, 2)](  # a path spans at most two splits (≤ 64 keys, 256 per split)
            q, k_cache, v_cache, cache_len, path, depth, part_acc, part_m, part_l, *common,
            path.stride(0), path.stride(1), depth.stride(0), Hkv, S, T, chunk, ns, G=G, D=D, **blocks,
        )  # fmt: skip
        combine_partials_triton(part_acc, part_m, part_l, out, ordered=True)
        return out
    plan = _launch_plan(q, Hkv, S, num_splits, out, blocks=blocks)
    (bm, bn, bd, warps, stages), num_mb, ns, chunk, (part_acc, part_m, part_l) = plan
    split = ns > 1
    _tree_attn_kernel[(B * Hkv * num_mb, ns)](
        q, k_cache, v_cache, cache_len, tree_bits, out, part_acc, part_m, part_l,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        tree_bits.stride(0),
        Hkv, S, T, chunk, ns,
        G=G, D=D, NUM_MB=num_mb, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
        SPLIT=split, PREC=dot_precision(q.dtype),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if split:
        combine_partials_triton(part_acc, part_m, part_l, out)
    return out


def tree_attention_torch(q, k_cache, v_cache, cache_len, tree_bits, scale, *, out=None, num_splits=None,
                         blocks=None, exact=False, depth=None, path=None):
    """Reference: masked softmax in fp32 over the whole cache (no host sync, graph-capturable). ``exact``: each
    node on its own as ``verify_attention_torch(exact=True)``'s 1-token query over a copy of its row's cache whose
    positions after the prefix hold the node's path in depth order (host loops: tests and the CPU engine)."""
    del num_splits, blocks
    B, T, Hq, D, Hkv, S = _check(q, k_cache, v_cache, tree_bits)
    if exact:
        _check_exact(depth, path, B, T)
        path = (tree_paths(tree_bits, depth) if path is None else path).long()
        o = torch.empty(B, T, Hq, D, device=q.device, dtype=q.dtype)
        for b in range(B):
            clen = int(cache_len[b])
            for t in range(T):
                dep = int(depth[b, t])
                src = clen + path[b, t, : dep + 1]
                k1, v1 = k_cache[b : b + 1].clone(), v_cache[b : b + 1].clone()
                k1[:, :, clen : clen + dep + 1] = k_cache[b : b + 1, :, src]
                v1[:, :, clen : clen + dep + 1] = v_cache[b : b + 1, :, src]
                o[b, t] = verify_attention_torch(q[b : b + 1, t : t + 1].clone(), k1, v1,
                                                 cache_len[b : b + 1] + dep, scale, exact=True)[0, 0]  # fmt: skip
        return o if out is None else out.copy_(o)
    node = torch.arange(S, device=q.device)[None, :] - cache_len.to(torch.long)[:, None]  # [B, S]
    bit = (tree_bits[:, :, None] >> node.clamp(0, 63)[:, None, :]) & 1  # [B, T, S]
    vis = (node[:, None, :] < 0) | ((node[:, None, :] < T) & (bit != 0))
    return masked_attention_torch(q, k_cache, v_cache, cache_len, vis, scale, out)


def tree_attention(q, k_cache, v_cache, cache_len, tree_bits, scale, impl: str = "triton", *, out=None,
                   num_splits=None, blocks=None, exact: bool = False, depth=None, path=None):  # fmt: skip
    """Tree attention of q [B, T, Hq, D] over k/v_cache [B, Hkv, S, D]: the prefix below cache_len[b]
    and the ancestors (``tree_bits [B, T]`` int64) of each node (module docstring).

    Returns out [B, T, Hq, D] in q's dtype (written into ``out`` if given). ``num_splits`` overrides
    the split-K count (tests); ``blocks`` = (BLOCK_M, BLOCK_N, num_warps, num_stages) the tile rule (tuning).
    ``exact`` (module docstring): node t's bits are ``verify_attention(exact=True)``'s for the same token at
    position ``cache_len[b] + depth[b, t]`` after its path; needs ``depth [B, T]`` (int, root 0), takes ``path``
    from :func:`tree_paths` if given (the engine computes it once per step, not per layer); ``num_splits`` and
    ``blocks`` are then ignored. ``depth`` must be each node's depth (the number of its ancestors, itself excluded:
    popcount(tree_bits) − 1) and ``path`` ``tree_paths(tree_bits, depth)``; the values are not checked (a check
    would sync the host), and inconsistent ones give wrong results, not an error.
    Raises ValueError on inconsistent shapes, T > 64, non-int64 bits, or ``exact`` without an int32/int64 ``depth``
    of [B, T] (or with a ``path`` that is not int32 [B, T, T]), or, on the Triton path, with more query heads per kv
    head than one exact-mode row tile holds (64 in bf16).
    """
    fn = pick_impl(impl, tree_attention_triton, tree_attention_torch)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return fn(q, k_cache, v_cache, cache_len, tree_bits, scale, out=out, num_splits=num_splits, blocks=blocks,
              exact=exact, depth=depth, path=path)
