"""Acceptance statistics with one convention everywhere (docs/method.md §1).

Each verify step commits n = a + 1 tokens (a accepted draft tokens + the bonus token), or fewer
when EOS / max_new_tokens cut the step; only committed tokens count. Then

* τ = mean n over steps (bonus included),
* accept_at_pos[k] = fraction of steps with n - 1 >= k, k = 1..bs-1,
* identity τ = 1 + Σ_k accept_at_pos[k].

:class:`GenerationResult` is what both decoders return (the engine and the reference decoder):
per-prompt stats that add up to the batch totals.
"""

from __future__ import annotations

from dataclasses import dataclass


class AcceptStats:
    """Histogram ``hist[n]`` of committed tokens per verify step, n = 1..block_size."""

    def __init__(self, block_size: int, hist: list[int] | None = None):
        self.block_size = int(block_size)
        if hist is not None and len(hist) != self.block_size + 1:
            raise ValueError(f"hist has {len(hist)} bins, expected block_size + 1 = {self.block_size + 1}")
        self.hist = [0] * (self.block_size + 1) if hist is None else [int(x) for x in hist]

    def record(self, n: int) -> None:
        """Add one step that committed n tokens (1..block_size)."""
        if not 1 <= n <= self.block_size:
            raise ValueError(f"committed tokens per step must be in 1..{self.block_size}, got {n}")
        self.hist[n] += 1

    def merge(self, other: AcceptStats) -> AcceptStats:
        if other.block_size != self.block_size:
            raise ValueError(f"cannot merge stats of block sizes {self.block_size} and {other.block_size}")
        self.hist = [a + b for a, b in zip(self.hist, other.hist)]
        return self

    @property
    def steps(self) -> int:
        return sum(self.hist)

    @property
    def tokens(self) -> int:
        return sum(n * c for n, c in enumerate(self.hist))

    @property
    def tau(self) -> float:
        """Committed tokens per verify step; NaN when no verify step ran (e.g. max_new_tokens=1)."""
        return self.tokens / self.steps if self.steps else float("nan")

    @property
    def accept_at_pos(self) -> list[float]:
        """[k = 1 .. bs-1] fraction of steps that accepted at least k draft tokens."""
        s = self.steps
        return [sum(self.hist[k + 1:]) / s if s else 0.0 for k in range(1, self.block_size)]

    def to_dict(self) -> dict:
        return {
            "tau": self.tau if self.steps else None,
            "accept_at_pos": self.accept_at_pos,
            "accept_hist": self.hist[1:],  # index 0 = steps that committed 1 token
            "verify_steps": self.steps,
            "committed_tokens": self.tokens,
            "convention": "tau counts the bonus token; accept_hist[i] = steps committing i+1 tokens",
        }


@dataclass
class GenerationResult:
    """One ``generate`` call of either decoder. ``prompt_stats[i]`` counts prompt i's own verify steps and
    committed tokens (``len(token_ids[i]) - 1``: the prefill token is no step's); ``stats`` pools them."""

    token_ids: list[list[int]]  # generated tokens per prompt (EOS included when hit)
    finish_reasons: list[str]  # "stop" (EOS) or "length"
    prompt_stats: list[AcceptStats]  # per prompt
    elapsed_s: float = 0.0  # wall time of the whole call (prefill included)
    prefill_s: float = 0.0
    steps: int = 0  # decode-loop iterations (one batched step each in the engine)

    @property
    def stats(self) -> AcceptStats:
        total = AcceptStats(self.prompt_stats[0].block_size)
        for st in self.prompt_stats:
            total.merge(st)
        return total

    @property
    def steps_per_prompt(self) -> list[int]:
        return [st.steps for st in self.prompt_stats]

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tok_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0
