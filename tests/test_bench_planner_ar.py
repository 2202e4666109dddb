"""benchmarks/engine/bench_planner_ar.py: the CPU smoke path (--tiny --device cpu, its small defaults) writes
its record."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_tiny_cpu_run_writes_every_time(tmp_path):
    out = tmp_path / "planner-ar.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "engine" / "bench_planner_ar.py"), "--tiny", "--device", "cpu",
           "--batches", "1,2", "--output", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["command"] and rec["device"] and rec["date"] and rec["commit"]
    assert rec["shape"] == "tiny" and rec["flush_rows"] == 16 and rec["context"] == 32
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 5 and lines[-1] == f"wrote {out}"  # one summary line per point, then the file
    times = ("plain_ar_ms", "immediate_ar_ms", "deferred_ar_ms", "flush_ms", "deferred_plus_flush_over_F_ms")
    for b in (1, 2):
        assert set(rec[f"batch{b}"]) == {"T0", "T1"}
        for p in rec[f"batch{b}"].values():
            assert set(p) == set(times) | {
                "immediate_ar_over_plain_ar",
                "deferred_ar_over_plain_ar",
                "deferred_plus_flush_over_F_over_plain_ar",
            }
            assert all(p[k] > 0 for k in times), p
            assert abs(p["deferred_plus_flush_over_F_ms"] - p["deferred_ar_ms"] - p["flush_ms"] / 16) < 1e-12
            assert abs(p["deferred_ar_over_plain_ar"] - p["deferred_ar_ms"] / p["plain_ar_ms"]) < 1e-12
