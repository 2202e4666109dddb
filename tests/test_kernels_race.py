"""The fused exponential race (``dspine.ops.race``) and the plain-temperature sampling path (issue 11).

* the kernel draws ``sample``'s torch race token for every row (bit for bit on a GPU; on the CPU
  interpreter NumPy's log may differ by an ulp, which no row of these fixed draws turns into
  another token), odd shapes, zeros, ties, a one-hot row;
* ``logits_to_probs`` without top-k / top-p (no sort) equals the sorted reference up to fp32
  rounding of the softmax sum, and ``sample`` draws the same tokens from both.
"""

import tests.kernel_env as env  # noqa: I001  (must precede the kernel imports)

import pytest
import torch

from dspine import sampling as rng
from dspine.ops.race import race
from dspine.sampling import logits_to_probs, sample

CPU = pytest.param("cpu", marks=pytest.mark.skipif(not env.TRITON_CPU, reason=str(env.TRITON_CPU_SKIP)))
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not env.HAS_CUDA, reason="no CUDA")])


def _probs(R, V, gen, device):
    p = torch.softmax(3 * torch.randn(R, V, generator=gen), -1)
    p[0] = 0.0
    p[0, V // 2] = 1.0  # one-hot: that token, whatever the noise
    if R > 2:
        p[1, : V // 3] = 0.0  # zeros never win
        p[1] /= p[1].sum()
        p[2] = 1.0 / V  # all equal: the noise decides
    return p.to(device)


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("R,V", [(1, 6), (5, 123), (7, 1100), (3, 2049)])
def test_race_kernel_is_the_torch_race(device, R, V):
    g = torch.Generator().manual_seed(R * 10000 + V)
    probs = _probs(R, V, g, device)
    seeds = torch.randint(0, 2**62, (R,), generator=g).to(device)
    pos = torch.randint(0, 4000, (R, 1), generator=g).to(device)
    want = sample(probs[:, None], seeds, rng.STREAM_TARGET, pos)[:, 0]  # the torch path
    keys = rng._position_keys(seeds, rng.STREAM_TARGET, pos)[:, 0]
    got = race(probs, keys, impl="triton")
    assert got.dtype == torch.int64 and got.shape == (R,)
    assert torch.equal(got, want)
    assert torch.equal(race(probs, keys, impl="torch"), want)
    assert int(got[0]) == V // 2
    if R > 2:
        assert int(got[1]) >= V // 3
    # through sample(impl="triton"), [B, K, V] and [B, V] layouts
    assert torch.equal(sample(probs[:, None], seeds, rng.STREAM_TARGET, pos, impl="triton")[:, 0], want)
    assert torch.equal(sample(probs, seeds, rng.STREAM_TARGET, pos[:, 0], impl="triton"), want)


@pytest.mark.gpu
@pytest.mark.skipif(not env.HAS_CUDA, reason="no CUDA")
def test_race_kernel_regeneration_shape_bitwise():
    """SmolLM2's vocabulary at 512 rows, many positions: every token equal."""
    g = torch.Generator().manual_seed(0)
    R, V = 512, 49152
    probs = torch.softmax(torch.randn(R, V, generator=g) / 0.8, -1).cuda()
    seeds = torch.randint(0, 2**62, (R,), generator=g).cuda()
    for step in range(8):
        pos = torch.full((R,), step, device="cuda")
        assert torch.equal(sample(probs, seeds, rng.STREAM_TARGET, pos, impl="triton"),
                           sample(probs, seeds, rng.STREAM_TARGET, pos))


def test_race_rejects_bad_input():
    with pytest.raises(ValueError, match="probs"):
        race(torch.zeros(2, 5, dtype=torch.float64), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="keys"):
        race(torch.zeros(2, 5), torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("top_k", [0, 500])
def test_plain_temperature_skips_the_sort(top_k, monkeypatch):
    g = torch.Generator().manual_seed(1)
    logits = 4 * torch.randn(64, 3, 500, generator=g)
    logits[0, 0, :10] = 7.0  # tied scores
    fast, ids = logits_to_probs(logits, 0.8, 1.0, top_k, with_ids=True)
    assert ids is None
    monkeypatch.setattr(rng, "PLAIN_FAST", False)
    ref = logits_to_probs(logits, 0.8, 1.0, top_k)
    # same values up to the softmax's rounding (its sum's order; on the CPU the vectorised exp's lanes):
    # a few fp32 ulp (measured: at most 5)
    assert bool(((fast - ref).abs() <= 8 * 2.0**-23 * ref).all())
    assert torch.allclose(fast.sum(-1), torch.ones(64, 3), atol=1e-5)
    seeds = torch.randint(0, 2**62, (64,), generator=g)
    pos = torch.arange(3)[None].expand(64, 3) + 11
    assert torch.equal(sample(fast, seeds, rng.STREAM_DRAFT, pos), sample(ref, seeds, rng.STREAM_DRAFT, pos))
