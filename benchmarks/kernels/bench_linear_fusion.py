"""What each fusion of the fast-mode Triton linear costs per call, at Qwen3-8B's decoder weights (issue 12).

    python benchmarks/kernels/bench_linear_fusion.py --output results/linear-fusion-h200.json
    python benchmarks/kernels/bench_linear_fusion.py --tiny        # CPU smoke test (Triton interpreter)

The engine's fused decode path (``infer.model.EngineTarget._layers`` with ``fuse_norm`` on, ``DSPINE_FUSE_ACT=1``)
replaces the two RMSNorm kernels and the SiLU·mul kernel of a layer by a prologue or epilogue of the linear layers
around them (``dspine.ops.linear.linear_triton``: ``norm=``, ``residual=``, ``act="silu_mul"``). Per weight and row
count M (1, 8, 16: AR batch 1 and 8, a verify of 16), each with the weight's fast-mode configuration
(``fast_config_rows``; where that is None, cuBLAS's rows, the exact path's tile for M), µs per call of:

* ``cublas``: ``F.linear``; ``plain``: the Triton kernel without a fusion;
* ``norm``: with the RMSNorm prologue (``norm=(weight, sumsq, eps)``, the statistic from 64-column tiles);
* ``residual``: with the residual epilogue (``residual=``; it also writes the per-tile sums of squares);
* ``act`` (the down projection only): with the SiLU·mul prologue, the input ``[M, 2K]``.

``unfused_by_m``: the kernels the fusions remove, each timed alone at M rows: ``rms_norm_residual_us``
(``dspine.ops.rmsnorm.rms_norm`` with its residual add over the hidden size, o's N; a layer runs two) and
``silu_mul_us`` (``dspine.ops.silu_mul.silu_mul`` over down's ``[M, 2K]``). A fusion pays where its extra µs on the
linear calls stay below the kernels it removes. ``act_by_split``: the act prologue on the down projection at the
first and last M over the tile configurations of ``ACT_CFGS``, beside the plain kernel with the same
configuration: the prologue's SiLU runs once per program on a ``[BLOCK_M, BLOCK_K]`` tile, so its cost falls as
the split (programs per tile column) rises. Timing as ``tune_linear_fast.py``: a CUDA graph over
rotating copies of the weight (``--stream-mb``), every call streaming it from HBM; median of 5 replays (one
wall-clock pass on the CPU). Each fused variant is checked against the unfused composition first (bf16, relative
error ≤ 2⁻⁷ of the output's largest magnitude; the residual epilogue's per-tile sums of squares against the fp32
sum of r² of each row, relative 2⁻⁷). Raises RuntimeError naming the variant otherwise. Writes JSON with the
command, GPU, date and commit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tests.kernel_env  # noqa: E402,F401  (TRITON_INTERPRET=1 without CUDA, before the kernel modules)
from benchmarks.kernels.tune_linear_fast import SHAPES, time_call  # noqa: E402
from dspine.io import atomic_write_json  # noqa: E402
from dspine.ops import linear as lin  # noqa: E402
from dspine.ops.rmsnorm import rms_norm  # noqa: E402
from dspine.ops.silu_mul import silu_mul  # noqa: E402
from dspine.paths import output_arg  # noqa: E402
from dspine.provenance import provenance  # noqa: E402

MS = (1, 8, 16)
TILE = 64  # the producer's BLOCK_N whose per-tile sums of squares feed the norm prologue
EPS = 1e-6
ACT_CFGS = ((16, 64, 256, 4, 4, 2), (16, 64, 256, 4, 1, 2), (16, 64, 256, 4, 2, 2), (16, 64, 128, 4, 4, 2),
            (16, 64, 64, 4, 4, 2), (16, 32, 128, 4, 3, 4), (16, 64, 256, 8, 4, 2), (16, 128, 128, 4, 3, 2),
            (16, 64, 128, 4, 3, 4))
TINY_SHAPES = {"qkv": (96, 128), "o": (128, 128), "down": (128, 192)}
TINY_MS = (1, 3)
TINY_ACT_CFGS = ((16, 32, 64, 4, 2, 1), (16, 32, 64, 4, 2, 3))


def _check(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    """Raises RuntimeError naming the variant where ``got`` is off the unfused composition ``ref``."""
    err = (got.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-30)
    if err > 2**-7:
        raise RuntimeError(f"{name}: relative error {err:.3g} against the unfused composition")


def _variants(name: str, m: int, w: torch.Tensor, cfg, g: torch.Generator) -> tuple[dict, dict]:
    """The calls ``{variant: call(x, w)}`` and their inputs ``{variant: x}`` for weight ``name`` at m rows, each
    checked once against the unfused composition."""
    N, K = w.shape
    dev, dt = w.device, w.dtype
    split = m <= lin.SPLIT_PROGRAMS_LIMIT
    x = torch.randn(m, K, generator=g).to(dt).to(dev)
    nw = (torch.rand(K, generator=g) + 0.5).to(dt).to(dev)
    res = torch.randn(m, N, generator=g).to(dt).to(dev)
    ss = (x.float() ** 2).view(m, -1, TILE).sum(-1).contiguous()  # as a residual epilogue of BLOCK_N = TILE writes
    calls = {
        "cublas": (x, lambda x, w: F.linear(x, w)),
        "plain": (x, lambda x, w: lin.linear_triton(x, w, cfg=cfg, split_programs=split)),
        "norm": (x, lambda x, w: lin.linear_triton(x, w, cfg=cfg, split_programs=split, norm=(nw, ss, EPS))),
        "residual": (x, lambda x, w: lin.linear_triton(x, w, cfg=cfg, split_programs=split, residual=res)),
    }
    plain = lambda inp: lin.linear_triton(inp, w, cfg=cfg, split_programs=split)  # noqa: E731
    _check(f"{name} M{m} norm", calls["norm"][1](x, w), plain(rms_norm(x, nw, EPS)))
    r, sumsq = calls["residual"][1](x, w)
    _check(f"{name} M{m} residual", r, plain(x) + res)
    _check(f"{name} M{m} residual sums of squares", sumsq.sum(-1), r.float().pow(2).sum(-1))
    if name == "down":
        xa = torch.randn(m, 2 * K, generator=g).to(dt).to(dev)
        calls["act"] = (xa, lambda x, w: lin.linear_triton(x, w, cfg=cfg, split_programs=split, act="silu_mul"))
        _check(f"{name} M{m} act", calls["act"][1](xa, w), plain(silu_mul(xa)))
    return {k: c for k, (_, c) in calls.items()}, {k: x for k, (x, _) in calls.items()}


def _copies(N: int, K: int, cuda: bool, stream_mb: int, g: torch.Generator) -> list[torch.Tensor]:
    """Random bf16 weights [N, K]: enough copies for ``stream_mb`` MB on CUDA (at least 2), one on the CPU."""
    n = max(2, -(-stream_mb * 2**20 // (N * K * 2))) if cuda else 1
    dev = "cuda" if cuda else "cpu"
    return [(torch.randn(N, K, generator=g) / K**0.5).to(torch.bfloat16).to(dev) for _ in range(n)]


@torch.inference_mode()
def run(args) -> dict:
    cuda = torch.cuda.is_available() and not args.tiny
    dev, dt = ("cuda" if cuda else "cpu"), torch.bfloat16
    shapes = TINY_SHAPES if args.tiny else SHAPES
    ms = TINY_MS if args.tiny else MS
    g = torch.Generator().manual_seed(0)
    out: dict = {"stream_mb": args.stream_mb, "ms": list(ms), "norm_tile": TILE, "weights": {}}
    for name, (N, K) in shapes.items():
        ws = _copies(N, K, cuda, args.stream_mb, g)
        copies = len(ws)
        rows = {}
        for m in ms:
            cfg = lin.fast_config_rows(m, ws[0]) or lin.config(N, K, dt, ws[0].device, m)
            calls, xs = _variants(name, m, ws[0], cfg, g)
            row = {"cfg": list(cfg), "us": {v: time_call(c, ws, xs[v], cuda) for v, c in calls.items()}}
            rows[f"M{m}"] = row
            print(f"{name} M{m} {cfg}: " + ", ".join(f"{v} {u:.2f}" for v, u in row["us"].items()) + " µs", flush=True)
        out["weights"][name] = {"N": N, "K": K, "copies": copies, "by_m": rows}
    hidden, inter = shapes["o"][0], shapes["down"][1]
    out["unfused_by_m"] = {}
    nw = torch.ones(hidden, dtype=dt, device=dev)
    for m in ms:
        h = torch.randn(m, hidden, generator=g).to(dt).to(dev)
        gu = torch.randn(m, 2 * inter, generator=g).to(dt).to(dev)
        u = {"rms_norm_residual_us": time_call(lambda x, w: rms_norm(x, nw, EPS, residual=x), [None], h, cuda),
             "silu_mul_us": time_call(lambda x, w: silu_mul(x), [None], gu, cuda)}
        out["unfused_by_m"][f"M{m}"] = u
        print(f"unfused M{m}: rms_norm + residual {u['rms_norm_residual_us']:.2f}, silu_mul {u['silu_mul_us']:.2f} µs",
              flush=True)
    ws = _copies(*shapes["down"], cuda, args.stream_mb, g)
    act = []
    for m in (ms[0], ms[-1]):
        for cfg in (TINY_ACT_CFGS if args.tiny else ACT_CFGS):
            calls, xs = _variants("down", m, ws[0], cfg, g)
            act.append({"m": m, "cfg": list(cfg), "plain_us": time_call(calls["plain"], ws, xs["plain"], cuda),
                        "act_us": time_call(calls["act"], ws, xs["act"], cuda)})
            print(f"down act M{m} {cfg}: plain {act[-1]['plain_us']:.2f}, act {act[-1]['act_us']:.2f} µs", flush=True)
    out["act_by_split"] = act
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None, help="JSON file to write (an existing one only with --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--stream-mb", type=int, default=400, help="MB of weight copies cycled per timed pass")
    args = ap.parse_args(argv)
    if args.stream_mb < 1:
        ap.error(f"--stream-mb {args.stream_mb}: must be at least 1")
    output_arg(ap, args)
    res = {**provenance(), "tiny": bool(args.tiny), **run(args)}
    if args.output is not None:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.output), res, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
