"""Training throughput of the DSpine step at Qwen3-8B shape (random bf16 weights), one GPU.

    accelerate launch --config_file configs/accelerate/zero2-1gpu.yaml benchmarks/train/bench_train.py \\
        --output results/train-h200.json                      # DeepSpeed ZeRO-2, the default recipe
    python benchmarks/train/bench_train.py --no-deepspeed --output results/train-h200-nods.json
    python benchmarks/train/bench_train.py --tiny --output /tmp/bench-tiny.json   # CPU smoke test

The step is ``train.step.train_step``, the same code as ``train/distill.py``: online target
features, block embeddings, ``forward_train`` (flex attention on CUDA), the fused chunked CE and
the optimizer step. Data are random tokens at max length (3072) with a loss mask of a prompt
(mask 0, 5-30 % of the row) followed by a response (mask 1). Warm-up steps (flex compile
included) are not timed.

Model FLOPs per optimizer step, summed over micro-batches (S tokens per row, n anchors, bs slots,
T_b = n·bs block tokens, R = weighted rows reaching the lm_head, Hq heads of size D):

* target forward (no grad; ``features()`` stops after layer max(target_layer_ids), so L' = that + 1
  layers and no lm_head): ``2·P_layer·L'·S + 2·L'·S²·Hq·D`` (causal attention: QKᵀ and PV over
  S²/2 pairs, 2 FLOPs per multiply-add);
* draft forward + backward (backward = 2x forward): ``6·P_block·T_b + 6·P_ctx·S + 3·A``, with
  P_block = per-layer q/k/v/o, MLP and injection weights x layers (run on block tokens),
  P_ctx = fc (k·H x H) + per-layer context k/v projections (run on the S context tokens), and
  A = ``4·Hq·D·L_d·Σ_blocks bs·(a + bs)`` (each block query sees a context keys and bs block keys);
* frozen lm_head: ``2·V·H·R`` forward + ``2·V·H·R`` backward (gradient w.r.t. the hidden states only).

MFU = FLOPs / step time / peak, against the H200 datasheet dense bf16 peak (989 TFLOP/s) and a
bf16 8192³ matmul timed in the same process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

DATASHEET_BF16_TFLOPS = 989.0  # H200 SXM dense bf16
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False)


def build_target(shape: dict, layer_ids: list[int], device: torch.device, dtype: torch.dtype):
    """A random-weight Qwen3 target built directly on ``device`` in ``dtype`` (no CPU copy)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dspine.target import TargetAdapter

    cfg = Qwen3Config(**shape, initializer_range=0.02)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return TargetAdapter(model, layer_ids, name="random-qwen3")


def random_rows(n: int, seq_len: int, vocab: int, gen: torch.Generator) -> list[dict]:
    rows = []
    for _ in range(n):
        prompt = int(seq_len * (0.05 + 0.25 * torch.rand(1, generator=gen).item()))
        ids = torch.randint(0, vocab, (seq_len,), generator=gen).tolist()
        rows.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (seq_len - prompt)})
    return rows


def param_count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def step_flops(batches, target, dcfg, p_block: int) -> dict:
    """Model FLOPs of one optimizer step (module docstring), split by part; ``p_block`` from
    :func:`draft_block_params`."""
    tc = target.config
    Hq, D = tc.num_attention_heads, getattr(tc, "head_dim", tc.hidden_size // tc.num_attention_heads)
    L_run = max(target.layer_ids) + 1
    p_layer = param_count(target.layers[0])
    dH, dHq, dD, Ld, bs = dcfg.hidden_size, dcfg.num_attention_heads, dcfg.head_dim, dcfg.num_hidden_layers, dcfg.block_size
    kv_dim = dcfg.num_key_value_heads * dD
    p_ctx = len(dcfg.target_layer_ids) * dH * dH + Ld * 2 * dH * kv_dim
    V = target.vocab_size
    out = {"target": 0.0, "draft": 0.0, "lm_head": 0.0}
    for b in batches:
        for row in range(b.input_ids.shape[0]):
            S = int(b.lengths[row])
            anchors = b.anchors[row][b.anchors[row] >= 0].double()
            T_b = len(anchors) * bs
            R = int((b.weights[row] > 0).sum())
            out["target"] += 2 * p_layer * L_run * S + 2 * L_run * S * S * Hq * D
            attn = 4 * dHq * dD * Ld * float((bs * (anchors + bs)).sum())
            out["draft"] += 6 * p_block * T_b + 6 * p_ctx * S + 3 * attn
            out["lm_head"] += 4 * V * dH * R
    return out


def draft_block_params(draft) -> int:
    """Matrix weights applied to every block token: all 2-D weights of the draft layers (q/k/v/o,
    MLP, injection); norms and gates are not matmuls, fc runs on context tokens only."""
    return sum(p.numel() for layer in draft.layers for p in layer.parameters() if p.dim() == 2)


def matmul_tflops(device: torch.device, n: int) -> float:
    """Measured TFLOP/s of an n x n x n matmul (bf16 on CUDA, fp32 on the CPU), mean of 10 after 3 warm-ups."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parents[2]).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", required=True, help="JSON result file")
    ap.add_argument("--steps", type=int, default=50, help="timed optimizer steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    ap.add_argument("--seq-len", type=int, default=3072)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--loss-chunk", type=int, default=2048)
    ap.add_argument("--attn", default="auto", choices=["auto", "flex", "dense"])
    ap.add_argument("--matmul-size", type=int, default=8192)
    ap.add_argument("--no-deepspeed", action="store_true", help="plain accelerate (bf16 autocast), even if launched with a DeepSpeed config")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, no DeepSpeed (smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.tiny:
        args.no_deepspeed = True
        args.seq_len, args.anchors, args.block_size, args.layers = min(args.seq_len, 96), min(args.anchors, 16), 8, 2
        args.matmul_size = min(args.matmul_size, 256)
    if args.no_deepspeed:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"

    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from dspine.config import DSpineConfig
    from dspine.model import DSpineDraftModel
    from dspine.target import TargetSpec
    from train.config import RunConfig, resolve_device_settings
    from train.data import make_batch
    from train.distill import configure_deepspeed
    from train.loss import anchor_generator
    from train.step import StepSettings, make_optimizer, make_scheduler, train_step

    cuda = torch.cuda.is_available() and not args.tiny
    run = RunConfig(target="bench", train="bench", micro_batch_size=args.micro_batch, grad_accum=args.grad_accum,
                    attn=args.attn, mixed_precision="auto")
    dev = resolve_device_settings(run, cuda)
    accelerator = Accelerator(mixed_precision=dev["mixed_precision"], gradient_accumulation_steps=args.grad_accum,
                              cpu=not cuda)
    device = accelerator.device
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    if deepspeed:
        configure_deepspeed(accelerator, run)
    shape = TINY if args.tiny else QWEN3_8B
    layer_ids = [1, 3] if args.tiny else [1, 9, 17, 25, 33]
    t0 = time.perf_counter()
    target = build_target(shape, layer_ids, device, torch.bfloat16 if cuda else torch.float32)
    spec = TargetSpec.from_config(target.config)
    dcfg = DSpineConfig.for_target(target.config, spec, layers=args.layers, block_size=args.block_size,
                                   injection="residual", target_layer_ids=layer_ids,
                                   mask_token_id=shape["vocab_size"] - 1,
                                   max_position_embeddings=max(args.seq_len + args.block_size, 4096))
    torch.manual_seed(args.seed)
    with device:
        draft = DSpineDraftModel(dcfg).float()
    build_s = time.perf_counter() - t0
    total = args.warmup + args.steps
    optimizer = make_optimizer(draft, 6e-4, 0.0, (0.9, 0.999))
    scheduler = make_scheduler(optimizer, total, 0.04, "cosine")
    draft, optimizer = accelerator.prepare(draft, optimizer)
    settings = StepSettings(dcfg.block_size, dev["attn"], args.loss_chunk, 1.0)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = shape["vocab_size"] - 2  # never the mask row

    times, losses, flops, tokens = [], [], [], []
    p_block = draft_block_params(accelerator.unwrap_model(draft))
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(total):
        batches = [make_batch(random_rows(args.micro_batch, args.seq_len, vocab, gen), list(range(args.micro_batch)),
                              max_length=args.seq_len, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                              gamma=7.0, anchors_per_seq=args.anchors, generator=anchor_generator(args.seed, step, 0, m),
                              pad_to_multiple=dev["pad_to_multiple"], static_anchors=dev["attn"] == "flex")
                   for m in range(args.grad_accum)]
        sync(device)
        t = time.perf_counter()
        res = train_step(accelerator, draft, target, optimizer, scheduler, batches, settings)
        sync(device)
        dt = time.perf_counter() - t
        f = step_flops(batches, target, dcfg, p_block)
        if not math.isfinite(res["loss"]):
            raise RuntimeError(f"non-finite loss at step {step}: {res['loss']}")
        if step >= args.warmup:
            times.append(dt)
            losses.append(res["loss"])
            flops.append(f)
            tokens.append(res["tokens"])
        print(f"step {step + 1}/{total}{' (warm-up)' if step < args.warmup else ''}: {dt * 1e3:.1f} ms, "
              f"loss {res['loss']:.4f}", flush=True)
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    measured = matmul_tflops(device, args.matmul_size)

    mean_t = sum(times) / len(times)
    parts = {k: sum(f[k] for f in flops) / len(flops) for k in flops[0]}
    step_f = sum(parts.values())
    achieved = step_f / mean_t / 1e12
    results = {
        "timed_steps": len(times), "warmup_steps": args.warmup,
        "step_time_s_mean": mean_t, "step_time_s_median": sorted(times)[len(times) // 2],
        "tokens_per_s": sum(tokens) / sum(times),
        "peak_memory_gib": peak_mem,
        "flops_per_step": step_f, "flops_per_step_by_part": parts,
        "model_tflops_per_s": achieved,
        "datasheet_bf16_tflops": DATASHEET_BF16_TFLOPS,
        "measured_matmul_tflops": measured,
        "mfu_vs_datasheet": achieved / DATASHEET_BF16_TFLOPS,
        "mfu_vs_measured_matmul": achieved / measured,
        "loss_first_timed": losses[0], "loss_last": losses[-1],
        "build_s": build_s,
    }
    import accelerate
    import transformers

    try:
        import deepspeed as ds

        ds_version = ds.__version__
    except ImportError:
        ds_version = None
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
        "launcher": "deepspeed" if deepspeed else str(accelerator.distributed_type),
        "gpu": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "accelerate": accelerate.__version__, "deepspeed": ds_version, "python": platform.python_version()},
        "config": {**vars(args), "attn_resolved": dev["attn"], "mixed_precision": dev["mixed_precision"],
                   "zero_stage": accelerator.state.deepspeed_plugin.zero_stage if deepspeed else None,
                   "target_shape": shape, "target_layer_ids": layer_ids, "target_params": param_count(target.model),
                   "draft_params": param_count(accelerator.unwrap_model(draft)) if not deepspeed else
                   sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in draft.parameters()),
                   "world_size": accelerator.num_processes},
        "results": results,
    }
    if accelerator.is_main_process:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps(results, indent=2))
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
