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
full-length. Layer types other than full / sliding attention are refused at config parsing.

Exact mode (``forward_step(exact=True)``, issue 13): every matmul of the decode/verify step is
``dspine.ops.linear``'s row-invariant GEMM and attention is ``verify_attention(exact=True)``; the
norms, q/k-norm+RoPE and SwiGLU kernels are per row already. So a position's logits are bitwise
the same in a 1-token step and in a verify block of any width, at any batch size, with or
without CUDA graphs. Prefill keeps cuBLAS; the engine prefills one prompt per pass in exact mode
so that a prompt's prefill does not depend on which prompts are admitted with it.

Features for the draft are the decoder-layer outputs (residual stream after layer i) at the
draft's ``target_layer_ids``, the last layer's after the final norm under the draft's
``last_layer_features = "post_norm"`` — the same tensors ``dspine.target.TargetAdapter`` returns.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dspine.config import check_rope, check_target_layers
from dspine.ops.linear import linear
from dspine.ops.rmsnorm import rms_norm
from dspine.ops.rope import qk_norm_rope_cache, rope_tables
from dspine.ops.silu_mul import silu_mul
from dspine.ops.tree_attention import tree_attention
from dspine.ops.verify_attention import verify_attention
from dspine.paths import read_json_object

SUPPORTED = ("qwen3", "qwen2", "llama")
# Exact mode's default (engine, CLIs). Issue 13: on if it costs <= 3% against the fast mode at 8B
# shape; off until benchmarks/engine/bench_exact.py has measured it on a GPU.
EXACT_DEFAULT = False


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

    @classmethod
    def from_hf_config(cls, cfg) -> ModelArgs:
        """From a transformers config object or a config.json dict.

        Raises:
            ValueError: an unsupported layer type (:func:`dspine.config.check_target_layers`), model type or
                RoPE (:func:`dspine.config.check_rope`), named in the message.
        """
        get = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        mt = get("model_type")
        windows = check_target_layers(cfg, f"target (model_type {mt})")
        if mt not in SUPPORTED:
            raise ValueError(f"target model_type={mt!r} is not supported by the engine (supported: {SUPPORTED})")
        check_rope(cfg, f"target (model_type {mt})")
        rope = get("rope_scaling") or get("rope_parameters") or {}
        theta = get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None) or 10000.0
        H, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        return cls(
            model_type=mt, vocab_size=int(get("vocab_size")), hidden_size=H,
            intermediate_size=int(get("intermediate_size")), num_layers=int(get("num_hidden_layers")),
            num_heads=heads, num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or H // heads), rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=float(theta), max_position_embeddings=int(get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)), qk_norm=mt == "qwen3",
            qkv_bias=bool(get("attention_bias", mt == "qwen2")), windows=tuple(windows),
        )


class Layer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        H, D = a.hidden_size, a.head_dim
        qkv = (a.num_heads + 2 * a.num_kv_heads) * D
        p = lambda *shape: nn.Parameter(torch.empty(*shape), requires_grad=False)
        self.input_norm = p(H)
        self.qkv = p(qkv, H)
        self.qkv_bias = p(qkv) if a.qkv_bias else None
        self.q_norm = p(D) if a.qk_norm else None
        self.k_norm = p(D) if a.qk_norm else None
        self.o = p(H, a.num_heads * D)
        self.post_norm = p(H)
        self.gate_up = p(2 * a.intermediate_size, H)
        self.down = p(H, a.intermediate_size)


class KVCache:
    """Static per-layer K/V ``[B, Hkv, S, D]``; position j of batch slot b at ``[b, :, j]``; and the
    RoPE tables (cos, sin) ``[S, D/2]`` fp32 of its positions. The cache owns the tables, so a CUDA
    graph that reads them stays valid whatever other caches of the same target are made later."""

    def __init__(self, a: ModelArgs, batch: int, seq: int, device, dtype):
        shape = (batch, a.num_kv_heads, seq, a.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(a.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(a.num_layers)]
        self.batch, self.seq = batch, seq
        self.cos, self.sin = rope_tables(a.head_dim, seq, a.rope_theta, device)

    def view(self, batch: int) -> KVCache:
        """The first ``batch`` slots (shared storage and tables)."""
        out = copy.copy(self)
        out.k, out.v, out.batch = [k[:batch] for k in self.k], [v[:batch] for v in self.v], batch
        return out


class EngineTarget(nn.Module):
    """Target forward for prefill (one sequence) and decode/verify steps (a batch, T tokens each)."""

    def __init__(self, a: ModelArgs, layer_ids: list[int] | None = None, impl: str = "triton",
                 last_layer_features: str = "post_norm"):
        super().__init__()
        self.args = a
        p = lambda *shape: nn.Parameter(torch.empty(*shape), requires_grad=False)
        self.embed = p(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Layer(a) for _ in range(a.num_layers))
        self.norm = p(a.hidden_size)
        self.lm_head = None if a.tie_word_embeddings else p(a.vocab_size, a.hidden_size)
        self.layer_ids = list(layer_ids or [])
        self.last_layer_features = last_layer_features  # "post_norm" | "pre_norm" (the draft's config)
        self.impl = impl
        self.scale = a.head_dim ** -0.5

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_hf_state(cls, a: ModelArgs, state: dict[str, torch.Tensor], device, dtype, layer_ids=None,
                      impl: str = "triton", last_layer_features: str = "post_norm") -> EngineTarget:
        """Build from HF tensor names (``model.layers.{i}.self_attn.q_proj.weight`` …), fusing
        q/k/v and gate/up. Raises KeyError naming a missing tensor."""
        with torch.device("meta"):
            m = cls(a, layer_ids, impl, last_layer_features)

        def get(name):
            if name not in state:
                raise KeyError(f"target checkpoint has no tensor {name!r}")
            return state[name].to(device=device, dtype=dtype)

        own = {"embed": get("model.embed_tokens.weight"), "norm": get("model.norm.weight")}
        if not a.tie_word_embeddings:
            own["lm_head"] = get("lm_head.weight")
        for i in range(a.num_layers):
            pre = f"model.layers.{i}."
            at = pre + "self_attn."
            own |= {
                f"layers.{i}.input_norm": get(pre + "input_layernorm.weight"),
                f"layers.{i}.qkv": torch.cat([get(at + f"{x}_proj.weight") for x in "qkv"]),
                f"layers.{i}.o": get(at + "o_proj.weight"),
                f"layers.{i}.post_norm": get(pre + "post_attention_layernorm.weight"),
                f"layers.{i}.gate_up": torch.cat([get(pre + "mlp.gate_proj.weight"), get(pre + "mlp.up_proj.weight")]),
                f"layers.{i}.down": get(pre + "mlp.down_proj.weight"),
            }
            if a.qkv_bias:
                own[f"layers.{i}.qkv_bias"] = torch.cat([get(at + f"{x}_proj.bias") for x in "qkv"])
            if a.qk_norm:
                own[f"layers.{i}.q_norm"] = get(at + "q_norm.weight")
                own[f"layers.{i}.k_norm"] = get(at + "k_norm.weight")
        m.load_state_dict(own, strict=True, assign=True)
        return m

    @classmethod
    def from_pretrained(cls, path: str, gguf_file: str | None = None, device="cuda", dtype=torch.bfloat16,
                        layer_ids=None, impl: str = "triton", last_layer_features: str = "post_norm") -> EngineTarget:
        """Load a local HF folder (safetensors, sharded or not) or a GGUF file (dequantized by
        transformers). Raises FileNotFoundError / ValueError naming the file or field."""
        from dspine.target import resolve_model_path

        path, gguf_file = resolve_model_path(path, gguf_file)
        folder = Path(path)
        if not folder.is_dir():
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors"]))
        if gguf_file:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf_file, dtype=torch.float32)
            a = ModelArgs.from_hf_config(hf.config)
            return cls.from_hf_state(a, hf.state_dict(), device, dtype, layer_ids, impl, last_layer_features)
        cfg_file = folder / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file}: missing")
        a = ModelArgs.from_hf_config(read_json_object(cfg_file, "a model config"))
        return cls.from_hf_state(a, read_safetensors(folder, device), device, dtype, layer_ids, impl,
                                 last_layer_features)

    # -- helpers ---------------------------------------------------------------------------------
    @property
    def head(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    def new_cache(self, batch: int, seq: int) -> KVCache:
        """Static cache of ``seq`` positions per slot (the engine checks the RoPE range before)."""
        return KVCache(self.args, batch, seq, self.embed.device, self.embed.dtype)

    def window(self, i: int) -> int | None:
        """Sliding window of layer i (None: full attention)."""
        return self.args.windows[i] if self.args.windows else None

    def _prompt_attention(self, i: int, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """Causal SDPA of a prompt's queries q ``[1, Hq, P, D]`` over its own keys kc/vc ``[1, Hkv, P, D]``;
        a sliding layer masks keys before p - window + 1."""
        a, w = self.args, self.window(i)
        P = q.shape[2]
        mask = None
        if w is not None and w < P:
            j = torch.arange(P, device=q.device)
            mask = (j[None, :] <= j[:, None]) & (j[None, :] > j[:, None] - w)  # [P, P]
        return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                              enable_gqa=a.num_heads != a.num_kv_heads)

    def _mlp(self, L: Layer, h: torch.Tensor, exact: bool = False) -> torch.Tensor:
        up = linear(h, L.gate_up, impl=self.impl, exact=exact)
        return linear(silu_mul(up, impl=self.impl), L.down, impl=self.impl, exact=exact)

    # -- forwards --------------------------------------------------------------------------------
    def _layers(self, tokens: torch.Tensor, pos: torch.Tensor, bidx: torch.Tensor, cache: KVCache, attend,
                want_features: bool, write_pos: torch.Tensor | None = None, exact: bool = False):
        """The decoder stack over N new tokens (flattened). ``attend(i, q [N, Hq, D]) -> [N, Hq*D]`` runs
        attention of layer i after this token's K/V were written at (bidx, write_pos); RoPE uses ``pos``
        (write_pos defaults to pos; they differ for tree nodes). ``exact``: row-invariant matmuls
        (``dspine.ops.linear``). Returns the final hidden state, the residual stream and
        {layer id: decoder-layer output}."""
        write_pos = pos if write_pos is None else write_pos
        a, impl = self.args, self.impl
        N = tokens.shape[0]
        cos, sin = cache.cos, cache.sin
        Hq, Hkv, D = a.num_heads, a.num_kv_heads, a.head_dim
        x = F.embedding(tokens, self.embed)
        residual, feats = None, {}
        for i, L in enumerate(self.layers):
            if residual is None:
                h, residual = rms_norm(x, L.input_norm, a.rms_norm_eps, impl=impl), x
            else:
                h, residual = rms_norm(x, L.input_norm, a.rms_norm_eps, residual=residual, impl=impl)
            qkv = linear(h, L.qkv, L.qkv_bias, impl=impl, exact=exact)
            q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            q = qk_norm_rope_cache(q.view(N, Hq, D), k.view(N, Hkv, D), v.view(N, Hkv, D), L.q_norm, L.k_norm,
                                   a.rms_norm_eps, cos, sin, pos, cache.k[i], cache.v[i], bidx, write_pos, impl=impl)
            x = linear(attend(i, q), L.o, impl=impl, exact=exact)
            h, residual = rms_norm(x, L.post_norm, a.rms_norm_eps, residual=residual, impl=impl)
            x = self._mlp(L, h, exact)
            if want_features and i in self.layer_ids:
                feats[i] = residual + x  # the HF decoder layer's output
        return x, residual, feats

    def _features(self, feats: dict, want: bool):
        if not want or not self.layer_ids:
            return None
        last = self.args.num_layers - 1
        if self.last_layer_features == "post_norm" and last in feats:
            # DFlash's convention: the last layer's feature is HF hidden_states[L], after the final norm
            feats = {**feats, last: rms_norm(feats[last], self.norm, self.args.rms_norm_eps, impl=self.impl)}
        return torch.cat([feats[i] for i in self.layer_ids], dim=-1)

    def forward_step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, cache_len: torch.Tensor,
                     want_features: bool = True, tree_bits: torch.Tensor | None = None, exact: bool = False):
        """Decode (T = 1) or verify (T = block) step for every batch slot.

        Args:
            tokens, positions: ``[B, T]`` int64; positions[b, t] = cache_len[b] + t.
            cache: the static KV cache (B slots); K/V of the new tokens are written at ``positions``.
            cache_len: ``[B]`` int32 committed positions before the new tokens.
            tree_bits: ``[B, T]`` int64 ancestor bitmasks (``dspine.tree.ancestor_bits``) for a tree
                verify: token t is tree node t at RoPE position ``positions[b, t]`` (prefix + depth),
                its K/V are written at cache_len[b] + t and it attends to the prefix and its ancestors.
            exact: row-invariant kernels (module docstring): a position's logits do not depend on T,
                B or the other rows. Chain steps only.
        Returns:
            logits ``[B, T, V]`` (model dtype) and features ``[B, T, k*H]`` (or None).
        Raises:
            ValueError: ``exact`` with ``tree_bits`` (tree attention has no exact mode).
        """
        a = self.args
        if exact and tree_bits is not None:
            raise ValueError("exact=True is not supported for tree verify (tree_bits given)")
        B, T = tokens.shape
        bidx = torch.arange(B, device=tokens.device).repeat_interleave(T)

        def attend(i, q):
            if tree_bits is not None:
                o = tree_attention(q.view(B, T, a.num_heads, a.head_dim), cache.k[i], cache.v[i], cache_len,
                                   tree_bits, self.scale, impl=self.impl)
                return o.view(B * T, -1)
            o = verify_attention(q.view(B, T, a.num_heads, a.head_dim), cache.k[i], cache.v[i], cache_len,
                                 self.scale, impl=self.impl, window=self.window(i), exact=exact)
            return o.view(B * T, -1)

        write = None
        if tree_bits is not None:
            write = (cache_len[:, None].long() + torch.arange(T, device=tokens.device)).reshape(-1)
        x, residual, feats = self._layers(tokens.reshape(-1), positions.reshape(-1), bidx, cache, attend, want_features,
                                          write, exact)
        h, _ = rms_norm(x, self.norm, a.rms_norm_eps, residual=residual, impl=self.impl)
        logits = linear(h, self.head, impl=self.impl, exact=exact).view(B, T, -1)
        f = self._features(feats, want_features)
        return logits, None if f is None else f.view(B, T, -1)

    def prefill(self, tokens: torch.Tensor, slot: int, cache: KVCache, want_features: bool = True):
        """Prompt ``tokens [P]`` of batch slot ``slot``: writes K/V at positions 0..P-1.

        Returns logits at the last position ``[V]`` and features ``[P, k*H]`` (or None).
        Attention is causal SDPA over the prompt itself (stale cache rows are never read)."""
        a = self.args
        P = tokens.shape[0]
        if P > cache.seq:
            raise ValueError(f"prompt of {P} tokens does not fit the cache ({cache.seq} positions)")
        Hq, D = a.num_heads, a.head_dim

        def attend(i, q):
            kc, vc = cache.k[i][slot : slot + 1, :, :P], cache.v[i][slot : slot + 1, :, :P]
            o = self._prompt_attention(i, q.view(1, P, Hq, D).transpose(1, 2), kc, vc)
            return o.transpose(1, 2).reshape(P, Hq * D)

        pos = torch.arange(P, device=tokens.device)
        bidx = torch.full((P,), slot, device=tokens.device, dtype=torch.long)
        x, residual, feats = self._layers(tokens, pos, bidx, cache, attend, want_features)
        h, _ = rms_norm(x[-1:], self.norm, a.rms_norm_eps, residual=residual[-1:], impl=self.impl)
        return F.linear(h, self.head)[0], self._features(feats, want_features)

    def prefill_packed(self, prompts: list[torch.Tensor], slots: list[int], cache: KVCache,
                       want_features: bool = True):
        """Several prompts in one pass (varlen packing): prompt i ``[P_i]`` goes to batch slot ``slots[i]``.

        The N = Σ P_i tokens run through every matmul together, so admitting k prompts costs one
        forward of N tokens instead of k forwards (the launch count of one prefill is about
        12 per layer, which dominates small targets). Attention is causal SDPA per prompt over its
        own cache rows, the same call :meth:`prefill` makes, so each prompt's logits equal a
        one-prompt prefill up to matmul rounding (exactly in fp32 on the CPU reference path).

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
        pos = torch.cat([torch.arange(n, device=dev) for n in lens])
        bidx = torch.cat([torch.full((n,), s, device=dev, dtype=torch.long) for n, s in zip(lens, slots)])
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)

        def attend(i, q):
            out = torch.empty(q.shape[0], Hq * D, device=q.device, dtype=q.dtype)
            for j, (s, n) in enumerate(zip(slots, lens)):
                kc, vc = cache.k[i][s : s + 1, :, :n], cache.v[i][s : s + 1, :, :n]
                qj = q[starts[j] : starts[j + 1]].view(1, n, Hq, D).transpose(1, 2)
                o = self._prompt_attention(i, qj, kc, vc)
                out[starts[j] : starts[j + 1]] = o.transpose(1, 2).reshape(n, Hq * D)
            return out

        x, residual, feats = self._layers(tokens, pos, bidx, cache, attend, want_features)
        last = torch.tensor([e - 1 for e in starts[1:]], device=dev)
        h, _ = rms_norm(x[last], self.norm, a.rms_norm_eps, residual=residual[last], impl=self.impl)
        return F.linear(h, self.head), self._features(feats, want_features)


def read_safetensors(folder: Path, device) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or the shards of ``model.safetensors.index.json``."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.is_file():
        weight_map = read_json_object(index, "a safetensors index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object of tensor name -> shard file")
        files = sorted(set(weight_map.values()))
    state = {}
    for f in files:
        path = folder / f
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing target weights")
        state.update(load_file(str(path), device=str(device)))
    return state
