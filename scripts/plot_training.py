"""Training curves from ``metrics.jsonl`` files: loss, and τ_sim next to τ_real per eval.

    python scripts/plot_training.py --run DSpine=runs/x/metrics.jsonl --run DFlash=runs/y/metrics.jsonl \\
        --output results/curves.png [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read(path: str) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def main(argv=None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", required=True, metavar="LABEL=METRICS_JSONL")
    ap.add_argument("--output", required=True)
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(11, 4))
    for i, item in enumerate(args.run):
        label, path = item.split("=", 1)
        rows = read(path)
        train = [r for r in rows if r.get("loss") is not None]
        evals = [r for r in rows if r.get("eval/tau_sim") is not None]
        color = f"C{i}"
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], color=color, label=label)
        ax_tau.plot([r["step"] for r in evals], [r["eval/tau_sim"] for r in evals], color=color, ls="--", marker="o",
                    label=f"{label} τ_sim (teacher-forced)")
        real = [r for r in evals if r.get("eval/tau_real") is not None]
        ax_tau.plot([r["step"] for r in real], [r["eval/tau_real"] for r in real], color=color, marker="s",
                    label=f"{label} τ_real (decoded)")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("weighted CE (Σ w·CE / Σ w)")
    ax_loss.set_yscale("log")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    ax_tau.set_xlabel("optimizer step")
    ax_tau.set_ylabel("τ (bonus token included)")
    ax_tau.grid(alpha=0.3)
    ax_tau.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
