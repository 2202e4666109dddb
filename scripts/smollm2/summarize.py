"""Collect a ``scripts/smollm2/recipe.sh`` work folder into ``results/`` (JSON + plots).

    python scripts/smollm2/summarize.py --work runs/smollm2 --out results [--tag h200]

Writes ``{out}/smollm2-{tag}-T{0,1}-c{1,8}.json`` (the infer.bench files), ``{out}/smollm2-recipe-{tag}.json``
(stage wall clocks, data report, training summary per run), ``{out}/smollm2-scaling.json`` and
``{out}/smollm2-scaling.png`` (τ against training steps and tokens per draft), and training curves
``{out}/smollm2-{tag}-curves.png``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import shutil
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def data_report(work: Path) -> dict:
    out: dict = {"prepare": read_json(work / "prepared" / "summary.json")}
    for split in ("train", "eval"):
        out[f"decontaminate_{split}"] = read_json(work / f"clean-{split}" / "summary.json")
    regen = {}
    for d in sorted(work.glob("regen-*")):
        s = read_json(d / "summary.json")
        args = read_json(d / "run_args.json") or {}
        if s:
            regen[d.name] = {k: s.get(k) for k in ("input_rows", "results", "errors", "skipped", "adds_up",
                                                      "generated_turns", "generated_tokens", "truncation_rate",
                                                      "wall_s", "generated_tokens_per_s", "world_size", "backend")}
            regen[d.name].update(temperature=args.get("temperature"), seed=args.get("seed"),
                                 max_new_tokens=args.get("max_new_tokens"))
    out["regenerate"] = regen
    train = [v for k, v in regen.items() if k.startswith("regen-train")]
    out["train_answers"] = sum(v["results"] for v in train)
    out["train_answer_tokens"] = sum(v["generated_tokens"] for v in train)
    for split in ("train", "eval"):
        caches = sorted((work / f"tok-{split}").glob("*/summary.json"))
        parts = [read_json(c) for c in caches]
        if len(parts) > 1:  # TRAIN_CACHES=all: the trainer read their union
            out[f"tokenize_{split}"] = {
                "caches": [c.parent.name for c in caches],
                **{k: sum(p.get(k) or 0 for p in parts) for k in ("sequences", "tokens")},
                "parts": parts}
        else:
            out[f"tokenize_{split}"] = parts[0] if parts else None
    return out


def train_report(run: Path) -> dict:
    rows = read_jsonl(run / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/loss" in r]
    steady = train[1:] or train  # the first window holds compilation
    rep = {
        "steps": train[-1]["step"] if train else 0,
        "final_loss": train[-1]["loss"] if train else None,
        "tokens": sum(r.get("tokens", 0) for r in train),
        "anchor_blocks": sum(r.get("anchor_blocks", 0) for r in train),
        "median_step_s": statistics.median(r["step_s"] for r in steady) if steady and "step_s" in steady[0] else None,
        "median_data_wait_s": (statistics.median(r["data_wait_s"] for r in steady)
                               if steady and "data_wait_s" in steady[0] else None),
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady) if steady else None,
        "median_anchor_blocks_per_s": (statistics.median(r["anchor_blocks_per_s"] for r in steady)
                                       if steady and "anchor_blocks_per_s" in steady[0] else None),
        "evals": [{**{k: e.get(k) for k in ("step", "eval/loss", "eval/tau_sim", "eval/tau_real")},
                   **{k: e[k] for k in ("eval/seconds", "eval/tau_real_seconds") if k in e}} for e in evals],
    }
    cfg = read_json(run / "config.json") or {}
    rep["config"] = {k: cfg.get(k) for k in ("injection", "seed", "lr", "micro_batch_size", "anchors_per_seq",
                                              "max_length", "max_steps", "layers", "injection_rank")}
    if rep["config"]["injection"] is None:  # a warm start (draft_init) takes its draft's: read the saved draft's
        latest = (run / "latest").read_text().strip() if (run / "latest").is_file() else None
        draft = read_json(run / latest / "draft" / "config.json") if latest else None
        if draft is not None:
            rep["config"]["injection"] = (draft.get("dspine_config") or {}).get("injection", "none")
    return rep


def cumulative(train_rows: list[dict], key: str):
    """step -> running total of ``key`` (logged every few steps, each row holding the steps since the last
    one); steps between two logged rows are interpolated linearly, None past the last row."""
    xs, ys, total = [0], [0.0], 0.0
    for r in train_rows:
        total += r.get(key, 0)
        xs.append(r["step"])
        ys.append(total)

    def at(step: int):
        if step > xs[-1]:
            return None
        i = bisect.bisect_left(xs, step)
        if xs[i] == step:
            return round(ys[i])
        return round(ys[i - 1] + (ys[i] - ys[i - 1]) * (step - xs[i - 1]) / (xs[i] - xs[i - 1]))

    return at


def scaling(work: Path) -> dict:
    out = {}
    for name in ("dspine", "dflash"):
        res = read_json(work / "bench" / f"scaling-{name}.json")
        if not res:
            continue
        rows = [r for r in read_jsonl(work / f"train-{name}-s0" / "metrics.jsonl") if "loss" in r]
        tokens, blocks = cumulative(rows, "tokens"), cumulative(rows, "anchor_blocks")
        points = []
        for label, s in res["summary"].items():
            step = int(re.sub(r"\D", "", label))
            points.append({"step": step, "target_tokens": tokens(step), "anchor_blocks": blocks(step),
                           "mean_tau": s["mean_tau"], "mean_tau_ci95": s.get("mean_tau_ci95")})
        out[name] = sorted(points, key=lambda p: p["step"])
    return out


def plot_scaling(points: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, pts in points.items():
        label = {"dspine": "DSpine", "dflash": "DFlash"}[name]
        for ax, key in zip(axes, ("step", "target_tokens")):
            xs = [p[key] for p in pts if p[key] is not None]
            ys = [p["mean_tau"] for p in pts if p[key] is not None]
            lo = [p["mean_tau"] - p["mean_tau_ci95"][0] for p in pts if p[key] is not None]
            hi = [p["mean_tau_ci95"][1] - p["mean_tau"] for p in pts if p[key] is not None]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=label)
    axes[0].set_xlabel("optimizer steps")
    axes[1].set_xlabel("target tokens seen")
    for ax in axes:
        ax.set_ylabel("mean τ over 5 tasks (T=0, 256 tokens)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M drafts: τ of the checkpoints along one cosine run (95% bootstrap CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from dspine.provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", default="results")
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--overwrite", action="store_true", help="replace result files that exist in --out")
    args = ap.parse_args(argv)
    work, out = Path(args.work), Path(args.out)
    benches = sorted((work / "bench").glob("smollm2-*-T*-c*.json"))
    trained = [d for d in sorted(work.glob("train-*")) if d.is_dir() and not d.name.startswith("train-calib")]
    if not (work / "timings.jsonl").is_file() or not (benches or trained):
        print(f"error: --work {work} holds no recipe run (timings.jsonl and a train-* or bench/ result); nothing to "
              "summarize", file=sys.stderr)
        return 2
    copies = [out / f.name.replace("smollm2-h200", f"smollm2-{args.tag}") for f in benches]
    existing = [str(t) for t in [*copies, out / f"smollm2-recipe-{args.tag}.json"] if t.exists()]
    if existing and not args.overwrite:
        print(f"error: {', '.join(existing)} exist(s); summarize does not replace results (give --overwrite, "
              "OVERWRITE=1 for recipe.sh, or another --out / --tag)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for f, dst in zip(benches, copies):
        shutil.copyfile(f, dst)
        if f.with_suffix(".png").is_file():
            shutil.copyfile(f.with_suffix(".png"), dst.with_suffix(".png"))
    runs = {d.name.removeprefix("train-"): train_report(d) for d in trained}
    recipe = {
        **provenance(),
        "command": "GGUF=models/SmolLM2-135M-Instruct.Q4_1.gguf bash scripts/smollm2/recipe.sh",
        "timings": read_jsonl(work / "timings.jsonl"),
        "data": data_report(work),
        "train": runs,
    }
    recipe["total_seconds"] = round(sum(t.get("seconds", 0) for t in recipe["timings"]), 1)
    (out / f"smollm2-recipe-{args.tag}.json").write_text(json.dumps(recipe, indent=1))
    pts = scaling(work)
    if pts:
        (out / "smollm2-scaling.json").write_text(json.dumps({**provenance(), "points": pts}, indent=1))
        plot_scaling(pts, out / "smollm2-scaling.png")
    metrics = [f"{name}={work / f'train-{name}' / 'metrics.jsonl'}" for name in runs]
    if metrics:
        from scripts.plot_training import main as plot_training

        plot_training([x for m in metrics for x in ("--run", m)] + ["--output", str(out / f"smollm2-{args.tag}-curves.png"),
                                                                   "--title", "SmolLM2-135M drafts"])
    print(f"wrote {out}/smollm2-recipe-{args.tag}.json ({len(runs)} runs, {len(recipe['timings'])} stages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
