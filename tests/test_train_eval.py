"""The trainer's in-run evaluation (issue 11): tau_real decodes its prompts with one target forward per step
(``ReferenceDecoder(batch_verify=True)``) and must give what one forward per prompt gives; ``evaluate``
reports its wall-clock split (``eval/seconds``, ``eval/loss_seconds``, ``eval/tau_real_seconds``) and, padded to
the training micro-batch (the flex path), the same metrics.
stories260K on the CPU, fp32: the batched path is bitwise equal there (same tokens, same statistics)."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator

from dspine.reference import ReferenceDecoder
from dspine.sampling import SamplingParams
from dspine.target import TargetSpec, load_target
from tests.helpers import oracle_reference_decoder, random_draft
from train import config as run_config
from train.data import open_rows
from train.distill import evaluate
from train.step import StepSettings

# prompts of different lengths (the batched prefill right-pads them), one ending at once (EOS 2 is likely late)
PROMPTS = [[1, 403, 407, 261, 378, 432, 383, 286], [1, 300], [1, 403, 407], [1, 261, 378, 432, 383, 286, 261, 268, 414]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40)


@pytest.fixture(scope="module")
def stories(stories_dir):
    target = load_target(str(stories_dir), dtype="fp32")
    return target, random_draft(target, block_size=8, mask=0)


def decode(target, draft, batch_verify: bool, params=GREEDY, reference=None, corrupt=0.0):
    dec = ReferenceDecoder(target, draft, [2], batch_verify=batch_verify)
    if reference is not None:
        oracle_reference_decoder(dec, reference, corrupt, seed=1)
    return dec.generate(PROMPTS, params)


def same_result(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert a.finish_reasons == b.finish_reasons
    assert [s.hist for s in a.prompt_stats] == [s.hist for s in b.prompt_stats] and a.steps == b.steps
    assert a.stats.accept_at_pos == b.stats.accept_at_pos and a.stats.tau == b.stats.tau


@pytest.mark.parametrize("corrupt", [0.0, 0.4])
def test_batched_verify_equals_per_row_verify(stories, corrupt):
    target, draft = stories
    ar = ReferenceDecoder(target, None, [2]).generate(PROMPTS, GREEDY)
    reference = [p + o for p, o in zip(PROMPTS, ar.token_ids)]
    rows = decode(target, draft, False, reference=reference, corrupt=corrupt)
    batched = decode(target, draft, True, reference=reference, corrupt=corrupt)
    same_result(rows, batched)
    assert batched.token_ids == ar.token_ids  # lossless, and the drafts were accepted for real:
    if corrupt == 0.0:  # every block fully accepted (7 drafts + bonus); the 5th step is cut at 39 committed tokens
        assert [s.hist for s in batched.prompt_stats] == [[0, 0, 0, 0, 0, 0, 0, 1, 4]] * 4
        assert batched.stats.tau == pytest.approx(7.8)
    else:  # 4 x 39 tokens over 61 steps: partial blocks accepted, so the per-row cache bookkeeping is exercised
        assert batched.stats.steps == 61 and batched.stats.tau == pytest.approx(156 / 61)


def test_batched_verify_sampled_and_untrained_draft(stories):
    target, draft = stories
    same_result(decode(target, draft, False), decode(target, draft, True))
    t1 = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, max_new_tokens=24, seed=5)
    same_result(decode(target, draft, False, t1), decode(target, draft, True, t1))


def test_batched_verify_refusals(stories, monkeypatch):
    target, draft = stories
    with pytest.raises(ValueError, match="batch_verify needs a draft"):
        ReferenceDecoder(target, None, [2], batch_verify=True)
    with pytest.raises(ValueError, match="verify='tree'"):
        ReferenceDecoder(target, draft, [2], verify="tree", batch_verify=True)
    assert ReferenceDecoder.can_batch_verify(target)
    n = target.num_layers
    monkeypatch.setattr(target.model.config, "layer_types", ["sliding_attention"] * n, raising=False)
    assert not ReferenceDecoder.can_batch_verify(target)  # a 4D mask would drop the window
    with pytest.raises(ValueError, match="sliding_attention"):
        ReferenceDecoder(target, draft, [2], batch_verify=True)


def test_evaluate_timing_keys_and_same_metrics(stories, stories_dir, tmp_path):
    target, draft = stories
    g = torch.Generator().manual_seed(0)
    with open(tmp_path / "eval.jsonl", "w") as f:
        for i in range(5):
            n = 20 + 7 * i
            ids = [1, *torch.randint(3, 512, (n - 1,), generator=g).tolist()]
            f.write(json.dumps({"id": f"r{i}", "input_ids": ids, "loss_mask": [0] * 6 + [1] * (n - 6)}) + "\n")
    cfg = run_config.load(None, [f"target={stories_dir}", f"eval={tmp_path / 'eval.jsonl'}", f"train={tmp_path / 'eval.jsonl'}",
                                 "block_size=8",
                                 "mask_token_id=0", "micro_batch_size=2", "anchors_per_seq=8", "eval_prompts=3",
                                 "eval_prompt_min_tokens=6", "eval_max_new_tokens=12"])
    dcfg = draft.config
    target.set_layer_ids(dcfg.target_layer_ids, dcfg.last_layer_features)
    settings = StepSettings(dcfg.block_size, "dense", cfg.loss_chunk_size, cfg.grad_clip)
    batch_kw = dict(max_length=cfg.max_length, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                    gamma=cfg.gamma, anchors_per_seq=cfg.anchors_per_seq)
    eos = sorted(TargetSpec.from_adapter(target).eos_ids)
    acc, rows = Accelerator(cpu=True), open_rows(cfg.eval)
    old, new = (evaluate(acc, draft, target, rows, cfg, batch_kw, settings, dcfg, eos, False, batch_verify=bv)
                for bv in (False, True))
    timing = ("eval/seconds", "eval/loss_seconds", "eval/tau_real_seconds")
    for out in (old, new):
        assert all(out[k] > 0 for k in timing)
        assert out["eval/seconds"] == pytest.approx(out["eval/loss_seconds"] + out["eval/tau_real_seconds"])
    assert {k: v for k, v in old.items() if k not in timing} == {k: v for k, v in new.items() if k not in timing}
    assert new["eval/real_steps"] >= 12 and 1.0 <= new["eval/tau_real"] <= 8.0
    # the flex path fills the last micro-batch (1 of 5 rows) with empty rows: nothing changes but rounding
    padded = evaluate(acc, draft, target, rows, cfg, batch_kw, settings, dcfg, eos, False, pad_batches=True)
    for k, v in new.items():
        if k not in timing:
            assert padded[k] == pytest.approx(v, rel=1e-5), k
    assert padded["eval/loss"] > 0 and new["eval/acc_at_pos"] == padded["eval/acc_at_pos"]
    assert draft.training  # evaluate leaves the draft in training mode (the trainer continues with it)
