"""Training throughput of the DSpine step at Qwen3-8B shape (random bf16 weights), one GPU.

    accelerate launch --config_file configs/accelerate/zero2-1gpu.yaml benchmarks/train/bench_train.py \\
        --output results/train-h200.json                      # DeepSpeed ZeRO-2, the default recipe
    python benchmarks/train/bench_train.py --no-deepspeed --output results/train-h200-nods.json
    python benchmarks/train/bench_train.py --tiny --output /tmp/bench-tiny.json   # CPU smoke test
    accelerate launch --config_file configs/accelerate/zero2-1gpu.yaml benchmarks/train/bench_train.py \
        --ab base,ce,ce+fa,ce+fa+tc,ce+fa+tc+dc --output results/train-h200-ab.json   # A/B of the step options

Step options (A/B variants are ``+``-joined names; ``base`` = none): ``ce`` the fused-CE chunk math under
torch.compile (``train.loss.ce_chunk``), ``fa`` PyTorch's fused CUDA AdamW, ``tc`` regional torch.compile of
the target's decoder layers, ``dc`` the same for the draft layers, ``chunkN`` N rows per lm_head chunk.
The trainer's run config has the first four (``ce_impl``, ``adamw_impl``, ``compile_layers``; on by default on
CUDA), through the same code (``train.speed``).
Variants share one model, optimizer and data stream and are timed in interleaved rounds (each after its
own warm-up), so they see the same GPU state; every variant trains the same anchors per sequence.
``results`` holds the fastest variant (``variant`` names it), ``ab`` all of them, and ``loss_at_init`` the
loss of one batch under each variant before any optimizer step (equal up to bf16 rounding).

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

from train.speed import Forwards, set_fused_adam  # the trainer's compile_layers / adamw_impl code

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
    return sum(numel(p) for p in module.parameters())


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
    return sum(numel(p) for layer in draft.layers for p in layer.parameters() if len(getattr(p, "ds_shape", p.shape)) == 2)


def numel(p) -> int:
    """Full element count, also of a ZeRO-3 partitioned parameter (whose local ``numel()`` is 0)."""
    return int(getattr(p, "ds_numel", p.numel()))


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


VARIANT_KEYS = ("ce", "fa", "tc", "dc")


def parse_variant(name: str, default_chunk: int) -> dict:
    """``"ce+fa+chunk4096"`` -> {ce, fa, tc, dc: bool, chunk: int}. Raises ValueError naming an unknown part."""
    v = {k: False for k in VARIANT_KEYS} | {"chunk": default_chunk}
    for part in name.split("+"):
        if part == "base":
            continue
        if part in VARIANT_KEYS:
            v[part] = True
        elif part.startswith("chunk") and part[5:].isdigit() and int(part[5:]) > 0:
            v["chunk"] = int(part[5:])
        else:
            raise ValueError(f"--ab variant {name!r}: unknown part {part!r} (base, {', '.join(VARIANT_KEYS)}, chunkN)")
    return v


def profile_table(fn, steps: int, device, top: int = 25) -> list[dict]:
    """Top ``top`` kernels/ops by self device time over ``steps`` calls of ``fn`` (ms per call)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)[:top]
    return [{"name": e.key[:120], "calls_per_step": e.count / steps, "self_ms_per_step": getattr(e, key, 0.0) / 1e3 / steps}
            for e in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", required=True, help="JSON result file")
    ap.add_argument("--steps", type=int, default=50, help="timed optimizer steps (per variant)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation; per variant)")
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
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (with --tiny: gloo ranks under torch.distributed.run)")
    ap.add_argument("--variant", default="base", help="step options of a single run, e.g. ce+fa (module docstring)")
    ap.add_argument("--ab", default=None, help="comma-separated variants to A/B in one process, e.g. base,ce,ce+fa")
    ap.add_argument("--ab-rounds", type=int, default=2, help="interleaved timing rounds per variant")
    ap.add_argument("--profile", type=int, default=0, help="profile this many steps of the first --ab variant (top kernels)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.tiny:
        args.no_deepspeed = True
        args.cpu = True
        args.seq_len, args.anchors, args.block_size, args.layers = min(args.seq_len, 96), min(args.anchors, 16), 8, 2
        args.matmul_size = min(args.matmul_size, 256)
    if args.no_deepspeed:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"
    names = [n.strip() for n in (args.ab or args.variant).split(",") if n.strip()]
    try:
        variants = {n: parse_variant(n, args.loss_chunk) for n in names}
    except ValueError as e:
        ap.error(str(e))

    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from dspine.config import DSpineConfig
    from dspine.model import DSpineDraftModel
    from dspine.target import TargetSpec, decoder_layers
    from train.config import RunConfig, resolve_device_settings
    from train.data import make_batch
    from train.distill import configure_deepspeed, whole_modules
    from train.loss import anchor_generator
    from train.step import StepSettings, make_optimizer, make_scheduler, micro_loss, train_step

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and any(v["fa"] for v in variants.values()):
        ap.error("variant 'fa' (fused AdamW) needs CUDA")
    run = RunConfig(target="bench", train="bench", micro_batch_size=args.micro_batch, grad_accum=args.grad_accum,
                    attn=args.attn, mixed_precision="auto")
    dev = resolve_device_settings(run, cuda)
    accelerator = Accelerator(mixed_precision=dev["mixed_precision"], gradient_accumulation_steps=args.grad_accum,
                              cpu=not cuda)
    device = accelerator.device
    rank, world = accelerator.process_index, accelerator.num_processes
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    if deepspeed:
        configure_deepspeed(accelerator, run)
    shape = TINY if args.tiny else QWEN3_8B
    layer_ids = [1, 3] if args.tiny else [1, 9, 17, 25, 33]
    t0 = time.perf_counter()
    with whole_modules(accelerator if deepspeed else None):  # ZeRO-3: the target is never partitioned
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
    total = args.warmup * len(variants) + args.steps * len(variants) + 1
    optimizer = make_optimizer(draft, 6e-4, 0.0, (0.9, 0.999))
    scheduler = make_scheduler(optimizer, total, 0.04, "cosine")
    draft, optimizer = accelerator.prepare(draft, optimizer)
    target_fw = Forwards(decoder_layers(target.model))
    draft_fw = Forwards(accelerator.unwrap_model(draft).layers)
    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)  # each rank its own rows (rank 0 as before)
    vocab = shape["vocab_size"] - 2  # never the mask row
    p_block = draft_block_params(accelerator.unwrap_model(draft))
    state = {"step": 0}

    def settings_of(v):
        return StepSettings(dcfg.block_size, dev["attn"], v["chunk"], 1.0, ce_impl="compiled" if v["ce"] else "eager")

    def apply(v):
        target_fw.use(v["tc"])
        draft_fw.use(v["dc"])
        if cuda:
            set_fused_adam(optimizer, v["fa"])

    def batches_of(step):
        return [make_batch(random_rows(args.micro_batch, args.seq_len, vocab, gen), list(range(args.micro_batch)),
                           max_length=args.seq_len, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                           gamma=7.0, anchors_per_seq=args.anchors,
                           generator=anchor_generator(args.seed, step, 0, m * world + rank),
                           pad_to_multiple=dev["pad_to_multiple"], static_anchors=dev["attn"] == "flex")
                for m in range(args.grad_accum)]

    def one_step(v):
        step = state["step"]
        batches = batches_of(step)
        sync(device)
        t = time.perf_counter()
        res = train_step(accelerator, draft, target, optimizer, scheduler, batches, settings_of(v))
        sync(device)
        dt = time.perf_counter() - t
        state["step"] += 1
        if not math.isfinite(res["loss"]):
            raise RuntimeError(f"non-finite loss at step {step}: {res['loss']}")
        blocks = float(reduce_all(accelerator, sum(int((b.anchors >= 0).sum()) for b in batches)))
        return dt, res, step_flops(batches, target, dcfg, p_block), blocks

    # the loss of one batch under each variant before any update: the options must not change it
    loss_at_init = {}
    probe = batches_of(-1)[0].to(device)
    for name, v in variants.items():
        apply(v)
        with torch.no_grad(), accelerator.autocast():
            loss_sum, st = micro_loss(draft, target, probe, settings_of(v))
        loss_at_init[name] = st.loss_sum / st.weight_sum if st.weight_sum else None

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for name, v in variants.items():  # warm-up (compilation) of every variant first
        apply(v)
        for _ in range(args.warmup):
            dt, res, _, _ = one_step(v)
            print(f"[{name}] warm-up step: {dt * 1e3:.1f} ms, loss {res['loss']:.4f}", flush=True)
    timed = {name: {"times": [], "losses": [], "flops": [], "tokens": [], "blocks": []} for name in variants}
    rounds = max(1, min(args.ab_rounds, args.steps)) if len(variants) > 1 else 1
    per_round = [args.steps // rounds + (r < args.steps % rounds) for r in range(rounds)]
    peak_by = dict.fromkeys(variants, 0.0)  # GiB: each variant's timed steps (the model and optimizer state included)
    for r in range(rounds):
        for name, v in variants.items():
            apply(v)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            for _ in range(per_round[r]):
                dt, res, f, blocks = one_step(v)
                rec = timed[name]
                rec["times"].append(dt)
                rec["losses"].append(res["loss"])
                rec["flops"].append(f)
                rec["tokens"].append(res["tokens"])
                rec["blocks"].append(blocks)
                print(f"[{name}] step {len(rec['times'])}/{args.steps}: {dt * 1e3:.1f} ms, loss {res['loss']:.4f}", flush=True)
            if cuda:
                peak_by[name] = max(peak_by[name], torch.cuda.max_memory_allocated(device) / 2**30)
    peak_all_by = {n: [float(x) for x in gather_all(accelerator, peak_by[n])] if cuda else None for n in variants}
    profile = None
    if args.profile:
        first = next(iter(variants.values()))
        apply(first)
        profile = profile_table(lambda: one_step(first), args.profile, device)
    measured = matmul_tflops(device, args.matmul_size)

    by_variant = {}
    for name, rec in timed.items():
        times = rec["times"]
        mean_t = sum(times) / len(times)
        parts = {k: sum(f[k] for f in rec["flops"]) / len(rec["flops"]) for k in rec["flops"][0]}
        # FLOPs are this rank's; every rank runs the same shapes, so the global rate is world x this
        step_f = sum(parts.values())
        achieved = step_f / mean_t / 1e12
        by_variant[name] = {
            "variant": name, "options": variants[name],
            "timed_steps": len(times), "warmup_steps": args.warmup,
            "step_time_s_mean": mean_t, "step_time_s_median": sorted(times)[len(times) // 2],
            "tokens_per_s": sum(rec["tokens"]) / sum(times),
            "tokens_per_s_per_gpu": sum(rec["tokens"]) / sum(times) / world,
            "anchor_blocks_per_s": sum(rec["blocks"]) / sum(times),
            "anchors_per_seq": args.anchors,
            "peak_memory_gib": peak_all_by[name][0] if peak_all_by[name] else None,  # this variant's timed steps
            "peak_memory_gib_per_gpu": peak_all_by[name],
            "peak_memory_scope": "variant",
            "flops_per_step": step_f, "flops_per_step_by_part": parts,
            "model_tflops_per_s": achieved,
            "datasheet_bf16_tflops": DATASHEET_BF16_TFLOPS,
            "measured_matmul_tflops": measured,
            "mfu_vs_datasheet": achieved / DATASHEET_BF16_TFLOPS,
            "mfu_vs_measured_matmul": achieved / measured,
            "loss_first_timed": rec["losses"][0], "loss_last": rec["losses"][-1],
            "loss_at_init": loss_at_init[name],
            "build_s": build_s,
        }
    best = min(by_variant, key=lambda n: by_variant[n]["step_time_s_mean"])
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
                   "draft_params": param_count(accelerator.unwrap_model(draft)),
                   "world_size": world},
        "results": by_variant[best],
    }
    if len(by_variant) > 1:
        base = by_variant.get("base")
        record["ab"] = by_variant
        record["ab_speedup_vs_base"] = ({n: base["step_time_s_mean"] / r["step_time_s_mean"] for n, r in by_variant.items()}
                                        if base else None)
    if profile is not None:
        record["profile_top_kernels"] = {"variant": next(iter(variants)), "rows": profile}
    if accelerator.is_main_process:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps(by_variant[best], indent=2))
    accelerator.end_training()
    return 0


def reduce_all(accelerator, x: float) -> float:
    """Sum of a number over ranks."""
    if accelerator.num_processes == 1:
        return x
    return float(accelerator.reduce(torch.tensor([float(x)], dtype=torch.float64, device=accelerator.device), "sum"))


def gather_all(accelerator, x: float) -> list[float]:
    """One number per rank, in rank order."""
    if accelerator.num_processes == 1:
        return [x]
    return accelerator.gather(torch.tensor([float(x)], dtype=torch.float64, device=accelerator.device)).tolist()


if __name__ == "__main__":
    sys.exit(main())
