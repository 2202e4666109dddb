"""benchmarks/engine/tree_lead_fit.py: the three per-request models of a tree's tokens per step from the chain's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.engine import tree_lead_fit as tlf


def test_each_model_fits_its_own_data_exactly():
    chain = np.linspace(1.5, 5.0, 20)
    lead = tlf.fit(chain, chain + 0.8)
    assert lead["lead"]["L"] == pytest.approx(0.8) and lead["lead"]["rmse"] == pytest.approx(0, abs=1e-12)
    assert lead["accepted"]["low_quartile_bias"] > 0.2  # a constant lead is under-predicted for the hard requests
    acc = tlf.fit(chain, 1 + 1.3 * (chain - 1))
    assert acc["accepted"]["k"] == pytest.approx(1.3) and acc["accepted"]["rmse"] == pytest.approx(0, abs=1e-12)
    assert acc["lead"]["low_quartile_bias"] < -0.2  # and a scaled one over-predicted by the constant lead
    ratio = tlf.fit(chain, 1.25 * chain)
    assert ratio["ratio"]["k"] == pytest.approx(1.25) and ratio["ratio"]["rmse"] == pytest.approx(0, abs=1e-12)
    assert ratio["requests"] == 20 and ratio["chain_mean"] == pytest.approx(3.25)
    with pytest.raises(ValueError, match="at least 4 requests"):
        tlf.fit(chain[:3], chain[:3])


def test_cli_reads_bench_files_and_names_a_missing_label(tmp_path, capsys):
    def task(name, committed):
        return {"task": name, "drafts": {lab: {"per_prompt_committed": c, "per_prompt_steps": [10] * len(c)}
                                         for lab, c in committed.items()}}

    run = {"commit": "abc", "args": {"concurrency": 8}, "tasks": [
        task("a", {"chain": [20, 30, 40, 50], "t16": [28, 38, 48, 58]}),
        task("b", {"chain": [25, 35], "t16": [33, 43]})]}
    f = tmp_path / "run.json"
    f.write_text(json.dumps(run))
    out = tmp_path / "fit.json"
    assert tlf.main([str(f), "--trees", "t16", "--output", str(out)]) == 0
    r = json.loads(out.read_text())["files"][str(f)]
    assert r["concurrency"] == 8 and r["t16"]["lead"]["L"] == pytest.approx(0.8) and r["t16"]["requests"] == 6
    assert tlf.main([str(f), "--trees", "t32"]) == 2
    assert "task 'a' has no draft label 't32'" in capsys.readouterr().err


def _task(name, committed, steps=None):
    return {"task": name, "drafts": {lab: {"per_prompt_committed": c,
                                           "per_prompt_steps": (steps or {}).get(lab, [10] * len(c))}
                                     for lab, c in committed.items()}}


def test_requests_are_paired_by_prompt_before_zero_step_ones_are_dropped(tmp_path):
    """A prompt with no step under one label is left out under every label: each tree stays paired with the chain
    on its own prompt (dropping per label shifted the pairs by one)."""
    chain = [20, 30, 40, 50, 60, 70]
    run = {"tasks": [_task("a", {"chain": chain, "t16": [c + 8 for c in chain], "t32": [c + 8 for c in chain]},
                           steps={"chain": [0, 10, 10, 10, 10, 10], "t16": [10, 0, 10, 10, 10, 10]})]}
    tau = tlf.per_request(run, ["chain", "t16", "t32"])
    assert tau.shape == (3, 4) and tau[0].tolist() == [4.0, 5.0, 6.0, 7.0]
    f = tmp_path / "run.json"
    f.write_text(json.dumps(run))
    out = tmp_path / "fit.json"
    assert tlf.main([str(f), "--output", str(out)]) == 0
    r = json.loads(out.read_text())["files"][str(f)]
    for label in ("t16", "t32"):
        assert r[label]["requests"] == 4 and r[label]["lead"]["L"] == pytest.approx(0.8), label
        assert r[label]["lead"]["rmse"] == pytest.approx(0, abs=1e-12), label


def test_errors_name_the_file_and_label(tmp_path, capsys):
    f = tmp_path / "run.json"
    for run, msg in [
            ({"tasks": [_task("a", {"chain": [20, 30, 40, 50], "t16": [28, 38, 48]})]},
             "task 'a': the labels ran different numbers of prompts {'chain': 4, 't16': 3}"),
            ({"tasks": [_task("a", {"chain": [20, 30, 40, 50]})]}, "task 'a' has no draft label 't16'"),
            ({"tasks": [{"task": "a", "drafts": {"chain": {}, "t16": {}}}]},
             "task 'a', label 'chain': no per_prompt_committed and per_prompt_steps"),
            ({"tasks": [_task("a", {"chain": [20, 30, 40], "t16": [28, 38, 48]})]},
             "label 't16' against 'chain': need two equal 1-D arrays of at least 4 requests"),
            ({"results": []}, "no 'tasks' list (not an infer.bench JSON)"),
            ({"tasks": [{"task": "a"}]}, "not an infer.bench JSON (KeyError 'drafts')")]:
        f.write_text(json.dumps(run))
        assert tlf.main([str(f), "--trees", "t16"]) == 2
        err = capsys.readouterr().err
        assert f"error: {f}" in err and msg in err, err
    f.write_text("{")
    assert tlf.main([str(f), "--trees", "t16"]) == 2
    assert f"error: {f}: Expecting property name" in capsys.readouterr().err


def test_an_existing_output_is_replaced_only_with_overwrite(tmp_path, capsys):
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"tasks": [_task("a", {"chain": [20, 30, 40, 50], "t16": [28, 38, 48, 58]})]}))
    out = tmp_path / "fit.json"
    out.write_text("keep")
    assert tlf.main([str(f), "--trees", "t16", "--output", str(out)]) == 2
    assert f"--output {out} exists; pass --overwrite to replace it" in capsys.readouterr().err
    assert out.read_text() == "keep"
    assert tlf.main([str(f), "--trees", "t16", "--output", str(out), "--overwrite"]) == 0
    assert json.loads(out.read_text())["files"][str(f)]["t16"]["requests"] == 4


def test_a_chain_that_never_accepts_is_an_error_not_nan(tmp_path, capsys):
    """Every chain τ 1.0 (a random draft): the accepted model's k is 0 / 0; an error naming the file and label, not a
    NaN that the JSON writer refuses after the work."""
    with pytest.raises(ValueError, match="every request's chain τ is 1.0: no accepted draft tokens to fit"):
        tlf.fit(np.ones(6), np.array([1.0, 1.2, 1.0, 1.5, 1.1, 1.0]))
    f, out = tmp_path / "run.json", tmp_path / "fit.json"
    f.write_text(json.dumps({"tasks": [_task("a", {"chain": [10, 10, 10, 10], "t16": [12, 10, 15, 11]})]}))
    assert tlf.main([str(f), "--trees", "t16", "--output", str(out)]) == 2
    assert (f"error: {f}, label 't16' against 'chain': every request's chain τ is 1.0"
            in capsys.readouterr().err) and not out.exists()
