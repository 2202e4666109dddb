"""benchmarks/train/two_gpu.py: the check logic and JSON assembly (pure functions), the compiled-CE chunk
math against the eager path, and the rank-layout-invariant anchor draws that the loss-curve check needs."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.conftest import REPO


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tg = load("two_gpu", REPO / "benchmarks" / "train" / "two_gpu.py")
bench = load("bench_train", REPO / "benchmarks" / "train" / "bench_train.py")


def rows(losses, **extra):
    return [{"step": i + 1, "loss": v, "grad_norm": 1.0 + i, "lr": 1e-3, **extra} for i, v in enumerate(losses)]


def test_scaling_efficiency_is_per_gpu():
    assert tg.scaling_efficiency({"tokens_per_s": 1000.0}, {"tokens_per_s": 1900.0, "world_size": 2}) == pytest.approx(0.95)
    assert tg.scaling_efficiency({}, {"tokens_per_s": 1.0}) is None


def test_compare_losses_tolerances():
    one = [10.0, 9.0, 8.0, 7.0]
    assert tg.compare_losses(rows(one), rows(one))["match"]
    near = tg.compare_losses(rows(one), rows([10.0, 9.0 * (1 + 2**-7), 8.0, 7.0]))
    assert near["match"] and near["max_rel_diff"] == pytest.approx(2**-7) and near["loss_drop"] == 3.0
    assert not tg.compare_losses(rows(one), rows([10.0, 9.0 * (1 + 2**-5), 8.0, 7.0]))["match"]  # > 4 bf16 ulps
    assert not tg.compare_losses(rows(one), rows([10.0 * (1 + 1e-5), 9.0, 8.0, 7.0]))["match"]  # step 1 must be exact
    assert not tg.compare_losses(rows(one), rows(one[:3]))["match"]  # missing step


def test_compare_resume_and_regen():
    straight = rows([5.0, 4.0, 3.0, 2.0])
    assert tg.compare_resume(straight, straight[2:], 2) == {"exact": True, "steps_compared": 2, "first_mismatch": None}
    off = [dict(r) for r in straight[2:]]
    off[1]["grad_norm"] += 1e-12
    assert tg.compare_resume(straight, off, 2)["first_mismatch"] == 4
    a = [{"index": i, "generated_token_ids": [[i, 7]], "finish_reason": ["stop"]} for i in range(4)]
    assert tg.compare_regen(a, list(reversed(a)))["identical"]
    b = [dict(r) for r in a]
    b[2] = {**b[2], "generated_token_ids": [[2, 8]]}
    res = tg.compare_regen(a, b)
    assert not res["identical"] and res["identical_rows"] == 3 and res["differing_rows"] == [2]
    assert not tg.compare_regen(a, a[:3])["identical"]


def test_assemble_top_level_keys():
    record = {"parts": {
        "a": {"status": "ok", "scaling_efficiency": {"zero2": 0.93, "zero3": 0.88}, "tokens_per_s_per_gpu": {"zero2": {}}},
        "b": {"status": "ok", "compare": {"match": True}},
        "c": {"status": "failed", "resume": {"exact": True}},
        "d": {"status": "ok", "compare": {"identical": False}, "rows_per_s": {"1": 2.0, "2": 3.9}},
    }}
    out = tg.assemble(record)
    assert out["scaling_efficiency_zero2"] == 0.93 and out["scaling_efficiency_zero3"] == 0.88
    assert out["scaling_goal_met_zero2"] is True and out["loss_match"] is True
    assert out["zero3_resume_exact"] is None  # a failed part never reports a check as passed
    assert out["regen_identical"] is False and out["regen_rows_per_s"] == {"1": 2.0, "2": 3.9}
    assert tg.assemble({})["loss_match"] is None


def test_bench_variants_parse():
    assert bench.parse_variant("ce+fa+chunk4096", 2048) == {"ce": True, "fa": True, "tc": False, "dc": False, "chunk": 4096}
    assert bench.parse_variant("base", 2048)["chunk"] == 2048
    with pytest.raises(ValueError, match="unknown part 'xx'"):
        bench.parse_variant("ce+xx", 2048)


def test_ce_chunk_matches_eager(monkeypatch):
    """The compiled path's math (train.loss.ce_chunk, here uncompiled) equals the eager in-place path."""
    from train import loss as L

    monkeypatch.setitem(L._CE_CHUNK, "fn", L.ce_chunk)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g)
    W, y, w = torch.randn(203, 16, generator=g), torch.randint(0, 203, (37,), generator=g), torch.rand(37, generator=g)
    res = {}
    for impl in ("eager", "compiled"):
        x = h.clone().requires_grad_()
        total, correct = L.fused_linear_cross_entropy(x, W, y, w, 16, impl=impl)
        total.backward()
        res[impl] = (total.detach(), correct, x.grad)
    ref = L.naive_linear_cross_entropy(h, W, y, w)[0]
    assert torch.allclose(res["compiled"][0], ref, rtol=1e-6) and torch.allclose(res["eager"][0], ref, rtol=1e-6)
    assert torch.equal(res["eager"][1], res["compiled"][1])
    assert torch.allclose(res["eager"][2], res["compiled"][2], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="impl='fast'"):
        L.fused_linear_cross_entropy(h, W, y, w, 16, impl="fast")


def test_anchor_draws_do_not_depend_on_the_rank_layout(tmp_path):
    """Global batch 4, micro-batch 1: 1 rank x grad_accum 4 and 2 ranks x grad_accum 2 see the same
    (row, anchors) pairs, so their loss curves can be compared (part b)."""
    from train.data import JsonlRows, StepBatches, StepOrder

    path = tmp_path / "rows.jsonl"
    tg.make_rows(path, 12, 40, 300)
    src = JsonlRows(path)
    kw = dict(max_length=40, block_size=4, mask_token_id=301, gamma=7.0, anchors_per_seq=5, pad_to_multiple=1,
              static_anchors=False)

    def seen(world, accum, rank):
        ds = StepBatches(src, StepOrder(len(src), 1, accum, world, 0), range(2), rank, 0, kw, 302, str(path))
        return {(step, b.row_ids[0]): b.anchors.tolist() for step in range(2) for b in ds[step]}

    one = seen(1, 4, 0)
    two = {**seen(2, 2, 0), **seen(2, 2, 1)}
    assert len(one) == 8 and one == two
