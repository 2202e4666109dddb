"""The top-k candidate path of ``dspine.sampling`` against its dense reference (TOP_K_FAST_MAX = 0).

* probabilities: equal up to fp32 rounding, the same support, on tied, flat and peaked rows;
* top-k keeps exactly k tokens, ties at the k-th score going to the lower ids, on both paths;
* ``uniforms_at`` is ``uniforms(..., vocab=V)`` gathered, bit for bit;
* draws over the candidates (``sample(..., ids)``, ``bonus_noise(..., ids)``) are the dense race's
  tokens bit for bit, and so are whole decodes (reference decoder and engine, T = 1, top_k 20).
"""

from __future__ import annotations

import pytest
import torch

from dspine import sampling as rng
from dspine.checkpoint import save_draft
from dspine.ops.accept import accept_sample
from dspine.reference import ReferenceDecoder
from dspine.sampling import SamplingParams, logits_to_probs, sample
from dspine.target import load_target
from infer.engine import load_engine
from tests.helpers import random_draft


def dense(logits, temperature, top_p, top_k, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(rng, "TOP_K_FAST_MAX", 0)
        return logits_to_probs(logits, temperature, top_p, top_k, with_ids=True)


def hard_logits(B, K, V, k, seed):
    """Random rows, plus: bf16-like rounding (many ties, some at the k-th score), a flat row, a peaked
    row, and a row whose k-th score is shared by tokens on both sides of the cut."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, K, V, generator=g) * 2
    x.view(-1, V)[0] = torch.round(x.view(-1, V)[0] * 2) / 2
    if B * K > 1:
        x.view(-1, V)[1] = 0.0
    if B * K > 2:
        x.view(-1, V)[2] *= 60
    if B * K > 3:
        row = x.view(-1, V)[3]
        kth = row.topk(k).values[-1]
        row[torch.randperm(V, generator=g)[:5]] = kth  # 5 more tokens tied at the k-th score
    return x


@pytest.mark.parametrize("top_k", [1, 20, 256])
@pytest.mark.parametrize("top_p", [0.5, 0.95, 1.0])
@pytest.mark.parametrize("B,K", [(1, 1), (2, 3)])
def test_candidate_probs_match_dense(top_k, top_p, B, K, monkeypatch):
    V = 700
    logits = hard_logits(B, K, V, top_k, seed=top_k * 10 + B)
    p, ids = logits_to_probs(logits, 0.8, top_p, top_k, with_ids=True)
    q, none = dense(logits, 0.8, top_p, top_k, monkeypatch)
    assert none is None and ids.shape == (B, K, top_k) and p.dtype == torch.float32
    assert torch.equal(p > 0, q > 0)
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # fp32 rounding of k- vs V-term sums
    assert ((p > 0).sum(-1) <= top_k).all() and torch.allclose(p.sum(-1), torch.ones(B, K))
    assert not p.scatter(-1, ids, 0.0).any()  # every nonzero is a candidate
    if top_p == 1.0:
        n = (p > 0).sum(-1).flatten()  # exactly k tokens, ties or not (the peaked row underflows)
        assert (n[torch.arange(len(n)) != 2] == top_k).all()


def test_topk_ties_go_to_lower_ids(monkeypatch):
    x = torch.tensor([3.0, 1.0, 2.0, 2.0, 2.0, 0.0])
    for probs, _ in (logits_to_probs(x, 1.0, 1.0, 3, with_ids=True), dense(x, 1.0, 1.0, 3, monkeypatch)):
        e = torch.tensor([3.0, 2.0, 2.0]).exp()
        torch.testing.assert_close(probs, torch.tensor([e[0], 0, e[1], e[2], 0, 0]) / e.sum())
    flat = torch.zeros(2, 8)  # top-p cuts inside the tie: the lower ids stay
    for top_k in (0, 6):
        probs = logits_to_probs(flat, 1.0, 0.5, top_k)
        want = torch.tensor([0.25] * 4 + [0.0] * 4) if top_k == 0 else torch.tensor([1 / 3] * 3 + [0.0] * 5)
        torch.testing.assert_close(probs, want.expand(2, 8))
    assert torch.equal(logits_to_probs(torch.tensor([-0.0, 0.0, 0.0]), 1.0, 1.0, 1), torch.tensor([1.0, 0, 0]))
    p, ids = logits_to_probs(torch.full((1, 50), float("nan")), 1.0, 0.9, 5, with_ids=True)
    assert 0 <= sample(p, torch.tensor([1]), rng.STREAM_TARGET, torch.tensor([0]), ids) < 50  # a valid id


def test_uniforms_at_is_uniforms_gathered():
    V = 5000
    seeds, pos = torch.tensor([3, -7, 2**62]), torch.tensor([[0, 9], [5, 5], [4095, 1]])
    full = rng.uniforms(seeds, rng.STREAM_TARGET, pos, V)
    ids = torch.randint(0, V, (3, 2, 31), generator=torch.Generator().manual_seed(0))
    assert torch.equal(rng.uniforms_at(seeds, rng.STREAM_TARGET, pos, ids), full.gather(-1, ids))
    assert rng.uniforms_at(seeds, rng.STREAM_DRAFT, pos, ids).ne(full.gather(-1, ids)).all()


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (20, 0.95), (256, 0.5)])
def test_candidate_draws_are_the_dense_draws(top_k, top_p, monkeypatch):
    B, K, V = 4, 15, 1000
    logits = hard_logits(B, K, V, top_k, seed=top_k)
    p, ids = logits_to_probs(logits, 1.0, top_p, top_k, with_ids=True)
    q, _ = dense(logits, 1.0, top_p, top_k, monkeypatch)
    pos = torch.arange(K)[None] + torch.tensor([0, 7, 100, 4000])[:, None]
    for s in range(3):
        seeds = torch.arange(B) * 1000 + s
        want = sample(p, seeds, rng.STREAM_DRAFT, pos)
        assert torch.equal(sample(p, seeds, rng.STREAM_DRAFT, pos, ids), want)
        assert torch.equal(sample(q, seeds, rng.STREAM_DRAFT, pos), want)
        assert torch.equal(sample(p[:, 0], seeds, rng.STREAM_TARGET, pos[:, 0], ids[:, 0]),
                           sample(p[:, 0], seeds, rng.STREAM_TARGET, pos[:, 0]))
    # the bonus race of the acceptance rule: noise at the target's candidates only
    draft = sample(p[:, 1:], seeds, rng.STREAM_DRAFT, pos[:, 1:], ids[:, 1:])
    g = torch.Generator().manual_seed(1)
    for s in range(3):
        seeds, out_pos = torch.arange(B) + 50 * s, pos[:, 0]
        d = torch.where(torch.rand(B, K - 1, generator=g) < 0.3, torch.randint(0, V, (B, K - 1), generator=g), draft)
        u = rng.uniforms(seeds, rng.STREAM_ACCEPT, pos[:, 1:])
        e_dense = rng.exponentials(seeds, rng.STREAM_TARGET, out_pos[:, None], V)[:, 0]
        e_fast = rng.bonus_noise(seeds, rng.STREAM_TARGET, out_pos, V, ids)
        assert torch.equal(e_fast.gather(1, ids.flatten(1)), e_dense.gather(1, ids.flatten(1)))
        a, bonus = accept_sample(d, p, p[:, 1:].roll(1, -1), u, e_dense, impl="torch")
        assert [torch.equal(x, y) for x, y in zip((a, bonus), accept_sample(d, p, p[:, 1:].roll(1, -1), u, e_fast,
                                                                                impl="torch"))] == [True, True]


def test_decoders_give_the_dense_tokens(stories_dir, tmp_path, monkeypatch):
    """T = 1, top_p 0.95, top_k 20: the reference decoder (chain: accept_sample's bonus) and the
    engine (tree: verify_tree's bonus; both: first tokens) emit the same tokens on the candidate
    path as on the dense one."""
    target = load_target(str(stories_dir), dtype="fp32")
    draft = random_draft(target, block_size=8, mask=0)
    folder = save_draft(draft, tmp_path / "draft")
    eng, _ = load_engine(str(stories_dir), None, str(folder), device="cpu", dtype=torch.float32, impl="torch",
                         max_seq=64, eos_token_ids=[2], verify="tree", tree_budget=10)
    prompts = [[1, 403, 407], [1, 300]]
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, max_new_tokens=6, seed=7)

    def run():
        return ReferenceDecoder(target, draft, [2]).generate(prompts, p).token_ids, eng.generate(prompts, p).token_ids

    fast = run()
    monkeypatch.setattr(rng, "TOP_K_FAST_MAX", 0)
    assert fast == run() and all(len(t) == 6 for t in fast[0] + fast[1])


def test_unit_map_is_exact_and_strictly_inside_zero_one():
    """Every 23-bit m maps to (m + 0.5) / 2^23 exactly, so u < 1 and the race noise -log u > 0. A key with
    all low bits set (-1) gave u = 1.0 with the 24-bit map (m + 0.5 rounds to 2^24 in fp32): noise ±0,
    a score of -inf in the torch race and +inf in the Triton kernel (seen on an H200: 1 row in 512)."""
    from dspine.counter_hash import UNIT_BITS, _to_unit

    m = torch.arange(1 << UNIT_BITS, dtype=torch.int64)
    u = _to_unit(m)
    assert u.dtype == torch.float32
    assert torch.equal(u.double() * (1 << UNIT_BITS) - 0.5, m.double())  # exact
    assert float(u.min()) == 2.0 ** -24 and float(u.max()) == 1 - 2.0 ** -24
    e = -torch.log(_to_unit(torch.tensor([-1, (1 << 24) - 1, 0])))
    assert bool((e > 0).all()) and bool(torch.isfinite(e).all())


def test_seed_out_of_range_is_refused_not_wrapped():
    """SamplingParams.seed: request seeds are 64-bit, so -1 or 2**64 + 1 would decode as 2**64 - 1 or 1 (the same
    request seeds, request_seed); they are refused by name, the range's ends accepted."""
    from dspine.sampling import SamplingParams, request_seed

    assert request_seed(2**64 + 1, 3) == request_seed(1, 3)  # what the check keeps users from
    for bad in (-1, 2**64, 2**64 + 1, 1.5, True):
        with pytest.raises(ValueError, match=r"seed=.* must be an integer in \[0, 2\*\*64 - 1\]"):
            SamplingParams(seed=bad).validate()
    for ok in (0, 2**64 - 1):
        assert SamplingParams(seed=ok).validate().seed == ok


def test_engine_top_k_kernel_decodes_the_torch_paths_tokens(stories_dir, tmp_path, monkeypatch):
    """T = 0.7, top_p 0.9, top_k 20: the engine with its Triton kernels (the top-k cut of ``dspine.ops.topk`` in the
    AR step, the draft's sampling and the chain's verify; interpreted on the CPU) emits the tokens of the engine on
    the torch paths and of the reference decoder, with the draft and without it."""
    import tests.kernel_env as env
    from dspine.ops import topk as topk_mod

    if not env.TRITON_CPU:
        pytest.skip(str(env.TRITON_CPU_SKIP))
    rows = []  # rows each kernel call cut: the AR steps' B, the chain's B·(block - 1) draft and B·block target rows
    kernel = topk_mod._topk_ids_triton
    monkeypatch.setattr(topk_mod, "_topk_ids_triton", lambda x, *a: rows.append(x.shape[0]) or kernel(x, *a))
    target = load_target(str(stories_dir), dtype="fp32")
    draft = random_draft(target, block_size=4, mask=0)
    folder = save_draft(draft, tmp_path / "draft")
    prompts = [[1, 403, 407], [1, 300], [1, 7, 9, 11]]
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=7, seed=3)
    out = {}
    for impl in ("torch", "triton"):
        eng, _ = load_engine(str(stories_dir), None, str(folder), device="cpu", dtype=torch.float32, impl=impl,
                             max_seq=64, eos_token_ids=[2], cuda_graphs=False)
        out[impl] = (eng.generate(prompts, p).token_ids, eng.generate(prompts, p, use_draft=False).token_ids)
    assert out["triton"] == out["torch"]
    assert {3, 9, 12} <= set(rows)  # the engine ran the kernel in the draft (3 rows x 3 slots), verify and AR steps
    assert out["torch"][0] == ReferenceDecoder(target, draft, [2]).generate(prompts, p).token_ids
    assert all(len(t) == 7 for t in out["torch"][0] + out["torch"][1])
