"""The DSpine training loss (docs/method.md §4): anchors, block inputs, weighted chunked cross entropy.

For each sampled anchor a of a sequence the draft sees the block ``[x_a, MASK × (bs-1)]``; slot
k >= 1 predicts ``x_{a+k}`` with weight ``w_k = exp(-(k-1)/γ) · loss_mask[a+k]`` (0 past the
sequence end), and ``loss = Σ w·CE / Σ w``. The vocabulary projection is the frozen target
``lm_head``, applied in row chunks by :class:`FusedLinearCE` so that the ``[rows, vocab]`` logits
never exist at once.

Knowledge distillation (run config ``distill``, docs/method.md §4): with soft targets slot k of the
block at anchor a is trained towards the target's own next-token distribution at sequence position
a+k-1 (its prediction of token a+k given the true prefix, the distribution used at verify), with the
same weights and normalisation; :class:`FusedLinearSoftCE` computes the target's logits per row
chunk as well, so neither ``[rows, vocab]`` tensor exists at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# ------------------------------------------------------------------------------------- anchors


def anchor_generator(seed: int, step: int, rank: int, micro: int) -> torch.Generator:
    """CPU generator for the anchors of one micro-batch, a pure function of its arguments.

    Resuming at ``step`` therefore draws the same anchors without saving RNG state for them.
    ``step`` is the 0-based optimizer step (use a negative value for eval draws)."""
    key = (((int(seed) * 1_000_003 + int(step)) * 8191 + int(rank)) * 131 + int(micro)) % (2**63 - 1)
    return torch.Generator().manual_seed(key)


def valid_anchors(loss_mask: torch.Tensor, length: int) -> torch.Tensor:
    """Positions p < length - 1 with ``loss_mask[p] = loss_mask[p+1] = 1`` (docs/method.md §4).

    loss_mask: ``[S]`` 0/1 (any int/bool dtype), valid up to ``length``. Returns sorted int64 ``[n]``."""
    m = loss_mask[:length].bool()
    if length < 2:
        return torch.zeros(0, dtype=torch.long)
    return torch.nonzero(m[:-1] & m[1:]).flatten()


def sample_anchors(loss_masks: list[torch.Tensor], lengths: list[int], max_anchors: int,
                   generator: torch.Generator, pad_to: int | None = None) -> torch.Tensor:
    """Up to ``max_anchors`` valid anchors per sequence, uniformly without replacement, sorted.

    Returns int64 ``[B, N]`` (N = ``pad_to`` or the largest count in the batch, at least 1),
    padded with -1. Draws happen in row order from ``generator``."""
    picks = []
    for mask, length in zip(loss_masks, lengths):
        valid = valid_anchors(mask, length)
        if len(valid) > max_anchors:
            valid = valid[torch.randperm(len(valid), generator=generator)[:max_anchors]].sort().values
        picks.append(valid)
    n = pad_to if pad_to is not None else max([len(p) for p in picks] + [1])
    out = torch.full((len(picks), n), -1, dtype=torch.long)
    for i, p in enumerate(picks):
        out[i, : len(p)] = p
    return out


# ------------------------------------------------------------------------------------- blocks


def block_input_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """``[B, N*bs]`` token ids ``[x_a, MASK, ..., MASK]`` per block (padding blocks: all MASK).

    input_ids: ``[B, S]`` int64; anchors: ``[B, N]`` int64 with -1 padding."""
    B, N = anchors.shape
    ids = torch.full((B, N, block_size), int(mask_token_id), dtype=input_ids.dtype, device=input_ids.device)
    tok = torch.gather(input_ids, 1, anchors.clamp(min=0))
    ids[:, :, 0] = torch.where(anchors >= 0, tok, ids[:, :, 0])
    return ids.view(B, N * block_size)


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """fp32 ``[bs]``: 0 for slot 0, ``exp(-(k-1)/γ)`` for slot k >= 1 (docs/method.md §4)."""
    k = torch.arange(block_size, dtype=torch.float64)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w.float()


def block_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
                  block_size: int, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and weights of every block slot.

    Args:
        input_ids, loss_mask: ``[B, S]``; lengths: ``[B]`` valid tokens per row; anchors ``[B, N]`` (-1 = pad).
    Returns:
        labels int64 ``[B, N*bs]`` (token at a+k; 0 at slot 0 and where undefined) and weights fp32 ``[B, N*bs]``
        = ``exp(-(k-1)/γ) · loss_mask[a+k]``, 0 for slot 0, padding blocks and a+k >= length.
    """
    B, N = anchors.shape
    k = torch.arange(block_size, device=anchors.device)
    pos = anchors[:, :, None] + k  # [B, N, bs]
    inside = (anchors[:, :, None] >= 0) & (pos < lengths[:, None, None])
    idx = torch.where(inside, pos, torch.zeros_like(pos)).view(B, -1)
    labels = torch.gather(input_ids, 1, idx).view(B, N, block_size)
    mask = torch.gather(loss_mask.to(torch.float32), 1, idx).view(B, N, block_size)
    w = slot_weights(block_size, gamma).to(anchors.device) * mask * inside
    labels = torch.where(inside & (k > 0), labels, torch.zeros_like(labels))
    return labels.view(B, -1), w.view(B, -1)


def target_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Sequence position whose target logits give the distribution of each block slot's token.

    Slot k of the block at anchor a predicts token a+k; the target predicts it from position a+k-1
    (causal LM: logits at p are the distribution of token p+1). anchors: int64 ``[B, N]`` (-1 = pad).
    Returns int64 ``[B, N*bs]`` = a+k-1, with 0 at slot 0 and in padding blocks (rows of weight 0)."""
    B, N = anchors.shape
    k = torch.arange(block_size, device=anchors.device)
    pos = anchors[:, :, None] + k - 1
    ok = (anchors[:, :, None] >= 0) & (k > 0)
    return torch.where(ok, pos, torch.zeros_like(pos)).view(B, N * block_size)


# ----------------------------------------------------------------------- fused linear cross entropy


class FusedLinearCE(torch.autograd.Function):
    """``Σ_r w_r · CE(h_r Wᵀ, y_r)`` with the logits computed in row chunks (Liger-style).

    Forward walks the rows in chunks of ``chunk_size``: logits (fp32) -> log-softmax -> weighted
    CE, and, when ``hidden`` needs a gradient, ``∂/∂h = w · (softmax - onehot(y)) · W`` for the
    chunk, kept in one ``[R, H]`` fp32 buffer. Backward only scales that buffer by the incoming
    scalar gradient. ``weight`` (the frozen target lm_head) gets no gradient. Peak extra memory is
    a few ``[chunk_size, V]`` fp32 tensors.

    Inputs: hidden ``[R, H]`` (any float dtype), weight ``[V, H]``, labels int64 ``[R]``,
    row_weights fp32 ``[R]``. Outputs: fp32 scalar loss sum and bool ``[R]`` (argmax == label;
    not differentiable).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, chunk_size: int, impl: str = "eager"):
        R = hidden.shape[0]
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty(R, hidden.shape[1], dtype=torch.float32, device=hidden.device) if need_grad else None
        correct = torch.empty(R, dtype=torch.bool, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, R, chunk_size):
            e = min(s + chunk_size, R)
            y, w = labels[s:e], row_weights[s:e].float()
            if impl == "compiled":
                loss_c, correct[s:e], dlogits = _compiled_ce_chunk()(hidden[s:e].to(weight.dtype) @ weight.t(), y, w,
                                                                     need_grad)
                total += loss_c
                if need_grad:
                    grad[s:e] = (dlogits @ weight).float()
                continue
            logits = (hidden[s:e].to(weight.dtype) @ weight.t()).float()  # [c, V]
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, y[:, None]).squeeze(1)
            total += (w * (lse - target_logit)).sum()
            correct[s:e] = logits.argmax(-1) == y
            if need_grad:
                # d CE / d logits = softmax - onehot; reuse the logits buffer in place
                probs = logits.sub_(lse[:, None]).exp_()
                probs[torch.arange(e - s, device=probs.device), y] -= 1.0
                probs.mul_(w[:, None])
                grad[s:e] = (probs.to(weight.dtype) @ weight).float()
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, _grad_correct):
        (grad,) = ctx.saved_tensors
        return (grad * grad_total).to(ctx.hidden_dtype), None, None, None, None, None


def ce_chunk(logits: torch.Tensor, labels: torch.Tensor, row_weights: torch.Tensor, need_grad: bool):
    """The per-chunk math of :class:`FusedLinearCE` as one function (the body that ``impl="compiled"`` fuses).

    logits ``[c, V]`` (the lm_head GEMM output, any float dtype), labels int64 ``[c]``, row_weights fp32 ``[c]``.
    Returns ``Σ w·(logsumexp - logit_y)`` (fp32 scalar), ``argmax == y`` (bool ``[c]``) and, when ``need_grad``,
    ``∂/∂logits = w·(softmax - onehot(y))`` in the dtype of ``logits`` (else None). Statistics in fp32 as the
    eager path; compiled, the ``[c, V]`` logits are read about twice instead of ~10 fp32 passes."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    loss = (row_weights * (lse - x.gather(1, labels[:, None]).squeeze(1))).sum()
    correct = x.argmax(-1) == labels
    if not need_grad:
        return loss, correct, None
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == labels[:, None]
    dlogits = (torch.exp(x - lse[:, None]) - onehot.to(x.dtype)) * row_weights[:, None]
    return loss, correct, dlogits.to(logits.dtype)


_CE_CHUNK = {}


def _compiled_ce_chunk():
    # compiled once per process; the last (shorter) chunk of a step makes the row count dynamic after one recompile
    if "fn" not in _CE_CHUNK:
        _CE_CHUNK["fn"] = torch.compile(ce_chunk)
    return _CE_CHUNK["fn"]


CE_IMPLS = ("eager", "compiled")


def fused_linear_cross_entropy(hidden, weight, labels, row_weights, chunk_size: int = 2048, impl: str = "eager"):
    """``(Σ w·CE, argmax == label)`` over rows of ``hidden [R, H]`` with ``weight [V, H]``; see :class:`FusedLinearCE`.

    ``impl``: ``"eager"`` (in-place fp32 ops on each chunk, the reference) or ``"compiled"`` (:func:`ce_chunk`
    under ``torch.compile``: same math, fused; equal to eager within fp32 reduction-order rounding).
    Raises ValueError for ``chunk_size < 1`` or an unknown ``impl``."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    if impl not in CE_IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {CE_IMPLS}")
    return FusedLinearCE.apply(hidden, weight, labels, row_weights, int(chunk_size), impl)


def naive_linear_cross_entropy(hidden, weight, labels, row_weights, chunk_size: int = 0):
    """Reference with the same signature: full ``[R, V]`` logits, ``F.cross_entropy``."""
    logits = (hidden.to(weight.dtype) @ weight.t()).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (row_weights.float() * ce).sum(), logits.argmax(-1) == labels


class FusedLinearSoftCE(torch.autograd.Function):
    """Distillation loss with soft targets over row chunks (the soft-label form of :class:`FusedLinearCE`).

    Per row r: draft logits ``z = h_r Wᵀ``, target logits ``u = t_{i_r} Wᵀ`` (same frozen lm_head),
    temperature T, ``q = softmax(z/T)``, ``p = softmax(u/T)``, and

        loss_r = α · CE(y_r, softmax(z)) + (1 - α) · T² · CE(p, q),   CE(p, q) = -Σ_v p_v log q_v

    (Hinton et al. 2015, "Distilling the Knowledge in a Neural Network": soft-target CE scaled by T²
    so its gradient keeps the hard-label scale). CE(p, q) = KL(p ‖ q) + H(p) and H(p) does not depend
    on the draft, so the soft term is the forward KL up to a constant. ``∂loss_r/∂z = α·(softmax(z) -
    onehot(y)) + (1-α)·T·(q - p)``; the forward keeps ``w·∂/∂z · W`` per chunk in one ``[R, H]``
    buffer, as :class:`FusedLinearCE` does. Logits are fp32 (fp64 when ``weight`` is fp64, which the
    gradient checks use). Peak extra memory is a few ``[chunk_size, V]`` tensors of that dtype.

    Inputs: hidden ``[R, H]``, weight ``[V, H]``, labels int64 ``[R]``, row_weights ``[R]``,
    target_hidden ``[U, H]`` (target rows after its final norm), target_index int64 ``[R]`` (row of
    target_hidden for each row). Outputs: loss sum Σ w·loss_r (scalar), bool ``[R]`` argmax(z) ==
    label, bool ``[R]`` argmax(z) == argmax(u), Σ w·KL(p ‖ q) and Σ w·CE(y, softmax(z)) (scalars), and
    without a gradient to keep (evaluation) the overlap ``Σ_v min(p_v, q_v)`` per row (``[R]``, the
    probability that rejection sampling accepts a token drawn from q when the target samples from p
    [Leviathan et al. 2023, §3]; an empty tensor when a gradient is kept, where it would cost a
    ``[chunk, V]`` buffer). Only the first output is differentiable.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, target_hidden, target_index, alpha: float,
                temperature: float, chunk_size: int):
        R, dev = hidden.shape[0], hidden.device
        acc = torch.promote_types(weight.dtype, torch.float32)
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty(R, hidden.shape[1], dtype=acc, device=dev) if need_grad else None
        correct = torch.empty(R, dtype=torch.bool, device=dev)
        agree = torch.empty(R, dtype=torch.bool, device=dev)
        total, kl_total, ce_total = (torch.zeros((), dtype=acc, device=dev) for _ in range(3))
        overlap = torch.empty(0 if need_grad else R, dtype=acc, device=dev)
        T, a = float(temperature), float(alpha)
        for s in range(0, R, chunk_size):
            e = min(s + chunk_size, R)
            z = (hidden[s:e].to(weight.dtype) @ weight.t()).to(acc)  # [c, V] draft logits
            u = (target_hidden[target_index[s:e]].to(weight.dtype) @ weight.t()).to(acc)  # [c, V] target logits
            y, w = labels[s:e], row_weights[s:e].to(acc)
            lse = torch.logsumexp(z, dim=-1)
            ce = lse - z.gather(1, y[:, None]).squeeze(1)  # hard-label CE, as in FusedLinearCE
            zmax = z.argmax(-1)
            correct[s:e] = zmax == y
            agree[s:e] = zmax == u.argmax(-1)
            log_q = z / T if T != 1.0 else z.clone()
            log_q -= torch.logsumexp(log_q, dim=-1, keepdim=True)
            log_p = u.div_(T) if T != 1.0 else u
            log_p -= torch.logsumexp(log_p, dim=-1, keepdim=True)
            p = log_p.exp()
            soft = -(p * log_q).sum(-1)  # CE(p, q)
            kl = (p * (log_p - log_q)).sum(-1)
            row = ce if a == 1.0 else a * ce + (1.0 - a) * (T * T) * soft
            total += (w * row).sum()
            kl_total += (w * kl).sum()
            ce_total += (w * ce).sum()
            if not need_grad:  # min(q, p) in the log_q buffer: no new [c, V] tensor
                overlap[s:e] = torch.minimum(log_q.exp_(), p, out=log_q).sum(-1)
            if need_grad:
                # (1-α)·T·(q - p) + α·(softmax(z) - onehot(y)), built in the log_q buffer
                g = log_q.exp_().sub_(p).mul_((1.0 - a) * T)
                if a != 0.0:
                    g += a * (z - lse[:, None]).exp_()
                    g[torch.arange(e - s, device=dev), y] -= a
                g.mul_(w[:, None])
                grad[s:e] = (g.to(weight.dtype) @ weight).to(acc)
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(correct, agree, kl_total, ce_total, overlap)
        return total, correct, agree, kl_total, ce_total, overlap

    @staticmethod
    def backward(ctx, grad_total, *_unused):
        (grad,) = ctx.saved_tensors
        return (grad * grad_total).to(ctx.hidden_dtype), None, None, None, None, None, None, None, None


def _check_soft_args(alpha: float, temperature: float, chunk_size: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must be in [0, 1] (weight of the hard-label CE)")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")


def fused_linear_soft_cross_entropy(hidden, weight, labels, row_weights, target_hidden, target_index,
                                    alpha: float = 0.0, temperature: float = 1.0, chunk_size: int = 2048):
    """``(Σ w·loss, argmax == label, argmax == target argmax, Σ w·KL, Σ w·CE_hard, overlap)``; see
    :class:`FusedLinearSoftCE` (``overlap`` is empty when a gradient is kept).

    Raises ValueError for chunk_size < 1, alpha outside [0, 1] or temperature <= 0."""
    _check_soft_args(alpha, temperature, chunk_size)
    return FusedLinearSoftCE.apply(hidden, weight, labels, row_weights, target_hidden, target_index, float(alpha),
                                   float(temperature), int(chunk_size))


def naive_linear_soft_cross_entropy(hidden, weight, labels, row_weights, target_hidden, target_index,
                                    alpha: float = 0.0, temperature: float = 1.0, chunk_size: int = 0):
    """Reference with the same signature: full ``[R, V]`` logits, ``F.cross_entropy`` with soft targets
    and ``F.kl_div``; autograd gives the gradient. The overlap is always computed."""
    _check_soft_args(alpha, temperature, max(chunk_size, 1))
    acc = torch.promote_types(weight.dtype, torch.float32)
    z = (hidden.to(weight.dtype) @ weight.t()).to(acc)
    u = (target_hidden[target_index].to(weight.dtype) @ weight.t()).to(acc)
    p = torch.softmax(u / temperature, dim=-1)
    ce = F.cross_entropy(z, labels, reduction="none")
    soft = F.cross_entropy(z / temperature, p, reduction="none")
    kl = F.kl_div(torch.log_softmax(z / temperature, -1), torch.log_softmax(u / temperature, -1), reduction="none",
                  log_target=True).sum(-1)
    w = row_weights.to(acc)
    loss = (w * (alpha * ce + (1 - alpha) * temperature ** 2 * soft)).sum()
    zmax = z.argmax(-1)
    overlap = torch.minimum(torch.softmax(z / temperature, -1), p).sum(-1).detach()
    return loss, zmax == labels, zmax == u.argmax(-1), (w * kl).sum().detach(), (w * ce).sum().detach(), overlap


# ------------------------------------------------------------------------------- block loss


@dataclass
class LossStats:
    """Sums over weighted rows (w > 0) of one or more micro-batches, per slot k = 0..bs-1 (0 unused).

    loss_sum = Σ w·loss (the trained objective), weight_sum = Σ w, ce_sum = Σ w·CE(label), kl_sum =
    Σ w·KL(p_target ‖ q_draft) (Python floats), count[k] = weighted rows of slot k, correct[k] = those
    where the draft's argmax equals the label, agree[k] = those where it equals the target's argmax
    (int64 ``[bs]``), overlap[k] = Σ over those rows of Σ_v min(p_v, q_v) (fp64 ``[bs]``). ``soft`` says
    whether the target's distribution was computed (kl_sum and agree are 0 otherwise), ``overlap_on``
    whether the overlap was (the fused op computes it only when no gradient is kept, i.e. at evaluation; the
    naive reference always)."""

    loss_sum: float
    weight_sum: float
    count: torch.Tensor
    correct: torch.Tensor
    ce_sum: float = 0.0
    kl_sum: float = 0.0
    agree: torch.Tensor | None = None
    soft: bool = False
    overlap: torch.Tensor | None = None
    overlap_on: bool = False

    def __post_init__(self):
        if self.agree is None:
            self.agree = torch.zeros_like(self.count)
        if self.overlap is None:
            self.overlap = torch.zeros(len(self.count), dtype=torch.float64)

    @classmethod
    def zeros(cls, block_size: int) -> LossStats:
        return cls(0.0, 0.0, torch.zeros(block_size, dtype=torch.long), torch.zeros(block_size, dtype=torch.long))

    def add(self, other: LossStats) -> LossStats:
        self.loss_sum += other.loss_sum
        self.weight_sum += other.weight_sum
        self.ce_sum += other.ce_sum
        self.kl_sum += other.kl_sum
        self.count += other.count
        self.correct += other.correct
        self.agree += other.agree
        self.overlap += other.overlap
        self.soft = self.soft or other.soft
        self.overlap_on = self.overlap_on or other.overlap_on
        return self

    def to_vector(self) -> torch.Tensor:
        """fp64 ``[6 + 4·bs]`` for one all-reduce: (loss_sum, weight_sum, ce_sum, kl_sum, soft, overlap_on, count,
        correct, agree, overlap)."""
        head = [self.loss_sum, self.weight_sum, self.ce_sum, self.kl_sum, float(self.soft), float(self.overlap_on)]
        return torch.cat([torch.tensor(head, dtype=torch.float64), self.count.double(), self.correct.double(),
                          self.agree.double(), self.overlap.double()])

    @classmethod
    def from_vector(cls, v: torch.Tensor) -> LossStats:
        v = v.double().cpu()
        bs = (len(v) - 6) // 4
        part = lambda i: v[6 + i * bs: 6 + (i + 1) * bs]
        n = lambda i: part(i).round().long()
        return cls(float(v[0]), float(v[1]), n(0), n(1), float(v[2]), float(v[3]), n(2), bool(v[4] > 0),
                   part(3).clone(), bool(v[5] > 0))

    @property
    def accuracy(self) -> list[float]:
        """Teacher-forced accuracy acc_k, k = 1..bs-1 (NaN for a slot with no weighted row)."""
        return [c / n if n else float("nan") for c, n in zip(self.correct.tolist()[1:], self.count.tolist()[1:])]

    @property
    def agreement(self) -> list[float] | None:
        """Fraction of slot k's rows (k = 1..bs-1) where the draft's argmax equals the target's argmax
        (what T = 0 acceptance tests); None when the target's distribution was not computed."""
        if not self.soft:
            return None
        return [c / n if n else float("nan") for c, n in zip(self.agree.tolist()[1:], self.count.tolist()[1:])]

    @property
    def overlap_rate(self) -> list[float] | None:
        """Mean of Σ_v min(p_v, q_v) over slot k's rows (k = 1..bs-1): the chance that a token sampled from
        the draft is accepted when the target samples from its distribution (T = 1 at distill_temperature
        1, no top-k / top-p), teacher forced; None when it was not computed."""
        if not self.overlap_on:
            return None
        return [o / n if n else float("nan") for o, n in zip(self.overlap.tolist()[1:], self.count.tolist()[1:])]


@dataclass
class DistillTargets:
    """What :func:`block_loss` needs for soft targets (run config ``distill``; docs/method.md §4).

    last_hidden: ``[B, S, H]`` output of the target's last decoder layer, *before* its final norm
    (:meth:`dspine.target.TargetAdapter.features_and_last_hidden`); norm: the target's final norm
    (``[..., H] -> [..., H]``); anchors: int64 ``[B, N]`` (-1 = pad); alpha: weight of the hard-label
    CE (0 = pure distillation, 1 = hard labels only, the target then only measured); temperature: T."""

    last_hidden: torch.Tensor
    norm: Callable[[torch.Tensor], torch.Tensor]
    anchors: torch.Tensor
    alpha: float = 0.0
    temperature: float = 1.0


def block_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
               block_size: int, chunk_size: int = 2048, fused: bool = True,
               distill: DistillTargets | None = None, ce_impl: str = "eager") -> tuple[torch.Tensor, LossStats]:
    """Weighted loss sum of the draft's block outputs and per-slot statistics.

    Args:
        hidden: ``[B, N*bs, H]`` draft outputs (``forward_train``); lm_head_weight ``[V, H]`` (frozen).
        labels, weights: ``[B, N*bs]`` from :func:`block_targets`.
        chunk_size, ce_impl: rows per lm_head chunk and the chunk math of the hard-label CE
            (:func:`fused_linear_cross_entropy`).
        distill: soft targets (None = hard-label CE only, :class:`FusedLinearCE`). The target rows of the
            weighted slots (:func:`target_positions`) are gathered once per distinct position, then put
            through the final norm; the lm_head runs per row chunk inside :class:`FusedLinearSoftCE`.
    Returns:
        ``Σ w·loss`` (fp32 scalar, differentiable w.r.t. ``hidden``; divide by Σ w for the loss of
        docs/method.md §4) and :class:`LossStats`. Only rows with w > 0 reach the lm_head.
    """
    H = hidden.shape[-1]
    flat_w = weights.reshape(-1)
    rows = torch.nonzero(flat_w > 0).flatten()
    h = hidden.reshape(-1, H).index_select(0, rows.to(hidden.device))
    y = labels.reshape(-1)[rows].to(hidden.device)
    w = flat_w[rows].to(hidden.device)
    slots = (rows % block_size).to(hidden.device)
    count = torch.bincount(slots, minlength=block_size).cpu()
    if distill is not None:
        B, S, _ = distill.last_hidden.shape
        anchors = distill.anchors.to(hidden.device)
        row_b = torch.div(rows.to(hidden.device), anchors.shape[1] * block_size, rounding_mode="floor")
        pos = target_positions(anchors, block_size).reshape(-1)[rows.to(hidden.device)] + row_b * S
        uniq, index = torch.unique(pos, return_inverse=True)  # one target row per distinct position
        with torch.no_grad():
            t = distill.norm(distill.last_hidden.reshape(B * S, -1).index_select(0, uniq))
        fn = fused_linear_soft_cross_entropy if fused else naive_linear_soft_cross_entropy
        if len(rows):
            loss_sum, correct, agree, kl_sum, ce_sum, overlap = fn(h, lm_head_weight, y, w, t, index, distill.alpha,
                                                                   distill.temperature, chunk_size)
        else:  # as below: a zero with a graph
            loss_sum, kl_sum, ce_sum = hidden.float().sum() * 0.0, 0.0, 0.0
            correct = agree = torch.zeros(0, dtype=torch.bool, device=hidden.device)
            overlap = torch.zeros(0, device=hidden.device)
        on = overlap.numel() == len(rows) if len(rows) else not torch.is_grad_enabled()  # computed: no gradient kept
        per_slot = (torch.bincount(slots, weights=overlap.double(), minlength=block_size).cpu() if on and len(rows)
                    else torch.zeros(block_size, dtype=torch.float64))
        stats = LossStats(float(loss_sum.detach()), float(w.double().sum()), count,
                          torch.bincount(slots[correct], minlength=block_size).cpu(), float(ce_sum), float(kl_sum),
                          torch.bincount(slots[agree], minlength=block_size).cpu(), True, per_slot, on)
        return loss_sum, stats
    if len(rows):
        if fused:
            loss_sum, correct = fused_linear_cross_entropy(h, lm_head_weight, y, w, chunk_size, impl=ce_impl)
        else:
            loss_sum, correct = naive_linear_cross_entropy(h, lm_head_weight, y, w, chunk_size)
    else:  # nothing to learn here: a zero that still reaches every draft parameter (DDP needs the graph)
        loss_sum, correct = hidden.float().sum() * 0.0, torch.zeros(0, dtype=torch.bool, device=hidden.device)
    hits = torch.bincount(slots[correct], minlength=block_size).cpu()
    loss = float(loss_sum.detach())
    stats = LossStats(loss, float(w.double().sum()), count, hits, ce_sum=loss)
    return loss_sum, stats


def tau_sim(accuracy: list[float]) -> tuple[float, list[float]]:
    """τ implied by teacher-forced per-position accuracies, bonus token included (docs/method.md §1).

    Approximation: the k-th draft is accepted with probability acc_k independently of the earlier
    ones being accepted, so P(first k drafts all accepted) ≈ Π_{j<=k} acc_j =: accept_at_pos[k] and
    τ_sim = 1 + Σ_k accept_at_pos[k]. acc_k is measured with the true tokens before slot k
    (teacher forcing), so τ_sim is optimistic against real decoding (docs/method.md §8.2).
    Returns (τ_sim, accept_at_pos for k = 1..bs-1). A slot without data counts as accuracy 0.
    """
    at_pos, run = [], 1.0
    for a in accuracy:
        run *= 0.0 if math.isnan(a) else a
        at_pos.append(run)
    return 1.0 + sum(at_pos), at_pos
