"""Planner points from ``infer.bench`` runs that timed AR, fixed verify modes and planners of one draft; CPU only.

    python benchmarks/engine/planner_points.py results/planner-exact-h200-T0-c1.json [...] \
        [--output results/planner-exact-points.json [--overwrite]]

Per file (one concurrency and temperature): each configuration's tokens per second as the mean over tasks of its
per-task tok/s (the figure ``benchmarks/engine/bench_tree.py`` reports), the best fixed configuration (AR and every
label without ``budget``: the chain, fixed trees), and for every planner label (``budget`` = ``auto``) its ratio to
the best fixed one and to AR. With ``--exact`` runs every greedy output equals AR's (``infer.bench`` fails otherwise),
so the configurations decode the same tokens and the ratios measure the planner's choices, not content; the file's
``greedy_equal`` / ``greedy_compared`` are reported per label to show it. Also per label: mean τ over tasks, the
per-task tok/s, the planner's steps per mode summed over tasks and, from runs whose planner reports them, its τ per
mode over the steps it chose that mode for (``planner_tau_by_mode``) and its mean step time of each mode against the
fixed run of that mode (``planner_step_ms_over_fixed``: the planner's CUDA-event times of the steps it timed, steps
with a prefill left out, ÷ the fixed label's (seconds − prefill seconds) ÷ loop steps, both summed over tasks; the
fixed label of the same mode, draft, draft vocabulary and chain-first rule, AR's row for AR, whose step does not keep
the target's features for the draft as the planner's AR step does; no ratio where none or several labels match. On the
H200 the planner's clipped online estimate of its tree steps read 1.01-1.03 × the fixed runs' time per step before
their bookkeeping became one launch, results/planner-default*).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dspine.io import atomic_write_json  # noqa: E402
from dspine.paths import check_output_file  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from infer.bench import parse_drafts  # noqa: E402


def point(run: dict) -> dict:
    """One planner point of an ``infer.bench`` JSON (module docstring). Raises ValueError: an interrupted run, no
    tasks, no AR row (``--no-ar``), a draft label named ``AR``, no planner label or no fixed label, labels missing from a task, or
    an AR tok/s of 0 (no ratio to it)."""
    tasks = run.get("tasks") if isinstance(run, dict) else None
    if not tasks:
        raise ValueError("no 'tasks' (not an infer.bench JSON)")
    if run.get("interrupted"):
        raise ValueError("the run was interrupted (\"interrupted\": true): its tasks are a part of the run's; "
                         "measure it again")
    if any(not t.get("ar") for t in tasks):
        raise ValueError("a task has no AR row (run without --no-ar)")
    labels = list(tasks[0]["drafts"])
    if "AR" in labels:  # its tok/s, τ and greedy counts would be read from the AR row instead
        raise ValueError("a draft label is named 'AR', the name of the AR row here")
    if any(set(t["drafts"]) != set(labels) for t in tasks):
        raise ValueError(f"the tasks have different draft labels (first task: {labels})")
    planners = [x for x in labels if tasks[0]["drafts"][x].get("budget") == "auto"]
    fixed = ["AR", *[x for x in labels if x not in planners]]
    if not planners or len(fixed) < 2:
        raise ValueError(f"need a planner label (budget=auto) and a fixed one; labels {labels}")

    def rows(label):
        return [t["ar"] if label == "AR" else t["drafts"][label] for t in tasks]

    tok = {x: sum(r["tok_per_s"] for r in rows(x)) / len(tasks) for x in fixed + planners}
    if not tok["AR"] > 0:  # every ratio divides by it (the best fixed one is at least AR's)
        raise ValueError(f"AR tok/s is {tok['AR']:g} (mean over tasks): no ratio to it")
    best = max(fixed, key=lambda x: tok[x])
    out = {
        "concurrency": run.get("args", {}).get("concurrency"),
        "temperature": run.get("args", {}).get("temperature"),
        "exact": run.get("args", {}).get("exact"),
        "num_prompts": run.get("args", {}).get("num_prompts"),
        "max_new_tokens": run.get("args", {}).get("max_new_tokens"),
        "tok_per_s": {x: round(v, 1) for x, v in tok.items()},
        "best_fixed": best,
        "best_fixed_tok_per_s": round(tok[best], 1),
        "planner_over_best_fixed": {x: round(tok[x] / tok[best], 4) for x in planners},
        "planner_over_ar": {x: round(tok[x] / tok["AR"], 4) for x in planners},
        "mean_tau": {x: round(sum(r["tau"] for r in rows(x)) / len(tasks), 4) for x in labels},
        "greedy_equal": {x: [sum(r.get("greedy_equal", 0) for r in rows(x)),
                             sum(r.get("greedy_compared", 0) for r in rows(x))] for x in labels},
        "per_task_tok_per_s": {t["task"]: {x: round(r["tok_per_s"], 1) for x, r in
                                           zip(fixed + planners, [t["ar"], *[t["drafts"][y] for y in fixed[1:] + planners]])}
                               for t in tasks},
        "planner_steps": {},
    }  # fmt: skip
    for x in planners:
        steps: dict[str, int] = {}
        real: dict[str, list] = {}  # mode -> [observed steps, committed tokens per request] (runs that report them)
        for r in rows(x):
            for mode, c in (r.get("planner_choices") or {}).items():
                steps[mode] = steps.get(mode, 0) + int(c.get("steps", 0))
                if "observed" in c:
                    acc = real.setdefault(mode, [0, 0.0])
                    acc[0] += int(c["observed"])
                    acc[1] += float(c["realized_tokens"])
        out["planner_steps"][x] = steps
        if real:  # the mode's τ in the steps the planner chose it for (infer.planner.StepPlanner.report)
            out.setdefault("planner_tau_by_mode", {})[x] = {m: round(t / n, 4) for m, (n, t) in real.items() if n}
    # the planner's mean step time per mode against the fixed run of that mode: the fixed label of the same mode name
    # (chain16, tree32; AR's row for ar), draft, draft vocabulary and chain-first rule; none or several: no ratio
    args = run.get("args") or {}
    configs = args.get("configs") or {}
    paths = parse_drafts(args.get("draft"))  # infer.bench's own [LABEL=]PATH rule

    def same_setup(a: str, b: str) -> bool:  # a fixed label, b a planner label
        ca, cb = configs.get(a) or {}, configs.get(b) or {}
        return (paths.get(a) == paths.get(b) and ca.get("draft_vocab") == cb.get("draft_vocab")
                and ca.get("chain_first") == cb.get("chain_first"))

    fixed_ms = {}  # fixed label -> (mode name, decode ms per loop step) for runs whose profile counts the steps
    for x in fixed:
        rs = rows(x)
        n = sum((r.get("profile") or {}).get("steps", 0) for r in rs)
        if n and all("prefill_s" in (r.get("profile") or {}) for r in rs):
            mode = "ar" if x == "AR" else f"{rs[0].get('verify')}{rs[0].get('verified_tokens_per_step')}"
            fixed_ms[x] = (mode, 1e3 * sum(r["seconds"] - r["profile"]["prefill_s"] for r in rs) / n)
    for x in planners:
        timed: dict[str, list] = {}  # mode -> [timed steps, their ms] (runs whose planner reports them)
        for r in rows(x):
            for mode, c in (r.get("planner_choices") or {}).items():
                if c.get("timed_steps"):
                    acc = timed.setdefault(mode, [0, 0.0])
                    acc[0] += int(c["timed_steps"])
                    acc[1] += float(c["timed_ms"])
        ratios = {}
        for m, (n, t) in timed.items():
            match = [f for f, (fm, ms) in fixed_ms.items() if fm == m and ms > 0 and (f == "AR" or same_setup(f, x))]
            if len(match) == 1:
                f = match[0]
                ratios[m] = {"planner_ms": round(t / n, 4), "fixed": f, "fixed_ms": round(fixed_ms[f][1], 4),
                             "ratio": round(t / n / fixed_ms[f][1], 4)}
        if ratios:  # module docstring; the planner's AR step also keeps the features for the draft (not a plain AR step)
            out.setdefault("planner_step_ms_over_fixed", {})[x] = ratios
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="infer.bench JSON files, one planner point each")
    ap.add_argument("--output", default=None, help="result JSON (refused if it exists, unless --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    args = ap.parse_args(argv)
    res: dict = {**provenance(argv if argv is None else [__file__, *argv]),
                 "note": "CPU analysis of the runs in the files (each file's own commit, GPU and command inside it)",
                 "points": {}}  # fmt: skip
    try:
        if args.output is not None:  # an empty name is refused, not skipped
            check_output_file("--output", args.output, args.overwrite)
        seen: dict[Path, str] = {}
        for f in args.files:  # one point per file: the same file twice would be merged into one silently
            key = Path(f).resolve()
            if key in seen:
                raise ValueError(f"{f}: given twice (as {seen[key]})")
            seen[key] = f
        for f in args.files:
            try:
                run = json.loads(Path(f).read_text())
                p = point(run)
            except (OSError, ValueError) as e:
                raise ValueError(f"{f}: {e}") from None
            except (KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{f}: not an infer.bench JSON ({type(e).__name__} {e})") from None
            res["points"][f] = {"commit": run.get("commit"), "date": run.get("date"), "gpu": run.get("gpu"), **p}
            c, t = p["concurrency"], p["temperature"]  # None in a file without them
            c, t = "?" if c is None else c, f"{t:g}" if isinstance(t, (int, float)) else "?"
            print(f"{f}: c{c} T{t} best fixed {p['best_fixed']} "
                  f"{p['best_fixed_tok_per_s']:.0f} tok/s; " + "; ".join(
                      f"{x} {p['planner_over_best_fixed'][x]:.3f} (x AR {p['planner_over_ar'][x]:.3f})"
                      for x in p["planner_over_best_fixed"]))  # fmt: skip
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output is not None:
        atomic_write_json(args.output, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
