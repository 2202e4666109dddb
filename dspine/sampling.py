"""Token sampling shared by the target and the draft (docs/method.md §5).

Temperature, then top-k, then top-p (nucleus) — the same processing is applied to target and
draft logits, so the rejection rule compares the distributions that were actually sampled
(docs/method.md §8.7).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    """Decoding settings. ``temperature == 0`` means greedy (top-p/top-k ignored).

    Raises ValueError (from :meth:`validate`) on a negative or non-finite temperature, ``top_p`` outside
    (0, 1], a negative ``top_k`` or ``max_new_tokens < 1``."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256
    seed: int = 0

    def validate(self) -> SamplingParams:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature} must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Sampling distribution of ``logits [..., V]`` -> fp32 probabilities ``[..., V]``.

    softmax(logits / T) restricted to the top-k tokens, then to the smallest prefix (by
    decreasing probability) whose mass reaches ``top_p``, renormalised. Requires T > 0."""
    if temperature <= 0:
        raise ValueError("logits_to_probs needs temperature > 0 (use argmax for greedy)")
    scores = logits.float() / temperature
    V = scores.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        keep_sorted = mass_before < top_p  # the first token is always kept
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs [..., V]`` -> int64 ``[...]``."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def greedy_accept(draft_tokens: torch.Tensor, target_argmax: torch.Tensor):
    """Exact-match acceptance (T = 0).

    Args:
        draft_tokens: ``[B, K]`` int64, the K = bs-1 draft tokens.
        target_argmax: ``[B, K+1]`` int64, the target's argmax at the anchor and each draft slot.
    Returns:
        (accepted ``[B]`` int64 in 0..K, bonus ``[B]`` int64 = target_argmax at the first mismatch).
    """
    match = (draft_tokens == target_argmax[:, :-1]).long()
    accepted = match.cumprod(dim=1).sum(dim=1)
    bonus = target_argmax.gather(1, accepted[:, None])[:, 0]
    return accepted, bonus


def chain_accept(draft_tokens, p_draft, p_target, generator: torch.Generator | None = None):
    """Chain rejection sampling (docs/method.md §5.5; Leviathan et al. 2023, Chen et al. 2023).

    Draft token k is accepted with probability ``min(1, p_t/p_d)`` in order until the first
    rejection; the bonus is drawn from ``normalize(max(p_t - p_d, 0))`` at that row, or from
    ``p_t`` of the last row when all K were accepted. The emitted tokens follow ``p_t`` exactly.

    Args:
        draft_tokens: ``[B, K]`` int64 tokens sampled from ``p_draft``.
        p_draft: ``[B, K, V]`` fp32, the distribution the draft tokens were sampled from.
        p_target: ``[B, K+1, V]`` fp32 target distributions at the anchor and each draft slot.
    Returns:
        (accepted ``[B]`` int64, bonus ``[B]`` int64).
    """
    B, K = draft_tokens.shape
    q = p_draft.gather(-1, draft_tokens[..., None])[..., 0]
    p = p_target[:, :K].gather(-1, draft_tokens[..., None])[..., 0]
    u = torch.rand(B, K, generator=generator, device=q.device)
    ok = (u * q < p).long()
    accepted = ok.cumprod(dim=1).sum(dim=1)
    rows = torch.arange(B, device=q.device)
    pt = p_target[rows, accepted]
    pd = torch.cat([p_draft, torch.zeros_like(p_draft[:, :1])], dim=1)[rows, accepted]
    residual = (pt - pd).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), pt)
    bonus = sample(residual, generator)
    return accepted, bonus
