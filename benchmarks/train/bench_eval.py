"""Cost of the trainer's in-run evaluation (``train.distill.evaluate``, issue 11), one GPU.

    python benchmarks/train/bench_eval.py --target runs/smollm2/smollm2-hf --output /tmp/bench-eval.json
    python benchmarks/train/bench_eval.py --target models/SmolLM2-135M-Instruct.Q4_1.gguf --output ...
    python benchmarks/train/bench_eval.py --tiny --output /tmp/bench-eval-tiny.json   # CPU smoke test

The trainer's setting of configs/smollm2-135m-dspine.yaml: the shipped draft (``--draft``), 116 held-out
rows (``--eval`` rows, or synthetic ones: random tokens, lengths 64..2048 around a mean of ~440 like the
recipe's eval set, the first 10-30 % of a row unsupervised), micro-batch 32, 256 anchors per row, max
length 2048, 6 tau_real prompts of 96 new tokens, attn flex on CUDA (dense on the CPU), bf16 autocast.
First ``--train-steps`` optimizer steps on the same rows with a training micro-batch (flex compiled for
training shapes, as in a run), then ``--repeats`` rounds of evaluate with one forward per tau_real prompt
(``per_row``, the old path) and with all prompts in one forward (``batched``), each round timing both.
Per call: ``eval/seconds``, ``eval/loss_seconds``, ``eval/tau_real_seconds``, torch.compile's graph count so
far (a compile for eval shapes shows as a jump; ``compile_times`` at the end lists each compile's seconds), and whether the two paths gave the same
metrics (tau_real may differ in the last digits on a GPU: batched bf16 GEMMs round differently). ``--profile`` adds
the top ops of one more evaluate (torch.profiler tables) to the report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch._dynamo.utils

REPO = Path(__file__).resolve().parents[2]
TIMING = ("eval/seconds", "eval/loss_seconds", "eval/tau_real_seconds")


def synthetic_rows(path: Path, n: int, vocab: int, max_length: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(n):
            length = int(min(max_length, max(64, torch.empty(1).exponential_(1 / 440, generator=g).item())))
            ids = torch.randint(100, vocab, (length,), generator=g).tolist()
            prompt = int(length * (0.1 + 0.2 * torch.rand(1, generator=g).item()))
            f.write(json.dumps({"id": f"syn-{i}", "input_ids": ids,
                                "loss_mask": [0] * prompt + [1] * (length - prompt)}) + "\n")


def compile_state() -> dict:
    """torch.compile graphs captured so far in this process (flex attention, block masks, ...)."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="HF folder or .gguf file of the target (SmolLM2-135M-Instruct)")
    ap.add_argument("--draft", default=str(REPO / "checkpoints" / "smollm2-135m-dspine"))
    ap.add_argument("--eval", help="held-out rows (.jsonl or data.tokenize cache); default synthetic rows")
    ap.add_argument("--rows", type=int, default=116)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--anchors", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true",
                    help="one more batched evaluate under torch.profiler: its top ops go to the report")
    ap.add_argument("--tiny", action="store_true", help="stories260K, random 2-layer draft, small sizes (CPU)")
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: must be >= 1 (the report would hold no round)")

    from accelerate import Accelerator

    from dspine.checkpoint import load_draft
    from dspine.paths import load_tokenizer
    from dspine.target import TargetSpec, load_target
    from train import config as run_config
    from train.data import make_batch, open_rows
    from train.distill import evaluate
    from train.loss import anchor_generator
    from train.step import StepSettings, make_optimizer, make_scheduler, train_step

    cuda = torch.cuda.is_available()
    if args.tiny:
        shared = REPO.parent / "shared"
        args.target = args.target or str(shared / "models" / "stories260K" / "hf")
        args.rows, args.micro_batch, args.anchors, args.max_length = 12, 4, 16, 256
        args.prompts, args.max_new, args.train_steps, args.repeats = 3, 24, 2, 2
    if not args.target:
        ap.error("--target is required (or --tiny)")
    dev = torch.device("cuda" if cuda else "cpu")
    accelerator = Accelerator(cpu=not cuda, mixed_precision="bf16" if cuda else "no")
    target = load_target(args.target, dtype="bf16" if cuda else "fp32", device=dev)
    try:
        tokenizer = load_tokenizer(args.target)
    except (OSError, ValueError):
        tokenizer = None
    if args.tiny:
        from tests.helpers import random_draft

        draft = random_draft(target, block_size=8, mask=0)
    else:
        draft = load_draft(args.draft, dtype=torch.float32)
    dcfg = draft.config
    target.set_layer_ids(dcfg.target_layer_ids, dcfg.last_layer_features)
    out_dir = Path(args.output).resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    eval_path = args.eval
    if eval_path is None:
        eval_path = str(out_dir / "bench-eval-rows.jsonl")
        synthetic_rows(Path(eval_path), args.rows, target.vocab_size, args.max_length, seed=0)
    overrides = [f"target={args.target}", f"train={eval_path}", f"eval={eval_path}", f"max_length={args.max_length}",
                 f"micro_batch_size={args.micro_batch}", f"anchors_per_seq={args.anchors}",
                 f"eval_max_rows={args.rows}", f"eval_prompts={args.prompts}", f"eval_max_new_tokens={args.max_new}",
                 f"block_size={dcfg.block_size}", f"mask_token_id={dcfg.mask_token_id}"]
    cfg = run_config.load(None, overrides)
    res = run_config.resolve_device_settings(cfg, cuda)
    settings = StepSettings(dcfg.block_size, res["attn"], cfg.loss_chunk_size, cfg.grad_clip)
    batch_kw = dict(max_length=cfg.max_length, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                    gamma=cfg.gamma, anchors_per_seq=cfg.anchors_per_seq, pad_to_multiple=res["pad_to_multiple"],
                    static_anchors=res["attn"] == "flex")
    eos = sorted(TargetSpec.from_adapter(target, tokenizer).eos_ids)
    rows = open_rows(eval_path)
    n = min(len(rows), args.rows)

    draft = draft.float().to(dev).train()
    optimizer = make_optimizer(draft, 1e-5, 0.0, (0.9, 0.95))
    scheduler = make_scheduler(optimizer, max(1, args.train_steps), 0.0, "constant")
    draft, optimizer = accelerator.prepare(draft, optimizer)
    t0 = time.perf_counter()
    for step in range(args.train_steps):  # compiles flex for training shapes first, as a run does
        ids = [(step * args.micro_batch + j) % n for j in range(args.micro_batch)]
        b = make_batch([rows.row(j) for j in ids], ids, generator=anchor_generator(0, step, 0, 0), **batch_kw)
        train_step(accelerator, draft, target, optimizer, scheduler, [b], settings)
    if cuda:
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    print(f"{args.train_steps} train steps: {train_s:.1f} s; {compile_state()}", flush=True)

    calls = []
    for r in range(args.repeats):
        got = {}
        for mode, batch_verify in (("per_row", False), ("batched", True)):
            out = evaluate(accelerator, draft, target, rows, cfg, batch_kw, settings, dcfg, eos, False,
                           batch_verify=batch_verify)
            got[mode] = out
            rec = {"round": r, "mode": mode, **{k.removeprefix("eval/"): round(out[k], 3) for k in TIMING},
                   "tau_real": out.get("eval/tau_real"), "real_steps": out.get("eval/real_steps"),
                   "tau_sim": out["eval/tau_sim"], **compile_state()}
            calls.append(rec)
            print(json.dumps(rec), flush=True)
        a, b = ({k: v for k, v in got[m].items() if k not in TIMING} for m in ("per_row", "batched"))
        calls[-1]["same_metrics_as_per_row"] = a == b
        calls[-1]["tau_real_diff"] = (b.get("eval/tau_real") or 0) - (a.get("eval/tau_real") or 0)
    profile = None
    if args.profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch_profile(activities=acts) as prof:
            evaluate(accelerator, draft, target, rows, cfg, batch_kw, settings, dcfg, eos, False)
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        profile = {k: prof.key_averages().table(sort_by=k, row_limit=25) for k in (key, "cpu_time_total")}
        print(profile[key])
    report = {
        "what": "train.distill.evaluate wall clock: per-row vs batched tau_real verify (issue 11)",
        "command": " ".join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "settings": {k: getattr(args, k) for k in ("target", "draft", "eval", "rows", "micro_batch", "anchors",
                                                  "max_length", "prompts", "max_new", "train_steps", "tiny")},
        "attn": res["attn"], "train_steps_s": round(train_s, 2), "calls": calls,
        "compile_times": torch._dynamo.utils.compile_times(),  # per compiled function, seconds of each compile
        "profile": profile,
    }
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
