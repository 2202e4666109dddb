"""The planner's AR step with and without the deferred draft-context append, against the plain AR step.

    python benchmarks/engine/bench_planner_ar.py --output results/planner-ar-h200.json
    python benchmarks/engine/bench_planner_ar.py --tiny --device cpu --output /tmp/planner-ar.json   # smoke (seconds)

Random weights, no checkpoint (``bench_draft_step.random_target`` / ``random_draft``): the SmolLM2-135M
target shape (bf16 on CUDA, fp32 on the CPU; ``--tiny``: the tiny shape) and its 3-layer DSpine draft
(residual injection, rank 128, block 16), an engine with ``budget="auto"`` and a ``--context``-token
(512; ``--tiny``: 32) prompt prefilled into every row (target KV cache and draft context). Per batch size
(``--batches``) and temperature (``--temperatures``; T > 0 with top_p 0.95, top_k 20), each of these is
one runner of the engine (a CUDA graph replay where the engine uses graphs: by default on CUDA), on idle
rows (the step does all its work and changes no state, so every replay is the same step):

* ``plain_ar_ms``: the AR step of an engine without the draft (``_runner(B, params, False)``);
* ``immediate_ar_ms``: the planner's AR step appending its features to the draft context every step
  (``defer_ar_append = False``: fc GEMM, RMSNorm, index math, per draft layer a K/V GEMM and the cache write);
* ``deferred_ar_ms``: the planner's AR step leaving its features pending (the default);
* ``flush_ms``: the flush of F = ``Engine.AR_DEFER`` pending rows per slot (once per F AR steps at most).

Timing: the variants round-robin in alternating order, each round ``--iters`` replays between two
``synchronize`` calls (host wall clock); the first ``--warmup`` rounds dropped, the median over ``--reps``
rounds. Derived: ``deferred_plus_flush_over_F_ms`` = deferred + flush / F (an AR stretch of F steps) and
each variant over ``plain_ar_ms``. JSON: provenance, settings, ``flush_rows`` (F) and per point
``batch{B}.T{t}``; one summary line per point on stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.bench_draft_step import random_setup  # noqa: E402
from benchmarks.engine.bench_planner_loop import int_list, params_for, temp_list, write  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.sampling import SamplingParams  # noqa: E402
from infer.engine import Engine  # noqa: E402

VARIANTS = ("plain_ar", "immediate_ar", "deferred_ar", "flush")


def wall_ms_per_call(fn, iters: int, dev) -> float:
    """Host wall milliseconds per call of ``iters`` calls between two device synchronisations."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t) * 1e3 / iters


def median_ms(fns: dict, iters: int, reps: int, warmup: int, dev) -> dict:
    """Median ms per call of each fn over ``reps`` rounds, round-robin in alternating order after ``warmup``
    dropped rounds."""
    times: dict = {k: [] for k in fns}
    names = list(fns)
    for r in range(warmup + reps):
        for name in names if r % 2 == 0 else names[::-1]:
            ms = wall_ms_per_call(fns[name], iters, dev)
            if r >= warmup:
                times[name].append(ms)
    return {k: statistics.median(v) for k, v in times.items()}


def sampling(t: float) -> SamplingParams:
    return params_for(t, 16)


def runners(eng: Engine, B: int, params: SamplingParams) -> dict:
    """The four variants' runners at batch B (built before the rows are admitted: a capture resets them)."""
    ar = ("ar", 1)
    eng.defer_ar_append = False
    immediate = eng._runner(B, params, True, ar)
    eng.defer_ar_append = True
    return {
        "plain_ar": eng._runner(B, params, False),
        "immediate_ar": immediate,
        "deferred_ar": eng._runner(B, params, True, ar),
        "flush": eng._runner(B, params, True, ("flush", eng._slots_for(B).pend_max)),
    }


@torch.inference_mode()
def run(args) -> dict:
    shape = "tiny" if args.tiny else "smollm2"
    dev, dtype, impl, a, d, draft, target = random_setup(args.device, shape)
    cuda = dev.type == "cuda"
    res: dict = {
        **provenance(),
        "shape": shape,
        "dtype": str(dtype),
        "impl": impl,
        "cuda_graphs": cuda,
        "context": args.context,
        "iters": args.iters,
        "reps": args.reps,
        "warmup_rounds": args.warmup,
        "draft_layers": d["layers"],
        "block_size": draft.config.block_size,
        "flush_rows": Engine.AR_DEFER,
        "batches": args.batches,
        "temperatures": args.temperatures,
    }
    g = torch.Generator().manual_seed(1)
    for B in args.batches:
        prompts = [
            torch.randint(0, a.vocab_size - 2, (args.context,), generator=g).tolist() for _ in range(B)
        ]
        eng = Engine(
            target, draft, [-1], max_batch=B, max_seq=args.context + 64, max_new_cap=16, budget="auto"
        )
        F = eng._slots_for(B).pend_max
        fns = {t: runners(eng, B, sampling(t)) for t in args.temperatures}  # every capture before the prefill
        s = eng._slots_for(B)
        kv, dcache = eng._cache_view(B)
        greedy = sampling(0.0)
        for i in range(0, B, 8):  # prefill: the target KV cache and the draft context of every row
            rows = list(range(i, min(i + 8, B)))
            eng._admit(s, [(b, prompts[b]) for b in rows], greedy, True, kv, dcache, rows)
        s.done.fill_(1)  # idle rows: each replay does the step's work and changes nothing
        assert int(s.lengths.min()) == args.context and not s.pend_count.any()
        row: dict = {}
        for t in args.temperatures:
            ms = median_ms(fns[t], args.iters, args.reps, args.warmup, dev)
            point = {f"{k}_ms": ms[k] for k in VARIANTS}
            point["deferred_plus_flush_over_F_ms"] = ms["deferred_ar"] + ms["flush"] / F
            for k in ("immediate_ar", "deferred_ar", "deferred_plus_flush_over_F"):
                point[f"{k}_over_plain_ar"] = point[f"{k}_ms"] / ms["plain_ar"]
            row[f"T{t:g}"] = point
            print(
                f"batch {B} T={t:g}: plain AR {ms['plain_ar']:.4f} ms, immediate {ms['immediate_ar']:.4f} "
                f"({point['immediate_ar_over_plain_ar']:.3f}x), deferred {ms['deferred_ar']:.4f} "
                f"({point['deferred_ar_over_plain_ar']:.3f}x), flush {ms['flush']:.4f}, deferred + flush/{F} "
                f"{point['deferred_plus_flush_over_F_ms']:.4f} ({point['deferred_plus_flush_over_F_over_plain_ar']:.3f}x)",
                flush=True,
            )
        res[f"batch{B}"] = row
        del eng, fns
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None, help="JSON file to write")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shape instead of SmolLM2-135M (CPU smoke test)")
    ap.add_argument("--batches", type=int_list, default=[1, 8, 32, 64], help="comma-separated batch sizes")
    ap.add_argument(
        "--temperatures",
        type=temp_list,
        default=[0.0, 1.0],
        help="comma-separated; T > 0 samples with top_p 0.95, top_k 20",
    )
    ap.add_argument(
        "--context", type=int, default=None, help="prompt tokens per row (default 512; --tiny 32)"
    )
    ap.add_argument("--iters", type=int, default=None, help="replays per timing (default 100; --tiny 5)")
    ap.add_argument(
        "--reps", type=int, default=None, help="timed rounds per variant, alternating order (10; --tiny 3)"
    )
    ap.add_argument(
        "--warmup", type=int, default=None, help="rounds dropped before timing (default 2; --tiny 1)"
    )
    args = ap.parse_args(argv)
    for name, full, tiny in (("context", 512, 32), ("iters", 100, 5), ("reps", 10, 3), ("warmup", 2, 1)):
        if getattr(args, name) is None:  # --tiny: a smoke run of seconds on the CPU
            setattr(args, name, tiny if args.tiny else full)
    if min(args.context, args.iters, args.reps) < 1 or args.warmup < 0:
        ap.error("--context, --iters and --reps must be >= 1, --warmup >= 0")
    res = run(args)
    if args.output:
        write(res, args.output)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
