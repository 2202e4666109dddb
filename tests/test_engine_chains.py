"""The planner's chains narrower than the verify width (``Engine(plan_chains=...)``): lossless output, what a wider
step tells the planner about them, and the settings' refusals; a fixed narrow chain per ``infer.bench`` label."""

from __future__ import annotations

import re

import pytest
import torch

from dspine.reference import ReferenceDecoder
from dspine.sampling import SamplingParams
from infer.planner import StepPlanner, parse_plan_chains
from tests.test_engine import PROMPTS, _engine
from tests.test_engine_tree import (
    second_choice_engine,
    stories,  # noqa: F401 (module fixture: target + random block-8 draft)
)


def oracle(eng, want):
    """second_choice_engine's draft: the true token, or with probability 1/2 a wrong argmax."""
    return second_choice_engine(eng, [p + w for p, w in zip(PROMPTS, want)])


def test_plan_chains_sets_the_planner_modes_or_is_refused(stories_dir, stories):  # noqa: F811
    """plan_chains: sorted, between AR and the full chain; () and the default PLAN_CHAINS leave the full chain
    alone; widths outside 2..verify_size - 1, repeated, not integers, or given without budget='auto' are refused."""
    _, _, folder = stories
    eng = _engine(stories_dir, folder, budget="auto", plan_chains=(5, 3), plan_trees=(16,))
    assert eng.plan_modes == [("ar", 1), ("chain", 3), ("chain", 5), ("chain", 8), ("tree", 16)]
    assert eng.plan_chains == (3, 5) and eng.verified_per_step == 16
    from infer.engine import Engine

    # the default: PLAN_CHAINS below this engine's verify width (the stories draft's block of 8)
    assert Engine.PLAN_CHAINS == (2, 4, 8) and _engine(stories_dir, folder, budget="auto").plan_chains == (2, 4)
    assert _engine(stories_dir, folder, budget="auto", plan_chains=()).plan_modes[:2] == [("ar", 1), ("chain", 8)]
    assert _engine(stories_dir, folder).plan_chains == ()  # no planner: none
    eng = _engine(stories_dir, folder, budget="auto", plan_trees=(), verify_size=6, plan_chains=[2, 4])
    assert eng.plan_modes == [("ar", 1), ("chain", 2), ("chain", 4), ("chain", 6)]
    for bad in ((1,), (8,), (9,), (3, 3), (3.0,), (True,), "3", 3, {3}):
        with pytest.raises(ValueError, match=r"plan_chains=.* must be a tuple or list of distinct integer chain "
                                             r"widths in 2\.\.7"):
            _engine(stories_dir, folder, budget="auto", plan_chains=bad)
    with pytest.raises(ValueError, match="applies to budget='auto' only"):
        _engine(stories_dir, folder, plan_chains=(4,))
    assert parse_plan_chains("4/8") == (4, 8) and parse_plan_chains("none") == ()
    for text in ("", "4/", "+4", "1", "65", "4/4", "4,8"):
        with pytest.raises(ValueError, match=re.escape(f"plan_chains={text!r}")):
            parse_plan_chains(text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_narrow_chains_in_turn_decode_what_ar_decodes(stories_dir, stories, temperature):  # noqa: F811
    """A schedule of AR, chains of 2, 3 and 8 in turn: the output is the target's own (greedy at T = 0; AR's
    sampled text under drafter-invariant sampling at T = 1), a narrow chain commits at most its width per step, and
    each chain step pairs every narrower chain with min(committed, width)."""
    target, _, folder = stories
    params = SamplingParams(max_new_tokens=30, temperature=temperature, invariant=temperature > 0)
    if temperature == 0:
        want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params).token_ids
    else:  # AR's sampled text: the engine without a draft, same seeds
        want = _engine(stories_dir, folder).generate(PROMPTS, params, use_draft=False).token_ids
    eng = oracle(_engine(stories_dir, folder, budget="auto", plan_trees=(), plan_chains=(2, 3)), want)
    eng.plan_schedule = [("chain", 3), ("ar", 1), ("chain", 8), ("chain", 2)]
    eng._step_costs = lambda B, p: {m: 1.0 for m in eng.planner_modes(p)}  # the oracle runs inside a decode only
    pairs, observed, paired, seen = [], StepPlanner.observe, StepPlanner.observe_paired, []
    choose, given = StepPlanner.choose, []

    def spy_choose(self, predicted=None, drain=None, kv=None):  # the confidence given after each observed mode
        if seen:
            given.append((seen[-1][0], predicted is not None))
        return choose(self, predicted, drain)

    def spy_observe(self, mode, x, ms=None, rows=1, kv=None):
        seen.append((mode, x))
        return observed(self, mode, x, ms, rows)

    def spy_paired(self, mode, x, rows=1):
        pairs.append((seen[-1], mode, x))
        return paired(self, mode, x, rows)

    StepPlanner.observe, StepPlanner.observe_paired, StepPlanner.choose = spy_observe, spy_paired, spy_choose
    try:
        # one request first: a pair is exactly min(committed, n) of the step run (several rows: that per row, averaged)
        res1 = eng.generate(PROMPTS[:1], params, concurrency=1)
        assert res1.token_ids == want[:1] and pairs
        assert all(x == min(x_run, m[1]) for (run, x_run), m, x in pairs), pairs
        pairs.clear()
        res = eng.generate(PROMPTS, params, concurrency=3)
    finally:
        StepPlanner.observe, StepPlanner.observe_paired, StepPlanner.choose = observed, paired, choose
    assert res.token_ids == want
    rep = eng.planner_report
    assert min(rep[k]["steps"] for k in ("ar", "chain2", "chain3", "chain8")) >= 3, rep
    assert 1 <= rep["chain2"]["tokens_per_step"] <= 2 and 1 <= rep["chain3"]["tokens_per_step"] <= 3
    # chain 8 pairs chains 2 and 3, chain 3 pairs chain 2, smallest first; AR and chain 2 pair nothing
    by_run: dict = {}
    for (run, x_run), mode, x in pairs:
        by_run.setdefault(run, []).append((mode, x, x_run))
    assert set(by_run) == {("chain", 8), ("chain", 3)}
    for run, got in by_run.items():
        widths = [m[1] for m, _, _ in got]
        assert widths == ([2, 3] * (len(widths) // 2) if run == ("chain", 8) else [2] * len(widths))
        # the mean of min(committed, n) is at most n and at most the run's own mean, and equals it when n covers it
        assert all(1 <= x <= min(m[1], x_run) + 1e-9 for m, x, x_run in got)
    assert any(x < x_run for (m, x, x_run) in by_run[("chain", 8)])  # a cut that mattered
    # the draft's confidence goes to the planner after a full chain at T = 0 only: a narrower chain's covers its own
    # slots (not comparable), an AR step has none, and T > 0 gets none by default (plan_confidence "greedy")
    after = {}
    for mode, got in given:
        after.setdefault(mode, set()).add(got)
    assert after[("chain", 2)] == after[("chain", 3)] == after[("ar", 1)] == {False}, after
    # (after a full chain at T = 0 mostly; none where no row was observed in the step)
    assert (True in after[("chain", 8)]) == (temperature == 0), after


def test_fixed_narrow_chain_label_and_its_refusals(stories_dir, stories):  # noqa: F811
    """infer.bench --config LABEL:width=N: that label's chain verifies N slots (the engine's verify_size), recorded
    as its verified tokens per step; width with a tree, with the planner or out of range is refused by name."""
    from types import SimpleNamespace

    from infer.bench import parse_configs

    args = SimpleNamespace(verify="chain", tree_budget=None, budget=None, draft_vocab=None, backend="cuda",
                           temperature=0.0, plan_trees=None, plan_chains=None)
    cfg = parse_configs(["c4:width=4", "p:budget=auto,plan_chains=4/6"], ["c4", "p"], args)
    assert cfg["c4"]["width"] == 4 and cfg["p"]["plan_chains"] == (4, 6) and cfg["p"]["width"] is None
    for item, match in (("c4:width=1", "width='1'; expected a chain width"),
                        ("c4:width=x", "width='x'"),
                        ("c4:verify=tree,width=4", "width applies to a fixed chain"),
                        ("c4:budget=auto,width=4", "width applies to a fixed chain"),
                        ("c4:plan_chains=4", "plan_chains applies to budget=auto")):
        with pytest.raises(ValueError, match=match):
            parse_configs([item], ["c4"], args)
    wide = SimpleNamespace(**{**vars(args), "plan_chains": "3"})
    assert parse_configs(["p:budget=auto"], ["p"], wide)["p"]["plan_chains"] == (3,)
    with pytest.raises(ValueError, match="--plan-chains 3: applies to budget=auto labels"):
        parse_configs(["c4:width=4"], ["c4"], wide)
    eng = _engine(stories_dir, folder=stories[2], verify_size=4)
    assert eng.mode == ("chain", 4)


def test_narrow_chains_feed_the_drain_statistics_and_the_real_draft_takes_a_width(stories_dir, stories):  # noqa: F811
    """The drain rule's per-request chain statistics count every chain step, a narrower chain's with its tokens cut at
    its width (a batch running only narrow chains would otherwise never get a request's statistic, and the rule judged
    it on the prior alone). Engine.draft_logits(width=W) is the whole block's draft
    with the head over slots 1..W-1 (fp32: the full call's first W - 1 rows), and a planner running the real draft's
    narrow chains decodes the target's greedy text."""
    target, _, folder = stories
    params = SamplingParams(max_new_tokens=30)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params).token_ids
    eng = _engine(stories_dir, folder, budget="auto", plan_trees=(), plan_chains=(2, 3))
    drains, choose = [], StepPlanner.choose

    def spy(self, predicted=None, drain=None, kv=None):
        if drain is not None:
            drains.append(list(drain))
        return choose(self, predicted, drain)

    StepPlanner.choose = spy
    try:
        for schedule in ([("chain", 3), ("chain", 2)], [("chain", 8), ("chain", 3)]):
            drains.clear()
            eng.plan_schedule = schedule
            assert eng.generate(PROMPTS, params, concurrency=3).token_ids == want  # the real (random) draft
            rows = [r for d in drains for r in d]  # (remaining, chain tokens, chain steps, tokens²) per request
            assert drains and max(r[2] for r in rows) > 0, (schedule, drains)
            for _, tokens, steps, sq in rows:  # each step commits 1..width tokens: within [steps, width × steps]
                width = 8 if ("chain", 8) in schedule else 3
                assert steps <= tokens <= width * steps and tokens <= sq <= width * tokens, (schedule, drains)
    finally:
        StepPlanner.choose = choose
    eng._slots_for(2)  # the batch's slots and caches
    dcache = eng._cache_view(2)[1]
    block = torch.randint(3, 400, (2, eng.block_size))
    full = eng.draft_logits(block, dcache)
    assert full.shape[1] == eng.verify_size - 1
    for W in (2, 3, 5):
        part = eng.draft_logits(block, dcache, width=W)
        assert part.shape == (2, W - 1, full.shape[2]) and torch.allclose(part, full[:, : W - 1], atol=1e-5)


def test_drain_model_persist_runs_in_the_engine_and_decodes_the_target_text(stories_dir, stories, monkeypatch):  # noqa: F811
    """Engine.plan_drain_model = "persist": the planner's drain rule takes its spread from persistent_spread over
    the engine's per-slot statistics, one entry per slot at every refresh (it matches requests by position; early
    window shortened to 2 chain steps), and the output is the target's greedy text. (The random test draft seldom
    leads the planner to chain steps, so whether a snapshot is taken is left to the planner tests.)"""
    import infer.planner as planner_mod

    target, _, folder = stories
    params = SamplingParams(max_new_tokens=30)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params).token_ids
    eng = _engine(stories_dir, folder, budget="auto", plan_trees=(), plan_chains=(2, 3))
    eng.plan_drain_model = "persist"
    monkeypatch.setattr(planner_mod, "PERSIST_EARLY", 2)
    calls, real = [], planner_mod.persistent_spread

    def spy(drain, snaps, early=planner_mod.PERSIST_EARLY):
        out = real(drain, snaps, early)
        calls.append((early, len(drain), dict(snaps), out))
        return out

    monkeypatch.setattr(planner_mod, "persistent_spread", spy)
    assert eng.generate(PROMPTS, params, concurrency=3).token_ids == want
    assert calls and all(c[0] == 2 and c[1] == 3 for c in calls)  # every slot, in order, at every refresh
    assert eng.generate(PROMPTS, params, concurrency=3).token_ids == want  # the spread carried over, ÷ ā²
    assert "spread_rel" in next(iter(eng.plan_token_memory.values()))


def test_the_default_drain_model_carries_the_spread_it_learned_relative(stories_dir, stories, monkeypatch):  # noqa: F811
    """The engine's default drain model is "persist" (the scaled one before). With an oracle draft (a third of its
    tokens corrupted), so the drain sees chain steps (early window shortened to 2 of them): the output is the
    target's greedy text, and the spread carried to the next generate is the one the drain learned
    (persist_variance of the last refresh's persistent_spread, ÷ ā², not the no-call default), as "spread_rel", not
    tokens²."""
    import infer.planner as planner_mod
    from tests.helpers import oracle_engine

    target, _, folder = stories
    params = SamplingParams(max_new_tokens=30)
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params).token_ids
    eng = oracle_engine(_engine(stories_dir, folder, budget="auto", plan_trees=(), plan_chains=(2, 4)),
                        [p + w for p, w in zip(PROMPTS, want)], corrupt=0.3)
    assert eng.plan_drain_model == "persist"
    eng._step_costs = lambda B, params: {("ar", 1): 1.0, ("chain", 2): 1.05, ("chain", 4): 1.1, ("chain", 8): 1.2}
    eng.plan_online = False
    monkeypatch.setattr(planner_mod, "PERSIST_EARLY", 2)
    calls, real = [], planner_mod.drain_tokens

    def spy(tokens, drain, modes, prior=None, *args):
        calls.append((drain, prior, args[1]))  # (own, persist, stats)
        return real(tokens, drain, modes, prior, *args)

    monkeypatch.setattr(planner_mod, "drain_tokens", spy)
    assert eng.generate(PROMPTS, params, concurrency=3).token_ids == want
    state = next(iter(eng.plan_token_memory.values()))
    assert "spread_rel" in state and "spread" not in state
    assert calls and all(c[2] is not None for c in calls)  # persist's (cov, weight) at every refresh
    drain, prior, persist = [c for c in calls if planner_mod.drain_spread(c[0])[3]][-1]  # the last with a chain step
    assert prior == planner_mod.DEFAULT_SPREAD_REL and persist[1] > 0  # the no-call prior; requests with both windows
    pooled = planner_mod.drain_spread(drain)[0]
    want_rel = planner_mod.persist_variance(persist, prior, pooled) / pooled**2
    assert state["spread_rel"] == pytest.approx(want_rel) and want_rel != prior  # learned, ÷ ā²
    assert eng.generate(PROMPTS, params, concurrency=3).token_ids == want


@pytest.mark.parametrize("extra, msg", [
    (["--config", "c:width=8"], "--config c:width=8: a fixed chain's width must be below the draft's block of 8"),
    (["--config", "c:budget=auto,plan_chains=2/8"], "draft 'c': plan_chains 2/8 (--config c:plan_chains= or "
                                                    "--plan-chains): each width must be below the planner's full chain of 8"),
    (["--block-size", "12"], "--block-size 12: must be in 2..8 (draft 'c''s block size)"),
])
def test_bench_refuses_a_width_not_below_the_block_before_the_target_loads(  # noqa: F811
        stories_dir, stories, capsys, extra, msg):  # noqa: F811
    """infer.bench names the label, the key and the draft's block when a fixed or planner chain is not narrower than
    the block, or --block-size is beyond it (exit 2, before the target's weights load)."""
    from infer import bench
    from tests.conftest import shared_path

    code = bench.main(["--target", str(stories_dir), "--draft", f"c={stories[2]}", *extra, "--datasets",
                       "gsm8k", "--data-dir", str(shared_path("data", "eval")), "--num-prompts", "1",
                       "--max-new-tokens", "4", "--backend", "cuda", "--device", "cpu", "--dtype", "fp32",
                       "--no-chat-template"])
    assert code == 2 and msg in capsys.readouterr().err
