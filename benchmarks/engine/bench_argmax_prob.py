"""The planner's greedy confidence kernel (``dspine.ops.argmax_prob``) against ``torch.argmax``, the only vocabulary
pass of the fixed chain's greedy step.

    python benchmarks/engine/bench_argmax_prob.py --output results/argmax-prob-h100.json
    python benchmarks/engine/bench_argmax_prob.py --device cpu --rows 2 --vocab 300 --iters 2 --reps 2 --output /tmp/a.json

For each row count R (``--rows``; a greedy chain step has B·15 rows: 15, 120, 480, 960 at batch 1, 8, 32, 64)
and bf16 logits ``[R, --vocab]`` (SmolLM2's 49,152 by default), three variants, each ``--iters`` calls captured
in one CUDA graph (the engine's steps are graphs: no host launch cost) and replayed between two ``synchronize``
calls (µs per call), round-robin in alternating order, the median over ``--reps`` rounds after one warm-up
round:

* ``torch_argmax_us``: ``logits.argmax(-1)`` (the fixed chain);
* ``one_program_us``: ``argmax_prob`` with one program per row (``PROGRAMS = 1``: the kernel before the split);
* ``split_us``: ``argmax_prob`` as shipped (the vocabulary split over S programs per row, then a combine).

The JSON has provenance, the settings, and per R the three times, ``S`` (programs per row) and
``split_minus_argmax_us`` (what the planner's chain step pays over the fixed chain's for its confidence, before the
one-launch ``plan_stats``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.bench_planner_loop import finish, int_list, require_positive  # noqa: E402
from dspine.ops import argmax_prob as ap_mod  # noqa: E402
from dspine.paths import output_arg  # noqa: E402
from dspine.provenance import provenance  # noqa: E402


def _graphed(fn, iters: int, cuda: bool):
    """``iters`` calls of ``fn`` as one CUDA graph replay (the engine replays its steps as graphs: no launch cost
    on the host), or the eager loop on the CPU."""
    if not cuda:
        return lambda: [fn() for _ in range(iters)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return graph.replay


def _time(run, iters: int, cuda: bool) -> float:
    """µs per call of the ``iters`` calls ``run`` makes, between two synchronizations."""
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    run()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e6


def median_us(fns: dict, iters: int, reps: int, cuda: bool) -> dict:
    """Per name of ``fns`` (name -> call), the median µs per call: each call ``iters`` times in one CUDA graph
    (:func:`_graphed`), timed round-robin in alternating order over ``reps`` rounds after one warm-up round (the
    module docstring's protocol; bench_topk.py's too)."""
    variants = {name: _graphed(fn, iters, cuda) for name, fn in fns.items()}
    times: dict = {name: [] for name in variants}
    for rep in range(reps + 1):
        for name in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
            t = _time(variants[name], iters, cuda)
            if rep:  # the first round warms up (compilation, autotuning)
                times[name].append(t)
    return {name: statistics.median(v) for name, v in times.items()}


def run(args) -> dict:
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    impl = "triton" if cuda else "torch"  # on the CPU a smoke run: the torch path in every variant
    res: dict = {**provenance(), "vocab": args.vocab, "iters": args.iters, "reps": args.reps, "impl": impl,
                 "programs": ap_mod.PROGRAMS, "block": ap_mod.BLOCK, "points": []}
    g = torch.Generator().manual_seed(0)
    shipped = ap_mod.PROGRAMS
    for R in args.rows:
        x = (4 * torch.randn(R, args.vocab, generator=g)).to(dev, torch.bfloat16 if cuda else torch.float32)

        def one(x=x):
            ap_mod.PROGRAMS = 1
            try:
                ap_mod.argmax_prob(x, impl=impl)
            finally:
                ap_mod.PROGRAMS = shipped

        fns = {"torch_argmax_us": lambda x=x: x.argmax(-1), "one_program_us": one,
               "split_us": lambda x=x: ap_mod.argmax_prob(x, impl=impl)}
        tiles = -(-args.vocab // ap_mod.BLOCK)
        chunk = -(-tiles // min(tiles, max(1, -(-shipped // R))))
        point = {"rows": R, "S": -(-tiles // chunk), **median_us(fns, args.iters, args.reps, cuda)}
        point["split_minus_argmax_us"] = point["split_us"] - point["torch_argmax_us"]
        res["points"].append(point)
        print(f"R={R} S={point['S']}: argmax {point['torch_argmax_us']:.1f} us, one program/row "
              f"{point['one_program_us']:.1f} us, split {point['split_us']:.1f} us", flush=True)
    return res


def build_parser() -> argparse.ArgumentParser:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", default=None, help="JSON file to write (refused if it exists, unless --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int_list, default=[15, 120, 480, 960], help="row counts R (B·15 at batch B)")
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary size V")
    ap.add_argument("--iters", type=int, default=200, help="launches per timing")
    ap.add_argument("--reps", type=int, default=7, help="timed rounds (median)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    require_positive(ap, args, ("vocab", "iters", "reps"))
    output_arg(ap, args)
    return finish(run(args), args.output)


if __name__ == "__main__":
    raise SystemExit(main())
