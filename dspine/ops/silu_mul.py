"""SwiGLU activation of a fused gate/up projection: ``out = silu(gate) · up`` in one launch.

Op: ``gate, up = gate_up.chunk(2, -1)``; ``out = silu(gate) * up`` with PyTorch's numerics in the
input dtype: silu computed in fp32 (``g / (1 + exp(−g))``) and rounded to the dtype, then the
product computed in fp32 and rounded — the two launches of ``F.silu(g) * u`` in bf16
[transformers Qwen3MLP / LlamaMLP; Shazeer 2020, GLU variants].

Layouts: gate_up [..., 2I] (last dim contiguous; leading dims flattened to N rows), gate first.
Returns out [..., I] in gate_up's dtype (into ``out`` if given). Grid: (N, cdiv(I, BLOCK)).
Memory traffic: reads 2·N·I, writes N·I elements (the unfused pair writes silu(g) and reads it
back: 5·N·I). Numerics: the exp differs from torch's by an ulp in fp32; bf16 results match
torch's except at rare rounding ties.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import pdl_enter, pdl_kwargs, pick_impl, tl, triton

__all__ = ["silu_mul", "silu_mul_torch"]

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(GU, Out, stride_gu, stride_out, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(GU + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + inter + cols, mask=ok, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype)  # rounded like torch's silu output
    y = s.to(tl.float32) * u.to(tl.float32)
    tl.store(Out + row * stride_out + cols, y.to(Out.dtype.element_ty), mask=ok)


def _check(gate_up, out):
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim {gate_up.shape[-1]} is not 2·I (gate and up halves)")
    want = (*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    if out is not None and tuple(out.shape) != want:
        raise ValueError(f"out must be {want}, got {tuple(out.shape)}")
    return want


def silu_mul_triton(gate_up, *, out=None):
    shape = _check(gate_up, out)
    inter = shape[-1]
    gu = gate_up.reshape(-1, 2 * inter)
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    y = torch.empty(shape, device=gate_up.device, dtype=gate_up.dtype) if out is None else out
    y2 = y.view(-1, inter)
    if gu.shape[0] > 0 and inter > 0:
        _silu_mul_kernel[(gu.shape[0], triton.cdiv(inter, BLOCK))](
            gu, y2, gu.stride(0), y2.stride(0), inter, BLOCK=BLOCK, num_warps=4, **pdl_kwargs(gu.device, gu.shape[0]),
        )
    return y


def silu_mul_torch(gate_up, *, out=None):
    """Reference: ``F.silu(gate) * up``, PyTorch's own two ops."""
    _check(gate_up, out)
    g, u = gate_up.chunk(2, dim=-1)
    y = F.silu(g) * u
    return y if out is None else out.copy_(y)


def silu_mul(gate_up, impl: str = "triton", *, out=None):
    """``silu(gate) * up`` of ``gate_up [..., 2I]`` -> ``[..., I]`` in its dtype (module docstring).

    Raises ValueError on an odd last dim or a wrongly shaped ``out``."""
    fn = pick_impl(impl, silu_mul_triton, silu_mul_torch)
    return fn(gate_up, out=out)
