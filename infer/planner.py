"""Verify-budget planner: per engine step, AR, the chain or a tree, whichever commits the most tokens per second.

A mode is ``("ar", 1)``, ``("chain", verify_size)`` or ``("tree", nodes)``. Cost model: the step time of
every mode at the running batch size, measured by the engine at start-up on its own device (graph
replays on a GPU). Benefit: committed tokens per live request per step, an exponential moving average
of what each mode actually committed (AR commits exactly 1). The planner runs the mode that maximises
``tokens / step time`` and re-measures the others now and then (every ``probe_every`` steps the least
recently run mode is run once), so a change of acceptance (a new prompt, an easy or hard passage) is
followed within a few steps. Confidence here is the draft's measured acceptance on the running
requests rather than its per-slot probabilities: it needs no calibration and no trained head, and the
engine gets it from the token counts it already reads (docs/method.md §6 describes the per-slot
confidence-head alternative).
"""

from __future__ import annotations

from collections import Counter

Mode = tuple[str, int]


class StepPlanner:
    """Chooses one mode per engine step (module docstring).

    Args:
        costs: step milliseconds per mode at this batch size (> 0).
        probe_every: run the least recently used mode once every this many steps.
        decay: weight of the newest observation in the moving average.
    Raises ValueError on an empty or non-positive cost table.
    """

    def __init__(self, costs: dict[Mode, float], probe_every: int = 16, decay: float = 0.3):
        if not costs or min(costs.values()) <= 0:
            raise ValueError(f"planner costs must be a non-empty table of positive step times, got {costs}")
        self.costs, self.probe_every, self.decay = dict(costs), probe_every, decay
        self.tokens: dict[Mode, float | None] = {m: 1.0 if m[0] == "ar" else None for m in costs}
        self.last_run = {m: -1 for m in costs}
        self.choices: Counter = Counter()
        self.step = 0

    def rate(self, mode: Mode) -> float:
        """Expected committed tokens per request per millisecond (optimistic before the first run)."""
        tok = self.tokens[mode]
        return (tok if tok is not None else float("inf")) / self.costs[mode]

    def choose(self) -> Mode:
        self.step += 1
        best = max(self.costs, key=self.rate)
        if self.step % self.probe_every == 0:
            best = min(self.costs, key=lambda m: self.last_run[m])
        self.last_run[best] = self.step
        self.choices[best] += 1
        return best

    def observe(self, mode: Mode, tokens_per_request: float) -> None:
        """Record what a step of ``mode`` committed, per request that was live in it."""
        if mode[0] == "ar":
            return
        old = self.tokens[mode]
        self.tokens[mode] = (
            tokens_per_request if old is None else (1 - self.decay) * old + self.decay * tokens_per_request
        )

    def report(self) -> dict:
        """``{mode name: {"steps", "step_ms", "tokens_per_step"}}``, e.g. ``"tree32"``."""
        return {
            f"{m[0]}{m[1] if m[0] != 'ar' else ''}": {
                "steps": self.choices[m],
                "step_ms": self.costs[m],
                "tokens_per_step": self.tokens[m],
            }
            for m in self.costs
        }
