"""The engine's draft path against the training draft (docs/method.md §2-§3), fp32.

The engine runs ``DSpineDraftModel`` over a static context cache (ring for sliding layers) with the
kernels; the reference is ``forward_train`` over the whole feature sequence with the dense block
mask. Nothing else ties the two: lossless decoding hides a wrong draft (only τ would drop), so
their logits must agree within 1e-5 here. Several context appends with ragged accept counts per
row, junk features past each row's committed count, random injection gates. On a GPU the same
plan runs the engine's draft with the Triton kernels on CUDA (fp32) against the CPU reference.
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import tests.kernel_env as env
from dspine.checkpoint import load_draft
from dspine.config import DSpineConfig
from dspine.model import DraftCache, DSpineDraftModel
from infer.engine import Engine
from infer.model import EngineTarget
from tests.conftest import REPO

H, I, HQ, HKV, D, BS, V, TARGET_LAYERS = 32, 48, 4, 2, 8, 4, 97, 2
PROMPTS = [5, 9, 2]  # context rows per batch row before the first block
COUNTS = [[1, 4, 2], [3, 1, 4], [4, 2, 1], [2, 3, 3], [1, 1, 4]]  # accepted + 1 per step and row


def tiny_draft(injection="residual", rank=0, sliding=False, causal=False, seed=0) -> DSpineDraftModel:
    cfg = DSpineConfig(
        vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=HQ,
        num_key_value_heads=HKV, head_dim=D, rope_theta=1e4, block_size=BS, num_target_layers=4,
        layer_types=["sliding_attention", "full_attention"] if sliding else None, sliding_window=6 if sliding else None,
        dflash_config={"mask_token_id": V - 1, "target_layer_ids": [1, 2]},
        dspine_config={"injection": injection, "injection_rank": rank,
                       "block_attention": "causal" if causal else "bidirectional"},
    )
    torch.manual_seed(seed)
    model = DSpineDraftModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".gate")):  # norms around 1, gates non-zero: injection matters
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.7 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return model


def random_target(hidden: int, vocab: int, seed=1):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(embed=torch.randn(vocab, hidden, generator=g), head=0.3 * torch.randn(vocab, hidden, generator=g))


def reference_logits(model, target, block, features, lengths):
    """lm_head(forward_train) for one block per row anchored at ``lengths[b]``: ``[B, bs-1, V]``."""
    hidden = model.forward_train(F.embedding(block, target.embed), features, lengths[:, None].long())
    return F.linear(hidden[:, 1:], target.head)


def engine_run(model, target, blocks, features, plan_counts, impl, device="cpu"):
    """The engine's draft over the plan, as :class:`infer.engine.Engine` runs it (fused weights, static
    cache, ``Engine.draft_logits``) on ``device``: prefill rows one by one, then per step block logits
    and an append of the step's bs feature rows of which only ``counts`` are committed. Returns the
    logits per step, on the CPU."""
    B, bs = len(PROMPTS), model.config.block_size
    dev = torch.device(device)
    on = SimpleNamespace(embed=target.embed.to(dev), head=target.head.to(dev))
    on.logits = lambda h, exact=False, lm_head="linear": EngineTarget.logits(on, h, exact, lm_head)
    eng = SimpleNamespace(draft=copy.deepcopy(model).to(dev).fuse_weights(), target=on, impl=impl, verify_size=bs,
                          lm_head_choice={}, draft_head=None)  # the whole vocabulary (no dspine.draft_vocab)
    features = features.to(dev)
    cache = DraftCache(eng.draft, B, features.shape[1] + bs + 1)
    for b, P in enumerate(PROMPTS):
        cache.append(features[b : b + 1, :P], torch.tensor([P]), rows=torch.tensor([b]), impl=impl)
    out = []
    for block, counts, junk in blocks:
        out.append(Engine.draft_logits(eng, block.to(dev), cache).cpu())
        lengths = cache.lengths.tolist()
        step = torch.stack([features[b, lengths[b] : lengths[b] + bs] for b in range(B)])
        keep = (torch.arange(bs)[None, :, None] < counts[:, None, None]).to(dev)
        cache.append(torch.where(keep, step, junk.to(dev)), counts.to(dev), impl=impl)
    return out


def plan(features_dim: int, mask_id: int, vocab: int, bs: int = BS, seed=2):
    """Blocks [anchor, MASK, ...], committed counts and junk features (rejected slots) per step."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for counts in COUNTS:
        block = torch.full((len(PROMPTS), bs), mask_id)
        block[:, 0] = torch.randint(0, vocab, (len(PROMPTS),), generator=g)
        steps.append((block, torch.tensor(counts), torch.randn(len(PROMPTS), bs, features_dim, generator=g)))
    return steps


def max_diff(model, target, impl="torch", device="cpu") -> float:
    """Largest |engine - reference| logit over the plan; the reference runs on the CPU."""
    bs = model.config.block_size
    S = max(PROMPTS) + sum(max(c) for c in COUNTS) + bs
    kH = len(model.config.target_layer_ids) * model.config.hidden_size
    features = torch.randn(len(PROMPTS), S, kH, generator=torch.Generator().manual_seed(3))
    steps = plan(kH, min(model.config.mask_token_id, target.embed.shape[0] - 1), target.embed.shape[0], bs)
    with torch.no_grad():
        got = engine_run(model, target, steps, features, COUNTS, impl, device)
        lengths = torch.tensor(PROMPTS)
        err = 0.0
        for (block, counts, _), logits in zip(steps, got):
            want = reference_logits(model, target, block, features, lengths)
            assert logits.shape == want.shape
            err = max(err, (logits - want).abs().max().item())
            lengths = lengths + counts
    return err


CASES = {
    "residual": dict(injection="residual"),
    "residual-lowrank": dict(injection="residual", rank=4),
    "kv": dict(injection="kv"),
    "none": dict(injection="none"),
    "sliding-residual": dict(injection="residual", sliding=True),
    "causal-kv": dict(injection="kv", causal=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_draft_equals_training_draft(case):
    err = max_diff(tiny_draft(**CASES[case]), random_target(H, V))
    assert err <= 1e-5, f"{case}: max |engine - reference| = {err:.3g}"


@pytest.mark.slow
@pytest.mark.skipif(not env.INTERPRET, reason="needs TRITON_INTERPRET=1 (CPU)")
@pytest.mark.parametrize("case", ["residual-lowrank", "sliding-residual", "causal-kv"])
def test_engine_draft_triton_equals_training_draft(case):
    err = max_diff(tiny_draft(**CASES[case]), random_target(H, V), impl="triton")
    assert err <= 1e-5, f"{case}: max |engine (triton) - reference| = {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_engine_draft_triton_cuda_equals_training_draft(case):
    """The issue-12 bar on the GPU: Triton kernels on CUDA, fp32, within 1e-5 of the CPU reference."""
    err = max_diff(tiny_draft(**CASES[case]), random_target(H, V), impl="triton", device="cuda")
    assert err <= 1e-5, f"{case}: max |engine (triton, cuda) - reference| = {err:.3g}"


@pytest.mark.parametrize("injection,rank", [("kv", 0), ("residual", 4)])
def test_fuse_weights_keeps_the_checkpoint_layout(injection, rank):
    model = tiny_draft(injection, rank=rank)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.fuse_weights()
    fused = [t.data_ptr() for t in model.buffers()]
    model.fuse_weights()  # idempotent, and keeps the fused tensors (an engine's CUDA graphs hold them)
    assert [t.data_ptr() for t in model.buffers()] == fused
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    at = model.layers[0].self_attn
    assert at.q_proj.weight.data_ptr() == at.qkv_weight.data_ptr()  # a view: no second copy
    adj = model.layers[0].adjacent
    if injection == "kv":  # both norms folded into one [q; k; v; k'; v'] weight that follows new weights in place
        layer = model.layers[0]

        def want():
            return torch.cat([at.qkv_weight * layer.input_layernorm.weight,
                              torch.cat([adj.k_proj.weight, adj.v_proj.weight]) * adj.norm.weight])

        assert torch.allclose(adj.qkvkv_weight, want()) and torch.equal(adj.unit_weight, torch.ones(H))
        with torch.no_grad():
            adj.k_proj.weight.mul_(2)
            layer.input_layernorm.weight.add_(1)
        model.fuse_weights()
        assert adj.qkvkv_weight.data_ptr() in fused and torch.allclose(adj.qkvkv_weight, want())
    if rank:  # the folded low-rank injection follows new weights, at the same address
        with torch.no_grad():
            adj.proj.up.weight.mul_(2)
        model.fuse_weights()
        assert adj.proj_weight.data_ptr() in fused
        assert torch.allclose(adj.proj_weight, adj.proj.up.weight @ adj.proj.down.weight)


def test_engine_draft_equals_training_draft_shipped_weights():
    """The trained SmolLM2 draft (residual, rank 128, trained gates) with a random embedding/head."""
    folder = REPO / "checkpoints" / "smollm2-135m-dspine"
    model = load_draft(folder, dtype=torch.float32)
    assert json.loads((folder / "config.json").read_text())["dspine_config"]["injection"] == "residual"
    assert any(layer.adjacent.gate.abs().max() > 0 for layer in model.layers)
    target = random_target(model.config.hidden_size, 1000)
    target.embed *= 0.05
    target.head *= 0.05
    err = max_diff(model, target)
    assert err <= 1e-5, f"max |engine - reference| = {err:.3g}"


def test_parity_check_can_fail():
    """A wrong engine draft (one gate changed after the engine copied the weights) is caught."""
    model = tiny_draft("residual")
    target = random_target(H, V)
    S = max(PROMPTS) + BS
    features = torch.randn(len(PROMPTS), S + sum(max(c) for c in COUNTS), 2 * H)
    steps = plan(2 * H, V - 1, V)
    with torch.no_grad():
        got = engine_run(model, target, steps[:1], features, COUNTS[:1], "torch")
        model.layers[1].adjacent.gate.add_(0.01)
        want = reference_logits(model, target, steps[0][0], features, torch.tensor(PROMPTS))
    assert (got[0] - want).abs().max() > 1e-4
