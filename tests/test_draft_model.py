"""Draft model: DFlash checkpoint layout, the DFlash equations, injection, train/inference forwards."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from dspine.checkpoint import load_draft, save_draft, warm_start
from dspine.config import DSpineConfig
from dspine.model import DraftCache, DSpineDraftModel, count_parameters

H, I, L, HQ, HKV, D, BS, K_LAYERS, V = 32, 48, 2, 4, 2, 8, 4, 3, 97


def dflash_config_json(**over) -> dict:
    """config.json with the keys of the published z-lab/Qwen3-8B-DFlash-b16, at tiny sizes."""
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": BS,
        "dflash_config": {"mask_token_id": 95, "target_layer_ids": [0, 2, 4]},
        "num_target_layers": 6,
        "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L,
        "num_attention_heads": HQ, "num_key_value_heads": HKV, "head_dim": D,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
        "max_position_embeddings": 40960, "tie_word_embeddings": False, "vocab_size": V,
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": L,
        "layer_types": ["full_attention"] * L, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16", "use_cache": True, "transformers_version": "4.57.1",
    }
    cfg.update(over)
    return cfg


def dflash_tensors(seed=0) -> dict[str, torch.Tensor]:
    """The DFlash tensor names (docs/method.md §2), random values (norm weights around 1)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2
    n = lambda d: 1 + 0.1 * torch.randn(d, generator=g)
    t = {"fc.weight": r(H, K_LAYERS * H), "hidden_norm.weight": n(H), "norm.weight": n(H)}
    for i in range(L):
        p = f"layers.{i}."
        t |= {
            p + "input_layernorm.weight": n(H), p + "post_attention_layernorm.weight": n(H),
            p + "self_attn.q_proj.weight": r(HQ * D, H), p + "self_attn.k_proj.weight": r(HKV * D, H),
            p + "self_attn.v_proj.weight": r(HKV * D, H), p + "self_attn.o_proj.weight": r(H, HQ * D),
            p + "self_attn.q_norm.weight": n(D), p + "self_attn.k_norm.weight": n(D),
            p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H), p + "mlp.down_proj.weight": r(H, I),
        }
    return t


@pytest.fixture()
def dflash_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dflash_config_json()))
    save_file(dflash_tensors(), str(tmp_path / "model.safetensors"))
    return tmp_path


# ---- an independent, straightforward implementation of the DFlash equations (fp64) ----------

def _rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=1e6):
    """x [n, heads, D]; rotate-half RoPE at integer positions pos [n]."""
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def dflash_block_reference(t: dict, feats: torch.Tensor, anchor: int, block_emb: torch.Tensor) -> torch.Tensor:
    """One block of one sequence. feats [S, kH] (only rows < anchor are used), block_emb [bs, H]."""
    t = {k: v.double() for k, v in t.items()}
    c = _rms(feats.double()[:anchor] @ t["fc.weight"].T, t["hidden_norm.weight"])
    h = block_emb.double()
    bs = h.shape[0]
    pos_q = torch.arange(anchor, anchor + bs)
    pos_k = torch.arange(0, anchor + bs)
    for i in range(L):
        p = f"layers.{i}."
        x = _rms(h, t[p + "input_layernorm.weight"])
        q = _rms((x @ t[p + "self_attn.q_proj.weight"].T).view(bs, HQ, D), t[p + "self_attn.q_norm.weight"])
        kv_in = torch.cat([c, x])
        k = _rms((kv_in @ t[p + "self_attn.k_proj.weight"].T).view(-1, HKV, D), t[p + "self_attn.k_norm.weight"])
        v = (kv_in @ t[p + "self_attn.v_proj.weight"].T).view(-1, HKV, D)
        q, k = _rope(q, pos_q), _rope(k, pos_k)
        heads = []
        for hq in range(HQ):
            g = hq // (HQ // HKV)
            w = torch.softmax(q[:, hq] @ k[:, g].T / math.sqrt(D), dim=-1)  # non-causal over ctx + block
            heads.append(w @ v[:, g])
        h = h + torch.cat(heads, -1) @ t[p + "self_attn.o_proj.weight"].T
        y = _rms(h, t[p + "post_attention_layernorm.weight"])
        h = h + (F.silu(y @ t[p + "mlp.gate_proj.weight"].T) * (y @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    return _rms(h, t["norm.weight"])


def test_dflash_checkpoint_loads_strictly_and_matches_equations(dflash_dir):
    model = load_draft(dflash_dir, dtype=torch.float32)
    assert model.config.injection == "none"  # a DFlash config carries no dspine_config
    assert model.config.mask_token_id == 95 and model.config.target_layer_ids == [0, 2, 4]
    assert set(model.state_dict()) == set(dflash_tensors())  # exact DFlash names, nothing more
    g = torch.Generator().manual_seed(1)
    S, anchors = 40, torch.tensor([[3, 17, 30], [0, 9, 36]])
    feats = torch.randn(2, S, K_LAYERS * H, generator=g)
    emb = torch.randn(2, anchors.shape[1] * BS, H, generator=g)
    with torch.no_grad():
        out = model.forward_train(emb, feats, anchors)
    tensors = dflash_tensors()
    err = 0.0
    for b in range(2):
        for n, a in enumerate(anchors[b].tolist()):
            ref = dflash_block_reference(tensors, feats[b], a, emb[b, n * BS:(n + 1) * BS])
            err = max(err, (out[b, n * BS:(n + 1) * BS].double() - ref).abs().max().item())
    assert err <= 1e-5, err

    # inference forward: the same blocks through the context cache, one block per sequence
    cache = DraftCache(model, batch_size=2, capacity=S)
    cache.append(feats, anchors[:, 1])
    with torch.no_grad():
        blk = model.forward_block(emb[:, BS:2 * BS], cache)
    for b in range(2):
        ref = dflash_block_reference(tensors, feats[b], int(anchors[b, 1]), emb[b, BS:2 * BS])
        assert (blk[b].double() - ref).abs().max().item() <= 1e-5


def test_flex_mask_matches_dense(dflash_dir):
    model = load_draft(dflash_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(2, 40, K_LAYERS * H, generator=g)
    anchors = torch.tensor([[5, 20, -1], [1, 2, 35]])  # -1 = padding block
    emb = torch.randn(2, 3 * BS, H, generator=g)
    with torch.no_grad():
        dense = model.forward_train(emb, feats, anchors, attn="dense")
        flex = model.forward_train(emb, feats, anchors, attn="flex")
    valid = (anchors >= 0).repeat_interleave(BS, 1)
    assert (dense - flex)[valid].abs().max().item() < 1e-5


def test_published_8b_parameter_counts():
    cfg = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=5,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]})
    with torch.device("meta"):
        dflash = DSpineDraftModel(DSpineConfig(**cfg, dspine_config={"injection": "none"}))
        spine = DSpineDraftModel(DSpineConfig(**cfg, dspine_config={"injection": "residual"}))
        low = DSpineDraftModel(DSpineConfig(**cfg, dspine_config={"injection": "residual", "injection_rank": 256}))
    assert count_parameters(dflash) == 1_048_626_432  # docs/method.md §2, the published draft
    H8 = 4096
    assert count_parameters(spine) == 1_048_626_432 + 5 * (H8 * H8 + 2 * H8)  # proj + norm + gate
    assert count_parameters(low) == 1_048_626_432 + 5 * (2 * 256 * H8 + 2 * H8)


def _spine(injection="residual", **dspine):
    cfg = dflash_config_json()
    cfg.pop("model_type")
    cfg["dspine_config"] = {"injection": injection, **dspine}
    torch.manual_seed(0)
    return DSpineDraftModel(DSpineConfig(**cfg)).eval()


def test_zero_gate_injection_is_exactly_dflash(dflash_dir, tmp_path):
    spine = _spine("residual")
    missing = warm_start(spine, dflash_dir)  # DFlash warm start: only adjacent.* keep their init
    assert missing and all(".adjacent." in k for k in missing)
    dflash = load_draft(dflash_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    feats, emb = torch.randn(1, 30, K_LAYERS * H, generator=g), torch.randn(1, 2 * BS, H, generator=g)
    anchors = torch.tensor([[4, 20]])
    with torch.no_grad():
        assert torch.equal(spine.forward_train(emb, feats, anchors), dflash.forward_train(emb, feats, anchors))
        for layer in spine.layers:
            layer.adjacent.gate.normal_()
        diff = (spine.forward_train(emb, feats, anchors) - dflash.forward_train(emb, feats, anchors)).abs()
    per_slot = diff.view(2, BS, H).amax(-1)
    assert per_slot.min() > 0  # injection reaches every slot through bidirectional attention
    # round trip of a DSpine checkpoint keeps the adjacent tensors and the outputs
    save_draft(spine, tmp_path / "spine")
    again = load_draft(tmp_path / "spine")
    with torch.no_grad():
        assert torch.equal(again.forward_train(emb, feats, anchors), spine.forward_train(emb, feats, anchors))


def test_warm_start_across_injection_modes(tmp_path, caplog):
    """residual -> kv: shared tensors copied, the residual's injection left out, kv's k/v_proj zero;
    kv -> residual: zero gates, so the result equals the kv source's weights without injection (DFlash)."""
    res = _spine("residual")
    with torch.no_grad():
        for layer in res.layers:
            layer.adjacent.gate.normal_()
    save_draft(res, tmp_path / "res")
    kv = _spine("kv")
    with caplog.at_level("WARNING", logger="dspine.checkpoint"):
        kept = warm_start(kv, tmp_path / "res")
    n_res_inj = sum(".adjacent." in k for k in res.state_dict())
    assert f"its {n_res_inj} injection tensors are not loaded" in caplog.text
    assert sorted(kept) == sorted(k for k in kv.state_dict() if ".adjacent." in k)
    src = res.state_dict()
    for k, v in kv.state_dict().items():
        if ".adjacent." not in k:
            assert torch.equal(v, src[k]), k
    for layer in kv.layers:
        assert torch.count_nonzero(layer.adjacent.v_proj.weight) == 0
        assert torch.count_nonzero(layer.adjacent.k_proj.weight) == 0
        assert torch.count_nonzero(layer.adjacent.norm.weight - 1) == 0  # the model's own init
    # kv -> residual and kv -> DFlash: the same function (zero gates)
    with torch.no_grad():
        for layer in kv.layers:
            layer.adjacent.v_proj.weight.normal_()
            layer.adjacent.k_proj.weight.normal_()
    save_draft(kv, tmp_path / "kv")
    back, plain = _spine("residual"), _spine("none")
    warm_start(back, tmp_path / "kv")
    warm_start(plain, tmp_path / "kv")
    g = torch.Generator().manual_seed(5)
    feats, emb = torch.randn(1, 30, K_LAYERS * H, generator=g), torch.randn(1, 2 * BS, H, generator=g)
    anchors = torch.tensor([[4, 20]])
    with torch.no_grad():
        out_back, out_plain = back.forward_train(emb, feats, anchors), plain.forward_train(emb, feats, anchors)
        out_kv = kv.forward_train(emb, feats, anchors)
    assert torch.equal(out_back, out_plain)
    assert (out_kv - out_plain).abs().max() > 1e-3  # the kv source's own injection did act
    # the same mode with another rank: named, not a list of unexpected tensors
    low = _spine("residual", injection_rank=4)
    with pytest.raises(ValueError, match=r"injection_rank 0 in the source, 4 in the model"):
        warm_start(low, tmp_path / "res")


def test_injection_shift_stays_inside_blocks_and_never_looks_ahead():
    from dspine.model import AdjacentInjection

    h = torch.arange(2 * 3 * BS, dtype=torch.float32).view(2, 3 * BS, 1).expand(2, 3 * BS, 5)
    prev = AdjacentInjection.previous(h, BS)
    for t in range(3 * BS):
        want = torch.zeros(2, 5) if t % BS == 0 else h[:, t - 1]  # no shift across a block boundary
        assert torch.equal(prev[:, t], want)
    # causal in-block attention + injection: perturbing slot t never changes slots < t
    for injection in ("none", "residual", "kv"):
        m = _spine(injection, block_attention="causal")
        for layer in m.layers:
            if layer.adjacent is not None and injection == "residual":
                layer.adjacent.gate.data.normal_()
        g = torch.Generator().manual_seed(4)
        feats, emb = torch.randn(1, 20, K_LAYERS * H, generator=g), torch.randn(1, 2 * BS, H, generator=g)
        anchors = torch.tensor([[10, 15]])
        emb2 = emb.clone()
        emb2[0, 2] += 1.0  # slot 2 of block 0
        with torch.no_grad():
            a, b = m.forward_train(emb, feats, anchors), m.forward_train(emb2, feats, anchors)
        changed = (a - b).abs().amax(-1)[0]
        assert changed[:2].max() == 0 and changed[2:BS].min() > 0, (injection, changed)
        assert changed[BS:].max() == 0  # the other block is untouched


def test_kv_injection_train_and_block_forward_agree():
    m = _spine("kv")
    g = torch.Generator().manual_seed(5)
    feats, emb = torch.randn(2, 25, K_LAYERS * H, generator=g), torch.randn(2, BS, H, generator=g)
    anchors = torch.tensor([[7], [19]])
    cache = DraftCache(m, 2, 25)
    cache.append(feats, anchors[:, 0])
    with torch.no_grad():
        assert (m.forward_train(emb, feats, anchors) - m.forward_block(emb, cache)).abs().max() < 1e-5


def test_sliding_window_layers_see_only_the_window():
    cfg = dflash_config_json(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    cfg.pop("model_type")
    m = DSpineDraftModel(DSpineConfig(**cfg)).eval()
    g = torch.Generator().manual_seed(6)
    feats, emb = torch.randn(1, 30, K_LAYERS * H, generator=g), torch.randn(1, BS, H, generator=g)
    mask = m.train_mask(torch.tensor([[20]]), 30, sliding=True)[0, 0]  # [bs, 30 + bs]
    for t in range(BS):
        ctx = mask[t, :30].nonzero().flatten().tolist()
        assert ctx == [j for j in range(20) if 20 + t - j < 6]
        assert mask[t, 30:].nonzero().flatten().tolist() == list(range(t + 1))  # causal in block
    cache = DraftCache(m, 1, 30)
    cache.append(feats, torch.tensor([20]))
    with torch.no_grad():
        assert (m.forward_train(emb, feats, torch.tensor([[20]])) - m.forward_block(emb, cache)).abs().max() < 1e-5


def test_gradients_reach_only_the_draft(stories_dir):
    from dspine.target import load_target

    target = load_target(str(stories_dir), dtype="fp32", layer_ids=[1, 3])
    cfg = DSpineConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=8, block_size=4,
                       num_target_layers=5, dflash_config={"mask_token_id": 0, "target_layer_ids": [1, 3]})
    draft = DSpineDraftModel(cfg)
    ids = torch.randint(3, 512, (1, 24))
    feats = target.features(ids)
    block = torch.full((1, 8), 0)
    block[0, 0], block[0, 4] = ids[0, 5], ids[0, 12]
    hidden = draft.forward_train(target.embed(block), feats, torch.tensor([[5, 12]]))
    loss = F.cross_entropy(target.lm_head(hidden).view(-1, 512), torch.randint(0, 512, (8,)))
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in target.parameters())
    assert all(p.grad is not None for n, p in draft.named_parameters() if ".adjacent.gate" not in n)
    assert all(p.grad is not None for n, p in draft.named_parameters())  # gate gets grad even at zero


def _sliding_draft(impl: str) -> DSpineDraftModel:
    """A draft of a sliding-window layer (window 6: a ring of 6 + block) and a full-attention layer, for the cache
    write tests; skips the Triton case where the interpreter cannot run it."""
    import tests.kernel_env as env

    if impl == "triton" and not env.TRITON_CPU:
        pytest.skip(str(env.TRITON_CPU_SKIP))
    cfg = dflash_config_json(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    cfg.pop("model_type")
    return DSpineDraftModel(DSpineConfig(**cfg)).eval()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_append_packed_equals_the_padded_append(impl):
    """DraftCache.append_packed (an admission's packed features, no padding) writes the same K/V and lengths as
    the padded append_context, for full and sliding-window layers (ring of 6 + block: prompts longer than the ring
    evict within the append), rows in any order, from non-zero lengths; padded rows never reach the cache."""
    m = _sliding_draft(impl)
    g = torch.Generator().manual_seed(7)
    lens, rows, start = [5, 17, 1], torch.tensor([3, 0, 2]), torch.tensor([0, 4, 2, 0], dtype=torch.int32)
    feats = torch.randn(sum(lens), K_LAYERS * H, generator=g)
    padded = torch.nn.utils.rnn.pad_sequence(list(feats.split(lens)), batch_first=True)
    padded[0, 5:] = padded[2, 1:] = 1e3  # padding that must not land anywhere
    caches = [DraftCache(m, 4, 40) for _ in range(2)]
    for c in caches:
        c.lengths.copy_(start)
    caches[0].append(padded, torch.tensor(lens), rows=rows, impl=impl)
    caches[1].append_packed(feats, torch.tensor(lens), rows, impl=impl)  # outside no_grad, as append: no graph
    assert not any(t.requires_grad for t in caches[1].k + caches[1].v)
    want_len = start.clone()
    want_len[rows] += torch.tensor(lens, dtype=torch.int32)
    assert caches[0].lengths.tolist() == caches[1].lengths.tolist() == want_len.tolist()
    for i in range(len(m.layers)):
        cap = caches[0].caps[i]
        for a, b in ((caches[0].k[i], caches[1].k[i]), (caches[0].v[i], caches[1].v[i])):
            torch.testing.assert_close(a[..., :cap, :], b[..., :cap, :], rtol=1e-5, atol=1e-5)
    full = caches[1].k[1]  # the full-attention layer: exactly the appended positions are written
    for row, (lo, hi) in {3: (0, 5), 0: (0, 17), 2: (2, 3), 1: (0, 0)}.items():
        written = (full[row].abs().sum((0, 2)) > 0).nonzero().flatten().tolist()
        assert written == list(range(lo, hi)), (row, written)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_prefix_write_after_later_positions_equals_the_in_order_append(impl):
    """append_packed(prefix=True), the engine's deferred prompt context: a row's prompt written as its first
    positions after the positions that follow it were appended gives the cache the in-order appends give, for full
    and sliding-window layers (ring of 6 + block; rows whose prompt, or prompt + later positions, pass the ring, so
    the late prompt write must skip what the later positions evicted); the lengths stay; a row with keep=False
    (a finished request's prompt) gets none of its prompt written."""
    m = _sliding_draft(impl)
    g = torch.Generator().manual_seed(11)
    prompt, later, rows = [5, 17, 3, 4], [9, 2, 14, 3], torch.tensor([2, 0, 3, 1])
    feats_p = torch.randn(sum(prompt), K_LAYERS * H, generator=g)
    feats_l = torch.randn(sum(later), K_LAYERS * H, generator=g)
    in_order, deferred = DraftCache(m, 4, 40), DraftCache(m, 4, 40)
    in_order.append_packed(feats_p, torch.tensor(prompt), rows, impl=impl)
    in_order.append_packed(feats_l, torch.tensor(later), rows, impl=impl)
    deferred.lengths[rows] = torch.tensor(prompt, dtype=torch.int32)  # the admission counts the deferred prompt
    deferred.append_packed(feats_l, torch.tensor(later), rows, impl=impl)
    keep = torch.tensor([True, True, True, False])  # row 1 (the last prompt): its request finished
    deferred.append_packed(feats_p, torch.tensor(prompt), rows, impl=impl, prefix=True, keep=keep)
    total = [p + n for p, n in zip(prompt, later)]
    want_len = torch.zeros(4, dtype=torch.int32)
    want_len[rows] = torch.tensor(total, dtype=torch.int32)
    assert in_order.lengths.tolist() == deferred.lengths.tolist() == want_len.tolist()
    for i in range(len(m.layers)):
        cap = in_order.caps[i]
        for a, b in ((in_order.k[i], deferred.k[i]), (in_order.v[i], deferred.v[i])):
            torch.testing.assert_close(a[rows[:3], :, :cap], b[rows[:3], :, :cap], rtol=1e-5, atol=1e-5)
            # row 1: only its later positions 4..6 (no ring wrap in the full layer, 7 < cap)
            if not m.layers[i].sliding:
                assert not b[1, :, :4].any() and b[1, :, 4:7].abs().sum() > 0
                torch.testing.assert_close(a[1, :, 4:7], b[1, :, 4:7], rtol=1e-5, atol=1e-5)
    assert in_order.caps[0] < max(total)  # the sliding layer's ring did wrap
