"""The run configuration of ``train/distill.py`` and ``train.capture`` (style.md §4).

Resolution order: the :class:`RunConfig` defaults, then a YAML file (``--config FILE``), then
``key=value`` arguments. Unknown keys, wrong types and invalid choices raise :class:`ConfigError`
naming the key before any model or data is touched. The recipe defaults are docs/method.md §4.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A bad run configuration (unknown key, wrong type, invalid value); the message names the key."""


@dataclass
class RunConfig:
    # -- target -------------------------------------------------------------------------------
    target: str = ""  # frozen target: HF folder, Hub id or path/to/model.gguf
    target_dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp32
    # -- draft: a folder made by `python -m dspine.init`, or the shape fields below ------------
    draft_init: str | None = None  # draft folder (config.json + weights); shape fields must then agree or be unset
    layers: int | None = None  # draft layers (default 5)
    block_size: int | None = None  # slots per block, anchor included (default 16)
    injection: str | None = None  # residual | kv | none (none = DFlash ablation; default residual)
    injection_rank: int | None = None  # 0 = full-rank H x H injection, r > 0 = low rank (default 0)
    injection_layers: list[int] | None = None  # draft layers with injection (None = all)
    block_attention: str | None = None  # bidirectional | causal inside a block (default bidirectional)
    target_layer_ids: list[int] | None = None  # target layers feeding the draft (None = docs/method.md §2 rule)
    mask_token_id: int | None = None  # unused vocab row used as MASK (None = first row the tokenizer never emits)
    intermediate_size: int | None = None  # draft MLP width (None = the target's)
    init_from: str | None = None  # weights only (e.g. a DFlash checkpoint) via dspine.checkpoint.warm_start
    resume_from: str = "auto"  # auto (latest checkpoint in output_dir, if any) | a step-N folder | none
    # -- data ---------------------------------------------------------------------------------
    train: str = ""  # tokenized rows: a .jsonl of {input_ids, loss_mask} or a data.tokenize cache folder; several,
    # comma-separated (a,b), train on their union in that order (the data digest depends on the order; all must
    # share tokenizer, chat template and thinking mode: train.data.ConcatRows)
    eval: str | None = None  # held-out rows (same formats) for eval loss, tau_sim and tau_real prompts (none: off)
    feature_source: str = "online"  # online (target runs in the job) | a train.capture folder
    max_length: int = 3072  # tokens per sequence; longer rows are truncated
    anchors_per_seq: int = 512  # anchors sampled per sequence and step (without replacement)
    gamma: float = 7.0  # slot k weight exp(-(k-1)/gamma) (docs/method.md §4)
    distill: str = "ce"  # ce (hard labels) | kl (target's next-token distribution at a+k-1) | mix (both)
    distill_alpha: float | None = None  # mix only (any value refused with ce/kl): weight of the hard-label CE, the kl
    # term gets 1 - alpha; None = 0.5 (MIX_ALPHA) with distill=mix
    distill_temperature: float = 1.0  # T of the soft targets (both softmaxes; the soft term is scaled by T^2)
    # -- optimisation -------------------------------------------------------------------------
    lr: float = 6e-4  # peak AdamW learning rate
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW (beta1, beta2)
    warmup_ratio: float = 0.04  # fraction of the optimizer steps with linear warmup
    schedule: str = "cosine"  # cosine | linear | constant (after warmup)
    min_lr_ratio: float = 0.0  # final lr / peak lr for cosine and linear
    epochs: int = 6  # passes over the train rows (ignored when max_steps > 0)
    max_steps: int = 0  # optimizer steps; > 0 overrides epochs
    stop_after_steps: int = 0  # end this launch once the run reaches this step (an absolute step count, checkpointed;
    # a resumed run past it stops at once); the schedule keeps its length
    micro_batch_size: int = 1  # sequences per rank and forward
    grad_accum: int = 1  # micro-batches per optimizer step (global batch = micro x accum x ranks)
    grad_clip: float = 1.0  # global grad-norm clip (0 = off); also set into the DeepSpeed config
    mixed_precision: str = "auto"  # auto (bf16 on CUDA, no on CPU) | bf16 | no
    attn: str = "auto"  # auto (flex on CUDA, dense on CPU) | flex | dense
    loss_chunk_size: int = 2048  # rows per lm_head chunk in the fused cross entropy
    ce_impl: str = "auto"  # chunk math of the fused hard-label CE: auto (compiled on CUDA with distill=ce, else
    # eager) | eager | compiled (distill=ce only: kl and mix take the soft-target path)
    adamw_impl: str = "auto"  # torch AdamW kernel: auto (fused on CUDA, default on CPU) | fused | default (foreach
    # on CUDA, for-loop on CPU)
    compile_layers: str = "auto"  # regional torch.compile of decoder layers: auto (both on CUDA with padded lengths,
    # target only under ZeRO-3; none on CPU) | none | target | draft | both
    data_workers: int | None = None  # processes building the next steps' batches (None = 2 on CUDA, 0 on CPU)
    pad_to_multiple: int = 0  # right-pad sequence length to a multiple (0 = auto: 512 with flex, else 1)
    seed: int = 0  # init, data order (per epoch) and anchor sampling (per step, rank, micro-step); 0..2**32-1
    # -- output -------------------------------------------------------------------------------
    output_dir: str = "runs/dspine"  # checkpoints, metrics.jsonl, config.yaml
    save_every: int = 1000  # optimizer steps between checkpoints (0 = only at the end)
    keep_last: int = 3  # step-N checkpoints kept (0 = all)
    save_dtype: str = "bf16"  # dtype of the saved draft weights: bf16 | fp32
    # -- eval ---------------------------------------------------------------------------------
    eval_every: int = 500  # optimizer steps between evals (0 = only at the end)
    eval_max_rows: int = 256  # eval rows used for eval/loss and eval/tau_sim
    eval_prompts: int = 4  # held-out prompts decoded for eval/tau_real (0 = skip)
    eval_prompt_min_tokens: int = 1  # a prompt is the eval row up to its first supervised token, at least this long
    eval_max_new_tokens: int = 128  # greedy tokens per prompt for eval/tau_real
    # -- logging ------------------------------------------------------------------------------
    log_every: int = 10  # optimizer steps between metrics rows
    log_samples: bool = False  # write samples-rank{r}.jsonl: row indices seen per step (debug)
    report_to: str = "none"  # wandb | none (metrics.jsonl is always written)
    wandb_project: str = "dspine"  # W&B project
    wandb_run_name: str | None = None  # W&B run name (None = W&B's own)
    wandb_tags: list[str] = field(default_factory=list)  # W&B tags


CHOICES: dict[str, tuple] = {
    "target_dtype": ("auto", "bf16", "fp32"),
    "injection": ("residual", "kv", "none", None),
    "block_attention": ("bidirectional", "causal", None),
    "schedule": ("cosine", "linear", "constant"),
    "mixed_precision": ("auto", "bf16", "no"),
    "attn": ("auto", "flex", "dense"),
    "save_dtype": ("bf16", "fp32"),
    "report_to": ("wandb", "none"),
    "distill": ("ce", "kl", "mix"),
    "ce_impl": ("auto", "eager", "compiled"),
    "adamw_impl": ("auto", "fused", "default"),
    "compile_layers": ("auto", "none", "target", "draft", "both"),
}
MIX_ALPHA = 0.5  # distill_alpha of distill=mix when unset
SEED_MAX = 2**32 - 1  # seeds are 32-bit: accelerate's set_seed seeds numpy, whose range this is
POSITIVE = ("max_length", "anchors_per_seq", "micro_batch_size", "grad_accum", "loss_chunk_size", "log_every", "layers",
            "eval_max_rows", "eval_max_new_tokens")
NON_NEGATIVE = ("mask_token_id", "data_workers", "max_steps", "stop_after_steps", "epochs", "save_every", "keep_last", "eval_every", "eval_prompts",
                "pad_to_multiple", "grad_clip", "weight_decay", "warmup_ratio", "min_lr_ratio")
# Draft shape fields of the run config (None = dspine.config.DSpineConfig.for_target's default).
DRAFT_FIELDS = ("layers", "block_size", "injection", "injection_rank", "injection_layers", "block_attention",
                "target_layer_ids", "mask_token_id", "intermediate_size")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) if not typing.get_args(tp) else str(tp).replace("typing.", "")


def _coerce(key: str, value, tp, from_cli: bool):
    """``value`` as an instance of the annotated type ``tp``; raises ConfigError naming ``key``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None or (from_cli and isinstance(value, str) and value.lower() in ("null", "~", "")):
            return None
        return _coerce(key, value, inner[0], from_cli)
    if origin is list:
        if from_cli and isinstance(value, str):
            value = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v.strip()]
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
        return [_coerce(f"{key}[{i}]", v, args[0], from_cli) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif tp in (int, float):  # a float key takes an int too
        if isinstance(value, int if tp is int else (int, float)) and not isinstance(value, bool):
            return tp(value)
        if isinstance(value, str):  # YAML 1.1 reads `6e-4` as a string
            with contextlib.suppress(ValueError):
                return tp(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if from_cli and isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, bool) and key in CHOICES:  # YAML 1.1 reads yes/no/on/off/true/false as booleans
            shown = [a for a in CHOICES[key] if a is not None]
            raise ConfigError(f"config key {key!r}: expected one of {shown}, got {value!r} (YAML reads an unquoted "
                              "yes/no/on/off/true/false as a boolean; quote the value)")
    raise ConfigError(f"config key {key!r}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def apply(cfg: RunConfig, values: dict, from_cli: bool = False) -> RunConfig:
    """Set ``values`` (key -> raw value) on ``cfg`` with type checks. Raises ConfigError."""
    hints = typing.get_type_hints(RunConfig)
    for key, raw in values.items():
        if key not in hints:
            names = [f.name for f in dataclasses.fields(RunConfig)]
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint} (known keys: {', '.join(names)})")
        off = key in ("resume_from", "report_to") and (raw is None or from_cli and str(raw).lower() in ("null", "~"))
        setattr(cfg, key, "none" if off else _coerce(key, raw, hints[key], from_cli))
    return cfg


def validate(cfg: RunConfig) -> RunConfig:
    """Check choices and ranges. Raises ConfigError naming the key. ``eval: none`` is no evaluation, as null is
    (``none`` and null are the off value of report_to and resume_from too: :func:`apply`)."""
    if isinstance(cfg.eval, str) and cfg.eval.strip().lower() == "none":
        cfg.eval = None
    for key, allowed in CHOICES.items():
        if getattr(cfg, key) not in allowed:
            shown = [a for a in allowed if a is not None]
            raise ConfigError(f"config key {key!r}: {getattr(cfg, key)!r} is not one of {shown}")
    for key in POSITIVE:  # None (layers: the target's default) passes
        if getattr(cfg, key) is not None and getattr(cfg, key) < 1:
            raise ConfigError(f"config key {key!r}: must be >= 1, got {getattr(cfg, key)}")
    for key in NON_NEGATIVE:
        if getattr(cfg, key) is not None and getattr(cfg, key) < 0:
            raise ConfigError(f"config key {key!r}: must be >= 0, got {getattr(cfg, key)}")
    for key, tp in typing.get_type_hints(RunConfig).items():  # lr=nan would pass every `<` check below and train to NaN
        values = getattr(cfg, key) if typing.get_origin(tp) is list else [getattr(cfg, key)]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values or []):
            raise ConfigError(f"config key {key!r}: must be a finite number, got {getattr(cfg, key)}")
    for key in ("warmup_ratio", "min_lr_ratio"):
        if not 0 <= getattr(cfg, key) <= 1:
            raise ConfigError(f"config key {key!r}: must be in [0, 1], got {getattr(cfg, key)}")
    for key in ("lr", "gamma", "distill_temperature"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"config key {key!r}: must be > 0, got {getattr(cfg, key)}")
    if not 0 <= cfg.seed <= SEED_MAX:  # refused here, before the target loads, not by numpy's set_seed later
        raise ConfigError(f"config key 'seed': must be in [0, 2**32 - 1] (numpy's generator refuses other values "
                          f"and torch's CPU generator keeps the low 32 bits only), got {cfg.seed}")
    if cfg.target_layer_ids is not None and any(i < 0 for i in cfg.target_layer_ids):
        raise ConfigError(f"config key 'target_layer_ids': must be >= 0, got {cfg.target_layer_ids}")
    if cfg.distill_alpha is not None and not 0 <= cfg.distill_alpha <= 1:
        raise ConfigError(f"config key 'distill_alpha': must be in [0, 1], got {cfg.distill_alpha}")
    if cfg.distill != "mix" and cfg.distill_alpha is not None:
        raise ConfigError(f"config key 'distill_alpha': {cfg.distill_alpha} weighs the two terms of distill=mix only; "
                          f"distill={cfg.distill} would ignore it (set distill=mix, or drop distill_alpha)")
    if cfg.distill != "ce" and cfg.feature_source != "online":
        raise ConfigError(f"config key 'distill': {cfg.distill} needs the target's logits, which a train.capture "
                          f"folder does not hold (feature_source={cfg.feature_source}); use feature_source=online "
                          "or distill=ce")
    if cfg.draft_init and cfg.init_from:
        raise ConfigError(f"config keys 'draft_init' and 'init_from' both given ({cfg.draft_init}, {cfg.init_from}): "
                          "draft_init already loads a draft's config and weights, init_from loads weights only; "
                          "keep one of them")
    if len(cfg.betas) != 2 or not all(0 <= b < 1 for b in cfg.betas):
        raise ConfigError(f"config key 'betas': expected two values in [0, 1), got {cfg.betas}")
    if cfg.block_size is not None and cfg.block_size < 2:
        raise ConfigError(f"config key 'block_size': must be >= 2, got {cfg.block_size}")
    if cfg.block_size is not None and cfg.max_length < cfg.block_size:
        raise ConfigError(f"config key 'max_length': {cfg.max_length} is shorter than one block "
                          f"(block_size {cfg.block_size})")
    if cfg.max_steps == 0 and cfg.epochs == 0:
        raise ConfigError("config keys 'epochs' and 'max_steps' are both 0: nothing to train")
    if not cfg.target:
        raise ConfigError("config key 'target': required (HF folder, Hub id or .gguf file)")
    if not cfg.train and cfg.feature_source == "online":
        raise ConfigError("config key 'train': required (tokenized rows: .jsonl or data.tokenize cache folder)")
    return cfg


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges; a key after it overrides the merged one
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):  # an unhashable key: the caller's error
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Defaults <- YAML file <- ``key=value`` overrides, validated.

    Raises:
        ConfigError: unknown key, wrong type, bad value, malformed override or unreadable YAML; an unknown key or
            a wrong type names where it came from (``config file PATH: ...`` or ``command line override: ...``).
    """
    cfg = RunConfig()
    if path is not None:
        try:
            data = yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader) or {}
        except (OSError, yaml.YAMLError) as e:  # a YAML error: one line with its line and column in the file
            mark = getattr(e, "problem_mark", None)
            raise ConfigError(f"config file {path}:{mark.line + 1}:{mark.column + 1}: {e.problem}" if mark else
                              f"config file {path}: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping of keys to values")
        try:
            apply(cfg, data)
        except ConfigError as e:  # an unknown key or a bad type: name the file it came from
            raise ConfigError(f"config file {path}: {e}") from None
    cli = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value")
        cli[key.strip()] = value
    try:
        apply(cfg, cli, from_cli=True)
    except ConfigError as e:
        raise ConfigError(f"command line override: {e}") from None
    return validate(cfg)


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)


def save(cfg: RunConfig, folder: str | Path, extra: dict | None = None) -> None:
    """Write the resolved config as ``config.yaml`` and ``config.json`` in ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = {**to_dict(cfg), **(extra or {})}
    (folder / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (folder / "config.json").write_text(json.dumps(data, indent=2) + "\n")


def key_help() -> str:
    """One line per :class:`RunConfig` key: name, default and the comment beside its field in this file."""
    import inspect
    import re

    notes = {}
    for line in inspect.getsource(RunConfig).splitlines():
        m = re.match(r"\s+(\w+): [^=]+?(?:= (.+?))?\s+#\s*(.+)$", line)
        if m:
            notes[m.group(1)] = m.group(3)
    width = max(len(f.name) for f in dataclasses.fields(RunConfig))
    rows = []
    for f in dataclasses.fields(RunConfig):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        rows.append(f"  {f.name:<{width}}  {default!r:<10}  {notes.get(f.name, '')}".rstrip())
    return "\n".join(rows)


def parse_cli(argv: list[str], prog: str, extra_flags: tuple[str, ...] = ()) -> tuple[RunConfig, dict]:
    """``--config FILE [--flag VALUE ...] key=value ...`` -> (config, {flag: value}).

    ``extra_flags`` names further ``--flag VALUE`` options of the calling CLI (e.g. ``--out``).
    Raises ConfigError on a bad config or an unknown flag.
    """
    path, flags, overrides = None, {}, []
    it = iter(argv)
    for arg in it:
        if arg in ("-h", "--help"):
            print(f"usage: {prog} [--config FILE] " + "".join(f"[{f} VALUE] " for f in extra_flags)
                  + "[key=value ...]\n\nkeys (a YAML --config sets them, key=value overrides; default, meaning):\n"
                  + key_help())
            raise SystemExit(0)
        name, eq, val = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if name == "--config" or name in extra_flags:
            value = val if eq else next(it, None)
            if value is None:
                raise ConfigError(f"{name} needs a value")
            if name == "--config":
                path = value
            else:
                flags[name] = value
        elif arg.startswith("--"):
            raise ConfigError(f"unknown flag {arg!r} (flags: --config{''.join(' ' + f for f in extra_flags)}; "
                              "config keys go as key=value)")
        else:
            overrides.append(arg)
    return load(path, overrides), flags


def draft_config(cfg: RunConfig, target, tokenizer=None):
    """The draft's :class:`dspine.config.DSpineConfig` for this run, checked against ``target``.

    From ``cfg.draft_init`` (its config.json; shape fields set in ``cfg`` must agree) or built from
    the shape fields with the target's layer shapes (``DSpineConfig.for_target``, the home of the
    defaults).

    Raises:
        ConfigError: a shape field that disagrees with ``draft_init``.
        ValueError: draft/target mismatch (layer ids, vocab, mask token, RoPE range; docs/method.md §8.4-8.11).
    """
    from dspine.config import DSpineConfig
    from dspine.target import TargetSpec, assert_compatible

    spec = TargetSpec.from_adapter(target, tokenizer)
    if cfg.draft_init:
        dcfg = load_draft_init(cfg.draft_init)
        have = dcfg.shape()
        for key in DRAFT_FIELDS:
            want = getattr(cfg, key)
            if want is not None and want != have[key]:
                raise ConfigError(f"config key {key!r}: {want!r} disagrees with draft_init {cfg.draft_init} "
                                  f"({have[key]!r}); unset it or use another draft folder")
    else:
        dcfg = DSpineConfig.for_target(target.config, spec, **{k: getattr(cfg, k) for k in DRAFT_FIELDS})
    assert_compatible(spec, dcfg, max_context=cfg.max_length)
    return dcfg


def load_draft_init(path: str):
    """The :class:`dspine.config.DSpineConfig` of the ``draft_init`` folder (or Hub id).

    Raises:
        ConfigError: naming 'draft_init', and the ``draft/`` subfolder when ``path`` is a trainer
            step-N checkpoint (its config.json is the run config, the draft sits in ``draft/``).
    """
    from dspine.checkpoint import load_config

    try:
        return load_config(path)
    except (ValueError, FileNotFoundError) as e:
        sub = Path(path) / "draft"
        if (sub / "config.json").is_file():
            raise ConfigError(f"config key 'draft_init': {path} is not a draft folder but holds one in its draft/ "
                              f"subfolder (a trainer step-N checkpoint?): give draft_init={sub}") from None
        if isinstance(e, FileNotFoundError):
            raise
        raise ConfigError(f"config key 'draft_init': {e}") from None


def resolve_device_settings(cfg: RunConfig, cuda: bool, zero3: bool = False) -> dict:
    """The ``auto`` fields made concrete: target dtype, mixed precision, attention backend, length padding,
    data workers and the step speed-ups (``ce_impl``, ``adamw_impl``, ``compile_layers``; all on with CUDA,
    off on the CPU so that CPU runs start without compiling; an explicit value is kept on either).

    ``compile_layers: auto`` compiles the target's and the draft's layers on CUDA when lengths are padded to
    a few buckets (``pad_to_multiple`` > 1; each padded length compiles once), the target's only under
    DeepSpeed ZeRO-3 (``zero3``: compiling partitioned draft layers is untested).

    Raises:
        ConfigError: ``attn: flex`` without CUDA (flex_attention has no CPU backward).
    """
    if cfg.attn == "flex" and not cuda:
        raise ConfigError("config key 'attn': flex needs a CUDA GPU (flex_attention has no CPU backward); "
                          "use attn=dense (or auto) on the CPU")
    if cfg.ce_impl == "compiled" and cfg.distill != "ce":
        raise ConfigError(f"config key 'ce_impl': compiled applies to the hard-label CE only (distill=ce); "
                          f"distill={cfg.distill} takes the soft-target path: use ce_impl=auto or eager")
    attn = cfg.attn if cfg.attn != "auto" else ("flex" if cuda else "dense")
    # flex_attention is compiled per shape: a few length buckets keep recompiles bounded
    pad = cfg.pad_to_multiple or (512 if attn == "flex" else 1)
    compile_layers = cfg.compile_layers
    if compile_layers == "auto":
        compile_layers = "none" if not cuda or pad == 1 else ("target" if zero3 else "both")
    return {
        "target_dtype": cfg.target_dtype if cfg.target_dtype != "auto" else ("bf16" if cuda else "fp32"),
        "mixed_precision": cfg.mixed_precision if cfg.mixed_precision != "auto" else ("bf16" if cuda else "no"),
        "attn": attn,
        "pad_to_multiple": pad,
        "data_workers": cfg.data_workers if cfg.data_workers is not None else (2 if cuda else 0),
        # the compiled chunk math is the hard-label CE's (train.loss): distill kl / mix take the soft path
        "ce_impl": cfg.ce_impl if cfg.ce_impl != "auto" else ("compiled" if cuda and cfg.distill == "ce" else "eager"),
        "adamw_impl": cfg.adamw_impl if cfg.adamw_impl != "auto" else ("fused" if cuda else "default"),
        "compile_layers": compile_layers,
    }
