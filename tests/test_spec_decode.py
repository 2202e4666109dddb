"""Reference speculative decoding: lossless greedy output, exact sampling, τ bookkeeping."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspine import sampling as rng
from dspine.ops.accept import accept_sample
from dspine.reference import ReferenceDecoder
from dspine.sampling import SamplingParams, draft_distribution, logits_to_probs, sample
from dspine.target import TargetSpec, load_target
from tests.helpers import oracle_reference_decoder as oracle
from tests.helpers import random_draft


def hf_greedy(target, prompt, n, eos):
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt):].tolist()


def test_stories260k_greedy_200_from_bos(stories_dir):
    from tests.conftest import shared_path

    ref = json.loads(shared_path("models", "stories260K", "greedy_200.json").read_text())
    target = load_target(str(stories_dir), dtype="fp32")
    draft = random_draft(target, block_size=16, mask=0)
    res = ReferenceDecoder(target, draft, eos_token_ids=[2]).generate([[1]], SamplingParams(max_new_tokens=200))
    assert res.token_ids[0] == ref["greedy_token_ids"]
    # and with a draft that is mostly right: long accepted prefixes, same output
    dec = oracle(ReferenceDecoder(target, draft, [2]), [[1] + ref["greedy_token_ids"]], corrupt=0.1)
    res = dec.generate([[1]], SamplingParams(max_new_tokens=200))
    assert res.token_ids[0] == ref["greedy_token_ids"]
    assert res.stats.tau > 4
    assert res.stats.tokens == 199  # the first token comes from prefill, not a verify step


def test_tiny_qwen3_batch_lossless(tiny_qwen3_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    texts = ["Hi", "What is 2 + 2? Answer briefly.", "Write a haiku about the sea and the moon, please.",
             "List three primes."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=True, enable_thinking=False) for t in texts]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    assert len({len(p) for p in prompts}) == 4
    target = load_target(str(tiny_qwen3_dir), dtype="fp32")
    eos = 151645
    n = 24  # several verify steps per row (the 151,936-token head makes each step costly)
    want = [hf_greedy(target, p, n, eos) for p in prompts]
    draft = random_draft(target, block_size=16, mask=151669)
    res = ReferenceDecoder(target, draft, [eos]).generate(prompts, SamplingParams(max_new_tokens=n))
    assert res.token_ids == want
    # mostly-right draft, ragged acceptance across the 4 rows
    dec = oracle(ReferenceDecoder(target, draft, [eos]), [p + w for p, w in zip(prompts, want)], corrupt=0.25)
    res = dec.generate(prompts, SamplingParams(max_new_tokens=n))
    assert res.token_ids == want
    assert res.stats.tau > 2 and len(set(res.steps_per_prompt)) > 1
    ar = ReferenceDecoder(target, None, [eos]).generate(prompts, SamplingParams(max_new_tokens=n))
    assert ar.token_ids == want and ar.stats.tau == 1.0
    # a narrower verify (4 of the 16 slots): same output, at most 4 tokens per step, the trained draft's
    # block still runs whole
    dec = oracle(ReferenceDecoder(target, draft, [eos], verify_size=4), [p + w for p, w in zip(prompts, want)],
                 corrupt=0.0)
    res = dec.generate(prompts, SamplingParams(max_new_tokens=n))
    assert res.token_ids == want
    assert 3.5 < res.stats.tau <= 4.0  # an exact oracle fills every 4-wide step (the last one may be short)
    res = ReferenceDecoder(target, draft, [eos], verify_size=3).generate(prompts, SamplingParams(max_new_tokens=n))
    assert res.token_ids == want
    with pytest.raises(ValueError, match="verify_size=17 must be in 2..16"):
        ReferenceDecoder(target, draft, [eos], verify_size=17)


def test_tau_identity_and_eos_inside_accepted_prefix(stories_dir):
    from tests.conftest import shared_path

    ref = json.loads(shared_path("models", "stories260K", "greedy_200.json").read_text())["greedy_token_ids"]
    target = load_target(str(stories_dir), dtype="fp32")
    draft = random_draft(target, block_size=16, mask=0)
    eos = ref[37]  # a token that first appears mid-sequence: the stop falls inside an accepted prefix
    first = ref.index(eos)
    dec = oracle(ReferenceDecoder(target, draft, [eos]), [[1] + ref], corrupt=0.0)
    res = dec.generate([[1]], SamplingParams(max_new_tokens=200))
    assert res.token_ids[0] == ref[: first + 1] and res.finish_reasons == ["stop"]
    s = res.stats
    assert s.tokens == len(res.token_ids[0]) - 1  # only committed tokens count
    assert abs(s.tau - (1 + sum(s.accept_at_pos))) < 1e-12
    assert s.hist[16] >= 1 and s.steps == (first + 15) // 16  # full blocks, then the EOS-cut step
    # max_new_tokens cut inside a block counts the same way
    res = oracle(ReferenceDecoder(target, draft, [2]), [[1] + ref], 0.0).generate([[1]], SamplingParams(max_new_tokens=21))
    assert len(res.token_ids[0]) == 21 and res.stats.hist[16] == 1 and res.stats.hist[4] == 1  # 1 (prefill) + 16 + 4


def pvalue(tokens, probs):
    counts = np.bincount(tokens.numpy(), minlength=probs.shape[-1]).astype(float)
    probs = probs.double().numpy()
    expected = probs / probs.sum() * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0  # never a token outside top-k / top-p
    return chisquare(counts[keep], expected[keep]).pvalue


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.7, 0.9, 0), (1.0, 1.0, 6), (1.0, 0.8, 5)])
def test_chain_rejection_sampling_is_exact(temperature, top_p, top_k):
    """10^5 steps on a toy vocabulary through the one acceptance rule (dspine.ops.accept's torch
    reference) with the decoders' noise (one dspine.sampling stream per row): the emitted tokens
    follow the target distribution."""
    g = torch.Generator().manual_seed(0)
    V, K, N = 12, 3, 100_000
    t_logits = torch.randn(K + 1, V, generator=g) * 1.5
    d_logits = 0.5 * t_logits + torch.randn(K + 1, V, generator=g)  # flatter, overlapping draft
    p_t = logits_to_probs(t_logits, temperature, top_p, top_k).expand(N, K + 1, V)
    p_d = logits_to_probs(d_logits[:K], temperature, top_p, top_k).expand(N, K, V)
    seeds, n = torch.arange(N) * 7 + 3, torch.full((N,), 5)
    slot_pos = n[:, None] + torch.arange(K)
    draft = sample(p_d, seeds, rng.STREAM_DRAFT, slot_pos)
    u = rng.uniforms(seeds, rng.STREAM_ACCEPT, slot_pos)
    noise = rng.exponentials(seeds, rng.STREAM_TARGET, n[:, None], V)[:, 0]

    def emitted(acc, bonus, draft):
        acc = acc.long()
        first = torch.where(acc >= 1, draft[:, 0], bonus)  # first emitted token of the step
        second_rows = acc >= 1  # given the first was accepted, the second follows p_t[1]
        second = torch.where(acc >= 2, draft[:, 1], bonus)[second_rows]
        return first, second

    acc, bonus = accept_sample(draft, p_t, p_d, u, noise, impl="torch")
    first, second = emitted(acc, bonus, draft)
    assert pvalue(first, p_t[0, 0]) > 0.01
    assert pvalue(second, p_t[0, 1]) > 0.01
    # the classic bug (docs/method.md §8.7): the draft takes its argmax but verification assumes a sample
    greedy_draft = p_d.argmax(-1)
    acc, bonus = accept_sample(greedy_draft, p_t, p_d, u, noise, impl="torch")
    first, _ = emitted(acc, bonus, greedy_draft)
    assert pvalue(first, p_t[0, 0]) < 1e-6


@pytest.mark.parametrize("draft_temperature", [0.5, 0.0])
def test_chain_rejection_at_a_draft_temperature_is_exact(draft_temperature):
    """The draft sampled at its own temperature (0: its argmax, q one-hot) through draft_distribution:
    the emitted tokens still follow the target's distribution at the target's temperature, and with
    the argmax draft the first slot is accepted with the target's probability of that token."""
    g = torch.Generator().manual_seed(3)
    V, K, N = 12, 3, 100_000
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=8, draft_temperature=draft_temperature).validate()
    t_logits = torch.randn(K + 1, V, generator=g) * 1.5
    d_logits = 0.5 * t_logits + torch.randn(K + 1, V, generator=g)
    p_t = logits_to_probs(t_logits, 1.0, 0.9, 8).expand(N, K + 1, V)
    p_d, d_ids = draft_distribution(d_logits[:K].expand(N, K, V), params)
    seeds, n = torch.arange(N) * 5 + 1, torch.full((N,), 3)
    slot_pos = n[:, None] + torch.arange(K)
    draft = sample(p_d, seeds, rng.STREAM_DRAFT, slot_pos, d_ids)
    u = rng.uniforms(seeds, rng.STREAM_ACCEPT, slot_pos)
    noise = rng.exponentials(seeds, rng.STREAM_TARGET, n[:, None], V)[:, 0]
    acc, bonus = accept_sample(draft, p_t, p_d, u, noise, impl="torch")
    first = torch.where(acc >= 1, draft[:, 0], bonus)
    assert pvalue(first, p_t[0, 0]) > 0.01
    if draft_temperature == 0:
        top = d_logits[0].argmax()
        assert (draft[:, 0] == top).all() and p_d[0, 0, top] == 1 and p_d[0, 0].sum() == 1
        assert abs((acc >= 1).float().mean().item() - p_t[0, 0, top].item()) < 0.005
    else:  # sharper than the draft at T = 1: a different q, the same target distribution out
        q1 = logits_to_probs(d_logits[0], 1.0, 0.9, 8)
        assert p_d[0, 0].max() > q1.max() + 0.05


def test_draft_temperature_runs_are_seeded_and_consistent(stories_dir):
    """Reference decoder on stories260K with a random draft: at every draft temperature a run is repeatable
    for its seed, None means the target's temperature, lengths and stats are consistent; tree verification
    refuses the argmax draft (its tree would be padding)."""
    target = load_target(str(stories_dir), dtype="fp32")
    draft = random_draft(target, block_size=8, mask=0)
    dec = ReferenceDecoder(target, draft, [2])
    base = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, max_new_tokens=30, seed=7)
    runs = {t: dec.generate([[1, 403]], dataclasses.replace(base, draft_temperature=t)) for t in (None, 1.0, 0.3, 0.0)}
    assert runs[None].token_ids == runs[1.0].token_ids  # None is the target's temperature
    assert runs[0.0].token_ids == dec.generate([[1, 403]], dataclasses.replace(base, draft_temperature=0.0)).token_ids
    for r in runs.values():
        assert len(r.token_ids[0]) == 30 and abs(r.stats.tau - (1 + sum(r.stats.accept_at_pos))) < 1e-12
    tree = ReferenceDecoder(target, draft, [2], verify="tree", tree_budget=8)
    with pytest.raises(ValueError, match="draft_temperature=0 with tree verification"):
        tree.generate([[1, 403]], dataclasses.replace(base, draft_temperature=0.0))
    assert len(tree.generate([[1, 403]], dataclasses.replace(base, draft_temperature=0.5)).token_ids[0]) == 30


def test_hash_sampler_samples_the_distribution():
    """The counter-based race draws v with probability p_v: across 10^5 requests at one position,
    and along 10^5 positions of one request (its stream), for each of the three streams."""
    g = torch.Generator().manual_seed(1)
    V, N = 17, 100_000
    probs = logits_to_probs(torch.randn(V, generator=g) * 2, 1.0, 0.95, 12)
    for stream in (rng.STREAM_TARGET, rng.STREAM_DRAFT, rng.STREAM_ACCEPT):
        across = sample(probs.expand(N, V), torch.arange(N), stream, torch.zeros(N, dtype=torch.long))
        along = sample(probs.expand(1, N, V), torch.tensor([12345]), stream, torch.arange(N)[None])[0]
        assert pvalue(across, probs) > 0.01 and pvalue(along, probs) > 0.01, stream
    u = rng.uniforms(torch.tensor([7]), rng.STREAM_ACCEPT, torch.arange(N)[None])[0]
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.005
    # a pure function: same arguments, same noise; another seed, stream or position, other noise
    a = rng.uniforms(torch.tensor([1, 2]), rng.STREAM_DRAFT, torch.tensor([[0, 1], [0, 1]]), V)
    assert torch.equal(a, rng.uniforms(torch.tensor([1, 2]), rng.STREAM_DRAFT, torch.tensor([[0, 1], [0, 1]]), V))
    assert not torch.equal(a[0, 0], a[1, 0]) and not torch.equal(a[0, 0], a[0, 1])
    assert not torch.equal(a, rng.uniforms(torch.tensor([1, 2]), rng.STREAM_TARGET, torch.tensor([[0, 1], [0, 1]]), V))


def test_sampled_spec_decode_runs_and_is_seeded(stories_dir):
    target = load_target(str(stories_dir), dtype="fp32")
    draft = random_draft(target, block_size=8, mask=0)
    dec = ReferenceDecoder(target, draft, [2])
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, max_new_tokens=30, seed=7)
    a = dec.generate([[1], [1, 403]], p)
    b = dec.generate([[1], [1, 403]], p)
    assert a.token_ids == b.token_ids and all(len(t) == 30 for t in a.token_ids)
    assert abs(a.stats.tau - (1 + sum(a.stats.accept_at_pos))) < 1e-12


def test_sampling_params_and_spec_errors():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0).validate()
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1).validate()
    with pytest.raises(ValueError, match="temperature > 0"):
        logits_to_probs(torch.zeros(3), 0.0)
    with pytest.raises(ValueError, match="draft_temperature=-0.5 must be"):
        SamplingParams(temperature=1.0, draft_temperature=-0.5).validate()
    with pytest.raises(ValueError, match="draft_temperature=nan must be"):
        SamplingParams(temperature=1.0, draft_temperature=float("nan")).validate()
    with pytest.raises(ValueError, match="draft_temperature=0.5 is for sampling"):
        SamplingParams(temperature=0.0, draft_temperature=0.5).validate()
    SamplingParams(temperature=0.0, draft_temperature=0.0).validate()  # greedy drafts the argmax anyway
    for bad in (1e-39, 1e-7):  # logits / T overflows fp32 (tau 1, or NaN probabilities): refused, 0 is greedy
        with pytest.raises(ValueError, match=f"temperature={bad} must be 0 \\(greedy\\) or >= 1e-06"):
            SamplingParams(temperature=bad).validate()
        with pytest.raises(ValueError, match=f"draft_temperature={bad} must be 0 \\(the draft's argmax\\) or >= 1e-06"):
            SamplingParams(temperature=1.0, draft_temperature=bad).validate()
    SamplingParams(temperature=1e-6, draft_temperature=1e-6).validate()


def test_target_spec_reads_special_ids(stories_dir, tiny_qwen3_dir):
    spec = TargetSpec.from_pretrained(str(tiny_qwen3_dir))
    assert spec.vocab_size == 151936 and spec.tokenizer_len == 151669 and 151645 in spec.eos_ids
    assert 151643 in spec.pad_ids
