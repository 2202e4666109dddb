"""The planner's drain models with trees, replayed on the CPU (``infer.planner``, "Drain"; issue 16).

    python benchmarks/engine/sim_drain_trees.py [--seeds 6] [--output results/sim-drain-trees-cpu.json]

Not a GPU measurement: a model of the concurrency-8 runs of results/planner-sizes-h200-T0-c8.json, written to see
what the drain model ``"lead"`` (a tree as the request's chain plus its lead) might change before an H200 A/B; that
A/B (results/planner-exact-h200.json, label ``pl``) put it level with or below ``"scaled"``, and it was removed
(results/sim-drain-trees-cpu.json, written before, has its ``planner_lead``). It runs the planner under every model of
``infer.planner.DRAIN_MODELS``.
Per task (:data:`sim_drain.TASKS`: mean chain τ and spread between requests of the shipped SmolLM2 draft, T = 0),
16 requests of 512 new tokens go through 8 slots: a finished request's slot takes the next one while any waits,
then the batch drains (the planner gets the batch every ``Engine.PLAN_DRAIN_EVERY`` = 8 steps, as the engine gives
it). Request i accepts each draft token of the chain with probability ``p_i`` (at most 15); a tree of n nodes
commits what the chain would have plus ``e``, and the planner gets that step's chain part as a paired observation,
as the engine does. Two laws for ``e`` (the truth the planner does not know):

- ``lead``: Poisson with the tree's mean lead over the chain (tree of 16: 0.64, of 32: 0.90 tokens per step: the
  concurrency-8 fits of results/tree-lead-fit-h200.json), whatever the request's acceptance;
- ``scaled``: Binomial(accepted chain tokens, k − 1) (k 1.14 and 1.27, the same fits' scaled model), so a
  request's tree gains in proportion to its chain.

Step costs are the H200's measured milliseconds at concurrency 8, T = 0 (:data:`COSTS`); the planner is told them
exactly, so what differs between the planners is the drain model alone. Per task, as ``infer.bench`` does: an
untimed pass, then the timed one from the acceptance memory the earlier tasks left; the cost model carries over.
Reported per law: milliseconds per task of every fixed mode and of the planner with each drain model, and each
planner's time ÷ the best fixed mode's (the issue's measure, inverted: below 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.sim_drain import TASKS  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from infer.planner import DRAIN_MODELS, StepPlanner  # noqa: E402

AR, CHAIN, TREE16, TREE32 = ("ar", 1), ("chain", 16), ("tree", 16), ("tree", 32)
# measured_ms of the planner's report, concurrency 8, T = 0, H200 (results/planner-sizes-h200-T0-c8.json, mean
# over the five tasks; tree 16 from the plan_trees=16/32 planner of the same runs)
COSTS = {AR: 1.01, CHAIN: 1.48, TREE16: 1.71, TREE32: 1.95}
# per tree: (mean lead over the chain, tokens per step; the scaled model's k): results/tree-lead-fit-h200.json,
# concurrency 8
TREES = {TREE16: (0.64, 1.14), TREE32: (0.90, 1.27)}
LAWS = ("lead", "scaled")
EVERY = 8  # Engine.PLAN_DRAIN_EVERY


def _poisson(rng: random.Random, mean: float) -> int:
    """Knuth's product-of-uniforms draw (mean below a few tokens here)."""
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def run_batch(accept, seed, law, slots=8, max_new=512, fixed=None, planner=None) -> float:
    """Milliseconds to finish ``len(accept)`` requests through ``slots`` slots (module docstring). ``fixed``: that
    mode every step; else ``planner`` chooses (drain given every :data:`EVERY` choices once no request waits)."""
    rng = random.Random(seed)
    queue = list(range(len(accept)))
    slot = [queue.pop(0) for _ in range(min(slots, len(queue)))]  # request per slot, None once idle
    rem = {i: max_new for i in range(len(accept))}
    stats = {i: [0, 0, 0] for i in range(len(accept))}  # chain tokens, chain steps, tokens² (the drain's counts)
    ms, age = 0.0, 0
    while any(r is not None and rem[r] for r in slot):
        live = [r for r in slot if r is not None and rem[r]]
        if fixed is None:
            drain = None
            if not queue and age % EVERY == 0:
                # one entry per slot, in slot order (an idle slot's zeros): drain model "persist" matches by position
                drain = [(rem[r], *stats[r]) if r is not None else (0, 0, 0, 0) for r in slot]
            mode = planner.choose(drain=drain)
            if drain is not None or age:
                age += 1
        else:
            mode = fixed
        ms += COSTS[mode]
        done, chain_part = [], []
        for r in live:
            a = 0
            while mode[0] != "ar" and a < 15 and rng.random() < accept[r]:
                a += 1
            extra = 0
            if mode in TREES:
                lead, k = TREES[mode]
                extra = _poisson(rng, lead) if law == "lead" else sum(rng.random() < k - 1.0 for _ in range(a))
            c = min(1 + a, rem[r])  # what the chain commits (paired)
            got = min(1 + a + extra, 16, rem[r])
            rem[r] -= got
            done.append(got)
            if mode[0] != "ar":
                s = stats[r]
                s[0], s[1], s[2] = s[0] + c, s[1] + 1, s[2] + c * c
                chain_part.append(c)
        if fixed is None:
            planner.observe(mode, sum(done) / len(live), COSTS[mode], len(live))
            if mode in TREES:
                planner.observe_paired(CHAIN, sum(chain_part) / len(live), len(live))
        for b, r in enumerate(slot):  # refill finished slots while requests wait
            if r is not None and not rem[r]:
                slot[b] = queue.pop(0) if queue else None
    return ms


def replay(seed: int, law: str, tasks=TASKS, prompts: int = 16) -> dict[str, list[float]]:
    """Milliseconds per task of every fixed mode and of the planner with each drain model, one draw of the
    requests (module docstring)."""
    rng = random.Random(seed)
    names = {AR: "ar", CHAIN: "chain16", TREE16: "tree16", TREE32: "tree32"}
    out: dict[str, list[float]] = {**{v: [] for v in names.values()}, **{f"planner_{d}": [] for d in DRAIN_MODELS}}
    memory = {d: (None, None) for d in DRAIN_MODELS}  # cost state, token state carried between tasks
    for k, (_, tau, sd) in enumerate(tasks):
        accept = []
        for _ in range(prompts):
            a = max(0.05, rng.gauss(tau - 1.0, sd))
            accept.append(a / (1.0 + a))
        for m, name in names.items():
            out[name].append(run_batch(accept, seed, law, fixed=m))
        for d in DRAIN_MODELS:
            passes = []
            for run_seed in (seed + 1000 + k, seed):  # untimed pass, then the timed one from the same memory
                p = StepPlanner(COSTS, drain_model=d)
                cost_state, token_state = memory[d]
                if cost_state is not None:
                    p.load_cost_state(cost_state)
                if token_state is not None:
                    p.load_token_state(token_state)
                passes.append((run_batch(accept, run_seed, law, planner=p), p))
                memory[d] = (p.cost_state(), token_state)
            ms, p = passes[1]
            out[f"planner_{d}"].append(ms)
            memory[d] = (memory[d][0], p.token_state())
    return out


def summarize(runs: list[dict[str, list[float]]], tasks=TASKS) -> dict:
    """Mean milliseconds per task over the draws and each planner's total ÷ the best fixed mode's total."""
    per_task = {k: [statistics.mean(r[k][i] for r in runs) for i in range(len(tasks))] for k in runs[0]}
    total = {k: sum(v) for k, v in per_task.items()}
    fixed = [k for k in total if not k.startswith("planner")]
    best = min(fixed, key=total.get)
    return {
        "tasks": [t[0] for t in tasks],
        "ms_per_task": per_task,
        "total_ms": total,
        "best_fixed": best,
        "planner_time_over_best_fixed": {k: total[k] / total[best] for k in total if k.startswith("planner")},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=6, help="draws of the requests (each law)")
    ap.add_argument("--output", default=None, help="write the results as JSON here (refuses an existing file)")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds {args.seeds}: must be >= 1")
    if args.output and Path(args.output).exists():
        ap.error(f"--output {args.output}: exists; remove it or name another file")
    result = {
        **provenance([__file__, *(argv if argv is not None else sys.argv[1:])]),
        "note": "CPU model, not a GPU measurement (module docstring)",
        "costs_ms": {f"{m[0]}{m[1] if m[0] != 'ar' else ''}": c for m, c in COSTS.items()},
        "trees": {f"tree{m[1]}": {"lead": lead, "k": k} for m, (lead, k) in TREES.items()},
        "seeds": args.seeds,
        "laws": {},
    }
    for law in LAWS:
        res = summarize([replay(s, law) for s in range(args.seeds)])
        result["laws"][law] = res
        print(f"law {law}: best fixed {res['best_fixed']}")
        print("tasks          " + " ".join(f"{t[:8]:>8s}" for t in res["tasks"]))
        for k, v in res["ms_per_task"].items():
            print(f"{k:15s}" + " ".join(f"{x:8.1f}" for x in v) + f"   total {res['total_ms'][k]:8.1f} ms")
        print("planner time / best fixed: " + ", ".join(
            f"{k} {v:.3f}" for k, v in res["planner_time_over_best_fixed"].items()))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
