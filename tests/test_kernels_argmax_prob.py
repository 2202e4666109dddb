"""The planner's greedy confidence kernel (``dspine.ops.argmax_prob``): the argmax and its softmax probability
in one pass, against the torch path (``argmax`` + fp32 ``softmax().amax``) and a float64 reference, on odd
shapes, ties (the lowest id wins, as ``torch.argmax``), -inf entries, a one-hot row and the bf16 logits the
engine passes; bad inputs raise."""

import tests.kernel_env as env  # noqa: I001  (must precede the kernel imports)

import pytest
import torch

from dspine.ops.argmax_prob import argmax_prob

CPU = pytest.param("cpu", marks=pytest.mark.skipif(not env.TRITON_CPU, reason=str(env.TRITON_CPU_SKIP)))
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not env.HAS_CUDA, reason="no CUDA")])


def _logits(shape, gen, dtype):
    x = 4 * torch.randn(*shape, generator=gen)
    flat = x.view(-1, shape[-1])
    V = shape[-1]
    flat[0, : V // 2] = float("-inf")  # masked entries: never the argmax, zero probability
    if flat.shape[0] > 1:
        flat[1] = 0.0
        flat[1, V - 1] = 1.0 if V > 1 else 0.0
    if flat.shape[0] > 2 and V > 3:  # a tie: the lowest id wins
        flat[2, 1] = flat[2, 3] = flat[2].max() + 1
    if flat.shape[0] > 3:
        flat[3] = -1e4
        flat[3, V // 3] = 0.0  # one-hot after softmax: p = 1
    return x.to(dtype)


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (2, 3, 2049), (4, 4100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_prob_kernel_is_the_torch_path(device, shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = _logits(shape, g, dtype).to(device)
    idx, p = argmax_prob(x, impl="triton")
    want_idx, want_p = argmax_prob(x, impl="torch")
    assert idx.shape == p.shape == shape[:-1] and idx.dtype == torch.int64 and p.dtype == torch.float32
    assert torch.equal(idx, want_idx) and torch.equal(idx, x.argmax(-1))
    exact = torch.softmax(x.double(), -1).amax(-1).float()
    # the kernel within 2e-6 of float64; the torch path's fp32 softmax sums 4100 exps in the CPU's vector order
    # (AVX2: 2.9e-6 off at (4, 4100); ~√V × 2^-24 expected), so 1e-5
    assert torch.allclose(p, exact, rtol=2e-6, atol=0) and torch.allclose(want_p, exact, rtol=1e-5, atol=0)
    flat_i, flat_p = idx.view(-1).cpu(), p.view(-1).cpu()
    V = shape[-1]
    assert flat_i[0] >= V // 2
    if flat_i.numel() > 2 and V > 3:
        assert flat_i[2] == 1
    if flat_i.numel() > 3:
        assert flat_i[3] == V // 3 and flat_p[3] == 1.0


def test_argmax_prob_rejects_bad_inputs():
    for bad in (torch.zeros(()), torch.zeros(3, 0), torch.zeros(2, 4, dtype=torch.int64)):
        with pytest.raises(ValueError, match="argmax_prob needs logits"):
            argmax_prob(bad)
    with pytest.raises(ValueError):
        argmax_prob(torch.zeros(2, 4), impl="cuda")


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_split_vocabulary_equals_one_program_per_row(device, monkeypatch):
    """The vocabulary split over S programs per row and combined (few rows: a greedy chain step at batch 1-8)
    against one program per row (PROGRAMS = 1): the same argmax, with a tie across chunks (the lowest id wins), a
    row whose maximum sits in the last, partial chunk and a row whose first chunk is all -inf; p within fp32
    rounding of each other and of float64."""
    from dspine.ops import argmax_prob as mod

    V = 4 * mod.BLOCK + 37
    g = torch.Generator().manual_seed(3)
    x = 3 * torch.randn(4, V, generator=g)
    x[0, 10] = x[0, 2 * mod.BLOCK + 5] = x[0].max() + 2  # a tie across chunks 0 and 2
    x[1, V - 3] = x[1].max() + 1  # the maximum in the last, partial chunk
    x[2, : mod.BLOCK] = float("-inf")  # an all -inf first chunk
    x = x.to(device)
    split = argmax_prob(x, impl="triton")
    monkeypatch.setattr(mod, "PROGRAMS", 1)
    whole = argmax_prob(x, impl="triton")
    assert split[0].tolist() == whole[0].tolist() == x.argmax(-1).tolist()
    assert split[0][0] == 10 and split[0][1] == V - 3
    exact = torch.softmax(x.double(), -1).amax(-1).float()
    assert torch.allclose(split[1], whole[1], rtol=2e-6, atol=0) and torch.allclose(split[1], exact, rtol=2e-6, atol=0)
