"""What a speculative step leaves for the verify-budget planner, in one launch: the chain's confidence and, after a
tree step, what the chain alone would have accepted.

Op, per row b:

- ``conf[b] = 1 + Σ_{k<K} Π_{j≤k} p[b, j]`` (:func:`chain_confidence`): the chain's expected committed tokens if the
  target accepted as the draft predicts (``p [B, K]`` fp32: the draft's probability of its own token per slot);
- with a tree: ``chain_acc[b]`` = the chain nodes on the accepted path below the root
  (``dspine.tree.chain_accepted``: ``chain [B, N]`` bool, ``path [B, P]`` int64 node per depth, entries past depth
  ``num_accepted[b]`` ignored);
- with a tree and the planner's smaller trees inside it: ``inner_acc[s, b]`` = the nodes on that path below the root
  with ``rank[b, node] < sizes[s]`` (``dspine.tree.inner_accepted``: what the tree of ``sizes[s]`` nodes would have
  accepted; ``rank [B, N]`` int64, :attr:`dspine.tree.Tree.rank`).

Why: in torch these are 4 launches (cumprod, sum, add, the copy into the engine's state) after every planner
step, 7 more after a tree step (an arange, a gather, two comparisons, a sum, a subtraction, a copy) and about 10
more for the inner trees (an arange, a comparison, a where, a gather, a comparison per size, a stack, an and, a sum,
a subtraction, the transposed copy). In a CUDA graph of a SmolLM2-size step each tiny launch costs a few µs of
device time: on the H200 the planner's own tree steps took 1.5-3% longer than the fixed tree's (its
``planner_choices.*.measured_ms`` against the fixed runs' ms per step, results/planner-default*-h200-T0-c1.json),
its chain steps 0-1% longer; after the chain's part was fused, the H100 still took 1.4-1.5% more time than the fixed
tree of 32 on tasks where the planner ran that tree at every step (results/verify-refresh-exact{,-rep2}-h100.json
``per_task``, humaneval and mbpp, 2026-12-06), the inner trees' launches still unfused.

Layouts: every tensor with any strides (the tree builder's ``chain_q`` is a strided view; ``conf`` ``[B]`` fp32,
``chain_acc`` ``[B]`` int32 and ``inner_acc`` ``[S, B]`` int32 are written in place, views into the engine's state
buffer; ``sizes`` ``[S]`` int32 or int64 on the device, read by the kernel: a CUDA graph replays it with the values it
holds then). Grid (B,). Node indices in ``path`` must lie in ``[0, N)`` (not checked on the Triton path: that would
sync the host inside a CUDA graph; the verify kernels produce them so).
Numerics: the Triton path's cumulative product and sum run in another order than torch's, so ``conf`` matches
the torch reference up to fp32 rounding (a few ulp); ``chain_acc`` and ``inner_acc`` are exact. The planner only
reads ``conf`` as a signal, never the output.
"""

from __future__ import annotations

import torch

from ._common import check_impl, next_pow2, tl, triton

__all__ = ["chain_confidence", "plan_stats"]


def chain_confidence(p: torch.Tensor) -> torch.Tensor:
    """Expected committed tokens of a chain step if the target accepted like the draft predicts.

    ``p [B, K]`` fp32: the draft's probability of its own token at slots 1..K (at T = 0 the max
    probability; at T > 0 the probability of the sampled token under the sampling distribution) ->
    ``[B]`` fp32 ``1 + Σ_k Π_{j≤k} p_j`` (bonus token included): slot k is accepted iff slots 1..k are,
    each with probability p_j if the target's next-token distribution were the draft's
    (the chain's E[τ], e.g. Leviathan et al. 2023 eq. 1 with per-slot rates).
    """
    return 1.0 + p.cumprod(-1).sum(-1)


@triton.jit
def _plan_stats_kernel(
    P, Conf, Chain, Path, A, Acc, Rank, Sizes, Inner, K, NP, S,
    stride_pb, stride_pk, stride_conf, stride_cb, stride_cn, stride_path_b, stride_path_d, stride_a, stride_acc,
    stride_rb, stride_rn, stride_sizes, stride_is, stride_ib,
    BK: tl.constexpr, BP: tl.constexpr, TREE: tl.constexpr, INNER: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BK)
    p = tl.load(P + r * stride_pb + k * stride_pk, mask=k < K, other=0.0)  # a 0 tail adds 0 to the sum
    tl.store(Conf + r * stride_conf, 1.0 + tl.sum(tl.cumprod(p, 0), 0))
    if TREE:
        j = tl.arange(0, BP)
        ok = (j < NP) & (j <= tl.load(A + r * stride_a).to(tl.int64))
        node = tl.load(Path + r * stride_path_b + j * stride_path_d, mask=ok, other=0)
        on = tl.load(Chain + r * stride_cb + node * stride_cn, mask=ok, other=0)
        tl.store(Acc + r * stride_acc, tl.sum((on != 0).to(tl.int32), 0) - 1)  # the root is on every path
        if INNER:  # the path's nodes inside each smaller tree: rank below its size (the root's rank is 0)
            rk = tl.load(Rank + r * stride_rb + node * stride_rn, mask=ok, other=0)
            for s in range(0, S):
                m = tl.load(Sizes + s * stride_sizes).to(tl.int64)
                n_in = tl.sum(((rk < m) & ok).to(tl.int32), 0) - 1
                tl.store(Inner + s * stride_is + r * stride_ib, n_in)


def plan_stats(p: torch.Tensor, conf: torch.Tensor, chain: torch.Tensor | None = None,
               path: torch.Tensor | None = None, num_accepted: torch.Tensor | None = None,
               chain_acc: torch.Tensor | None = None, impl: str = "torch", rank: torch.Tensor | None = None,
               sizes: torch.Tensor | None = None, inner_acc: torch.Tensor | None = None) -> None:
    """Write ``conf`` (and, given a tree, ``chain_acc``; given the inner trees too, ``inner_acc``) in place (module
    docstring). No host sync.

    Args: p ``[B, K]`` fp32; conf ``[B]`` fp32; chain ``[B, N]`` bool (``Tree.chain``), path ``[B, P]`` int64 node
    per depth (``dspine.tree.path_nodes``), num_accepted ``[B]`` int (the path's depth), chain_acc ``[B]`` int32:
    all four or none; rank ``[B, N]`` int64 (``Tree.rank``), sizes ``[S]`` int32 or int64 (the smaller trees' node
    counts, on p's device), inner_acc ``[S, B]`` int32: all three or none, and only with a tree. Raises ValueError on
    shapes, dtypes or a partial tree or inner set (a path's node outside [0, N) is not checked on the Triton
    path)."""
    check_impl(impl)
    inner = (rank, sizes, inner_acc)
    if any(t is None for t in inner) and any(t is not None for t in inner):
        raise ValueError("plan_stats: rank, sizes and inner_acc go together (the inner trees) or not at all")
    has_inner = rank is not None
    if has_inner and chain is None:
        raise ValueError("plan_stats: the inner trees (rank, sizes, inner_acc) need the tree step's chain, path, "
                         "num_accepted and chain_acc")
    tree = (chain, path, num_accepted, chain_acc)
    if p.dim() != 2 or p.dtype != torch.float32 or conf.shape != p.shape[:1] or conf.dtype != torch.float32:
        raise ValueError(f"plan_stats needs p [B, K] fp32 and conf [B] fp32, got p {p.dtype} {tuple(p.shape)}, "
                         f"conf {conf.dtype} {tuple(conf.shape)}")
    if any(t is None for t in tree) and any(t is not None for t in tree):
        raise ValueError("plan_stats: chain, path, num_accepted and chain_acc go together (a tree step) or not at all")
    B = p.shape[0]
    has_tree = chain is not None
    if has_tree and (chain.dtype != torch.bool or chain.dim() != 2 or path.dim() != 2 or path.dtype != torch.int64
                     or chain.shape[0] != B or path.shape[0] != B or num_accepted.shape != (B,)
                     or num_accepted.dtype not in (torch.int32, torch.int64)
                     or chain_acc.shape != (B,) or chain_acc.dtype != torch.int32):
        raise ValueError(f"plan_stats: chain must be [B={B}, N] bool, path [B, P] int64, num_accepted [B] int32 or "
                         f"int64 and chain_acc [B] int32; got chain {chain.dtype} {tuple(chain.shape)}, path "
                         f"{path.dtype} {tuple(path.shape)}, num_accepted {num_accepted.dtype} "
                         f"{tuple(num_accepted.shape)}, chain_acc {chain_acc.dtype} {tuple(chain_acc.shape)}")
    if has_inner and (rank.dtype != torch.int64 or rank.shape != chain.shape or sizes.dim() != 1
                      or sizes.dtype not in (torch.int32, torch.int64) or inner_acc.dtype != torch.int32
                      or inner_acc.shape != (sizes.shape[0], B)):
        raise ValueError(f"plan_stats: rank must be int64 shaped as chain {tuple(chain.shape)}, sizes [S] int32 or "
                         f"int64 and inner_acc [S, B={B}] int32; got rank {rank.dtype} {tuple(rank.shape)}, sizes "
                         f"{sizes.dtype} {tuple(sizes.shape)}, inner_acc {inner_acc.dtype} {tuple(inner_acc.shape)}")
    if impl == "torch":
        from dspine.tree import chain_accepted, inner_accepted

        conf.copy_(chain_confidence(p))
        if has_tree:
            chain_acc.copy_(chain_accepted(chain, path, num_accepted))
        if has_inner:
            inner_acc.copy_(inner_accepted(rank, path, num_accepted, sizes).T)
        return
    if B == 0:
        return
    K = p.shape[1]
    if has_tree:  # every tensor with its own strides (views of the engine's state buffer included)
        ch = chain.view(torch.uint8)
        tree_args = (ch, path, num_accepted, chain_acc, path.shape[1])
        tree_strides = (ch.stride(0), ch.stride(1), path.stride(0), path.stride(1), num_accepted.stride(0),
                        chain_acc.stride(0))
        bp = max(2, next_pow2(path.shape[1]))
    else:  # placeholders, never read
        tree_args, tree_strides, bp = (conf, conf, conf, conf, 0), (0,) * 6, 2
    ch, pa, a, acc, n_path = tree_args
    has_inner = has_inner and sizes.shape[0] > 0
    if has_inner:
        inner_args = (rank, sizes, inner_acc, sizes.shape[0])
        inner_strides = (rank.stride(0), rank.stride(1), sizes.stride(0), inner_acc.stride(0), inner_acc.stride(1))
    else:  # placeholders, never read
        inner_args, inner_strides = (conf, conf, conf, 0), (0,) * 5
    _plan_stats_kernel[(B,)](
        p, conf, ch, pa, a, acc, *inner_args[:3], K, n_path, inner_args[3], p.stride(0), p.stride(1), conf.stride(0),
        *tree_strides, *inner_strides, BK=max(2, next_pow2(K)), BP=bp, TREE=has_tree, INNER=has_inner, num_warps=1,
    )  # fmt: skip
