"""One optimizer step of the DSpine trainer, shared by ``train/distill.py`` and ``benchmarks/train/bench_train.py``.

Normalisation (docs/method.md §4, loss = Σ w·CE / Σ w over the global batch; the same with the
distillation loss of ``distill``): the weight total W of all
micro-batches of all ranks is known before any forward (it depends only on anchors and loss
masks), so it is all-reduced first and every micro-batch backpropagates
``Σ_micro w·CE · (world · grad_accum / W)``; the ``1/grad_accum`` of accelerate/DeepSpeed and the
rank average of DDP/ZeRO then leave exactly ``∇(Σ w·CE / W)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from train.data import MicroBatch
from train.loss import DistillTargets, LossStats, block_loss


@dataclass
class StepSettings:
    block_size: int  # draft block size (anchor slot included)
    attn: str  # "dense" | "flex" (DSpineDraftModel.forward_train)
    loss_chunk_size: int  # rows per lm_head chunk
    grad_clip: float  # max global grad norm (0 = off)
    distill: str = "ce"  # ce | kl | mix (train.config.RunConfig.distill)
    distill_alpha: float = 0.5  # mix: weight of the hard-label CE
    distill_temperature: float = 1.0  # T of the soft targets
    ce_impl: str = "eager"  # chunk math of the fused CE: eager (reference) | compiled (train.loss.ce_chunk fused)


def micro_loss(draft, target, batch: MicroBatch, s: StepSettings,
               measure_target: bool = False) -> tuple[torch.Tensor, LossStats]:
    """``Σ w·loss`` of one micro-batch (already on the device) and its per-slot statistics.

    Target features come from ``batch.features`` (offline capture) or a no-grad target forward;
    block inputs use the frozen target embedding and the loss its frozen lm_head. With
    ``s.distill`` kl or mix (or ``measure_target``: ce loss, plus KL and argmax agreement in the
    statistics) the online target forward also returns its last layer for the soft targets."""
    soft = s.distill != "ce" or measure_target
    last = None
    with torch.no_grad():
        feats = batch.features
        if soft:
            if feats is not None:
                raise ValueError(f"distill={s.distill} needs the target's logits: use online features")
            feats, last = target.features_and_last_hidden(batch.input_ids, batch.attention_mask)
        elif feats is None:
            feats = target.features(batch.input_ids, batch.attention_mask)
        block_embeds = target.embed(batch.block_ids)
    hidden = draft(block_embeds, feats, batch.anchors, attn=s.attn)
    distill = None
    if soft:
        alpha = {"ce": 1.0, "kl": 0.0, "mix": s.distill_alpha}[s.distill]
        distill = DistillTargets(last, target.final_norm, batch.anchors, alpha, s.distill_temperature)
    return block_loss(hidden, target.lm_head_weight, batch.labels, batch.weights, s.block_size, s.loss_chunk_size,
                      distill=distill, ce_impl=s.ce_impl)


def reduce_sum(accelerator, values: torch.Tensor) -> torch.Tensor:
    """Sum of a small fp64 vector over ranks (returned on the CPU)."""
    if accelerator.num_processes == 1:
        return values
    return accelerator.reduce(values.to(accelerator.device), reduction="sum").cpu()


def train_step(accelerator, draft, target, optimizer, scheduler, batches: list[MicroBatch], s: StepSettings) -> dict:
    """Forward/backward over ``grad_accum`` micro-batches, clip, optimizer and scheduler step.

    Returns global (all-rank) values: ``loss`` (Σ w·loss / Σ w), ``lr`` used for this step,
    ``grad_norm`` (before clipping), ``tokens`` (target tokens), ``skipped`` (rows without an
    anchor) and ``stats`` (:class:`LossStats`).
    """
    if len(batches) != accelerator.gradient_accumulation_steps:
        raise ValueError(f"{len(batches)} micro-batches for gradient_accumulation_steps="
                         f"{accelerator.gradient_accumulation_steps}")
    lr = scheduler.get_last_lr()[0]
    total_w = float(reduce_sum(accelerator, torch.tensor([sum(b.weight_sum for b in batches)], dtype=torch.float64)))
    scale = accelerator.num_processes * len(batches) / total_w if total_w > 0 else 0.0
    stats = LossStats.zeros(s.block_size)
    for b in batches:
        with accelerator.accumulate(draft):
            loss_sum, st = micro_loss(draft, target, b.to(accelerator.device), s)
            accelerator.backward(loss_sum * scale)
        stats.add(st)
    grad_norm = accelerator.clip_grad_norm_(draft.parameters(), s.grad_clip if s.grad_clip > 0 else math.inf)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    extra = torch.tensor([sum(b.tokens for b in batches), sum(b.skipped for b in batches)], dtype=torch.float64)
    total = reduce_sum(accelerator, torch.cat([stats.to_vector(), extra]))
    stats = LossStats.from_vector(total[:-2])
    return {
        "loss": stats.loss_sum / stats.weight_sum if stats.weight_sum else 0.0,
        "lr": lr,
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "tokens": int(total[-2]),
        "skipped": int(total[-1]),
        "stats": stats,
    }


def make_optimizer(draft: torch.nn.Module, lr: float, weight_decay: float, betas,
                   fused: bool = False) -> torch.optim.Optimizer:
    """AdamW over the draft's trainable parameters (fp32 master weights; docs/method.md §4); ``fused``: torch's
    fused kernel (one launch for all parameters; ``train.speed.set_fused_adam`` switches a built one)."""
    params = [p for p in draft.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), fused=fused or None)


def lr_lambda(step: int, total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """lr multiplier of 0-based optimizer ``step``: linear warmup ``(step+1)/warmup``, then
    cosine ``r + (1-r)·½(1+cos(π·p))`` or linear ``r + (1-r)(1-p)`` or constant, p = progress after warmup."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    p = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    return min_lr_ratio + (1 - min_lr_ratio) * (1 - p)


def make_scheduler(optimizer, total_steps: int, warmup_ratio: float, schedule: str, min_lr_ratio: float = 0.0):
    """``LambdaLR`` of :func:`lr_lambda`, stepped once per optimizer step (not per rank)."""
    warmup = int(math.ceil(warmup_ratio * total_steps))
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_lambda(step, total_steps, warmup, schedule, min_lr_ratio))
