"""benchmarks/engine/bench_argmax_prob.py on the CPU (a smoke run of the torch path): the record's fields, the
programs per row it reports (the kernel's own choice), and an existing output refused."""

import json

import pytest

from benchmarks.engine import bench_argmax_prob
from dspine.ops import argmax_prob as mod


def test_cpu_smoke_run_writes_every_row_count(tmp_path):
    out = tmp_path / "argmax.json"
    assert bench_argmax_prob.main(["--device", "cpu", "--rows", "1,300", "--vocab", str(3 * mod.BLOCK + 1),
                                   "--iters", "2", "--reps", "1", "--output", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["date"] and rec["vocab"] == 3 * mod.BLOCK + 1 and rec["reps"] == 1
    assert rec["programs"] == mod.PROGRAMS and rec["block"] == mod.BLOCK and rec["impl"] == "torch"
    assert [p["rows"] for p in rec["points"]] == [1, 300]
    # 4 tiles: one row splits into 4 programs, 300 rows into 2 (600 programs reach PROGRAMS = 512)
    assert [p["S"] for p in rec["points"]] == [4, 2]
    for p in rec["points"]:
        assert min(p[k] for k in ("torch_argmax_us", "one_program_us", "split_us")) > 0
        assert p["split_minus_argmax_us"] == pytest.approx(p["split_us"] - p["torch_argmax_us"])
    with pytest.raises(SystemExit):
        bench_argmax_prob.main(["--device", "cpu", "--rows", "1", "--vocab", "8", "--output", str(out)])
