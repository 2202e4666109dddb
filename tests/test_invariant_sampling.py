"""Drafter-invariant verification (``SamplingParams.invariant``): at T > 0 the speculative decode's text is the plain
decode's for the same seed, token for token, whatever the draft, the concurrency or the planner (fp32, stories260K;
the drafts are oracles proposing the plain decode's text with 30% of the tokens replaced, so most blocks pass in part
and some tokens are rejected)."""

from __future__ import annotations

import pytest
import torch

from dspine.reference import ReferenceDecoder
from dspine.sampling import SamplingParams
from infer.engine import load_engine
from tests.helpers import oracle_engine, oracle_reference_decoder

PROMPTS = [[1], [1, 403, 407], [1, 403, 407, 261, 378, 432, 383], [1, 300], [1, 301, 302, 303, 304]]
NEW = 20


def params(invariant: bool, seed: int = 3) -> SamplingParams:
    """T = 1 with top-k/top-p (the candidate path of dspine.sampling) for odd seeds, plain (every token) for even."""
    cut = dict(top_p=0.9, top_k=40) if seed % 2 else {}
    return SamplingParams(temperature=1.0, max_new_tokens=NEW, seed=seed, invariant=invariant, **cut)


def _engine(stories_dir, folder, impl="torch", device="cpu", **kw):
    eng, _ = load_engine(str(stories_dir), None, str(folder), device=device, dtype=torch.float32, impl=impl,
                         max_seq=500, eos_token_ids=[2], **kw)
    return eng


def test_engine_chain_decodes_the_plain_text(stories_dir, stories):
    eng = _engine(stories_dir, stories[2])
    for seed in (3, 8):
        want = eng.generate(PROMPTS, params(True, seed), use_draft=False).token_ids  # plain (AR) sampling
        assert want != eng.generate(PROMPTS, params(True, seed + 2), use_draft=False).token_ids  # it does sample
        ref = [p + w for p, w in zip(PROMPTS, want)]
        spec = oracle_engine(_engine(stories_dir, stories[2]), ref, corrupt=0.3, seed=seed)
        for concurrency in (1, 3):
            res = spec.generate(PROMPTS, params(True, seed), concurrency=concurrency)
            assert res.token_ids == want, (seed, concurrency)
            assert 1.5 < res.stats.tau and 0 < res.stats.accept_at_pos[0] < 1  # passes and rejections both
        # rejection sampling (the default) draws other text with the same seed and draft
        assert spec.generate(PROMPTS, params(False, seed), concurrency=3).token_ids != want


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_engine_chain_decodes_the_plain_text_on_the_gpu(stories_dir, stories, graphs):
    """The same with the Triton kernels on CUDA (through the interpreter they took 10 minutes on the CPU): inside
    the step's CUDA graph with the untrained draft (few tokens pass; every bonus must still be the plain draw),
    and eagerly with the oracle draft."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    eng = _engine(stories_dir, stories[2], impl="triton", device="cuda", cuda_graphs=graphs)
    want = eng.generate(PROMPTS, params(True), use_draft=False).token_ids
    if not graphs:  # the oracle reads the slots' lengths on the host: eager only
        eng = oracle_engine(eng, [p + w for p, w in zip(PROMPTS, want)], corrupt=0.3)
    res = eng.generate(PROMPTS, params(True), concurrency=3)
    assert res.token_ids == want and (graphs or res.stats.tau > 1.5)


def test_engine_planner_decodes_the_plain_text_without_trees(stories_dir, stories):
    eng = _engine(stories_dir, stories[2], budget="auto")
    assert [m for m in eng.planner_modes(params(True)) if m[0] == "tree"] == []
    assert any(m[0] == "tree" for m in eng.planner_modes(params(False)))  # the default keeps its trees
    assert eng.planner_modes(SamplingParams(invariant=True)) == eng.planner_modes(SamplingParams())  # T = 0: no effect
    want = eng.generate(PROMPTS, params(True), use_draft=False).token_ids
    spec = oracle_engine(eng, [p + w for p, w in zip(PROMPTS, want)], corrupt=0.3)
    assert spec.generate(PROMPTS, params(True), concurrency=3).token_ids == want


def test_reference_decoder_decodes_the_plain_text(stories):
    target, draft, _ = stories
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params(True)).token_ids
    dec = oracle_reference_decoder(ReferenceDecoder(target, draft, [2]), [p + w for p, w in zip(PROMPTS, want)],
                                   corrupt=0.3)
    res = dec.generate(PROMPTS, params(True))
    assert res.token_ids == want and 1.5 < res.stats.tau
    assert dec.generate(PROMPTS, params(False)).token_ids != want


def test_invariant_is_chain_only_and_a_step_setting(stories_dir, stories):
    target, draft, folder = stories
    with pytest.raises(ValueError, match="invariant sampling verifies the chain only"):
        _engine(stories_dir, folder, verify="tree").generate(PROMPTS[:1], params(True))
    with pytest.raises(ValueError, match="invariant sampling verifies the chain only"):
        ReferenceDecoder(target, draft, [2], verify="tree").generate(PROMPTS[:1], params(True))
    forced = _engine(stories_dir, folder)
    forced.force_accept = 3  # the engine benchmark's oracle: it would ignore the target's draws
    with pytest.raises(ValueError, match="force_accept with invariant sampling"):
        forced.generate(PROMPTS[:1], params(True))
    # greedy decoding is invariant already: the flag changes nothing there (and no compiled step differs)
    greedy = SamplingParams(max_new_tokens=8)
    assert SamplingParams(max_new_tokens=8, invariant=True).step_key == greedy.step_key
    assert params(True).step_key != params(False).step_key  # separate CUDA graphs and step-cost tables
    tree = _engine(stories_dir, folder, verify="tree")
    assert tree.generate(PROMPTS[:2], SamplingParams(max_new_tokens=8, invariant=True)).token_ids == \
        tree.generate(PROMPTS[:2], greedy).token_ids


def test_generate_cli_invariant_equals_the_plain_decode(stories_dir, tmp_path, capsys):
    """infer.generate --invariant --compare-ar at T > 0 (reference backend, an untrained draft): ar_equal is
    checked and holds; without --invariant it is not checked (null: rejection sampling draws other text)."""
    import json

    from dspine import init as init_cli
    from infer import generate

    draft = tmp_path / "draft"
    assert init_cli.main(["--target", str(stories_dir), "--out", str(draft), "--layers", "1", "--block-size", "8",
                          "--mask-token-id", "3", "--dtype", "fp32"]) == 0
    base = ["--target", str(stories_dir), "--draft", str(draft), "--prompt", "Once upon", "--max-new-tokens", "16",
            "--backend", "reference", "--json", "--compare-ar", "--temperature", "1", "--top-k", "40", "--seed", "5"]
    capsys.readouterr()
    assert generate.main([*base, "--invariant"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["ar_equal"] is True and res["sampling"]["invariant"] is True and res["num_tokens"] == 16
    assert generate.main(base) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ar_equal"] is None
    assert generate.main([*base[:-6], "--invariant"]) == 0  # T = 0: greedy, invariant already; a warning says so
    assert "--invariant applies at --temperature > 0 only" in capsys.readouterr().err


def _target_as_draft(target, reference: list[list[int]]):
    """``lookup(b, start, K, V) -> [K, V]`` logits: the target's own next-token logits along ``reference[b]`` (prompt
    plus the plain decode), slot k (1..K) of a block anchored at ``start`` getting those that predict
    ``reference[b][start + k]`` (as :func:`tests.helpers.oracle_logits` places its tokens), zeros past the end."""
    with torch.no_grad():
        full = [target(torch.tensor([seq])).logits[0].float() for seq in reference]

    def lookup(b, start, K, V):
        out = torch.zeros(K, V)
        rows = full[b][start : start + K]  # row start + k - 1 predicts reference[b][start + k]
        out[: len(rows)] = rows
        return out

    return lookup


def test_a_draft_with_the_targets_distribution_passes_every_token(stories_dir, stories):
    """A draft whose distribution is the target's, racing with the target's noise at the same positions, drafts the
    target's own draws: every drafted token passes (a draft that raced with another stream or position would pass
    about Σ p² of them). Reference decoder and engine."""
    target, _, folder = stories
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params(True)).token_ids
    ref = [p + w for p, w in zip(PROMPTS, want)]
    lookup = _target_as_draft(target, ref)
    V = target.vocab_size

    dec = ReferenceDecoder(target, stories[1], [2])
    dec.draft_logits = lambda block, dcache: torch.stack(
        [lookup(b, int(dcache.lengths[b]), block.shape[1] - 1, V) for b in range(block.shape[0])])[:, : dec.verify_size - 1]
    res = dec.generate(PROMPTS, params(True))
    assert res.token_ids == want and res.stats.accept_at_pos[0] > 0.95 and res.stats.tau > 4, res.stats

    eng = _engine(stories_dir, folder)

    def engine_draft(block, cache, width=None):  # width: a planner chain narrower than verify_size
        owner = eng.slot_owner or [None] * block.shape[0]
        rows = [lookup(owner[b], int(cache.lengths[b]), block.shape[1] - 1, V) if owner[b] is not None
                else torch.zeros(block.shape[1] - 1, V) for b in range(block.shape[0])]
        return torch.stack(rows)[:, : (width or eng.verify_size) - 1]

    eng.draft_logits = engine_draft
    res = eng.generate(PROMPTS, params(True), concurrency=3)
    assert res.token_ids == want and res.stats.accept_at_pos[0] > 0.95 and res.stats.tau > 4, res.stats
