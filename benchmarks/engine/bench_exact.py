"""Exact mode on a GPU (issue 13): speculative output identical to the engine's own AR output, and
what exact mode costs against the fast mode at Qwen3-8B shape.

    python benchmarks/engine/bench_exact.py --parts smollm2 --smollm2-target runs/smollm2/smollm2-hf \\
        --output results/exact-h200.json
    python benchmarks/engine/bench_exact.py --parts 8b,cost --append --output results/exact-h200.json
    python benchmarks/engine/bench_exact.py --tiny --cpu --output /tmp/exact.json        # CPU smoke test

Parts (``--parts``, comma separated; each prints its wall time):
* ``smollm2``: the SmolLM2 target (a converted HF folder) with its draft (default the shipped
  ``checkpoints/smollm2-135m-dspine``), ``--smollm2-prompts`` first-turn prompts per task of the
  five eval sets (``infer.datasets``), ``--smollm2-tokens`` new tokens, greedy;
* ``8b``: a random bf16 target at Qwen3-8B shape (``bench_engine.build``) with an oracle draft
  that proposes the engine's own AR continuation with every ``--oracle-every``-th position
  corrupted (so verify blocks are accepted deep, then rejected: rollbacks, ragged batches),
  ``--8b-prompts`` random prompts of mixed length × ``--8b-tokens`` new tokens;
  both in exact mode at batch 1 and 8, CUDA graphs on and off (the graphs-off runs use the first
  ``--eager-prompts`` prompts, per task for SmolLM2: eager decoding is several times slower).
  Each run decodes AR, then speculatively, with the same engine: ``runs`` gets
  ``{target, batch, cuda_graphs, compared, identical}`` (+ τ, seconds, and whether the AR output
  equals the first configuration's AR output: batch and graph invariance of AR itself).
* ``cost``: step times at 8B shape (graph replays, idle rows at context ``--ctx``, warm-up excluded,
  fast and exact measured alternately, median of ``--rounds`` medians): ``exact_over_fast`` =
  ``{ar_step_bs1, spec_step_bs1, ar_step_bs8, spec_step_bs8}`` = exact ms ÷ fast ms.
``--append`` adds to an existing ``--output`` (runs extended, other keys replaced), so the parts can
run as separate commands. ``--tiny`` uses bench_engine's tiny shape for ``8b`` and ``cost``.
Exit status 1 if any exact run is not identical.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.bench_engine import QWEN3_8B, TINY, build, timed  # noqa: E402
from benchmarks.engine.lossless import install_device_oracle  # noqa: E402
from dspine.io import atomic_write_json  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.sampling import SamplingParams  # noqa: E402
from infer.engine import Engine, load_engine  # noqa: E402
from infer.model import EngineTarget, ModelArgs  # noqa: E402

TASKS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
REPO = Path(__file__).resolve().parents[2]
# defaults: the sizes, and a CPU smoke test's
FULL_SIZES = dict(smollm2_prompts=20, smollm2_tokens=512, eightb_prompts=64, eightb_tokens=256, eager_prompts=2,
                  min_prompt=16, max_prompt=512, ctx=768, iters=30, rounds=3)
TINY_SIZES = dict(smollm2_prompts=1, smollm2_tokens=16, eightb_prompts=4, eightb_tokens=24, eager_prompts=1,
                  min_prompt=4, max_prompt=40, ctx=64, iters=2, rounds=1)


def identity_runs(name: str, make_engine, prompts: list[list[int]], eager_prompts: list[list[int]], max_new: int,
                  oracle_every: int | None, report: list, cpu: bool = False) -> None:
    """AR then speculative decoding with one exact engine per graphs setting, batch 1 and 8; appends a
    row per (batch, graphs) to ``report``. ``make_engine(graphs)`` -> Engine; ``oracle_every``: install
    the device oracle over the AR output (every n-th position corrupted) instead of the engine's draft.
    On the CPU (``cpu`` or no CUDA) only the graphs-off runs, on all of ``prompts``."""
    params = SamplingParams(max_new_tokens=max_new)
    first_ar: dict[tuple, list[int]] = {}  # prompt tokens -> AR output of the first configuration that ran it
    for graphs in (True, False) if torch.cuda.is_available() and not cpu else (False,):
        use = prompts if graphs or cpu or not torch.cuda.is_available() else eager_prompts
        for batch in (1, 8):
            t0 = time.perf_counter()
            eng = make_engine(graphs)
            ar = eng.generate(use, params, concurrency=batch, use_draft=False).token_ids
            if oracle_every:
                install_device_oracle(eng, [p + a for p, a in zip(use, ar)], every=oracle_every)
            spec = eng.generate(use, params, concurrency=batch)
            same = [s == a for s, a in zip(spec.token_ids, ar)]
            # keyed by the prompt: the graphs-off runs take a subset (eager_prompts) in another order
            ar_same = [first_ar.setdefault(tuple(p), a) == a for p, a in zip(use, ar)]
            row = {"target": name, "batch": batch, "cuda_graphs": eng.cuda_graphs, "compared": len(use),
                   "identical": sum(same), "tau": spec.stats.tau, "max_new_tokens": max_new,
                   "ar_equal_to_first_config": sum(ar_same),
                   "first_differing_prompts": [i for i, ok in enumerate(same) if not ok][:10],
                   "seconds": time.perf_counter() - t0}
            report.append(row)
            print(f"{name:8} batch={batch} graphs={graphs!s:5} identical {row['identical']}/{row['compared']} "
                  f"tau={row['tau']:.2f} AR==first {row['ar_equal_to_first_config']}/{len(use)} "
                  f"({row['seconds']:.1f} s)", flush=True)
            del eng


def smollm2_part(args, report: list) -> None:
    from dspine.paths import load_tokenizer, resolve_model_path
    from dspine.prompts import encode_prompt
    from infer.datasets import load_eval_prompts

    path, gguf = resolve_model_path(args.smollm2_target, None)
    tok = load_tokenizer(path, gguf)
    chat = bool(getattr(tok, "chat_template", None))
    per_task = []
    for task in TASKS:
        items = load_eval_prompts(task, args.smollm2_prompts, args.data_dir)
        per_task.append([encode_prompt(tok, p.turns[0], chat=chat)[-args.max_prompt_tokens :] for p in items])
    prompts = [p for ps in per_task for p in ps]
    eager = [p for ps in per_task for p in ps[: args.eager_prompts]]
    dev = "cpu" if args.cpu else "cuda"
    max_seq = max(map(len, prompts)) + args.smollm2_tokens + 64

    def make(graphs: bool) -> Engine:
        eng, _ = load_engine(path, gguf, args.smollm2_draft, device=dev, dtype=torch.bfloat16, max_batch=8,
                             max_seq=max_seq, cuda_graphs=graphs and dev == "cuda", exact=True,
                             max_new_cap=args.smollm2_tokens)
        return eng

    identity_runs("smollm2", make, prompts, eager, args.smollm2_tokens, None, report, args.cpu)


def random_target(args, dev):
    """(EngineTarget, draft) at the 8B (or tiny) shape, random bf16 weights, the transformers copy freed."""
    hf, dm = build(TINY if args.tiny else QWEN3_8B, dev, torch.bfloat16, args.draft_layers, 16)
    a = ModelArgs.from_hf_config(hf.config)
    target = EngineTarget.from_hf_state(a, hf.state_dict(), dev, torch.bfloat16, dm.config.target_layer_ids,
                                        "triton" if dev.type == "cuda" else "torch")
    del hf
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return target, dm


def eightb_part(args, target, draft, report: list) -> None:
    dev = target.embed.device
    V = target.args.vocab_size
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_prompt, args.max_prompt + 1, (args.eightb_prompts,), generator=g).tolist()
    prompts = [torch.randint(0, V - 2, (n,), generator=g).tolist() for n in lens]
    max_seq = args.max_prompt + args.eightb_tokens + 64

    def make(graphs: bool) -> Engine:
        return Engine(target, draft, [-1], max_batch=8, max_seq=max_seq, cuda_graphs=graphs and dev.type == "cuda",
                      exact=True, max_new_cap=args.eightb_tokens)

    identity_runs("qwen3-8b-shape-random" if not args.tiny else "tiny-random", make, prompts,
                  prompts[: args.eager_prompts], args.eightb_tokens, args.oracle_every, report, args.cpu)


def cost_part(args, target, draft) -> dict:
    """exact ms ÷ fast ms of one AR step and one speculative step (graph replays on the GPU), batch 1 and 8."""
    dev = target.embed.device
    greedy = SamplingParams(max_new_tokens=16)
    out: dict = {}
    ms: dict = {}
    for B in (1, 8):
        engines = {mode: Engine(target, draft, [-1], max_batch=B, max_seq=args.ctx + 64, exact=mode == "exact",
                                cuda_graphs=dev.type == "cuda") for mode in ("fast", "exact")}
        steps = {}
        for mode, eng in engines.items():
            for kind, spec in (("ar", False), ("spec", True)):
                steps[(mode, kind)] = eng._runner(B, greedy, spec)  # captures (and warms) the graph
            s = eng._slots_for(B)
            s.done.fill_(1)  # idle rows: the step computes everything and commits nothing
            s.lengths.fill_(args.ctx)  # attention over a context of ctx positions
        times: dict = {k: [] for k in steps}
        for _ in range(args.rounds):  # alternate fast and exact: drift hits both
            for k, fn in steps.items():
                times[k].append(timed(fn, args.iters))
        for (mode, kind), t in times.items():
            ms[f"{kind}_step_bs{B}_{mode}_ms"] = sorted(t)[len(t) // 2]
        for kind in ("ar", "spec"):
            out[f"{kind}_step_bs{B}"] = ms[f"{kind}_step_bs{B}_exact_ms"] / ms[f"{kind}_step_bs{B}_fast_ms"]
        print(f"batch {B}: " + ", ".join(f"{k}={v:.3f}" for k, v in ms.items() if f"bs{B}" in k)
              + f" -> exact/fast AR {out[f'ar_step_bs{B}']:.3f}, spec {out[f'spec_step_bs{B}']:.3f}", flush=True)
        del engines, steps
    return {"exact_over_fast": out, "step_ms": ms, "ctx": args.ctx}


@torch.inference_mode()
def run(args) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    res: dict = {"runs": [], "part_seconds": {}}
    if "smollm2" in parts:
        t = time.perf_counter()
        smollm2_part(args, res["runs"])
        res["part_seconds"]["smollm2"] = time.perf_counter() - t
    if "8b" in parts or "cost" in parts:
        t = time.perf_counter()
        target, draft = random_target(args, dev)
        res["part_seconds"]["build_8b"] = time.perf_counter() - t
        if "8b" in parts:
            t = time.perf_counter()
            eightb_part(args, target, draft, res["runs"])
            res["part_seconds"]["8b"] = time.perf_counter() - t
        if "cost" in parts:
            t = time.perf_counter()
            res.update(cost_part(args, target, draft))
            res["part_seconds"]["cost"] = time.perf_counter() - t
    for k, v in res["part_seconds"].items():
        print(f"part {k}: {v:.1f} s", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--append", action="store_true", help="add to an existing --output instead of replacing it")
    ap.add_argument("--parts", default="smollm2,8b,cost", help="comma list of smollm2, 8b, cost")
    ap.add_argument("--tiny", action="store_true", help="tiny random target for 8b/cost and small sizes (smoke test)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (torch kernels, no graphs)")
    ap.add_argument("--smollm2-target", default=None, help="SmolLM2 HF folder (e.g. runs/smollm2/smollm2-hf)")
    ap.add_argument("--smollm2-draft", default=str(REPO / "checkpoints" / "smollm2-135m-dspine"))
    ap.add_argument("--smollm2-prompts", type=int, default=None, help="prompts per task (5 tasks)")
    ap.add_argument("--smollm2-tokens", type=int, default=None)
    ap.add_argument("--max-prompt-tokens", type=int, default=1536)
    ap.add_argument("--data-dir", default=None, help="eval sets folder (default $DSPINE_SHARED/data/eval, else the Hub)")
    ap.add_argument("--8b-prompts", dest="eightb_prompts", type=int, default=None)
    ap.add_argument("--8b-tokens", dest="eightb_tokens", type=int, default=None)
    ap.add_argument("--min-prompt", type=int, default=None)
    ap.add_argument("--max-prompt", type=int, default=None)
    ap.add_argument("--oracle-every", type=int, default=11, help="oracle draft: corrupt every n-th position")
    ap.add_argument("--eager-prompts", type=int, default=None,
                    help="graphs-off runs: the first this many prompts (per task for SmolLM2)")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=None, help="cost: context length of the timed steps")
    ap.add_argument("--iters", type=int, default=None, help="cost: timed replays per measurement")
    ap.add_argument("--rounds", type=int, default=None, help="cost: alternating fast/exact measurements")
    ap.add_argument("--linear-config", default=None, metavar="BM,BN,BK,WARPS,STAGES",
                    help="exact GEMM tiles for every weight (dspine.ops.linear.CONFIG_OVERRIDE; from "
                         "benchmarks/kernels/bench_linear.py)")
    args = ap.parse_args(argv)
    for name, value in (TINY_SIZES if args.tiny else FULL_SIZES).items():  # sizes not given on the command line
        if getattr(args, name) is None:
            setattr(args, name, value)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"smollm2", "8b", "cost"}:
        ap.error(f"--parts {args.parts!r}: choose from smollm2, 8b, cost")
    if "smollm2" in parts and not args.smollm2_target:
        ap.error("--parts smollm2 needs --smollm2-target (the converted SmolLM2 HF folder)")
    for name in ("smollm2_prompts", "smollm2_tokens", "eightb_prompts", "eightb_tokens", "eager_prompts", "ctx",
                 "iters", "rounds", "oracle_every", "min_prompt"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-').replace('eightb', '8b')} {getattr(args, name)}: must be >= 1")
    if args.max_prompt < args.min_prompt:
        ap.error(f"--max-prompt {args.max_prompt} < --min-prompt {args.min_prompt}")
    if args.linear_config:
        from dspine.ops import linear as lin

        try:
            cfg = tuple(int(v) for v in args.linear_config.split(","))
        except ValueError:
            cfg = ()
        if len(cfg) != 5 or min(cfg) < 1:
            ap.error(f"--linear-config {args.linear_config!r}: give five positive ints BM,BN,BK,WARPS,STAGES")
        lin.CONFIG_OVERRIDE = cfg
    out = Path(args.output)
    if out.is_dir():
        ap.error(f"--output {out} is a folder; give a file name")
    res = run(args)
    prev: dict = {}
    if args.append and out.is_file():
        prev = json.loads(out.read_text())
    merged = {**prev, **provenance(), **{k: v for k, v in res.items() if k not in ("runs", "part_seconds")}}
    merged["runs"] = prev.get("runs", []) + res["runs"]
    merged["part_seconds"] = {**prev.get("part_seconds", {}), **res["part_seconds"]}
    merged["commands"] = prev.get("commands", []) + [" ".join(sys.argv if argv is None else ["bench_exact.py", *argv])]
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, merged, indent=1, allow_nan=True)
    bad = [r for r in res["runs"] if r["identical"] != r["compared"]]
    print(f"wrote {out}: {len(merged['runs'])} runs" + (f"; exact_over_fast {merged['exact_over_fast']}"
                                                        if "exact_over_fast" in merged else ""))
    if bad:
        print(f"error: {len(bad)} exact runs with speculative != AR output", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
