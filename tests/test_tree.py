"""Token trees from a block draft (dspine.tree): construction, ancestor masks, exact verification."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspine import sampling as rng
from dspine.ops.accept import accept_greedy, accept_sample
from dspine.sampling import logits_to_probs, sample
from dspine.tree import (
    Tree,
    ancestor_bits,
    ancestor_mask,
    build_tree,
    chain_accepted,
    inner_accepted,
    node_uniforms,
    path_nodes,
    verify_tree,
)


def paths(tree: Tree, b: int, below: int | None = None) -> list[tuple[int, ...]]:
    """Token path (root excluded) of every real node of row b (of rank < ``below`` if given), by walking parent
    pointers."""
    out = []
    for i in range(1, tree.size):
        if tree.parent[b, i] < 0 or (below is not None and tree.rank[b, i] >= below):
            continue
        toks, j = [], i
        while j > 0:
            toks.append(int(tree.tokens[b, j]))
            j = int(tree.parent[b, j])
        out.append(tuple(reversed(toks)))
    return out


def test_ancestor_mask_matches_brute_force_on_random_trees():
    g = torch.Generator().manual_seed(0)
    for N in (1, 2, 7, 33, 64):
        parent = torch.stack(
            [
                torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)])
                for _ in range(3)
            ]
        )
        parent[0, N // 2 :] = -1  # padding nodes: only themselves
        want = torch.zeros(3, N, N, dtype=torch.bool)
        for b, i in itertools.product(range(3), range(N)):
            j = i
            while j >= 0:
                want[b, i, j] = True
                j = int(parent[b, j])
        assert torch.equal(ancestor_mask(parent), want)
        bits = ancestor_bits(want)
        assert all(
            bool(bits[b, i] >> j & 1) == bool(want[b, i, j])
            for b, i, j in itertools.product(range(3), range(N), range(N))
        )
    with pytest.raises(ValueError, match="65 nodes"):
        ancestor_bits(torch.zeros(1, 65, 65, dtype=torch.bool))


@pytest.mark.parametrize("N", [2, 4, 9, 20])
def test_build_tree_is_best_first_and_holds_the_chain(N):
    """Against brute force over all V^1 + .. + V^K paths: the chain prefix first, then the best scores."""
    g = torch.Generator().manual_seed(N)
    B, K, V = 2, 3, 5
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1)
    tree = build_tree(torch.tensor([11, 12]), q, N)
    assert tree.tokens.shape == (B, N) and torch.equal(tree.tokens[:, 0], torch.tensor([11, 12]))
    for b in range(B):
        chain = tuple(q[b].argmax(-1).tolist())
        every = [p for n in range(1, K + 1) for p in itertools.product(range(V), repeat=n)]
        logq = q[b].log().tolist()
        key = {
            p: float("inf") if p == chain[: len(p)] else sum(logq[d][t] for d, t in enumerate(p))
            for p in every
        }
        want = sorted(every, key=key.get, reverse=True)[: N - 1]
        got = paths(tree, b)
        assert sorted(got) == sorted(want)
        assert [len(p) for p in got] == sorted(len(p) for p in got)  # breadth first
        assert tree.depth[b].tolist() == [0] + [len(p) for p in got]
        on_chain = [p == chain[: len(p)] for p in got]
        assert tree.chain[b, 1:].tolist() == on_chain


@pytest.mark.parametrize("N", [2, 4, 9, 20, 40])
def test_build_tree_without_chain_first_is_the_best_paths(N):
    """chain_first=False against brute force: the N - 1 best path scores (the set; ties aside: continuous q),
    breadth first, and a node is flagged chain iff its path is a prefix of the argmax chain."""
    g = torch.Generator().manual_seed(100 + N)
    B, K, V = 2, 3, 5
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1)
    tree = build_tree(torch.tensor([11, 12]), q, N, chain_first=False)
    forced = build_tree(torch.tensor([11, 12]), q, N)
    assert torch.equal(tree.anc, ancestor_mask(tree.parent))
    for b in range(B):
        chain = tuple(q[b].argmax(-1).tolist())
        every = [p for n in range(1, K + 1) for p in itertools.product(range(V), repeat=n)]
        logq = q[b].log().tolist()
        key = {p: sum(logq[d][t] for d, t in enumerate(p)) for p in every}
        want = sorted(every, key=key.get, reverse=True)[: N - 1]
        got = paths(tree, b)
        assert sorted(got) == sorted(want)
        assert [len(p) for p in got] == sorted(len(p) for p in got)
        assert tree.chain[b, 1:].tolist() == [p == chain[: len(p)] for p in got]
        # the same budget spent on better paths: the sum of scores is at least the chain-first tree's
        assert sum(key[p] for p in got) >= sum(key[p] for p in paths(forced, b)) - 1e-6
    if N == 4:  # a budget where the deepest chain node is outscored by a shallow sibling (this seed)
        assert not torch.equal(tree.tokens, forced.tokens)
    with pytest.raises(ValueError, match="chain_first=None must be True or False"):
        build_tree(torch.tensor([11, 12]), q, N, chain_first=None)


def test_build_tree_pads_when_the_draft_has_few_tokens():
    q = torch.zeros(1, 2, 6)
    q[0, 0, 3] = q[0, 1, 4] = 1.0  # one token per depth has mass: the chain, then padding
    tree = build_tree(torch.tensor([0]), q, 6)
    assert tree.tokens[0, :3].tolist() == [0, 3, 4] and tree.parent[0].tolist() == [-1, 0, 1, -1, -1, -1]
    with pytest.raises(ValueError, match="budget=1"):
        build_tree(torch.tensor([0]), q, 1)


def test_greedy_verify_accepts_the_longest_matching_path():
    g = torch.Generator().manual_seed(3)
    B, K, V, N = 64, 4, 3, 12
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    tree = build_tree(torch.zeros(B, dtype=torch.long), q, N)
    t_arg = torch.randint(0, V, (B, N), generator=g)
    last, a, bonus = verify_tree(tree, target_argmax=t_arg)
    for b in range(B):
        ok = [0]  # nodes whose whole path matches the target's argmax at each parent
        for i in range(1, N):
            p = int(tree.parent[b, i])
            if p in ok and int(tree.tokens[b, i]) == int(t_arg[b, p]):
                ok.append(i)
        best = max(ok, key=lambda i: int(tree.depth[b, i]))
        assert (
            int(last[b]) == best
            and int(a[b]) == int(tree.depth[b, best])
            and int(bonus[b]) == int(t_arg[b, best])
        )
    assert a.float().mean() > 1  # the test exercised deep paths
    path = path_nodes(tree, last, K)
    for b in range(B):
        j, want = int(last[b]), list(range(K + 1))
        while j > 0:
            want[int(tree.depth[b, j])] = j
            j = int(tree.parent[b, j])
        assert path[b].tolist() == want


def test_chain_sized_tree_is_the_chain():
    """A tree of K + 1 nodes is the chain: same acceptance as dspine.ops.accept, greedy and sampled."""
    g = torch.Generator().manual_seed(4)
    B, K, V = 200, 3, 6
    t_logits, d_logits = torch.randn(B, K + 1, V, generator=g), torch.randn(B, K, V, generator=g)
    anchor = torch.zeros(B, dtype=torch.long)
    tree = build_tree(anchor, torch.softmax(d_logits, -1), K + 1)
    assert torch.equal(tree.tokens[:, 1:], d_logits.argmax(-1)) and bool(tree.chain.all())
    last, a, bonus = verify_tree(tree, target_argmax=t_logits.argmax(-1))
    a_ref, bonus_ref = accept_greedy(d_logits.argmax(-1), t_logits.argmax(-1), impl="torch")
    assert torch.equal(a, a_ref) and torch.equal(bonus, bonus_ref)
    p_t, p_d = logits_to_probs(t_logits, 1.0), logits_to_probs(d_logits, 1.0)
    seeds, n = torch.arange(B) + 5, torch.full((B,), 9)
    draft = sample(p_d, seeds, rng.STREAM_DRAFT, n[:, None] + torch.arange(K))
    tree = build_tree(anchor, p_d, K + 1, chain_tokens=draft)
    u = node_uniforms(tree, seeds, n)
    e = rng.exponentials(seeds, rng.STREAM_TARGET, n[:, None], V)[:, 0]
    _, a, bonus = verify_tree(tree, p_target=p_t, q=p_d, u=u, exp_noise=e)
    a_ref, bonus_ref = accept_sample(draft, p_t, p_d, u[:, 1:], e, impl="torch")
    assert torch.equal(a, a_ref) and torch.equal(bonus, bonus_ref)
    assert 0 < a.float().mean() < K


@pytest.mark.parametrize("N", [4, 8, 14])
def test_chain_accepted_on_a_tree_path_is_the_chain_step(N):
    """The chain nodes on a tree's accepted path are what the chain step accepts from the same draft block
    (the planner's paired observation), greedy and sampled; a tree of N - 1 < K nodes is a chain cut at N - 1."""
    g = torch.Generator().manual_seed(N)
    B, K, V = 300, 5, 6
    d_logits = 2 * torch.randn(B, K, V, generator=g)
    anchor = torch.zeros(B, dtype=torch.long)
    chain_len = min(K, N - 1)

    def chain_nodes(tree):  # [B, chain_len + 1]: the chain node at depth 0 .. chain_len
        at = [(tree.chain & (tree.depth == d)).int().argmax(1) for d in range(chain_len + 1)]
        return torch.stack(at, 1)

    # greedy: the target's argmax at a chain node is its chain child's token with probability 0.7
    tree = build_tree(anchor, torch.softmax(d_logits, -1), N)
    t_arg = torch.randint(0, V, (B, N), generator=g)
    nodes = chain_nodes(tree)
    child = tree.tokens.gather(1, nodes[:, 1:])
    hit = torch.rand(B, chain_len, generator=g) < 0.7
    t_arg.scatter_(1, nodes[:, :-1], torch.where(hit, child, t_arg.gather(1, nodes[:, :-1])))
    last, a, _ = verify_tree(tree, target_argmax=t_arg)
    got = chain_accepted(tree.chain, path_nodes(tree, last, chain_len), a)
    want, _ = accept_greedy(child, t_arg.gather(1, nodes), impl="torch")
    assert torch.equal(got, want)
    assert (got == chain_len).any() and (got == 0).any()
    assert (a > got).any() == (N - 1 > K)  # the tree went past the chain where it holds other nodes
    # sampled: the chain's test against the target's distribution at each chain node, with its uniforms
    p_d = logits_to_probs(d_logits, 1.0)
    seeds, n = torch.arange(B) + 11, torch.full((B,), 4)
    draft = sample(p_d, seeds, rng.STREAM_DRAFT, n[:, None] + torch.arange(K))
    tree = build_tree(anchor, p_d, N, chain_tokens=draft)
    p_t = logits_to_probs(2 * torch.randn(B, N, V, generator=g), 1.0)
    u = node_uniforms(tree, seeds, n)
    e = rng.exponentials(seeds, rng.STREAM_TARGET, n[:, None], V)[:, 0]
    last, a, _ = verify_tree(tree, p_target=p_t, q=p_d, u=u, exp_noise=e)
    got = chain_accepted(tree.chain, path_nodes(tree, last, chain_len), a)
    nodes = chain_nodes(tree)
    pt_chain = p_t.gather(1, nodes[..., None].expand(-1, -1, V))
    want, _ = accept_sample(draft[:, :chain_len], pt_chain, p_d[:, :chain_len], u.gather(1, nodes[:, 1:]), e,
                            impl="torch")
    assert torch.equal(got, want)
    assert (a > got).any() == (N - 1 > K) and (got == 0).any() and (got >= 2).any()


@pytest.mark.parametrize("chain_first", [False, True])
@pytest.mark.parametrize("kind", ["random", "ties"])
def test_inner_accepted_is_the_smaller_trees_acceptance(chain_first, kind):
    """The nodes of rank < M of a tree of N are the tree of M built from the same draft (same token paths), and at
    T = 0 inner_accepted on the tree of 32's accepted path is what verifying each smaller tree accepts (the planner's
    paired observation of a smaller tree, infer.engine.Engine._tree_step), also with exact ties in q."""
    g = torch.Generator().manual_seed(7 + chain_first)
    B, K, V, N = 200, 6, 12, 32
    if kind == "ties":  # integer weights: equal q, equal log q and equal path sums
        w = torch.randint(0, 4, (B, K, V), generator=g).float()
        w[..., 0] += 1
        q = w / w.sum(-1, keepdim=True)
    else:
        q = torch.softmax(3 * torch.randn(B, K, V, generator=g), -1)
    anchor = torch.zeros(B, dtype=torch.long)
    # the target's greedy continuation: the draft's argmax at a depth with probability 0.6, else a random token
    greedy = torch.where(torch.rand(B, K, generator=g) < 0.6, q.argmax(-1), torch.randint(0, V, (B, K), generator=g))

    def verify(tree):
        t_arg = torch.cat([greedy, greedy.new_full((B, 1), -1)], 1).gather(1, tree.depth)
        last, a, _ = verify_tree(tree, target_argmax=t_arg)
        return a, path_nodes(tree, last, K)

    big = build_tree(anchor, q, N, chain_first=chain_first)
    a, path = verify(big)
    sizes = [2, 5, 8, 16, 32]
    got = inner_accepted(big.rank, path, a, sizes)
    assert got.shape == (B, len(sizes)) and got.dtype == torch.int32
    for j, M in enumerate(sizes):
        small = build_tree(anchor, q, M, chain_first=chain_first)
        for b in range(0, B, 17):
            assert set(paths(big, b, below=M)) == set(paths(small, b)), (M, b)
        want, _ = verify(small)
        assert torch.equal(got[:, j], want), M
    assert torch.equal(got[:, -1], a) and (got[:, 1] < got[:, 3]).any()  # the larger trees accept more somewhere
    assert inner_accepted(big.rank, path, a, []).shape == (B, 0)  # no smaller tree: no column


def pvalue(tokens, probs):
    counts = np.bincount(tokens.numpy(), minlength=probs.shape[-1]).astype(float)
    probs = probs.double().numpy()
    expected = probs / probs.sum() * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0
    return chisquare(counts[keep], expected[keep]).pvalue


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 5)])
def test_tree_rejection_sampling_is_exact(temperature, top_p, top_k):
    """10^5 steps on a toy Markov target (the next-token distribution depends on the depth and the
    last token): the first emitted token follows the root's distribution and the second, given the
    first x, follows the distribution after x, through chain and non-chain (top-k) children alike."""
    g = torch.Generator().manual_seed(7)
    T, K, V, N = 100_000, 3, 8, 10
    p_root = logits_to_probs(torch.randn(V, generator=g) * 1.5, temperature, top_p, top_k)
    p_next = logits_to_probs(
        torch.randn(K + 1, V, V, generator=g) * 1.5, temperature, top_p, top_k
    )  # [depth, x]
    q = logits_to_probs(torch.randn(K, V, generator=g), temperature, top_p, top_k).expand(T, K, V)
    seeds, n = torch.arange(T) * 3 + 1, torch.full((T,), 4)
    chain = sample(q, seeds, rng.STREAM_DRAFT, n[:, None] + torch.arange(K))
    tree = build_tree(torch.zeros(T, dtype=torch.long), q, N, chain_tokens=chain)
    p_t = torch.where((tree.depth == 0)[..., None], p_root, p_next[tree.depth, tree.tokens])
    u = node_uniforms(tree, seeds, n)
    e = rng.exponentials(seeds, rng.STREAM_TARGET, n[:, None], V)[:, 0]

    def emitted(tree):
        last, a, bonus = verify_tree(tree, p_target=p_t, q=q, u=u, exp_noise=e)
        tok = torch.cat([tree.tokens.gather(1, path_nodes(tree, last, K))[:, 1:], bonus[:, None]], 1)
        tok = tok.scatter(1, a.long()[:, None], bonus[:, None])  # the committed a tokens, then the bonus
        return tok[:, 0], tok[:, 1], a

    first, second, a = emitted(tree)
    assert pvalue(first, p_root) > 0.01
    many_children = (tree.depth == 1).sum(1).float().mean()
    assert many_children > 2 and (a >= 1).float().mean() > 0.25
    counts = first[a >= 1].bincount(minlength=V)
    xs = (counts >= 2000).nonzero()[:, 0].tolist()
    assert len(xs) >= 2
    for x in xs:  # the second token, given that the first was the accepted tree node x
        assert pvalue(second[(first == x) & (a >= 1)], p_next[1, x]) > 0.01
    # the classic bug (docs/method.md §8.7): min(1, p/q) for top-k children that were never sampled from q
    wrong = Tree(tree.tokens, tree.parent, tree.depth, tree.parent >= -1, tree.anc)
    first, _, _ = emitted(wrong)
    assert pvalue(first, p_root) < 1e-6


# -- the reference decoder with tree verification ------------------------------------------------


def second_choice_oracle(decoder, reference: list[list[int]], seed: int = 0):
    """Patch the decoder's draft: at every slot the true next token gets logit 9, and with probability
    1/2 a wrong token gets 10 (the argmax). A chain stops at the first wrong argmax; a tree of enough
    nodes holds the true token as a second choice."""
    g = torch.Generator().manual_seed(seed)
    V = decoder.target.vocab_size

    def draft_logits(block, dcache):
        B, bs = block.shape
        logits = torch.zeros(B, bs - 1, V)
        for b in range(B):
            start = int(dcache.lengths[b])
            for k in range(1, bs):
                seq = reference[b]
                logits[b, k - 1, seq[start + k] if start + k < len(seq) else 0] = 9.0
                if torch.rand(1, generator=g) < 0.5:
                    logits[b, k - 1, int(torch.randint(0, V, (1,), generator=g))] = 10.0
        return logits

    decoder.draft_logits = draft_logits
    return decoder


def test_reference_tree_greedy_equals_chain_and_generate(tiny_qwen3_dir, stories_dir):
    """fp32: tree output == chain output == transformers greedy generate, random and oracle drafts."""
    import json

    from dspine.reference import ReferenceDecoder
    from dspine.sampling import SamplingParams
    from dspine.target import load_target
    from tests.conftest import shared_path
    from tests.helpers import random_draft

    target = load_target(str(tiny_qwen3_dir), dtype="fp32")
    prompts, eos, n = [[151644, 872, 198, 13048], [151644, 872, 198, 3838, 374, 220, 17, 10]], 151645, 16
    want = []
    for p in prompts:
        ids = torch.tensor([p])
        out = target.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        want.append(out[0, len(p) :].tolist())
    draft = random_draft(target, block_size=8, mask=151669)
    params = SamplingParams(max_new_tokens=n)
    for budget in (2, 12):
        res = ReferenceDecoder(target, draft, [eos], verify="tree", tree_budget=budget).generate(
            prompts, params
        )
        assert res.token_ids == want, budget

    ref = json.loads(shared_path("models", "stories260K", "greedy_200.json").read_text())["greedy_token_ids"][
        :80
    ]
    target = load_target(str(stories_dir), dtype="fp32")
    draft = random_draft(target, block_size=8, mask=0)
    params = SamplingParams(max_new_tokens=80)
    taus = {}
    for verify, budget in (("chain", 0), ("tree", 8), ("tree", 24)):
        dec = ReferenceDecoder(target, draft, [2], verify=verify, tree_budget=budget)
        res = second_choice_oracle(dec, [[1] + ref]).generate([[1]], params)
        assert res.token_ids[0] == ref, (verify, budget)
        taus[budget] = res.stats.tau
        assert abs(res.stats.tau - (1 + sum(res.stats.accept_at_pos))) < 1e-12
    assert taus[0] < 2.5 and taus[24] > taus[0] + 1.5, taus  # second choices are verified and accepted
    with pytest.raises(ValueError, match="verify='beam'"):
        ReferenceDecoder(target, draft, [2], verify="beam")
    with pytest.raises(ValueError, match="tree_budget >= 2"):
        ReferenceDecoder(target, None, [2], verify="tree")


def test_reference_tree_sampling_is_seeded(stories_dir):
    from dspine.reference import ReferenceDecoder
    from dspine.sampling import SamplingParams
    from dspine.target import load_target
    from tests.helpers import random_draft

    target = load_target(str(stories_dir), dtype="fp32")
    dec = ReferenceDecoder(
        target, random_draft(target, block_size=8, mask=0), [2], verify="tree", tree_budget=12
    )
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, max_new_tokens=30, seed=7)
    a, b = dec.generate([[1], [1, 403]], p), dec.generate([[1], [1, 403]], p)
    assert a.token_ids == b.token_ids and all(len(t) == 30 for t in a.token_ids)
