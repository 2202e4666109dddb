"""The sampling cut's top-k (``dspine.ops.topk``) at T > 0: the kernel against the torch path it replaces.

    python benchmarks/engine/bench_topk.py --output results/topk-h200.json
    python benchmarks/engine/bench_topk.py --device cpu --rows 2 --vocab 300 --iters 2 --reps 1 --output /tmp/t.json

For each row count R (``--rows``: an AR step at batch B has B rows, a chain of W has B·W target rows and B·(W - 1)
draft rows; 64, 128, 256 and 1024 are batch 64's AR step and its chains of 2, 4 and 16) and bf16 logits
``[R, --vocab]`` (SmolLM2's 49,152 by default), four variants, each ``--iters`` calls captured in one CUDA graph and
replayed between two ``synchronize`` calls (µs per call), round-robin in alternating order, the median over
``--reps`` rounds after one warm-up round:

* ``torch_topk_us`` / ``kernel_topk_us``: ``topk_ids(x, T, k)`` with ``impl="torch"`` (``topk`` over int64 order
  keys) and ``impl="triton"``;
* ``torch_probs_us`` / ``kernel_probs_us``: the whole ``logits_to_probs(x, T, top_p, k, with_ids=True)`` the engine
  runs per verified row block (cut, softmax over k, top-p, the dense scatter).

On the CPU (a smoke run) both variants take the torch path. The JSON has provenance, the settings, and per R the
four times and ``topk_speedup`` / ``probs_speedup`` (torch ÷ kernel).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.bench_argmax_prob import median_us  # noqa: E402
from benchmarks.engine.bench_planner_loop import finish, int_list, require_positive  # noqa: E402
from dspine.ops.topk import CHUNK, topk_ids  # noqa: E402
from dspine.paths import output_arg  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.sampling import logits_to_probs  # noqa: E402


def run(args) -> dict:
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    kernel = "triton" if cuda else "torch"  # on the CPU a smoke run: the torch path in every variant
    res: dict = {**provenance(), "vocab": args.vocab, "k": args.k, "top_p": args.top_p, "temperature": args.temperature,
                 "iters": args.iters, "reps": args.reps, "kernel_impl": kernel, "chunk": CHUNK, "points": []}
    g = torch.Generator().manual_seed(0)
    T, k, top_p = args.temperature, args.k, args.top_p
    for R in args.rows:
        x = (4 * torch.randn(R, args.vocab, generator=g)).to(dev, torch.bfloat16)
        fns = {"torch_topk_us": lambda x=x: topk_ids(x, T, k, "torch"),
               "kernel_topk_us": lambda x=x: topk_ids(x, T, k, kernel),
               "torch_probs_us": lambda x=x: logits_to_probs(x, T, top_p, k, with_ids=True, impl="torch"),
               "kernel_probs_us": lambda x=x: logits_to_probs(x, T, top_p, k, with_ids=True, impl=kernel)}
        if not torch.equal(fns["torch_topk_us"](), fns["kernel_topk_us"]()):
            raise AssertionError(f"rows {R}: the kernel's ids differ from the torch path's")
        point = {"rows": R, **median_us(fns, args.iters, args.reps, cuda)}
        point["topk_speedup"] = point["torch_topk_us"] / point["kernel_topk_us"]
        point["probs_speedup"] = point["torch_probs_us"] / point["kernel_probs_us"]
        res["points"].append(point)
        print(f"R={R}: top-k torch {point['torch_topk_us']:.1f} us, kernel {point['kernel_topk_us']:.1f} us; "
              f"logits_to_probs torch {point['torch_probs_us']:.1f} us, kernel {point['kernel_probs_us']:.1f} us",
              flush=True)
    return res


def build_parser() -> argparse.ArgumentParser:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", default=None, help="JSON file to write (refused if it exists, unless --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int_list, default=[1, 16, 64, 128, 256, 1024], help="row counts R")
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary size V")
    ap.add_argument("--k", type=int, default=20, help="top_k (bench_tree.py's T > 0 points use 20)")
    ap.add_argument("--top-p", type=float, default=0.95, help="top_p of the logits_to_probs variants")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--iters", type=int, default=50, help="launches per timing")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds (median)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    require_positive(ap, args, ("vocab", "k", "iters", "reps"))
    if args.k > args.vocab or args.k > 256:
        ap.error(f"--k {args.k}: must be <= --vocab ({args.vocab}) and <= 256 (the kernel's largest)")
    if not args.temperature > 0 or not 0 < args.top_p <= 1:
        ap.error(f"--temperature {args.temperature} must be > 0 and --top-p {args.top_p} in (0, 1]")
    output_arg(ap, args)
    return finish(run(args), args.output)


if __name__ == "__main__":
    raise SystemExit(main())
