"""Summarise a planner step log (``DSPINE_PLAN_LOG=FILE``, ``infer.planner.StepPlanner.start_log``).

    python benchmarks/engine/plan_log.py FILE [--batch 32] [--temperature 0] [--json OUT]

Per logged call (one ``--budget auto`` generate call; infer.bench makes one per task and pass, the untimed
warm-up pass included) and for all of them together: the steps each mode ran in and out of the drain rule, the
probes, the tokens per millisecond each mode realized in its observed timed steps (committed tokens per live
request ÷ measured ms, so a batch's rate per request), and, for the choices made under the drain rule, how often
each mode was judged the best (the highest rate it was judged on), the median judged rates and the realized
rates by the number of live requests. ``--batch`` and
``--temperature`` keep only the calls at that concurrency and temperature.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path


def read_log(path: str | Path) -> list[dict]:
    """The JSON lines of a plan log (gzipped if its name ends in .gz). Raises ValueError naming the file and line
    of a line that is not a call record (``batch``, ``log``)."""
    calls = []
    text = gzip.decompress(Path(path).read_bytes()).decode() if str(path).endswith(".gz") else Path(path).read_text()
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict) or "batch" not in rec or not isinstance(rec.get("log"), list) or not rec["log"]:
            raise ValueError(f"{path}:{i}: not a plan-log record (needs 'batch' and a non-empty 'log')")
        calls.append(rec)
    return calls


def summarize(calls: list[dict]) -> dict:
    """Totals over ``calls`` (:func:`read_log`): ``{"calls", "steps", "modes": {name: {"steps", "drain_steps",
    "probes", "observed", "timed", "tokens", "ms", "tok_per_ms"}}, "drain_choices": {"n", "best": {name: count},
    "median_rate": {name: rate}}}``. A mode's ``tok_per_ms`` is its realized tokens per request over its timed
    steps' milliseconds (None without a timed step). Raises ValueError if the calls name different modes."""
    names = calls[0]["log"][0] if calls else []
    modes = {n: Counter() for n in names}
    drain_best: Counter = Counter()
    drain_rates = defaultdict(list)
    drain_n = steps = 0
    for rec in calls:
        if rec["log"][0] != names:
            raise ValueError(f"plan-log calls with different modes: {names} and {rec['log'][0]}")
        for e in rec["log"][1:]:
            if e[0] == "c":
                _, _, i, drain, loss, rates = e
                steps += 1
                m = modes[names[i]]
                m["steps"] += 1
                m["drain_steps"] += drain
                m["probes"] += loss is not None and loss > 0
                if drain and rates is not None:
                    drain_n += 1
                    known = [(r, j) for j, r in enumerate(rates) if r is not None]
                    drain_best[names[max(known)[1]]] += 1
                    for r, j in known:
                        drain_rates[names[j]].append(r)
            elif e[0] == "o":  # ("d": a drain refresh's requests, not summarised here)
                _, i, tokens, ms, rows = e
                m = modes[names[i]]
                m["observed"] += 1
                if ms is not None and ms > 0:
                    m["timed"] += 1
                    m["tokens"] += tokens
                    m["ms"] += ms
    out = {}
    bands = _drain_by_rows(calls, names)
    for n, m in modes.items():
        row = {k: m[k] for k in ("steps", "drain_steps", "probes", "observed", "timed")}
        row["tokens"], row["ms"] = round(m["tokens"], 3), round(m["ms"], 3)
        row["tok_per_ms"] = round(m["tokens"] / m["ms"], 4) if m["ms"] else None
        out[n] = row
    return {"calls": len(calls), "steps": steps, "modes": out, "drain_by_rows": bands,
            "drain_choices": {"n": drain_n, "best": dict(drain_best),
                              "median_rate": {n: round(statistics.median(v), 4) for n, v in drain_rates.items()}}}


ROW_BANDS = ((1, 1), (2, 4), (5, 12), (13, 1 << 30))  # live requests in an observed step


def _drain_by_rows(calls: list[dict], names: list[str]) -> dict:
    """Per mode and band of live requests (:data:`ROW_BANDS`), over the timed steps chosen under the drain rule:
    ``{name: {"1" | "2-4" | "5-12" | ">12": {"steps", "tok_per_ms"}}}``, realized tokens per live request ÷
    measured ms. An observation belongs to the oldest choice not yet observed of its mode (the planner's own
    rule, ``StepPlanner.observe``); with one live request it is the rate the drain rule judged that request on."""
    acc = {n: {} for n in names}
    for rec in calls:
        pending = []
        for e in rec["log"][1:]:
            if e[0] == "c":
                pending.append(e)
                continue
            if e[0] != "o":
                continue
            _, i, tokens, ms, rows = e
            while pending and pending[0][2] != i:
                pending.pop(0)
            if not pending:
                continue
            choice = pending.pop(0)
            if not choice[3] or ms is None or not ms > 0:
                continue
            lo, hi = next(b for b in ROW_BANDS if b[0] <= rows <= b[1])
            key = str(lo) if lo == hi else f">{lo - 1}" if hi == 1 << 30 else f"{lo}-{hi}"
            a = acc[names[i]].setdefault(key, [0, 0.0, 0.0])
            a[0] += 1
            a[1] += tokens
            a[2] += ms
    return {n: {k: {"steps": a[0], "tok_per_ms": round(a[1] / a[2], 4)} for k, a in b.items()} for n, b in acc.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--json", default=None, help="write the summary here too (refused if it exists)")
    ap.add_argument("--by-point", action="store_true",
                    help="one summary per (batch, temperature) of the calls kept, instead of one for all of them")
    args = ap.parse_args(argv)
    try:
        calls = read_log(args.log)
        if args.json and Path(args.json).exists():
            raise ValueError(f"--json {args.json}: exists (not overwritten)")
    except (OSError, ValueError) as e:
        print(f"plan_log: {e}", file=sys.stderr)
        return 2
    keep = [c for c in calls if (args.batch is None or c["batch"] == args.batch)
            and (args.temperature is None or c["temperature"] == args.temperature)]
    if not keep:
        print(f"plan_log: no call in {args.log} at batch {args.batch}, temperature {args.temperature}",
              file=sys.stderr)
        return 2
    if args.by_point:
        points = sorted({(c["batch"], c["temperature"]) for c in keep}, key=lambda p: (p[1], p[0]))
        out = []
        for b, t in points:
            print(f"== batch {b}, temperature {t}")
            s = summarize([c for c in keep if (c["batch"], c["temperature"]) == (b, t)])
            _print(s)
            out.append({"batch": b, "temperature": t, **s})
        if args.json:
            Path(args.json).write_text(json.dumps({"log": args.log, "points": out}, indent=1) + "\n")
        return 0
    s = summarize(keep)
    _print(s)
    if args.json:
        Path(args.json).write_text(json.dumps({"log": args.log, "batch": args.batch,
                                               "temperature": args.temperature, **s}, indent=1) + "\n")
    return 0


def _print(s: dict) -> None:
    print(f"{s['calls']} calls, {s['steps']} steps")
    print(f"{'mode':>9} {'steps':>7} {'drain':>7} {'probes':>7} {'timed':>7} {'tok/ms':>8}")
    for n, m in s["modes"].items():
        rate = "-" if m["tok_per_ms"] is None else f"{m['tok_per_ms']:.3f}"
        print(f"{n:>9} {m['steps']:>7} {m['drain_steps']:>7} {m['probes']:>7} {m['timed']:>7} {rate:>8}")
    d = s["drain_choices"]
    print(f"drain choices {d['n']}: judged best {d['best']}, median judged tok/ms {d['median_rate']}")
    for n, b in s["drain_by_rows"].items():
        if b:
            print(f"  drain, {n} by live requests: " + ", ".join(f"{k}: {v['tok_per_ms']:.3f} tok/ms ({v['steps']})"
                                                             for k, v in b.items()))


if __name__ == "__main__":
    sys.exit(main())
