"""Target adapter: any Hugging Face causal LM (Qwen3, Qwen2, Llama, …) as the frozen target.

The adapter returns logits and the *target features*: the outputs of decoder layers
``target_layer_ids`` (0-based), concatenated on the last dim (docs/method.md §2). With the draft's
``last_layer_features = "post_norm"`` (DFlash's convention, the default) the last layer's feature is
taken after the target's final norm, so every feature equals HF ``output_hidden_states[id + 1]``;
"pre_norm" keeps the raw decoder-layer output of the last layer (older DSpine drafts).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dspine.config import (
    LAST_LAYER_FEATURES,
    ROPE_IMPLEMENTED,
    check_rope,
    check_target_layers,
    is_multimodal,
    is_recurrent,
    layers_error,
    unsupported_layers,
    unsupported_rope,
)
from dspine.io import WEIGHTS, WEIGHTS_INDEX, open_each_weight_file, read_safetensors
from dspine.paths import hub_errors, load_tokenizer, resolve_model_path, snapshot_folder


class _StopForward(Exception):
    """Raised from a hook to end a forward once the last needed layer ran (features only)."""


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [B, T, V] (float of the model dtype)
    features: torch.Tensor | None  # [B, T, k*H]
    past_key_values: object | None = None


def _decoder(model: nn.Module) -> nn.Module:
    """The decoder stack of an HF causal LM (``model.model`` for Llama/Qwen)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)


def final_norm(model: nn.Module) -> nn.Module:
    """The final norm of an HF causal LM (``model.model.norm`` for Llama/Qwen)."""
    norm = getattr(_decoder(model), "norm", None)
    if norm is None:
        raise ValueError(f"{type(model).__name__}: cannot find the final norm (expected .model.norm)")
    return norm


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder-layer list of an HF causal LM (``model.model.layers`` for Llama/Qwen)."""
    layers = getattr(_decoder(model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find the decoder layers (expected .model.layers)")
    return layers


class TargetAdapter(nn.Module):
    """Frozen target wrapper.

    Args:
        model: an HF ``*ForCausalLM``; it is put in eval mode and its parameters frozen.
        layer_ids: target layers whose outputs form the features (may be set later with
            :meth:`set_layer_ids`).
        last_layer_features: "post_norm" | "pre_norm" (``dspine_config.last_layer_features``).
    Raises:
        ValueError: a layer id outside ``[0, num_hidden_layers)``.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int] | None = None, name: str = "",
                 last_layer_features: str = "post_norm"):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.layers = decoder_layers(model)
        self.name = name
        self.layer_ids: list[int] = []
        self.last_layer_features = "post_norm"
        if layer_ids is not None:
            self.set_layer_ids(layer_ids, last_layer_features)

    # -- properties ------------------------------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    @property
    def recurrent(self) -> bool:
        """A hybrid target: some layers keep a recurrent state (``dspine.config.is_recurrent``)."""
        return is_recurrent(self.config)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[1]

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding (the model vocab, possibly padded beyond the tokenizer)."""
        return self.model.get_input_embeddings().weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    def set_layer_ids(self, layer_ids: list[int], last_layer_features: str = "post_norm") -> None:
        """Set the feature layers and the last-layer convention (take both from the draft config)."""
        if last_layer_features not in LAST_LAYER_FEATURES:
            raise ValueError(f"last_layer_features={last_layer_features!r}: choose one of {LAST_LAYER_FEATURES}")
        bad = [i for i in layer_ids if not 0 <= int(i) < self.num_layers]
        if bad:
            raise ValueError(f"dflash_config.target_layer_ids {list(layer_ids)}: {bad} outside [0, {self.num_layers}) "
                             f"for target {self.name or type(self.model).__name__} with {self.num_layers} layers")
        self.layer_ids = [int(i) for i in layer_ids]
        self.last_layer_features = last_layer_features

    # -- shared embedding / head ----------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[...]`` -> target input embeddings ``[..., H]`` (frozen, shared with the draft)."""
        return self.model.get_input_embeddings()(input_ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[..., H]`` -> logits ``[..., V]`` with the target's own (frozen) head."""
        head = self.model.get_output_embeddings()
        return head(hidden.to(head.weight.dtype))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    # -- forwards --------------------------------------------------------------------------------
    def _concat(self, store: dict) -> torch.Tensor:
        """Features ``[B, T, k*H]`` from the hooked layer outputs; the last layer's gets the final norm
        under "post_norm" (= HF ``output_hidden_states[L]``, DFlash's and SGLang's input)."""
        last = self.num_layers - 1
        feats = [store[i] for i in self.layer_ids]
        if self.last_layer_features == "post_norm" and last in self.layer_ids:
            norm = final_norm(self.model)
            feats = [norm(f) if i == last else f for i, f in zip(self.layer_ids, feats)]
        return torch.cat(feats, dim=-1)

    def _hooks(self, store: dict, stop_after: int | None, extra: list[int] = ()):
        handles = []
        for i in [*self.layer_ids, *extra]:
            def hook(_module, _inp, out, i=i):
                store[i] = out[0] if isinstance(out, tuple) else out
                if stop_after is not None and i == stop_after:
                    raise _StopForward
            handles.append(self.layers[i].register_forward_hook(hook))
        return handles

    def forward(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None,
                use_cache: bool = False, features: bool = True) -> TargetOutput:
        """Target forward returning logits ``[B, T, V]`` and features ``[B, T, k*H]``.

        With ``past_key_values`` (an HF cache object) the new tokens attend to the cached prefix;
        the updated cache is returned in ``TargetOutput.past_key_values``. A new cache keeps every
        position in every attention layer (sliding layers included: their mask still slides), so that
        :meth:`crop_cache` can drop rejected draft positions beyond the window; a hybrid target's
        cache also holds its recurrent layers' conv and recurrent states (transformers' layout).
        """
        if use_cache and past_key_values is None:
            from transformers import DynamicCache

            past_key_values = DynamicCache(config=self.config) if self.recurrent else DynamicCache()
        store: dict[int, torch.Tensor] = {}
        handles = self._hooks(store, None) if features and self.layer_ids else []
        # transformers renamed the cache argument/output (`past_key_values` -> `cache`, 5.2x)
        if not hasattr(self, "_cache_kw"):
            params = inspect.signature(self.model.forward).parameters
            self._cache_kw = "cache" if "cache" in params else "past_key_values"
        try:
            out = self.model(
                input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                use_cache=use_cache, **{self._cache_kw: past_key_values},
            )
        finally:
            for h in handles:
                h.remove()
        feats = self._concat(store) if handles else None
        cache = getattr(out, "cache", None)
        if cache is None:
            cache = getattr(out, "past_key_values", None)
        return TargetOutput(out.logits, feats, cache)

    @staticmethod
    def crop_cache(cache, keep: int) -> None:
        """Drop cached positions beyond the first ``keep`` (negative ``crop`` works on every
        transformers version since 4.4x; positive means different things across versions)."""
        remove = cache.get_seq_length() - keep
        if remove > 0:
            cache.crop(-remove)

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Features only ``[B, S, k*H]``: the forward stops after the last needed layer (no lm_head)."""
        return self._features(input_ids, attention_mask, last=False)[0]

    def features_and_last_hidden(self, input_ids: torch.Tensor,
                                 attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``[B, S, k*H]`` and the last decoder layer's output ``[B, S, H]`` *before* the final norm.

        ``lm_head(final_norm(last))`` are the target's logits; the trainer's distillation loss applies both
        only at the positions it needs (``train.loss.block_loss``), never ``[B, S, V]`` at once."""
        return self._features(input_ids, attention_mask, last=True)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's final norm: ``[..., H] -> [..., H]`` (what the lm_head reads)."""
        return final_norm(self.model)(hidden)

    def _features(self, input_ids, attention_mask, last: bool):
        if not self.layer_ids:
            raise ValueError("target_layer_ids are not set on the target adapter")
        store: dict[int, torch.Tensor] = {}
        top = self.num_layers - 1
        extra = [top] if last and top not in self.layer_ids else []
        handles = self._hooks(store, top if last else max(self.layer_ids), extra)
        try:
            _decoder(self.model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        finally:
            for h in handles:
                h.remove()
        return self._concat(store), (store[top] if last else None)


# ------------------------------------------------------------------------------------------------
# loading


def check_target_dtype(dtype: torch.dtype, model_type: str | None) -> None:
    """Refuse fp16 for a Qwen-family target (its activations overflow fp16 to NaN: docs/method.md §8.15); the
    reference loader and the engine both call it.

    Raises:
        ValueError: ``dtype`` is ``torch.float16`` and ``model_type`` starts with ``qwen``."""
    if dtype == torch.float16 and str(model_type or "").startswith("qwen"):
        raise ValueError("fp16 with a Qwen-family target overflows to NaN; use bf16 or fp32 (docs/method.md §8.15)")


def load_target(path_or_id: str, gguf_file: str | None = None, dtype: str | torch.dtype = "auto",
                device: str | torch.device = "cpu", layer_ids: list[int] | None = None) -> TargetAdapter:
    """Load an HF causal LM (local folder, Hub id, or ``.gguf``) as a frozen :class:`TargetAdapter`.

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: a file that is not ``.gguf``, a folder without ``config.json`` or whose config is not a causal LM's (e.g. a draft folder); fp16 requested for a Qwen-family target (overflows; docs/method.md §8.15); RoPE other than plain full-head RoPE (:func:`dspine.config.check_rope`); a layer or model type the reference path does not run (:func:`dspine.config.check_target_layers` with ``engine=False``: full, sliding and, for qwen3_next / qwen3_5_text, linear attention run; a multimodal qwen3_5 runs its text model, :func:`load_text_model`), a truncated or corrupt safetensors file of a local folder (named), all before any weight is read.
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM

    path_or_id, gguf_file = resolve_model_path(path_or_id, gguf_file, need_config=True)
    torch_dtype = _parse_dtype(dtype)
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    who = f"target {path_or_id}{f'/{gguf_file}' if gguf_file else ''}"
    with hub_errors("target", path_or_id):
        config = AutoConfig.from_pretrained(path_or_id, **kw)
        if not is_multimodal(config) and type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:  # e.g. a draft folder
            raise ValueError(f"{who}: model_type={config.model_type!r} is not a causal LM (not a target model)")
        check_target_layers(config, who, engine=False)
        if not is_recurrent(config):  # the engine runs attention-only targets: same RoPE (docs/method.md §8.3)
            check_rope(config, who)
        check_target_dtype(torch_dtype, config.model_type)
        folder = Path(path_or_id)
        if not gguf_file and any((folder / n).is_file() for n in (WEIGHTS, WEIGHTS_INDEX)):
            # a local safetensors folder: a truncated or corrupt file is one error naming it, as in the engine's
            # loader (transformers' own is a traceback without the file's name); headers only, no tensor read
            open_each_weight_file(folder, lambda fh: list(fh.keys()))
        if is_multimodal(config):
            model = load_text_model(path_or_id, config, torch_dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=torch_dtype, **kw)
    if gguf_file:
        # GGUF tensors are dequantized to fp32; drop the quantization marker so the model behaves
        # (and saves) like a plain dense checkpoint.
        model.config.quantization_config = None
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
    model.to(device)
    try:  # a causal LM of another layout (e.g. GPT-2's transformer.h): the error names the target
        return TargetAdapter(model, layer_ids, name=f"{path_or_id}/{gguf_file}" if gguf_file else path_or_id)
    except ValueError as e:
        raise ValueError(f"{who}: {e} (the target adapter runs Llama/Qwen-style decoders)") from None


def load_text_model(path_or_id: str, config, dtype=torch.float32, **kw) -> nn.Module:
    """The text causal LM (e.g. ``Qwen3_5ForCausalLM``) of a multimodal checkpoint (e.g. a Qwen3.5 release,
    ``Qwen3_5ForConditionalGeneration``), without its vision tower.

    transformers' own loader when it maps the multimodal config to the text causal LM and remaps the
    ``model.language_model.`` tensors (5.2x: ``AutoModelForCausalLM`` "VLM compatibility"); otherwise the text
    model is built from ``config.text_config`` and its tensors read by name (:func:`dspine.io.read_safetensors`).
    ``kw`` (e.g. ``attn_implementation``) go to transformers.

    Raises:
        ValueError: the checkpoint lacks a tensor of the text model (a tied head excepted; the CLIs report it).
    """
    from transformers import AutoModelForCausalLM

    text = config.text_config
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=dtype, output_loading_info=True, **kw)
        if model.config.model_type == text.model_type and not info["missing_keys"] and not info["mismatched_keys"]:
            return model
    except ValueError:  # "Unrecognized configuration class" on a transformers without that mapping
        pass
    return _text_model_from_tensors(path_or_id, text, dtype, **kw)


def _text_model_from_tensors(path_or_id: str, text, dtype, **kw) -> nn.Module:
    from transformers import AutoModelForCausalLM

    folder = snapshot_folder(path_or_id)
    if dtype == "auto":  # the checkpoint's own dtype, as from_pretrained's "auto"
        dtype = getattr(torch, str(getattr(text, "dtype", None) or "float32").removeprefix("torch."))
    model = AutoModelForCausalLM.from_config(text, dtype=dtype, **kw)
    state = read_safetensors(folder, "cpu", multimodal=True)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    want = set(model.state_dict())
    missing = sorted(want - set(state) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set()))
    if missing:
        raise ValueError(f"target {path_or_id}: the checkpoint has no tensor model.language_model.* for {missing[:4]}")
    model.load_state_dict({k: v for k, v in state.items() if k in want}, strict=False)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def _parse_dtype(dtype):
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
             "fp16": torch.float16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype={dtype!r} is unknown; choose one of {sorted(table)} or 'auto'")
    return table[dtype]


# ------------------------------------------------------------------------------------------------
# compatibility checks (docs/method.md §8.4, §8.5, §8.6, §8.11)


@dataclass
class TargetSpec:
    """What the draft must agree with, read from the target's config (no weights needed)."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int  # embedding rows (possibly padded beyond the tokenizer)
    pad_ids: set
    eos_ids: set
    rope_theta: float | None
    max_position_embeddings: int | None
    tokenizer_len: int | None = None
    rope_problems: list[str] = field(default_factory=list)  # dspine.config.unsupported_rope
    layer_problems: list[str] = field(default_factory=list)  # dspine.config.unsupported_layers, reference path
    engine_layer_problems: list[str] = field(default_factory=list)  # the same for the engine

    def check_supported(self, engine: bool = False) -> None:
        """Raise ``ValueError`` naming a layer type or RoPE of this target that the engine (``engine=True``)
        or the reference path does not implement; reads the config only (call before loading weights)."""
        problems = self.engine_layer_problems if engine else self.layer_problems
        if problems:
            raise ValueError(layers_error(f"target {self.name}", problems, engine))
        if self.rope_problems:
            raise ValueError(f"target {self.name}: {', '.join(self.rope_problems)} is not implemented (DSpine "
                             f"implements {ROPE_IMPLEMENTED})")

    @classmethod
    def from_config(cls, config, name: str = "", tokenizer=None, generation_config=None) -> TargetSpec:
        pad, eos = set(), set()
        text = config.get_text_config() if hasattr(config, "get_text_config") else config  # qwen3_5: text_config
        for src in (config, text, generation_config, tokenizer):
            if src is None:
                continue
            for bucket, key in ((pad, "pad_token_id"), (eos, "eos_token_id")):
                v = getattr(src, key, None)
                if v is not None:
                    bucket.update([v] if isinstance(v, int) else list(v))
        outer = config  # decides support (a multimodal qwen3_5 is its text model; other multimodal types are refused)
        config = text
        theta = getattr(config, "rope_theta", None)
        params = getattr(config, "rope_parameters", None)
        if theta is None and isinstance(params, dict):  # (one dict per layer type: unsupported_rope judges them)
            theta = params.get("rope_theta", next((v.get("rope_theta") for v in params.values() if isinstance(v, dict)), None))
        return cls(
            name=name, model_type=str(getattr(config, "model_type", "")),
            num_layers=int(config.num_hidden_layers), hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size), pad_ids=pad, eos_ids=eos,
            rope_theta=float(theta) if theta is not None else None,
            max_position_embeddings=getattr(config, "max_position_embeddings", None),
            tokenizer_len=len(tokenizer) if tokenizer is not None else None,
            # a hybrid target runs on transformers' modules only (its RoPE included; the draft has its own plain
            # RoPE), the engine refuses it by its layer types
            rope_problems=[] if is_recurrent(outer) else unsupported_rope(config) + (
                [f"model_type={getattr(config, 'model_type', '?')!r} without rope_theta (positions not by RoPE)"]
                if theta is None else []),
            layer_problems=unsupported_layers(outer, engine=False), engine_layer_problems=unsupported_layers(outer),
        )

    @classmethod
    def from_pretrained(cls, path_or_id: str, gguf_file: str | None = None, with_tokenizer: bool = True) -> TargetSpec:
        """Read config (+ tokenizer and generation config when present) without loading weights."""
        from transformers import AutoConfig, GenerationConfig

        path_or_id, gguf_file = resolve_model_path(path_or_id, gguf_file, need_config=True)
        kw = {"gguf_file": gguf_file} if gguf_file else {}
        with hub_errors("target", path_or_id):
            config = AutoConfig.from_pretrained(path_or_id, **kw)
        tok = None
        if with_tokenizer:
            try:
                tok = load_tokenizer(path_or_id, gguf_file)
            except (OSError, ValueError, TypeError):  # a weights-only folder: ids come from the config
                tok = None
        try:
            gen = GenerationConfig.from_pretrained(path_or_id, **kw)
        except (OSError, ValueError, TypeError):
            gen = None
        name = f"{path_or_id}/{gguf_file}" if gguf_file else path_or_id
        return cls.from_config(config, name, tok, gen)

    @classmethod
    def from_adapter(cls, target: TargetAdapter, tokenizer=None) -> TargetSpec:
        spec = cls.from_config(target.config, target.name, tokenizer, getattr(target.model, "generation_config", None))
        spec.num_layers, spec.vocab_size, spec.hidden_size = target.num_layers, target.vocab_size, target.hidden_size
        return spec


@dataclass
class CheckRow:
    field: str
    target: object
    draft: object
    ok: bool
    note: str = ""


def check_compat(target: TargetSpec | TargetAdapter, draft_config, max_context: int | None = None) -> list[CheckRow]:
    """Compare a draft config with a target. Returns one :class:`CheckRow` per checked field."""
    spec = TargetSpec.from_adapter(target) if isinstance(target, TargetAdapter) else target
    rows: list[CheckRow] = []
    L = spec.num_layers
    ids = list(draft_config.target_layer_ids)
    bad = [i for i in ids if not 0 <= i < L]
    rows.append(CheckRow("dflash_config.target_layer_ids", f"{L} layers", ids, not bad,
                         f"{bad} outside [0, {L})" if bad else ""))
    conv = draft_config.last_layer_features
    if L - 1 in ids:
        note = (f"layer {L - 1} is read after the final norm (HF hidden_states[{L}], DFlash/SGLang convention)"
                if conv == "post_norm" else f"layer {L - 1} is read before the final norm (DSpine drafts made "
                "before this field; DFlash engines feed the post-norm state)")
    else:
        note = f"the last layer ({L - 1}) is not read: no effect"
    rows.append(CheckRow("dspine_config.last_layer_features", "post_norm | pre_norm", conv, True, note))
    same_depth = draft_config.num_target_layers == L
    rows.append(CheckRow("num_target_layers", L, draft_config.num_target_layers, same_depth,
                         "" if same_depth else "draft was built for a target of another depth"))
    same_width = spec.hidden_size == draft_config.hidden_size
    rows.append(CheckRow("hidden_size", spec.hidden_size, draft_config.hidden_size, same_width,
                         "" if same_width else f"target {spec.hidden_size} != draft {draft_config.hidden_size}: "
                         "the draft was built for a target of another width"))
    V = spec.vocab_size
    vocab_ok, note = draft_config.vocab_size == V, ""
    if spec.tokenizer_len is not None and spec.tokenizer_len > V:
        vocab_ok, note = False, f"tokenizer has {spec.tokenizer_len} tokens > {V} embedding rows"
    elif spec.tokenizer_len is not None and spec.tokenizer_len < V:
        note = f"target vocab padded ({spec.tokenizer_len} tokens, {V} rows): fine"
    if draft_config.vocab_size != V:
        note = "draft was trained for another vocabulary (lm_head not shareable)"
    rows.append(CheckRow("vocab_size", V, draft_config.vocab_size, vocab_ok, note))
    mask = draft_config.mask_token_id
    if mask is None:
        rows.append(CheckRow("dflash_config.mask_token_id", f"< {V}", None, False, "missing"))
    else:
        problems = []
        if not 0 <= mask < V:
            problems.append(f"outside the embedding [0, {V})")
        if mask in spec.pad_ids:
            problems.append("equals the pad token")
        if mask in spec.eos_ids:
            problems.append("equals an eos token")
        rows.append(CheckRow("dflash_config.mask_token_id", f"< {V}, not pad/eos", mask, not problems,
                             "; ".join(problems)))
    layers_ok = not spec.layer_problems
    note = "not supported" if not layers_ok else (
        f"engine: {'; '.join(spec.engine_layer_problems)} (use the reference backend)" if spec.engine_layer_problems
        else "")
    rows.append(CheckRow("layer_types", "; ".join(spec.layer_problems) or "supported", "-", layers_ok, note))
    rope_ok = not spec.rope_problems
    rows.append(CheckRow("rope", "plain" if rope_ok else ", ".join(spec.rope_problems), "plain", rope_ok,
                         "" if rope_ok else f"not implemented: the draft and the engine implement {ROPE_IMPLEMENTED}"))
    theta = spec.rope_theta
    rows.append(CheckRow("rope_theta", theta, draft_config.rope_theta, True,
                         "" if theta in (None, draft_config.rope_theta) else "differs from the target's (allowed)"))
    if max_context is not None:
        need = max_context + draft_config.block_size
        ok = draft_config.max_position_embeddings >= need
        bs, have = draft_config.block_size, draft_config.max_position_embeddings
        rows.append(CheckRow("max_position_embeddings", f"needed: >= {need} (context {max_context} + block {bs})",
                             have, ok,
                             "" if ok else f"draft RoPE range shorter than the requested context: the draft's "
                                           f"{have} positions must hold the context plus one block of {bs}, so a "
                                           f"context of at most {have - bs} tokens (prompt + new tokens)"))
        tmax = spec.max_position_embeddings
        if tmax is not None:
            rows.append(CheckRow("target max_position_embeddings", tmax, f"needs {need}", tmax >= need,
                                 "" if tmax >= need else "target context shorter than requested"))
    return rows


def assert_compatible(target: TargetSpec | TargetAdapter, draft_config, max_context: int | None = None) -> None:
    """Raise ``ValueError`` listing every failed row of :func:`check_compat`."""
    bad = [r for r in check_compat(target, draft_config, max_context) if not r.ok]
    if bad:
        lines = [f"  {r.field}: target={r.target} draft={r.draft}" + (f" ({r.note})" if r.note else "") for r in bad]
        raise ValueError("draft/target mismatch:\n" + "\n".join(lines))


def format_table(rows: list[CheckRow]) -> str:
    head = ("field", "target", "draft", "status", "note")
    body = [(r.field, str(r.target), str(r.draft), "ok" if r.ok else "MISMATCH", r.note) for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(5)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*x).rstrip() for x in [head, *body])
