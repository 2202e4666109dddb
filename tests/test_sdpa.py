"""dspine.ops.sdpa: SDPA without the cuDNN backend (results/prefill-h200.json) and its prefill benchmark."""

from __future__ import annotations

import json
import statistics

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


def _reference(q, k, v, mask=None, causal=False, scale=None):
    """Attention written out: softmax(q kᵀ · scale + mask) v, K/V heads repeated for their query heads."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("kwargs", [dict(is_causal=True, enable_gqa=True), dict(scale=0.3, enable_gqa=True)])
def test_cpu_matches_written_out_attention(kwargs):
    q, k, v = _qkv("cpu", torch.float64)
    ref = _reference(q, k, v, causal=kwargs.get("is_causal", False), scale=kwargs.get("scale"))
    assert torch.allclose(sdpa(q, k, v, **kwargs), ref, atol=1e-12)


def test_masked_cpu_matches_written_out_attention():
    q, k, v = _qkv("cpu", torch.float64, Tq=3, Tk=9, Hkv=4)
    mask = torch.rand(2, 1, 3, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True
    assert torch.allclose(sdpa(q, k, v, attn_mask=mask), _reference(q, k, v, mask=mask), atol=1e-12)


def test_backends_context_switches_torch_flags_on_cuda_only(monkeypatch):
    """On a CUDA device the context turns cuDNN SDPA off (and the allowed backends on) and restores the
    flags on exit, also after an error; on the CPU, or with BACKENDS = None, it leaves them alone."""
    b = torch.backends.cuda
    before = (b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled())
    b.enable_cudnn_sdp(True)
    try:
        with sdpa_mod.backends_context(torch.device("cuda")):
            assert not b.cudnn_sdp_enabled() and b.flash_sdp_enabled() and b.mem_efficient_sdp_enabled()
        assert b.cudnn_sdp_enabled()
        with pytest.raises(RuntimeError, match="boom"):
            with sdpa_mod.backends_context(torch.device("cuda", 0)):
                raise RuntimeError("boom")
        assert b.cudnn_sdp_enabled()
        with sdpa_mod.backends_context(torch.device("cpu")):
            assert b.cudnn_sdp_enabled()
        monkeypatch.setattr(sdpa_mod, "BACKENDS", None)
        with sdpa_mod.backends_context(torch.device("cuda")):
            assert b.cudnn_sdp_enabled()
        monkeypatch.setattr(sdpa_mod, "BACKENDS", ("FLASH_ATTENTION",))
        with sdpa_mod.backends_context(torch.device("cuda")):
            assert b.flash_sdp_enabled() and not b.mem_efficient_sdp_enabled() and not b.math_sdp_enabled()
    finally:
        for flag, on in zip((b.enable_cudnn_sdp, b.enable_flash_sdp, b.enable_mem_efficient_sdp, b.enable_math_sdp),
                            before):
            flag(on)


def test_sliding_gqa_prompt_attention_matches_written_out():
    """infer.model's prompt attention of a sliding layer under GQA (K/V repeated, no SDPA GQA flag with a
    mask) against attention written out with the window mask."""
    from infer.model import EngineTarget, ModelArgs

    a = ModelArgs(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                  max_position_embeddings=64, tie_word_embeddings=False, qk_norm=True, qkv_bias=False,
                  windows=(3, None))
    with torch.device("meta"):
        t = EngineTarget(a, [], "torch")
    q, k, v = _qkv("cpu", torch.float64, Tq=7, Tk=7, Hq=4, Hkv=2, D=8)
    q, k, v = q[:1], k[:1], v[:1]
    j = torch.arange(7)
    window = (j[None, :] <= j[:, None]) & (j[None, :] > j[:, None] - 3)
    assert t.window(0) == 3 and t.window(1) is None
    assert torch.allclose(t._prompt_attention(0, q, k, v), _reference(q, k, v, mask=window, scale=t.scale), atol=1e-12)
    assert torch.allclose(t._prompt_attention(1, q, k, v), _reference(q, k, v, causal=True, scale=t.scale), atol=1e-12)


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


def test_prefill_bench_tiny_cpu(tmp_path, monkeypatch):
    """benchmarks/engine/bench_prefill.py --device cpu --tiny: one child process per setting, medians recorded.
    The parent is its main() in this process (one torch start fewer); the settings run in their child processes."""
    from benchmarks.engine import bench_prefill

    out = tmp_path / "prefill.json"
    monkeypatch.chdir(REPO)
    rc = bench_prefill.main(["--device", "cpu", "--tiny", "--lengths", "4", "--max-len", "48",
                             "--settings", "torch_default,no_cudnn,buckets", "--output", str(out)])
    assert rc == 0
    rec = json.loads(out.read_text())
    assert set(rec["runs"]) == {"torch_default", "no_cudnn", "buckets"} and rec["command"] and rec["date"]
    for name, run in rec["runs"].items():
        assert run["setting"] == name
        assert len(run["c1_first_ms"]) == 4 and len(run["c8_first_ms"]) == 1 and min(run["c1_repeat_ms"]) > 0
        for k in ("c1_first", "c1_repeat", "c8_first", "c8_repeat"):
            assert run[f"{k}_median_ms"] == statistics.median(run[f"{k}_ms"])
    assert rec["runs"]["torch_default"]["sdp_backends"].startswith("torch's choice")
    assert rec["runs"]["no_cudnn"]["sdp_backends"] == list(sdpa_mod.BACKENDS) == rec["runs"]["buckets"]["sdp_backends"]
    b = rec["runs"]["buckets"]  # every measured length falls in the bucket the warm-up already met
    assert [b[f"{k}_new_buckets"] for k in ("c1_first", "c1_repeat", "c8_first", "c8_repeat")] == [0, 0, 0, 0]


@pytest.mark.parametrize("extra, msg", [
    (["--settings", "no_cudnn,cudnn_fast"], "unknown setting 'cudnn_fast'"),
    (["--lengths", "0"], "--lengths 0: must be >= 4"),
    (["--lengths", "4", "--max-len", "30"], "--max-len 30: prompts of 16 .. 26 tokens give 11 distinct lengths, and "
                                            "--lengths 4 needs 12: raise --max-len to 31"),
    (["--max-len", "10"], "--max-len 10: prompts of 16 .. 6 tokens give 0 distinct lengths"),
    (["--device", "bogus"], "--device 'bogus': not a torch device"),
    (["--output", "{tmp}"], "is a folder; give a file name"),
    (["--output", "{tmp}/old.json"], "exists; pass --overwrite"),
])
def test_prefill_bench_checks_arguments_before_any_run(tmp_path, extra, msg, capsys, monkeypatch):
    """Every bad argument fails in the parent, before a child process starts (exit 2, the argument named). The
    parent is bench_prefill.main() in this process (no torch start per case); a child process would be an error."""
    from benchmarks.engine import bench_prefill

    def no_child(*a, **k):
        raise AssertionError(f"a child process started: {a}")

    monkeypatch.setattr(bench_prefill.subprocess, "run", no_child)
    (tmp_path / "old.json").write_text("{}")
    extra = [x.replace("{tmp}", str(tmp_path)) for x in extra]
    try:
        rc = bench_prefill.main(["--device", "cpu", "--tiny", *extra])
    except SystemExit as e:  # argparse's error
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2 and msg in err, err[-2000:]
    assert "RESULT" not in out and (tmp_path / "old.json").read_text() == "{}"


def test_kv_cache_layers_are_views_of_one_tensor():
    """infer.model.KVCache: every attention layer's K and V are views of ``kv [2, La, B, Hkv, S, D]`` (K then V, in
    layer order; linear layers have none), also through ``view(batch)``, so one gather/scatter over ``kv`` moves
    rows of every layer (the tree step's accepted path)."""
    import dataclasses

    from infer.model import KVCache, ModelArgs

    a = ModelArgs(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                  max_position_embeddings=64, tie_word_embeddings=False, qk_norm=True, qkv_bias=False)
    c = KVCache(a, batch=3, seq=10, device="cpu", dtype=torch.float32)
    assert c.kv.shape == (2, 3, 3, 2, 10, 8)
    for i in range(3):
        c.k[i][1, 0, 4] = 1.0 + i
        c.v[i][2, 1, 7] = -1.0 - i
    assert torch.equal(c.kv[0, :, 1, 0, 4, 0], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(c.kv[1, :, 2, 1, 7, 0], torch.tensor([-1.0, -2.0, -3.0]))
    v = c.view(2)
    assert v.kv.shape == (2, 3, 2, 2, 10, 8) and v.kv.data_ptr() == c.kv.data_ptr()
    v.kv[0, 2, 1, 0, 4] = 9.0  # through the batch view's stacked tensor, seen by the full cache's layer view
    assert torch.equal(c.k[2][1, 0, 4], torch.full((8,), 9.0)) and torch.equal(v.k[2][1, 0, 4], c.k[2][1, 0, 4])
    hybrid = dataclasses.replace(a, layer_kinds=("linear", "attention", "linear"), lin_k_heads=1, lin_v_heads=1,
                                 lin_k_dim=4, lin_v_dim=4, conv_kernel=4)
    h = KVCache(hybrid, batch=2, seq=10, device="cpu", dtype=torch.float32)
    assert h.kv.shape[1] == 1 and h.k[0] is None and h.v[2] is None
    assert h.k[1].data_ptr() == h.kv[0, 0].data_ptr() and h.v[1].data_ptr() == h.kv[1, 0].data_ptr()
