"""Best-first token tree, ancestor mask and ancestor bits in three launches (``dspine.tree``).

Op: ``dspine.tree.build_tree`` bit for bit (best first under a node budget N, chain first or not, breadth-first
layout, padding: that module's docstring), plus ``anc = ancestor_mask(parent)`` and
``bits = ancestor_bits(anc)``. The per-depth candidates (``dspine.tree.tree_candidates``: the chain
token, the W - 1 most probable others by q, equal q by lower token id) are two launches
(:func:`candidates_triton`): per (row, vocabulary chunk of 1,024+ tokens) the best 2^G keys by a bitonic
top-k, then per row the best of those; their log is torch's, so both paths add the same fp32 numbers. The
rest (in torch a K-long loop of sort, gather and cat kernels, then ceil(log2 N) batched matmuls) is one
Triton program per row:

  * the beam of depth d is the chain node (slot 0, score kept apart) and slots 1..M-1 (M = N - 1), best
    first. Depth d + 1 keeps the chain child (key +inf: always slot 0) and the best M - 1 of the other
    children, ordered as torch's stable descending sort orders them: by score ``s[m] + logq[d, j]``
    (fp32), ties by lower flat index m·W + j. Each child is packed into one int64 whose ascending order
    is that order. The children of slots 1.. at candidate j form a list already sorted (the beam is best
    first and fp32 addition is monotone), so the best BM of the W lists are a bitonic merge tree, with
    no sort [Batcher 1968]; the chain node's W - 1 other children are sorted (BM entries) and merged in.
  * the best M over all depths: the min(K, M) chain nodes (+inf), then the best of the recorded slots
    1.. of every depth, again sorted lists merged. Node index = 1 + the picks with a lower flat index
    (depth, then slot: breadth first); padding (score -inf) fills the last nodes.
  * without the chain first (``chain_first=False``, ``_best_first_kernel``): the beam is slots 0..M-1, every
    slot's W children in the lists (the chain node's too), and the lane of the chain node is followed from
    depth to depth for the chain flags (-1 once it scored out).
  * parents by matching flat indices; ancestor bits by pointer jumping over the parents (read back in
    node order after a barrier, ceil(log2(min(K, M) + 1)) rounds of one-hot gathers); the mask from them.

Packed key: bits 63..32 hold -score as an int32 in float order (negative floats have their 31 low bits
flipped); the index lies below. Scores are never NaN (q >= 0) nor -0.0 (log q <= 0 added to a +0.0
root), the two cases where this integer order would differ from torch's float order; +inf sorts first,
-inf last. Comparator layers work on the [2] * L hypercube of a power-of-2 vector.

Layouts: anchor [B] int64; q [B, K, V] fp32 (rows sum to 1); chain_tokens [B, K] int64 (default
argmax). Returns ``dspine.tree.Tree``: tokens, parent, depth [B, N] int64, chain [B, N] bool,
anc [B, N, N] bool, bits [B, N] int64, rank [B, N] int64 (a node's place in the selection order: the lane of
the merged best M it came from). Constraints: 2 <= N <= 64 (one bit per node), 1 <= K <= 64.
No host sync and fixed shapes: CUDA-graph capturable. Kernel memory traffic per row: 8·K·W bytes of
log q read, at most 8·N of token gathers, 33·N + N² bytes written; the candidates read q once and write
16·(V / chunk)·2^G bytes of chunk picks per (row, depth).
Exactness: ``build_tree_triton`` and ``build_tree_torch`` return identical tensors.
"""

from __future__ import annotations

import torch

from dspine.tree import Tree, ancestor_bits, build_tree

from ._common import next_pow2, pick_impl, tl, triton

__all__ = ["build_tree_fused", "build_tree_triton", "build_tree_torch", "candidates_triton"]

MAX_NODES = 64  # one int64 bitmask per node
MAX_DEPTH = 64  # the picks of all depths are held in registers ([BK, BM] int64)


@triton.jit
def _packed_key(score):
    """int32 in ascending order for descending fp32 scores (-0.0 and NaN excluded)."""
    u = (-score).to(tl.int32, bitcast=True)
    return u ^ ((u >> 31) & 0x7FFFFFFF)


@triton.jit
def _unpacked_score(hi):
    """The fp32 score of a high word made by _packed_key (the map is its own inverse)."""
    u = hi ^ ((hi >> 31) & 0x7FFFFFFF)
    return -(u.to(tl.float32, bitcast=True))


@triton.jit
def _bit(L: tl.constexpr, t: tl.constexpr):
    """Bit t of the flat index (0/1) as a tensor broadcastable to the hypercube [2] * L."""
    return tl.reshape(tl.arange(0, 2), [1] * (L - 1 - t) + [2] + [1] * t)


@triton.jit
def _exchange(h, L: tl.constexpr, t: tl.constexpr, desc):
    """One comparator layer on the int64 hypercube h: each pair of flat indices differing in bit t is put
    in ascending order where desc is 0, descending where 1. The partner is the pair's sum minus the
    entry (a wrapping int64 sum is still exact): one sum over a dim of size 2."""
    partner = tl.sum(h, axis=L - 1 - t, keep_dims=True) - h
    take_min = (_bit(L, t) ^ desc) == 0
    return tl.where(take_min, tl.minimum(h, partner), tl.maximum(h, partner))


@triton.jit
def _merge(h, L: tl.constexpr, G: tl.constexpr, desc):
    """Bitonic merge of every block of 2^G consecutive entries (a bitonic sequence each) [Batcher 1968]."""
    for u in tl.static_range(G):
        h = _exchange(h, L, G - 1 - u, desc)
    return h


@triton.jit
def _direction(L: tl.constexpr, s: tl.constexpr):
    """Sort direction of the blocks of 2^s: bit s of the index (alternating), ascending for the whole."""
    if s < L:
        return _bit(L, s)
    else:
        return 0


@triton.jit
def _smallest(x, L: tl.constexpr, G: tl.constexpr, SORTED: tl.constexpr):
    """The 2^G smallest of the 2^L entries of 1-D int64 x, ascending (1 <= G <= L). Blocks of 2^G are
    sorted (skipped if SORTED: already ascending where bit G of the index is 0, descending where 1);
    then L - G halvings, each keeping the smaller entry of every pair of opposite-ordered neighbour
    blocks (a bitonic block of their 2^G smallest) and merging it again [Shanbhag et al. 2018, bitonic
    top-k]."""
    h = tl.reshape(x, [2] * L)
    if not SORTED:
        for s in tl.static_range(1, G + 1):
            h = _merge(h, L, s, _direction(L, s))
    for r in tl.static_range(L - G):
        h = tl.min(h, axis=L - r - 1 - G)  # the dim of bit G
        h = _merge(h, L - r - 1, G, _direction(L - r - 1, G))
    return tl.reshape(h, [2**G])


@triton.jit
def _reversed(x, L: tl.constexpr):
    """1-D int x of 2^L entries in reverse order (every index bit flipped, one pair swap per bit)."""
    h = tl.reshape(x, [2] * L)
    for t in tl.static_range(L):
        h = tl.sum(h, axis=t, keep_dims=True) - h
    return tl.reshape(h, [2**L])


@triton.jit
def _root_and_ancestors(Tokens, Parent, Depth, Chain, Anc, Bits, Rank, Anchor, b, stride_a, N,
                        BN: tl.constexpr, ROUNDS: tl.constexpr):  # fmt: skip
    """Node 0 (the anchor), then every node's ancestor bits and mask row from the parents stored so far."""
    n = tl.arange(0, BN)
    first = n == 0
    tl.store(Tokens + b * N + n, tl.load(Anchor + b * stride_a + n * 0), mask=first)
    tl.store(Parent + b * N + n, tl.full([BN], -1, tl.int64), mask=first)
    tl.store(Depth + b * N + n, tl.zeros([BN], tl.int64), mask=first)
    tl.store(Rank + b * N + n, tl.zeros([BN], tl.int64), mask=first)
    tl.store(Chain + b * N + n, first.to(Chain.dtype.element_ty), mask=first)
    tl.debug_barrier()  # the parents above, written by other threads, are read back in node order

    # ancestors by pointer jumping: bits[n] = the nodes from n up to (not including) jump[n], -1 = none
    jump = tl.load(Parent + b * N + n, mask=n < N, other=-1)
    bits = tl.where(n < N, tl.full([BN], 1, tl.int64) << n.to(tl.int64), 0)
    for _ in tl.static_range(ROUNDS):  # each round doubles the levels covered
        hit = jump[:, None] == n[None, :]
        bits = bits | tl.sum(tl.where(hit, bits[None, :], 0), axis=1)  # one term: the sum is that bit set
        jump = tl.where(jump >= 0, tl.sum(tl.where(hit, jump[None, :] + 1, 0), axis=1) - 1, jump)
    tl.store(Bits + b * N + n, bits, mask=n < N)
    row = ((bits[:, None] >> n[None, :].to(tl.int64)) & 1) != 0
    tl.store(Anc + (b * N + n)[:, None] * N + n[None, :], row.to(Anc.dtype.element_ty),
             mask=(n < N)[:, None] & (n < N)[None, :])  # fmt: skip


@triton.jit
def _build_tree_kernel(
    LogQ, Cand, Anchor, Tokens, Parent, Depth, Chain, Anc, Bits, Rank,
    stride_lb, stride_lk, stride_cb, stride_ck, stride_a,
    K, M, W, N, KC,
    BM: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
    LOG_M: tl.constexpr, LOG_W: tl.constexpr, LOG_K: tl.constexpr, ROUNDS: tl.constexpr,
):  # fmt: skip
    IDX: tl.constexpr = LOG_M + LOG_W + 1  # bits of a child's index m·BW + j (m <= BM)
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BM)  # position in a beam: slot c + 1 (slot 0, the chain node, is kept apart)
    j = tl.arange(0, BW)  # candidate column
    dk = tl.arange(0, BK)
    empty = tl.full([BM], 0x7FFFFFFF, tl.int64) << 32  # after every key (-inf is 0x7F800000 << 32)
    # the children of beam slot m >= 1 at candidate j, as BW lists of BM over the slots: slot m = c + 1 in
    # ascending lists (even j), m = BM - c in descending ones (odd j); the beam is best first, so each
    # list is sorted in packed order and the BM best of all are a merge (_smallest, SORTED)
    odd = (j % 2 == 1)[:, None]
    m2 = tl.where(odd, BM - c[None, :], c[None, :] + 1)
    idx2 = (m2 * BW + j[:, None]).to(tl.int64)
    live2 = (m2 < M) & (j < W)[:, None]
    chain_s = tl.zeros([BM], tl.float32)  # the chain node's score (every lane)
    rest = tl.full([BM], float("-inf"), tl.float32)  # scores of beam slots 1.. (at c = slot - 1)
    picks = tl.full([BK, BM], 0x7FFFFFFF, tl.int64) << 32  # slots >= 1 of every depth, packed
    lq_row = LogQ + b * stride_lb
    for d in range(K):
        lq = tl.load(lq_row + d * stride_lk + j, mask=j < W, other=float("-inf"))
        lq_c = tl.load(lq_row + d * stride_lk + c, mask=(c >= 1) & (c < W), other=float("-inf"))
        lq0 = tl.load(lq_row + d * stride_lk)
        rev = _reversed(rest.to(tl.int32, bitcast=True), LOG_M).to(tl.float32, bitcast=True)
        score = tl.where(odd, rev[None, :], rest[None, :]) + lq[:, None]
        lists = tl.where(live2, (_packed_key(score).to(tl.int64) << 32) | idx2, empty[None, :])
        best = _smallest(tl.reshape(lists, [BW * BM]), LOG_W + LOG_M, LOG_M, True)
        # the chain node's children but its chain child (+inf, always slot 0): index j, sorted descending
        kids = (_packed_key(chain_s + lq_c).to(tl.int64) << 32) | c.to(tl.int64)
        kids = ~_smallest(~tl.where((c >= 1) & (c < W), kids, empty), LOG_M, LOG_M, False)
        best = tl.reshape(_merge(tl.reshape(tl.minimum(best, kids), [2] * LOG_M), LOG_M, LOG_M, 0), [BM])
        hi = best >> 32
        chain_s = chain_s + lq0
        rest = tl.where(c < M - 1, _unpacked_score(hi.to(tl.int32)), float("-inf"))
        # recorded with flat index d·BM + slot; odd depths reversed for the final merge (SORTED)
        rec = (hi << 32) | ((d * BM + c + 1).to(tl.int64) << IDX) | (best & ((1 << IDX) - 1))
        rec = tl.where(c < M - 1, rec, empty)
        rec = tl.where(d % 2 == 1, _reversed(rec, LOG_M), rec)
        picks = tl.where((dk == d)[:, None], rec[None, :], picks)

    # the best M: the KC = min(K, M) chain nodes (key +inf, slot 0 of depths 0..KC-1) and the best M - KC
    # recorded slots; node order: flat index ascending (depth, then slot); padding last
    top = _smallest(tl.reshape(picks, [BK * BM]), LOG_K + LOG_M, LOG_M, True)
    real = (c < M - KC) & ((top >> 32) < 0x7F800000)
    f = tl.where(real, (top >> IDX) & ((1 << (LOG_K + LOG_M)) - 1), 1 << 30)  # flat index d·BM + slot
    dep = f // BM
    m = (top & ((1 << IDX) - 1)) // BW  # the parent's slot at depth d - 1
    col = top & (BW - 1)  # its candidate column
    below = (f[None, :] < f[:, None]).to(tl.int32)  # [BM, BM]: picks before pick c
    node = tl.where(real, 1 + tl.minimum(KC, dep + 1) + tl.sum(below, axis=1), 1 + KC + c)
    pf = (dep - 1) * BM + m  # the parent's flat index
    found = (m == 0) | (tl.sum(((f[None, :] == pf[:, None]) & real[None, :]).to(tl.int32), axis=1) > 0)
    ups = tl.sum((f[None, :] < pf[:, None]).to(tl.int32), axis=1)  # picks before the parent
    p_node = 1 + tl.minimum(KC, dep - 1 + (m > 0).to(tl.int64)) + ups  # chain nodes before it, then those
    parent = tl.where(real, tl.where(dep == 0, 0, tl.where(found, p_node, -1)), -1)
    tok = tl.load(Cand + b * stride_cb + dep * stride_ck + col, mask=real, other=0)
    out = b * N + node
    ok = c < M - KC
    tl.store(Tokens + out, tl.where(real, tok, 0), mask=ok)
    tl.store(Parent + out, parent.to(tl.int64), mask=ok)
    tl.store(Depth + out, tl.where(real, dep + 1, 0).to(tl.int64), mask=ok)
    tl.store(Chain + out, tl.zeros([BM], tl.int1).to(Chain.dtype.element_ty), mask=ok)
    tl.store(Rank + out, (1 + KC + c).to(tl.int64), mask=ok)  # after the KC chain nodes, by key
    # chain nodes, depth e = 0..KC-1: node 1 + e + the picks before it; its parent the one above
    e = dk
    before = tl.sum((f[None, :] < (e * BM)[:, None]).to(tl.int32), axis=1)
    before_up = tl.sum((f[None, :] < ((e - 1) * BM)[:, None]).to(tl.int32), axis=1)
    out = b * N + 1 + e + before
    ok = e < KC
    chain_tok = tl.load(Cand + b * stride_cb + e * stride_ck, mask=ok, other=0)
    tl.store(Tokens + out, chain_tok, mask=ok)
    tl.store(Parent + out, tl.where(e == 0, 0, e + before_up).to(tl.int64), mask=ok)
    tl.store(Depth + out, (e + 1).to(tl.int64), mask=ok)
    tl.store(Chain + out, (e >= 0).to(Chain.dtype.element_ty), mask=ok)
    tl.store(Rank + out, (1 + e).to(tl.int64), mask=ok)  # key +inf, in depth order
    _root_and_ancestors(Tokens, Parent, Depth, Chain, Anc, Bits, Rank, Anchor, b, stride_a, N, BN, ROUNDS)


@triton.jit
def _best_first_kernel(
    LogQ, Cand, Anchor, Tokens, Parent, Depth, Chain, Anc, Bits, Rank,
    stride_lb, stride_lk, stride_cb, stride_ck, stride_a,
    K, M, W, N,
    BM: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
    LOG_M: tl.constexpr, LOG_W: tl.constexpr, LOG_K: tl.constexpr, ROUNDS: tl.constexpr,
):  # fmt: skip
    """``_build_tree_kernel`` without the chain kept first (``chain_first=False``): the beam of every depth is
    slots 0..M-1 at lanes c = slot, the chain node among them while it scores in; its lane is followed
    (``chain_lane``, -1 once it fell out) for the chain flags."""
    IDX: tl.constexpr = LOG_M + LOG_W + 1  # bits of a child's index m·BW + j (m < BM)
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BM)
    j = tl.arange(0, BW)
    dk = tl.arange(0, BK)
    empty = tl.full([BM], 0x7FFFFFFF, tl.int64) << 32
    # the children of slot m at candidate j, as BW lists over the slots, ascending (even j) or descending
    # (odd j) in packed order: the beam is best first, so the BM best of all are a merge (_smallest, SORTED)
    odd = (j % 2 == 1)[:, None]
    m2 = tl.where(odd, BM - 1 - c[None, :], c[None, :])
    idx2 = (m2 * BW + j[:, None]).to(tl.int64)
    live2 = (m2 < M) & (j < W)[:, None]
    beam = tl.where(c == 0, 0.0, float("-inf"))  # scores of slots 0..M-1; depth 0: the root alone
    chain_lane = 0  # the root is the chain's first node
    chain_at = tl.full([BK], -1, tl.int32)  # the chain node's slot at every depth, -1: not in the beam
    picks = tl.full([BK, BM], 0x7FFFFFFF, tl.int64) << 32
    lq_row = LogQ + b * stride_lb
    for d in range(K):
        lq = tl.load(lq_row + d * stride_lk + j, mask=j < W, other=float("-inf"))
        rev = _reversed(beam.to(tl.int32, bitcast=True), LOG_M).to(tl.float32, bitcast=True)
        score = tl.where(odd, rev[None, :], beam[None, :]) + lq[:, None]
        lists = tl.where(live2, (_packed_key(score).to(tl.int64) << 32) | idx2, empty[None, :])
        best = _smallest(tl.reshape(lists, [BW * BM]), LOG_W + LOG_M, LOG_M, True)
        hi = best >> 32
        keep = c < M
        kid = best & ((1 << IDX) - 1)
        beam = tl.where(keep, _unpacked_score(hi.to(tl.int32)), float("-inf"))
        is_chain = keep & (hi < 0x7F800000) & (kid == chain_lane * BW) & (chain_lane >= 0)
        chain_lane = tl.max(tl.where(is_chain, c, -1), axis=0)
        chain_at = tl.where(dk == d, chain_lane, chain_at)
        rec = (hi << 32) | ((d * BM + c).to(tl.int64) << IDX) | kid  # flat index d·BM + slot
        rec = tl.where(keep, rec, empty)
        rec = tl.where(d % 2 == 1, _reversed(rec, LOG_M), rec)
        picks = tl.where((dk == d)[:, None], rec[None, :], picks)

    # the best M of all depths; node order: flat index ascending (depth, then slot); padding last
    top = _smallest(tl.reshape(picks, [BK * BM]), LOG_K + LOG_M, LOG_M, True)
    real = (c < M) & ((top >> 32) < 0x7F800000)
    f = tl.where(real, (top >> IDX) & ((1 << (LOG_K + LOG_M)) - 1), 1 << 30)
    dep = f // BM
    m = (top & ((1 << IDX) - 1)) // BW  # the parent's slot at depth d - 1
    col = top & (BW - 1)
    node = tl.where(real, 1 + tl.sum((f[None, :] < f[:, None]).to(tl.int32), axis=1), 1 + c)
    pf = (dep - 1) * BM + m
    found = tl.sum(((f[None, :] == pf[:, None]) & real[None, :]).to(tl.int32), axis=1) > 0
    p_node = 1 + tl.sum((f[None, :] < pf[:, None]).to(tl.int32), axis=1)
    parent = tl.where(real, tl.where(dep == 0, 0, tl.where(found, p_node, -1)), -1)
    lane_of_chain = tl.sum(tl.where(dk[None, :] == dep[:, None], chain_at[None, :], 0), axis=1)
    on_chain = real & ((f % BM) == lane_of_chain)
    tok = tl.load(Cand + b * stride_cb + dep * stride_ck + col, mask=real, other=0)
    out = b * N + node
    ok = c < M
    tl.store(Tokens + out, tl.where(real, tok, 0), mask=ok)
    tl.store(Parent + out, parent.to(tl.int64), mask=ok)
    tl.store(Depth + out, tl.where(real, dep + 1, 0).to(tl.int64), mask=ok)
    tl.store(Chain + out, on_chain.to(Chain.dtype.element_ty), mask=ok)
    tl.store(Rank + out, (1 + c).to(tl.int64), mask=ok)  # lane c of top is the c-th pick by key
    _root_and_ancestors(Tokens, Parent, Depth, Chain, Anc, Bits, Rank, Anchor, b, stride_a, N, BN, ROUNDS)


@triton.jit
def _cand_chunk_kernel(
    Q, Chain, Part, V, stride_q, CHUNK_ITEMS,
    CHUNK: tl.constexpr, L: tl.constexpr, G: tl.constexpr, HAS_CHAIN: tl.constexpr,
):  # fmt: skip
    """Program (row r, chunk c): the 2^G best tokens of q[r, c·CHUNK : (c+1)·CHUNK] (other than Chain[r] if
    HAS_CHAIN), as complemented keys ~((fp32 bits of q) << 32 | 0x7FFFFFFF - token): ascending (best first) in
    even chunks, descending in odd ones, the block order ``_smallest(..., SORTED=True)`` merges."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(Q + r * stride_q + offs, mask=offs < V, other=0.0) + 0.0  # -0.0 + 0.0 = +0.0: one key for zero
    key = (x.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0x7FFFFFFF - offs).to(tl.int64)
    ok = offs < V
    if HAS_CHAIN:
        ok = ok & (offs != tl.load(Chain + r))
    key = tl.where(ok, key, -0x7FFFFFFFFFFFFFFF - 1)  # int64 min: never picked
    top = _smallest(~key, L, G, False)
    top = tl.where(c % 2 == 1, _reversed(top, G), top)
    tl.store(Part + (r * CHUNK_ITEMS + c) * (2**G) + tl.arange(0, 2**G), top)


@triton.jit
def _cand_merge_kernel(
    Part, Q, Chain, Cand, Val, stride_q, W, ITEMS,
    L: tl.constexpr, G: tl.constexpr, HAS_CHAIN: tl.constexpr,
):  # fmt: skip
    """Program r: the best of row r's chunk picks (ITEMS keys): W - 1 after the chain token in column 0
    (HAS_CHAIN), else W (column 0 the argmax); Val = q of each (the key's high word: the same fp32 value)."""
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, 2**L)
    k = tl.load(Part + r * ITEMS + i, mask=i < ITEMS, other=0x7FFFFFFFFFFFFFFF)
    top = ~_smallest(k, L, G, True)  # best first
    j = tl.arange(0, 2**G)
    tok = (0x7FFFFFFF - (top & 0x7FFFFFFF)).to(tl.int64)
    val = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    first = 1 if HAS_CHAIN else 0
    ok = j < W - first
    tl.store(Cand + r * W + first + j, tok, mask=ok)
    tl.store(Val + r * W + first + j, val, mask=ok)
    if HAS_CHAIN:
        chain = tl.load(Chain + r)
        tl.store(Cand + r * W, chain)
        tl.store(Val + r * W, tl.load(Q + r * stride_q + chain))


def candidates_triton(q: torch.Tensor, chain_tok: torch.Tensor | None, W: int, num_warps: int | None = None):
    """``dspine.tree.tree_candidates``'s (cand, q of each) with ``top_others``'s order, in two launches: per
    (row, chunk of the vocabulary) the best 2^G keys by a bitonic top-k (``_smallest``), then per row the
    best of those. q ``[B, K, V]`` fp32 (>= 0, last dim contiguous), chain_tok ``[B, K]`` int64 or None (the
    argmax: column 0 is then the best token, ties to the lower id as ``torch.argmax``), 1 <= W <= V.
    Returns cand ``[B, K, W]`` int64 and q values ``[B, K, W]`` fp32. Memory traffic: q read once, plus
    16·B·K·(V / chunk)·2^G bytes of chunk picks. Raises ValueError on a q that is not ``[B, K, V]`` fp32, chain
    tokens of another shape or dtype, or W outside [1, V]. (-0.0 in q counts as +0.0.)"""
    if q.dim() != 3 or q.dtype != torch.float32:
        raise ValueError(f"q must be [B, K, V] fp32, got {q.dtype} {tuple(q.shape)}")
    B, K, V = q.shape
    if isinstance(W, bool) or not isinstance(W, int) or not 1 <= W <= V:
        raise ValueError(f"W={W!r} candidates per depth: need an int in [1, V={V}]")
    if chain_tok is not None and (chain_tok.shape != (B, K) or chain_tok.dtype != torch.int64):
        raise ValueError(f"chain_tok must be int64 [{B}, {K}], got {chain_tok.dtype} {tuple(chain_tok.shape)}")
    R = B * K
    cand = torch.empty(B, K, W, dtype=torch.int64, device=q.device)
    val = torch.empty(B, K, W, dtype=torch.float32, device=q.device)
    if R == 0:
        return cand, val
    qr = q.reshape(R, V)
    if qr.stride(1) != 1:  # the kernels read a row as one contiguous run
        qr = qr.contiguous()
    has_chain = chain_tok is not None
    ch = chain_tok.reshape(R).contiguous() if has_chain else qr  # (unused without a chain)
    n = W - 1 if has_chain else W  # picks besides the chain token
    if n == 0:
        cand[..., 0] = chain_tok
        val[..., 0] = q.gather(-1, chain_tok[..., None])[..., 0]
        return cand, val
    bg = max(2, next_pow2(n))  # _smallest keeps 2^G >= 2
    chunk = max(bg, min(next_pow2(V), max(1024, next_pow2(triton.cdiv(V, 64)))))
    C = triton.cdiv(V, chunk)
    part = torch.empty(R, C, bg, dtype=torch.int64, device=q.device)
    lg, lc = bg.bit_length() - 1, chunk.bit_length() - 1
    _cand_chunk_kernel[(R, C)](qr, ch, part, V, qr.stride(0), C, CHUNK=chunk, L=lc, G=lg, HAS_CHAIN=has_chain,
                               num_warps=num_warps or (8 if chunk >= 4096 else 4))
    items = C * bg
    lm = max(next_pow2(items), bg).bit_length() - 1
    _cand_merge_kernel[(R,)](part, qr, ch, cand, val, qr.stride(0), W, items, L=lm, G=lg, HAS_CHAIN=has_chain,
                             num_warps=8 if items > 2048 else 4)
    return cand, val


def _check(anchor, q, budget, chain_tokens):
    if q.dim() != 3 or q.dtype != torch.float32:
        raise ValueError(f"q must be [B, K, V] fp32, got {q.dtype} {tuple(q.shape)}")
    B, K, V = q.shape
    if not isinstance(budget, int) or isinstance(budget, bool):  # a shape, fixed per CUDA graph: never a tensor
        raise ValueError(f"tree budget must be a Python int, got {type(budget).__name__} {budget!r}")
    if not 2 <= budget <= MAX_NODES:
        raise ValueError(f"tree budget={budget} must be in [2, {MAX_NODES}] (root + nodes, one bit each)")
    if not 1 <= K <= MAX_DEPTH or V < 1:
        raise ValueError(f"q of {K} depths and {V} tokens: need 1 <= K <= {MAX_DEPTH} and V >= 1")
    if anchor.shape != (B,) or (chain_tokens is not None and chain_tokens.shape != (B, K)):
        raise ValueError(f"anchor must be [{B}] and chain_tokens [{B}, {K}], got {tuple(anchor.shape)} and "
                         f"{None if chain_tokens is None else tuple(chain_tokens.shape)}")
    for name, t in (("anchor", anchor), ("chain_tokens", chain_tokens)):
        if t is not None and (t.dtype != torch.int64 or t.device != q.device):
            raise ValueError(f"{name} must be int64 on {q.device}, got {t.dtype} on {t.device}")
    return B, K, V


def build_tree_triton(anchor, q, budget, chain_tokens=None, num_warps: int | None = None, chain_first: bool = True) -> Tree:
    B, K, _ = _check(anchor, q, budget, chain_tokens)
    N, M, W = budget, budget - 1, min(budget - 1, q.shape[-1])
    # [B, K, W] each; without chain tokens column 0 is the argmax (the same token as tree_candidates' q.argmax)
    cand, qv = candidates_triton(q if q.stride(-1) == 1 else q.contiguous(), chain_tokens, W)
    logq = qv.log()  # torch's log, as in tree_candidates: both paths add the same fp32 numbers
    dev = q.device
    tokens, parent, depth, bits, rank = (torch.empty(B, N, dtype=torch.int64, device=dev) for _ in range(5))
    chain = torch.empty(B, N, dtype=torch.bool, device=dev)
    anc = torch.empty(B, N, N, dtype=torch.bool, device=dev)
    if B > 0:
        bm, bw, bk, bn = max(2, next_pow2(M)), max(2, next_pow2(W)), max(2, next_pow2(K)), next_pow2(N)
        kernel, extra = (_build_tree_kernel, (min(K, M),)) if chain_first else (_best_first_kernel, ())
        kernel[(B,)](
            logq, cand, anchor, tokens, parent, depth, chain, anc, bits, rank,
            logq.stride(0), logq.stride(1), cand.stride(0), cand.stride(1), anchor.stride(0),
            K, M, W, N, *extra,
            BM=bm, BW=bw, BK=bk, BN=bn,
            LOG_M=bm.bit_length() - 1, LOG_W=bw.bit_length() - 1, LOG_K=bk.bit_length() - 1,
            ROUNDS=min(K, M).bit_length(),
            # 8 warps from N = 32 (results/tune-tree-step-h200.json, 2026-12-02: N = 32, batch 1 96 µs against 114
            # with 4; N = 16 equal), sm_90: no spills
            num_warps=num_warps or (8 if max(bm * bw, bk * bm, bn * bn) >= 1024 else 4),
        )  # fmt: skip
    # column 0 holds the chain token (given, or the argmax) and qv its q, bit for bit
    return Tree(tokens=tokens, parent=parent, depth=depth, chain=chain, anc=anc, bits=bits, chain_q=qv[..., 0],
                rank=rank)


def build_tree_torch(anchor, q, budget, chain_tokens=None, chain_first: bool = True) -> Tree:
    """Reference: ``dspine.tree.build_tree`` (its ancestor mask by matrix squaring) and ``ancestor_bits``."""
    _check(anchor, q, budget, chain_tokens)
    tree = build_tree(anchor, q, budget, chain_tokens, chain_first=chain_first)
    tree.bits = ancestor_bits(tree.anc)
    return tree


def build_tree_fused(anchor, q, budget, chain_tokens=None, impl: str = "triton", chain_first: bool = True) -> Tree:
    """Best-first token tree of ``budget`` nodes per row with its ancestor mask and bits (module docstring).

    Args: anchor ``[B]`` int64 root tokens; q ``[B, K, V]`` fp32 draft distributions of depths 1..K;
    budget N (a Python int, 2..64, root included); chain_tokens ``[B, K]`` int64 with values in [0, V)
    (default ``q.argmax(-1)``; not checked: that would sync the host inside the engine's CUDA graph);
    chain_first: keep the chain path first (``dspine.tree.build_tree``); False: every node by its score alone.
    Returns ``dspine.tree.Tree`` with ``bits`` and ``chain_q`` (``[B, K]`` fp32: q of the chain token at each depth,
    the values the tree's scores were built from) set. Raises ValueError on shapes, dtypes, a non-int budget,
    N, K out of range or a chain_first that is not a bool.
    """
    fn = pick_impl(impl, build_tree_triton, build_tree_torch)
    if not isinstance(chain_first, bool):
        raise ValueError(f"chain_first={chain_first!r} must be True or False")
    return fn(anchor, q, budget, chain_tokens, chain_first=chain_first)
