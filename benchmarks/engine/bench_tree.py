"""Tree verification against chain verification (issue 16): step cost at Qwen3-8B shape, τ and speed on SmolLM2.

    python benchmarks/engine/bench_tree.py --output results/verify-h200.json \
        [--smollm2 models/SmolLM2-135M-Instruct.Q4_1.gguf --draft checkpoints/smollm2-135m-dspine] [--tiny]

1. Qwen3-8B shape, random bf16 weights, 5-layer block-16 draft, 512-token prompts: the engine's whole
   speculative step (draft block, tree construction, target verify with tree attention, acceptance,
   accepted-path K/V move, commit, draft context append) as a CUDA graph replay, median over
   ``--iters`` after warm-up, for the chain of 16 and trees of 16, 32 and 64 nodes, at batch 1 and 8.
   The draft is an oracle (``force_accept``: the chain's first 6 tokens are accepted), so the cost
   does not depend on random weights agreeing. ``step_ms_over_chain16`` = tree step ÷ chain step.
2. With ``--smollm2 GGUF --draft DIR``: one ``infer.bench`` run on the 5 tasks at T = 0, concurrency 1,
   with the draft twice, as ``chain`` and as ``tree`` (``--config tree:verify=tree,tree_budget=N``): same
   prompts, alternated per task, warm-up excluded: ``tree_tau_over_chain_tau`` (mean τ over tasks) and
   ``tree_speedup_over_chain`` (mean over tasks of tree tok/s ÷ chain tok/s).
3. With ``--planner C:T[,C:T...]`` (and ``--smollm2``/``--draft``): for each concurrency C and temperature
   T, one ``infer.bench`` run with AR, the fixed chain, the narrower fixed chains (``--fixed-chains``, labels
   chainN), the fixed trees (``--fixed-trees``, default ``--tree-budget``) and the planner (``auto``: ``--config
   auto:budget=auto``, ``--plan-trees`` its tree sizes, ``--plan-chains`` its narrower chains); every fixed mode
   counts in ``best_static_tok_per_s``,
   alternated per task; appends ``{concurrency, temperature,
   planner_tok_per_s, ar_tok_per_s, best_static_tok_per_s, planner_over_best_static, planner_over_ar,
   ...}`` to ``planner`` (mean tok/s over the tasks; at T > 0: top_p 0.95, top_k 20). Separate runs per
   configuration (before 2026-12-02) let run-to-run drift and the order of runs into the comparison.
   ``--seeds S,S...``: a T > 0 point runs once per sampling seed and its tok/s are the means over the seeds
   (``per_seed`` keeps each run's ratios; ``same_run``: every seed's run holds all configurations;
   ``planner_choices_per_task`` and ``per_task`` list the runs' tasks seed after seed, ``per_task`` rows with their
   ``seed``; ``--keep-runs`` names a run ``planner-cC-TT-seedS.json`` unless the seeds are just 0): a planner's probe changes the sampled text of every live request from
   there on, so one seed compares different texts (at concurrency 32, T = 1 on the H100 the planner ran AR in all but
   21 steps and its per-task ratios to AR were 0.92-0.97, its texts 1-8% shorter or longer than AR's).
   ``--keep-runs DIR`` keeps every ``infer.bench`` JSON (per-task τ, tok/s, the engine's time split).
Writes JSON (command, GPU, date, commit via ``dspine.provenance``, also inside each part); with
``--merge`` the parts measured now replace those keys of an existing ``--output`` file, so the two parts
can run as two commands into one file. ``--tiny`` runs tiny shapes on the CPU (eager, torch kernels;
``--smollm2`` may then name a small HF target such as stories260K).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.bench_engine import QWEN3_8B, TINY, build, timed  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.sampling import SamplingParams  # noqa: E402
from infer.bench import PROFILE_KEYS  # noqa: E402
from infer.engine import Engine  # noqa: E402
from infer.model import EngineTarget, ModelArgs  # noqa: E402
from infer.planner import DRAIN_MODELS, PLAN_STATES  # noqa: E402

CONFIGS = [("chain16", "chain", 16), ("tree16", "tree", 16), ("tree32", "tree", 32), ("tree64", "tree", 64)]


@torch.inference_mode()
def step_costs(args, dev) -> dict:
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    impl = "triton" if dev.type == "cuda" else "torch"
    hf, dm = build(TINY if args.tiny else QWEN3_8B, dev, dtype, args.draft_layers, 16)
    a = ModelArgs.from_hf_config(hf.config)
    target = EngineTarget.from_hf_state(a, hf.state_dict(), dev, dtype, dm.config.target_layer_ids, impl)
    del hf
    gc.collect()
    out: dict = {
        "shape": "tiny" if args.tiny else "Qwen3-8B",
        "dtype": str(dtype),
        "prompt_tokens": args.prompt,
        "oracle_accepted_per_step": 6,
    }
    g = torch.Generator().manual_seed(1)
    greedy = SamplingParams(max_new_tokens=32)
    for B in (1, 8):
        prompts = [torch.randint(0, a.vocab_size - 2, (args.prompt,), generator=g).tolist() for _ in range(B)]
        row: dict = {}
        for name, verify, n in CONFIGS:
            eng = Engine(
                target,
                dm,
                [-1],
                max_batch=B,
                max_seq=args.prompt + 128,
                max_new_cap=32,
                force_accept=6,
                verify=verify,
                tree_budget=n,
            )
            eng.generate(prompts, greedy)  # prefill, warm-up and graph capture; the rows end at 32 tokens
            step = eng._runner(B, greedy, spec=True)  # idle rows: every kernel runs, nothing is committed
            row[f"{name}_step_ms"] = timed(step, args.iters)
            del eng, step
            gc.collect()
        for name, _, _ in CONFIGS[1:]:
            row[f"{name}_step_over_chain16"] = row[f"{name}_step_ms"] / row["chain16_step_ms"]
        out[f"batch{B}"] = row
        print(f"batch {B}: " + ", ".join(f"{k}={v:.3f}" for k, v in row.items()), flush=True)
    return out


def bench_run(args, argv: list[str], name: str) -> dict:
    """One ``infer.bench`` run with flags ``argv`` -> its JSON (also kept as ``--keep-runs``/``name``.json)."""
    from infer import bench

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.keep_runs) / f"{name}.json" if args.keep_runs else Path(tmp) / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        if bench.main([*argv, "--output-json", str(path), "--overwrite"]) != 0:
            raise RuntimeError(f"infer.bench {' '.join(argv)} failed (its error is printed above)")
        return json.loads(path.read_text())


def bench_base(args, concurrency: int = 1, temperature: float = 0.0, tree: bool = True) -> list[str]:
    """``infer.bench`` flags shared by every run: the target, the draft under the labels chain and (``tree``) tree
    (the tree set by ``--config``), the tasks, the settings."""
    trees = ["--draft", f"tree={args.draft}", "--config", f"tree:verify=tree,tree_budget={args.tree_budget}"]
    base = ["--target", args.smollm2, "--draft", f"chain={args.draft}", *(trees if tree else []),
            "--datasets", args.datasets,
            "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
            "--temperature", str(temperature), "--concurrency", str(concurrency)]  # fmt: skip
    if temperature > 0:
        base += ["--top-p", "0.95", "--top-k", "20"]
    if args.data_dir:
        base += ["--data-dir", args.data_dir]
    if args.prefill_buckets is not None:
        base += ["--prefill-buckets" if args.prefill_buckets else "--no-prefill-buckets"]
    if args.exact is not None:
        base += ["--exact" if args.exact else "--no-exact"]
    if args.tiny:
        base += ["--backend", "cuda", "--device", "cpu", "--dtype", "fp32", "--no-chat-template"]
    else:
        base += ["--backend", "cuda"]
    return base


def mean_over_tasks(run: dict, label: str, key: str) -> float:
    rows = [t["ar"] if label == "AR" else t["drafts"][label] for t in run["tasks"]]
    return sum(r[key] for r in rows) / len(rows)


def per_task(run: dict) -> list[dict]:
    """Per task of one ``infer.bench`` run, per configuration (``ar``, then each draft label): seconds, tok/s and
    the decode loop's profile of its timed pass, summed (``infer.bench`` PROFILE_KEYS: ``prefill_s``, ``launch_s``,
    ``wait_s``, ``host_s``, ``admit_device_s``, ``admits`` and ``steps``, so a mode's time per decode step,
    ``(seconds - prefill_s) / steps``, compares with the planner's; a key the run did not record is left out)."""
    out = []
    for t in run["tasks"]:
        rows = {"ar": t["ar"], **t["drafts"]} if t.get("ar") else dict(t["drafts"])
        out.append({"task": t["task"], **{
            label: {"seconds": round(r["seconds"], 4), "tok_per_s": round(r["tok_per_s"], 1),
                    **{k: round(v, 4) for k, v in r.get("profile", {}).items() if k in PROFILE_KEYS}}
            for label, r in rows.items()}})  # fmt: skip
    return out


def smollm2(args) -> dict:
    """The chain and the tree of one draft in one ``infer.bench`` run (alternated per task, each task
    warmed up with both first on a GPU), compared."""
    run = bench_run(args, bench_base(args) + ["--no-ar"], "chain-tree")
    per_task = []
    for t in run["tasks"]:
        dc, dt = t["drafts"]["chain"], t["drafts"]["tree"]
        per_task.append(
            {
                "task": t["task"],
                "chain_tau": dc["tau"],
                "tree_tau": dt["tau"],
                "chain_tok_per_s": dc["tok_per_s"],
                "tree_tok_per_s": dt["tok_per_s"],
                "tree_speedup_over_chain": dt["tok_per_s"] / dc["tok_per_s"],
            }
        )
    chain_tau, tree_tau = (run["summary"][v]["mean_tau"] for v in ("chain", "tree"))
    return {
        "target": args.smollm2,
        "draft": args.draft,
        "tree_budget": args.tree_budget,
        "temperature": 0,
        "concurrency": 1,
        "num_prompts": args.num_prompts,
        "max_new_tokens": args.max_new_tokens,
        "chain_mean_tau": chain_tau,
        "tree_mean_tau": tree_tau,
        "tree_tau_over_chain_tau": tree_tau / chain_tau,
        "tree_speedup_over_chain": sum(r["tree_speedup_over_chain"] for r in per_task) / len(per_task),
        "tasks": per_task,
    }


def fixed_trees(args) -> list[int]:
    """The fixed trees a planner point is compared with: ``--fixed-trees`` (default: ``--tree-budget`` alone)."""
    return sorted({int(n) for n in args.fixed_trees.split(",")}) if args.fixed_trees else [args.tree_budget]


# the fixed chains narrower than the block a planner point runs by default: the planner's own narrower chains
# (Engine.PLAN_CHAINS) are fixed modes a user could pick, so its "best fixed mode" includes the two that led on the
# H100 at some point (results/verify-chains-*-h100.json; a fixed chain of 8 was not run there, and each adds a run
# per point)
FIXED_CHAINS = "2,4"


def fixed_chains(args, block: int | None = None) -> list[int]:
    """The fixed chains narrower than the block a planner point is compared with: ``--fixed-chains`` ("none": none),
    or when not given ``FIXED_CHAINS`` less the widths not below ``block`` (the draft's, where known)."""
    if args.fixed_chains is None:
        return [n for n in map(int, FIXED_CHAINS.split(",")) if block is None or n < block]
    return [] if args.fixed_chains == "none" else sorted({int(n) for n in args.fixed_chains.split(",")})


def check_sizes(ap, flag: str, text, sizes, what: str, example: str, plan_text, plan_flag) -> None:
    """``ap.error`` for a fixed-mode list (``flag``, its value ``text``; ``sizes()`` parses it) that is not integers in
    2..64, or a planner list ``plan_text`` that ``plan_flag`` (``infer.planner.plan_*_flag``) refuses."""
    try:
        if not all(2 <= n <= 64 for n in sizes()):
            raise ValueError
    except ValueError:
        ap.error(f"{flag} {text!r}: give {what} in 2..64 joined by commas, e.g. {example}")
    if plan_text:
        try:
            plan_flag(plan_text)
        except ValueError as e:
            ap.error(str(e))


def draft_block_size(draft: str | None) -> int | None:
    """The block size in a local draft folder's config.json, or None (no folder, no file, no such field)."""
    path = Path(draft) / "config.json" if draft else None
    try:
        return int(json.loads(path.read_text())["block_size"]) if path and path.is_file() else None
    except (ValueError, KeyError, TypeError):
        return None


def parse_chain_flag(text: str | None) -> tuple[int, ...]:
    """``--plan-chains`` as widths (() when not given); its errors are reported by main() before this is called."""
    from infer.planner import parse_plan_chains

    return parse_plan_chains(text) if text else ()


def planner_points(args, on_point=None) -> list[dict]:
    """Planner against AR and the best fixed configuration at each ``--planner`` point (module docstring):
    AR, the chain, the fixed trees (``--tree-budget`` as ``tree``, the other ``--fixed-trees`` as ``treeN``) and the
    planner (``--plan-trees``: its tree sizes) of one draft in one ``infer.bench`` run per point, so all decode the
    same prompts, alternated per task and warmed up per task on a GPU. ``best_static_tok_per_s`` is the best of AR,
    the chain and every fixed tree. ``on_point(point)``: called with each point once measured (main() writes the
    output file then, so a later point's failure loses none before it)."""
    out = []
    for point in args.planner.split(","):
        c, t = point.split(":")
        # drafter-invariant verification (T > 0): every label decodes AR's sampled text, and no tree runs
        inv = bool(args.invariant) and float(t) > 0
        auto = "auto:budget=auto" + (f",plan_trees={args.plan_trees}" if args.plan_trees and not inv else "")
        auto += f",drain={args.plan_drain_model}" if args.plan_drain_model else ""
        auto += f",state={args.plan_state}" if args.plan_state else ""
        auto += f",plan_chains={args.plan_chains}" if args.plan_chains else ""
        argv = bench_base(args, int(c), float(t), tree=not inv) + ["--draft", f"auto={args.draft}", "--config", auto]
        argv += ["--invariant"] if inv else []
        extra = [n for n in fixed_trees(args) if n != args.tree_budget] if not inv else []  # beside --tree-budget's
        for n in extra:
            argv += ["--draft", f"tree{n}={args.draft}", "--config", f"tree{n}:verify=tree,tree_budget={n}"]
        narrow = {n: f"chain{n}" for n in fixed_chains(args)}  # fixed chains narrower than the block (all points)
        for n, label in narrow.items():
            argv += ["--draft", f"{label}={args.draft}", "--config", f"{label}:width={n}"]
        if args.plan_drain is not None:
            argv += ["--plan-drain" if args.plan_drain else "--no-plan-drain"]
        seeds = args.seeds if float(t) > 0 else [0]
        runs = [bench_run(args, argv + ["--seed", str(sd)], f"planner-c{c}-T{t}" + (f"-seed{sd}" if seeds != [0] else ""))
                for sd in seeds]  # fmt: skip
        trees = {args.tree_budget: "tree", **{n: f"tree{n}" for n in extra}} if not inv else {}
        static = ("AR", "chain", *narrow.values(), *trees.values())
        labels = ("AR", "chain", "auto", *narrow.values(), *trees.values())
        per_seed = []
        for sd, run in zip(seeds, runs):
            tok = {n: mean_over_tasks(run, n, "tok_per_s") for n in labels}
            best = max(tok[n] for n in static)
            per_seed.append({"seed": sd, "tok_per_s": tok, "planner_over_best_static": tok["auto"] / best,
                             "planner_over_ar": tok["auto"] / tok["AR"]})
        tok = {n: sum(r["tok_per_s"][n] for r in per_seed) / len(runs) for n in labels}  # mean over the seeds
        best = max(tok[n] for n in static)
        run = runs[0]
        out.append({"concurrency": int(c), "temperature": float(t), "planner_tok_per_s": tok["auto"],
                    "ar_tok_per_s": tok["AR"], "chain_tok_per_s": tok["chain"], "tree_tok_per_s": tok.get("tree"),
                    "fixed_tree_tok_per_s": {str(n): tok[label] for n, label in sorted(trees.items())},
                    **({"fixed_chain_tok_per_s": {str(n): tok[label] for n, label in narrow.items()}} if narrow else {}),
                    "plan_trees": run["tasks"][0]["drafts"]["auto"].get("plan_trees"),
                    "plan_chains": run["tasks"][0]["drafts"]["auto"].get("plan_chains"),
                    **({"plan_drain_model": args.plan_drain_model} if args.plan_drain_model else {}),
                    **({"plan_state": args.plan_state} if args.plan_state else {}),
                    "best_static_tok_per_s": best, "planner_over_best_static": tok["auto"] / best,
                    "planner_over_ar": tok["auto"] / tok["AR"],
                    "mean_tau": {n: sum(r["summary"][n]["mean_tau"] for r in runs) / len(runs)
                                 for n in ("chain", "auto", *narrow.values(), *trees.values())},
                    "same_run": True, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                    "exact": bool(run["args"].get("exact")), "invariant": inv,
                    # outputs equal to AR's / compared, per label, summed over the seeds (infer.bench checks them at T = 0
                    # and under --invariant: the same text, so the tok/s ratios compare the same work)
                    "same_text_as_ar": {n: [sum(r["summary"][n]["greedy_equal"] for r in runs),
                                            sum(r["summary"][n]["greedy_compared"] for r in runs)]
                                        for n in ("chain", "auto", *narrow.values(), *trees.values())
                                        if all("greedy_compared" in r["summary"][n] for r in runs)},
                    "seeds": seeds, **({"per_seed": per_seed} if len(seeds) > 1 else {}),
                    "planner_choices_per_task": [x["drafts"]["auto"].get("planner_choices")
                                                 for r in runs for x in r["tasks"]],
                    "per_task": [{**row, "seed": sd} for sd, r in zip(seeds, runs) for row in per_task(r)]})  # fmt: skip
        print(f"planner point {out[-1]}", flush=True)
        if on_point is not None:
            on_point(out[-1])
    return out


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``: ``--seeds``. Raises ValueError naming the text for an item that is not a
    non-negative integer in plain digits, or a seed given twice."""
    items = text.split(",")
    if not all(x.isascii() and x.isdigit() for x in items):
        raise ValueError(f"--seeds {text!r}: give non-negative integers joined by commas, e.g. 0,1,2")
    seeds = [int(x) for x in items]
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"--seeds {text!r}: a seed given twice")
    return seeds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None, help="JSON file (e.g. results/verify-h200.json)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (smoke test)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens of the 8B-shape step measurement")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--skip-steps", action="store_true", help="skip the 8B-shape step costs")
    ap.add_argument(
        "--skip-smollm2", action="store_true", help="with --planner: skip the chain-vs-tree τ part"
    )
    ap.add_argument("--planner", default=None, metavar="C:T,...", help="planner points, e.g. 1:0,8:0,8:1")
    ap.add_argument(
        "--smollm2", default=None, help="SmolLM2 target (GGUF file or HF folder) for the τ / speed part"
    )
    ap.add_argument("--draft", default=None, help="draft folder for --smollm2")
    ap.add_argument("--tree-budget", type=int, default=32)
    ap.add_argument("--fixed-trees", default=None, metavar="N[,N...]",
                    help="--planner points: fixed trees run beside the --tree-budget one (which always runs, as 'tree') and "
                         "compared with the planner")
    ap.add_argument("--plan-trees", default=None, metavar="N[/N...]",
                    help="--planner points: the planner's tree sizes (infer.bench plan_trees; default: the engine's)")
    ap.add_argument("--fixed-chains", default=None, metavar="N[,N...]",
                    help="--planner points: fixed chains narrower than the block (labels chainN, infer.bench "
                         f"width=N), run beside the full chain and compared with the planner (default {FIXED_CHAINS}; "
                         "none for no narrower chain)")
    ap.add_argument("--plan-chains", default=None, metavar="N[/N...]",
                    help="--planner points: the planner's narrower chains (infer.bench plan_chains; default: the "
                         "engine's)")
    ap.add_argument("--datasets", default="gsm8k,math500,humaneval,mbpp,mt-bench")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument(
        "--merge", action="store_true", help="update an existing --output file with the parts run now"
    )
    ap.add_argument("--keep-runs", default=None, metavar="DIR", help="keep each infer.bench JSON in DIR")
    ap.add_argument("--prefill-buckets", action=argparse.BooleanOptionalAction, default=None,
                    help="passed to every infer.bench run (default: the engine's)")
    ap.add_argument("--plan-drain-model", default=None, choices=list(DRAIN_MODELS),
                    help="--planner points: the planner's drain model (infer.bench --config auto:drain=...; default: "
                         "the engine's, persist)")
    ap.add_argument("--plan-state", default=None, choices=list(PLAN_STATES),
                    help="--planner points: the planner's state (infer.bench --config auto:state=...; default: the "
                         "engine's, steps)")
    ap.add_argument("--plan-drain", action=argparse.BooleanOptionalAction, default=None,
                    help="passed to the --planner points' infer.bench runs (default: infer.bench's, on)")
    ap.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                    help="passed to every infer.bench run: the engine's bit-exact mode, in which every mode decodes AR's "
                         "greedy text, so at T = 0 the modes' tok/s compare the same text (in the fast bf16 mode a "
                         "near-tie can flip and the texts part: on the H100 at concurrency 1 math500's five outputs "
                         "were 905-1,441 tokens long across the modes); default: the engine's")
    ap.add_argument("--invariant", action="store_true",
                    help="--planner points at T > 0: drafter-invariant verification in every run (infer.bench "
                         "--invariant): the chain and the planner decode AR's sampled text for the seed, so their tok/s "
                         "compare the same text as AR's; no tree runs there (invariant verification checks the chain "
                         "only: --fixed-trees and --plan-trees apply to the T = 0 points) and the planner runs AR and "
                         "the chain. T = 0 points are unchanged (use --exact there)")
    ap.add_argument("--seeds", default="0", metavar="S[,S...]",
                    help="--planner points at T > 0: one infer.bench run per sampling seed (--seed), tok/s averaged "
                         "over them (a probe changes the sampled text of every live request, so one seed's ratio "
                         "carries the text's noise); T = 0 points run once (greedy text does not depend on the seed)")
    args = ap.parse_args(argv)
    if (args.smollm2 is None) != (args.draft is None):
        ap.error("--smollm2 and --draft go together")
    if args.planner and not args.smollm2:
        ap.error("--planner needs --smollm2 and --draft")
    given = [f for f, v in (("--plan-state", args.plan_state), ("--plan-drain-model", args.plan_drain_model)) if v]
    if given and not args.planner:
        ap.error(f"{' and '.join(given)} set the --planner points' planner: give --planner")
    if args.planner and not all(len(p.split(":")) == 2 for p in args.planner.split(",")):
        ap.error(f"--planner {args.planner!r}: give CONCURRENCY:TEMPERATURE pairs, e.g. 1:0,8:1")
    if args.planner:
        try:
            pts = [(int(c), float(t)) for c, t in (p.split(":") for p in args.planner.split(","))]
        except ValueError:
            ap.error(f"--planner {args.planner!r}: CONCURRENCY is an integer, TEMPERATURE a number, e.g. 1:0,8:1")
        if len(set(pts)) < len(pts):
            ap.error(f"--planner {args.planner!r}: a point given twice")
        from dspine.sampling import MIN_TEMPERATURE

        bad = [f"{c}:{t:g}" for c, t in pts if c < 1 or not math.isfinite(t) or t < 0 or 0 < t < MIN_TEMPERATURE]
        if bad:
            ap.error(f"--planner {args.planner!r}: {', '.join(bad)}: CONCURRENCY must be >= 1 and TEMPERATURE 0 or a "
                     f"finite number >= {MIN_TEMPERATURE:g}")
    if args.invariant and not any(t > 0 for _, t in (pts if args.planner else [])):
        ap.error("--invariant applies to --planner points at T > 0 (at T = 0 use --exact: every mode then decodes "
                 "AR's greedy text)")
    if args.invariant and (args.plan_trees or args.fixed_trees) and not any(t == 0 for _, t in pts):
        ap.error("--invariant with --plan-trees or --fixed-trees and no T = 0 point: no tree runs at a T > 0 point "
                 "under invariant verification (the tree options apply to the T = 0 points)")
    if (args.fixed_trees or args.plan_trees or args.fixed_chains or args.plan_chains) and not args.planner:
        ap.error("--fixed-trees, --plan-trees, --fixed-chains and --plan-chains apply to --planner points")
    from infer.planner import plan_chains_flag, plan_trees_flag

    check_sizes(ap, "--fixed-chains", args.fixed_chains, lambda: fixed_chains(args), "chain widths", "4,8",
                args.plan_chains, plan_chains_flag)
    block = draft_block_size(args.draft)  # a narrower chain must be below the draft's block (None: not read here)
    if args.fixed_chains is None:  # the default, less what a small-block draft cannot run
        args.fixed_chains = ",".join(map(str, fixed_chains(args, block))) or "none"
    if block is not None and args.planner:
        for flag, widths in (("--fixed-chains", fixed_chains(args)), ("--plan-chains", parse_chain_flag(args.plan_chains))):
            if any(n >= block for n in widths):
                ap.error(f"{flag} {','.join(map(str, widths))}: each width must be below the draft's block of {block} "
                         f"({args.draft})")
    check_sizes(ap, "--fixed-trees", args.fixed_trees, lambda: fixed_trees(args), "tree sizes", "16,32",
                args.plan_trees, plan_trees_flag)
    try:
        args.seeds = parse_seeds(args.seeds)
    except ValueError as e:
        ap.error(str(e))
    if args.seeds != [0] and not any(t > 0 for _, t in (pts if args.planner else [])):
        ap.error(f"--seeds {','.join(map(str, args.seeds))}: applies to --planner points at T > 0 (none given)")
    if args.keep_runs and Path(args.keep_runs).exists() and not Path(args.keep_runs).is_dir():
        ap.error(f"--keep-runs {args.keep_runs}: exists and is not a folder")
    if not args.tiny and not torch.cuda.is_available():
        print(
            "error: bench_tree.py measures a CUDA GPU and none is visible; use --tiny for a CPU smoke run",
            file=sys.stderr,
        )
        return 2
    dev = torch.device("cpu" if args.tiny else "cuda")
    res: dict = {}
    if args.merge and args.output and Path(args.output).is_file():
        res = json.loads(Path(args.output).read_text())
    res.update(provenance(), tiny=args.tiny)
    if not args.skip_steps:
        res["step_cost"] = {**step_costs(args, dev), "provenance": provenance()}
    if args.planner:
        def merge_point(point: dict) -> None:  # written as soon as measured: a later point's failure keeps it
            by_point = {(p["concurrency"], p["temperature"]): p
                        for p in res.get("planner", []) + [{**point, "provenance": provenance()}]}
            res["planner"] = sorted(by_point.values(), key=lambda p: (p["temperature"], p["concurrency"]))
            write_output(args.output, res)

        planner_points(args, merge_point)
    if args.smollm2 and not args.skip_smollm2:
        sm = {**smollm2(args), "provenance": provenance()}
        res["smollm2"] = sm
        res["tree_tau_over_chain_tau"], res["tree_speedup_over_chain"] = (
            sm["tree_tau_over_chain_tau"],
            sm["tree_speedup_over_chain"],
        )
    write_output(args.output, res)
    print(json.dumps(res, indent=1))
    return 0


def write_output(path: str | None, res: dict) -> None:
    """``res`` as JSON into ``path`` (its folder made; nothing without a path)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(main())
