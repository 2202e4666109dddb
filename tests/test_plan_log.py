"""benchmarks/engine/plan_log.py: the summary of a planner step log (DSPINE_PLAN_LOG) on a hand-made log."""

from __future__ import annotations

import json

import pytest

from benchmarks.engine import plan_log

NAMES = ["ar:1", "chain:16", "tree:32"]
CALL = {"batch": 32, "prompts": 64, "temperature": 0.0, "max_new_tokens": 512, "steps": 4, "wall_s": 0.01,
        "tokens": 100, "log": [NAMES,
                               ["c", 0, 0, 0, 0.0, None],  # the decode's first step: no comparison
                               ["c", 1, 1, 0, 0.5, [1.0, 1.5, None]],  # a probe of the chain
                               ["o", 0, 1.0, 1.0, 32],
                               ["d", 2, [[100, 30, 10], [0, 40, 12]]],  # a drain refresh: ignored by the summary
                               ["c", 2, 0, 1, 0.0, [1.0, 0.8, 0.9]],  # drain: AR judged best
                               ["o", 1, 3.0, 2.0, 32],
                               ["c", 3, 1, 1, 0.0, [1.0, 1.2, 0.9]],  # drain: the chain judged best
                               ["o", 0, 1.0, None, 20],  # untimed: counted as observed, not in the rate
                               ["o", 1, 2.0, 2.0, 20]]}


def test_summary_counts_and_rates(tmp_path):
    path = tmp_path / "p.jsonl"
    other = dict(CALL, batch=8)
    path.write_text(json.dumps(CALL) + "\n" + json.dumps(other) + "\n")
    s = plan_log.summarize([c for c in plan_log.read_log(path) if c["batch"] == 32])
    assert (s["calls"], s["steps"]) == (1, 4)
    assert s["modes"]["ar:1"] == {"steps": 2, "drain_steps": 1, "probes": 0, "observed": 2, "timed": 1,
                                  "tokens": 1.0, "ms": 1.0, "tok_per_ms": 1.0}
    assert s["modes"]["chain:16"] == {"steps": 2, "drain_steps": 1, "probes": 1, "observed": 2, "timed": 2,
                                      "tokens": 5.0, "ms": 4.0, "tok_per_ms": 1.25}
    assert s["modes"]["tree:32"]["steps"] == 0 and s["modes"]["tree:32"]["tok_per_ms"] is None
    assert s["drain_choices"] == {"n": 2, "best": {"ar:1": 1, "chain:16": 1},
                                  "median_rate": {"ar:1": 1.0, "chain:16": 1.0, "tree:32": 0.9}}
    # the one drain choice observed with a time: the chain's, 2 tokens in 2 ms with 20 requests live
    assert s["drain_by_rows"] == {"ar:1": {}, "chain:16": {">12": {"steps": 1, "tok_per_ms": 1.0}}, "tree:32": {}}
    out = tmp_path / "s.json"
    assert plan_log.main([str(path), "--batch", "8", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["steps"] == 4
    assert plan_log.main([str(path), "--batch", "8", "--json", str(out)]) == 2  # never overwritten


@pytest.mark.parametrize("text, msg", [("{oops\n", "p.jsonl:1: not JSON"),
                                       ('{"batch": 1}\n', "p.jsonl:1: not a plan-log record")])
def test_bad_lines_are_named(tmp_path, capsys, text, msg):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    assert plan_log.main([str(path)]) == 2
    assert msg in capsys.readouterr().err


def test_no_matching_call_and_mixed_modes(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(CALL) + "\n")
    assert plan_log.main([str(path), "--batch", "64"]) == 2
    assert "no call in" in capsys.readouterr().err
    other = dict(CALL, log=[["ar:1", "chain:16"], ["c", 0, 0, 0, 0.0, None]])
    with pytest.raises(ValueError, match="different modes"):
        plan_log.summarize([CALL, other])


def test_by_point_reads_gzip(tmp_path):
    import gzip

    path = tmp_path / "p.jsonl.gz"
    path.write_bytes(gzip.compress((json.dumps(CALL) + "\n" + json.dumps(dict(CALL, temperature=1.0)) + "\n").encode()))
    out = tmp_path / "s.json"
    assert plan_log.main([str(path), "--by-point", "--json", str(out)]) == 0
    points = json.loads(out.read_text())["points"]
    assert [(p["batch"], p["temperature"], p["steps"]) for p in points] == [(32, 0.0, 4), (32, 1.0, 4)]
