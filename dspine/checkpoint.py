"""Draft checkpoints: Hugging Face folders (``config.json`` + ``model.safetensors``).

Tensor names are the DFlash ones (docs/method.md §2) plus ``layers.{i}.adjacent.*``; loading is
``safetensors`` + ``load_state_dict`` with strict key matching, no renaming. The target's
embedding and lm_head are never stored.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from dspine.config import DSpineConfig
from dspine.io import WEIGHTS, default_file_mode, open_each_weight_file, read_safetensors
from dspine.model import DSpineDraftModel
from dspine.paths import hub_errors, read_json_object, snapshot_folder

logger = logging.getLogger(__name__)


def resolve_checkpoint(path_or_id: str) -> Path:
    """Local folder, or a Hub repo id fetched with ``huggingface_hub.snapshot_download``.

    Raises:
        FileNotFoundError: a local-looking path that does not exist.
    """
    p = Path(path_or_id)
    if not p.is_dir() and (p.exists() or path_or_id.startswith((".", "/", "~")) or path_or_id.count("/") != 1):
        raise FileNotFoundError(f"draft checkpoint folder not found: {path_or_id}")
    with hub_errors("draft", path_or_id):
        return snapshot_folder(path_or_id)


def load_config(path_or_id: str | Path) -> DSpineConfig:
    """Read ``config.json``. A DFlash config (no ``dspine_config``) loads with ``injection = "none"`` and
    DFlash's post-norm last-layer features; a DSpine config written before
    ``dspine_config.last_layer_features`` existed loads with "pre_norm", what it was trained with.

    Raises:
        FileNotFoundError: no config.json in the folder.
        ValueError: invalid JSON or invalid field (the message names the file and the field).
    """
    folder = resolve_checkpoint(str(path_or_id))
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: missing (a draft folder holds config.json and {WEIGHTS})")
    raw = read_json_object(cfg_file, "a draft config")
    raw.pop("model_type", None)
    raw.pop("transformers_version", None)
    if "dspine_config" not in raw:
        raw["dspine_config"] = {"injection": "none", "last_layer_features": "post_norm"}
    elif isinstance(raw["dspine_config"], dict) and "last_layer_features" not in raw["dspine_config"]:
        raw["dspine_config"] = {**raw["dspine_config"], "last_layer_features": "pre_norm"}
    if "dflash_config" not in raw:
        raise ValueError(f"{cfg_file}: no dflash_config block (mask_token_id, target_layer_ids); not a DFlash/DSpine draft")
    _check_types(raw, cfg_file)
    try:
        return DSpineConfig(**raw)
    except Exception as e:  # a field of the wrong shape, or fields that disagree (strict-dataclass checks)
        raise ValueError(f"{cfg_file}: {type(e).__name__}: {' '.join(str(e).split())}") from e  # the reason may sit on a later line


_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "block_size", "num_target_layers")
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "attention_dropout", "initializer_range")
_NULLABLE_FIELDS = ("head_dim", "sliding_window")  # null: derived from hidden_size / no sliding layers


def _check_types(raw: dict, cfg_file: Path) -> None:
    """Name the field when a config.json value has the wrong type or is null (before the constructor casts it)."""
    for key in (*_INT_FIELDS, "sliding_window", *_FLOAT_FIELDS):
        if key not in raw or (raw[key] is None and key in _NULLABLE_FIELDS):
            continue
        v, integer = raw[key], key not in _FLOAT_FIELDS
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
            raise ValueError(f"{cfg_file}: field {key!r} must be {'an integer' if integer else 'a number'}, got {v!r}")
        if key in _INT_FIELDS and v < 1:
            raise ValueError(f"{cfg_file}: field {key!r} must be >= 1, got {v!r}")
    for key in ("dspine_config", "rope_scaling", "rope_parameters"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ValueError(f"{cfg_file}: field {key!r} must be an object, got {raw[key]!r}")
    d = raw.get("dflash_config") or {}
    if not isinstance(d, dict):
        raise ValueError(f"{cfg_file}: field 'dflash_config' must be an object")
    ids = d.get("target_layer_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
        raise ValueError(f"{cfg_file}: field 'dflash_config.target_layer_ids' must be a list of integers, got {ids!r}")
    mask = d.get("mask_token_id")
    if mask is not None and not isinstance(mask, int):
        raise ValueError(f"{cfg_file}: field 'dflash_config.mask_token_id' must be an integer, got {mask!r}")


def check_weights(path_or_id: str | Path) -> None:
    """Open every safetensors file of a draft folder (header + data extent, no tensor read) as
    :func:`dspine.io.read_safetensors` would, and match its tensor names and shapes with its config.json.

    Raises:
        FileNotFoundError: no weights file, or a shard listed in the index is missing.
        ValueError: a truncated or corrupt file (named); missing, unexpected or misshapen tensors, as
            :func:`load_draft` would refuse them.
    """
    folder, shapes = resolve_checkpoint(str(path_or_id)), {}
    open_each_weight_file(folder, lambda fh: shapes.update({k: fh.get_slice(k).get_shape() for k in fh.keys()}))
    with torch.device("meta"):
        load_weights(DSpineDraftModel(load_config(folder)), {k: torch.empty(v) for k, v in shapes.items()}, str(folder))


def load_weights(model: DSpineDraftModel, state: dict[str, torch.Tensor], source: str,
                 allow_missing_prefixes: tuple[str, ...] = ()) -> list[str]:
    """Strictly load ``state`` into ``model``; returns the keys left at init (allowed prefixes only).

    Raises:
        ValueError: missing keys, unexpected keys (e.g. an embedding or lm_head, or injection
            tensors for a draft built without injection) or shape mismatches, all listed.
    """
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    missing = sorted(set(own) - set(state))
    allowed = [k for k in missing if any(p in k for p in allow_missing_prefixes)]
    missing = [k for k in missing if k not in allowed]
    shapes = [f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in set(state) & set(own) if state[k].shape != own[k].shape]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing[:8]}{' …' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:8]}{' …' if len(unexpected) > 8 else ''}")
    if shapes:
        problems.append("shape mismatch " + "; ".join(sorted(shapes)[:8]))
    if problems:
        raise ValueError(f"{source}: " + " | ".join(problems))
    model.load_state_dict({k: v for k, v in state.items()}, strict=not allowed)
    return allowed


def load_draft(path_or_id: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> DSpineDraftModel:
    """Load a DSpine or DFlash draft folder (or Hub id) with strict key matching.

    Returns the model in eval mode, in ``dtype`` (default: the stored dtype).
    """
    folder = resolve_checkpoint(str(path_or_id))
    config = load_config(folder)
    state = read_safetensors(folder)
    stored = next(iter(state.values())).dtype if state else torch.float32
    model = DSpineDraftModel(config)
    load_weights(model, state, str(folder))
    return model.to(device=device, dtype=dtype or stored).eval()


def save_draft(model: DSpineDraftModel, out_dir: str | Path, dtype: torch.dtype | None = None,
               metadata: dict[str, str] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (tensors cast to ``dtype`` if given).

    ``metadata`` (str -> str) goes into the safetensors header (e.g. training mode, target id); an
    absolute local path there is stored relative to the working directory (:func:`portable_path`),
    so a shipped folder does not carry the paths of the machine that built it.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype is not None else v).detach().cpu().contiguous()
             for k, v in model.state_dict().items()}
    tmp = out / (WEIGHTS + ".tmp")
    meta = {k: portable_path(str(v)) for k, v in (metadata or {}).items()}
    save_file(state, str(tmp), metadata={"format": "pt", **meta})
    default_file_mode(tmp)
    tmp.replace(out / WEIGHTS)
    model.config.save_pretrained(out)
    return out


def portable_path(value: str) -> str:
    """``value`` unchanged unless it is an absolute path, which becomes relative to the working
    directory (``/home/me/repo/runs/x`` -> ``runs/x`` when run from the repo, ``../data/y`` next to it)."""
    if not os.path.isabs(value):
        return value
    try:
        return os.path.relpath(value)
    except ValueError:  # another drive (Windows): keep the last two components only
        return os.path.join(*Path(value).parts[-2:])


def warm_start(model: DSpineDraftModel, source_dir: str | Path) -> list[str]:
    """Initialise ``model`` from the weights of a DFlash or DSpine checkpoint (``init_from``).

    Injection tensors (``*.adjacent.*``) that the source lacks keep their init. A ``residual`` model
    then starts exactly as the source draft (zero gates). A ``kv`` model gets zero ``adjacent.k_proj``
    and ``adjacent.v_proj`` weights: every query's extra key and value start at zero (score 0), so the
    attention output is the source's times ``1 - p``, ``p = 1 / (1 + Σ_j exp(s_j))`` over the query's
    other scaled scores ``s_j``. A trained ``residual`` source loses what its own injection added (the
    shipped SmolLM2 draft: loss 3.63 -> 5.01 on one CPU batch, the same with a random extra key). A
    source trained with another injection mode (``residual`` into ``kv`` or back) gives its shared tensors; its own injection
    tensors are left out (their names are logged). Returns the keys that kept their init.

    Raises:
        ValueError: another number of layers, or the same injection mode with another ``injection_rank`` /
            ``injection_layers`` (named),
            any other missing/unexpected tensor or a shape mismatch (the message names the folder).
    """
    folder = resolve_checkpoint(str(source_dir))
    state = read_safetensors(folder)
    src = load_config(folder)
    src_mode, own = src.injection, model.config
    if src.num_hidden_layers != own.num_hidden_layers:
        raise ValueError(f"{folder}: layers {src.num_hidden_layers} in the source, {own.num_hidden_layers} in the "
                         "model (set layers to the source's, or train from scratch)")
    if src_mode == own.injection != "none":  # the same mode: its tensors load, so their shapes must agree
        diff = [f"{k} {getattr(src, k)!r} in the source, {getattr(own, k)!r} in the model"
                for k in (("injection_rank",) if src_mode == "residual" else ()) + ("injection_layers",)
                if getattr(src, k) != getattr(own, k)]
        if diff:
            raise ValueError(f"{folder}: {'; '.join(diff)} (set them to the source's, or train from scratch)")
    if src_mode not in ("none", model.config.injection):
        dropped = sorted(k for k in state if ".adjacent." in k)
        state = {k: v for k, v in state.items() if k not in dropped}
        logger.warning("%s: injection %r, the model's %r: its %d injection tensors are not loaded (%s ...)",
                       folder, src_mode, model.config.injection, len(dropped), ", ".join(dropped[:3]))
    kept = load_weights(model, state, str(folder), allow_missing_prefixes=(".adjacent.",))
    if model.config.injection == "kv":
        params = dict(model.named_parameters())
        with torch.no_grad():
            for k in kept:
                if k.endswith(("adjacent.k_proj.weight", "adjacent.v_proj.weight")):
                    params[k].zero_()
    return kept
