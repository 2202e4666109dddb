"""What a speculative step leaves for the verify-budget planner, in one launch: the chain's confidence and, after a
tree step, what the chain alone would have accepted.

Op, per row b:

- ``conf[b] = 1 + Σ_{k<K} Π_{j≤k} p[b, j]`` (:func:`chain_confidence`): the chain's expected committed tokens if the
  target accepted as the draft predicts (``p [B, K]`` fp32: the draft's probability of its own token per slot);
- with a tree: ``chain_acc[b]`` = the chain nodes on the accepted path below the root
  (``dspine.tree.chain_accepted``: ``chain [B, N]`` bool, ``path [B, P]`` int64 node per depth, entries past depth
  ``num_accepted[b]`` ignored).

Why: in torch these are 4 launches (cumprod, sum, add, the copy into the engine's state) after every planner
step and 7 more after a tree step (an arange, a gather, two comparisons, a sum, a subtraction, a copy). In a CUDA
graph of a SmolLM2-size step each tiny launch costs a few µs of device time: on the H200 the planner's own tree
steps took 1.5-3% longer than the fixed tree's (its ``planner_choices.*.measured_ms`` against the fixed runs'
ms per step, results/planner-default*-h200-T0-c1.json), its chain steps 0-1% longer.

Layouts: every tensor with any strides (the tree builder's ``chain_q`` is a strided view; ``conf`` ``[B]`` fp32 and
``chain_acc`` ``[B]`` int32 are written in place, views into the engine's state buffer). Grid (B,). Node indices in
``path`` must lie in ``[0, N)`` (not checked on the Triton path: that would sync the host inside a CUDA graph; the
verify kernels produce them so).
Numerics: the Triton path's cumulative product and sum run in another order than torch's, so ``conf`` matches
the torch reference up to fp32 rounding (a few ulp); ``chain_acc`` is exact. The planner only reads ``conf`` as a
signal, never the output.
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
    P, Conf, Chain, Path, A, Acc, K, NP,
    stride_pb, stride_pk, stride_conf, stride_cb, stride_cn, stride_path_b, stride_path_d, stride_a, stride_acc,
    BK: tl.constexpr, BP: tl.constexpr, TREE: tl.constexpr,
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


def plan_stats(p: torch.Tensor, conf: torch.Tensor, chain: torch.Tensor | None = None,
               path: torch.Tensor | None = None, num_accepted: torch.Tensor | None = None,
               chain_acc: torch.Tensor | None = None, impl: str = "torch") -> None:
    """Write ``conf`` (and, given a tree, ``chain_acc``) in place (module docstring). No host sync.

    Args: p ``[B, K]`` fp32; conf ``[B]`` fp32; chain ``[B, N]`` bool (``Tree.chain``), path ``[B, P]`` int64 node
    per depth (``dspine.tree.path_nodes``), num_accepted ``[B]`` int (the path's depth), chain_acc ``[B]`` int32:
    all four or none. Raises ValueError on shapes, dtypes or a partial tree (a path's node outside [0, N) is not
    checked on the Triton path)."""
    check_impl(impl)
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
    if impl == "torch":
        from dspine.tree import chain_accepted

        conf.copy_(chain_confidence(p))
        if has_tree:
            chain_acc.copy_(chain_accepted(chain, path, num_accepted))
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
    _plan_stats_kernel[(B,)](
        p, conf, ch, pa, a, acc, K, n_path, p.stride(0), p.stride(1), conf.stride(0), *tree_strides,
        BK=max(2, next_pow2(K)), BP=bp, TREE=has_tree, num_warps=1,
    )  # fmt: skip
