"""Bucketed prefill (``Engine(prefill_buckets=True)``): each prompt alone, padded to a length bucket at static
shapes (``EngineTarget.prefill_static``), one CUDA graph per bucket on the GPU. On the CPU the same padded pass
runs eagerly: its logits, features and K/V rows equal the unpadded prefill's, and the engine's greedy output is
unchanged."""

from __future__ import annotations

import pytest
import torch

from dspine.reference import ReferenceDecoder
from dspine.sampling import SamplingParams
from dspine.target import load_target
from infer.engine import load_engine
from infer.model import EngineTarget, prefill_bucket

PROMPTS = [[1], [1, 403, 407], [1, 403, 407, 261, 378, 432, 383], [1, 300], [1, 301, 302, 303, 304], [1, 410]]


def test_prefill_bucket_lengths():
    assert [prefill_bucket(p, 10_000) for p in (1, 64, 65, 500, 512, 513, 768, 769, 2048, 2049, 8192)] == [
        64, 64, 128, 512, 512, 768, 768, 1024, 2048, 3072, 8192]
    assert len({prefill_bucket(p, 10_000) for p in range(1, 8193)}) == 20
    assert prefill_bucket(70, 100) == 100  # capped at the cache
    for bad, cap in ((0, 100), (101, 100), (8193, 10_000)):
        with pytest.raises(ValueError, match=f"1 <= P <= {min(cap, 8192)}"):
            prefill_bucket(bad, cap)


@pytest.fixture(scope="module")
def swa_dir(tmp_path_factory):
    """A tiny random Qwen3 with sliding-window layers (window 5; layer 0 full)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rope_theta=1e4, tie_word_embeddings=False, eos_token_id=None, pad_token_id=0,
                      bos_token_id=None, initializer_range=0.1, use_sliding_window=True, sliding_window=5,
                      max_window_layers=1)
    out = tmp_path_factory.mktemp("tiny_swa_buckets")
    Qwen3ForCausalLM(cfg).eval().save_pretrained(out)
    return out


@pytest.mark.parametrize("which", ["stories", "qwen3", "swa"])
def test_prefill_static_equals_prefill(which, stories_dir, tiny_qwen3_dir, swa_dir):
    path = {"stories": stories_dir, "qwen3": tiny_qwen3_dir, "swa": swa_dir}[which]
    eng = EngineTarget.from_pretrained(str(path), device="cpu", dtype=torch.float32, layer_ids=[0, 1], impl="torch")
    g = torch.Generator().manual_seed(3)
    P, slot = 23, 2
    ids = torch.randint(3, 250, (P,), generator=g)
    ref_cache, cache = eng.new_cache(3, 128), eng.new_cache(3, 128)
    want_logits, want_feats = eng.prefill(ids, slot, ref_cache)
    Pb = prefill_bucket(P, cache.seq)
    tokens = torch.cat([ids, torch.randint(3, 250, (Pb - P,), generator=g)])  # padding: any ids
    logits, feats = eng.prefill_static(tokens, torch.tensor([slot]), torch.tensor([P - 1]), cache)
    assert logits.shape == (1, eng.args.vocab_size) and feats.shape[0] == Pb
    assert torch.allclose(logits[0], want_logits, atol=1e-5, rtol=1e-5)
    assert torch.allclose(feats[:P], want_feats, atol=1e-5, rtol=1e-5)
    for i in range(eng.args.num_layers):
        assert torch.allclose(cache.k[i][slot, :, :P], ref_cache.k[i][slot, :, :P], atol=1e-5)  # matmul rounding
        assert torch.allclose(cache.v[i][slot, :, :P], ref_cache.v[i][slot, :, :P], atol=1e-5)
        assert cache.k[i][[0, 1]].abs().sum() == 0  # the other slots untouched


def test_engine_prefill_buckets_keep_greedy_output(stories_dir, tmp_path):
    from dspine.checkpoint import save_draft
    from tests.helpers import random_draft

    target = load_target(str(stories_dir), dtype="fp32")
    folder = save_draft(random_draft(target, block_size=8, mask=0), tmp_path / "draft")
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS, SamplingParams(max_new_tokens=40)).token_ids
    eng, _ = load_engine(str(stories_dir), None, str(folder), device="cpu", dtype=torch.float32, impl="torch",
                         max_seq=500, eos_token_ids=[2], prefill_buckets=True)
    assert eng.prefill_buckets and not eng.cuda_graphs
    for conc in (1, 3, 6):
        assert eng.generate(PROMPTS, SamplingParams(max_new_tokens=40), concurrency=conc).token_ids == want, conc
    assert eng.generate(PROMPTS, SamplingParams(max_new_tokens=40), use_draft=False).token_ids == want
    assert {k[0] for k in eng._prefill_graphs} == {64}  # one bucket for all these prompts; no graphs on the CPU
    off, _ = load_engine(str(stories_dir), None, str(folder), device="cpu", dtype=torch.float32, impl="torch",
                         max_seq=500, eos_token_ids=[2])
    assert not off.prefill_buckets  # auto: only with CUDA graphs


def test_bucketed_admission_writes_the_draft_context(stories_dir, tmp_path):
    """With a draft, the bucketed prefill writes each admitted prompt's draft-context K/V in its own pass (inside
    the bucket's graph on a GPU): the draft cache and the lengths equal the unbucketed admission's, the padding's
    rows are not written, a slot not admitted keeps its length, and each (bucket, batch size) has its own pass."""
    from dspine.checkpoint import save_draft
    from tests.helpers import random_draft

    target = load_target(str(stories_dir), dtype="fp32")
    folder = save_draft(random_draft(target, block_size=8, mask=0), tmp_path / "draft")
    kw = dict(device="cpu", dtype=torch.float32, impl="torch", max_seq=500, eos_token_ids=[2])
    engines = [load_engine(str(stories_dir), None, str(folder), prefill_buckets=b, **kw)[0] for b in (False, True)]
    prompts = {3: PROMPTS[2], 1: [1] + list(range(300, 370)), 0: PROMPTS[0]}  # buckets 64, 128, 64
    for eng in engines:
        s = eng._slots_for(4)
        kv, dc = eng._cache_view(4)
        s.lengths.fill_(99)  # stale lengths of an earlier request: overwritten, slot 2 (not admitted) kept
        eng._admit(s, list(prompts.items()), SamplingParams(max_new_tokens=8), True, kv, dc, [0, 1, 2])
    plain, bucketed = engines
    want = [len(prompts[0]), len(prompts[1]), 99, len(prompts[3])]
    assert plain._slots_for(4).lengths.tolist() == bucketed._slots_for(4).lengths.tolist() == want
    for i in range(len(plain.draft.layers)):
        for b, p in prompts.items():
            for a, c in ((plain.draft_cache.k[i], bucketed.draft_cache.k[i]),
                         (plain.draft_cache.v[i], bucketed.draft_cache.v[i])):
                assert c[b, :, : len(p)].abs().sum() > 0
                assert torch.allclose(a[b, :, : len(p)], c[b, :, : len(p)], atol=1e-5), (i, b)
                assert c[b, :, len(p) : 128].abs().sum() == 0  # the padding went to the scratch slot
        assert bucketed.draft_cache.k[i][2].abs().sum() == 0
    assert set(bucketed._prefill_graphs) == {(64, True, 4), (128, True, 4)}
    s2 = bucketed._slots_for(2)
    kv, dc = bucketed._cache_view(2)
    bucketed._admit(s2, [(1, PROMPTS[1])], SamplingParams(max_new_tokens=8), True, kv, dc, [0])
    assert s2.lengths[1] == len(PROMPTS[1]) and (64, True, 2) in bucketed._prefill_graphs  # its own pass at B = 2
    assert bucketed._slots_for(4).lengths.tolist() == want  # B = 4's lengths untouched
    # more prompts than PREFILL_BUCKETS_MAX_PROMPTS in one admission: the packed pass (no bucket pass made), same
    # draft context
    bucketed.PREFILL_BUCKETS_MAX_PROMPTS = 2
    s3 = bucketed._slots_for(3)
    kv, dc = bucketed._cache_view(3)
    bucketed._admit(s3, [(0, PROMPTS[1]), (1, PROMPTS[2]), (2, PROMPTS[4])], SamplingParams(max_new_tokens=8), True,
                    kv, dc, [0, 1, 2])
    assert not any(k[2] == 3 for k in bucketed._prefill_graphs)
    assert s3.lengths.tolist() == [len(PROMPTS[1]), len(PROMPTS[2]), len(PROMPTS[4])]


def test_capture_prefill_makes_what_admissions_would(stories_dir, tmp_path):
    """Engine.capture_prefill makes, before a decode, the bucket entries (graphs on a GPU) that its admissions would
    make at their first prompt, under the same keys: a later generate at that batch size makes none, and its output
    is unchanged; calls between decodes only, with checked arguments."""
    from dspine.checkpoint import save_draft
    from tests.helpers import random_draft

    target = load_target(str(stories_dir), dtype="fp32")
    folder = save_draft(random_draft(target, block_size=8, mask=0), tmp_path / "draft")
    prompts = PROMPTS + [[1] + list(range(300, 370))]  # 71 tokens: bucket 128
    want = ReferenceDecoder(target, None, [2]).generate(prompts, SamplingParams(max_new_tokens=20)).token_ids
    eng, _ = load_engine(str(stories_dir), None, str(folder), device="cpu", dtype=torch.float32, impl="torch",
                         max_seq=500, eos_token_ids=[2], prefill_buckets=True, max_batch=4)
    assert eng.capture_prefill(3, 71) == 2 and eng.capture_prefill(3, 71) == 0
    assert eng.capture_prefill(3, 71, use_draft=False) == 2
    keys = set(eng._prefill_graphs)
    assert keys == {(64, True, 3), (128, True, 3), (64, False, None), (128, False, None)}
    for use_draft in (True, False):
        got = eng.generate(prompts, SamplingParams(max_new_tokens=20), concurrency=3, use_draft=use_draft).token_ids
        assert got == want, use_draft
    assert set(eng._prefill_graphs) == keys  # nothing made during the decodes
    assert eng.capture_prefill(2, 10_000) == 8  # prompts up to max_seq - 1 = 499: buckets 64 .. 448, and 509 (the cache)
    for bad in (dict(batch=0, max_prompt=5), dict(batch=5, max_prompt=5), dict(batch=1, max_prompt=0)):
        with pytest.raises(ValueError, match="capture_prefill"):
            eng.capture_prefill(**bad)
    with pytest.raises(ValueError, match="capture_prefill"):
        eng.capture_prefill(2.5, 5)
    eng.slot_owner = [None, 4, None]
    with pytest.raises(RuntimeError, match="requests are decoding"):
        eng.capture_prefill(1, 5)
    eng.slot_owner = None
    with pytest.raises(ValueError, match="exceeds the engine context"):  # a failed generate leaves no request decoding
        eng.generate([[1] * 490], SamplingParams(max_new_tokens=20))
    assert eng.slot_owner is None and eng.capture_prefill(1, 5) == 1  # B = 1: its bucket made now
    off, _ = load_engine(str(stories_dir), None, str(folder), device="cpu", dtype=torch.float32, impl="torch",
                         max_seq=500, eos_token_ids=[2], prefill_buckets=False)
    assert off.capture_prefill(3, 71) == 0 and not off._prefill_graphs


@pytest.mark.gpu
def test_engine_prefill_graphs_cuda(stories_dir, tmp_path):
    """CUDA graphs per bucket: the same greedy output as the eager unpadded prefill, one graph per bucket."""
    target = load_target(str(stories_dir), dtype="fp32")
    from dspine.checkpoint import save_draft
    from tests.helpers import random_draft

    folder = save_draft(random_draft(target, block_size=8, mask=0), tmp_path / "draft")
    kw = dict(device="cuda", dtype=torch.float32, impl="triton", max_seq=500, eos_token_ids=[2])
    plain, _ = load_engine(str(stories_dir), None, str(folder), prefill_buckets=False, **kw)
    graphed, _ = load_engine(str(stories_dir), None, str(folder), prefill_buckets=True, **kw)
    assert graphed.prefill_buckets and graphed.cuda_graphs
    prompts = PROMPTS + [[1] + list(range(300, 370))]  # a second bucket (71 tokens -> 128)
    want = plain.generate(prompts, SamplingParams(max_new_tokens=40), concurrency=3).token_ids
    assert graphed.generate(prompts, SamplingParams(max_new_tokens=40), concurrency=3).token_ids == want
    assert sorted(k[0] for k in graphed._prefill_graphs) == [64, 128]
    assert all(v[0] is not None for v in graphed._prefill_graphs.values())
    # the graphs made before the decode (Engine.capture_prefill) are the ones it replays: none made during it
    pre, _ = load_engine(str(stories_dir), None, str(folder), prefill_buckets=True, **kw)
    assert pre.capture_prefill(3, 71) == 2 and all(v[0] is not None for v in pre._prefill_graphs.values())
    keys = set(pre._prefill_graphs)
    assert pre.generate(prompts, SamplingParams(max_new_tokens=40), concurrency=3).token_ids == want
    assert set(pre._prefill_graphs) == keys


def test_cli_prefill_buckets(stories_dir, tmp_path, capsys):
    """--prefill-buckets: refused on the reference backend (infer.generate, infer.bench); on the engine
    (CPU, eager) infer.bench runs with it and the greedy output equals the AR output."""
    import json

    from dspine.checkpoint import save_draft
    from infer import bench, generate
    from tests.conftest import shared_path
    from tests.helpers import random_draft

    base = ["--target", str(stories_dir), "--draft", "none", "--prompt", "hi", "--backend", "reference",
            "--prefill-buckets"]
    assert generate.main(base) == 2
    assert "--prefill-buckets needs the engine" in capsys.readouterr().err
    folder = save_draft(random_draft(load_target(str(stories_dir), dtype="fp32"), block_size=8, mask=0),
                        tmp_path / "draft")
    argv = ["--target", str(stories_dir), "--draft", f"D={folder}", "--datasets", "gsm8k", "--data-dir",
            str(shared_path("data", "eval")), "--num-prompts", "2", "--max-new-tokens", "8", "--no-chat-template",
            "--dtype", "fp32", "--prefill-buckets"]
    assert bench.main([*argv, "--backend", "reference", "--output-json", str(tmp_path / "r.json")]) == 2
    assert "--prefill-buckets needs the engine" in capsys.readouterr().err
    out = tmp_path / "b.json"
    assert bench.main([*argv, "--backend", "cuda", "--device", "cpu", "--output-json", str(out)]) == 0
    d = json.loads(out.read_text())["tasks"][0]["drafts"]["D"]
    assert d["greedy_equal"] == d["greedy_compared"] == 2


def test_padded_prefill_with_the_triton_kernels(stories_dir, tmp_path):
    """The Triton kernels (interpreter) read index vectors packed: the slot index, a stride-0 view in
    prefill_static, must reach them contiguous or rows past the first land in other slots. K/V of the padded
    pass under impl="triton" equal the torch path's, other slots stay untouched, and the engine's greedy output
    with buckets equals the reference decoder's."""
    import tests.kernel_env as env
    from dspine.checkpoint import save_draft
    from dspine.ops.rope import qk_norm_rope_cache
    from tests.helpers import random_draft

    if not env.TRITON_CPU:
        pytest.skip(str(env.TRITON_CPU_SKIP))
    g = torch.Generator().manual_seed(0)
    N, H, D, S = 40, 2, 16, 64
    q, k, v = (torch.randn(N, H, D, generator=g) for _ in range(3))
    cos, sin = torch.randn(S, D // 2, generator=g), torch.randn(S, D // 2, generator=g)
    pos = torch.arange(N)
    outs = []
    for impl in ("torch", "triton"):
        kc, vc = torch.zeros(3, H, S, D), torch.zeros(3, H, S, D)
        qo = qk_norm_rope_cache(q, k, v, None, None, 1e-6, cos, sin, pos, kc, vc, torch.tensor([2]).expand(N), pos,
                                impl=impl)
        outs.append((qo, kc, vc))
    assert torch.allclose(outs[0][1], outs[1][1], atol=1e-6) and torch.allclose(outs[0][2], outs[1][2], atol=1e-6)
    assert outs[1][1][:2].abs().sum() == 0 and outs[1][1][2, :, :N].abs().sum() > 0

    target = load_target(str(stories_dir), dtype="fp32")
    folder = save_draft(random_draft(target, block_size=8, mask=0), tmp_path / "draft")
    # 4 new tokens: the first from the padded prefill's logits, three decode steps reading its K/V rows (each
    # interpreted step costs seconds); the third prompt is admitted after the first two finish
    want = ReferenceDecoder(target, None, [2]).generate(PROMPTS[:3], SamplingParams(max_new_tokens=4)).token_ids
    eng, _ = load_engine(str(stories_dir), None, str(folder), device="cpu", dtype=torch.float32, impl="triton",
                         max_seq=200, eos_token_ids=[2], prefill_buckets=True)
    assert eng.generate(PROMPTS[:3], SamplingParams(max_new_tokens=4), concurrency=2).token_ids == want
