"""Replay of the planner's drain rule (``infer.planner``, "Drain") on batches with no queue; CPU only.

    python benchmarks/engine/sim_drain.py [--seeds 6] [--drain-model persist] [--output results/sim-drain-cpu.json]

Not a GPU measurement. Five tasks in a row, as ``infer.bench`` runs them at concurrency 64 with 64 prompts of 256
new tokens: every request starts together, so the whole decode is the batch's drain. Request i accepts each draft
token with probability ``p_i``, its mean accepted tokens per chain step ``p_i / (1 - p_i)`` drawn from a normal with
the task's mean and spread between requests (:data:`TASKS`: from the per-prompt τ of the shipped SmolLM2 draft on
the H200 at concurrency 8, T = 0, results/smollm2-h200-shipped-T0-c8.json; the spread is the variance of the
prompts' accepted tokens per step less the mean of ``ā (1 + ā) / steps``, a geometric's variance per step, so an
estimate: a truncated geometric's smaller variance gives standard deviations 0.02-0.07 larger). The tasks run in
the listed order and reversed (gsm8k, the one task where the chain finishes first, last: the spread the four
others leave must not keep the planner from it). Step times are the H200's at concurrency 64,
T = 0 (AR 1.12 ms, chain of 16 2.39 ms: ``measured_ms`` of results/verify-h200.json ``planner``); the planner is told
them exactly. Per task, as in ``infer.bench``: an untimed pass, then the planner's acceptance memory goes back to
what the earlier tasks left and the timed pass runs; the cost model carries over. Reported: milliseconds per task of
AR, the chain and the planner (the drain given every ``Engine.PLAN_DRAIN_EVERY`` = 8 steps; ``--drain-model``: its
drain model, ``infer.planner.DRAIN_MODELS``, default the planner's, ``persist``; results/sim-drain-cpu.json is
``scaled``'s, the default when it was written).

``--turns`` (with ``--narrow``): the H100's stale-state case (docs/status.md, the session of 2026-12-07, fifteenth) in
miniature: each task's requests have a prompt (:data:`TASKS_TURNS`, illustrative lengths), MT-Bench's long second
turn runs just before its first, and a step costs its table time plus ``--kv-ms`` per context token of the live
requests (prompt + committed; the default 5e-6 ms puts 38k tokens at 0.2 ms, the H100's long-context step at
concurrency 64), which the planner is told with the tokens. ``--state``: the planner's (``infer.planner.PLAN_STATES``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dspine.provenance import git_commit, utc_now  # noqa: E402
from infer.planner import DRAIN_MODELS, PLAN_STATES, StepPlanner  # noqa: E402

AR, CHAIN = ("ar", 1), ("chain", 16)
COSTS = {AR: 1.12, CHAIN: 2.39}
# --narrow: the planner's default chains beside the full one, at the H100's start-up table for concurrency 64, T = 0,
# exact (results/verify-topk-exact-h100.json, planner_choices_per_task step_ms)
COSTS_NARROW = {AR: 1.267, ("chain", 2): 1.648, ("chain", 4): 1.86, ("chain", 8): 2.33, CHAIN: 3.664}
# task, mean τ of the chain (bonus included), standard deviation of the requests' mean accepted tokens per step
# (their spread less the part a request's own step-to-step noise explains)
TASKS = [
    ("gsm8k", 3.95, 0.64),
    ("math500", 2.94, 0.72),
    ("humaneval", 2.78, 0.45),
    ("mbpp", 2.90, 0.32),
    ("mt-bench", 2.66, 0.61),
]
# --turns: (task, τ, spread, prompt tokens): the tasks above with prompts, MT-Bench's second turn (its first turn's
# conversation, ~700 tokens) before its first
TASKS_TURNS = [("gsm8k", 3.95, 0.64, 150), ("math500", 2.94, 0.72, 120), ("humaneval", 2.78, 0.45, 160),
               ("mbpp", 2.90, 0.32, 130), ("mt-bench-2", 2.66, 0.61, 700), ("mt-bench", 2.66, 0.61, 100)]


def drain_batch(costs, accept, max_new, seed, fixed=None, drain=True, every=1, planner=None,
                feed_narrow=True, lengths=None, ctx=None, kv_ms=0.0) -> float:
    """Milliseconds to finish one batch with no queue (the batch keeps its size to the end). Request i accepts
    each draft token with probability ``accept[i]`` (a chain of W commits 1 + accepted, at most W); every
    step costs its table time, which the planner is told. ``fixed``: run that mode every step instead of the
    planner; ``drain``: give the planner the batch (else it runs its throughput rule) every ``every`` steps (the
    engine: ``Engine.PLAN_DRAIN_EVERY``); ``planner``: the one to use (a fresh one by default). As in the engine, a
    chain step pairs each narrower chain of the table with min(committed, width) per request, and its tokens go
    into the drain statistics: the full chain's always, a narrower one's with ``feed_narrow`` (the engine before
    2026-12-06, fifth: not). ``lengths``: request i ends after ``lengths[i]`` tokens (at most ``max_new``; an end of
    text), while the planner is told ``max_new`` − committed as its remaining, as the engine tells it; None: every
    request runs to ``max_new``. ``ctx``: each request's prompt tokens; a step then costs ``kv_ms`` more per context
    token (prompt + committed) of its live requests, and the planner is told them (``kv``). Raises ValueError for
    ``lengths`` not one per request or a length outside 1..``max_new``."""
    if lengths is not None:
        if len(lengths) != len(accept):
            raise ValueError(f"drain_batch: {len(lengths)} lengths for {len(accept)} requests")
        bad = [x for x in lengths if not 1 <= x <= max_new]
        if bad:
            raise ValueError(f"drain_batch: lengths {bad[:3]} outside 1..max_new ({max_new})")
    rng = random.Random(seed)
    planner = planner or StepPlanner(costs)
    n = len(accept)
    rem = [max_new] * n if lengths is None else [int(x) for x in lengths]
    tok, steps, sq, ms = [0] * n, [0] * n, [0] * n, 0.0
    ends = list(rem)  # each request's length: committed = ends[i] − rem[i]

    def told(i: int) -> int:  # what the engine tells the planner: max_new − committed while running, 0 once ended
        return max_new - (ends[i] - rem[i]) if rem[i] else 0

    while any(rem):
        live = [i for i in range(n) if rem[i]]
        kv = sum(ctx[i] + ends[i] - rem[i] for i in live) if ctx is not None else None
        if fixed is None:
            give = drain and planner.step % every == 0
            mode = planner.choose(drain=[(told(i), tok[i], steps[i], sq[i]) for i in range(n)] if give else None, kv=kv)
        else:
            mode = fixed
        step_ms = costs[mode] + kv_ms * (kv or 0)
        ms += step_ms
        done = []
        stats = mode[0] != "ar" and (mode == CHAIN or feed_narrow)
        for i in live:
            a = 0
            while mode[0] != "ar" and a < mode[1] - 1 and rng.random() < accept[i]:
                a += 1
            k = min(1 + a, rem[i])
            rem[i] -= k
            done.append(k)
            if stats:
                tok[i], steps[i], sq[i] = tok[i] + k, steps[i] + 1, sq[i] + k * k
        if fixed is None:
            planner.observe(mode, sum(done) / len(live), step_ms, len(live), kv)
            if mode[0] == "chain":  # smallest first, as the engine
                for m in sorted((m for m in costs if m[0] == "chain" and m[1] < mode[1]), key=lambda m: m[1]):
                    planner.observe_paired(m, sum(min(d, m[1]) for d in done) / len(live), len(live))
    return ms


def replay_tasks(
    seed: int, tasks=TASKS, batch: int = 64, max_new: int = 256, every: int = 8, costs=None, feed_narrow: bool = True,
    drain_model: str | None = None, state: str | None = None, kv_ms: float = 0.0,
) -> dict[str, list[float]]:
    """Milliseconds per task of ``ar``, ``chain`` (the full one), each narrower chain of ``costs`` (``chainW``) and
    ``planner`` for one draw of the requests (module docstring); ``tasks``: ``(name, mean τ, standard deviation
    between requests)`` in the order run; ``costs``: the step table (default :data:`COSTS`); ``feed_narrow``: as in
    :func:`drain_batch`; ``drain_model``, ``state``: the planner's (None: its default); a task's fourth item, if any,
    its prompt tokens (``ctx`` of :func:`drain_batch`, with ``kv_ms``)."""
    planner_args = {k: v for k, v in (("drain_model", drain_model), ("state", state)) if v is not None}
    costs = costs or COSTS
    rng = random.Random(seed)
    narrow = [m for m in costs if m[0] == "chain" and m != CHAIN]
    out: dict[str, list[float]] = {"ar": [], "chain": [], **{f"chain{m[1]}": [] for m in narrow}, "planner": []}
    cost_state = token_state = None
    for k, (_, tau, sd, *prompt) in enumerate(tasks):
        accept = []
        for _ in range(batch):
            a = max(0.05, rng.gauss(tau - 1.0, sd))
            accept.append(a / (1.0 + a))
        kw = {"ctx": [prompt[0]] * batch, "kv_ms": kv_ms} if prompt else {}
        out["ar"].append(drain_batch(costs, accept, max_new, seed, fixed=AR, **kw))
        out["chain"].append(drain_batch(costs, accept, max_new, seed, fixed=CHAIN, **kw))
        for m in narrow:
            out[f"chain{m[1]}"].append(drain_batch(costs, accept, max_new, seed, fixed=m, **kw))
        passes = []
        for run_seed in (seed + 1000 + k, seed):  # untimed pass, then the timed one from the same memory
            p = StepPlanner(costs, **planner_args)
            if cost_state is not None:
                p.load_cost_state(cost_state)
            if token_state is not None:
                p.load_token_state(token_state)
            passes.append((drain_batch(costs, accept, max_new, run_seed, every=every, planner=p,
                                       feed_narrow=feed_narrow, **kw), p))
            cost_state = p.cost_state()
        ms, p = passes[1]
        out["planner"].append(ms)
        token_state = p.token_state()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=6, help="draws of the requests")
    ap.add_argument("--narrow", action="store_true",
                    help="the planner's chains of 2, 4 and 8 beside the full one, at the H100's table (COSTS_NARROW); "
                         "the planner with and without the narrower chains' steps in its drain statistics")
    ap.add_argument("--drain-model", default=None, choices=list(DRAIN_MODELS),
                    help="the planner's drain model (default: the planner's, persist)")
    ap.add_argument("--turns", action="store_true",
                    help="TASKS_TURNS: prompts, MT-Bench's long second turn before its first, a step-time term in the "
                         "context tokens (module docstring)")
    ap.add_argument("--kv-ms", type=float, default=5e-6, help="--turns: step ms per context token of the live requests")
    ap.add_argument("--state", default=None, choices=list(PLAN_STATES),
                    help="the planner's state (default: the planner's, steps)")
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.turns and not args.narrow:
        ap.error("--turns needs --narrow (the chains whose price and lead go stale)")
    if not args.kv_ms >= 0:
        ap.error(f"--kv-ms {args.kv_ms}: give milliseconds >= 0")
    costs = COSTS_NARROW if args.narrow else COSTS
    result = {
        "command": "python benchmarks/engine/sim_drain.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": "CPU (a replay: no model runs)", "date": utc_now(), "commit": git_commit(),
        "costs_ms": {f"{m[0]}{m[1]}" if m[0] == "chain" else m[0]: c for m, c in costs.items()},
        "seeds": args.seeds,
        "drain_model": args.drain_model or StepPlanner(costs).drain_model,  # the planner's default where none given
        "state": args.state or StepPlanner(costs).state, **({"kv_ms": args.kv_ms} if args.turns else {}),
        "orders": [],
    }
    for tasks in ((TASKS_TURNS,) if args.turns else (TASKS, TASKS[::-1])):
        per_task: dict = {}
        for feed in ((True, False) if args.narrow else (True,)):
            runs = [replay_tasks(s, tasks, costs=costs, feed_narrow=feed, drain_model=args.drain_model, state=args.state,
                                 kv_ms=args.kv_ms if args.turns else 0.0) for s in range(args.seeds)]
            for k in runs[0]:
                name = k if k != "planner" or not args.narrow else f"planner_{'fed' if feed else 'unfed'}"
                per_task[name] = [statistics.mean(r[k][i] for r in runs) for i in range(len(tasks))]
        total = {k: sum(v) for k, v in per_task.items()}
        print("tasks          " + " ".join(f"{t[0][:7]:>7s}" for t in tasks))
        for k, v in per_task.items():
            print(f"{k:15s}" + " ".join(f"{x:7.1f}" for x in v) + f"   total {total[k]:7.1f} ms")
        fixed = [k for k in per_task if not k.startswith("planner")]
        best = sum(min(per_task[k][i] for k in fixed) for i in range(len(tasks)))
        best_fixed = min(total[k] for k in fixed)
        order = {"tasks": [t[0] for t in tasks], "ms_per_task": per_task, "total_ms": total}
        for k in (k for k in per_task if k.startswith("planner")):
            suffix = k[len("planner"):]
            order[f"planner{suffix}_over_ar_time"] = total[k] / total["ar"]
            order[f"planner{suffix}_over_best_fixed_time"] = total[k] / best_fixed
            order[f"planner{suffix}_over_best_per_task_time"] = total[k] / best
            print(f"{k} time / AR {total[k] / total['ar']:.3f}, / best fixed {total[k] / best_fixed:.3f}, "
                  f"/ best per task {total[k] / best:.3f}")
        result["orders"].append(order)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
