"""LM-head candidates (``dspine.ops.lm_head``, issue 12) per row count M, and the engine's pick.

    python benchmarks/kernels/bench_lm_head.py --output results/lm-head-h200.json
    python benchmarks/kernels/bench_lm_head.py --tiny        # CPU smoke test (Triton interpreter)

For the LM heads of Qwen3-8B (K 4096, N 151936: W 1.24 GB in bf16) and SmolLM2-135M (K 576, N 49152)
and M = 1, 8, 15, 16, 32, 64, 120, 128, 256 rows (AR batch 1..256, verify blocks of 16 at batch 1..16, draft
blocks of 15 predicted slots at batch 1 and 8): the
CUDA-graph time of each candidate (``triton.testing.do_bench_cudagraph``, median, µs; what the
engine's captured step replays), its effective bandwidth (W + h + logits bytes / time, GB/s) and
its ratio to ``F.linear``; then the pick of ``dspine.ops.lm_head.pick`` (CUDA events, eager: what
the engine runs at start-up), the µs it measured and its own wall time (the autotune cost per M,
Triton kernels already compiled). Runs in well under a minute on an H200.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tests.kernel_env  # noqa: E402,F401  (TRITON_INTERPRET=1 without CUDA, before the kernel modules)
from dspine.io import atomic_write_json  # noqa: E402
from dspine.ops import lm_head as lh  # noqa: E402
from dspine.provenance import provenance  # noqa: E402

SHAPES = {"qwen3-8b": (4096, 151936), "smollm2-135m": (576, 49152)}  # name: (K, N)
MS = (1, 8, 15, 16, 32, 64, 120, 128, 256)
TINY_SHAPES = {"tiny": (72, 300)}
TINY_MS = (1, 8, 37)


def us(fn, cuda: bool) -> float:
    """Median µs: CUDA-graph replays on the GPU, the host clock (median of 3 after one call) on the CPU."""
    fn()
    if cuda:
        import triton.testing

        torch.cuda.synchronize()
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - t))
    return sorted(times)[1]


@torch.inference_mode()
def run(args) -> dict:
    cuda = torch.cuda.is_available() and not args.tiny
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shapes, ms = (SHAPES, MS) if cuda else (TINY_SHAPES, TINY_MS)
    names = [n for n in lh.CANDIDATES if lh.HAS_TRITON or n not in lh.TRITON_BN]
    g = torch.Generator(device=dev).manual_seed(0)
    res: dict = {"dtype": str(dtype).removeprefix("torch."), "rows": [], "pick": []}
    for shape, (K, N) in shapes.items():
        w = (torch.randn(N, K, device=dev, generator=g) / K**0.5).to(dtype)
        x = torch.randn(max(ms), K, device=dev, generator=g).to(dtype)
        for m in ms:
            size = w.element_size()
            traffic = (N * K + m * K + m * N) * size  # bytes: W, h, logits once each
            base = None
            for name in names:
                try:
                    t = us(lambda m=m, name=name, x=x, w=w: lh.lm_head(x[:m], w, name), cuda)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: record and go on
                    res["rows"].append({"shape": shape, "K": K, "N": N, "M": m, "impl": name,
                                        "error": f"{type(e).__name__}: {e}"[:300]})
                    continue
                base = t if name == "linear" else base
                res["rows"].append({"shape": shape, "K": K, "N": N, "M": m, "impl": name, "us": t,
                                    "gb_s": traffic / t / 1e3, "vs_linear": t / base if base else None})
            t0 = time.perf_counter()
            best, times = lh.pick(m, w, names=names)
            wall = time.perf_counter() - t0
            graph = {r["impl"]: r["us"] for r in res["rows"] if r["shape"] == shape and r["M"] == m and "us" in r}
            fastest = min(graph, key=graph.get)
            res["pick"].append({"shape": shape, "M": m, "pick": best, "pick_event_us": times,
                                "pick_graph_us": graph.get(best), "fastest_in_graph": fastest,
                                "linear_graph_us": graph.get("linear"), "autotune_s": wall})
            print(f"{shape:>13} M={m:<4} " + "  ".join(f"{n} {graph[n]:8.1f}" for n in names if n in graph)
                  + f"  | pick {best} ({graph.get(best, float('nan')):.1f} us, {wall * 1e3:.0f} ms)", flush=True)
        del w, x
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    args = ap.parse_args(argv)
    res = {**provenance(), **run(args)}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.output), res, indent=1, allow_nan=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
