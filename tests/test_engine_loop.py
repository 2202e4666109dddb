"""The engine's decode loop and packed prefill on the host side (issue 11), on the CPU.

* the loop runs one step ahead of the flags it reads: outputs equal the reference decoder's at any
  concurrency; a batch whose rows all run to max_new_tokens takes exactly max_new_tokens steps (one
  idle step after the last commit, the price of not waiting for the flags); ``loop_profile`` counts them;
* the varlen prefill attention (GPU only) against the per-prompt SDPA loop, through a CPU stand-in
  for ``varlen_attn`` with its documented layout, and its fallback when the call fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspine.reference import ReferenceDecoder
from dspine.sampling import SamplingParams
from dspine.target import load_target
from infer.engine import load_engine
from infer.model import EngineTarget

PROMPTS = [[1], [1, 403, 407], [1, 403, 407, 261, 378, 432, 383], [1, 300], [1, 301, 302, 303, 304], [1, 410]]


def test_pipelined_loop_outputs_steps_and_profile(stories_dir):
    eng, _ = load_engine(str(stories_dir), None, None, device="cpu", dtype=torch.float32, impl="torch",
                         max_batch=8, max_seq=200, eos_token_ids=[2])
    prompts = PROMPTS[:5]
    params = SamplingParams(0.9, max_new_tokens=8, seed=3)  # greedy: tests/test_engine.py (refill)
    want = ReferenceDecoder(load_target(str(stories_dir), dtype="fp32"), None, [2]).generate(prompts, params)
    got = eng.generate(prompts, params, concurrency=2, use_draft=False)  # slots refilled 3 times
    assert got.token_ids == want.token_ids and got.finish_reasons == want.finish_reasons
    prof = eng.loop_profile
    assert prof["steps"] == got.steps and prof["tokens"] == got.num_tokens
    assert prof["wall_s"] >= prof["launch_s"] + prof["wait_s"] + prof["host_s"] + prof["prefill_s"] - 1e-6
    # no EOS (none is a stop id): every row runs 6 tokens, 5 steps each, and the flags of the last are
    # read during one more (idle) step
    eng.eos_set, eng.eos = set(), torch.tensor([-1])
    got = eng.generate(PROMPTS[:3], SamplingParams(max_new_tokens=6), concurrency=3, use_draft=False)
    assert all(len(t) == 6 for t in got.token_ids) and set(got.finish_reasons) == {"length"}
    assert got.steps == 6
    for prompts, conc, msg in (([], None, "generate: no prompts"),
                               (PROMPTS[:2], 0, "generate: concurrency 0: must be >= 1")):
        with pytest.raises(ValueError, match=msg):
            eng.generate(prompts, SamplingParams(max_new_tokens=2), concurrency=conc, use_draft=False)


def _varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's contract on the CPU: q [T, Hq, D], k/v [T, Hkv, D],
    sequences cu[j]..cu[j+1]-1, window (-1, 0) = causal."""
    assert window_size == (-1, 0) and cu_q is cu_k and q.dim() == 3 and k.shape[0] == q.shape[0]
    assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                                           v[a:b].transpose(0, 1)[None], is_causal=True, scale=scale,
                                           enable_gqa=enable_gqa)
        out[a:b] = o[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("mode", ["gqa-flag", "torch-2.11", "runtime-error", "type-error", "value-error"])
def test_varlen_prefill_equals_the_per_prompt_loop(stories_dir, monkeypatch, capsys, mode):
    """The packed prefill through varlen_attn equals the per-prompt loop: with torch >= 2.12's
    ``enable_gqa``, with torch 2.11's signature (no such keyword: the key/value heads are repeated), and
    after a failing call (the loop runs, once and from then on)."""
    import torch.nn.attention.varlen as varlen

    eng = EngineTarget.from_pretrained(str(stories_dir), device="cpu", dtype=torch.float32, layer_ids=[1, 3],
                                       impl="torch")
    assert eng.args.num_heads != eng.args.num_kv_heads  # the GQA paths are what this test checks
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g) for n in (5, 1, 17, 9)]
    slots = [3, 0, 2, 5]
    loop, packed = eng.new_cache(6, 40), eng.new_cache(6, 40)
    want_logits, want_feats = eng.prefill_packed(prompts, slots, loop)
    calls = []
    fail = mode.endswith("error")

    def new_api(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        calls.append(1)
        if mode == "runtime-error":
            raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
        if mode == "type-error":
            raise TypeError("varlen_attn() got an unexpected keyword argument 'window_size'")
        if mode == "value-error":  # not a refusal of the call: it propagates, no silent fallback
            raise ValueError("a bug")
        assert enable_gqa
        return _varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size,
                                enable_gqa=enable_gqa)

    def old_api(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        calls.append(1)
        assert k.shape[1] == v.shape[1] == q.shape[1]  # heads repeated for the call without enable_gqa
        return _varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

    monkeypatch.setattr(varlen, "varlen_attn", old_api if mode == "torch-2.11" else new_api)
    monkeypatch.setattr(EngineTarget, "_varlen_ok", lambda self, n, dev: self.varlen_prefill and n > 1)
    if mode == "value-error":
        with pytest.raises(ValueError, match="a bug"):
            eng.prefill_packed(prompts, slots, packed)
        assert eng.varlen_prefill
        return
    logits, feats = eng.prefill_packed(prompts, slots, packed)
    assert len(calls) == (1 if fail else eng.args.num_layers)
    assert (logits - want_logits).abs().max() < 1e-5 and (feats - want_feats).abs().max() < 1e-5
    for i in range(eng.args.num_layers):
        assert torch.equal(packed.k[i], loop.k[i]) and torch.equal(packed.v[i], loop.v[i])
    assert eng.varlen_prefill is not fail
    assert ("varlen prefill attention failed" in capsys.readouterr().out) is fail


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_varlen_prefill_on_cuda(tiny_qwen3_dir):
    """The real varlen call (bf16): as close to an fp32 one-prompt prefill as the per-prompt loop is."""
    ref = EngineTarget.from_pretrained(str(tiny_qwen3_dir), device="cuda", dtype=torch.float32, layer_ids=[1, 2],
                                       impl="torch")
    eng = EngineTarget.from_pretrained(str(tiny_qwen3_dir), device="cuda", dtype=torch.bfloat16, layer_ids=[1, 2],
                                       impl="triton")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 150000, (n,), generator=g).cuda() for n in (5, 1, 170, 93, 31)]
    slots = [3, 0, 2, 5, 1]
    want = torch.stack([ref.prefill(p, b, ref.new_cache(6, 256))[0] for p, b in zip(prompts, slots)])
    got, _ = eng.prefill_packed(prompts, slots, eng.new_cache(6, 256))
    assert eng.varlen_prefill, "varlen_attn failed on this GPU: the per-prompt loop ran"
    eng.varlen_prefill = False
    loop, _ = eng.prefill_packed(prompts, slots, eng.new_cache(6, 256))
    err_varlen = (got.float() - want).abs().max().item()
    err_loop = (loop.float() - want).abs().max().item()
    assert err_varlen <= 2 * err_loop + 1e-2, (err_varlen, err_loop)
