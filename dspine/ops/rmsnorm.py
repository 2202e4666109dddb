"""RMSNorm with an optional fused residual add, numerically shaped like Hugging Face's, and the
shifted variant that feeds DSpine's adjacent injection.

Op: ``r = scale ⊙ x + residual`` (``scale`` optional; the product and the sum each rounded to x's
dtype, as PyTorch's ``residual + scale * x`` in bf16), then
``y = weight · (r / sqrt(mean(r²) + eps))`` with the HF Qwen3/Llama structure: upcast to fp32,
``r · rsqrt(mean(r²) + eps)``, cast to the input dtype, then multiply by weight with the product
rounded to the input dtype. [transformers modeling_qwen3.Qwen3RMSNorm; Zhang & Sennrich 2019]

``shift_rms_norm`` (docs/method.md §3): rows are blocks of ``block_size`` slots back to back; output
row n holds the norm of row n − 1 of the same block and slot 0 of every block holds zeros, i.e.
``y_t = RMSNorm(r_{t−1})`` for t ≥ 1 and ``y_0 = 0`` — the "preceding slot" input of the injection,
in the same single pass that finishes the previous layer's residual add.

Layouts: x [..., H] (leading dims flattened to N rows; last dim contiguous), residual like x,
weight and scale [H]. Returns y (and r with a residual) with x's shape and dtype.
Constraints: H ≤ 65536 (one row per program, whole row in registers); shift: N % block_size == 0.
Memory traffic: reads x (+ residual) and weight, writes y (+ r): 2–4 · N · H · bytes.
Numerics: identical op sequence to HF; the fp32 mean's summation order differs (tree vs
torch's), so a bf16 output can differ from HF's by one ulp in rare elements.
"""

from __future__ import annotations

import torch

from ._common import check_impl, next_pow2, pdl_enter, pdl_kwargs, tl, triton

__all__ = ["rms_norm", "rms_norm_torch", "shift_rms_norm"]


@triton.jit
def _rms_norm_kernel(
    X, R, W, S, Y, ROut, eps,
    stride_x, stride_r, stride_y, stride_ro, H, block_size,
    BLOCK_H: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, SHIFT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    ok = cols < H
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        if HAS_SCALE:
            s = tl.load(S + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) * s.to(tl.float32)).to(X.dtype.element_ty)  # rounded like torch's mul
        res = tl.load(R + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(X.dtype.element_ty)  # rounded like torch's add
        tl.store(ROut + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    normed = (xf * tl.math.rsqrt(var + eps)).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=ok, other=0.0)
    y = (normed.to(tl.float32) * w.to(tl.float32)).to(Y.dtype.element_ty)
    if SHIFT:
        slot = cols * 0 + row % block_size  # block-shaped: triton 3.9's interpreter wants tensor masks
        tl.store(Y + (row + 1) * stride_y + cols, y, mask=ok & (slot < block_size - 1))
        tl.store(Y + row * stride_y + cols, tl.zeros_like(y), mask=ok & (slot == 0))
    else:
        tl.store(Y + row * stride_y + cols, y, mask=ok)


def _rows(x):
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _check(x, weight, residual, scale, residual_out=None):
    H = x.shape[-1]
    if residual_out is not None and (residual is None or residual_out.shape != x.shape
                                     or residual_out.dtype != x.dtype or residual_out.stride(-1) != 1
                                     or not (residual_out.dim() == 2 or residual_out.is_contiguous())):
        raise ValueError(f"residual_out must be given with a residual, with x's shape {tuple(x.shape)} and dtype "
                         f"{x.dtype}, unit last stride and rows one stride apart (2-D, or contiguous), got "
                         f"{tuple(residual_out.shape)} {residual_out.dtype} strides {residual_out.stride()}")
    if weight.shape != (H,) or (scale is not None and scale.shape != (H,)):
        raise ValueError(f"weight and scale must be [{H}], got {tuple(weight.shape)}")
    if scale is not None and residual is None:
        raise ValueError("scale applies to x before the residual add: give a residual")
    if residual is not None and residual.shape != x.shape:
        raise ValueError("residual must have x's shape")


def _launch(x, weight, eps, residual, scale, out, block_size, residual_out=None):
    _check(x, weight, residual, scale, residual_out)
    H = x.shape[-1]
    if H > 65536:
        raise ValueError(f"hidden size {H} > 65536 is not supported")
    x2 = _rows(x)
    N = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    y2 = y.view(-1, H)
    if residual is not None:
        r_in = _rows(residual)
        r_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual_out is None else residual_out
        r2 = r_out.view(-1, H)  # residual_out: 2-D (any row stride) or contiguous (_check), so a view
    else:
        r_in = r2 = x2  # unused
    if N > 0:
        bh = max(16, next_pow2(H))
        warps = 4 if bh <= 2048 else (8 if bh <= 8192 else 16)
        _rms_norm_kernel[(N,)](
            x2, r_in, weight, scale if scale is not None else weight, y2, r2, float(eps),
            x2.stride(0), r_in.stride(0), y2.stride(0), r2.stride(0), H, max(block_size, 1),
            BLOCK_H=bh, HAS_RES=residual is not None, HAS_SCALE=scale is not None, SHIFT=block_size > 0,
            num_warps=warps,
            enable_fp_fusion=False,  # sum of squares as torch: product rounded, then added
            **pdl_kwargs(x.device, N),
        )
    return y if residual is None else (y, r_out)


def rms_norm_torch(x, weight, eps, residual=None, *, out=None, scale=None, residual_out=None):
    """Reference: the HF op sequence, in plain PyTorch."""
    _check(x, weight, residual, scale, residual_out)
    if residual is not None:
        if scale is not None:
            x = (x.float() * scale.float()).to(x.dtype)  # == torch's bf16 mul: one rounding
        x = (x.float() + residual.float()).to(x.dtype)  # == torch's bf16 add: one rounding
        if residual_out is not None:
            x = residual_out.copy_(x)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = (normed.float() * weight.float()).to(x.dtype)
    y = y if out is None else out.copy_(y)
    return y if residual is None else (y, x)


def rms_norm(x, weight, eps, residual=None, impl: str = "triton", *, out=None, scale=None, residual_out=None):
    """RMSNorm of x [..., H] with weight [H]; with ``residual`` returns (y, scale ⊙ x + residual).

    Outputs in x's dtype; ``out`` (y only) may be given for static buffers, and ``residual_out`` (with a
    residual; x's shape and dtype, unit last stride, any row stride) receives the sum, which is then the second
    return value: the engine's target writes a layer's output straight into its column block of the draft
    features ``[N, k·H]`` this way (``infer.model.EngineTarget._layers``). Raises ValueError on shape mismatch or
    a ``scale`` without ``residual``. Numerics: see the module docstring.
    """
    check_impl(impl)
    if impl == "triton":
        return _launch(x, weight, eps, residual, scale, out, 0, residual_out)
    return rms_norm_torch(x, weight, eps, residual, out=out, scale=scale, residual_out=residual_out)


def shift_rms_norm(x, weight, eps, block_size: int, residual=None, impl: str = "triton"):
    """(y, r): r = x + residual (x itself without one); y[n] = RMSNorm(r[n − 1]) inside each block of
    ``block_size`` rows, 0 at slot 0 (module docstring). One launch; raises ValueError on shapes.
    Reference (``impl="torch"``): rms_norm, then each block's rows moved down one slot."""
    check_impl(impl)
    if block_size < 1 or x.reshape(-1, x.shape[-1]).shape[0] % block_size:
        raise ValueError(f"{x.reshape(-1, x.shape[-1]).shape[0]} rows are not whole blocks of {block_size}")
    if impl == "triton":
        out = _launch(x, weight, eps, residual, None, None, block_size)
        return out if residual is not None else (out, x)
    out = rms_norm_torch(x, weight, eps, residual)
    y, r = out if residual is not None else (out, x)
    yb = y.reshape(-1, block_size, y.shape[-1])
    return torch.cat([torch.zeros_like(yb[:, :1]), yb[:, :-1]], dim=1).view(x.shape), r
