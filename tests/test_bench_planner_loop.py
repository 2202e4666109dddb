"""benchmarks/engine/bench_planner_loop.py: the CPU smoke path runs its configurations on the same steps."""

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
        for name in ("ar", "chain", "planner_ar", "planner_ar_immediate", "planner_ar_noflush", "planner_chain"):
            row = p[name]
            assert row["tokens"] == 9 * p["batch"]  # no EOS: every request makes all its tokens
            assert row["tok_per_s"] > 0 and row["ms_per_step"] > 0 and row["launch_ms"] > 0
        # the planner with one mode runs that mode's steps: AR makes one token a step (8 after the prefill's)
        steps = p["ar"]["steps"]
        assert steps == p["planner_ar"]["steps"] == p["planner_ar_immediate"]["steps"] == p["planner_ar_noflush"]["steps"]
        assert steps >= 8
        assert abs(p["planner_ar_over_ar"] - p["planner_ar"]["tok_per_s"] / p["ar"]["tok_per_s"]) < 1e-12
        assert abs(p["planner_ar_noflush_over_ar"] - p["planner_ar_noflush"]["tok_per_s"] / p["ar"]["tok_per_s"]) < 1e-12
        # fewer AR steps than F = 16: no flush (the count itself: test_exact_puts_every_engine_in_exact_mode)
        assert [p[n]["flushes"] for n in ("planner_ar", "planner_ar_immediate", "planner_ar_noflush")] == [0] * 3
        assert "flushes" not in p["ar"] and "flushes" not in p["chain"]  # no planner: nothing counted
        if p["temperature"] == 0:  # greedy: the same tokens, so the same accepts and steps as the fixed chain
            assert p["chain"]["steps"] == p["planner_chain"]["steps"]


@pytest.mark.parametrize("bad", [["--batches", "0"], ["--batches", ""], ["--batches", "1,x"], ["--batches", "2,2"],
                                 ["--temperatures", "abc"], ["--temperatures", "0,-1"], ["--new", "0"],
                                 ["--switch", "1"], ["--switch", "65"]])
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
    assert rec["complete"] is False  # stopped part way: marked, so reproduce_h200.sh measures it again
    # an existing --output is refused before any work unless --overwrite
    monkeypatch.setattr(Engine, "generate", real)
    with pytest.raises(SystemExit) as e:
        bench_planner_loop.main(["--tiny", "--device", "cpu", "--batches", "1", "--output", str(out)])
    assert e.value.code == 2 and json.loads(out.read_text()) == rec


def test_switch_runs_the_chain_and_the_tree_in_turn(monkeypatch, capsys):
    """--switch N: tree runs the fixed tree of N nodes (no planner), planner_tree that tree as the planner's only
    mode, planner_switch the chain and that tree in turn
    (Engine.plan_schedule, every step through the planner's loop); switch_over_mean is its ms per step over the
    mean of the two alone."""
    from benchmarks.engine import bench_planner_loop
    from infer.engine import Engine

    reports = {}
    real = Engine.generate

    def keep(self, prompts, *a, **kw):
        out = real(self, prompts, *a, **kw)
        if self.plan_schedule:
            reports.setdefault("switch", []).append(self.planner_report)
        elif self.budget == "auto" and [m[0] for m in self.plan_modes] == ["tree"]:
            reports.setdefault("tree", []).append(self.planner_report)
        elif self.budget is None and self.verify == "tree":  # the fixed tree: the plain loop, no planner
            reports.setdefault("fixed_tree", []).append(self.tree_budget)
        return out

    monkeypatch.setattr(Engine, "generate", keep)
    res = bench_planner_loop.run(bench_planner_loop.build_parser().parse_args(
        ["--tiny", "--device", "cpu", "--batches", "1", "--temperatures", "0", "--context", "8", "--new", "9",
         "--reps", "1", "--switch", "6"]))
    p = res["points"][0]
    assert res["switch_tree"] == 6
    n = p["switch_steps"]
    assert min(n.values()) >= 4 and res["complete"] is True
    assert p["switch_over_mean"] == pytest.approx(p["planner_switch"]["ms_per_step"] * (n["chain"] + n["tree"]) / (
        n["chain"] * p["planner_chain"]["ms_per_step"] + n["tree"] * p["planner_tree"]["ms_per_step"]))
    for rep in reports["switch"]:  # warm-up and timed call: the two modes in turn, nothing else
        steps = {k: v["steps"] for k, v in rep.items()}
        chain = next(k for k in steps if k.startswith("chain"))
        assert set(steps) == {chain, "tree6"} and abs(steps[chain] - steps["tree6"]) <= 1 and steps["tree6"] >= 4
    for rep in reports["tree"]:
        assert {k: v["steps"] > 0 for k, v in rep.items()} == {"tree6": True}
    assert p["planner_tree"]["tokens"] == p["planner_switch"]["tokens"] == p["tree"]["tokens"] == 9
    assert reports["fixed_tree"] == [6, 6]  # warm-up and timed call of the fixed tree of 6
    assert p["planner_tree_over_tree"] == pytest.approx(p["planner_tree"]["tok_per_s"] / p["tree"]["tok_per_s"])
    # a run too short to alternate (one decode step: the chain only) reports no switching cost
    short = bench_planner_loop.run(bench_planner_loop.build_parser().parse_args(
        ["--tiny", "--device", "cpu", "--batches", "1", "--temperatures", "0", "--context", "4", "--new", "2",
         "--reps", "1", "--switch", "6"]))["points"][0]
    assert short["switch_over_mean"] is None and short["switch_steps"]["tree"] < 4


def test_exact_puts_every_engine_in_exact_mode(monkeypatch):
    """--exact: the fixed engine, the planner engines and the fixed tree are all built with exact=True, the file
    says so, and greedy planner_chain still runs the fixed chain's steps (same tokens, same accepts); each planner
    AR configuration runs its own number of draft-context flushes."""
    from benchmarks.engine import bench_planner_loop
    from infer.engine import Engine

    built = []
    init = Engine.__init__

    def record(self, *a, **kw):
        init(self, *a, **kw)
        built.append(self.exact)

    monkeypatch.setattr(Engine, "__init__", record)
    monkeypatch.setattr(Engine, "AR_DEFER", 3)  # a flush after every 3 deferred AR steps: twice in 8
    res = bench_planner_loop.run(bench_planner_loop.build_parser().parse_args(
        ["--tiny", "--device", "cpu", "--batches", "2", "--temperatures", "0", "--context", "8", "--new", "9",
         "--reps", "1", "--switch", "6", "--exact"]))
    assert res["exact"] is True and len(built) == 8 and all(built)
    p = res["points"][0]
    assert p["chain"]["steps"] == p["planner_chain"]["steps"] and p["chain"]["tokens"] == 18
    # 9 AR steps (the pipelined loop's last one finds every row done): planner_ar flushes before its 4th and 7th;
    # planner_ar_noflush (F = --new) and the immediate append never
    assert p["planner_ar"]["steps"] == p["planner_ar_noflush"]["steps"] == 9
    assert (res["flush_rows"], res["noflush_flush_rows"]) == (3, 9)
    assert [p[n]["flushes"] for n in ("planner_ar", "planner_ar_noflush", "planner_ar_immediate")] == [2, 0, 0]
