"""Compare the runs of ``scripts/smollm2/ab_loss.sh`` (one training loss per run) from their ``metrics.jsonl``.

    python scripts/smollm2/ab_summary.py --run ce=runs/ab-loss/train-ce --run kl=runs/ab-loss/train-kl \\
        --timings runs/ab-loss/ab-timings.jsonl --out runs/ab-loss/ab-loss.json [--command "..."]

For each run: every eval row (step, tau_real, tau_sim, tau_sim_agree, loss, hard-label CE, KL to the
target, per-slot accuracy and argmax agreement) and the training speed (median step_s, tokens/s over the
logged rows). ``delta`` = last eval of each run minus the first run's (the baseline), per eval metric.
Exits 1 (after writing the JSON) when a run has no eval row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

EVAL_KEYS = ("eval/tau_real", "eval/tau_sim", "eval/tau_sim_agree", "eval/loss", "eval/ce", "eval/kl")
SLOT_KEYS = ("eval/acc_at_pos", "eval/argmax_agree_at_pos", "eval/real_accept_at_pos")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def run_report(folder: Path) -> dict:
    rows = read_jsonl(folder / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    evals = [{"step": r["step"], **{k.removeprefix("eval/"): r.get(k) for k in EVAL_KEYS + SLOT_KEYS}}
             for r in rows if "eval/loss" in r]
    cfg = folder / "config.json"
    cfg = json.loads(cfg.read_text()) if cfg.is_file() else {}
    return {
        "output_dir": str(folder),
        "config": {k: cfg.get(k) for k in ("distill", "distill_alpha", "distill_temperature", "injection", "seed",
                                           "max_steps", "lr", "micro_batch_size", "anchors_per_seq", "train", "eval")},
        "steps": train[-1]["step"] if train else 0,
        "final_train_loss": train[-1]["loss"] if train else None,
        "step_s_median": statistics.median(r["step_s"] for r in train) if train else None,
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in train) if train else None,
        "evals": evals,
    }


def compare(runs: dict[str, dict]) -> dict:
    """Last eval of each run minus the first run's, per scalar eval metric (None where either is missing)."""
    names = list(runs)
    last = {n: (runs[n]["evals"][-1] if runs[n]["evals"] else {}) for n in names}
    keys = [k.removeprefix("eval/") for k in EVAL_KEYS]
    diff = lambda a, b: a - b if a is not None and b is not None else None
    return {f"{n}-{names[0]}": {k: diff(last[n].get(k), last[names[0]].get(k)) for k in keys} for n in names[1:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", required=True, metavar="NAME=FOLDER",
                    help="a training output_dir; the first one is the baseline")
    ap.add_argument("--timings", help="stage wall clocks (jsonl of {stage, seconds, rc})")
    ap.add_argument("--command", help="the command that made the runs (recorded in the JSON)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    from dspine.provenance import provenance

    runs = {}
    for item in args.run:
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            ap.error(f"--run {item!r}: expected NAME=FOLDER")
        if not (Path(folder) / "metrics.jsonl").is_file():
            ap.error(f"--run {item!r}: {folder}/metrics.jsonl does not exist (did the run start?)")
        runs[name] = run_report(Path(folder))
    prov = provenance()
    if args.command:
        prov["command"] = args.command
    report = {**prov, "runs": runs, "delta": compare(runs),
              "timings": read_jsonl(Path(args.timings)) if args.timings else []}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    fmt = lambda v: "-" if v is None else f"{v:.4f}"
    print(f"{'run':<8} {'steps':>6} {'tau_real':>9} {'tau_sim':>8} {'sim_agree':>9} {'eval_ce':>8} {'eval_kl':>8} "
          f"{'step_s':>7}")
    for name, r in runs.items():
        e = r["evals"][-1] if r["evals"] else {}
        print(f"{name:<8} {r['steps']:>6} {fmt(e.get('tau_real')):>9} {fmt(e.get('tau_sim')):>8} "
              f"{fmt(e.get('tau_sim_agree')):>9} {fmt(e.get('ce')):>8} {fmt(e.get('kl')):>8} {fmt(r['step_s_median']):>7}")
    print(f"wrote {args.out}")
    missing = [n for n, r in runs.items() if not r["evals"]]
    if missing:
        print(f"error: no eval row in run(s) {missing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
