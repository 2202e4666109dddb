"""benchmarks/reference/tree_policy.py: the offline replay of tree rules at T = 0 builds the shipped trees
(dspine.tree.build_tree, chain first or best first), counts steps like a decoder and refuses to overwrite."""

import json

import pytest
import torch

from benchmarks.reference import tree_policy as tp
from dspine.checkpoint import save_draft
from dspine.target import load_target
from dspine.tree import build_tree
from tests.conftest import shared_path
from tests.helpers import random_draft


def column_paths(tree, cand, b):
    """Every real node of row b as its path of candidate columns (cand [K, W]: the tokens of each depth)."""
    out = []
    for n in range(1, tree.size):
        if int(tree.parent[b, n]) < 0:
            continue
        path, x = [], n
        while x > 0:
            d = int(tree.depth[b, x]) - 1
            path.append(int((cand[d] == tree.tokens[b, x]).nonzero()[0, 0]))
            x = int(tree.parent[b, x])
        out.append(tuple(reversed(path)))
    return sorted(out)


@pytest.mark.parametrize("chain_first", [True, False])
@pytest.mark.parametrize("N", [3, 9, 17, 33])
def test_best_first_builds_the_shipped_tree(chain_first, N):
    g = torch.Generator().manual_seed(N + 100 * chain_first)
    B, K, V = 4, 6, 80
    q = torch.softmax(3 * torch.randn(B, K, V, generator=g), -1)
    tree = build_tree(torch.zeros(B, dtype=torch.long), q, N, chain_first=chain_first)
    vals, cand = q.topk(N - 1, dim=-1)
    for b in range(B):
        lq = vals[b].log().tolist()
        nodes = tp.best_first([[row, row] for row in lq], N, forced=chain_first)
        assert sorted(nodes) == column_paths(tree, cand[b], b)


def test_accepted_depth_and_replay_count_like_a_decoder():
    nodes = [(0,), (1,), (0, 0), (0, 2), (0, 0, 1)]
    assert tp.accepted_depth(nodes, [0, 0, 1]) == 3
    assert tp.accepted_depth(nodes, [0, 2, 0]) == 2
    assert tp.accepted_depth(nodes, [1, 0, 0]) == 1
    assert tp.accepted_depth(nodes, [2, 0, 0]) == 0
    # 7 tokens to emit: at 0 accept 2 (3 tokens), at 3 accept 0 (1), at 4 accept 5 capped to the 2 left + bonus
    assert tp.replay([2, 9, 9, 0, 5, 9, 9], 7) == (7, 3)
    assert tp.replay([0] * 5, 5) == (5, 5)


def test_platt_fit_recovers_a_logistic_slope():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(20000, generator=g) * -6
    y = (torch.rand(20000, generator=g) < torch.sigmoid(0.5 + 1.2 * x)).float()
    a, b = tp.fit_platt(x, y)
    assert abs(a - 0.5) < 0.1 and abs(b - 1.2) < 0.1


def test_tree_policy_tiny_run(stories_dir, tmp_path, capsys):
    target = load_target(str(stories_dir), dtype="fp32")
    draft = save_draft(random_draft(target, block_size=6, mask=0), tmp_path / "draft")
    out = tmp_path / "tp.json"
    argv = ["--target", str(stories_dir), "--draft", str(draft), "--datasets", "gsm8k,mbpp", "--num-prompts", "2",
            "--max-new-tokens", "10", "--budgets", "4,7", "--data-dir", str(shared_path("data", "eval")),
            "--output", str(out)]
    assert tp.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["commit"] and res["budgets"] == [4, 7] and set(res["per_task_tau"]) == {"gsm8k", "mbpp"}
    tau = res["mean_tau"]
    for n in (4, 7):  # the Python best first is the shipped builder's rule
        assert tau[f"builder_N{n}"] == pytest.approx(tau[f"product_forced_N{n}"])
    assert all(v >= 1.0 for v in tau.values())
    with pytest.raises(SystemExit, match="exists"):
        tp.main(argv)


def test_tree_policy_bad_arguments_are_named_before_the_models_load(stories_dir, tmp_path):
    """--num-prompts 0, an unknown task and a draft built for another target end in a message naming the flag and
    value, not a traceback (second fresh-clone review); nothing is written."""
    target = load_target(str(stories_dir), dtype="fp32")
    draft = save_draft(random_draft(target, block_size=6, mask=0), tmp_path / "draft")
    out = tmp_path / "tp.json"
    base = ["--target", str(stories_dir), "--data-dir", str(shared_path("data", "eval")), "--output", str(out)]
    for extra, msg in ((["--draft", str(draft), "--num-prompts", "0"], r"--num-prompts 0 \(each at least 1\)"),
                       (["--draft", str(draft), "--max-new-tokens", "-3"], "--max-new-tokens -3"),
                       (["--draft", str(draft), "--datasets", "gsm8k,bogus"], "--datasets 'bogus'.*unknown dataset"),
                       (["--draft", str(draft), "--budgets", "4,4"], "--budgets 4,4: each must be in \\[2, 64\\], none"),
                       (["--draft", str(draft), "--budgets", "+4, 8"], "--budgets '\\+4, 8': give comma-separated"),
                       (["--draft", str(draft), "--datasets", "gsm8k,GSM8K"], "--datasets 'GSM8K'.*given twice"),
                       # a --data-dir that is not there fails at once (it went to the Hub: 25 s of retries offline)
                       (["--draft", str(draft), "--data-dir", str(tmp_path / "nope")], "--data-dir .*nope: no such folder"),
                       (["--draft", str(draft), "--data-dir", str(draft / "config.json")], "config.json: no such folder")):
        with pytest.raises(SystemExit, match=msg):
            tp.main([*base, *extra])
    cfg = json.loads((draft / "config.json").read_text())
    cfg["num_target_layers"] = target.num_layers + 3  # a draft made for a deeper target
    (draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit, match=f"--draft {draft}: draft/target mismatch:\n  num_target_layers"):
        tp.main([*base, "--draft", str(draft), "--datasets", "gsm8k", "--num-prompts", "1"])
    assert not out.exists()
