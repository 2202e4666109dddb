"""benchmarks/engine/bench_topk.py on the CPU (a smoke run of the torch path): the record's fields, the ids
checked equal before timing, and bad flags refused."""

import json

import pytest

from benchmarks.engine import bench_topk


def test_cpu_smoke_run_writes_every_row_count(tmp_path):
    out = tmp_path / "topk.json"
    assert bench_topk.main(["--device", "cpu", "--rows", "1,3", "--vocab", "300", "--k", "5", "--iters", "2",
                            "--reps", "1", "--output", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["date"] and rec["vocab"] == 300 and rec["k"] == 5 and rec["kernel_impl"] == "torch"
    assert [p["rows"] for p in rec["points"]] == [1, 3]
    for p in rec["points"]:
        assert min(p[k] for k in ("torch_topk_us", "kernel_topk_us", "torch_probs_us", "kernel_probs_us")) > 0
        assert p["topk_speedup"] == pytest.approx(p["torch_topk_us"] / p["kernel_topk_us"])
    with pytest.raises(SystemExit):  # an existing output
        bench_topk.main(["--device", "cpu", "--rows", "1", "--vocab", "8", "--k", "2", "--output", str(out)])


@pytest.mark.parametrize("flags,msg", [(["--k", "400"], "--k 400"), (["--k", "9", "--vocab", "8"], "--k 9"),
                                       (["--temperature", "0"], "--temperature 0.0"), (["--top-p", "0"], "--top-p 0.0"),
                                       (["--reps", "0"], "--reps must be")])
def test_bad_flags_are_refused(flags, msg, capsys):
    with pytest.raises(SystemExit):
        bench_topk.main(["--device", "cpu", *flags])
    assert msg in capsys.readouterr().err
