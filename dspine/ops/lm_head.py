"""LM head ``logits = h · Wᵀ`` with an implementation chosen per row count M (issue 12).

Op: ``y[m, n] = Σ_k h[m, k] · w[n, k]``, fp32 accumulation, rounded once to h's dtype; h [..., K]
(leading dims flattened to M rows), w [N, K] contiguous (the vocabulary head, N ≈ 150k), y [..., N].

Why: at Qwen3-8B shape (K 4096, N 151936, W 1.24 GB in bf16) cuBLAS picks, for the M = 128 rows of
a batch-8 verify block, a tile 16 rows wide (``nvjet_sm90_tst_384x16``), so it streams the weight
~8 times: 2.4 ms where one read of W costs ~0.3 ms (H200 profile, benchmarks/engine/profile_step.py).
The candidates below compute the same product with other kernels; :func:`pick` times them on the
device for one M and the engine keeps the fastest per M (``infer.engine.Engine``).

Candidates (:data:`CANDIDATES`), all returning a contiguous [M, N]:
  ``linear``       ``F.linear`` (what the engine did before; cuBLAS picks the kernel from M).
  ``transposed``   ``(W · hᵀ)ᵀ``: the same GEMM posed as [N, K] · [K, M], so the library sees the
                   other orientation and picks another kernel; no copy of W (no extra weight memory),
                   plus one transpose copy of the [M, N] result (M · N · 2 · bytes of traffic: 78 MB
                   at M = 128 in bf16, ~20 µs). A transposed contiguous copy of W would cost another
                   1.24 GB at 8B shape; it is not kept.
  ``chunked8k`` / ``chunked32k``  ``F.linear`` over vocabulary chunks of 8192 / 32768 rows of W,
                   each written into its column slice of y (no concatenation copy): a smaller N per
                   call, for which the library may choose a wider tile along M.
  ``triton64`` / ``triton128``  ``dspine.ops.linear``'s Triton kernel with a tile that covers up to
                   128 rows (BLOCK_M = next power of two of M, 16..128) and 64 / 128 vocabulary
                   columns: W is read once for M <= 128 (once per 128-row tile beyond, the tiles of
                   one weight tile launched together for L2 reuse). Not row invariant (the tile
                   depends on M): exact mode keeps ``dspine.ops.linear`` with its own fixed config.

Numerics: every candidate accumulates in fp32 and rounds once, so they differ from ``F.linear``
by bf16 rounding only (fp32 inputs: fp32 rounding; the Triton kernel uses exact fp32 products).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from ._common import HAS_TRITON, next_pow2
from .linear import linear_triton

__all__ = ["CANDIDATES", "lm_head", "triton_config", "pick", "default_timer"]

CHUNKS = {"chunked8k": 8192, "chunked32k": 32768}
TRITON_BN = {"triton64": 64, "triton128": 128}
CANDIDATES = ("linear", "transposed", *CHUNKS, *TRITON_BN)


def triton_config(M: int, block_n: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for ``block_n`` vocabulary columns: one row
    tile up to 128 rows; shared memory stages · (BLOCK_M + BLOCK_N) · BLOCK_K · 2 bytes <= 128 KB in
    bf16 (H100/H200: 227 KB per block). fp32 (CPU tests) uses a 32-wide K tile. Not tuned on a GPU
    yet (benchmarks/kernels/bench_lm_head.py)."""
    bm = min(128, max(16, next_pow2(M)))
    if dtype == torch.float32:
        return bm, block_n, 32, 4, 2
    return (bm, 64, 64, 4, 4) if block_n == 64 else (bm, 128, 64, 8, 3)


def _chunked(x2: torch.Tensor, w: torch.Tensor, chunk: int) -> torch.Tensor:
    y = torch.empty(x2.shape[0], w.shape[0], device=x2.device, dtype=x2.dtype)
    for n0 in range(0, w.shape[0], chunk):
        torch.mm(x2, w[n0 : n0 + chunk].t(), out=y[:, n0 : n0 + chunk])  # y's row stride is N: no copy on cuBLAS
    return y


def lm_head(h: torch.Tensor, w: torch.Tensor, choice: str = "linear") -> torch.Tensor:
    """``h [..., K] · w [N, K]ᵀ`` -> logits ``[..., N]`` in h's dtype, computed by candidate ``choice``.

    Raises ValueError on an unknown ``choice``, a weight that is not 2-D, a hidden size ``h.shape[-1]`` other
    than ``w.shape[1]``, or (``triton*``) mismatched dtypes."""
    if choice not in CANDIDATES:
        raise ValueError(f"lm_head: unknown implementation {choice!r} (one of {CANDIDATES})")
    if w.dim() != 2 or h.dim() < 1 or h.shape[-1] != w.shape[1]:
        raise ValueError(f"lm_head: h {tuple(h.shape)} and w {tuple(w.shape)}: need w [N, K] and h [..., K]")
    K, N = w.shape[1], w.shape[0]
    # One 2-D GEMM over all M rows. A 3-D input that is not contiguous (the engine's draft rows,
    # hidden[:, 1:16] of [B, 16, H]) is not folded by torch.matmul: it runs as a batched GEMM of B
    # problems of 15 rows that reads the weight B times (7 × the 2-D call's time on the H200: docs/status.md,
    # results/profile-step-h200.json). reshape copies those rows (M·K elements, ~1 MB) instead.
    x2 = h.reshape(-1, K)
    if choice == "linear":
        y = F.linear(x2, w)
    elif choice == "transposed":
        y = torch.mm(w, x2.t()).t().contiguous()
    elif choice in CHUNKS:
        y = _chunked(x2, w, CHUNKS[choice])
    else:
        y = linear_triton(x2, w, cfg=triton_config(x2.shape[0], TRITON_BN[choice], h.dtype))
    return y.view(*h.shape[:-1], N)


def default_timer(name: str, fn, warmup: int = 2, reps: int = 5) -> float:
    """Median µs of ``fn()`` over ``reps`` calls after ``warmup``: CUDA events on the current stream
    when a GPU is present (no sync between the timed calls), else the host clock. ``name`` is unused
    (the signature of an injected timer, which may key on it)."""
    del name
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
        return sorted(times)[reps // 2]
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) * 1e3 for a, b in ev)[reps // 2]


def pick(M: int, w: torch.Tensor, timer=None, names=None, seed: int = 0,
         margin: float = 0.05) -> tuple[str, dict[str, float]]:
    """Time each candidate on random rows ``[M, K]`` (w's device and dtype) and return the fastest
    name and every candidate's µs (``inf``: failed to run, or its logits differ from ``F.linear``'s
    by more than 2 % of their largest magnitude — a broken kernel is never chosen).

    ``timer(name, fn) -> µs`` (default :func:`default_timer`); ``names`` default: every candidate
    (the Triton ones when Triton is installed). Ties go to the earlier name; ``linear`` stays unless
    the fastest beats it by more than ``margin`` (a timing-noise "win" does not change the kernel).
    """
    timer = timer or default_timer
    names = names or [n for n in CANDIDATES if HAS_TRITON or n not in TRITON_BN]
    g = torch.Generator(device=w.device).manual_seed(seed)
    x = torch.randn(M, w.shape[1], device=w.device, generator=g).to(w.dtype)
    ref = F.linear(x, w).float()
    tol = 0.02 * float(ref.abs().max())
    times: dict[str, float] = {}
    for name in names:
        fn = lambda name=name: lm_head(x, w, name)
        try:
            if float((fn().float() - ref).abs().max()) > tol:
                times[name] = math.inf
                continue
            times[name] = float(timer(name, fn))
        except Exception as e:  # noqa: BLE001 - e.g. a Triton config out of resources on this device
            print(f"note: lm_head candidate {name} failed at M={M}: {str(e).splitlines()[0][:200]}", flush=True)
            times[name] = math.inf
    best = min(names, key=lambda n: times[n])
    if not math.isfinite(times[best]) or times.get("linear", math.inf) <= (1 + margin) * times[best]:
        best = "linear"
    return best, times
