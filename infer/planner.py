"""Verify-budget planner: per engine step, AR, the chain or a tree, whichever commits the most tokens per second.

A mode is ``("ar", 1)``, ``("chain", verify_size)`` or ``("tree", nodes)``. Cost model: the step time of
every mode at the running batch size, measured by the engine at start-up on its own device (graph
replays on a GPU). Benefit: committed tokens per live request per step, a moving average of what each
mode actually committed (AR commits exactly 1). Confidence here is the draft's measured acceptance on
the running requests rather than its per-slot probabilities: it needs no calibration and no trained
head, and the engine gets it from the token counts it already reads (docs/method.md §6 describes the
per-slot confidence-head alternative).

Rule (:func:`choose_mode`, a pure function of the cost table, the token averages and the time spent):

1. Exploit: the best mode is the measured one (AR always is) with the most tokens per millisecond.
2. Prune: a mode is worth probing only if its *ceiling* divided by its step time beats the best rate.
   The ceiling is at most the tokens one step of the mode can commit (1 for AR, ``verify_size`` for a
   chain, ``min(nodes, verify_size)`` for a tree: its depth is the draft block's). A measured mode's
   ceiling is also at most ``headroom`` × its own average; an unrun mode's at most ``gain`` × the best
   average of the measured speculative modes (the same draft: on SmolLM2 the tree of 32 commits 1.32 ×
   the chain's tokens, published block-draft trees about 1.4 ×). A mode that cannot win is never run;
   on the H200 tables of issue 16 a tree step at concurrency 64 costs 17-27 AR steps.
3. Probe under a time budget: of the plausible modes the cheapest is run once when the time it is
   expected to lose (its step time minus the time the best mode needs for the tokens it is expected to
   commit; 1 token for an unrun mode) fits in ``share`` of the step time spent so far plus a warm-up
   allowance of ``warmup`` steps of the cheapest mode (at most the time spent: the first step runs AR).
   :class:`StepPlanner` settles the charge with what the probe committed, so a probe that beat the
   best mode gives time back. Near-ties probe often (they lose little), distant rivals rarely, and
   the time lost to probing stays under about ``share`` plus the warm-up (≈ 1% over 512 AR steps).

Averages: per mode a fast one (newest observation weighted ``max(decay, 1 / n)``) follows a change
of acceptance (a new prompt, an easy or hard passage) within a few steps of that mode, and a slow one
(``max(slow, 1 / n)``) is what the fast one relaxes to, by ``1 - decay`` per step the mode is not run:
a mode left after a few unlucky steps (one request's tokens per step are geometric-like and noisy) is
judged again on its long-run acceptance instead of being frozen at its low point.

``benchmarks/engine/sim_planner.py`` replays the recorded H200 cost tables with a synthetic
acceptance process (planner ≥ 0.98 × the best fixed mode at the 8 recorded points); the start-up
table is the cost model, host time outside the measured step is not in it.
"""

from __future__ import annotations

from collections import Counter

Mode = tuple[str, int]


def max_tokens(mode: Mode, modes) -> int:
    """Most tokens one step of ``mode`` can commit per request: 1 (AR), ``n`` (chain of ``n``), or for a
    tree of ``n`` nodes ``min(n, longest chain among modes)`` (the tree's depth is the draft block's)."""
    kind, n = mode
    if kind == "ar":
        return 1
    chains = [m[1] for m in modes if m[0] == "chain"]
    return min(n, max(chains)) if kind == "tree" and chains else n


def choose_mode(
    costs: dict[Mode, float],
    tokens: dict[Mode, float | None],
    spent_ms: float,
    lost_ms: float,
    share: float = 0.005,
    warmup: float = 2.0,
    headroom: float = 2.0,
    gain: float = 2.0,
) -> tuple[Mode, float, float]:
    """One planner decision (module docstring, rule 1-3).

    Args:
        costs: step milliseconds per mode.
        tokens: average committed tokens per request per step of each mode, ``None`` if never run
            (AR's may be ``None`` too: it is taken as 1).
        spent_ms: step time run so far (sum of ``costs`` of the modes run).
        lost_ms: time lost to probes so far (the second return values, settled by :class:`StepPlanner`
            with what each probe committed).
        share, warmup, headroom, gain: rule 2-3 of the module docstring (``warmup`` in steps of the
            cheapest mode).
    Returns:
        ``(mode, lost, rate)``: the mode to run, the milliseconds this step is expected to lose against
        the best mode (0 when it is the best mode) and the best mode's tokens per millisecond.
    """
    est = {m: 1.0 if m[0] == "ar" else tokens.get(m) for m in costs}
    known = [m for m in costs if est[m] is not None]
    if not known:  # no AR in the table and nothing run yet: the cheapest mode first
        return min(costs, key=lambda m: costs[m]), 0.0, 0.0
    best = max(known, key=lambda m: (est[m] / costs[m], -costs[m]))
    rate = est[best] / costs[best]
    spec = [est[m] for m in known if m[0] != "ar"]

    def ceiling(m: Mode) -> float:
        cap = max_tokens(m, costs)
        if est[m] is not None:
            return min(cap, headroom * est[m])
        return min(cap, gain * max(spec)) if spec else cap

    plausible = [m for m in costs if m != best and ceiling(m) / costs[m] > rate]
    if not plausible:
        return best, 0.0, rate
    probe = min(plausible, key=lambda m: costs[m])
    loss = max(0.0, costs[probe] - (1.0 if est[probe] is None else est[probe]) / rate)
    allowance = share * spent_ms + min(spent_ms, warmup * min(costs.values()))
    if lost_ms + loss <= allowance:
        return probe, loss, rate
    return best, 0.0, rate


class StepPlanner:
    """Chooses one mode per engine step (module docstring).

    Args:
        costs: step milliseconds per mode at this batch size (> 0).
        decay: least weight of the newest observation in a mode's fast moving average.
        slow: least weight of the newest observation in a mode's slow moving average.
        share, warmup, headroom, gain: the probing rule of :func:`choose_mode`.
    Raises ValueError on an empty or non-positive cost table.
    """

    def __init__(
        self,
        costs: dict[Mode, float],
        decay: float = 0.3,
        slow: float = 0.02,
        share: float = 0.005,
        warmup: float = 2.0,
        headroom: float = 2.0,
        gain: float = 2.0,
    ):
        if not costs or min(costs.values()) <= 0:
            raise ValueError(f"planner costs must be a non-empty table of positive step times, got {costs}")
        self.costs, self.decay, self.slow_decay = dict(costs), decay, slow
        self.rule = dict(share=share, warmup=warmup, headroom=headroom, gain=gain)
        self.fast: dict[Mode, float | None] = {m: 1.0 if m[0] == "ar" else None for m in costs}
        self.slow: dict[Mode, float | None] = dict(self.fast)
        self.seen: Counter = Counter()  # observations per mode
        self.last_seen: dict[Mode, int] = {m: 0 for m in costs}  # step of the latest observation
        self.choices: Counter = Counter()
        self.step = 0
        self.spent_ms = 0.0  # step time of the modes run (cost table)
        self.lost_ms = 0.0  # time lost to probes against the best mode (negative: probes gained)
        # this step's probe: mode, ms the best mode needs for the tokens assumed in its charge, best rate
        self.probe: tuple[Mode, float, float] | None = None

    @property
    def tokens(self) -> dict[Mode, float | None]:
        """Expected committed tokens per request per step of each mode (``None``: never run): the fast
        average, relaxing towards the slow one by ``1 - decay`` per step the mode is not run. A mode left
        after a few unlucky steps is not judged on them for ever (its fast average stops moving then)."""
        out = {}
        for m, f in self.fast.items():
            if f is None or m[0] == "ar":
                out[m] = f
            else:
                keep = (1 - self.decay) ** (self.step - self.last_seen[m])
                out[m] = self.slow[m] + keep * (f - self.slow[m])
        return out

    def rate(self, mode: Mode) -> float | None:
        """Expected committed tokens per request per millisecond, ``None`` before the mode's first run."""
        tok = self.tokens[mode]
        return None if tok is None else tok / self.costs[mode]

    def choose(self) -> Mode:
        mode, loss, rate = choose_mode(self.costs, self.tokens, self.spent_ms, self.lost_ms, **self.rule)
        self.step += 1
        self.spent_ms += self.costs[mode]
        self.lost_ms += loss
        # a probe is charged what it is expected to lose; observe() settles the charge with what it committed
        self.probe = (mode, self.costs[mode] - loss, rate) if loss > 0 else None
        self.choices[mode] += 1
        return mode

    def observe(self, mode: Mode, tokens_per_request: float) -> None:
        """Record what a step of ``mode`` committed, per request that was live in it."""
        if self.probe is not None and self.probe[0] == mode:  # settle: a lucky probe gives time back
            _, assumed_ms, rate = self.probe
            self.lost_ms += assumed_ms - tokens_per_request / rate
            self.probe = None
        if mode[0] == "ar":
            return
        x, n = tokens_per_request, self.seen[mode] + 1
        self.seen[mode], self.last_seen[mode] = n, self.step
        w = max(self.slow_decay, 1.0 / n)  # a plain mean over the first observations
        self.slow[mode] = x if self.slow[mode] is None else self.slow[mode] + w * (x - self.slow[mode])
        w = max(self.decay, 1.0 / n)
        old = self.fast[mode]
        self.fast[mode] = x if old is None else old + w * (x - old)

    def report(self) -> dict:
        """``{mode name: {"steps", "step_ms", "tokens_per_step"}}``, e.g. ``"tree32"``; ``tokens_per_step``
        is the slow average (``None``: never run)."""
        return {
            f"{m[0]}{m[1] if m[0] != 'ar' else ''}": {
                "steps": self.choices[m],
                "step_ms": self.costs[m],
                "tokens_per_step": self.slow[m],
            }
            for m in self.costs
        }
