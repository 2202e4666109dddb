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
