"""The draft inside the engine: DSpine / DFlash weights over a static context K/V cache.

Same equations as ``dspine.model`` (docs/method.md §2-§3) with the engine's kernels: the context
cache holds ``k_norm(k_proj(c))`` (RoPE at the context position) and ``v_proj(c)`` of the fused
target features ``c``; one block ``[anchor, MASK x (bs-1)]`` per sequence attends to it and to its
own K/V, which is discarded. Sliding-window layers keep a ring of ``window + block`` positions.
The frozen target embedding and lm_head are shared with :class:`infer.model.EngineTarget`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspine.model import DSpineDraftModel
from dspine.ops.draft_attention import draft_attention
from dspine.ops.rmsnorm import rms_norm
from dspine.ops.rope import qk_norm_rope_cache, rope_tables
from infer.model import EngineTarget


class DraftCtxCache:
    """Per draft layer ``[B, Hkv, C, D]``; ``C = seq`` (position j at j) or a ring (j at j % C)."""

    def __init__(self, draft: EngineDraft, batch: int, seq: int):
        cfg = draft.cfg
        self.caps, self.k, self.v = [], [], []
        for sliding in draft.sliding:
            cap = min(seq, cfg.sliding_window + cfg.block_size) if sliding else seq
            shape = (batch, cfg.num_key_value_heads, cap, cfg.head_dim)
            self.caps.append(cap)
            self.k.append(torch.zeros(shape, device=draft.device, dtype=draft.dtype))
            self.v.append(torch.zeros(shape, device=draft.device, dtype=draft.dtype))
        self.batch, self.seq = batch, seq


class EngineDraft(nn.Module):
    """Engine-side draft built from a loaded :class:`DSpineDraftModel` (weights copied, kv fused)."""

    def __init__(self, model: DSpineDraftModel, target: EngineTarget, impl: str = "triton"):
        super().__init__()
        cfg = model.config
        self.cfg, self.target, self.impl = cfg, target, impl
        dev, dt = target.embed.device, target.embed.dtype
        self.device, self.dtype = dev, dt
        w = lambda t: t.detach().to(device=dev, dtype=dt).contiguous()
        self.fc, self.hidden_norm, self.norm = w(model.fc.weight), w(model.hidden_norm.weight), w(model.norm.weight)
        self.layers = []
        for layer in model.layers:
            at = layer.self_attn
            L = {
                "input_norm": w(layer.input_layernorm.weight), "q": w(at.q_proj.weight),
                "kv": w(torch.cat([at.k_proj.weight, at.v_proj.weight])), "q_norm": w(at.q_norm.weight),
                "k_norm": w(at.k_norm.weight), "o": w(at.o_proj.weight),
                "post_norm": w(layer.post_attention_layernorm.weight),
                "gate_up": w(torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])),
                "down": w(layer.mlp.down_proj.weight), "adj": None,
            }
            if at.q_proj.bias is not None:
                raise ValueError("draft attention_bias=True is not supported by the engine")
            adj = layer.adjacent
            if adj is not None:
                A = {"mode": adj.mode, "norm": w(adj.norm.weight)}
                if adj.mode == "residual":
                    A["gate"] = w(adj.gate)
                    if hasattr(adj.proj, "down"):
                        A["down"], A["up"] = w(adj.proj.down.weight), w(adj.proj.up.weight)
                    else:
                        A["proj"] = w(adj.proj.weight)
                else:
                    A["kv"] = w(torch.cat([adj.k_proj.weight, adj.v_proj.weight]))
                L["adj"] = A
            self.layers.append(L)
        self.sliding = [t == "sliding_attention" for t in cfg.layer_types]
        self.bs = cfg.block_size
        self.mask_id = cfg.mask_token_id
        self.scale = cfg.head_dim ** -0.5
        self._rope = None

    def new_cache(self, batch: int, seq: int) -> DraftCtxCache:
        """Context cache of ``seq`` positions (the engine checks the RoPE range before)."""
        if self._rope is None or self._rope[0].shape[0] < seq:
            self._rope = rope_tables(self.cfg.head_dim, seq, self.cfg.rope_theta, self.device)
        return DraftCtxCache(self, batch, seq)

    # -- context ---------------------------------------------------------------------------------
    def append(self, feats: torch.Tensor, start: torch.Tensor, cache: DraftCtxCache, slot: int | None = None):
        """Write the context K/V of features ``feats [B, T, k*H]`` at positions ``start[b] + t``.

        With ``slot`` (prefill) feats is ``[1, T, k*H]`` for batch slot ``slot`` and start is 0.
        All T rows are written; rows past the committed length are overwritten by the next append."""
        cfg, impl = self.cfg, self.impl
        B, T, _ = feats.shape
        N = B * T
        Hkv, D = cfg.num_key_value_heads, cfg.head_dim
        pos = (start[:, None] + torch.arange(T, device=feats.device)).reshape(N)
        if slot is None:
            bidx = torch.arange(B, device=feats.device).repeat_interleave(T)
        else:
            bidx = torch.full((N,), slot, device=feats.device, dtype=torch.long)
        c = rms_norm(F.linear(feats.reshape(N, -1), self.fc), self.hidden_norm, cfg.rms_norm_eps, impl=impl)
        cos, sin = self._rope
        for i, L in enumerate(self.layers):
            k, v = F.linear(c, L["kv"]).split(Hkv * D, dim=-1)
            cpos = pos % cache.caps[i] if self.sliding[i] else pos
            qk_norm_rope_cache(None, k.view(N, Hkv, D), v.view(N, Hkv, D), None, L["k_norm"], cfg.rms_norm_eps,
                               cos, sin, pos, cache.k[i], cache.v[i], bidx, cpos, impl=impl)

    # -- one block per sequence ------------------------------------------------------------------
    def block_logits(self, block: torch.Tensor, lengths: torch.Tensor, cache: DraftCtxCache) -> torch.Tensor:
        """Draft logits ``[B, bs-1, V]`` for blocks ``[B, bs]`` = [anchor, MASK, ...] whose anchor sits
        at position ``lengths[b]`` (the context cache holds positions < lengths[b])."""
        cfg, impl = self.cfg, self.impl
        B, bs = block.shape
        N = B * bs
        Hq, Hkv, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        dev = block.device
        t = torch.arange(bs, device=dev)
        pos = (lengths[:, None] + t).reshape(N)
        bidx = torch.arange(B, device=dev).repeat_interleave(bs)
        slot = t.repeat(B)
        cos, sin = self._rope
        h = F.embedding(block.reshape(N), self.target.embed)
        blk_k = torch.empty(B, Hkv, bs, D, device=dev, dtype=self.dtype)
        blk_v = torch.empty_like(blk_k)
        not_first = (slot > 0)[:, None].to(self.dtype)
        for i, L in enumerate(self.layers):
            A, extra = L["adj"], (None, None)
            if A is not None:
                prev = torch.roll(h.view(B, bs, -1), 1, dims=1).view(N, -1)  # slot t-1 (slot 0 masked below)
                pn = rms_norm(prev, A["norm"], eps, impl=impl)
                if A["mode"] == "residual":
                    inj = F.linear(F.linear(pn, A["down"]), A["up"]) if "down" in A else F.linear(pn, A["proj"])
                    h = h + A["gate"] * inj * not_first
                else:
                    ek, ev = F.linear(pn, A["kv"]).split(Hkv * D, dim=-1)
                    ext_k, ext_v = torch.empty_like(blk_k), torch.empty_like(blk_v)
                    qk_norm_rope_cache(None, ek.view(N, Hkv, D), ev.view(N, Hkv, D), None, L["k_norm"], eps,
                                       cos, sin, (pos - 1).clamp(min=0), ext_k, ext_v, bidx, slot, impl=impl)
                    extra = (ext_k.transpose(1, 2), ext_v.transpose(1, 2))
            x = rms_norm(h, L["input_norm"], eps, impl=impl)
            q = F.linear(x, L["q"])
            k, v = F.linear(x, L["kv"]).split(Hkv * D, dim=-1)
            q = qk_norm_rope_cache(q.view(N, Hq, D), k.view(N, Hkv, D), v.view(N, Hkv, D), L["q_norm"], L["k_norm"],
                                   eps, cos, sin, pos, blk_k, blk_v, bidx, slot, impl=impl)
            sliding = self.sliding[i]
            o = draft_attention(
                q.view(B, bs, Hq, D), cache.k[i], cache.v[i], lengths, blk_k.transpose(1, 2), blk_v.transpose(1, 2),
                self.scale, window=cfg.sliding_window if sliding else None,
                causal=sliding or cfg.block_attention == "causal", k_extra=extra[0], v_extra=extra[1], impl=impl,
            )
            h = h + F.linear(o.view(N, Hq * D), L["o"])
            y = rms_norm(h, L["post_norm"], eps, impl=impl)
            g, u = F.linear(y, L["gate_up"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(g) * u, L["down"])
        h = rms_norm(h.view(B, bs, -1)[:, 1:].reshape(B * (bs - 1), -1), self.norm, eps, impl=impl)
        return F.linear(h, self.target.head).view(B, bs - 1, -1)
