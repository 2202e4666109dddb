"""Verify-budget planner: per engine step, AR, the chain or a tree, whichever commits the most tokens per second.

A mode is ``("ar", 1)``, ``("chain", width)`` (``verify_size``, or narrower: ``Engine.plan_chains``) or
``("tree", nodes)``. docs/planner.md gives the reasoning and
the measurements behind every rule below (same section names); docs/status.md the session-by-session record.

Cost model: each mode's step time at the running batch size, measured by the engine at start-up (graph replays, idle
rows, empty context) and corrected online by the wall time of every step it runs ("Online cost"). The engine's AR
step leaves the draft-context append of its features pending; a flush every ``Engine.AR_DEFER`` AR steps and before a
speculative step appends them, its time inside the measured time of the step after it. Benefit: committed tokens
per live request per step, a moving average of what each mode committed (AR: exactly 1), scaled by the draft's
confidence where the engine gives one ("Calibration"): after every speculative step, per speculative mode, the mean
over the step's live rows of the chain's expected committed tokens ``1 + Σ_k Π_{j≤k} p_j`` (p_j the draft's
probability of its own token at slot j, the argmax's at T = 0; ``dspine.ops.plan_stats.chain_confidence``), written
inside the step and read with ``out_len``, two steps old because the loop is pipelined. :class:`StepPlanner` keeps
the choices not yet observed in order; while a probe is unobserved it starts no other, and the decode's first mode
repeats until it is timed (or 3 steps came back without a time). A trained confidence head is the alternative
(docs/method.md §6).

Rule (:func:`choose_mode`, a pure function of the cost table, the token averages and the time spent):

1. Exploit: the best mode is the measured one (AR always is) with the most tokens per millisecond.
2. Prune: a mode is worth probing only if its *ceiling* ÷ its step time beats the best rate. The ceiling is at most
   what one step can commit (1 for AR, ``verify_size`` for a chain, ``min(nodes, verify_size)`` for a tree). A
   measured mode's is at most ``1 + (headroom − 1) × min(1, max(1, √(PRIOR_ROWS / n)) / √r)`` × its average (n its
   observations, r its requests per observation, 1 under the drain rule); a led mode's ("Paired observations"), once
   ``LEAD_MIN_STEPS`` paired steps are behind each of its leads, its estimate plus ``LEAD_Z`` standard errors of the
   leads (:meth:`StepPlanner.lead_se`; without them, the measured mode's rule on its estimate); an unrun mode's at
   most ``gain`` × the best average of the measured speculative modes.
3. Probe under a time budget: of the plausible modes the cheapest runs once when its expected loss (its step time
   minus the time the best mode needs for the tokens it is expected to commit; 1 token for an unrun mode) fits in
   ``share`` of the step time spent plus ``warmup`` steps of the cheapest mode (at most the time spent).
   :class:`StepPlanner` settles each probe with what it committed, at the larger of the best mode's rate as estimated
   at the choice and its long-run rate (slow average without confidence; a led mode's paired mode's plus the lead;
   times the drain's factor), so a lucky probe gives time back and the time lost stays near ``share`` plus the warm-up.

Averages: per mode a fast one (newest observation weighted ``max(decay × r / (r + PRIOR_ROWS), 1 / n)``, r the requests
in that step) and a slow one (``max(slow, 1 / n)``) plus a standard-error bonus ``√(BONUS_VAR / (n·r̄))`` (n at most
``2 / slow − 1``), which the fast one relaxes to by ``1 − decay`` per step the mode is not run. A mode's first step is
averaged with ``PRIOR_ROWS`` requests at the best average of the other speculative modes, capped at what one step of
the mode can commit (:func:`max_tokens`).

Online cost: a mode's step time is its table time × its measured ÷ table ratio: the decode's first timed mode runs 3
steps first and their median in log space sets its ratio; later steps are clipped to 1/3-3 × the estimate they were
chosen with; a mode's first 3 timings (with the nearest timed mode's ratio as a prior while fewer) give its ratio as
their log-space median, then a log-space moving average (weight ``cost_decay``, each step moving it by at most
``cost_decay`` × log 1.25). Time spent and probe losses are in these measured (clipped) milliseconds. A mode's price
stays where its last timing left it while the mode is not timed.

Calibration: per mode, moving averages (weight ``max(cal_decay, 1 / n)``) of the predicted (P) and realized *accepted*
tokens over the steps with a prediction (realized ÷ predicted is reported). A mode run at least once is expected to
commit ``1 + (T − 1) × (1 + s × (ρ − 1))``, T its token average above, ρ = ``(predicted − 1) / P`` clipped to [1/3, 3],
the result clipped to [1, :func:`max_tokens`]; ``s`` (``conf_slope``, :meth:`StepPlanner.slope`) is 1 for the proportional rule or, with
``"auto"`` (the default), the least-squares slope through the origin of the realized surprise ``(committed − 1) −
(T − 1)`` on the move ``(T − 1)(ρ − 1)``, with a prior of ``SLOPE_PRIOR`` steps at 1, clipped to [0, ``SLOPE_MAX``]. A
led mode takes its paired mode's scaled estimate plus the lead.

Paired observations (:meth:`StepPlanner.observe_paired`): a chain-first tree holds the chain as each node's first
child, tested first with the chain's own test, so the chain nodes on a tree step's accepted path are what the chain
step would have accepted (a lower bound for best-first trees at T = 0, which may drop the chain's deeper nodes), and a
smaller tree inside the run tree (its first nodes by ``dspine.tree.Tree.rank``) accepts the run path's prefix inside
it (``dspine.tree.inner_accepted``). The engine gives them after each tree step; the planner updates their averages
as if they had run, keeps per run mode a slow average of its *lead* over the largest mode paired on its steps (and
of the squared difference, for :meth:`StepPlanner.lead_se`), estimates a led mode as that mode's estimate plus the
lead (no bonus), and does not probe a mode paired within the last ``PAIRED_FRESH`` steps and timed once.

State (``state``; docs/planner.md, "State"): ``"steps"`` (the default) weighs every step alike in the slow averages
and leads, and prices a mode at table × ratio. ``"kv"`` (opt-in) adds ``k × (X − X_m)`` to that price: X the live
requests' context tokens now, X_m their average behind the mode's ratio, k the pooled within-mode slope of step time on
X (:attr:`StepPlanner.kv_slope`); ``"rows_kv"`` (opt-in) also weighs a step by its live requests in the slow averages
and leads (:meth:`StepPlanner._weight`).

Across calls: the engine keeps the cost model (:meth:`StepPlanner.cost_state`) and the acceptance — averages,
calibration, leads, the drain rule's spread — (:meth:`StepPlanner.token_state`) per batch size and sampling setting
from one ``generate`` to the next (``Engine.plan_memory``).

Drain: once no request waits to be admitted, the modes are compared on the time to finish the batch's last request.
Every ``Engine.PLAN_DRAIN_EVERY`` steps the engine gives each request's remaining tokens and chain(-equivalent)
acceptance; :func:`drain_tokens` maps each speculative mode's estimate to what it commits per step for the request
that would finish last under it (each request's acceptance an empirical Bayes posterior of a normal model, shrunk
towards the batch's by :func:`spread_weight`; the finishing step the median of the last request's), and rules 1-3
run until the next refresh on the estimates times one factor, that of the speculative mode with the highest mapped
rate. ``drain_model`` ``"persist"`` (the default) scales every speculative mode alike by the request's acceptance,
takes the spread between requests from the covariance of each request's early and later acceptance
(:func:`persistent_spread`: acceptance comes in bursts, and the spread of short windows' means mostly does not
persist) and carries it to the next call relative to the pooled acceptance squared (docs/planner.md, "Drain"). The
alternatives: ``"scaled"`` (the default before) scales alike with the spread of the requests' means less a step's
noise, carried in tokens²; ``"own"`` scales by each request's acceptance over the longest chain's current estimate (not
the batch's pooled one) and takes no confidence in the drain; ``"persist_cap"`` (opt-in) is ``"persist"`` with a
capped prior (docs/planner.md, "Drain" and "Constants"). With one request every model but ``"own"`` leaves each mode's estimate as it is.

``benchmarks/engine/sim_planner.py`` replays recorded cost tables with a synthetic acceptance process, true step
times that differ from the table and a miscalibrated confidence; ``benchmarks/reference/planner_trace.py replay``
replays the planner over a recorded trace of the shipped draft's acceptance with a GPU run's step times.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter, deque

import numpy as np

Mode = tuple[str, int]
LOG_CLIP = math.log(1.25)  # largest log step-time residual one timed step contributes (online cost)
FIRST_CLIP = 3.0  # a timed step counts within 1/3 .. 3 × the estimate it was chosen with
BONUS_VAR = 1.5  # token² per request in the standard-error bonus (module docstring, "Averages")
FIRST_TIMED = 3  # timings of the decode's first mode before any other runs (module docstring, "Online cost")
PENDING = 8  # unobserved choices kept by StepPlanner (the engine has at most 2)
# steps a paired observation keeps its mode from being probed (module docstring, "Paired ...")
PAIRED_FRESH = 4
PRIOR_ROWS = 4.0  # requests' worth of prior in a mode's first token average (module docstring, "Averages")
# how the drain rule maps a mode to one request (drain_tokens; "scaled", "own" and "persist", the default: module
# docstring, "Drain"; "persist_cap", an opt-in experiment: PERSIST_MODELS)
DRAIN_MODELS = ("scaled", "own", "persist", "persist_cap")
# a led mode's probing ceiling (module docstring, rule 2): its estimate plus LEAD_Z standard errors of its leads, once
# LEAD_MIN_STEPS paired steps are behind each (the paired mode's part of the estimate is observed on the same steps and
# needs no headroom)
LEAD_Z = 1.0
LEAD_MIN_STEPS = 4
# chain steps per request at which this batch's spread and the prior weigh the same (module docstring, "Drain")
SPREAD_STEPS = 16.0
# The drain rule's constants (docs/planner.md, "Constants", gives the measurements behind each): the prior spread of a
# planner with no earlier call (variance between requests' accepted draft tokens per chain step, tokens²); the largest
# standard deviation between requests drain_tokens uses, as a fraction of the pooled acceptance ā; drain model
# "persist"'s early window in chain steps (and the least after it that makes a late one, persistent_spread) and its
# prior spread relative to ā², (sd / ā)²
DEFAULT_SPREAD = 0.25
SPREAD_CV = 0.5
PERSIST_EARLY = 16
DEFAULT_SPREAD_REL = 0.04
# token_state's key for the carried spread and its value with no earlier call, per drain model (a key of its own where
# the units or the meaning differ; the others: "spread", DEFAULT_SPREAD, in tokens²)
SPREAD_STATE = {m: ("spread_rel", DEFAULT_SPREAD_REL) for m in ("persist", "persist_cap")}
# the drain models that estimate the spread as "persist" does (persistent_spread); "persist_cap" (opt-in) takes an
# earlier call's carried spread as its prior only up to DEFAULT_SPREAD_REL (docs/planner.md, "Constants")
PERSIST_MODELS = ("persist", "persist_cap")
SLOPE_PRIOR = 8.0  # steps' worth of the proportional slope (1) in conf_slope="auto" (StepPlanner.slope)
SLOPE_MOVE2 = 0.1  # tokens²: least squared move of each of the prior's steps, a move of about 0.3 tokens (StepPlanner.slope)
SLOPE_MAX = 2.0  # largest confidence slope (StepPlanner.slope)
# the planner's state (module docstring, "State"): "steps" (the default), "kv" or "rows_kv" (opt-in, not yet measured)
PLAN_STATES = ("steps", "kv", "rows_kv")
KV_DECAY = 0.02  # least weight of the newest timed step in the KV-length slope's averages (StepPlanner.kv_slope)
KV_MIN_STEPS = 8  # timed steps with a KV length, across modes, before the slope is used
KV_SHRINK = 0.05  # the slope's ridge: a spread of the KV length below this share of its mean counts for half


def _parse_sizes(text: str, key: str, what: str, example: str) -> tuple[int, ...]:
    """``"A/B"`` -> ``(A, B)``, ``"none"`` -> ``()``; ValueError naming ``key`` and the text for an item that is not
    plain decimal digits (no sign, '_' or spaces, which int() would take), outside 2..64, or repeated."""
    items = [] if text == "none" else text.split("/")
    if not all(re.fullmatch(r"[0-9]+", x) for x in items):
        raise ValueError(f"{key}={text!r}; expected {what}s joined by '/' (e.g. {example}) or none")
    sizes = tuple(int(x) for x in items)
    if not all(2 <= n <= 64 for n in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"{key}={text!r}; each {what.split()[-1]} must be in 2..64, none repeated")
    return sizes


def _flag(parse, text: str, flag: str) -> tuple[int, ...]:
    """``parse(text)``, its ValueError prefixed with the flag's name (``"--plan-trees: plan_trees='x'; expected ..."``):
    what infer.generate and infer.bench report."""
    try:
        return parse(text)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def parse_plan_trees(text: str) -> tuple[int, ...]:
    """``"16/32"`` -> ``(16, 32)``, ``"none"`` -> ``()``: the planner's tree sizes as the command lines take them
    (``infer.generate --plan-trees``, ``infer.bench --plan-trees`` and ``--config LABEL:plan_trees=``;
    ``Engine(plan_trees=...)``). Raises ValueError naming the text (:func:`_parse_sizes`)."""
    return _parse_sizes(text, "plan_trees", "tree size", "16/32")


def parse_plan_chains(text: str) -> tuple[int, ...]:
    """``"4/8"`` -> ``(4, 8)``, ``"none"`` -> ``()``: the planner's chains narrower than the engine's verify width
    (``Engine(plan_chains=...)``, ``infer.generate --plan-chains``, ``infer.bench --config LABEL:plan_chains=``).
    Raises ValueError naming the text (:func:`_parse_sizes`; the engine also refuses a width not below its
    ``verify_size``)."""
    return _parse_sizes(text, "plan_chains", "chain width", "4/8")


def plan_chains_flag(text: str, flag: str = "--plan-chains") -> tuple[int, ...]:
    """:func:`parse_plan_chains` of a command-line flag's value, its ValueError prefixed with the flag's name."""
    return _flag(parse_plan_chains, text, flag)


def plan_trees_flag(text: str, flag: str = "--plan-trees") -> tuple[int, ...]:
    """:func:`parse_plan_trees` of a command-line flag's value, its ValueError prefixed with the flag's name."""
    return _flag(parse_plan_trees, text, flag)


def parse_conf_slope(text: str) -> float | str:
    """``"auto"`` -> ``"auto"``, ``"0.5"`` -> ``0.5``: :class:`StepPlanner`'s ``conf_slope`` as the command lines take it
    (``infer.bench --config LABEL:conf_slope=``, ``planner_trace.py replay --conf-slope``). Raises ValueError naming the
    text for anything else or a number outside 0..SLOPE_MAX."""
    if text == "auto":
        return text
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and 0 <= x <= SLOPE_MAX):
        raise ValueError(f"conf_slope={text!r}; expected auto or a number in 0..{SLOPE_MAX:g}")
    return x


def _lead_rank(mode: Mode) -> tuple[bool, int]:
    """Order of the modes a lead is taken over (:meth:`StepPlanner.observe_paired`): chains below trees, each by
    size."""
    return (mode[0] == "tree", mode[1])


def max_tokens(mode: Mode, modes) -> int:
    """Most tokens one step of ``mode`` can commit per request: 1 (AR), ``n`` (chain of ``n``), or for a
    tree of ``n`` nodes ``min(n, longest chain among modes)`` (the tree's depth is the draft block's)."""
    kind, n = mode
    if kind == "ar":
        return 1
    chains = [m[1] for m in modes if m[0] == "chain"]
    return min(n, max(chains)) if kind == "tree" and chains else n


def best_mode(costs: dict[Mode, float], tokens: dict[Mode, float | None]) -> Mode | None:
    """Rule 1 of the module docstring: the mode with an estimate (AR always: 1 token) and the most tokens per
    millisecond, the cheaper of a tie; ``None`` when no mode has one. ``costs``, ``tokens``: as :func:`choose_mode`'s."""
    est = {m: 1.0 if m[0] == "ar" else tokens.get(m) for m in costs}
    known = [m for m in costs if est[m] is not None]
    return max(known, key=lambda m: (est[m] / costs[m], -costs[m])) if known else None


def choose_mode(
    costs: dict[Mode, float],
    tokens: dict[Mode, float | None],
    spent_ms: float,
    lost_ms: float,
    share: float = 0.005,
    warmup: float = 2.0,
    headroom: float = 2.0,
    gain: float = 2.0,
    settled: frozenset = frozenset(),
    rows: dict[Mode, float] | None = None,
    seen: dict[Mode, int] | None = None,
    ceilings: dict[Mode, float] | None = None,
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
        settled: modes never probed (their tokens are observed without running them: "Paired
            observations"); they run when they are the best mode.
        rows, seen: requests per observation and observations of each measured mode (``None``: 1 request,
            PRIOR_ROWS observations); its ceiling's headroom is ``1 + (headroom - 1) × min(1, max(1, √(PRIOR_ROWS /
            seen)) / √rows)`` (module docstring, rule 2): ``headroom`` at one request per step.
        ceilings: committed tokens per request a mode's step can reach, in place of the headroom rule's for the modes
            given (:class:`StepPlanner`'s led modes); still capped at :func:`max_tokens`.
    Returns:
        ``(mode, lost, rate)``: the mode to run, the milliseconds this step is expected to lose against
        the best mode (0 when it is the best mode) and the best mode's tokens per millisecond.
    """
    est = {m: 1.0 if m[0] == "ar" else tokens.get(m) for m in costs}
    best = best_mode(costs, tokens)
    if best is None:  # no AR in the table and nothing run yet: the cheapest mode first
        return min(costs, key=lambda m: costs[m]), 0.0, 0.0
    rate = est[best] / costs[best]
    known = [m for m in costs if est[m] is not None]
    spec = [est[m] for m in known if m[0] != "ar"]

    def ceiling(m: Mode) -> float:
        cap = max_tokens(m, costs)
        if ceilings and m in ceilings:
            return min(cap, ceilings[m])
        if est[m] is not None:
            r, n = max((rows or {}).get(m, 1.0), 1.0), max((seen or {}).get(m, PRIOR_ROWS), 1)
            narrow = min(1.0, max(1.0, math.sqrt(PRIOR_ROWS / n)) / math.sqrt(r))
            return min(cap, (1.0 + (headroom - 1.0) * narrow) * est[m])
        return min(cap, gain * max(spec)) if spec else cap

    plausible = [m for m in costs if m != best and m not in settled and ceiling(m) / costs[m] > rate]
    if not plausible:
        return best, 0.0, rate
    probe = min(plausible, key=lambda m: costs[m])
    loss = max(0.0, costs[probe] - (1.0 if est[probe] is None else est[probe]) / rate)
    allowance = share * spent_ms + min(spent_ms, warmup * min(costs.values()))
    if lost_ms + loss <= allowance:
        return probe, loss, rate
    return best, 0.0, rate


def drain_spread(drain) -> tuple[float, float, float, float]:
    """The batch's chain acceptance for the drain rule (module docstring, "Drain").

    Args:
        drain: one ``(remaining, chain_tokens, chain_steps, chain_tokens_sq)`` per request (:func:`drain_tokens`).
    Returns:
        ``(pooled, within, between, nbar)``: accepted draft tokens per chain step pooled over every request (0.0
        before any chain step); the within-request variance of one step's tokens, pooled over the requests with 2
        or more steps (a geometric's ``pooled × (1 + pooled)`` without any); the variance of the requests' mean
        acceptances less the part ``within / n_i`` explains (at least 0; 0.0 with no chain step); the mean chain
        steps per request that has any (0.0 if none).
    """
    steps = sum(d[2] for d in drain)
    pooled = sum(d[1] - d[2] for d in drain) / steps if steps else 0.0
    seen = [d for d in drain if d[2]]
    many = [d for d in seen if d[2] > 1]
    dof = sum(d[2] - 1 for d in many)
    within = sum(q - t * t / n for _, t, n, q in many) / dof if dof else pooled * (1 + pooled)
    between = (max(0.0, sum(((t - n) / n - pooled) ** 2 - within / n for _, t, n, _ in seen) / len(seen)) if seen
               else 0.0)
    return pooled, within, between, steps / len(seen) if seen else 0.0


def spread_weight(drain) -> float:
    """Weight of this batch's between-request variance against the prior (:func:`drain_tokens`): ``n̄ / (n̄ +
    SPREAD_STEPS) × (m − 1) / (m − 1 + PRIOR_ROWS)``, n̄ the mean chain steps of the m requests that have any: few
    steps per request make the estimate mostly noise, and one request's is 0 by construction (no evidence of no
    spread). ``drain`` as in :func:`drain_tokens`."""
    seen = [d[2] for d in drain if d[2]]
    m = len(seen)
    if m < 2:
        return 0.0
    nbar = sum(seen) / m
    return nbar / (nbar + SPREAD_STEPS) * (m - 1) / (m - 1 + PRIOR_ROWS)


def spread_variance(drain, between: float, prior) -> float:
    """The variance between requests :func:`drain_tokens` uses, tokens²: ``w × between + (1 − w) × prior``, w from
    :func:`spread_weight`, the prior term 0 without a finite prior ≥ 0; ``between`` from :func:`drain_spread`."""
    w = spread_weight(drain)
    return w * between + (1.0 - w) * (_finite_prior(prior) or 0.0)


def plan_log_path() -> str | None:
    """The file ``DSPINE_PLAN_LOG`` names (None: unset or empty), checked for appending without creating it: an
    existing file must be empty or a plan log (its first line a call record with a ``log``), so a results file named
    by mistake is not appended to. Raises ValueError naming the variable for a folder, a file that is not a plan
    log, or a path that cannot be appended to (its folder missing or not writable)."""
    path = os.environ.get("DSPINE_PLAN_LOG")
    if not path:
        return None
    if os.path.isdir(path):
        raise ValueError(f"DSPINE_PLAN_LOG={path}: a folder; give the path of a file to append to")
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                first = f.readline(1 << 20)
            rec = json.loads(first) if first.strip() else None
        except (OSError, UnicodeDecodeError, ValueError):
            rec = False
        if rec is False or (rec is not None and not (isinstance(rec, dict) and "log" in rec)):
            raise ValueError(f"DSPINE_PLAN_LOG={path}: an existing file that is not a plan log (its first line is "
                             "not a planner call record); give a new file or a plan log to append to")
        if not os.access(path, os.W_OK):
            raise ValueError(f"DSPINE_PLAN_LOG={path}: cannot append to it (not writable)")
        return path
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ValueError(f"DSPINE_PLAN_LOG={path}: cannot create it (no writable folder {parent})")
    return path


def append_plan_record(path: str, record: dict) -> None:
    """Append one call record (one JSON line) to the step log ``path``, starting it on a line of its own: a run
    killed while writing leaves a line without its end, and the next record glued to it would make both unreadable
    (``benchmarks/engine/plan_log.py`` names such a line by number)."""
    with open(path, "ab+") as f:
        f.seek(0, 2)
        torn = f.tell() > 0 and (f.seek(-1, 2), f.read(1))[1] != b"\n"
        f.write((("\n" if torn else "") + json.dumps(record, separators=(",", ":")) + "\n").encode())


def _sig(x: float | None) -> float | None:
    """``x`` rounded to 4 significant digits (None stays None): :meth:`StepPlanner.start_log`'s numbers."""
    return None if x is None else float(f"{x:.4g}")


def _finite_prior(prior) -> float | None:
    """``prior`` if it is a finite number ≥ 0, else ``None`` (a corrupted state is no prior)."""
    return float(prior) if prior is not None and math.isfinite(prior) and prior >= 0 else None


def persist_variance(persist: tuple[float, float], prior, pooled: float) -> float:
    """The variance between requests of drain model ``"persist"`` (tokens², before :func:`drain_tokens`' cap):
    ``w × max(cov, 0) + (1 − w) × prior × ā²``, ``(cov, w)`` from :func:`persistent_spread`, ``prior`` relative to
    ā² (the prior term 0 without a finite prior ≥ 0), ā = ``pooled``; :func:`spread_variance`'s twin. Raises
    ValueError for a covariance that is not finite or a weight outside 0..1."""
    cov, w = persist
    if not (math.isfinite(cov) and 0.0 <= w <= 1.0):
        raise ValueError(f"persist={persist!r}: expected (a finite covariance, a weight in 0..1), persistent_spread's")
    return w * max(cov, 0.0) + (1.0 - w) * (_finite_prior(prior) or 0.0) * pooled**2


def persistent_spread(drain, snaps: dict[int, tuple[float, float]], early: int = PERSIST_EARLY) -> tuple[float, float]:
    """The spread between requests that persists through their answers, for drain model ``"persist"``.

    The drain rule takes a request's acceptance so far as its own for the rest of its answer. Acceptance comes in
    bursts longer than a step, so over a short window the requests' means spread more than the noise of independent
    steps explains, and little of it persists (docs/planner.md, "Drain"). The covariance across requests of a request's early mean and its later mean measures the
    persistent part without a noise model (the two windows' noise is independent).

    Args:
        drain: one ``(remaining, chain_tokens, chain_steps, chain_tokens_sq)`` per slot, as for :func:`drain_tokens`,
            every slot in slot order at every refresh of one call (the engine gives an idle slot's as zeros): a
            request is matched to its snapshot by its position.
        snaps: per index of ``drain``, its request's ``(chain_tokens, chain_steps)`` at the first refresh where it had
            ``early`` chain steps or more; updated in place (a request whose steps fell below its snapshot's was
            replaced: its snapshot is dropped).
        early: chain steps of the early window, and the least of the later one.
    Returns:
        ``(cov, weight)``: the covariance (tokens², population form; may be negative) of the early and later mean
        accepted draft tokens per chain step over the requests with both windows, and the weight it gets against the
        prior, ``n̄ / (n̄ + SPREAD_STEPS) × (m − 1) / (m − 1 + PRIOR_ROWS)`` with m such requests and n̄ their mean
        later steps (as :func:`spread_weight`); ``(0.0, 0.0)`` with fewer than two. Raises ValueError if ``early``
        is below 1.
    """
    if not early >= 1:
        raise ValueError(f"early={early!r}: a window needs at least 1 chain step")
    for i in [i for i in snaps if i >= len(drain)]:  # a shorter list: those slots are gone
        del snaps[i]
    for i, d in enumerate(drain):
        snap = snaps.get(i)
        if snap is not None and d[2] < snap[1]:
            del snaps[i]
            snap = None
        if snap is None and d[2] >= early:
            snaps[i] = (float(d[1]), float(d[2]))
    pairs = []
    for i, (t0, n0) in snaps.items():
        if i < len(drain) and drain[i][2] - n0 >= early:
            t, n = drain[i][1], drain[i][2]
            pairs.append(((t0 - n0) / n0, ((t - t0) - (n - n0)) / (n - n0), n - n0))
    m = len(pairs)
    if m < 2:
        return 0.0, 0.0
    e_mean = sum(p[0] for p in pairs) / m
    l_mean = sum(p[1] for p in pairs) / m
    cov = sum((p[0] - e_mean) * (p[1] - l_mean) for p in pairs) / m
    nbar = sum(p[2] for p in pairs) / m
    return cov, nbar / (nbar + SPREAD_STEPS) * (m - 1) / (m - 1 + PRIOR_ROWS)


def drain_tokens(
    tokens: dict[Mode, float | None], drain, modes, prior: float | None = None,
    own: bool = False,
    persist: tuple[float, float] | None = None,
    stats: tuple[float, float, float, float] | None = None,
) -> dict[Mode, float | None]:
    """Token estimates for the drain rule (module docstring, "Drain"): each speculative mode's ``tokens`` mapped
    to the AR-equivalent tokens per step of the request that would finish last under it.

    Args:
        tokens: committed tokens per request per step of each mode (``None``: unknown), the batch's estimate.
        drain: one ``(remaining, chain_tokens, chain_steps, chain_tokens_sq)`` per request in the batch: the
            tokens it may still commit (``max_new_tokens`` − committed; 0 or less once finished), and the sum,
            count and sum of squares of the tokens its chain(-equivalent) steps committed.
        modes: the cost table's modes (:func:`max_tokens`).
        prior: the variance between requests' mean accepted draft tokens per chain step, learned on earlier
            requests (:attr:`StepPlanner.spread`); ``None``: only this batch's.
        own: the drain model ``"own"``: ``ā`` in ``τ_i(m)`` below is the longest chain's ``tokens`` − 1 where that is
            above 0 (the chain commits ``1 + a_i`` for request i), not the pooled acceptance.
        persist: the drain model ``"persist"``: ``(cov, w)`` of :func:`persistent_spread`; the variance between
            requests is then :func:`persist_variance`'s, ``w × max(cov, 0) + (1 − w) × prior × ā²`` (``prior``
            relative to ā², as :attr:`StepPlanner.spread` carries it under this model) instead of the one below, with
            the same cap.
            Raises ValueError for a covariance that is not finite or a weight outside 0..1.
        stats: :func:`drain_spread` of ``drain`` where the caller has it already (None: computed here).
    Returns:
        ``R / y(m)`` per mode, clipped to [1, max_tokens]: R the largest remaining of the live requests (remaining
        > 0), ``y(m)`` the median of the number of steps the last of them needs under mode m. AR's 1 stays 1;
        with equal requests and no prior (or a prior of 0) a mode keeps its ``tokens``. Request i commits
        ``τ_i(m) = 1 + (tokens[m] − 1) × a_i / ā`` per step of a chain or a tree, clipped to [1, max_tokens]: every
        speculative mode scaled alike, so the spread moves the choice between AR and the speculative modes, not
        among them (docs/planner.md, "Drain"); ā is the accepted draft tokens per chain step pooled over every request of the batch,
        finished ones included (:func:`drain_spread`: once the easy requests are done, the estimate they raised
        is scaled down for the hard ones left), or before any chain step with a ``prior`` the longest chain's
        ``tokens`` − 1. a_i is unknown: normal with the empirical Bayes posterior of a normal-normal model, mean
        ``â_i = ā + k_i (mean_i − ā)`` and variance ``v (1 − k_i)``, ``k_i = v / (v + s² / n_i)`` (n_i its chain
        steps, s² the within-request variance, v the variance between requests: ``w × this batch's estimate +
        (1 − w) × prior``, w from :func:`spread_weight`, the prior term 0 without a prior (or with a prior that
        is not a finite number ≥ 0): over a few steps per request the batch's estimate is mostly noise, and
        trusted at once it would make 64 equal requests look spread; at most ``(SPREAD_CV × ā)²``, docs/planner.md,
        "Constants"). ``y(m)`` solves ``Π_i P(remaining_i / τ_i(m) ≤ y) =
        1/2`` over the live requests, taken as independent: one request's median, the largest of known ones, and
        for L equal requests of spread σ the median of their maximum (Φ⁻¹(2^(−1/L)), 2.30 σ beyond the mean at
        L = 64; its mean is 2.34 σ); a request sure to finish early does not count. Requests that differ only by
        chance are not told apart, and a spread the steps cannot show yet (a prior) still makes the slowest of L
        requests slower than the mean. Unchanged with no live request, no chain step and no prior, no chain
        estimate with a prior, or ā ≤ 0.
    """
    live = [d for d in drain if d[0] > 0]
    prior = _finite_prior(prior)
    pooled, within, between, nbar = drain_spread(drain) if stats is None else stats
    chains = [m for m in tokens if m[0] == "chain" and tokens[m] is not None]
    ref = max(chains, key=lambda m: m[1]) if chains else None  # the pooled acceptance before any chain step
    if not nbar and prior is not None and ref is not None:
        pooled, within = tokens[ref] - 1.0, (tokens[ref] - 1.0) * tokens[ref]
    if not live or not pooled > 0:
        return dict(tokens)
    unit = tokens[ref] - 1.0 if own and ref is not None and tokens[ref] > 1.0 else pooled  # ā of τ_i(m)
    if persist is not None:
        v = persist_variance(persist, prior, pooled)
    else:
        v = spread_variance(drain, between, prior)
    v = min(v, (SPREAD_CV * pooled) ** 2)
    rem = np.array([float(d[0]) for d in live])
    n = np.array([float(d[2]) for d in live])
    mean = np.array([(d[1] - d[2]) / d[2] if d[2] else pooled for d in live])
    k = np.where(n > 0, v / (v + within / np.maximum(n, 1e-9)), 0.0) if v > 0 else np.zeros_like(n)
    ahat = pooled + k * (mean - pooled)
    sd = np.sqrt(np.maximum(v * (1.0 - k), 0.0))
    R = float(rem.max())
    out = dict(tokens)
    # (mode, tokens, cap) of the modes whose τ_i depends on a_i with more than one request:
    # τ_i = clip(1 + (tokens − 1) a_i / ā, 1, cap)
    grid = []
    for m, x in tokens.items():
        if x is None or m[0] == "ar":
            continue
        cap = float(max_tokens(m, modes))
        if not x > 1.0 or len(live) == 1:  # τ the same for every request, or one request: R / τ(its median)
            a = float(ahat[0]) if x > 1.0 else 0.0
            out[m] = min(max(1.0 + (x - 1.0) * a / unit, 1.0), cap)
        else:
            grid.append((m, x, cap))
    if grid:
        ms, base, cap = (list(x) for x in zip(*grid))
        steps = _median_last_finish(rem, ahat, sd, unit, np.array(base), np.array(cap))
        out.update({m: min(max(R / y, 1.0), c) for m, y, c in zip(ms, steps.tolist(), cap)})
    return out


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    """Φ(z) through erfc's Chebyshev fit (Press et al., *Numerical Recipes in C*, 2nd ed., §6.2, erfcc:
    fractional error below 1.2e-7). numpy, not torch: element-wise numpy never enters a thread pool, and a
    torch op on CPU tensors can (the planner runs on the engine's launching thread)."""
    x = np.abs(z) * (1.0 / math.sqrt(2.0))
    t = 1.0 / (1.0 + 0.5 * x)
    poly = 0.17087277
    for c in (-0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806, 0.09678418, 0.37409196, 1.00002368,
              -1.26551223):  # fmt: skip
        poly = c + t * poly
    tail = 0.5 * t * np.exp(-x * x + poly)  # Φ(-|z|)
    return np.where(z < 0, tail, 1.0 - tail)


def _median_last_finish(rem, ahat, sd, pooled, base, cap, grid=16, rounds=5) -> np.ndarray:
    """Per mode j, ``y_j`` with ``Π_i P(rem_i / τ_ij ≤ y_j) = 1/2`` (:func:`drain_tokens`), ``τ_ij = clip(1 +
    (base_j − 1) a_i / pooled, 1, cap_j)`` (``base_j > 1``), ``a_i ~ N(ahat_i, sd_i²)`` (``sd_i = 0``: known).
    Σ_i log P(finished by y) rises with y from −∞ at 0 to 0 at ``max(rem)``; ``rounds`` of a ``grid``-point search,
    each inside the bracket of the last (``max(rem) / grid^rounds`` wide at the end), all modes at once. ``rem``,
    ``ahat``, ``sd``: float64 ``[L]``; ``base``, ``cap``: float64 ``[M]``. Returns float64 ``[M]``."""
    base, cap = base[:, None, None], cap[:, None, None]  # [M, 1, 1]
    slope = pooled / (base - 1.0)  # accepted tokens per unit of τ above 1
    sd = np.maximum(sd, 1e-12)  # a known a_i: Φ of ±1e12 σ is its indicator
    lo = np.zeros((base.shape[0], 1, 1))
    width = np.full_like(lo, float(rem.max()))
    frac = (np.arange(1, grid + 1, dtype=np.float64) / grid)[None, :, None]  # [1, G, 1]
    half = -math.log(2.0)
    with np.errstate(divide="ignore"):
        for _ in range(rounds):
            u = rem / (lo + width * frac)  # [M, G, L]: the τ request i needs to finish within y steps
            late = _normal_cdf(((u - 1.0) * slope - ahat) / sd)  # P(τ_i < u) = P(a_i < a*)
            late = np.where(u <= 1.0, 0.0, np.where(u > cap, 1.0, late))
            below = (np.log1p(-late).sum(axis=2, keepdims=True) < half).sum(axis=1, keepdims=True)
            width = width / grid
            lo = lo + below * width  # grid points where the last request is more likely than not still running
    return np.maximum((lo + width / 2).ravel(), 1e-9)


class StepPlanner:
    """Chooses one mode per engine step (module docstring).

    Args:
        costs: start-up step milliseconds per mode at this batch size (> 0).
        decay: least weight of the newest observation in a mode's fast moving average of tokens.
        slow: least weight of the newest observation in a mode's slow moving average of tokens.
        share, warmup, headroom, gain: the probing rule of :func:`choose_mode`.
        cost_decay: least weight of the newest measured ÷ table step time (online cost).
        cal_decay: least weight of the newest predicted / realized accepted tokens (calibration).
        drain_model: :data:`DRAIN_MODELS`: ``"persist"`` (the default: :func:`drain_tokens`' ``persist``, from
            :func:`persistent_spread` over the drain refreshes; the spread carried relative to the pooled acceptance
            squared), ``"scaled"`` (the default before: every speculative mode scaled alike, the spread carried in
            tokens²), ``"own"`` (its ``own``; no confidence under the drain rule) or ``"persist_cap"`` (opt-in:
            ``"persist"`` with the carried spread capped at ``DEFAULT_SPREAD_REL`` in :meth:`load_token_state`).
        conf_slope: ``"auto"`` or a number in [0, ``SLOPE_MAX``]: how far the confidence moves an estimate (module
            docstring, "Calibration"; :meth:`slope`).
        state: :data:`PLAN_STATES`: ``"steps"`` (the default), ``"kv"`` (a KV-length step-time term: :meth:`choose` and
            :meth:`observe` then take ``kv``) or ``"rows_kv"`` (that and row-weighted averages): module docstring, "State".
    Raises ValueError on an empty cost table or one with a step time that is not a positive finite number, an
    unknown drain model or state or a conf_slope that is neither ``"auto"`` nor a number in [0, ``SLOPE_MAX``].
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
        cost_decay: float = 0.1,
        cal_decay: float = 0.05,
        drain_model: str = "persist",
        conf_slope: float | str = "auto",
        state: str = "steps",
    ):
        if not costs or not all(isinstance(c, (int, float)) and math.isfinite(c) and c > 0 for c in costs.values()):
            raise ValueError(f"planner costs must be a non-empty table of positive finite step times, got {costs}")
        if drain_model not in DRAIN_MODELS:
            raise ValueError(f"drain_model={drain_model!r}; expected one of {', '.join(DRAIN_MODELS)}")
        if conf_slope != "auto" and not (
            isinstance(conf_slope, (int, float)) and math.isfinite(conf_slope) and 0 <= conf_slope <= SLOPE_MAX
        ):
            raise ValueError(f"conf_slope={conf_slope!r}; expected 'auto' or a number in 0..{SLOPE_MAX}")
        if state not in PLAN_STATES:
            raise ValueError(f"state={state!r}; expected one of {', '.join(PLAN_STATES)}")
        self.conf_slope, self.state = conf_slope, state
        # "kv", "rows_kv": the most live requests of a step (R), the requests behind each slow average (("slow" | "lead",
        # mode) -> W: _weight), the context tokens at the coming step, and the KV-length fit: per mode the tokens behind
        # its ratio ("ref"), its timed steps' mean tokens and ms ("x", "t"; counts "n"), the pooled within-mode moments
        # and means over "steps" timed steps (kv_slope)
        self.rows_max, self.weight, self.kv = 1, {}, None
        self.kv_fit = {"ref": {}, "x": {}, "t": {}, "n": Counter(), "sxx": 0.0, "sxy": 0.0, "xbar": 0.0, "tbar": 0.0,
                       "steps": 0}
        # a fixed cycle of modes that choose() runs instead of deciding (benchmarks/engine/bench_planner_loop.py
        # --switch: what switching modes costs the loop); observations are still recorded; None: decide
        self.schedule: list[Mode] | None = None
        self.drain_model = drain_model
        self.table, self.decay, self.slow_decay = dict(costs), decay, slow
        self.cost_decay, self.cal_decay = cost_decay, cal_decay
        self.rule = dict(share=share, warmup=warmup, headroom=headroom, gain=gain)
        self.fast: dict[Mode, float | None] = {m: 1.0 if m[0] == "ar" else None for m in costs}
        self.slow: dict[Mode, float | None] = dict(self.fast)
        self.seen: Counter = Counter()  # token observations per mode
        self.rows: dict[Mode, float] = {m: 1.0 for m in costs}  # requests per observation, slow average
        self.last_seen: dict[Mode, int] = {m: 0 for m in costs}  # step of the latest observation
        self.ratio: dict[Mode, float | None] = {m: None for m in costs}  # measured ÷ table step time
        self.timed: Counter = Counter()  # step-time observations per mode
        # this planner's own timed steps per mode and the sum of their times as measured (before clipping; timed counts
        # those of earlier planners too, load_cost_state): report()'s mean step time
        self.timed_steps: Counter = Counter()
        self.timed_ms: Counter = Counter()
        self.first: dict[Mode, list[float]] = {m: [] for m in costs}  # prior ratio + the first 3 measured
        self.pred: dict[Mode, float | None] = {m: None for m in costs}  # mean predicted accepted tokens
        self.real: dict[Mode, float | None] = {m: None for m in costs}  # mean realized, same steps
        self.calibrated: Counter = Counter()  # steps with a prediction per mode
        # conf_slope="auto" (module docstring, "Calibration"): moving averages of the proportional rule's move z² and
        # of z × the realized surprise, over the steps recorded with a prediction and an estimate, and their count
        self.pred_var: dict[Mode, float] = {m: 0.0 for m in costs}
        self.pred_cov: dict[Mode, float] = {m: 0.0 for m in costs}
        self.slope_steps: Counter = Counter()
        self.choices: Counter = Counter()
        # per mode, the steps observed and the sum of their committed tokens per request (what the mode realized in
        # the steps the planner chose it for, against its fixed runs' τ: report())
        self.observed: Counter = Counter()
        self.realized: Counter = Counter()
        self.paired: Counter = Counter()  # paired observations per mode (observe_paired)
        self.last_predicted: float | None = None  # the confidence given with the step observed last
        self.last_observed: tuple[Mode, float] = (("ar", 1), 1.0)  # the step observed last: mode, tokens
        # the paired observations of the step observed last, mode -> tokens (a smaller tree's lead over the chain on
        # the same step: module docstring, "Paired observations")
        self.paired_now: dict[Mode, float] = {}
        # run mode -> (paired mode, slow average of the run mode's tokens minus the paired mode's on the same
        # steps): module docstring, "Paired observations"
        self.lead: dict[Mode, tuple[Mode, float]] = {}
        self.lead_steps: Counter = Counter()  # paired steps behind each lead
        self.lead_sq: dict[Mode, float] = {}  # slow average of the squared differences behind each lead
        self.untimed = 0  # steps observed without a time
        self.drain_choices: Counter = Counter()  # choices made under the drain rule, per mode
        self.drain_scale: dict[Mode, float] | None = None  # drain tokens ÷ estimate per mode (choose's drain)
        # variance between requests' accepted draft tokens per chain step: drain_tokens' prior, from an earlier
        # call (load_token_state), and the one its latest drain with a chain step used (this batch's estimate weighted
        # with the prior as in drain_tokens), which token_state carries on
        # (drain model "persist": relative to the pooled acceptance squared; its early windows per request,
        # persistent_spread)
        self.spread_prior: float | None = self._default_spread()
        self.spread: float | None = None
        self.persist_snaps: dict[int, tuple[float, float]] = {}
        # an optional per-step log (None: off; :meth:`start_log`), for diagnosing a decode after the fact
        self.log: list | None = None
        self.step = 0
        self.spent_ms = 0.0  # step time of the modes run (measured where given, else estimated)
        self.lost_ms = 0.0  # time lost to probes against the best mode (negative: probes gained)
        # choices not yet observed, oldest first (the engine observes a step one step late, after it has
        # chosen the next): mode, its estimated ms, its predicted tokens, its probe (charged loss, best rate, the
        # drain rule's tokens ÷ the mode's estimate when chosen)
        # (at most PENDING kept: a caller that never observes does not grow it)
        self.pending: deque[tuple[Mode, float, float | None, tuple[float, float, float] | None]] = deque(maxlen=PENDING)

    @property
    def costs(self) -> dict[Mode, float]:
        """Estimated step milliseconds per mode: table × the mode's measured ratio, or for a mode never timed × the
        ratio of the timed mode nearest in table time (the table itself before any timing)."""
        timed = [m for m in self.table if self.ratio[m] is not None]
        slope = self.kv_slope if self.kv is not None else 0.0  # ("kv", "rows_kv": module docstring, "State")
        out = {}
        for m, t in self.table.items():
            near = (m if self.ratio[m] is not None
                    else min(timed, key=lambda k: abs(math.log(self.table[k] / t)), default=None))
            out[m] = t * (self.ratio[near] if near is not None else 1.0)
            ref = self.kv_fit["ref"].get(near)
            if self.kv is not None and ref is not None:
                out[m] = max(out[m] + slope * (self.kv - ref), out[m] / 2)
        return out

    @property
    def kv_slope(self) -> float:
        """Milliseconds of step time per context token of the live requests (module docstring, "State"): the pooled
        within-mode covariance of step time and context tokens over their variance plus ``(KV_SHRINK × mean)²``,
        clipped to [0, mean ms ÷ mean tokens]; 0 before ``KV_MIN_STEPS`` timed steps with a context length."""
        f = self.kv_fit
        if f["steps"] < KV_MIN_STEPS or f["xbar"] <= 0:
            return 0.0
        return min(max(f["sxy"] / (f["sxx"] + (KV_SHRINK * f["xbar"]) ** 2), 0.0), f["tbar"] / f["xbar"])

    def _fit_kv(self, mode: Mode, kv: float, ms: float) -> None:
        """One timed step of ``mode`` at ``kv`` context tokens into the KV-length fit (:attr:`kv_slope`) and into the
        mode's reference tokens (the first ``FIRST_TIMED`` timings' mean, then the ratio's moving-average weight)."""
        f, n = self.kv_fit, self.timed[mode]
        ref = f["ref"].get(mode)
        f["ref"][mode] = kv if ref is None or n == 1 else ref + (1 / n if n <= FIRST_TIMED else self.cost_decay) * (kv - ref)
        k = f["n"][mode] = f["n"][mode] + 1
        if k > 1:  # deviations from the mode's own averages before this step
            dx, dt = kv - f["x"][mode], ms - f["t"][mode]
            f["steps"] += 1
            w = max(KV_DECAY, 1 / f["steps"])
            for key, v in (("sxx", dx * dx), ("sxy", dx * dt), ("xbar", kv), ("tbar", ms)):
                f[key] += w * (v - f[key])
        w = max(KV_DECAY, 1 / k)
        for key, v in (("x", kv), ("t", ms)):
            f[key][mode] = v if k == 1 else f[key][mode] + w * (v - f[key][mode])

    def _weight(self, key: tuple, rows: int, n: int) -> float:
        """Weight of the newest step in the slow average ``key`` (its ``n``-th step, ``rows`` live requests):
        ``max(slow, 1 / n)`` under states ``"steps"`` and ``"kv"``; under ``"rows_kv"`` ``max(1 − (1 − slow)^(rows / R),
        rows / W)``, W the requests of its steps so far (module docstring, "State"; n = 1 starts it afresh; an average
        loaded without W counts its steps as ``min(n − 1, 1 / slow)`` of R requests): the same weights while every step
        has R requests."""
        if self.state != "rows_kv":
            return max(self.slow_decay, 1.0 / n)
        r = max(rows, 1)
        w = 0.0 if n == 1 else self.weight.get(key, min(n - 1, 1 / self.slow_decay) * self.rows_max)
        w = self.weight[key] = w + r
        return max(1 - (1 - self.slow_decay) ** (r / self.rows_max), r / w)

    def calibration(self, mode: Mode) -> float | None:
        """Realized ÷ predicted accepted tokens of ``mode`` (``None``: no prediction or none accepted)."""
        if not self.calibrated[mode] or self.pred[mode] <= 0:
            return None
        return self.real[mode] / self.pred[mode]

    @property
    def tokens(self) -> dict[Mode, float | None]:
        """Expected committed tokens per request per step of each mode (``None``: never run): the fast
        average, relaxing towards the slow one plus its standard error by ``1 - decay`` per step the mode
        is not run (module docstring, "Averages"); for a mode with a lead over a paired mode, that mode's
        estimate + the lead ("Paired observations")."""
        out = {m: self._own_tokens(m) for m in self.fast}
        # the paired mode's estimate now plus this mode's average lead over it (module docstring, "Paired
        # observations"): the passage is read from both modes' steps
        return self._with_leads(out)

    def _long_run(self, m: Mode, path: tuple = ()) -> float | None:
        """``m``'s long-run tokens per request per step: 1 for AR, the slow average for a mode run or paired, a led
        mode's paired mode's long run plus the lead (clipped as in :meth:`_with_leads`); ``None`` before any. No
        confidence, no fast average, no bonus: what a probe is settled against (module docstring, rule 3)."""
        if m[0] == "ar":
            return 1.0
        if m in self.lead and m not in path:
            ref, lead = self.lead[m]
            r = self._long_run(ref, path + (m,)) if ref in self.table else None
            if r is not None:
                return min(max(r + lead, 1.0), float(max_tokens(m, self.table)))
        return self.slow[m]

    def _own_tokens(self, m: Mode) -> float | None:
        """:attr:`tokens` of ``m`` from its own averages alone (no lead over a paired mode)."""
        f = self.fast[m]
        if f is None or m[0] == "ar":
            return f
        n = min(self.seen[m], 2.0 / self.slow_decay - 1)  # effective samples of the slow average
        target = self.slow[m] + math.sqrt(BONUS_VAR / (n * self.rows[m]))
        keep = (1 - self.decay) ** (self.step - self.last_seen[m])
        return target + keep * (f - target)

    def _with_leads(self, est: dict[Mode, float | None]) -> dict[Mode, float | None]:
        """``est`` with every mode that has a lead over a paired mode set to that mode's value in the result (itself
        resolved first when it has a lead too; a cycle stops at the mode met twice) plus the lead, clipped to
        [1, :func:`max_tokens`]; a mode whose paired mode has no value keeps its own."""
        out: dict[Mode, float | None] = {}

        def value(m: Mode, path: tuple) -> float | None:
            if m not in out:
                out[m] = est[m]
                if m in self.lead and m not in path:
                    ref, lead = self.lead[m]
                    r = value(ref, path + (m,)) if ref in est else None
                    if r is not None:
                        out[m] = min(max(r + lead, 1.0), float(max_tokens(m, self.table)))
            return out[m]

        for m in est:
            value(m, ())
        return {m: out[m] for m in est}

    def expected(self, predicted: dict[Mode, float] | None = None) -> dict[Mode, float | None]:
        """:attr:`tokens`, scaled by this step's confidence (module docstring, "Calibration"); a prediction that is
        not a finite number is ignored."""
        out = self.tokens
        led = {m for m in self.lead if self.lead[m][0] in out and out.get(self.lead[m][0]) is not None}
        for m, x in (predicted or {}).items():
            if (m[0] != "ar" and m not in led and out.get(m) is not None and self.calibrated[m] and self.pred[m] > 0
                    and isinstance(x, (int, float)) and math.isfinite(x)):
                rel = min(max((x - 1.0) / self.pred[m], 1 / 3), 3.0)
                rel = 1.0 + self.slope(m) * (rel - 1.0)
                out[m] = min(max(1.0 + (out[m] - 1.0) * rel, 1.0), float(max_tokens(m, self.table)))
        # a led mode: its paired mode's estimate this step plus the lead (module docstring, "Calibration")
        return self._with_leads(out)

    def drafting_pays(self) -> bool:
        """Whether a speculative mode's estimated rate (:meth:`expected` tokens, no confidence and no drain, ÷ its
        step time) beats AR's: False when AR's is the best, or no speculative mode has an estimate yet (then the
        rules run AR until a probe). The engine's admissions defer the draft's prompt context while it is False
        (``Engine.plan_defer_prompt``)."""
        costs, est = self.costs, self.expected()
        ar = [m for m in costs if m[0] == "ar"]
        if not ar:
            return True
        return any(x is not None and x / costs[m] > 1.0 / costs[ar[0]] for m, x in est.items() if m[0] != "ar")

    def slope(self, mode: Mode) -> float:
        """How far this step's confidence moves ``mode``'s estimate (module docstring, "Calibration"): 1 moves it in
        proportion (the estimate ``1 + (T - 1) × (x - 1) / P``), 0 not at all. ``conf_slope="auto"``: the
        least-squares slope through the origin of the realized surprise ``(committed - 1) - (T - 1)`` on the
        proportional rule's move ``z = (T - 1)(ρ - 1)``, ``Σ z·surprise / Σ z²`` over the moving averages' k effective
        steps, with a prior of ``SLOPE_PRIOR`` steps at slope 1: ``(k·E[z·surprise] + λ) / (k·E[z²] + λ)``,
        λ = SLOPE_PRIOR × max(E[z²], SLOPE_MOVE2), clipped to [0, SLOPE_MAX]. With the confidence moving by at least
        ``√SLOPE_MOVE2`` tokens that is ``(k·fit + SLOPE_PRIOR) / (k + SLOPE_PRIOR)``, the fit shrunk by steps (a mode
        seldom run, such as probes where AR wins, keeps a slope near 1); where it barely moves, the prior's weight
        does not shrink with the moves, so noise cannot drive the slope to 0 or SLOPE_MAX. A number: that slope."""
        if self.conf_slope != "auto":
            return float(self.conf_slope)
        n = self.slope_steps[mode]
        if n < 2:  # one step fits nothing
            return 1.0
        k = min(n, 2.0 / self.cal_decay - 1)  # effective samples of the moving averages
        lam = SLOPE_PRIOR * max(SLOPE_MOVE2, self.pred_var[mode])
        return min(max((k * self.pred_cov[mode] + lam) / (k * self.pred_var[mode] + lam), 0.0), SLOPE_MAX)

    def rate(self, mode: Mode) -> float | None:
        """Expected committed tokens per request per estimated millisecond, ``None`` before the first run."""
        tok = self.tokens[mode]
        return None if tok is None else tok / self.costs[mode]

    def choose(self, predicted: dict[Mode, float] | None = None, drain=None, kv: float | None = None) -> Mode:
        """The mode for this step. ``predicted``: optional confidence, committed tokens per request per
        speculative mode this step would commit (bonus included), calibrated online. ``drain``: no request
        waiting to be admitted, one ``(remaining tokens, chain tokens, chain steps, chain tokens²)`` per request
        of the batch (:func:`drain_tokens`): the modes are compared on the time to finish the last live one (module
        docstring, "Drain"); it stays in force, as each mode's drain tokens ÷ its estimate, until the next
        ``drain`` (the engine gives one every ``PLAN_DRAIN_EVERY`` steps: the ratios move slowly, and mapping a
        batch of 64 requests costs about 1 ms of host time on a 2-core CPU, :func:`drain_tokens`) or
        :meth:`end_drain`. None before any: tokens per
        millisecond. ``kv``: the live requests' context tokens now (states ``"kv"``, ``"rows_kv"``: module docstring,
        "State")."""
        self.kv = kv if self.state != "steps" else None
        costs = self.costs
        if self.schedule:  # a fixed cycle of modes (benchmarks: the loop's cost of switching modes), no decision
            mode = self.schedule[self.step % len(self.schedule)]
            if self.log is not None:
                self._log_choice(mode, 0.0, costs, None)
            return self._commit(mode, costs, predicted, 0.0, None, 1.0)
        raw = None  # this step's token estimates, computed once
        # drain model "own": no confidence while the drain rule is in force (module docstring, "Drain")
        own = self.drain_model == "own"
        conf = None if own and (drain is not None or self.drain_scale is not None) else predicted
        if drain is not None and self.log is not None:
            self.log.append(["d", self.step, [[d[0], d[1], d[2], d[3]] for d in drain]])
        if drain is not None:
            raw = self.expected(conf)
            persist = (persistent_spread(drain, self.persist_snaps, PERSIST_EARLY) if self.drain_model in PERSIST_MODELS
                       else None)
            stats = drain_spread(drain)  # once a refresh: drain_tokens takes it too
            mapped = drain_tokens(raw, drain, self.table, self.spread_prior, own, persist, stats)
            pooled, _, between, nbar = stats
            if nbar and pooled > 0 and persist is not None:  # relative to ā², as drain_tokens took the prior
                self.spread = persist_variance(persist, self.spread_prior, pooled) / pooled**2
            elif nbar and pooled > 0:  # the spread drain_tokens used (before its cap), for later batches
                self.spread = spread_variance(drain, between, self.spread_prior)
            # one factor for every speculative mode: that of the mode whose mapped drain rate is the highest. The
            # drain decides between AR and speculation; among the speculative modes the throughput rule's order
            # stands (module docstring, "Drain")
            spec = {m: x for m, x in raw.items() if x and m[0] != "ar"}
            ref = max(spec, key=lambda m: mapped[m] / costs[m], default=None)
            self.drain_scale = {m: mapped[ref] / spec[ref] for m in spec} if ref is not None else {}
        timed = [m for m in self.table if self.timed[m]]
        # nothing timed yet and a step in flight (a pipelined caller): the decode's first mode again, until it is
        # timed or FIRST_TIMED steps came back without a time (a caller that never times: table only)
        if not timed and self.pending and self.untimed < FIRST_TIMED:
            timed = [self.pending[0][0]]
        scale = 1.0
        tokens = None
        if len(timed) == 1 and self.timed[timed[0]] < FIRST_TIMED:  # the decode's first mode: 3 timings first
            mode, loss, rate = timed[0], 0.0, None
        else:
            # a probe not yet observed: no second one before its result is in (the engine chooses a step before
            # it observes the previous one), so this step exploits
            probing = any(e[3] is not None for e in self.pending)
            # a mode paired within the last steps and timed once is not probed: its tokens are being observed
            settled = frozenset(m for m in self.table
                                if self.paired[m] and self.timed[m] and self.step - self.last_seen[m] <= PAIRED_FRESH)
            tokens = raw = self.expected(conf) if raw is None else raw
            if self.drain_scale is not None:
                tokens = {m: x * self.drain_scale.get(m, 1.0) if x is not None and m[0] != "ar" else x
                          for m, x in raw.items()}
            # (rows: the drain rule's tokens are one request's, the slowest: no mean over the batch's requests)
            mode, loss, rate = choose_mode(costs, tokens, self.spent_ms, math.inf if probing else self.lost_ms,
                                           **self.rule, settled=settled, seen=self.seen,
                                           rows=self.rows if self.drain_scale is None else None,
                                           ceilings=self._lead_ceilings(tokens))
            if self.drain_scale is not None:
                self.drain_choices[mode] += 1
                # a probe is settled in the same terms: its tokens as the drain rule counts them
                if raw.get(mode):
                    scale = tokens[mode] / raw[mode]
            if loss > 0:  # module docstring, rule 3: settled at the best mode's long run
                best = best_mode(costs, tokens)
                long_run = self._long_run(best)
                if long_run is not None:
                    factor = self.drain_scale.get(best, 1.0) if self.drain_scale is not None else 1.0
                    rate = max(rate, factor * long_run / costs[best])
        if self.log is not None:
            self._log_choice(mode, loss, costs, tokens, raw if tokens is not None else None, conf)
        return self._commit(mode, costs, predicted, loss, rate, scale)

    def _lead_ceilings(self, tokens: dict[Mode, float | None]) -> dict[Mode, float]:
        """A led mode's probing ceiling (module docstring, rule 2): per led mode with a :meth:`lead_se`, its estimate
        in ``tokens`` plus ``LEAD_Z`` standard errors (× the drain rule's factor while it is in force); a mode without
        one is left to :func:`choose_mode`'s headroom rule."""
        out = {}
        for m in self.lead:
            se = self.lead_se(m) if tokens.get(m) is not None else None
            if se is not None:
                factor = self.drain_scale.get(m, 1.0) if self.drain_scale is not None else 1.0
                out[m] = tokens[m] + LEAD_Z * se * factor
        return out

    def _commit(self, mode: Mode, costs: dict, predicted, loss: float, rate, scale: float) -> Mode:
        """Book the choice of ``mode`` (its estimated time, a probe's expected loss) and keep it pending until
        :meth:`observe`; returns ``mode``."""
        self.step += 1
        self.spent_ms += costs[mode]
        self.lost_ms += loss
        # a probe is charged what it is expected to lose; observe() settles the charge with what it committed
        probe = (loss, rate, scale) if loss > 0 else None
        self.pending.append((mode, costs[mode], (predicted or {}).get(mode), probe))
        self.choices[mode] += 1
        return mode

    def start_log(self) -> None:
        """Keep a per-step log in :attr:`log` from now on: the modes in table order (``self.log[0]``, as
        ``"kind:size"``) and then one entry per event, all numbers rounded to 4 significant digits (a choice's
        estimates and confidence when written: :meth:`logged`):

        * a choice ``["c", step, mode index, drain, probe, rates, estimates, confidence]``: ``drain`` 1 under the
          drain rule, ``probe`` the milliseconds it was expected to lose (0: exploited), ``rates`` per mode the
          committed tokens per millisecond it was judged on (tokens ÷ estimated step time; None: no estimate; the
          drain rule's tokens under it), ``estimates`` per mode the committed tokens per request per step before
          the drain rule's mapping (:meth:`expected` with the confidence it used), ``confidence`` per mode that
          confidence (None: none given, or none used: drain model ``"own"`` under the drain rule). The steps that
          time the decode's first mode (rule "Online cost": 3 timings before any other mode) and a ``schedule``'s
          have ``rates``, ``estimates`` and ``confidence`` None (no comparison made). The last two are kept as
          they are and rounded by :meth:`logged`; logs before 2026-12-07 lack them.
        * an observation ``["o", mode index, tokens per request, ms or None, rows]``, under states ``"kv"``, ``"rows_kv"`` with
          the rows' context tokens after them (:meth:`observe`), then the
          step's paired observations ``["p", mode index, tokens per request, None, rows]`` (:meth:`observe_paired`;
          logs before 2026-12-08 lack them), so a replay can rebuild the token averages and leads.
        * a skip ``["s"]`` (:meth:`skip`): the oldest choice not yet observed will not be (no request was live in
          its step).
        * a drain refresh ``["d", step, requests]`` (:meth:`choose`'s ``drain``): per request of the batch
          ``[remaining, chain tokens, chain steps, chain tokens²]`` as the rule got them (remaining 0 once finished;
          logs before 2026-12-06, sixth, lack the last), so a request's finishing step and its acceptance over time
          can be read back against what the rule assumed, and :func:`drain_tokens` replayed on them.

        Costs a list append per event and the rounding of a choice's rates (about 7-10 µs a step, its choice and its
        observation, with 7 modes on a 2-core CPU, the same before the estimates were logged); the engine turns it
        on with ``DSPINE_PLAN_LOG`` (``infer.engine.Engine``)."""
        self.log = [[f"{k}:{n}" for k, n in self.table]]
        self._log_index = {m: i for i, m in enumerate(self.table)}  # mode -> its index in the log's names

    def _log_choice(self, mode: Mode, loss: float, costs: dict, tokens, raw=None, conf=None) -> None:
        rates = None
        if tokens is not None:
            rates = [_sig(tokens[m] / costs[m]) if tokens.get(m) is not None else None for m in self.table]
        # the estimates and the confidence as they are (this runs on the engine's launching thread every step):
        # logged() rounds them
        est = [raw.get(m) for m in self.table] if raw is not None else None
        cf = [conf.get(m) for m in self.table] if raw is not None and conf else None
        self.log.append(["c", self.step, self._log_index[mode], int(self.drain_scale is not None), _sig(loss), rates,
                         est, cf])

    def logged(self) -> list | None:
        """:attr:`log` as it is written (``Engine`` to ``DSPINE_PLAN_LOG``): each choice's estimates and confidence
        rounded to 4 significant digits, a value that is not a finite number as None. None with no log."""
        if self.log is None:
            return None

        def rnd(xs):
            if xs is None:
                return None
            out = []
            for x in xs:
                try:
                    x = float(x)
                except (TypeError, ValueError):
                    x = None
                out.append(_sig(x) if x is not None and math.isfinite(x) else None)
            return out

        return [e[:6] + [rnd(e[6]), rnd(e[7])] if e[0] == "c" and len(e) == 8 else e for e in self.log]

    def end_drain(self) -> None:
        """Back to tokens per millisecond (a caller whose queue refills: :meth:`choose`'s ``drain``)."""
        self.drain_scale = None

    def skip(self) -> None:
        """Forget the oldest choice not yet observed (its step is not observed: e.g. no request was live in
        it); its estimated time stays in the time spent and a probe keeps its charge."""
        if self.log is not None:
            self.log.append(["s"])
        if self.pending:
            self.pending.popleft()

    def observe(self, mode: Mode, tokens_per_request: float, ms: float | None = None, rows: int = 1,
                kv: float | None = None) -> None:
        """Record what a step of ``mode`` committed, per request of the ``rows`` live in it, and (``ms``)
        the wall milliseconds it took as measured by the caller. Steps are observed in the order they were
        chosen; the oldest unobserved choice of ``mode`` is this step's (older choices of other modes not
        observed are dropped as by :meth:`skip`). A ``mode`` never chosen is recorded at its estimate. ``kv``: the
        context tokens of the ``rows`` requests in the step, for states ``"kv"`` and ``"rows_kv"`` (ignored under
        ``"steps"``)."""
        est_ms, predicted, probe = self.costs[mode], None, None
        kv = kv if self.state != "steps" else None
        if self.log is not None:
            self.log.append(["o", self._log_index[mode], _sig(tokens_per_request), _sig(ms), rows]
                            + ([_sig(kv)] if kv is not None else []))
        self.rows_max = max(self.rows_max, rows)
        self.untimed += not (ms is not None and ms > 0)
        while self.pending and self.pending[0][0] != mode:
            self.pending.popleft()
        if self.pending:
            _, est_ms, predicted, probe = self.pending.popleft()
        if ms is not None and ms > 0:
            self.timed_steps[mode] += 1
            self.timed_ms[mode] += ms
            before = est_ms / self.table[mode]  # the ratio used for this step
            x = ms / self.table[mode]
            # no other mode measured yet and fewer than FIRST_TIMED timings of this one: take x as it is
            first = self.timed[mode] < FIRST_TIMED and all(r is None for k, r in self.ratio.items() if k != mode)
            if not first:
                x = min(max(x, before / FIRST_CLIP), FIRST_CLIP * before)
            ms = x * self.table[mode]
            self.spent_ms += ms - est_ms  # the choice added the estimate
            self.timed[mode] += 1
            if kv is not None:
                self._fit_kv(mode, kv, ms)
            if self.timed[mode] <= FIRST_TIMED:  # a median in log space, one of the first may be a spike
                self.first[mode] = (self.first[mode] or ([] if first else [before])) + [x]
                logs = sorted(math.log(r) for r in self.first[mode][-3:])
                mid = len(logs) // 2
                self.ratio[mode] = math.exp(logs[mid] if len(logs) % 2 else (logs[mid - 1] + logs[mid]) / 2)
            else:  # log-space average, one step moves it by at most cost_decay × LOG_CLIP
                step = min(max(math.log(x / self.ratio[mode]), -LOG_CLIP), LOG_CLIP)
                self.ratio[mode] *= math.exp(self.cost_decay * step)
        else:
            ms = est_ms
        if probe is not None:
            loss, rate, scale = probe  # settle: the real loss of this probe, a lucky one gives time back
            self.lost_ms += ms - scale * tokens_per_request / rate - loss
        self.last_predicted, self.last_observed = predicted, (mode, tokens_per_request)
        self.paired_now = {}
        self.observed[mode] += 1
        self.realized[mode] += tokens_per_request
        if mode[0] != "ar":
            self._record(mode, tokens_per_request, rows, predicted)

    def observe_paired(self, mode: Mode, tokens_per_request: float, rows: int = 1) -> None:
        """Record what a step of ``mode`` *would have* committed in the step just observed (:meth:`observe`),
        which ran another mode (module docstring, "Paired observations"): token averages, and calibration
        against the confidence given with that step; no time, no choice consumed, no probe settled. Leads: the run
        mode's over the largest mode paired on its steps (a chain, or a smaller tree inside the run tree), and any
        paired mode's over the largest smaller mode paired before it on the same step (a tree's, and a chain's: the
        chain of 4 paired after the chain of 2 on a step of the chain of 8 or of a tree); give a step's paired modes smallest
        first (chains, then trees by size). Raises ValueError for a mode outside the cost table."""
        if mode not in self.table:
            raise ValueError(f"paired mode {mode} is not in the planner's cost table {sorted(self.table)}")
        if mode in self.paired_now:
            raise ValueError(f"paired mode {mode} was already paired in the step observed last")
        if mode[0] == "ar":
            return
        if self.log is not None:
            self.log.append(["p", self._log_index[mode], _sig(tokens_per_request), None, rows])
        self.paired[mode] += 1
        self._record(mode, tokens_per_request, rows, self.last_predicted)
        run, x_run = self.last_observed
        if run[0] != "ar" and run != mode:
            self._lead(run, mode, x_run - tokens_per_request, rows)
        below = [m for m in self.paired_now if _lead_rank(m) < _lead_rank(mode)]
        if below:  # a tree inside the run tree: its lead over the largest smaller mode of the same step
            ref = max(below, key=_lead_rank)
            self._lead(mode, ref, tokens_per_request - self.paired_now[ref], rows)
        self.paired_now[mode] = tokens_per_request

    def _lead(self, mode: Mode, ref: Mode, diff: float, rows: int = 1) -> None:
        """One paired step's ``diff`` (``mode``'s tokens − ``ref``'s; ``rows`` live requests) into ``mode``'s slow-average
        lead (:meth:`_weight`). A ref that ranks above the lead's present one (:func:`_lead_rank`: a tree above a chain,
        a larger tree above a smaller) replaces it and the average starts again; one ranking below is not used for ``mode``."""
        cur = self.lead.get(mode)
        if cur is not None and cur[0] != ref:
            if _lead_rank(ref) < _lead_rank(cur[0]):
                return
            cur, self.lead_steps[mode] = None, 0
        n = self.lead_steps[mode] = self.lead_steps[mode] + 1
        w = self._weight(("lead", mode), rows, n)
        lead = 0.0 if cur is None else cur[1]
        self.lead[mode] = (ref, lead + w * (diff - lead))
        sq = 0.0 if cur is None else self.lead_sq.get(mode, lead * lead)
        self.lead_sq[mode] = sq + w * (diff * diff - sq)

    def lead_se(self, mode: Mode, path: tuple = ()) -> float | None:
        """Standard error of ``mode``'s lead-resolved estimate (tokens per request): ``√Σ var/n`` over the leads from
        ``mode`` to its unled paired mode, var the slow averages' squared difference less the squared lead and n the
        paired steps behind each lead (at most ``2 / slow − 1``, the slow average's effective samples); ``None``
        unless ``mode`` is led with at least ``LEAD_MIN_STEPS`` steps behind each of those leads and their squared
        differences (a token state from before them has none: the headroom rule applies). A led mode's probing
        ceiling is the estimate plus ``LEAD_Z`` of it (module docstring, rule 2)."""
        if mode not in self.lead or mode in path or self.lead_steps[mode] < LEAD_MIN_STEPS or mode not in self.lead_sq:
            return None
        ref, lead = self.lead[mode]
        n = min(self.lead_steps[mode], 2.0 / self.slow_decay - 1)
        var = max(self.lead_sq[mode] - lead * lead, 0.0)
        var *= 1.0 / n
        if ref in self.lead:
            below = self.lead_se(ref, path + (mode,))
            if below is None:
                return None
            var += below * below
        return math.sqrt(var)

    def cost_state(self) -> dict:
        """The online cost model (measured ÷ table ratios, their timing counts and first timings, and the KV-length
        fit), for :meth:`load_cost_state` of the next planner on the same device, batch size and sampling settings."""
        return {
            "ratio": dict(self.ratio),
            "timed": dict(self.timed),
            "first": {m: list(v) for m, v in self.first.items()},
            "kv": {k: v.copy() if isinstance(v, dict) else v for k, v in self.kv_fit.items()},
        }

    def load_cost_state(self, state: dict) -> None:
        """Start from an earlier planner's cost model (:meth:`cost_state`; module docstring, "Online cost"):
        its modes' ratios are taken as measured, so the decode's first mode is not re-timed 3 times and no
        mode's step time is re-learned from the start-up table. Token averages are not carried: they belong
        to the earlier requests. Raises ValueError if ``state`` holds a mode not in this table."""
        extra = set(state["ratio"]) - set(self.table)
        if extra:
            raise ValueError(f"cost state has modes {sorted(extra)} not in the planner's table {sorted(self.table)}")
        for m, r in state["ratio"].items():
            if r is not None:
                self.ratio[m], self.timed[m], self.first[m] = r, state["timed"][m], list(state["first"][m])
        if "kv" in state:  # (a state from before the KV-length fit has none)
            self.kv_fit = {k: v.copy() if isinstance(v, dict) else v for k, v in state["kv"].items()}

    TOKEN_FIELDS = ("fast", "slow", "seen", "rows", "pred", "real", "calibrated", "lead", "lead_steps", "pred_var",
                    "pred_cov", "slope_steps", "lead_sq")

    def token_state(self) -> dict:
        """The learned acceptance (token averages, calibration, the leads of paired modes, and under ``"spread"`` the
        drain rule's spread between requests: :attr:`spread`, else the prior it started with; under drain model
        ``"persist"`` as ``"spread_rel"``, relative to the pooled acceptance squared), for :meth:`load_token_state` of the next planner of the same engine, batch size and sampling
        settings."""
        spread = self.spread if self.spread is not None else self.spread_prior
        return {**{f: dict(getattr(self, f)) for f in self.TOKEN_FIELDS}, self._spread_key(): spread,
                "weight": dict(self.weight), "rows_max": self.rows_max}

    def _spread_key(self) -> str:
        """:meth:`token_state`'s key of the carried spread: ``"spread"`` (tokens²) or ``"spread_rel"`` (drain model
        ``"persist"``, relative to ā²; :data:`SPREAD_STATE`)."""
        return SPREAD_STATE.get(self.drain_model, ("spread", DEFAULT_SPREAD))[0]

    def _default_spread(self) -> float:
        """The drain rule's prior spread with no earlier call, in :meth:`_spread_key`'s units (:data:`SPREAD_STATE`)."""
        return SPREAD_STATE.get(self.drain_model, ("spread", DEFAULT_SPREAD))[1]

    def load_token_state(self, state: dict) -> None:
        """Start from an earlier planner's acceptance (:meth:`token_state`; module docstring, "Across calls"):
        every mode counts as seen at step 0, so the averages are taken as they were, and the fast ones then
        follow the new requests; its ``"spread"`` becomes the drain rule's prior (``DEFAULT_SPREAD`` if absent, as in
        a state written before it existed; under drain model ``"persist"`` its ``"spread_rel"``, else
        ``DEFAULT_SPREAD_REL``: a key of another model, such as the removed ``"relative"``'s ``"spread_ratio"`` or
        ``"persist_len"``'s ``"lengths"``, is not read). Raises ValueError if ``state`` holds a mode not in this table."""
        extra = set(state["fast"]) - set(self.table)
        if extra:
            raise ValueError(f"token state has modes {sorted(extra)} not in the planner's table {sorted(self.table)}")
        for f in self.TOKEN_FIELDS:  # (Counter.update would add the counts: replace)
            cur = getattr(self, f)
            # a state written before the slope fit existed lacks its fields: they start afresh (any other is required)
            got = state.get(f, {}) if f in ("pred_var", "pred_cov", "slope_steps", "lead_sq") else state[f]
            setattr(self, f, Counter(got) if isinstance(cur, Counter) else {**cur, **got})
        # its model's own key: a state of another model carries tokens² or another ratio
        self.spread_prior = _finite_prior(state.get(self._spread_key(), self._default_spread()))
        if self.drain_model == "persist_cap" and self.spread_prior is not None:  # PERSIST_MODELS' comment
            self.spread_prior = min(self.spread_prior, DEFAULT_SPREAD_REL)
        self.spread = None
        self.last_seen = {m: 0 for m in self.table}
        self.weight, self.rows_max = dict(state.get("weight", {})), state.get("rows_max", 1)

    def _record(self, mode: Mode, tokens_per_request: float, rows: int, predicted: float | None) -> None:
        """Token averages and calibration of a speculative ``mode`` (module docstring, "Averages")."""
        if predicted is not None and isinstance(predicted, (int, float)) and math.isfinite(predicted):
            n = self.calibrated[mode] + 1
            w = max(self.cal_decay, 1.0 / n)
            x, y = predicted - 1.0, tokens_per_request - 1.0
            # (a mode led by a paired mode takes that mode's slope: its own fit is not needed while it is led)
            fit = self.conf_slope == "auto" and mode not in self.lead and self.pred[mode] and self.pred[mode] > 0
            est = self._own_tokens(mode) if fit else None
            if est is not None:  # the proportional move this prediction makes and what it had to explain
                z = (est - 1.0) * (min(max(x / self.pred[mode], 1 / 3), 3.0) - 1.0)
                wz = max(self.cal_decay, 1.0 / (self.slope_steps[mode] + 1))
                self.slope_steps[mode] += 1
                self.pred_var[mode] += wz * (z * z - self.pred_var[mode])
                self.pred_cov[mode] += wz * (z * (y - (est - 1.0)) - self.pred_cov[mode])
            for avg, v in ((self.pred, x), (self.real, y)):
                avg[mode] = v if avg[mode] is None else avg[mode] + w * (v - avg[mode])
            self.calibrated[mode] = n
        x, n, r = tokens_per_request, self.seen[mode] + 1, max(rows, 1)
        if n == 1:  # the first step, shrunk towards the other modes of the same draft
            others = [self.slow[m] for m in self.table if m != mode and m[0] != "ar" and self.slow[m] is not None]
            if others:  # at most what one step of this mode can commit (a narrower chain's first step, paired
                # after a wider chain, would otherwise be pulled above its own width)
                x = (r * x + PRIOR_ROWS * min(max(others), float(max_tokens(mode, self.table)))) / (r + PRIOR_ROWS)
        self.seen[mode], self.last_seen[mode] = n, self.step
        w = max(self.slow_decay, 1.0 / n)  # a plain mean over the first observations (rows: per step in any state)
        self.rows[mode] += w * (r - self.rows[mode]) if n > 1 else r - self.rows[mode]
        w = self._weight(("slow", mode), r, n)
        self.slow[mode] = x if self.slow[mode] is None else self.slow[mode] + w * (x - self.slow[mode])
        w = max(self.decay * r / (r + PRIOR_ROWS), 1.0 / n)
        old = self.fast[mode]
        self.fast[mode] = x if old is None else old + w * (x - old)

    def report(self) -> dict:
        """``{mode name: {"steps", "drain_steps", "paired", "step_ms", "measured_ms", "tokens_per_step",
        "calibration", "conf_slope", "observed", "realized_tokens", "timed_steps", "timed_ms"}}``, e.g. ``"tree32"``: ``steps`` the steps it ran (``drain_steps`` of them chosen while a
        drain was in force, whether or not it changed the choice: with one request it maps every mode to its
        own estimate, and before any chain step too when there is no prior), ``paired`` the paired observations it got from steps of other modes, ``step_ms`` the start-up table, ``measured_ms`` the online estimate (``None``: never
        timed), ``tokens_per_step`` the slow average (``None``: never run nor paired), ``calibration``
        realized ÷ predicted accepted tokens (``None``: no prediction given; a mode with a lead over a paired mode
        takes that mode's scaling instead, and its own is reported only), ``conf_slope`` :meth:`slope` (``None``: AR, or
        ``"auto"`` with no step fitted yet; a tree led by the chain takes the chain's slope, and its own, fitted only
        while it was not led, is reported only), ``observed`` the steps of it observed (:meth:`observe`) and
        ``realized_tokens`` the sum of their committed tokens per request: ``realized_tokens / observed`` is the mode's τ
        in the steps the planner chose it for; ``timed_steps`` the steps of it this planner observed with a time (not those
        of the planner whose cost model it loaded) and ``timed_ms``
        the sum of those times as the caller measured them (unclipped): ``timed_ms / timed_steps`` is the mode's mean
        step time in the planner's own decode (on the engine CUDA-event time, no step with a prefill), against a
        fixed run of that mode."""
        costs = self.costs
        return {
            f"{m[0]}{m[1] if m[0] != 'ar' else ''}": {
                "steps": self.choices[m],
                "drain_steps": self.drain_choices[m],
                "paired": self.paired[m],
                "step_ms": self.table[m],
                "measured_ms": costs[m] if self.timed[m] else None,
                "tokens_per_step": self.slow[m],
                "calibration": self.calibration(m) if self.calibrated[m] else None,
                "conf_slope": (round(self.slope(m), 4) if m[0] != "ar" and (self.conf_slope != "auto"
                                                                          or self.slope_steps[m]) else None),
                "observed": self.observed[m],
                "realized_tokens": self.realized[m],
                "timed_steps": self.timed_steps[m],
                "timed_ms": self.timed_ms[m],
            }
            for m in self.table
        }
