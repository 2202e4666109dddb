"""Token sampling shared by both decoders (docs/method.md §5; the stream layout: docs/contracts.md).

Temperature, then top-k, then top-p: the same processing for target and draft logits, so the
rejection rule (``dspine.ops.accept``) compares the distributions actually sampled (§8.7).
Randomness is counter based, one stream per request: every uniform is a SplitMix64 hash of (request
seed, stream, output position, token) in int64 tensor ops — no generator state, no host sync, so it
runs inside a CUDA graph, and a request's sample depends only on its own seed and tokens, never on
its batch neighbours or the concurrency. Sampling is the exponential race ``argmax_v p_v / E_v``,
``E = -log u`` (gpt-fast's ``multinomial_sample_one_no_sync``), which draws v with probability p_v.

Top-k fast path (0 < top_k <= ``TOP_K_FAST_MAX``, the serving case): one ``topk`` over V gives the
k candidates in sampling order; softmax and top-p run on those k values, the race evaluates noise
only at the candidates (``uniforms_at``). It skips the sort over V of ``[B, K, V]`` and the
B·K·V-element noise, and is exact: the same support as the dense path, probabilities equal up to
fp32 rounding (k-term instead of V-term sums), and on the same probabilities the race over the
candidates draws the dense race's token bit for bit (noise is a per-token function, zeros never win).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from dspine.counter_hash import _GOLDEN, _M1, _M2, _mix64, _signed, _to_unit  # noqa: F401 (also the race kernel's)
from dspine.ops.topk import inv_temperature, topk_ids

STREAM_TARGET, STREAM_DRAFT, STREAM_ACCEPT = 1, 2, 3


MIN_TEMPERATURE = 1e-6  # smallest positive (draft) temperature: |logits| up to ~1e32 stay finite in fp32 after / T


@dataclass
class SamplingParams:
    """Decoding settings. ``temperature == 0`` means greedy (top-p/top-k ignored); ``seed`` seeds the
    per-request streams (module docstring).

    ``draft_temperature`` (T > 0 only; None = ``temperature``): the temperature the draft's tokens are
    sampled at, with the same top-k/top-p; 0 drafts the draft's argmax (q one-hot). The output still
    follows the target's distribution at ``temperature``: the rejection rule takes the q actually
    sampled from (:func:`draft_distribution`); the acceptance rate changes, and so may the text drawn for
    a given seed. A block draft samples every slot from its own marginal, independently of the tokens
    drafted before it, so a sharper q might keep the drafted chain coherent (docs/method.md §5); on the
    shipped SmolLM2 draft no value beat the default (results/smollm2-draft-temperature-h200.json).

    ``invariant`` (T > 0; no effect at T = 0, where greedy decoding is invariant already): drafter-invariant
    verification. Every drafted token is checked against the target's own draw at its output position, the race the
    plain (autoregressive) decoder runs with the same seed and position (:func:`sample`, ``STREAM_TARGET``), and the
    draft draws its tokens with that same noise; the longest matching prefix is accepted and the target's draw
    after it is the bonus token. The text is then the plain decode's for that seed, token for token, whatever the
    draft, the verify budget, the planner or the concurrency, bit for bit where the target's logits are bitwise the
    same in a verify block and a 1-token step (``exact`` mode; the CPU fp32 tests), else up to the race's rare
    near-ties, as greedy decoding is up to argmax near-ties; and each token is an exact draw from the target's
    distribution. The acceptance rate is lower than rejection sampling's: a drafted token passes with the
    probability that the two races pick the same token, at least ``(1 − δ) / (1 + δ)`` against rejection sampling's
    ``1 − δ`` (δ the total variation distance between target and draft; Daliri, Musco and Suresh 2024,
    "Coupling without Communication and Drafter-Invariant Speculative Decoding"). Chain verification only.

    Raises ValueError (from :meth:`validate`) on a negative or non-finite temperature or draft
    temperature, one in (0, ``MIN_TEMPERATURE``) (logits / T would overflow fp32: use 0), a draft
    temperature > 0 with ``temperature == 0``, ``top_p`` outside (0, 1], a negative ``top_k`` or
    ``max_new_tokens < 1``."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256
    seed: int = 0
    draft_temperature: float | None = None  # None = temperature; 0 = the draft's argmax
    invariant: bool = False  # T > 0: drafter-invariant verification (the plain decode's text for the seed)

    def validate(self) -> SamplingParams:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature} must be a finite number >= 0")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature={self.temperature} must be 0 (greedy) or >= {MIN_TEMPERATURE:g} "
                             "(logits / T overflow fp32 below that)")
        if self.draft_temperature is not None:
            if not (math.isfinite(self.draft_temperature) and self.draft_temperature >= 0):
                raise ValueError(f"draft_temperature={self.draft_temperature} must be a finite number >= 0")
            if 0 < self.draft_temperature < MIN_TEMPERATURE:
                raise ValueError(f"draft_temperature={self.draft_temperature} must be 0 (the draft's argmax) or >= "
                                 f"{MIN_TEMPERATURE:g} (logits / T overflow fp32 below that)")
            if self.temperature == 0 and self.draft_temperature != 0:
                raise ValueError(f"draft_temperature={self.draft_temperature} is for sampling (temperature > 0); "
                                 "greedy decoding drafts the draft's argmax")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= SEED_MAX:
            raise ValueError(f"seed={self.seed!r} must be an integer in [0, 2**64 - 1] (request seeds are 64-bit: "
                             "another value would wrap onto one of those, e.g. -1 onto 2**64 - 1)")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def invariant_sampling(self) -> bool:
        """Sampling (T > 0) with drafter-invariant verification (``invariant``)."""
        return self.invariant and not self.greedy

    @property
    def step_key(self) -> tuple:
        """The settings a compiled decoding step depends on (temperature, top_p, top_k, draft_temperature, and
        whether verification is drafter-invariant), for the engine's CUDA-graph and step-cost caches;
        max_new_tokens and seed are runtime state."""
        return self.temperature, self.top_p, self.top_k, self.draft_temperature, self.invariant_sampling


def check_tree_draft_temperature(params: SamplingParams, tree: bool) -> None:
    """Raise ValueError for tree verification with draft temperature 0: the tree is built from the draft's
    distribution, one-hot at 0, so every node off the chain would be padding that the verify pays for; and for
    tree verification with drafter-invariant sampling (``invariant``: chain verification only)."""
    if tree and params.invariant_sampling:
        raise ValueError("invariant sampling verifies the chain only: use --verify chain (with --budget auto the "
                         "planner leaves its trees out)")
    if tree and params.draft_temperature == 0 and not params.greedy:
        raise ValueError("draft_temperature=0 with tree verification: the tree is built from the draft's distribution, "
                         "one-hot at 0; use chain verification or a draft temperature > 0")


def draft_distribution(logits: torch.Tensor, params: SamplingParams, impl: str = "torch"):
    """The draft's sampling distribution at T > 0: ``logits [..., V]`` -> ``(q [..., V] fp32, ids)`` as
    :func:`logits_to_probs` with ``with_ids=True``, at ``params.draft_temperature`` (None: the target's
    temperature) and the target's top-k/top-p. Draft temperature 0 gives the argmax one-hot, ``ids
    [..., 1]`` (:func:`sample` then returns the argmax, and the rejection rule accepts it with the
    target's probability of it). Sync-free."""
    t = params.temperature if params.draft_temperature is None else params.draft_temperature
    if t == 0:
        ids = logits.argmax(-1, keepdim=True)
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, ids, 1.0), ids
    return logits_to_probs(logits, t, params.top_p, params.top_k, with_ids=True, impl=impl)


SEED_MAX = 2**64 - 1  # SamplingParams.seed: request seeds are int64 bit patterns (request_seed)
TOP_K_FAST_MAX = 256  # top_k up to this takes the candidate path (0 forces the dense reference path)
PLAIN_FAST = True  # no top-k / top-p cut: softmax without the sort (False forces the sorted reference)


def _top_p(sorted_p: torch.Tensor, top_p: float) -> torch.Tensor:
    """Probabilities sorted in sampling order -> the smallest prefix whose mass reaches top_p, renormalised."""
    mass_before = sorted_p.cumsum(-1) - sorted_p
    sorted_p = sorted_p * (mass_before < top_p)  # the first token is always kept
    return sorted_p / sorted_p.sum(-1, keepdim=True)


def scaled_scores(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``fp32(logits) * fp32(1 / T)``: the scores every sampling path cuts and softmaxes, the same bits on every
    device (torch on CUDA divides by a Python-float T as this product, on the CPU as an IEEE division)."""
    return logits.float() * inv_temperature(temperature)


def top_k_probs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, impl: str = "torch"):
    """The sampling distribution of ``logits [..., V]`` on its top-k candidates (``logits_to_probs``'s
    fast path): ``(probs [..., k] fp32, ids [..., k] int64)``, k = min(top_k, V), in sampling order;
    probabilities cut by top-p are 0. One top-k over V (``dspine.ops.topk.topk_ids``: ``impl="triton"``
    reads the logits once); softmax and top-p on the k values only."""
    ids = topk_ids(logits, temperature, min(top_k, logits.shape[-1]), impl)  # in sampling order
    probs = torch.softmax(scaled_scores(logits.gather(-1, ids), temperature), dim=-1)
    return (_top_p(probs, top_p) if top_p < 1.0 else probs), ids


def logits_to_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0, *,
                    with_ids: bool = False, impl: str = "torch"):
    """Sampling distribution of ``logits [..., V]`` -> fp32 probabilities ``[..., V]``.

    softmax(logits / T) restricted to the top-k tokens, then to the smallest prefix (in sampling
    order) whose mass reaches ``top_p``, renormalised. Sampling order: higher score first, the lower
    token id among equal scores; so top-k keeps exactly min(k, V) tokens (ties at the k-th score go
    to the lower ids) and both cuts are the same on every device. Requires T > 0.

    With 0 < top_k <= ``TOP_K_FAST_MAX`` it takes the candidate path (:func:`top_k_probs`, one
    scatter into zeros): no sort over V; the result equals the dense path's up to fp32 rounding
    (softmax and top-p sum k values instead of V), with the same support; ``impl="triton"`` takes its top-k
    in one kernel (``dspine.ops.topk``, the same ids). Plain temperature (top_k 0
    or >= V, top_p 1; ``PLAIN_FAST``) is one softmax in vocabulary order: the sorted path's values up to
    fp32 rounding (the order of the softmax's sum; a few ulp). ``with_ids=True`` returns
    ``(probs, ids)``: ``ids [..., k]`` int64 hold every nonzero of ``probs`` (for :func:`sample`,
    :func:`bonus_noise`), or None on the dense path.
    """
    if temperature <= 0:
        raise ValueError("logits_to_probs needs temperature > 0 (use argmax for greedy)")
    V = logits.shape[-1]
    if 0 < top_k <= TOP_K_FAST_MAX and top_k < V:
        p, ids = top_k_probs(logits, temperature, top_p, top_k, impl)
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, ids, p)
        return (probs, ids) if with_ids else probs
    if top_p >= 1.0 and not 0 < top_k < V and PLAIN_FAST:  # plain temperature: nothing to cut, no sort
        probs = torch.softmax(scaled_scores(logits, temperature), dim=-1)
        return (probs, None) if with_ids else probs
    # dense reference: one stable sort over V (equal scores keep the lower id first)
    sorted_s, order = scaled_scores(logits, temperature).sort(dim=-1, descending=True, stable=True)
    if 0 < top_k < V:
        sorted_s[..., top_k:] = float("-inf")
    sorted_p = torch.softmax(sorted_s, dim=-1)
    if top_p < 1.0:
        sorted_p = _top_p(sorted_p, top_p)
    probs = torch.zeros_like(sorted_p).scatter_(-1, order, sorted_p)
    return (probs, None) if with_ids else probs


# -- counter-based randomness ------------------------------------------------------------------

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
        fp32 ``[B, K]`` or ``[B, K, V]`` in (0, 1): 23-bit ``(m + 0.5) / 2^23``, exact, never 0 or 1.
    """
    key = _position_keys(seeds, stream, positions)
    if vocab is not None:
        key = _mix64(key[..., None] + torch.arange(vocab, device=key.device) * _GOLDEN)
    return _to_unit(key)


def _position_keys(seeds: torch.Tensor, stream: int, positions: torch.Tensor) -> torch.Tensor:
    base = _mix64(_mix64(seeds.long()) + _signed(stream * 0x9E3779B97F4A7C15))
    return _mix64(base[:, None] + positions.long() * _GOLDEN)


def uniforms_at(seeds: torch.Tensor, stream: int, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``uniforms(seeds, stream, positions, vocab=V)`` at the given tokens only, bit for bit:
    ``token_ids [B, K, n]`` int -> fp32 ``[B, K, n]``, entry ``[b, k, j]`` = the uniform of token
    ``token_ids[b, k, j]``. Work is B·K·n hashes instead of B·K·V."""
    key = _position_keys(seeds, stream, positions)
    return _to_unit(_mix64(key[..., None] + token_ids.long() * _GOLDEN))


def exponentials(seeds, stream: int, positions, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``[B, K, V]`` fp32, strictly positive: ``-log`` of :func:`uniforms`."""
    return -torch.log(uniforms(seeds, stream, positions, vocab))


def sample(probs: torch.Tensor, seeds: torch.Tensor, stream: int, positions: torch.Tensor,
           ids: torch.Tensor | None = None, impl: str = "torch") -> torch.Tensor:
    """One draw per row of ``probs [B, K, V]`` (or ``[B, V]`` with ``positions [B]``) -> int64 ``[B, K]``
    (``[B]``): the exponential race ``argmax p / E`` with E from the request's stream. Sync-free.

    ``ids [B, K, n]`` (``[B, n]``) int64, distinct per row and holding every nonzero of the row (the
    ``ids`` of ``logits_to_probs(..., with_ids=True)``): the race runs over those n tokens only, with
    E from :func:`uniforms_at` — no noise over B·K·V; the same token, bit for bit (equal maxima go
    to the lower id, as ``argmax`` over V does).

    ``impl="triton"`` (no ``ids``): the race over V runs in one kernel that makes the noise itself
    (``dspine.ops.race``), the same token without the B·K·V noise tensors."""
    if probs.dim() == 2:
        return sample(probs[:, None], seeds, stream, positions[:, None], None if ids is None else ids[:, None],
                      impl)[:, 0]
    if ids is None:
        if impl == "triton":
            from dspine.ops.race import race

            keys = _position_keys(seeds, stream, positions)  # [B, K]
            return race(probs.reshape(-1, probs.shape[-1]), keys.reshape(-1), impl).view(keys.shape)
        return (probs / exponentials(seeds, stream, positions, probs.shape[-1])).argmax(-1)
    score = probs.gather(-1, ids) / -torch.log(uniforms_at(seeds, stream, positions, ids))
    best = score.amax(-1, keepdim=True)
    V = probs.shape[-1]  # a NaN row has no max: clamp to a valid id, the non-finite check then raises
    return torch.where(score == best, ids, V).amin(-1).clamp_max(V - 1)


def bonus_noise(seeds: torch.Tensor, stream: int, positions: torch.Tensor, vocab: int,
                ids: torch.Tensor | None = None) -> torch.Tensor:
    """Exp(1) noise ``[B, V]`` fp32 for the bonus race of ``accept_sample`` / ``verify_tree``:
    ``exponentials(seeds, stream, positions[:, None], vocab)[:, 0]`` (``positions [B]``).

    ``ids [B, ...]`` int64: the target's candidate ids of every verified row (the ``ids`` of
    ``logits_to_probs(..., with_ids=True)``); the noise is exact there and 1.0 elsewhere, where the
    target's probabilities are 0 and the race never looks — the same bonus, bit for bit, from B·n
    hashes instead of B·V."""
    if ids is None:
        return exponentials(seeds, stream, positions[:, None], vocab)[:, 0]
    flat = ids.reshape(ids.shape[0], 1, -1)
    e = -torch.log(uniforms_at(seeds, stream, positions[:, None], flat))[:, 0]
    return torch.ones(ids.shape[0], vocab, device=ids.device).scatter_(1, flat[:, 0], e)


def nonfinite_error(who: str) -> FloatingPointError:
    """The error every backend raises for NaN/Inf logits of the target or the draft (never "τ = 1")."""
    hint = ("check the dtype (fp16 overflows Qwen-family layers) and the target's weights" if who == "target"
            else "check the draft checkpoint's weights and dtype")
    return FloatingPointError(f"non-finite {who} logits (NaN/Inf): {hint}")


INVARIANT_HELP = ("T > 0: drafter-invariant verification: each drafted token is checked against the target's own "
                  "draw with the seed (the plain decoder's), so the text is the plain decode's for that seed whatever "
                  "the draft, planner or concurrency (bit for bit with --exact; otherwise up to rare near-ties, as "
                  "greedy output); fewer drafted tokens pass than with rejection sampling (the default). Chain "
                  "verification only")
DRAFT_TEMPERATURE_HELP = ("temperature the draft's tokens are sampled at (default: --temperature; 0: the draft's "
                          "argmax), with the same top-k/top-p; sampling only. The output still follows the target's "
                          "distribution at --temperature (the text drawn for a seed may change); the acceptance "
                          "rate changes. Not with --verify tree at 0 (the tree needs the draft's distribution)")


def sampling_params(args):
    """``SamplingParams`` from the CLI flags (``--temperature --top-p --top-k --max-new-tokens --seed``, and
    ``--draft-temperature`` and ``--invariant`` where the CLI has them),
    validated; a ValueError names the flag (``--top-p=nan must be in (0, 1]``); a warning on stderr names
    ``--top-p`` / ``--top-k`` given with ``--temperature 0`` (greedy ignores them). Shared by every CLI that
    samples (``infer.generate``, ``infer.bench``, ``data.regenerate``)."""
    try:
        params = SamplingParams(args.temperature, args.top_p, args.top_k, args.max_new_tokens, args.seed,
                                getattr(args, "draft_temperature", None), getattr(args, "invariant", False)).validate()
    except ValueError as e:
        field, _, rest = str(e).partition("=")
        raise ValueError(f"--{field.replace('_', '-')}={rest}") from None
    ignored = [f for f, on in (("--top-p", params.top_p != 1), ("--top-k", params.top_k != 0),
                                ("--invariant", params.invariant)) if on]
    if params.greedy and ignored:  # common in copied commands, harmless: say so once instead of refusing
        verb, them = ("apply", "them") if len(ignored) > 1 else ("applies", "it")
        print(f"warning: {' / '.join(ignored)} {verb} at --temperature > 0 only; --temperature 0 decodes greedily "
              f"and ignores {them}", file=sys.stderr)
    return params
