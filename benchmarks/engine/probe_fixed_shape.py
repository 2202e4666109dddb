"""Probe for issue 13: is a verify position bitwise equal to an AR step padded to the verify width?

    python benchmarks/engine/probe_fixed_shape.py --output results/probe-fixed-shape-h200.json
    python benchmarks/engine/probe_fixed_shape.py --device cpu --shapes tiny --output /tmp/probe.json   # smoke

Exact mode (``forward_step(exact=True)``) makes a position's logits independent of the step width
with row-invariant GEMMs, which cost 16-29% of the step at Qwen3-8B shape (results/exact-h200.json).
The alternative probed here: keep the fast kernels, but give every decode-time pass the same shape,
i.e. run an AR step as a verify pass of the block width (the token in column 0, padding after; the
padding's K/V rows lie past the committed length and are overwritten later). A GEMM of fixed shape
uses one kernel configuration, and no GEMM reduces across rows, so row 0 of the padded AR pass should
equal the same position inside a verify pass, bit for bit, if the attention is width-invariant too.

For each shape, batch size and mode, with random weights and prompts of random lengths: one verify
pass over a random block of ``--width`` tokens, then the same tokens one AR step at a time; counts the
(row, position) pairs whose logits are bitwise equal to the verify pass's and whose argmax agrees.
Modes: ``fast`` (T = 1 AR steps, fast kernels: the baseline, expected to differ), ``fast_padded``
(AR steps padded to the width, fast kernels), ``attn_exact_padded`` (padded, fast GEMMs, exact-mode
attention), ``exact`` (T = 1 AR steps, exact mode: expected equal). Also the eager step time of a T = 1
and a padded AR step (median of ``--iters``; CUDA graphs off, so only indicative). Writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import infer.model as model_mod  # noqa: E402
from benchmarks.engine.bench_draft_step import TARGETS, random_target  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from infer.model import EngineTarget, ModelArgs  # noqa: E402

MODES = ("fast", "fast_padded", "attn_exact_padded", "exact")


@contextlib.contextmanager
def fast_gemms():
    """forward_step(exact=True) with its GEMMs (and LM head) on the fast kernels: exact attention only."""
    lin, logits = model_mod.linear, EngineTarget.logits
    model_mod.linear = lambda *a, exact=False, **k: lin(*a, exact=False, **k)
    EngineTarget.logits = lambda self, h, exact=False, lm_head="linear": logits(self, h, False, lm_head)
    try:
        yield
    finally:
        model_mod.linear, EngineTarget.logits = lin, logits


@torch.inference_mode()
def probe(t: EngineTarget, B: int, width: int, mode: str, seed: int, dev) -> dict:
    g = torch.Generator().manual_seed(seed)
    V = t.args.vocab_size
    lens = torch.randint(16, 200, (B,), generator=g)
    cache = t.new_cache(B, int(lens.max()) + 3 * width)
    for b in range(B):
        t.prefill(torch.randint(1, V - 1, (int(lens[b]),), generator=g).to(dev), b, cache, want_features=False)
    L = lens.to(dev, torch.int32)
    block = torch.randint(1, V - 1, (B, width), generator=g).to(dev)
    exact = mode in ("attn_exact_padded", "exact")
    padded = mode.endswith("padded")
    ctx = fast_gemms() if mode == "attn_exact_padded" else contextlib.nullcontext()
    ar = torch.arange(width, device=dev)
    with ctx:
        ref, _ = t.forward_step(block, L[:, None].long() + ar, cache, L, want_features=False, exact=exact)
        equal = agree = 0
        for j in range(width):
            if padded:
                tok = torch.zeros_like(block)
                tok[:, 0] = block[:, j]
                out, _ = t.forward_step(tok, (L + j)[:, None].long() + ar, cache, L + j, want_features=False,
                                        exact=exact)
            else:
                out, _ = t.forward_step(block[:, j : j + 1], (L + j)[:, None].long(), cache, L + j,
                                        want_features=False, exact=exact)
            a, r = out[:, 0], ref[:, j]
            equal += int((a == r).all(-1).sum())
            agree += int((a.argmax(-1) == r.argmax(-1)).sum())
    return {"pairs": B * width, "bitwise_equal": equal, "argmax_agree": agree}


@torch.inference_mode()
def step_ms(t: EngineTarget, B: int, width: int, padded: bool, iters: int, dev) -> float:
    cache = t.new_cache(B, 512 + 2 * width)
    L = torch.full((B,), 256, dtype=torch.int32, device=dev)
    T = width if padded else 1
    tok = torch.ones(B, T, dtype=torch.long, device=dev)
    pos = L[:, None].long() + torch.arange(T, device=dev)
    times = []
    for i in range(iters + 3):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        t.forward_step(tok, pos, cache, L, want_features=False)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None, help="JSON file")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="smollm2,qwen3-8b", help=f"comma list of {tuple(TARGETS)}")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--width", type=int, default=16, help="verify width (the draft block; default 16)")
    ap.add_argument("--iters", type=int, default=20, help="timed eager steps per step-time figure")
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",")]
    bad = [s for s in shapes if s not in TARGETS]
    if bad:
        ap.error(f"--shapes: unknown shape {bad[0]!r}; expected some of {tuple(TARGETS)}")
    if not 2 <= args.width <= 64 or min(args.batch) < 1 or args.iters < 1:
        ap.error("--width must be in 2..64, --batch sizes >= 1, --iters >= 1")
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA GPU is visible (use --device cpu --shapes tiny)")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    impl = "triton" if dev.type == "cuda" else "torch"
    res = {**provenance(), "device": str(dev), "dtype": str(dtype), "width": args.width, "shapes": {}}
    for shape in shapes:
        t = random_target(ModelArgs(**TARGETS[shape]), [], dev, dtype, impl)
        out = {}
        for B in args.batch:
            row = {m: probe(t, B, args.width, m, seed=B, dev=dev) for m in MODES}
            row["ar_step_ms"] = step_ms(t, B, args.width, False, args.iters, dev)
            row["padded_ar_step_ms"] = step_ms(t, B, args.width, True, args.iters, dev)
            row["padded_over_ar"] = row["padded_ar_step_ms"] / row["ar_step_ms"]
            out[f"batch{B}"] = row
            print(f"{shape} batch {B}: " + "; ".join(f"{m} {row[m]['bitwise_equal']}/{row[m]['pairs']} equal, "
                                                     f"{row[m]['argmax_agree']} argmax" for m in MODES)
                  + f"; padded AR step {row['padded_over_ar']:.2f}x the T = 1 step (eager)", flush=True)
        res["shapes"][shape] = out
        del t
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
