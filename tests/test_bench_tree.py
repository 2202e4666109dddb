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


def test_tiny_chain_tree_and_planner_point(stories_dir, draft_dir, tmp_path):
    out, runs = tmp_path / "verify.json", tmp_path / "runs"
    cmd = [sys.executable, str(REPO / "benchmarks" / "engine" / "bench_tree.py"), "--tiny", "--skip-steps",
           "--smollm2", str(stories_dir), "--draft", str(draft_dir), "--planner", "2:0", "--tree-budget", "12",
           "--datasets", "gsm8k,mbpp", "--data-dir", str(shared_path("data", "eval")), "--num-prompts", "2",
           "--max-new-tokens", "8", "--keep-runs", str(runs), "--output", str(out), "--prefill-buckets",
           "--no-plan-drain", "--fixed-trees", "12,6", "--plan-trees", "6/12"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    kept = json.loads((runs / "planner-c2-T0.json").read_text())
    assert kept["args"]["prefill_buckets"] is True and kept["args"]["plan_drain"] is False  # passed through
    assert [t["run_order"] for t in kept["tasks"]] == [["AR", "chain", "tree", "auto", "tree6"],
                                                       ["chain", "tree", "auto", "tree6", "AR"]]
    assert kept["args"]["configs"]["auto"]["plan_trees"] == [6, 12]
    assert kept["args"]["configs"]["tree6"]["tree_budget"] == 6
    (p,) = res["planner"]
    ar = sum(t["ar"]["tok_per_s"] for t in kept["tasks"]) / 2
    tok = {n: sum(t["drafts"][n]["tok_per_s"] for t in kept["tasks"]) / 2 for n in ("chain", "tree", "auto", "tree6")}
    assert p["ar_tok_per_s"] == pytest.approx(ar) and p["planner_tok_per_s"] == pytest.approx(tok["auto"])
    assert p["best_static_tok_per_s"] == pytest.approx(max(ar, tok["chain"], tok["tree"], tok["tree6"]))
    assert p["fixed_tree_tok_per_s"] == pytest.approx({"6": tok["tree6"], "12": tok["tree"]})
    assert p["plan_trees"] == [6, 12] and set(p["mean_tau"]) == {"chain", "auto", "tree", "tree6"}
    assert p["planner_over_best_static"] == pytest.approx(tok["auto"] / p["best_static_tok_per_s"])
    assert p["planner_over_ar"] == pytest.approx(tok["auto"] / ar) and p["same_run"] is True
    assert len(p["planner_choices_per_task"]) == 2 and all(p["planner_choices_per_task"])
    for row, t in zip(p["per_task"], kept["tasks"]):  # per task and configuration, from the kept run
        assert row["task"] == t["task"] and set(row) == {"task", "ar", "chain", "tree", "auto", "tree6"}
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


@pytest.mark.parametrize("extra, msg", [
    (["--planner", "2:0,2:0.0"], "a point given twice"),
    (["--planner", "x:0"], "CONCURRENCY is an integer"),
    (["--planner", "2:0", "--keep-runs", "{file}"], "exists and is not a folder"),
    (["--planner", "2:0", "--fixed-trees", "16,x"], "--fixed-trees '16,x': give tree sizes in 2..64"),
    (["--planner", "2:0", "--fixed-trees", "99"], "--fixed-trees '99': give tree sizes in 2..64"),
    (["--planner", "2:0", "--plan-trees", "16,32"], "--plan-trees: plan_trees='16,32'; expected tree sizes joined by '/'"),
    (["--plan-trees", "16/32"], "--fixed-trees and --plan-trees apply to --planner points"),
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
