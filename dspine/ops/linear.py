"""Row-invariant linear layer ``y = x · Wᵀ (+ bias)`` for the engine's exact decode/verify path.

Op: ``y[m, n] = Σ_k x[m, k] · w[n, k] (+ bias[n])``, accumulated in fp32 and rounded once to x's
dtype. **Row invariance** (the point of this op): row m of y is bitwise the same whatever the number
of rows M (1..any) and whatever the other rows hold. cuBLAS does not promise that: it picks a
kernel (tile shape, split-K, gemv vs gemm) from M, so a 16-row verify pass can round a position
differently from a 1-row decode step (issue 13).

Kernel: K is cut into ``split`` chunks (:func:`split_k`, from the weight and device only; chunk
starts at multiples of CHUNK_GRANULE). Each chunk is summed on its own in fp32, BLOCK_K tiles in
increasing K order through ``tl.dot``, and the chunk sums are added in chunk order starting from 0.0;
the bias is added last, then one rounding. Where those sums run is a matter of time only: for few
rows (M <= SPLIT_PROGRAMS_MAX_M, or as the device's tuned file says up to SPLIT_PROGRAMS_LIMIT) each chunk
gets its own programs, which write fp32 partials that the tile's last program to finish adds in chunk order
(an atomic arrival count per tile; ``FUSED_REDUCE``, else a second kernel does); otherwise one program sums
all chunks of its tile. The tile
configuration (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) changes neither the chunks nor the order of
the tensor-core k16 steps, so :func:`config` may pick it from M (``mixed_row_tiles``; checked bitwise on the
device by benchmarks/kernels/bench_linear.py --cross, recorded in the device's tuned file
``tuned/linear-<GPU>.json``); ``CONFIG_OVERRIDE`` fixes it for tuning. Where that file says cuBLAS gave
the one-pass (split 1) kernel's bits at a row count above SMALL_M (``cublas_m``), the exact path calls
cuBLAS there instead (:func:`cublas_agrees`).
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

import functools
import json
import re
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from ._common import (
    OutOfResources,
    check_impl,
    dot_precision,
    env_choice,
    next_pow2,
    num_sms,
    pdl_enter,
    pdl_kwargs,
    tile_counters,
    tl,
    triton,
)
from .silu_mul import silu_mul

__all__ = [
    "linear",
    "linear_torch",
    "linear_triton",
    "config",
    "chunk_k",
    "split_k",
    "CONFIG_OVERRIDE",
    "SPLIT_PROGRAMS_MAX_M",
    "SPLIT_PROGRAMS_LIMIT",
    "SMALL_M",
    "FAST_MAX_M",
    "use_in_fast_mode",
    "fast_config",
    "fast_config_rows",
    "fast_pick",
    "fuse_act",
    "act_input",
    "FUSE_ACT",
    "ACTS",
    "tuned",
    "cublas_agrees",
    "in_ranges",
]

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, split]) for every shape when set (tuning:
# benchmarks/kernels/bench_linear.py); None = :func:`config`'s choice.
CONFIG_OVERRIDE: tuple[int, ...] | None = None


@triton.jit
def _load_x(X, NW, rm, k, m_ok, k_ok, K, stride_xm, rstd, PRO: tl.constexpr):
    """x[rm, k] as the GEMV's input tile [BLOCK_M, BLOCK_K]. PRO 0: as stored. PRO 1 (``act="silu_mul"``): X holds
    gate_up rows [gate (K) | up (K)]; silu(gate)·up with silu_mul's roundings (silu in fp32 rounded to the dtype,
    then the product rounded). PRO 2 (``norm=``): X holds a residual sum r; ``(r·rstd)`` rounded, times the norm
    weight, rounded (rms_norm's op sequence, rstd per row)."""
    mk = m_ok[:, None] & k_ok[None, :]
    x = tl.load(X + rm[:, None] * stride_xm + k[None, :], mask=mk, other=0.0)
    if PRO == 1:
        u = tl.load(X + rm[:, None] * stride_xm + K + k[None, :], mask=mk, other=0.0)
        g = x.to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
        x = (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype)
    elif PRO == 2:
        nw = tl.load(NW + k, mask=k_ok, other=0.0)
        normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
        x = (normed.to(tl.float32) * nw.to(tl.float32)[None, :]).to(x.dtype)
    return x


@triton.jit
def _chunk_dot(X, W, NW, rm, rn, m_ok, n_ok, rk, c0, c1, K, stride_xm, stride_wn, rstd,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
               PRO: tl.constexpr):
    """fp32 sum of x[rm, k] · w[rn, k] over k in [c0, min(c1, K)): BLOCK_K tiles in increasing K order
    through ``tl.dot`` (the order never depends on M); x through :func:`_load_x`'s prologue PRO."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(c0, tl.minimum(c1, K), BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        x = _load_x(X, NW, rm, k, m_ok, k_ok, K, stride_xm, rstd, PRO)
        w = tl.load(W + rn[None, :] * stride_wn + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PREC)  # w tile [BLOCK_K, BLOCK_N]
    return acc


@triton.jit
def _store_y(Y, Res, SumSq, total, rm, rn, m_ok, n_ok, stride_ym, stride_res, n_tiles, pid_n, RES: tl.constexpr):
    """Round the fp32 tile to y's dtype and store it; RES: first add the residual (rounded, as torch's bf16 add)
    and store that sum instead, with its squares summed over this tile's columns at SumSq[row, pid_n]."""
    mn_ok = m_ok[:, None] & n_ok[None, :]
    y = total.to(Y.dtype.element_ty)
    if RES:
        res = tl.load(Res + rm[:, None] * stride_res + rn[None, :], mask=mn_ok, other=0.0)
        y = (y.to(tl.float32) + res.to(tl.float32)).to(Y.dtype.element_ty)
        yf = tl.where(mn_ok, y.to(tl.float32), 0.0)
        tl.store(SumSq + rm * n_tiles + pid_n, tl.sum(yf * yf, axis=1), mask=m_ok)
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], y, mask=mn_ok)


@triton.jit
def _linear_kernel(
    X,
    W,
    Bias,
    Y,
    P,
    Count,
    NW,
    SumSqIn,
    Res,
    SumSqOut,
    M,
    N,
    K,
    CHUNK_K,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_res,
    n_tiles_in,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_PROGRAMS: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PREC: tl.constexpr,
    PRO: tl.constexpr,
    TILES_IN: tl.constexpr,
    RES: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid_m = tl.program_id(0)  # fastest: the row tiles of one weight tile run together (L2 reuse)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    if PRO == 2:  # the rows' RMSNorm statistic from their producer's per-tile sums of squares, TILES_IN at a time
        total_ss = tl.zeros([BLOCK_M], tl.float32)
        for t0 in range(0, n_tiles_in, TILES_IN):
            t = t0 + tl.arange(0, TILES_IN)
            ss = tl.load(SumSqIn + rm[:, None] * n_tiles_in + t[None, :],
                         mask=m_ok[:, None] & (t < n_tiles_in)[None, :], other=0.0)
            total_ss += tl.sum(ss, axis=1)
        rstd = tl.math.rsqrt(total_ss / K + eps)
    else:
        rstd = tl.zeros([BLOCK_M], tl.float32)
    if SPLIT_PROGRAMS:  # this program: K chunk pid(2) alone; fp32 partial to P[chunk, M, N]
        c0 = tl.program_id(2) * CHUNK_K
        acc = _chunk_dot(X, W, NW, rm, rn, m_ok, n_ok, rk, c0, c0 + CHUNK_K, K, stride_xm, stride_wn, rstd,
                         BLOCK_M, BLOCK_N, BLOCK_K, PREC, PRO)
        mn_ok = m_ok[:, None] & n_ok[None, :]
        tl.store(P + (tl.program_id(2) * M + rm[:, None]) * N + rn[None, :], acc, mask=mn_ok)
        if FUSED_REDUCE:  # the tile's last chunk program to arrive adds the partials as _linear_reduce_kernel does
            tl.debug_barrier()  # every thread's partial stored before the release below
            tile = pid_n * tl.num_programs(0) + pid_m
            arrived = tl.atomic_add(Count + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(2) - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in range(0, tl.num_programs(2)):  # chunk order, from 0.0
                    total += tl.load(P + (s * M + rm[:, None]) * N + rn[None, :], mask=mn_ok, other=0.0,
                                     cache_modifier=".cg")  # from L2: other SMs wrote them
                if HAS_BIAS:
                    total += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                _store_y(Y, Res, SumSqOut, total, rm, rn, m_ok, n_ok, stride_ym, stride_res, tl.num_programs(1),
                         pid_n, RES)
                tl.atomic_xchg(Count + tile, 0)  # zero for the next launch on this stream
    else:  # every chunk here, summed in chunk order exactly as _linear_reduce_kernel sums the partials
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for c0 in range(0, K, CHUNK_K):
            total += _chunk_dot(X, W, NW, rm, rn, m_ok, n_ok, rk, c0, c0 + CHUNK_K, K, stride_xm, stride_wn, rstd,
                                BLOCK_M, BLOCK_N, BLOCK_K, PREC, PRO)
        if HAS_BIAS:
            total += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        _store_y(Y, Res, SumSqOut, total, rm, rn, m_ok, n_ok, stride_ym, stride_res, tl.num_programs(1), pid_n, RES)


@triton.jit(do_not_specialize=["M", "N"])
def _linear_reduce_kernel(
    P, Bias, Y, M, N, stride_ym, SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    i = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mn = M.to(tl.int64) * N  # int64: M·N·SPLIT may pass 2^31
    ok = i < mn
    total = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):  # chunk order, from 0.0: the same fp32 sums as the one-program path
        total += tl.load(P + s * mn + i, mask=ok, other=0.0)
    n = i % N
    if HAS_BIAS:
        total += tl.load(Bias + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + (i // N) * stride_ym + n, total.to(Y.dtype.element_ty), mask=ok)


def _cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def _check(x, w, bias):
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear: x [..., {x.shape[-1]}] and weight {tuple(w.shape)} do not match (want [N, K])")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"linear: bias {tuple(bias.shape)} must be [{w.shape[0]}]")
    if x.dtype != w.dtype:
        raise ValueError(f"linear: x is {x.dtype}, weight is {w.dtype}")
    if bias is not None and bias.dtype != w.dtype:
        raise ValueError(f"linear: bias is {bias.dtype}, weight is {w.dtype}")


def _cfg6(cfg) -> tuple[int, int, int, int, int, int]:
    """A 5-tuple (no split) or 6-tuple configuration as (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split)."""
    cfg = tuple(int(v) for v in cfg)
    if len(cfg) == 5:
        cfg = (*cfg, 1)
    if len(cfg) != 6 or min(cfg) < 1:
        raise ValueError(f"linear: configuration {cfg} is not (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, split])")
    if any(v & (v - 1) for v in cfg[:4]) or min(cfg[:3]) < 16:
        raise ValueError(f"linear: configuration {cfg}: BLOCK_M, BLOCK_N, BLOCK_K and warps must be powers of 2, "
                         "the blocks at least 16 (tl.dot's least)")
    return cfg


# K chunks start at multiples of this many columns, whatever BLOCK_K (64, 128 and 256 divide it), so that
# the chunks, and with them the sums, do not depend on the tile configuration.
CHUNK_GRANULE = 256


def chunk_k(K: int, split: int) -> int:
    """Length of one K chunk: ``split`` chunks of whole CHUNK_GRANULE column groups covering K (the last
    chunk may be shorter, and fewer than ``split`` chunks result when K is small)."""
    return _cdiv(_cdiv(K, split), CHUNK_GRANULE) * CHUNK_GRANULE


def split_k(N: int, K: int, device) -> int:
    """K chunks of a weight [N, K] without a tuned file: when 64-wide column tiles give fewer than two programs
    per streaming multiprocessor, up to 4 chunks of at least 4·CHUNK_GRANULE columns (4 for K >= 4096, 2-3 for
    2048 <= K < 4096, 1 below), else 1. From the weight and the device only."""
    if _cdiv(N, 64) >= 2 * num_sms(device):
        return 1
    return max(1, min(4, K // (4 * CHUNK_GRANULE)))


# M up to which the "small" tile configuration is used (16-row tiles: mma.sync), above it the "large"
# one (64-row tiles or wider: wgmma on Hopper). A tile configuration changes neither the chunks nor the
# order of the BLOCK_K tiles and tensor-core k16 steps, so the sums should not change with it; the
# device's tuned file says whether that held bitwise there (``mixed_row_tiles``, written by
# benchmarks/kernels/bench_linear.py --cross --write-tuned); without a file, one configuration for all M.
SMALL_M = 16
TUNED_DIR = Path(__file__).with_name("tuned")


@functools.cache
def tuned(device_name: str) -> dict:
    """The tuned tiles of one GPU model: ``TUNED_DIR/linear-<name>.json`` ({} if there is none).

    Format: {"mixed_row_tiles": bool, "weights": {"N,K": {"split": S, "small": [BM, BN, BK, warps,
    stages], "large": [...], "programs": {"small": bool, "large": bool}, "small_ratio_to_cublas": r,
    "cublas_m": [[lo, hi], ...], "fast": {...}, "fast_wide": {...}}}, "versions": {"torch": ..., "triton": ...}};
    ``fast`` / ``fast_wide``: the fast path's tile at <= FAST_MAX_M rows / above that up to ``max_m`` rows
    (:func:`fast_config_rows`); ``programs``: K chunks over programs at that size (up to
    SPLIT_PROGRAMS_LIMIT rows); ``small_ratio_to_cublas`` (optional): the small tile's mean time over
    cuBLAS's at M <= SMALL_M, < 1 puts the fast path on this kernel (:func:`use_in_fast_mode`);
    ``cublas_m`` (optional, split 1 only): row counts
    at which cuBLAS (``F.linear``, no bias) gave this kernel's bits on the device, so the exact path may
    call it there (:func:`cublas_agrees`). Raises ValueError naming the file when it is not that."""
    path = TUNED_DIR / f"linear-{device_name.replace(' ', '_')}.json"
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text())
        _check_tuned(d)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a tuned-tile file ({type(e).__name__}: {e})") from e
    return d


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_positive(x) -> bool:
    """A finite number > 0 (a bool is none)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf")


def _is_tile(t, n: int) -> bool:
    """``[BLOCK_M, BLOCK_N, BLOCK_K, warps, stages(, split)]`` of ``n`` integers >= 1, block sizes >= 16."""
    return isinstance(t, list) and len(t) == n and all(_is_int(v) and v >= 1 for v in t) and min(t[:3]) >= 16


def _check_tuned(d: dict) -> None:
    """Raise on anything :func:`tuned`'s format does not allow (types exact: a string is no bool)."""
    if not isinstance(d.get("mixed_row_tiles"), bool):
        raise ValueError(f"mixed_row_tiles must be true or false, got {d.get('mixed_row_tiles')!r}")
    if not isinstance(d.get("weights"), dict):
        raise ValueError("weights must be an object of 'N,K' keys")
    if "versions" in d and not isinstance(d["versions"], dict):
        raise ValueError(f"versions must be an object (torch, triton), got {d['versions']!r}")
    for key, e in d["weights"].items():
        if not re.fullmatch(r"[1-9][0-9]*,[1-9][0-9]*", key):
            raise ValueError(f"weight key {key!r} is not 'N,K' (two positive integers, no spaces)")
        split = e["split"]
        if not (_is_int(split) and split >= 1):
            raise ValueError(f"weight {key}: split {split!r} must be an integer >= 1")
        for size in ("small", "large"):
            tile = e[size]
            if not _is_tile(tile, 5):
                raise ValueError(f"weight {key}: {size} {tile!r} is not [BLOCK_M, BLOCK_N, BLOCK_K, warps, stages] "
                                 "(integers; block sizes >= 16, tl.dot's least)")
            if any(v & (v - 1) for v in tile[:4]) or CHUNK_GRANULE % tile[2]:
                raise ValueError(f"weight {key}: {size} {tile}: block sizes and warps must be powers of 2 and "
                                 f"BLOCK_K must divide {CHUNK_GRANULE}")
            if not isinstance(e["programs"][size], bool):
                raise ValueError(f"weight {key}: programs.{size} must be true or false")
        ratio = e.get("small_ratio_to_cublas")
        if ratio is not None and not _is_positive(ratio):
            raise ValueError(f"weight {key}: small_ratio_to_cublas {ratio!r} must be a positive number")
        for r in e.get("cublas_m", []):
            if not (isinstance(r, list) and len(r) == 2 and all(map(_is_int, r)) and 1 <= r[0] <= r[1]):
                raise ValueError(f"weight {key}: cublas_m range {r!r} is not [lo, hi] with 1 <= lo <= hi")
        if e.get("cublas_m") and split != 1:
            raise ValueError(f"weight {key}: cublas_m needs split 1 (cuBLAS sums K in one pass)")
        for field in ("fast", "fast_wide"):
            if field not in e:
                continue
            f = e[field]
            cfg, r = f["cfg"], f["ratio_to_cublas"]
            if not (_is_tile(cfg, 6) and not any(v & (v - 1) for v in cfg[:4]) and CHUNK_GRANULE % cfg[2] == 0):
                raise ValueError(
                    f"weight {key}: {field}.cfg {cfg!r} is not [BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split] "
                    f"(integers; block sizes >= 16 and with warps powers of 2; BLOCK_K divides {CHUNK_GRANULE})"
                )
            if not _is_positive(r):
                raise ValueError(f"weight {key}: {field}.ratio_to_cublas {r!r} must be a positive number")
            by_m = f.get("ratio_by_m", {})
            if not (isinstance(by_m, dict) and all(re.fullmatch(r"M[1-9][0-9]*", k) and _is_positive(v)
                                                   for k, v in by_m.items())):
                raise ValueError(f"weight {key}: {field}.ratio_by_m {by_m!r} must map 'M<rows>' to positive numbers")
            if field == "fast_wide":
                top = f.get("max_m")
                if not (_is_int(top) and FAST_MAX_M < top <= SPLIT_PROGRAMS_LIMIT):
                    raise ValueError(f"weight {key}: fast_wide.max_m {top!r} must be an integer in "
                                     f"{FAST_MAX_M + 1}..{SPLIT_PROGRAMS_LIMIT}")


def versions() -> dict:
    """The library versions a tuned file's bitwise findings depend on (the writer records them)."""
    return {"torch": torch.__version__, "triton": getattr(triton, "__version__", None)}


@functools.cache
def _same_versions(device_name: str) -> bool:
    """Whether the device's tuned file was measured with this torch and Triton (a file without ``versions``
    counts as matching). Its bitwise findings (``mixed_row_tiles``, ``cublas_m``) hold only there; otherwise
    they are set aside with a one-time warning, and its tiles serve for speed only."""
    want = tuned(device_name).get("versions")
    if want is None or want == versions():
        return True
    warnings.warn(
        f"dspine.ops.linear: the tuned file for {device_name!r} was measured with {want}, this is "
        f"{versions()}: its bitwise findings (mixed row tiles, cuBLAS rows) are not used; rerun "
        "benchmarks/kernels/bench_linear.py --cross --write-tuned to measure them here",
        stacklevel=3,
    )
    return False


def _weight_entry(device_name: str, N: int, K: int) -> dict | None:
    """The tuned file's entry of weight ``[N, K]`` on this GPU model (None without one)."""
    return tuned(device_name).get("weights", {}).get(f"{N},{K}")


def _mixed_rows(device_name: str) -> bool:
    """Whether tiles may be picked by M on this GPU model: the tuned file found them bitwise equal
    (``mixed_row_tiles``) with this torch and Triton."""
    return bool(tuned(device_name).get("mixed_row_tiles")) and _same_versions(device_name)


def in_ranges(m: int, ranges) -> bool:
    """Whether ``m`` lies in one of the inclusive ``[lo, hi]`` ranges."""
    return any(lo <= m <= hi for lo, hi in ranges)


def cublas_agrees(x2: torch.Tensor, w: torch.Tensor, bias) -> bool:
    """Whether the exact path may run ``F.linear`` for x2 [M, K] · wᵀ: M > SMALL_M and the device's tuned
    file lists M under the weight's ``cublas_m`` (cuBLAS gave this kernel's bits at that M on the device), no bias,
    bf16/fp16, and both operands 256-byte aligned and contiguous as in the check (cuBLAS may pick
    another kernel for other alignments)."""
    if bias is not None or not x2.is_cuda or x2.dtype == torch.float32 or CONFIG_OVERRIDE is not None:
        return False
    if x2.data_ptr() % 256 or w.data_ptr() % 256 or not x2.is_contiguous():
        return False
    name = torch.cuda.get_device_name(x2.device)
    e = _weight_entry(name, *w.shape)
    M = x2.shape[0]  # at M <= SMALL_M the kernel is the faster one (results/exact-kernels-cross-h200.json)
    return (
        e is not None
        and e["split"] == 1
        and M > SMALL_M
        and in_ranges(M, e.get("cublas_m", ()))
        and _same_versions(name)
    )


def config(N: int, K: int, dtype: torch.dtype, device, M: int = 1) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, split) for x [M, K] · w[N, K]ᵀ.

    ``split`` comes from the weight and device only (the device's tuned file, else :func:`split_k`);
    the tile configuration may depend on M where the tuned file says that keeps the bits
    (``mixed_row_tiles``). Without a file entry: 16-row tiles (64 columns, 128-deep K) at M <= 16 where the
    file allows mixing, else 64-row tiles; on the H200 16-row tiles ran 0.72-1.07x cuBLAS's time at M <= 16
    on the Qwen3-8B weights (results/exact-kernels-cross-h200.json). fp32 (tests, the CPU interpreter)
    uses 32-deep K tiles and one row-tile size.
    """
    if CONFIG_OVERRIDE is not None:
        return _cfg6(CONFIG_OVERRIDE)
    if dtype == torch.float32:
        return 64, 32, 32, 4, 2, split_k(N, K, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    mixed = bool(name) and _mixed_rows(name)
    e = _weight_entry(name, N, K) if name else None
    if e is not None:
        return _cfg6((*e["small" if M <= SMALL_M and mixed else "large"], e["split"]))
    if mixed and M <= SMALL_M:
        return 16, 64, 128, 4, 4, split_k(N, K, device)
    return 64, 64, 128, 4, 4, split_k(N, K, device)


# Largest M that splits K over programs by default (fp32 partials + one reduce launch); above it every program
# sums its chunks itself, unless the tuned file says otherwise for that size, and never above
# SPLIT_PROGRAMS_LIMIT (the partials take split·M·N·4 bytes: a prompt-length M would take gigabytes). Either
# way the sums are the same, so this only moves time.
SPLIT_PROGRAMS_MAX_M = 16
SPLIT_PROGRAMS_LIMIT = 256
# Split programs: the last chunk program of each tile to finish (an atomic arrival count per tile,
# ``_common.tile_counters``) adds the partials, in chunk order from 0.0 exactly as the reduce kernel does, so
# the bits are the same and one launch per call goes (72 of an AR step's 452 at Qwen3-8B shape). False, or
# no counters (a graph captured on a stream that had none): the separate ``_linear_reduce_kernel``.
FUSED_REDUCE = True


ACTS = (None, "silu_mul")
# Whether linear(act=...) applies the activation in the kernel's load where the Triton kernel runs (bitwise the
# separate silu_mul kernel's output; one launch and an [M, K] round trip fewer, but every column tile reads gate and
# up, twice the input bytes). None: environment variable DSPINE_FUSE_ACT, 0 (default) or 1. Off by default: on the H200
# the prologue takes Qwen3-8B's down projection from 28 to 170 µs at M = 1 (SiLU over a 16-row tile in every program's
# critical path; results/linear-fusion-h200.json): far more than the separate silu_mul launch it removes.
FUSE_ACT: bool | None = None


def fuse_act() -> bool:
    """:data:`FUSE_ACT`, else ``DSPINE_FUSE_ACT`` (0 or 1; default 0). Raises ValueError on another value."""
    return FUSE_ACT if FUSE_ACT is not None else env_choice("DSPINE_FUSE_ACT", ("0", "1"), "0") == "1"


def act_input(x: torch.Tensor, act: str | None, impl: str) -> tuple[torch.Tensor, str | None]:
    """``(x, act)`` for a layer whose input wants ``act``: unchanged while :func:`fuse_act` is on (the kernel applies
    it as it loads), else ``(silu_mul(x), None)``, the separate activation kernel first."""
    if act is None or fuse_act():
        return x, act
    return silu_mul(x, impl=impl), None


def _norm_tiles_ok(K: int, tiles: int) -> bool:
    """Whether ``tiles`` per-tile sums of squares can cover K columns: cdiv(K, bn) == tiles for a power-of-two
    tile width bn >= 16 (a residual epilogue's BLOCK_N)."""
    bn = 16
    while bn < 2 * max(K, 16):
        if _cdiv(K, bn) == tiles:
            return True
        bn *= 2
    return False


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses of t's elements."""
    return t.data_ptr(), t.data_ptr() + t.element_size() * (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors may share an element: the same storage and intersecting byte spans, except two 2-D row
    views with one row stride whose column ranges are disjoint (column blocks of one buffer, as the draft features'
    blocks are). Conservative otherwise."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    if not (a0 < b1 and b0 < a1):
        return False
    if a.dim() == b.dim() == 2 and a.stride() == b.stride() and a.stride(1) == 1 and a.element_size() == b.element_size():
        row = a.stride(0) * a.element_size()
        ca, cb = (a0 - a.untyped_storage().data_ptr()) % row, (b0 - b.untyped_storage().data_ptr()) % row
        wa, wb = a.shape[1] * a.element_size(), b.shape[1] * b.element_size()
        if ca + wa <= row and cb + wb <= row and (ca + wa <= cb or cb + wb <= ca):
            return False  # disjoint columns of every row
    return True


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _check_fusion(x, w, act, norm, residual, out):
    """Shapes of the fused prologue/epilogue arguments of :func:`linear_triton` (raises ValueError naming the one
    that does not fit). Returns (K, M): the GEMV's inner size and rows."""
    if act not in ACTS:
        raise ValueError(f"linear: act must be one of {ACTS}, got {act!r}")
    if act is not None and norm is not None:
        raise ValueError("linear: act and norm are two prologues of the input; give one")
    if w.dim() != 2:
        raise ValueError(f"linear: weight {tuple(w.shape)} must be [N, K]")
    N, K = w.shape
    if K == 0:
        raise ValueError(f"linear: weight {tuple(w.shape)} has no columns; the fused forms need K >= 1")
    width = 2 * K if act == "silu_mul" else K
    if x.dim() < 1 or x.shape[-1] != width:
        raise ValueError(f"linear: x {tuple(x.shape)} does not fit weight {tuple(w.shape)}"
                         + (f" with act='silu_mul' (want gate_up [..., {width}])" if act else " (want [..., K])"))
    if x.dtype != w.dtype:
        raise ValueError(f"linear: x is {x.dtype}, weight is {w.dtype}")
    M = x.numel() // width
    if norm is not None:
        if not (isinstance(norm, (tuple, list)) and len(norm) == 3):
            raise ValueError("linear: norm must be (weight [K], sumsq [M, tiles] float32, eps)")
        nw, ss, _eps = norm
        if tuple(nw.shape) != (K,) or nw.dtype != w.dtype:
            raise ValueError(f"linear: norm weight {tuple(nw.shape)} {nw.dtype} must be [{K}] {w.dtype}")
        if (ss.dim() != 2 or ss.shape[0] != M or ss.dtype != torch.float32 or not ss.is_contiguous()
                or not _norm_tiles_ok(K, ss.shape[1])):
            raise ValueError(f"linear: norm sums of squares {tuple(ss.shape)} {ss.dtype} must be a contiguous "
                             f"[{M}, cdiv({K}, BLOCK_N)] float32 (a residual epilogue's second output, every tile)")
    want = (*x.shape[:-1], N)
    if residual is not None and (tuple(residual.shape) != want or residual.dtype != w.dtype):
        raise ValueError(f"linear: residual {tuple(residual.shape)} {residual.dtype} must be {want} {w.dtype}")
    if out is not None:
        if (tuple(out.shape) != want or out.dtype != w.dtype or (N > 1 and out.stride(-1) != 1)
                or not (out.dim() == 2 or out.is_contiguous()) or (out.dim() == 2 and M > 1 and out.stride(0) < N)):
            raise ValueError(f"linear: out {tuple(out.shape)} {out.dtype} strides {out.stride()} must be {want} "
                             f"{w.dtype} (unit last stride; 2-D with rows at least {N} apart, or contiguous)")
        if any(_overlap(out, t) for t in (x, w, *(norm[:2] if norm is not None else ()))):
            raise ValueError("linear: out overlaps x, the weight or the norm's tensors (other programs still read "
                             "them); residual is the one input out may share, element for element")
        if residual is not None and _overlap(out, residual) and not _same_layout(out, residual):
            raise ValueError("linear: out overlaps residual without being it (other row tiles still read it); give "
                             "the same tensor or disjoint memory")
    return K, M


# Pipeline stages that fit shared memory, per (tile configuration, prologue): a tile tuned as a plain GEMM
# (tune_linear_fast.py) can need more with the silu_mul prologue, which pipelines gate and up tiles (128×64×128 at 4
# stages: 256 KB against the H200's 227). A launch that Triton refuses for its shared memory is retried with one
# stage fewer, and the count that fits is remembered. Stages change the pipelining only, not the sums.
_STAGES_FIT: dict[tuple, int] = {}


def _rows2(t, width):
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def linear_triton(x, w, bias=None, cfg: tuple[int, ...] | None = None, split_programs: bool | None = None, *,
                  act: str | None = None, norm: tuple | None = None, residual: torch.Tensor | None = None,
                  out: torch.Tensor | None = None):
    """Row-invariant ``x · wᵀ (+ bias)`` (module docstring). ``cfg``: a 5- or 6-tuple (:func:`config`);
    ``split_programs``: spread the K chunks over programs (None: when M <= SPLIT_PROGRAMS_MAX_M, or as the
    device's tuned file says, never above SPLIT_PROGRAMS_LIMIT rows); the result is bitwise the same either
    way.

    Fusions (the engine's small-M decode/verify path, ``infer.model.EngineTarget._layers``):
      * ``act="silu_mul"``: x is a fused gate/up projection ``[..., 2K]`` (gate first) and the input is
        ``silu(gate)·up``, computed as it is loaded with :mod:`dspine.ops.silu_mul`'s roundings: the result is
        bitwise ``linear_triton(silu_mul(x), w)`` (one launch and the ``[M, K]`` round trip fewer).
      * ``norm=(weight [K], sumsq [M, T] float32, eps)``: x is a residual sum r ``[..., K]`` and the input is
        RMSNorm(r)·weight with :mod:`dspine.ops.rmsnorm`'s op sequence; the statistic is ``Σ_t sumsq[m, t] / K``,
        the per-tile sums of squares that a ``residual=`` epilogue wrote for these rows (tile order). The fp32
        sum of squares runs in another order than rms_norm's, so bf16 results may differ by an ulp, and the
        statistic depends on the producer's tile width: not for exact mode.
      * ``residual [..., N]``: the output is ``round(y) + residual`` rounded (torch's bf16 add), and the call
        returns ``(r, sumsq)``: r ``[..., N]`` and sumsq ``[M, cdiv(N, BLOCK_N)]`` float32, each row's sum of
        r² over every BLOCK_N-column tile (feed to the next call's ``norm``).
      * ``out``: a ``[..., N]`` buffer that receives y (or r): contiguous, or 2-D with unit last stride and rows at
        least N apart, e.g. a column block of the draft's features. It may not overlap x, the weight, the bias or
        the norm's tensors; with ``residual`` it may be that very tensor (in place).
    Raises ValueError on mismatched shapes or dtypes (bias, fusion arguments and ``out`` included) and a
    non-contiguous weight."""
    if act is None and norm is None and residual is None and out is None:
        _check(x, w, bias)
    else:
        _check_fusion(x, w, act, norm, residual, out)
        if bias is not None and (tuple(bias.shape) != (w.shape[0],) or bias.dtype != w.dtype):
            raise ValueError(f"linear: bias {tuple(bias.shape)} {bias.dtype} must be [{w.shape[0]}] {w.dtype}")
        if bias is not None and out is not None and _overlap(out, bias):
            raise ValueError("linear: out overlaps the bias (other programs still read it)")
    N, K = w.shape
    if K == 0:  # an empty sum: the bias (or zeros), as F.linear gives (the fused forms refused it above)
        y = torch.zeros(*x.shape[:-1], N, device=x.device, dtype=x.dtype)
        return y + bias if bias is not None else y
    width = 2 * K if act == "silu_mul" else K
    if w.stride(1) != 1 or w.stride(0) != K:
        raise ValueError("linear: weight must be contiguous [N, K]")
    x2 = _rows2(x, width)
    M = x2.shape[0]
    y = torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype) if out is None else out
    y2 = y.view(M, N) if y.dim() != 2 else y
    bm, bn, bk, warps, stages, split = _cfg6(cfg or config(N, K, x.dtype, x.device, M))
    sumsq = torch.empty(M, _cdiv(N, bn), device=x.device, dtype=torch.float32) if residual is not None else None
    done = (y, sumsq) if residual is not None else y
    if M == 0 or N == 0:
        return done
    if CHUNK_GRANULE % bk:
        raise ValueError(f"linear: BLOCK_K {bk} must divide CHUNK_GRANULE {CHUNK_GRANULE}")
    ck = chunk_k(K, split)
    n_chunks = _cdiv(K, ck)
    if split_programs is None:
        split_programs = M <= SPLIT_PROGRAMS_MAX_M
        if cfg is None and CONFIG_OVERRIDE is None and x.is_cuda and x.dtype != torch.float32:
            name = torch.cuda.get_device_name(x.device)
            e = _weight_entry(name, N, K)
            if e is not None:
                split_programs = e["programs"]["small" if M <= SMALL_M and _mixed_rows(name) else "large"]
    split_programs = bool(split_programs) and n_chunks > 1 and M <= SPLIT_PROGRAMS_LIMIT
    count = tile_counters(x.device, _cdiv(M, bm) * _cdiv(N, bn)) if split_programs and FUSED_REDUCE else None
    if residual is not None and split_programs and count is None:
        split_programs = False  # the epilogue lives in the kernel's tile stores; one program per tile, same bits
    part = torch.empty(n_chunks, M, N, device=x.device, dtype=torch.float32) if split_programs else y2
    grid = (_cdiv(M, bm), _cdiv(N, bn), n_chunks if split_programs else 1)
    res2 = _rows2(residual, N) if residual is not None else None
    nw, ss_in, eps = norm if norm is not None else (w, y2, 0.0)
    pro = 1 if act == "silu_mul" else (2 if norm is not None else 0)
    key = (bm, bn, bk, warps, stages, pro, x.dtype, x.device.type)
    while True:
        try:
            _linear_kernel[grid](
                x2,
                w,
                bias if bias is not None else w,
                y2,
                part,
                count if count is not None else part,
                nw,
                ss_in,
                res2 if res2 is not None else y2,
                sumsq if sumsq is not None else part,
                M,
                N,
                K,
                ck,
                x2.stride(0),
                w.stride(0),
                y2.stride(0),
                res2.stride(0) if res2 is not None else 0,
                ss_in.shape[1] if norm is not None else 1,
                float(eps),
                BLOCK_M=bm,
                BLOCK_N=bn,
                BLOCK_K=bk,
                SPLIT_PROGRAMS=split_programs,
                FUSED_REDUCE=count is not None,
                HAS_BIAS=bias is not None,
                PREC=dot_precision(x.dtype),
                PRO=pro,
                TILES_IN=min(32, next_pow2(ss_in.shape[1])) if norm is not None else 1,  # a [BLOCK_M, 32] fp32 tile at most
                RES=residual is not None,
                num_warps=warps,
                num_stages=_STAGES_FIT.get(key, stages),
                **pdl_kwargs(x.device, M),
            )
            break
        except OutOfResources:  # shared memory: one stage fewer (_STAGES_FIT)
            fit = _STAGES_FIT.get(key, stages)
            if fit <= 1:
                raise
            _STAGES_FIT[key] = fit - 1
    if split_programs and count is None:
        block = 1024
        _linear_reduce_kernel[(_cdiv(M * N, block),)](
            part,
            bias if bias is not None else w,
            y2,
            M,
            N,
            y2.stride(0),
            SPLIT=n_chunks,
            BLOCK=block,
            HAS_BIAS=bias is not None,
            num_warps=4,
            **pdl_kwargs(x.device, M),
        )
    return done


def linear_torch(x, w, bias=None):
    """Reference: ``F.linear`` row by row on fresh contiguous copies (row invariant by construction)."""
    _check(x, w, bias)
    if w.shape[1] == 0:  # an empty sum: F.linear's bias (or zeros)
        return F.linear(x, w, bias)
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.empty(x2.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    for m in range(x2.shape[0]):
        y[m] = F.linear(x2[m : m + 1].clone(), w, bias)[0]
    return y.view(*x.shape[:-1], w.shape[0])


# The fast (non-exact) path takes this kernel too at M <= FAST_MAX_M rows for the bf16 weights whose small tile
# the device's tuned file measured faster than cuBLAS (``small_ratio_to_cublas`` < 1). On the H200: o 0.82,
# down 0.93, lm_head 0.96, gate_up 0.98 (mean over M = 1, 8, 16), qkv 1.06 (stays on cuBLAS);
# results/exact-kernels-cross-h200.json. cuBLAS for every other shape and above FAST_MAX_M.
FAST_MAX_M = 16


def fast_config(x: torch.Tensor, w: torch.Tensor) -> tuple[int, ...] | None:
    """The Triton configuration ``linear(exact=False, impl="triton")`` runs instead of cuBLAS, or None for
    cuBLAS: CUDA, bf16, at most FAST_MAX_M rows (above: :func:`fast_config_rows`'s ``fast_wide``), and the
    device's tuned file has a ``fast`` entry for the weight
    measured faster than cuBLAS (``fast.ratio_to_cublas`` < 1: benchmarks/kernels/tune_linear_fast.py, weights
    streamed from HBM as in a decode step, not from L2). Fast mode needs no row invariance, so that entry's
    split may differ from the exact path's. Without one, the exact path's small tile where the file measured
    it faster (``small_ratio_to_cublas`` < 1)."""
    if not (x.is_cuda and x.dtype == w.dtype):
        return None
    return fast_config_rows(x.numel() // max(1, x.shape[-1]), w)


def fast_config_rows(rows: int, w: torch.Tensor) -> tuple[int, ...] | None:
    """:func:`fast_config` for an input of ``rows`` rows in w's dtype on w's device. Above FAST_MAX_M rows (a
    batched verify: 16 rows a request), the weight's ``fast_wide`` entry up to its ``max_m`` rows where it was
    measured faster than cuBLAS (``tune_linear_fast.py --wide``), else None."""
    if not (w.is_cuda and w.dtype == torch.bfloat16):
        return None
    name = torch.cuda.get_device_name(w.device)
    pick = fast_pick(_weight_entry(name, *w.shape), rows)
    if pick == "small":  # the measured gain is the small tile's: other versions may not run it (no mixed tiles)
        return config(*w.shape, w.dtype, w.device, rows) if _same_versions(name) else None
    return pick


def _wide_ratio(wide: dict, rows: int) -> float:
    """A ``fast_wide`` entry's time over cuBLAS's at ``rows``: from ``ratio_by_m`` ({"M32": r, ...}) the ratio of the
    smallest measured row count >= rows (rows 17-32 take M32's, 33-64 M64's, ...); without per-M ratios, or above
    every measured count, the entry's mean ``ratio_to_cublas``."""
    by_m = sorted((int(k[1:]), r) for k, r in wide.get("ratio_by_m", {}).items())
    return next((r for m, r in by_m if m >= rows), wide["ratio_to_cublas"])


def fast_pick(entry: dict | None, rows: int) -> tuple[int, ...] | str | None:
    """The fast path's choice from a weight's tuned-file entry at ``rows`` rows: its ``fast`` configuration at
    1..FAST_MAX_M rows where it measured faster than cuBLAS (mean ratio < 1); above that up to ``max_m`` its
    ``fast_wide`` one where it measured faster at that size (:func:`_wide_ratio`); at <= FAST_MAX_M without
    ``fast``, "small" (the exact path's small tile) where that was measured faster (``small_ratio_to_cublas`` < 1);
    None (cuBLAS) otherwise."""
    if entry is None or rows < 1:
        return None
    if rows > FAST_MAX_M:
        wide = entry.get("fast_wide")
        if wide is None or rows > wide["max_m"]:
            return None
        return tuple(wide["cfg"]) if _wide_ratio(wide, rows) < 1.0 else None
    if "fast" in entry:
        return tuple(entry["fast"]["cfg"]) if entry["fast"]["ratio_to_cublas"] < 1.0 else None
    return "small" if entry.get("small_ratio_to_cublas", float("inf")) < 1.0 else None


def use_in_fast_mode(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``linear(exact=False, impl="triton")`` runs a Triton kernel instead of cuBLAS (:func:`fast_config`)."""
    return fast_config(x, w) is not None


def linear(x, w, bias=None, impl: str = "triton", exact: bool = True, *, act: str | None = None):
    """``x [..., K] · w[N, K]ᵀ (+ bias [N])`` -> ``[..., N]`` in x's dtype.

    ``exact=True``: row invariant (module docstring), Triton kernel or the row-by-row reference
    by ``impl``. ``exact=False``: ``F.linear`` (cuBLAS / the CPU BLAS), except the Triton kernel where
    :func:`use_in_fast_mode` says it is faster. ``act="silu_mul"``: x is a gate/up projection ``[..., 2K]`` and
    the input is ``silu(gate)·up`` (:mod:`dspine.ops.silu_mul`); with :func:`fuse_act` on and where the Triton
    kernel runs, the kernel applies the activation as it loads x (:func:`linear_triton`, the same bits), and the
    exact path then does not take the cuBLAS rows of :func:`cublas_agrees`; otherwise silu_mul runs first.
    Raises ValueError on mismatched shapes or dtypes, another ``act``, or a bad ``DSPINE_FUSE_ACT``.
    """
    if act not in ACTS:
        raise ValueError(f"linear: act must be one of {ACTS}, got {act!r}")
    if act is not None:
        if w.dim() != 2 or x.dim() < 1 or x.shape[-1] != 2 * w.shape[1]:
            raise ValueError(f"linear: x {tuple(x.shape)} does not fit weight {tuple(w.shape)} with act='silu_mul' "
                             f"(want gate_up [..., {2 * w.shape[-1]}])")
        x, act = act_input(x, act, impl)  # DSPINE_FUSE_ACT=0 (the default, measured faster): silu_mul first
    if not exact:
        cfg = fast_config(x, w) if impl == "triton" else None
        if cfg is not None:
            return linear_triton(x, w, bias, cfg=cfg, split_programs=True, act=act)
        return F.linear(x if act is None else silu_mul(x, impl=impl), w, bias)
    check_impl(impl)
    if act is not None:
        if impl == "triton":
            return linear_triton(x, w, bias, act=act)
        x = silu_mul(x, impl=impl)
    if impl == "triton" and x.is_cuda:
        _check(x, w, bias)
        x2 = x.reshape(-1, x.shape[-1])
        if cublas_agrees(
            x2, w, bias
        ):  # the same bits as linear_triton here (checked on the device: tuned file)
            return F.linear(x2, w).view(*x.shape[:-1], w.shape[0])
    return linear_triton(x, w, bias) if impl == "triton" else linear_torch(x, w, bias)
