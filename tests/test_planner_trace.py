"""benchmarks/reference/planner_trace.py: per-anchor acceptance of every verify mode from one greedy output, and the
planner replayed over it against the fixed modes and the clairvoyant schedule."""

import json

import pytest
import torch

from benchmarks.reference import planner_trace as pt
from dspine.checkpoint import save_draft
from dspine.ops.plan_stats import chain_confidence
from dspine.target import load_target
from infer.planner import StepPlanner
from tests.conftest import shared_path
from tests.helpers import random_draft

AR, CHAIN, T4 = ("ar", 1), ("chain", 4), ("tree", 4)


def test_anchor_table_counts_chain_tree_and_paired_chain():
    # V = 5, K = 3, two anchors. Anchor 0: the draft's argmax is the greedy token at depths 1 and 2, not 3.
    # Anchor 1: the argmax misses at depth 1, the second most probable token is the greedy one.
    q = torch.full((2, 3, 5), 0.05)
    q[0, :, 1] = 0.8
    q[1, 0, 2], q[1, 0, 3] = 0.6, 0.2  # argmax 2, then 3
    q[1, 1:, 4] = 0.8
    greedy = torch.tensor([[1, 1, 0], [3, 4, -1]])
    t = pt.anchor_table(q, greedy, torch.tensor([0, 0]), [2, 4, 6])
    assert t["chain"] == [2, 0]
    p = q.max(-1).values
    assert t["conf"] == [pytest.approx(float(x), abs=1e-5) for x in chain_confidence(p)]
    assert t["conf"][0] == pytest.approx(1 + 0.8 + 0.64 + 0.512, abs=1e-5)
    # a tree of 2 nodes is the root and the best depth-1 node (the argmax): the chain's first node
    assert t["tree2"] == [1, 0] and t["pair2"] == [1, 0]
    # best first at anchor 1, by path probability: 2 (0.6), 2-4 (0.48), 2-4-4 (0.384), 3 (0.2), 3-4 (0.16). 4 nodes
    # hold the chain alone (the greedy 3 is missed); 6 nodes hold the greedy path 3-4, off the chain
    assert t["tree4"][1] == 0 and t["pair4"][1] == 0
    assert t["tree6"][1] == 2 and t["pair6"][1] == 0
    assert t["tree4"][0] == 2 and t["pair4"][0] == 2  # the chain's first 2 accepted, depth 3 misses


def row(chain, tree4, pair4, conf=None):
    n = len(chain)
    return {"task": "x", "tokens": n, "chain": chain, "tree4": tree4, "pair4": pair4, "conf": conf or [2.0] * n}


def test_fixed_and_clairvoyant_schedules():
    r = row([3, 0, 0, 1, 0, 0, 0, 0], [3, 2, 2, 2, 2, 2, 2, 0], [3, 0, 0, 1, 0, 0, 0, 0])
    ms = {AR: 1.0, CHAIN: 1.5, T4: 2.0}
    # chain from anchor 1: accepted 0 -> 1 token (p 2), 0 -> p 3, 1 -> 2 tokens (p 5), 0, 0 -> p 7, 0 -> p 8
    assert pt.fixed_ms(r, CHAIN, ms) == (7, 1.5 * 6, 6)
    assert pt.fixed_ms(r, AR, ms) == (7, 7.0, 7)
    # tree from 1: 2 accepted -> 3 tokens (p 4), 3 tokens (p 7), 1 token (p 8)
    assert pt.fixed_ms(r, T4, ms) == (7, 6.0, 3)
    assert pt.committed(r, T4, 6) == 2  # 3 would pass the end: capped by the tokens left
    # tree, tree (p 7), then the last token by AR (1 ms) instead of a third tree step: below every fixed mode
    assert pt.clairvoyant_ms(r, [AR, CHAIN, T4], ms) == pytest.approx(5.0)
    assert pt.clairvoyant_ms(r, [AR], ms) == pytest.approx(7.0)
    assert pt.clairvoyant_ms(r, [CHAIN], ms) == pytest.approx(9.0)


def test_planner_replay_commits_every_token_and_pairs_tree_steps():
    r = row([1] * 40, [3] * 40, [1] * 40)
    ms = {AR: 1.0, CHAIN: 1.2, T4: 1.4}
    planner = StepPlanner(dict(ms))
    tok, total, steps = pt.batch_ms([r], 1, ms, 4, 40, planner=planner)
    assert tok == 39
    n = planner.choices
    assert sum(n.values()) == steps and n[T4] > n[CHAIN]  # the tree commits 4 a step, the chain 2
    assert total == pytest.approx(sum(k * ms[m] for m, k in n.items()))
    assert planner.paired[CHAIN] >= n[T4] - 1  # every tree step observed gives the chain's tokens


def test_replay_pairs_the_smaller_tree_inside_a_tree_step():
    """pair_trees: a step of the tree of 6 gives the tree of 4 its recorded tokens at that anchor (the engine's
    inner_acc), so the tree of 6's lead is over the tree of 4; without it, only the chain is paired."""
    T6 = ("tree", 6)
    r = {**row([1] * 40, [2] * 40, [1] * 40), "tree6": [3] * 40, "pair6": [1] * 40}
    ms = {AR: 1.0, CHAIN: 1.2, T4: 3.0, T6: 1.3}  # the tree of 6 wins; the tree of 4 never pays its way
    for pair in (True, False):
        planner = StepPlanner(dict(ms))
        pt.batch_ms([r], 1, ms, 4, 40, planner=planner, pair_trees=pair)
        assert planner.choices[T6] > 5 and planner.paired[CHAIN] >= planner.choices[T6] - 1
        if pair:
            assert planner.paired[T4] >= planner.choices[T6] - 1 and planner.lead[T6][0] == T4
            # 4 against 3 tokens a step, but at the output's end where both commit the last ones
            assert 0.8 < planner.lead[T6][1] <= 1.0 and 2.8 < planner.slow[T4] <= 3.0
        else:
            assert planner.paired[T4] == 0 and planner.lead[T6][0] == CHAIN


def test_batch_replay_fixed_mode_counts_steps_with_idle_rows():
    # chain accepting 1 (2 tokens a step): a has 9 tokens after its prefill's (5 steps), b 5 (3 steps). A request's
    # finish is seen one step late (the engine reads each step's snapshot after launching the next): its row idles
    # in that step, which runs even when no row is live
    a, b = row([1] * 10, [3] * 10, [1] * 10), row([1] * 6, [3] * 6, [1] * 6)
    assert pt.batch_ms([a, b], 2, {CHAIN: 2.0}, 4, 10, mode=CHAIN) == (14, 12.0, 6)
    assert pt.batch_ms([a, b], 1, {CHAIN: 2.0}, 4, 10, mode=CHAIN) == (14, 20.0, 10)  # 5 + 1 idle, 3 + 1
    # c (3 one-token steps) waits for the first free slot: b's, seen after step 4, so c runs in steps 5-7
    c = row([0] * 4, [0] * 4, [0] * 4)
    assert pt.batch_ms([a, b, c], 2, {CHAIN: 2.0}, 4, 10, mode=CHAIN)[2] == 8


def test_record_and_replay_tiny(stories_dir, tmp_path, capsys, monkeypatch):
    target = load_target(str(stories_dir), dtype="fp32")
    draft = save_draft(random_draft(target, block_size=5, mask=0), tmp_path / "draft")
    trace = tmp_path / "trace.json"
    argv = ["record", "--target", str(stories_dir), "--draft", str(draft), "--datasets", "gsm8k,mbpp",
            "--num-prompts", "1", "--max-new-tokens", "12", "--budgets", "4,6",
            "--data-dir", str(shared_path("data", "eval")), "--output", str(trace)]
    assert pt.main(argv) == 0
    t = json.loads(trace.read_text())
    assert t["commit"] and t["budgets"] == [4, 6] and t["block_size"] == 5 and len(t["prompts"]) == 2
    for p in t["prompts"]:
        n = p["tokens"]
        assert 1 <= n <= 12 and len(p["chain"]) == len(p["conf"]) == len(p["tree6"]) == n
        assert all(0 <= c <= 4 for c in p["chain"]) and all(1.0 <= c <= 5.0 for c in p["conf"])
        assert all(pr <= tr for pr, tr in zip(p["pair6"], p["tree6"]))
    with pytest.raises(SystemExit, match="exists"):
        pt.main(argv)
    # an unknown task is refused before the models load, by name
    bad = [a if a != "gsm8k,mbpp" else "gsm8k,nope" for a in argv]
    bad[bad.index("--output") + 1] = str(tmp_path / "other.json")
    with pytest.raises(SystemExit, match="--datasets 'nope'"):
        pt.main(bad)
    assert not (tmp_path / "other.json").exists()
    # an infer.bench-like costs file: the planner label with its modes, a fixed tree of 6 nodes
    modes = {"ar": 1.0, "chain5": 1.2, "tree4": 1.3}
    costs = tmp_path / "bench.json"
    costs.write_text(json.dumps({"tasks": [{"task": "gsm8k", "drafts": {
        "p": {"planner_choices": {k: {"steps": 10, "step_ms": v, "measured_ms": 1.1 * v} for k, v in modes.items()}},
        "t4": {"verify": "tree", "verified_tokens_per_step": 4, "seconds": 1.0, "verify_steps": 100},
        "t6": {"verify": "tree", "verified_tokens_per_step": 6, "seconds": 1.5, "verify_steps": 100}}}]}))
    out = tmp_path / "replay.json"
    assert pt.main(["replay", str(trace), "--costs", str(costs), "--plan-trees", "4", "--output", str(out)]) == 0
    rep = json.loads(out.read_text())["points"][0]
    assert rep["concurrency"] == 1 and rep["true_ms"]["tree6"] == pytest.approx(1.5 * 1.1 * 1.3, rel=1e-3)  # scaled from tree4's measured
    tps = rep["tok_per_s"]
    assert tps["clairvoyant"] >= max(v for k, v in tps.items() if k not in ("planner", "clairvoyant")) - 1e-6
    # AR: a request's tokens after its prefill's in as many 1.1 ms steps, plus the step in which its finish is seen
    n = [p["tokens"] for p in t["prompts"]]  # one prompt per task
    assert tps["ar1"] == pytest.approx(sum(1e3 * (k - 1) / (1.1 * k) for k in n) / 2)
    # --conf-slope: one point per slope, each recording it; the fixed modes do not depend on it
    out2 = tmp_path / "replay2.json"
    import infer.planner as planner_mod

    given, models, states = [], [], []

    class Spy(planner_mod.StepPlanner):
        def __init__(self, *a, **kw):
            given.append(kw.get("conf_slope"))
            models.append(kw.get("drain_model"))
            states.append(kw.get("state"))
            super().__init__(*a, **kw)

    monkeypatch.setattr(planner_mod, "StepPlanner", Spy)
    assert pt.main(["replay", str(trace), "--costs", str(costs), "--plan-trees", "4", "--conf-slope", "1,auto",
                    "--output", str(out2)]) == 0
    pts = json.loads(out2.read_text())["points"]
    assert [p["conf_slope"] for p in pts] == [1.0, "auto"] and pts[1]["tok_per_s"]["ar1"] == tps["ar1"]
    assert set(given) == {1.0, "auto"} and len(given) == 2 * 2 * 2  # per point: 2 tasks × warm-up and timed pass
    assert pts[0]["tok_per_s"]["tree4"] == pts[1]["tok_per_s"]["tree4"]
    # --drain-model: one point per model, each recording it and building its planners with it
    models.clear()
    assert pt.main(["replay", str(trace), "--costs", str(costs), "--plan-trees", "4", "--drain-model", "scaled,own",
                    "--output", str(out2), "--overwrite"]) == 0
    pts = json.loads(out2.read_text())["points"]
    assert [p["drain_model"] for p in pts] == ["scaled", "own"] and models == ["scaled"] * 4 + ["own"] * 4
    # --state: one point per planner state, recorded, each building its planners with it
    states.clear()
    assert pt.main(["replay", str(trace), "--costs", str(costs), "--plan-trees", "4", "--state", "steps,rows_kv",
                    "--output", str(out2), "--overwrite"]) == 0
    pts = json.loads(out2.read_text())["points"]
    assert [p["state"] for p in pts] == ["steps", "rows_kv"] and states == ["steps"] * 4 + ["rows_kv"] * 4
    with pytest.raises(SystemExit):  # the ceilings "headroom" and "lead_age" were removed (their A/B): no --ceiling
        pt.main(["replay", str(trace), "--costs", str(costs), "--ceiling", "headroom"])
    with pytest.raises(SystemExit):  # the settle rule "estimate" was removed (its GPU A/B): no --settle
        pt.main(["replay", str(trace), "--costs", str(costs), "--settle", "estimate"])
    with pytest.raises(SystemExit, match="--conf-slope: conf_slope='3'"):
        pt.main(["replay", str(trace), "--costs", str(costs), "--conf-slope", "auto,3"])
    with pytest.raises(SystemExit, match=r"records trees \[4, 6\], not \[8\]"):
        pt.main(["replay", str(trace), "--costs", str(costs), "--plan-trees", "8"])


def test_one_token_outputs_and_concurrency_with_the_planner():
    # a prompt whose output is its prefill's token alone never decodes (it used to keep its slot forever)
    one = row([0], [0], [0])
    assert pt.batch_ms([one], 1, {CHAIN: 2.0}, 4, 10, mode=CHAIN) == (0, 0.0, 0)
    a, b = row([1] * 30, [3] * 30, [1] * 30), row([0] * 12, [1] * 12, [0] * 12)
    ms = {AR: 1.0, CHAIN: 1.2, T4: 1.4}
    planner = StepPlanner(dict(ms))
    tok, total, steps = pt.batch_ms([a, one, b, a], 2, ms, 4, 30, planner=planner)
    assert tok == 29 + 11 + 29 and sum(planner.choices.values()) == steps
    assert planner.drain_choices  # the queue runs dry before the last request ends: the drain rule is given
    assert total == pytest.approx(sum(k * ms[m] for m, k in planner.choices.items()))


def bench_file(path, conc, planner_modes, fixed=()):
    """An infer.bench-like JSON: label p with planner_choices, fixed tree labels (size, seconds, verify_steps)."""
    drafts = {"p": {"planner_choices": {k: {"steps": 10, "step_ms": v, "measured_ms": 1.1 * v}
                                        for k, v in planner_modes.items()}}}
    for n, sec, st in fixed:
        drafts[f"t{n}"] = {"verify": "tree", "verified_tokens_per_step": n, "seconds": sec, "verify_steps": st}
    path.write_text(json.dumps({"args": {"concurrency": conc}, "tasks": [{"task": "gsm8k", "drafts": drafts}]}))
    return str(path)


def test_step_times_derives_a_fixed_tree_only_at_concurrency_one(tmp_path):
    modes = {"ar": 1.0, "chain5": 1.2, "tree4": 1.3}
    f1 = bench_file(tmp_path / "c1.json", 1, modes, [(4, 1.0, 100), (6, 1.5, 100)])
    table, true = pt.step_times(f1, "p")
    assert true[T4] == pytest.approx(1.43) and true[("tree", 6)] == pytest.approx(1.5 * 1.43)
    assert table[("tree", 6)] == pytest.approx(1.5 * 1.3)
    # at concurrency 8 a fixed label's verify_steps count request steps: no step time is made up from them
    f8 = bench_file(tmp_path / "c8.json", 8, modes, [(4, 1.0, 100), (6, 1.5, 100)])
    assert ("tree", 6) not in pt.step_times(f8, "p")[1]
    with pytest.raises(SystemExit, match=r"no label 'q' with planner_choices \(labels run with budget=auto: p"):
        pt.step_times(f1, "q")
    with pytest.raises(SystemExit, match="no such file"):
        pt.step_times(str(tmp_path / "none.json"), "p")
    (tmp_path / "bad.json").write_text('{"prompts": []}')
    with pytest.raises(SystemExit, match="no 'tasks' list"):
        pt.step_times(str(tmp_path / "bad.json"), "p")


def test_replay_cli_refuses_bad_arguments_before_any_work(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"prompts": [row([1] * 8, [2] * 8, [1] * 8)], "budgets": [4], "block_size": 5,
                                 "num_prompts": 1, "max_new_tokens": 8}))
    costs = bench_file(tmp_path / "c1.json", 1, {"ar": 1.0, "chain5": 1.2, "tree4": 1.3})
    base = ["replay", str(trace), "--costs", costs]
    for extra, msg in ((["--plan-trees", "4,abc"], "--plan-trees"), (["--plan-trees", "4/4"], "none repeated"),
                       (["--concurrency", "0"], "at least 1"), (["--output", str(tmp_path)], "is a folder"),
                       # a parent that is a file: refused now, not by a traceback after every point was computed
                       (["--output", f"{trace}/a/r.json"], f"cannot create it under {trace} \\(not a writable folder"),
                       (["--output", str(trace)], "exists; pass --overwrite")):
        with pytest.raises(SystemExit, match=msg):
            pt.main(base + extra)
    empty = tmp_path / "e.json"
    empty.write_text(json.dumps({"prompts": [], "budgets": [4], "block_size": 5}))
    with pytest.raises(SystemExit, match="needs non-empty 'prompts'"):
        pt.main(["replay", str(empty), "--costs", costs])
    for extra, msg in ((["--pair-trees", "on,maybe"], "--pair-trees 'on,maybe'"),
                       (["--state", "steps,rows"], "--state 'steps,rows': steps, kv, rows_kv"),
                       (["--drain-model", "own,tail"], "--drain-model 'own,tail': scaled, own, persist"),
                       # "lead" was removed after its H200 A/B: refused, the models named
                       (["--drain-model", "persist,lead"], "--drain-model 'persist,lead': scaled, own, persist,"),
                       (["--tree-like", "4"], "expected N=M"), (["--tree-like", "8=4"], "records trees \\[4\\]")):
        with pytest.raises(SystemExit, match=msg):
            pt.main(base + extra)
    with pytest.raises(SystemExit, match="no step time for"):  # a recorded tree of 6 that no run timed
        pt.replay_point({**json.loads(trace.read_text()), "budgets": [4, 6]}, costs, "p", "6")
    assert pt.main(base + ["--plan-trees", "4, none"]) == 0  # spaces around a comma-separated item are fine
    # an item given twice would compute and write the same point twice (newcomer review: it did)
    for extra, msg in ((["--plan-trees", "4,none, 4"], "--plan-trees: '4' repeats '4'"),
                       (["--times", "table,measured,table"], "--times: 'table' repeats 'table'"),
                       (["--pair-trees", "off,off"], "--pair-trees: 'off' repeats 'off'"),
                       (["--costs", f"{costs},{tmp_path}/../{tmp_path.name}/c1.json"], "--costs: .* repeats")):
        with pytest.raises(SystemExit, match=msg):
            pt.main(base + extra)
    # one prompt cannot fill 8 slots: the engine would run batch 1, not the run's batch 8: skipped, with the reason
    c8 = bench_file(tmp_path / "c8.json", 8, {"ar": 1.0, "chain5": 1.2, "tree4": 1.3})
    out = tmp_path / "r.json"
    assert pt.main(["replay", str(trace), "--costs", f"{c8},{costs}", "--plan-trees", "4", "--output", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [p["concurrency"] for p in rep["points"]] == [1] and "smaller batch" in rep["skipped"][0]["why"]


def test_replay_narrow_chains_are_paired_and_fixed_and_repeat_fills_a_batch(tmp_path):
    """--plan-chains: the chain of 2 is a planner mode and a fixed mode; a step of the full chain gives it its tokens
    capped at 2 (the engine's paired narrow chains), and its own steps give the drain rule chain statistics but no
    confidence. --repeat: a task's prompts decoded K times over, so one prompt fills a batch of 2."""
    C2 = ("chain", 2)
    r = row([3] * 30, [3] * 30, [3] * 30)  # the chain of 4 commits 4 a step, the chain of 2 commits 2
    ms = {AR: 1.0, C2: 1.1, CHAIN: 1.2}
    planner = StepPlanner(dict(ms))
    pt.batch_ms([r], 1, ms, 4, 30, planner=planner)
    assert planner.choices[CHAIN] > planner.choices[C2] and planner.paired[C2] >= planner.choices[CHAIN] - 1
    assert planner.slow[C2] == pytest.approx(2.0, abs=0.05)  # min(4, 2) on every paired step
    # the drain rule's statistics: a narrow chain's steps count for "scaled", not for "own" (the engine's rule)
    seen = {}
    for model in ("scaled", "own"):
        p = StepPlanner({AR: 1.0, C2: 1.1, CHAIN: 9.0}, drain_model=model)  # the full chain never pays
        real = p.choose
        p.choose = lambda predicted, drain, real=real, model=model: (
            seen.setdefault(model, []).append(drain) if drain else None) or real(predicted, drain)
        assert pt.batch_ms([r, r, r], 2, {AR: 1.0, C2: 1.1, CHAIN: 9.0}, 4, 30, planner=p)[0] == 87
    assert max(d[2] for drain in seen["scaled"] for d in drain) > 0  # chain steps counted per request
    assert all(d[2] == 0 for drain in seen["own"] for d in drain)
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"prompts": [row([3] * 20, [3] * 20, [3] * 20)], "budgets": [4], "block_size": 5,
                                 "num_prompts": 1, "max_new_tokens": 20}))
    c2 = bench_file(tmp_path / "c2.json", 2, {"ar": 1.0, "chain2": 1.1, "chain5": 1.2, "tree4": 1.3})
    out = tmp_path / "r.json"
    args = ["replay", str(trace), "--costs", c2, "--plan-trees", "none", "--plan-chains", "2", "--output", str(out)]
    with pytest.raises(SystemExit, match="every point was skipped"):  # one prompt cannot fill a batch of 2
        pt.main(args)
    assert pt.main(args + ["--repeat", "2"]) == 0
    p = json.loads(out.read_text())["points"][0]
    assert p["repeat"] == 2 and p["plan_chains"] == "2" and p["concurrency"] == 2
    assert set(p["per_task_tok_per_s"]["x"]) == {"ar1", "chain2", "chain5", "tree4", "planner"}
    # two prompts of 19 decoded tokens side by side; the chain of 2 commits 2 a step: 10 steps and the one in which
    # the finish is seen, of 1.1 × 1.1 ms (measured)
    assert p["per_task_tok_per_s"]["x"]["chain2"] == pytest.approx(38 / (11 * 1.21) * 1e3)
    # --mix: the tasks' prompts in turn as one task, so two tasks of one prompt each fill a batch of 2 together; the
    # fixed chain of 2 decodes y's 9 tokens (it accepts nothing: one a step) beside x's 19, whose 10 steps and the one
    # in which its finish is seen set the batch's time
    y = {**row([0] * 10, [0] * 10, [0] * 10), "task": "y"}
    trace.write_text(json.dumps({"prompts": [row([3] * 20, [3] * 20, [3] * 20), y], "budgets": [4], "block_size": 5,
                                 "num_prompts": 1, "max_new_tokens": 20}))
    with pytest.raises(SystemExit, match="every point was skipped"):
        pt.main(args + ["--overwrite"])
    assert pt.main(args + ["--overwrite", "--mix"]) == 0
    p = json.loads(out.read_text())["points"][0]
    assert p["mix"] is True and list(p["per_task_tok_per_s"]) == ["mixed"]
    assert p["per_task_tok_per_s"]["mixed"]["chain2"] == pytest.approx((19 + 9) / (11 * 1.21) * 1e3)
    for extra, msg in ((["--repeat", "0"], "--repeat 0: must be 1 to 1024"),
                       (["--repeat", "1025"], "--repeat 1025: must be 1 to 1024"),
                       (["--plan-chains", "2/x"], "--plan-chains"),
                       (["--plan-chains", "8"], "below the trace's block of 5")):
        with pytest.raises(SystemExit, match=msg):
            pt.main(args[:-2] + extra)


def test_replay_never_replaces_a_file_written_during_the_run(tmp_path, monkeypatch, capsys):
    """A --output that another run wrote after this one checked the name stays, and the points go beside it
    (r.2.json); with --overwrite a file there at the start is replaced (newcomer review: a file that appeared during
    the run was silently replaced; planner_trace.py record writes the same way)."""
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"prompts": [row([1] * 8, [2] * 8, [1] * 8)], "budgets": [4], "block_size": 5,
                                 "num_prompts": 1, "max_new_tokens": 8}))
    costs = bench_file(tmp_path / "c1.json", 1, {"ar": 1.0, "chain5": 1.2, "tree4": 1.3})
    out = tmp_path / "r.json"
    real = pt.replay_point

    def meanwhile(*a, **kw):
        out.write_text("another run")
        return real(*a, **kw)

    monkeypatch.setattr(pt, "replay_point", meanwhile)
    argv = ["replay", str(trace), "--costs", costs, "--plan-trees", "4", "--output", str(out)]
    assert pt.main(argv) == 0
    assert out.read_text() == "another run"
    assert f"these points are in {tmp_path / 'r.2.json'}" in capsys.readouterr().err
    assert [p["plan_trees"] for p in json.loads((tmp_path / "r.2.json").read_text())["points"]] == ["4"]
    monkeypatch.setattr(pt, "replay_point", real)
    assert pt.main([*argv, "--overwrite"]) == 0
    assert [p["plan_trees"] for p in json.loads(out.read_text())["points"]] == ["4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c1.json", "r.2.json", "r.json", "t.json"]


def test_replay_takes_the_batch_the_costs_run_ran_at(tmp_path):
    """An infer.bench run at --concurrency 8 whose tasks had one prompt ran batch 1 (its args.max_batch): its step
    times are replayed at concurrency 1, and --concurrency 8 is refused as a batch it did not measure."""
    trace = {"prompts": [row([1] * 8, [2] * 8, [1] * 8)], "budgets": [4], "block_size": 5, "num_prompts": 1,
             "max_new_tokens": 8}
    costs = tmp_path / "c.json"
    bench_file(costs, 8, {"ar": 1.0, "chain5": 1.2, "tree4": 1.3})
    run = json.loads(costs.read_text())
    run["args"]["max_batch"] = 1
    costs.write_text(json.dumps(run))
    assert pt.replay_point(trace, str(costs), "p", "4")["concurrency"] == 1
    with pytest.raises(pt.NoStepTime, match="at concurrency 1, not 8"):
        pt.replay_point(trace, str(costs), "p", "4", concurrency=8)


def test_record_ctrl_c_keeps_the_prompts_recorded(stories_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C during record writes the prompts finished so far, marked "interrupted", and replay notes it (newcomer
    review: a traceback, and every recorded prompt was lost)."""
    target = load_target(str(stories_dir), dtype="fp32")
    draft = save_draft(random_draft(target, block_size=5, mask=0), tmp_path / "draft")
    real, calls = pt.anchor_table, []

    def second_is_stopped(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(pt, "anchor_table", second_is_stopped)
    trace = tmp_path / "trace.json"
    assert pt.main(["record", "--target", str(stories_dir), "--draft", str(draft), "--datasets", "gsm8k,mbpp",
                    "--num-prompts", "1", "--max-new-tokens", "12", "--budgets", "4", "--data-dir",
                    str(shared_path("data", "eval")), "--output", str(trace)]) == 130
    assert f"interrupted: wrote the 1 prompt(s) recorded to {trace}" in capsys.readouterr().err
    t = json.loads(trace.read_text())
    assert t["interrupted"] is True and [p["task"] for p in t["prompts"]] == ["gsm8k"]
    costs = bench_file(tmp_path / "c1.json", 1, {"ar": 1.0, "chain5": 1.2, "tree4": 1.3})
    out = tmp_path / "r.json"
    assert pt.main(["replay", str(trace), "--costs", costs, "--plan-trees", "4", "--output", str(out)]) == 0
    assert f"note: {trace} is an interrupted recording: 1 prompt(s), not 1 per task" in capsys.readouterr().err
    assert json.loads(out.read_text())["trace_interrupted"] is True


def record_argv(stories_dir, draft, out, datasets="gsm8k,mbpp", num="2", new="12", budgets="4,6"):
    return ["record", "--target", str(stories_dir), "--draft", str(draft), "--datasets", datasets, "--num-prompts",
            num, "--max-new-tokens", new, "--budgets", budgets, "--data-dir", str(shared_path("data", "eval")),
            "--output", str(out)]


def stop_at(monkeypatch, n: int) -> list:
    """anchor_table raises KeyboardInterrupt at its n-th call (the n-th prompt of this run); returns the calls."""
    real, calls = pt.anchor_table, []

    def table(*a, **kw):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(pt, "anchor_table", table)
    return calls


def test_record_resume_gives_the_uninterrupted_trace(stories_dir, tmp_path, monkeypatch, capsys):
    """--resume: a recording interrupted after 1 prompt, resumed and interrupted again after 1 more, then resumed to
    the end, holds the rows of a run never interrupted, in its order; replay reads it alike."""
    target = load_target(str(stories_dir), dtype="fp32")
    draft = save_draft(random_draft(target, block_size=5, mask=0), tmp_path / "draft")
    full, part = tmp_path / "full.json", tmp_path / "part.json"
    assert pt.main(record_argv(stories_dir, draft, full)) == 0
    want = json.loads(full.read_text())
    assert want["resumed"] == 0 and want["earlier_runs"] == [] and want["tasks"] == ["gsm8k", "mbpp"]
    assert [(p["task"], p["id"]) for p in want["prompts"]] == [("gsm8k", "0"), ("gsm8k", "1"), ("mbpp", "11"),
                                                              ("mbpp", "12")]
    # rows that tell prompts apart: the equalities below compare real content
    assert len({tuple(p["conf"]) for p in want["prompts"]}) == 4 and len({p["prompt_tokens"] for p in want["prompts"]}) == 4
    calls = stop_at(monkeypatch, 2)
    assert pt.main(record_argv(stories_dir, draft, part)) == 130
    assert len(calls) == 2 and len(json.loads(part.read_text())["prompts"]) == 1
    # resumed: gsm8k's second prompt is recorded (the first is not recomputed), then Ctrl-C in mbpp's first
    calls = stop_at(monkeypatch, 2)
    assert pt.main(record_argv(stories_dir, draft, part) + ["--resume"]) == 130
    assert f"interrupted: wrote the 2 prompt(s) recorded to {part}" in capsys.readouterr().err
    t = json.loads(part.read_text())
    assert t["interrupted"] is True and t["resumed"] == 1 and t["prompts"] == want["prompts"][:2]
    assert [r["prompts"] for r in t["earlier_runs"]] == [1] and sorted(p.name for p in tmp_path.iterdir()) == [
        "draft", "full.json", "part.json"]
    first_seconds = t["seconds"]
    # Ctrl-C before a new prompt is done: the trace is left as it was
    stop_at(monkeypatch, 1)
    before = part.read_text()
    assert pt.main(record_argv(stories_dir, draft, part) + ["--resume"]) == 130
    assert f"no prompt was recorded; {part} is left as it was" in capsys.readouterr().err
    assert part.read_text() == before
    calls = stop_at(monkeypatch, 0)  # never stops
    assert pt.main(record_argv(stories_dir, draft, part) + ["--resume"]) == 0
    assert len(calls) == 2  # mbpp's two prompts alone
    t = json.loads(part.read_text())
    assert t["interrupted"] is False and t["resumed"] == 2 and t["prompts"] == want["prompts"]
    assert [r["prompts"] for r in t["earlier_runs"]] == [1, 2] and t["seconds"] >= first_seconds
    assert t["earlier_runs"][1]["seconds"] == first_seconds and t["command"].endswith("--resume")
    for key in ("target", "draft", "tasks", "num_prompts", "max_new_tokens", "block_size", "budgets"):
        assert t[key] == want[key]
    # replay: the same points from the resumed trace as from the uninterrupted one
    costs = bench_file(tmp_path / "c1.json", 1, {"ar": 1.0, "chain5": 1.2, "tree4": 1.3})
    points = []
    for trace in (full, part):
        out = tmp_path / f"replay-{trace.name}"
        assert pt.main(["replay", str(trace), "--costs", costs, "--plan-trees", "4", "--output", str(out)]) == 0
        rep = json.loads(out.read_text())
        assert rep["trace_interrupted"] is False
        points.append(rep["points"])
    assert points[0] == points[1] and points[0][0]["tok_per_s"]["ar1"] > 0


def test_record_resume_refusals(stories_dir, tmp_path, monkeypatch, capsys):
    """--resume refuses, each by name: a missing --output, a complete trace, another setting (the first that
    differs), prompts not of record's order, and --overwrite (record has no such flag: it never replaces a trace)."""
    target = load_target(str(stories_dir), dtype="fp32")
    draft = save_draft(random_draft(target, block_size=5, mask=0), tmp_path / "draft")
    part, full = tmp_path / "part.json", tmp_path / "full.json"
    assert pt.main(record_argv(stories_dir, draft, full, num="1", new="6")) == 0
    stop_at(monkeypatch, 2)
    assert pt.main(record_argv(stories_dir, draft, part, num="1", new="6")) == 130
    before = part.read_text()
    loaded = []
    monkeypatch.setattr(pt.tp, "load_models", lambda *a: loaded.append(a))  # every refusal comes before the models
    with pytest.raises(SystemExit, match=f"--resume: {tmp_path / 'none.json'} is no file"):
        pt.main(record_argv(stories_dir, draft, tmp_path / "none.json", num="1", new="6") + ["--resume"])
    with pytest.raises(SystemExit, match=f"--resume: {full} is a complete trace .*: nothing to resume"):
        pt.main(record_argv(stories_dir, draft, full, num="1", new="6") + ["--resume"])
    for kw, msg in (({"new": "7"}, "max_new_tokens 6, not 7"), ({"num": "2"}, "num_prompts 1, not 2"),
                    ({"budgets": "4"}, r"budgets \[4, 6\], not \[4\]"),
                    ({"datasets": "mbpp,gsm8k"}, r"tasks \['gsm8k', 'mbpp'\], not \['mbpp', 'gsm8k'\]"),
                    # the first field that differs is named
                    ({"new": "7", "budgets": "4"}, "max_new_tokens 6, not 7")):
        with pytest.raises(SystemExit, match=f"--resume: {part} was recorded with {msg}: resume it with its own"):
            pt.main(record_argv(stories_dir, draft, part, **{"num": "1", "new": "6", **kw}) + ["--resume"])
    with pytest.raises(SystemExit, match=f"--resume: {part} was recorded with draft '{draft}', not '{tmp_path}'"):
        pt.main(record_argv(stories_dir, tmp_path, part, num="1", new="6") + ["--resume"])
    # a trace recorded before "tasks" was stored: its rows' tasks in record's order are what is compared
    t = json.loads(before)
    del t["tasks"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(t))
    with pytest.raises(SystemExit, match=f"{old}: prompts\\[0\\] is gsm8k 0 where record's order has mbpp 11"):
        pt.main(record_argv(stories_dir, draft, old, datasets="mbpp,gsm8k", num="1", new="6") + ["--resume"])
    with pytest.raises(SystemExit) as e:  # argparse: no --overwrite for record
        pt.main(record_argv(stories_dir, draft, part, num="1", new="6") + ["--resume", "--overwrite"])
    assert e.value.code == 2 and "unrecognized arguments: --overwrite" in capsys.readouterr().err
    assert loaded == [] and part.read_text() == before
    monkeypatch.undo()
    # after the models load: another block size, another prompt length than the trace's (nothing recorded)
    for key, value, msg in (("block_size", 9, "block_size 9, not 5"),
                            ("prompt_tokens", 3, r"prompts\[0\] \(gsm8k 0\) has prompt_tokens 3, not \d+")):
        t = json.loads(before)
        if key == "block_size":
            t[key] = value
        else:
            t["prompts"][0][key] = value
        part.write_text(json.dumps(t))
        with pytest.raises(SystemExit, match=f"--resume: {part}.*{msg}"):
            pt.main(record_argv(stories_dir, draft, part, num="1", new="6") + ["--resume"])


def test_second_turn_replay_shows_what_a_mixed_call_carries(tmp_path, capsys):
    """benchmarks/reference/replay_second_turn.py over the committed CPU trace with the H100 step times: the mixed call
    leaves a spread above DEFAULT_SPREAD_REL; "persist" takes it into the stand-in second-turn call and runs more AR
    steps there than "persist_cap", which caps it; within the mixed call the two are the same planner."""
    from benchmarks.reference import replay_second_turn as rst
    from infer.planner import DEFAULT_SPREAD_REL

    out = tmp_path / "new" / "r.json"  # its folder is made
    assert rst.main(["--costs", "results/planner-cost-h100-exact-T0-c64.json", "--models", "persist,persist_cap",
                     "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    persist, cap = (r["models"][m]["calls"] for m in ("persist", "persist_cap"))
    assert [c["call"] for c in persist] == ["mixed", "second turn"]
    assert persist[0]["steps"] == cap[0]["steps"] and persist[0]["carried"] > DEFAULT_SPREAD_REL
    assert persist[1]["steps"].get("ar1", 0) > cap[1]["steps"].get("ar1", 0)
    assert cap[1]["over_chain4"] > persist[1]["over_chain4"]
    assert r["fixed"]["chain4"] == [1.0, 1.0] and r["fixed"]["ar1"][0] < 1
    assert "persist_cap: " in capsys.readouterr().out
    with pytest.raises(SystemExit, match="'lead' is not a drain model"):
        rst.main(["--costs", "results/planner-cost-h100-exact-T0-c64.json", "--models", "persist,lead"])


def test_second_turn_replay_refuses_an_existing_output_and_a_trace_of_another_shape_before_any_work(tmp_path,
                                                                                                    monkeypatch,
                                                                                                    capsys):
    """replay_second_turn.py --output: an existing file is refused up front (was: the replay ran, then wrote
    NAME.2.json beside it with a note that someone else had written it during the run), a folder too (was: written
    as FOLDER.2); --overwrite replaces it. A JSON object that is no record trace names the file (was: KeyError)."""
    from benchmarks.reference import replay_second_turn as rst

    costs = "results/planner-cost-h100-exact-T0-c64.json"
    (tmp_path / "r.json").write_text('{"mine": 1}')
    calls = []
    monkeypatch.setattr(rst, "replay_calls", lambda args: calls.append(args) or {"fixed": {}, "models": {}})
    for output, why in ((tmp_path / "r.json", "exists"), (tmp_path, "is a folder")):
        with pytest.raises(SystemExit) as e:
            rst.main(["--costs", costs, "--output", str(output)])
        assert e.value.code == 2 and f"error: --output {output} {why}" in capsys.readouterr().err
    assert calls == [] and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    assert (tmp_path / "r.json").read_text() == '{"mine": 1}'
    assert rst.main(["--costs", costs, "--output", str(tmp_path / "r.json"), "--overwrite"]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["models"] == {} and len(calls) == 1
    monkeypatch.undo()
    with pytest.raises(SystemExit, match=f"^{costs}: needs non-empty 'prompts', 'block_size' and 'max_new_tokens'"):
        rst.main(["--costs", costs, "--trace", costs])
