"""Collect the eval rows of the stories260K ablation runs into one results file."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dspine.provenance import provenance  # noqa: E402


def main(work: str, out: str) -> None:
    runs = {}
    for name in ("dspine", "dflash"):
        rows = [json.loads(x) for x in (Path(work) / name / "metrics.jsonl").read_text().splitlines() if x.strip()]
        evals = [r for r in rows if "eval/tau_real" in r]
        train = [r for r in rows if "loss" in r]
        runs[name] = {"final": evals[-1], "evals": evals, "train_loss": [(r["step"], r["loss"]) for r in train]}
    steps = runs["dspine"]["final"]["step"]  # the script's STEPS, recorded so the command reproduces this file
    res = {**provenance([f"STEPS={steps}", "bash", "scripts/stories260k/ablation.sh"]),
           "target": "stories260K (llama2.c, 260K params)", "runs": runs}
    Path(out).write_text(json.dumps(res, indent=1))
    for name, r in runs.items():
        f = r["final"]
        print(f"{name}: tau_real {f['eval/tau_real']:.3f}  tau_sim {f['eval/tau_sim']:.3f}  eval loss {f['eval/loss']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
