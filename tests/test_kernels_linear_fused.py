"""The linear kernel's fused prologues and epilogue (``dspine.ops.linear.linear_triton``: ``act="silu_mul"``,
``norm=``, ``residual=``, ``out=``) and the engine target's fused layer path built on them
(``infer.model.EngineTarget.fuse_norms``).

CPU: the Triton kernels under TRITON_INTERPRET=1, small odd shapes (partial row, column and K tiles; K split over
programs with the fused reduce, over programs with the separate reduce kernel, and in one program), bf16 and fp32.
GPU (``-m gpu``): the compiled kernels at Qwen3-8B's layer shapes with the device's fast tiles, and an engine whose
fused layers run inside CUDA graphs.
"""

import tests.kernel_env as kenv  # noqa: I001  (before the kernel modules: sets TRITON_INTERPRET)

import pytest
import torch

import dspine.ops.linear as lin
from dspine.ops.linear import linear, linear_triton
from dspine.ops.rmsnorm import rms_norm
from dspine.ops.silu_mul import silu_mul

needs_interp = pytest.mark.skipif(not kenv.TRITON_CPU, reason=str(kenv.TRITON_CPU_SKIP))

M, K, N = 19, 600, 96  # two row tiles of 16; K chunks of 256/256/88 with split 3; three column tiles of 32
CFGS = [(16, 32, 64, 4, 2, 3), (16, 32, 64, 4, 2, 1)]


def _data(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    gate_up = (2 * torch.randn(M, 2 * K, generator=g)).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    res = torch.randn(M, N, generator=g).to(dtype)
    return x, gate_up, w, res


@needs_interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("split_programs", [True, False])
def test_silu_mul_prologue_is_bitwise_silu_mul_then_linear(dtype, cfg, split_programs):
    _, gate_up, w, _ = _data(dtype)
    want = linear_triton(silu_mul(gate_up, impl="triton"), w, cfg=cfg, split_programs=split_programs)
    got = linear_triton(gate_up, w, cfg=cfg, split_programs=split_programs, act="silu_mul")
    assert torch.equal(got, want)
    # and it is the op: silu(g)·u · wᵀ within rounding
    g, u = gate_up.double().chunk(2, -1)
    ref = (g * torch.sigmoid(g) * u) @ w.double().T
    tol = (2 * 2**-8 if dtype == torch.bfloat16 else 1e-5) * ref.abs().max().item()
    assert (got.double() - ref).abs().max().item() <= tol
    # rows do not depend on M (exact mode may use it)
    assert torch.equal(linear_triton(gate_up[3:4], w, cfg=cfg, split_programs=split_programs, act="silu_mul")[0],
                       got[3])


@needs_interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused_reduce", [True, False])
def test_residual_epilogue_and_norm_prologue(dtype, fused_reduce, monkeypatch):
    """``residual=``: r is bitwise round(y) + residual rounded, sumsq the per-tile sums of r² (the reduce-kernel path
    falls back to one program per tile: same bits). ``norm=`` with those sums: RMSNorm(r)·weight fed to the next
    GEMV, equal to rms_norm then linear within the fp32 order of the sum of squares."""
    monkeypatch.setattr(lin, "FUSED_REDUCE", fused_reduce)
    x, _, w, res = _data(dtype, 1)
    cfg = CFGS[0]
    y = linear_triton(x, w, cfg=cfg, split_programs=True)
    r, sumsq = linear_triton(x, w, cfg=cfg, split_programs=True, residual=res)
    assert torch.equal(r, (y.float() + res.float()).to(dtype))
    assert sumsq.shape == (M, 3) and sumsq.dtype == torch.float32
    tiles = (r.double() ** 2).view(M, 3, 32).sum(-1)
    assert torch.allclose(sumsq.double(), tiles, rtol=1e-6, atol=0)

    g = torch.Generator().manual_seed(3)
    w2 = (torch.randn(40, N, generator=g) / N**0.5).to(dtype)
    nw = (1 + 0.2 * torch.randn(N, generator=g)).to(dtype)
    for cfg2 in ((16, 32, 32, 4, 2, 1), (16, 16, 32, 4, 2, 2)):
        got = linear_triton(r, w2, cfg=cfg2, split_programs=True, norm=(nw, sumsq, 1e-6))
        want = linear_triton(rms_norm(r, nw, 1e-6, impl="torch"), w2, cfg=cfg2, split_programs=True)
        scale = want.abs().max().item()
        assert (got.float() - want.float()).abs().max().item() <= (2**-7 if dtype == torch.bfloat16 else 1e-6) * scale
        ref = (rms_norm(r.double(), nw.double(), 1e-6, impl="torch")) @ w2.double().T
        assert (got.double() - ref).abs().max().item() <= (2**-6 if dtype == torch.bfloat16 else 1e-5) * scale


@needs_interp
def test_stages_retried_when_shared_memory_refuses(monkeypatch):
    """A launch Triton refuses for its shared memory (OutOfResources) is retried with one stage fewer, and the count
    that fit is kept for that tile and prologue: the second call launches once, with it."""
    from dspine.ops._common import OutOfResources

    _, gate_up, w, _ = _data(torch.float32, 7)
    cfg = (16, 32, 64, 4, 4, 1)
    monkeypatch.setattr(lin, "_STAGES_FIT", {})
    launches = []

    class Refusing:
        def __getitem__(self, grid):
            def launch(*a, num_stages, **k):
                launches.append(num_stages)
                if num_stages > 2:
                    raise OutOfResources(300_000, 232_448, "shared memory")
                return real[grid](*a, num_stages=num_stages, **k)
            return launch

    real = lin._linear_kernel
    monkeypatch.setattr(lin, "_linear_kernel", Refusing())
    got = linear_triton(gate_up, w, cfg=cfg, act="silu_mul")
    assert launches == [4, 3, 2] and list(lin._STAGES_FIT.values()) == [2]
    launches.clear()
    linear_triton(gate_up, w, cfg=cfg, act="silu_mul")
    assert launches == [2]
    monkeypatch.setattr(lin, "_linear_kernel", real)  # never refused: the configuration's own 4 stages
    assert torch.equal(got, linear_triton(gate_up, w, cfg=cfg, act="silu_mul"))  # stages do not change the sums


@needs_interp
def test_norm_prologue_over_many_producer_tiles():
    """A producer of 600 columns in 16-wide tiles leaves 38 sums of squares a row: the consumer adds them 32 at a
    time (two passes, the second partial) and gets rms_norm's statistic."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 64, generator=g)
    w = torch.randn(600, 64, generator=g) / 8
    res = torch.randn(5, 600, generator=g)
    r, sumsq = linear_triton(x, w, cfg=(16, 16, 32, 4, 2, 1), residual=res)
    assert sumsq.shape == (5, 38)
    w2 = torch.randn(24, 600, generator=g) / 600**0.5
    nw = 1 + 0.2 * torch.randn(600, generator=g)
    got = linear_triton(r, w2, cfg=(16, 16, 64, 4, 2, 1), norm=(nw, sumsq, 1e-6))
    want = rms_norm(r, nw, 1e-6, impl="torch") @ w2.T
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@needs_interp
def test_out_buffer_with_row_stride_and_errors():
    x, gate_up, w, res = _data(torch.float32, 2)
    feats = torch.full((M, 3 * N), float("nan"))
    block = feats[:, N : 2 * N]
    r, sumsq = linear_triton(x, w, cfg=CFGS[0], residual=res, out=block)
    assert r.data_ptr() == block.data_ptr()
    assert torch.equal(feats[:, N : 2 * N], linear_triton(x, w, cfg=CFGS[0], residual=res)[0])
    assert feats[:, :N].isnan().all() and feats[:, 2 * N :].isnan().all()  # nothing outside the block
    with pytest.raises(ValueError, match="act must be one of"):
        linear_triton(gate_up, w, act="gelu")
    with pytest.raises(ValueError, match="want gate_up"):
        linear_triton(x, w, act="silu_mul")
    with pytest.raises(ValueError, match="two prologues"):
        linear_triton(gate_up, w, act="silu_mul", norm=(torch.ones(K), sumsq, 1e-6))
    with pytest.raises(ValueError, match=r"norm weight \(5,\)"):
        linear_triton(x, w, norm=(torch.ones(5), torch.zeros(M, 3), 1e-6))
    with pytest.raises(ValueError, match="sums of squares"):
        linear_triton(x, w, norm=(torch.ones(K), torch.zeros(M + 1, 3), 1e-6))
    with pytest.raises(ValueError, match="residual"):
        linear_triton(x, w, residual=res[:, :-1])
    with pytest.raises(ValueError, match="out"):
        linear_triton(x, w, out=torch.empty(M, N + 1))
    with pytest.raises(ValueError, match="no columns"):
        linear_triton(torch.zeros(M, 0), torch.zeros(N, 0), residual=res)
    with pytest.raises(ValueError, match="no columns"):
        linear_triton(torch.zeros(M, 0), torch.zeros(N, 0), out=torch.empty(M, N))
    with pytest.raises(ValueError, match="act must be one of"):
        linear(gate_up, w, act="relu")
    # out may not share memory with what other programs still read, nor hold rows that overlap
    with pytest.raises(ValueError, match="out overlaps x"):
        x2 = torch.randn(M, N)
        linear_triton(x2, torch.randn(N, N), out=x2)
    buf = torch.randn(M, 3 * N)  # column blocks of one buffer: disjoint, so allowed as x and out
    w3 = torch.randn(N, N)
    got = linear_triton(buf[:, :N], w3, cfg=CFGS[1], out=buf[:, 2 * N :])
    assert torch.equal(got, linear_triton(buf[:, :N].clone(), w3, cfg=CFGS[1]))
    with pytest.raises(ValueError, match="out overlaps x"):  # one column shared
        linear_triton(buf[:, :N], w3, cfg=CFGS[1], out=buf[:, N - 1 : 2 * N - 1])
    b3 = torch.zeros(2 * N)
    with pytest.raises(ValueError, match="overlaps the bias"):
        linear_triton(x[:1], w, b3[:N], out=b3[N // 2 : N // 2 + N].view(1, N), residual=res[:1])
    res2 = torch.randn(M + 1, N)
    with pytest.raises(ValueError, match="overlaps residual without being it"):
        linear_triton(x, w, residual=res2[1:], out=res2[:-1])
    r_in = res.clone()
    r_out, _ = linear_triton(x, w, residual=r_in, out=r_in)  # in place: each element read, then written, by one program
    assert torch.equal(r_out, linear_triton(x, w, residual=res)[0])
    with pytest.raises(ValueError, match="rows at least"):
        linear_triton(x, w, out=torch.empty(N).expand(M, N))
    with pytest.raises(ValueError, match=r"must be \(1, 19, 96\)"):
        linear_triton(x[None], w, out=torch.empty(M, N))
    with pytest.raises(ValueError, match="norm must be"):
        linear_triton(x, w, norm=(torch.ones(K), sumsq))
    with pytest.raises(ValueError, match="every tile"):  # 0 columns, or fewer than any tile width leaves
        linear_triton(x, w, norm=(torch.ones(K), torch.zeros(M, 0), 1e-6))
    with pytest.raises(ValueError, match="every tile"):
        linear_triton(x, w, norm=(torch.ones(K), torch.zeros(M, 7), 1e-6))  # cdiv(600, bn) is 38, 19, 10, 5, 3...
    linear_triton(x, w, norm=(torch.ones(K), torch.ones(M, 10), 1e-6))  # bn = 64
    with pytest.raises(ValueError, match=r"x \(\) does not fit"):
        linear_triton(torch.tensor(1.0), w, residual=res)
    with pytest.raises(ValueError, match="powers of 2"):
        linear_triton(x, w, cfg=(16, 24, 64, 4, 2, 1))
    with pytest.raises(ValueError, match=r"want gate_up \[\.\.\., 1200\]"):
        linear(x, w, exact=False, act="silu_mul")
    with pytest.raises(ValueError, match=r"want gate_up \[\.\.\., 1200\]"):
        linear(gate_up[:, :-2], w, impl="torch", act="silu_mul")


@needs_interp
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("fuse", [True, False])
def test_linear_act_routes(exact, fuse, monkeypatch):
    """``linear(act="silu_mul")``: the kernel's prologue where the Triton kernel runs and FUSE_ACT is on, silu_mul
    then the layer otherwise: the same values as the unfused pair in every route; which route ran shows in whether
    the silu_mul kernel was launched."""
    monkeypatch.setattr(lin, "FUSE_ACT", fuse)
    calls = []
    real = lin.silu_mul
    monkeypatch.setattr(lin, "silu_mul", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, gate_up, w, _ = _data(torch.bfloat16, 4)
    for impl in ("triton", "torch"):
        want = linear(silu_mul(gate_up, impl=impl), w, impl=impl, exact=exact)
        calls.clear()
        assert torch.equal(linear(gate_up, w, impl=impl, exact=exact, act="silu_mul"), want), impl
        # the prologue runs only on the kernel path: exact Triton (fast mode on the CPU is torch's F.linear)
        assert len(calls) == (0 if fuse and impl == "triton" and exact else 1), (impl, exact, fuse)


@needs_interp
def test_fusion_switches_from_the_environment(monkeypatch):
    """DSPINE_FUSE_ACT (0/1, default 0) and DSPINE_FUSE_NORM (auto/on/off, default off): read where used, a bad value
    is a ValueError naming the variable."""
    monkeypatch.setattr(lin, "FUSE_ACT", None)
    monkeypatch.delenv("DSPINE_FUSE_ACT", raising=False)
    monkeypatch.delenv("DSPINE_FUSE_NORM", raising=False)
    assert lin.fuse_act() is False and _tiny_target(torch.float32, layers=1).fuse_norm == "off"
    monkeypatch.setenv("DSPINE_FUSE_ACT", "1")
    monkeypatch.setenv("DSPINE_FUSE_NORM", "Auto")
    assert lin.fuse_act() is True and _tiny_target(torch.float32, layers=1).fuse_norm == "auto"
    monkeypatch.setenv("DSPINE_FUSE_ACT", "yes")
    with pytest.raises(ValueError, match="DSPINE_FUSE_ACT='yes': use one of 0, 1"):
        linear(torch.zeros(2, 8), torch.zeros(3, 4), act="silu_mul")
    monkeypatch.setenv("DSPINE_FUSE_NORM", "always")
    with pytest.raises(ValueError, match="DSPINE_FUSE_NORM='always'"):
        _tiny_target(torch.float32, layers=1)


def _tiny_target(dtype, layers=3):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from infer.model import EngineTarget, ModelArgs

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      rope_theta=1e4, tie_word_embeddings=False, initializer_range=0.2)
    hf = Qwen3ForCausalLM(cfg).eval()
    return EngineTarget.from_hf_state(ModelArgs.from_hf_config(cfg), hf.state_dict(), "cpu", dtype, [0, 1, layers - 1],
                                      "triton")


def _step_off_and_on(tgt, prompts: list[list[int]], toks: torch.Tensor, seq: int, calls: list | None = None) -> dict:
    """One verify step of ``toks [B, T]`` (on the target's device) after prefilling ``prompts``, with ``fuse_norm`` off
    and then on, each over a fresh cache of ``seq`` positions: {mode: (logits, features)}, and with ``calls`` the
    number of entries it gained during each step ({mode + "_calls"})."""
    out, dev = {}, toks.device
    with torch.inference_mode():
        for mode in ("off", "on"):
            tgt.fuse_norm = mode
            cache = tgt.new_cache(len(prompts), seq)
            for slot, p in enumerate(prompts):
                tgt.prefill(torch.tensor(p, device=dev), slot, cache)
            lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=dev)
            if calls is not None:
                calls.clear()
            out[mode] = tgt.forward_step(toks, lens[:, None].long() + torch.arange(toks.shape[1], device=dev), cache,
                                         lens)
            if calls is not None:
                out[mode + "_calls"] = len(calls)
    return out


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_target_fused_layers_match_unfused(dtype, monkeypatch):
    """A verify step (batch 2, 5 tokens) with the norms folded into the linear layers gives the unfused step's
    logits and draft features (fp32: to 1e-5; bf16: within rounding), and runs 2 norm kernels (layer 0's input norm
    and the final norm) where the unfused step runs 2 per layer and the final one."""
    import infer.model as im

    monkeypatch.setattr(lin, "FUSE_ACT", True)
    tgt = _tiny_target(dtype)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (7, 4)]
    toks = torch.randint(0, 300, (2, 5), generator=g)
    calls = []
    real = im.rms_norm
    monkeypatch.setattr(im, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = _step_off_and_on(tgt, prompts, toks, 32, calls)
    assert out["off_calls"] == 2 * 3 + 1 + 1  # + the last layer's features through the final norm (post_norm)
    assert out["on_calls"] == 1 + 1 + 1
    (lo, fo), (ln, fn) = out["off"], out["on"]
    tol = 1e-5 if dtype == torch.float32 else 0.05
    scale = lo.abs().max().item()
    assert (ln.float() - lo.float()).abs().max().item() <= tol * scale
    assert (fn.float() - fo.float()).abs().max().item() <= tol * fo.abs().max().item()
    assert not torch.equal(ln, torch.zeros_like(ln))


@needs_interp
def test_fuse_norms_decision():
    tgt = _tiny_target(torch.float32, layers=2)
    tgt.fuse_norm = "auto"
    assert not tgt.fuse_norms(1)  # CPU: the fast path runs no Triton kernel, so auto keeps the unfused layers
    tgt.fuse_norm = "on"
    assert tgt.fuse_norms(1) and tgt.fuse_norms(200)
    assert not tgt.fuse_norms(1, exact=True)  # the fused statistic is not row invariant
    tgt.impl = "torch"
    assert not tgt.fuse_norms(1)
    tgt.impl, tgt.fuse_norm = "triton", "yes"
    with pytest.raises(ValueError, match="fuse_norm must be"):
        tgt.fuse_norms(1)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 16, 128])
def test_fused_kernels_cuda_qwen3_8b_shapes(rows):
    """bf16 on the GPU with the tiles the fast path picks (the device's tuned file, else the exact path's tile for
    that row count: at 128 rows a wgmma tile whose 3 stages fill the H200's shared memory as a plain GEMM, so the
    silu_mul prologue's launch is retried with fewer stages): the silu_mul prologue and the residual epilogue are
    bitwise their unfused pairs; the norm prologue is rms_norm then the layer within bf16 rounding."""
    from dspine.ops.linear import config, fast_config_rows

    H, inter = 4096, 12288
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=g, device="cuda")).to(torch.bfloat16)
    o_w, up_w, down_w = rnd(H, H, scale=H**-0.5), rnd(2 * inter, H, scale=H**-0.5), rnd(H, inter, scale=inter**-0.5)
    cfg = lambda w: fast_config_rows(rows, w) or config(*w.shape, w.dtype, w.device, rows)
    attn, res, nw = rnd(rows, H), rnd(rows, H), (1 + 0.1 * torch.randn(H, generator=g, device="cuda")).bfloat16()
    r, sumsq = linear_triton(attn, o_w, cfg=cfg(o_w), split_programs=True, residual=res)
    y = linear_triton(attn, o_w, cfg=cfg(o_w), split_programs=True)
    assert torch.equal(r, (y.float() + res.float()).bfloat16())
    up = linear_triton(r, up_w, cfg=cfg(up_w), split_programs=True, norm=(nw, sumsq, 1e-6))
    want = linear_triton(rms_norm(r, nw, 1e-6), up_w, cfg=cfg(up_w), split_programs=True)
    assert (up.float() - want.float()).abs().max().item() <= 2**-7 * want.abs().max().item()
    down = linear_triton(up, down_w, cfg=cfg(down_w), split_programs=True, act="silu_mul")
    assert torch.equal(down, linear_triton(silu_mul(up), down_w, cfg=cfg(down_w), split_programs=True))


@pytest.mark.gpu
def test_engine_fused_layers_cuda_graphs(monkeypatch):
    """A small Qwen3 target in bf16 with ``fuse_norm="on"``: the step's logits match the unfused step's within
    bf16 rounding, and greedy speculative output from CUDA graphs equals the same engine's eager output (the
    fused kernels capture, counters and all)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dspine.sampling import SamplingParams
    from infer.engine import Engine
    from infer.model import EngineTarget, ModelArgs
    from tests.test_exact import _draft_for

    monkeypatch.setattr(lin, "FUSE_ACT", True)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      rope_theta=1e6, tie_word_embeddings=False, initializer_range=0.1)
    hf = Qwen3ForCausalLM(cfg).eval()
    tgt = EngineTarget.from_hf_state(ModelArgs.from_hf_config(cfg), hf.state_dict(), "cuda", torch.bfloat16, [0, 3],
                                     "triton")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 4000, (int(n),), generator=g).tolist() for n in (5, 40, 200)]
    toks = torch.randint(0, 4000, (3, 16), generator=g).cuda()
    steps = _step_off_and_on(tgt, prompts, toks, 512)
    (lo, fo), (ln, fn) = steps["off"], steps["on"]
    assert (ln.float() - lo.float()).abs().max().item() <= 0.05 * lo.abs().max().item()
    assert (fn.float() - fo.float()).abs().max().item() <= 0.05 * fo.abs().max().item()
    tgt.fuse_norm = "on"
    draft = _draft_for(tgt, block=16)
    params = SamplingParams(max_new_tokens=64)
    out = {}
    for graphs in (False, True):
        eng = Engine(tgt, draft, [-1], max_batch=3, max_seq=400, cuda_graphs=graphs)
        eng.lm_head_tune = False  # one head implementation in both engines (a timed pick could differ between them)
        out[graphs] = eng.generate(prompts, params).token_ids
    assert out[True] == out[False] and all(len(t) == 64 for t in out[True])
