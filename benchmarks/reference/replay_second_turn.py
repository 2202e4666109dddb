"""Replay of ``infer.bench --mix``'s two calls over the CPU trace: what a drain model carries from a mixed batch into
the next one.

``infer.bench --mix`` decodes the five tasks' first turns in one call, every batch holding every task's prompts, then
mt-bench's second turns as a call of their own: 64 requests admitted at once, so the drain rule is in force from its
first step, and the planner starts from the token state the mixed call left (``StepPlanner.load_token_state``: the
drain model's carried spread becomes the prior). ``planner_trace.py replay --mix`` replays the first call only. The
trace has no second turns; mt-bench's first-turn rows (the first 64 after ``--repeat``) stand in for them.
``--mode pertask`` replays the five tasks' calls one after another (``infer.bench`` without ``--mix``), then the same
stand-in call.

Each drain model runs the calls twice, as ``infer.bench`` runs an untimed pass before the timed one: the timed pass
starts from the untimed pass's cost state and from the token state that pass started from (none: ``infer.bench``
restores the planner's acceptance memory after the untimed pass; its start-up warm-up is not replayed). Printed
and written per model: tok/s pooled over the calls ÷ the fixed chain of 4's, and per call that ratio, the planner's
steps per mode and the spread it carries on (``"spread_rel"`` under ``persist`` and ``persist_cap``, else
``"spread"``). The H100 mixed-batch run of a0f4220 (``results/planner-mix-h100-exact-T0-c64.json``) and this replay
are discussed in docs/status.md (the session of 2026-12-07, fourteenth)::

    python benchmarks/reference/replay_second_turn.py --costs results/planner-cost-h100-exact-T0-c64.json \\
        --models scaled,persist,persist_cap [--shuffle SEED] [--output FILE]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.reference import planner_trace as pt
from dspine.io import write_json_new
from dspine.paths import check_output_file
from infer.datasets import interleave
from infer.planner import DRAIN_MODELS, SPREAD_STATE, StepPlanner

FIXED = (("ar", 1), ("chain", 4), ("chain", 8))  # the fixed modes replayed beside the planner; the chain of 4: the unit


def replay_calls(args) -> dict:
    """{"fixed": {mode: [tok/s ÷ the chain of 4's, per call]}, "models": {model: {...}}} for ``args``' calls."""
    trace = pt.load_json(args.trace, "a planner_trace.py record trace")
    if not trace.get("prompts") or not trace.get("block_size") or not trace.get("max_new_tokens"):
        raise SystemExit(f"{args.trace}: needs non-empty 'prompts', 'block_size' and 'max_new_tokens' (a trace "
                         "written by planner_trace.py record)")
    table, true_ms = pt.step_times(args.costs, args.label)
    bench = pt.load_json(args.costs, "an infer.bench result")["args"]
    batch = int(bench.get("max_batch") or bench["concurrency"])
    verify, max_new = trace["block_size"], trace["max_new_tokens"]
    plan = [("ar", 1), ("chain", 2), ("chain", 4), ("chain", 8), ("chain", verify)]
    tasks: dict[str, list] = {}
    for _ in range(args.repeat):
        for row in trace["prompts"]:
            if row["tokens"] > 1:  # a one-token output never decodes (batch_ms)
                tasks.setdefault(row["task"], []).append(row)
    if args.second_turn_task not in tasks:
        raise SystemExit(f"--second-turn-task {args.second_turn_task!r}: not a task of {args.trace} ({sorted(tasks)})")
    second = tasks[args.second_turn_task][:64]  # infer.bench: 64 second turns
    if args.shuffle is not None:
        for rows in tasks.values():
            random.Random(args.shuffle).shuffle(rows)
    calls = ([("mixed", interleave(list(tasks.values())))] if args.mode == "mix" else list(tasks.items()))
    calls.append(("second turn", second))
    fixed = {m: [pt.batch_ms(rows, batch, true_ms, verify, max_new, mode=m)[:2] for _, rows in calls] for m in FIXED}
    unit = fixed[("chain", 4)]
    rate = lambda tok_ms: tok_ms[0] / tok_ms[1]  # noqa: E731
    out = {"fixed": {f"{k}{n}": [rate(x) / rate(u) for x, u in zip(v, unit)] for (k, n), v in fixed.items()},
           "models": {}}
    for model in args.models.split(","):
        key = SPREAD_STATE.get(model, ("spread",))[0]
        cost_state = None
        for _ in ("untimed", "timed"):
            state, rows_out = None, []
            for name, rows in calls:
                planner = StepPlanner({m: table[m] for m in plan}, drain_model=model)
                if cost_state is not None:
                    planner.load_cost_state(cost_state)
                if state is not None:
                    planner.load_token_state(state)
                tok, ms, _ = pt.batch_ms(rows, batch, true_ms, verify, max_new, planner=planner)
                cost_state, state = planner.cost_state(), planner.token_state()
                rows_out.append({"call": name, "tokens": tok, "ms": ms,
                                 "steps": {f"{k}{n}": v for (k, n), v in planner.choices.items() if v},
                                 "carried": state.get(key)})
        tok, ms = sum(r["tokens"] for r in rows_out), sum(r["ms"] for r in rows_out)
        for r, u in zip(rows_out, unit):
            r["over_chain4"] = r["tokens"] / r["ms"] / rate(u)
        out["models"][model] = {"over_chain4": tok / ms / (sum(u[0] for u in unit) / sum(u[1] for u in unit)),
                                "calls": rows_out}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", required=True, help="infer.bench JSON of the device: the step times (planner_trace.py)")
    ap.add_argument("--label", default="p", help="the label of --costs whose measured step times are the truth")
    ap.add_argument("--trace", default="results/planner-trace16-cpu.json", help="planner_trace.py record output")
    ap.add_argument("--repeat", type=int, default=4, help="copies of each trace prompt (16 a task x 4: 64)")
    ap.add_argument("--models", default="scaled,persist",
                    help=f"drain models, comma-joined ({', '.join(DRAIN_MODELS)})")
    ap.add_argument("--mode", choices=("mix", "pertask"), default="mix")
    ap.add_argument("--second-turn-task", default="mt-bench", help="the task whose rows stand in for the second turns")
    ap.add_argument("--shuffle", type=int, default=None, help="seed: shuffle each task's prompts before the mix")
    ap.add_argument("--output", help="JSON file (refused if it exists, unless --overwrite)")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    if not 1 <= args.repeat <= 64:
        ap.error(f"--repeat {args.repeat}: must be 1 to 64")
    for model in args.models.split(","):  # before any replay
        if model not in DRAIN_MODELS:
            raise SystemExit(f"--models {args.models!r}: {model!r} is not a drain model ({', '.join(DRAIN_MODELS)})")
    if args.output is not None:  # before any work: a folder, an existing file, a parent that is no writable folder
        try:
            check_output_file("--output", args.output, args.overwrite)
        except ValueError as e:
            ap.error(str(e))
    out = replay_calls(args)
    for model, r in out["models"].items():
        print(f"{model}: {r['over_chain4']:.4f} of the chain of 4 over the calls")
        for c in r["calls"]:
            print(f"  {c['call']}: {c['over_chain4']:.4f}, steps {c['steps']}, carries {c['carried']}")
    for mode, v in out["fixed"].items():
        print(f"fixed {mode}: " + " / ".join(f"{x:.4f}" for x in v))
    if args.output:
        from dspine.provenance import provenance

        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        write_json_new(args.output, {**provenance(), "args": vars(args), **out}, indent=1, replace=args.overwrite,
                       what="this replay is")
    return 0


if __name__ == "__main__":
    sys.exit(main())
