"""Sliding-window Qwen3 targets (issue 14): the engine and the reference decoder against transformers.

A tiny random fp32 Qwen3 with ``use_sliding_window``, window 8, ``max_window_layers`` 1 (layer 0 full,
layers 1-3 sliding), prompts longer than the window and 40 new tokens. Before the fix the engine ran
every layer with full attention (prefill logits off by ~3, greedy output wrong from the first token).
"""

from __future__ import annotations

import pytest
import torch

from dspine.reference import ReferenceDecoder
from dspine.sampling import SamplingParams
from dspine.target import load_target
from infer.engine import Engine
from infer.model import EngineTarget
from tests.helpers import oracle_engine, oracle_reference_decoder, random_draft

WINDOW, NEW = 8, 40
PROMPTS = [list(range(3, 23)), list(range(40, 66, 2))]  # 20 and 13 tokens


def _config(**kw):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       rope_theta=1e4, tie_word_embeddings=False, eos_token_id=None, pad_token_id=0,
                       bos_token_id=None, initializer_range=0.1, **kw)


@pytest.fixture(scope="module")
def swa_dir(tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = _config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    assert cfg.layer_types == ["full_attention"] + ["sliding_attention"] * 3
    out = tmp_path_factory.mktemp("tiny_swa")
    Qwen3ForCausalLM(cfg).eval().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_greedy(swa_dir):
    """transformers' greedy continuation (NEW tokens) of every prompt, and the model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(swa_dir, dtype=torch.float32).eval()
    outs = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             pad_token_id=0)
        outs.append(ids[0, len(p):].tolist())
    return model, outs


def test_window_changes_the_output(swa_dir, hf_greedy):
    """The test is sharp: the same weights with full attention continue differently."""
    from transformers import Qwen3ForCausalLM

    model, want = hf_greedy
    full = Qwen3ForCausalLM(_config()).eval()
    full.load_state_dict(model.state_dict())
    got = full.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert got[0, len(PROMPTS[0]):].tolist() != want[0]
    assert len(set(want[0])) > 5  # not a constant continuation


def test_engine_prefill_and_features_match_transformers(swa_dir, hf_greedy):
    model, _ = hf_greedy
    ids = torch.tensor([PROMPTS[0] + [100, 101, 102, 103, 104]])
    with torch.no_grad():
        want = model(ids, output_hidden_states=True)
    eng = EngineTarget.from_pretrained(str(swa_dir), device="cpu", dtype=torch.float32, layer_ids=[1, 3],
                                       impl="torch")
    assert eng.args.windows == (None, WINDOW, WINDOW, WINDOW)
    feats_want = torch.cat([want.hidden_states[2], want.hidden_states[4]], dim=-1)[0]
    cache = eng.new_cache(2, 64)
    logits, feats = eng.prefill(ids[0, :20], 1, cache)
    assert (logits - want.logits[0, 19]).abs().max() < 1e-4
    assert (feats - feats_want[:20]).abs().max() < 1e-4
    lens = torch.tensor([0, 20], dtype=torch.int32)
    pos = lens[:, None].long() + torch.arange(5)
    step_logits, step_feats = eng.forward_step(ids[:, 20:].repeat(2, 1), pos, cache, lens)
    assert (step_logits[1] - want.logits[0, 20:]).abs().max() < 1e-4
    assert (step_feats[1] - feats_want[20:]).abs().max() < 1e-4
    # packed prefill of two prompts takes the same masks
    logits2, _ = eng.prefill_packed([ids[0, :20], ids[0, :3]], [0, 1], eng.new_cache(2, 64))
    assert (logits2[0] - want.logits[0, 19]).abs().max() < 1e-4


def test_adapter_features_match_transformers(swa_dir, hf_greedy):
    model, _ = hf_greedy
    target = load_target(str(swa_dir), dtype="fp32", layer_ids=[0, 2])
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    want = torch.cat([hs[1], hs[3]], dim=-1)
    assert (target.features(ids) - want).abs().max() < 1e-5
    assert (target(ids).features - want).abs().max() < 1e-5


def test_reference_decoder_equals_transformers(swa_dir, hf_greedy):
    """Greedy speculative decoding with an oracle draft (the true continuation, each token replaced by a
    random one with probability 0.15: accept lengths from 0 to 15, accepts that cross the window)
    commits exactly transformers' greedy tokens."""
    _, want = hf_greedy
    target = load_target(str(swa_dir), dtype="fp32")
    dec = ReferenceDecoder(target, random_draft(target, block_size=16, mask=1), eos_token_ids=[])
    oracle_reference_decoder(dec, [p + w for p, w in zip(PROMPTS, want)], corrupt=0.15)
    res = dec.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))
    assert res.token_ids == want
    assert res.stats.tau > 3


def test_engine_torch_path_equals_transformers(swa_dir, hf_greedy):
    """The engine's torch path (speculative with the same oracle draft, and autoregressive)."""
    _, want = hf_greedy
    draft = random_draft(load_target(str(swa_dir), dtype="fp32"), block_size=16, mask=1)
    eng_target = EngineTarget.from_pretrained(str(swa_dir), device="cpu", dtype=torch.float32, impl="torch",
                                              layer_ids=draft.config.target_layer_ids)
    eng = Engine(eng_target, draft, [], max_batch=2, max_seq=64, max_new_cap=NEW)
    oracle_engine(eng, [p + w for p, w in zip(PROMPTS, want)], corrupt=0.15)
    res = eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))
    assert res.token_ids == want
    assert res.stats.tau > 3
    ar = eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW), use_draft=False)
    assert ar.token_ids == want


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_engine_cuda_equals_transformers(swa_dir, hf_greedy, graphs):
    """H200: the Triton kernels (windowed verify/decode attention) with and without CUDA graphs, fp32."""
    _, want = hf_greedy
    draft = random_draft(load_target(str(swa_dir), dtype="fp32"), block_size=16, mask=1)
    eng_target = EngineTarget.from_pretrained(str(swa_dir), device="cuda", dtype=torch.float32, impl="triton",
                                              layer_ids=draft.config.target_layer_ids)
    eng = Engine(eng_target, draft, [], max_batch=2, max_seq=64, max_new_cap=NEW, cuda_graphs=graphs)
    for use_draft in (True, False):
        for conc in (1, 2):
            got = eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW), concurrency=conc, use_draft=use_draft)
            assert got.token_ids == want, (use_draft, conc)
