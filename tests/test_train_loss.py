"""DSpine loss (docs/method.md §4): anchors, labels/weights, fused chunked CE, block mask, tau_sim."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dspine.config import DSpineConfig
from dspine.model import DSpineDraftModel
from train.loss import (
    LossStats,
    anchor_generator,
    block_input_ids,
    block_loss,
    block_targets,
    fused_linear_cross_entropy,
    naive_linear_cross_entropy,
    sample_anchors,
    tau_sim,
    valid_anchors,
)

# ------------------------------------------------------------------------------------- anchors


def test_valid_anchors_follow_the_rule():
    #             0  1  2  3  4  5  6  7  8  9
    m = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1, 1])
    # p with m[p] = m[p+1] = 1 and p + 1 < length
    assert valid_anchors(m, 10).tolist() == [1, 2, 5, 8]
    assert valid_anchors(m, 9).tolist() == [1, 2, 5]  # p = 8 needs p + 1 < 9
    assert valid_anchors(torch.tensor([1]), 1).tolist() == []
    assert valid_anchors(torch.tensor([1, 0, 1, 0]), 4).tolist() == []


def test_sample_anchors_valid_capped_unique_deterministic():
    torch.manual_seed(0)
    masks = [(torch.rand(200) < 0.8).long() for _ in range(3)] + [torch.zeros(50, dtype=torch.long)]
    lengths = [200, 150, 37, 50]
    a = sample_anchors(masks, lengths, 20, anchor_generator(1, 5, 0, 0))
    assert a.shape == (4, 20) and a.dtype == torch.long
    for row, m, L in zip(a, masks, lengths):
        picked = row[row >= 0].tolist()
        ok = set(valid_anchors(m, L).tolist())
        assert set(picked) <= ok
        assert len(picked) == min(20, len(ok))
        assert len(set(picked)) == len(picked) and picked == sorted(picked)
    assert (a[3] == -1).all()  # a row without valid anchors contributes nothing
    same = sample_anchors(masks, lengths, 20, anchor_generator(1, 5, 0, 0))
    assert torch.equal(a, same)
    for other in (anchor_generator(1, 6, 0, 0), anchor_generator(1, 5, 1, 0), anchor_generator(1, 5, 0, 1),
                  anchor_generator(2, 5, 0, 0)):
        assert not torch.equal(a, sample_anchors(masks, lengths, 20, other))
    # fewer valid anchors than the cap: all of them, padded to pad_to
    few = sample_anchors([torch.tensor([1, 1, 1, 0])], [4], 8, anchor_generator(0, 0, 0, 0), pad_to=5)
    assert few.tolist() == [[0, 1, -1, -1, -1]]


def test_anchor_draws_are_uniform_over_valid_positions():
    m = torch.ones(12, dtype=torch.long)  # valid anchors 0..10
    counts = torch.zeros(12)
    for step in range(3000):
        a = sample_anchors([m], [12], 3, anchor_generator(0, step, 0, 0))
        counts[a[0]] += 1
    assert counts[11] == 0
    freq = counts[:11] / counts[:11].sum()
    assert (freq - 1 / 11).abs().max() < 0.02


# ------------------------------------------------------------------------------------- blocks


def test_block_inputs_labels_and_weights_by_hand():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0, 0]])
    lengths = torch.tensor([6])
    anchors = torch.tensor([[1, 4, -1]])
    bs, gamma = 4, 2.0
    blocks = block_input_ids(ids, anchors, bs, mask_token_id=99)
    assert blocks.tolist() == [[11, 99, 99, 99, 14, 99, 99, 99, 99, 99, 99, 99]]
    labels, w = block_targets(ids, mask, lengths, anchors, bs, gamma)
    # block at 1: slot k -> token at 1+k = 12, 13, 14; mask 1, 0, 1
    # block at 4: slot 1 -> 15 (mask 1), slots 2, 3 past the end (length 6)
    assert labels.tolist() == [[0, 12, 13, 14, 0, 15, 0, 0, 0, 0, 0, 0]]
    e = math.exp
    want = [0, 1, 0, e(-2 / 2), 0, 1, 0, 0, 0, 0, 0, 0]
    assert w[0].tolist() == pytest.approx(want, abs=1e-7)


def test_loss_against_hand_computed_values():
    """Tiny vocab (V = H = 3, lm_head = identity, so logits = hidden): loss = Σ w·CE / Σ w."""
    bs, gamma = 3, 7.0
    ids = torch.tensor([[0, 1, 2, 1, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    anchors = torch.tensor([[1, 2]])
    labels, w = block_targets(ids, mask, torch.tensor([5]), anchors, bs, gamma)
    logits = torch.tensor([[[9.0, 9.0, 9.0], [2.0, 0.0, 1.0], [0.0, 3.0, 0.0],
                            [9.0, 9.0, 9.0], [1.0, 1.0, 0.0], [0.5, 0.0, 0.0]]])
    hidden = logits.clone().requires_grad_(True)
    loss_sum, stats = block_loss(hidden, torch.eye(3), labels, w, bs, chunk_size=2)

    def ce(row, y):
        return math.log(sum(math.exp(v) for v in row)) - row[y]

    # block at 1: slot 1 -> token 2 (w 1), slot 2 -> token 1 (w e^{-1/7}); block at 2: slot 1 -> 1 (w 1),
    # slot 2 -> token 0 at position 4 with loss_mask 0 (w 0)
    terms = [(1.0, ce([2, 0, 1], 2)), (math.exp(-1 / 7), ce([0, 3, 0], 1)), (1.0, ce([1, 1, 0], 1))]
    want = sum(a * b for a, b in terms) / sum(a for a, _ in terms)
    assert stats.weight_sum == pytest.approx(2 + math.exp(-1 / 7))
    assert loss_sum.item() / stats.weight_sum == pytest.approx(want, rel=1e-6)
    assert stats.count.tolist() == [0, 2, 1]
    # argmax == label: [2,0,1] -> 0 != 2; [0,3,0] -> 1 == 1; [1,1,0] -> 0 != 1
    assert stats.correct.tolist() == [0, 0, 1]
    loss_sum.backward()
    assert hidden.grad[0, 0].abs().sum() == 0 and hidden.grad[0, 5].abs().sum() == 0  # w = 0 rows
    p = torch.softmax(torch.tensor([2.0, 0.0, 1.0]), 0)
    assert hidden.grad[0, 1].tolist() == pytest.approx((p - torch.tensor([0, 0, 1.0])).tolist(), abs=1e-6)


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 1000])
def test_fused_ce_matches_naive_value_and_gradient(chunk):
    g = torch.Generator().manual_seed(chunk)
    R, H, V = 37, 24, 101
    hidden = torch.randn(R, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    labels = torch.randint(0, V, (R,), generator=g)
    w = torch.rand(R, generator=g, dtype=torch.float64)
    w[::4] = 0
    # fp64 reference, then both implementations in fp32
    h64 = hidden.clone().requires_grad_(True)
    ref = (w * F.cross_entropy(h64 @ weight.t(), labels, reduction="none")).sum()
    ref.backward()
    ref_grad = h64.grad
    out = {}
    for name, fn in (("fused", fused_linear_cross_entropy), ("naive", naive_linear_cross_entropy)):
        h = hidden.float().requires_grad_(True)
        loss, correct = fn(h, weight.float(), labels, w.float(), chunk)
        (loss * 3.0).backward()  # a non-unit upstream gradient
        out[name] = (loss.item(), h.grad.double() / 3.0, correct)
    naive_err = (out["naive"][1] - ref_grad).abs().max()
    for name in out:
        assert out[name][0] == pytest.approx(ref.item(), rel=1e-5)
        assert (out[name][1] - ref_grad).abs().max() <= 4 * naive_err + 1e-6
    assert torch.equal(out["fused"][2], out["naive"][2])
    assert torch.equal(out["fused"][2], (hidden @ weight.t()).argmax(-1) == labels)
    assert ref_grad.abs().max() > 0.1  # the comparison is not vacuous


def test_fused_ce_bf16_weight_close_to_fp32():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(50, 32, generator=g)
    weight = torch.randn(64, 32, generator=g) * 0.3
    labels = torch.randint(0, 64, (50,), generator=g)
    w = torch.ones(50)
    h = hidden.clone().requires_grad_(True)
    loss, _ = fused_linear_cross_entropy(h, weight.bfloat16(), labels, w, 16)
    loss.backward()
    ref, _ = naive_linear_cross_entropy(hidden, weight, labels, w)
    assert loss.item() == pytest.approx(ref.item(), rel=2e-2)
    assert h.grad.dtype == torch.float32


def test_block_loss_without_weighted_rows_is_zero_with_a_graph():
    hidden = torch.randn(1, 8, 4, requires_grad=True)
    loss, stats = block_loss(hidden, torch.randn(5, 4), torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8), 4)
    assert loss.item() == 0.0 and stats.weight_sum == 0.0 and stats.count.sum() == 0
    loss.backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() == 0


# ------------------------------------------------------------------------------------- tau_sim


def test_tau_sim_by_hand_and_identity():
    tau, at_pos = tau_sim([0.8, 0.5, 0.25])
    assert at_pos == pytest.approx([0.8, 0.4, 0.1])
    assert tau == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert tau == pytest.approx(1 + sum(at_pos))  # docs/method.md §1 identity
    assert tau_sim([1.0] * 15)[0] == pytest.approx(16.0)
    assert tau_sim([0.5, float("nan"), 1.0])[1] == [0.5, 0.0, 0.0]


def test_loss_stats_sum_over_ranks_before_dividing():
    # rank 0: slot 1 has 1/1 right; rank 1: 0/3 -> pooled 1/4 (not the mean of ratios 0.5)
    a = LossStats(1.0, 1.0, torch.tensor([0, 1]), torch.tensor([0, 1]))
    b = LossStats(3.0, 3.0, torch.tensor([0, 3]), torch.tensor([0, 0]))
    pooled = LossStats.from_vector(a.to_vector() + b.to_vector())
    assert pooled.accuracy == [0.25]
    assert pooled.loss_sum == 4.0 and pooled.count.tolist() == [0, 4]
    assert pooled.overlap_rate is None and pooled.agreement is None
    # the sampling overlap (fp64 sums, evaluation only) pools the same way: (0.9 + 3 x 0.5) / 4 = 0.6
    c = LossStats(1.0, 1.0, torch.tensor([0, 1]), torch.tensor([0, 1]), soft=True,
                  overlap=torch.tensor([0.0, 0.9], dtype=torch.float64), overlap_on=True)
    d = LossStats(3.0, 3.0, torch.tensor([0, 3]), torch.tensor([0, 0]), soft=True,
                  overlap=torch.tensor([0.0, 1.5], dtype=torch.float64), overlap_on=True)
    both = LossStats.from_vector(c.to_vector() + d.to_vector())
    assert both.overlap_rate == pytest.approx([0.6]) and both.soft and both.overlap_on
    assert LossStats.zeros(2).add(c).add(d).overlap_rate == pytest.approx([0.6])


# ------------------------------------------------------------------------------------- block mask


def brute_force_mask(anchors, S, bs, *, causal, window, extra):
    """docs/method.md §4 written out key by key: a query at slot t of block b (anchor a) sees context
    positions j < a (and a + t - j < window for sliding layers), keys of its own block (slots
    s <= t when causal), and with kv injection the extra key of its own slot t >= 1."""
    B, N = anchors.shape
    T = N * bs
    Tk = S + T + (T if extra else 0)
    out = torch.zeros(B, T, Tk, dtype=torch.bool)
    for b_ in range(B):
        for q in range(T):
            blk, t = divmod(q, bs)
            a = int(anchors[b_, blk])
            for j in range(S):
                out[b_, q, j] = j < a and (window is None or a + t - j < window)
            for s in range(bs):
                out[b_, q, S + blk * bs + s] = (s <= t) if causal else True
            if extra and t >= 1:
                out[b_, q, S + T + blk * bs + t] = True
    return out


def small_draft(**over):
    kw = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, block_size=4, num_target_layers=6,
              dflash_config={"mask_token_id": 95, "target_layer_ids": [0, 2, 4]})
    kw.update(over)
    torch.manual_seed(0)
    return DSpineDraftModel(DSpineConfig(**kw)).eval()


VARIANTS = {
    "bidirectional": ({}, dict(causal=False, window=None, extra=False), False),
    "causal": ({"dspine_config": {"block_attention": "causal"}}, dict(causal=True, window=None, extra=False), False),
    "kv": ({"dspine_config": {"injection": "kv"}}, dict(causal=False, window=None, extra=True), False),
    "sliding": ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6},
                dict(causal=True, window=6, extra=False), True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_train_mask_dense_and_flex_match_brute_force(variant):
    over, rule, sliding = VARIANTS[variant]
    model = small_draft(**over)
    S = 19
    anchors = torch.tensor([[0, 3, 9, 17, 2], [5, 1, -1, -1, -1]])
    want = brute_force_mask(anchors, S, 4, **rule)
    dense = model.train_mask(anchors, S, sliding=sliding, kind="dense")
    assert torch.equal(dense[:, 0], want)
    flex = model.train_mask(anchors, S, sliding=sliding, kind="flex")
    B, T, Tk = want.shape
    b = torch.arange(B)[:, None, None]
    q = torch.arange(T)[None, :, None]
    kv = torch.arange(Tk)[None, None, :]
    assert torch.equal(flex.mask_mod(b, torch.zeros_like(b), q, kv).expand(B, T, Tk), want)
    assert want.any() and not want.all()


def test_forward_train_flex_equals_dense_on_cpu():
    model = small_draft()
    for layer in model.layers:
        torch.nn.init.normal_(layer.adjacent.gate, std=0.5)
    g = torch.Generator().manual_seed(1)
    feats, emb = torch.randn(2, 23, 96, generator=g), torch.randn(2, 20, 32, generator=g)
    anchors = torch.tensor([[0, 3, 7, 15, 21], [2, 5, -1, -1, -1]])
    with torch.no_grad():  # flex has no CPU backward
        dense = model.forward_train(emb, feats, anchors, attn="dense")
        flex = model.forward_train(emb, feats, anchors, attn="flex")
    assert (dense - flex).abs().max() < 1e-5
