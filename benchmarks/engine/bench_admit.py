"""Cost of admitting prompts into the engine: the target's packed prefill and first token, with and without
the draft's context (the target features of every prompt position and their K/V in the draft cache).

A speculative engine admits with ``spec=True`` (:meth:`infer.engine.Engine._admit`); plain AR decoding
without. Issue 16: at concurrency 32 the planner, running AR at 99% of its steps, spent 0.1-0.28 s more per
task in admission than the AR engine (64 prompts, H200), most of its gap to AR. This times, per number of
prompts admitted at once: the whole admission both ways, and its parts (``prefill_packed`` with and without
features, the draft-context append), synchronized, after warm-up; with ``--profile`` a torch profiler table
of one speculative admission.

    python benchmarks/engine/bench_admit.py --target runs/smollm2/smollm2-hf \\
        --draft checkpoints/smollm2-135m-dspine --output results/admit-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from dspine.provenance import provenance  # noqa: E402
from dspine.sampling import SamplingParams  # noqa: E402
from infer.engine import load_engine  # noqa: E402


def timed(fn, device, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` synchronized calls after 2 warm-up calls."""
    out = []
    for i in range(reps + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="target folder (Hugging Face layout)")
    ap.add_argument("--draft", required=True, help="draft folder")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bf16 on a GPU, fp32 on the CPU")
    ap.add_argument("--counts", default="1,2,8,32", help="prompts admitted at once")
    ap.add_argument("--prompt-len", type=int, default=160, help="tokens per prompt (random ids)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="torch profiler table of one speculative admission of 2 prompts (1 if --counts is 1)")
    ap.add_argument("--prefill-buckets", action="store_true",
                    help="also time each admission with Engine.prefill_buckets (one CUDA graph replay per prompt at its "
                         "length bucket, the draft-context append inside it), at every count (the engine's own cap, "
                         "Engine.PREFILL_BUCKETS_MAX_PROMPTS, lifted): keys admit_ms_ar_buckets, admit_ms_spec_buckets")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.counts.split(",")]
    if min(counts) < 1:
        ap.error(f"--counts {args.counts}: each must be >= 1")
    dev = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[args.dtype] or (
        torch.bfloat16 if dev.type == "cuda" else torch.float32)
    eng, _ = load_engine(args.target, None, args.draft, device=dev, dtype=dtype, max_batch=max(counts),
                         max_seq=args.prompt_len + 300, impl="triton" if dev.type == "cuda" else "torch",
                         prefill_buckets=False)
    B = max(counts)
    s = eng._slots_for(B)
    kv, dcache = eng._cache_view(B)
    params = SamplingParams(max_new_tokens=256)
    g = torch.Generator().manual_seed(0)
    V = eng.target.args.vocab_size
    rows = []
    for n in counts:
        prompts = [torch.randint(10, V, (args.prompt_len,), generator=g).tolist() for _ in range(n)]
        items = [(b, p) for b, p in enumerate(prompts)]
        ids = [torch.tensor(p, device=dev) for p in prompts]
        slots = list(range(n))
        row = {"prompts": n, "prompt_len": args.prompt_len}
        for spec in (False, True):
            row[f"admit_ms_{'spec' if spec else 'ar'}"] = timed(
                partial(eng._admit, s, items, params, spec, kv, dcache, list(range(n))), dev, args.reps)
            if args.prefill_buckets:  # the same admission, each prompt one graph replay of its length bucket
                # (whatever the count: the engine's cap, PREFILL_BUCKETS_MAX_PROMPTS, lifted for this timing)
                eng.prefill_buckets, eng.PREFILL_BUCKETS_MAX_PROMPTS = True, max(counts)
                row[f"admit_ms_{'spec' if spec else 'ar'}_buckets"] = timed(
                    partial(eng._admit, s, items, params, spec, kv, dcache, list(range(n))), dev, args.reps)
                eng.prefill_buckets = False
                del eng.PREFILL_BUCKETS_MAX_PROMPTS  # back to the class's
            row[f"prefill_ms_{'features' if spec else 'plain'}"] = timed(
                partial(eng.target.prefill_packed, ids, slots, kv, want_features=spec), dev, args.reps)
        _, feats = eng.target.prefill_packed(ids, slots, kv, want_features=True)
        lengths = torch.full((n,), args.prompt_len, dtype=torch.int32, device=dev)
        idx = torch.arange(n, device=dev)

        def append(idx, feats, lengths):  # as the packed admission (Engine._admit): the packed features, no padding
            s.lengths[idx] = 0
            dcache.append_packed(feats, lengths, idx, impl=eng.impl)

        row["draft_append_ms"] = timed(partial(append, idx, feats, lengths), dev, args.reps)
        row["spec_over_ar"] = row["admit_ms_spec"] / row["admit_ms_ar"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {**provenance(), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "dtype": str(dtype), "target": args.target, "draft": args.draft, "rows": rows}
    if args.profile:
        k = min(2, B)
        items = [(b, torch.randint(10, V, (args.prompt_len,), generator=g).tolist()) for b in range(k)]
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with torch.profiler.profile(activities=acts) as prof:
            eng._admit(s, items, params, True, kv, dcache, list(range(k)))
            if dev.type == "cuda":
                torch.cuda.synchronize()
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=25)
        print(table)
        out["profile_table"] = table.splitlines()
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
