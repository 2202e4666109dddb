"""Where one engine step spends its time: per-kernel table of an AR step and a speculative step.

    python benchmarks/engine/profile_step.py --output results/profile-step-h200.json
    python benchmarks/engine/profile_step.py --tiny --device cpu --output /tmp/profile-step.json   # smoke
    python benchmarks/engine/profile_step.py --shape smollm2 --batch 1 --kinds ar,spec,tree32 --output F  # tree step

Random weights at Qwen3-8B shape (bf16 on CUDA; fp32 on the CPU; ``--tiny`` for a tiny shape): the
engine target and a 5-layer DSpine draft (residual injection, full rank, non-zero gates), a
``--context``-token context per row. CUDA graphs are OFF so that every kernel shows in
``torch.profiler``: the step is the eager sequence of launches the graph would replay, so wall
time here includes the host's launch overhead that the graph removes, while the kernel times are
the graph's. ``--draft-vocab-size N``: the draft's logits over N rows of the head (``dspine.draft_vocab``), as in
``bench_engine.py``. ``--shape`` picks the target (``qwen3-8b``, ``smollm2``: SmolLM2-135M's layout with the
3-layer draft of bench_draft_step.py, ``tiny``). For each batch size and step kind of ``--kinds`` (``ar``:
1 token through the target; ``spec``: draft block + verify block + accept + commit + draft context append;
``treeN``: the tree-verify step of N nodes, greedy: draft block, candidates and tree build, the target over
the N nodes with the tree mask, acceptance and path, the path's K/V move, commit), after ``--warmup`` eager steps,
``--steps`` steps are profiled and each kernel's device time summed by name. Idle rows: the step
does all its work and changes no state, so every profiled step is the same step.

JSON per ``batch{B}.{kind}``: ``kernel_us_per_step`` (sum of kernel device times),
``kernels_per_step`` (launches), ``wall_ms_per_step`` (eager, host-bound), and ``top`` = the 25
kernels with the largest total time: name, ``us_per_step``, ``count_per_step``, ``us_per_call``,
``fraction`` of the step's kernel time; ``lm_head_choice``: the engine's LM-head implementation per
row count (``dspine.ops.lm_head``; empty on the CPU). On the CPU the table lists PyTorch ops by self
CPU time.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.bench_draft_step import TARGETS, random_setup  # noqa: E402
from benchmarks.engine.bench_engine import (  # noqa: E402
    DRAFT_VOCAB_SIZE_HELP,
    FUSE_ACT_HELP,
    FUSE_NORM_CHOICES,
    FUSE_NORM_HELP,
    apply_fusion_args,
    check_draft_vocab_size,
    random_draft_vocab,
)
from dspine.io import atomic_write_json  # noqa: E402
from dspine.paths import output_arg  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.sampling import SamplingParams  # noqa: E402
from infer.engine import Engine  # noqa: E402

TOP = 25


def kernel_table(prof, steps: int, cuda: bool) -> dict:
    """Per-name totals of the profiled events: CUDA kernels (and memcpy/memset) on a GPU, PyTorch ops
    by self time on the CPU. Times in µs per step."""
    total, count = defaultdict(float), defaultdict(int)
    if cuda:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                total[e.name] += e.time_range.elapsed_us()
                count[e.name] += 1
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0:
                total[e.key] += e.self_cpu_time_total
                count[e.key] += e.count
    all_us = sum(total.values())
    top = sorted(total, key=total.get, reverse=True)[:TOP]
    return {
        "kernel_us_per_step": all_us / steps,
        "kernels_per_step": sum(count.values()) / steps,
        "top": [{"name": n, "us_per_step": total[n] / steps, "count_per_step": count[n] / steps,
                 "us_per_call": total[n] / count[n], "fraction": total[n] / all_us} for n in top],
    }


def profile_step(step, steps: int, warmup: int, cuda: bool) -> dict:
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    return {"wall_ms_per_step": wall * 1e3 / steps, **kernel_table(prof, steps, cuda)}


@torch.inference_mode()
def run(args) -> dict:
    shape = "tiny" if args.tiny else args.shape
    dev, dtype, impl, a, d, draft, target = random_setup(args.device, shape)
    cuda = dev.type == "cuda"
    res: dict = {**provenance(), "shape": shape, "dtype": str(dtype), "impl": impl, "cuda_graphs": False,
                 "context": args.context, "steps": args.steps, "draft_layers": d["layers"],
                 "block_size": draft.config.block_size, "kinds": args.kinds}
    vocab = random_draft_vocab(a.vocab_size, args.draft_vocab_size)  # --draft-vocab-size: bench_engine.py's set
    res["draft_vocab_size"] = args.draft_vocab_size or a.vocab_size
    res.update(apply_fusion_args(args, target))
    g = torch.Generator().manual_seed(1)
    greedy = SamplingParams(max_new_tokens=16)
    for B in args.batch:
        prompts = [torch.randint(0, a.vocab_size - 2, (args.context,), generator=g).tolist() for _ in range(B)]
        eng = Engine(target, draft, [-1], max_batch=B, max_seq=args.context + 128, max_new_cap=16, cuda_graphs=False,
                     draft_vocab=vocab)
        eng.generate(prompts, greedy)  # fills the caches; afterwards every row is idle (done)
        row = {}
        for kind in args.kinds:
            mode = ("tree", int(kind[4:])) if kind.startswith("tree") else None
            row[kind] = profile_step(eng._runner(B, greedy, kind != "ar", mode), args.steps, args.warmup, cuda)
            r = row[kind]
            print(f"batch {B} {kind}: {r['kernel_us_per_step']:.1f} us of kernels in {r['kernels_per_step']:.0f} "
                  f"launches per step; top: " + ", ".join(f"{k['name'][:40]} {k['us_per_step']:.1f}"
                                                         for k in r["top"][:5]), flush=True)
        for kind in args.kinds:
            if kind != "ar" and "ar" in row:
                row[f"{kind}_kernel_time_over_ar"] = row[kind]["kernel_us_per_step"] / row["ar"]["kernel_us_per_step"]
            if kind.startswith("tree") and "spec" in row:
                row[f"{kind}_kernel_time_over_spec"] = row[kind]["kernel_us_per_step"] / row["spec"]["kernel_us_per_step"]
        row["lm_head_choice"] = {str(m): c for m, c in sorted(eng.lm_head_choice.items())}  # rows -> impl (GPU)
        res[f"batch{B}"] = row
        del eng
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None, help="JSON file to write (an existing one only with --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shape instead of Qwen3-8B (CPU smoke test; = --shape tiny)")
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(TARGETS), help="target layout (random weights)")
    ap.add_argument("--kinds", default="ar,spec", help="comma list of step kinds: ar, spec, treeN (N nodes, 2..64)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=512, help="context tokens per row")
    ap.add_argument("--steps", type=int, default=5, help="profiled steps per kind")
    ap.add_argument("--warmup", type=int, default=3, help="eager steps before profiling (compiles the kernels)")
    ap.add_argument("--draft-vocab-size", type=int, default=0, help=DRAFT_VOCAB_SIZE_HELP)
    ap.add_argument("--fuse-norm", default=None, choices=FUSE_NORM_CHOICES, help=FUSE_NORM_HELP)
    ap.add_argument("--fuse-act", default=None, choices=("on", "off"), help=FUSE_ACT_HELP)
    args = ap.parse_args(argv)
    check_draft_vocab_size(ap, args.draft_vocab_size, TARGETS["tiny" if args.tiny else args.shape]["vocab_size"])
    if args.steps < 1 or args.context < 1:
        ap.error(f"--steps={args.steps} and --context={args.context} must be >= 1")
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for k in args.kinds:
        if not (k in ("ar", "spec") or (k.startswith("tree") and k[4:].isdigit() and 2 <= int(k[4:]) <= 64)):
            ap.error(f"--kinds: unknown step kind {k!r} (ar, spec or treeN with 2 <= N <= 64)")
    if not args.kinds:
        ap.error("--kinds is empty")
    output_arg(ap, args)  # before the profile: an existing result is not replaced by accident
    res = run(args)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.output, res, indent=1, allow_nan=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
