"""benchmarks/engine/plan_log.py: the summary of a planner step log (DSPINE_PLAN_LOG) on hand-made logs."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.engine import plan_log

NAMES = ["ar:1", "chain:16", "tree:32"]
CALL = {"batch": 32, "prompts": 64, "temperature": 0.0, "max_new_tokens": 512, "steps": 6, "wall_s": 0.01,
        "tokens": 100, "tag": {"label": "p", "task": "gsm8k", "turn": 0, "pass": "timed"},
        "log": [NAMES,
                ["c", 0, 0, 0, 0.0, None],  # the decode's first step: no comparison
                ["c", 1, 1, 0, 0.5, [1.0, 1.5, None]],  # a probe of the chain
                ["o", 0, 1.0, 1.0, 32],
                ["d", 2, [[100, 30, 10], [0, 40, 12]]],  # a drain refresh: not summarised
                ["c", 2, 0, 1, 0.0, [1.0, 0.8, 0.9]],  # drain: AR judged best
                ["o", 1, 3.0, 2.0, 32],
                ["p", 2, 2.5, None, 32],  # a paired observation: replays read it, the summaries do not
                ["c", 3, 1, 1, 0.0, [1.0, 1.2, 0.9]],  # drain: the chain judged best
                ["o", 0, 1.0, None, 20],  # untimed: counted as observed, not in the rate
                ["c", 4, 1, 0, 0.0, [1.0, 1.1, 0.9]],  # the chain again, no longer under the drain rule
                ["s"],  # choice 3 is never observed (no live request in its step)
                ["o", 1, 2.0, 4.0, 1],  # choice 4's, one request live (without the skip: choice 3's)
                ["c", 5, 0, 1, 0.0, [None, None, None]]]}  # drain, no estimate: not judged


def _write(tmp_path, *calls, name="p.jsonl"):
    path = tmp_path / name
    text = "".join(json.dumps(c) + "\n" for c in calls)
    path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    return path


def test_summary_counts_rates_and_skips(tmp_path):
    s = plan_log.summarize([c for c in plan_log.read_log(_write(tmp_path, CALL, dict(CALL, batch=8)))
                            if c["batch"] == 32])
    assert (s["calls"], s["steps"]) == (1, 6)
    assert s["modes"]["ar:1"] == {"steps": 3, "drain_steps": 2, "probes": 0, "observed": 2, "timed": 1,
                                  "tokens": 1.0, "ms": 1.0, "tok_per_ms": 1.0}
    assert s["modes"]["chain:16"] == {"steps": 3, "drain_steps": 1, "probes": 1, "observed": 2, "timed": 2,
                                      "tokens": 5.0, "ms": 6.0, "tok_per_ms": 0.8333}
    assert s["modes"]["tree:32"]["steps"] == 0 and s["modes"]["tree:32"]["tok_per_ms"] is None
    assert s["drain_choices"] == {"n": 2, "best": {"ar:1": 1, "chain:16": 1},
                                  "median_rate": {"ar:1": 1.0, "chain:16": 1.0, "tree:32": 0.9}}
    # the last observation is choice 4's, outside the drain rule (the skip dropped choice 3, a drain choice): no
    # drain step was observed with a time
    assert s["drain_by_rows"] == {"ar:1": {}, "chain:16": {}, "tree:32": {}}
    # judged against realized outside the drain rule: the chain's probe (judged 1.5, 3 tokens in 2 ms) and choice 4
    # (judged 1.1, 2 tokens in 4 ms); AR's first step made no comparison, its drain step is left to drain_by_rows
    assert s["calibration"] == {"chain:16": {"steps": 2, "judged_tok_per_ms": 1.3, "realized_tok_per_ms": 0.8333}}


def test_main_per_point_pass_filter_and_gzip(tmp_path):
    path = _write(tmp_path, CALL, dict(CALL, temperature=1.0), dict(CALL, tag={"pass": "warmup"}), name="p.jsonl.gz")
    out = tmp_path / "s.json"
    assert plan_log.main([str(path), "--pass", "timed", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [(p["batch"], p["temperature"], p["calls"]) for p in d["points"]] == [(32, 0.0, 1), (32, 1.0, 1)]
    assert d["command"].startswith("python benchmarks/engine/plan_log.py ") and d["device"] == "unrecorded"
    assert d["gpu"] is None and d["date"]  # the log's device: these calls name none
    assert plan_log.main([str(path), "--json", str(out)]) == 2  # never overwritten
    out2 = tmp_path / "s2.json"
    assert plan_log.main([str(path), "--temperature", "0", "--json", str(out2)]) == 0
    assert json.loads(out2.read_text())["points"][0]["calls"] == 2  # the warm-up pass too


def test_label_filter_keeps_one_planner_of_an_ab_run(tmp_path):
    """--label: one log holds every planner label of an infer.bench run (an A/B): only that label's calls count."""
    other = dict(CALL, tag={**CALL["tag"], "label": "pe"}, log=[CALL["log"][0]] + CALL["log"][1:3])
    path = _write(tmp_path, CALL, other)
    outs = {}
    for label in (None, "p", "pe"):
        out = tmp_path / f"s-{label}.json"
        assert plan_log.main([str(path), "--json", str(out)] + (["--label", label] if label else [])) == 0
        outs[label] = json.loads(out.read_text())
    assert [outs[k]["points"][0]["calls"] for k in (None, "p", "pe")] == [2, 1, 1]
    assert outs["p"]["label"] == "p" and outs["p"]["points"][0]["steps"] != outs["pe"]["points"][0]["steps"]
    assert plan_log.main([str(path), "--label", "q"]) == 2  # no call of that label


def test_mixed_modes_are_summarised_per_point(tmp_path, capsys):
    other = dict(CALL, temperature=1.0, log=[["ar:1", "chain:16"], ["c", 0, 0, 0, 0.0, None]])
    assert plan_log.main([str(_write(tmp_path, CALL, other))]) == 0
    assert "== batch 32, temperature 1.0\n" in capsys.readouterr().out
    # the same batch and temperature with other modes (e.g. an --invariant run, no trees): summarised apart
    same = dict(other, temperature=0.0)
    out = tmp_path / "s.json"
    assert plan_log.main([str(_write(tmp_path, CALL, same)), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "== batch 32, temperature 0.0, modes ar:1/chain:16" in text and "modes ar:1/chain:16/tree:32" in text
    assert sorted(len(p["mode_names"]) for p in json.loads(out.read_text())["points"]) == [2, 3]
    with pytest.raises(ValueError, match="different modes"):
        plan_log.summarize([CALL, other])


@pytest.mark.parametrize("text, msg", [
    ("{oops\n", "p.jsonl:1: not JSON"),
    ('{"batch": 1}\n', "p.jsonl:1: not a plan-log record"),
    ("", "p.jsonl: no plan-log record in it"),
    (json.dumps(dict(CALL, log=[NAMES, ["c", 0, 7, 0, 0.0, None]])) + "\n", "p.jsonl:1: event 1 of the log: mode index 7 outside the 3"),
    (json.dumps(dict(CALL, log=[NAMES, ["o", 0, 1.0]])) + "\n", "p.jsonl:1: event 1 of the log: a 'o' event has 5 or 6 fields, this one 3"),
    (json.dumps(dict(CALL, log=[NAMES, ["o", 0, 1.0, 1.0, 0]])) + "\n", "live requests must be an integer >= 1, got 0"),
    (json.dumps(dict(CALL, log=[NAMES, ["c", 0, 0, 0, 0.0, [1.0]]])) + "\n", "rates must be None or one per mode"),
    (json.dumps(dict(CALL, log=[NAMES, ["x"]])) + "\n", "is not a list starting with"),
    (json.dumps(dict(CALL, batch="32")) + "\n", "p.jsonl:1: not a plan-log record (needs an integer 'batch'"),
    (json.dumps(dict(CALL, temperature=None)) + "\n", "p.jsonl:1: not a plan-log record"),
    (json.dumps(dict(CALL, log=[["ar:1", "ar:1"]])) + "\n", "the mode names, each once"),
    (json.dumps(dict(CALL, log=[NAMES, ["o", 0, "1", 1.0, 1]])) + "\n", "tokens must be a number >= 0"),
    (json.dumps(dict(CALL, log=[NAMES, ["o", 0, -3.0, 1.0, 1]])) + "\n", "tokens must be a number >= 0"),
    (json.dumps(dict(CALL, log=[NAMES, ["p", 5, 1.0, None, 1]])) + "\n", "mode index 5 outside the 3 modes"),
    (json.dumps(dict(CALL, log=[NAMES, ["p", 1, 1.0, None, 0]])) + "\n", "live requests must be an integer >= 1"),
    (json.dumps(dict(CALL, log=[NAMES, ["c", 0, 0, 0, "x", None]])) + "\n",
     "a choice's probe loss must be a finite number, got 'x'"),
    (json.dumps(dict(CALL, log=[NAMES, ["c", 0, 0, 0, 0.0, None, [1.0], None]])) + "\n",
     "estimates must be None or one per mode"),
    (json.dumps(dict(CALL, log=[NAMES, ["c", 0, 0, 0, 0.0, None, None, [1.0, "x", None]]])) + "\n",
     "must be finite numbers"),
    (json.dumps(dict(CALL, log=[NAMES, ["c", 0, 0, 0, 0.0, None, None]])) + "\n", "has 6 or 8 fields, this one 7"),
    (json.dumps(dict(CALL, log=[NAMES, ["c", 0, 0, 0, 0.0, None, [1.0, -2.0, None], None]])) + "\n",
     "estimates must be finite numbers >= 0 or None, got -2.0 for mode 1"),
    (json.dumps(dict(CALL, log=[NAMES, ["c", 0, 0, 0, 0.0, None, [1.0, 10**400, None], None]])) + "\n",
     "estimates must be finite numbers >= 0 or None, got 1000"),
    (json.dumps(dict(CALL, log=[NAMES, ["o", 0, 1.0, 1.0, 1], ["c", 1, 0, 0, 0.0, [1.0, True, None]]])) + "\n",
     "p.jsonl:1: event 2 of the log: a choice's rates must be finite numbers or None, got True for mode 1"),
    (json.dumps(dict(CALL, tag="p")) + "\n", "p.jsonl:1: the record's 'tag' must be an object"),
    ('{"batch": 32, "temperature": 0.0, "log": [["ar:1"], ["c", 0, 0, 0, 0.0, [NaN]]]}\n', "must be finite"),
])
def test_bad_records_are_named(tmp_path, capsys, text, msg):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    assert plan_log.main([str(path)]) == 2
    assert msg in capsys.readouterr().err


def test_bad_files_and_flags(tmp_path, capsys):
    good = _write(tmp_path, CALL)
    cases = [([str(tmp_path)], "a folder, not a plan log"),
             ([str(tmp_path / "none.jsonl")], "not readable as a plan log"),
             ([str(good), "--batch", "64"], "no call in"),
             ([str(good), "--json", str(tmp_path / "no" / "o.json")], "--json"),
             ([str(_write(tmp_path, dict(CALL, tag=None), name="t.jsonl")), "--pass", "timed"], "without a tag.pass"),
             ([str(_write(tmp_path, dict(CALL, tag={"pass": "timed"}), name="u.jsonl")), "--label", "p"],
              "without a tag.label")]
    plain = tmp_path / "x.gz"
    plain.write_text(json.dumps(CALL))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(json.dumps(CALL).encode())[:-12])
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe")
    cases += [([str(plain)], "x.gz: not readable as a plan log"), ([str(cut)], "cut.jsonl.gz: not readable"),
              ([str(binary)], "b.jsonl: not readable")]
    for argv, msg in cases:
        assert plan_log.main(argv) == 2, argv
        assert msg in capsys.readouterr().err, argv


def test_persistence_splits_each_request_at_its_early_steps_and_refills_start_a_new_one():
    """persistence(): per request the mean accepted tokens per chain step at the first refresh with >= early steps
    and over its steps after it; covariance across requests; a slot whose counts drop was refilled."""
    # refreshes: per slot [remaining, cumulative chain tokens, cumulative chain steps]
    log = [NAMES,
           ["c", 0, 1, 0, 0.0, None], ["c", 1, 1, 1, 0.0, None], ["c", 2, 0, 1, 0.0, None],
           ["d", 0, [[90, 6, 2], [90, 3, 2], [90, 5, 2]]],  # under 4 steps each: not yet early
           ["d", 8, [[80, 12, 4], [80, 6, 4], [80, 10, 4]]],  # early: a = 2, 0.5, 1.5
           ["d", 16, [[40, 24, 8], [40, 10, 8], [40, 18, 8]]],  # + 4 steps: late a = 2, 0, 1
           ["d", 24, [[0, 24, 8], [30, 12, 4], [20, 26, 12]]]]  # slot 1 refilled (steps 8 -> 4); slot 2 late grows
    s = plan_log.persistence([dict(CALL, log=log)], early=4)
    assert len(s) == 1
    q = s[0]
    # slot 0: early 2 (4 steps), late (24-12-4)/4 = 2; slot 1's first request: early 0.5, late (10-6-4)/4 = 0, its
    # second (refill) has 4 steps and no late window: left out; slot 2: early 1.5, late (26-10-8)/8 = 1
    e, lt = [2.0, 0.5, 1.5], [2.0, 0.0, 1.0]
    me, ml = sum(e) / 3, sum(lt) / 3
    cov = sum((x - me) * (y - ml) for x, y in zip(e, lt)) / 3
    ve = sum((x - me) ** 2 for x in e) / 3
    assert (q["requests"], q["early_steps"], q["late_steps"]) == (3, 4.0, pytest.approx(16 / 3, abs=0.05))
    assert q["early_mean"] == pytest.approx(me, abs=1e-4) and q["early_var"] == pytest.approx(ve, abs=1e-4)
    assert q["cov"] == pytest.approx(cov, abs=1e-4) and q["slope"] == pytest.approx(cov / ve, abs=1e-3)
    assert q["shares"] == {"chain:16": 1.0} and q["tag"]["task"] == "gsm8k"
    # nothing persists: late means unrelated to the early ones
    flat = [NAMES, ["d", 0, [[9, 8, 4], [9, 4, 4]]], ["d", 8, [[0, 16, 8], [0, 12, 8]]]]  # early 1, 0; late 1, 1
    assert plan_log.persistence([dict(CALL, log=flat)], early=4)[0]["cov"] == 0.0
    assert plan_log.persistence([dict(CALL, log=flat)], early=5) == []  # no request with 5 early and 5 late steps
    with pytest.raises(ValueError, match="early=0"):
        plan_log.persistence([CALL], early=0)


def test_persistence_flag_prints_and_writes_it(tmp_path, capsys):
    log = [NAMES, ["d", 0, [[9, 8, 4], [9, 4, 4]]], ["d", 8, [[0, 16, 8], [0, 12, 8]]]]
    out = tmp_path / "s.json"
    assert plan_log.main([str(_write(tmp_path, dict(CALL, log=log))), "--persistence", "4", "--json", str(out)]) == 0
    assert "persistence (first 4 chain steps" in capsys.readouterr().out
    assert json.loads(out.read_text())["points"][0]["persistence"][0]["requests"] == 2


@pytest.mark.parametrize("refresh, msg", [
    (5, "a drain refresh's requests must be a list"),
    ([[1, 2]], "a drain refresh's requests must be a list"),
    ([[1, 2, float("nan")]], "finite numbers"),
    ([[1, -2, 1]], "the counts >= 0"),
])
def test_bad_drain_refreshes_are_named(tmp_path, capsys, refresh, msg):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(dict(CALL, log=[NAMES, ["d", 0, refresh]])) + "\n")
    assert plan_log.main([str(path), "--persistence", "4"]) == 2
    assert msg in capsys.readouterr().err


def test_persistence_flag_below_one_is_refused_before_reading(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert plan_log.main([str(_write(tmp_path, CALL)), "--persistence", "0", "--json", str(out)]) == 2
    assert "--persistence 0: give at least 1" in capsys.readouterr().err and not out.exists()


def test_per_call_counts_the_opening_and_the_few_row_tail(tmp_path, capsys):
    """per_call: every choice per mode, the first ``opening`` of them, and the observed steps with at most
    ``tail_rows`` live requests (CALL: rows 32, 32, 20 and 1; the one-row step committed 2.0 of the chain)."""
    rows = plan_log.per_call(plan_log.read_log(_write(tmp_path, CALL)), opening=2, tail_rows=4)
    assert rows == [{"tag": CALL["tag"], "steps": 6, "wall_s": 0.01,
                     "modes": {"ar:1": 3, "chain:16": 3}, "opening": {"ar:1": 1, "chain:16": 1},
                     "tail_steps": 1, "tail_modes": {"chain:16": 1}, "tail_tokens": 2.0}]
    wide = plan_log.per_call(plan_log.read_log(_write(tmp_path, CALL, name="w.jsonl")), opening=99, tail_rows=20)[0]
    assert wide["opening"] == wide["modes"] and wide["tail_steps"] == 2 and wide["tail_tokens"] == 1.5
    with pytest.raises(ValueError, match="opening 0"):
        plan_log.per_call([], opening=0)
    out = tmp_path / "s.json"
    assert plan_log.main([str(_write(tmp_path, CALL, name="m.jsonl")), "--per-call", "--json", str(out)]) == 0
    assert "p gsm8k 0 timed: 6, 0.01" in capsys.readouterr().out
    assert json.loads(out.read_text())["points"][0]["per_call"][0]["tail_modes"] == {"chain:16": 1}


def test_refresh_timing_splits_steps_by_when_they_were_chosen(tmp_path, capsys):
    """refresh_timing: a choice at the step of a drain refresh ("d") is grouped "refresh", another under the drain
    rule "drain", one while prompts waited "queue"; untimed observations are left out."""
    call = dict(CALL, log=[["ar:1", "chain:16"],
                           ["d", 0, [[100, 0, 0, 0]]], ["c", 0, 1, 1, 0.0, None], ["o", 1, 2.0, 5.0, 32],
                           ["c", 1, 1, 1, 0.0, [1.0, 1.2]], ["o", 1, 2.0, 1.0, 32],
                           ["c", 2, 0, 0, 0.0, [1.0, 0.9]], ["o", 0, 1.0, 0.5, 32],
                           ["c", 3, 0, 0, 0.0, [1.0, 0.9]], ["o", 0, 1.0, None, 32]])
    t = plan_log.refresh_timing(plan_log.read_log(_write(tmp_path, call)), over=2.0)
    assert t == {"ar:1": {"queue": {"steps": 1, "median_ms": 0.5, "p90_ms": 0.5, "over_share": 0.0}},
                 "chain:16": {"refresh": {"steps": 1, "median_ms": 5.0, "p90_ms": 5.0, "over_share": 1.0},
                              "drain": {"steps": 1, "median_ms": 1.0, "p90_ms": 1.0, "over_share": 0.0}}}
    with pytest.raises(ValueError, match="over 0"):
        plan_log.refresh_timing([], over=0)
    assert plan_log.main([str(_write(tmp_path, call, name="r.jsonl")), "--refresh-timing", "0"]) == 2
    assert "give a threshold above 0 ms" in capsys.readouterr().err
    assert plan_log.main([str(_write(tmp_path, call, name="s.jsonl")), "--refresh-timing", "2"]) == 0
    assert "chain:16 refresh 1, 5.000, 5.000, 100.0%; drain 1, 1.000, 1.000, 0.0%" in capsys.readouterr().out


def test_estimates_against_what_the_steps_committed(tmp_path, capsys):
    """--estimates: per call and mode, the mean logged estimate and confidence against the committed tokens per
    request of the mode's observed steps (weighted by live requests); a log without the fields gives None."""
    log = [NAMES,
           ["c", 0, 1, 0, 0.0, None, None, None],  # the first mode's timing: nothing compared, nothing estimated
           ["o", 1, 3.0, 2.0, 30],
           ["c", 1, 1, 1, 0.0, [1.0, 1.2, None], [1.0, 2.0, None], [None, 2.5, None]],
           ["o", 1, 2.0, 2.0, 10],
           ["c", 2, 0, 1, 0.0, [1.0, 0.9, 0.8], [1.0, 3.0, 4.0], [None, 3.5, 4.5]],
           ["o", 0, 1.0, 1.0, 10]]
    path = _write(tmp_path, dict(CALL, log=log), CALL)
    new, old = plan_log.estimates(plan_log.read_log(path))
    chain, ar, tree = new["modes"]["chain:16"], new["modes"]["ar:1"], new["modes"]["tree:32"]
    assert (chain["choices"], chain["estimate"], chain["confidence"], chain["steps"]) == (2, 2.5, 3.0, 2)
    assert chain["realized"] == pytest.approx((3.0 * 30 + 2.0 * 10) / 40)
    assert (ar["estimate"], ar["confidence"], ar["realized"]) == (1.0, None, 1.0)
    assert (tree["choices"], tree["estimate"], tree["steps"], tree["realized"]) == (1, 4.0, 0, None)
    assert all(m["estimate"] is None and m["confidence"] is None for m in old["modes"].values())
    assert (new["logged"], old["logged"]) == (True, False)
    assert plan_log.main([str(path), "--estimates"]) == 0
    out = capsys.readouterr().out
    assert "chain:16 2.50/3.00 -> 2.75 (2)" in out and "(1 of 2 calls logged without estimates: written by an engine before commit 3947ddd)" in out


def test_a_record_after_a_torn_line_starts_on_its_own(tmp_path, capsys):
    """infer.planner.append_plan_record: after a run killed mid-write (a last line without its end) the next record
    starts on a new line, so only the torn line is unreadable and plan_log.py names it; a clean log gets no blank
    line."""
    from infer.planner import append_plan_record

    path = tmp_path / "p.jsonl"
    append_plan_record(str(path), CALL)
    append_plan_record(str(path), CALL)
    assert path.read_text().count("\n") == 2 and len(plan_log.read_log(path)) == 2
    with open(path, "a") as f:
        f.write(json.dumps(CALL)[:40])  # killed mid-write
    append_plan_record(str(path), CALL)
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[3]) == CALL
    assert plan_log.main([str(path)]) == 2
    assert "p.jsonl:3: not JSON" in capsys.readouterr().err


def test_a_log_of_two_runs_is_noted_and_run_keeps_one(tmp_path, capsys):
    """A log appended to by two infer.bench invocations (tag.run) pools them with a note naming both ids; --run keeps
    one; an id no call has finds nothing."""
    first, second = (dict(CALL, tag={**CALL["tag"], "run": r}) for r in ("20261207T010000-11", "20261207T020000-12"))
    path = _write(tmp_path, first, second)
    out = tmp_path / "all.json"
    assert plan_log.main([str(path), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["points"][0]["calls"] == 2
    err = capsys.readouterr().err
    assert "holds the calls of 2 infer.bench runs (20261207T010000-11, 20261207T020000-12)" in err and "--run" in err
    one = tmp_path / "one.json"
    assert plan_log.main([str(path), "--run", "20261207T020000-12", "--json", str(one)]) == 0
    d = json.loads(one.read_text())
    assert d["run"] == "20261207T020000-12" and d["points"][0]["calls"] == 1
    assert "runs (" not in capsys.readouterr().err
    assert plan_log.main([str(path), "--run", "x"]) == 2
    assert "run x" in capsys.readouterr().err
    assert plan_log.main([str(_write(tmp_path, CALL, name="old.jsonl")), "--run", "x"]) == 2  # no tag.run at all
    assert "has calls without a tag.run" in capsys.readouterr().err
    # a log written before run ids existed, then appended to by a run with one: noted, and --run picks the new run
    mixed = _write(tmp_path, CALL, second, name="mixed.jsonl")
    assert plan_log.main([str(mixed), "--json", str(tmp_path / "m.json")]) == 0
    assert "holds the calls of 2 infer.bench runs (untagged, 20261207T020000-12)" in capsys.readouterr().err
    assert plan_log.main([str(mixed), "--run", "20261207T020000-12", "--json", str(tmp_path / "m1.json")]) == 0
    assert json.loads((tmp_path / "m1.json").read_text())["points"][0]["calls"] == 1


def test_cost_replay_moves_the_modes_not_run_by_the_share():
    """plan_log.cost_replay: the planner's step-time rule replayed over the log (a timed step moves its mode by decay ×
    the clipped log residual); share 0 leaves a mode not run where it was, share 1 moves it by the same factor; a mode
    starts from the step time (estimate ÷ rate) of a call's first judged choice and starts again there until timed
    FIRST_TIMED times."""
    import math

    names = ["ar:1", "chain:4"]

    def call(task, obs):  # AR judged at 1 ms, the chain at 2 ms (2 tokens at 1 token/ms) on its first judged choice
        return {"batch": 8, "temperature": 0.0, "tag": {"task": task},
                "log": [names, ["c", 0, 1, 0, 0.0, [1.0, 1.0], [1.0, 2.0], None], *obs]}

    ar = [["o", 0, 1.0, 1.0, 8]] * 3  # AR timed three times where it was judged: no move
    timed = [["o", 1, 2.0, 2.5, 8]] * 3  # the chain at 2.5 ms: a log residual above LOG_CLIP, clipped
    calls = [call("a", ar + timed), call("b", [])]
    for share in (0.0, 1.0):
        rows = plan_log.cost_replay(calls, share)
        assert rows[0]["replayed"] == rows[0]["logged"] == {"ar:1": 1.0, "chain:4": 2.0}
        chain = 2.0
        for _ in range(3):
            chain *= math.exp(min(math.log(2.5 / chain), plan_log.LOG_CLIP) * 0.1)
        assert rows[1]["replayed"]["chain:4"] == pytest.approx(chain)  # timed 3 times: not taken from call b's log
        assert rows[1]["replayed"]["ar:1"] == pytest.approx(1.0 * (chain / 2.0) ** share)
        assert rows[1]["logged"] == {"ar:1": 1.0, "chain:4": 2.0}
    two = plan_log.cost_replay([call("a", timed[:2]), call("b", [])], 0.0)  # timed twice: starts again from b's log
    assert two[1]["replayed"]["chain:4"] == 2.0


def test_kv_fit_within_modes(tmp_path, capsys):
    """--kv: observations with context tokens (planner state kv / rows_kv); the slope is fitted within modes (AR at
    1,000-3,000 tokens and the chain at 1,000 / 3,000, both 0.5 ms per 1,000 tokens over different offsets: pooled
    across modes it would read 0.28); an untimed observation and one without tokens are left out."""
    log = [NAMES, ["c", 0, 0, 0, 0.0, None], ["o", 0, 1.0, 1.0, 4, 1000], ["o", 0, 1.0, 1.5, 4, 2000],
           ["o", 0, 1.0, 2.0, 4, 3000], ["o", 1, 3.0, 3.0, 4, 1000], ["o", 1, 3.0, 4.0, 4, 3000],
           ["o", 1, 3.0, None, 4, 9000], ["o", 1, 3.0, 9.0, 4]]
    path = _write(tmp_path, dict(CALL, log=log))
    (q,) = plan_log.kv_fit(plan_log.read_log(path))
    assert (q["timed_steps"], q["kv_first"], q["kv_last"]) == (5, 1000, 3000)
    assert q["ms_per_1k_tokens"] == pytest.approx(0.5)
    assert plan_log.main([str(path), "--kv"]) == 0
    assert "p gsm8k 0 timed: 5, 1000 -> 3000, 0.5000" in capsys.readouterr().out
    (old,) = plan_log.kv_fit(plan_log.read_log(_write(tmp_path, CALL, name="old.jsonl")))
    assert old["timed_steps"] == 0 and old["ms_per_1k_tokens"] is None
    bad = _write(tmp_path, dict(CALL, log=log[:2] + [["o", 0, 1.0, 1.0, 4, -5]]), name="bad.jsonl")
    with pytest.raises(ValueError, match="context tokens must be a number >= 0, got -5"):
        plan_log.read_log(bad)


def test_drain_finish_reads_the_last_requests_realized_tokens_against_the_replayed_mapping(tmp_path, capsys):
    from infer.planner import DEFAULT_SPREAD_REL, drain_spread, drain_tokens, persistent_spread

    first = [[20, 10, 5, 20]] * 3 + [[8, 10, 5, 20]]  # four live requests, chain tokens/steps 2.0
    chain = lambda step: ["c", step, 1, 1, 0.0, [0.5, 1.0], [1.0, 2.0], None]  # noqa: E731
    call = dict(CALL, tag={"label": "p", "task": "gsm8k", "turn": 0, "pass": "timed"},
                log=[["ar:1", "chain:4"], ["d", 0, first], *[chain(s) for s in range(8)],
                     ["d", 8, [[4, 22, 13, 50]] * 3 + [[0, 18, 9, 40]]], chain(8), chain(9)])
    rows = plan_log.drain_finish(plan_log.read_log(_write(tmp_path, call)))
    # refresh 8 has 3 live requests (< 4): only refresh 0 counts. Slots 0-2 committed 16 by refresh 8, then at most
    # 2 steps x 22/13 tokens (4 left); slot 3 finished within refresh 0's interval: at most 8. 10 steps left.
    assert len(rows) == 1 and rows[0]["mode"] == "chain:4" and rows[0]["refreshes"] == 1
    assert rows[0]["realized"] == pytest.approx((16 + 2 * 22 / 13) / 10) and rows[0]["estimate"] == 2.0
    table = [("ar", 1), ("chain", 4)]
    want = drain_tokens({("ar", 1): 1.0, ("chain", 4): 2.0}, [tuple(r) for r in first], table, DEFAULT_SPREAD_REL,
                        False, persistent_spread(first, {}), drain_spread(first))[("chain", 4)]
    assert rows[0]["mapped"] == pytest.approx(want) and rows[0]["steps"] == 10
    # the rest of a call mostly on AR: no row
    mostly_ar = dict(call, log=call["log"][:2] + [["c", s, 0, 1, 0.0, [0.5, 1.0], [1.0, 2.0], None] for s in range(9)])
    assert plan_log.drain_finish(plan_log.read_log(_write(tmp_path, mostly_ar, name="ar.jsonl"))) == []
    assert plan_log.main([str(_write(tmp_path, call, name="f.jsonl")), "--drain-finish"]) == 0
    assert "gsm8k 0 timed chain:4: 1.938 / 2.000 / " in capsys.readouterr().out


@pytest.mark.parametrize("state,how", [("steps", "steps"), ("rows_kv", "rows")])
def test_leads_replay_the_planners_own_lead(state, how):
    """--leads: the chain of 4's lead over the chain of 2 paired on its steps, replayed from the log, equals the lead
    the planner kept (StepPlanner._lead) under the state whose weighing it replays, across two calls; a tail of
    one-request steps with a small lead moves the per-step lead far and the per-request one little."""
    from infer.planner import StepPlanner

    table = {("ar", 1): 1.0, ("chain", 2): 1.2, ("chain", 4): 1.5}
    calls, carried = [], None
    for k in range(2):
        p = StepPlanner(table, state=state)
        if carried is not None:
            p.load_token_state(carried)
        p.start_log()
        for i in range(100):
            rows = 64 - i if i < 40 else 1  # a drained batch, then 60 steps of its last request
            run, pair = (3.0 + 0.1 * (i % 3), 1.9) if i < 40 else (1.95, 1.9)
            p.observe(("chain", 4), run, 2.0, rows, 1000.0 * rows if state != "steps" else None)
            p.observe_paired(("chain", 2), pair, rows)
        carried = p.token_state()
        calls.append(dict(CALL, tag={"label": "p", "task": "t", "turn": k, "pass": "timed"}, log=p.logged()))
        (q,) = plan_log.leads([calls[-1]]) if k == 0 else plan_log.leads(calls)[1:]
        assert q[how]["chain:4"] == pytest.approx(p.lead[("chain", 4)][1], rel=1e-3)
    steps, rows = plan_log.leads(calls)[-1]["steps"]["chain:4"], plan_log.leads(calls)[-1]["rows"]["chain:4"]
    assert steps < 0.5 < 0.9 < rows  # the tail's 0.05 against the batch's 1.1-1.3


def test_state_replay_reproduces_the_logged_openings_and_reweighs_them():
    """--replay-state: the observations of two tasks (a warm-up and a timed pass each, both starting from the state
    after the task before, as infer.bench runs them) fed to a planner of the logged state reproduce each call's
    logged opening estimates and first choice; under rows_kv the chain of 4's lead over the chain of 2 keeps the
    batch's value instead of its one-request tail's, and the best rate at the logged prices moves to the chain of 4."""
    from infer.planner import StepPlanner

    table = {("ar", 1): 1.0, ("chain", 2): 1.0, ("chain", 4): 1.5}
    calls, tokens, costs = [], None, None
    for task in ("gsm8k", "mbpp"):
        saved = tokens
        for phase in ("warmup", "timed"):
            p = StepPlanner(table)
            if costs is not None:
                p.load_cost_state(costs)
            if saved is not None:
                p.load_token_state(saved)
            p.start_log()
            p.choose()  # the opening choice, logged with its estimates once a cost state is loaded
            for i in range(100):
                rows = 64 - i if i < 40 else 1  # a drained batch, then 60 steps of its last request
                run, pair = (3.2, 1.9) if i < 40 else (1.95, 1.9)
                p.observe(("chain", 4), run, 1.5 if i < 40 else 1.6, rows)
                p.observe_paired(("chain", 2), pair, rows)
            tokens, costs = p.token_state(), p.cost_state()
            calls.append(dict(CALL, tag={"label": "p", "task": task, "turn": 0, "pass": phase}, log=p.logged()))
    steps = plan_log.state_replay(calls, "steps")
    # gsm8k's passes open with no acceptance yet (AR alone has an estimate), mbpp's from gsm8k's timed pass
    assert [(q["tag"]["task"], q["pick"], list(q["replayed"])) for q in steps[:2]] == [("gsm8k", "ar:1", ["ar:1"])] * 2
    for q in steps:
        assert q["replayed"] == pytest.approx(q["logged"], rel=1e-3)
    assert [(q["chose"], q["pick"]) for q in steps[2:]] == [("chain:2", "chain:2")] * 2
    rows = plan_log.state_replay(calls, "rows_kv")
    for q, s in zip(rows[2:], steps[2:]):
        assert q["replayed"]["chain:4"] > s["replayed"]["chain:4"] + 0.5 and q["pick"] == "chain:4"


def test_leads_replay_paired_modes_leads_per_label_and_drop_a_warmups_end(capsys, tmp_path):
    """--leads replays every lead the planner keeps: on a step of the chain of 8 or of a tree, the paired chain of 4's
    lead over the chain of 2 (StepPlanner.observe_paired) as well as the run mode's; each label's planner is carried
    apart, and a warmup pass's end is dropped (infer.bench restores the planner's memory after it)."""
    from infer.planner import StepPlanner

    table = {("ar", 1): 1.0, ("chain", 2): 1.2, ("chain", 4): 1.5, ("chain", 8): 2.0, ("tree", 16): 2.5}
    pairs = {("chain", 8): [("chain", 2), ("chain", 4)], ("tree", 16): [("chain", 2), ("chain", 4), ("chain", 8)],
             ("chain", 4): [("chain", 2)]}
    plans = {"a": [("chain", 8), ("tree", 16), ("chain", 4)], "b": [("chain", 4), ("tree", 16)]}
    calls, want, carried = [], [], {}
    for k, phase in enumerate(["timed", "warmup", "timed"]):
        for label, modes in plans.items():
            p = StepPlanner(table, state="rows_kv")
            if label in carried:
                p.load_token_state(carried[label])
            p.start_log()
            for i in range(30):
                mode, rows = modes[(i + k) % len(modes)], 32 - i
                p.observe(mode, 2.0 + 0.1 * (i % 4) + k, 2.0, rows, 100.0 * rows)
                for j, m in enumerate(pairs[mode]):
                    p.observe_paired(m, 1.0 + 0.3 * j + 0.05 * (i % 3) - 0.2 * k * (label == "b"), rows)
            if phase != "warmup":
                carried[label] = p.token_state()
            calls.append(dict(CALL, tag={"label": label, "task": "t", "turn": k, "pass": phase}, log=p.logged()))
            want.append({f"{m[0]}:{m[1]}": v[1] for m, v in p.lead.items()})
    got = plan_log.leads(calls)
    for q, w in zip(got, want):
        assert set(q["rows"]) == set(w) and set(w) >= {"chain:4", "chain:8"}
        assert all(q["rows"][m] == pytest.approx(w[m], rel=1e-3, abs=1e-4) for m in w)
    # the chain of 4's lead moves on the chain of 8's and the tree's steps too (0.3 over the chain of 2 there, 1.0-1.15
    # on its own steps): between the two, not its own steps' alone
    assert 0.4 < got[0]["steps"]["chain:4"] < 0.9
    assert plan_log.main([str(_write(tmp_path, *calls)), "--leads"]) == 0
    assert f"a t 0 timed: chain:4 {got[0]['steps']['chain:4']:.3f}/{got[0]['rows']['chain:4']:.3f}" in capsys.readouterr().out
