"""Where greedy speculative output and greedy AR output part ways in an ``infer.bench`` result, and
how close the target's top-2 logits are there (a near-tie means rounding, not a decoding bug).

    python scripts/smollm2/divergence_margins.py --bench results/smollm2-cpu-T0-c1.json \
        --target models/SmolLM2-135M-Instruct.Q4_1.gguf --output results/smollm2-cpu-T0-c1-divergence.json

For each mismatch recorded by the bench (``greedy_mismatches``) the target re-reads prompt + shared
prefix in one forward pass (fp32 and bf16) and reports, at the first differing position, the top-2
logit margin and whether each path's token is among the top 2 under fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dspine.provenance import provenance  # noqa: E402
from dspine.target import load_target  # noqa: E402


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (None if one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


@torch.no_grad()
def margins(target, ids: list[int]) -> tuple[float, list[int]]:
    """(top1 - top2 logit at the last position, [top1, top2] token ids) of one forward over ``ids``."""
    logits = target(torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return float(top.values[0] - top.values[1]), top.indices.tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    bench = json.loads(Path(args.bench).read_text())
    targets = {dt: load_target(args.target, dtype=dt) for dt in ("fp32", "bf16")}
    rows = []
    for task in bench["tasks"]:
        for label, d in task["drafts"].items():
            for m in d.get("greedy_mismatches", []):
                i = first_divergence(m["draft_tokens"], m["ar_tokens"])
                if i is None:
                    rows.append({"task": task["task"], "draft": label, "position": None, "note": "length differs only"})
                    continue
                ids = m["prompt_ids"] + m["ar_tokens"][:i]
                row = {"task": task["task"], "draft": label, "position": i,
                       "spec_token": m["draft_tokens"][i], "ar_token": m["ar_tokens"][i]}
                for dt, t in targets.items():
                    margin, top2 = margins(t, ids)
                    row[f"{dt}_top2"], row[f"{dt}_margin"] = top2, margin
                row["both_in_fp32_top2"] = {row["spec_token"], row["ar_token"]} <= set(row["fp32_top2"])
                rows.append(row)
                print(row, flush=True)
    out = {**provenance(), "bench": args.bench, "divergences": rows,
           "max_fp32_margin": max((r["fp32_margin"] for r in rows if "fp32_margin" in r), default=None)}
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
