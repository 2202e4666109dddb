"""Row-invariant linear layer ``y = x · Wᵀ (+ bias)`` for the engine's exact decode/verify path.

Op: ``y[m, n] = Σ_k x[m, k] · w[n, k] (+ bias[n])``, accumulated in fp32 and rounded once to x's
dtype. **Row invariance** (the point of this op): row m of y is bitwise the same whatever the number
of rows M (1..any) and whatever the other rows hold. cuBLAS does not promise that: it picks a
kernel (tile shape, split-K, gemv vs gemm) from M, so a 16-row verify pass can round a position
differently from a 1-row decode step (issue 13).

Kernel: grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); each program owns a BLOCK_M × BLOCK_N tile of y
and walks K in BLOCK_K tiles, in increasing order, accumulating ``tl.dot`` in fp32. The row tiles
of one column tile are neighbours in launch order, so a weight tile read by several row tiles
can come from L2 after the first (not measured yet). The configuration (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
num_stages) comes from (N, K, dtype, device) only (:func:`config`; ``CONFIG_OVERRIDE`` for
tuning). So for a given weight the compiled kernel and each output element's reduction order
over K are the same for every M; no split-K, no M-dependent choice.
Layouts: x [..., K] (leading dims flattened to M rows; last dim contiguous), w [N, K] contiguous
(nn.Linear's layout), bias [N] or None. Returns y [..., N] in x's dtype.
Memory traffic: W once per row tile (N · K · bytes each; from L2 after the first when the row tiles
run together), x once per column tile, y once.
Numerics: bf16/fp16 inputs use tensor-core products with fp32 accumulation (like cuBLAS, but a
different summation order, so y differs from ``F.linear`` by bf16 rounding); fp32 inputs use
exact (non-TF32) products. A bias is added in fp32 before the single rounding.

Reference (``impl="torch"``): ``F.linear`` one row at a time on a fresh contiguous copy of the row,
so every call has the same shape and alignment and the library picks the same kernel: row
invariant by construction (slow; for tests and the CPU engine).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import check_impl, dot_precision, num_sms, tl, triton

__all__ = ["linear", "linear_torch", "linear_triton", "config", "CONFIG_OVERRIDE"]

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for every shape when set (tuning:
# benchmarks/kernels/bench_linear.py); None = :func:`config`'s choice.
CONFIG_OVERRIDE: tuple[int, int, int, int, int] | None = None


@triton.jit
def _linear_kernel(
    X, W, Bias, Y, M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)  # fastest: the row tiles of one weight tile run together (L2 reuse)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # fixed order: the row's reduction never depends on M
        k = k0 + rk
        k_ok = k < K
        x = tl.load(X + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + rn[None, :] * stride_wn + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PREC)  # w tile [BLOCK_K, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _check(x, w, bias):
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear: x [..., {x.shape[-1]}] and weight {tuple(w.shape)} do not match (want [N, K])")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"linear: bias {tuple(bias.shape)} must be [{w.shape[0]}]")
    if x.dtype != w.dtype:
        raise ValueError(f"linear: x is {x.dtype}, weight is {w.dtype}")


def config(N: int, K: int, dtype: torch.dtype, device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) from the weight's shape only, never from M.

    One row tile up to 64 rows (4 verify blocks of 16 at 8B shape); BLOCK_N 64, or 32 when 64-wide
    tiles would leave streaming multiprocessors idle at one row tile (the memory-bound decode of a
    small N). fp32 (tests, CPU) uses a smaller K tile. Not tuned on a GPU yet: see
    benchmarks/kernels/bench_linear.py.
    """
    del K
    if CONFIG_OVERRIDE is not None:
        return CONFIG_OVERRIDE
    bn = 64 if triton.cdiv(N, 64) >= num_sms(device) else 32
    bk = 32 if dtype == torch.float32 else 128
    return 64, bn, bk, 4, 3


def linear_triton(x, w, bias=None, cfg: tuple[int, int, int, int, int] | None = None):
    _check(x, w, bias)
    N, K = w.shape
    if w.stride(1) != 1 or w.stride(0) != K:
        raise ValueError("linear: weight must be contiguous [N, K]")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return y
    y2 = y.view(M, N)
    bm, bn, bk, warps, stages = cfg or config(N, K, x.dtype, x.device)
    _linear_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x2, w, bias if bias is not None else w, y2, M, N, K,
        x2.stride(0), w.stride(0), y2.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias is not None, PREC=dot_precision(x.dtype),
        num_warps=warps, num_stages=stages,
    )
    return y


def linear_torch(x, w, bias=None):
    """Reference: ``F.linear`` row by row on fresh contiguous copies (row invariant by construction)."""
    _check(x, w, bias)
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.empty(x2.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    for m in range(x2.shape[0]):
        y[m] = F.linear(x2[m : m + 1].clone(), w, bias)[0]
    return y.view(*x.shape[:-1], w.shape[0])


def linear(x, w, bias=None, impl: str = "triton", exact: bool = True):
    """``x [..., K] · w[N, K]ᵀ (+ bias [N])`` -> ``[..., N]`` in x's dtype.

    ``exact=True``: row invariant (module docstring), Triton kernel or the row-by-row reference
    by ``impl``. ``exact=False``: plain ``F.linear`` (cuBLAS / the CPU BLAS), whatever ``impl``.
    Raises ValueError on mismatched shapes or dtypes.
    """
    if not exact:
        return F.linear(x, w, bias)
    check_impl(impl)
    return linear_triton(x, w, bias) if impl == "triton" else linear_torch(x, w, bias)
