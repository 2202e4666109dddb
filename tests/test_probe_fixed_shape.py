"""benchmarks/engine/probe_fixed_shape.py on the CPU (tiny random target, fp32, torch kernels): an AR step padded
to the verify width gives logits bitwise equal to the same position inside a verify pass (issue 13's
fixed-shape idea), as exact mode does; the JSON counts add up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def test_padded_ar_equals_verify_on_the_cpu(tmp_path):
    out = tmp_path / "probe.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "engine" / "probe_fixed_shape.py"), "--device", "cpu",
           "--shapes", "tiny", "--batch", "1", "3", "--width", "8", "--iters", "2", "--output", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    for B in (1, 3):
        row = res["shapes"]["tiny"][f"batch{B}"]
        for mode in ("fast", "fast_padded", "attn_exact_padded", "exact"):
            assert row[mode]["pairs"] == 8 * B and 0 <= row[mode]["bitwise_equal"] <= row[mode]["argmax_agree"] <= 8 * B
        for mode in ("fast_padded", "attn_exact_padded", "exact"):  # one GEMM shape for AR and verify: bitwise
            assert row[mode]["bitwise_equal"] == 8 * B, (B, mode, row[mode])
        assert row["padded_over_ar"] == row["padded_ar_step_ms"] / row["ar_step_ms"]


def test_probe_rejects_unknown_shape(capsys):
    """Its main() in this process (an argument check: no torch start of its own)."""
    from benchmarks.engine import probe_fixed_shape

    with pytest.raises(SystemExit) as e:  # argparse's error
        probe_fixed_shape.main(["--device", "cpu", "--shapes", "tiny,llama-70b"])
    assert e.value.code == 2 and "unknown shape 'llama-70b'" in capsys.readouterr().err
