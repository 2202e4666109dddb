"""A draft vocabulary (dspine.draft_vocab) in the engine and the reference decoder: the draft's logits over the
subset only, lossless output, the same steps in both decoders."""

from __future__ import annotations

import pytest
import torch

from dspine.draft_vocab import spread_logits
from dspine.ops.accept import accept_sample
from dspine.reference import ReferenceDecoder
from dspine.sampling import SamplingParams, draft_distribution
from infer.engine import Engine, load_engine
from infer.model import EngineTarget
from tests.test_kernels_accept import chi2_p, first_token, random_probs, sample_inputs

PROMPTS = [[1], [1, 403, 407], [1, 403, 407, 261, 378, 432, 383], [1, 300], [1, 301, 302, 303, 304]]


def _vocab(n: int, V: int = 512, seed: int = 0) -> torch.Tensor:
    return torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:n]


def _engine(stories_dir, folder, max_batch=5, **kw):
    eng, _ = load_engine(str(stories_dir), None, str(folder), device="cpu", dtype=torch.float32, impl="torch",
                         max_seq=300, max_batch=max_batch, eos_token_ids=[2], **kw)
    return eng


def test_draft_logits_are_the_subsets_rows(stories_dir, stories):
    """The engine's draft logits with a vocabulary: the full head's logits at those ids (same fp32 values up to
    GEMM rounding), the lowest finite value elsewhere; so argmax and softmax never reach the other ids."""
    _, _, folder = stories
    ids = _vocab(100)
    full, sub = _engine(stories_dir, folder), _engine(stories_dir, folder, draft_vocab=ids)
    assert torch.equal(sub.draft_vocab, ids.sort().values) and sub.draft_head.shape == (100, full.target.head.shape[1])
    block = torch.tensor([[1] + [0] * 7, [403] + [0] * 7])
    cache_a, cache_b = (e.draft_cache.view(2, lengths=torch.zeros(2, dtype=torch.int32)) for e in (full, sub))
    la, lb = full.draft_logits(block, cache_a), sub.draft_logits(block, cache_b)
    assert la.shape == lb.shape == (2, 7, 512)
    keep = torch.zeros(512, dtype=torch.bool)
    keep[ids] = True
    assert (lb[..., keep] - la[..., keep]).abs().max() < 1e-5
    assert (lb[..., ~keep] == torch.finfo(torch.float32).min).all() and torch.isfinite(lb).all()
    assert keep[lb.argmax(-1)].all()
    p = torch.softmax(lb, -1)
    assert (p[..., ~keep] == 0).all() and torch.allclose(p[..., keep], torch.softmax(la[..., keep], -1), atol=1e-6)


def test_greedy_is_lossless_and_equals_the_reference_decoder(stories_dir, stories):
    """Greedy output with a draft vocabulary of 64 ids is the target's AR output; the engine and the reference
    decoder (same vocabulary) take the same steps; the whole vocabulary as a 'subset' changes nothing."""
    target, draft, folder = stories
    params = SamplingParams(max_new_tokens=20)
    ids = _vocab(64, seed=1)
    ar = ReferenceDecoder(target, None, [2]).generate(PROMPTS, params)
    eng = _engine(stories_dir, folder, draft_vocab=ids).generate(PROMPTS, params, concurrency=3)
    ref = ReferenceDecoder(target, draft, [2], verify_size=8, draft_vocab=ids).generate(PROMPTS, params)
    assert eng.token_ids == ref.token_ids == ar.token_ids
    assert [s.hist for s in eng.prompt_stats] == [s.hist for s in ref.prompt_stats]
    whole = _engine(stories_dir, folder, draft_vocab=torch.arange(512)).generate(PROMPTS, params, concurrency=3)
    plain = _engine(stories_dir, folder).generate(PROMPTS, params, concurrency=3)
    assert whole.token_ids == plain.token_ids and [s.hist for s in whole.prompt_stats] == [
        s.hist for s in plain.prompt_stats]


def test_forced_acceptance_commits_the_vocabularys_argmax(stories_dir, stories):
    """With every draft token accepted (force_accept, the benchmark's oracle) the output shows the draft's own
    greedy tokens: 3 drafted tokens and a bonus per step after the prefill's token. Each drafted token must be a
    vocabulary id (ids 256..511, so an unmapped column number 0..255 fails); the vocabulary's argmax mapped
    through the ids is the argmax of the spread logits (the path of trees and sampling)."""
    _, _, folder = stories
    ids = torch.arange(256, 512)
    eng = _engine(stories_dir, folder, draft_vocab=ids, max_batch=2)
    eng.force_accept = 3
    out = eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=17)).token_ids[0]
    assert len(out) == 17 and 2 not in out[:-1]
    drafted = [t for i, t in enumerate(out) if i % 4 != 0]
    assert len(drafted) == 12 and all(256 <= t < 512 for t in drafted), out
    block = torch.tensor([[out[0]] + [0] * 7, [out[4]] + [0] * 7])
    cache = eng.draft_cache.view(2, lengths=torch.zeros(2, dtype=torch.int32))
    full = eng.draft_logits(block, cache)  # [2, 7, V]
    sub = eng.draft_logits(block, cache, spread=False)  # [2, 7, N]
    assert sub.shape == (2, 7, 256) and torch.equal(ids[sub.argmax(-1)], full.argmax(-1))


def test_whole_vocabulary_and_foreign_files(stories_dir, stories, tmp_path, capsys):
    """All V ids select nothing (no head copy); a file counted for another vocabulary size is refused by name,
    with the flag, before any weights load."""
    from dspine.draft_vocab import save_draft_vocab
    from infer import generate

    _, _, folder = stories
    eng = _engine(stories_dir, folder, draft_vocab=torch.arange(512))
    assert eng.draft_vocab is None and eng.draft_head is None
    other = tmp_path / "smollm2.safetensors"
    save_draft_vocab(other, torch.arange(64, 300), {"vocab_size": 49152})
    code = generate.main(["--target", str(stories_dir), "--draft", str(folder), "--prompt", "x", "--no-chat-template",
                          "--backend", "reference", "--draft-vocab", str(other)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: --draft-vocab: {other}: counted for a vocabulary of 49152 ids")
    assert "the target has 512" in err


def test_a_vocabulary_without_the_drafts_tokens_accepts_nothing(stories_dir, stories):
    """The draft's own greedy tokens removed from its vocabulary: every draft token misses, each step commits the
    bonus token only, and the output is still the target's."""
    target, draft, folder = stories
    params = SamplingParams(max_new_tokens=12)
    ar = ReferenceDecoder(target, None, [2]).generate(PROMPTS[:2], params)
    ref = ReferenceDecoder(target, draft, [2], verify_size=8).generate(PROMPTS[:2], params)
    # the target's own tokens (what the draft must propose to be accepted) are left out
    used = {t for row in ar.token_ids for t in row} | {t for p in PROMPTS[:2] for t in p}
    ids = torch.tensor([t for t in range(512) if t not in used])
    out = _engine(stories_dir, folder, draft_vocab=ids).generate(PROMPTS[:2], params)
    assert out.token_ids == ar.token_ids == ref.token_ids
    assert out.stats.tau == 1.0


def test_tree_and_sampling_run_with_a_vocabulary(stories_dir, stories):
    """Tree verify and the planner (greedy: lossless) and T = 1 chain sampling with a vocabulary; the sampled run is
    reproducible from its seed and ends at the token limit or an EOS."""
    target, draft, folder = stories
    ids = _vocab(200, seed=2)
    greedy = SamplingParams(max_new_tokens=16)
    ar = ReferenceDecoder(target, None, [2]).generate(PROMPTS, greedy)
    tree = _engine(stories_dir, folder, draft_vocab=ids, verify="tree", tree_budget=16).generate(PROMPTS, greedy)
    assert tree.token_ids == ar.token_ids
    planner = _engine(stories_dir, folder, draft_vocab=ids, budget="auto", plan_trees=(8,)).generate(PROMPTS, greedy)
    assert planner.token_ids == ar.token_ids
    hot = SamplingParams(max_new_tokens=16, temperature=1.0)
    eng = _engine(stories_dir, folder, draft_vocab=ids)
    a, b = eng.generate(PROMPTS, hot, seeds=[5, 6, 7, 8, 9]), eng.generate(PROMPTS, hot, seeds=[5, 6, 7, 8, 9])
    assert a.token_ids == b.token_ids and all(len(t) == 16 or 2 in t for t in a.token_ids)


def test_rejection_sampling_keeps_the_target_distribution_when_q_is_zero_off_the_vocabulary():
    """χ² of the first emitted token when the draft distribution is a softmax over a subset (q = 0 on the other
    tokens, some of which the target favours): still the target's distribution."""
    g = torch.Generator().manual_seed(7)
    B, K, V = 100_000, 2, 12
    pt_rows = random_probs(g, K + 1, V)
    ids = torch.tensor([0, 2, 3, 5, 8, 11])
    logits = torch.randn(K, len(ids), generator=g)
    p_draft, _ = draft_distribution(spread_logits(logits, ids, V)[None], SamplingParams(temperature=1.0))
    pd_rows = p_draft[0]
    off = torch.ones(V, dtype=torch.bool)
    off[ids] = False
    assert (pd_rows[:, off] == 0).all() and torch.allclose(pd_rows.sum(-1), torch.ones(K))
    assert pt_rows[0, off].sum() > 0.2  # the target puts real mass where the draft cannot go
    draft, p_target, p_draft, uniform, noise = sample_inputs(g, B, K, V, pt_rows, pd_rows)
    num, bonus = accept_sample(draft, p_target, p_draft, uniform, noise, impl="torch")
    assert chi2_p(first_token(draft, num, bonus), pt_rows[0]) > 0.01


def test_bad_vocabularies_are_refused_by_name(stories_dir, stories):
    target, draft, folder = stories
    t = EngineTarget.from_pretrained(str(stories_dir), device="cpu", dtype=torch.float32, impl="torch")
    with pytest.raises(ValueError, match="token id 512 is outside the target's vocabulary 0..511"):
        Engine(t, draft, [2], max_seq=64, draft_vocab=torch.arange(449, 513))
    with pytest.raises(ValueError, match="token id 7 appears more than once"):
        Engine(t, draft, [2], max_seq=64, draft_vocab=torch.cat([torch.arange(64), torch.tensor([7])]))
    with pytest.raises(ValueError, match="10 token ids; need 64..512"):
        Engine(t, draft, [2], max_seq=64, draft_vocab=torch.arange(10))
    with pytest.raises(ValueError, match="draft_vocab needs a draft"):
        Engine(t, None, [2], max_seq=64, draft_vocab=torch.arange(64))
    with pytest.raises(ValueError, match="draft_vocab needs a draft"):
        ReferenceDecoder(target, None, [2], draft_vocab=torch.arange(64))


def test_a_vocabulary_counted_with_another_tokenizer_is_refused(stories_dir, stories, tmp_path, capsys):
    """Same vocabulary size, other tokens: infer.generate, infer.bench and load_engine refuse a file whose
    tokens_digest does not match the target's tokenizer, naming the file; the matching digest decodes."""
    from dspine.draft_vocab import save_draft_vocab, tokens_digest
    from dspine.paths import load_tokenizer
    from infer import bench, generate
    from infer.engine import load_engine
    from tests.conftest import shared_path

    _, _, folder = stories
    ids = torch.arange(64, 200)
    bad, good = tmp_path / "bad.safetensors", tmp_path / "good.safetensors"
    save_draft_vocab(bad, ids, {"vocab_size": 512, "tokenizer": "some/other-tokenizer", "tokens_digest": "0" * 32})
    save_draft_vocab(good, ids, {"vocab_size": 512,
                                 "tokens_digest": tokens_digest(load_tokenizer(str(stories_dir)), ids)})
    args = ["--target", str(stories_dir), "--draft", str(folder), "--prompt", "Once upon", "--no-chat-template",
            "--max-new-tokens", "6", "--backend", "reference"]
    assert generate.main(args + ["--draft-vocab", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"error: --draft-vocab: {bad}: its token ids name other tokens" in err, err
    assert "some/other-tokenizer" in err
    assert generate.main(args + ["--draft-vocab", str(good)]) == 0
    capsys.readouterr()
    assert bench.main(["--target", str(stories_dir), "--draft", f"sub={folder}", "--config", f"sub:draft_vocab={bad}",
                       "--datasets", "gsm8k", "--data-dir", str(shared_path("data", "eval")), "--num-prompts", "1",
                       "--max-new-tokens", "4", "--no-chat-template", "--backend", "cuda", "--device", "cpu",
                       "--dtype", "fp32", "--output-json", str(tmp_path / "b.json")]) == 2
    assert f"{bad}: its token ids name other tokens" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()
    with pytest.raises(ValueError, match="its token ids name other tokens"):
        load_engine(str(stories_dir), None, str(folder), device="cpu", dtype=torch.float32, max_seq=256, draft_vocab=bad)
    eng, _ = load_engine(str(stories_dir), None, str(folder), device="cpu", dtype=torch.float32, max_seq=256, draft_vocab=good)
    assert eng.draft_vocab.tolist() == ids.tolist()


def test_bench_and_generate_take_a_vocabulary_file(stories_dir, stories, tmp_path, capsys):
    """``infer.bench --config LABEL:draft_vocab=FILE`` (engine on the CPU) and ``infer.generate --draft-vocab FILE``
    (reference backend): lossless greedy output, the file's size and coverage in the JSON, the whole-vocabulary
    label beside it; a missing file fails before any model is read."""
    import json

    from dspine.draft_vocab import save_draft_vocab
    from infer import bench, generate
    from tests.conftest import shared_path

    _, _, folder = stories
    vocab = tmp_path / "v.safetensors"
    save_draft_vocab(vocab, _vocab(128, seed=3).sort().values, {"coverage": 0.75, "size": 128})
    out = tmp_path / "b.json"
    code = bench.main(["--target", str(stories_dir), "--draft", f"full={folder}", "--draft", f"sub={folder}",
                       "--config", f"sub:draft_vocab={vocab}", "--datasets", "gsm8k",
                       "--data-dir", str(shared_path("data", "eval")), "--num-prompts", "2", "--max-new-tokens", "10",
                       "--no-chat-template", "--backend", "cuda", "--device", "cpu", "--dtype", "fp32",
                       "--output-json", str(out)])
    assert code == 0
    res = json.loads(out.read_text())
    d = res["tasks"][0]["drafts"]
    assert d["full"]["draft_vocab"] is None
    assert d["sub"]["draft_vocab"] == {"path": str(vocab), "size": 128, "coverage": 0.75}
    assert d["sub"]["greedy_equal"] == d["sub"]["greedy_compared"] == 2
    assert res["args"]["configs"]["sub"]["draft_vocab"] == str(vocab)
    capsys.readouterr()

    args = ["--target", str(stories_dir), "--draft", str(folder), "--prompt", "Once upon", "--no-chat-template",
            "--max-new-tokens", "12", "--backend", "reference", "--json", "--compare-ar"]
    assert generate.main(args + ["--draft-vocab", str(vocab)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["draft_vocab"] == {"path": str(vocab), "size": 128, "coverage": 0.75} and got["ar_equal"] is True

    assert generate.main(args + ["--draft-vocab", str(tmp_path / "missing.safetensors")]) == 2
    assert "draft vocabulary not found: " + str(tmp_path / "missing.safetensors") in capsys.readouterr().err
    assert bench.main(["--target", str(stories_dir), "--draft", f"D={folder}", "--draft-vocab", str(tmp_path / "no"),
                       "--datasets", "gsm8k", "--backend", "cuda", "--device", "cpu"]) == 2
    assert f"--draft-vocab {tmp_path / 'no'}: no such file" in capsys.readouterr().err
    no_draft = ["--target", str(stories_dir), "--prompt", "x", "--draft", "none", "--draft-vocab", str(vocab)]
    assert generate.main(no_draft) == 2
    assert f"--draft-vocab {vocab} needs a draft" in capsys.readouterr().err


def test_vocabulary_flag_edges(stories_dir, stories, tmp_path, capsys):
    """The run-wide --draft-vocab is checked as given even where every label overrides it; an empty path, a path
    with a comma in --config, a refused file named by its --config labels; `none` in infer.generate; a file that
    records neither vocab_size nor tokens_digest is used with a note; --block-size with the planner's trees fails
    before the target loads, naming the CLI fix."""
    import json

    from dspine.draft_vocab import save_draft_vocab
    from infer import bench, generate
    from tests.conftest import shared_path

    _, _, folder = stories
    common = ["--target", str(stories_dir), "--datasets", "gsm8k", "--data-dir", str(shared_path("data", "eval")),
              "--num-prompts", "1", "--max-new-tokens", "4", "--no-chat-template", "--backend", "cuda", "--device",
              "cpu", "--dtype", "fp32"]
    assert bench.main(common + ["--draft", f"a={folder}", "--draft-vocab", str(tmp_path / "nope.safetensors"),
                                "--config", "a:draft_vocab=none"]) == 2
    assert f"--draft-vocab {tmp_path / 'nope.safetensors'}: no such file" in capsys.readouterr().err
    assert bench.main(common + ["--draft", f"a={folder}", "--draft-vocab", ""]) == 2
    assert "--draft-vocab: give the path of a draft vocabulary file" in capsys.readouterr().err
    assert bench.main(common + ["--draft", f"a={folder}", "--config", f"a:draft_vocab={tmp_path}/x,y.safetensors"]) == 2
    assert "cannot go in --config: give it run-wide with --draft-vocab" in capsys.readouterr().err

    other = tmp_path / "other.safetensors"
    save_draft_vocab(other, torch.arange(64, 300), {"vocab_size": 49152})
    out = tmp_path / "b.json"
    assert bench.main(common + ["--draft", f"a={folder}", "--draft", f"b={folder}", "--config",
                                f"a:draft_vocab={other}", "--config", f"b:draft_vocab={other}",
                                "--output-json", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: --config a,b:draft_vocab: {other}: counted for a vocabulary of 49152 ids" in err, err
    assert not out.exists()

    bare = tmp_path / "bare.safetensors"
    save_draft_vocab(bare, torch.arange(64, 300), {})
    args = ["--target", str(stories_dir), "--draft", str(folder), "--prompt", "Once upon", "--no-chat-template",
            "--max-new-tokens", "8", "--backend", "reference", "--json"]
    assert generate.main(args + ["--draft-vocab", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["draft_vocab"] is None
    assert generate.main(args + ["--draft-vocab", str(bare)]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["draft_vocab"]["size"] == 236
    assert f"note: --draft-vocab: {bare} records neither vocab_size nor tokens_digest" in got.err

    assert bench.main(common + ["--draft", f"p={folder}", "--config", "p:budget=auto", "--block-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "--block-size 4 with the planner of label p (--config p:budget=auto)" in err, err
    assert "add --config p:plan_trees=none" in err, err
    assert bench.main(common + ["--draft", f"p={folder}", "--budget", "auto", "--block-size", "4"]) == 2
    assert "the planner of label p (--budget auto)" in capsys.readouterr().err
    assert bench.main(common + ["--draft", f"a={folder}", "--config", f"a:draft_vocab={tmp_path}/x,y=1.st"]) == 2
    assert "cannot go in --config: give it run-wide with --draft-vocab" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_engine_with_a_vocabulary_is_lossless(stories_dir, stories, dtype):
    """On the GPU (Triton kernels, CUDA graphs, the draft head's implementation picked per row count): greedy
    chain, tree and planner output with a vocabulary equal the target's (fp32: the reference decoder's AR output;
    bf16 in exact mode: the same engine's AR output); a T = 1 run is reproducible from its seeds."""
    target, _, folder = stories
    params = SamplingParams(max_new_tokens=60)
    ids = _vocab(200, seed=4)
    kw = dict(device="cuda", dtype=dtype, impl="triton", max_seq=300, max_batch=5, eos_token_ids=[2],
              exact=dtype == torch.bfloat16, draft_vocab=ids)
    for mode in ({}, {"verify": "tree", "tree_budget": 16}, {"budget": "auto", "plan_trees": (8,)}):
        eng, _ = load_engine(str(stories_dir), None, str(folder), **kw, **mode)
        assert eng.draft_head.shape[0] == 200 and eng.draft_vocab.is_cuda
        want = (ReferenceDecoder(target, None, [2]).generate(PROMPTS, params).token_ids if dtype == torch.float32
                else eng.generate(PROMPTS, params, use_draft=False).token_ids)
        for conc in (1, 5):
            assert eng.generate(PROMPTS, params, concurrency=conc).token_ids == want, (mode, conc)
    hot = SamplingParams(max_new_tokens=40, temperature=1.0)
    eng, _ = load_engine(str(stories_dir), None, str(folder), **kw)
    seeds = [1, 2, 3, 4, 5]
    assert eng.generate(PROMPTS, hot, seeds=seeds).token_ids == eng.generate(PROMPTS, hot, seeds=seeds).token_ids
