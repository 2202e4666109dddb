"""Tree construction (``dspine.ops.tree_build``): torch's build_tree + ancestor_bits against the fused kernel.

    python benchmarks/kernels/bench_tree_build.py --output results/tree-build-h200.json
    python benchmarks/kernels/bench_tree_build.py --tiny      # CPU smoke test (Triton interpreter)

For batch 1 and 8, budgets N = 16, 32, 64, K = 15 depths and V = 49152 (SmolLM2's vocabulary), draft
distributions softmax(3·randn), both tree rules (``chain_first`` True: the chain kept first, the engine's rule at
T > 0; False: best first, its rule at T = 0): the median µs of three paths, eager (``triton.testing.do_bench``,
includes the Python launch overhead) and as a CUDA-graph replay (``do_bench_cudagraph``, as in the
engine's captured step): ``torch`` (``dspine.tree.build_tree`` and ``ancestor_bits``), ``fused``
(``build_tree_fused``, the engine's: the per-depth candidates in two Triton launches, then the tree kernel) and
``candidates`` (``dspine.tree.tree_candidates`` alone, torch's candidate selection; before 1b55f86 the fused
path ran it too, and ``fused`` − ``candidates`` was recorded as the tree kernel's time). ``equal`` records
that the two builders returned identical trees on that input. ``--tiny`` runs small shapes on the CPU
(host clock, median of 3).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tests.kernel_env  # noqa: E402,F401  (TRITON_INTERPRET=1 without CUDA, before the kernel modules)
from benchmarks.kernels.bench_kernels import bench  # noqa: E402
from benchmarks.kernels.bench_lm_head import us  # noqa: E402
from dspine.io import atomic_write_json  # noqa: E402
from dspine.ops._common import triton  # noqa: E402
from dspine.ops.tree_build import build_tree_fused  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.tree import tree_candidates  # noqa: E402

SHAPES = dict(batch=(1, 8), budget=(16, 32, 64), depth=15, vocab=49152)
TINY = dict(batch=(1, 2), budget=(5, 9), depth=3, vocab=50)
FIELDS = ("tokens", "parent", "depth", "chain", "anc", "bits")


@torch.inference_mode()
def run(args) -> dict:
    cuda = torch.cuda.is_available() and not args.tiny
    dev = "cuda" if cuda else "cpu"
    shapes = SHAPES if cuda else TINY
    K, V = shapes["depth"], shapes["vocab"]
    g = torch.Generator(device=dev).manual_seed(0)
    res: dict = {"triton": triton.__version__, "depth": K, "vocab": V, "timer": "do_bench / do_bench_cudagraph medians" if cuda else
                 "host clock, median of 3", "rows": []}  # fmt: skip
    for B in shapes["batch"]:
        q = torch.softmax(3 * torch.randn(B, K, V, device=dev, generator=g), -1)
        anchor = torch.arange(B, device=dev)
        for N in shapes["budget"]:
            for cf in (True, False):
                paths = {
                    "torch": lambda q=q, a=anchor, N=N, cf=cf: build_tree_fused(a, q, N, impl="torch", chain_first=cf),
                    "fused": lambda q=q, a=anchor, N=N, cf=cf: build_tree_fused(a, q, N, impl="triton", chain_first=cf),
                    "candidates": lambda q=q, a=anchor, N=N: tree_candidates(a, q, N),
                }
                want, got = paths["torch"](), paths["fused"]()
                equal = all(torch.equal(getattr(want, f), getattr(got, f)) for f in FIELDS)
                row = {"B": B, "N": N, "chain_first": cf, "equal": equal}
                for name, fn in paths.items():
                    eager, graph = bench(fn) if cuda else (us(fn, False), None)
                    row[f"{name}_us"], row[f"{name}_graph_us"] = eager, graph
                if cuda:
                    row["graph_speedup"] = row["torch_graph_us"] / row["fused_graph_us"]
                res["rows"].append(row)
                print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)  # fmt: skip
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    args = ap.parse_args(argv)
    res = {**provenance(argv if argv is None else [__file__, *argv]), **run(args)}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.output), res, indent=1, allow_nan=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
