"""The decode core shared by the reference decoder and the engine (torch path on the CPU).

* non-finite target or draft logits raise FloatingPointError on every backend, and the CLI turns it
  into one ``error:`` line (issue 10, defect 4);
* per-prompt stats are per prompt and add up to the batch totals, in the results and in
  ``infer.generate --json`` (defect 6);
* at T > 0 a prompt's sample depends only on its own seed: the same prompt and seed give the same
  tokens alone, batched at another position, at any concurrency (defect 9).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dspine.checkpoint import save_draft
from dspine.reference import ReferenceDecoder
from dspine.sampling import SamplingParams, request_seed
from dspine.target import load_target
from infer import generate
from infer.engine import load_engine
from tests.helpers import random_draft

PROMPTS = [[1, 403, 407], [1], [1, 403, 407, 261, 378, 432, 383], [1, 300, 301]]
T1 = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, max_new_tokens=24, seed=5)


@pytest.fixture(scope="module")
def stories(stories_dir, tmp_path_factory):
    target = load_target(str(stories_dir), dtype="fp32")
    draft = random_draft(target, block_size=4, mask=0)
    return target, draft, save_draft(draft, tmp_path_factory.mktemp("draft"))


def engine(stories_dir, folder):
    eng, _ = load_engine(str(stories_dir), None, str(folder) if folder else None, device="cpu", dtype=torch.float32,
                         impl="torch", max_seq=200, eos_token_ids=[2])
    return eng


def decoders(stories_dir, stories):
    target, draft, folder = stories
    return {"reference": ReferenceDecoder(target, draft, [2]), "engine": engine(stories_dir, folder)}


# ---- defect 4: NaN weights are an error on every backend -------------------------------------------


def test_nonfinite_target_and_draft_logits_raise(stories_dir, stories, tmp_path, capsys):
    target, draft, folder = stories
    for params in (SamplingParams(max_new_tokens=16), T1):
        # a NaN draft: its tokens would only be rejected (tau 1.00), now an error
        bad_draft = random_draft(target, block_size=4, mask=0)
        with torch.no_grad():
            bad_draft.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
        bad_folder = save_draft(bad_draft, tmp_path / "nan-draft")
        with pytest.raises(FloatingPointError, match="non-finite draft logits"):
            ReferenceDecoder(target, bad_draft, [2]).generate([[1, 5, 6]], params)
        with pytest.raises(FloatingPointError, match="non-finite draft logits"):
            engine(stories_dir, bad_folder).generate([[1, 5, 6]], params)
        # a NaN target norm weight: 16 x token 0 and tau 1.00 before, now an error
        eng = engine(stories_dir, folder)
        eng.target.norm.data[0] = float("nan")
        with pytest.raises(FloatingPointError, match="non-finite target logits"):
            eng.generate([[1, 5, 6]], params)
        with pytest.raises(FloatingPointError, match="non-finite target logits"):
            eng.generate([[1, 5, 6]], params, use_draft=False)
        nan_target = load_target(str(stories_dir), dtype="fp32")
        with torch.no_grad():
            nan_target.model.model.norm.weight[0] = float("nan")
        for d in (draft, None):
            with pytest.raises(FloatingPointError, match="non-finite target logits"):
                ReferenceDecoder(nan_target, d, [2]).generate([[1, 5, 6]], params)
    # the CLI: one error line, exit status 2
    rc = generate.main(["--target", str(stories_dir), "--draft", str(bad_folder), "--prompt", "Once upon",
                        "--backend", "reference", "--no-chat-template", "--max-new-tokens", "8"])
    err = capsys.readouterr().err  # (transformers may print loading progress bars before)
    assert rc == 2 and "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: non-finite draft")
    assert sum(line.startswith("error:") for line in err.splitlines()) == 1


# ---- defect 6: per-prompt stats --------------------------------------------------------------------


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=20), T1], ids=["T0", "T1"])
def test_per_prompt_stats_are_per_prompt_and_add_up(stories_dir, stories, params):
    for name, dec in decoders(stories_dir, stories).items():
        kw = {"concurrency": 2} if name == "engine" else {}
        res = dec.generate(PROMPTS, params, **kw)
        total = res.stats
        for toks, st in zip(res.token_ids, res.prompt_stats):
            assert st.tokens == len(toks) - 1, name  # the prefill token is no verify step's
            assert st.steps >= 1 and abs(st.tau - st.tokens / st.steps) < 1e-12, name
            assert abs(st.tau - 1 - sum(st.accept_at_pos)) < 1e-12, name
        assert sum(st.tokens for st in res.prompt_stats) == total.tokens == res.num_tokens - len(PROMPTS), name
        assert sum(st.steps for st in res.prompt_stats) == total.steps, name
        assert [sum(h) for h in zip(*(st.hist for st in res.prompt_stats))] == total.hist, name
        assert res.steps_per_prompt == [st.steps for st in res.prompt_stats], name


def test_generate_json_with_several_prompts(stories_dir, stories, capsys):
    rc = generate.main(["--target", str(stories_dir), "--draft", str(stories[2]), "--dataset", "gsm8k",
                        "--num-prompts", "2", "--max-new-tokens", "16", "--backend", "reference", "--json",
                        "--no-chat-template"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = out["batch"]
    assert len(rows) == out["num_prompts"] == 2 and "token_ids" not in out  # top level = totals only
    assert out["num_tokens"] == sum(r["num_tokens"] for r in rows) == sum(len(r["token_ids"]) for r in rows)
    for key in ("verify_steps", "committed_tokens"):
        assert out[key] == sum(r[key] for r in rows)
    assert out["accept_hist"] == [sum(h) for h in zip(*(r["accept_hist"] for r in rows))]
    for r in rows:
        assert r["committed_tokens"] == r["num_tokens"] - 1 and r["verify_steps"] == sum(r["accept_hist"])
        assert abs(r["accept_len"] - r["committed_tokens"] / r["verify_steps"]) < 1e-12
    assert abs(out["accept_len"] - out["committed_tokens"] / out["verify_steps"]) < 1e-12


# ---- defect 9: one random stream per request ----------------------------------------------------------


def test_same_prompt_and_seed_give_the_same_sample_at_any_concurrency(stories_dir, stories):
    p, others = PROMPTS[0], PROMPTS[1:]
    s = request_seed(T1.seed, 0)
    outputs = {}
    for name, dec in decoders(stories_dir, stories).items():
        alone = dec.generate([p], T1, seeds=[s]).token_ids[0]
        assert alone == dec.generate([p], T1).token_ids[0]  # prompt 0's default seed is request_seed(seed, 0)
        batched = dec.generate([others[0], p, *others[1:]], T1, seeds=[11, s, 12, 13]).token_ids[1]
        last = dec.generate([*others, p], T1, seeds=[21, 22, 23, s]).token_ids[3]
        assert alone == batched == last, name
        if name == "engine":  # the same call at concurrency 1, 2 (slots refilled) and 4
            calls = [dec.generate(PROMPTS, T1, concurrency=c).token_ids for c in (1, 2, 4)]
            assert calls[0] == calls[1] == calls[2]
            ar = [dec.generate([others[0], p], T1, concurrency=c, use_draft=False, seeds=[9, s]).token_ids[1]
                  for c in (1, 2)]
            assert ar[0] == ar[1] == dec.generate([p], T1, use_draft=False, seeds=[s]).token_ids[0]
        outputs[name] = alone
    # the same sampler and streams: engine and reference agree token for token (fp32 logits)
    assert outputs["engine"] == outputs["reference"]
    # a draft temperature (and the argmax draft) reaches both decoders the same way
    for t in (0.4, 0.0):
        dt = dataclasses.replace(T1, draft_temperature=t)
        got = {name: dec.generate(PROMPTS, dt, seeds=[s, 3, 4, 5]) for name, dec in decoders(stories_dir, stories).items()}
        assert got["engine"].token_ids == got["reference"].token_ids, t
        assert got["engine"].stats.hist == got["reference"].stats.hist, t
    # and the seed matters
    assert ReferenceDecoder(stories[0], stories[1], [2]).generate([p], T1, seeds=[s + 1]).token_ids[0] != outputs["reference"]


def test_tau_is_undefined_without_verify_steps(stories_dir):
    from dspine.stats import AcceptStats

    assert AcceptStats(4).to_dict()["tau"] is None
    target = load_target(str(stories_dir), dtype="fp32")
    res = ReferenceDecoder(target, random_draft(target, mask=0), [2]).generate([[1, 5]], SamplingParams(max_new_tokens=1))
    assert len(res.token_ids[0]) == 1 and res.stats.steps == 0 and res.stats.to_dict()["tau"] is None
