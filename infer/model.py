"""The engine's own target model: Qwen3 and the Llama / Qwen2 family, over a static KV cache.

Weights load straight from Hugging Face safetensors (sharded or not) into modules built on the
meta device; q/k/v and gate/up are fused at load time (the checkpoint keeps the HF names). Every
op is a kernel from ``dspine.ops`` with a selectable ``impl`` ("triton" on the GPU, "torch" as
the reference and on the CPU), plus cuBLAS matmuls. Numerics follow transformers'
``modeling_qwen3`` / ``modeling_llama`` op by op (bf16 residual adds, fp32 norm statistics, RoPE
rotate-half), so logits match transformers to bf16 rounding.

Sliding-window targets (Qwen2/Qwen3 ``use_sliding_window``, per-layer ``layer_types``): a sliding
layer's query at position p attends to keys p - window + 1 .. p (transformers' mask) in prefill
(SDPA with a band mask), verify and decode (``verify_attention(window=...)``); the KV cache stays
full-length.

Hybrid targets (``qwen3_5_text``, ``qwen3_next``; issue 14): gated delta-rule layers
(:mod:`infer.linear_attention`, fla-core kernels under impl "triton") with per-slot conv and fp32
recurrent states in the cache, rolled back after a verify by masked replay (:meth:`EngineTarget.commit_states`);
gated full attention (sigmoid output gate from q_proj) with partial rotary (q/k channels permuted at
load, :func:`rope_permutation`); zero-centred RMSNorm weights folded to 1 + w at load; Qwen3-Next's
sparse MoE. Chain verify only (no tree, no exact mode). Other layer types are refused at config parsing.

Exact mode (``forward_step(exact=True)``, issue 13): every matmul of the decode/verify step is
``dspine.ops.linear``'s row-invariant GEMM and attention is ``verify_attention(exact=True)``; the
norms, q/k-norm+RoPE and SwiGLU kernels are per row already. So a position's logits are bitwise
the same in a 1-token step and in a verify block of any width, at any batch size, with or
without CUDA graphs. A tree verify (``tree_bits``) uses ``tree_attention(exact=True)``: a node's logits
are those of the last token of its path decoded one token at a time. Prefill keeps cuBLAS; the
engine prefills one prompt per pass in exact mode so that a prompt's prefill does not depend on
which prompts are admitted with it.

Features for the draft are the decoder-layer outputs (residual stream after layer i) at the
draft's ``target_layer_ids``, the last layer's after the final norm under the draft's
``last_layer_features = "post_norm"`` — the same tensors ``dspine.target.TargetAdapter`` returns.
"""

from __future__ import annotations

import copy
import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspine.config import (
    ROPE_IMPLEMENTED,
    check_target_layers,
    is_multimodal,
    target_layer_types,
    text_config,
    unsupported_rope,
)
from dspine.io import read_safetensors
from dspine.ops._common import env_choice
from dspine.ops.linear import SPLIT_PROGRAMS_LIMIT, act_input, fast_config_rows, linear, linear_triton
from dspine.ops.lm_head import lm_head as lm_head_op
from dspine.ops.rmsnorm import rms_norm
from dspine.ops.rope import qk_norm_rope_cache, rope_tables
from dspine.ops.sdpa import backends_context
from dspine.ops.silu_mul import silu_mul
from dspine.ops.tree_attention import tree_attention, tree_paths
from dspine.ops.verify_attention import verify_attention
from dspine.paths import read_json_object, resolve_model_path, snapshot_folder
from infer import linear_attention

SUPPORTED = ("qwen3", "qwen2", "llama", "qwen3_5_text", "qwen3_next")
HYBRID = ("qwen3_5_text", "qwen3_next")  # gated delta-rule + gated full attention (infer.linear_attention)
# Exact mode's default (engine, CLIs). Issue 13: on if it costs <= 3% against the fast mode at 8B
# shape; off until benchmarks/engine/bench_exact.py has measured it on a GPU.
EXACT_DEFAULT = False


FUSE_NORM_MODES = ("auto", "on", "off")  # EngineTarget.fuse_norm


def to_device(values: list[int], dtype: torch.dtype, device) -> torch.Tensor:
    """Host integers as a tensor on ``device`` without a stream sync: on CUDA a pinned copy with
    ``non_blocking`` (a copy from pageable memory waits for the stream's work in flight first, CUDA's rule for
    host-to-device copies from pageable memory, so an admission made while a decode step runs would idle the
    device for the rest of that step). torch's pinned allocator keeps the host block until the copy is done."""
    t = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def prefill_bucket(P: int, capacity: int) -> int:
    """Padded length of a bucketed prefill (:meth:`EngineTarget.prefill_static`): the next multiple of 64 up
    to 512 tokens (at most 63 tokens of padding), of 256 up to 2,048 (up to 50% past 512, 255 tokens), of 1,024
    up to PREFILL_BUCKET_MAX (8,192), capped at the cache ``capacity``: 20 buckets at most. Raises ValueError
    for P < 1 or P > min(capacity, PREFILL_BUCKET_MAX) (longer prompts prefill unpadded)."""
    if not 1 <= P <= min(capacity, PREFILL_BUCKET_MAX):
        raise ValueError(f"prompt of {P} tokens: need 1 <= P <= {min(capacity, PREFILL_BUCKET_MAX)} (the cache's "
                         f"positions, and PREFILL_BUCKET_MAX for a bucketed prefill)")
    step = 64 if P <= 512 else 256 if P <= 2048 else 1024
    return min(-(-P // step) * step, capacity)


PREFILL_BUCKET_MAX = 8192  # longest bucketed prefill; longer prompts take the unpadded pass


@dataclass
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k
    qkv_bias: bool  # Qwen2: biases on q/k/v
    windows: tuple[int | None, ...] = ()  # per layer: sliding window (keys p-w+1 .. p), None = full attention
    # hybrid targets (HYBRID): per-layer "attention" | "linear" (gated delta rule); empty = all attention
    layer_kinds: tuple[str, ...] = ()
    gated_attention: bool = False  # q_proj also yields an output gate: o * sigmoid(gate) before o_proj
    norm_offset: bool = False  # RMSNorm weights are stored as w - 1 (zero-centred): folded to 1 + w at load
    rotary_dim: int = 0  # RoPE on the first rotary_dim channels of a head (partial_rotary_factor); 0 = head_dim
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    conv_kernel: int = 0
    # Qwen3-Next sparse MoE MLP (moe_layers[i]: layer i is sparse): top-k softmax router, shared expert
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()

    @property
    def hybrid(self) -> bool:
        return "linear" in self.layer_kinds

    @classmethod
    def from_hf_config(cls, cfg) -> ModelArgs:
        """From a transformers config object or a config.json dict (a multimodal qwen3_5: its ``text_config``).

        Raises:
            ValueError: an unsupported layer type (:func:`dspine.config.check_target_layers`), model type or
                RoPE (:func:`dspine.config.check_rope`), named in the message.
        """
        mt = (cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k, None))("model_type")
        windows = check_target_layers(cfg, f"target (model_type {mt})")
        cfg = text_config(cfg)  # a multimodal qwen3_5 (checked above): its text model
        get = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        mt = get("model_type")
        if mt not in SUPPORTED:
            raise ValueError(f"target model_type={mt!r} is not supported by the engine (supported: {SUPPORTED})")
        rope = get("rope_scaling") or get("rope_parameters") or {}
        problems = unsupported_rope(cfg)
        if mt in HYBRID:  # the engine implements partial rotary for these (ModelArgs.rotary_dim)
            problems = [p for p in problems if "partial_rotary_factor" not in p]
        if problems:
            raise ValueError(f"target (model_type {mt}): {', '.join(problems)} is not implemented by the engine "
                             f"(it implements {ROPE_IMPLEMENTED}, and partial rotary for {HYBRID}); refused instead "
                             "of decoding it as full plain RoPE")
        theta = get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None) or 10000.0
        H, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        head_dim = int(get("head_dim") or H // heads)
        extra = {}
        if mt in HYBRID:
            factor = (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) \
                or get("partial_rotary_factor") or 1.0
            kinds = tuple("linear" if t == "linear_attention" else "attention" for t in target_layer_types(cfg))
            n_exp = int(get("num_experts", 0) or 0) if mt == "qwen3_next" else 0
            step, only = int(get("decoder_sparse_step", 1) or 1), set(get("mlp_only_layers") or [])
            extra = dict(
                layer_kinds=kinds, gated_attention=True, norm_offset=True, rotary_dim=int(head_dim * float(factor)),
                lin_k_heads=int(get("linear_num_key_heads")), lin_v_heads=int(get("linear_num_value_heads")),
                lin_k_dim=int(get("linear_key_head_dim")), lin_v_dim=int(get("linear_value_head_dim")),
                conv_kernel=int(get("linear_conv_kernel_dim")), num_experts=n_exp,
                top_k=int(get("num_experts_per_tok", 0) or 0), norm_topk_prob=bool(get("norm_topk_prob", True)),
                moe_intermediate_size=int(get("moe_intermediate_size", 0) or 0),
                shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 0) or 0),
                moe_layers=tuple(n_exp > 0 and i not in only and (i + 1) % step == 0 for i in range(len(kinds))))
            if extra["rotary_dim"] % 2 or extra["lin_v_heads"] % extra["lin_k_heads"]:
                raise ValueError(f"target (model_type {mt}): rotary dim {extra['rotary_dim']} must be even and "
                                 f"linear_num_value_heads={extra['lin_v_heads']} a multiple of "
                                 f"linear_num_key_heads={extra['lin_k_heads']}")
        return cls(
            model_type=mt, vocab_size=int(get("vocab_size")), hidden_size=H,
            intermediate_size=int(get("intermediate_size")), num_layers=int(get("num_hidden_layers")),
            num_heads=heads, num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=head_dim, rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=float(theta), max_position_embeddings=int(get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)), qk_norm=mt in ("qwen3",) + HYBRID,
            qkv_bias=bool(get("attention_bias", mt == "qwen2")), windows=tuple(windows), **extra,
        )


class Layer(nn.Module):
    """One decoder layer: attention (q/k/v [+ output gate] fused in ``qkv``) or a gated delta-rule layer
    (``kind == "linear"``, :mod:`infer.linear_attention`), then a SwiGLU MLP or a sparse MoE."""

    def __init__(self, a: ModelArgs, i: int = 0):
        super().__init__()
        H, D = a.hidden_size, a.head_dim
        p = lambda *shape: nn.Parameter(torch.empty(*shape), requires_grad=False)
        self.kind = a.layer_kinds[i] if a.layer_kinds else "attention"
        self.moe = bool(a.moe_layers and a.moe_layers[i])
        self.input_norm = p(H)
        if self.kind == "linear":
            Hv, Vd = a.lin_v_heads, a.lin_v_dim
            conv = 2 * a.lin_k_heads * a.lin_k_dim + Hv * Vd
            self.in_proj = p(conv + Hv * Vd + 2 * Hv, H)  # x (conv input: q, k, v), z, b, a
            self.conv = p(conv, a.conv_kernel)
            self.A_log, self.dt_bias, self.lin_norm = p(Hv), p(Hv), p(Vd)
            self.o = p(H, Hv * Vd)
        else:
            qkv = (a.num_heads * (2 if a.gated_attention else 1) + 2 * a.num_kv_heads) * D
            self.qkv = p(qkv, H)  # q, k, v, then the output gate (gated attention)
            self.qkv_bias = p(qkv) if a.qkv_bias else None
            self.q_norm = p(D) if a.qk_norm else None
            self.k_norm = p(D) if a.qk_norm else None
            self.o = p(H, a.num_heads * D)
        self.post_norm = p(H)
        if self.moe:
            E, I, S = a.num_experts, a.moe_intermediate_size, a.shared_expert_intermediate_size
            self.router, self.experts_gate_up, self.experts_down = p(E, H), p(E, 2 * I, H), p(E, H, I)
            self.gate_up, self.down, self.shared_gate = p(2 * S, H), p(H, S), p(1, H)  # the shared expert
        else:
            self.gate_up = p(2 * a.intermediate_size, H)
            self.down = p(H, a.intermediate_size)


@functools.lru_cache(maxsize=16)
def _accepts(fn, name: str) -> bool:
    """Whether callable ``fn`` takes a keyword ``name`` (torch APIs gain keywords between releases)."""
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class _VarlenFailed(Exception):
    """``varlen_attn`` itself refused the call (no flash kernel for this GPU, an older signature): the packed
    prefill falls back to one SDPA call per prompt. Raised only around that call, so a bug elsewhere in the
    layers is not taken for it."""


def target_rope_tables(a: ModelArgs, seq: int, device):
    """(cos, sin) ``[seq, head_dim/2]`` fp32 for the engine's rotate-half kernels. Partial rotary
    (rotary_dim r < D, transformers' ``partial_rotary_factor``): the first r/2 pairs carry HF's
    frequencies base^(-2i/r), the other pairs angle 0 (cos 1, sin 0: passed through unchanged). The
    q/k channels are permuted at load (:func:`rope_permutation`) so that HF's pairs (i, i + r/2) become
    the kernels' pairs (j, j + D/2); q·k is unchanged by a permutation applied to both."""
    r = a.rotary_dim or a.head_dim
    cos, sin = rope_tables(r, seq, a.rope_theta, device)
    if r < a.head_dim:
        pad = torch.zeros(seq, (a.head_dim - r) // 2, device=cos.device)
        cos, sin = torch.cat([cos, pad + 1.0], 1), torch.cat([sin, pad], 1)
    return cos, sin


def rope_permutation(a: ModelArgs) -> torch.Tensor | None:
    """Head-channel order for partial rotary (see :func:`target_rope_tables`): new channel j holds HF
    channel perm[j]; None when RoPE covers the whole head."""
    D, r = a.head_dim, a.rotary_dim or a.head_dim
    if r == D:
        return None
    h, p = r // 2, (D - r) // 2
    return torch.cat([torch.arange(0, h), torch.arange(r, r + p), torch.arange(h, r), torch.arange(r + p, D)])


class KVCache:
    """Static per-slot target state. Attention layers: K/V ``[B, Hkv, S, D]``, position j of batch slot b
    at ``[b, :, j]`` (None for linear layers), views of one tensor ``kv [2, La, B, Hkv, S, D]`` (K then V of
    the La attention layers in layer order; None without attention layers). Linear (gated delta-rule) layers: ``conv[i]``
    ``[B, C, K-1]`` (model dtype) and ``state[i]`` ``[B, Hv, Dk, Dv]`` fp32 (None for attention layers),
    plus ``pending`` (the inputs of the last verify step, :func:`infer.linear_attention.commit`). And
    the RoPE tables (cos, sin) ``[S, D/2]`` fp32 of its positions. The cache owns the tables, so a CUDA
    graph that reads them stays valid whatever other caches of the same target are made later."""

    def __init__(self, a: ModelArgs, batch: int, seq: int, device, dtype):
        shape = (batch, a.num_kv_heads, seq, a.head_dim)
        kinds = a.layer_kinds or ("attention",) * a.num_layers
        n_att = sum(k == "attention" for k in kinds)
        # one tensor for every attention layer's K and V, so a step that moves K/V rows (the tree step's
        # accepted path) does it in one gather and one scatter for all layers instead of a gather and a scatter
        # for K and for V in every layer
        self.kv = torch.zeros(2, n_att, *shape, device=device, dtype=dtype) if n_att else None
        slot = iter(range(n_att))
        att_ids = [next(slot) if k == "attention" else None for k in kinds]
        self.k = [None if j is None else self.kv[0, j] for j in att_ids]
        self.v = [None if j is None else self.kv[1, j] for j in att_ids]
        conv = 2 * a.lin_k_heads * a.lin_k_dim + a.lin_v_heads * a.lin_v_dim
        self.conv = [torch.zeros(batch, conv, a.conv_kernel - 1, device=device, dtype=dtype) if k == "linear"
                     else None for k in kinds]
        self.state = [torch.zeros(batch, a.lin_v_heads, a.lin_k_dim, a.lin_v_dim, device=device, dtype=torch.float32)
                      if k == "linear" else None for k in kinds]
        self.pending: dict[int, tuple] = {}
        self.batch, self.seq = batch, seq
        self.cos, self.sin = target_rope_tables(a, seq, device)

    def view(self, batch: int) -> KVCache:
        """The first ``batch`` slots (shared storage and tables; its own ``pending``)."""
        out = copy.copy(self)
        cut = lambda xs: [None if x is None else x[:batch] for x in xs]
        out.k, out.v, out.conv, out.state, out.batch = cut(self.k), cut(self.v), cut(self.conv), cut(self.state), batch
        out.kv = None if self.kv is None else self.kv[:, :, :batch]
        out.pending = {}
        return out


class EngineTarget(nn.Module):
    """Target forward for prefill (one sequence) and decode/verify steps (a batch, T tokens each)."""

    def __init__(self, a: ModelArgs, layer_ids: list[int] | None = None, impl: str = "triton",
                 last_layer_features: str = "post_norm"):
        super().__init__()
        self.args = a
        p = lambda *shape: nn.Parameter(torch.empty(*shape), requires_grad=False)
        self.embed = p(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Layer(a, i) for i in range(a.num_layers))
        self.norm = p(a.hidden_size)
        self.lm_head = None if a.tie_word_embeddings else p(a.vocab_size, a.hidden_size)
        self.layer_ids = list(layer_ids or [])
        self.last_layer_features = last_layer_features  # "post_norm" | "pre_norm" (the draft's config)
        self.impl = impl
        self.scale = a.head_dim ** -0.5
        # decode/verify steps: norms folded into the linear layers (fuse_norms); DSPINE_FUSE_NORM, default off (measured slower)
        self.fuse_norm = env_choice("DSPINE_FUSE_NORM", FUSE_NORM_MODES, "off")

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_hf_state(cls, a: ModelArgs, state: dict[str, torch.Tensor], device, dtype, layer_ids=None,
                      impl: str = "triton", last_layer_features: str = "post_norm") -> EngineTarget:
        """Build from HF tensor names (``model.layers.{i}.self_attn.q_proj.weight`` …), fusing
        q/k/v and gate/up. Raises KeyError naming a missing tensor."""
        with torch.device("meta"):
            m = cls(a, layer_ids, impl, last_layer_features)

        def get(name, norm: bool = False):
            if name not in state:
                raise KeyError(f"target checkpoint has no tensor {name!r}")
            t = state[name]
            if norm and a.norm_offset:  # zero-centred RMSNorm: y = x̂ · (1 + w), folded in fp32
                t = t.float() + 1.0
            return t.to(device=device, dtype=dtype)

        perm = rope_permutation(a)
        D = a.head_dim

        def heads(w, n, take=None):  # [n·D', H] per-head rows: take = slice of each head, then perm
            w = w.view(n, -1, w.shape[-1])
            w = w[:, take] if take is not None else w
            return (w[:, perm] if perm is not None else w).reshape(-1, w.shape[-1])

        own = {"embed": get("model.embed_tokens.weight"), "norm": get("model.norm.weight", norm=True)}
        if not a.tie_word_embeddings:
            own["lm_head"] = get("lm_head.weight")
        for i, L in enumerate(m.layers):
            pre = f"model.layers.{i}."
            at = pre + "self_attn."
            own |= {f"layers.{i}.input_norm": get(pre + "input_layernorm.weight", norm=True),
                    f"layers.{i}.post_norm": get(pre + "post_attention_layernorm.weight", norm=True)}
            if L.kind == "linear":
                own |= {f"layers.{i}.{k}": v for k, v in linear_attention.load_linear_layer(a, get, pre).items()}
            else:
                q = get(at + "q_proj.weight")
                gate = []
                if a.gated_attention:  # q_proj rows per head: [query D | gate D]
                    gate = [q.view(a.num_heads, 2 * D, -1)[:, D:].reshape(-1, q.shape[-1])]
                    q = q.view(a.num_heads, 2 * D, -1)[:, :D].reshape(-1, q.shape[-1])
                own |= {
                    f"layers.{i}.qkv": torch.cat([heads(q, a.num_heads), heads(get(at + "k_proj.weight"), a.num_kv_heads),
                                                  get(at + "v_proj.weight")] + gate),
                    f"layers.{i}.o": get(at + "o_proj.weight"),
                }
                if a.qkv_bias:
                    if a.gated_attention or perm is not None:
                        raise ValueError("attention biases with gated attention / partial rotary are not implemented")
                    own[f"layers.{i}.qkv_bias"] = torch.cat([get(at + f"{x}_proj.bias") for x in "qkv"])
                if a.qk_norm:
                    for x in "qk":
                        w = get(at + f"{x}_norm.weight", norm=True)
                        own[f"layers.{i}.{x}_norm"] = w[perm] if perm is not None else w
            if L.moe:
                mp = pre + "mlp."
                if mp + "experts.gate_up_proj" in state:  # transformers >= 5 fused layout [E, 2I, H], [E, H, I]
                    gu, dn = get(mp + "experts.gate_up_proj"), get(mp + "experts.down_proj")
                else:  # per-expert tensors (the published checkpoints)
                    E = range(a.num_experts)
                    gu = torch.stack([torch.cat([get(mp + f"experts.{e}.gate_proj.weight"),
                                                 get(mp + f"experts.{e}.up_proj.weight")]) for e in E])
                    dn = torch.stack([get(mp + f"experts.{e}.down_proj.weight") for e in E])
                sp = mp + "shared_expert."
                own |= {f"layers.{i}.router": get(mp + "gate.weight"), f"layers.{i}.experts_gate_up": gu,
                        f"layers.{i}.experts_down": dn, f"layers.{i}.shared_gate": get(mp + "shared_expert_gate.weight"),
                        f"layers.{i}.gate_up": torch.cat([get(sp + "gate_proj.weight"), get(sp + "up_proj.weight")]),
                        f"layers.{i}.down": get(sp + "down_proj.weight")}
            else:
                own |= {f"layers.{i}.gate_up": torch.cat([get(pre + "mlp.gate_proj.weight"),
                                                          get(pre + "mlp.up_proj.weight")]),
                        f"layers.{i}.down": get(pre + "mlp.down_proj.weight")}
        m.load_state_dict(own, strict=True, assign=True)
        return m

    @classmethod
    def from_pretrained(cls, path: str, gguf_file: str | None = None, device="cuda", dtype=torch.bfloat16,
                        layer_ids=None, impl: str = "triton", last_layer_features: str = "post_norm") -> EngineTarget:
        """Load a local HF folder (safetensors, sharded or not) or a GGUF file (dequantized by
        transformers). Raises FileNotFoundError / ValueError naming the file or field."""
        path, gguf_file = resolve_model_path(path, gguf_file)
        folder = snapshot_folder(path)
        if gguf_file:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf_file, dtype=torch.float32)
            a = ModelArgs.from_hf_config(hf.config)
            return cls.from_hf_state(a, hf.state_dict(), device, dtype, layer_ids, impl, last_layer_features)
        cfg_file = folder / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file}: missing")
        cfg = read_json_object(cfg_file, "a model config")
        a = ModelArgs.from_hf_config(cfg)  # a multimodal qwen3_5: its text model, its tensors only (no vision tower)
        return cls.from_hf_state(a, read_safetensors(folder, device, multimodal=is_multimodal(cfg)), device, dtype,
                                 layer_ids, impl, last_layer_features)

    # -- helpers ---------------------------------------------------------------------------------
    @property
    def head(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    def logits(self, h: torch.Tensor, exact: bool = False, lm_head: str = "linear") -> torch.Tensor:
        """``h [..., H] -> [..., V]`` (model dtype) through the head: ``dspine.ops.linear``'s row-invariant
        GEMM when ``exact``, else ``dspine.ops.lm_head`` candidate ``lm_head`` (the engine's choice for
        this row count; "linear" = ``F.linear``)."""
        if exact:
            return linear(h, self.head, impl=self.impl, exact=True)
        return lm_head_op(h, self.head, lm_head)

    def new_cache(self, batch: int, seq: int) -> KVCache:
        """Static cache of ``seq`` positions per slot (the engine checks the RoPE range before)."""
        return KVCache(self.args, batch, seq, self.embed.device, self.embed.dtype)

    def window(self, i: int) -> int | None:
        """Sliding window of layer i (None: full attention)."""
        return self.args.windows[i] if self.args.windows else None

    def _prompt_attention(self, i: int, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """Causal SDPA of a prompt's queries q ``[1, Hq, P, D]`` over its own keys kc/vc ``[1, Hkv, P, D]``;
        a sliding layer masks keys before p - window + 1. Called inside :meth:`prefill_packed`'s
        :func:`~dspine.ops.sdpa.backends_context` (no cuDNN: it plans every new prompt length)."""
        a, w = self.args, self.window(i)
        P = q.shape[2]
        gqa = a.num_heads != a.num_kv_heads
        mask = None
        if w is not None and w < P:
            j = torch.arange(P, device=q.device)
            mask = (j[None, :] <= j[:, None]) & (j[None, :] > j[:, None] - w)  # [P, P]
            if gqa:  # SDPA's GQA flag takes flash or math only, and flash no mask: repeat for memory-efficient
                kc, vc = (x.repeat_interleave(a.num_heads // a.num_kv_heads, dim=1) for x in (kc, vc))
                gqa = False
        return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                              enable_gqa=gqa)

    # packed prefill attention through one varlen flash call (issue 11); set False after a failed call
    varlen_prefill = True

    def _varlen_ok(self, n_prompts: int, device: torch.device) -> bool:
        """Whether a packed prefill of ``n_prompts`` (> 1) runs its attention as one varlen call: CUDA,
        bf16/fp16, ``torch.nn.attention.varlen`` present, not switched off by an earlier failure."""
        if not (self.varlen_prefill and n_prompts > 1 and device.type == "cuda" and not self.args.hybrid
                and self.embed.dtype in (torch.bfloat16, torch.float16)):
            return False
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        except ImportError:
            self.varlen_prefill = False
            return False
        return True

    def _varlen_attention(self, i: int, q: torch.Tensor, cache: KVCache, bidx: torch.Tensor, pos: torch.Tensor,
                          cu: torch.Tensor, max_len: int) -> torch.Tensor:
        """Causal attention of packed prompts in one call: q ``[N, Hq·D]`` (prompt j = rows cu[j]..cu[j+1]-1),
        keys/values gathered from the cache rows just written (slot ``bidx``, position ``pos``) ->
        ``[N, Hq·D]``. Each prompt sees only its own keys (``cu`` int32 ``[k + 1]``): the per-prompt SDPA
        loop's result up to the flash kernel's rounding, with one launch per layer instead of ~8 per
        prompt. Full-attention layers only (sliding layers keep the loop)."""
        from torch.nn.attention.varlen import varlen_attn

        a = self.args
        N = q.shape[0]
        k = cache.k[i][bidx, :, pos]  # [N, Hkv, D]
        v = cache.v[i][bidx, :, pos]
        gqa = {}
        if a.num_heads != a.num_kv_heads:
            if _accepts(varlen_attn, "enable_gqa"):
                gqa = {"enable_gqa": True}
            else:  # torch <= 2.11: no GQA flag, so each key/value head is repeated for its query heads
                k, v = (x.repeat_interleave(a.num_heads // a.num_kv_heads, dim=1) for x in (k, v))
        try:  # (varlen_attn picks its kernel itself: flash, or cuDNN on sm90/sm100 in releases that follow the
            # SDPA backend priority, which the prefill's backends_context then steers away from; see dspine.ops.sdpa)
            o = varlen_attn(q.reshape(N, a.num_heads, a.head_dim), k, v, cu, cu, max_len, max_len,
                            scale=self.scale, window_size=(-1, 0), **gqa)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError) as e:
            raise _VarlenFailed(str(e).splitlines()[0][:200] if str(e) else type(e).__name__) from e
        return o.reshape(N, a.num_heads * a.head_dim)

    def _experts(self, L: Layer, h: torch.Tensor) -> torch.Tensor:
        """Qwen3-Next routed experts of h ``[N, H]`` [transformers modeling_qwen3_next]: softmax router in
        fp32, top-k (renormalised when ``norm_topk_prob``), weights in the model dtype, each token's k
        experts' SwiGLU summed. The k experts' weights are gathered per token ``[N, k, 2I, H]``: static
        shapes (CUDA-graph capturable) and exact, but it reads N·k expert matrices: fine for a few
        verify tokens of a small MoE, not a fast path for large ones."""
        a = self.args
        probs = torch.softmax(F.linear(h, L.router).float(), dim=-1)
        w, idx = torch.topk(probs, a.top_k, dim=-1)  # [N, k]
        if a.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        gu = torch.einsum("nh,nkih->nki", h, L.experts_gate_up[idx])  # [N, k, 2I]
        act = silu_mul(gu, impl=self.impl)  # [N, k, I]
        out = torch.einsum("nki,nkhi->nkh", act, L.experts_down[idx])  # [N, k, H]
        return (out * w.to(h.dtype)[..., None]).sum(1)

    # -- forwards --------------------------------------------------------------------------------
    def fuse_norms(self, rows: int, exact: bool = False) -> bool:
        """Whether a step of ``rows`` new tokens runs the fused path of :meth:`_layers`: each RMSNorm folded into
        the linear layers around it (``dspine.ops.linear.linear_triton``'s ``residual=`` epilogue on the o and down
        projections, ``norm=`` prologue on the next qkv and gate/up), so no norm kernel runs between layers.

        ``fuse_norm`` (attribute; its default is the environment variable ``DSPINE_FUSE_NORM``, else "off": on the
        H200 the fused path made the Qwen3-8B-shape AR step at batch 1 1.10× as long, results/engine-fusenorm-h200.json;
        its prologue and epilogue add 16-17 µs of linear time a layer, results/linear-fusion-h200.json): "off" never; "on" whenever it applies (Triton, not exact, attention layers with a
        dense MLP; the tests run it in the CPU interpreter); "auto" where it applies and the fast path runs
        the Triton kernel anyway (``dspine.ops.linear.fast_config_rows``: CUDA, bf16, and the device's tuned file
        prefers it for all four layer weights at this row count, ``fast`` up to 16 rows, ``fast_wide`` above), so
        that no cuBLAS call is traded for it. Not in exact mode: the fused statistic sums the
        squares in the producer's tile order, which is not row invariant across tile configurations."""
        a, mode = self.args, self.fuse_norm
        if mode not in FUSE_NORM_MODES:
            raise ValueError(f"fuse_norm must be 'auto', 'on' or 'off', got {mode!r}")
        if mode == "off" or exact or self.impl != "triton" or a.hybrid or any(L.moe for L in self.layers):
            return False
        if mode == "on":
            return True
        L = self.layers[0]
        return all(fast_config_rows(rows, w) is not None for w in (L.qkv, L.o, L.gate_up, L.down))

    def _layers(self, tokens: torch.Tensor, pos: torch.Tensor, bidx: torch.Tensor, cache: KVCache, attend,
                want_features: bool, write_pos: torch.Tensor | None = None, exact: bool = False, mix=None,
                fused: bool = False):
        """The decoder stack over N new tokens (flattened). ``attend(i, q [N, Hq, D]) -> [N, Hq*D]`` runs
        attention of layer i after this token's K/V were written at (bidx, write_pos); RoPE uses ``pos``
        (write_pos defaults to pos; they differ for tree nodes). ``mix(i, L, h [N, H]) -> [N, H]`` runs
        linear-attention layer i (hybrid targets). ``exact``: row-invariant matmuls
        (``dspine.ops.linear``). ``fused``: the norms folded into the linear layers (:meth:`fuse_norms`).
        Returns the final hidden state x, the residual stream and {layer id: decoder-layer output}; with
        ``fused``, x is None and the residual stream already holds the last layer's output (residual + x)."""
        write_pos = pos if write_pos is None else write_pos
        a, impl = self.args, self.impl
        N = tokens.shape[0]
        cos, sin = cache.cos, cache.sin
        Hq, Hkv, D = a.num_heads, a.num_kv_heads, a.head_dim
        x = F.embedding(tokens, self.embed)
        residual = sumsq = None
        # the draft's features [N, k·H]: layer i's output (residual + x) is the residual sum that layer i + 1's
        # input norm computes anyway, so that norm writes it into i's column block (no add, no concatenation);
        # fused, the down projection's residual epilogue writes it there
        ids, H = (self.layer_ids if want_features else []), a.hidden_size
        feats = x.new_empty(N, len(ids) * H) if ids else None
        col = self._feature_columns() if ids else {}
        into = None  # the column block the next input norm writes its residual sum into

        def lin(inp, w, bias=None, **fuse):  # fused: the fast path's Triton kernel with a prologue/epilogue
            inp, fuse["act"] = act_input(inp, fuse.get("act"), impl)
            return linear_triton(inp, w, bias, cfg=fast_config_rows(N, w), split_programs=N <= SPLIT_PROGRAMS_LIMIT,
                                 **fuse)

        for i, L in enumerate(self.layers):
            h = None
            if sumsq is None:
                if residual is None:
                    h, residual = rms_norm(x, L.input_norm, a.rms_norm_eps, impl=impl), x
                else:
                    h, residual = rms_norm(x, L.input_norm, a.rms_norm_eps, residual=residual, impl=impl,
                                           residual_out=into)
            into = None
            if L.kind == "linear":
                x = mix(i, L, h)
            else:
                if h is None:  # fused: the input norm of residual (the previous layer's output) as qkv loads it
                    qkv = lin(residual, L.qkv, L.qkv_bias, norm=(L.input_norm, sumsq, a.rms_norm_eps))
                else:
                    qkv = linear(h, L.qkv, L.qkv_bias, impl=impl, exact=exact)
                q, k, v, gate = qkv.split([Hq * D, Hkv * D, Hkv * D, Hq * D if a.gated_attention else 0], dim=-1)
                q = qk_norm_rope_cache(q.view(N, Hq, D), k.view(N, Hkv, D), v.view(N, Hkv, D), L.q_norm, L.k_norm,
                                       a.rms_norm_eps, cos, sin, pos, cache.k[i], cache.v[i], bidx, write_pos,
                                       impl=impl)
                o = attend(i, q)
                if a.gated_attention:  # Qwen3.5 / Qwen3-Next output gate
                    o = o * torch.sigmoid(gate)
                if fused:
                    block = feats[:, col[i] * H : (col[i] + 1) * H] if i in col else None
                    residual, sumsq = lin(o, L.o, residual=residual)
                    up = lin(residual, L.gate_up, norm=(L.post_norm, sumsq, a.rms_norm_eps))
                    residual, sumsq = lin(up, L.down, act="silu_mul", residual=residual, out=block)
                    x = None
                    continue
                x = linear(o, L.o, impl=impl, exact=exact)
            h, residual = rms_norm(x, L.post_norm, a.rms_norm_eps, residual=residual, impl=impl)
            up = linear(h, L.gate_up, impl=self.impl, exact=exact)
            x = linear(up, L.down, impl=self.impl, exact=exact, act="silu_mul")  # silu(gate)·up as the kernel loads it
            if L.moe:  # the shared expert above, gated; plus the routed experts
                x = self._experts(L, h) + torch.sigmoid(F.linear(h, L.shared_gate)) * x
            if i in col:  # the HF decoder layer's output, residual + x
                block = feats[:, col[i] * H : (col[i] + 1) * H]
                if i + 1 < len(self.layers):
                    into = block
                else:
                    torch.add(residual, x, out=block)
        return x, residual, feats

    def _feature_columns(self) -> dict[int, int]:
        """Target layer id -> its column block in the features (its first position in ``layer_ids``). Raises
        ValueError for an id outside 0 .. num_layers - 1 (its block would never be written)."""
        col: dict[int, int] = {}
        bad = [i for i in self.layer_ids if not 0 <= i < self.args.num_layers]
        if bad:
            raise ValueError(f"feature layer ids {bad} outside the target's layers 0..{self.args.num_layers - 1} "
                             f"(layer_ids={self.layer_ids})")
        for j, i in enumerate(self.layer_ids):
            col.setdefault(i, j)
        return col

    def _features(self, feats: torch.Tensor | None, want: bool) -> torch.Tensor | None:
        """The features ``[N, k·H]`` that :meth:`_layers` wrote, finished: the last layer's block through the final
        norm (``last_layer_features == "post_norm"``), a repeated layer id's block copied from its first."""
        if not want or feats is None:
            return None
        H, last, col = self.args.hidden_size, self.args.num_layers - 1, self._feature_columns()
        if self.last_layer_features == "post_norm" and last in col:
            # DFlash's convention: the last layer's feature is HF hidden_states[L], after the final norm
            block = feats[:, col[last] * H : (col[last] + 1) * H]
            rms_norm(block, self.norm, self.args.rms_norm_eps, impl=self.impl, out=block)
        for j, i in enumerate(self.layer_ids):
            if col[i] != j:
                feats[:, j * H : (j + 1) * H] = feats[:, col[i] * H : (col[i] + 1) * H]
        return feats

    def forward_step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, cache_len: torch.Tensor,
                     want_features: bool = True, tree_bits: torch.Tensor | None = None, exact: bool = False,
                     lm_head: str = "linear"):
        """Decode (T = 1) or verify (T = block) step for every batch slot.

        Args:
            tokens, positions: ``[B, T]`` int64; positions[b, t] = cache_len[b] + t.
            cache: the static KV cache (B slots); K/V of the new tokens are written at ``positions``.
            cache_len: ``[B]`` int32 committed positions before the new tokens.
            tree_bits: ``[B, T]`` int64 ancestor bitmasks (``dspine.tree.ancestor_bits``) for a tree
                verify: token t is tree node t at RoPE position ``positions[b, t]`` (prefix + depth),
                its K/V are written at cache_len[b] + t and it attends to the prefix and its ancestors.
            exact: row-invariant kernels (module docstring): a position's logits do not depend on T,
                B or the other rows; a tree node's are those of its path's last token decoded one at a time
                (``tree_attention(exact=True)``; depth = ``positions - cache_len``).
            lm_head: the head's implementation when not ``exact`` (:meth:`logits`).
        Hybrid targets: a T = 1 step commits the linear layers' states in place; a T > 1 (verify) step
        leaves them and keeps its inputs until :meth:`commit_states` says how many tokens each row keeps.

        Returns:
            logits ``[B, T, V]`` (model dtype) and features ``[B, T, k*H]`` (or None).
        Raises:
            ValueError: ``tree_bits`` on a target with sliding-window layers (tree attention has no window); a
                hybrid target with ``tree_bits`` or ``exact``.
        """
        a = self.args
        if tree_bits is not None and any(w is not None for w in a.windows):
            raise ValueError(f"tree verify (tree_bits given) on a target with sliding-window layers (windows "
                             f"{sorted({w for w in a.windows if w is not None})}): tree attention has no window; "
                             "use chain verify")
        B, T = tokens.shape
        bidx = torch.arange(B, device=tokens.device).repeat_interleave(T)
        depth = path = None
        if exact and tree_bits is not None:  # once per step: every layer's exact tree attention reads the same paths
            depth = positions - cache_len[:, None].long()
            path = tree_paths(tree_bits, depth)

        def attend(i, q):
            if tree_bits is not None:
                o = tree_attention(q.view(B, T, a.num_heads, a.head_dim), cache.k[i], cache.v[i], cache_len,
                                   tree_bits, self.scale, impl=self.impl, exact=exact, depth=depth, path=path)
                return o.view(B * T, -1)
            o = verify_attention(q.view(B, T, a.num_heads, a.head_dim), cache.k[i], cache.v[i], cache_len,
                                 self.scale, impl=self.impl, window=self.window(i), exact=exact)
            return o.view(B * T, -1)

        if a.hybrid and (tree_bits is not None or exact):
            raise ValueError("hybrid targets (linear-attention layers) support chain verify only, without exact mode")

        def mix(i, L, h):
            return linear_attention.step(a, L, i, h.view(B, T, -1), cache, self.impl).reshape(B * T, -1)

        write = None
        if tree_bits is not None:
            write = (cache_len[:, None].long() + torch.arange(T, device=tokens.device)).reshape(-1)
        x, residual, feats = self._layers(tokens.reshape(-1), positions.reshape(-1), bidx, cache, attend, want_features,
                                          write, exact, mix, fused=self.fuse_norms(B * T, exact))
        if x is None:  # fused layers: residual is already the last layer's output
            h = rms_norm(residual, self.norm, a.rms_norm_eps, impl=self.impl)
        else:
            h, _ = rms_norm(x, self.norm, a.rms_norm_eps, residual=residual, impl=self.impl)
        logits = self.logits(h, exact, lm_head).view(B, T, -1)
        f = self._features(feats, want_features)
        return logits, None if f is None else f.view(B, T, -1)

    def commit_states(self, cache: KVCache, n: torch.Tensor) -> None:
        """After a verify step (T > 1) of a hybrid target: advance the linear layers' conv and recurrent
        states by the first ``n [B]`` (int) verified tokens of each row, 0 = unchanged (rollback, see
        :mod:`infer.linear_attention`). No-op for attention-only targets and after a T = 1 step."""
        if cache.pending:
            linear_attention.commit(cache, n, self.impl)

    def prefill(self, tokens: torch.Tensor, slot: int, cache: KVCache, want_features: bool = True):
        """Prompt ``tokens [P]`` of batch slot ``slot``: writes K/V at positions 0..P-1 (and, for a hybrid
        target, the slot's linear-layer states from zero).

        Returns logits at the last position ``[V]`` and features ``[P, k*H]`` (or None): :meth:`prefill_packed` of
        one prompt, whose attention is causal SDPA over the prompt itself (stale cache rows are never read)."""
        logits, feats = self.prefill_packed([tokens], [slot], cache, want_features)
        return logits[0], feats

    def prefill_static(self, tokens: torch.Tensor, slot: torch.Tensor, last: torch.Tensor, cache: KVCache,
                       want_features: bool = True):
        """One prompt padded to a fixed length, with no host-side values: static shapes, so one CUDA graph of
        it serves every slot and every prompt of its length bucket (:func:`prefill_bucket`).

        Args:
            tokens: ``[Pb]`` int64, the prompt followed by any valid ids (padding).
            slot: ``[1]`` int64 on the device, the batch slot written.
            last: ``[1]`` int64 on the device, the prompt's last position (P - 1).
        Returns:
            logits ``[1, V]`` at ``last`` and features ``[Pb, k*H]`` (or None); rows past ``last`` are padding.

        K/V are written at positions 0..Pb-1 of the slot: the padding's rows lie past the prompt, where
        decoding writes before it reads. Attention is causal over the rows just written (gathered from the
        cache by slot and position), so no real position sees the padding; each position's result equals
        :meth:`prefill`'s up to matmul rounding (the matmuls see Pb rows instead of P: about 1e-6 in fp32, bf16
        rounding in bf16, so greedy output can part at near-ties in bf16). Attention-only targets (a hybrid
        target's recurrent state would run over the padding)."""
        a = self.args
        if a.hybrid:
            raise ValueError("prefill_static: hybrid targets (linear-attention layers) prefill unpadded")
        Pb = tokens.shape[0]
        if Pb > cache.seq:
            raise ValueError(f"padded prompt of {Pb} tokens does not fit the cache ({cache.seq} positions)")
        Hq, D = a.num_heads, a.head_dim
        pos = torch.arange(Pb, device=tokens.device)
        bidx = slot.expand(Pb).contiguous()  # kernels read index vectors packed (dspine.ops.rope)

        def attend(i, q):
            kc = cache.k[i][bidx, :, pos].transpose(0, 1)[None]  # [1, Hkv, Pb, D]
            vc = cache.v[i][bidx, :, pos].transpose(0, 1)[None]
            o = self._prompt_attention(i, q.view(1, Pb, Hq, D).transpose(1, 2), kc, vc)
            return o.transpose(1, 2).reshape(Pb, Hq * D)

        with backends_context(tokens.device):
            x, residual, feats = self._layers(tokens, pos, bidx, cache, attend, want_features)
        h, _ = rms_norm(x[last], self.norm, a.rms_norm_eps, residual=residual[last], impl=self.impl)
        return F.linear(h, self.head), self._features(feats, want_features)

    def prefill_packed(self, prompts: list[torch.Tensor], slots: list[int], cache: KVCache,
                       want_features: bool = True):
        """Several prompts in one pass (varlen packing): prompt i ``[P_i]`` goes to batch slot ``slots[i]``.

        The N = Σ P_i tokens run through every matmul together, so admitting k prompts costs one
        forward of N tokens instead of k forwards (the launch count of one prefill is about
        12 per layer, which dominates small targets). Attention is causal SDPA per prompt over its
        own cache rows, one call per prompt, so each prompt's logits equal a one-prompt prefill
        (:meth:`prefill`) up to matmul rounding (exactly in fp32 on the CPU reference path). On a
        GPU in bf16/fp16, k > 1 prompts attend in one varlen flash call per full-attention layer
        instead (:meth:`_varlen_attention`; the per-prompt loop costs ~8 launches per prompt and layer,
        most of a small target's prefill): equal up to the kernels' rounding.

        Returns:
            logits ``[k, V]`` at each prompt's last position and features ``[N, k*H]`` (or None)
            in packed order (prompt i occupies rows ``offsets[i] .. offsets[i+1]-1``).
        Raises:
            ValueError: a prompt longer than the cache.
        """
        a = self.args
        lens = [int(p.shape[0]) for p in prompts]
        if max(lens) > cache.seq:
            raise ValueError(f"prompt of {max(lens)} tokens does not fit the cache ({cache.seq} positions)")
        Hq, D = a.num_heads, a.head_dim
        dev = prompts[0].device
        tokens = torch.cat(prompts)
        starts = [0, *itertools.accumulate(lens)]
        # positions and slots per token from one host-to-device copy, no sync (to_device) and no launch per prompt
        k, N = len(prompts), starts[-1]
        meta = to_device(starts + list(slots) + lens, torch.long, dev)
        starts_d, slots_d, lens_d = meta[: k + 1], meta[k + 1 : 2 * k + 1], meta[2 * k + 1 :]
        seg = torch.repeat_interleave(torch.arange(k, device=dev), lens_d, output_size=N)  # prompt of each token
        pos = torch.arange(N, device=dev) - starts_d[seg]
        bidx = slots_d[seg]

        varlen = self._varlen_ok(len(prompts), dev)
        if varlen:
            cu = starts_d.to(torch.int32)

        def attend(i, q):
            if varlen and self.window(i) is None:
                return self._varlen_attention(i, q, cache, bidx, pos, cu, max(lens))
            out = torch.empty(q.shape[0], Hq * D, device=q.device, dtype=q.dtype)
            for j, (s, n) in enumerate(zip(slots, lens)):
                kc, vc = cache.k[i][s : s + 1, :, :n], cache.v[i][s : s + 1, :, :n]
                qj = q[starts[j] : starts[j + 1]].view(1, n, Hq, D).transpose(1, 2)
                o = self._prompt_attention(i, qj, kc, vc)
                out[starts[j] : starts[j + 1]] = o.transpose(1, 2).reshape(n, Hq * D)
            return out

        def mix(i, L, h):
            return torch.cat([linear_attention.prefill(a, L, i, h[starts[j]:starts[j + 1]], s, cache, self.impl)
                              for j, s in enumerate(slots)])

        with backends_context(dev):  # one switch per prefill (about 12 µs of host time each way)
            try:
                x, residual, feats = self._layers(tokens, pos, bidx, cache, attend, want_features, mix=mix)
            except _VarlenFailed as e:  # no flash kernel for this GPU, an older varlen_attn: the loop, from now on
                print(f"note: varlen prefill attention failed ({e}); using one SDPA call per prompt", flush=True)
                self.varlen_prefill = varlen = False
                x, residual, feats = self._layers(tokens, pos, bidx, cache, attend, want_features, mix=mix)
        last = starts_d[1:] - 1
        h, _ = rms_norm(x[last], self.norm, a.rms_norm_eps, residual=residual[last], impl=self.impl)
        return F.linear(h, self.head), self._features(feats, want_features)
