"""LM-head candidates (``dspine.ops.lm_head``, issue 12): each equals ``F.linear`` to the dtype's
rounding (fp32 and bf16 against an fp64 reference, Triton under the interpreter on the CPU), and
``pick`` keeps the fastest candidate under injected timings and never a failing or wrong one."""

import tests.kernel_env as env  # noqa: I001  (must precede the kernel imports)

import math

import pytest
import torch
import torch.nn.functional as F

from dspine.ops import lm_head as lh

needs_interp = pytest.mark.skipif(not env.TRITON_CPU, reason=str(env.TRITON_CPU_SKIP))
TRITON = [pytest.param(n, marks=needs_interp) for n in lh.TRITON_BN]


def _data(M, K, N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) / K**0.5
    return h.to(dtype), w.to(dtype)


def _err(y, h, w):
    ref = h.double() @ w.double().t()
    return float((y.double() - ref).abs().max()), float(ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["transposed", "chunked8k", "chunked32k", *TRITON])
def test_candidate_matches_f_linear(name, dtype):
    # chunked: N = 20000 is two full 8192-chunks and a partial one; Triton: N 300 (a partial column
    # tile), K 72 (a partial K tile), M 130 (two row tiles of 128)
    N, K, Ms = (20000, 40, (1, 6, 37)) if name.startswith("chunked") else (300, 72, (1, 6, 37, 130))
    for M in Ms:
        h, w = _data(M, K, N, dtype, seed=M)
        y = lh.lm_head(h.view(1, M, K), w, name)  # leading dims are flattened and restored
        assert y.shape == (1, M, N) and y.dtype == dtype and y.is_contiguous()
        err, scale = _err(y[0], h, w)
        torch_err, _ = _err(F.linear(h, w), h, w)
        # the dtype's own rounding: at most 2x torch's error plus half an ulp of the largest logit
        ulp = torch.finfo(dtype).eps * scale
        assert err <= 2 * torch_err + ulp, (name, M, err, torch_err)
        if dtype == torch.float32:
            assert err < 1e-5 * scale, (name, M, err)


def test_linear_candidate_is_f_linear_and_unknown_name_raises():
    h, w = _data(5, 16, 40, torch.float32)
    assert torch.equal(lh.lm_head(h, w), F.linear(h, w))
    with pytest.raises(ValueError, match="unknown implementation"):
        lh.lm_head(h, w, "cublaslt")


def test_triton_config_covers_the_rows():
    bf16 = torch.bfloat16
    assert lh.triton_config(1, 64, bf16)[0] == 16 and lh.triton_config(8, 128, bf16)[0] == 16
    assert lh.triton_config(120, 64, bf16)[0] == 128 and lh.triton_config(128, 128, bf16)[0] == 128
    assert lh.triton_config(512, 128, bf16)[0] == 128  # 4 row tiles, launched together per weight tile
    for M in (1, 128):
        for bn in (64, 128):
            bm, n, bk, _, stages = lh.triton_config(M, bn, bf16)
            assert n == bn and stages * (bm + n) * bk * 2 <= 128 * 1024  # shared memory per block


def test_pick_takes_the_fastest_and_skips_broken_candidates(monkeypatch):
    _, w = _data(1, 24, 100, torch.float32)
    names = ["linear", "transposed", "chunked8k", "chunked32k"]
    table = {"linear": 30.0, "transposed": 12.0, "chunked8k": 7.0, "chunked32k": 9.0}
    seen = []

    def timer(name, fn):
        seen.append((name, tuple(fn().shape)))
        return table[name]

    best, times = lh.pick(6, w, timer=timer, names=names)
    assert best == "chunked8k" and times == table
    assert seen == [(n, (6, 100)) for n in names]  # every candidate timed on M = 6 rows
    table["transposed"] = 7.0  # a tie goes to the earlier name
    assert lh.pick(6, w, timer=timer, names=names)[0] == "transposed"
    table["linear"] = 7.3  # F.linear within the 5 % margin of the fastest: kept
    assert lh.pick(6, w, timer=timer, names=names)[0] == "linear"
    assert lh.pick(6, w, timer=timer, names=names, margin=0.0)[0] == "transposed"

    # a candidate that raises or returns wrong logits is never chosen, even when "faster"
    real = lh.lm_head

    def broken(h, w_, choice="linear"):
        if choice == "chunked8k":
            raise RuntimeError("out of resources: shared memory")
        y = real(h, w_, choice)
        return y * 1.1 if choice == "transposed" else y

    monkeypatch.setattr(lh, "lm_head", broken)
    best, times = lh.pick(6, w, timer=lambda n, fn: {"linear": 30.0}.get(n, 1.0), names=names)
    assert best == "chunked32k"
    assert math.isinf(times["chunked8k"]) and math.isinf(times["transposed"]) and times["linear"] == 30.0
    # nothing works: F.linear
    monkeypatch.setattr(lh, "lm_head", lambda h, w_, choice="linear": real(h, w_) * 2)
    assert lh.pick(3, w, timer=lambda n, fn: 1.0, names=names)[0] == "linear"


def test_default_timer_returns_a_median_in_microseconds():
    calls = []
    us = lh.default_timer("x", lambda: calls.append(1), warmup=2, reps=5)
    assert len(calls) == 7 and 0 <= us < 1e5


def test_bench_lm_head_smoke(monkeypatch):
    """benchmarks/kernels/bench_lm_head.py --tiny at one M: every candidate timed, a pick among them."""
    from benchmarks.kernels import bench_lm_head

    monkeypatch.setattr(bench_lm_head, "TINY_MS", (5,))
    res = bench_lm_head.run(type("A", (), {"tiny": True})())
    names = [n for n in lh.CANDIDATES if lh.HAS_TRITON or n not in lh.TRITON_BN]
    assert [r["impl"] for r in res["rows"]] == names and all(r["us"] > 0 and r["gb_s"] > 0 for r in res["rows"])
    (p,) = res["pick"]
    assert p["M"] == 5 and p["pick"] in names and set(p["pick_event_us"]) == set(names)


@pytest.mark.gpu
@pytest.mark.parametrize("K,N", [(576, 49152), (4096, 151936)])
def test_candidates_cuda_bf16(K, N):
    """Compiled kernels: every candidate runs (pick times all of them) and matches F.linear's bf16
    error against an fp32 reference at decode and verify row counts."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).bfloat16()
    for M in (1, 8, 120, 128, 256):
        h = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        ref = h.float() @ w.float().t()
        torch_err = float((F.linear(h, w).float() - ref).abs().max())
        for name in lh.CANDIDATES:
            err = float((lh.lm_head(h, w, name).float() - ref).abs().max())
            assert err <= 2 * torch_err + 1e-3, (name, M, err, torch_err)
        best, times = lh.pick(M, w)
        assert all(math.isfinite(t) and t > 0 for t in times.values()), times
        assert times[best] <= 1.05 * min(times.values())  # linear kept within the margin


@pytest.mark.parametrize("name", ["linear", "transposed", "chunked8k"])
def test_strided_rows_run_as_one_2d_gemm(name):
    """The engine's draft rows are a strided slice, hidden[:, 1:16] of [B, 16, H]. F.linear on such a 3-D
    view runs aten::bmm (B GEMMs of 15 rows, the weight read B times: 2.39 ms instead of ~0.33 ms for the
    Qwen3-8B head at batch 8 on an H200); lm_head flattens the rows first so one aten::mm reads it once."""
    from torch.profiler import profile

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(8, 16, 64, generator=g)
    w = torch.randn(9000, 64, generator=g)
    rows = hidden[:, 1:16]
    assert not rows.is_contiguous()
    with profile() as p:
        y = lh.lm_head(rows, w, name)
    ops = {e.name for e in p.events()}
    assert "aten::bmm" not in ops and "aten::mm" in ops, sorted(o for o in ops if "mm" in o)
    assert y.shape == (8, 15, 9000)
    assert torch.allclose(y, F.linear(rows.contiguous(), w), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("name", lh.CANDIDATES)
def test_hidden_size_mismatch_is_a_value_error(name):
    with pytest.raises(ValueError, match=r"h \(4, 128\) and w \(300, 64\)"):
        lh.lm_head(torch.randn(4, 128), torch.randn(300, 64), name)
