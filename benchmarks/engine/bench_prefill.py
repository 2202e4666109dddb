"""Prefill time for prompt lengths the engine has not seen before against lengths it has (time to first token).

    python benchmarks/engine/bench_prefill.py --output results/prefill-h200.json
    python benchmarks/engine/bench_prefill.py --device cpu --tiny --output /tmp/prefill.json   # smoke

Why: ``infer.bench`` on an H200 showed that the first pass of a configuration over a task's prompts
spends 0.5-2 s more in prefill than a second pass over the same prompts (``warmup_profile.prefill_s``
against ``profile.prefill_s`` in results/smollm2-h200-shipped-*.json; decode time equal), i.e. tens of
milliseconds per prompt length seen for the first time. A server sees new lengths all the time, so
that cost is paid by users, not only by benchmarks.

What it does: a random-weight AR engine of the SmolLM2-135M shape (bf16 on CUDA), one fresh process
per ``--settings`` entry (so process-wide caches start cold), each timing ``Engine.generate`` with one
new token on: ``--lengths`` prompts of distinct lengths never seen (``first``), the same prompts again
(``repeat``), and the same for packed admissions of 8 prompts at once (concurrency 8: one packed
prefill per group). Settings (the backends :func:`dspine.ops.sdpa.sdpa` allows the prompt attention):
``torch_default`` (torch's own choice: cuDNN on an H200; the engine before results/prefill-h200.json),
``no_cudnn`` (flash, memory-efficient, math: the engine's default since), ``flash`` (flash only),
``buckets`` (``no_cudnn`` with ``Engine(prefill_buckets=True)``: each prompt alone, padded to its length
bucket, one CUDA graph per bucket). For ``buckets`` "first" is still a length's first prompt, whose bucket may
already have its graph (the warm-up lengths fill the top bucket); ``<phase>_new_buckets`` counts the graphs each
phase captured.
``--profile`` adds torch.profiler's ten most expensive ops (self CPU time) of a first and a repeat
pass in the ``torch_default`` setting.

Writes JSON: per setting ``c1_first_ms`` / ``c1_repeat_ms`` (median prefill time per prompt),
``c8_first_ms`` / ``c8_repeat_ms`` (median per packed group of 8; packed prompts attend in one varlen
flash call, so only a refill of one prompt goes through SDPA) and ``sdp_backends``, plus the profiler
tables.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.bench_draft_step import TARGETS, random_target  # noqa: E402
from dspine.io import atomic_write_json  # noqa: E402
from dspine.ops import sdpa as sdpa_mod  # noqa: E402
from dspine.paths import output_arg  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.sampling import SamplingParams  # noqa: E402
from infer.engine import Engine  # noqa: E402
from infer.model import ModelArgs  # noqa: E402

SETTINGS = ("torch_default", "no_cudnn", "flash", "buckets")


def apply_setting(name: str) -> None:
    """Choose the SDPA backends :func:`dspine.ops.sdpa.sdpa` allows for setting ``name`` (one of SETTINGS)."""
    if name == "torch_default":
        sdpa_mod.BACKENDS = None
    elif name == "flash":
        sdpa_mod.BACKENDS = ("FLASH_ATTENTION",)
    elif name not in ("no_cudnn", "buckets"):
        raise ValueError(f"unknown setting {name!r}; expected one of {SETTINGS}")


def backends() -> list[str] | str:
    """The SDPA backends the engine's prefill may use in this setting."""
    return list(sdpa_mod.BACKENDS) if sdpa_mod.BACKENDS is not None else "torch's choice (cuDNN first on an H200)"


def prompts_of(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(1, vocab - 1) for _ in range(n)] for n in lengths]


def run_setting(args) -> dict:
    """One setting in this process: the medians of the module docstring."""
    apply_setting(args.setting)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = ModelArgs(**TARGETS["tiny" if args.tiny else "smollm2"])
    target = random_target(a, [], dev, dtype, "triton" if dev.type == "cuda" else "torch")
    eng = Engine(target, None, [-1], max_batch=8, max_seq=args.max_len + 8, max_new_cap=2,
                 prefill_buckets=args.setting == "buckets")
    one = SamplingParams(max_new_tokens=1)
    g = random.Random(0)
    # start-up: graph capture and every kernel compiled once, on lengths outside the measured ones
    warm = prompts_of([args.max_len - 1, args.max_len - 2] * 4, a.vocab_size, 1)
    eng.generate(warm[:1], one, concurrency=1)
    eng.generate(warm, one, concurrency=8)
    used = {args.max_len - 1, args.max_len - 2}

    def fresh(n: int) -> list[int]:
        """n prompt lengths in 16 .. max_len - 4 not used before (main() checks that enough exist)."""
        left = [x for x in range(16, args.max_len - 3) if x not in used]
        if len(left) < n:
            raise ValueError(f"--max-len {args.max_len}: {len(left)} unused prompt lengths left, {n} needed")
        out = g.sample(left, n)
        used.update(out)
        return out

    def time_c1(ps):
        ms = []
        for p in ps:
            r = eng.generate([p], one, concurrency=1)
            ms.append(1e3 * r.prefill_s)
        return ms

    def time_c8(groups):
        return [1e3 * eng.generate(grp, one, concurrency=8).prefill_s for grp in groups]

    c1 = prompts_of(fresh(args.lengths), a.vocab_size, 2)
    c8 = [prompts_of(fresh(8), a.vocab_size, 3 + i) for i in range(args.lengths // 4)]
    out = {"setting": args.setting, "sdp_backends": backends()}
    for name, fn, arg in (("c1_first", time_c1, c1), ("c1_repeat", time_c1, c1), ("c8_first", time_c8, c8),
                          ("c8_repeat", time_c8, c8)):
        before = len(eng._prefill_graphs)
        out[f"{name}_ms"] = fn(arg)
        if args.setting == "buckets":  # prefill graphs captured in this phase (a bucket's first prompt)
            out[f"{name}_new_buckets"] = len(eng._prefill_graphs) - before
    if args.profile and args.setting == "torch_default":
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        ps = prompts_of(fresh(5), a.vocab_size, 99)
        for name in ("profile_first", "profile_repeat"):
            with profile(activities=acts) as prof:
                time_c1(ps)
            out[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60)
    for k in [k for k in out if k.endswith("_ms")]:
        out[k.replace("_ms", "_median_ms")] = statistics.median(out[k])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None, help="JSON file")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny target (CPU smoke test)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of {SETTINGS}")
    ap.add_argument("--setting", default=None, help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--lengths", type=int, default=20, help="prompts of distinct new lengths per pass (default 20)")
    ap.add_argument("--max-len", type=int, default=600, help="longest prompt (default 600)")
    ap.add_argument("--profile", action="store_true",
                    help="profiler tables of a first and a repeat pass (torch_default setting)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per setting's process (default 900)")
    args = ap.parse_args(argv)
    if args.setting:
        print("RESULT " + json.dumps(run_setting(args)), flush=True)
        return 0
    settings = [x.strip() for x in args.settings.split(",")]
    bad = [x for x in settings if x not in SETTINGS]
    if bad or not settings:
        ap.error(f"--settings {args.settings!r}: unknown setting {bad[0]!r}; expected some of {SETTINGS}" if bad
                 else f"--settings {args.settings!r}: give at least one of {SETTINGS}")
    if args.lengths < 4:
        ap.error(f"--lengths {args.lengths}: must be >= 4 (the packed part admits groups of 8, --lengths // 4 of them)")
    need = args.lengths + 8 * (args.lengths // 4) + (5 if args.profile else 0)  # distinct new lengths used
    if args.max_len - 19 < need:
        ap.error(f"--max-len {args.max_len}: prompts of 16 .. {args.max_len - 4} tokens give {max(args.max_len - 19, 0)} "
                 f"distinct lengths, and --lengths {args.lengths} needs {need}: raise --max-len to {need + 19} or more")
    try:
        dev = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device!r}: not a torch device (cuda, cuda:N or cpu)")
    if dev.type not in ("cuda", "cpu"):
        ap.error(f"--device {args.device!r}: the engine runs on cuda or cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA GPU is visible (use --device cpu --tiny for a smoke run)")
    output_arg(ap, args)  # an empty --output name is refused, not skipped
    runs = {}
    for s in settings:
        cmd = [sys.executable, __file__, "--setting", s, "--device", args.device, "--lengths", str(args.lengths),
               "--max-len", str(args.max_len)] + (["--tiny"] if args.tiny else []) + (["--profile"] if args.profile else [])
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{s}: no result within --timeout {args.timeout:g} s", file=sys.stderr)
            runs[s] = {"error": f"timeout after {args.timeout:g} s"}
            continue
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode != 0 or not line:
            last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"{s}: failed (exit {p.returncode}): {last}", file=sys.stderr)
            runs[s] = {"error": f"exit {p.returncode}", "stderr_tail": p.stderr[-2000:]}
            continue
        runs[s] = json.loads(line[0][7:])
        r = runs[s]
        print(f"{s}: c1 first {r['c1_first_median_ms']:.1f} ms, repeat {r['c1_repeat_median_ms']:.1f} ms; "
              f"c8 first {r['c8_first_median_ms']:.1f} ms, repeat {r['c8_repeat_median_ms']:.1f} ms; {r['sdp_backends']}",
              flush=True)
        for k in ("profile_first", "profile_repeat"):
            if k in r:
                print(k, r[k], sep="\n", flush=True)
    res = {**provenance(), "device": args.device, "target": "tiny" if args.tiny else "smollm2 (random bf16)",
           "lengths": args.lengths, "max_len": args.max_len, "runs": runs}
    if args.output is not None:  # through a temp file and a rename: a run stopped mid-write leaves no half file
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.output, res, indent=1, allow_nan=True)
    return 0 if all("error" not in r for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
