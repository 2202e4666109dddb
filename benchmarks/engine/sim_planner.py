"""Replay of the verify-budget planner (``infer.planner``) on recorded step-cost tables; CPU only.

    python benchmarks/engine/sim_planner.py [--recorded verify-p1.json,verify-p8.json,...] [--seeds 16]

Not a GPU measurement: it replays step-cost tables that ``infer.engine`` measured at start-up on an
H200 (SmolLM2-135M target with the shipped DSpine draft, ``benchmarks/engine/bench_tree.py --planner``,
commit 98956b1, 2026-12-01; :data:`H200_COSTS`, or the ``planner_choices_per_task`` of ``--recorded``
JSON files) and feeds the planner a synthetic acceptance process instead of a model. Each request
commits ``1 + a`` tokens per speculative step, ``a`` = accepted draft tokens, geometric with a per-token
acceptance chosen so that the mean is the mode's τ (:data:`TAU`, truncated at the mode's most tokens);
the planner sees the mean over the batch's requests, as from the engine. Throughput is expected tokens
÷ summed step milliseconds, so the comparison with the fixed modes (τ ÷ step time) carries no sampling
noise of its own; one run decodes ``--new-tokens`` per request. The step time outside the measured
step (host loop, prefill, the batch's tail) is not modelled.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from infer.planner import StepPlanner, max_tokens  # noqa: E402

MODES = [("ar", 1), ("chain", 16), ("tree", 32), ("tree", 64)]
# (concurrency, temperature) -> start-up step ms of MODES (engine graph replays, H200, issue 16)
H200_COSTS = {
    (1, 0): (0.978, 1.204, 2.819, 2.947),
    (1, 1): (1.226, 2.032, 5.221, 6.839),
    (8, 0): (0.996, 1.453, 3.388, 3.691),
    (8, 1): (1.345, 3.888, 8.103, 11.408),
    (32, 0): (1.023, 2.058, 4.983, 5.703),
    (32, 1): (1.531, 10.078, 17.958, 26.358),
    (64, 0): (1.008, 2.697, 6.407, 8.284),
    (64, 1): (1.766, 17.965, 30.394, 46.914),
}
# temperature -> committed tokens per request per step of MODES. Chain (2.08 at T = 0) and tree32 (2.74)
# from the same H200 run (bench_tree.py, 5 tasks, concurrency 1); chain at T = 1 from the engine's
# acceptance at T = 1; the trees at T = 1 and tree64 are guesses (≈ 1.3 × the chain).
TAU = {0: (1.0, 2.1, 2.7, 2.9), 1: (1.0, 1.7, 2.2, 2.3)}


def accept_prob(tau: float, most: int) -> float:
    """Per-token acceptance p with E[1 + min(Geometric(p), most - 1)] = tau (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        mean = (1 - p**most) / (1 - p)  # 1 + p + ... + p^(most-1)
        lo, hi = (p, hi) if mean < tau else (lo, p)
    return lo


def simulate(costs: dict, taus, batch: int, new_tokens: int = 512, seed: int = 0, **rule) -> dict:
    """Run the planner until each of ``batch`` requests committed ``new_tokens``.

    ``taus``: mean tokens per mode, or a function ``tokens so far -> {mode: tau}`` (acceptance that
    changes along the output). Returns ``{"tok_per_ms", "steps": {mode: n}}``; ``tok_per_ms`` =
    Σ τ(chosen mode) ÷ Σ step ms.
    """
    rng = random.Random(seed)
    planner = StepPlanner(costs, **rule)
    done = tok = ms = 0.0
    while done < new_tokens:
        tau = taus(done) if callable(taus) else taus
        mode = planner.choose()
        most = max_tokens(mode, costs)
        p = accept_prob(tau[mode], most) if mode[0] != "ar" else 0.0
        committed = 0
        for _ in range(batch):
            n = 1
            while n < most and rng.random() < p:
                n += 1
            committed += n
        planner.observe(mode, committed / batch)
        done += committed / batch
        tok += tau[mode]
        ms += costs[mode]
    return {"tok_per_ms": tok / ms, "steps": {f"{m[0]}{m[1]}": n for m, n in planner.choices.items()}}


def replay(costs: dict, taus: dict, batch: int, seeds: int = 5, new_tokens: int = 512, **rule) -> dict:
    """Planner against AR and the best fixed mode on one cost table, mean over ``seeds`` runs."""
    fixed = {m: taus[m] / costs[m] for m in costs}
    runs = [simulate(costs, taus, batch, new_tokens, seed, **rule) for seed in range(seeds)]
    rates = [r["tok_per_ms"] for r in runs]
    best = max(fixed, key=fixed.get)
    return {
        "best_fixed": f"{best[0]}{best[1]}",
        "planner_over_best": sum(rates) / len(rates) / fixed[best],
        "worst_over_best": min(rates) / fixed[best],
        "planner_over_ar": min(rates) / fixed[("ar", 1)],
        "steps": runs[0]["steps"],
    }


def recorded_tables(paths: list[str]) -> dict:
    """``(concurrency, temperature) -> MODES step ms`` from bench_tree.py ``--planner`` JSON files."""
    out = {}
    for path in paths:
        for point in json.loads(Path(path).read_text())["planner"]:
            first = point["planner_choices_per_task"][0]  # {"ar": {"step_ms", ...}, "chain16": ...}
            modes = {
                k: (m.group(1), int(m.group(2) or 1))
                for k in first
                for m in [re.fullmatch(r"([a-z]+)(\d*)", k)]
            }
            out[(point["concurrency"], round(point["temperature"]))] = {
                modes[k]: v["step_ms"] for k, v in first.items()
            }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Replays recorded cost tables; not a GPU measurement (see the module docstring).",
    )
    ap.add_argument(
        "--recorded",
        default=None,
        metavar="JSON,...",
        help="bench_tree.py --planner outputs to take the cost tables from (default: the H200 tables)",
    )
    ap.add_argument("--seeds", type=int, default=16, help="runs per point (different acceptance draws)")
    ap.add_argument("--new-tokens", type=int, default=512, help="tokens per request in one run")
    ap.add_argument("--share", type=float, default=0.005, help="the planner's probe time share")
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    tables = (
        recorded_tables(args.recorded.split(","))
        if args.recorded
        else {k: dict(zip(MODES, v)) for k, v in H200_COSTS.items()}
    )
    rows = []
    for (c, t), costs in sorted(tables.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        taus = {m: TAU[t][MODES.index(m)] for m in costs}
        r = replay(costs, taus, c, args.seeds, args.new_tokens, share=args.share)
        rows.append({"concurrency": c, "temperature": t, **r})
        print(
            f"c{c:<3} T{t}  best {r['best_fixed']:<8} planner/best {r['planner_over_best']:.3f} "
            f"(worst seed {r['worst_over_best']:.3f})  planner/AR {r['planner_over_ar']:.3f}  steps {r['steps']}"
        )
    if args.output:
        Path(args.output).write_text(json.dumps({"simulated": True, "points": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
