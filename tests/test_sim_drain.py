"""benchmarks/engine/sim_drain.py: the no-queue drain model (CPU), with the narrower chains of ``--narrow``."""

from __future__ import annotations

import pytest

from benchmarks.engine import sim_drain as sim
from infer.planner import StepPlanner


def test_fixed_chains_commit_what_the_acceptance_allows():
    """A chain of W commits 1 + accepted tokens, at most W: with acceptance 0 one token a step, with acceptance 1
    W tokens a step (the last step cut at what is left)."""
    costs = sim.COSTS_NARROW
    for m in (sim.AR, ("chain", 2), ("chain", 4), sim.CHAIN):
        assert sim.drain_batch(costs, [0.0] * 3, 30, 0, fixed=m) == pytest.approx(30 * costs[m])
    for W in (2, 4, 16):
        assert sim.drain_batch(costs, [1.0] * 3, 30, 0, fixed=("chain", W)) == pytest.approx(-(-30 // W) * costs[("chain", W)])


@pytest.mark.parametrize("feed", [True, False])
def test_narrow_chains_feed_the_drain_statistics_only_when_told(feed):
    """The planner's drain requests carry chain steps of a narrower chain only with ``feed_narrow`` (the full chain's
    always); a chain step pairs every narrower chain of the table."""
    seen, paired = [], []
    planner = StepPlanner({sim.AR: 1.0, ("chain", 2): 1.2, ("chain", 4): 1.3})
    planner.schedule = [("chain", 4)] * 3 + [("chain", 2)] * 30
    choose, observe_paired = planner.choose, planner.observe_paired

    def spy(predicted=None, drain=None, kv=None):
        if drain is not None:
            seen.append(drain)
        return choose(predicted, drain)

    planner.choose = spy
    planner.observe_paired = lambda m, x, rows: paired.append(m) or observe_paired(m, x, rows)
    sim.drain_batch(planner.table, [0.5] * 4, 12, 1, planner=planner, feed_narrow=feed)
    steps = max(r[2] for d in seen for r in d)
    assert steps > 0 if feed else steps == 0
    assert paired and set(paired) == {("chain", 2)}


def test_replay_reports_every_fixed_chain():
    out = sim.replay_tasks(0, sim.TASKS[:1], batch=4, max_new=16, costs=sim.COSTS_NARROW)
    assert set(out) == {"ar", "chain", "chain2", "chain4", "chain8", "planner"}
    assert out["ar"] == [pytest.approx(16 * sim.COSTS_NARROW[sim.AR])]


def test_the_record_names_its_command_device_and_date(tmp_path, monkeypatch):
    """The JSON carries what tests/test_readme.py asks of every results file (one small draw, one task)."""
    import json

    monkeypatch.setattr(sim, "TASKS", sim.TASKS[:1])
    out = tmp_path / "sim.json"
    assert sim.main(["--seeds", "1", "--narrow", "--output", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["command"].endswith(f"--narrow --output {out}") and rec["device"].startswith("CPU") and rec["date"]
    order = rec["orders"][0]
    assert set(order["total_ms"]) == {"ar", "chain", "chain2", "chain4", "chain8", "planner_fed", "planner_unfed"}
    assert order["planner_fed_over_ar_time"] == order["total_ms"]["planner_fed"] / order["total_ms"]["ar"]


def test_lengths_end_requests_early_while_the_planner_is_told_max_new():
    """``lengths``: request i ends after lengths[i] tokens (a fixed mode's time is the longest request's steps), and
    the drain requests the planner gets say max_new − committed while a request runs, 0 once it ended."""
    costs = sim.COSTS_NARROW
    assert sim.drain_batch(costs, [0.0] * 3, 30, 0, fixed=sim.AR, lengths=[5, 12, 30]) == pytest.approx(30 * costs[sim.AR])
    assert sim.drain_batch(costs, [0.0] * 3, 30, 0, fixed=sim.AR, lengths=[5, 12, 7]) == pytest.approx(12 * costs[sim.AR])
    assert sim.drain_batch(costs, [1.0] * 2, 30, 0, fixed=("chain", 4), lengths=[9, 3]) == pytest.approx(
        3 * costs[("chain", 4)])  # 9 tokens in chain-of-4 steps: 4 + 4 + 1
    seen = []
    planner = StepPlanner(costs)
    planner.schedule = [sim.AR] * 40
    choose = planner.choose

    def spy(predicted=None, drain=None, kv=None):
        if drain is not None:
            seen.append([d[0] for d in drain])
        return choose(predicted, drain)

    planner.choose = spy
    sim.drain_batch(costs, [0.0] * 2, 30, 0, planner=planner, lengths=[2, 4])
    assert seen[:4] == [[30, 30], [29, 29], [0, 28], [0, 27]]
    for bad, msg in (([2, 4, 6], "3 lengths for 2"), ([2], "1 lengths for 2"), ([0, 4], r"\[0\] outside"),
                     ([4, 31], r"\[31\] outside")):
        with pytest.raises(ValueError, match=msg):
            sim.drain_batch(costs, [0.0] * 2, 30, 0, fixed=sim.AR, lengths=bad)


def test_context_tokens_add_to_each_step_and_reach_the_planner():
    """ctx / kv_ms: a step costs its table time plus kv_ms per context token of its live requests (prompt + committed;
    a finished one's row reads no cache, infer.engine.Engine._attn_lengths), and the planner is told those tokens: one
    request of a 10-token prompt, 4 AR steps at 10..13 context tokens; two of 10 and 20 tokens ending after 2 and 8,
    8 AR steps at 30 + 2j while both run, then 20 + j."""
    costs, ar = sim.COSTS, sim.AR
    assert sim.drain_batch(costs, [0.5], 4, 0, fixed=ar, ctx=[10], kv_ms=0.5) == pytest.approx(4 * costs[ar] + 0.5 * 46)
    got = sim.drain_batch(costs, [0.5, 0.5], 8, 0, fixed=ar, ctx=[10, 20], kv_ms=0.5, lengths=[2, 8])
    assert got == pytest.approx(8 * costs[ar] + 0.5 * (30 + 32 + sum(20 + j for j in range(2, 8))))
    p = StepPlanner(costs, state="kv")
    seen = []
    observe = p.observe
    p.observe = lambda mode, x, ms=None, rows=1, kv=None: (seen.append((kv, ms - costs[mode])), observe(mode, x, ms, rows, kv))
    sim.drain_batch(costs, [0.5, 0.5], 8, 0, planner=p, ctx=[10, 20], kv_ms=0.01)
    assert seen[0][0] == 30 and len(seen) >= 4  # both prompts, nothing committed yet
    assert all(extra == pytest.approx(0.01 * kv) for kv, extra in seen)
    assert seen[1][0] > 30
