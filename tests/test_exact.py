"""Exact mode (issue 13): a position's target logits are bitwise the same in a 1-token step, in a
verify block of any width and at any batch size.

CPU: the row-invariant kernels (``dspine.ops.linear``, ``verify_attention(exact=True)``) with the
torch paths and, under TRITON_INTERPRET=1, the Triton kernels (small shapes); the engine target's
step at widths 1, 4, 16 and batch 1, 3 in bf16; the engine's greedy speculative output against its
own AR output. The ``gpu`` tests check the compiled kernels over the decode/verify range of M and
the engine end to end with CUDA graphs.
"""

import tests.kernel_env as kenv  # noqa: I001  (before the kernel modules: sets TRITON_INTERPRET)

import json
import re

import pytest
import torch

from dspine.ops.linear import linear
from dspine.ops.verify_attention import verify_attention
from dspine.sampling import SamplingParams
from infer.engine import Engine
from infer.model import EngineTarget, ModelArgs
from tests.helpers import oracle_engine

needs_interp = pytest.mark.skipif(not kenv.TRITON_CPU, reason=str(kenv.TRITON_CPU_SKIP))
IMPLS = ["torch", pytest.param("triton", marks=needs_interp)]
DEV = "cpu"


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.view(torch.int16 if a.element_size() == 2 else torch.int32),
            b.view(torch.int16 if b.element_size() == 2 else torch.int32),
        )
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_linear_rows_do_not_depend_on_m(impl):
    g = torch.Generator().manual_seed(0)
    M, K, N = 19, 300, 96  # K: full and partial K tiles; N: two or three column tiles
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(torch.bfloat16)
    bias = torch.randn(N, generator=g).to(torch.bfloat16)
    full = linear(x, w, bias, impl=impl)
    for width in (1, 4, 16):
        for start in (0, 3):
            part = linear(x[start : start + width], w, bias, impl=impl)
            assert _bits_equal(part, full[start : start + width]), (impl, width, start)
    # other rows' contents do not matter either
    y = x.clone()
    y[1:] = torch.randn(M - 1, K, generator=g).to(torch.bfloat16)
    assert _bits_equal(linear(y, w, bias, impl=impl)[0], full[0])
    # and the op is the linear map: within bf16 rounding of the fp32 result
    ref = x.float() @ w.float().T + bias.float()
    err = (full.float() - ref).abs().max().item()
    assert err <= 2 * 2**-8 * ref.abs().max().item(), err
    with pytest.raises(ValueError, match=r"weight \(96, 301\)"):
        linear(x, torch.zeros(N, K + 1, dtype=torch.bfloat16), impl=impl)


@needs_interp
def test_linear_split_k_same_bits_both_ways():
    """A split configuration sums K in fixed chunks: spread over programs (fp32 partials + the ordered
    reduce) or all in one program, the bits are the same, for every M; and rows stay M-invariant."""
    from dspine.ops.linear import chunk_k, linear_triton

    g = torch.Generator().manual_seed(1)
    M, K, N = 19, 600, 96
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(torch.bfloat16)
    bias = torch.randn(N, generator=g).to(torch.bfloat16)
    cfg = (16, 32, 64, 4, 2, 3)
    assert chunk_k(K, 3) == 256  # chunks of 256, 256 and 88 columns
    full = linear_triton(x, w, bias, cfg=cfg, split_programs=False)
    for m in (1, 3, 16, 19):
        for sp in (True, False):
            assert _bits_equal(linear_triton(x[:m], w, bias, cfg=cfg, split_programs=sp), full[:m]), (m, sp)
    ref = x.float() @ w.float().T + bias.float()
    assert (full.float() - ref).abs().max().item() <= 2 * 2**-8 * ref.abs().max().item()
    # the chunked sum is a different summation from the unsplit one: it is exact only against itself
    one = linear_triton(x, w, bias, cfg=cfg[:5])
    assert (one.float() - ref).abs().max().item() <= 2 * 2**-8 * ref.abs().max().item()
    with pytest.raises(ValueError, match="split"):
        linear_triton(x, w, cfg=(16, 32, 64, 4, 2, 0))


@needs_interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp32 out: a reordered sum shows
def test_linear_fused_reduce_same_bits_and_counters_reset(monkeypatch, dtype):
    """Split programs whose last one to arrive adds the partials (``FUSED_REDUCE``) give the separate reduce
    kernel's bits (two row tiles, three column tiles, a bias, chunks of 256/256/88) and leave every tile counter
    at zero, so the next launch on the stream starts clean; a counter left non-zero would leave the tile
    unwritten (y stays NaN) and fail the comparison."""
    import dspine.ops.linear as lin
    from dspine.ops._common import tile_counters

    g = torch.Generator().manual_seed(2)
    M, K, N = 19, 600, 96
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    cfg = (16, 32, 64, 4, 2, 3)
    monkeypatch.setattr(lin, "FUSED_REDUCE", False)
    calls = []
    monkeypatch.setattr(lin, "_linear_reduce_kernel", _Spy(lin._linear_reduce_kernel, calls))
    two = {b: lin.linear_triton(x, w, b, cfg=cfg, split_programs=True) for b in (bias, None)}
    assert len(calls) == 2
    monkeypatch.setattr(lin, "FUSED_REDUCE", True)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))  # unwritten = NaN
    for b in (bias, None):
        for _ in range(2):  # a second launch reuses the counters the first one left
            one = lin.linear_triton(x, w, b, cfg=cfg, split_programs=True)
            assert _bits_equal(one, two[b]), b is None
    assert len(calls) == 2  # the fused path launched no reduce kernel
    assert int(tile_counters(x.device, 6).count_nonzero()) == 0
    ref = x.float() @ w.float().T + bias.float()
    assert (two[bias].float() - ref).abs().max().item() <= 2 * 2**-8 * ref.abs().max().item()


@needs_interp
def test_tune_linear_fast_tiny_writes_fast_entries(tmp_path):
    """benchmarks/kernels/tune_linear_fast.py --tiny: candidates timed against cuBLAS, the best one's per-M ratios
    consistent with its times, written as a ``fast`` entry that ``tuned``'s checks accept; a tuned file without
    the weight's entry is refused by name."""
    from benchmarks.kernels import tune_linear_fast as tlf

    tuned = tmp_path / "linear-X.json"
    base = {"mixed_row_tiles": True, "weights": {"96,600": {
        "split": 3, "small": [16, 32, 64, 4, 2], "large": [64, 32, 32, 4, 2],
        "programs": {"small": True, "large": False}}}}  # fmt: skip
    tuned.write_text(json.dumps(base))
    out = tmp_path / "r.json"
    assert tlf.main(["--tiny", "--output", str(out), "--write-tuned", str(tuned)]) == 0
    res = json.loads(out.read_text())["weights"]["a"]
    best = res["best"]
    assert best["cfg"][:5] == [16, 32, 64, 4, 2] and best["cfg"][5] in (1, 3)
    for m in ("M1", "M3"):
        assert res["best_ratio_by_m"][m] == pytest.approx(best["us"][m] / res["cublas_us"][m])
    assert best["mean_ratio_to_cublas"] == pytest.approx(sum(res["best_ratio_by_m"].values()) / 2)
    fast = json.loads(tuned.read_text())["weights"]["96,600"]["fast"]
    assert fast["cfg"] == best["cfg"] and fast["ratio_to_cublas"] == best["mean_ratio_to_cublas"]
    assert json.loads(tuned.read_text())["weights"]["96,600"]["split"] == 3  # the exact path's entry kept
    base["weights"] = {"1,1": base["weights"]["96,600"]}
    tuned.write_text(json.dumps(base))
    with pytest.raises(ValueError, match=r"linear-X.json: no entry for weight a \[96,600\]"):
        tlf.write_tuned(tuned, json.loads(out.read_text()))


@needs_interp
def test_tune_linear_fast_tiny_wide_writes_fast_wide(tmp_path):
    """--wide: the verify row counts (tiny: 20 and 40), written as a ``fast_wide`` entry with ``max_m`` = 40 beside
    the weight's ``fast`` one, which stays."""
    from benchmarks.kernels import tune_linear_fast as tlf

    tuned = tmp_path / "linear-X.json"
    fast = {"cfg": [16, 32, 64, 4, 2, 1], "ratio_to_cublas": 0.9}
    tuned.write_text(json.dumps({"mixed_row_tiles": True, "weights": {"96,600": {
        "split": 3, "small": [16, 32, 64, 4, 2], "large": [64, 32, 32, 4, 2],
        "programs": {"small": True, "large": False}, "fast": fast}}}))  # fmt: skip
    out = tmp_path / "r.json"
    assert tlf.main(["--tiny", "--wide", "--output", str(out), "--write-tuned", str(tuned)]) == 0
    res = json.loads(out.read_text())
    assert res["wide"] is True and res["ms"] == [20, 40]
    e = json.loads(tuned.read_text())["weights"]["96,600"]
    best = res["weights"]["a"]["best"]
    assert e["fast"] == fast and e["fast_wide"]["max_m"] == 40 and e["fast_wide"]["cfg"] == best["cfg"]
    assert e["fast_wide"]["ratio_to_cublas"] == best["mean_ratio_to_cublas"]
    assert set(e["fast_wide"]["ratio_by_m"]) == {"M20", "M40"}


def test_fast_pick_by_rows():
    """The fast path's tile by row count: ``fast`` at 1..16 rows, ``fast_wide`` above up to its ``max_m``, each only
    where it beat cuBLAS; without ``fast``, the exact path's small tile where that beat cuBLAS."""
    from dspine.ops.linear import fast_pick

    e = {"fast": {"cfg": [16, 64, 128, 4, 3, 2], "ratio_to_cublas": 0.9},
         "fast_wide": {"cfg": [128, 128, 64, 8, 3, 1], "ratio_to_cublas": 0.95, "max_m": 128}}
    assert fast_pick(e, 1) == fast_pick(e, 16) == (16, 64, 128, 4, 3, 2)
    assert fast_pick(e, 17) == fast_pick(e, 128) == (128, 128, 64, 8, 3, 1)
    assert fast_pick(e, 129) is None and fast_pick(e, 0) is None and fast_pick(None, 1) is None
    slow = {**e, "fast_wide": {**e["fast_wide"], "ratio_to_cublas": 1.02}, "fast": {**e["fast"], "ratio_to_cublas": 1.1}}
    assert fast_pick(slow, 8) is None and fast_pick(slow, 64) is None
    # per row count where the tuner recorded it: the ratio of the smallest measured count at or above the rows
    by_m = {**e, "fast_wide": {**e["fast_wide"], "ratio_by_m": {"M32": 1.2, "M64": 0.9, "M128": 0.8}}}
    assert fast_pick(by_m, 17) is None and fast_pick(by_m, 32) is None
    assert fast_pick(by_m, 33) == fast_pick(by_m, 128) == (128, 128, 64, 8, 3, 1)
    assert fast_pick({"small_ratio_to_cublas": 0.95}, 8) == "small"
    assert fast_pick({"small_ratio_to_cublas": 1.05}, 8) is None and fast_pick({"small_ratio_to_cublas": 0.95}, 32) is None


def test_tuned_fast_entry_checked():
    """A ``fast`` entry's configuration must be six integers with power-of-two blocks and warps, its ratio a
    positive number; the error names the weight and field."""
    from dspine.ops.linear import _check_tuned

    e = {"split": 1, "small": [16, 32, 64, 4, 2], "large": [64, 32, 32, 4, 2],
         "programs": {"small": False, "large": False}}  # fmt: skip
    ok = {"mixed_row_tiles": True, "weights": {"8,8": {**e, "fast": {"cfg": [16, 64, 128, 4, 3, 4],
                                                                      "ratio_to_cublas": 0.9}}}}
    _check_tuned(ok)
    for cfg, ratio, msg in (([16, 64, 128, 4, 3], 0.9, "fast.cfg"), ([16, 48, 128, 4, 3, 2], 0.9, "fast.cfg"),
                            ([16, 64, 512, 4, 3, 2], 0.9, "fast.cfg"), ([16, 64, 128, 4, 3, 2], 0, "fast.ratio")):
        bad = {"mixed_row_tiles": True, "weights": {"8,8": {**e, "fast": {"cfg": cfg, "ratio_to_cublas": ratio}}}}
        with pytest.raises(ValueError, match=rf"weight 8,8: {msg}"):
            _check_tuned(bad)
    wide = {"cfg": [128, 128, 64, 8, 3, 1], "ratio_to_cublas": 0.95, "max_m": 128}
    _check_tuned({"mixed_row_tiles": True, "weights": {"8,8": {**e, "fast_wide": wide}}})
    for bad_wide, msg in (({**wide, "max_m": 16}, "fast_wide.max_m 16"), ({**wide, "max_m": "128"}, "fast_wide.max_m"),
                          ({**wide, "cfg": [128, 96, 64, 8, 3, 1]}, "fast_wide.cfg"),
                          ({**wide, "ratio_by_m": {"M32": 0}}, "fast_wide.ratio_by_m"),
                          ({**wide, "ratio_by_m": {"32": 0.9}}, "fast_wide.ratio_by_m")):
        with pytest.raises(ValueError, match=rf"weight 8,8: {msg}"):
            _check_tuned({"mixed_row_tiles": True, "weights": {"8,8": {**e, "fast_wide": bad_wide}}})


class _Spy:
    """A Triton kernel stand-in that records its launches (``kernel[grid](...)``) and runs the real one."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def launch(*a, **k):
            self.calls.append(grid)
            return self.kernel[grid](*a, **k)

        return launch


@pytest.mark.gpu
def test_linear_fused_reduce_cuda_same_bits():
    """Compiled on the GPU, many launches back to back (the arrival counters reused by each), inside a CUDA graph
    too: the fused reduce gives the two-kernel path's bits at the Qwen3-8B o_proj and down_proj shapes, M 1-16."""
    import dspine.ops.linear as lin

    g = torch.Generator().manual_seed(0)
    for N, K in ((4096, 4096), (4096, 12288)):
        w = (torch.randn(N, K, generator=g) / K**0.5).to(torch.bfloat16).cuda()
        for M in (1, 3, 8, 16):
            x = torch.randn(M, K, generator=g).to(torch.bfloat16).cuda()
            cfg = (16, 64, 64, 4, 4, 4)
            lin.FUSED_REDUCE = False
            try:
                ref = lin.linear_triton(x, w, cfg=cfg, split_programs=True)
            finally:
                lin.FUSED_REDUCE = True
            outs = [lin.linear_triton(x, w, cfg=cfg, split_programs=True) for _ in range(50)]
            torch.cuda.synchronize()
            assert all(_bits_equal(o, ref) for o in outs), (N, K, M)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                lin.linear_triton(x, w, cfg=cfg, split_programs=True)  # counters for this stream, before capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=s):
                    y = lin.linear_triton(x, w, cfg=cfg, split_programs=True)
            torch.cuda.current_stream().wait_stream(s)
            for _ in range(20):
                y.zero_()
                graph.replay()
                torch.cuda.synchronize()
                assert _bits_equal(y, ref), (N, K, M, "graph")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [None, 70])
def test_verify_attention_exact_queries_do_not_depend_on_block_or_batch(impl, window):
    """Queries of a 16- and 4-wide block at batch 3 equal the same positions computed one token at a time
    at batch 1; S = 300 gives two 256-key splits (the ordered combine), lengths cross the split edge."""
    g = torch.Generator().manual_seed(1)
    B, Hkv, G, D, S, T = 3, 2, 2, 32, 300, 16
    dt = torch.bfloat16
    k = torch.randn(B, Hkv, S, D, generator=g).to(dt)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dt)
    q = torch.randn(B, T, Hkv * G, D, generator=g).to(dt)
    lens = torch.tensor([250, 5, 270], dtype=torch.int32)
    scale = D**-0.5
    block = verify_attention(q, k, v, lens, scale, impl=impl, window=window, exact=True)
    narrow = verify_attention(q[:, :4].contiguous(), k, v, lens, scale, impl=impl, window=window, exact=True)
    assert _bits_equal(narrow, block[:, :4])
    for b in (0, 2):
        for t in (0, 7, 15):
            one = verify_attention(
                q[b : b + 1, t : t + 1].contiguous(),
                k[b : b + 1],
                v[b : b + 1],
                lens[b : b + 1] + t,
                scale,
                impl=impl,
                window=window,
                exact=True,
            )
            assert _bits_equal(one[0, 0], block[b, t]), (b, t)
    fast = verify_attention(q, k, v, lens, scale, impl=impl, window=window)
    assert (fast.float() - block.float()).abs().max().item() <= 2**-6  # same op, other rounding
    assert not torch.equal(fast, torch.zeros_like(fast))


def _tiny_target(dtype=torch.bfloat16, impl="torch", layers=2, window=None):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    extra = dict(use_sliding_window=True, sliding_window=window, max_window_layers=0) if window else {}
    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_theta=1e4,
        tie_word_embeddings=False,
        initializer_range=0.2,
        **extra,
    )
    hf = Qwen3ForCausalLM(cfg).eval()
    return EngineTarget.from_hf_state(
        ModelArgs.from_hf_config(cfg), hf.state_dict(), DEV, dtype, [0, layers - 1], impl
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_target_step_logits_width_and_batch_invariant(impl):
    """bf16 logits and features of positions P .. P+15 of row 1: one verify block of 16 at batch 3, four
    blocks of 4 at batch 1 and sixteen 1-token steps at batch 1 give the same bits."""
    tgt = _tiny_target(impl=impl)
    g = torch.Generator().manual_seed(2)
    P, T = 9, 16
    prompts = [torch.randint(0, 500, (n,), generator=g) for n in (5, P, 12)]
    cont = torch.randint(0, 500, (3, T), generator=g)

    def fresh(B, rows):
        cache = tgt.new_cache(B, 64)
        for slot, r in enumerate(rows):
            tgt.prefill(prompts[r], slot, cache)
        return cache, torch.tensor([len(prompts[r]) for r in rows], dtype=torch.int32)

    with torch.inference_mode():
        cache, lens = fresh(3, [0, 1, 2])
        pos = lens[:, None].long() + torch.arange(T)
        wide, wide_f = tgt.forward_step(cont, pos, cache, lens, exact=True)
        fast, _ = tgt.forward_step(cont, pos, cache, lens)
        for width, n in ((4, T), (1, 6)):  # width 1: the first 6 positions (interpreter time)
            cache1, lens1 = fresh(1, [1])
            parts, feats = [], []
            for s in range(0, n, width):
                p1 = lens1[:, None].long() + s + torch.arange(width)
                lg, ft = tgt.forward_step(cont[1:2, s : s + width], p1, cache1, lens1 + s, exact=True)
                parts.append(lg)
                feats.append(ft)
            assert _bits_equal(torch.cat(parts, 1)[0], wide[1, :n]), width
            assert _bits_equal(torch.cat(feats, 1)[0], wide_f[1, :n]), width
    assert (
        fast.float() - wide.float()
    ).abs().max().item() < 0.1  # fast mode: the same logits up to bf16 rounding


@pytest.mark.parametrize("impl", IMPLS)
def test_target_tree_step_is_its_paths_decode(impl):
    """bf16: the logits and features of every node of a tree verified in one step at batch 2 (exact mode) are
    bitwise those of the last token of the node's path decoded one token at a time at batch 1 (exact mode)."""
    from dspine.tree import ancestor_bits, ancestor_mask

    tgt = _tiny_target(impl=impl)
    g = torch.Generator().manual_seed(4)
    T = 9
    prompts = [torch.randint(0, 500, (n,), generator=g) for n in (6, 11)]
    parent = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 6, 0], [-1, 0, 1, 2, 0, 4, 1, 6, 7]])
    anc = ancestor_mask(parent)
    depth = anc.sum(-1) - 1
    tokens = torch.randint(0, 500, (2, T), generator=g)

    def fresh(rows):
        cache = tgt.new_cache(len(rows), 64)
        for slot, r in enumerate(rows):
            tgt.prefill(prompts[r], slot, cache)
        return cache, torch.tensor([len(prompts[r]) for r in rows], dtype=torch.int32)

    with torch.inference_mode():
        cache, lens = fresh([0, 1])
        pos = lens[:, None].long() + depth
        tree, tree_f = tgt.forward_step(tokens, pos, cache, lens, tree_bits=ancestor_bits(anc), exact=True)
        nodes = range(T) if impl == "torch" else (3, 7, 8)  # interpreter time
        for b in (0, 1):
            for t in nodes:
                path = anc[b, t].nonzero()[:, 0].tolist()  # ancestors in index order = depth order here
                cache1, lens1 = fresh([b])
                for j, n in enumerate(path):
                    lg, ft = tgt.forward_step(tokens[b : b + 1, n : n + 1], lens1[:, None].long() + j, cache1,
                                              lens1 + j, exact=True)  # fmt: skip
                assert _bits_equal(lg[0, 0], tree[b, t]), (b, t)
                assert _bits_equal(ft[0, 0], tree_f[b, t]), (b, t)
    fast, _ = tgt.forward_step(tokens, pos, fresh([0, 1])[0], lens, tree_bits=ancestor_bits(anc))
    assert (fast.float() - tree.float()).abs().max().item() < 0.1  # fast tree: the same logits up to rounding


def _draft_for(tgt: EngineTarget, block=8):
    from dspine.config import DSpineConfig
    from dspine.model import DSpineDraftModel

    a = tgt.args
    torch.manual_seed(1)
    cfg = DSpineConfig(
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        block_size=block,
        num_target_layers=a.num_layers,
        max_position_embeddings=a.max_position_embeddings,
        rope_theta=a.rope_theta,
        dflash_config={"mask_token_id": a.vocab_size - 1, "target_layer_ids": tgt.layer_ids},
    )
    return DSpineDraftModel(cfg).eval()


def test_engine_exact_spec_equals_ar_bf16():
    """Greedy bf16 on the CPU reference path: with an oracle draft proposing the AR continuation (so
    every committed token passed through a wide verify block), exact mode reproduces the AR output at
    concurrency 1 and 3; tree verify is refused in exact mode."""
    tgt = _tiny_target(layers=2)
    draft = _draft_for(tgt)
    prompts = [[5, 6, 7], [9] * 11, [100, 200], [3, 1, 4, 1, 5]]
    params = SamplingParams(max_new_tokens=24)
    eng = Engine(tgt, draft, [-1], max_batch=3, max_seq=64, exact=True)
    ar = eng.generate(prompts, params, use_draft=False, concurrency=3).token_ids
    assert eng.generate(prompts, params, use_draft=False, concurrency=1).token_ids == ar
    oracle_engine(eng, [p + o for p, o in zip(prompts, ar)], corrupt=0.1)
    for conc in (1, 3):
        res = eng.generate(prompts, params, concurrency=conc)
        assert res.token_ids == ar, conc
        assert res.stats.tau > 3.0  # most tokens were committed from inside verify blocks


@pytest.mark.parametrize("kw", [dict(verify="tree", tree_budget=12), dict(budget="auto", plan_trees=(6, 12))],
                         ids=["tree12", "planner"])  # fmt: skip
def test_engine_exact_tree_and_planner_equal_ar_bf16(kw, monkeypatch):
    """Greedy bf16 on the CPU reference path: exact mode with tree verify (every token from a tree of 12 nodes
    built from an oracle draft with 30% wrong tokens, so accepted paths leave the draft's chain) and with the
    planner (chain and trees mixed per step) reproduces the engine's exact AR output at concurrency 1 and 3.
    This tiny target has no bf16 near-ties (its fast-mode trees give the same tokens): the bits are held by
    test_target_tree_step_is_its_paths_decode here and by the gpu tests on SmolLM2-size shapes; here every tree
    attention call the engine makes is checked to be the exact one, with the step's depths and paths."""
    import infer.model

    calls = []

    def spy(*args, **kw):
        calls.append((kw.get("exact"), kw.get("depth") is not None, kw.get("path") is not None))
        return tree_attention(*args, **kw)

    tree_attention = infer.model.tree_attention
    monkeypatch.setattr(infer.model, "tree_attention", spy)
    tgt = _tiny_target(layers=2)
    draft = _draft_for(tgt)
    prompts = [[5, 6, 7], [9] * 11, [100, 200], [3, 1, 4, 1, 5]]
    params = SamplingParams(max_new_tokens=24)
    eng = Engine(tgt, draft, [-1], max_batch=3, max_seq=64, exact=True, **kw)
    if "budget" in kw:  # a table where speculative steps pay (the CPU's own has AR fastest), not corrected online
        eng._step_costs = lambda B, params: {("ar", 1): 2.0, ("chain", 8): 1.0, ("tree", 6): 1.1, ("tree", 12): 1.2}
        eng.plan_online = False
    ar = eng.generate(prompts, params, use_draft=False, concurrency=3).token_ids
    oracle_engine(eng, [p + o for p, o in zip(prompts, ar)], corrupt=0.3)
    for conc in (1, 3):
        res = eng.generate(prompts, params, concurrency=conc)
        assert res.token_ids == ar, conc
        assert res.stats.tau > 2.0  # tokens came out of verify steps
    assert calls and set(calls) == {(True, True, True)}, set(calls)  # exact, with depths and paths, every time
    if "budget" in kw:
        ran = {m for m, r in eng.planner_report.items() if r["steps"]}
        assert len(ran) >= 2 and ran & {"tree6", "tree12"}, eng.planner_report  # tree and other steps in one decode


def test_tree_verify_refused_on_sliding_window_targets():
    """Tree attention has no sliding window: the engine refuses trees (fixed or the planner's) on a target with
    sliding-window layers, naming the flags that avoid them, and the target refuses a tree step; the planner
    without trees is accepted."""
    tgt = _tiny_target(layers=2, window=8)
    draft = _draft_for(tgt)
    with pytest.raises(ValueError, match=r"sliding-window layers \(windows \[8\]\).*--verify chain"):
        Engine(tgt, draft, [-1], max_seq=64, verify="tree", tree_budget=8)
    with pytest.raises(ValueError, match="--plan-trees none"):
        Engine(tgt, draft, [-1], max_seq=64, budget="auto")
    assert Engine(tgt, draft, [-1], max_seq=64, budget="auto", plan_trees=()).plan_trees == ()
    cache = tgt.new_cache(1, 64)
    tgt.prefill(torch.tensor([1, 2, 3]), 0, cache)
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="tree attention has no window"):
        tgt.forward_step(torch.tensor([[4, 5]]), torch.tensor([[3, 4]]), cache, lens, tree_bits=torch.tensor([[1, 3]]))

def test_bench_exact_mode_compares_spec_with_ar(stories_dir, tmp_path):
    """``infer.bench --exact`` on the CPU engine in bf16: every greedy output of the chain, a tree and the
    planner equals AR (exit 0, JSON says exact); ``first_divergence`` finds the parting position; --exact on the reference backend is refused."""
    from dspine.checkpoint import save_draft
    from dspine.target import load_target
    from infer import bench
    from tests.conftest import shared_path
    from tests.helpers import random_draft

    draft = save_draft(
        random_draft(load_target(str(stories_dir), dtype="fp32"), block_size=8, mask=0), tmp_path / "d"
    )
    out = tmp_path / "b.json"
    argv = [
        "--target",
        str(stories_dir),
        "--draft",
        f"D={draft}",
        "--datasets",
        "gsm8k",
        "--num-prompts",
        "2",
        "--data-dir",
        str(shared_path("data", "eval")),
        "--max-new-tokens",
        "12",
        "--no-chat-template",
        "--concurrency",
        "2",
        "--output-json",
        str(out),
    ]
    trees = ["--draft", f"T={draft}", "--draft", f"P={draft}", "--config", "T:verify=tree,tree_budget=8",
             "--config", "P:budget=auto,plan_trees=8"]  # fmt: skip
    assert bench.main([*argv, *trees, "--backend", "cuda", "--device", "cpu", "--dtype", "bf16", "--exact"]) == 0
    drafts = json.loads(out.read_text())["tasks"][0]["drafts"]
    assert set(drafts) == {"D", "T", "P"} and drafts["T"]["verify"] == "tree"
    for d in drafts.values():  # the chain, a tree of 8 and the planner
        assert (
            d["exact"] is True and d["greedy_equal"] == d["greedy_compared"] == 2 and d["greedy_mismatches"] == []
        )
    out.unlink()
    assert bench.main([*argv, "--backend", "reference", "--exact"]) == 2
    assert (
        bench.first_divergence([1, 2, 3], [1, 2, 4]) == 2 and bench.first_divergence([1, 2], [1, 2, 3]) == 2
    )


def test_bench_reports_divergence_and_fails_in_exact_mode(stories_dir, tmp_path, monkeypatch):
    """A draft run whose first output is changed at position 3: the fast mode lists it with the target's
    top-2 margin there (margin >= 0, top-1 = AR's token); exact mode exits 1 after writing the JSON."""
    from dspine.checkpoint import save_draft
    from dspine.target import load_target
    from infer import bench
    from tests.conftest import shared_path
    from tests.helpers import random_draft

    draft = save_draft(
        random_draft(load_target(str(stories_dir), dtype="fp32"), block_size=8, mask=0), tmp_path / "d"
    )
    run = bench.Runner.run

    def corrupt(self, prompts, params, label, tag=None):
        tokens, *rest = run(self, prompts, params, label, tag)
        if label is not None:
            tokens[0] = tokens[0][:3] + [(tokens[0][3] + 1) % 500] + tokens[0][4:]
        return (tokens, *rest)

    monkeypatch.setattr(bench.Runner, "run", corrupt)
    out = tmp_path / "b.json"
    argv = [
        "--target",
        str(stories_dir),
        "--draft",
        f"D={draft}",
        "--datasets",
        "gsm8k",
        "--num-prompts",
        "2",
        "--data-dir",
        str(shared_path("data", "eval")),
        "--max-new-tokens",
        "8",
        "--no-chat-template",
        "--output-json",
        str(out),
        "--backend",
        "cuda",
        "--device",
        "cpu",
        "--dtype",
        "bf16",
    ]
    assert bench.main(argv) == 0
    d = json.loads(out.read_text())["tasks"][0]["drafts"]["D"]
    assert d["exact"] is False and d["greedy_equal"] == 1 and len(d["greedy_mismatches"]) == 1
    m = d["greedy_mismatches"][0]
    assert m["position"] == 3 and m["ar_top2"][0] == m["ar_tokens"][3] and m["ar_top2_margin"] >= 0
    assert bench.main([*argv, "--exact", "--overwrite"]) == 1 and out.is_file()


# -- GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 12288), (1000, 576)])
def test_linear_cuda_row_invariant(N, K):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(128, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).bfloat16()
    full = linear(x, w)
    for m in (1, 2, 3, 4, 16, 17, 48, 64, 65, 100, 128):
        assert _bits_equal(linear(x[:m], w), full[:m]), m
        assert _bits_equal(linear(x[m - 1 : m], w)[0], full[m - 1]), m
    ref = torch.nn.functional.linear(x.float(), w.float())
    assert (full.float() - ref).abs().max().item() <= 2 * 2**-8 * ref.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 300])
def test_verify_attention_cuda_exact(window):
    g = torch.Generator(device="cuda").manual_seed(0)
    B, Hkv, G, D, S, T = 8, 8, 4, 128, 2000, 16
    k = torch.randn(B, Hkv, S, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(B, Hkv, S, D, device="cuda", generator=g).bfloat16()
    q = torch.randn(B, T, Hkv * G, D, device="cuda", generator=g).bfloat16()
    lens = torch.tensor([0, 1, 255, 256, 700, 1500, 1900, 1984], dtype=torch.int32, device="cuda")
    block = verify_attention(q, k, v, lens, D**-0.5, window=window, exact=True)
    for b in range(B):
        for t in range(T):
            one = verify_attention(
                q[b : b + 1, t : t + 1].contiguous(),
                k[b : b + 1],
                v[b : b + 1],
                lens[b : b + 1] + t,
                D**-0.5,
                window=window,
                exact=True,
            )
            assert _bits_equal(one[0, 0], block[b, t]), (b, t)
    # a larger cache (more, empty splits) does not change the result
    k2, v2 = torch.cat([k, k], 2), torch.cat([v, v], 2)
    assert _bits_equal(verify_attention(q, k2, v2, lens, D**-0.5, window=window, exact=True), block)
    ref = verify_attention(q, k, v, lens, D**-0.5, window=window, impl="torch")
    assert (block.float() - ref.float()).abs().max().item() <= 2**-6


@pytest.mark.gpu
def test_tree_attention_cuda_exact():
    """Compiled kernels, Qwen3-8B heads: every node of trees of 32 nodes at batch 4 (nodes in random order,
    contexts across the 256-key splits) has the bits of verify_attention(exact=True) for the same query as a
    1-token step over a cache holding its path in depth order."""
    from dspine.ops.tree_attention import tree_attention, tree_paths
    from dspine.tree import ancestor_bits, ancestor_mask

    g = torch.Generator().manual_seed(5)
    B, T, Hkv, G, D, S = 4, 32, 8, 4, 128, 2100
    parent = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):
        perm = [0] + (torch.randperm(T - 1, generator=g) + 1).tolist()
        new = {old: n for n, old in enumerate(perm)}
        par = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)]
        parent[b] = torch.tensor([-1 if par[o] < 0 else new[par[o]] for o in perm])
    anc = ancestor_mask(parent)
    depth = (anc.sum(-1) - 1).cuda()
    bits = ancestor_bits(anc).cuda()
    k = torch.randn(B, Hkv, S, D, generator=g).bfloat16().cuda()
    v = torch.randn(B, Hkv, S, D, generator=g).bfloat16().cuda()
    q = torch.randn(B, T, Hkv * G, D, generator=g).bfloat16().cuda()
    lens = torch.tensor([0, 250, 700, 2000], dtype=torch.int32, device="cuda")
    out = tree_attention(q, k, v, lens, bits, D**-0.5, exact=True, depth=depth)
    path = tree_paths(bits, depth)
    for b in range(B):
        clen = int(lens[b])
        for t in range(T):
            src = clen + path[b, t, : int(depth[b, t]) + 1].long()
            k1, v1 = k[b : b + 1].clone(), v[b : b + 1].clone()
            k1[:, :, clen : clen + len(src)] = k[b : b + 1, :, src]
            v1[:, :, clen : clen + len(src)] = v[b : b + 1, :, src]
            one = verify_attention(q[b : b + 1, t : t + 1].contiguous(), k1, v1, lens[b : b + 1] + int(depth[b, t]),
                                   D**-0.5, exact=True)  # fmt: skip
            assert _bits_equal(one[0, 0], out[b, t]), (b, t)
    ref = tree_attention(q, k, v, lens, bits, D**-0.5, impl="torch")
    assert (out.float() - ref.float()).abs().max().item() <= 2**-6


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("kw", [{}, dict(verify="tree", tree_budget=32), dict(budget="auto", plan_trees=(16, 32))],
                         ids=["chain", "tree32", "planner"])  # fmt: skip
def test_engine_cuda_exact_spec_equals_ar(graphs, kw):
    """bf16 on the GPU: exact speculative output (the chain, trees of 32, the planner) equals the engine's exact
    AR output at concurrency 1 and 8 (random draft: every block verified, its anchor row committed)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rope_theta=1e6,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    hf = Qwen3ForCausalLM(cfg).eval()
    tgt = EngineTarget.from_hf_state(
        ModelArgs.from_hf_config(cfg), hf.state_dict(), "cuda", torch.bfloat16, [0, 3], "triton"
    )
    draft = _draft_for(tgt, block=16)
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(0, 4000, (int(n),), generator=g).tolist()
        for n in torch.randint(3, 300, (16,), generator=g)
    ]
    params = SamplingParams(max_new_tokens=160)
    eng = Engine(tgt, draft, [-1], max_batch=8, max_seq=600, exact=True, cuda_graphs=graphs, **kw)
    ar = eng.generate(prompts, params, use_draft=False, concurrency=8).token_ids
    assert eng.generate(prompts, params, use_draft=False, concurrency=1).token_ids == ar
    for conc in (1, 8):
        assert eng.generate(prompts, params, concurrency=conc).token_ids == ar, conc
    if not graphs:  # the oracle draft (host-side) runs eagerly: most tokens come out of wide blocks
        oracle_engine(eng, [p + o for p, o in zip(prompts, ar)], corrupt=0.1)
        # a new draft: the planner must not start from what the random draft's runs taught it (about 1 token per
        # step; with that memory it re-probes the chain only within its probe budget, and the H200 run under -n 4
        # left it on AR, tau 1.36). Its step costs are fixed here too: this tiny target's steps are launch-bound,
        # and under -n 4 the GPU is shared, so the measured table and the online times (also remembered across
        # calls) can price the draft's modes far above AR (an H200 run at 2363cff: tau 1.28 with an oracle draft).
        # What this checks is the token side: with spec steps priced at 1-2 AR steps the oracle's blocks win.
        eng.plan_online = False
        for table in eng._costs.values():
            for mode in table:
                table[mode] = 1.0 if mode[0] == "ar" else 1.0 + mode[1] / 64
        eng.plan_cost_memory.clear()
        eng.plan_token_memory.clear()
        for conc in (1, 8):
            res = eng.generate(prompts, params, concurrency=conc)
            assert res.token_ids == ar, conc
            assert res.stats.tau > 4.0, (conc, kw)


def test_bench_exact_smoke(stories_dir, tmp_path):
    """benchmarks/engine/bench_exact.py --tiny --cpu: all three parts (stories260K with a random draft stands
    in for SmolLM2), every exact run identical, the four step-time ratios, --append keeps earlier runs."""
    from benchmarks.engine import bench_exact
    from dspine.checkpoint import save_draft
    from dspine.target import load_target
    from tests.conftest import shared_path
    from tests.helpers import random_draft

    draft = save_draft(
        random_draft(load_target(str(stories_dir), dtype="fp32"), block_size=8, mask=0), tmp_path / "d"
    )
    out = tmp_path / "exact.json"
    common = ["--tiny", "--cpu", "--output", str(out), "--data-dir", str(shared_path("data", "eval"))]
    assert (
        bench_exact.main(
            [
                *common,
                "--parts",
                "smollm2",
                "--smollm2-target",
                str(stories_dir),
                "--smollm2-draft",
                str(draft),
            ]
        )
        == 0
    )
    assert bench_exact.main([*common, "--parts", "8b,cost", "--append", "--8b-prompts", "3"]) == 0
    res = json.loads(out.read_text())
    assert [(r["target"], r["batch"]) for r in res["runs"]] == [
        ("smollm2", 1),
        ("smollm2", 8),
        ("tiny-random", 1),
        ("tiny-random", 8),
    ]
    assert [r["compared"] for r in res["runs"]] == [5, 5, 3, 3]
    assert all(r["identical"] == r["compared"] and r["cuda_graphs"] is False for r in res["runs"])
    assert res["runs"][2]["tau"] > 2.0  # the oracle draft: blocks accepted deep
    assert set(res["exact_over_fast"]) == {"ar_step_bs1", "spec_step_bs1", "ar_step_bs8", "spec_step_bs8"}
    assert all(v > 0 for v in res["exact_over_fast"].values())
    assert len(res["commands"]) == 2 and set(res["part_seconds"]) == {"smollm2", "build_8b", "8b", "cost"}


@needs_interp
def test_bench_linear_smoke():
    """benchmarks/kernels/bench_linear.py --tiny: both candidate configurations row invariant, a best one."""
    from benchmarks.kernels import bench_linear

    res = bench_linear.run(type("A", (), {"tiny": True, "ctx": 300})())
    assert set(res["per_token_step"]) == {"64,32,128,4,3", "16,32,64,4,2,3"}
    assert (
        all(v["row_invariant"] for v in res["per_token_step"].values())
        and res["best_config"] in res["per_token_step"]
    )
    assert [(a["B"], a["T"]) for a in res["attention"]] == [(1, 1), (2, 4)]


def test_generate_refuses_exact_where_it_does_not_exist(stories_dir, capsys):
    from infer import generate

    base = [
        "--target",
        str(stories_dir),
        "--draft",
        "none",
        "--prompt",
        "hi",
        "--backend",
        "reference",
        "--exact",
    ]
    assert generate.main(base) == 2
    assert "--exact needs the engine" in capsys.readouterr().err


def test_tuned_tile_file_of_the_h200(tmp_path, monkeypatch):
    """The committed H200 file is read and valid (every Qwen3-8B weight, tiles mixed by M as measured
    bitwise equal there); a broken file is refused with its path named."""
    from dspine.ops import linear as lin

    t = lin.tuned("NVIDIA H200")
    assert t["mixed_row_tiles"] is True
    assert set(t["weights"]) == {"6144,4096", "4096,4096", "24576,4096", "4096,12288", "151936,4096"}
    for e in t["weights"].values():
        assert e["small"][0] == 16 and e["large"][0] >= 64 and e["split"] in (1, 4)
        assert lin.CHUNK_GRANULE % e["small"][2] == 0 and lin.CHUNK_GRANULE % e["large"][2] == 0
    assert lin.tuned("No Such GPU") == {}
    monkeypatch.setattr(lin, "TUNED_DIR", tmp_path)
    (tmp_path / "linear-Bad_GPU.json").write_text(
        '{"mixed_row_tiles": true, "weights": {"64,64": {"split": 0}}}'
    )
    lin.tuned.cache_clear()
    try:
        with pytest.raises(ValueError, match="linear-Bad_GPU.json"):
            lin.tuned("Bad GPU")
    finally:
        lin.tuned.cache_clear()


def test_tuned_file_takes_cublas_where_it_gave_the_kernels_bits():
    """bench_linear's tuned-file writer: a weight whose cuBLAS result equalled the one-pass kernel at every
    large M gets split 1 and ``cublas_m`` (its large-M time counts as cuBLAS's), even where split 4 had
    faster small-M tiles than split 1 has large-M tiles; without agreement the faster split wins."""
    from benchmarks.kernels import bench_linear as bl

    ms = (1, 16, 128)

    def rows(name, split, small_us, large_us):
        t = (16, 64, 128, 4, 4)
        us = {f"M{m}/{sp}": (small_us if m <= 16 else large_us) for m in ms for sp in (False, True)}
        return {
            "weight": name,
            "N": 64,
            "K": 512,
            "split": split,
            "tile": list(t),
            "bits_equal_to_first_tile": True,
            "us": us,
        }

    def summary(name, agree):
        best = {f"M{m}": {"cublas_us": 10.0} for m in ms}
        return {
            f"{name}/split1": {"all_bits_equal": True, "best_by_m": best, "cublas_agrees_m": agree},
            f"{name}/split4": {"all_bits_equal": True, "best_by_m": best},
        }

    r = [rows("w", 1, 10.5, 15.0), rows("w", 4, 9.0, 14.0)]
    with_agree = bl.tuned_file(r, summary("w", [[1, 256]]), ms)["weights"]["64,512"]
    assert with_agree["split"] == 1 and with_agree["cublas_m"] == [[1, 256]]
    assert with_agree["worst_ratio_to_cublas"] == pytest.approx(1.05)
    without = bl.tuned_file(r, summary("w", [[1, 100]]), ms)["weights"]["64,512"]
    assert (
        without["split"] == 4
        and "cublas_m" not in without
        and without["worst_ratio_to_cublas"] == pytest.approx(1.4)
    )
    assert bl.ranges([5, 1, 2, 3, 7]) == [[1, 3], [5, 5], [7, 7]] and bl.ranges([]) == []


def test_tuned_file_refuses_cublas_rows_without_split_1(tmp_path, monkeypatch):
    from dspine.ops import linear as lin

    monkeypatch.setattr(lin, "TUNED_DIR", tmp_path)
    entry = {
        "split": 4,
        "small": [16, 64, 128, 4, 4],
        "large": [64, 64, 128, 4, 4],
        "programs": {"small": True, "large": False},
        "cublas_m": [[17, 256]],
    }
    for name, e in (("A", entry), ("B", {**entry, "split": 1, "cublas_m": [[9, 3]]})):
        (tmp_path / f"linear-{name}.json").write_text(
            json.dumps({"mixed_row_tiles": True, "weights": {"64,512": e}})
        )
    lin.tuned.cache_clear()
    try:
        with pytest.raises(ValueError, match="linear-A.json.*needs split 1"):
            lin.tuned("A")
        with pytest.raises(ValueError, match=r"linear-B.json.*\[9, 3\]"):
            lin.tuned("B")
        (tmp_path / "linear-C.json").write_text(
            json.dumps({"mixed_row_tiles": True, "weights": {"64,512": {**entry, "split": 1}}})
        )
        assert lin.tuned("C")["weights"]["64,512"]["cublas_m"] == [[17, 256]]
        assert lin.in_ranges(17, [[17, 256]]) and not lin.in_ranges(16, [[17, 256]])
    finally:
        lin.tuned.cache_clear()


def test_identity_runs_compare_ar_by_prompt_not_position(monkeypatch):
    """bench_exact's AR-equal-to-first-configuration count keys each output by its prompt: the graphs-off runs
    decode a subset (eager_prompts) whose positions differ from the full list's."""
    from types import SimpleNamespace

    from benchmarks.engine import bench_exact

    class Stub:
        cuda_graphs = False

        def generate(self, prompts, params, concurrency=1, use_draft=True):
            return SimpleNamespace(
                token_ids=[[sum(p) % 7, len(p)] for p in prompts], stats=SimpleNamespace(tau=1.0)
            )

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    prompts = [[1, 2], [3], [4, 5, 6], [7, 8]]
    report: list = []
    bench_exact.identity_runs(
        "stub", lambda graphs: Stub(), prompts, [prompts[2], prompts[0]], 4, None, report
    )
    assert [(r["compared"], r["identical"], r["ar_equal_to_first_config"]) for r in report] == [
        (4, 4, 4),
        (4, 4, 4),
        (2, 2, 2),
        (2, 2, 2),
    ]


@needs_interp
def test_linear_edge_cases_k0_and_bias_dtype():
    from dspine.ops.linear import linear_torch, linear_triton

    x = torch.randn(3, 0).to(torch.bfloat16)
    w = torch.zeros(5, 0, dtype=torch.bfloat16)
    b = torch.randn(5).to(torch.bfloat16)
    for fn in (linear_triton, linear_torch):
        assert torch.equal(fn(x, w, b), b.expand(3, 5)) and torch.equal(
            fn(x, w), torch.zeros(3, 5, dtype=torch.bfloat16)
        )
        with pytest.raises(ValueError, match="bias is torch.float32"):
            fn(torch.randn(3, 8).to(torch.bfloat16), torch.randn(5, 8).to(torch.bfloat16), torch.randn(5))


@pytest.mark.parametrize(
    "patch, msg",
    [
        ({"mixed_row_tiles": "false"}, "mixed_row_tiles must be true or false"),
        ({"w": {"programs": {"small": "no", "large": False}}}, "programs.small must be true or false"),
        ({"w": {"small": [16, 64, 96, 4, 4]}}, "BLOCK_K must divide 256"),
        ({"w": {"large": [24, 64, 128, 4, 4]}}, "powers of 2"),
        ({"w": {"split": 2.7}}, "split 2.7 must be an integer"),
        ({"key": "64, 512"}, "'64, 512' is not 'N,K'"),
        ({"w": {"small_ratio_to_cublas": "fast"}}, "small_ratio_to_cublas 'fast'"),
    ],
)
def test_tuned_file_refuses_loose_values(tmp_path, monkeypatch, patch, msg):
    from dspine.ops import linear as lin

    entry = {
        "split": 1,
        "small": [16, 64, 128, 4, 4],
        "large": [64, 64, 128, 4, 4],
        "programs": {"small": False, "large": False},
        **patch.get("w", {}),
    }
    d = {
        "mixed_row_tiles": patch.get("mixed_row_tiles", True),
        "weights": {patch.get("key", "64,512"): entry},
    }
    monkeypatch.setattr(lin, "TUNED_DIR", tmp_path)
    (tmp_path / "linear-X.json").write_text(json.dumps(d))
    lin.tuned.cache_clear()
    try:
        with pytest.raises(ValueError, match=f"linear-X.json.*{re.escape(msg)}"):
            lin.tuned("X")
    finally:
        lin.tuned.cache_clear()


@needs_interp
def test_bench_linear_cross_tiny_writes_a_loadable_tuned_file():
    """bench_linear --cross --tiny: every (weight, split) summarised, the cuBLAS check recorded for split 1, and
    the tuned file it derives passes dspine.ops.linear's validation."""
    from benchmarks.kernels import bench_linear
    from dspine.ops import linear as lin

    res = bench_linear.cross(type("A", (), {"tiny": True})())
    assert set(res["cross_summary"]) == {"a/split1", "a/split4"}
    agree = res["cross_summary"]["a/split1"]["cublas_agrees_m"]
    assert all(1 <= lo <= hi <= 32 for lo, hi in agree)
    lin._check_tuned(res["tuned"])
    e = res["tuned"]["weights"]["96,300"]
    assert e["split"] in (1, 4) and e["small_ratio_to_cublas"] > 0


def test_tuned_file_bitwise_findings_need_the_same_versions(tmp_path, monkeypatch):
    """A tuned file measured with other torch / Triton versions keeps its tiles but not its bitwise findings
    (mixed row tiles, cuBLAS rows): _same_versions says so, with a warning; no versions recorded counts as
    matching (the files written before the writer recorded them)."""
    from dspine.ops import linear as lin

    entry = {
        "split": 1,
        "small": [16, 64, 128, 4, 4],
        "large": [64, 64, 128, 4, 4],
        "programs": {"small": False, "large": False},
    }
    monkeypatch.setattr(lin, "TUNED_DIR", tmp_path)
    for name, extra in (
        ("Old", {"versions": {"torch": "0.1", "triton": "0.1"}}),
        ("Same", {"versions": lin.versions()}),
        ("None", {}),
    ):
        (tmp_path / f"linear-{name}.json").write_text(
            json.dumps({"mixed_row_tiles": True, "weights": {"64,512": entry}, **extra})
        )
    lin.tuned.cache_clear()
    lin._same_versions.cache_clear()
    try:
        with pytest.warns(UserWarning, match="not used; rerun benchmarks/kernels/bench_linear.py --cross"):
            assert lin._same_versions("Old") is False
        assert lin._same_versions("Same") is True and lin._same_versions("None") is True
    finally:
        lin.tuned.cache_clear()
        lin._same_versions.cache_clear()


@needs_interp
def test_bench_linear_fusion_tiny(tmp_path, monkeypatch, capsys):
    """benchmarks/kernels/bench_linear_fusion.py --tiny: every variant of each weight timed at each row count (the act
    prologue on the down projection only), the unfused kernels per row count, the act sweep over its configurations
    at the first and last row count; bad outputs and --stream-mb are refused before any work (exit 2, the flag
    named); each fused variant is checked inside main: a wrong unfused norm or SiLU-mul composition is reported by
    name."""
    from benchmarks.kernels import bench_linear_fusion as blf

    out = tmp_path / "f.json"
    assert blf.main(["--tiny", "--output", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["ms"] == [1, 3] and res["norm_tile"] == 64 and res["tiny"] is True and res["commit"]
    assert set(res["weights"]) == set(blf.TINY_SHAPES)
    for name, (N, K) in blf.TINY_SHAPES.items():
        w = res["weights"][name]
        assert (w["N"], w["K"], w["copies"]) == (N, K, 1)
        for m in ("M1", "M3"):
            row = w["by_m"][m]
            want = {"cublas", "plain", "norm", "residual"} | ({"act"} if name == "down" else set())
            assert set(row["us"]) == want and len(row["cfg"]) == 6
    assert set(res["unfused_by_m"]) == {"M1", "M3"}
    assert all(set(u) == {"rms_norm_residual_us", "silu_mul_us"} for u in res["unfused_by_m"].values())
    assert [(a["m"], tuple(a["cfg"])) for a in res["act_by_split"]] == [(m, c) for m in (1, 3) for c in blf.TINY_ACT_CFGS]
    for bad, msg in [(["--output", str(out)], f"--output {out} exists; pass --overwrite"),
                     (["--output", ""], "--output: give a file name"),
                     (["--output", str(tmp_path)], "is a folder"),
                     (["--stream-mb", "0"], "--stream-mb 0: must be at least 1")]:
        with pytest.raises(SystemExit) as e:
            blf.main(["--tiny", *bad])
        assert e.value.code == 2 and msg in capsys.readouterr().err
    # the checks run inside main: an unfused reference off by a factor is refused, naming the variant
    real_norm, real_act = blf.rms_norm, blf.silu_mul
    monkeypatch.setattr(blf, "rms_norm", lambda x, w, eps, **kw: real_norm(x, w, eps, **kw) * 1.05)
    with pytest.raises(RuntimeError, match=r"qkv M1 norm: relative error 0\.0[45]"):
        blf.main(["--tiny"])
    monkeypatch.setattr(blf, "rms_norm", real_norm)
    monkeypatch.setattr(blf, "silu_mul", lambda x: real_act(x) * 1.05)
    with pytest.raises(RuntimeError, match=r"down M1 act: relative error 0\.0[45]"):
        blf.main(["--tiny"])
    blf._check("within", torch.ones(2, 3), torch.ones(2, 3) * (1 + 2**-8))
    with pytest.raises(RuntimeError, match=r"x: relative error 0\.01"):
        blf._check("x", torch.ones(2, 3), torch.ones(2, 3) * (1 + 2**-6.5))
