"""What the verify-budget planner's decode loop costs when it runs the same steps as a fixed configuration.

    python benchmarks/engine/bench_planner_loop.py --output results/planner-loop-h200.json
    python benchmarks/engine/bench_planner_loop.py --tiny --device cpu --batches 1,4 --new 16 --output /tmp/pl.json

Random weights at SmolLM2-135M shape (``--tiny``: a tiny shape), a 3-layer DSpine draft, ``--context`` random
prompt tokens per request, exactly ``--new`` new tokens per request (no EOS in the vocabulary's reach), as many
requests as slots (one wave: every slot busy from the first step). For each batch size B and temperature,
``Engine.generate`` decodes the same prompts in six configurations, in alternating order, ``--reps`` times:

- ``ar``: the engine without the draft (``use_draft=False``: the plain pipelined loop, plain AR steps);
- ``chain``: the fixed chain of ``verify_size`` (the plain pipelined loop);
- ``planner_ar``: ``budget="auto"`` with AR as the planner's only mode (``Engine.plan_modes``), so every step is
  the planner's AR step and every step goes through the planner's loop (choose, snapshot, observe); its AR
  steps leave their draft features pending, flushed every ``Engine.AR_DEFER`` steps (the default);
- ``planner_ar_immediate``: the same with ``defer_ar_append = False`` (the draft-context append in every AR
  step, as before the deferral);
- ``planner_ar_noflush``: ``planner_ar`` with ``Engine.ar_defer`` = ``--new``, so its AR steps keep their features
  pending and no flush runs (the loop runs at most ``--new`` steps; a flush would precede the next): ``planner_ar``
  against it is what the flushes cost, it against ``ar`` what the loop and the AR step's kept features cost
  (issue 16: the planner's AR steps at concurrency 32, T = 1 ran 1.447 against AR's 1.435 ms on the H100, and
  0.994 × AR here at batch 32, results/planner-loop-b32-b64-T1-h100.json, with these two parts not told apart);
- ``planner_chain``: ``budget="auto"`` with the chain as its only mode;
- with ``--switch N`` also ``tree``: the fixed tree of N nodes (the plain pipelined loop), ``planner_tree``: that tree
  as the planner's only mode (``planner_tree_over_tree``, as ``planner_chain_over_chain``), and ``planner_switch``: the
  chain and that tree in turn, step after step (``Engine.plan_schedule``: the planner's loop with no decision). Its ms per
  step ÷ the mean of ``planner_chain``'s and ``planner_tree``'s (``switch_over_mean``) is what alternating the two
  step graphs costs beyond the steps themselves (the mean weighted by the steps of each mode the switch runs made;
  ``None`` where either ran fewer than ``SWITCH_MIN_STEPS``) (issue 16: on the H200 the planner's steps took 1.7-2.6% longer than
  its modes' own steps in the fixed runs, results/planner-default*-h200-T0-c1.json).

``--exact``: every engine in exact mode (``Engine(exact=True)``, the mode of the same-text planner points; issue 16:
in those runs of 2026-12-06 the planner's chain steps were timed 3% longer than the fixed chain's at concurrency 8,
T = 0, 1.541 against 1.495 ms on the H100 and 1.525 against 1.481 ms on the H200, results/verify-exact-h*.json
``planner_choices_per_task`` ``measured_ms`` against ``per_task``; here, with random weights at batch 8, the
planner's chain step ran 0.996 of the fixed chain's in exact mode, results/planner-loop-exact-h100.json).

``planner_ar`` ÷ ``ar`` and ``planner_chain`` ÷ ``chain`` are the planner's loop and step overhead against the
configuration it chose (on the H200 at concurrency 32-64 and T = 1 it chose AR at 99-100% of its steps and ran
0.86-0.95 × the plain AR engine: results/verify-planner-h200.json). With random weights the draft's tokens are
rejected (τ ≈ 1): the chain rows measure the loop, not a speedup.

Per configuration: decode tok/s = new tokens ÷ (wall − prefill) (median over reps), ms per step, and the
loop's own split per step (``Engine.loop_profile``: ``launch_ms`` host time to choose and launch a step,
``wait_ms`` host time blocked on the device, ``host_ms`` the host's bookkeeping after the wait). A loop whose
``wait_ms`` is near 0 is host-bound: the device waits for the host; for the planner configurations also ``flushes``,
the draft-context flushes run (``Engine.loop_profile``). The JSON (``flush_rows`` = ``Engine.AR_DEFER``, and
``noflush_flush_rows`` = ``--new``, ``planner_ar_noflush``'s) is rewritten after every point, so a run stopped part way keeps the points it finished, with ``"complete": false``
(true once every point is in). An existing ``--output`` is refused unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.bench_draft_step import random_setup  # noqa: E402
from dspine.io import atomic_write_json  # noqa: E402
from dspine.paths import output_arg  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.sampling import SamplingParams  # noqa: E402
from infer.engine import Engine  # noqa: E402

CONFIGS = ("ar", "chain", "planner_ar", "planner_ar_immediate", "planner_ar_noflush", "planner_chain")
SWITCH_CONFIGS = ("tree", "planner_tree", "planner_switch")  # --switch N
SWITCH_MIN_STEPS = 4  # steps of each mode a planner_switch run needs for switch_over_mean


def _distinct_list(cast, what: str, least: float):
    """An argparse type: distinct comma-separated ``cast`` values >= ``least`` (a bad list is a usage error)."""

    def parse(text: str) -> list:
        try:
            out = [cast(x) for x in text.split(",")]
        except ValueError:
            kind = "integers" if cast is int else "numbers"
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind}") from None
        if min(out) < least or len(set(out)) != len(out):
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be >= {least:g} and distinct")
        return out

    return parse


int_list = _distinct_list(int, "batch sizes", 1)  # --batches
temp_list = _distinct_list(float, "temperatures", 0)  # --temperatures


def write(res: dict, path: str | None) -> None:
    """The record to ``path`` (none: nothing), through a temp file and a rename: rewritten after every point,
    a run killed mid-write keeps the previous points."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, res, indent=1, allow_nan=True)


def params_for(temperature: float, new: int) -> SamplingParams:
    """Greedy at T = 0, else temperature sampling with top_p 0.95, top_k 20 (the project's T > 0 setting)."""
    if temperature == 0:
        return SamplingParams(max_new_tokens=new)
    return SamplingParams(max_new_tokens=new, temperature=temperature, top_p=0.95, top_k=20)


def run(args) -> dict:
    shape = "tiny" if args.tiny else "smollm2"
    dev, dtype, impl, a, d, draft, target = random_setup(args.device, shape)
    cuda = dev.type == "cuda"
    res: dict = {**provenance(), "shape": shape, "dtype": str(dtype), "impl": impl, "context": args.context,
                 "new_tokens": args.new, "reps": args.reps, "draft_layers": d["layers"],
                 "flush_rows": Engine.AR_DEFER, "noflush_flush_rows": args.new, "switch_tree": args.switch,
                 "exact": args.exact, "complete": False,
                 "points": []}
    configs = CONFIGS + (SWITCH_CONFIGS if args.switch else ())
    g = torch.Generator().manual_seed(0)
    max_seq = args.context + args.new + 64
    for B in args.batches:
        prompts = [torch.randint(0, a.vocab_size - 2, (args.context,), generator=g).tolist() for _ in range(B)]
        fixed = Engine(target, draft, [-1], max_batch=B, max_seq=max_seq, max_new_cap=args.new, exact=args.exact)
        planners = {}
        chain, tree = ("chain", fixed.verify_size), ("tree", args.switch)
        setups = [("planner_ar", [("ar", 1)], True), ("planner_ar_immediate", [("ar", 1)], False),
                  ("planner_ar_noflush", [("ar", 1)], True), ("planner_chain", [chain], True)]
        if args.switch:
            setups += [("planner_tree", [tree], True), ("planner_switch", [chain, tree], True)]
        for name, modes, defer in setups:
            eng = Engine(target, draft, [-1], max_batch=B, max_seq=max_seq, max_new_cap=args.new, budget="auto",
                         plan_trees=tuple(n for k, n in modes if k == "tree") or None, exact=args.exact)
            eng.plan_modes = modes  # the planner's only modes: every step is one of them, through the planner's loop
            eng.plan_schedule = modes if name == "planner_switch" else None  # in turn, no decision
            eng.defer_ar_append = defer
            if name == "planner_ar_noflush":  # F >= the loop's steps: no flush (set before its slots are made)
                eng.ar_defer = args.new
            planners[name] = eng
        engines = {"ar": fixed, "chain": fixed, **planners}
        if args.switch:  # the fixed tree: no planner, the plain pipelined loop
            engines["tree"] = Engine(target, draft, [-1], max_batch=B, max_seq=max_seq, max_new_cap=args.new,
                                     verify="tree", tree_budget=args.switch, exact=args.exact)
        planners.clear()
        for temperature in args.temperatures:
            params = params_for(temperature, args.new)
            for name in configs:  # warm-up: graph capture, kernel compilation, the planner's cost table
                engines[name].generate(prompts, params, use_draft=name != "ar")
            rows = {name: [] for name in configs}
            switch_steps: dict = {}  # planner_switch: steps per mode over the timed runs (Engine.planner_report)
            for rep in range(args.reps):
                order = configs if rep % 2 == 0 else configs[::-1]
                for name in order:
                    out = engines[name].generate(prompts, params, use_draft=name != "ar")
                    if name == "planner_switch":
                        for mode, e in engines[name].planner_report.items():
                            switch_steps[mode] = switch_steps.get(mode, 0) + e["steps"]
                    prof = dict(engines[name].loop_profile)
                    tokens = sum(len(r) for r in out.token_ids)
                    decode_s = prof["wall_s"] - prof["prefill_s"]
                    steps = max(prof["steps"], 1)
                    rows[name].append({"tok_per_s": tokens / decode_s, "ms_per_step": 1e3 * decode_s / steps,
                                       "steps": prof["steps"], "tokens": tokens,
                                       **{k.replace("_s", "_ms"): 1e3 * prof[k] / steps
                                          for k in ("launch_s", "wait_s", "host_s")},
                                       **({"flushes": prof["flushes"]} if "flushes" in prof else {})})  # planners
            point = {"batch": B, "temperature": temperature}
            for name in configs:
                point[name] = {k: statistics.median(r[k] for r in rows[name]) for k in rows[name][0]}
            point["planner_ar_over_ar"] = point["planner_ar"]["tok_per_s"] / point["ar"]["tok_per_s"]
            point["planner_ar_immediate_over_ar"] = point["planner_ar_immediate"]["tok_per_s"] / point["ar"]["tok_per_s"]
            point["planner_ar_noflush_over_ar"] = point["planner_ar_noflush"]["tok_per_s"] / point["ar"]["tok_per_s"]
            point["planner_chain_over_chain"] = point["planner_chain"]["tok_per_s"] / point["chain"]["tok_per_s"]
            if args.switch:  # alternating the two step graphs against the two alone, weighted by the steps each ran
                point["planner_tree_over_tree"] = point["planner_tree"]["tok_per_s"] / point["tree"]["tok_per_s"]
                n_chain = switch_steps.get(f"chain{chain[1]}", 0)
                n_tree = switch_steps.get(f"tree{tree[1]}", 0)
                point["switch_steps"] = {"chain": n_chain, "tree": n_tree}
                # a run too short to alternate (fewer than SWITCH_MIN_STEPS of either) measures no switching: None
                point["switch_over_mean"] = (
                    point["planner_switch"]["ms_per_step"] * (n_chain + n_tree)
                    / (n_chain * point["planner_chain"]["ms_per_step"] + n_tree * point["planner_tree"]["ms_per_step"])
                    if min(n_chain, n_tree) >= SWITCH_MIN_STEPS else None)
            res["points"].append(point)
            write(res, args.output)  # after every point: a run stopped part way keeps what it measured
            print(f"B={B} T={temperature:g}: " + ", ".join(
                f"{n} {point[n]['tok_per_s']:.0f} tok/s ({point[n]['ms_per_step']:.3f} ms/step, launch "
                f"{point[n]['launch_ms']:.3f} wait {point[n]['wait_ms']:.3f} host {point[n]['host_ms']:.3f})"
                for n in configs) + f"; planner_ar/ar {point['planner_ar_over_ar']:.3f} (immediate append "
                f"{point['planner_ar_immediate_over_ar']:.3f}, no flush {point['planner_ar_noflush_over_ar']:.3f}), "
                f"planner_chain/chain "
                f"{point['planner_chain_over_chain']:.3f}"
                + (f", planner_tree/tree {point['planner_tree_over_tree']:.3f}" if args.switch else "")
                + (f", switch/mean {point['switch_over_mean']:.3f}" if point.get("switch_over_mean") else ""),
                flush=True)
        engines.clear()
        del fixed
        if cuda:
            torch.cuda.empty_cache()
    res["complete"] = True  # every point measured (a stopped run's file keeps "complete": false)
    return res


def build_parser() -> argparse.ArgumentParser:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None, help="JSON file to write (refused if it exists, unless --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--batches", type=int_list, default=[1, 8, 32, 64],
                    help="comma-separated batch sizes (requests = slots)")
    ap.add_argument("--temperatures", type=temp_list, default=[0.0, 1.0],
                    help="comma-separated; T > 0 uses top_p 0.95, top_k 20")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=256, help="new tokens per request (all of them: no EOS)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions of each configuration (median)")
    ap.add_argument("--exact", action="store_true", help="every engine in exact mode (Engine(exact=True))")
    ap.add_argument("--switch", type=int, default=0, metavar="N",
                    help="also the tree of N nodes alone and the chain and that tree in turn (0: not; 2..64)")
    return ap


def require_positive(ap: argparse.ArgumentParser, args, flags) -> None:
    """A usage error (exit 2) naming the first of ``flags`` (argument names) whose value is below 1."""
    for flag in flags:
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")


def finish(res: dict, path: str | None) -> int:
    """The last write of a benchmark's record (:func:`write`), said on stdout; exit status 0."""
    write(res, path)
    if path:
        print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    require_positive(ap, args, ("context", "new", "reps"))
    if args.switch and not 2 <= args.switch <= 64:
        ap.error(f"--switch {args.switch}: a tree size in 2..64, or 0 for none")
    output_arg(ap, args)
    return finish(run(args), args.output)


if __name__ == "__main__":
    raise SystemExit(main())
