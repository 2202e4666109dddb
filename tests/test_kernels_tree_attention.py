"""tree_attention (torch reference and Triton kernel) against an fp64 softmax over prefix + ancestors."""

import tests.kernel_env  # noqa: F401,I001  (must precede the kernel imports)

import pytest
import torch

from dspine.ops.tree_attention import tree_attention
from dspine.ops.verify_attention import verify_attention
from dspine.tree import ancestor_bits, ancestor_mask
from tests.test_kernels_attention import CPU, CUDA, check_budget

CASES = [
    # B, T nodes, Hq, Hkv, D, cache lengths, dtype
    (3, 9, 4, 2, 16, [0, 5, 40], torch.float32),
    (2, 16, 4, 1, 32, [7, 70], torch.bfloat16),
    (1, 64, 2, 1, 16, [3], torch.float32),  # 64 nodes: every bit of the mask
]


def make_tree(B, T, Hq, Hkv, D, lens, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = max(lens) + T + 5
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    cache_len = torch.tensor(lens, dtype=torch.int32)
    parent = torch.tensor(
        [[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)] for _ in range(B)]
    )
    j = torch.arange(S)
    unwritten = j[None, :] >= (cache_len[:, None] + T)
    k[unwritten[:, None, :, None].expand_as(k)] = float("nan")  # stale rows must never be read
    v[unwritten[:, None, :, None].expand_as(v)] = float("nan")
    anc = ancestor_mask(parent)  # [B, T, T]
    node = j[None, :] - cache_len[:, None].long()
    vis = (node[:, None, :] < 0) | anc.gather(2, node.clamp(0, T - 1)[:, None, :].expand(B, T, S)) & (
        node[:, None, :] < T
    )
    return [x.to(device) for x in (q, k, v, cache_len, ancestor_bits(anc))], vis.to(device)


IMPLS = [
    ("torch", "cpu"),
    pytest.param("triton", "cpu", marks=CPU.marks),
    pytest.param("triton", "cuda", marks=CUDA.marks),
]


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}G{c[2] // c[3]}D{c[4]}{str(c[6])[6:]}")
def test_tree_attention(case, impl, device):
    (q, k, v, cache_len, bits), vis = make_tree(*case, device)
    scale = case[4] ** -0.5
    for splits in (None, 2) if impl == "triton" else (None,):
        out = torch.full_like(q, float("nan"))
        tree_attention(q, k, v, cache_len, bits, scale, impl=impl, out=out, num_splits=splits)
        check_budget(out, q, k, v, vis, scale)


def test_chain_tree_is_verify_attention():
    (q, k, v, cache_len, _), _ = make_tree(2, 6, 4, 2, 16, [3, 11], torch.float32, "cpu")
    chain = (torch.ones(6, dtype=torch.long) << torch.arange(1, 7)) - 1  # node t sees nodes 0..t
    out = tree_attention(q, k, v, cache_len, chain.expand(2, 6).contiguous(), 0.25, impl="torch")
    torch.testing.assert_close(out, verify_attention(q, k, v, cache_len, 0.25, impl="torch"), rtol=0, atol=0)
    with pytest.raises(ValueError, match="int64"):
        tree_attention(q, k, v, cache_len, chain.int().expand(2, 6), 0.25, impl="torch")


def _path_cache(k, v, cache_len, b, path_slots):
    """Row b's cache with its positions after the prefix holding ``path_slots`` (node indices in depth order),
    as the AR decode of that path had it."""
    clen = int(cache_len[b])
    k1, v1 = k[b : b + 1].clone(), v[b : b + 1].clone()
    src = clen + torch.as_tensor(path_slots, device=k.device)
    k1[:, :, clen : clen + len(path_slots)] = k[b : b + 1, :, src]
    v1[:, :, clen : clen + len(path_slots)] = v[b : b + 1, :, src]
    return k1, v1


EXACT_IMPLS = [
    "torch",
    pytest.param("triton", marks=CPU.marks),
]


@pytest.mark.parametrize("impl", EXACT_IMPLS)
@pytest.mark.parametrize("T, lens", [(12, [250, 0, 505]), (30, [60, 130, 0])], ids=["T12", "T30"])
def test_tree_attention_exact_is_the_one_token_step_of_its_path(impl, T, lens):
    """Exact mode: every node's bits equal verify_attention(exact=True) of the same query as a 1-token step at
    position prefix + depth over a cache holding its path in depth order; S = 530 gives three 256-key splits and
    the lengths put paths across the first split edge (250 + depth), across the second with the first tree tile in
    split 1 (505 + depth), across a 64-key tile edge (60 + depth) and at the start (0); T = 30 nodes of G = 3 rows fill two 64-row tiles, node 21 in both.
    Nodes in random order (a child may precede its parent) and stale rows poisoned."""
    from dspine.ops.tree_attention import tree_paths

    g = torch.Generator().manual_seed(3)
    B, Hkv, G, D, S = 3, 2, 3, 32, 530
    dt = torch.bfloat16
    lens = torch.tensor(lens, dtype=torch.int32)
    parent = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):  # a random tree, then its nodes shuffled (root kept first)
        par = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)]
        perm = [0] + (torch.randperm(T - 1, generator=g) + 1).tolist()  # new index of old node i: perm.index(i)
        new = {old: n for n, old in enumerate(perm)}
        parent[b] = torch.tensor([-1 if par[old] < 0 else new[par[old]] for old in perm])
    anc = torch.zeros(B, T, T, dtype=torch.bool)
    depth = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        for t in range(T):
            n = t
            while n >= 0:
                anc[b, t, n] = True
                n = int(parent[b, n])
            depth[b, t] = int(anc[b, t].sum()) - 1
    bits = ancestor_bits(anc)
    q = torch.randn(B, T, Hkv * G, D, generator=g).to(dt)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dt)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dt)
    stale = torch.arange(S)[None, :] >= (lens[:, None] + T)
    k[stale[:, None, :, None].expand_as(k)] = float("nan")
    v[stale[:, None, :, None].expand_as(v)] = float("nan")
    path = tree_paths(bits, depth)
    out = tree_attention(q, k, v, lens, bits, D**-0.5, impl=impl, exact=True, depth=depth)
    same = tree_attention(q, k, v, lens, bits, D**-0.5, impl=impl, exact=True, depth=depth, path=path)
    assert torch.equal(out.view(torch.int16), same.view(torch.int16))
    checked = [(0, t) for t in range(T)] + [(1, 0), (1, T - 1), (2, 0), (2, 5)] + ([(1, 21), (2, 21)] if T > 21 else [])
    for b, t in checked:
        slots = path[b, t, : int(depth[b, t]) + 1].tolist()
        assert slots[-1] == t and all(anc[b, t, n] for n in slots)  # the path ends at the node itself
        k1, v1 = _path_cache(k, v, lens, b, slots)
        one = verify_attention(q[b : b + 1, t : t + 1].contiguous(), k1, v1, lens[b : b + 1] + int(depth[b, t]),
                               D**-0.5, impl=impl, exact=True)  # fmt: skip
        assert torch.equal(one[0, 0].view(torch.int16), out[b, t].view(torch.int16)), (b, t)
    # the same op as the fast tree attention, up to rounding
    fast = tree_attention(q, k, v, lens, bits, D**-0.5, impl="torch")
    assert (fast.float() - out.float()).abs().max().item() <= 2**-6
    with pytest.raises(ValueError, match="depth"):
        tree_attention(q, k, v, lens, bits, D**-0.5, impl=impl, exact=True)
    with pytest.raises(ValueError, match="int32"):
        tree_attention(q, k, v, lens, bits, D**-0.5, impl=impl, exact=True, depth=depth, path=path.long())
    with pytest.raises(ValueError, match="int32/int64"):
        tree_attention(q, k, v, lens, bits, D**-0.5, impl=impl, exact=True, depth=depth.float())
    strided = torch.zeros(B, 2 * T, dtype=torch.long)[:, ::2]  # non-contiguous depth and path give the same bits
    strided.copy_(depth)
    path_t = path.transpose(1, 2).contiguous().transpose(1, 2)
    again = tree_attention(q, k, v, lens, bits, D**-0.5, impl=impl, exact=True, depth=strided, path=path_t)
    assert torch.equal(again.view(torch.int16), out.view(torch.int16))


@pytest.mark.parametrize("device", [CPU])
def test_tree_attention_exact_refuses_more_heads_than_a_tile(device):
    """The Triton exact path's per-node programs hold one 64-row tile (bf16): 66 query heads per kv head are refused
    rather than left uncomputed."""
    q = torch.randn(1, 2, 66, 16).bfloat16()
    k = v = torch.randn(1, 1, 8, 16).bfloat16()
    bits, depth = torch.tensor([[1, 3]]), torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="66 query heads per kv head"):
        tree_attention(q, k, v, torch.tensor([4], dtype=torch.int32), bits, 0.25, impl="triton", exact=True,
                       depth=depth)  # fmt: skip


@pytest.mark.parametrize("device", [CPU])
def test_bench_tree_exact_tiny(tmp_path, device):
    """benchmarks/kernels/bench_tree_exact.py --tiny: every row's exact nodes are the 1-token steps of their paths."""
    import json

    from benchmarks.kernels import bench_tree_exact

    out = tmp_path / "t.json"
    assert bench_tree_exact.main(["--tiny", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["heads"], r["B"], r["T"]) for r in rows] == [(h, b, 6) for h in ("smollm2", "qwen3-8b") for b in (1, 2)]
    assert all(r["equal"] and r["exact_us"] > 0 and r["fast_us"] > 0 for r in rows)
