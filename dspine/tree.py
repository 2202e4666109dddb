"""Token trees from a block draft, and their verification (docs/method.md §5, extended to trees).

A block draft gives, in one pass, a distribution ``q[d]`` over the token at every depth d = 1..K of
the block (K = bs - 1; slot 0 is the anchor). A chain verifies one token per depth; a tree verifies
several candidates per depth under a node budget N (anchor included) in one target pass.

Construction (:func:`build_tree`), best-first: each depth has W = min(N - 1, V) candidate tokens:
the *chain token* c_d (argmax of q[d] at T = 0, the token sampled from q[d] at T > 0), then the
W - 1 most probable other tokens. A node's score is Σ log q along its path (the product of draft
probabilities). Two rules (``chain_first``):
  * chain first (T > 0, and on request): every node on the chain path c_1 .. c_min(K, N-1) is kept
    first, so a tree always contains the chain and its τ is never below the chain's on the same draft;
    the other N - 1 - K slots take the best-scoring paths. T > 0 needs it: the chain child's test
    treats it as a draw from q[d], which holds only if the tree keeps it whatever it scores.
  * best first (the engine's default at T = 0): the N - 1 best-scoring paths, the chain's nodes among
    them only where they score in. A block draft's deep positions are uncertain, so a sibling near the
    root often outscores them (measured: the README's tree section, results/tree-policy-cpu.json and
    results/verify-h200.json). Lossless at T = 0 whatever the tree (the target's argmax decides).
Both are found depth by depth with a beam of N - 1 nodes. Fixed shapes, sort/gather only, no host
sync: graph-safe. ``dspine.ops.tree_build.build_tree_fused`` returns the same
tree, its ancestor mask and bits from one Triton launch after :func:`tree_candidates`.

Node layout (breadth first): node 0 is the anchor (depth 0); nodes 1..N-1 are sorted by depth,
then by decreasing score (padding last), so a chain node is the first child of its parent (with the chain
first at any chain tokens; best first where they are the argmax, as at T = 0) and every parent comes
before its children. A node that could not be filled (score -inf: fewer than N - 1 tokens with
q > 0) is *padding*: parent -1, never accepted.

Verification (:func:`verify_tree`), walking the nodes in order with the current node ``cur``:
  * T = 0: a child of ``cur`` is accepted iff its token is the target's argmax at ``cur``;
    siblings hold distinct tokens, so at most one matches. Output = target greedy output.
  * T > 0: multi-candidate rejection sampling over the siblings [SpecInfer, Miao et al. 2024,
    §4.2 "multi-step speculative sampling"]: with r the target's (residual) distribution at
    ``cur``, child x drawn from proposal g is accepted with probability min(1, r(x) / g(x));
    on rejection r ← normalize(max(r − g, 0)); if no child is accepted the bonus is drawn from r.
    Each sibling is one exact rejection step for the residual, so the emitted token follows the
    target distribution whatever the tree. The chain child was *sampled* from g = q[d] (the test
    is ``u · q(x) < r(x)``, exactly the chain rule of ``dspine.ops.accept``, so a tree of K + 1
    nodes decodes like the chain with the same noise). The other children are deterministic
    (top-k), so their proposal is the point mass g = δ_x: accept with probability r(x), else
    remove x from r (using q(x) there would bias the output: docs/method.md §8.7).
  The bonus token is the target's (argmax, or a draw from r) at the last accepted node.

Layouts: q ``[B, K, V]`` fp32 (rows sum to 1); trees: tokens ``[B, N]`` int64 (node 0 = anchor),
parent ``[B, N]`` int64 (-1: root or padding), depth ``[B, N]`` int64, chain ``[B, N]`` bool,
ancestor mask ``[B, N, N]`` bool (``anc[b, i, j]``: node j is node i or one of its ancestors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspine import sampling as rng
from dspine.ops.tree_verify import path_from_mask, verify_tree_greedy, verify_tree_sample

STREAM_TREE = 4  # dspine.sampling's streams 1-3 are the target's, the draft's and the chain's

__all__ = [
    "Tree",
    "build_tree",
    "tree_candidates",
    "verify_tree",
    "ancestor_mask",
    "ancestor_bits",
    "path_nodes",
    "node_uniforms",
    "top_others",
    "chain_accepted",
    "inner_accepted",
]


@dataclass
class Tree:
    """A batch of token trees of N nodes each (layouts: module docstring)."""

    tokens: torch.Tensor  # [B, N] int64
    parent: torch.Tensor  # [B, N] int64, -1 for the root and padding
    depth: torch.Tensor  # [B, N] int64
    chain: torch.Tensor  # [B, N] bool: node is on the chain path (root included)
    anc: torch.Tensor  # [B, N, N] bool ancestor mask (:func:`ancestor_mask`)
    bits: torch.Tensor | None = None  # [B, N] int64 ancestor_bits(anc), when the builder made them
    # [B, K] fp32 q of the chain token at each depth 1..K (the chain's own draft probabilities, whether or not a
    # best-first tree kept its deep nodes), from the candidates (build_tree and dspine.ops.tree_build)
    chain_q: torch.Tensor | None = None
    # [B, N] int64: the node's place in the builder's selection order (0 the root, then 1.. by key: the chain nodes
    # first when kept first, then by score, ties as torch's stable sort; padding last). The tree of M <= N nodes built
    # from the same q holds exactly the nodes of rank < M (:func:`inner_accepted`); set by build_tree and
    # dspine.ops.tree_build
    rank: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


def tree_candidates(
    anchor: torch.Tensor, q: torch.Tensor, budget: int, chain_tokens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The W = min(budget - 1, V) candidates of every depth, shared by :func:`build_tree` and the fused
    builder (``dspine.ops.tree_build``): (cand ``[B, K, W]`` int64: the chain token, then the W - 1 most
    probable others; logq ``[B, K, W]``: log q of each, -inf where q = 0). Others are ordered by q
    descending, equal q by lower token id (so the candidates do not depend on the top-k algorithm:
    ``dspine.ops.tree_build.candidates_triton`` selects the same ones). Arguments as :func:`build_tree`; raises
    ValueError on a budget < 2 or mismatched shapes."""
    B, K, V = q.shape
    if budget < 2:
        raise ValueError(f"tree budget={budget} must be >= 2 (the anchor and at least one draft token)")
    if anchor.shape != (B,) or (chain_tokens is not None and chain_tokens.shape != (B, K)):
        raise ValueError(f"anchor must be [{B}] and chain_tokens [{B}, {K}]")
    W = min(budget - 1, V)
    chain_tok = q.argmax(-1) if chain_tokens is None else chain_tokens
    cand = torch.cat([chain_tok[..., None], top_others(q, chain_tok, W - 1)], dim=-1)
    return cand, q.gather(-1, cand).log()  # log 0 = -inf: never a real node


def top_others(q: torch.Tensor, chain_tok: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` tokens of highest q ``[B, K, V]`` fp32 (>= 0) other than ``chain_tok [B, K]``, as
    ``[B, K, n]`` int64: q descending, ties by lower token id (-0.0 counts as 0). One int64 key per token (q's fp32 bits,
    which order like q for q >= 0, above 31 bits of reversed token id), so every key is distinct and
    torch's top-k returns one order whatever its algorithm. Requires n <= V - 1."""
    V = q.shape[-1]
    low = 0x7FFFFFFF - torch.arange(V, device=q.device, dtype=torch.int64)
    key = ((q.float() + 0.0).contiguous().view(torch.int32).to(torch.int64) << 32) | low  # -0.0 + 0.0 = +0.0
    key = key.scatter(-1, chain_tok[..., None], torch.iinfo(torch.int64).min)
    return 0x7FFFFFFF - (key.topk(n, dim=-1).values & 0x7FFFFFFF)


def build_tree(
    anchor: torch.Tensor, q: torch.Tensor, budget: int, chain_tokens: torch.Tensor | None = None,
    chain_first: bool = True,
) -> Tree:
    """Best-first token tree of ``budget`` nodes per row (module docstring).

    Args:
        anchor: ``[B]`` int64, the root token (slot 0 of the block).
        q: ``[B, K, V]`` fp32 draft distributions of depths 1..K.
        budget: N, nodes per tree including the root (N >= 2).
        chain_tokens: ``[B, K]`` int64 chain tokens (the sampled draft tokens at T > 0);
            default ``q.argmax(-1)``.
        chain_first: keep the chain path first (the default; T > 0 needs it, module docstring). False: the
            best N - 1 paths by score alone, the chain nodes flagged where they score in (T = 0 only).
    Returns :class:`Tree`. Raises ValueError on a budget < 2, mismatched shapes or a chain_first that is not a
    bool.
    """
    B, K, _ = q.shape
    if not isinstance(chain_first, bool):
        raise ValueError(f"chain_first={chain_first!r} must be True or False")
    cand, logq = tree_candidates(anchor, q, budget, chain_tokens)
    dev = q.device
    M, W = budget - 1, cand.shape[-1]

    j0 = torch.arange(W, device=dev) == 0
    # beam at depth 0: slot 0 = the root; scores s, sort keys (chain = +inf), chain flags
    s = torch.full((B, M), float("-inf"), device=dev)
    s[:, 0] = 0.0
    on_chain = torch.zeros(B, M, dtype=torch.bool, device=dev)
    on_chain[:, 0] = True
    all_tok, all_par, all_key, all_chain = [], [], [], []
    for d in range(K):
        cs = (s[:, :, None] + logq[:, d, None, :]).reshape(B, M * W)  # children of every beam slot
        cc = (on_chain[:, :, None] & j0).reshape(B, M * W)
        key = torch.where(cc, float("inf"), cs) if chain_first else cs  # a Python scalar: no host copy in a graph
        # stable: equal keys keep the parent-major order, so a parent always ranks before its children
        order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :M]
        s, on_chain = cs.gather(1, order), cc.gather(1, order)
        all_key.append(key.gather(1, order))
        all_tok.append(cand[:, d].gather(1, order % W))
        all_par.append(order // W + (d - 1) * M if d > 0 else torch.full_like(order, -1))
        all_chain.append(on_chain)
    key, tok = torch.cat(all_key, 1), torch.cat(all_tok, 1)  # [B, K·M], depth-major
    par, chain = torch.cat(all_par, 1), torch.cat(all_chain, 1)
    # the best M of all depths; a parent precedes its children (key >= child's, earlier on ties)
    pick = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :M]
    real = key.gather(1, pick) > float("-inf")
    # breadth first: by depth, then by key (beam order); padding last
    order = torch.where(real, pick, pick + K * M).sort(dim=1)
    pick = order.values % (K * M)
    real = real.sort(dim=1, descending=True, stable=True).values
    node_of = torch.full((B, K * M + 1), -1, dtype=torch.long, device=dev)  # flat id (+1) -> node
    node_of[:, 0] = 0  # flat parent -1 is the root
    node_of.scatter_(1, pick + 1, torch.arange(1, M + 1, device=dev).expand(B, M))
    parent = torch.where(real, node_of.gather(1, par.gather(1, pick) + 1), -1)
    depth = torch.where(real, pick // M + 1, 0)
    zero = torch.zeros(B, 1, dtype=torch.long, device=dev)
    parent = torch.cat([zero - 1, parent], 1)
    return Tree(
        tokens=torch.cat([anchor[:, None], torch.where(real, tok.gather(1, pick), 0)], 1),
        parent=parent,
        depth=torch.cat([zero, depth], 1),
        chain=torch.cat([zero == 0, chain.gather(1, pick) & real], 1),
        anc=ancestor_mask(parent),
        chain_q=q.gather(-1, cand[..., :1])[..., 0],  # candidate column 0 is the chain token
        rank=torch.cat([zero, order.indices + 1], 1),  # node j + 1 was the order.indices[j]-th pick by key
    )


def inner_accepted(rank: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor, sizes) -> torch.Tensor:
    """``[B, S]`` int32: per tree size M of ``sizes`` (S Python ints, or an ``[S]`` integer tensor on the path's
    device; each at most N), the draft tokens the tree of M nodes built from the same draft distributions would have
    accepted in this verification of the tree of N — the nodes of its accepted path below the root with ``rank < M``
    (``rank [B, N]``, :attr:`Tree.rank`; ``path [B, Kp + 1]`` int64, ``num_accepted [B]`` a; entries past depth a
    are ignored).

    The tree of M is the first M nodes of this one in the builder's order (the best M - 1 keys: a node's
    ancestors rank before it, the candidates and each depth's beam of the smaller tree hold all of them), so at
    T = 0 its accepted path is this path's prefix inside it, exactly, given the target's argmax at each node (the
    same in both trees' passes in exact mode; in fast bf16 a near-tie can differ between a pass over N and over M
    nodes): the argmax picks the same child at every node while the child is in the smaller tree. At T > 0 (``dspine.ops.tree_verify``'s multi-candidate
    rejection sampling) a node's children in the smaller tree are the first of its children here (ranked by key),
    tested in the same order against the same residual distributions, so the prefix is a draw of the smaller tree's
    acceptance (with other nodes' uniforms: equal in law, not draw for draw). Once the path leaves the smaller tree
    it does not come back (a node ranks after its parent), so the count is a sum. Up to fp32 ties between the two
    builds' keys, the Triton builder's ranks equal build_tree's (tests/test_tree_build.py)."""
    depth = torch.arange(path.shape[1], device=path.device)
    live = depth <= num_accepted[:, None]
    r = rank.gather(1, torch.where(live, path, 0))  # [B, Kp + 1]; the root's rank 0 where not live
    if isinstance(sizes, torch.Tensor):  # [S] on the device (dspine.ops.plan_stats): compared there, no host copy
        inside = (r[:, :, None] < sizes.to(r.dtype)[None, None, :]) & live[:, :, None]
        return inside.sum(1, dtype=torch.int32) - 1
    sizes = [int(m) for m in sizes]
    if not sizes:
        return torch.zeros(path.shape[0], 0, dtype=torch.int32, device=path.device)
    inside = torch.stack([r < m for m in sizes], -1) & live[:, :, None]  # [B, Kp + 1, S] (no host copy)
    return inside.sum(1, dtype=torch.int32) - 1  # the root is on every path


def ancestor_mask(parent: torch.Tensor) -> torch.Tensor:
    """``[B, N, N]`` bool: ``anc[b, i, j]`` iff node j is node i or an ancestor of it (``parent [B, N]``,
    -1 = none). Reachability by squaring: after k squarings of (I + parent edges) every ancestor up to
    2^k levels up is marked, so ceil(log2 N) batched matmuls cover any tree (few kernels)."""
    B, N = parent.shape
    idx = torch.arange(N, device=parent.device)
    reach = ((idx[:, None] == idx) | (parent[..., None] == idx)).float()  # 0/1, exact in fp32
    for _ in range(max(N - 1, 1).bit_length()):
        reach = (reach @ reach).clamp_max(1.0)
    return reach > 0


def ancestor_bits(anc: torch.Tensor) -> torch.Tensor:
    """The ancestor mask ``anc [B, N, N]`` packed as ``[B, N]`` int64 bitmasks (bit j of row i = anc[b, i, j]),
    N <= 64. Raises ValueError for N > 64."""
    N = anc.shape[-1]
    if N > 64:
        raise ValueError(f"tree of {N} nodes: the bitmask holds at most 64")
    bits = torch.ones(N, dtype=torch.long, device=anc.device) << torch.arange(N, device=anc.device)
    return (anc.long() * bits).sum(-1)  # disjoint bits: the sum is the OR (bit 63 wraps to the sign bit)


def path_nodes(tree: Tree, last: torch.Tensor, K: int) -> torch.Tensor:
    """``[B, K + 1]`` int64: the node at depth 0..K of the path from the root to ``last [B]`` (depth a);
    entries past depth a hold their own index, so moving row ``path[d]`` to row d leaves them in place."""
    on_path = tree.anc[torch.arange(tree.parent.shape[0], device=last.device), last]  # [B, N]
    return path_from_mask(on_path, tree.depth, K)


def chain_accepted(chain: torch.Tensor, path: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """``[B]`` int32: the draft tokens the chain alone would have accepted in this verification — the chain
    nodes on the accepted path below the root. ``chain [B, N]`` bool (``Tree.chain``), ``path [B, Kp + 1]``
    int64 (the node at each depth, :func:`path_nodes`; entries past depth a are ignored), ``num_accepted [B]``
    (a, the path's depth).

    Exact, not an estimate: the chain node is the first child of its parent and is tested first, against the
    target's unmodified distribution at that node with the chain's own test (T = 0: the argmax; T > 0:
    ``u · q(x) < p(x)`` with the chain decoder's uniform, :func:`node_uniforms`). So the path follows the chain
    exactly as long as the chain step would accept, and leaves it where the chain step would stop (or the
    tree's chain ends: at depth min(K, N - 1) with the chain first, and where its next node scored out of a
    best-first tree; a count equal to that depth is censored there)."""
    depth = torch.arange(path.shape[1], device=path.device)
    live = depth <= num_accepted[:, None]
    on = chain.gather(1, torch.where(live, path, 0)) & live  # entries past depth a are never read
    return on.sum(1, dtype=torch.int32) - 1  # the root is on every path


def node_uniforms(tree: Tree, seeds: torch.Tensor, out_pos: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` fp32 U(0, 1) per node for :func:`verify_tree`: a chain node at depth d takes the chain
    decoder's uniform (``STREAM_ACCEPT`` at output position out_pos + d - 1), every other node its own
    draw keyed by (out_pos, node index) on ``STREAM_TREE`` (``out_pos [B]``: the step's first output
    position, ``seeds [B]`` int64)."""
    B, N = tree.tokens.shape
    chain_u = rng.uniforms(seeds, rng.STREAM_ACCEPT, out_pos[:, None] + (tree.depth - 1).clamp_min(0))
    own_u = rng.uniforms(seeds, STREAM_TREE, out_pos[:, None], N)[:, 0]
    return torch.where(tree.chain, chain_u, own_u)


def verify_tree(
    tree: Tree,
    *,
    target_argmax: torch.Tensor | None = None,
    p_target: torch.Tensor | None = None,
    q: torch.Tensor | None = None,
    u: torch.Tensor | None = None,
    exp_noise: torch.Tensor | None = None,
):
    """Accept the longest verified path of ``tree`` (module docstring).

    Greedy: ``target_argmax [B, N]`` int64, the target's argmax at every node. Sampling:
    ``p_target [B, N, V]`` fp32 (the target's distribution after every node), ``q [B, K, V]``
    fp32 (the draft distributions the chain tokens were sampled from), ``u [B, N]`` fp32
    U(0, 1) per node, ``exp_noise [B, V]`` fp32 Exp(1) for the bonus race.
    Returns (last [B] int64: the last accepted node, num_accepted [B] int32 = its depth,
    bonus [B] int64). Raises ValueError if neither or both modes are given, or on shapes and dtypes.
    The torch reference of ``dspine.ops.tree_verify`` (``impl="torch"``), whose Triton kernels do the same
    in a few launches.
    """
    greedy = target_argmax is not None
    if greedy == (p_target is not None):
        raise ValueError("give target_argmax (T = 0) or p_target, q, u, exp_noise (T > 0)")
    if greedy:
        return verify_tree_greedy(tree.tokens, tree.parent, tree.depth, tree.anc, target_argmax, impl="torch")
    return verify_tree_sample(tree.tokens, tree.parent, tree.depth, tree.chain, p_target, q, u, exp_noise, impl="torch")
