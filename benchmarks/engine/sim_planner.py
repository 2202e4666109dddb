"""Replay of the verify-budget planner (``infer.planner``) on recorded step-cost tables; CPU only.

    python benchmarks/engine/sim_planner.py [--recorded verify-p1.json,...] [--seeds 16] [--scenarios ...]

Not a GPU measurement: it replays step-cost tables that ``infer.engine`` measured at start-up on an
H200 (SmolLM2-135M target with the shipped DSpine draft, ``benchmarks/engine/bench_tree.py --planner``,
commit 98956b1, 2026-12-01; :data:`H200_COSTS`, or the ``planner_choices_per_task`` of ``--recorded``
JSON files) and feeds the planner a synthetic acceptance process instead of a model. Each request
commits ``1 + a`` tokens per speculative step, ``a`` = accepted draft tokens, geometric with a per-token
acceptance chosen so that the mean is the mode's τ (:data:`TAU`, truncated at the mode's most tokens);
the planner sees the mean over the batch's requests, as from the engine.

The start-up table is not the true step time (issue 16: real H200 steps took 1.1-5× the table, not the
same factor per mode). A :class:`Mismatch` scenario (:data:`SCENARIOS`) gives the true step time
``host_ms + ctx_ms × context / 1000 + table × (ar_scale | spec_scale)`` (context = ``prompt`` + tokens
so far: the KV read grows along the output, the same for every mode), the step time the planner is
told (true × lognormal timer noise, ``spikes`` of the steps 5× longer: GC, preemption) and an optional
confidence: per step, predicted tokens of every speculative mode = ``1 + over × (τ − 1)`` × noise, i.e.
``over`` × too confident (``conf="mode"``, the default). ``conf="engine"`` (``--conf engine``) gives it as
``infer.engine`` does: after a speculative step is observed, one value for every speculative mode, the
chain's ``1 + over × (τ_chain − 1)`` × noise at that step's acceptance (the draft's view of the block it
drafted), nothing after an AR step; its noise has its own random stream. ``lag`` (``--lag``, default 1 as
in the engine's pipelined loop) is how many steps later than its choice a step is observed: the planner
chooses step k before it sees step k - 1. Two planners run on every point: ``table``, the start-up table alone (what the
engine did before online costs), and ``online``, told the measured step time and the confidence.
Throughput is expected tokens ÷ summed true step milliseconds, and every fixed mode runs through the
same context growth, so the comparison with the fixed modes carries no sampling noise of its own; one
run decodes ``--new-tokens`` per request. Prefill and the batch's tail are not modelled.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections import deque
from dataclasses import asdict, dataclass, replace
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


@dataclass(frozen=True)
class Mismatch:
    """True and measured step time, and the confidence, of one scenario (module docstring)."""

    ar_scale: float = 1.0  # true ÷ table step time of AR
    spec_scale: float = 1.0  # true ÷ table step time of the chain and the trees
    host_ms: float = 0.0  # per-step host time outside the measured graph replay, every mode
    ctx_ms: float = 0.0  # ms per 1000 tokens of context per step, every mode (KV read)
    prompt: int = 200  # context tokens before the first output token
    noise: float = 0.0  # lognormal sigma of the measured step time
    spikes: float = 0.0  # fraction of steps measured 5 × too long
    over: float | None = None  # confidence: predicted accepted tokens = over × true (None: no confidence)
    conf: str = "mode"  # "mode": per mode, this step's τ; "engine": the chain's, of the last observed step
    lag: int = 1  # steps between a choice and its observation (infer.engine's pipelined loop: 1)

    def true_ms(self, mode, table_ms: float, done: float) -> float:
        scale = self.ar_scale if mode[0] == "ar" else self.spec_scale
        return self.host_ms + self.ctx_ms * (self.prompt + done) / 1000 + table_ms * scale


# Named scenarios. "h200" matches the end-to-end ratios of the issue 16 run at concurrency 1, T = 0
# (true ÷ table: AR 1.35, chain 1.65): speculative steps underestimated more than AR. "spec-slow" is the
# same with the gap of sampling at T > 0 over many verified tokens; "host" an additive host time (favours
# the speculative modes); "spec-fast" the table overestimating speculative steps relative to AR (the
# c8/c32 T = 1 ratios of the same run). Every scenario has timer noise and an overconfident draft.
NOISY = dict(noise=0.05, spikes=0.01, over=1.6)
SCENARIOS = {
    "table": Mismatch(),
    "h200": Mismatch(ar_scale=1.35, spec_scale=1.65, ctx_ms=0.1, **NOISY),
    "spec-slow": Mismatch(ar_scale=1.2, spec_scale=1.8, ctx_ms=0.2, **NOISY),
    "host": Mismatch(host_ms=1.0, ctx_ms=0.2, **NOISY),
    "spec-fast": Mismatch(ar_scale=2.0, spec_scale=1.7, **NOISY),
}


def simulate(
    costs: dict,
    taus,
    batch: int,
    new_tokens: int = 512,
    seed: int = 0,
    mismatch: Mismatch | None = None,
    online: bool = True,
    **rule,
) -> dict:
    """Run the planner until each of ``batch`` requests committed ``new_tokens``.

    ``taus``: mean tokens per mode, or a function ``tokens so far -> {mode: tau}`` (acceptance that
    changes along the output). ``online``: tell the planner the measured step time and the confidence
    of ``mismatch`` (default: none, the table is the truth). Returns ``{"tok_per_ms", "steps": {mode: n},
    "planner"}``; ``tok_per_ms`` = Σ τ(chosen mode) ÷ Σ true step ms.
    """
    mm = mismatch or Mismatch()
    if mm.conf not in ("mode", "engine"):
        raise ValueError(f"Mismatch.conf={mm.conf!r} must be 'mode' or 'engine'")
    if mm.lag < 0:
        raise ValueError(f"Mismatch.lag={mm.lag}: must be >= 0")
    rng, conf_rng = random.Random(seed), random.Random(seed + 1)
    planner = StepPlanner(costs, **rule)
    chain = next((m for m in costs if m[0] == "chain"), None)
    done = tok = ms = 0.0
    prev = None  # (mode, τ per mode) of the last observed step (conf="engine": its confidence is given)
    backlog: deque = deque()  # steps run and not yet observed (mm.lag of them)
    while done < new_tokens:
        tau = taus(done) if callable(taus) else taus
        predicted = None
        if online and mm.over is not None and mm.conf == "mode":
            predicted = {
                m: 1 + mm.over * (tau[m] - 1) * rng.lognormvariate(0, 0.1) for m in costs if m[0] != "ar"
            }
        elif online and mm.over is not None and chain is not None and prev is not None and prev[0][0] != "ar":
            c = 1 + mm.over * (prev[1][chain] - 1) * conf_rng.lognormvariate(0, 0.1)
            predicted = {m: c for m in costs if m[0] != "ar"}
        mode = planner.choose(predicted)
        most = max_tokens(mode, costs)
        # a tree step: the chain's draw (what the chain would have committed: its paired observation) plus the
        # tree's lead over the chain, floor(lead) + Bernoulli(frac(lead)) tokens, within the tree's depth
        tree = mode[0] == "tree" and chain is not None
        p = accept_prob(tau[chain if tree else mode], max_tokens(chain, costs) if tree else most)
        lead = tau[mode] - tau[chain] if tree else 0.0
        committed = chain_count = 0
        for _ in range(batch):
            n = 1
            while n < (chain[1] if tree else most) and mode[0] != "ar" and rng.random() < p:
                n += 1
            chain_count += n
            if tree:
                n = min(most, n + int(lead) + (rng.random() < lead - int(lead)))
            committed += n
        true = mm.true_ms(mode, costs[mode], done)
        seen = true * rng.lognormvariate(0, mm.noise) * (5.0 if rng.random() < mm.spikes else 1.0)
        backlog.append((mode, committed / batch, seen, tau, chain_count / batch if tree else None))
        if len(backlog) > mm.lag:  # the engine observes step k - lag after launching step k
            m0, c0, s0, tau0, paired = backlog.popleft()
            planner.observe(m0, c0, s0 if online else None, batch)
            if paired is not None:  # infer.engine gives it after every tree step (its chain is whole)
                planner.observe_paired(chain, paired, batch)
            prev = (m0, tau0)
        done += committed / batch
        tok += tau[mode]
        ms += true
    steps = {f"{m[0]}{m[1]}": n for m, n in planner.choices.items()}
    return {"tok_per_ms": tok / ms, "steps": steps, "planner": planner}


def fixed_rate(
    mode, costs: dict, tau: float, mismatch: Mismatch | None = None, new_tokens: int = 512
) -> float:
    """Tokens per true millisecond of always ``mode`` (τ tokens a step) through the same context growth."""
    mm = mismatch or Mismatch()
    done = ms = 0.0
    while done < new_tokens:
        ms += mm.true_ms(mode, costs[mode], done)
        done += tau
    return done / ms


def replay(
    costs: dict,
    taus: dict,
    batch: int,
    seeds: int = 5,
    new_tokens: int = 512,
    mismatch: Mismatch | None = None,
    online: bool = True,
    **rule,
) -> dict:
    """Planner against AR and the best fixed mode on one cost table, mean over ``seeds`` runs."""
    fixed = {m: fixed_rate(m, costs, taus[m], mismatch, new_tokens) for m in costs}
    runs = [simulate(costs, taus, batch, new_tokens, seed, mismatch, online, **rule) for seed in range(seeds)]
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
    ap.add_argument(
        "--scenarios",
        default="table,h200,spec-slow,host,spec-fast",
        help=f"comma-separated, of {sorted(SCENARIOS)}",
    )
    ap.add_argument(
        "--conf",
        choices=("mode", "engine"),
        default=None,
        help="confidence of every scenario: per mode this step ('mode'), or as the engine gives it ('engine')",
    )
    ap.add_argument(
        "--lag", type=int, default=1, help="steps between a choice and its observation (the engine's loop: 1)"
    )
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.lag < 0:
        ap.error(f"--lag {args.lag}: must be >= 0")
    scenarios = {
        k: replace(v, conf=args.conf or v.conf, lag=args.lag) for k, v in SCENARIOS.items()
    }
    tables = (
        recorded_tables(args.recorded.split(","))
        if args.recorded
        else {k: dict(zip(MODES, v)) for k, v in H200_COSTS.items()}
    )
    rows = []
    for name in args.scenarios.split(","):
        mm = scenarios[name]
        for (c, t), costs in sorted(tables.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            taus = {m: TAU[t][MODES.index(m)] for m in costs}
            row = {"scenario": name, "concurrency": c, "temperature": t}
            for planner, online in (("table", False), ("online", True)):
                r = replay(costs, taus, c, args.seeds, args.new_tokens, mm, online, share=args.share)
                row[planner] = r
            rows.append(row)
            tb, on = row["table"], row["online"]
            print(
                f"{name:<9} c{c:<3} T{t}  best {on['best_fixed']:<7} "
                f"table-only /best {tb['planner_over_best']:.3f} /AR {tb['planner_over_ar']:.3f} | "
                f"online /best {on['planner_over_best']:.3f} (worst seed {on['worst_over_best']:.3f}) "
                f"/AR {on['planner_over_ar']:.3f}  steps {on['steps']}"
            )
    if args.output:
        scen = {k: asdict(v) for k, v in scenarios.items()}
        from dspine.provenance import command_line, git_commit, utc_now

        meta = {"command": command_line([__file__, *(argv if argv is not None else sys.argv[1:])]),
                "device": "CPU (a replay: no model runs)", "date": utc_now(), "commit": git_commit(),
                "seeds": args.seeds}
        Path(args.output).write_text(
            json.dumps({**meta, "simulated": True, "scenarios": scen, "points": rows}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
