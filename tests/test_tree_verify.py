"""dspine.ops.tree_verify: the Triton tree verification against its torch reference (the rule of
dspine.tree.verify_tree), on build_tree's trees and on general ones, plus the distribution it emits."""

import tests.kernel_env as env  # noqa: I001  (must precede the kernel imports)

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspine import sampling as rng
from dspine.ops.tree_verify import (
    _node_sums,
    verify_tree_greedy,
    verify_tree_sample,
    verify_tree_sample_torch,
)
from dspine.sampling import logits_to_probs, sample
from dspine.tree import Tree, ancestor_bits, ancestor_mask, build_tree, node_uniforms, path_nodes, verify_tree

needs_interp = pytest.mark.skipif(not env.TRITON_CPU, reason=str(env.TRITON_CPU_SKIP))


# ----------------------------------------------------------------------------- inputs


def sparse_probs(g, *shape, sharp=3.0, zero_frac=0.0):
    """Random distributions over the last dim; a fraction of the entries zero (at least one kept)."""
    p = torch.rand(*shape, generator=g) ** sharp
    if zero_frac:
        p = p * (torch.rand(*shape, generator=g) >= zero_frac)
        p[..., 0] += (p.sum(-1) == 0) * 1.0  # never an all-zero row
    return p / p.sum(-1, keepdim=True)


def top_k_cut(g, p):
    """Zero all but the k most probable entries of each row (k random in 1..V), renormalized."""
    V = p.shape[-1]
    k = torch.randint(1, V + 1, p.shape[:-1], generator=g)
    rank = p.argsort(-1, descending=True).argsort(-1)
    p = p * (rank < k[..., None])
    return p / p.sum(-1, keepdim=True)


def sample_case(g, B, N, K, V, zeros=True):
    """A build_tree tree from a random draft (chain tokens sampled from q) and a target that follows the
    draft at the next depth to a per-row degree, so paths are accepted deep and rejected early alike."""
    q = sparse_probs(g, B, K, V, sharp=4.0, zero_frac=0.3 if zeros else 0.0)
    chain = torch.stack([torch.multinomial(q[:, k], 1, generator=g)[:, 0] for k in range(K)], 1)
    tree = build_tree(torch.randint(0, V, (B,), generator=g), q, N, chain_tokens=chain)
    follow = q[torch.arange(B)[:, None], tree.depth.clamp(max=K - 1)]  # [B, N, V]
    mix = torch.rand(B, 1, 1, generator=g)
    p = mix * follow + (1 - mix) * sparse_probs(g, B, N, V, sharp=4.0)
    if zeros:
        cut = torch.rand(B, N, 1, generator=g) < 0.5
        p = torch.where(cut, top_k_cut(g, p), p)
    u = torch.rand(B, N, generator=g)
    e = torch.empty(B, V).exponential_(generator=g)
    return tree, (tree.tokens, tree.parent, tree.depth, tree.chain, p, q, u, e)


def general_tree(g, B, N, K, V, random_depth):
    """Trees build_tree does not make: random parents (some after the node: never tested; some -1), random
    depths (or the parent's + 1, capped at K), at most one chain child per node, few tokens (duplicate
    siblings)."""
    parent = torch.full((B, N), -1)
    depth = torch.zeros(B, N, dtype=torch.long)
    wide = torch.rand(B, generator=g) < 0.5  # rows with few parents: many siblings
    for i in range(1, N):
        parent[:, i] = torch.randint(-1, i + 2, (B,), generator=g).clamp(max=N - 1)
        parent[:, i] = torch.where(wide, parent[:, i].clamp(max=min(2, i - 1)), parent[:, i])
        up = depth.gather(1, parent[:, i : i + 1].clamp(0, i - 1))[:, 0]
        depth[:, i] = (up + 1).clamp(max=K)
    if random_depth:
        depth[:, 1:] = torch.randint(1, K + 1, (B, N - 1), generator=g)
    chain = torch.zeros(B, N, dtype=torch.bool)
    for b in range(B):
        taken = set()
        for i in torch.randperm(N - 1, generator=g).tolist():
            j = i + 1
            if int(parent[b, j]) not in taken and torch.rand(1, generator=g) < 0.5:
                taken.add(int(parent[b, j]))
                chain[b, j] = True
    tokens = torch.randint(0, min(V, 4), (B, N), generator=g)
    return tokens, parent, depth, chain


# ----------------------------------------------------------------------------- sampling: Triton == torch


def compare_sample(args, splits=None, path_depth=None):
    """Triton vs the torch reference: bit-equal to the reference with fp64 Σr (the kernels' sum), and to
    the fp32 one except where the two references differ (a near-tie of u·Σr and r(x)). Returns
    (reference outputs, rows where the fp32 reference differs)."""
    ref32 = verify_tree_sample(*args, impl="torch", path_depth=path_depth)
    ref64 = verify_tree_sample_torch(*args, path_depth=path_depth, sum_dtype=torch.float64)
    got = verify_tree_sample(*args, splits=splits, path_depth=path_depth)
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.int32 and got[2].dtype == torch.int64
    for x, y in zip(got, ref64):
        assert torch.equal(x, y)
    differ = torch.zeros(len(args[0]), dtype=torch.bool)
    for x, y in zip(ref32, ref64):
        differ |= (x != y).reshape(len(x), -1).any(1)
    return ref32, differ


@needs_interp
@pytest.mark.parametrize(
    "N,K,B,V",
    [
        (2, 1, 5, 7),
        (16, 15, 5, 7),
        (16, 1, 1, 1000),
        (32, 15, 5, 1000),
        (64, 15, 5, 1000),
        (64, 15, 1, 7),
        (64, 1, 5, 1000),
    ],
)
def test_sample_triton_equals_torch_on_built_trees(N, K, B, V):
    g = torch.Generator().manual_seed(N * 100 + K * 10 + V)
    reps = 6 if B == 5 else 12
    accepted, differ = [], 0
    for rep in range(reps):
        tree, args = sample_case(g, B, N, K, V, zeros=rep % 2 == 0)
        splits = (None, 1, 3, (2, 5))[rep % 4]
        (last, a, bonus, path), bad = compare_sample(args, splits, path_depth=min(K, N - 1))
        differ += int(bad.sum())
        assert torch.equal(path, path_nodes(tree, last, min(K, N - 1)))
        assert (args[4][torch.arange(B), last, bonus] > 0).all()  # the bonus has target mass at the last node
        accepted.append(a)
    assert differ == 0  # fp32 vs fp64 Σr: a near-tie, about 1e-7 per deterministic test
    a = torch.cat(accepted).float()
    if N > 2:
        assert (a == 0).any() and a.max() >= min(3, K)  # shallow and deep paths both exercised


@needs_interp
def test_sample_triton_equals_torch_on_general_trees():
    """Parents after the node, random depths, duplicate sibling tokens, padding: the same walk."""
    g = torch.Generator().manual_seed(5)
    B, K, V = 5, 4, 6
    for N in (2, 9, 33, 64):
        for rep in range(6):
            tokens, parent, depth, chain = general_tree(g, B, N, K, V, random_depth=rep % 2 == 1)
            q = sparse_probs(g, B, K, V, sharp=2.0, zero_frac=0.3)
            p = sparse_probs(g, B, N, V, sharp=1.0, zero_frac=0.2) * (1 + rep)  # unnormalized: the rule holds
            u = torch.rand(B, N, generator=g)
            e = torch.empty(B, V).exponential_(generator=g)
            args = (tokens, parent, depth, chain, p, q, u, e)
            (last, a, _, path), differ = compare_sample(args, splits=rep % 3 + 1, path_depth=K)
            assert not differ.any()
            if rep % 2 == 0:  # depths along a path distinct: the path is defined
                anc = ancestor_mask(torch.where(parent < torch.arange(N), parent, -1))  # the tested links
                assert torch.equal(path, path_nodes(Tree(tokens, parent, depth, chain, anc), last, K))


@needs_interp
def test_node_sums_are_fp64_sums():
    """Pass 1's Σ p_target[c] and Σ max(p_target[c] − q, 0) (q of c's chain child) for every node with a
    deterministic child (before / after its chain child), in any split: fp64 sums of the fp32 rows."""
    g = torch.Generator().manual_seed(2)
    B, N, K, V = 3, 24, 4, 3000
    tree, (tok, par, dep, ch, p, q, u, e) = sample_case(g, B, N, K, V)
    p = p * torch.exp(4 * torch.randn(B, N, V, generator=g))  # wide exponents: fp32 partial sums would drift
    for splits in (1, 5):
        got = _node_sums(tok, par, dep, ch, p, q, splits).sum(1)  # [B, N, 2]
        checked = 0
        for b in range(B):
            for c in range(N):
                kids = [j for j in range(c + 1, N) if par[b, j] == c]
                chain_kid = [j for j in kids if ch[b, j]]
                det = [j for j in kids if not ch[b, j]]
                if not det:
                    continue
                want0 = p[b, c].double().sum()
                assert abs(got[b, c, 0] - want0) <= 1e-12 * want0
                if chain_kid and any(j > chain_kid[0] for j in det):
                    res = (p[b, c] - q[b, dep[b, chain_kid[0]] - 1]).clamp_min(0).double().sum()
                    assert abs(got[b, c, 1] - res) <= 1e-12 * res
                    checked += 1
        assert checked >= 3


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_sample_crafted(impl):
    """Hand-checked rows over V = 6 and a tree root -> {1: chain x=1, 2: x=2, 3: x=3}, 1 -> {4: chain x=4}."""
    if impl == "triton" and not env.TRITON_CPU:
        pytest.skip(str(env.TRITON_CPU_SKIP))
    V = 6
    tokens = torch.tensor([[0, 1, 2, 3, 4]]).repeat(4, 1)
    parent = torch.tensor([[-1, 0, 0, 0, 1]]).repeat(4, 1)
    depth = torch.tensor([[0, 1, 1, 1, 2]]).repeat(4, 1)
    chain = torch.tensor([[True, True, False, False, True]]).repeat(4, 1)
    q = torch.zeros(4, 2, V)
    q[:, 0, 1] = q[:, 1, 4] = 1.0
    p = torch.zeros(4, 5, V)
    p[:, 0] = torch.tensor([0.0, 0.4, 0.3, 0.3, 0.0, 0.0])
    p[:, 1, 4] = p[:, 2, 5] = p[:, 3, 5] = 1.0
    p[:, 4, 0] = 1.0
    # row 0: 0.1·1 < 0.4: node 1; 0.5·1 < 1: node 4; bonus from p[4]: token 0
    # row 1: node 1 rejected, r = (0, 0, .3, .3); 0.6·0.6 < 0.3 fails, r = .3·e3; node 3: 0·0.3 < 0.3: accepted;
    #        bonus from p[3]: token 5
    # row 2: nodes 1, 2 and (u = 1) 3 rejected: r all zero, the race runs on p[0]
    # row 3: node 2: 0.4·0.6 = 0.24 < 0.3: accepted; bonus 5
    u = torch.tensor(
        [
            [0.0, 0.1, 0.0, 0.0, 0.5],
            [0.0, 0.9, 0.6, 0.0, 0.0],
            [0.0, 0.9, 0.6, 1.0, 0.0],
            [0.0, 0.9, 0.4, 0.0, 0.0],
        ]
    )
    e = torch.ones(4, V)
    e[2] = torch.tensor([1.0, 2.0, 1.0, 4.0, 1.0, 1.0])  # race on p[0]: 0.4/2 < 0.3/1 > 0.3/4: token 2
    last, a, bonus, path = verify_tree_sample(
        tokens, parent, depth, chain, p, q, u, e, impl=impl, path_depth=2
    )
    assert last.tolist() == [4, 3, 0, 2] and a.tolist() == [2, 1, 0, 1] and bonus.tolist() == [0, 5, 2, 5]
    assert path.tolist() == [[0, 1, 4], [0, 3, 2], [0, 1, 2], [0, 2, 2]]


@needs_interp
def test_sample_zero_residual_and_zero_draft():
    """A chain child rejected with p <= q everywhere (residual all zero: the bonus races p_target[last]),
    and drafts with few nonzero tokens (padding nodes)."""
    g = torch.Generator().manual_seed(11)
    B, N, K, V = 5, 16, 3, 40
    tree, (tok, par, dep, ch, p, q, u, e) = sample_case(g, B, N, K, V)
    p = 0.5 * q[torch.arange(B)[:, None], dep.clamp(max=K - 1)]  # half the draft: max(p - q, 0) = 0
    u = torch.full((B, N), 0.75)  # 0.75·q(x) >= 0.5·q(x): every chain child rejected
    (last, a, bonus), differ = compare_sample((tok, par, dep, ch, p, q, u, e))
    assert not differ.any() and (last == 0).all() and (p[torch.arange(B), 0, bonus] > 0).all()
    q = torch.zeros(B, K, V)
    q[:, :, :2] = 0.5  # two tokens per depth: N = 16 leaves padding
    tree, (tok, par, dep, ch, p, _, u, e) = sample_case(g, B, N, K, V)
    tree = build_tree(tok[:, 0], q, N)
    assert (tree.parent[:, 1:] == -1).any()
    compare_sample((tree.tokens, tree.parent, tree.depth, tree.chain, p, q, u, e), path_depth=K)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_sample_race_ties_go_to_the_lowest_token(impl):
    """Equal race scores in different chunks and V slices: the lowest token wins, for the residual and for
    the fallback on p_target[last] (exact equality is where a wrong tie rule would show)."""
    if impl == "triton" and not env.TRITON_CPU:
        pytest.skip(str(env.TRITON_CPU_SKIP))
    V = 2100
    tokens, parent = torch.tensor([[0, 7], [0, 7]]), torch.tensor([[-1, 0], [-1, 0]])
    depth, chain = torch.tensor([[0, 1], [0, 1]]), torch.tensor([[True, True], [True, True]])
    q = torch.zeros(2, 1, V)
    q[:, 0, 7] = 1.0
    p = torch.zeros(2, 2, V)
    p[0, 0, [7, 1500, 2050, 40]] = torch.tensor([0.4, 0.25, 0.25, 0.1])  # x = 7 rejected: 1500 and 2050 tie
    p[1, 0, [1300, 2099]] = 0.5  # r(7) = 0: rejected; the residual ties 1300 and 2099
    p[:, 1, 0] = 1.0
    u = torch.tensor([[0.0, 0.9], [0.0, 0.5]])
    e = torch.ones(2, V)
    for splits in (None, 1, 3):  # slices of 2048 or 1024 tokens (chunks of 1024)
        last, a, bonus = verify_tree_sample(
            tokens, parent, depth, chain, p, q, u, e, impl=impl, splits=splits
        )
        assert last.tolist() == [0, 0] and bonus.tolist() == [1500, 1300]
    p[0, 0] = 0.0
    p[0, 0, [7, 999, 1024]] = torch.tensor([0.3, 0.5, 0.5])
    q[0, 0, [999, 1024]] = 0.5  # q >= p: the residual is all zero, the race runs on p_target[0]
    last, a, bonus = verify_tree_sample(tokens, parent, depth, chain, p, q, u, e, impl=impl, splits=2)
    assert bonus.tolist() == [999, 1300]


# ----------------------------------------------------------------------------- distribution


def markov_case(T, device="cpu", seed=7):
    """T seeded steps on a toy Markov target (the next-token distribution depends on the depth and the last
    token, with top-k/top-p zeros) and a draft q that differs from it; trees of N = 10 nodes, K = 3."""
    g = torch.Generator().manual_seed(seed)
    K, V, N = 3, 8, 10
    p_root = logits_to_probs(torch.randn(V, generator=g) * 1.5, 0.8, 0.95, 6)
    p_next = logits_to_probs(torch.randn(K + 1, V, V, generator=g) * 1.5, 0.8, 0.95, 6)  # [depth, x]
    q = logits_to_probs(torch.randn(K, V, generator=g), 1.0).expand(T, K, V).to(device)
    p_root, p_next = p_root.to(device), p_next.to(device)
    seeds, n = torch.arange(T, device=device) * 3 + 1, torch.full((T,), 4, device=device)
    chain = sample(q, seeds, rng.STREAM_DRAFT, n[:, None] + torch.arange(K, device=device))
    tree = build_tree(torch.zeros(T, dtype=torch.long, device=device), q, N, chain_tokens=chain)
    p = torch.where((tree.depth == 0)[..., None], p_root, p_next[tree.depth, tree.tokens]).contiguous()
    u = node_uniforms(tree, seeds, n)
    e = rng.exponentials(seeds, rng.STREAM_TARGET, n[:, None], V)[:, 0]
    return tree, (tree.tokens, tree.parent, tree.depth, tree.chain, p, q.contiguous(), u, e), p_root, p_next


def emitted(tokens, a, bonus, path):
    """The first two emitted tokens: the accepted nodes' tokens, then the bonus."""
    tok = torch.cat([tokens.gather(1, path)[:, 1:], bonus[:, None]], 1)
    tok = tok.scatter(1, a.long()[:, None], bonus[:, None])
    return tok[:, 0], tok[:, 1]


def pvalue(tokens, probs):
    counts = np.bincount(tokens.cpu().numpy(), minlength=probs.shape[-1]).astype(float)
    probs = probs.double().cpu().numpy()
    expected = probs / probs.sum() * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "emitted a token of zero target probability"
    return chisquare(counts[keep], expected[keep]).pvalue


def check_distribution(args, impl, p_root, p_next):
    """The first emitted token follows p_root, the second given an accepted first x follows p_next[1, x]
    (p > 1e-3 each: several tests per call); with a proposal other than the one the chain tokens were drawn
    from (uniform q in the chain test) the first token is biased (p < 1e-6: the test has the power)."""
    tokens, K = args[0], args[5].shape[1]
    last, a, bonus, path = verify_tree_sample(*args, impl=impl, path_depth=K)
    first, second = emitted(tokens, a, bonus, path)
    assert pvalue(first, p_root) > 1e-3
    assert (a >= 1).float().mean() > 0.25 and (tokens.shape[1] - 1 - K) > 2  # deterministic siblings too
    counts = first[a >= 1].bincount(minlength=p_root.numel())
    xs = (counts >= 2000).nonzero()[:, 0].tolist()
    assert len(xs) >= 2
    for x in xs:
        sel = (first == x) & (a >= 1)
        assert pvalue(second[sel], p_next[1, x]) > 1e-3
    wrong = list(args)
    wrong[5] = torch.full_like(args[5], 1.0 / args[5].shape[-1])
    _, a, bonus, path = verify_tree_sample(*wrong, impl=impl, path_depth=K)
    assert pvalue(emitted(tokens, a, bonus, path)[0], p_root) < 1e-6


def test_sample_emits_the_target_distribution():
    """Chi-square over 6·10^4 seeded steps (torch path; the Triton path is bit-equal to it on a slice of
    them here, for interpreter time, and runs the full test on the GPU)."""
    tree, args, p_root, p_next = markov_case(60_000)
    check_distribution(args, "torch", p_root, p_next)
    if env.TRITON_CPU:
        rows = slice(0, 100)
        _, differ = compare_sample([x[rows] for x in args], path_depth=3)
        assert not differ.any()


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize(
    "N,K,B,V", [(2, 1, 5, 7), (16, 15, 5, 7), (32, 15, 1, 1000), (64, 15, 5, 1000), (64, 1, 5, 7)]
)
def test_greedy_equals_verify_tree(impl, N, K, B, V):
    """Bits or mask, against dspine.tree.verify_tree and path_nodes, with targets that follow the tree."""
    if impl == "triton" and not env.TRITON_CPU:
        pytest.skip(str(env.TRITON_CPU_SKIP))
    g = torch.Generator().manual_seed(N + K + V)
    deep = 0
    for _ in range(4):
        q = sparse_probs(g, B, K, V, zero_frac=0.3)
        tree = build_tree(torch.zeros(B, dtype=torch.long), q, N)
        # the target's argmax at a node: mostly one of its children's tokens, else a random token
        kid = tree.parent[:, None, :] == torch.arange(N)[None, :, None]  # [B, node, j]
        j = torch.where(kid, torch.rand(B, N, N, generator=g), -1.0).argmax(-1)
        hit = kid.any(-1) & (torch.rand(B, N, generator=g) < 0.8)
        ta = torch.where(hit, tree.tokens.gather(1, j), torch.randint(0, V, (B, N), generator=g))
        want = verify_tree(tree, target_argmax=ta)
        for anc in (tree.anc, ancestor_bits(tree.anc)):
            last, a, bonus, path = verify_tree_greedy(
                tree.tokens, tree.parent, tree.depth, anc, ta, impl=impl, path_depth=min(K, N - 1)
            )
            assert torch.equal(last, want[0]) and torch.equal(a, want[1]) and torch.equal(bonus, want[2])
            assert a.dtype == torch.int32 and last.dtype == bonus.dtype == torch.int64
            assert torch.equal(path, path_nodes(tree, last, min(K, N - 1)))
        deep += int(want[1].max())
    assert deep > 0


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_greedy_general_trees_take_the_deepest_lowest_node(impl):
    """Duplicate sibling tokens: several matching paths; the deepest node wins, the lowest index on ties."""
    if impl == "triton" and not env.TRITON_CPU:
        pytest.skip(str(env.TRITON_CPU_SKIP))
    g = torch.Generator().manual_seed(9)
    B, N = 40, 24
    parent = torch.stack([torch.randint(0, max(i, 1), (B,), generator=g) for i in range(N)], 1)
    parent[:, 0] = -1
    parent[:, -3:] = -1  # padding
    anc = ancestor_mask(parent)
    depth = anc.sum(-1) - 1
    tokens = torch.randint(0, 2, (B, N), generator=g)
    ta = torch.randint(0, 2, (B, N), generator=g)
    bits = ancestor_bits(anc)
    want = verify_tree_greedy(tokens, parent, depth, anc, ta, impl="torch", path_depth=3)
    for a in (anc, bits):
        got = verify_tree_greedy(tokens, parent, depth, a, ta, impl=impl, path_depth=3)
        assert all(torch.equal(x, y) for x, y in zip(got, want))
    ok = torch.zeros(B, N, dtype=torch.bool)  # brute force: every node whose whole path matches
    for b in range(B):
        for i in range(N):
            j, good = i, parent[b, i] >= 0 or i == 0
            while j > 0 and good:
                good = bool(tokens[b, j] == ta[b, parent[b, j]])
                j = int(parent[b, j])
            ok[b, i] = good
    key = torch.where(ok, depth, -1)
    best = (key == key.max(1, keepdim=True).values).int().argmax(1)
    assert torch.equal(want[0], best) and (ok.sum(1) > want[1] + 1).any()  # other matching nodes existed


def test_validation():
    g = torch.Generator().manual_seed(0)
    tree, args = sample_case(g, 2, 8, 3, 10)
    tok, par, dep, ch, p, q, u, e = args
    with pytest.raises(ValueError, match="impl"):
        verify_tree_sample(*args, impl="cuda")
    with pytest.raises(ValueError, match="chain must be"):
        verify_tree_sample(tok, par, dep, ch.long(), p, q, u, e, impl="torch")
    with pytest.raises(ValueError, match="p_target must be"):
        verify_tree_sample(tok, par, dep, ch, p[:, :5], q, u, e, impl="torch")
    with pytest.raises(ValueError, match="exp_noise must be"):
        verify_tree_sample(tok, par, dep, ch, p, q, u, e.double(), impl="torch")
    with pytest.raises(ValueError, match="path_depth"):
        verify_tree_sample(*args, impl="torch", path_depth=-1)
    with pytest.raises(ValueError, match="anc_or_bits"):
        verify_tree_greedy(tok, par, dep, tree.anc.long(), tok, impl="torch")
    big = torch.zeros(1, 65, dtype=torch.long)
    with pytest.raises(ValueError, match="N <= 64"):
        verify_tree_greedy(big, big, big, torch.zeros(1, 65, 65, dtype=torch.bool), big)
    if env.TRITON_CPU:
        with pytest.raises(ValueError, match="contiguous last dim"):
            verify_tree_sample(tok, par, dep, ch, p.transpose(1, 2).contiguous().transpose(1, 2), q, u, e)


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not env.HAS_CUDA, reason="no CUDA")
def test_gpu_matches_torch_in_a_graph_and_emits_the_target():
    """On the GPU at the engine's shapes (SmolLM2 vocab): Triton == torch (fp64 Σr exactly, fp32 Σr but for
    near-ties), eager and replayed from a CUDA graph; greedy with bitmasks; chi-square with the kernels."""
    g = torch.Generator().manual_seed(1)
    mismatch = rows = 0
    for B, N in ((1, 16), (8, 32), (8, 64)):
        for rep in range(3):
            tree, args = sample_case(g, B, N, 15, 49152, zeros=rep != 1)
            args = [x.cuda() for x in args]
            ref64 = verify_tree_sample_torch(*args, path_depth=15, sum_dtype=torch.float64)
            ref32 = verify_tree_sample(*args, impl="torch", path_depth=15)
            got = verify_tree_sample(*args, path_depth=15)
            assert all(torch.equal(x, y) for x, y in zip(got, ref64))
            mismatch += int(sum((x != y).reshape(B, -1).any(1) for x, y in zip(ref32, ref64)).bool().sum())
            rows += B
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = verify_tree_sample(*args, path_depth=15)
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(x, y) for x, y in zip(out, ref64))
            ta = args[4].argmax(-1)
            tree = Tree(*(x.cuda() for x in (tree.tokens, tree.parent, tree.depth, tree.chain, tree.anc)))
            want = verify_tree(tree, target_argmax=ta)
            got = verify_tree_greedy(
                tree.tokens, tree.parent, tree.depth, ancestor_bits(tree.anc), ta, path_depth=15
            )
            assert all(torch.equal(x, y) for x, y in zip(got[:3], want))
            assert torch.equal(got[3], path_nodes(tree, got[0], 15))
    assert mismatch <= 1, (mismatch, rows)  # fp32 vs fp64 Σr: near-ties only
    tree, args, p_root, p_next = markov_case(100_000, device="cuda")
    check_distribution(args, "triton", p_root, p_next)


@needs_interp
def test_bench_tree_verify_tiny():
    """benchmarks/kernels/bench_tree_verify.py --tiny: every case timed for both impls, outputs equal."""
    from benchmarks.kernels import bench_tree_verify

    res = bench_tree_verify.run(bench_tree_verify.parse_args(["--tiny"]))
    assert res["backend"] == "cpu" and len(res["rows"]) == 2 * len(res["cases"])
    for row in res["rows"]:
        assert row["torch_us"] > 0 and row["triton_us"] > 0 and row["equal"] is True
