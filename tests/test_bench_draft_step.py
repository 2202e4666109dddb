"""benchmarks/engine/bench_draft_step.py: the CPU smoke path (--device cpu --tiny) writes its record."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_tiny_cpu_run_writes_the_ratio(tmp_path):
    """Plain and with --kv (a third draft with the kv injection, timed in the same interleaved rounds)."""
    out = tmp_path / "draft-step.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "engine" / "bench_draft_step.py"), "--device", "cpu", "--tiny",
           "--batch", "1", "2", "--context", "16", "--iters", "1", "--reps", "2", "--warmup", "0", "--kv",
           "--output", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["command"] and rec["device"] and rec["date"]
    rows = [rec["shapes"]["tiny"][f"batch{b}"] for b in (1, 2)]
    for row in rows:
        assert row["dflash_step_ms"] > 0 and row["dspine_step_ms"] > 0
        assert abs(row["dspine_step_over_dflash_step"] - row["dspine_step_ms"] / row["dflash_step_ms"]) < 1e-12
        assert row["dspine_draft_over_dflash_draft"] > 0
    assert rec["dspine_step_over_dflash_step"] == max(row["dspine_step_over_dflash_step"] for row in rows)
    for row in rows:
        assert row["dspine_kv_step_ms"] > 0 and row["dspine_kv_draft_over_dflash_draft"] > 0
        assert abs(row["dspine_kv_step_over_dflash_step"] - row["dspine_kv_step_ms"] / row["dflash_step_ms"]) < 1e-12
    assert rec["dspine_kv_step_over_dflash_step"] == max(row["dspine_kv_step_over_dflash_step"] for row in rows)
