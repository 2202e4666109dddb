"""Summarise a planner step log (``DSPINE_PLAN_LOG=FILE``, ``infer.planner.StepPlanner.start_log``).

    python benchmarks/engine/plan_log.py FILE [--batch 32] [--temperature 0] [--pass timed] [--label p] [--json OUT]
        [--persistence 16] [--estimates] [--cost-share S] [--kv] [--drain-finish] [--leads] [--replay-state S]

One summary per point (batch, temperature) of the calls kept (one ``--budget auto`` generate call per line;
infer.bench makes one per task, turn and pass: ``tag.pass`` is ``start`` for its start-up warm-up, ``warmup`` for a
task's untimed pass, ``timed`` for the pass it reports): the steps each mode ran in and out of the drain rule, the
probes, the tokens per millisecond each mode realized in its observed timed steps (committed tokens per live
request ÷ measured ms), for the choices made under the drain rule how often each mode was judged the best and the
median judged rates, and the realized rates under the drain rule by the number of live requests. ``--batch``,
``--temperature``, ``--pass`` and ``--label`` keep only the calls at that batch size (the engine's: concurrency,
capped by the number of prompts), temperature, pass and draft label (``tag.label``: one log holds every planner label
of an ``infer.bench`` run, e.g. the two of an A/B). ``batch`` is the engine's batch, not always ``--concurrency``.
``--persistence N`` adds, per call, how much of the spread between requests' acceptance over their first N chain
steps persists to the rest of their answers (:func:`persistence`); ``--estimates``, per call and mode, the estimate
the planner judged the mode on before the drain rule's mapping and the confidence the engine gave, against what the
mode's steps committed (:func:`estimates`); ``--cost-share S`` replays the planner's step-time model over the calls
kept with every mode not run following a run mode's drift by the share S, against the logged step times
(:func:`cost_replay`; 0 reproduces the log); ``--kv``, per call of a log written under planner state ``kv`` or
``rows_kv``, the within-mode slope of step time on the live requests' context tokens (:func:`kv_fit`);
``--drain-finish``, per call, where the rest of the call ran one speculative mode after a drain refresh, the tokens per
step the batch's last request realized against the drain rule's mapping replayed on the refresh (:func:`drain_finish`;
one ``--label``, every pass); ``--leads``, per call, each paired mode's lead (a chain's over the narrower chain paired on
its steps) at the call's end, replayed with steps weighed alike and by their live requests (:func:`leads`; every pass:
each label's carried apart); ``--replay-state S``, per call, its first choice's estimates as logged and
as replayed under planner state S (:func:`state_replay`; every pass: each label's carried apart).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
import zlib
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # dspine.provenance when run as a script

from infer.planner import (  # noqa: E402
    DEFAULT_SPREAD_REL,
    FIRST_TIMED,
    LOG_CLIP,
    PERSIST_EARLY,
    PLAN_STATES,
    drain_spread,
    drain_tokens,
    persist_variance,
    persistent_spread,
)

ROW_BANDS = ((1, 1), (2, 4), (5, 12), (13, 1 << 30))  # live requests in an observed step


def _finite(x) -> bool:
    """A number (not a bool) that is finite; an integer too large for a float is not."""
    try:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    except OverflowError:
        return False


def _check_event(e, n_modes: int) -> str | None:
    """What is wrong with one log event (None: nothing): its kind, length, mode index and numbers, naming the field
    (and the mode) at fault."""
    if not isinstance(e, list) or not e or e[0] not in ("c", "o", "p", "s", "d"):
        return f"event {e!r:.60} is not a list starting with 'c', 'o', 'p', 's' or 'd'"
    # a choice's estimates and confidence: 2026-12-07; paired observations ("p", as "o" with ms None): 2026-12-08
    # an observation's context tokens (planner state "rows_kv"): 2026-12-07, sixteenth
    sizes = {"c": (6, 8), "o": (5, 6), "p": (5,), "s": (1,), "d": (3,)}[e[0]]
    if len(e) not in sizes:
        return f"a {e[0]!r} event has {' or '.join(map(str, sizes))} fields, this one {len(e)}"
    if e[0] in ("c", "o", "p"):
        i = e[2] if e[0] == "c" else e[1]
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n_modes:
            return f"mode index {i!r} outside the {n_modes} modes"
    if e[0] == "c":
        if not _finite(e[4]):
            return f"a choice's probe loss must be a finite number, got {e[4]!r:.40}"
        for k, what in ((5, "rates"), (6, "estimates"), (7, "confidence")):
            if k >= len(e) or e[k] is None:
                continue
            if not isinstance(e[k], list) or len(e[k]) != n_modes:
                return f"a choice's {what} must be None or one per mode ({n_modes}), got {e[k]!r:.60}"
            for j, x in enumerate(e[k]):
                if x is not None and not (_finite(x) and (k == 5 or x >= 0)):
                    return (f"a choice's {what} must be finite numbers{'' if k == 5 else ' >= 0'} or None, got "
                            f"{x!r:.40} for mode {j}")
    if e[0] in ("o", "p") and (not isinstance(e[4], int) or isinstance(e[4], bool) or e[4] < 1):
        return f"an observation's live requests must be an integer >= 1, got {e[4]!r}"
    if e[0] in ("o", "p") and (not _finite(e[2]) or e[2] < 0 or not (e[3] is None or _finite(e[3]))):
        return f"an observation's tokens must be a number >= 0 and its ms a number or None, got {e[2]!r}, {e[3]!r}"
    if e[0] == "o" and len(e) == 6 and not (_finite(e[5]) and e[5] >= 0):
        return f"an observation's context tokens must be a number >= 0, got {e[5]!r}"
    if e[0] == "d" and not (isinstance(e[2], list) and all(
            isinstance(r, list) and len(r) in (3, 4) and all(_finite(x) for x in r) and all(x >= 0 for x in r[1:])
            for r in e[2])):
        return ("a drain refresh's requests must be a list of [remaining, chain tokens, chain steps(, tokens²)], "
                f"finite numbers, the counts >= 0; got {e[2]!r:.80}")
    return None


def read_log(path: str | Path) -> list[dict]:
    """The call records of a plan log (gzipped if its name ends in .gz). Raises ValueError naming the file (and
    line) of a file that is not readable as one, holds no record, or has a line that is not a call record
    (``batch``, ``temperature``, ``log``: the mode names, then well-formed events)."""
    try:
        raw = Path(path).read_bytes()
        text = (gzip.decompress(raw) if str(path).endswith(".gz") else raw).decode()
    except IsADirectoryError:
        raise ValueError(f"{path}: a folder, not a plan log") from None
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not readable as a plan log ({e})") from None
    calls = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
        log = rec.get("log") if isinstance(rec, dict) else None
        if (not isinstance(rec, dict) or not isinstance(rec.get("batch"), int) or isinstance(rec.get("batch"), bool)
                or not isinstance(rec.get("temperature"), (int, float)) or not isinstance(log, list)
                or not log or not isinstance(log[0], list) or not all(isinstance(n, str) for n in log[0])
                or len(set(log[0])) != len(log[0])):
            raise ValueError(f"{path}:{i}: not a plan-log record (needs an integer 'batch', a number 'temperature' and "
                             "a 'log' whose first entry lists the mode names, each once)")
        if rec.get("tag") is not None and not isinstance(rec["tag"], dict):
            raise ValueError(f"{path}:{i}: the record's 'tag' must be an object (infer.bench's label, task, turn, "
                             f"pass), got {rec['tag']!r:.40}")
        for j, e in enumerate(log[1:], 1):
            problem = _check_event(e, len(log[0]))
            if problem:
                raise ValueError(f"{path}:{i}: event {j} of the log: {problem}")
        calls.append(rec)
    if not calls:
        raise ValueError(f"{path}: no plan-log record in it")
    return calls


def _matched(rec: dict):
    """(choice, observation) pairs of one call, in order: an observation belongs to the oldest choice not yet
    observed of its mode, older choices of other modes being dropped, and a skip drops the oldest
    (``StepPlanner.observe`` and ``skip``)."""
    pending = []
    for e in rec["log"][1:]:
        if e[0] == "c":
            pending.append(e)
        elif e[0] == "s":
            if pending:
                pending.pop(0)
        elif e[0] == "o":
            while pending and pending[0][2] != e[1]:
                pending.pop(0)
            if pending:
                yield pending.pop(0), e[:5]  # (context tokens, if logged: kv_fit)


def summarize(calls: list[dict]) -> dict:
    """Totals over ``calls`` of one point (:func:`read_log`): ``{"calls", "steps", "modes": {name: {"steps",
    "drain_steps", "probes", "observed", "timed", "tokens", "ms", "tok_per_ms"}}, "drain_by_rows": {name: {band:
    {"steps", "tok_per_ms"}}}, "drain_choices": {"n", "best": {name: count}, "median_rate": {name: rate}}}``. A
    mode's ``tok_per_ms`` is its realized tokens per request over its timed steps' milliseconds (None without a
    timed step); ``drain_by_rows`` the same over the timed steps chosen under the drain rule, by live requests
    (:data:`ROW_BANDS`). ``calibration``: ``{name: {"steps", "judged_tok_per_ms", "realized_tok_per_ms"}}`` over
    the timed steps chosen outside the drain rule with a comparison made: the mean rate the chosen mode was judged
    on against what those steps realized (tokens ÷ ms); realized below judged is partly selection (a mode is
    chosen where it is judged high), a mode far below the others is overestimated. Raises ValueError if the calls
    name different modes."""
    names = calls[0]["log"][0]
    modes = {n: Counter() for n in names}
    drain_best: Counter = Counter()
    drain_rates: dict[str, list] = {}
    bands: dict[str, dict] = {n: {} for n in names}
    judged: dict[str, list] = {}  # mode -> [steps, Σ judged rate, Σ tokens, Σ ms] (calibration)
    drain_n = steps = 0
    for rec in calls:
        if rec["log"][0] != names:
            raise ValueError(f"plan-log calls with different modes: {names} and {rec['log'][0]} (give --batch and "
                             "--temperature, or summarise per point)")
        for e in rec["log"][1:]:
            if e[0] == "c":
                _, _, i, drain, loss, rates = e[:6]
                steps += 1
                m = modes[names[i]]
                m["steps"] += 1
                m["drain_steps"] += bool(drain)
                m["probes"] += loss is not None and loss > 0
                known = [(r, j) for j, r in enumerate(rates or []) if r is not None]
                if drain and known:
                    drain_n += 1
                    drain_best[names[max(known)[1]]] += 1
                    for r, j in known:
                        drain_rates.setdefault(names[j], []).append(r)
            elif e[0] == "o":
                _, i, tokens, ms = e[:4]
                m = modes[names[i]]
                m["observed"] += 1
                if ms is not None and ms > 0:
                    m["timed"] += 1
                    m["tokens"] += tokens
                    m["ms"] += ms
        for choice, (_, i, tokens, ms, rows) in _matched(rec):
            if ms is None or not ms > 0:
                continue
            if not choice[3]:
                rate = (choice[5] or [None] * len(names))[i]
                if rate is not None:
                    j = judged.setdefault(names[i], [0, 0.0, 0.0, 0.0])
                    j[0], j[1], j[2], j[3] = j[0] + 1, j[1] + rate, j[2] + tokens, j[3] + ms
                continue
            lo, hi = next(b for b in ROW_BANDS if b[0] <= rows <= b[1])
            key = str(lo) if lo == hi else f">{lo - 1}" if hi == 1 << 30 else f"{lo}-{hi}"
            a = bands[names[i]].setdefault(key, [0, 0.0, 0.0])
            a[0] += 1
            a[1] += tokens
            a[2] += ms
    out = {}
    for n, m in modes.items():
        row = {k: m[k] for k in ("steps", "drain_steps", "probes", "observed", "timed")}
        row["tokens"], row["ms"] = round(m["tokens"], 3), round(m["ms"], 3)
        row["tok_per_ms"] = round(m["tokens"] / m["ms"], 4) if m["ms"] else None
        out[n] = row
    by_rows = {n: {k: {"steps": a[0], "tok_per_ms": round(a[1] / a[2], 4)} for k, a in b.items()}
               for n, b in bands.items()}
    calibration = {n: {"steps": j[0], "judged_tok_per_ms": round(j[1] / j[0], 4),
                       "realized_tok_per_ms": round(j[2] / j[3], 4)} for n, j in judged.items()}
    return {"calls": len(calls), "steps": steps, "modes": out, "drain_by_rows": by_rows, "calibration": calibration,
            "drain_choices": {"n": drain_n, "best": dict(drain_best),
                              "median_rate": {n: round(statistics.median(v), 4) for n, v in drain_rates.items()}}}


def persistence(calls: list[dict], early: int = 16) -> list[dict]:
    """How much of the spread between requests' acceptance early in their answers persists to the rest of them (the
    drain rule takes a request's early chain acceptance as its own for the rest: ``infer.planner.drain_tokens``).
    Per call with drain refreshes (``"d"`` events: per slot its remaining tokens and cumulative chain tokens and steps;
    matched by position, so a log before 2026-12-06, sixth, whose engine left out idle slots without chain steps, can
    shift a slot's series once such a slot appears), per request: its mean accepted draft tokens per chain step at the first refresh where it has at least
    ``early`` chain steps, and over its chain steps after that refresh up to its last (at least ``early`` of them);
    a slot whose counts drop was refilled and starts a new request. Returns one dict per call with two such
    requests or more: ``tag``, ``requests``, ``early_steps`` and ``late_steps`` (means), ``early_mean``,
    ``early_var`` (variance of the early means across requests, its noise included), ``cov`` (early with late:
    the persistent part, noise-free as the two windows' noise is independent), ``corr``, ``slope`` (``cov /
    early_var``: the late mean's regression on the early one; 0 when nothing persists, 1 when all of it does) and
    ``shares`` (each mode's share of the call's speculative choices: the acceptance of a narrower chain is counted
    cut at its width). Raises ValueError if ``early`` < 1."""
    if early < 1:
        raise ValueError(f"early={early}: give at least 1 chain step")
    out = []
    for rec in calls:
        names = rec["log"][0]
        refresh = [e[2] for e in rec["log"][1:] if e[0] == "d"]
        spec = Counter(names[e[2]] for e in rec["log"][1:] if e[0] == "c" and not names[e[2]].startswith("ar"))
        pairs = []
        for slot in range(max((len(r) for r in refresh), default=0)):
            series = [r[slot] for r in refresh if slot < len(r)]
            cuts = [0] + [i for i in range(1, len(series)) if series[i][2] < series[i - 1][2]] + [len(series)]
            for seg in (series[a:b] for a, b in zip(cuts, cuts[1:])):
                first = next((x for x in seg if x[2] >= early), None)
                if first is None:
                    continue
                last = seg[-1]
                n_late = last[2] - first[2]
                if n_late < early:
                    continue
                pairs.append(((first[1] - first[2]) / first[2], first[2],
                              ((last[1] - first[1]) - n_late) / n_late, n_late))
        if len(pairs) < 2:
            continue
        e = [p[0] for p in pairs]
        lt = [p[2] for p in pairs]
        me, ml = statistics.fmean(e), statistics.fmean(lt)
        ve = statistics.fmean([(x - me) ** 2 for x in e])
        vl = statistics.fmean([(y - ml) ** 2 for y in lt])
        cov = statistics.fmean([(x - me) * (y - ml) for x, y in zip(e, lt)])
        total = sum(spec.values())
        out.append({"tag": rec.get("tag"), "requests": len(pairs),
                    "early_steps": round(statistics.fmean(p[1] for p in pairs), 1),
                    "late_steps": round(statistics.fmean(p[3] for p in pairs), 1),
                    "early_mean": round(me, 4), "early_var": round(ve, 4), "cov": round(cov, 4),
                    "corr": round(cov / math.sqrt(ve * vl), 3) if ve > 0 and vl > 0 else None,
                    "slope": round(cov / ve, 3) if ve > 0 else None,
                    "shares": {n: round(c / total, 3) for n, c in spec.most_common()}})
    return out


def per_call(calls: list[dict], opening: int = 20, tail_rows: int = 4) -> list[dict]:
    """One row per call (in log order): what the planner chose where a call begins and where it ends, the two places
    the token state carried from the call before shows.

    Args:
        calls: :func:`read_log`'s records.
        opening: how many of a call's first choices ``opening`` counts.
        tail_rows: a step observed with at most this many live requests counts in ``tail`` (the batch's drain down
            to its last requests; its observations are what the next call's planner starts from).
    Returns:
        Per call ``{"tag", "steps", "wall_s", "modes", "opening", "tail_steps", "tail_modes",
        "tail_tokens"}``: ``modes`` the choices per mode name, ``opening`` the first ``opening`` choices per
        mode name, ``tail_steps`` the observed steps with at most ``tail_rows`` requests, ``tail_modes`` their
        modes and ``tail_tokens`` their mean committed tokens per request (None without such steps).
    Raises:
        ValueError: ``opening`` or ``tail_rows`` below 1.
    """
    if opening < 1 or tail_rows < 1:
        raise ValueError(f"per_call: opening {opening} and tail_rows {tail_rows} must be at least 1")
    out = []
    for c in calls:
        names = c["log"][0]
        events = c["log"][1:]
        chosen = [names[e[2]] for e in events if e[0] == "c"]
        tail = [e for e in events if e[0] == "o" and e[4] <= tail_rows]
        count = lambda xs: dict(sorted(Counter(xs).items()))  # noqa: E731
        out.append({"tag": c.get("tag"), "steps": c.get("steps"), "wall_s": c.get("wall_s"), "modes": count(chosen),
                    "opening": count(chosen[:opening]), "tail_steps": len(tail),
                    "tail_modes": count(names[e[1]] for e in tail),
                    "tail_tokens": sum(e[2] for e in tail) / len(tail) if tail else None})
    return out


def estimates(calls: list[dict]) -> list[dict]:
    """Per call, per mode: what the planner estimated it would commit against what it committed (choices logged
    with ``estimates``, from 2026-12-07 on).

    Args:
        calls: :func:`read_log`'s records.
    Returns:
        One row per call (in log order) ``{"tag", "logged", "modes": {name: {"choices", "estimate", "confidence",
        "steps", "realized"}}}``: ``logged`` whether the call's choices carry estimates (logs from 2026-12-07 on);
        ``choices`` the call's choices that estimated the mode (whatever mode they chose), ``estimate`` the plain
        mean of those estimates (committed tokens per request per step before the drain rule's mapping; None where
        never estimated), ``confidence`` the plain mean of the confidence those estimates used (None where none
        was), ``steps`` the mode's observed steps in the call and ``realized`` their committed tokens per request,
        weighted by live requests (None without a step). The estimate is over every choice and the realized value
        over the mode's own steps only: a mode chosen where it is judged high reads lower than its estimate, and a
        mode never run has no realized value.
    """
    out = []
    for c in calls:
        names = c["log"][0]
        est = {n: [] for n in names}
        conf = {n: [] for n in names}
        tok = {n: 0.0 for n in names}
        rows = {n: 0 for n in names}
        steps = Counter()
        logged = False
        for e in c["log"][1:]:
            if e[0] == "c" and len(e) == 8:
                logged = True
                for i, n in enumerate(names):
                    if e[6] is not None and e[6][i] is not None:
                        est[n].append(e[6][i])
                    if e[7] is not None and e[7][i] is not None:
                        conf[n].append(e[7][i])
            elif e[0] == "o":
                n = names[e[1]]
                steps[n] += 1
                tok[n] += e[2] * e[4]
                rows[n] += e[4]
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        out.append({"tag": c.get("tag"), "logged": logged, "modes": {
            n: {"choices": len(est[n]), "estimate": mean(est[n]), "confidence": mean(conf[n]), "steps": steps[n],
                "realized": tok[n] / rows[n] if rows[n] else None} for n in names}})
    return out


def kv_fit(calls: list[dict]) -> list[dict]:
    """Per call logged under planner state ``"kv"`` or ``"rows_kv"`` (observations with context tokens): its timed
    steps, their context tokens (first, last), and the least-squares slope of step ms on context tokens within modes
    (each mode's timed steps less their own means; ms per 1,000 tokens, None with fewer than 3 steps or no spread) —
    the whole call's estimate of what ``StepPlanner.kv_slope`` tracks online."""
    out = []
    for c in calls:
        obs = [(e[1], e[5], e[3]) for e in c["log"][1:] if e[0] == "o" and len(e) == 6 and e[3] is not None]
        sxx = sxy = 0.0
        for m in {m for m, _, _ in obs}:
            xs, ts = [x for k, x, _ in obs if k == m], [t for k, _, t in obs if k == m]
            mx, mt = statistics.fmean(xs), statistics.fmean(ts)
            sxx += sum((x - mx) ** 2 for x in xs)
            sxy += sum((x - mx) * (t - mt) for x, t in zip(xs, ts))
        out.append({"tag": c.get("tag"), "timed_steps": len(obs), "kv_first": obs[0][1] if obs else None,
                    "kv_last": obs[-1][1] if obs else None,
                    "ms_per_1k_tokens": 1e3 * sxy / sxx if len(obs) >= 3 and sxx > 0 else None})
    return out


def leads(calls: list[dict], slow: float = 0.02) -> list[dict]:
    """The leads of paired modes (``StepPlanner.observe_paired`` and ``_lead``: the run mode's committed tokens per
    request less those of the largest mode paired on its step, and each paired mode's less the largest smaller mode
    paired before it on the same step, e.g. the chain of 4's over the chain of 2 on a step of the chain of 8 or of a
    tree; a reference ranking above the lead's present one replaces it and the average starts again, one ranking below
    is not used), replayed over ``calls`` in log order and carried from call to call as infer.bench's planner carries
    them (per ``tag.label`` and ``tag.run``; a ``"warmup"`` pass starts from the state before it and its end is
    dropped: infer.bench restores the planner's memory after it), two ways: each step weighed alike
    (``max(slow, 1 / n)``, states ``"steps"`` and ``"kv"``) and each step weighed by its live requests r
    (``max(1 − (1 − slow)^(r / R), r / W)``, R the most requests a step had, W the requests of the lead's steps so
    far: state ``"rows_kv"``, ``StepPlanner._weight``).

    Returns:
        Per call, ``{"tag", "steps": {mode: lead}, "rows": {mode: lead}}`` at the call's end (mode as ``chain:N`` or
        ``tree:N``, tokens per request per step; only modes with a lead so far).
    """
    book, out = {}, []  # (label, run) -> _pass_start's; its state {"steps" | "rows": {mode: (ref, lead, n, W)}, "rmax"}
    for c in calls:
        entry = _pass_start(book, c, {"steps": {}, "rows": {}, "rmax": 1})
        had = entry["state"]
        state = {"steps": dict(had["steps"]), "rows": dict(had["rows"]), "rmax": had["rmax"]}
        names = c["log"][0]
        run, paired = None, {}  # (mode, tokens) of the step observed last; its paired modes' tokens
        for e in c["log"][1:]:
            if e[0] == "o":
                state["rmax"] = max(state["rmax"], e[4])
                run, paired = (names[e[1]], e[2]), {}
            elif e[0] == "p" and run is not None:
                m, x, r = names[e[1]], e[2], max(e[4], 1)
                if not run[0].startswith("ar:") and run[0] != m:
                    _lead_step(state, run[0], m, run[1] - x, r, slow)
                below = [i for i in paired if _rank(i) < _rank(m)]
                if below:
                    ref = max(below, key=_rank)
                    _lead_step(state, m, ref, x - paired[ref], r, slow)
                paired[m] = x
        entry["state"] = state
        out.append({"tag": c.get("tag"),
                    **{how: {m: state[how][m][1] for m in sorted(state[how], key=_rank)} for how in ("steps", "rows")}})
    return out


def _pass_start(book: dict, call: dict, init) -> dict:
    """The planner memory a call of ``infer.bench`` starts from, per ``tag.label`` and ``tag.run`` (``book``: {(label,
    run): {"state", "saved", "last"}}; ``init`` for a planner's first call): a task's warm-up passes (one per turn)
    start from the state after the previous task's timed passes and carry from turn to turn, then its timed passes
    start from that state again (infer.bench restores the memory after the warm-up). Returns the entry: read
    ``entry["state"]`` and set it to the call's end state; a caller may keep state that every pass carries under
    other keys of it (:func:`state_replay`'s ``"costs"``)."""
    tag = call.get("tag") if isinstance(call.get("tag"), dict) else {}
    entry = book.setdefault((tag.get("label"), tag.get("run")), {"state": init, "saved": init, "last": None})
    if tag.get("pass") == "warmup" and entry["last"] != "warmup":
        entry["saved"] = entry["state"]
    elif tag.get("pass") != "warmup" and entry["last"] == "warmup":
        entry["state"] = entry["saved"]
    entry["last"] = tag.get("pass")
    return entry


def _mode(name: str) -> tuple[str, int]:
    """A logged mode name (``ar:1``, ``chain:N``, ``tree:N``) as the planner's mode tuple."""
    kind, n = name.split(":")
    return kind, int(n)


def _rank(name: str) -> tuple[bool, int]:
    """``infer.planner._lead_rank`` of a logged mode name (``chain:N``, ``tree:N``): chains below trees, by size."""
    kind, n = _mode(name)
    return kind == "tree", n


def _lead_step(state: dict, mode: str, ref: str, diff: float, rows: int, slow: float) -> None:
    """:func:`leads`' ``StepPlanner._lead``: one paired step's ``diff`` (``mode``'s tokens less ``ref``'s, logged mode
    names) into ``mode``'s lead, both weighings (``state``: {"steps" | "rows": {mode: (ref, lead, steps,
    requests)}, "rmax": R})."""
    for how in ("steps", "rows"):
        lead = state[how]
        cur = lead.get(mode)
        if cur is not None and cur[0] != ref:
            if _rank(ref) < _rank(cur[0]):
                continue
            cur = None
        _, x, n, w = cur if cur is not None else (ref, 0.0, 0, 0.0)
        n, w = n + 1, w + rows
        k = max(slow, 1 / n) if how == "steps" else max(1 - (1 - slow) ** (rows / state["rmax"]), rows / w)
        lead[mode] = (ref, diff if n == 1 else x + k * (diff - x), n, w)


def state_replay(calls: list[dict], state: str) -> list[dict]:
    """One planner's observations (its ``o`` and ``p`` records) fed in log order to a ``StepPlanner`` of ``state``
    (``infer.planner.PLAN_STATES``), its acceptance and cost state carried from call to call as ``infer.bench`` carries
    them (each task's passes start from the acceptance after the previous task's timed passes: its warm-up passes
    for every turn first, then its timed ones), and each call's opening estimates, before any of its steps: what that
    state would have judged the call's first choice on. Under the state the log was written with it reproduces the
    logged estimates (the observations do not depend on the state; the choices they came from do, so later calls
    drift from what that state would have run). Each ``tag.label`` and ``tag.run`` is carried apart; give every pass.

    Returns:
        Per call with a first choice that logged estimates, ``{"tag", "logged", "replayed", "chose", "pick"}``:
        ``logged`` and ``replayed`` the committed tokens per request per mode (``{name: tokens}``), ``chose`` the
        mode the call chose first and ``pick`` the mode of the highest rate with the replayed estimates at the logged
        prices (each mode's logged rate × replayed ÷ logged estimate: under the drain rule its logged factor, not
        one mapped again).
    """
    from infer.planner import StepPlanner

    book, out = {}, []
    for c in calls:
        names = c["log"][0]
        modes = [_mode(n) for n in names]
        entry = _pass_start(book, c, None)
        # the cost state carries through warm-ups too (infer.bench restores the acceptance only)
        tokens, costs = entry["state"], entry.get("costs")
        p = StepPlanner({m: 1.0 for m in modes}, state=state)  # (unit table: the ratios are the step times)
        if costs is not None:
            p.load_cost_state(costs)
        if tokens is not None:
            p.load_token_state(tokens)
        first = next((e for e in c["log"][1:] if e[0] == "c" and len(e) == 8 and e[5] and e[6]), None)
        if first is not None:
            est = p.expected()
            rates = {n: r * est[m] / x for n, m, r, x in zip(names, modes, first[5], first[6]) if r and x and est.get(m)}
            out.append({"tag": c.get("tag"), "chose": names[first[2]], "pick": max(rates, key=rates.get),
                        "logged": {n: x for n, x in zip(names, first[6]) if x is not None},
                        "replayed": {n: est[m] for n, m in zip(names, modes) if est.get(m) is not None}})
        for e in c["log"][1:]:
            if e[0] == "o":
                p.observe(modes[e[1]], e[2], e[3], e[4])
            elif e[0] == "p":
                p.observe_paired(modes[e[1]], e[2], e[4])
        entry["state"], entry["costs"] = p.token_state(), p.cost_state()
    return out


def cost_replay(calls: list[dict], share: float, decay: float = 0.1) -> list[dict]:
    """The planner's online step-time model (``StepPlanner.observe``: a timed step moves its mode's estimate by
    ``decay`` × the log residual, clipped to ``LOG_CLIP``) replayed over ``calls`` in log order, with every other mode's
    estimate moved by ``share`` × that step too (``share`` 0: the planner's rule, which leaves a mode's step time where
    it was while the mode does not run). A mode starts from its step time at the first judged choice of a call
    (estimate ÷ rate) that has one, and starts again there until it has been timed ``FIRST_TIMED`` times (the planner
    takes the median of its first timings); a mode without one is left out. Give one planner's calls (one
    ``--label``, every pass: the planner carries its cost state from call to call).

    Returns:
        Per call, ``{"tag", "replayed", "logged"}``: each mode's step milliseconds at the call's first judged choice
        (a choice outside the drain rule with rates and estimates) as replayed and as logged (None: no such choice).
    """
    def judged(c):
        e = next((e for e in c["log"][1:] if e[0] == "c" and len(e) == 8 and not e[3] and e[5] and e[6]), None)
        return None if e is None else {i: t / r for i, (r, t) in enumerate(zip(e[5], e[6])) if r and t}

    cost, timed, out = {}, Counter(), []
    for c in calls:
        logged = judged(c) or {}
        cost.update({k: v for k, v in logged.items() if timed[k] < FIRST_TIMED})
        out.append({"tag": c.get("tag"), "replayed": dict(cost) or None, "logged": logged or None})
        for e in c["log"][1:]:
            if e[0] == "o" and e[3] and e[1] in cost:
                timed[e[1]] += 1
                step = decay * min(max(math.log(e[3] / cost[e[1]]), -LOG_CLIP), LOG_CLIP)
                for k in cost:
                    cost[k] *= math.exp(step if k == e[1] else share * step)
    names = calls[0]["log"][0] if calls else []
    return [{**r, **{k: None if r[k] is None else {names[i]: v for i, v in r[k].items()} for k in ("replayed", "logged")}}
            for r in out]


def _true_remaining(refresh: list, i: int, slot: int, last_step: int) -> float:
    """Slot ``slot``'s request's remaining tokens at drain refresh ``refresh[i]`` as its later refreshes show them:
    what it committed up to its last refresh alive, plus, finished before the next refresh, half that interval's steps
    at its chain tokens per step (or all its steps to the call's last step, live at the call's last refresh), at
    most what it had left (an estimate: the log has no finishing step)."""
    r0 = refresh[i][2][slot]
    j = i
    while (j + 1 < len(refresh) and refresh[j + 1][2][slot][0] > 0
           and refresh[j + 1][2][slot][2] >= refresh[j][2][slot][2]):
        j += 1
    rj = refresh[j][2][slot]
    rate = max(rj[1] / rj[2], 1.0) if rj[2] else 1.0
    steps = (refresh[j + 1][1] - refresh[j][1]) / 2 if j + 1 < len(refresh) else last_step + 1 - refresh[j][1]
    return r0[0] - rj[0] + min(rj[0], steps * rate)


def drain_finish(calls: list[dict], least: float = 0.97, min_live: int = 4) -> list[dict]:
    """The drain rule's tokens for the batch's last request against what it realized, where the log shows it: at each
    drain refresh after which the call ran one speculative mode for at least ``least`` of its choices, with at least
    ``min_live`` live requests, the largest true remaining tokens of the live requests (:func:`_true_remaining`)
    ÷ the steps the call took after the refresh (the tokens per step the last request committed under that mode, in
    AR steps' units: AR would take the largest remaining's steps) against the mode's estimate at the refresh's choice
    (before the mapping) and :func:`infer.planner.drain_tokens` replayed on the refresh with drain model
    ``"persist"`` (the default): the spread from :func:`persistent_spread` and the prior carried from call to call,
    ``DEFAULT_SPREAD_REL`` before the first. Give one planner's calls in log order (one ``--label``, every pass, a
    log that starts at the engine's first call at that batch size and temperature). Requests that end on EOS make the
    realized figure read above the mapped one even with the spread right: the rule takes each request's remaining as
    ``max_new_tokens`` less what it committed.

    Returns:
        One row per call with such refreshes, ``{"tag", "mode", "refreshes", "realized", "estimate", "mapped",
        "steps"}``: the mode that ran, and the medians over the refreshes of the realized and estimated tokens, the
        replayed mapping and the steps left.
    """
    prior: dict = {}
    out = []
    for c in calls:
        key = (c["batch"], c["temperature"])
        names = c["log"][0]
        table = [_mode(n) for n in names]
        events = c["log"][1:]
        refresh = [e for e in events if e[0] == "d"]
        choices = [e for e in events if e[0] == "c"]
        last = max((e[1] for e in choices), default=0)
        snaps: dict = {}
        spread = None
        p0 = prior.get(key, DEFAULT_SPREAD_REL)
        rows = {}
        for i, d in enumerate(refresh):
            persist = persistent_spread(d[2], snaps, PERSIST_EARLY)
            stats = drain_spread(d[2])
            if stats[3] and stats[0] > 0:
                spread = persist_variance(persist, p0, stats[0]) / stats[0] ** 2
            rest = Counter(names[e[2]] for e in choices if e[1] >= d[1])
            mode, n = rest.most_common(1)[0] if rest else (None, 0)
            live = [b for b, r in enumerate(d[2]) if r[0] > 0]
            choice = next((e for e in choices if e[1] >= d[1]), None)
            if (mode is None or mode.startswith("ar") or n < least * sum(rest.values()) or len(live) < min_live
                    or choice is None or len(choice) < 8 or not choice[6] or choice[6][names.index(mode)] is None):
                continue
            m = table[names.index(mode)]
            raw = dict(zip(table, choice[6]))
            mapped = drain_tokens(raw, [tuple(r) + (0,) * (4 - len(r)) for r in d[2]], table, p0, False, persist,
                                  stats)[m]
            left = last + 1 - d[1]
            rows.setdefault(mode, []).append((max(_true_remaining(refresh, i, b, last) for b in live) / left, raw[m],
                                              mapped, left))
        prior[key] = spread if spread is not None else p0
        for mode, v in rows.items():
            med = lambda k: statistics.median(x[k] for x in v)  # noqa: E731, B023
            out.append({"tag": c.get("tag"), "mode": mode, "refreshes": len(v), "realized": med(0), "estimate": med(1),
                        "mapped": med(2), "steps": med(3)})
    return out


def refresh_timing(calls: list[dict], over: float) -> dict:
    """The timed steps' milliseconds per mode, split by when the step was chosen: with a drain refresh (a choice at
    the step of a ``"d"`` event: the host mapped the batch just before the launch), under the drain rule otherwise,
    or while prompts waited (``queue``). Choices and observations are paired as :meth:`StepPlanner.observe` pairs
    them (:func:`_matched`).

    Args:
        calls: :func:`read_log`'s records.
        over: the threshold, milliseconds, of ``over_share``.
    Returns:
        ``{mode name: {"refresh" | "drain" | "queue": {"steps", "median_ms", "p90_ms", "over_share"}}}``, the 90th
        percentile the value at index ⌊0.9 n⌋ of the sorted times; a group without timed steps is left out.
    Raises:
        ValueError: ``over`` not above 0.
    """
    if not over > 0:
        raise ValueError(f"refresh_timing: over {over} must be above 0 ms")
    times: dict = {}
    for c in calls:
        names = c["log"][0]
        refreshed = {e[1] for e in c["log"][1:] if e[0] == "d"}
        for choice, obs in _matched(c):
            if not obs[3]:
                continue
            group = "refresh" if choice[1] in refreshed else "drain" if choice[3] else "queue"
            times.setdefault(names[choice[2]], {}).setdefault(group, []).append(obs[3])
    out = {}
    for mode, groups in sorted(times.items()):
        out[mode] = {}
        for group in ("refresh", "drain", "queue"):
            v = sorted(groups.get(group, []))
            if v:
                out[mode][group] = {"steps": len(v), "median_ms": statistics.median(v),
                                    "p90_ms": v[int(0.9 * len(v))], "over_share": sum(x > over for x in v) / len(v)}
    return out


def _where(tag, keys=("label", "task", "turn", "pass")) -> str:
    """A call's tag as the per-call lines print it: its ``keys`` present, joined by spaces ("?" with none)."""
    tag = tag or {}
    return " ".join(str(tag[k]) for k in keys if k in tag) or "?"


def _print(s: dict) -> None:
    print(f"{s['calls']} calls, {s['steps']} steps")
    print(f"{'mode':>9} {'steps':>7} {'drain':>7} {'probes':>7} {'timed':>7} {'tok/ms':>8}")
    for n, m in s["modes"].items():
        rate = "-" if m["tok_per_ms"] is None else f"{m['tok_per_ms']:.3f}"
        print(f"{n:>9} {m['steps']:>7} {m['drain_steps']:>7} {m['probes']:>7} {m['timed']:>7} {rate:>8}")
    if s["calibration"]:
        print("outside the drain rule, judged -> realized tok/ms: " + ", ".join(
            f"{n} {c['judged_tok_per_ms']:.3f} -> {c['realized_tok_per_ms']:.3f} ({c['steps']})"
            for n, c in s["calibration"].items()))
    d = s["drain_choices"]
    print(f"drain choices {d['n']}: judged best {d['best']}, median judged tok/ms {d['median_rate']}")
    for n, b in s["drain_by_rows"].items():
        if b:
            print(f"  drain, {n} by live requests: " + ", ".join(f"{k}: {v['tok_per_ms']:.3f} tok/ms ({v['steps']})"
                                                             for k, v in b.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--pass", dest="phase", default=None, choices=["start", "warmup", "timed"],
                    help="keep the calls infer.bench tagged with this pass (tag.pass)")
    ap.add_argument("--label", default=None, help="keep the calls of this infer.bench draft label (tag.label)")
    ap.add_argument("--run", default=None, help="keep the calls of this infer.bench invocation (tag.run; a log appended "
                                                "to by several runs lists their ids)")
    ap.add_argument("--json", default=None, help="write the summaries here too (refused if it exists)")
    ap.add_argument("--per-call", action="store_true",
                    help="also: per call, its choices, its first 20 choices and its steps with at most 4 live "
                         "requests (per_call())")
    ap.add_argument("--refresh-timing", type=float, default=None, metavar="MS",
                    help="also: the timed steps' milliseconds per mode, chosen with a drain refresh, under the drain "
                         "rule otherwise, or while prompts waited, with the share over MS (refresh_timing())")
    ap.add_argument("--persistence", type=int, default=None, metavar="N",
                    help="also: per call, how much of the requests' spread in acceptance over their first N chain steps "
                         "persists to the rest of their answers (persistence())")
    ap.add_argument("--cost-share", type=float, default=None, metavar="S",
                    help="also: each call's step times at its first judged choice, the planner's step-time model "
                         "replayed with the modes not run following a run mode's drift by the share S (0: as logged; "
                         "keep one --label and every pass: cost_replay())")
    ap.add_argument("--kv", action="store_true",
                    help="also: per call, its timed steps' context tokens and the within-mode slope of step ms on them "
                         "(kv_fit(); logs of planner state kv or rows_kv)")
    ap.add_argument("--drain-finish", action="store_true",
                    help="also: per call, where the rest of the call ran one speculative mode, the tokens per step "
                         "its last request realized against the drain rule's mapping replayed (keep one --label and "
                         "every pass: drain_finish())")
    ap.add_argument("--leads", action="store_true",
                    help="also: per call, each paired mode's lead (a chain's over its paired narrower chain) at the "
                         "call's end, replayed with steps weighed alike and by live requests (leads(); every pass, "
                         "each --label carried apart)")
    ap.add_argument("--replay-state", default=None, choices=list(PLAN_STATES), metavar="STATE",
                    help="also: one planner's observations replayed under planner state STATE (steps, kv, rows_kv), "
                         "each call's opening estimates as logged and as replayed (state_replay(); every pass, each "
                         "--label carried apart)")
    ap.add_argument("--estimates", action="store_true",
                    help="also: per call and mode, the mean estimated committed tokens per request (before the drain "
                         "rule) and confidence against the committed tokens of its steps (estimates(); logs from "
                         "2026-12-07 on)")
    args = ap.parse_args(argv)
    try:
        if args.json and Path(args.json).exists():
            raise ValueError(f"--json {args.json}: exists (not overwritten)")
        if args.json and not Path(args.json).resolve().parent.is_dir():
            raise ValueError(f"--json {args.json}: no folder {Path(args.json).parent}")
        if args.refresh_timing is not None and not args.refresh_timing > 0:
            raise ValueError(f"--refresh-timing {args.refresh_timing}: give a threshold above 0 ms")
        if args.cost_share is not None and not 0 <= args.cost_share <= 1:
            raise ValueError(f"--cost-share {args.cost_share}: give a share in 0..1")
        if args.persistence is not None and args.persistence < 1:
            raise ValueError(f"--persistence {args.persistence}: give at least 1 chain step")
        calls = read_log(args.log)
        tags = {k: v for k, v in (("pass", args.phase), ("label", args.label), ("run", args.run))
                if v}  # infer.bench's tag keys kept
        for k, v in tags.items():
            # a run id exists since 2026-12-07: a log appended to before and after holds calls with and without one
            check = any if k == "run" else all
            if not check(isinstance(c.get("tag"), dict) and k in c["tag"] for c in calls):
                raise ValueError(f"--{k} {v}: {args.log} has calls without a tag.{k} (logged without "
                                 "infer.bench, or before tags were written)")
    except ValueError as e:
        print(f"plan_log: {e}", file=sys.stderr)
        return 2
    keep = [c for c in calls if (args.batch is None or c["batch"] == args.batch)
            and (args.temperature is None or c["temperature"] == args.temperature)
            and all(isinstance(c.get("tag"), dict) and c["tag"].get(k) == v for k, v in tags.items())]
    if not keep:
        print(f"plan_log: no call in {args.log} at batch {args.batch}, temperature {args.temperature}, pass "
              f"{args.phase}, label {args.label}" + (f", run {args.run}" if args.run else ""), file=sys.stderr)
        return 2
    # calls without a run id (an infer.bench before 2026-12-07, or no infer.bench) count as one more run
    runs = list(dict.fromkeys(c["tag"]["run"] if isinstance(c.get("tag"), dict) and "run" in c["tag"] else "untagged"
                              for c in keep))
    if len(runs) > 1:  # one file appended to by several infer.bench invocations: their calls would pool
        print(f"plan_log: note: {args.log} holds the calls of {len(runs)} infer.bench runs ({', '.join(runs)}); the "
              "summaries pool them: --run ID keeps one", file=sys.stderr)
    out = []
    # a point: batch, temperature and the planner's modes (runs of one point with other modes, e.g. --invariant or
    # another --plan-trees, are summarised apart)
    points = sorted({(c["batch"], c["temperature"], tuple(c["log"][0])) for c in keep}, key=lambda p: (p[1], p[0], p[2]))
    for b, t, modes in points:
        group = [c for c in keep if (c["batch"], c["temperature"], tuple(c["log"][0])) == (b, t, modes)]
        s = summarize(group)
        several = sum((q[0], q[1]) == (b, t) for q in points) > 1
        print(f"== batch {b}, temperature {t}" + (f", modes {'/'.join(modes)}" if several else ""))
        _print(s)
        row = {"batch": b, "temperature": t, "mode_names": list(modes), **s}
        if args.persistence is not None:
            row["persistence"] = persistence(group, args.persistence)
            print(f"persistence (first {args.persistence} chain steps against the rest), per call: requests, steps "
                  "early/late, early mean, var, cov, corr, slope, shares")
            for q in row["persistence"]:
                tag = q["tag"] or {}
                print(f"  {tag.get('task', '?')} {tag.get('turn', '')}: {q['requests']}, {q['early_steps']:.0f}/"
                      f"{q['late_steps']:.0f}, {q['early_mean']:.3f}, {q['early_var']:.4f}, {q['cov']:.4f}, "
                      f"{q['corr']}, {q['slope']}, {q['shares']}")
        if args.cost_share is not None:
            row["cost_replay"] = cost_replay(group, args.cost_share)
            print(f"step ms at each call's first judged choice, replayed with share {args.cost_share:g} / logged:")
            for q in row["cost_replay"]:
                tag, rep, got = q["tag"] or {}, q["replayed"] or {}, q["logged"] or {}
                print(f"  {tag.get('task', '?')} {tag.get('turn', '')} {tag.get('pass', '')}: " + ", ".join(
                    f"{n} {rep[n]:.3f}/" + (f"{got[n]:.3f}" if n in got else "-") for n in rep))
        if args.per_call:
            row["per_call"] = per_call(group)
            print("per call: steps, wall s, choices; the first 20 choices; the steps with at most 4 live requests "
                  "(modes, mean tokens)")
            for q in row["per_call"]:
                where = _where(q["tag"])
                tok = "–" if q["tail_tokens"] is None else f"{q['tail_tokens']:.2f}"
                print(f"  {where}: {q['steps']}, {q['wall_s']}, {q['modes']}; {q['opening']}; "
                      f"{q['tail_steps']} {q['tail_modes']} {tok}")
        if args.kv:
            row["kv_fit"] = kv_fit(group)
            print("per call: timed steps with context tokens, tokens first -> last, step ms per 1,000 tokens")
            for q in row["kv_fit"]:
                slope = "-" if q["ms_per_1k_tokens"] is None else f"{q['ms_per_1k_tokens']:.4f}"
                print(f"  {_where(q['tag'])}: {q['timed_steps']}, {q['kv_first']} -> {q['kv_last']}, {slope}")
        if args.leads:
            row["leads"] = leads(group)
            print("per call: each paired mode's lead over its reference (a chain's: the widest narrower chain paired "
                  "on its steps) at the call's end, steps weighed alike / by their live requests")
            for q in row["leads"]:
                print(f"  {_where(q['tag'])}: " + ", ".join(f"{m} {x:.3f}/{q['rows'][m]:.3f}" for m, x in q["steps"].items()))
            if not any(e[0] == "p" for c in group for e in c["log"][1:]):
                print("  (no paired observations in these calls: no lead to replay; logs written before the engine "
                      "logged them lack them)")
        if args.replay_state is not None:
            row["state_replay"] = state_replay(group, args.replay_state)
            print(f"per call: its first choice's estimates as logged -> its choice; replayed under state "
                  f"{args.replay_state} -> the best rate at the logged prices")
            for q in row["state_replay"]:
                fmt = lambda d: ", ".join(f"{n} {x:.3f}" for n, x in d.items() if not n.startswith("ar"))  # noqa: E731
                print(f"  {_where(q['tag'])}: {fmt(q['logged'])} -> {q['chose']}; {fmt(q['replayed'])} -> {q['pick']}")
        if args.estimates:
            row["estimates"] = estimates(group)
            print("per call and mode: mean estimate / mean confidence -> realized committed tokens per request "
                  "(observed steps)")
            fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
            for q in row["estimates"]:
                print(f"  {_where(q['tag'])}: " + ", ".join(
                    f"{n} {fmt(m['estimate'])}/{fmt(m['confidence'])} -> {fmt(m['realized'])} ({m['steps']})"
                    for n, m in q["modes"].items() if m["choices"] or m["steps"]))
            old = sum(not q["logged"] for q in row["estimates"])
            if old:
                print(f"  ({old} of {len(row['estimates'])} calls logged without estimates: written by an engine "
                      "before commit 3947ddd)")
        if args.drain_finish:
            row["drain_finish"] = drain_finish(group)
            print("drain refreshes followed by one speculative mode: the last request's realized tokens per step / "
                  "the mode's estimate / the drain rule's mapping replayed (refreshes, median steps left)")
            for q in row["drain_finish"]:
                print(f"  {_where(q['tag'], ('task', 'turn', 'pass'))} {q['mode']}: {q['realized']:.3f} / {q['estimate']:.3f} / {q['mapped']:.3f} "
                      f"({q['refreshes']}, {q['steps']:.0f})")
        if args.refresh_timing is not None:
            row["refresh_timing"] = refresh_timing(group, args.refresh_timing)
            print(f"timed steps by when chosen: steps, median ms, 90th percentile ms, share over {args.refresh_timing} ms")
            for mode, groups in row["refresh_timing"].items():
                print(f"  {mode:>9} " + "; ".join(f"{g} {v['steps']}, {v['median_ms']:.3f}, {v['p90_ms']:.3f}, "
                                                  f"{v['over_share']:.1%}" for g, v in groups.items()))
        out.append(row)
    if args.json:
        from dspine.provenance import command_line, utc_now

        devices = sorted({str(c.get("device", "unrecorded")) for c in keep})
        meta = {"command": command_line([__file__, *(argv if argv is not None else sys.argv[1:])]),
                "date": utc_now(), "device": ", ".join(devices),
                "gpu": ", ".join(d for d in devices if d not in ("cpu", "unrecorded")) or None,
                "what": "summary of a DSPINE_PLAN_LOG file (the device is the log's: where it was measured)"}
        Path(args.json).write_text(json.dumps({**meta, "log": args.log, "batch": args.batch,
                                               "temperature": args.temperature, "pass": args.phase,
                                               "label": args.label, "run": args.run, "points": out},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
