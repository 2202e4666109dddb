"""benchmarks/engine/bench_planner_loop.py: the CPU smoke path runs the four configurations on the same steps."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def test_tiny_cpu_run_times_the_same_steps(tmp_path):
    out = tmp_path / "planner-loop.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "engine" / "bench_planner_loop.py"), "--device", "cpu", "--tiny",
           "--batches", "1,3", "--temperatures", "0,1", "--context", "12", "--new", "9", "--reps", "1",
           "--output", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["command"].startswith("python benchmarks/engine/bench_planner_loop.py") and rec["date"]
    assert [(p["batch"], p["temperature"]) for p in rec["points"]] == [(1, 0.0), (1, 1.0), (3, 0.0), (3, 1.0)]
    for p in rec["points"]:
        for name in ("ar", "chain", "planner_ar", "planner_ar_immediate", "planner_chain"):
            row = p[name]
            assert row["tokens"] == 9 * p["batch"]  # no EOS: every request makes all its tokens
            assert row["tok_per_s"] > 0 and row["ms_per_step"] > 0 and row["launch_ms"] > 0
        # the planner with one mode runs that mode's steps: AR makes one token a step (8 after the prefill's)
        assert p["ar"]["steps"] == p["planner_ar"]["steps"] == p["planner_ar_immediate"]["steps"] >= 8
        assert abs(p["planner_ar_over_ar"] - p["planner_ar"]["tok_per_s"] / p["ar"]["tok_per_s"]) < 1e-12
        if p["temperature"] == 0:  # greedy: the same tokens, so the same accepts and steps as the fixed chain
            assert p["chain"]["steps"] == p["planner_chain"]["steps"]


@pytest.mark.parametrize("bad", [["--batches", "0"], ["--batches", ""], ["--batches", "1,x"], ["--batches", "2,2"],
                                 ["--temperatures", "abc"], ["--temperatures", "0,-1"], ["--new", "0"]])
def test_bad_lists_are_usage_errors_before_any_work(bad, capsys):
    from benchmarks.engine import bench_planner_loop

    with pytest.raises(SystemExit) as e:
        bench_planner_loop.main(["--tiny", "--device", "cpu", *bad])
    assert e.value.code == 2 and f"{bad[0]}" in capsys.readouterr().err


def test_every_finished_point_is_on_disk(tmp_path, monkeypatch):
    """The JSON is rewritten after each point: a run that fails at its second batch size keeps the first."""
    from benchmarks.engine import bench_planner_loop
    from infer.engine import Engine

    out = tmp_path / "pl.json"
    real = Engine.generate

    def fail_at_batch_2(self, prompts, *a, **kw):
        if len(prompts) == 2:
            raise RuntimeError("stopped")
        return real(self, prompts, *a, **kw)

    monkeypatch.setattr(Engine, "generate", fail_at_batch_2)
    with pytest.raises(RuntimeError, match="stopped"):
        bench_planner_loop.main(["--tiny", "--device", "cpu", "--batches", "1,2", "--temperatures", "0",
                                 "--context", "8", "--new", "4", "--reps", "1", "--output", str(out)])
    rec = json.loads(out.read_text())
    assert [p["batch"] for p in rec["points"]] == [1] and rec["flush_rows"] == Engine.AR_DEFER
