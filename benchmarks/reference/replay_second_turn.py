"""CPU replay of infer.bench --mix's two calls: the mixed first-turn call, then MT-Bench's second turns as a batch of
their own (64 requests admitted at once, a drain from its first step), the planner's token state carried from the first
call as the engine carries it. The trace has no second turns: their proxy is MT-Bench's first-turn rows. --mode pertask:
the five tasks' calls in a row, then the same proxy call. --carry none/cap rewrite the carried "spread_rel" (none: the
no-call prior; cap: at most it), --early sets infer.planner.PERSIST_EARLY. Prints each model's pooled tok/s over the
calls ÷ the fixed chain of 4's, per call the ratio, the planner's steps and the spread it carries on. Investigation tool
(2026-12-07, the mixed-batch discrepancy), not a GPU measurement:

    PYTHONPATH=. python benchmarks/reference/replay_second_turn.py --costs results/planner-cost-h100-exact-T0-c64.json \
        --models scaled,persist,persist_cap --mode mix [--shuffle SEED]
"""
import json, sys, argparse
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import planner_trace as pt
from infer.datasets import interleave
from infer.planner import StepPlanner, parse_plan_chains

ap = argparse.ArgumentParser()
ap.add_argument("--costs"); ap.add_argument("--label", default="p"); ap.add_argument("--repeat", type=int, default=4)
ap.add_argument("--models", default="scaled,persist"); ap.add_argument("--mode", default="mix")  # mix | pertask
ap.add_argument("--t2task", default="mt-bench"); ap.add_argument("--extra", default="{}")
ap.add_argument("--shuffle", type=int, default=-1)
ap.add_argument("--early", type=int, default=16); ap.add_argument("--carry", default="keep")
a = ap.parse_args()
trace = json.load(open("results/planner-trace16-cpu.json"))
table, true_ms = pt.step_times(a.costs, a.label)
B = int(json.load(open(a.costs))["args"].get("max_batch") or json.load(open(a.costs))["args"]["concurrency"])
verify, max_new = trace["block_size"], trace["max_new_tokens"]
plan = [("ar", 1), ("chain", 2), ("chain", 4), ("chain", 8), ("chain", verify)]
tasks = {}
for _ in range(a.repeat):
    for row in trace["prompts"]:
        if row["tokens"] > 1:
            tasks.setdefault(row["task"], []).append(row)
t2 = tasks[a.t2task][:64]  # infer.bench: 64 second turns, queued past B
if a.shuffle >= 0:
    import random
    for k in tasks: random.Random(a.shuffle).shuffle(tasks[k])
calls = [("mixed", interleave(list(tasks.values()))), ("turn2", t2)] if a.mode == "mix" else \
        [(t, r) for t, r in tasks.items()] + [("turn2", t2)]
extra = json.loads(a.extra)
import infer.planner as IP; IP.PERSIST_EARLY = a.early
def fixed(rows, m):
    tok, x, _ = pt.batch_ms(rows, B, true_ms, verify, max_new, mode=m); return tok, x
fx = {m: [fixed(r, m) for _, r in calls] for m in [("ar",1),("chain",4),("chain",8)]}
for dm in a.models.split(","):
    cost_state, before = None, None
    res = []
    for passname in ("warmup", "timed"):
        state = before if a.mode == "mix" else None
        out = []
        for name, rows in calls:
            pl = StepPlanner({m: table[m] for m in plan}, drain_model=dm, **extra)
            if cost_state is not None: pl.load_cost_state(cost_state)
            if state is not None:
                state = dict(state)
                if a.carry == "none" and "spread_rel" in state: state["spread_rel"] = IP.DEFAULT_SPREAD_REL
                if a.carry == "cap" and "spread_rel" in state: state["spread_rel"] = min(state["spread_rel"], IP.DEFAULT_SPREAD_REL)
                pl.load_token_state(state)
            tok, x, _ = pt.batch_ms(rows, B, true_ms, verify, max_new, planner=pl)
            cost_state, state = pl.cost_state(), pl.token_state()
            sk = "spread_rel" if dm.startswith("persist") else "spread"
            out.append((name, tok, x, dict((f"{k[0]}{k[1]}", v) for k, v in pl.choices.items() if v), round(state.get(sk), 4)))
        res = out
    T = sum(o[1] for o in res); X = sum(o[2] for o in res)
    c4 = fx[("chain",4)]; T4 = sum(t for t, _ in c4); X4 = sum(x for _, x in c4)
    print(f"{dm}: pooled/chain4 {T/X/(T4/X4):.4f}", "calls:",
          [(o[0], round((o[1]/o[2])/(c[0]/c[1]), 4), o[3], "carried", o[4]) for o, c in zip(res, c4)])
for m, v in fx.items():
    print(m, [round((t/x)/(c[0]/c[1]), 4) for (t, x), c in zip(v, fx[("chain",4)])])
