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
