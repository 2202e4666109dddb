"""benchmarks/engine/bench_tree.py on the CPU (--tiny, stories260K target, random draft): the chain-vs-tree
part and a planner point, each one infer.bench run with the configurations alternated per task."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dspine.checkpoint import save_draft
from dspine.target import load_target
from tests.conftest import REPO, shared_path
from tests.helpers import random_draft


@pytest.fixture(scope="module")
def draft_dir(stories_dir, tmp_path_factory):
    target = load_target(str(stories_dir), dtype="fp32")
    return save_draft(random_draft(target, block_size=8, mask=0), tmp_path_factory.mktemp("tree_draft"))


def test_tiny_invariant_planner_point_runs_no_tree_and_decodes_ars_text(stories_dir, draft_dir, tmp_path):
    """--invariant at a T > 0 point: every run gets infer.bench --invariant, no fixed tree runs, the best fixed mode
    is AR or the chain, and the chain's and the planner's outputs are AR's (same_text_as_ar); a T = 0 point alone is
    refused, as is --plan-trees."""
    out, runs = tmp_path / "verify.json", tmp_path / "runs"
    base = [sys.executable, str(REPO / "benchmarks" / "engine" / "bench_tree.py"), "--tiny", "--skip-steps",
            "--skip-smollm2", "--smollm2", str(stories_dir), "--draft", str(draft_dir), "--datasets", "gsm8k",
            "--data-dir", str(shared_path("data", "eval")), "--num-prompts", "2", "--max-new-tokens", "8",
            "--output", str(out)]
    r = subprocess.run(base + ["--planner", "2:1", "--invariant", "--keep-runs", str(runs)], capture_output=True,
                       text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    (p,) = json.loads(out.read_text())["planner"]
    kept = json.loads((runs / "planner-c2-T1.json").read_text())
    # the default fixed narrower chains (FIXED_CHAINS, 2 and 4) run beside the chain, and count in the best fixed mode
    assert kept["args"]["invariant"] is True and set(kept["tasks"][0]["drafts"]) == {"chain", "auto", "chain2", "chain4"}
    assert p["invariant"] is True and p["tree_tok_per_s"] is None and p["fixed_tree_tok_per_s"] == {}
    assert p["plan_chains"] == [2, 4]  # not given: Engine.PLAN_CHAINS below the tiny draft's block of 8
    assert p["best_static_tok_per_s"] == pytest.approx(max(p["ar_tok_per_s"], p["chain_tok_per_s"],
                                                           *p["fixed_chain_tok_per_s"].values()))
    assert p["same_text_as_ar"] == {"chain": [2, 2], "auto": [2, 2], "chain2": [2, 2], "chain4": [2, 2]}
    for extra, msg in ((["--planner", "2:0", "--invariant"], "applies to --planner points at T > 0"),
                       (["--planner", "2:1", "--invariant", "--plan-trees", "6"], "no tree runs at a T > 0 point"),
                       (["--planner", "2:1", "--invariant", "--fixed-trees", "6"], "no tree runs at a T > 0 point")):
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=600, cwd=REPO)
        assert r.returncode == 2 and msg in r.stderr, r.stderr[-2000:]


def test_tiny_chain_tree_and_planner_point(stories_dir, draft_dir, tmp_path):
    out, runs = tmp_path / "verify.json", tmp_path / "runs"
    cmd = [sys.executable, str(REPO / "benchmarks" / "engine" / "bench_tree.py"), "--tiny", "--skip-steps",
           "--smollm2", str(stories_dir), "--draft", str(draft_dir), "--planner", "2:0", "--tree-budget", "12",
           "--datasets", "gsm8k,mbpp", "--data-dir", str(shared_path("data", "eval")), "--num-prompts", "2",
           "--max-new-tokens", "8", "--keep-runs", str(runs), "--output", str(out), "--prefill-buckets",
           "--no-plan-drain", "--fixed-trees", "12,6", "--plan-trees", "6/12", "--fixed-chains", "4",
           "--plan-chains", "2/4"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    kept = json.loads((runs / "planner-c2-T0.json").read_text())
    assert kept["args"]["prefill_buckets"] is True and kept["args"]["plan_drain"] is False  # passed through
    assert [t["run_order"] for t in kept["tasks"]] == [["AR", "chain", "tree", "auto", "tree6", "chain4"],
                                                       ["chain", "tree", "auto", "tree6", "chain4", "AR"]]
    assert kept["args"]["configs"]["auto"]["plan_trees"] == [6, 12]
    assert kept["args"]["configs"]["auto"]["plan_chains"] == [2, 4] and kept["args"]["configs"]["chain4"]["width"] == 4
    assert kept["tasks"][0]["drafts"]["chain4"]["verified_tokens_per_step"] == 4
    assert kept["args"]["configs"]["tree6"]["tree_budget"] == 6
    (p,) = res["planner"]
    ar = sum(t["ar"]["tok_per_s"] for t in kept["tasks"]) / 2
    tok = {n: sum(t["drafts"][n]["tok_per_s"] for t in kept["tasks"]) / 2
           for n in ("chain", "tree", "auto", "tree6", "chain4")}
    assert p["ar_tok_per_s"] == pytest.approx(ar) and p["planner_tok_per_s"] == pytest.approx(tok["auto"])
    assert p["best_static_tok_per_s"] == pytest.approx(max(ar, tok["chain"], tok["tree"], tok["tree6"], tok["chain4"]))
    assert p["fixed_tree_tok_per_s"] == pytest.approx({"6": tok["tree6"], "12": tok["tree"]})
    assert p["fixed_chain_tok_per_s"] == pytest.approx({"4": tok["chain4"]})
    assert p["plan_trees"] == [6, 12] and p["plan_chains"] == [2, 4]
    assert set(p["mean_tau"]) == {"chain", "auto", "tree", "tree6", "chain4"}
    assert p["planner_over_best_static"] == pytest.approx(tok["auto"] / p["best_static_tok_per_s"])
    assert p["planner_over_ar"] == pytest.approx(tok["auto"] / ar) and p["same_run"] is True
    assert len(p["planner_choices_per_task"]) == 2 and all(p["planner_choices_per_task"])
    assert p["seeds"] == [0] and "per_seed" not in p and kept["args"]["seed"] == 0
    for row, t in zip(p["per_task"], kept["tasks"]):  # per task and configuration, from the kept run
        assert row["task"] == t["task"] and set(row) == {"task", "seed", "ar", "chain", "tree", "auto", "tree6",
                                                         "chain4"}
        assert row["auto"]["seconds"] == pytest.approx(t["drafts"]["auto"]["seconds"], abs=1e-4)
        assert row["ar"]["admits"] == t["ar"]["profile"]["admits"] >= 1
        for label in ("ar", "auto"):  # the decode steps too: time per step, mode against mode
            assert row[label]["steps"] == pytest.approx(t[label]["profile"]["steps"] if label == "ar" else
                                                        t["drafts"][label]["profile"]["steps"], abs=1e-4)
            assert row[label]["steps"] >= 8 and set(row[label]) >= {"host_s", "wait_s", "launch_s", "prefill_s"}
    sm = json.loads((runs / "chain-tree.json").read_text())
    assert "ar" not in sm["tasks"][0] and sm["tasks"][0]["drafts"]["tree"]["verified_tokens_per_step"] == 12
    assert res["smollm2"]["tree_tau_over_chain_tau"] == pytest.approx(
        sm["summary"]["tree"]["mean_tau"] / sm["summary"]["chain"]["mean_tau"])


def test_tiny_planner_point_over_seeds(stories_dir, draft_dir, tmp_path):
    """--seeds at T > 0: one infer.bench run per seed (kept as -seedN), the point's tok/s the mean over the seeds,
    per_seed with each run's ratios; the T = 0 point of the same command runs once."""
    out, runs = tmp_path / "verify.json", tmp_path / "runs"
    cmd = [sys.executable, str(REPO / "benchmarks" / "engine" / "bench_tree.py"), "--tiny", "--skip-steps",
           "--skip-smollm2", "--smollm2", str(stories_dir), "--draft", str(draft_dir), "--planner", "2:0,2:1",
           "--tree-budget", "6", "--datasets", "gsm8k", "--data-dir", str(shared_path("data", "eval")),
           "--num-prompts", "2", "--max-new-tokens", "8", "--keep-runs", str(runs), "--output", str(out),
           "--plan-trees", "6", "--seeds", "3,5", "--plan-drain-model", "own", "--plan-state", "kv"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    t0, t1 = json.loads(out.read_text())["planner"]
    assert t0["seeds"] == [0] and "per_seed" not in t0 and (runs / "planner-c2-T0.json").is_file()
    kept = [json.loads((runs / f"planner-c2-T1-seed{sd}.json").read_text()) for sd in (3, 5)]
    # --plan-drain-model and --plan-state: the planner's, passed to every run and recorded with the point
    assert [k["args"]["configs"]["auto"]["drain"] for k in kept] == ["own", "own"] and t1["plan_drain_model"] == "own"
    assert [k["args"]["configs"]["auto"]["state"] for k in kept] == ["kv", "kv"] and t1["plan_state"] == "kv"
    assert [k["args"]["seed"] for k in kept] == [3, 5] and t1["seeds"] == [3, 5]
    mean = lambda k, n: sum(t["ar"]["tok_per_s"] if n == "AR" else t["drafts"][n]["tok_per_s"] for t in k["tasks"])
    for n, key in (("AR", "ar_tok_per_s"), ("auto", "planner_tok_per_s"), ("chain", "chain_tok_per_s")):
        assert t1[key] == pytest.approx((mean(kept[0], n) + mean(kept[1], n)) / 2)
    for e, k in zip(t1["per_seed"], kept):
        assert e["planner_over_ar"] == pytest.approx(mean(k, "auto") / mean(k, "AR"))
    assert [row["seed"] for row in t1["per_task"]] == [3, 5] and len(t1["planner_choices_per_task"]) == 2
    assert t1["planner_over_ar"] == pytest.approx(t1["planner_tok_per_s"] / t1["ar_tok_per_s"])


@pytest.mark.parametrize("extra, msg", [
    (["--planner", "2:1", "--seeds", "0,x"], "--seeds '0,x': give non-negative integers"),
    (["--planner", "2:1", "--seeds", "1,1"], "--seeds '1,1': a seed given twice"),
    (["--planner", "2:0", "--seeds", "0,1"], "--seeds 0,1: applies to --planner points at T > 0"),
    (["--planner", "2:0,2:0.0"], "a point given twice"),
    (["--planner", "1:0,2:-1"], "2:-1: CONCURRENCY must be >= 1 and TEMPERATURE 0 or a finite number"),
    (["--planner", "0:1"], "0:1: CONCURRENCY must be >= 1"),
    (["--planner", "2:nan"], "2:nan: CONCURRENCY must be >= 1"),
    (["--planner", "x:0"], "CONCURRENCY is an integer"),
    (["--planner", "2:0", "--keep-runs", "{file}"], "exists and is not a folder"),
    (["--planner", "2:0", "--fixed-trees", "16,x"], "--fixed-trees '16,x': give tree sizes in 2..64"),
    (["--planner", "2:0", "--fixed-trees", "99"], "--fixed-trees '99': give tree sizes in 2..64"),
    (["--planner", "2:0", "--plan-trees", "16,32"], "--plan-trees: plan_trees='16,32'; expected tree sizes joined by '/'"),
    (["--plan-trees", "16/32"], "--fixed-trees, --plan-trees, --fixed-chains and --plan-chains apply to --planner"),
    (["--plan-chains", "4"], "--fixed-trees, --plan-trees, --fixed-chains and --plan-chains apply to --planner"),
    (["--planner", "2:0", "--fixed-chains", "4,x"], "--fixed-chains '4,x': give chain widths in 2..64"),
    (["--planner", "2:0", "--fixed-chains", "1"], "--fixed-chains '1': give chain widths in 2..64"),
    (["--planner", "2:0", "--plan-chains", "4,8"], "--plan-chains: plan_chains='4,8'; expected chain widths"),
    (["--fixed-chains", "2,4"], "--fixed-trees, --plan-trees, --fixed-chains and --plan-chains apply to --planner"),
    (["--plan-state", "kv"], "--plan-state set the --planner points' planner: give --planner"),
    (["--plan-state", "kv", "--plan-drain-model", "own"], "--plan-state and --plan-drain-model set the --planner points'"),
    (["--planner", "2:0", "--fixed-chains", "4,8"], "--fixed-chains 4,8: each width must be below the draft's block of 8"),
    (["--planner", "2:0", "--plan-chains", "2/12"], "--plan-chains 2,12: each width must be below the draft's block of 8"),
])
def test_bench_tree_checks_planner_points_and_keep_runs(stories_dir, draft_dir, tmp_path, extra, msg, capsys):
    """bench_tree.py's argument checks, through its main() in this process (no torch start per case): exit 2 and
    the message on stderr."""
    from benchmarks.engine import bench_tree

    (tmp_path / "f").write_text("")
    extra = [x.replace("{file}", str(tmp_path / "f")) for x in extra]
    argv = ["--tiny", "--skip-steps", "--smollm2", str(stories_dir), "--draft", str(draft_dir), *extra]
    try:
        rc = bench_tree.main(argv)
    except SystemExit as e:  # argparse's error
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and msg in err, err[-2000:]


def test_default_fixed_chains_keep_the_widths_below_the_drafts_block(tmp_path):
    """bench_tree's default fixed chains (FIXED_CHAINS) drop the widths a small-block draft cannot run, so a draft of
    block 4 gets the chain of 2 and no error for a flag it was not given; a given --fixed-chains is kept as given
    (main() refuses one not below the block); draft_block_size reads a local folder's config.json, else None."""
    from types import SimpleNamespace

    from benchmarks.engine.bench_tree import FIXED_CHAINS, draft_block_size, fixed_chains

    assert FIXED_CHAINS == "2,4"
    default = SimpleNamespace(fixed_chains=None)
    assert fixed_chains(default) == [2, 4] and fixed_chains(default, 8) == [2, 4]
    assert fixed_chains(default, 4) == [2] and fixed_chains(default, 2) == []
    assert fixed_chains(SimpleNamespace(fixed_chains="4,2,4"), 4) == [2, 4]
    assert fixed_chains(SimpleNamespace(fixed_chains="none"), 8) == []
    (tmp_path / "config.json").write_text(json.dumps({"block_size": 4}))
    assert draft_block_size(str(tmp_path)) == 4
    assert draft_block_size(str(tmp_path / "missing")) is None and draft_block_size(None) is None
    (tmp_path / "config.json").write_text("{}")
    assert draft_block_size(str(tmp_path)) is None
