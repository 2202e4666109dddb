"""Regeneration throughput of the engine's autoregressive loop, and where a step's time goes (issue 11).

    python benchmarks/engine/bench_regen.py --output /tmp/regen-h200.json                  # SmolLM2, H200
    python benchmarks/engine/bench_regen.py --tiny --device cpu --output /tmp/regen-cpu.json  # smoke

What ``data.regenerate --backend engine`` runs, without the data pipeline: ``Engine.generate`` with
``use_draft=False`` over ``--prompts`` random prompts (token ids drawn uniformly from the vocabulary
with a fixed seed, lengths uniform in ``--prompt-len``) at ``--concurrency`` slots, greedy or
sampled (``--temperature``). Default target: SmolLM2-135M-Instruct (``models/`` GGUF, bf16 on CUDA);
``--tiny``: stories260K (``$DSPINE_SHARED/models/stories260K/hf``, fp32), so that the host loop, not the
model, dominates and its cost shows.

Prints and writes (JSON) generated tokens per second (EOS included) and, per decode step, the
milliseconds of the loop's parts from ``Engine.loop_profile``: launching the step (a graph replay),
waiting for the device's flags, host bookkeeping (flags, harvest of finished rows), and admission
(packed prefill, per admitted prompt). An engine without ``loop_profile`` (before issue 11) gets
tokens per second only. ``--repeat`` runs the whole call again (the first includes graph capture).

``--null-model`` (CPU, no graphs) replaces the target's decode step and prefill by stubs that return
logits whose argmax is the EOS with probability 1/``--mean-len`` per row and step (else token 5):
what is left is the loop's host work at the real batch size, comparable between engine versions
(run this file with ``PYTHONPATH`` pointing at another checkout to time its loop).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from dspine.sampling import SamplingParams
from infer.engine import load_engine

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="stories260K instead of SmolLM2 (CPU smoke test)")
    p.add_argument("--target", default=None, help="model folder or .gguf file (default: SmolLM2 GGUF in models/)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--prompts", type=int, default=None, help="default 4096 (--tiny: 256)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="default 32 256 (--tiny: 4 32)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 1024 (--tiny: 64)")
    p.add_argument("--concurrency", type=int, default=None, help="default 512 (--tiny: 64)")
    p.add_argument("--max-context", type=int, default=2048, help="engine context per slot (--tiny: 256)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--null-model", action="store_true", help="stub target (host loop only; module docstring)")
    p.add_argument("--mean-len", type=int, default=355, help="--null-model: mean answer length in tokens")
    p.add_argument("--output", default=None, help="JSON file")
    a = p.parse_args(argv)
    if a.repeat < 1:
        p.error(f"--repeat {a.repeat}: must be >= 1 (the JSON would hold no run)")
    tiny = a.tiny
    n = a.prompts or (256 if tiny else 4096)
    lo, hi = a.prompt_len or ((4, 32) if tiny else (32, 256))
    max_new = a.max_new_tokens or (64 if tiny else 1024)
    conc = a.concurrency or (64 if tiny else 512)
    context = 256 if tiny and a.max_context == 2048 else a.max_context
    if not 1 <= lo <= hi or hi + max_new > context:
        raise SystemExit(f"--prompt-len {lo} {hi} with --max-new-tokens {max_new} must fit --max-context {context}")
    cuda = torch.device(a.device).type == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(a.dtype, torch.bfloat16 if cuda and not tiny
                                                                  else torch.float32)
    if tiny:
        target, gguf = a.target or os.path.join(os.environ.get("DSPINE_SHARED", "/work/shared"), "models",
                                                "stories260K", "hf"), None
    else:
        path = Path(a.target) if a.target else SMOLLM2
        target, gguf = (str(path.parent), path.name) if path.suffix == ".gguf" else (str(path), None)
    engine, spec = load_engine(target, gguf, None, device=a.device, dtype=dtype, max_batch=conc, max_seq=context)
    vocab = engine.target.args.vocab_size
    if a.null_model:
        _stub_target(engine, a.mean_len, a.seed)
    g = torch.Generator().manual_seed(a.seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]
    params = SamplingParams(a.temperature, 1.0, 0, max_new, a.seed)
    timed = {"step_s": 0.0, "admit_s": 0.0}
    if not cuda:  # on the CPU a step runs synchronously: time it and the admissions from outside, so
        # that loop_host_ms_per_step = the rest is comparable between engine versions
        runner, admit_fn = engine._runner, engine._admit

        def timer(fn, key):
            def run(*args, **kw):
                t = time.perf_counter()
                out = fn(*args, **kw)
                timed[key] += time.perf_counter() - t
                return out
            return run

        engine._runner = lambda *args, **kw: timer(runner(*args, **kw), "step_s")
        engine._admit = timer(admit_fn, "admit_s")
    runs = []
    for r in range(a.repeat):
        timed.update(step_s=0.0, admit_s=0.0)
        t = time.perf_counter()
        res = engine.generate(prompts, params, concurrency=conc, use_draft=False)
        wall = time.perf_counter() - t
        tokens = res.num_tokens
        steps = max(res.steps, 1)
        run = {"wall_s": round(wall, 3), "tokens": tokens, "tok_per_s": round(tokens / wall, 1), "steps": res.steps,
               "ms_per_step": round(wall / steps * 1e3, 3)}
        if not cuda:
            run["loop_host_ms_per_step"] = round((wall - timed["step_s"] - timed["admit_s"]) / steps * 1e3, 3)
        prof = getattr(engine, "loop_profile", None)
        if prof:
            for key in ("launch_s", "wait_s", "host_s"):
                run[key.replace("_s", "_ms_per_step")] = round(prof[key] / steps * 1e3, 3)
            run["prefill_ms_per_step"] = round(prof["prefill_s"] / steps * 1e3, 3)
            run["prefill_ms_per_prompt"] = round(prof["prefill_s"] / n * 1e3, 3)
        runs.append(run)
        print(f"run {r}: " + ", ".join(f"{k} {v}" for k, v in run.items()), flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    out = {"command": "python benchmarks/engine/bench_regen.py " + " ".join(argv or []), "target": target,
           "gguf_file": gguf, "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
           "dtype": str(dtype), "prompts": n, "prompt_len": [lo, hi], "max_new_tokens": max_new, "concurrency": conc,
           "temperature": a.temperature, "commit": commit, "date": time.strftime("%Y-%m-%d"), "runs": runs}
    if a.output:
        Path(a.output).write_text(json.dumps(out, indent=1) + "\n")
    return out


def _stub_target(engine, mean_len: int, seed: int) -> None:
    """Replace the engine target's forward_step / prefill_packed by logit stubs (``--null-model``)."""
    t, eos = engine.target, int(engine.eos[0])
    V = t.args.vocab_size
    g = torch.Generator(device=engine.device).manual_seed(seed)

    def logits(rows: int) -> torch.Tensor:
        out = torch.zeros(rows, V, device=engine.device)
        hit = torch.rand(rows, generator=g, device=engine.device) < 1.0 / mean_len
        out[:, 5] = 1.0
        out[hit, eos] = 2.0
        return out

    def forward_step(tokens, positions, cache, cache_len, want_features=True, **kw):
        B, T = tokens.shape
        return logits(B * T).view(B, T, V), None

    def prefill_packed(prompts, slots, cache, want_features=True):
        return logits(len(prompts)), None

    t.forward_step, t.prefill_packed = forward_step, prefill_packed


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
