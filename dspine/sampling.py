"""Token sampling shared by both decoders (docs/method.md §5; the stream layout: docs/contracts.md).

Temperature, then top-k, then top-p: the same processing for target and draft logits, so the
rejection rule (``dspine.ops.accept``) compares the distributions actually sampled (§8.7).
Randomness is counter based, one stream per request: every uniform is a SplitMix64 hash of (request
seed, stream, output position, token) in int64 tensor ops — no generator state, no host sync, so it
runs inside a CUDA graph, and a request's sample depends only on its own seed and tokens, never on
its batch neighbours or the concurrency. Sampling is the exponential race ``argmax_v p_v / E_v``,
``E = -log u`` (gpt-fast's ``multinomial_sample_one_no_sync``), which draws v with probability p_v.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

STREAM_TARGET, STREAM_DRAFT, STREAM_ACCEPT = 1, 2, 3


@dataclass
class SamplingParams:
    """Decoding settings. ``temperature == 0`` means greedy (top-p/top-k ignored); ``seed`` seeds the
    per-request streams (module docstring).

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


# -- counter-based randomness ------------------------------------------------------------------

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)  # SplitMix64 increment [Steele, Lea & Flood 2014]
_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 tensors (wrapping products, logical right shifts)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _M1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _M2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def request_seed(seed: int, index: int) -> int:
    """The default seed of prompt ``index`` of a call with ``SamplingParams.seed = seed`` (int64)."""
    z = torch.tensor([_signed(int(seed) * 0x9E3779B97F4A7C15 + int(index))], dtype=torch.int64)
    return int(_mix64(_mix64(z))[0])


def uniforms(seeds: torch.Tensor, stream: int, positions: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """U(0, 1) fp32 noise, a pure function of its arguments (module docstring).

    Args:
        seeds: ``[B]`` int64 request seeds.
        stream: ``STREAM_TARGET`` | ``STREAM_DRAFT`` | ``STREAM_ACCEPT``.
        positions: ``[B, K]`` int output positions.
        vocab: None for one uniform per (b, k), else V for ``[B, K, V]`` (one per token).
    Returns:
        fp32 ``[B, K]`` or ``[B, K, V]`` in (0, 1): 24-bit ``(m + 0.5) / 2^24``, never 0 or 1.
    """
    base = _mix64(_mix64(seeds.long()) + _signed(stream * 0x9E3779B97F4A7C15))
    key = _mix64(base[:, None] + positions.long() * _GOLDEN)
    if vocab is not None:
        key = _mix64(key[..., None] + torch.arange(vocab, device=key.device) * _GOLDEN)
    return ((key & 0xFFFFFF).float() + 0.5) * (1.0 / (1 << 24))


def exponentials(seeds, stream: int, positions, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``[B, K, V]`` fp32, strictly positive: ``-log`` of :func:`uniforms`."""
    return -torch.log(uniforms(seeds, stream, positions, vocab))


def sample(probs: torch.Tensor, seeds: torch.Tensor, stream: int, positions: torch.Tensor) -> torch.Tensor:
    """One draw per row of ``probs [B, K, V]`` (or ``[B, V]`` with ``positions [B]``) -> int64 ``[B, K]``
    (``[B]``): the exponential race ``argmax p / E`` with E from the request's stream. Sync-free."""
    if probs.dim() == 2:
        return sample(probs[:, None], seeds, stream, positions[:, None])[:, 0]
    return (probs / exponentials(seeds, stream, positions, probs.shape[-1])).argmax(-1)


def nonfinite_error(who: str) -> FloatingPointError:
    """The error every backend raises for NaN/Inf logits of the target or the draft (never "τ = 1")."""
    hint = ("check the dtype (fp16 overflows Qwen-family layers) and the target's weights" if who == "target"
            else "check the draft checkpoint's weights and dtype")
    return FloatingPointError(f"non-finite {who} logits (NaN/Inf): {hint}")


def sampling_params(args):
    """``SamplingParams`` from the CLI flags (``--temperature --top-p --top-k --max-new-tokens --seed``),
    validated; a ValueError names the flag (``--top-p=nan must be in (0, 1]``). Shared by every CLI that
    samples (``infer.generate``, ``infer.bench``, ``data.regenerate``)."""
    try:
        return SamplingParams(args.temperature, args.top_p, args.top_k, args.max_new_tokens, args.seed).validate()
    except ValueError as e:
        field, _, rest = str(e).partition("=")
        raise ValueError(f"--{field.replace('_', '-')}={rest}") from None
