"""How a tree's tokens per step follow the chain's from one request to the next (the planner's drain model); CPU only.

    python benchmarks/engine/tree_lead_fit.py results/planner-sizes-h200-T0-c8.json [...] \
        [--chain chain] [--trees t16,t32] [--output results/tree-lead-fit.json [--overwrite]]

Reads ``infer.bench`` JSON files that ran the chain and fixed trees of one draft on the same prompts, and takes each
request's committed tokens per step, ``τ_c`` (the chain) and ``τ_t`` (a tree), from ``per_prompt_committed`` /
``per_prompt_steps``, paired by prompt (a request with no step under one label is left out under all). Fits three models of ``τ_t`` from ``τ_c`` by least squares over the requests of a file:

- ``accepted``: ``τ_t = 1 + k (τ_c − 1)``: the accepted draft tokens scale (what ``infer.planner.drain_tokens`` does
  for every speculative mode: ``1 + (tokens − 1) × a_i / ā``);
- ``ratio``: ``τ_t = k τ_c``;
- ``lead``: ``τ_t = τ_c + L``: the tree adds the same tokens per step to every request (how
  ``infer.planner.StepPlanner`` estimates a tree outside the drain: the chain plus its lead).

Reported per file and tree: each model's parameter, root-mean-square residual, and mean residual over the requests
in the chain's lowest quartile (the hard requests, the drain's slowest): a model that under-predicts the tree there
makes the drain rule prefer the chain for the request that finishes last. Caveats: ``τ_c`` is itself measured with
noise over a request's steps, which flattens the fitted slope towards the ``lead`` model; and each configuration's
output may part from the others' at bf16 near-ties, so a request's content differs somewhat between them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dspine.io import atomic_write_json  # noqa: E402
from dspine.paths import check_output_file  # noqa: E402
from dspine.provenance import provenance  # noqa: E402


def per_request(run: dict, labels: list[str]) -> np.ndarray:
    """Committed tokens per step ``[len(labels), n]`` float64 of each request under each label of an ``infer.bench``
    JSON, in task and prompt order, paired by prompt (its task and index in the per-prompt lists): a request with no
    step under one label is dropped from all, so column j is one prompt in every row. Raises ValueError naming the
    task and label: a task without the label or its per-prompt lists, or labels with different numbers of prompts."""
    if not isinstance(run, dict) or not isinstance(run.get("tasks"), list):
        raise ValueError("no 'tasks' list (not an infer.bench JSON)")
    out = []
    for t in run["tasks"]:
        rows = []
        for label in labels:
            r = t["drafts"].get(label)
            if r is None:
                raise ValueError(f"task {t['task']!r} has no draft label {label!r} (labels: {sorted(t['drafts'])})")
            committed, steps = r.get("per_prompt_committed"), r.get("per_prompt_steps")
            if not isinstance(committed, list) or not isinstance(steps, list) or len(committed) != len(steps):
                raise ValueError(f"task {t['task']!r}, label {label!r}: no per_prompt_committed and per_prompt_steps "
                                 "lists of one length")
            rows.append((committed, steps))
        counts = {label: len(steps) for label, (_, steps) in zip(labels, rows)}
        if len(set(counts.values())) > 1:
            raise ValueError(f"task {t['task']!r}: the labels ran different numbers of prompts {counts}")
        keep = [i for i in range(len(rows[0][1])) if all(steps[i] > 0 for _, steps in rows)]
        out.append(np.array([[c[i] / s[i] for i in keep] for c, s in rows], dtype=np.float64).reshape(len(labels), -1))
    return np.concatenate([np.zeros((len(labels), 0)), *out], axis=1)


def fit(chain: np.ndarray, tree: np.ndarray) -> dict:
    """The three models of the module docstring on paired per-request values (both ``[n]``, n ≥ 4): per model its
    parameter, ``rmse`` and ``low_quartile_bias`` (mean of tree − model over requests with ``chain`` at or below its
    25th percentile). Raises ValueError on shapes that differ, fewer than 4 requests, or a chain τ of 1.0 in every
    request (no accepted draft token: the ``accepted`` model's k is 0 / 0)."""
    if chain.shape != tree.shape or chain.ndim != 1 or chain.size < 4:
        raise ValueError(f"need two equal 1-D arrays of at least 4 requests, got {chain.shape} and {tree.shape}")
    low = chain <= np.quantile(chain, 0.25)
    a, t = chain - 1.0, tree - 1.0
    if not np.any(a):  # e.g. a random draft: k would be NaN, which the JSON cannot hold
        raise ValueError("every request's chain τ is 1.0: no accepted draft tokens to fit")
    k_acc = float(np.sum(a * t) / np.sum(a * a))
    k_ratio = float(np.sum(chain * tree) / np.sum(chain * chain))
    lead = float(np.mean(tree - chain))
    models = {"accepted": ("k", k_acc, 1.0 + k_acc * a), "ratio": ("k", k_ratio, k_ratio * chain),
              "lead": ("L", lead, chain + lead)}
    out = {"requests": int(chain.size), "chain_mean": float(chain.mean()), "tree_mean": float(tree.mean())}
    for name, (param, value, pred) in models.items():
        res = tree - pred
        out[name] = {param: value, "rmse": float(np.sqrt(np.mean(res**2))), "low_quartile_bias": float(res[low].mean())}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="infer.bench JSON files with the chain and fixed trees of one draft")
    ap.add_argument("--chain", default="chain", help="the chain's draft label (default chain)")
    ap.add_argument("--trees", default="t16,t32", help="the fixed trees' draft labels, comma-separated")
    ap.add_argument("--output", default=None, help="result JSON (refused if it exists, unless --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    args = ap.parse_args(argv)
    res: dict = {**provenance(argv if argv is None else [__file__, *argv]),
                 "note": "CPU analysis of the per-request τ in the files (each file's own commit and GPU inside it)",
                 "files": {}}
    trees = args.trees.split(",")
    try:
        if args.output is not None:  # before any work; an empty name is refused, not skipped
            check_output_file("--output", args.output, args.overwrite)
        for f in args.files:
            try:
                run = json.loads(Path(f).read_text())
                tau = per_request(run, [args.chain, *trees])  # row 0 the chain, one row per tree
            except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{f}: {e}") from None
            except (KeyError, TypeError, AttributeError) as e:  # e.g. a task without 'drafts'
                raise ValueError(f"{f}: not an infer.bench JSON ({type(e).__name__} {e})") from None
            res["files"][f] = {"commit": run.get("commit"), "concurrency": run.get("args", {}).get("concurrency")}
            for label, tree in zip(trees, tau[1:]):
                try:
                    r = res["files"][f][label] = fit(tau[0], tree)
                except ValueError as e:
                    raise ValueError(f"{f}, label {label!r} against {args.chain!r}: {e}") from None
                print(f"{f} {label}: " + "; ".join(
                    f"{m} {next(iter(r[m].values())):.2f} rmse {r[m]['rmse']:.3f} low-quartile bias "
                    f"{r[m]['low_quartile_bias']:+.3f}" for m in ("accepted", "ratio", "lead")))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output is not None:
        atomic_write_json(Path(args.output), res, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
