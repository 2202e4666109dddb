"""The planner AR step's deferred-features kernel (``dspine.ops.defer``): the Triton path against the torch path
and against hand-set values, with idle rows, a row at the bound F, odd widths over several BLOCK tiles and a
strided feature view (the engine passes ``feats[:, 0]`` of ``[B, 1, k·H]``); bad inputs raise."""

import tests.kernel_env as env  # noqa: I001  (must precede the kernel imports)

import pytest
import torch

from dspine.ops.defer import BLOCK, defer_features

CPU = pytest.param("cpu", marks=pytest.mark.skipif(not env.TRITON_CPU, reason=str(env.TRITON_CPU_SKIP)))
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not env.HAS_CUDA, reason="no CUDA")])


def _state(B, F, D, device, dtype, gen):
    feats = torch.randn(B, 3, D, generator=gen).to(dtype)[:, 1]  # a strided row view, as the engine's
    done = torch.tensor([0, 1, 0, 0, 1, 0, 0][:B], dtype=torch.int32)
    count = torch.tensor([0, 2, F, F - 1, 0, 1, 3][:B], dtype=torch.int32).clamp(max=F)
    lengths = torch.tensor([5, 9, 40, 7, 0, 12, 3][:B], dtype=torch.int32)
    pend = torch.randn(B * F + 1, D, generator=gen).to(dtype)
    return [t.to(device) for t in (feats, done, pend, count, lengths)]


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("B,F,D", [(1, 1, 3), (4, 4, 17), (7, 4, BLOCK + 5), (6, 16, 2 * BLOCK)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_defer_features_kernel_is_the_torch_path(device, B, F, D, dtype):
    g = torch.Generator().manual_seed(B * 100 + D)
    feats, done, pend, count, lengths = _state(B, F, D, device, dtype, g)
    want = [t.clone() for t in (pend, count, lengths)]
    defer_features(feats, done, *want[:2], want[2], F, impl="torch")
    before = pend.clone()
    defer_features(feats, done, pend, count, lengths, F, impl="triton")
    assert torch.equal(pend[:-1], want[0][:-1])  # the scratch row is the torch path's, not part of the result
    assert torch.equal(count, want[1]) and torch.equal(lengths, want[2])
    # hand-checked: live rows below F took their features at b·F + count and advanced by one
    c0, l0 = _state(B, F, D, "cpu", dtype, torch.Generator().manual_seed(B * 100 + D))[3:]
    for b in range(B):
        live = int(done[b]) == 0
        assert int(count[b]) == int(c0[b]) + live and int(lengths[b]) == int(l0[b]) + live
        for t in range(F):
            row = b * F + t
            if live and t == int(c0[b]):
                assert torch.equal(pend[row], feats[b]), (b, t)
            else:
                assert torch.equal(pend[row], before[row]), (b, t)


def test_defer_features_rejects_bad_shapes():
    feats, done, pend, count, lengths = _state(4, 4, 8, "cpu", torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"pend_feats \[B·F \+ 1, D\]"):
        defer_features(feats, done, pend[:-1], count, lengths, 4, impl="torch")
    with pytest.raises(ValueError, match="lengths must be"):
        defer_features(feats, done, pend, count, lengths[:3], 4, impl="torch")
    with pytest.raises(ValueError, match="int32"):
        defer_features(feats, done, pend, count.long(), lengths, 4, impl="torch")
    with pytest.raises(ValueError, match="differ"):
        defer_features(feats.double(), done, pend, count, lengths, 4, impl="torch")
