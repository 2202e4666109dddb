"""On-GPU acceptance and commit for one speculative step (docs/method.md §1, §5).

Ops (K = block_size − 1 draft tokens per row, B rows):
  * ``accept_greedy``: a = length of the longest prefix with draft[k] == target_argmax[k];
    bonus = target_argmax[a].
  * ``accept_sample``: chain rejection sampling [Leviathan et al. 2023; Chen et al. 2023]:
    accept draft k in order iff ``u_k · p_draft[k, x_k] < p_target[k, x_k]`` (u < p/q), stop at
    the first rejection. Bonus: if a < K from normalize(max(p_target[a] − p_draft[a], 0)) (from
    p_target[a] if that residual is all zero), if a == K from p_target[K]. The draw is the
    exponential race ``argmax_v w[v] / e[v]`` with e ~ Exp(1) given by the caller, which samples
    v with probability w[v] / Σ w (unnormalised w is fine), so the op is deterministic and
    graph-capturable. Entries with w[v] = 0 are never drawn; ties go to the lowest index.
  * ``commit_step``: append the a + 1 candidate tokens (draft 1..a, then bonus) to each live row,
    cut after the first EOS (inclusive) and at min(max_new, L) tokens; n = tokens written;
    ``out_len += n``, ``hist[b, n] += 1``, done if an EOS was written or the row is full; with
    ``anchor`` given, ``anchor = bonus`` (the next block's slot 0, in the same launch).
    Rows already done are untouched. τ = Σ n·hist[n] / Σ hist[n] then counts only committed
    tokens (docs/method.md §8 item 9).

Layouts: draft_tokens [B, K] int64; target_argmax [B, K+1] int64; p_target [B, K+1, V] fp32;
p_draft [B, K, V] fp32; uniform [B, K] fp32; exp_noise [B, V] fp32 (> 0); block_tokens [B, K+1]
int64 (slot 0 = anchor); num_accepted [B] int32; bonus, anchor [B] int64; out_tokens [B, L] int64;
out_len, max_new [B] int32; done [B] bool, int8 or int32 (the engine's); eos_ids [E] int64; hist [B, K+2] int32.
Last dims contiguous. Kernels: one program per row, except accept_sample: grid (B, splits), each
program redoes the K-long acceptance scan and loops over its vocabulary slice in chunks of
BLOCK_V, then a one-program-per-row pass merges the slices (splits from shapes: about one program
per SM; one program per row looping over all of V measured ~300 µs at V = 151936 on an H200).
accept_sample reads p_target[b, a] and p_draft[b, a] once (8·V bytes + 4·V for the noise per row).
Exactness: the Triton and torch paths give identical results on identical inputs (same fp32
products and IEEE divisions, same tie-breaking).
"""

from __future__ import annotations

import torch

from ._common import next_pow2, num_sms, pick_impl, tl, triton

__all__ = ["accept_greedy", "accept_sample", "commit_step"]


# ----------------------------------------------------------------------------- greedy


@triton.jit
def _accept_greedy_kernel(Draft, Target, NumAcc, Bonus, stride_d, stride_t, K, BLOCK_K: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    ok = k < K
    x = tl.load(Draft + b * stride_d + k, mask=ok, other=0)
    y = tl.load(Target + b * stride_t + k, mask=ok, other=0)
    a = tl.min(tl.where(ok & (x != y), k, K), axis=0)
    tl.store(NumAcc + b, a.to(tl.int32))
    tl.store(Bonus + b, tl.load(Target + b * stride_t + a))


def accept_greedy_triton(draft_tokens, target_argmax):
    B, K = draft_tokens.shape
    if target_argmax.shape != (B, K + 1):
        raise ValueError(f"target_argmax must be {(B, K + 1)}, got {tuple(target_argmax.shape)}")
    num = torch.empty(B, dtype=torch.int32, device=draft_tokens.device)
    bonus = torch.empty(B, dtype=torch.int64, device=draft_tokens.device)
    if B > 0:
        _accept_greedy_kernel[(B,)](draft_tokens, target_argmax, num, bonus,
                                    draft_tokens.stride(0), target_argmax.stride(0), K,
                                    BLOCK_K=max(16, next_pow2(K)), num_warps=1)
    return num, bonus


def accept_greedy_torch(draft_tokens, target_argmax):
    B, K = draft_tokens.shape
    match = (draft_tokens == target_argmax[:, :K]).to(torch.int32)
    a = match.cumprod(dim=1).sum(dim=1)  # longest all-match prefix
    bonus = target_argmax.gather(1, a[:, None].long())[:, 0]
    return a.to(torch.int32), bonus


def accept_greedy(draft_tokens, target_argmax, impl: str = "triton"):
    """(num_accepted [B] int32, bonus [B] int64) of greedy verification; see module docstring."""
    fn = pick_impl(impl, accept_greedy_triton, accept_greedy_torch)
    return fn(draft_tokens, target_argmax)


# ----------------------------------------------------------------------------- sampling


@triton.jit
def _race_parts_store(PartBest, PartIdx, PartAny, b, sp, num_splits, best_r, best_t, idx_r, idx_t, any_r):
    """One V slice's race results (``[B, splits, 2]`` fp32 best scores and int32 indices of the residual and
    of the target race, ``[B, splits]`` int32 any-residual flag): the layout :func:`_race_parts_merge` reads."""
    off = (b * num_splits + sp) * 2
    tl.store(PartBest + off, best_r)
    tl.store(PartBest + off + 1, best_t)
    tl.store(PartIdx + off, idx_r)
    tl.store(PartIdx + off + 1, idx_t)
    tl.store(PartAny + b * num_splits + sp, any_r)


@triton.jit
def _race_parts_merge(PartBest, PartIdx, PartAny, b, num_splits, BLOCK_S: tl.constexpr):
    """Row b's winners over its slices (the lowest slice among equal maxima: the global first index) and
    whether any slice had residual mass: (idx_r, idx_t, any_r)."""
    s = tl.arange(0, BLOCK_S)
    ok = s < num_splits
    base = (b * num_splits + s) * 2
    best_r = tl.load(PartBest + base, mask=ok, other=-3.0)
    best_t = tl.load(PartBest + base + 1, mask=ok, other=-3.0)
    j_r = tl.argmax(best_r, axis=0)
    j_t = tl.argmax(best_t, axis=0)
    idx_r = tl.sum(tl.where(s == j_r, tl.load(PartIdx + base, mask=ok, other=0), 0), axis=0)
    idx_t = tl.sum(tl.where(s == j_t, tl.load(PartIdx + base + 1, mask=ok, other=0), 0), axis=0)
    any_r = tl.max(tl.load(PartAny + b * num_splits + s, mask=ok, other=0), axis=0)
    return idx_r, idx_t, any_r


@triton.jit
def _accept_sample_partial_kernel(
    Draft, PT, PD, U, E, NumAcc, PartBest, PartIdx, PartAny,
    stride_db, stride_ptb, stride_ptk, stride_pdb, stride_pdk, stride_ub, stride_eb,
    K, V, span, num_splits,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Program (b, s): the acceptance scan (cheap, redone by every split) and the best
    race entry of both candidate weights over the vocabulary slice [s·span, (s+1)·span)."""
    b = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    k = tl.arange(0, BLOCK_K)
    ok = k < K
    x = tl.load(Draft + b * stride_db + k, mask=ok, other=0)
    pt_x = tl.load(PT + b * stride_ptb + k * stride_ptk + x, mask=ok, other=0.0)
    pd_x = tl.load(PD + b * stride_pdb + k * stride_pdk + x, mask=ok, other=0.0)
    u = tl.load(U + b * stride_ub + k, mask=ok, other=1.0)
    rejected = ok & ~(u * pd_x < pt_x)
    a = tl.min(tl.where(rejected, k, K), axis=0)
    if sp == 0:
        tl.store(NumAcc + b, a.to(tl.int32))

    pt_row = PT + b * stride_ptb + a * stride_ptk
    pd_row = PD + b * stride_pdb + a * stride_pdk  # row K does not exist: loads masked by a < K
    e_row = E + b * stride_eb
    best_r = -2.0
    best_t = -2.0
    idx_r = 0
    idx_t = 0
    any_r = 0
    lo = sp * span
    hi = tl.minimum(lo + span, V)
    for v0 in range(lo, hi, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        v_ok = v < hi
        p = tl.load(pt_row + v, mask=v_ok, other=0.0)
        q = tl.load(pd_row + v, mask=v_ok & (v * 0 + a < K), other=0.0)  # block mask: triton 3.9 interpreter
        e = tl.load(e_row + v, mask=v_ok, other=1.0)
        r = tl.maximum(p - q, 0.0)
        score_r = tl.where(r > 0, tl.math.div_rn(r, e), -1.0)
        score_t = tl.where(p > 0, tl.math.div_rn(p, e), -1.0)
        c_r = tl.max(score_r, axis=0)
        c_t = tl.max(score_t, axis=0)
        i_r = tl.argmax(score_r, axis=0) + v0  # first maximum in the chunk
        i_t = tl.argmax(score_t, axis=0) + v0
        idx_r = tl.where(c_r > best_r, i_r, idx_r)  # strict: earlier chunks win ties
        best_r = tl.maximum(c_r, best_r)
        idx_t = tl.where(c_t > best_t, i_t, idx_t)
        best_t = tl.maximum(c_t, best_t)
        any_r = tl.maximum(any_r, tl.max((r > 0).to(tl.int32), axis=0))
    _race_parts_store(PartBest, PartIdx, PartAny, b, sp, num_splits, best_r, best_t, idx_r, idx_t, any_r)


@triton.jit
def _accept_sample_reduce_kernel(NumAcc, Bonus, PartBest, PartIdx, PartAny, K, num_splits,
                                 BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    idx_r, idx_t, any_r = _race_parts_merge(PartBest, PartIdx, PartAny, b, num_splits, BLOCK_S)
    a = tl.load(NumAcc + b)
    use_res = (a < K) & (any_r > 0)
    tl.store(Bonus + b, tl.where(use_res, idx_r, idx_t).to(tl.int64))


def _check_sample(draft_tokens, p_target, p_draft, uniform, exp_noise):
    B, K = draft_tokens.shape
    V = p_target.shape[-1]
    if (tuple(p_target.shape) != (B, K + 1, V) or tuple(p_draft.shape) != (B, K, V)
            or tuple(uniform.shape) != (B, K) or tuple(exp_noise.shape) != (B, V)):
        raise ValueError("shapes: draft [B,K], p_target [B,K+1,V], p_draft [B,K,V], uniform [B,K], "
                         f"exp_noise [B,V]; got {tuple(draft_tokens.shape)}, {tuple(p_target.shape)}, "
                         f"{tuple(p_draft.shape)}, {tuple(uniform.shape)}, {tuple(exp_noise.shape)}")
    return B, K, V


def accept_sample_triton(draft_tokens, p_target, p_draft, uniform, exp_noise, *, num_splits=None):
    B, K, V = _check_sample(draft_tokens, p_target, p_draft, uniform, exp_noise)
    for t in (p_target, p_draft, exp_noise):
        if t.stride(-1) != 1:
            raise ValueError("probability and noise tensors need a contiguous last dim")
    dev = draft_tokens.device
    num = torch.empty(B, dtype=torch.int32, device=dev)
    bonus = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return num, bonus
    block_v = min(2048, max(16, next_pow2(V)))
    chunks = triton.cdiv(V, block_v)
    if num_splits is None:  # about one program per SM over the whole batch
        num_splits = max(1, num_sms(dev) // B)
    num_splits = max(1, min(int(num_splits), chunks, 256))
    span = triton.cdiv(chunks, num_splits) * block_v
    num_splits = triton.cdiv(V, span)
    part_best = torch.empty(B, num_splits, 2, dtype=torch.float32, device=dev)
    part_idx = torch.empty(B, num_splits, 2, dtype=torch.int32, device=dev)
    part_any = torch.empty(B, num_splits, dtype=torch.int32, device=dev)
    _accept_sample_partial_kernel[(B, num_splits)](
        draft_tokens, p_target, p_draft, uniform, exp_noise, num, part_best, part_idx, part_any,
        draft_tokens.stride(0), p_target.stride(0), p_target.stride(1),
        p_draft.stride(0), p_draft.stride(1), uniform.stride(0), exp_noise.stride(0),
        K, V, span, num_splits, BLOCK_K=max(16, next_pow2(K)), BLOCK_V=block_v, num_warps=4,
    )
    _accept_sample_reduce_kernel[(B,)](num, bonus, part_best, part_idx, part_any, K, num_splits,
                                       BLOCK_S=max(16, next_pow2(num_splits)), num_warps=1)
    return num, bonus


def accept_sample_torch(draft_tokens, p_target, p_draft, uniform, exp_noise, *, num_splits=None):
    del num_splits
    B, K, V = _check_sample(draft_tokens, p_target, p_draft, uniform, exp_noise)
    x = draft_tokens[..., None]
    pt_x = p_target[:, :K].gather(2, x)[..., 0]
    pd_x = p_draft.gather(2, x)[..., 0]
    accepted = (uniform * pd_x < pt_x).to(torch.int32)
    a = accepted.cumprod(dim=1).sum(dim=1).long()  # first rejection, or K
    has_res = a < K
    pt_a = p_target.gather(1, a[:, None, None].expand(B, 1, V))[:, 0]
    if K > 0:
        pd_a = p_draft.gather(1, a.clamp(max=K - 1)[:, None, None].expand(B, 1, V))[:, 0]
        pd_a = pd_a * has_res[:, None]
    else:
        pd_a = torch.zeros_like(pt_a)
    r = (pt_a - pd_a).clamp_min(0.0)
    use_res = has_res & (r > 0).any(dim=1)
    w = torch.where(use_res[:, None], r, pt_a)
    score = torch.where(w > 0, w / exp_noise, torch.full_like(w, -1.0))
    return a.to(torch.int32), score.argmax(dim=1)


def accept_sample(draft_tokens, p_target, p_draft, uniform, exp_noise, impl: str = "triton", *,
                  num_splits=None):
    """(num_accepted [B] int32, bonus [B] int64) of chain rejection sampling (module docstring).

    ``uniform`` ~ U[0, 1) and ``exp_noise`` ~ Exp(1) (strictly positive) come from the caller.
    ``num_splits`` overrides the number of vocabulary slices per row (tests).
    """
    fn = pick_impl(impl, accept_sample_triton, accept_sample_torch)
    return fn(draft_tokens, p_target, p_draft, uniform, exp_noise, num_splits=num_splits)


# ----------------------------------------------------------------------------- commit


@triton.jit
def _commit_kernel(
    Block, NumAcc, Bonus, OutTok, OutLen, MaxNew, Done, Eos, Hist, Anchor,
    stride_blk, stride_out, stride_hist, L, E,
    BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, HAS_ANCHOR: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    live = tl.load(Done + b).to(tl.int32) == 0
    a = tl.load(NumAcc + b).to(tl.int32)
    bonus = tl.load(Bonus + b)
    olen = tl.load(OutLen + b).to(tl.int32)
    cap = tl.minimum(tl.load(MaxNew + b).to(tl.int32), L)
    i = tl.arange(0, BLOCK_K)
    tok = tl.load(Block + b * stride_blk + 1 + i, mask=i < a, other=0)
    tok = tl.where(i < a, tok, bonus)  # candidates: draft 1..a, then the bonus at i = a
    e = tl.arange(0, BLOCK_E)
    eos = tl.load(Eos + e, mask=e < E, other=-1)
    hit = (tok[:, None] == eos[None, :]) & (e < E)[None, :]
    is_eos = (tl.max(hit.to(tl.int32), axis=1) > 0) & (i <= a)
    first_eos = tl.min(tl.where(is_eos, i, BLOCK_K), axis=0)
    n = tl.minimum(tl.minimum(a + 1, first_eos + 1), tl.maximum(cap - olen, 0))
    n = tl.where(live, n, 0)
    tl.store(OutTok + b * stride_out + olen + i, tok, mask=i < n)
    new_len = olen + n
    finished = (first_eos < n) | (new_len >= cap)
    tl.store(OutLen + b, new_len.to(OutLen.dtype.element_ty), mask=live)
    h_ptr = Hist + b * stride_hist + n
    tl.store(h_ptr, tl.load(h_ptr) + 1, mask=live)
    tl.store(Done + b, finished.to(Done.dtype.element_ty), mask=live)
    if HAS_ANCHOR:
        tl.store(Anchor + b, bonus, mask=live)


def _check_commit(block_tokens, num_accepted, bonus, out_tokens, out_len, max_new, done, eos_ids, hist, anchor):
    B, K1 = block_tokens.shape
    if tuple(hist.shape) != (B, K1 + 1):
        raise ValueError(f"hist must be {(B, K1 + 1)}, got {tuple(hist.shape)}")
    for name, t in (("num_accepted", num_accepted), ("bonus", bonus), ("out_len", out_len),
                    ("max_new", max_new), ("done", done)) + ((("anchor", anchor),) if anchor is not None else ()):
        if tuple(t.shape) != (B,):
            raise ValueError(f"{name} must be [{B}], got {tuple(t.shape)}")
    if out_tokens.shape[0] != B or eos_ids.dim() != 1:
        raise ValueError("out_tokens must be [B, L] and eos_ids [E]")
    return B, K1


def commit_step_triton(block_tokens, num_accepted, bonus, out_tokens, out_len, max_new, done, eos_ids, hist,
                       anchor=None):
    B, K1 = _check_commit(block_tokens, num_accepted, bonus, out_tokens, out_len, max_new, done, eos_ids, hist, anchor)
    if B > 0:
        _commit_kernel[(B,)](
            block_tokens, num_accepted, bonus, out_tokens, out_len, max_new, done, eos_ids, hist,
            anchor if anchor is not None else bonus,  # a dummy when there is no anchor
            block_tokens.stride(0), out_tokens.stride(0), hist.stride(0),
            out_tokens.shape[1], eos_ids.shape[0],
            BLOCK_K=max(16, next_pow2(K1)), BLOCK_E=max(16, next_pow2(eos_ids.shape[0])),
            HAS_ANCHOR=anchor is not None, num_warps=1,
        )


def commit_step_torch(block_tokens, num_accepted, bonus, out_tokens, out_len, max_new, done, eos_ids, hist,
                      anchor=None):
    B, K1 = _check_commit(block_tokens, num_accepted, bonus, out_tokens, out_len, max_new, done, eos_ids, hist, anchor)
    L = out_tokens.shape[1]
    dev = block_tokens.device
    a = num_accepted.long()
    i = torch.arange(K1, device=dev)
    drafts = torch.cat([block_tokens[:, 1:], block_tokens[:, :1]], dim=1)  # slot K1-1 never used
    tok = torch.where(i[None, :] < a[:, None], drafts, bonus[:, None])  # [B, K1] candidates
    is_eos = (tok[..., None] == eos_ids[None, None, :]).any(-1) & (i[None, :] <= a[:, None])
    first_eos = torch.where(is_eos, i[None, :], K1).amin(dim=1)
    olen = out_len.long()
    cap = max_new.long().clamp(max=L)
    live = done == 0
    n = torch.minimum(torch.minimum(a + 1, first_eos + 1), (cap - olen).clamp_min(0))
    n = torch.where(live, n, 0)
    j = torch.arange(L, device=dev)
    rel = j[None, :] - olen[:, None]  # [B, L] index into the candidates
    write = (rel >= 0) & (rel < n[:, None])
    out_tokens.copy_(torch.where(write, tok.gather(1, rel.clamp(0, K1 - 1)), out_tokens))
    new_len = olen + n
    finished = (first_eos < n) | (new_len >= cap)
    out_len.copy_(torch.where(live, new_len, olen).to(out_len.dtype))
    hist.scatter_add_(1, n[:, None], live[:, None].to(hist.dtype))
    done.copy_(torch.where(live, finished, done != 0).to(done.dtype))
    if anchor is not None:
        anchor.copy_(torch.where(live, bonus, anchor))


def commit_step(block_tokens, num_accepted, bonus, out_tokens, out_len, max_new, done, eos_ids, hist,
                impl: str = "triton", *, anchor=None) -> None:
    """Commit one step's accepted tokens + bonus in place (module docstring); ``anchor [B]`` (optional)
    takes the bonus of live rows. Returns None; raises ValueError on shapes."""
    fn = pick_impl(impl, commit_step_triton, commit_step_torch)
    fn(block_tokens, num_accepted, bonus, out_tokens, out_len, max_new, done, eos_ids, hist, anchor)
