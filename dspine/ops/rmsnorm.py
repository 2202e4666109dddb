"""RMSNorm with an optional fused residual add, numerically shaped like Hugging Face's.

Op: ``r = x + residual`` (rounded to x's dtype, as PyTorch's ``residual + x`` in bf16), then
``y = weight · (r / sqrt(mean(r²) + eps))`` with the HF Qwen3/Llama structure: upcast to fp32,
``r · rsqrt(mean(r²) + eps)``, cast to the input dtype, then multiply by weight with the product
rounded to the input dtype. [transformers modeling_qwen3.Qwen3RMSNorm; Zhang & Sennrich 2019]

Layouts: x [..., H] (leading dims flattened to N rows; last dim contiguous), residual like x,
weight [H]. Returns y (and r with a residual) with x's shape and dtype.
Constraints: H ≤ 65536 (one row per program, whole row in registers).
Memory traffic: reads x (+ residual) and weight, writes y (+ r): 2–4 · N · H · bytes.
Numerics: identical op sequence to HF; the fp32 mean's summation order differs (tree vs
torch's), so a bf16 output can differ from HF's by one ulp in rare elements.
"""

from __future__ import annotations

import torch

from ._common import check_impl, next_pow2, tl, triton

__all__ = ["rms_norm", "rms_norm_torch"]


@triton.jit
def _rms_norm_kernel(
    X, R, W, Y, ROut, eps,
    stride_x, stride_r, stride_y, stride_ro, H,
    BLOCK_H: tl.constexpr, HAS_RES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        res = tl.load(R + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(X.dtype.element_ty)  # rounded like torch's add
        tl.store(ROut + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    normed = (xf * tl.math.rsqrt(var + eps)).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=ok, other=0.0)
    y = (normed.to(tl.float32) * w.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + row * stride_y + cols, y, mask=ok)


def _rows(x):
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm_triton(x, weight, eps, residual=None, *, out=None):
    H = x.shape[-1]
    if weight.shape != (H,):
        raise ValueError(f"weight must be [{H}], got {tuple(weight.shape)}")
    if H > 65536:
        raise ValueError(f"hidden size {H} > 65536 is not supported")
    x2 = _rows(x)
    N = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    y2 = y.view(-1, H)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError("residual must have x's shape")
        r_in = _rows(residual)
        r_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        r2 = r_out.view(-1, H)
    else:
        r_in = r2 = x2  # unused
    if N > 0:
        bh = max(16, next_pow2(H))
        warps = 4 if bh <= 2048 else (8 if bh <= 8192 else 16)
        _rms_norm_kernel[(N,)](
            x2, r_in, weight, y2, r2, float(eps),
            x2.stride(0), r_in.stride(0), y2.stride(0), r2.stride(0), H,
            BLOCK_H=bh, HAS_RES=residual is not None, num_warps=warps,
            enable_fp_fusion=False,  # sum of squares as torch: product rounded, then added
        )
    return y if residual is None else (y, r_out)


def rms_norm_torch(x, weight, eps, residual=None, *, out=None):
    """Reference: the HF op sequence, in plain PyTorch."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)  # == torch's bf16 add: one rounding
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = (normed.float() * weight.float()).to(x.dtype)
    if out is not None:
        out.copy_(y)
        y = out
    return y if residual is None else (y, x)


def rms_norm(x, weight, eps, residual=None, impl: str = "triton", *, out=None):
    """RMSNorm of x [..., H] with weight [H]; with ``residual`` returns (y, x + residual).

    Outputs in x's dtype; ``out`` (y only) may be given for static buffers. Raises ValueError on
    shape mismatch. Numerics: see the module docstring (HF Qwen3RMSNorm structure).
    """
    check_impl(impl)
    fn = rms_norm_triton if impl == "triton" else rms_norm_torch
    return fn(x, weight, eps, residual, out=out)
