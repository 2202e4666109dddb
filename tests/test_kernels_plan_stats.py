"""The planner's per-step bookkeeping in one launch (``dspine.ops.plan_stats``): the chain's confidence equals
``chain_confidence`` within fp32 rounding and the chain's accepted count after a tree step equals
``dspine.tree.chain_accepted`` exactly, on real trees and paths (best first and chain first, every accept depth,
a strided p as the tree builder hands it over, B = 0); bad inputs raise by name."""

import tests.kernel_env as env  # noqa: I001  (must precede the kernel imports)

import pytest
import torch

from dspine.ops.plan_stats import chain_confidence, plan_stats
from dspine.ops.tree_build import build_tree_fused
from dspine.tree import chain_accepted, path_nodes

CPU = pytest.param("cpu", marks=pytest.mark.skipif(not env.TRITON_CPU, reason=str(env.TRITON_CPU_SKIP)))
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not env.HAS_CUDA, reason="no CUDA")])


def _tree_case(B, K, V, N, chain_first, seed, device):
    """A best-first (or chain-first) tree from a random draft and a path to a random node of every row (its depth
    a)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(3 * torch.randn(B, K, V, generator=g), -1).to(device)
    tree = build_tree_fused(torch.arange(B, device=device), q, N, impl="torch", chain_first=chain_first)
    last = torch.randint(0, N, (B,), generator=g).to(device)
    if B > 1:
        last[0] = 0  # the root: a = 0
    if B > 2:  # the deepest chain node: the chain's whole run
        last[1] = torch.where(tree.chain[1], tree.depth[1], -1).argmax()
    a = tree.depth[torch.arange(B, device=device), last].to(torch.int32)
    Kp = min(K, N - 1)
    return tree, path_nodes(tree, last, Kp), a


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("B,K,V,N,chain_first", [(5, 15, 300, 32, False), (4, 15, 300, 16, True), (3, 7, 50, 8, False),
                                                 (2, 1, 20, 2, True), (6, 31, 100, 64, False)])
def test_plan_stats_kernel_is_the_torch_reference(device, B, K, V, N, chain_first):
    for seed in range(3):
        tree, path, a = _tree_case(B, K, V, N, chain_first, seed, device)
        wide = torch.zeros(B, K, 3, device=device)  # strided as the Triton builder's chain_q (a column of [B, K, W])
        wide[..., 0] = tree.chain_q
        p = wide[..., 0]
        state = torch.full((2 * B,), -7, dtype=torch.int32, device=device)  # views as in the engine's state buffer
        conf, acc = state[:B].view(torch.float32), state[B:]
        plan_stats(p, conf, tree.chain, path, a, acc, impl="triton")
        want_acc = chain_accepted(tree.chain, path, a)
        assert torch.equal(acc, want_acc), (acc, want_acc)
        torch.testing.assert_close(conf, chain_confidence(p), rtol=2e-6, atol=0)
        ref_conf, ref_acc = torch.zeros(B, device=device), torch.zeros(B, dtype=torch.int32, device=device)
        plan_stats(p, ref_conf, tree.chain, path, a, ref_acc, impl="torch")
        assert torch.equal(ref_acc, want_acc) and torch.equal(ref_conf, chain_confidence(p))
        if B > 2:  # the root's path: nothing accepted; the chain's deepest node: all its chain nodes
            assert int(acc[0]) == 0 and int(acc[1]) == int(tree.depth[1][tree.chain[1]].max())
        # the chain step: conf only, the other half of the state untouched
        before = acc.clone()
        conf.zero_()
        plan_stats(p.contiguous(), conf, impl="triton")
        torch.testing.assert_close(conf, chain_confidence(p), rtol=2e-6, atol=0)
        assert torch.equal(acc, before)


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_plan_stats_reads_and_writes_through_any_strides(device):
    """Strided chain, path, num_accepted, conf and chain_acc (every other element of a larger tensor): the same
    values as the torch reference, and the elements between the written ones untouched (fresh-clone review: the
    first kernel took unit strides for all but p and the path's rows, and wrote over the neighbours)."""
    B, K, V, N = 5, 7, 60, 16
    tree, path, a = _tree_case(B, K, V, N, False, 11, device)
    g = torch.Generator().manual_seed(1)
    wide_chain = torch.zeros(B, 2 * N, dtype=torch.bool, device=device)
    wide_chain[:, ::2] = tree.chain
    wide_chain[:, 1::2] = torch.rand(B, N, generator=g).to(device) < 0.5  # noise between the real flags
    chain = wide_chain[:, ::2]
    wide_path = torch.full((B, path.shape[1], 3), 99, dtype=torch.int64, device=device)
    wide_path[..., 1] = path
    wide_a = torch.full((B, 2), 50, dtype=torch.int64, device=device)
    wide_a[:, 0] = a
    p = torch.rand(B, 2 * K, generator=g).to(device)[:, ::2]
    conf_buf = torch.full((2 * B,), -3.0, device=device)
    acc_buf = torch.full((3 * B,), -5, dtype=torch.int32, device=device)
    conf, acc = conf_buf[::2], acc_buf[1::3]
    plan_stats(p, conf, chain, wide_path[..., 1], wide_a[:, 0], acc, impl="triton")
    assert torch.equal(acc, chain_accepted(tree.chain, path, a))
    torch.testing.assert_close(conf, chain_confidence(p), rtol=2e-6, atol=0)
    assert (conf_buf[1::2] == -3.0).all() and (acc_buf[0::3] == -5).all() and (acc_buf[2::3] == -5).all()


@pytest.mark.parametrize("device", [CPU])
def test_plan_stats_edge_values_and_errors(device):
    p = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.5, 0.5, 0.5]], device=device)
    conf = torch.zeros(3, device=device)
    plan_stats(p, conf, impl="triton")
    assert conf.tolist() == [4.0, 1.0, 1.875]  # 1 + 3; 1 + 0; 1 + 0.5 + 0.25 + 0.125
    plan_stats(torch.zeros(0, 4, device=device), torch.zeros(0, device=device), impl="triton")  # B = 0: nothing
    with pytest.raises(ValueError, match="p \\[B, K\\] fp32"):
        plan_stats(p.double(), conf)
    with pytest.raises(ValueError, match="go together"):
        plan_stats(p, conf, chain=torch.zeros(3, 4, dtype=torch.bool))
    chain, path = torch.zeros(3, 4, dtype=torch.bool), torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="chain must be"):  # chain_acc int64
        plan_stats(p, conf, chain, path, torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_accepted \\[B\\] int32 or int64.*num_accepted torch.float32"):
        plan_stats(p, conf, chain, path, torch.zeros(3), torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("B,K,V,N,sizes", [(5, 15, 300, 32, (16,)), (4, 15, 300, 64, (16, 32)), (3, 7, 50, 16, (2, 8)),
                                           (6, 31, 100, 64, (8, 16, 32, 48))])
def test_the_inner_trees_in_the_same_launch_are_inner_accepted(device, B, K, V, N, sizes):
    """The planner's smaller trees inside a tree step (``rank``, ``sizes``, ``inner_acc``): the Triton kernel writes
    exactly ``dspine.tree.inner_accepted``'s counts into a strided ``[S, B]`` view of a state buffer (as the engine's
    ``_Slots.inner_acc``), with int32 and int64 sizes, leaves the rest of the buffer alone, and the chain's count and
    confidence are unchanged by the extra outputs; the torch path writes the same."""
    from dspine.tree import inner_accepted

    for seed, dtype in ((0, torch.int64), (1, torch.int32), (2, torch.int64)):
        tree, path, a = _tree_case(B, K, V, N, seed % 2 == 1, seed, device)
        S = len(sizes)
        want = inner_accepted(tree.rank, path, a, list(sizes)).T  # [S, B]
        # the state buffer's layout: conf [B] | chain_acc [B] | inner [S, B], plus one spare row never written
        state = torch.full(((3 + S) * B,), -9, dtype=torch.int32, device=device)
        conf, acc = state[:B].view(torch.float32), state[B: 2 * B]
        inner = state[2 * B: (2 + S) * B].view(S, B)
        p = tree.chain_q.contiguous()
        size_t = torch.tensor(sizes, dtype=dtype, device=device)
        plan_stats(p, conf, tree.chain, path, a, acc, impl="triton", rank=tree.rank, sizes=size_t, inner_acc=inner)
        assert torch.equal(inner, want.to(torch.int32)), (inner, want)
        assert torch.equal(acc, chain_accepted(tree.chain, path, a))
        torch.testing.assert_close(conf, chain_confidence(p), rtol=2e-6, atol=0)
        assert (state[(2 + S) * B:] == -9).all()
        if B > 1:  # the root's path: nothing accepted in any tree
            assert inner[:, 0].tolist() == [0] * S
        ref = torch.zeros(S, B, dtype=torch.int32, device=device)
        plan_stats(p, torch.zeros(B, device=device), tree.chain, path, a, torch.zeros(B, dtype=torch.int32, device=device),
                   impl="torch", rank=tree.rank, sizes=size_t, inner_acc=ref)
        assert torch.equal(ref, want.to(torch.int32))
        # the count is monotone in the size and never above the path's depth
        assert (inner[1:] >= inner[:-1]).all() and (inner <= a[None, :].to(torch.int32)).all()


@pytest.mark.parametrize("device", [CPU])
def test_the_inner_trees_refuse_a_partial_set(device):
    B, K, V, N = 3, 7, 50, 16
    tree, path, a = _tree_case(B, K, V, N, False, 0, device)
    p, conf, acc = tree.chain_q.contiguous(), torch.zeros(B), torch.zeros(B, dtype=torch.int32)
    sizes, inner = torch.tensor([8]), torch.zeros(1, B, dtype=torch.int32)
    with pytest.raises(ValueError, match="rank, sizes and inner_acc go together"):
        plan_stats(p, conf, tree.chain, path, a, acc, rank=tree.rank, sizes=sizes)
    with pytest.raises(ValueError, match="need the tree step's chain"):
        plan_stats(p, conf, rank=tree.rank, sizes=sizes, inner_acc=inner)
    with pytest.raises(ValueError, match=r"inner_acc \[S, B=3\] int32; got rank"):
        plan_stats(p, conf, tree.chain, path, a, acc, rank=tree.rank, sizes=sizes, inner_acc=torch.zeros(2, B, dtype=torch.int32))
    with pytest.raises(ValueError, match="rank must be int64"):
        plan_stats(p, conf, tree.chain, path, a, acc, rank=tree.rank.int(), sizes=sizes, inner_acc=inner)
    # no inner tree (the smallest planner tree's step): an empty set writes nothing and raises nothing
    empty = torch.zeros(0, B, dtype=torch.int32)
    for impl in ("torch", "triton"):
        plan_stats(p, conf, tree.chain, path, a, acc, impl=impl, rank=tree.rank, sizes=torch.zeros(0, dtype=torch.int64),
                   inner_acc=empty)
