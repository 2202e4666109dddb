"""Token-tree verification in a fixed number of launches (the rule: ``dspine.tree``'s module docstring).

Ops (B rows, trees of N nodes in ``dspine.tree``'s breadth-first layout, K draft depths, V tokens):
  * ``verify_tree_greedy``: the deepest node whose every node on the root path matches the target's argmax
    at its parent (lowest index among equally deep ones); bonus = the argmax there. One program per row.
  * ``verify_tree_sample``: multi-candidate rejection sampling over the siblings [SpecInfer, Miao et al.
    2024, §4.2]: walking the nodes in order with r the residual at the current node, the chain child x
    (sampled from q[depth - 1]) is accepted iff ``u·q(x) < r(x)``, on rejection r ← max(r − q, 0); a
    deterministic child x iff ``u·Σr < r(x)``, on rejection r(x) ← 0; an accepted child becomes the
    current node with r = p_target[child]. Bonus: the exponential race ``argmax_v w[v] / e[v]`` (lowest
    v among equal maxima) over w = r at the last node, or p_target[last] if that r is all zero.
  Both return (last [B] int64, num_accepted [B] int32 = depth[last], bonus [B] int64), and with
  ``path_depth = Kp`` also path ``[B, Kp + 1]`` int64 (``dspine.tree.path_nodes``: node at depth d of the
  accepted path, d itself past depth a).

Why a walk needs no loop over the nodes: if a child i is ever tested, every sibling before it was tested
and rejected (else the walk would have left the parent). So the state when i is tested is known from the
tree alone: r = base with the earlier deterministic siblings' tokens zeroed, base = p_target[parent], or
max(p_target[parent] − q, 0) if the parent's chain child comes before i. Each node's test is then
independent of the others (``ok[i]``), the accepted child of a node is its first ok child, and the
accepted path is the set of nodes whose whole root path is first-ok (pointer doubling over the parents,
log2 N steps). Σr = Σbase − Σ base(x) over the zeroed tokens, in fp64 from per-node sums over V.

Layouts: tokens, parent, depth ``[B, N]`` int64 (parent −1: root or padding), chain ``[B, N]`` bool,
p_target ``[B, N, V]`` fp32, q ``[B, K, V]`` fp32, u ``[B, N]`` fp32 in [0, 1), exp_noise ``[B, V]`` fp32
(> 0), target_argmax ``[B, N]`` int64, ancestors ``[B, N, N]`` bool (``Tree.anc``) or ``[B, N]`` int64
(``dspine.tree.ancestor_bits``). Unit stride over V. Triton: N <= 64.
Preconditions of the Triton sampling path (``build_tree``'s trees meet them; the torch path takes any
tree): at most one chain child per node among the children after it; tokens in 0..V-1 and depths in 0..K
(the Triton path clamps values out of range where the torch path raises; neither is checked on the
device). Nodes whose parent is not before them are never tested (as in the walk); duplicate sibling tokens
are handled.

Why: ``dspine.tree.verify_tree`` walks the nodes in Python, ~15 kernels over [B, V] per node, then
``path_nodes``: ~500 launches per step at N = 64. Here: 3 launches (sampling) or 1 (greedy), whatever N
(N <= 64 on the Triton path: one int64 bitmask per node).

Kernels (sampling): (1) grid (B, S1): for every node with a deterministic child, fp64 partial sums over a
V slice of p_target[node] and of max(p_target[node] − q, 0) (q of its chain child); rows of other nodes
are masked off, so it reads 4·V bytes per such node (8·V for a chain node); (2) grid (B, S2): every
program redoes the walk ([N, N] register tiles, a few gathers, the N·S1 partials; program 0 writes last, a
and the path) and races its V slice of the last node's residual, reading p_target[last], q and exp_noise
once (12·V bytes per row); (3) one program per row merges the slices. S1 about two programs per SM over
the batch (at most 64), S2 about one. Greedy: one launch, one program per row, no V traffic. Scratch
(fp64 partials, race partials) is allocated per call: fixed shapes, no host sync, graph capturable.

Exactness (Triton vs torch on identical inputs): bit-equal except the deterministic children's test
``u·Σr < r(x)``. Torch sums the V floats of r in fp32 (its own order; CPU and CUDA differ); the kernels
take Σr = fp32(max(Σbase − Σzeroed, 0)) with both sums in fp64, i.e. the exact sum rounded once, barring
fp64 rounding at a boundary. The two differ by a few fp32 ulps of Σr at most, so the test can differ only
when u·Σr is that close to r(x) (a near-tie, measure zero for continuous u; ``verify_tree_sample_torch``
with ``sum_dtype=torch.float64`` is the kernels' sum, and the tests hold them bit-equal). Exact: the
whole greedy op; the chain child's ``u·q(x) < r(x)`` (one fp32 product, one compare); r(x), max(r − q, 0)
and the zeroing (pointwise, the same fp32 ops); ``any(r > 0)``; the race (IEEE division ``div_rn``, the
lowest index among equal maxima, across chunks and slices); the accepted path and its depth.
"""

from __future__ import annotations

import torch

from ._common import next_pow2, num_sms, pick_impl, tl, triton
from .accept import _race_parts_merge, _race_parts_store

__all__ = ["verify_tree_greedy", "verify_tree_sample", "path_from_mask", "MAX_NODES"]

MAX_NODES = 64  # Triton: [N, N] register tiles per program and 64-bit ancestor masks


# ----------------------------------------------------------------------------- shared


def path_from_mask(on_path: torch.Tensor, depth: torch.Tensor, path_depth: int) -> torch.Tensor:
    """``[B, path_depth + 1]`` int64: column d holds the node j with ``on_path [B, N]`` and depth d, or d."""
    B, N = on_path.shape
    dev = on_path.device
    slot = torch.where(on_path & (depth <= path_depth), depth, path_depth + 1)  # the rest: a dropped column
    path = torch.arange(path_depth + 2, device=dev).expand(B, path_depth + 2).clone()
    return path.scatter_(1, slot, torch.arange(N, device=dev).expand(B, N))[:, : path_depth + 1]


def _check_tree(tokens, parent, depth, **extra):
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, N], got {tuple(tokens.shape)}")
    B, N = tokens.shape
    if N < 1:
        raise ValueError("a tree has at least its root (N >= 1)")
    for name, t in (("tokens", tokens), ("parent", parent), ("depth", depth)):
        if tuple(t.shape) != (B, N) or t.dtype != torch.int64:
            raise ValueError(f"{name} must be [{B}, {N}] int64, got {tuple(t.shape)} {t.dtype}")
    for name, (t, shape, dtype) in extra.items():
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{name} must be {list(shape)} {dtype}, got {tuple(t.shape)} {t.dtype}")
    return B, N


def _check_path_depth(path_depth):
    if path_depth is not None and int(path_depth) < 0:
        raise ValueError(f"path_depth={path_depth} must be >= 0")


def _triton_nodes(N):
    if N > MAX_NODES:
        raise ValueError(f"the Triton tree ops take N <= {MAX_NODES} nodes, got {N}; use impl='torch'")


# ----------------------------------------------------------------------------- greedy


@triton.jit
def _greedy_kernel(
    Tokens,
    Parent,
    Depth,
    Anc,
    TA,
    Last,
    NumAcc,
    Bonus,
    Path,
    stride_anc_b,
    stride_anc_i,
    stride_ta,
    stride_path,
    N,
    KP,
    BLOCK_N: tl.constexpr,
    BLOCK_KP: tl.constexpr,
    BITS: tl.constexpr,
    WANT_PATH: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    iok = i < N
    tok = tl.load(Tokens + b * N + i, mask=iok, other=0)
    par = tl.load(Parent + b * N + i, mask=iok, other=-1)
    dep = tl.load(Depth + b * N + i, mask=iok, other=0)
    ta_par = tl.load(TA + b * stride_ta + tl.minimum(tl.maximum(par, 0), N - 1), mask=iok, other=-1)
    match = ((par >= 0) & (tok == ta_par)) | (i == 0)
    if BITS:  # bit j of bits[i]: node j is node i or an ancestor
        bits = tl.load(Anc + b * stride_anc_b + i, mask=iok, other=0)
        one = tl.full([BLOCK_N], 1, tl.int64)
        miss = tl.sum(tl.where(iok & ~match, one << i.to(tl.int64), 0), axis=0)  # disjoint bits: sum = or
        ok = iok & ((bits & miss) == 0)
    else:
        anc = (
            tl.load(
                Anc + b * stride_anc_b + i[:, None] * stride_anc_i + i[None, :],
                mask=iok[:, None] & iok[None, :],
                other=0,
            )
            != 0
        )
        ok = iok & (tl.max((anc & ~match[None, :]).to(tl.int32), axis=1) == 0)
    key = tl.where(ok, dep, -1)
    cur = tl.min(tl.where(key == tl.max(key, axis=0), i, BLOCK_N), axis=0)  # deepest, lowest index
    tl.store(Last + b, cur.to(tl.int64))
    tl.store(NumAcc + b, tl.sum(tl.where(i == cur, dep, 0), axis=0).to(tl.int32))
    tl.store(Bonus + b, tl.load(TA + b * stride_ta + cur))
    if WANT_PATH:
        if BITS:
            row = tl.sum(tl.where(i == cur, bits, 0), axis=0)
            on = iok & (((row >> i.to(tl.int64)) & 1) != 0)
        else:
            on = tl.max((anc & (i[:, None] == cur)).to(tl.int32), axis=0) != 0
        _store_path(Path + b * stride_path, on, dep, i, KP, BLOCK_KP)


@triton.jit
def _store_path(Row, on, dep, i, KP, BLOCK_KP: tl.constexpr):
    d = tl.arange(0, BLOCK_KP)
    node = tl.max(tl.where(on[None, :] & (dep[None, :] == d[:, None]), i[None, :], -1), axis=1)
    tl.store(Row + d, tl.where(node >= 0, node, d).to(tl.int64), mask=d <= KP)


def _check_greedy(tokens, parent, depth, anc_or_bits, target_argmax):
    B, N = _check_tree(
        tokens, parent, depth, target_argmax=(target_argmax, (tokens.shape[0], tokens.shape[1]), torch.int64)
    )
    if tuple(anc_or_bits.shape) == (B, N, N) and anc_or_bits.dtype == torch.bool:
        return B, N, False
    if tuple(anc_or_bits.shape) == (B, N) and anc_or_bits.dtype == torch.int64 and N <= 64:
        return B, N, True
    raise ValueError(f"anc_or_bits must be a [{B}, {N}, {N}] bool mask or [{B}, {N}] int64 bitmasks (N <= 64), "
                     f"got {tuple(anc_or_bits.shape)} {anc_or_bits.dtype}")


def _outputs(B, dev, path_depth):
    last = torch.empty(B, dtype=torch.int64, device=dev)
    num = torch.empty(B, dtype=torch.int32, device=dev)
    bonus = torch.empty(B, dtype=torch.int64, device=dev)
    path = None if path_depth is None else torch.empty(B, int(path_depth) + 1, dtype=torch.int64, device=dev)
    return last, num, bonus, path


def _result(last, num, bonus, path):
    return (last, num, bonus) if path is None else (last, num, bonus, path)


def verify_tree_greedy_triton(tokens, parent, depth, anc_or_bits, target_argmax, *, path_depth=None):
    B, N, bits = _check_greedy(tokens, parent, depth, anc_or_bits, target_argmax)
    _check_path_depth(path_depth)
    _triton_nodes(N)
    tokens, parent, depth, anc_or_bits = (t.contiguous() for t in (tokens, parent, depth, anc_or_bits))
    if target_argmax.stride(-1) != 1:
        target_argmax = target_argmax.contiguous()
    last, num, bonus, path = _outputs(B, tokens.device, path_depth)
    if B > 0:
        kp = 0 if path is None else int(path_depth)
        _greedy_kernel[(B,)](
            tokens,
            parent,
            depth,
            anc_or_bits,
            target_argmax,
            last,
            num,
            bonus,
            last if path is None else path,
            anc_or_bits.stride(0),
            anc_or_bits.stride(1) if not bits else 0,
            target_argmax.stride(0),
            kp + 1,
            N,
            kp,
            BLOCK_N=max(16, next_pow2(N)),
            BLOCK_KP=max(16, next_pow2(kp + 1)),
            BITS=bits,
            WANT_PATH=path is not None,
            num_warps=1 if bits else 4,
        )
    return _result(last, num, bonus, path)


def verify_tree_greedy_torch(tokens, parent, depth, anc_or_bits, target_argmax, *, path_depth=None):
    B, N, bits = _check_greedy(tokens, parent, depth, anc_or_bits, target_argmax)
    _check_path_depth(path_depth)
    rows = torch.arange(B, device=tokens.device)
    anc = (anc_or_bits[..., None] >> torch.arange(N, device=tokens.device)) & 1 != 0 if bits else anc_or_bits
    # node i is reachable iff every node on its path matches the argmax at its parent
    match = (parent >= 0) & (tokens == target_argmax.gather(1, parent.clamp_min(0)))
    match[:, 0] = True
    ok = ~(anc & ~match[:, None, :]).any(-1)  # [B, N]; the ok nodes form one path (distinct sibling tokens)
    cur = torch.where(ok, depth, -1).argmax(1)
    out = (cur, depth[rows, cur].to(torch.int32), target_argmax[rows, cur])
    return out if path_depth is None else (*out, path_from_mask(anc[rows, cur], depth, int(path_depth)))


def verify_tree_greedy(tokens, parent, depth, anc_or_bits, target_argmax, impl: str = "triton", *, path_depth=None):
    """Greedy tree verification (module docstring).

    Args: tokens, parent, depth ``[B, N]`` int64; anc_or_bits ``[B, N, N]`` bool ancestor mask or ``[B, N]``
    int64 bitmasks (``ancestor_bits``, N <= 64); target_argmax ``[B, N]`` int64, the target's argmax after
    every node; path_depth: Kp, to also return the accepted path ``[B, Kp + 1]``.
    Returns (last [B] int64, num_accepted [B] int32, bonus [B] int64[, path]). Raises ValueError on shapes,
    dtypes, or N > 64 with impl="triton".
    """
    fn = pick_impl(impl, verify_tree_greedy_triton, verify_tree_greedy_torch)
    return fn(tokens, parent, depth, anc_or_bits, target_argmax, path_depth=path_depth)


# ----------------------------------------------------------------------------- sampling


@triton.jit
def _load_tree(Tokens, Parent, Depth, Chain, b, N, V, BLOCK_N: tl.constexpr):
    """Row b's tree as [BLOCK_N] vectors; valid: node i has a parent before it (so the walk tests it)."""
    i = tl.arange(0, BLOCK_N)
    iok = i < N
    tok = tl.load(Tokens + b * N + i, mask=iok, other=0)
    tok = tl.minimum(tl.maximum(tok, 0), V - 1)  # in range for the gathers
    par = tl.load(Parent + b * N + i, mask=iok, other=-1)
    dep = tl.load(Depth + b * N + i, mask=iok, other=0)
    ch = tl.load(Chain + b * N + i, mask=iok, other=0).to(tl.int32) != 0
    valid = iok & (par >= 0) & (par < i)
    return i, iok, tok, par, dep, ch, valid


@triton.jit
def _tree_sums_kernel(
    Tokens,
    Parent,
    Depth,
    Chain,
    PT,
    Q,
    Sums,
    stride_pb,
    stride_pn,
    stride_qb,
    stride_qk,
    N,
    K,
    V,
    span,
    num_splits,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program (b, s): for every node c with a deterministic child, fp64 sums over the V slice
    [s·span, (s+1)·span) of p_target[c] (needed when such a child comes before c's chain child or c has
    none) and of max(p_target[c] − q[d], 0), d = depth of c's chain child − 1 (when one comes after it).
    Rows of nodes that need neither are masked off (not read). Sums: [B, S, N, 2]."""
    b = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    n, nok, tok, par, dep, ch, valid = _load_tree(Tokens, Parent, Depth, Chain, b, N, V, BLOCK_N)
    child = valid[None, :] & (par[None, :] == n[:, None])  # [c, j]: j is a tested child of c
    ci = tl.min(tl.where(child & ch[None, :], n[None, :], BLOCK_N), axis=1)  # c's chain child (BLOCK_N: none)
    det = child & ~ch[None, :]
    need0 = tl.max((det & (n[None, :] < ci[:, None])).to(tl.int32), axis=1) > 0
    need1 = tl.max((det & (n[None, :] > ci[:, None])).to(tl.int32), axis=1) > 0
    dq = tl.sum(tl.where(n[None, :] == ci[:, None], dep[None, :], 0), axis=1) - 1
    dq = tl.minimum(tl.maximum(dq, 0), K - 1)
    pt_rows = PT + b * stride_pb + n[:, None].to(tl.int64) * stride_pn
    q_rows = Q + b * stride_qb + dq[:, None] * stride_qk
    rd0 = (need0 | need1)[:, None]
    rd1 = need1[:, None]
    s0 = tl.zeros([BLOCK_N], tl.float64)
    s1 = tl.zeros([BLOCK_N], tl.float64)
    lo = sp * span
    hi = tl.minimum(lo + span, V)
    for v0 in range(lo, hi, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)[None, :]
        v_ok = v < hi
        p = tl.load(pt_rows + v, mask=v_ok & rd0, other=0.0)
        q = tl.load(q_rows + v, mask=v_ok & rd1, other=0.0)
        s0 += tl.sum(p.to(tl.float64), axis=1)
        s1 += tl.sum(tl.maximum(p - q, 0.0).to(tl.float64), axis=1)
    out = Sums + ((b * num_splits + sp) * N + n) * 2
    tl.store(out, s0, mask=nok)
    tl.store(out + 1, s1, mask=nok)


@triton.jit
def _tree_sample_kernel(
    Tokens,
    Parent,
    Depth,
    Chain,
    U,
    PT,
    Q,
    E,
    Sums,
    Last,
    NumAcc,
    Path,
    PartBest,
    PartIdx,
    PartAny,
    stride_pb,
    stride_pn,
    stride_qb,
    stride_qk,
    stride_eb,
    stride_path,
    N,
    K,
    V,
    sum_splits,
    span,
    num_splits,
    KP,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    LOG_N: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_KP: tl.constexpr,
    WANT_PATH: tl.constexpr,
):
    """Program (b, s): the whole walk (every program of the row; program 0 stores last, a, path), then
    the best race entries of the last node's residual and of p_target[last] over V slice s."""
    b = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    i, iok, tok, par, dep, ch, valid = _load_tree(Tokens, Parent, Depth, Chain, b, N, V, BLOCK_N)
    ii = i[:, None]
    jj = i[None, :]
    # family relations [i, j]: j is a tested child of i's parent
    fam = valid[:, None] & valid[None, :] & (par[:, None] == par[None, :])
    fam_ch = fam & ch[None, :]
    dch = tl.max(tl.where(fam_ch, dep[None, :], 0), axis=1)  # depth of the family's chain child
    has_ch = tl.max(fam_ch.to(tl.int32), axis=1) > 0
    # r is a chain residual when i is tested
    ch_before = tl.max((fam_ch & (jj < ii)).to(tl.int32), axis=1) > 0
    sib = fam & (jj < ii)  # earlier siblings: all tested and rejected before i is
    zsib = sib & ~ch[None, :]  # ... the deterministic ones: their tokens are zeroed in r
    dup = tl.max((zsib & (tok[:, None] == tok[None, :])).to(tl.int32), axis=1) > 0  # r(x_i) already zeroed

    # pointwise values at x_i under i's parent (one gather each)
    pr = tl.minimum(tl.maximum(par, 0), N - 1).to(tl.int64)
    px = tl.load(PT + b * stride_pb + pr * stride_pn + tok, mask=valid, other=0.0)
    qrow = tl.minimum(tl.maximum(dep - 1, 0), K - 1)
    qx = tl.load(Q + b * stride_qb + qrow * stride_qk + tok, mask=valid & ch, other=0.0)
    crow = tl.minimum(tl.maximum(dch - 1, 0), K - 1)
    qc = tl.load(Q + b * stride_qb + crow * stride_qk + tok, mask=valid & has_ch & ~ch, other=0.0)
    res = tl.maximum(px - qc, 0.0)  # the chain residual at x_i
    rx = tl.where(dup, 0.0, tl.where(ch_before, res, px))

    # Σr when i is tested = Σ base − base at the distinct zeroed tokens (fp64, rounded once)
    s = tl.arange(0, BLOCK_S)
    sums = Sums + ((b * sum_splits + s[None, :]) * N + ii) * 2
    s_ok = iok[:, None] & (s[None, :] < sum_splits)
    tot0 = tl.sum(tl.load(sums, mask=s_ok, other=0.0), axis=1)  # [c]
    tot1 = tl.sum(tl.load(sums + 1, mask=s_ok, other=0.0), axis=1)
    at_par = par[:, None] == jj
    tot0 = tl.sum(tl.where(at_par, tot0[None, :], 0.0), axis=1)  # [i]: of i's parent
    tot1 = tl.sum(tl.where(at_par, tot1[None, :], 0.0), axis=1)
    zero = zsib & ~dup[None, :]
    gone0 = tl.sum(tl.where(zero, px.to(tl.float64)[None, :], 0.0), axis=1)
    gone1 = tl.sum(tl.where(zero, res.to(tl.float64)[None, :], 0.0), axis=1)
    total = tl.maximum(tl.where(ch_before, tot1 - gone1, tot0 - gone0), 0.0).to(tl.float32)
    u = tl.load(U + b * N + i, mask=iok, other=1.0)
    ok = valid & tl.where(ch, u * qx < rx, u * total < rx)

    # accepted: the first ok child of an accepted node; pointer doubling over the parent links
    good = ok & (tl.max((sib & ok[None, :]).to(tl.int32), axis=1) == 0)
    acc = good | (i == 0)
    jump = tl.where(valid, par, 0)
    for _ in tl.static_range(LOG_N):
        hop = jump[:, None] == jj
        acc_up = tl.max((hop & acc[None, :]).to(tl.int32), axis=1) > 0
        jump = tl.sum(tl.where(hop, jump[None, :], 0), axis=1)
        acc = acc & acc_up
    acc = acc & iok
    last = tl.max(tl.where(acc, i, 0), axis=0)
    if sp == 0:
        tl.store(Last + b, last.to(tl.int64))
        tl.store(NumAcc + b, tl.sum(tl.where(i == last, dep, 0), axis=0).to(tl.int32))
        if WANT_PATH:
            _store_path(Path + b * stride_path, acc, dep, i, KP, BLOCK_KP)

    # the race over the slice: r = base of the last node with its rejected children's tokens zeroed
    kid = valid & (par == last)
    m = tl.max((kid & ch).to(tl.int32), axis=0) > 0  # its chain child was rejected
    dq = tl.minimum(tl.maximum(tl.max(tl.where(kid & ch, dep, 0), axis=0) - 1, 0), K - 1)
    zt = tl.where(kid & ~ch & ~dup, tok, -1)
    pt_row = PT + b * stride_pb + last.to(tl.int64) * stride_pn
    q_row = Q + b * stride_qb + dq * stride_qk
    e_row = E + b * stride_eb
    rr = tl.arange(0, ROWS)[:, None]  # a chunk is [ROWS, 32]: v = v0 + 32·row + col
    cc = tl.arange(0, 32)[None, :]
    best_r = -2.0
    best_t = -2.0
    idx_r = 0
    idx_t = 0
    any_r = 0
    lo = sp * span
    hi = tl.minimum(lo + span, V)
    for v0 in range(lo, hi, ROWS * 32):
        v = v0 + rr * 32 + cc
        v_ok = v < hi
        p = tl.load(pt_row + v, mask=v_ok, other=0.0)
        m_blk = v * 0 + m.to(tl.int32) > 0  # a block mask: the interpreter refuses a scalar one here
        q = tl.load(q_row + v, mask=v_ok & m_blk, other=0.0)
        e = tl.load(e_row + v, mask=v_ok, other=1.0)
        # zeroed tokens in this chunk as one 32-bit word per chunk row
        zr = zt - v0
        z_in = (zt >= 0) & (zr >= 0) & (zr < ROWS * 32)
        bit = (zr[None, :] * 0 + 1) << (zr[None, :] & 31)
        word = tl.sum(tl.where(z_in[None, :] & ((zr[None, :] >> 5) == rr), bit, 0), axis=1)
        hit = ((word[:, None] >> cc.to(tl.int64)) & 1) != 0
        r = tl.where(hit, 0.0, tl.where(m, tl.maximum(p - q, 0.0), p))
        score_r = tl.where(r > 0, tl.math.div_rn(r, e), -1.0)
        score_t = tl.where(p > 0, tl.math.div_rn(p, e), -1.0)
        c_r = tl.max(tl.max(score_r, axis=1), axis=0)
        c_t = tl.max(tl.max(score_t, axis=1), axis=0)
        i_r = tl.min(tl.min(tl.where(score_r == c_r, v, V), axis=1), axis=0)  # first maximum in the chunk
        i_t = tl.min(tl.min(tl.where(score_t == c_t, v, V), axis=1), axis=0)
        idx_r = tl.where(c_r > best_r, i_r, idx_r)  # strict: earlier chunks win ties
        best_r = tl.maximum(c_r, best_r)
        idx_t = tl.where(c_t > best_t, i_t, idx_t)
        best_t = tl.maximum(c_t, best_t)
        any_r = tl.maximum(any_r, tl.max(tl.max((r > 0).to(tl.int32), axis=1), axis=0))
    _race_parts_store(PartBest, PartIdx, PartAny, b, sp, num_splits, best_r, best_t, idx_r, idx_t, any_r)


@triton.jit
def _race_merge_kernel(Bonus, PartBest, PartIdx, PartAny, num_splits, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    idx_r, idx_t, any_r = _race_parts_merge(PartBest, PartIdx, PartAny, b, num_splits, BLOCK_S)
    tl.store(Bonus + b, tl.where(any_r > 0, idx_r, idx_t).to(tl.int64))


def _check_sample(tokens, parent, depth, chain, p_target, q, u, exp_noise):
    if q.dim() != 3 or p_target.dim() != 3:
        raise ValueError(f"p_target must be [B, N, V] and q [B, K, V], got {tuple(p_target.shape)}, {tuple(q.shape)}")
    B, N = tokens.shape if tokens.dim() == 2 else (-1, -1)
    K, V = q.shape[1], q.shape[2]
    _check_tree(
        tokens,
        parent,
        depth,
        chain=(chain, (B, N), torch.bool),
        p_target=(p_target, (B, N, V), torch.float32),
        q=(q, (B, K, V), torch.float32),
        u=(u, (B, N), torch.float32),
        exp_noise=(exp_noise, (B, V), torch.float32),
    )
    if K < 1 or V < 1:
        raise ValueError(f"q must have K >= 1 depths and V >= 1 tokens, got {tuple(q.shape)}")
    return B, N, K, V


def _splits(n, chunks, B, dev, cap, per_sm=1):
    if n is None:  # about per_sm programs per SM over the whole batch
        n = -(-per_sm * num_sms(dev) // max(B, 1))
    return max(1, min(int(n), chunks, cap))


def _node_sums(tokens, parent, depth, chain, p_target, q, splits=None):
    """Pass 1: ``[B, S1, N, 2]`` fp64 partial sums (``_tree_sums_kernel``); inputs validated, tree tensors
    contiguous."""
    (B, N), (K, V) = tokens.shape, q.shape[1:]
    block_n = max(16, next_pow2(N))
    block_v = max(16, min(next_pow2(V), 8192 // block_n))  # [BLOCK_N, BLOCK_V] tiles of the nodes' rows
    chunks = triton.cdiv(V, block_v)
    # two programs per SM to hide latency; capped as every program of pass 2 reads all N·S1 partials
    splits = _splits(splits, chunks, B, tokens.device, 64, per_sm=2)
    span = triton.cdiv(chunks, splits) * block_v
    splits = triton.cdiv(V, span)
    sums = torch.empty(B, splits, N, 2, dtype=torch.float64, device=tokens.device)
    _tree_sums_kernel[(B, splits)](
        tokens,
        parent,
        depth,
        chain,
        p_target,
        q,
        sums,
        p_target.stride(0),
        p_target.stride(1),
        q.stride(0),
        q.stride(1),
        N,
        K,
        V,
        span,
        splits,
        BLOCK_N=block_n,
        BLOCK_V=block_v,
        num_warps=8,
    )
    return sums


def verify_tree_sample_triton(tokens, parent, depth, chain, p_target, q, u, exp_noise, *, path_depth=None, splits=None):
    B, N, K, V = _check_sample(tokens, parent, depth, chain, p_target, q, u, exp_noise)
    _check_path_depth(path_depth)
    _triton_nodes(N)
    for name, t in (("p_target", p_target), ("q", q), ("exp_noise", exp_noise)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")
    tokens, parent, depth, chain, u = (t.contiguous() for t in (tokens, parent, depth, chain, u))
    dev = tokens.device
    last, num, bonus, path = _outputs(B, dev, path_depth)
    if B == 0:
        return _result(last, num, bonus, path)
    block_n = max(16, next_pow2(N))
    s1, s2 = (None, None) if splits is None else (splits, splits) if isinstance(splits, int) else splits
    sums = _node_sums(tokens, parent, depth, chain, p_target, q, s1)
    s1 = sums.shape[1]
    # pass 2: the walk and the race over [ROWS, 32] chunks
    block_v2 = min(1024, max(32, next_pow2(V)))
    chunks2 = triton.cdiv(V, block_v2)
    s2 = _splits(s2, chunks2, B, dev, 256)
    span2 = triton.cdiv(chunks2, s2) * block_v2
    s2 = triton.cdiv(V, span2)
    part_best = torch.empty(B, s2, 2, dtype=torch.float32, device=dev)
    part_idx = torch.empty(B, s2, 2, dtype=torch.int32, device=dev)
    part_any = torch.empty(B, s2, dtype=torch.int32, device=dev)
    kp = 0 if path is None else int(path_depth)
    _tree_sample_kernel[(B, s2)](
        tokens,
        parent,
        depth,
        chain,
        u,
        p_target,
        q,
        exp_noise,
        sums,
        last,
        num,
        last if path is None else path,
        part_best,
        part_idx,
        part_any,
        p_target.stride(0),
        p_target.stride(1),
        q.stride(0),
        q.stride(1),
        exp_noise.stride(0),
        kp + 1,
        N,
        K,
        V,
        s1,
        span2,
        s2,
        kp,
        BLOCK_N=block_n,
        BLOCK_S=max(16, next_pow2(s1)),
        LOG_N=block_n.bit_length() - 1,
        ROWS=block_v2 // 32,
        BLOCK_KP=max(16, next_pow2(kp + 1)),
        WANT_PATH=path is not None,
        num_warps=4,
    )
    _race_merge_kernel[(B,)](bonus, part_best, part_idx, part_any, s2, BLOCK_S=max(16, next_pow2(s2)), num_warps=1)
    return _result(last, num, bonus, path)


def verify_tree_sample_torch(
    tokens,
    parent,
    depth,
    chain,
    p_target,
    q,
    u,
    exp_noise,
    *,
    path_depth=None,
    splits=None,
    sum_dtype=torch.float32,
):
    """The rule, walked node by node (``sum_dtype=torch.float64``: Σr in fp64 rounded once, as the kernels)."""
    del splits
    B, N, K, V = _check_sample(tokens, parent, depth, chain, p_target, q, u, exp_noise)
    _check_path_depth(path_depth)
    rows = torch.arange(B, device=tokens.device)
    cur = torch.zeros(B, dtype=torch.long, device=rows.device)
    taken = torch.zeros(B, N, dtype=torch.bool, device=rows.device)  # the accepted nodes (the path)
    taken[:, 0] = True
    r = p_target[:, 0]
    for i in range(1, N):
        x = tokens[:, i]
        cand = parent[:, i] == cur
        q_i = q[rows, (depth[:, i] - 1).clamp_min(0)]  # [B, V]: the chain child's proposal
        r_x = r.gather(1, x[:, None])[:, 0]
        sampled = chain[:, i]
        r_sum = r.sum(-1) if sum_dtype == torch.float32 else r.to(sum_dtype).sum(-1).float()
        ok = torch.where(sampled, u[:, i] * q_i.gather(1, x[:, None])[:, 0] < r_x, u[:, i] * r_sum < r_x)
        rejected = cand & ~ok
        r_rej = torch.where(sampled[:, None], (r - q_i).clamp_min(0.0), r.scatter(1, x[:, None], 0.0))
        cur = torch.where(cand & ok, i, cur)
        if path_depth is not None:
            taken[:, i] = cand & ok
        r = torch.where((cand & ok)[:, None], p_target[:, i], torch.where(rejected[:, None], r_rej, r))
    p_cur = p_target[rows, cur]
    w = torch.where((r > 0).any(-1, keepdim=True), r, p_cur)  # an all-zero residual: rounding only
    bonus = torch.where(w > 0, w / exp_noise, torch.full_like(w, -1.0)).argmax(-1)
    out = (cur, depth[rows, cur].to(torch.int32), bonus)
    return out if path_depth is None else (*out, path_from_mask(taken, depth, int(path_depth)))


def verify_tree_sample(
    tokens,
    parent,
    depth,
    chain,
    p_target,
    q,
    u,
    exp_noise,
    impl: str = "triton",
    *,
    path_depth=None,
    splits=None,
):
    """Tree rejection sampling (module docstring).

    Args: tokens, parent, depth ``[B, N]`` int64; chain ``[B, N]`` bool; p_target ``[B, N, V]`` fp32 (the
    target after every node); q ``[B, K, V]`` fp32 (the draft distributions the chain tokens were sampled
    from); u ``[B, N]`` fp32 U[0, 1) per node; exp_noise ``[B, V]`` fp32 Exp(1) (> 0) for the bonus race;
    path_depth: Kp, to also return the accepted path ``[B, Kp + 1]``; splits: V slices per row of the two
    passes (int or (S1, S2); tests).
    Returns (last [B] int64, num_accepted [B] int32, bonus [B] int64[, path]). Raises ValueError on shapes,
    dtypes, a non-contiguous last dim (Triton) or N > 64 with impl="triton".
    """
    fn = pick_impl(impl, verify_tree_sample_triton, verify_tree_sample_torch)
    return fn(tokens, parent, depth, chain, p_target, q, u, exp_noise, path_depth=path_depth, splits=splits)
