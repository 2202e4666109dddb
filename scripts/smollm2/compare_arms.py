"""DSpine against DFlash at equal data, steps and seed: the paired difference of mean τ, per seed.

    python scripts/smollm2/compare_arms.py --bench runs/smollm2/bench/smollm2-h200-T0-c8.json \
        runs/smollm2/bench/smollm2-h200-T1-c8.json --output results/smollm2-arms-h200.json

Input: ``infer.bench --output-json`` files whose drafts come in pairs ``DSpine`` / ``DFlash`` (seed 0)
and ``DSpine-s<k>`` / ``DFlash-s<k>`` (seed k), as ``scripts/smollm2/recipe.sh`` benches them with
``SEEDS="0 1"``; injection variants (``VARIANTS``) as ``DSpine-NAME[-s<k>]``, each paired with the DFlash
draft of its seed (under ``variants.NAME``, same fields). Both drafts of a pair decoded the same prompts in the
same run (alternating order).

Per file and seed: each arm's mean τ (the mean over tasks of the task's τ = Σ committed / Σ verify
steps, the ``mean_tau`` of infer.bench), the relative difference ``rel = τ_DSpine / τ_DFlash − 1`` and
its 95% paired percentile-bootstrap interval (``infer.bench.task_bootstrap``: prompts resampled with
replacement within each task, the same indices for both arms, so the spread both arms share cancels). ``all_seeds`` does the same for the arms' means averaged over the seeds (one
index draw per task for every draft). ``goal_met``: rel ≥ +5% (the issue's goal), judged on the point
estimate; ``interval_excludes_zero`` says whether the difference is resolved at all.
Writes JSON with the command, date and commit; prints one line per file and seed.

Raises SystemExit with the file and field named when a file lacks a pair, a task or the per-prompt
counts, or when the two arms of a pair saw a different number of prompts in a task.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from infer.bench import task_bootstrap  # noqa: E402

GOAL = 0.05  # DSpine ≥ +5% over DFlash (the goal)
# DSpine[-VARIANT][-s<k>] / DFlash[-s<k>]: VARIANT a recipe.sh VARIANTS name (lower case, not s<k>)
_LABEL = re.compile(r"^(?:(DSpine)(?:-(?!s\d+$)([a-z][a-z0-9]*))?|(DFlash))(?:-s(\d+))?$")


def _pairs(path: Path, rec: dict) -> dict[tuple[str, int], tuple[str, str]]:
    """(variant, seed) -> (DSpine label, DFlash label) from the labels of every task; variant "" is plain DSpine,
    every variant is paired with the DFlash draft of its seed."""
    labels = {lab for t in rec["tasks"] for lab in t["drafts"]}
    dspine: dict[tuple[str, int], str] = {}
    dflash: dict[int, str] = {}
    for lab in labels:
        m = _LABEL.match(lab)
        if m and m[1]:
            dspine[(m[2] or "", int(m[4] or 0))] = lab
        elif m:
            dflash[int(m[4] or 0)] = lab
    pairs = {k: (lab, dflash[k[1]]) for k, lab in dspine.items() if k[1] in dflash}
    if not pairs:
        raise SystemExit(f"error: {path}: no DSpine / DFlash pair among the drafts {sorted(labels)} "
                         "(labels DSpine, DFlash, DSpine-s<k>, DFlash-s<k>, DSpine-VARIANT[-s<k>])")
    return dict(sorted(pairs.items()))


def _counts(path: Path, rec: dict, labels: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per task: committed and steps tensors ``[len(labels), prompts]`` float64."""
    out = []
    for t in rec["tasks"]:
        rows = []
        for lab in labels:
            d = t["drafts"].get(lab)
            if d is None:
                raise SystemExit(f"error: {path}: task {t['task']} has no draft {lab!r}")
            if "per_prompt_committed" not in d or "per_prompt_steps" not in d:
                raise SystemExit(f"error: {path}: task {t['task']}, draft {lab}: no per_prompt_committed / "
                                 "per_prompt_steps (an infer.bench file from before they were recorded?)")
            rows.append((d["per_prompt_committed"], d["per_prompt_steps"]))
        n = {len(c) for c, _ in rows} | {len(s) for _, s in rows}
        if len(n) != 1:
            raise SystemExit(f"error: {path}: task {t['task']}: the drafts {labels} saw different prompt counts "
                             f"{sorted(n)}; a paired comparison needs the same prompts")
        out.append((torch.tensor([c for c, _ in rows], dtype=torch.float64),
                    torch.tensor([s for _, s in rows], dtype=torch.float64)))
    if not out:
        raise SystemExit(f"error: {path}: no tasks")
    return out


def _load(path: Path) -> dict:
    """An infer.bench --output-json record: a JSON object with a non-empty ``tasks`` list of objects that
    each hold ``drafts`` (SystemExit naming the file and what is missing otherwise)."""
    try:
        rec = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: {path}: not JSON ({e}); expected an infer.bench --output-json file") from None
    tasks = rec.get("tasks") if isinstance(rec, dict) else None
    if not isinstance(tasks, list) or not all(isinstance(t, dict) and isinstance(t.get("drafts"), dict)
                                              for t in tasks):
        raise SystemExit(f"error: {path}: no 'tasks' list of objects with 'drafts' (not an infer.bench "
                         "--output-json file?)")
    return rec


def compare(path: Path, n: int = 2000, seed: int = 0) -> dict:
    """The comparison record of one bench file (module docstring)."""
    rec = _load(path)
    pairs = _pairs(path, rec)
    labels = sorted({lab for pair in pairs.values() for lab in pair})  # every draft once: one bootstrap column each
    col = {lab: j for j, lab in enumerate(labels)}
    point, boot = task_bootstrap(_counts(path, rec, labels), n, seed)  # [D], [n, D]
    q = torch.tensor([0.025, 0.975], dtype=torch.float64)

    def entry(sp: torch.Tensor, fl: torch.Tensor, bsp: torch.Tensor, bfl: torch.Tensor) -> dict:
        rel = float(sp / fl - 1)
        lo, hi = torch.quantile(bsp / bfl - 1, q).tolist()
        return {"dspine_mean_tau": float(sp), "dflash_mean_tau": float(fl), "rel": rel, "rel_ci95": [lo, hi],
                "goal_met": rel >= GOAL, "interval_excludes_zero": lo > 0 or hi < 0}

    def group(variant: str) -> dict:
        """The variant's per-seed entries and, over two seeds or more, the entry of the seeds' means."""
        mine = {s: pair for (v, s), pair in pairs.items() if v == variant}
        sp, fl = [col[p[0]] for p in mine.values()], [col[p[1]] for p in mine.values()]
        res = {"seeds": {str(s): {"labels": list(p), **entry(point[col[p[0]]], point[col[p[1]]], boot[:, col[p[0]]],
                                                              boot[:, col[p[1]]])} for s, p in mine.items()}}
        if len(mine) > 1:
            res["all_seeds"] = entry(point[sp].mean(), point[fl].mean(), boot[:, sp].mean(1), boot[:, fl].mean(1))
        return res

    a = rec.get("args", {})
    out = {"bench": str(path), "temperature": a.get("temperature"), "concurrency": a.get("concurrency"),
           "num_prompts": a.get("num_prompts"), "max_new_tokens": a.get("max_new_tokens"),
           "bench_commit": rec.get("commit"), "gpu": rec.get("gpu")}
    variants = sorted({v for v, _ in pairs})
    if "" in variants:
        out |= group("")
    else:
        out["seeds"] = {}
    named = [v for v in variants if v]
    if named:
        out["variants"] = {v: group(v) for v in named}
    return out


def main(argv=None) -> int:
    from dspine.provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", nargs="+", required=True, help="infer.bench --output-json files")
    ap.add_argument("--output", default=None, help="write the JSON here (refuses to replace an existing file)")
    ap.add_argument("--resamples", type=int, default=2000)
    args = ap.parse_args(argv)
    if args.resamples < 100:
        ap.error(f"--resamples={args.resamples}: use at least 100")
    if args.output and Path(args.output).exists():
        ap.error(f"--output {args.output} exists; give another path or delete it")
    for b in args.bench:
        if not Path(b).is_file():
            ap.error(f"--bench {b}: no such file")
    rows = [compare(Path(b), args.resamples) for b in args.bench]
    for r in rows:
        groups = {"": r, **{f"-{v}": g for v, g in r.get("variants", {}).items()}}
        for name, g in groups.items():
            for s, e in {**g["seeds"], **({"all": g["all_seeds"]} if "all_seeds" in g else {})}.items():
                print(f"T={r['temperature']} c{r['concurrency']} seed {s}: DSpine{name} {e['dspine_mean_tau']:.3f} vs DFlash "
                      f"{e['dflash_mean_tau']:.3f}: {100 * e['rel']:+.1f}% [{100 * e['rel_ci95'][0]:+.1f}, "
                      f"{100 * e['rel_ci95'][1]:+.1f}] (goal +{100 * GOAL:.0f}%: {'met' if e['goal_met'] else 'missed'})")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({**provenance(), "goal_rel": GOAL, "comparisons": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
