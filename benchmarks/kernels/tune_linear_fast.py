"""Fast-mode GEMV tiles: the Triton linear kernel against cuBLAS at decode row counts, weights read from HBM.

    python benchmarks/kernels/tune_linear_fast.py --output results/linear-fast-h200.json \
        --write-tuned dspine/ops/tuned/linear-NVIDIA_H200.json
    python benchmarks/kernels/tune_linear_fast.py --wide --output results/linear-fast-wide-h200.json \
        --write-tuned dspine/ops/tuned/linear-NVIDIA_H200.json
    python benchmarks/kernels/tune_linear_fast.py --tiny        # CPU smoke test (Triton interpreter)

Fast mode (``linear(exact=False)``) needs no row invariance, so each weight may take whatever configuration
(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split) is fastest at M = 1, 8, 16 rows (AR batch 1, AR batch 8,
verify batch 1). Split > 1 runs the K chunks on their own programs, the last one of a tile adding the partials
(``dspine.ops.linear.FUSED_REDUCE``). Timing: a CUDA graph of calls over rotating copies of the weight, at least
``--stream-mb`` MB of them, so every call streams its weight from HBM as the engine's step does (the 33-50 MB
o/qkv weights of Qwen3-8B fit in the H200's L2, where ``do_bench_cudagraph`` on one copy would time them);
µs per call, median of 5 replays. Per weight: the candidate with the lowest mean ratio to cuBLAS's
``F.linear`` over the row counts, and its ratio per row count. ``--write-tuned`` adds it to the device's tuned
file as that weight's ``fast`` entry (``dspine.ops.linear.fast_config`` uses it where the ratio is below 1);
the exact path's entries are left as they are. ``--wide``: the same at a batched verify's 32, 64 and 128 rows
(where cuBLAS's GEMMs read the weights at 2.4-3.3 TB/s against the GEMV's 3.7 on the H200,
results/profile-step-h200.json), written as ``fast_wide`` entries that ``fast_config_rows`` uses up to 128 rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tests.kernel_env  # noqa: E402,F401  (TRITON_INTERPRET=1 without CUDA, before the kernel modules)
from dspine.io import atomic_write_json  # noqa: E402
from dspine.ops import linear as lin  # noqa: E402
from dspine.provenance import provenance  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
MS = (1, 8, 16)
# candidate tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), each with every split of SPLITS
TILES = [(16, bn, bk, w, st) for bn, bk, w, st in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4))
         if bn * bk <= 16384 and (w == 4 or bn * bk >= 8192)]
SPLITS = (1, 2, 3, 4, 6, 8)
# --wide: a batched verify's rows (16 a request: batch 2, 4, 8), wgmma-sized row tiles, shared memory of the
# pipeline stages within the H200's 227 KB
MS_WIDE = (32, 64, 128)
TILES_WIDE = [(bm, bn, bk, w, st) for bm, bn, bk, w, st in itertools.product((64, 128), (64, 128, 256), (64, 128),
                                                                          (4, 8), (3, 4, 5))
              if st * (bm * bk + bk * bn) * 2 <= 200_000 and (w == 8 or bm * bn <= 128 * 64)]
SPLITS_WIDE = (1, 2, 4)
TINY_SHAPES = {"a": (96, 600)}
TINY_MS = (1, 3)
TINY_MS_WIDE = (20, 40)
TINY_TILES = [(16, 32, 64, 4, 2)]
TINY_SPLITS = (1, 3)


def _graph_us(fn, reps: int) -> float:
    """µs per ``fn()`` call: a CUDA graph of ``reps`` calls, median of 5 replays after a warm-up replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            for _ in range(reps):
                fn()
    torch.cuda.current_stream().wait_stream(s)
    graph.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(1e3 * e0.elapsed_time(e1) / reps)
    return statistics.median(ts)


def time_call(call, ws, x, cuda: bool) -> float:
    """µs of ``call(x, w)`` with w cycling over the copies ``ws`` (wall clock of one pass on the CPU)."""
    if cuda:
        return _graph_us(lambda: [call(x, w) for w in ws], reps=2) / len(ws)
    t = time.perf_counter()
    for w in ws:
        call(x, w)
    return 1e6 * (time.perf_counter() - t) / len(ws)


@torch.inference_mode()
def run(args) -> dict:
    cuda = torch.cuda.is_available() and not args.tiny
    dev = "cuda" if cuda else "cpu"
    dt = torch.bfloat16
    shapes = TINY_SHAPES if args.tiny else {k: SHAPES[k] for k in args.weights}
    if args.tiny:
        ms, tiles, splits = (TINY_MS_WIDE if args.wide else TINY_MS), TINY_TILES, TINY_SPLITS
    else:
        ms, tiles, splits = (MS_WIDE, TILES_WIDE, SPLITS_WIDE) if args.wide else (MS, TILES, SPLITS)
    g = torch.Generator().manual_seed(0)
    out = {"stream_mb": args.stream_mb, "ms": list(ms), "wide": bool(args.wide), "weights": {},
           "bandwidth_gbps": args.bandwidth_gbps}  # floor_us's basis: the H200's copy bandwidth unless given
    for name, (N, K) in shapes.items():
        copies = 1 if not cuda else max(2, -(-args.stream_mb * 2**20 // (N * K * 2)))
        ws = [(torch.randn(N, K, generator=g) / K**0.5).to(dt).to(dev) for _ in range(copies)]
        xs = {m: torch.randn(m, K, generator=g).to(dt).to(dev) for m in ms}
        cub = {m: time_call(F.linear, ws, xs[m], cuda) for m in ms}
        rows = []
        for tile, split in itertools.product(tiles, splits):
            if split > 1 and lin.chunk_k(K, split) * (split - 1) >= K:
                continue  # fewer chunks than split: the same launch as a smaller split
            cfg = (*tile, split)
            us, err = {}, 0.0
            for m in ms:
                y = lin.linear_triton(xs[m], ws[0], cfg=cfg, split_programs=True)
                ref = F.linear(xs[m].float(), ws[0].float())
                err = max(err, (y.float() - ref).abs().max().item() / ref.abs().max().item())
                us[m] = time_call(lambda x, w, c=cfg: lin.linear_triton(x, w, cfg=c, split_programs=True), ws,
                                  xs[m], cuda)
            if err > 2 * 2**-8:
                raise RuntimeError(f"{name} {cfg}: relative error {err:.3g} against the fp32 product")
            ratio = statistics.mean(us[m] / cub[m] for m in ms)
            rows.append({"cfg": list(cfg), "us": {f"M{m}": us[m] for m in ms}, "mean_ratio_to_cublas": ratio})
        best = min(rows, key=lambda r: r["mean_ratio_to_cublas"])
        out["weights"][name] = {
            "N": N,
            "K": K,
            "copies": copies,
            "cublas_us": {f"M{m}": cub[m] for m in ms},
            "floor_us": N * K * 2 / args.bandwidth_gbps / 1e3,
            "best": best,
            "best_ratio_by_m": {f"M{m}": best["us"][f"M{m}"] / cub[m] for m in ms},
            "candidates": sorted(rows, key=lambda r: r["mean_ratio_to_cublas"])[: args.keep],
        }
        print(f"{name} [{N},{K}]: cuBLAS {[round(cub[m], 2) for m in ms]} µs; best {best['cfg']} "
              f"{[round(best['us'][f'M{m}'], 2) for m in ms]} µs (mean ratio {best['mean_ratio_to_cublas']:.3f}; "
              f"{len(rows)} candidates)", flush=True)
    return out


def write_tuned(path: Path, res: dict) -> None:
    """Add each weight's best configuration as its ``fast`` entry (``fast_wide`` with ``max_m``, the largest row
    count measured, for a ``--wide`` run) of the tuned file at ``path`` (which must have an entry for the weight
    already: the exact path's). Raises ValueError naming the file and weight otherwise."""
    d = json.loads(path.read_text())
    wide = bool(res.get("wide"))
    for name, w in res["weights"].items():
        key = f"{w['N']},{w['K']}"
        if key not in d.get("weights", {}):
            raise ValueError(f"{path}: no entry for weight {name} [{key}] (run bench_linear.py --cross first)")
        d["weights"][key]["fast_wide" if wide else "fast"] = {
            "cfg": w["best"]["cfg"],
            "ratio_to_cublas": w["best"]["mean_ratio_to_cublas"],
            "ratio_by_m": w["best_ratio_by_m"],
            **({"max_m": max(res["ms"])} if wide else {}),
            "source": "benchmarks/kernels/tune_linear_fast.py" + (" --wide" if wide else ""),
            **{k: res[k] for k in ("gpu", "date", "commit") if k in res},
        }
    lin._check_tuned(d)
    atomic_write_json(path, d, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None, help="JSON file to write")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--weights", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--stream-mb", type=int, default=400, help="MB of weight copies cycled per timed pass")
    ap.add_argument("--bandwidth-gbps", type=float, default=4265.0, help="for floor_us (H200 copy bandwidth)")
    ap.add_argument("--keep", type=int, default=8, help="candidates kept per weight in the output")
    ap.add_argument("--write-tuned", default=None, metavar="FILE",
                    help="add the best configurations as fast entries to this tuned file")
    ap.add_argument("--wide", action="store_true",
                    help=f"a batched verify's row counts {MS_WIDE} with wgmma-sized tiles; writes fast_wide entries")
    args = ap.parse_args(argv)
    if args.stream_mb < 1:
        ap.error(f"--stream-mb {args.stream_mb}: must be at least 1")
    if args.write_tuned and not Path(args.write_tuned).is_file():
        ap.error(f"--write-tuned {args.write_tuned}: no such file")
    res = {**provenance(), **run(args)}
    if args.write_tuned:
        write_tuned(Path(args.write_tuned), res)
        print(f"wrote fast entries to {args.write_tuned}")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.output), res, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
