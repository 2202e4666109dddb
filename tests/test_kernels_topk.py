"""The sampling cut's top-k kernel (``dspine.ops.topk``): the ids of the k largest ``fp32(x) · fp32(1/T)`` in
sampling order (higher score first, the lower id among equal scores), against the torch path (``topk`` over the
int64 order keys) and against a plain Python sort, on ties inside and across chunks (bf16 rounding, a constant
row, ties at the k-th score), -0.0 against +0.0, -inf entries, V below, at and above one chunk, k = 1 and k = V;
``logits_to_probs`` gives the same ids and probabilities with either path; bad inputs raise."""

import tests.kernel_env as env  # noqa: I001  (must precede the kernel imports)

import re

import pytest
import torch

from dspine.ops import topk as topk_mod
from dspine.ops.topk import inv_temperature, topk_ids
from dspine.sampling import logits_to_probs

CPU = pytest.param("cpu", marks=pytest.mark.skipif(not env.TRITON_CPU, reason=str(env.TRITON_CPU_SKIP)))
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not env.HAS_CUDA, reason="no CUDA")])
CHUNK = topk_mod.CHUNK


def hard_rows(R: int, V: int, k: int, seed: int, dtype) -> torch.Tensor:
    """Random rows plus: a row rounded to halves (many ties, some at the k-th score), a constant row, a row with
    -0.0 and +0.0 at its top, a row of -inf but for three entries, and a row whose k-th score is shared by tokens
    in several chunks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, V, generator=g) * 3
    x[0] = torch.round(x[0] * 2) / 2
    if R > 1:
        x[1] = 0.25
    if R > 2:
        x[2] = -1.0
        x[2, torch.randperm(V, generator=g)[: min(V, 4)]] = 0.0
        x[2, torch.randperm(V, generator=g)[: min(V, 4)]] = -0.0
    if R > 3:
        x[3] = float("-inf")
        x[3, torch.randperm(V, generator=g)[: min(V, 3)]] = torch.tensor([1.0, 2.0, 0.5])[: min(V, 3)]
    if R > 4:
        kth = x[4].topk(k).values[-1]
        x[4, torch.randperm(V, generator=g)[: min(V, 7)]] = kth  # more tokens at the k-th score, spread over V
    return x.to(dtype)


def python_topk(x: torch.Tensor, T: float, k: int) -> list[list[int]]:
    """Sampling order by a plain sort: score fp32(x) * fp32(1/T) descending, -0.0 equal to +0.0, then id."""
    s = (x.float() * inv_temperature(T)).tolist()
    return [sorted(range(len(row)), key=lambda i, row=row: (-row[i], i))[:k] for row in s]


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("V,k", [(1, 1), (7, 7), (100, 5), (CHUNK, 20), (CHUNK + 3, 1), (3 * CHUNK - 5, 20),
                                 (4100, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_kernel_is_the_torch_path(device, V, k, dtype):
    x = hard_rows(6, V, k, V + k, dtype)
    for T in (1.0, 0.7, 2.3):
        got = topk_ids(x.to(device), T, k, impl="triton")
        want = topk_ids(x, T, k, impl="torch")
        assert got.dtype == torch.int64 and got.shape == (6, k)
        assert torch.equal(got.cpu(), want)
        assert want.tolist() == python_topk(x, T, k)


def test_topk_kernel_ties_and_signed_zero():
    """The cases by hand: equal scores go to the lower id (also across chunks), -0.0 ties with +0.0."""
    V = 2 * CHUNK + 10
    x = torch.full((3, V), -5.0)
    x[0, [CHUNK + 4, 3, 2 * CHUNK + 1, 9]] = 1.0  # four equal maxima in three chunks
    x[1, [CHUNK + 1, 5]] = -0.0
    x[1, [7, 2 * CHUNK]] = 0.0  # -0.0 and +0.0 tie: ids in order
    x[2, 11] = float("inf")
    x[2, 12] = float("-inf")
    got = topk_ids(x, 1.0, 4, impl="triton" if env.TRITON_CPU else "torch")
    assert got.tolist() == [[3, 9, CHUNK + 4, 2 * CHUNK + 1], [5, 7, CHUNK + 1, 2 * CHUNK], [11, 0, 1, 2]]


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("top_p", [0.9, 1.0])
def test_logits_to_probs_kernel_path_equals_torch_path(device, top_p):
    """[B, K, V] logits as the engine passes them: the same ids and the same probabilities, bit for bit (the
    softmax and the top-p cut run on the same k gathered scores)."""
    x = hard_rows(6, 3 * CHUNK + 7, 20, 5, torch.bfloat16).view(2, 3, -1).to(device)
    p, ids = logits_to_probs(x, 0.8, top_p, 20, with_ids=True, impl="triton")
    want_p, want_ids = logits_to_probs(x, 0.8, top_p, 20, with_ids=True, impl="torch")  # same device: same softmax
    assert ids.shape == (2, 3, 20)
    assert torch.equal(ids, want_ids) and torch.equal(p, want_p)
    assert torch.equal((p > 0).sum(-1), (want_p > 0).sum(-1))


def test_inv_temperature_is_the_fp32_reciprocal():
    for T in (1.0, 0.7, 0.3, 2.3, 1e-3):
        inv = inv_temperature(T)
        want = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(T, dtype=torch.float32)
        assert inv == float(want)
    assert inv_temperature(0.5) == 2.0


def test_topk_ids_rejects_bad_inputs():
    for bad in (torch.zeros(()), torch.zeros(3, 0), torch.zeros(2, 4, dtype=torch.int64)):
        with pytest.raises(ValueError, match="topk_ids needs logits"):
            topk_ids(bad, 1.0, 1)
    with pytest.raises(ValueError, match=r"k = 5 outside 1\.\.4"):
        topk_ids(torch.zeros(2, 4), 1.0, 5)
    with pytest.raises(ValueError, match="k = 0 outside"):
        topk_ids(torch.zeros(2, 4), 1.0, 0)
    for T in (0.0, -1.0, float("inf"), float("nan"), 1e-46, 1e-40, 1e39):  # 1e-40: 1/T overflows fp32
        with pytest.raises(ValueError, match=re.escape(f"temperature {T} must be > 0 and finite")):
            topk_ids(torch.zeros(2, 4), T, 1)
    with pytest.raises(ValueError, match="k = True outside"):
        topk_ids(torch.zeros(2, 4), 1.0, True)
    with pytest.raises(ValueError, match="k = 300 > 256"):
        topk_ids(torch.zeros(2, 400), 1.0, 300, impl="triton")
    with pytest.raises(ValueError, match="impl must be"):
        topk_ids(torch.zeros(2, 4), 1.0, 1, impl="cuda")
