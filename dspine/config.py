"""Draft configuration: the DFlash keys plus a ``dspine_config`` block.

The layout follows the published DFlash drafts (docs/method.md §2): Qwen3 decoder-layer fields,
``block_size``, ``num_target_layers`` and ``dflash_config = {mask_token_id, target_layer_ids}``.
DSpine adds ``dspine_config = {injection, injection_rank, injection_layers, block_attention,
last_layer_features}`` (docs/method.md §2-§3). A DFlash ``config.json`` (``model_type: "qwen3"``) loads as a DSpine config with
``injection = "none"``.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig

# The draft's defaults live here only (DSpineConfig's signature, DSPINE_DEFAULTS and for_target).
DEFAULT_LAYERS, DEFAULT_BLOCK_SIZE = 5, 16
INJECTION_MODES = ("residual", "kv", "none")
# What the draft reads from the target's *last* layer when target_layer_ids include it
# (docs/method.md §2): "post_norm" = the state after the target's final RMSNorm, i.e. HF
# output_hidden_states[L] as DFlash's reference code and SGLang feed it (DSpine's convention);
# "pre_norm" = the raw decoder-layer output, what DSpine drafts made before the field existed read.
LAST_LAYER_FEATURES = ("post_norm", "pre_norm")
BLOCK_ATTENTION_MODES = ("bidirectional", "causal")
LAYER_TYPES = ("full_attention", "sliding_attention")

DSPINE_DEFAULTS: dict[str, Any] = {
    "injection": "residual",
    "injection_rank": 0,  # 0 = full-rank H x H projection; r > 0 = low rank (down r x H, up H x r)
    "injection_layers": None,  # None = every draft layer
    "block_attention": "bidirectional",
    "last_layer_features": "post_norm",
}


ROPE_IMPLEMENTED = "plain RoPE on the whole head (rope_type 'default', partial_rotary_factor 1)"


def unsupported_rope(cfg) -> list[str]:
    """RoPE settings of a config (object or ``config.json`` dict) that DSpine does not implement.

    The draft (``dspine.model``) and the engine's target (``infer.model``) implement one RoPE: rotate
    half over all ``head_dim`` channels at ``rope_theta`` (docs/method.md §2, §8.3). Anything else
    (scaled types such as linear/dynamic/yarn/llama3, ``partial_rotary_factor`` or ``rotary_pct`` < 1,
    ``rotary_dim`` < head_dim, layers without RoPE) would be silently decoded as full plain RoPE, so
    it is reported here, one ``field=value`` string per problem (empty list: supported).
    """
    get = _getter(cfg)
    problems = []
    for key in ("rope_scaling", "rope_parameters"):
        rope = get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            problems.append(f"{key}={rope!r}")
            continue
        # transformers 5 may keep one dict per layer type ({"full_attention": {...}, ...})
        nested = bool(rope) and all(isinstance(v, dict) for v in rope.values())
        for where, d in (((f"{key}.{k}", v) for k, v in rope.items()) if nested else [(key, rope)]):
            rope_type = d.get("rope_type", d.get("type", "default"))
            if rope_type not in ("default", None):
                problems.append(f"{where}.rope_type={rope_type!r}")
            factor = d.get("partial_rotary_factor")
            if factor is not None and float(factor) != 1.0:
                problems.append(f"{where}.partial_rotary_factor={factor}")
    for key in ("partial_rotary_factor", "rotary_pct"):
        v = get(key)
        if v is not None and float(v) != 1.0:
            problems.append(f"{key}={v}")
    rotary_dim, heads, hidden = get("rotary_dim"), get("num_attention_heads"), get("hidden_size")
    head_dim = get("head_dim") or (hidden // heads if hidden and heads else None)
    if rotary_dim is not None and rotary_dim != head_dim:
        problems.append(f"rotary_dim={rotary_dim} (head_dim {head_dim})")
    no_rope = get("no_rope_layers")
    if no_rope and not all(no_rope):
        problems.append(f"no_rope_layers={list(no_rope)}")
    return list(dict.fromkeys(problems))


def check_rope(cfg, who: str) -> None:
    """Raise ``ValueError`` naming each field of :func:`unsupported_rope` (``who``: "target x", "draft config")."""
    problems = unsupported_rope(cfg)
    if problems:
        raise ValueError(f"{who}: {', '.join(problems)} is not implemented (DSpine implements {ROPE_IMPLEMENTED}); "
                         "refused instead of decoding it as full plain RoPE")


# Target layer types (transformers' ``config.layer_types`` values) each path decodes; anything else is
# refused up front instead of failing mid-decode. Both the reference path (transformers' own modules:
# dspine.target, dspine.reference, the trainer) and the engine (infer.model, infer.linear_attention) run
# the hybrid text models whose ``linear_attention`` layers (gated delta rule) keep a recurrent state that
# a rejected draft rolls back; other model types with such layers are refused.
TARGET_LAYER_TYPES = ("full_attention", "sliding_attention")
RECURRENT_LAYER_TYPES = ("linear_attention",)
# hybrid model types (named even when a config omits ``layer_types``), then the text models both decode paths run
RECURRENT_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text")
RUN_RECURRENT_MODEL_TYPES = ("qwen3_next", "qwen3_5_text")
# Multimodal model types whose text model is the target (the vision tower is never used): outer model_type ->
# its ``text_config``'s model_type. transformers' Qwen3_5ForConditionalGeneration keeps the text model's
# tensors under ``model.language_model.`` and the head at ``lm_head.weight`` (text_weight_name).
MULTIMODAL_TEXT_MODEL_TYPES = {"qwen3_5": "qwen3_5_text"}


def _getter(cfg):
    return (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))


def text_config(cfg):
    """The text model's config of a multimodal config (``text_config``, object or dict), else ``cfg``."""
    get = _getter(cfg)
    return get("text_config") if get("text_config") is not None and get("num_hidden_layers") is None else cfg


def is_multimodal(cfg) -> bool:
    return text_config(cfg) is not cfg


def multimodal_problem(cfg) -> str | None:
    """Why a multimodal config's text model is not a DSpine target (None: not multimodal, or supported)."""
    if not is_multimodal(cfg):
        return None
    outer, inner = _getter(cfg)("model_type"), _getter(text_config(cfg))("model_type")
    if MULTIMODAL_TEXT_MODEL_TYPES.get(outer) == inner:
        return None
    runs = ", ".join(f"{k} with {v}" for k, v in MULTIMODAL_TEXT_MODEL_TYPES.items())
    return (f"multimodal model_type={outer!r} with text_config model_type={inner!r} is not supported (DSpine "
            f"runs the text model of the multimodal model types: {runs})")


def text_weight_name(name: str, multimodal: bool) -> str | None:
    """A checkpoint tensor's name in the text causal LM (``model.layers.0…``, ``lm_head.weight``); None for a
    tensor of a multimodal checkpoint that is not the text model's (vision tower, MTP head)."""
    if not multimodal:
        return name
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name if name == "lm_head.weight" else None


def _window(cfg) -> int | None:
    """``sliding_window``, None when ``use_sliding_window`` is false (transformers nulls it then)."""
    get = _getter(cfg)
    return get("sliding_window") if get("use_sliding_window", False) or get("layer_types") is not None else None


def target_layer_types(cfg) -> list[str]:
    """Per-layer attention type of a target config (object or ``config.json`` dict).

    transformers' rule (Qwen2/Qwen3 configs): ``layer_types`` when given; otherwise layer i slides iff
    ``use_sliding_window`` is true, ``sliding_window`` is set and ``i >= max_window_layers``. A
    multimodal config is read through its ``text_config``.
    """
    get = _getter(text_config(cfg))
    types = get("layer_types")
    if types is not None:
        return [str(t) for t in types]
    window, first = _window(text_config(cfg)), get("max_window_layers") or 0
    return ["sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(int(get("num_hidden_layers") or 0))]  # no depth: nothing to check here


def is_recurrent(cfg) -> bool:
    """True for a hybrid target (a layer with recurrent state, or a hybrid model type)."""
    return _getter(cfg)("model_type") in RECURRENT_MODEL_TYPES or any(
        t in RECURRENT_LAYER_TYPES for t in target_layer_types(cfg))


def unsupported_layers(cfg, engine: bool = True) -> list[str]:
    """Layer types and settings of a target config that DSpine does not decode, one string each
    (empty: supported), for the engine (``engine=True``) or the reference path. Names the model type,
    the layer type and the layers that carry it; a multimodal config is judged by its text model
    (:data:`MULTIMODAL_TEXT_MODEL_TYPES`, anything else refused)."""
    problem = multimodal_problem(cfg)
    if problem:
        return [problem]
    cfg = text_config(cfg)  # a multimodal qwen3_5 is its text model
    problems = []
    model_type = _getter(cfg)("model_type")
    runs = RUN_RECURRENT_MODEL_TYPES
    known = TARGET_LAYER_TYPES + RECURRENT_LAYER_TYPES if model_type in runs or not engine else TARGET_LAYER_TYPES
    if model_type in RECURRENT_MODEL_TYPES and model_type not in runs:
        where = "the engine" if engine else "the reference path"
        problems.append(f"model_type={model_type!r} (hybrid: gated delta-rule linear attention with a recurrent "
                        f"state) is not implemented by {where} (it runs the text models {' / '.join(runs)})")
    types = target_layer_types(cfg)
    for kind in dict.fromkeys(t for t in types if t not in known):
        layers = [i for i, t in enumerate(types) if t == kind]
        problems.append(f"layer_types has {kind!r} (layers {layers})")
    window = _window(text_config(cfg))
    if "sliding_attention" in types and (not isinstance(window, int) or window < 1):
        problems.append(f"sliding_attention layers with sliding_window={window!r}")
    return problems


def layers_error(who: str, problems: list[str], engine: bool) -> str:
    path = "the engine (--backend cuda)" if engine else "DSpine"
    return (f"{who}: {'; '.join(problems)}: not supported ({path} decodes targets whose layers are "
            f"{' / '.join(TARGET_LAYER_TYPES)}, and {' / '.join(RECURRENT_LAYER_TYPES)} in the model types "
            f"{' / '.join(RUN_RECURRENT_MODEL_TYPES)})")


def check_target_layers(cfg, who: str, engine: bool = True) -> list[int | None]:
    """Per-layer attention window of a target (None = full attention or a recurrent layer; w = a query at
    position p sees keys at positions p-w+1 .. p, transformers' sliding mask).

    Raises:
        ValueError: naming each entry of :func:`unsupported_layers` (``who``: "target x").
    """
    problems = unsupported_layers(cfg, engine)
    if problems:
        raise ValueError(layers_error(who, problems, engine))
    window = _window(text_config(cfg))
    return [int(window) if t == "sliding_attention" else None for t in target_layer_types(cfg)]


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the draft: ``round(1 + i*(L-4)/(n-1))`` (docs/method.md §2).

    Qwen3-8B (L = 36) with 5 draft layers gives [1, 9, 17, 25, 33]. A single draft layer takes
    the middle target layer; ids are clipped into [0, L) for very shallow targets.

    Raises:
        ValueError: ``num_target_layers`` or ``num_draft_layers`` below 1.
    """
    L, n = int(num_target_layers), int(num_draft_layers)
    if L < 1 or n < 1:
        raise ValueError(f"num_target_layers={L} and num_draft_layers={n} must be >= 1")
    if n == 1:
        return [L // 2]
    ids = sorted(min(max(int(round(1 + i * (L - 4) / (n - 1))), 0), L - 1) for i in range(n))
    if len(set(ids)) < n and L >= n:
        # a shallow target (L < n + 3 or so): the rule repeats layers; spread distinct ones instead
        lo, hi = (1, L - 2) if L - 2 >= n else (0, L - 1)
        ids = [int(round(lo + i * (hi - lo) / (n - 1))) for i in range(n)]
    return ids


def default_mask_token_id(spec) -> int:
    """First embedding row that the tokenizer never produces (Qwen3: 151669); ``spec`` is a
    ``dspine.target.TargetSpec``.

    Raises:
        ValueError: the target vocabulary has no unused row; choose the mask token explicitly.
    """
    if spec.tokenizer_len is not None and spec.tokenizer_len < spec.vocab_size:
        return spec.tokenizer_len
    raise ValueError(f"target {spec.name}: every one of its {spec.vocab_size} embedding rows is a real token; "
                     "choose an unused token for --mask-token-id (not pad/eos)")


# Draft fields a caller may choose (the keyword arguments of DSpineConfig.for_target); None = default.
SHAPE_FIELDS = ("layers", "block_size", "injection", "injection_rank", "injection_layers", "block_attention",
                "target_layer_ids", "mask_token_id", "intermediate_size", "sliding_window", "sliding_layers",
                "max_position_embeddings", "last_layer_features")


class DSpineConfig(PretrainedConfig):
    """Hugging Face config of a DSpine / DFlash draft.

    Only draft fields live here (style.md §3): layer shapes, block size, target layer ids, mask
    token, injection settings. Everything about the target comes from the target's own config.

    Raises:
        ValueError: an unknown ``dspine_config.injection`` / ``block_attention``, a bad
            ``layer_types`` entry, a sliding layer without ``sliding_window``, ``block_size < 2``,
            empty ``dflash_config.target_layer_ids`` or RoPE other than plain full-head RoPE
            (:func:`check_rope`).
    """

    model_type = "dspine"

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 4096,
        intermediate_size: int = 12288,
        num_hidden_layers: int = DEFAULT_LAYERS,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 8,
        head_dim: int | None = 128,
        hidden_act: str = "silu",
        max_position_embeddings: int = 40960,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 1e6,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        initializer_range: float = 0.02,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_target_layers: int = 36,
        dflash_config: dict | None = None,
        dspine_config: dict | None = None,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        # RoPE: DFlash configs carry `rope_theta` (+ `rope_scaling: null`); transformers 5 writes
        # `rope_parameters`. Only plain RoPE is supported: the engine and trainer must agree on it
        # (docs/method.md §8.3), so anything else is refused instead of silently ignored.
        check_rope({**kwargs, "head_dim": head_dim, "hidden_size": hidden_size,
                    "num_attention_heads": num_attention_heads}, "draft config")
        for key in ("rope_scaling", "rope_parameters"):
            rope = kwargs.pop(key, None)
            if rope:
                rope_theta = float(rope.get("rope_theta", rope_theta))
        for key in ("partial_rotary_factor", "rotary_pct", "rotary_dim"):  # checked above: full-head values
            kwargs.pop(key, None)
        kwargs.pop("use_sliding_window", None)
        kwargs.pop("max_window_layers", None)

        self.vocab_size = int(vocab_size)
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
        self.num_hidden_layers = int(num_hidden_layers)
        self.num_attention_heads = int(num_attention_heads)
        self.num_key_value_heads = int(num_key_value_heads)
        self.head_dim = int(head_dim) if head_dim else self.hidden_size // self.num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = int(max_position_embeddings)
        self.rms_norm_eps = float(rms_norm_eps)
        self.rope_theta = float(rope_theta)
        self.attention_bias = bool(attention_bias)
        self.attention_dropout = float(attention_dropout)
        self.initializer_range = float(initializer_range)
        self.sliding_window = int(sliding_window) if sliding_window else None
        self.layer_types = list(layer_types) if layer_types else ["full_attention"] * self.num_hidden_layers
        self.block_size = int(block_size)
        self.num_target_layers = int(num_target_layers)
        dflash = dict(dflash_config or {})
        unknown = set(dflash) - {"mask_token_id", "target_layer_ids"}
        if unknown:
            raise ValueError(f"draft config: unknown dflash_config keys {sorted(unknown)}; known: mask_token_id, "
                             "target_layer_ids")
        if dflash.get("target_layer_ids") is None:
            dflash["target_layer_ids"] = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        dflash["target_layer_ids"] = [int(i) for i in dflash["target_layer_ids"]]
        dflash.setdefault("mask_token_id", None)
        self.dflash_config = dflash
        dspine = {**DSPINE_DEFAULTS, **(dspine_config or {})}
        unknown = set(dspine) - set(DSPINE_DEFAULTS)
        if unknown:
            raise ValueError(f"draft config: unknown dspine_config keys {sorted(unknown)}; known: {sorted(DSPINE_DEFAULTS)}")
        self.dspine_config = dspine
        kwargs.setdefault("architectures", ["DSpineDraftModel"])
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.validate_fields()

    @classmethod
    def for_target(cls, target_config, spec, **shape) -> DSpineConfig:
        """A draft for a target (its transformers config and ``dspine.target.TargetSpec``): layer shapes
        copy the target's (hidden, heads, head_dim, MLP width, eps, RoPE, vocabulary), as DFlash does;
        ``shape`` sets draft fields (``SHAPE_FIELDS``), None or absent = the default: ``DEFAULT_LAYERS``
        layers, block ``DEFAULT_BLOCK_SIZE``, ``DSPINE_DEFAULTS``, the docs/method.md §2 target layers,
        the first unused embedding row as mask token, full-attention layers.

        Raises:
            ValueError: an unknown shape field, a ``sliding_layers`` index outside ``[0, layers)``, no
                unused embedding row for the mask token, or any field :meth:`validate_fields` refuses.
        """
        unknown = sorted(set(shape) - set(SHAPE_FIELDS))
        if unknown:
            raise ValueError(f"unknown draft fields {unknown}; known: {', '.join(SHAPE_FIELDS)}")
        target_config = text_config(target_config)  # a multimodal qwen3_5: its text model's shapes
        get = lambda key, default: default if shape.get(key) is None else shape[key]
        field = lambda name, default=None: default if getattr(target_config, name, None) is None else getattr(
            target_config, name)
        layers = int(get("layers", DEFAULT_LAYERS))
        sliding = list(get("sliding_layers", []))
        bad = [i for i in sliding if not 0 <= i < layers]
        if bad:
            raise ValueError(f"--sliding-layers {bad} outside [0, {layers}) for a draft of {layers} layers")
        H, heads = int(target_config.hidden_size), int(target_config.num_attention_heads)
        mask = shape.get("mask_token_id")
        return cls(
            vocab_size=spec.vocab_size, hidden_size=H,
            intermediate_size=int(get("intermediate_size", target_config.intermediate_size)),
            num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=int(field("num_key_value_heads", heads)), head_dim=int(field("head_dim", H // heads)),
            max_position_embeddings=int(get("max_position_embeddings", spec.max_position_embeddings or 40960)),
            rms_norm_eps=float(field("rms_norm_eps", 1e-6)), rope_theta=spec.rope_theta or 1e6,
            layer_types=["sliding_attention" if i in sliding else "full_attention" for i in range(layers)],
            sliding_window=shape.get("sliding_window"), block_size=int(get("block_size", DEFAULT_BLOCK_SIZE)),
            num_target_layers=spec.num_layers,
            dflash_config={"mask_token_id": default_mask_token_id(spec) if mask is None else int(mask),
                           "target_layer_ids": shape.get("target_layer_ids") or None},
            dspine_config={k: shape[k] for k in DSPINE_DEFAULTS if shape.get(k) is not None},
        )

    def shape(self) -> dict:
        """This config's draft fields, as :meth:`for_target` takes them (``injection_layers`` None = all)."""
        sliding = [i for i, t in enumerate(self.layer_types) if t == "sliding_attention"]
        return {"layers": self.num_hidden_layers, "block_size": self.block_size, "injection": self.injection,
                "injection_rank": self.injection_rank, "injection_layers": self.dspine_config["injection_layers"],
                "block_attention": self.block_attention, "target_layer_ids": self.target_layer_ids,
                "mask_token_id": self.mask_token_id, "intermediate_size": self.intermediate_size,
                "sliding_window": self.sliding_window, "sliding_layers": sliding,
                "max_position_embeddings": self.max_position_embeddings,
                "last_layer_features": self.last_layer_features}

    # -- convenience accessors (the JSON keys stay nested as in DFlash) --------------------------
    @property
    def mask_token_id(self) -> int | None:
        return self.dflash_config.get("mask_token_id")

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.dflash_config["target_layer_ids"])

    @property
    def injection(self) -> str:
        return self.dspine_config["injection"]

    @property
    def injection_rank(self) -> int:
        return int(self.dspine_config["injection_rank"])

    @property
    def injection_layers(self) -> list[int]:
        layers = self.dspine_config["injection_layers"]
        return list(range(self.num_hidden_layers)) if layers is None else [int(i) for i in layers]

    @property
    def block_attention(self) -> str:
        return self.dspine_config["block_attention"]

    @property
    def last_layer_features(self) -> str:
        """"post_norm" | "pre_norm": the target's last-layer feature after / before its final norm."""
        return self.dspine_config["last_layer_features"]

    def validate_fields(self) -> None:
        """Check the draft fields on their own (target compatibility is ``dspine.target.check_compat``)."""
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "max_position_embeddings", "num_target_layers"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 (or unset)")
        for key in ("rms_norm_eps", "rope_theta"):  # NaN fails both comparisons
            if not 0 < getattr(self, key) < float("inf"):
                raise ValueError(f"{key}={getattr(self, key)} must be finite and > 0")
        d = self.dspine_config
        for key, modes in (("injection", INJECTION_MODES), ("last_layer_features", LAST_LAYER_FEATURES),
                           ("block_attention", BLOCK_ATTENTION_MODES)):
            if d[key] not in modes:
                raise ValueError(f"dspine_config.{key}={d[key]!r} is unknown; choose one of {modes}")
        if not isinstance(d["injection_rank"], int) or d["injection_rank"] < 0:
            raise ValueError(f"dspine_config.injection_rank={d['injection_rank']!r} must be an int >= 0 (0 = full rank)")
        if d["injection_layers"] is not None:
            bad = [i for i in d["injection_layers"] if not 0 <= int(i) < self.num_hidden_layers]
            if bad:
                raise ValueError(f"dspine_config.injection_layers has {bad} outside [0, {self.num_hidden_layers})")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}"
            )
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                raise ValueError(f"layer_types entry {t!r} is unknown; choose one of {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size} must be >= 2 (anchor + at least one draft slot)")
        if not self.target_layer_ids:
            raise ValueError("dflash_config.target_layer_ids is empty")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (Qwen3 layers use silu)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        mask = self.mask_token_id
        if mask is not None and not 0 <= int(mask) < self.vocab_size:
            raise ValueError(f"dflash_config.mask_token_id={mask} is outside the vocabulary [0, {self.vocab_size})")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        # keep the DFlash spelling of RoPE so DFlash-aware engines read it
        out["rope_theta"] = self.rope_theta
        out.setdefault("rope_scaling", None)
        if self.injection == "none":
            # A draft without injection has exactly the DFlash tensors: write the DFlash header too, so
            # engines that know z-lab/Qwen3-8B-DFlash-b16 load it (load_config reads it back as DSpine).
            out["model_type"] = "qwen3"
            out["architectures"] = ["DFlashDraftModel"]
        return out


AutoConfig.register("dspine", DSpineConfig, exist_ok=True)  # AutoConfig.from_pretrained of a draft folder
