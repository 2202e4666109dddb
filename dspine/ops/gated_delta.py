"""Gated delta rule: the recurrent linear attention of Qwen3.5 / Qwen3-Next's ``linear_attention`` layers.

Op [Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025; transformers' modeling_qwen3_5 and
modeling_qwen3_next]: per value head, token t, with q_t and k_t L2-normalised (eps 1e-6 inside the
root), q_t scaled by Dk^-1/2, decay g_t <= 0 (log space), write strength beta_t in (0, 1) and the state
S [Dk, Dv] (fp32):

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t.

Chunked form (T > 1; our unrolling of that recurrence over a chunk of C tokens, with
Gamma_t = g_1 + ... + g_t inside the chunk and S0 the state before it):

    (I + A) U = beta (V - e^Gamma K S0),   A[t, s] = beta_t e^(Gamma_t - Gamma_s) k_t.k_s  (s < t)
    O = e^Gamma Q S0 + (e^(Gamma_t - Gamma_s) q_t.k_s)_{s <= t} U
    S_C = e^Gamma_C S0 + sum_s e^(Gamma_C - Gamma_s) k_s u_s^T

(a unit lower-triangular solve per chunk; every exponent is <= 0). A token with beta_t = 0 and g_t = 0
leaves the state unchanged, which the engine's rollback uses (``infer.model``).

Layouts: q, k ``[B, T, Hk, Dk]``; v ``[B, T, Hv, Dv]`` with Hv a multiple of Hk (value head h reads
q/k head h // (Hv / Hk)); g, beta ``[B, T, Hv]``; state ``[B, Hv, Dk, Dv]`` fp32 (not modified).
Returns o ``[B, T, Hv, Dv]`` in v's dtype and the final state ``[B, Hv, Dk, Dv]`` fp32.

impl "triton": fla-core's ``chunk_gated_delta_rule`` (T > 1) and ``fused_recurrent_gated_delta_rule``
(T = 1) (``pip install --no-deps fla-core einops``; imported at the first call, so a CPU-only install
never needs it). impl "torch": the formulas above in fp32, the reference for tests.
"""

from __future__ import annotations

import torch

from ._common import pick_impl

__all__ = ["gated_delta_rule", "gated_delta_rule_torch", "l2norm"]

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in x's dtype (fla's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _check(q, k, v, g, beta, state):
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if k.shape != q.shape or v.shape[:2] != (B, T) or Hv % Hk:
        raise ValueError(f"gated_delta_rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need q = k "
                         "[B, T, Hk, Dk], v [B, T, Hv, Dv] with Hv a multiple of Hk")
    if g.shape != (B, T, Hv) or beta.shape != (B, T, Hv) or state.shape != (B, Hv, Dk, Dv):
        raise ValueError(f"gated_delta_rule: g {tuple(g.shape)}, beta {tuple(beta.shape)}, state {tuple(state.shape)}: "
                         f"need [B, T, Hv] = {(B, T, Hv)} and [B, Hv, Dk, Dv] = {(B, Hv, Dk, Dv)}")
    if state.dtype != torch.float32:
        raise ValueError(f"gated_delta_rule: state dtype {state.dtype}, need float32")


def gated_delta_rule_torch(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Reference (module docstring): the recurrence for T = 1, the chunked form for T > 1, in fp32."""
    _check(q, k, v, g, beta, state)
    B, T, Hk, Dk = q.shape
    Hv = v.shape[2]
    rep, dtype = Hv // Hk, v.dtype
    f = lambda x: x.float().transpose(1, 2)  # [B, H, T, ...]
    q = l2norm(f(q)).repeat_interleave(rep, 1) * Dk ** -0.5
    k = l2norm(f(k)).repeat_interleave(rep, 1)
    v, g, beta = f(v), f(g), f(beta)  # [B, Hv, T, Dv], [B, Hv, T]
    S = state.clone()
    if T == 1:
        S = S * g[..., 0, None, None].exp()
        u = beta[..., 0, None] * (v[:, :, 0] - (S * k[:, :, 0, :, None]).sum(-2))  # [B, Hv, Dv]
        S = S + k[:, :, 0, :, None] * u[..., None, :]
        o = (S * q[:, :, 0, :, None]).sum(-2)[:, :, None]
        return o.transpose(1, 2).to(dtype), S
    outs = []
    for c0 in range(0, T, chunk):
        qc, kc, vc = q[:, :, c0:c0 + chunk], k[:, :, c0:c0 + chunk], v[:, :, c0:c0 + chunk]
        gam = g[:, :, c0:c0 + chunk].cumsum(-1)  # [B, Hv, C]
        bc = beta[:, :, c0:c0 + chunk]
        C = gam.shape[-1]
        diff = gam[..., :, None] - gam[..., None, :]  # [B, Hv, C, C]: Gamma_t - Gamma_s
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower, diff, torch.full_like(diff, -torch.inf)).exp()  # 0 above the diagonal
        eg = gam.exp()[..., None]  # [B, Hv, C, 1]
        A = (bc[..., None] * decay * (kc @ kc.transpose(-1, -2))).tril(-1)
        rhs = bc[..., None] * (vc - eg * (kc @ S))
        eye = torch.eye(C, dtype=A.dtype, device=A.device)
        U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        outs.append(eg * (qc @ S) + (decay * (qc @ kc.transpose(-1, -2))) @ U)
        last = (gam[..., -1:] - gam).exp()  # [B, Hv, C]: e^(Gamma_C - Gamma_s)
        S = gam[..., -1, None, None].exp() * S + (kc * last[..., None]).transpose(-1, -2) @ U
    return torch.cat(outs, 2).transpose(1, 2).to(dtype), S


def gated_delta_rule_triton(q, k, v, g, beta, state):
    """fla-core kernels (module docstring): chunked for T > 1, fused recurrent for T = 1."""
    _check(q, k, v, g, beta, state)
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError as e:
        raise ImportError("impl='triton' of the gated delta rule needs fla-core (pip install --no-deps fla-core "
                          f"einops): {e}") from e
    fn = fused_recurrent_gated_delta_rule if q.shape[1] == 1 else chunk_gated_delta_rule
    q, k, v = (x.contiguous() for x in (q, k, v))  # split views of the conv output
    o, S = fn(q, k, v, g=g.float().contiguous(), beta=beta.to(q.dtype).contiguous(), scale=q.shape[-1] ** -0.5,
              initial_state=state.contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o.to(v.dtype), S.float()


def gated_delta_rule(q, k, v, g, beta, state, impl: str = "triton"):
    """Outputs ``[B, T, Hv, Dv]`` (v's dtype) and the final state ``[B, Hv, Dk, Dv]`` fp32 from ``state``
    (module docstring for the op, layouts and sources). Raises ValueError on inconsistent shapes or a
    non-fp32 state; ImportError for impl "triton" without fla-core."""
    fn = pick_impl(impl, gated_delta_rule_triton, gated_delta_rule_torch)
    return fn(q, k, v, g, beta, state)
