"""silu_mul against PyTorch's ``F.silu(g) * u`` and an fp64 reference, odd sizes, bf16 and fp32.

Two checks: (1) structure — the kernel equals torch's two ops up to the last bits of the fp32 exp
(bf16: one ulp in a small fraction of elements; fp32: a few ulp); (2) accuracy — max error
against fp64 within 2x torch's own error at that dtype, plus a floor.
"""

import tests.kernel_env as env  # noqa: I001  (must precede the kernel imports)

import pytest
import torch
import torch.nn.functional as F

from dspine.ops.silu_mul import silu_mul

CPU = pytest.param("cpu", marks=pytest.mark.skipif(not env.TRITON_CPU, reason=str(env.TRITON_CPU_SKIP)))
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not env.HAS_CUDA, reason="no CUDA")])
FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-3}


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(1, 6), (3, 42), (16, 123), (2, 431), (1, 1100)])
def test_silu_mul_matches_torch(device, dtype, rows, inter):
    g = torch.Generator().manual_seed(rows * 1000 + inter)
    gate_up = (3 * torch.randn(rows, 2 * inter, generator=g)).to(device=device, dtype=dtype)
    got = silu_mul(gate_up, impl="triton")
    gate, up = gate_up.chunk(2, dim=-1)
    torch_out = F.silu(gate) * up
    assert got.shape == (rows, inter) and got.dtype == dtype
    # (1) structure: torch's ops up to the exp's last bits: bf16 one ulp of |out| in a few elements,
    # fp32 a few ulp (silu and the product each round once more on top of the exp's ulp) plus, on CUDA,
    # the fast exp's absolute error near silu's zero (H200: 3.8e-6 at |out| ~ 1e-7)
    ulps, frac = (1, 0.02) if dtype == torch.bfloat16 else (4, 1.0)
    diff = (got.double() - torch_out.double()).abs()
    ulp = torch.finfo(dtype).eps * torch_out.double().abs().clamp_min(torch.finfo(dtype).tiny)
    slack = FLOOR[dtype] * torch_out.double().abs().max() if dtype == torch.float32 and device == "cuda" else 0.0
    assert bool((diff <= ulps * ulp + slack).all()), f"max diff {diff.max().item():.3g}"
    assert (diff > 0).double().mean().item() <= frac
    # (2) accuracy against fp64
    g64, u64 = gate.double(), up.double()
    exact = g64 * torch.sigmoid(g64) * u64
    torch_err = (torch_out.double() - exact).abs().max().item()
    err = (got.double() - exact).abs().max().item()
    assert err <= 2 * torch_err + FLOOR[dtype] * exact.abs().max().item()


def test_silu_mul_reference_is_torch_and_checks_shapes():
    gate_up = torch.randn(2, 3, 10)
    out = torch.empty(2, 3, 5)
    got = silu_mul(gate_up, impl="torch", out=out)
    assert got is out and torch.equal(out, F.silu(gate_up[..., :5]) * gate_up[..., 5:])
    with pytest.raises(ValueError, match="last dim 9"):
        silu_mul(torch.randn(2, 9), impl="torch")
    with pytest.raises(ValueError, match="out must be"):
        silu_mul(gate_up, impl="torch", out=torch.empty(2, 3, 4))
    with pytest.raises(ValueError, match="impl"):
        silu_mul(gate_up, impl="cuda")
