"""benchmarks/engine: the compiled-transformers peer records a failure instead of raising, and the
step profiler's CPU smoke path writes its per-kernel table."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from benchmarks.engine import bench_engine, profile_step


def test_compiled_peer_records_the_error_and_keeps_going():
    def generate(*_, **__):
        raise RuntimeError("inductor exploded")

    hf = SimpleNamespace(device=torch.device("cpu"), generate=generate)
    row = bench_engine.compiled_hf(hf, [1, 2, 3], new_tokens=32, short=16, reps=1)
    assert row == {"compiled_hf_tok_per_s": None, "compiled_hf_error": "RuntimeError: inductor exploded"}


def test_compiled_peer_refuses_a_short_long_generation():
    with pytest.raises(SystemExit):
        bench_engine.main(["--tiny", "--cpu", "--compiled-hf-only", "--compiled-new-tokens", "16"])


def test_profile_step_tiny_cpu_writes_the_table(tmp_path):
    out = tmp_path / "profile.json"
    profile_step.main(["--tiny", "--device", "cpu", "--batch", "1", "--context", "8", "--steps", "1",
                       "--warmup", "0", "--kinds", "ar,spec,tree8", "--output", str(out)])
    rec = json.loads(out.read_text())
    assert rec["command"] and rec["date"] and rec["cuda_graphs"] is False and rec["kinds"] == ["ar", "spec", "tree8"]
    for kind in ("ar", "spec", "tree8"):
        r = rec["batch1"][kind]
        assert 0 < len(r["top"]) <= profile_step.TOP and r["kernels_per_step"] > 0
        assert abs(sum(k["fraction"] for k in r["top"]) - sum(k["us_per_step"] for k in r["top"])
                   / r["kernel_us_per_step"]) < 1e-9
        assert all(a["us_per_step"] >= b["us_per_step"] for a, b in zip(r["top"], r["top"][1:]))
    # the speculative step does the AR step's target work over a block, plus the draft
    assert rec["batch1"]["spec"]["kernels_per_step"] > rec["batch1"]["ar"]["kernels_per_step"]
    # the tree step adds the candidates, the build, the path's K/V move to the chain step's work
    assert rec["batch1"]["tree8"]["kernels_per_step"] > rec["batch1"]["spec"]["kernels_per_step"]
    assert rec["batch1"]["tree8_kernel_time_over_spec"] == (rec["batch1"]["tree8"]["kernel_us_per_step"]
                                                           / rec["batch1"]["spec"]["kernel_us_per_step"])
    with pytest.raises(SystemExit):
        profile_step.main(["--tiny", "--device", "cpu", "--kinds", "ar,tree65"])


def test_profile_step_draft_vocab_size_reaches_the_engine(tmp_path, monkeypatch):
    """--draft-vocab-size N: the engine gets a fixed set of N distinct ids (bench_engine.py's seed), the JSON
    records N; out-of-range sizes are refused."""
    seen = []

    class Spy(profile_step.Engine):
        def __init__(self, *a, **kw):
            seen.append(kw.get("draft_vocab"))
            super().__init__(*a, **kw)

    monkeypatch.setattr(profile_step, "Engine", Spy)
    monkeypatch.setattr(profile_step.apply_fusion_args.__globals__["lin"], "FUSE_ACT", None)  # --fuse-act sets it
    out = tmp_path / "profile.json"
    profile_step.main(["--tiny", "--device", "cpu", "--batch", "1", "--context", "8", "--steps", "1", "--warmup", "0",
                       "--kinds", "spec", "--draft-vocab-size", "64", "--fuse-norm", "on", "--fuse-act", "on",
                       "--output", str(out)])
    rec = json.loads(out.read_text())
    assert rec["draft_vocab_size"] == 64 and len(seen) == 1
    # recorded as set; on the CPU's torch path no norm is folded, which fused_rows says
    assert rec["fuse_norm"] == "on" and rec["fuse_act"] is True and rec["fused_rows"] == []
    ids = seen[0]
    assert ids.numel() == 64 and ids.unique().numel() == 64 and 0 <= int(ids.min()) and int(ids.max()) < 512
    assert ids.tolist() == torch.randperm(512, generator=torch.Generator().manual_seed(2))[:64].tolist()
    for bad in ("63", "513"):
        with pytest.raises(SystemExit):
            profile_step.main(["--tiny", "--device", "cpu", "--draft-vocab-size", bad])


def test_bench_engine_skip_peers_keeps_engine_keys_only(tmp_path):
    out = tmp_path / "engine.json"
    bench_engine.main(["--tiny", "--cpu", "--skip-peers", "--iters", "1", "--prompt", "16", "--new-tokens", "32",
                       "--draft-vocab-size", "512", "--output", str(out)])
    rec = json.loads(out.read_text())
    # the draft's logits over 512 of the 2048 head rows (tiny shape: hidden 256, fp32 on the CPU)
    assert rec["draft_vocab_size"] == 512 and rec["head_row_bytes"] == 256 * 4
    ar_bytes = rec["weight_bytes_excl_embedding"]
    assert rec["spec_weight_bytes_over_ar"] == (ar_bytes + rec["draft_weight_bytes"] + 512 * 1024) / ar_bytes
    for b in ("batch1", "batch8"):
        row = rec[b]
        assert "hf_generate_tok_per_s" not in row and "compiled_hf_tok_per_s" not in row
        assert row["spec_step_ms"] > 0 and row["ar_step_ms"] > 0
        assert row["spec_step_over_ar_step"] == row["spec_step_ms"] / row["ar_step_ms"]
        # force_accept=6: every full step commits 7 tokens; the last step of 32 tokens is cut short
        assert 5.0 < row["oracle_tau"] <= 7.0
        rates = row["oracle_tok_per_s_runs"]  # the reported rate is the median run's
        assert len(rates) == 3 and row["oracle_tok_per_s"] == sorted(rates)[1]
        # the AR decode loop's breakdown: 32 tokens per row in 32 steps (+1 idle step after the last)
        prof = row["ar_loop_profile"]
        assert prof["steps"] in (32, 33) and prof["tokens"] == 32 * (1 if b == "batch1" else 8)
        assert row["ar_decode_ms_per_step"] == pytest.approx(1e3 * (prof["wall_s"] - prof["prefill_s"]) / prof["steps"])
    assert "hf_generate_tok_per_s" not in rec and rec["spec_step_over_ar_step"] == rec["batch1"]["spec_step_over_ar_step"]
    assert rec["fuse_norm"] == "off" and rec["fuse_act"] is False and rec["fused_rows"] == []  # the defaults


@pytest.mark.parametrize("argv, msg", [(["--block", "4"], "--block=4: the tau = 7 oracle"),
                                       (["--compiled-hf-only"], "exclude each other"),
                                       (["--new-tokens", "0"], "must be >= 1"),
                                       (["--oracle-reps", "0"], "--oracle-reps=0 must be >= 1"),
                                       (["--draft-vocab-size", "32"], "--draft-vocab-size=32: 0 (the whole")])
def test_bench_engine_refuses_settings_it_cannot_measure(argv, msg, capsys):
    with pytest.raises(SystemExit):
        bench_engine.main(["--tiny", "--cpu", "--skip-peers", *argv])
    assert msg in capsys.readouterr().err


def test_oracle_rate_is_the_median_for_an_even_count_too(tmp_path):
    """--oracle-reps 2: the reported rate is the mean of the two runs (the median), not the larger one."""
    out = tmp_path / "e.json"
    bench_engine.main(["--tiny", "--cpu", "--skip-peers", "--iters", "1", "--prompt", "8", "--new-tokens", "16",
                       "--oracle-reps", "2", "--output", str(out)])
    for b in ("batch1", "batch8"):
        row = json.loads(out.read_text())[b]
        a, c = row["oracle_tok_per_s_runs"]
        assert row["oracle_tok_per_s"] == pytest.approx((a + c) / 2, rel=1e-12)


def test_existing_outputs_are_not_replaced(tmp_path):
    """bench_engine.py and profile_step.py refuse an existing --output before measuring (--overwrite replaces)."""
    out = tmp_path / "r.json"
    out.write_text("{}")
    for mod, argv in ((bench_engine, ["--tiny", "--cpu", "--skip-peers"]), (profile_step, ["--tiny", "--device", "cpu"])):
        for target in (str(out), "", str(tmp_path)):  # existing file, empty name, a folder
            with pytest.raises(SystemExit):
                mod.main(argv + ["--output", target])
        assert out.read_text() == "{}"
    profile_step.main(["--tiny", "--device", "cpu", "--batch", "1", "--context", "8", "--steps", "1", "--warmup", "0",
                       "--kinds", "ar", "--output", str(out), "--overwrite"])
    assert json.loads(out.read_text())["kinds"] == ["ar"]


def test_bench_engine_ab_fusion_alternates_and_restores(tmp_path, monkeypatch):
    """--ab-fusion 2: off, on, on, off in one process, each variant's runs at both batch sizes with the medians of
    its headline figures and on ÷ off; the target's and the module's settings are as before afterwards; the flags
    that would fight it are refused."""
    from dspine.ops import linear as lin

    monkeypatch.setattr(lin, "FUSE_ACT", None)
    seen = []
    real = bench_engine.measure_batch

    def spy(args, target, *a, **k):
        seen.append((target.fuse_norm, lin.FUSE_ACT, len(a[2])))
        return real(args, target, *a, **k)

    monkeypatch.setattr(bench_engine, "measure_batch", spy)
    out = tmp_path / "ab.json"
    bench_engine.main(["--tiny", "--cpu", "--ab-fusion", "2", "--iters", "1", "--prompt", "16", "--new-tokens", "16",
                       "--oracle-reps", "1", "--output", str(out)])
    rec = json.loads(out.read_text())
    ab = rec["ab_fusion"]
    assert ab["order"] == ["off", "on", "on", "off"]
    off, on = [("off", False, 1), ("off", False, 8)], [("auto", True, 1), ("auto", True, 8)]
    assert seen == off + on + on + off
    for v in ("off", "on"):
        runs = ab["variants"][v]["runs"]["batch1"]
        assert len(runs) == 2 and all(r["fused_rows"] == [] for r in runs)  # the CPU's torch path folds nothing
        med = ab["variants"][v]["batch1"]
        assert med["ar_tok_per_s"] == pytest.approx(sum(r["ar_tok_per_s"] for r in runs) / 2)  # median of two
    on, off = ab["variants"]["on"]["batch8"], ab["variants"]["off"]["batch8"]
    assert ab["batch8_on_over_off"]["spec_step_ms"] == pytest.approx(on["spec_step_ms"] / off["spec_step_ms"])
    assert "batch1" not in rec and lin.FUSE_ACT is None
    assert not {"fuse_norm", "fuse_act", "fused_rows"} & set(rec)  # only per variant: the process default ran neither
    for bad in (["--ab-fusion", "-1"], ["--ab-fusion", "1", "--fuse-norm", "on"], ["--ab-fusion", "1", "--fuse-act", "off"]):
        with pytest.raises(SystemExit):
            bench_engine.main(["--tiny", "--cpu", *bad])
