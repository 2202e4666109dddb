"""The engine's gated delta-rule (``linear_attention``) layer of hybrid targets (Qwen3.5, Qwen3-Next).

Layer [transformers' modeling_qwen3_5 ``Qwen3_5GatedDeltaNet``; modeling_qwen3_next]: from the normed
hidden state h ``[N, H]``: x = in_proj_qkv(h) ``[N, C]`` (C = 2·Hk·Dk + Hv·Dv), z = in_proj_z(h),
b, a = in_proj_b/a(h) ``[N, Hv]``; x goes through a causal depthwise conv1d of width K (no bias) and
SiLU, then splits into q, k ``[Hk, Dk]`` and v ``[Hv, Dv]``; beta = sigmoid(b),
g = -exp(A_log) · softplus(a + dt_bias) (fp32); o = gated delta rule (``dspine.ops.gated_delta``);
y = out_proj(RMSNorm(o) · w · silu(z)) per value head (norm before gate). Qwen3-Next's interleaved
``in_proj_qkvz`` / ``in_proj_ba`` are split into these pieces at load time.

State per batch slot: the conv state (the last K-1 inputs x, model dtype) and the recurrent state
``[Hv, Dk, Dv]`` (fp32), in static per-slot buffers of :class:`infer.model.KVCache`.

Rollback on rejection: **masked replay of the accepted tokens**. A verify step of T tokens computes
its outputs from the committed state without writing it and keeps the step's conv inputs and its
q, k, v, g, beta (``cache.pending``); after acceptance, :func:`commit` runs the delta rule once more
from the committed state over the same T tokens with beta = g = 0 past the row's n committed tokens
(such a token leaves the state unchanged), and takes the conv state from the inputs at n .. n+K-2.
Why not keep per-position states from the verify pass: at a 27B-class layout (48 linear layers,
48 value heads of 128x128 fp32) one position's states are 151 MiB per sequence, so a 16-wide verify
would write 2.4 GiB per sequence and step; the replay reads and writes the state once more per
layer (3 MiB) and keeps the step's shapes static (CUDA-graph capturable). Decode steps (T = 1)
commit in place: every live row commits its one token, and an idle row's state is rewritten by the
prefill that admits its next request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspine.ops.gated_delta import gated_delta_rule
from dspine.ops.linear import linear


def load_linear_layer(a, get, pre: str) -> dict[str, torch.Tensor]:
    """Engine tensors of linear-attention layer ``pre`` (``model.layers.{i}.``) from HF names.

    Returns {"in_proj": [C + Hv·Dv + 2·Hv, H] (x, z, b, a rows), "conv": [C, K], "A_log", "dt_bias": [Hv],
    "norm": [Dv], "out": [H, Hv·Dv]}. Raises KeyError (``get``) naming a missing tensor."""
    la = pre + "linear_attn."
    Hk, Hv, Dk, Dv = a.lin_k_heads, a.lin_v_heads, a.lin_k_dim, a.lin_v_dim
    if a.model_type == "qwen3_next":  # per k-head groups [q, k, v, z] and [b, a]: split and regroup
        r = Hv // Hk
        qkvz = get(la + "in_proj_qkvz.weight").view(Hk, 2 * Dk + 2 * r * Dv, -1)
        q, k, v, z = qkvz.split([Dk, Dk, r * Dv, r * Dv], dim=1)
        ba = get(la + "in_proj_ba.weight").view(Hk, 2 * r, -1)
        b, a_ = ba.split([r, r], dim=1)
        flat = lambda t: t.reshape(-1, t.shape[-1])
        rows = [flat(q), flat(k), flat(v), flat(z), flat(b), flat(a_)]
    else:
        rows = [get(la + f"in_proj_{x}.weight") for x in ("qkv", "z", "b", "a")]
    return {"in_proj": torch.cat(rows), "conv": get(la + "conv1d.weight").reshape(-1, a.conv_kernel),
            "A_log": get(la + "A_log"), "dt_bias": get(la + "dt_bias"), "lin_norm": get(la + "norm.weight"),
            "o": get(la + "out_proj.weight")}


def _mix(a, L, h: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor, impl: str):
    """Shared body: h ``[B, T, H]`` -> (core output before the gated norm ``[B, T, Hv, Dv]``, z, the conv
    window ``[B, C, K-1+T]`` (conv state then the new inputs), q, k, v, g, beta, final state)."""
    B, T, _ = h.shape
    Hk, Hv, Dk, Dv = a.lin_k_heads, a.lin_v_heads, a.lin_k_dim, a.lin_v_dim
    C = 2 * Hk * Dk + Hv * Dv
    proj = linear(h, L.in_proj, impl=impl, exact=False)
    x, z, b, al = proj.split([C, Hv * Dv, Hv, Hv], dim=-1)
    window = torch.cat([conv_state, x.transpose(1, 2).to(conv_state.dtype)], dim=2)  # [B, C, K-1+T]
    xc = F.silu(F.conv1d(window, L.conv[:, None, :], groups=C)).transpose(1, 2)  # [B, T, C]
    q, k, v = xc.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q, k, v = q.reshape(B, T, Hk, Dk), k.reshape(B, T, Hk, Dk), v.reshape(B, T, Hv, Dv)
    beta = b.sigmoid()
    g = -L.A_log.float().exp() * F.softplus(al.float() + L.dt_bias)  # [B, T, Hv] fp32
    o, final = gated_delta_rule(q, k, v, g, beta, state, impl=impl)
    return o, z, window, (q, k, v, g, beta), final


def _out(a, L, o: torch.Tensor, z: torch.Tensor, impl: str) -> torch.Tensor:
    """Gated RMSNorm per value head (norm, weight in the model dtype, then silu(z) in fp32), out_proj."""
    dt = o.dtype
    of = o.float()
    normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + a.rms_norm_eps)).to(dt)
    y = (L.lin_norm * normed).float() * F.silu(z.reshape(o.shape).float())
    return linear(y.to(dt).flatten(-2), L.o, impl=impl, exact=False)


def step(a, L, i: int, h: torch.Tensor, cache, impl: str) -> torch.Tensor:
    """Decode (T = 1: state committed in place) or verify (T > 1: ``cache.pending[i]`` for :func:`commit`)
    step of linear layer i over h ``[B, T, H]`` for the cache's B slots; returns ``[B, T, H]``."""
    T = h.shape[1]
    o, z, window, qkvgb, final = _mix(a, L, h, cache.conv[i], cache.state[i], impl)
    if T == 1:
        cache.state[i].copy_(final)
        cache.conv[i].copy_(window[:, :, 1:])
    else:
        cache.pending[i] = (window, qkvgb)
    return _out(a, L, o, z, impl)


def prefill(a, L, i: int, h: torch.Tensor, slot: int, cache, impl: str) -> torch.Tensor:
    """One prompt h ``[P, H]`` into batch slot ``slot`` from zero states; returns ``[P, H]``."""
    conv = torch.zeros_like(cache.conv[i][slot:slot + 1])
    state = torch.zeros_like(cache.state[i][slot:slot + 1])
    o, z, window, _, final = _mix(a, L, h[None], conv, state, impl)
    cache.state[i][slot] = final[0]
    cache.conv[i][slot] = window[0, :, window.shape[2] - conv.shape[2]:]
    return _out(a, L, o, z, impl)[0]


def commit(cache, n: torch.Tensor, impl: str) -> None:
    """Advance every linear layer's states by the first ``n [B]`` (int) tokens of the pending verify step
    (masked replay, module docstring) and clear ``cache.pending``."""
    for i, (window, (q, k, v, g, beta)) in cache.pending.items():
        B, T = g.shape[:2]
        keep = (torch.arange(T, device=g.device)[None, :] < n[:, None].long())[..., None]  # [B, T, 1]
        _, final = gated_delta_rule(q, k, v, g * keep, beta * keep, cache.state[i], impl=impl)
        cache.state[i].copy_(final)
        K1 = cache.conv[i].shape[2]
        idx = n[:, None].long() + torch.arange(K1, device=g.device)  # inputs n .. n+K-2 of the window
        cache.conv[i].copy_(window.gather(2, idx[:, None, :].expand(-1, window.shape[1], -1)))
    cache.pending.clear()
