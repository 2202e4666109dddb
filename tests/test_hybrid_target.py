"""Hybrid targets (issue 14): transformers' qwen3_next and qwen3_5_text, three gated delta-rule
(linear-attention) layers + one full-attention layer, tiny random fp32 weights, vocab 256.

The reference path (target adapter, reference decoder, trainer) runs them; the engine's tests are in
tests/test_hybrid_engine.py. Rollback of the recurrent state is checked at every accept length 0..15.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspine.reference import ReferenceDecoder
from dspine.sampling import SamplingParams
from dspine.target import TargetSpec, load_target
from tests.helpers import hybrid_config, random_draft

REPO = Path(__file__).resolve().parents[1]
PROMPT = list(range(3, 23))  # 20 tokens
BS = 16


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def hybrid(request, tmp_path_factory):
    """(folder, transformers model, its greedy continuation of PROMPT: 40 tokens)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = hybrid_config(request.param)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    out = tmp_path_factory.mktemp(request.param)
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = model.generate(torch.tensor([PROMPT]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                         pad_token_id=0)
    want = ids[0, len(PROMPT):].tolist()
    assert len(set(want)) > 5
    return out, model, want


def forced_draft(decoder, truth: list[int], accepts: list[int], V: int):
    """Patch the decoder's draft: at step s it proposes the true tokens for slots 1..accepts[s] and a wrong
    token at the next slot, so the target accepts exactly accepts[s] tokens (the last value repeats)."""
    step = [0]

    def draft_logits(block, dcache):
        n = int(dcache.lengths[0])  # position of the anchor
        a = accepts[min(step[0], len(accepts) - 1)]
        step[0] += 1
        logits = torch.zeros(1, BS - 1, V)
        for k in range(1, BS):
            tok = truth[n + k] if n + k < len(truth) else 0
            logits[0, k - 1, (tok + 1) % V if k == a + 1 else tok] = 10.0
        return logits

    decoder.draft_logits = draft_logits


def test_spec_supported_on_both_paths(hybrid):
    out, _, _ = hybrid
    spec = TargetSpec.from_pretrained(str(out))
    assert spec.layer_problems == [] and spec.rope_problems == [] and spec.engine_layer_problems == []
    spec.check_supported()
    spec.check_supported(engine=True)  # the engine runs it too (tests/test_hybrid_engine.py)


def test_features_equal_transformers_hidden_states(hybrid):
    out, model, _ = hybrid
    target = load_target(str(out), dtype="fp32", layer_ids=[1, 3])
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    want = torch.cat([hs[2], hs[4]], dim=-1)
    assert (target.features(ids) - want).abs().max() < 1e-5
    assert (target(ids).features - want).abs().max() < 1e-5


def test_rollback_at_every_accept_length(hybrid):
    """One verify step that accepts exactly a draft tokens (a = 0..15), then a second step on the rolled-back
    state: both commit transformers' greedy tokens, and the accept lengths are the forced ones."""
    out, _, want = hybrid
    target = load_target(str(out), dtype="fp32")
    draft = random_draft(target, block_size=BS, mask=1)
    truth = PROMPT + want
    for a in range(BS):
        dec = ReferenceDecoder(target, draft, eos_token_ids=[])
        forced_draft(dec, truth, [a, 2], target.vocab_size)
        n = 1 + (a + 1) + 3  # prefill token, step 1 commits a + 1, step 2 accepts 2 and commits 3
        res = dec.generate([PROMPT], SamplingParams(max_new_tokens=n))
        assert res.token_ids[0] == want[:n], a
        hist = [0] * (BS + 1)
        hist[a + 1] += 1
        hist[3] += 1
        assert res.stats.hist == hist, a


def test_greedy_speculative_equals_transformers(hybrid):
    """40 tokens with accept lengths cycling 15, 0, 7, 3, 11, 1 (both rollback paths, replay of long and
    short prefixes), and autoregressive decoding."""
    out, _, want = hybrid
    target = load_target(str(out), dtype="fp32")
    dec = ReferenceDecoder(target, random_draft(target, block_size=BS, mask=1), eos_token_ids=[])
    forced_draft(dec, PROMPT + want, [15, 0, 7, 3, 11, 1] * 4, target.vocab_size)
    res = dec.generate([PROMPT], SamplingParams(max_new_tokens=40))
    assert res.token_ids[0] == want
    ar = ReferenceDecoder(target, None, eos_token_ids=[]).generate([PROMPT], SamplingParams(max_new_tokens=40))
    assert ar.token_ids[0] == want


@pytest.mark.parametrize("hybrid", ["qwen3_next"], indirect=True)  # one model: the trainer path is shared
def test_tiny_distillation_trains_and_evaluates(hybrid, tmp_path):
    """train/distill.py on the hybrid target: a few steps with evaluation (teacher-forced and real τ through
    the reference decoder, which rolls back the recurrent state)."""
    out, _, want = hybrid
    g = torch.Generator().manual_seed(0)
    for name, n in (("train", 16), ("eval", 4)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                ids = torch.randint(2, 256, (48,), generator=g).tolist()
                f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 8 + [1] * 40}) + "\n")
    run = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "train" / "distill.py"), "--config", str(REPO / "configs" / "stories260k-cpu.yaml"),
           f"target={out}", f"train={tmp_path / 'train.jsonl'}", f"eval={tmp_path / 'eval.jsonl'}",
           f"output_dir={run}", "max_steps=4", "save_every=4", "eval_every=4", "log_every=1", "layers=1",
           "block_size=8", "mask_token_id=1", "micro_batch_size=4", "eval_prompts=1", "eval_max_new_tokens=8",
           "max_length=64", "anchors_per_seq=8"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in rows if "eval/loss" in x]
    assert [x["step"] for x in evals] == [4]
    assert 1.0 <= evals[0]["eval/tau_real"] <= 8 and evals[0]["eval/loss"] > 0
    assert (run / "step-4" / "draft" / "config.json").is_file()
