"""The DSpine draft: a DFlash block drafter with adjacent causal injection.

Equations (docs/method.md §2-§3; DFlash: z-lab/dflash ``model.py``):

* fusion      ``c = hidden_norm(fc(concat_k h_k))``, once per forward, shared by all layers;
* each layer  ``Q = q_norm(q_proj(x))``, ``K = k_norm(k_proj([c ; x]))``, ``V = v_proj([c ; x])``
  with ``x = input_layernorm(u)``; RoPE on absolute positions; o_proj, residual,
  post_attention_layernorm, SwiGLU MLP, residual;
* injection   ``u_t = h_t + g ⊙ W · RMSNorm(h_{t-1})`` for slots t >= 1 of each block
  (``residual``), or one extra key/value per query made from slot t-1 (``kv``), or nothing
  (``none`` = DFlash). The shift never crosses a block boundary.
* output      ``norm(h)``; the frozen target ``lm_head`` turns it into logits. Slot k of a block
  predicts the token at position anchor + k.

Two forwards share the modules: ``forward_train`` (many blocks per sequence, block mask, SDPA or
flex_attention) and ``forward_block`` (one block per sequence over a static :class:`DraftCache`, the
``dspine.ops`` kernels with ``impl="torch"|"triton"``: the engine and the reference decoder both run
it). :meth:`DSpineDraftModel.fuse_weights` fuses q/k/v and gate/up for inference.

Parameter names are the DFlash checkpoint's (``fc``, ``hidden_norm``, ``norm``,
``layers.{i}.self_attn.q_proj`` …) plus ``layers.{i}.adjacent.{norm,proj,gate}``; the draft holds
no embedding and no lm_head (they are the target's).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, PreTrainedModel

from dspine.config import DSpineConfig
from dspine.ops.draft_attention import draft_attention
from dspine.ops.linear import linear
from dspine.ops.rmsnorm import rms_norm, shift_rms_norm
from dspine.ops.rope import qk_norm_rope_cache, rope_tables
from dspine.ops.sdpa import sdpa


class RMSNorm(nn.Module):
    """RMSNorm with Qwen3/Llama numerics: fp32 statistics, cast back, then scale by ``weight``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables for integer ``positions`` (any shape P): returns two ``[*P, head_dim]`` tensors.

    Standard RoPE, ``inv_freq_i = theta^(-2i/D)``, computed in fp32 and cast to ``dtype``
    (as transformers' Qwen3/Llama rotary embedding does)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, heads, T, D]``; cos/sin ``[B, T, D]``. Rotate-half convention (pairs i, i + D/2)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attend(q, k, v, mask, scale: float) -> torch.Tensor:
    """Attention of q ``[B, Hq, Tq, D]`` over k/v ``[B, Hkv, Tk, D]`` (GQA by head groups).

    ``mask`` is a bool ``[B, 1, Tq, Tk]`` tensor (True = visible; the dense reference path) or a
    ``torch.nn.attention.flex_attention.BlockMask`` (the GPU path). Returns ``[B, Tq, Hq*D]``.
    """
    B, Hq, Tq, D = q.shape
    if isinstance(mask, torch.Tensor):
        groups = Hq // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = sdpa(q, k, v, attn_mask=mask, scale=scale)
    else:
        from torch.nn.attention.flex_attention import flex_attention

        out = _compiled_flex(flex_attention)(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(B, Tq, Hq * D)


_FLEX = {}
FLEX_RECOMPILE_LIMIT = 64  # compiled variants per function (see _compiled_flex)


def _compiled_flex(fn):
    # flex_attention is only fast (and memory-light) when compiled; compile once per process.
    if "fn" not in _FLEX:
        if torch.cuda.is_available():
            # dynamic=False specialises on every shape and on grad mode: the trainer's length buckets with
            # grad plus its evaluation's without (issue 11) pass dynamo's default of 8 entries per function
            # at max_length 3072 (6 buckets), and past the limit every new shape runs flex eagerly (dense
            # scores: slow and memory-hungry) each time it recurs, rather than compiling once.
            cfg = torch._dynamo.config
            name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
            setattr(cfg, name, max(getattr(cfg, name), FLEX_RECOMPILE_LIMIT))
        _FLEX["fn"] = torch.compile(fn, dynamic=False) if torch.cuda.is_available() else fn
    return _FLEX["fn"]


class DraftAttention(nn.Module):
    def __init__(self, config: DSpineConfig):
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, D
        bias = config.attention_bias
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=bias)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)
        self.scale = 1.0 / math.sqrt(D)
        self.register_buffer("qkv_weight", None, persistent=False)  # inference: fuse_weights()

    def project(self, x: torch.Tensor, with_q: bool = True) -> torch.Tensor:
        """``[q ;] k ; v`` projections of x ``[..., H]`` in one GEMM once fused, else one by one."""
        if self.qkv_weight is None:
            return torch.cat([lin(x) for lin in (self.q_proj, self.k_proj, self.v_proj)[0 if with_q else 1:]], -1)
        return F.linear(x, self.qkv_weight[0 if with_q else self.num_heads * self.head_dim:])

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], n, self.head_dim).transpose(1, 2)  # [B, n, T, D]

    def kv(self, x: torch.Tensor, cos, sin, k_proj=None, v_proj=None):
        """Keys/values of inputs x ``[B, T, H]`` at the positions of cos/sin: ``[B, Hkv, T, D]`` each."""
        k = self.k_norm(self._heads((k_proj or self.k_proj)(x), self.num_kv_heads))
        v = self._heads((v_proj or self.v_proj)(x), self.num_kv_heads)
        return apply_rope(k, cos, sin), v

    def q(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        return apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)


class DraftMLP(nn.Module):
    def __init__(self, config: DSpineConfig):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)  # inference: fuse_weights()

    def forward(self, x: torch.Tensor, impl: str = "torch") -> torch.Tensor:
        """SwiGLU of x ``[..., H]``; once fused (inference), one gate/up GEMM and the down projection with
        ``silu(gate)·up`` on its input (``dspine.ops.linear``'s fast path: cuBLAS after ``dspine.ops.silu_mul``, or
        with ``impl="triton"`` the Triton GEMV that applies it as it loads, where the device's tuned file prefers it)."""
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        up = linear(x, self.gate_up_weight, impl=impl, exact=False)
        return linear(up, self.down_proj.weight, impl=impl, exact=False, act="silu_mul")


class LowRank(nn.Module):
    """``up(down(x))``: an H x H map of rank r (tensor names ``proj.down`` / ``proj.up``)."""

    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class AdjacentInjection(nn.Module):
    """Adjacent causal injection of one layer (docs/method.md §3).

    ``residual``: ``u_t = h_t + gate ⊙ proj(norm(h_{t-1}))`` for slots t >= 1; ``gate`` starts at
    zero so an untrained injection is exactly DFlash. ``kv``: makes one key/value per slot t from
    ``norm(h_{t-1})`` with its own ``k_proj``/``v_proj`` (RoPE at position t-1)."""

    def __init__(self, config: DSpineConfig):
        super().__init__()
        H = config.hidden_size
        self.mode = config.injection
        self.norm = RMSNorm(H, config.rms_norm_eps)
        if self.mode == "residual":
            r = config.injection_rank
            self.proj = LowRank(H, r) if r else nn.Linear(H, H, bias=False)
            self.gate = nn.Parameter(torch.zeros(H))
            self.register_buffer("proj_weight", None, persistent=False)  # inference: up·down folded
        else:  # kv
            kvd = config.num_key_value_heads * config.head_dim
            self.k_proj = nn.Linear(H, kvd, bias=False)
            self.v_proj = nn.Linear(H, kvd, bias=False)
            # inference (fuse_weights): the layer's q/k/v and this k/v over one unit-weight RMSNorm of h
            self.register_buffer("qkvkv_weight", None, persistent=False)
            self.register_buffer("unit_weight", None, persistent=False)

    @staticmethod
    def previous(h: torch.Tensor, block_size: int) -> torch.Tensor:
        """h ``[B, N*bs, H]`` -> the state of the preceding slot in the same block (zeros at slot 0)."""
        B, T, H = h.shape
        hb = h.view(B, T // block_size, block_size, H)
        return F.pad(hb[:, :, :-1], (0, 0, 1, 0)).view(B, T, H)

    def forward(self, h: torch.Tensor, block_size: int) -> torch.Tensor:
        """``residual`` mode on h ``[B, N*bs, H]``; a module call, so DeepSpeed ZeRO-3 gathers ``gate``."""
        prev = self.previous(h, block_size)
        inj = self.gate * self.proj(self.norm(prev))
        slot = torch.arange(h.shape[1], device=h.device) % block_size
        return h + inj * (slot > 0)[None, :, None].to(inj.dtype)


class DraftLayer(nn.Module):
    def __init__(self, config: DSpineConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)
        self.sliding = config.layer_types[index] == "sliding_attention"
        if config.injection != "none" and index in config.injection_layers:
            self.adjacent = AdjacentInjection(config)
        else:
            self.adjacent = None

    def forward(self, h, ctx_k, ctx_v, rope_blk, rope_prev, mask, block_size: int):
        """One draft layer over block states h ``[B, T, H]`` (T = N blocks x bs, back to back).

        ctx_k/ctx_v ``[B, Hkv, S, D]``: this layer's context keys/values (from the fused target
        features, RoPE applied). rope_blk/rope_prev: (cos, sin) ``[B, T, D]`` at the slots' positions
        and one position earlier. mask: visibility over keys ``[ctx ; block ; extra]``."""
        attn = self.self_attn
        extra = None
        if self.adjacent is not None:
            if self.adjacent.mode == "residual":
                h = self.adjacent(h, block_size)
            else:
                prev = self.adjacent.norm(AdjacentInjection.previous(h, block_size))
                extra = attn.kv(prev, *rope_prev, self.adjacent.k_proj, self.adjacent.v_proj)
        x = self.input_layernorm(h)
        q = attn.q(x, *rope_blk)
        k_blk, v_blk = attn.kv(x, *rope_blk)
        ks, vs = [ctx_k, k_blk], [ctx_v, v_blk]
        if extra is not None:
            ks.append(extra[0])
            vs.append(extra[1])
        out = attend(q, torch.cat(ks, dim=2), torch.cat(vs, dim=2), mask, attn.scale)
        h = h + attn.o_proj(out)
        return h + self.mlp(self.post_attention_layernorm(h))

    def block_step(self, h, delta, k_ctx, v_ctx, ctx: BlockContext, impl: str):
        """This layer over the N = B·bs block rows ``h [N, H]`` with the previous layer's pending residual
        ``delta [N, H]`` (None for layer 0): returns (h, delta) for the next layer. Same equations as
        :meth:`forward`, through ``dspine.ops`` (each residual add fused into the following norm).

        k_ctx/v_ctx ``[B, Hkv, C, D]``: this layer's context cache (ring of C positions if sliding).

        Cost of the residual injection (docs/method.md §3) over a DFlash layer: one ``shift_rms_norm``
        launch (it also finishes the previous layer's residual add, so it replaces nothing and moves
        4·N·H elements) and one projection GEMM (low rank: two, unless ``fuse_weights`` folded up·down
        into one H×H weight, which it does when that reads fewer bytes than a second launch costs);
        ``gate ⊙ inj`` and ``+ h`` ride in the ``input_layernorm`` launch DFlash has anyway. Predicted
        at Qwen3-8B shape (H200, bf16, N = 16, full rank): ≈ 3 µs + 33.5 MB / 4.2 TB/s ≈ 11 µs per
        layer, ≈ 55 µs for 5 layers, ≈ 0.9% of the 6.5 ms speculative step (results/engine-h200.json);
        SmolLM2 (H = 576, rank 128 folded): ≈ 6 µs per layer, 3 layers ≈ 2% of a ≈ 1 ms step.
        With the kv injection and fused weights (:meth:`DSpineDraftModel.fuse_weights`), both norms of h
        (``input_layernorm`` and the injection's) are one unit-weight RMSNorm ``u = h / rms(h)`` whose
        weights are folded into one GEMM: ``[q; k; v; k'; v'] = u · [W_qkv·diag(w_in); W_kv'·diag(w_adj)]ᵀ``
        (equal in exact arithmetic: ``W (u ⊙ w) = (W diag(w)) u``). Row s's ``k'/v'`` is slot s+1's
        extra key/value, written at position s by one ``qk_norm_rope_cache`` into slot s+1 of a scratch
        of bs+1 slots (slot 0's extra key is masked). Over a DFlash layer that costs one launch and
        4·Hkv·D more GEMM columns (unfused: a shifted norm, two GEMMs, a concatenation and the write)."""
        at, eps, bs = self.self_attn, self.input_layernorm.eps, ctx.block_size
        B, N = h.shape[0] // bs, h.shape[0]
        Hq, Hkv, D = at.num_heads, at.num_kv_heads, at.head_dim
        k_extra = v_extra = gate = None
        adj = self.adjacent
        if adj is not None and adj.mode == "kv" and adj.qkvkv_weight is not None:
            if delta is None:
                u = rms_norm(h, adj.unit_weight, eps, impl=impl)
            else:
                u, h = rms_norm(delta, adj.unit_weight, eps, residual=h, impl=impl)
            q, k, v, k2, v2 = F.linear(u, adj.qkvkv_weight).split([Hq * D] + [Hkv * D] * 4, dim=-1)
            kx, vx = ctx.scratch(B, Hkv, D, h.dtype, extra_slot=True)
            qk_norm_rope_cache(None, k2.reshape(N, Hkv, D), v2.reshape(N, Hkv, D), None, at.k_norm.weight, eps,
                               ctx.cos, ctx.sin, ctx.positions, kx, vx, ctx.rows, ctx.slots + 1, impl=impl)
            k_extra, v_extra = kx[:, :, :bs].transpose(1, 2), vx[:, :, :bs].transpose(1, 2)
            return self._attend_mlp(h, q, k, v, k_ctx, v_ctx, ctx, k_extra, v_extra, impl)
        if self.adjacent is not None:
            adj = self.adjacent
            prev, h = shift_rms_norm(h if delta is None else delta, adj.norm.weight, eps, bs,
                                     residual=None if delta is None else h, impl=impl)
            if adj.mode == "residual":
                delta = adj.proj(prev) if adj.proj_weight is None else F.linear(prev, adj.proj_weight)
                gate = adj.gate
            else:
                delta = None
                kv = torch.cat([adj.k_proj(prev), adj.v_proj(prev)], -1)
                k_extra, v_extra = ctx.scratch(B, Hkv, D, h.dtype)
                qk_norm_rope_cache(None, *(t.view(N, Hkv, D) for t in kv.split(Hkv * D, -1)), None, at.k_norm.weight,
                                   eps, ctx.cos, ctx.sin, ctx.prev_positions, k_extra, v_extra, ctx.rows, ctx.slots,
                                   impl=impl)
                k_extra, v_extra = k_extra.transpose(1, 2), v_extra.transpose(1, 2)
        w = self.input_layernorm.weight
        if delta is None:
            x = rms_norm(h, w, eps, impl=impl)
        else:
            x, h = rms_norm(delta, w, eps, residual=h, scale=gate, impl=impl)
        qkv = at.project(x) if at.qkv_weight is None else linear(x, at.qkv_weight, impl=impl, exact=False)
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        return self._attend_mlp(h, q, k, v, k_ctx, v_ctx, ctx, k_extra, v_extra, impl)

    def _attend_mlp(self, h, q, k, v, k_ctx, v_ctx, ctx: BlockContext, k_extra, v_extra, impl: str):
        """The rest of :meth:`block_step` after the q/k/v projection (rows ``[N, ·]``): RoPE + q/k norms,
        block attention over context, block (and extra) keys, o_proj, residual add, MLP."""
        at, eps, bs = self.self_attn, self.input_layernorm.eps, ctx.block_size
        B, N = h.shape[0] // bs, h.shape[0]
        Hq, Hkv, D = at.num_heads, at.num_kv_heads, at.head_dim
        k_blk, v_blk = ctx.scratch(B, Hkv, D, h.dtype)
        q = qk_norm_rope_cache(q.reshape(N, Hq, D), k.reshape(N, Hkv, D), v.reshape(N, Hkv, D), at.q_norm.weight,
                               at.k_norm.weight, eps, ctx.cos, ctx.sin, ctx.positions, k_blk, v_blk, ctx.rows,
                               ctx.slots, impl=impl)
        window = ctx.window if self.sliding else None
        o = draft_attention(q.view(B, bs, Hq, D), k_ctx, v_ctx, ctx.lengths, k_blk.transpose(1, 2),
                            v_blk.transpose(1, 2), at.scale, window=window, causal=self.sliding or ctx.causal,
                            k_extra=k_extra, v_extra=v_extra, impl=impl)
        o = linear(o.view(N, Hq * D), at.o_proj.weight, at.o_proj.bias, impl=impl, exact=False)
        y, h = rms_norm(o, self.post_attention_layernorm.weight, eps, residual=h, impl=impl)
        return h, self.mlp(y, impl)


@dataclass
class BlockContext:
    """Per-call index tensors of :meth:`DSpineDraftModel.forward_block`, shared by all layers (N = B·bs)."""

    block_size: int
    lengths: torch.Tensor  # [B] int: context positions per row; the anchor sits at lengths[b]
    positions: torch.Tensor  # [N] int64: lengths[b] + t
    prev_positions: torch.Tensor  # [N] int64: one position earlier (the kv injection's keys), >= 0
    rows: torch.Tensor  # [N] int64: b
    slots: torch.Tensor  # [N] int64: t
    cos: torch.Tensor  # RoPE tables [P, D/2] fp32 (dspine.ops.rope.rope_tables)
    sin: torch.Tensor
    window: int | None  # sliding_window of sliding layers
    causal: bool  # block_attention == "causal"

    def scratch(self, B: int, Hkv: int, D: int, dtype, extra_slot: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Two ``[B, Hkv, bs, D]`` buffers for the block's own keys/values (never kept); ``extra_slot``:
        ``[B, Hkv, bs + 1, D]`` (the fused kv injection writes row s at slot s + 1)."""
        shape = (B, Hkv, self.block_size + int(extra_slot), D)
        dev = self.positions.device
        return torch.empty(shape, device=dev, dtype=dtype), torch.empty(shape, device=dev, dtype=dtype)


def block_visibility(q_anchor, q_slot, q_block, k_pos, k_block, k_slot, k_kind, *, causal: bool, window: int | None):
    """The draft's attention rule as a function of broadcastable index tensors (True = visible).

    Queries: anchor position, slot t and block id. Keys: kind 0 = context position ``k_pos``
    (visible iff ``k_pos < anchor`` — the anchor's own target feature is not known at inference —
    and, with a window, ``anchor + t - k_pos < window``); kind 1 = slot s of block ``k_block``
    (same block only; ``s <= t`` when causal); kind 2 = the injected key of slot ``k_slot``
    (only ``s == t`` and ``t >= 1``). docs/method.md §4 (training mask), DFlash sliding layers."""
    ctx = (k_kind == 0) & (k_pos < q_anchor)
    if window is not None:
        ctx = ctx & (q_anchor + q_slot - k_pos < window)
    same = k_block == q_block
    blk = (k_kind == 1) & same
    if causal:
        blk = blk & (k_slot <= q_slot)
    ext = (k_kind == 2) & same & (k_slot == q_slot) & (q_slot >= 1)
    return ctx | blk | ext


class DSpineDraftModel(PreTrainedModel):
    """DSpine / DFlash draft. See the module docstring for the equations.

    Two forwards share the layers: :meth:`forward_train` (many blocks per sequence, block mask)
    and :meth:`forward_block` (one block per sequence over a :class:`DraftCache`)."""

    config_class = DSpineConfig
    base_model_prefix = ""
    _no_split_modules = ["DraftLayer"]
    supports_gradient_checkpointing = False

    def __init__(self, config: DSpineConfig):
        super().__init__(config)
        H = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, AdjacentInjection) and module.mode == "residual":
            module.gate.zero_()

    # -- shared pieces ---------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features ``[B, S, k*H]`` (concat of the target layers' outputs) -> ``c [B, S, H]``."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def _rope(self, positions: torch.Tensor, dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor):
        """Per-layer context keys/values of fused features c ``[B, S, H]`` at ``positions [B, S]``."""
        cos, sin = self._rope(positions, c.dtype)
        return [layer.self_attn.kv(c, cos, sin) for layer in self.layers]

    # -- training forward --------------------------------------------------------------------------
    def forward_train(self, block_embeds, features, anchors, attn: str = "dense"):
        """Draft hidden states for many blocks per sequence (teacher forcing).

        Args:
            block_embeds: ``[B, N*bs, H]`` target embeddings of ``[anchor, MASK x (bs-1)]`` per block.
            features: ``[B, S, k*H]`` target features of the whole sequence (positions 0..S-1).
            anchors: ``[B, N]`` int64 anchor positions; -1 marks a padding block (its outputs are
                garbage and must be masked out of the loss).
            attn: ``"dense"`` (bool mask, SDPA; the CPU reference) or ``"flex"`` (flex_attention).
        Returns:
            ``[B, N*bs, H]`` final-normed hidden states (slot k predicts the token at anchor + k).
        """
        B, T, _ = block_embeds.shape
        bs = self.block_size
        if T % bs:
            raise ValueError(f"block_embeds has {T} slots, not a multiple of block_size={bs}")
        S = features.shape[1]
        c = self.fuse(features)
        ctx_pos = torch.arange(S, device=c.device).expand(B, S)
        ctx_kv = self.context_kv(c, ctx_pos)
        slot = torch.arange(T, device=c.device) % bs
        positions = anchors.clamp(min=0).repeat_interleave(bs, dim=1) + slot
        masks = {
            sliding: self.train_mask(anchors, S, sliding=sliding, kind=attn)
            for sliding in {layer.sliding for layer in self.layers}
        }
        h = block_embeds.to(c.dtype)
        rope_blk = self._rope(positions, h.dtype)
        rope_prev = self._rope((positions - 1).clamp(min=0), h.dtype)
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            h = layer(h, ck, cv, rope_blk, rope_prev, masks[layer.sliding], self.block_size)
        return self.norm(h)

    def train_mask(self, anchors: torch.Tensor, S: int, *, sliding: bool, kind: str = "dense"):
        """The block mask of docs/method.md §4 over keys ``[ctx (S) ; blocks (N*bs) ; extra (N*bs if kv)]``.

        Returns a bool ``[B, 1, N*bs, Tk]`` tensor (``kind="dense"``) or a flex ``BlockMask``."""
        B, N = anchors.shape
        bs = self.block_size
        T = N * bs
        n_kinds = 3 if self.config.injection == "kv" else 2
        Tk = S + (n_kinds - 1) * T
        causal = sliding or self.config.block_attention == "causal"
        window = self.config.sliding_window if sliding else None
        dev = anchors.device

        def key_fields(kv):
            kind = torch.where(kv < S, 0, torch.where(kv < S + T, 1, 2))
            j = torch.where(kind == 1, kv - S, kv - S - T)
            return kind, kv, j // bs, j % bs

        if kind == "dense":
            q = torch.arange(T, device=dev)
            k_kind, k_pos, k_block, k_slot = key_fields(torch.arange(Tk, device=dev))
            q_anchor = anchors.repeat_interleave(bs, dim=1)  # [B, T]
            vis = block_visibility(
                q_anchor[:, :, None], (q % bs)[None, :, None], (q // bs)[None, :, None],
                k_pos[None, None], k_block[None, None], k_slot[None, None], k_kind[None, None],
                causal=causal, window=window,
            )
            return vis[:, None]
        if kind != "flex":
            raise ValueError(f"attn={kind!r} is unknown; choose 'dense' or 'flex'")
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q_idx, kv_idx):
            k_kind, k_pos, k_block, k_slot = key_fields(kv_idx)
            return block_visibility(
                anchors[b, q_idx // bs], q_idx % bs, q_idx // bs, k_pos, k_block, k_slot, k_kind,
                causal=causal, window=window,
            )

        # compiled mask construction: the eager path evaluates mask_mod on all B·T·Tk pairs each step
        return create_block_mask(mask_mod, B, None, T, Tk, device=dev, _compile=dev.type == "cuda")

    # -- inference forward ---------------------------------------------------------------------------
    @torch.no_grad()
    def forward_block(self, block_embeds: torch.Tensor, cache: DraftCache, impl: str = "torch") -> torch.Tensor:
        """One block per sequence over the context cache (the engine's and the reference decoder's draft).

        Args:
            block_embeds: ``[B, bs, H]`` embeddings of ``[anchor, MASK, ...]``; the anchor of row b
                sits at position ``cache.lengths[b]`` (its own target feature is not in the cache).
            cache: :class:`DraftCache` holding the context K/V of positions ``0 .. lengths[b]-1``.
            impl: ``"torch"`` (the reference ops) or ``"triton"``.
        Returns:
            ``[B, bs, H]`` final-normed hidden states in the model dtype. The block's own K/V is not
            kept. No host synchronisation (CUDA-graph safe); autocast is off, the model dtype rules.
        """
        B, bs, H = block_embeds.shape
        if bs != self.block_size:
            raise ValueError(f"block of {bs} slots, the draft was built for block_size={self.block_size}")
        cfg, dev = self.config, block_embeds.device
        t = torch.arange(bs, device=dev)
        positions = (cache.lengths[:, None].long() + t).reshape(-1)
        ctx = BlockContext(bs, cache.lengths, positions, (positions - 1).clamp(min=0),
                           torch.arange(B, device=dev).repeat_interleave(bs), t.repeat(B), cache.cos, cache.sin,
                           cfg.sliding_window, cfg.block_attention == "causal")
        with torch.autocast(dev.type, enabled=False):
            h, delta = block_embeds.to(self.fc.weight.dtype).reshape(B * bs, H), None
            for i, layer in enumerate(self.layers):
                h, delta = layer.block_step(h, delta, *cache.context(i), ctx, impl)
            y, _ = rms_norm(delta, self.norm.weight, self.norm.eps, residual=h, impl=impl)
        return y.view(B, bs, H)

    @torch.no_grad()
    def append_context(self, cache: DraftCache, features: torch.Tensor, counts: torch.Tensor,
                       rows: torch.Tensor | None = None, impl: str = "torch") -> None:
        """Write the context K/V of committed positions and advance ``cache.lengths``.

        Row j of ``features [n, T, k·H]`` belongs to batch row ``rows[j]`` (default j); its first
        ``counts[j]`` entries are the target features of positions ``lengths[rows[j]] + t``, the rest
        (rejected slots) are ignored. K/V = ``k_norm(k_proj(c))`` (RoPE at the position) and
        ``v_proj(c)`` of ``c = hidden_norm(fc(features))`` (docs/method.md §2). No host sync: discarded
        rows go to the cache's scratch slot, so the caller sizes the cache (positions < capacity).
        """
        n, T, _ = features.shape
        dev = features.device
        rows = torch.arange(n, device=dev) if rows is None else rows.to(dev).long()
        counts = counts.to(dev).long()
        start = cache.lengths[rows].long()
        pos = start[:, None] + torch.arange(T, device=dev)  # [n, T]
        end = (start + counts)[:, None].expand(n, T)
        self._write_kv(cache, features.reshape(n * T, -1), rows.repeat_interleave(T), pos.reshape(-1),
                       (pos < end).reshape(-1), end.reshape(-1), impl)
        cache.lengths.index_copy_(0, rows, (start + counts).to(cache.lengths.dtype))

    @torch.no_grad()
    def append_packed(self, cache: DraftCache, features: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor,
                      impl: str = "torch", prefix: bool = False, keep: torch.Tensor | None = None) -> None:
        """:meth:`append_context` for features packed back to back (an admission's prompts, as the target's packed
        prefill returns them): ``features [N, k·H]`` holds ``counts[j]`` rows of batch row ``rows[j]``, then the
        next row's (``N = Σ counts``; no padding, so no padded rows through the fc and K/V GEMMs). The same K/V as
        the padded call up to the GEMMs' rounding at another row count. No host sync.

        ``prefix``: write row ``rows[j]``'s positions ``0 .. counts[j] - 1`` instead, under a row whose length
        already counts them and any later positions (the engine's deferred prompt context, written after the AR
        steps that followed the prompt); its length stays, and a sliding layer's ring skips the positions that
        length has evicted, so the later positions it holds are not overwritten. ``keep [n]`` bool: rows whose
        entries go to the scratch slot when False (a deferred prompt whose request has finished)."""
        n, N = rows.shape[0], features.shape[0]
        dev = features.device
        rows, counts = rows.to(dev).long(), counts.to(dev).long()
        seg = torch.repeat_interleave(torch.arange(n, device=dev), counts, output_size=N)  # row of each entry
        length = cache.lengths[rows].long()
        start = torch.zeros_like(length) if prefix else length
        pos = start[seg] + torch.arange(N, device=dev) - (torch.cumsum(counts, 0) - counts)[seg]
        end = (length if prefix else start + counts)[seg]
        kept = torch.ones_like(pos, dtype=torch.bool) if keep is None else keep.to(dev)[seg]
        self._write_kv(cache, features, rows[seg], pos, kept, end, impl)
        if not prefix:
            cache.lengths.index_copy_(0, rows, (start + counts).to(cache.lengths.dtype))

    def _write_kv(self, cache: DraftCache, features: torch.Tensor, bidx: torch.Tensor, pos: torch.Tensor,
                  keep: torch.Tensor, end: torch.Tensor, impl: str) -> None:
        """K/V of ``features [M, k·H]`` into ``cache``: entry m at batch row ``bidx[m]``, position ``pos[m]``, kept if
        ``keep[m]`` (else the scratch slot); ``end[m]`` is its row's length after the append (a sliding layer's ring
        skips entries evicted within the append). All ``[M]``, int64 / bool."""
        dt, eps = self.fc.weight.dtype, self.config.rms_norm_eps
        Hkv, D = self.config.num_key_value_heads, self.config.head_dim
        with torch.autocast(features.device.type, enabled=False):
            c = rms_norm(F.linear(features.to(dt), self.fc.weight), self.hidden_norm.weight, eps, impl=impl)
            table_pos = pos.clamp(max=cache.cos.shape[0] - 1)  # discarded rows may run past it
            index = {}  # (sliding, cap) -> cache index of each row: shared by the layers of that kind
            for i, layer in enumerate(self.layers):
                cap = cache.caps[i]
                if (layer.sliding, cap) not in index:
                    if layer.sliding:  # ring: position j at j % cap; rows evicted within this append are skipped
                        slot, ok = pos % cap, keep & (pos >= end - cap)
                    else:
                        slot, ok = pos, keep & (pos < cap)
                    index[layer.sliding, cap] = torch.where(ok, slot, cap)  # cap = the scratch slot
                slot = index[layer.sliding, cap]
                k, v = layer.self_attn.project(c, with_q=False).split(Hkv * D, dim=-1)
                qk_norm_rope_cache(None, k.reshape(-1, Hkv, D), v.reshape(-1, Hkv, D), None,
                                   layer.self_attn.k_norm.weight, eps, cache.cos, cache.sin, table_pos,
                                   cache.k[i], cache.v[i], bidx, slot, impl=impl)

    @torch.no_grad()
    def fuse_weights(self) -> DSpineDraftModel:
        """Inference only: q/k/v and gate/up each become one weight (non-persistent buffers) and the
        original parameters views of it, so ``state_dict`` keeps the DFlash names and no memory is
        doubled. A low-rank injection whose H×H product is small (≤ 2rH + 4M elements: one GEMM over it
        costs less than a second launch) gets ``up·down`` folded into one weight. A kv injection gets
        ``[W_qkv·diag(w_in); W_kv'·diag(w_adj)]`` (:meth:`DraftLayer.block_step`), a second copy of the
        layer's q/k/v weight plus the injection's k/v (SmolLM2: 0.8 M elements a layer; Qwen3-8B shape:
        34 M), refreshed in place by a later call. Call after the last
        ``.to()`` (which moves buffer and views apart). Idempotent, and a layer whose views are intact
        keeps its fused tensors (an engine's CUDA graphs hold their addresses: a second engine over the
        same draft must not replace them). Returns self.

        Raises:
            ValueError: a draft with ``attention_bias`` (the fused path has no biases).
        """
        if self.config.attention_bias:
            raise ValueError("draft attention_bias=True is not supported by the fused inference path")

        def fuse(owner, name, linears):
            w = torch.cat([lin.weight for lin in linears])
            setattr(owner, name, w)
            for lin, part in zip(linears, w.split([lin.weight.shape[0] for lin in linears])):
                lin.weight = nn.Parameter(part, requires_grad=False)

        def refresh(owner, name, value):  # in place where it fits: current values at the same address
            old = getattr(owner, name)
            if old is not None and (old.device, old.dtype, old.shape) == (value.device, value.dtype, value.shape):
                with torch.inference_mode(torch.is_inference(old)):
                    old.copy_(value)
            else:
                setattr(owner, name, value)

        for layer in self.layers:
            at, mlp, adj = layer.self_attn, layer.mlp, layer.adjacent
            if at.qkv_weight is None or at.q_proj.weight.data_ptr() != at.qkv_weight.data_ptr():
                fuse(at, "qkv_weight", [at.q_proj, at.k_proj, at.v_proj])  # not fused, or moved apart by .to()
                fuse(mlp, "gate_up_weight", [mlp.gate_proj, mlp.up_proj])
            if adj is not None and adj.mode == "kv":  # norms folded into one GEMM (DraftLayer.block_step)
                w_in, w_adj = layer.input_layernorm.weight.float(), adj.norm.weight.float()
                folded = torch.cat([at.qkv_weight.float() * w_in, torch.cat([adj.k_proj.weight, adj.v_proj.weight]).float()
                                    * w_adj]).to(at.qkv_weight.dtype)
                refresh(adj, "qkvkv_weight", folded)
                refresh(adj, "unit_weight", torch.ones_like(layer.input_layernorm.weight))
            if adj is not None and adj.mode == "residual" and isinstance(adj.proj, LowRank):
                up, down = adj.proj.up.weight, adj.proj.down.weight  # [H, r], [r, H]
                if up.shape[0] ** 2 <= 2 * up.numel() + (1 << 22):
                    refresh(adj, "proj_weight", (up.float() @ down.float()).to(up.dtype))
        return self

    def forward(self, block_embeds, features, anchors, attn: str = "dense"):
        return self.forward_train(block_embeds, features, anchors, attn)


class DraftCache:
    """The draft's context K/V for a batch of rows, in static buffers (the engine's layout).

    ``k[i], v[i]``: ``[B, Hkv, caps[i] + 1, D]`` for draft layer i. A full-attention layer holds
    position j at index j (``caps[i] = capacity``); a sliding-window layer keeps a ring of
    ``min(capacity, sliding_window + bs)`` positions (j at j % cap). The last index is a scratch slot
    that takes the writes :meth:`DSpineDraftModel.append_context` discards. ``lengths [B]`` int32:
    context positions per row. ``cos/sin``: RoPE tables for positions ``< capacity + bs``.
    Appends and reads never synchronise with the host (CUDA-graph safe).
    """

    def __init__(self, model: DSpineDraftModel, batch_size: int, capacity: int, device=None, dtype=None):
        cfg = model.config
        device = device or model.fc.weight.device
        dtype = dtype or model.fc.weight.dtype
        self.model, self.capacity = model, capacity
        self.caps = [min(capacity, cfg.sliding_window + cfg.block_size) if layer.sliding else capacity
                     for layer in model.layers]
        shape = lambda cap: (batch_size, cfg.num_key_value_heads, cap + 1, cfg.head_dim)
        self.k = [torch.zeros(shape(cap), device=device, dtype=dtype) for cap in self.caps]
        self.v = [torch.zeros(shape(cap), device=device, dtype=dtype) for cap in self.caps]
        self.lengths = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.cos, self.sin = rope_tables(cfg.head_dim, capacity + cfg.block_size, cfg.rope_theta, device)

    def context(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's context keys/values ``[B, Hkv, caps[i], D]`` (views without the scratch slot)."""
        return self.k[i][:, :, : self.caps[i]], self.v[i][:, :, : self.caps[i]]

    def view(self, batch_size: int, lengths: torch.Tensor | None = None) -> DraftCache:
        """The first ``batch_size`` rows (shared storage); ``lengths`` replaces the length tensor (the
        engine shares its slot lengths, so appends advance them)."""
        out = copy.copy(self)
        out.k, out.v = [k[:batch_size] for k in self.k], [v[:batch_size] for v in self.v]
        out.lengths = self.lengths[:batch_size] if lengths is None else lengths
        return out

    def append(self, features: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor | None = None,
               impl: str = "torch") -> None:
        """Append the first ``counts[j]`` rows of ``features [n, T, k*H]`` (see
        :meth:`DSpineDraftModel.append_context`)."""
        self.model.append_context(self, features, counts, rows, impl)

    def append_packed(self, features: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor,
                      impl: str = "torch", prefix: bool = False, keep: torch.Tensor | None = None) -> None:
        """Append ``features [Σ counts, k*H]`` packed row after row, or write them as the rows' first positions
        (``prefix``; see :meth:`DSpineDraftModel.append_packed`)."""
        self.model.append_packed(self, features, counts, rows, impl, prefix, keep)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


AutoModel.register(DSpineConfig, DSpineDraftModel, exist_ok=True)  # AutoModel.from_pretrained of a draft folder
