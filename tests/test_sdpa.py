"""dspine.ops.sdpa: SDPA without the cuDNN backend (results/prefill-h200.json) and its prefill benchmark."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from dspine.ops import sdpa as sdpa_mod
from dspine.ops.sdpa import sdpa
from tests.conftest import REPO


def _qkv(device, dtype, Tq=7, Tk=7, Hq=4, Hkv=2, D=16):
    g = torch.Generator().manual_seed(0)
    mk = lambda H, T: torch.randn(2, H, T, D, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return mk(Hq, Tq), mk(Hkv, Tk), mk(Hkv, Tk)


def test_backend_names_exist():
    """A typo in BACKENDS would only fail on a GPU: every name must be an SDPBackend member, cuDNN not among them."""
    from torch.nn.attention import SDPBackend

    assert sdpa_mod.BACKENDS and all(isinstance(getattr(SDPBackend, b), SDPBackend) for b in sdpa_mod.BACKENDS)
    assert "CUDNN_ATTENTION" not in sdpa_mod.BACKENDS


@pytest.mark.parametrize("kwargs", [dict(is_causal=True, enable_gqa=True), dict(scale=0.3, enable_gqa=True)])
def test_cpu_equals_torch(kwargs):
    q, k, v = _qkv("cpu", torch.float32)
    assert torch.equal(sdpa(q, k, v, **kwargs), F.scaled_dot_product_attention(q, k, v, **kwargs))


def test_masked_cpu_equals_torch():
    q, k, v = _qkv("cpu", torch.float32, Tq=3, Tk=9, Hkv=4)
    mask = torch.rand(2, 1, 3, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True
    assert torch.equal(sdpa(q, k, v, attn_mask=mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


@pytest.mark.gpu
def test_cuda_never_runs_cudnn_and_matches():
    """On CUDA bf16 the call equals torch's within bf16 rounding and no cuDNN attention op runs."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v = _qkv("cuda", torch.bfloat16, Tq=37, Tk=37, Hq=9, Hkv=3, D=64)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = sdpa(q, k, v, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    assert not any("cudnn" in n for n in names), sorted(names)
    assert (out.float() - ref).abs().max().item() < 2e-2


def test_prefill_bench_tiny_cpu(tmp_path):
    """benchmarks/engine/bench_prefill.py --device cpu --tiny: one child process per setting, medians recorded."""
    out = tmp_path / "prefill.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "engine" / "bench_prefill.py"), "--device", "cpu", "--tiny",
           "--lengths", "4", "--max-len", "48", "--settings", "torch_default,no_cudnn", "--output", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert set(rec["runs"]) == {"torch_default", "no_cudnn"} and rec["command"] and rec["date"]
    for name, run in rec["runs"].items():
        assert run["setting"] == name
        assert len(run["c1_first_ms"]) == 4 and len(run["c8_first_ms"]) == 1 and min(run["c1_repeat_ms"]) > 0
        for k in ("c1_first", "c1_repeat", "c8_first", "c8_repeat"):
            assert run[f"{k}_median_ms"] == statistics.median(run[f"{k}_ms"])
    assert rec["runs"]["torch_default"]["sdp_backends"].startswith("torch's choice")
    assert rec["runs"]["no_cudnn"]["sdp_backends"] == list(sdpa_mod.BACKENDS)


def test_prefill_bench_rejects_unknown_setting(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "engine" / "bench_prefill.py"), "--device", "cpu", "--tiny",
           "--settings", "cudnn_fast"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "unknown setting 'cudnn_fast'" in r.stderr
