"""benchmarks/train/bench_train.py: the CPU smoke path (--tiny) and the FLOP count by hand."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

BENCH = REPO / "benchmarks" / "train" / "bench_train.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_train", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_run_writes_the_record(tmp_path):
    out = tmp_path / "r" / "bench.json"
    r = subprocess.run([sys.executable, str(BENCH), "--tiny", "--steps", "2", "--warmup", "1", "--output", str(out)],
                       capture_output=True, text=True, timeout=240, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text())
    for key in ("command", "gpu", "date", "git_commit", "versions", "config", "results"):
        assert key in rec
    res = rec["results"]
    assert res["timed_steps"] == 2 and res["step_time_s_mean"] > 0 and res["tokens_per_s"] > 0
    assert res["tokens_per_s"] == pytest.approx(96 / res["step_time_s_mean"], rel=0.05)  # 1 row x 96 tokens
    assert res["mfu_vs_datasheet"] == pytest.approx(res["model_tflops_per_s"] / 989.0)
    assert res["measured_matmul_tflops"] > 0 and all(v > 0 for v in res["flops_per_step_by_part"].values())
    assert rec["config"]["tiny"] and rec["config"]["no_deepspeed"] and rec["versions"]["torch"] == torch.__version__


def test_flop_count_by_hand():
    from train.data import make_batch
    from train.loss import anchor_generator

    bench = load_bench()
    from dspine.config import DSpineConfig
    from dspine.model import DSpineDraftModel
    from dspine.target import TargetSpec

    target = bench.build_target(bench.TINY, [1, 3], torch.device("cpu"), torch.float32)
    dcfg = DSpineConfig.for_target(target.config, TargetSpec.from_config(target.config), layers=2, block_size=4,
                                   target_layer_ids=[1, 3], mask_token_id=511)
    draft = DSpineDraftModel(dcfg)
    rows = [{"input_ids": list(range(10)), "loss_mask": [0, 0] + [1] * 8}]
    b = make_batch(rows, [0], max_length=10, block_size=4, mask_token_id=511, gamma=7.0, anchors_per_seq=2,
                   generator=anchor_generator(0, 0, 0, 0))
    anchors = b.anchors[0].tolist()
    p_block = bench.draft_block_params(draft)
    # per draft layer: q 64x64, k 64x32, v 64x32, o 64x64, MLP 3 x 64x128, injection proj 64x64
    assert p_block == 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192 + 4096)
    f = bench.step_flops([b], target, dcfg, p_block)
    S, L_run, Hq_D = 10, 4, 64  # layers 0..3 run (max layer id 3)
    p_layer = sum(p.numel() for p in target.layers[0].parameters())
    assert f["target"] == 2 * p_layer * L_run * S + 2 * L_run * S * S * Hq_D
    p_ctx = 2 * 64 * 64 + 2 * 2 * 64 * 32  # fc (2 layers of features) + context k/v per draft layer
    attn = 4 * Hq_D * 2 * sum(4 * (a + 4) for a in anchors)
    assert f["draft"] == 6 * p_block * 4 * len(anchors) + 6 * p_ctx * S + 3 * attn
    assert f["lm_head"] == 4 * 512 * 64 * int((b.weights > 0).sum())
