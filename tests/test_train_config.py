"""Run config: defaults <- YAML <- key=value, typed errors naming the key (style.md §4)."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import REPO
from train.config import ConfigError, RunConfig, load, parse_cli, resolve_device_settings, save


def write(tmp_path, text: str):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_defaults_are_the_recipe():
    c = RunConfig()
    assert (c.lr, c.weight_decay, c.warmup_ratio, c.schedule, c.epochs, c.max_length) == (6e-4, 0.0, 0.04, "cosine", 6, 3072)
    assert (c.anchors_per_seq, c.gamma, c.grad_clip, c.resume_from, c.feature_source) == (512, 7.0, 1.0, "auto", "online")


def test_yaml_then_overrides(tmp_path):
    p = write(tmp_path, "target: t\ntrain: d.jsonl\nlr: 6e-4\nlayers: 3\nwandb_tags: [a, b]\n")
    cfg = load(p, ["lr=1e-3", "layers=2", "target_layer_ids=1,9,17", "draft_init=null", "log_samples=true",
                   "betas=[0.9, 0.95]"])
    assert cfg.lr == 1e-3 and isinstance(cfg.lr, float)
    assert cfg.layers == 2 and cfg.target_layer_ids == [1, 9, 17] and cfg.wandb_tags == ["a", "b"]
    assert cfg.draft_init is None and cfg.log_samples is True and cfg.betas == [0.9, 0.95]
    assert load(p).lr == 6e-4  # YAML 1.1 reads 6e-4 as a string: still a float here


@pytest.mark.parametrize("source, key", [("yaml", "lrr"), ("cli", "anchors")])
def test_unknown_key_is_named(tmp_path, source, key):
    text = "target: t\ntrain: d\n" + (f"{key}: 1\n" if source == "yaml" else "")
    with pytest.raises(ConfigError, match=f"unknown config key '{key}'"):
        load(write(tmp_path, text), [] if source == "yaml" else [f"{key}=1"])


@pytest.mark.parametrize("text,where,problem", [
    ("target: t\nlr: [\n", "3:1", "expected the node content, but found '<stream end>'"),
    ("target: t\n- a\n", "2:1", "expected <block end>, but found '-'"),
    ("target: t\n\tlr: 1\n", "2:1", "found character '\\t' that cannot start any token"),
    ("target: t\ntrain: d\nlr: 1\nlr: 2\n", "4:1", "key 'lr' given twice"),
])
def test_a_yaml_syntax_error_is_one_line_with_the_files_line_and_column(tmp_path, text, where, problem):
    """It was PyYAML's message of 4-7 lines, whose location named '<unicode string>', not the file."""
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load(p)
    assert str(e.value) == f"config file {p}:{where}: {problem}"


def test_a_yaml_key_given_twice_is_refused_and_the_last_override_wins(tmp_path):
    """PyYAML keeps the last of two values of a key silently: a config file's second is refused. On the command line
    the last override wins (scripts append a run's overrides to a common list)."""
    with pytest.raises(ConfigError, match=r"config file .*: key 'lr' given twice"):
        load(write(tmp_path, "target: t\ntrain: d\nlr: 1e-4\nlr: 2e-4\n"))
    assert load(write(tmp_path, "target: t\ntrain: d\n"), ["lr=1e-4", "lr=2e-4"]).lr == 2e-4
    merged = load(write(tmp_path, "target: t\ntrain: d\n<<: {lr: 0.002, seed: 3}\nlr: 0.005\n"))  # a merge key
    assert (merged.lr, merged.seed) == (0.005, 3)


@pytest.mark.parametrize("override, key, expected", [
    ("lr=fast", "lr", "float"), ("layers=2.5", "layers", "int"), ("log_samples=maybe", "log_samples", "bool"),
    ("target_layer_ids=1,x", "target_layer_ids[1]", "int"), ("mask_token_id=abc", "mask_token_id", "int"),
])
def test_wrong_type_names_key_and_type(tmp_path, override, key, expected):
    with pytest.raises(ConfigError) as e:
        load(write(tmp_path, "target: t\ntrain: d\n"), [override])
    assert f"'{key}'" in str(e.value) and expected in str(e.value)


def test_wrong_type_in_yaml(tmp_path):
    with pytest.raises(ConfigError, match="'micro_batch_size': expected int"):
        load(write(tmp_path, "target: t\ntrain: d\nmicro_batch_size: [1]\n"))
    with pytest.raises(ConfigError, match="'report_to': 'tensorboard' is not one of"):
        load(write(tmp_path, "target: t\ntrain: d\nreport_to: tensorboard\n"))
    with pytest.raises(ConfigError, match="'grad_accum': must be >= 1"):
        load(write(tmp_path, "target: t\ntrain: d\ngrad_accum: 0\n"))
    for key in ("eval_max_rows", "eval_max_new_tokens"):  # were refused only at the first eval, after training
        with pytest.raises(ConfigError, match=f"'{key}': must be >= 1, got 0"):
            load(write(tmp_path, f"target: t\ntrain: d\n{key}: 0\n"))
    with pytest.raises(ConfigError, match="'target': required"):
        load(write(tmp_path, "train: d\n"))


def test_parse_cli_flags(tmp_path):
    p = write(tmp_path, "target: t\ntrain: d\n")
    cfg, flags = parse_cli(["--config", str(p), "--out", "x", "seed=3"], "prog", extra_flags=("--out",))
    assert cfg.seed == 3 and flags == {"--out": "x"}
    with pytest.raises(ConfigError, match="unknown flag '--bogus'"):
        parse_cli(["--config", str(p), "--bogus", "1"], "prog")


def test_save_round_trip(tmp_path):
    cfg = load(write(tmp_path, "target: t\ntrain: d\nlayers: 2\n"))
    save(cfg, tmp_path / "out", extra={"world_size": 2})
    data = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    assert data["layers"] == 2 and data["world_size"] == 2
    data.pop("world_size")
    assert load(None, [f"{k}={v}" for k, v in data.items() if v is not None and not isinstance(v, list)]).layers == 2


def test_auto_settings():
    cfg = RunConfig(target="t", train="d")
    assert resolve_device_settings(cfg, cuda=True) == {"target_dtype": "bf16", "mixed_precision": "bf16",
                                                        "attn": "flex", "pad_to_multiple": 512,
                                                        "data_workers": 2, "ce_impl": "compiled",
                                                        "adamw_impl": "fused", "compile_layers": "both"}
    assert resolve_device_settings(cfg, cuda=False) == {"target_dtype": "fp32", "mixed_precision": "no",
                                                         "attn": "dense", "pad_to_multiple": 1,
                                                         "data_workers": 0, "ce_impl": "eager",
                                                         "adamw_impl": "default", "compile_layers": "none"}


def test_step_speedups_auto_and_explicit():
    """ce_impl, adamw_impl, compile_layers (issue 15): auto = on with CUDA, off on the CPU; explicit values are
    kept on either; compile_layers auto needs padded lengths and leaves the ZeRO-3 draft eager."""
    keys = ("ce_impl", "adamw_impl", "compile_layers")
    cfg = RunConfig(target="t", train="d")
    assert (cfg.ce_impl, cfg.adamw_impl, cfg.compile_layers) == ("auto", "auto", "auto")
    resolved = lambda c, **kw: tuple(resolve_device_settings(c, **kw)[k] for k in keys)
    assert resolved(cfg, cuda=True, zero3=True) == ("compiled", "fused", "target")
    assert resolved(cfg, cuda=False, zero3=True) == ("eager", "default", "none")
    # dense attention on CUDA pads to 1 token: every length would compile, so auto leaves the layers eager
    assert resolved(load(None, ["target=t", "train=d", "attn=dense"]), cuda=True) == ("compiled", "fused", "none")
    assert resolved(load(None, ["target=t", "train=d", "attn=dense", "pad_to_multiple=256"]), cuda=True)[2] == "both"
    explicit = load(None, ["target=t", "train=d", "ce_impl=compiled", "adamw_impl=fused", "compile_layers=draft"])
    assert resolved(explicit, cuda=False) == resolved(explicit, cuda=True, zero3=True) == ("compiled", "fused", "draft")
    off = load(None, ["target=t", "train=d", "ce_impl=eager", "adamw_impl=default", "compile_layers=none"])
    assert resolved(off, cuda=True) == ("eager", "default", "none")
    # the compiled chunk math belongs to the hard-label CE: kl / mix resolve auto to eager and refuse compiled
    for distill in ("kl", "mix"):
        assert resolved(load(None, ["target=t", "train=d", f"distill={distill}"]), cuda=True)[0] == "eager"
        with pytest.raises(ConfigError, match="ce_impl': compiled applies to the hard-label CE only"):
            resolve_device_settings(load(None, ["target=t", "train=d", f"distill={distill}", "ce_impl=compiled"]),
                                    cuda=True)


@pytest.mark.parametrize("key, value, choices", [
    ("ce_impl", "fast", "['auto', 'eager', 'compiled']"),
    ("adamw_impl", "foreach", "['auto', 'fused', 'default']"),
    ("compile_layers", "all", "['auto', 'none', 'target', 'draft', 'both']"),
])
def test_step_speedups_bad_values_name_the_key(tmp_path, key, value, choices):
    shown = f"config key '{key}': '{value}' is not one of {choices}"
    for yaml_text, cli in ((f"{key}: {value}\n", []), ("", [f"{key}={value}"])):
        with pytest.raises(ConfigError) as e:
            load(write(tmp_path, "target: t\ntrain: d\n" + yaml_text), cli)
        assert shown in str(e.value)
    with pytest.raises(ConfigError) as e:  # YAML reads an unquoted `on` as a boolean
        path = write(tmp_path, f"target: t\ntrain: d\n{key}: on\n")
        load(path)
    assert str(e.value) == (f"config file {path}: config key '{key}': expected one of {choices}, got True (YAML reads "
                            "an unquoted yes/no/on/off/true/false as a boolean; quote the value)")
    with pytest.raises(ConfigError, match="^command line override: unknown config key 'gama'"):
        load(write(tmp_path, "target: t\ntrain: d\n"), ["gama=1"])


def test_distill_cli_fails_fast_on_bad_config(tmp_path, capsys):
    """train/distill.py's main() in this process: the key is refused while the command line is read."""
    from train.distill import main

    p = write(tmp_path, "target: t\ntrain: d\n")
    assert main(["--config", str(p), "gama=7"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'gama'" in err and "did you mean 'gamma'" in err


@pytest.mark.parametrize("seed", [-1, 2**32, 2**64 + 1, -(2**64) + 1])
def test_out_of_range_seed_is_refused_not_wrapped(tmp_path, capsys, seed):
    """A seed outside [0, 2**32 - 1] is refused while the config is read, naming the key and the value (was: refused
    by numpy in accelerate's set_seed after the target had loaded, a message without the key; and torch's CPU
    generator, which seeds the data order, keeps the low 32 bits only: 2**32 read the rows in seed 0's order)."""
    from train.distill import main

    p = write(tmp_path, "target: t\ntrain: d\n")
    message = "config key 'seed': must be in [0, 2**32 - 1]"
    for cfg_source in ("cli", "yaml"):
        with pytest.raises(ConfigError) as e:
            if cfg_source == "cli":
                load(p, [f"seed={seed}"])
            else:
                load(write(tmp_path, f"target: t\ntrain: d\nseed: {seed}\n"))
        assert message in str(e.value) and str(e.value).endswith(f"got {seed}")
    assert main(["--config", str(p), f"seed={seed}"]) == 2  # before the target (t, no such model) is looked at
    err = capsys.readouterr().err
    assert message in err and f"got {seed}" in err


def test_seed_range_ends_are_accepted(tmp_path):
    p = write(tmp_path, "target: t\ntrain: d\n")
    assert [load(p, [f"seed={s}"]).seed for s in (0, 2**32 - 1)] == [0, 2**32 - 1]


def test_config_files_hold_only_what_differs_from_the_defaults():
    """configs/*.yaml repeat no default (RunConfig's, or the draft's from DSpineConfig); each DFlash
    ablation equals its DSpine file but for the injection and the run's names."""
    from dspine.config import DEFAULT_BLOCK_SIZE, DEFAULT_LAYERS, DSPINE_DEFAULTS

    base = RunConfig()
    draft = {"layers": DEFAULT_LAYERS, "block_size": DEFAULT_BLOCK_SIZE, **DSPINE_DEFAULTS}
    for path in sorted((REPO / "configs").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        cfg = load(path)  # and every file is valid
        repeated = [k for k in data if getattr(cfg, k) == (draft[k] if k in draft else getattr(base, k))]
        assert not repeated, f"{path.name} repeats defaults: {repeated}"
    for name in ("qwen3-8b-{}-b16.yaml", "smollm2-135m-{}.yaml"):
        spine, flash = (yaml.safe_load((REPO / "configs" / name.format(k)).read_text()) for k in ("dspine", "dflash"))
        differ = {k for k in spine.keys() | flash.keys() if spine.get(k) != flash.get(k)}
        assert flash["injection"] == "none" and differ <= {"injection", "injection_rank", "output_dir", "wandb_run_name",
                                                            "wandb_tags"}, name


def test_draft_init_with_init_from_is_refused():
    with pytest.raises(ConfigError, match="config keys 'draft_init' and 'init_from' both given"):
        load(None, ["target=t", "train=x", "draft_init=a", "init_from=b"])


def test_trainer_resume_and_path_errors_name_the_fix(tmp_path):
    """max_steps below the checkpoint (was: a warning, exit 0), a truncated state (was: a SafetensorError
    traceback), a step folder as draft_init, a folder of caches or a data.pack archive as train."""
    import torch
    from accelerate import Accelerator

    from train.config import load_draft_init
    from train.distill import check_resume, load_resume_state, open_train_rows, resolve_resume

    cfg = load(None, ["target=t", "train=x", "max_steps=100"])
    with pytest.raises(ConfigError, match=r"checkpoint is at step 300 but this run has 100 total steps .*max_steps=100"):
        check_resume({"step": 300}, cfg, 1, 100)
    check_resume({"step": 100}, cfg, 1, 100)

    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(4, 4))
    for n in (1, 2):
        acc.save_state(str(tmp_path / f"step-{n}" / "state"))
        (tmp_path / f"step-{n}" / "trainer_state.json").write_text("{}")
    load_resume_state(acc, tmp_path / "step-2")
    for ckpt, what in ((tmp_path / "step-2", None), (tmp_path / "step-9", "does not exist"),
                       (tmp_path, r"is not a step-N checkpoint \(trainer_state.json \+ state/\)")):
        c = load(None, ["target=t", "train=x", f"resume_from={ckpt}", f"output_dir={tmp_path / 'o'}"])
        if what is None:
            assert resolve_resume(c, tmp_path / "o") == ckpt
        else:  # newcomer review: a deleted folder read "is not a step-N checkpoint"
            with pytest.raises(ConfigError, match=rf"config key 'resume_from': {ckpt} {what}"):
                resolve_resume(c, tmp_path / "o")
    weights = tmp_path / "step-2" / "state" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])
    with pytest.raises(ConfigError, match=rf"resume from {tmp_path / 'step-2'}: cannot read .*SafetensorError.*"
                                          rf"resume_from=<step-N folder> \(available: {tmp_path / 'step-1'}\)"):
        load_resume_state(acc, tmp_path / "step-2")
    del model

    step = tmp_path / "step-300"
    save(RunConfig(), step)  # a trainer checkpoint: the run config beside draft/
    (step / "draft").mkdir()
    (step / "draft" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=rf"'draft_init': {step} is not a draft folder .* give draft_init={step}/draft"):
        load_draft_init(str(step))

    (tmp_path / "caches" / "train").mkdir(parents=True)
    (tmp_path / "caches" / "train" / "data.arrow").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"^config key 'train': .*give the <key> subfolder, e.g. train=.*caches/train"):
        open_train_rows(str(tmp_path / "caches"))
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "pack.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^config key 'train': .*python -m data.pack import --parts"):
        open_train_rows(str(tmp_path / "archive"))


def test_eval_none_is_off(tmp_path):
    """eval=none turns evaluation off like eval=null (none is the off value of report_to and resume_from too)."""
    for cli in (["eval=none"], ["eval=None"], ["eval=null"]):
        assert load(write(tmp_path, "target: t\ntrain: d\neval: rows.jsonl\n"), cli).eval is None
    assert load(write(tmp_path, "target: t\ntrain: d\neval: none\n")).eval is None
    assert load(write(tmp_path, "target: t\ntrain: d\neval: rows.jsonl\n")).eval == "rows.jsonl"
    # null is the off value of resume_from and report_to as well (it was refused: "expected str")
    cfg = load(write(tmp_path, "target: t\ntrain: d\nresume_from: null\nreport_to: ~\n"))
    assert (cfg.resume_from, cfg.report_to) == ("none", "none")
    assert load(write(tmp_path, "target: t\ntrain: d\n"), ["resume_from=null"]).resume_from == "none"
    with pytest.raises(ConfigError, match="'output_dir': expected str"):  # other string keys still need a string
        load(write(tmp_path, "target: t\ntrain: d\noutput_dir: null\n"))


def test_distill_config_values_are_checked_when_read():
    from train import config as run_config

    for override, message in [("lr=nan", "'lr': must be a finite number, got nan"),
                              ("warmup_ratio=1.5", "'warmup_ratio': must be in [0, 1], got 1.5"),
                              ("betas=[0.9,.inf]", "'betas': must be a finite number"),
                              ("max_length=4", "'max_length': 4 is shorter than one block (block_size 8)"),
                              ("mask_token_id=-1", "'mask_token_id': must be >= 0")]:
        with pytest.raises(run_config.ConfigError) as e:
            run_config.load(REPO / "configs" / "stories260k-cpu.yaml", ["target=x", override])
        assert message in str(e.value), override
    cfg = run_config.load(REPO / "configs" / "stories260k-cpu.yaml", ["target=x", "attn=flex"])
    with pytest.raises(run_config.ConfigError, match="'attn': flex needs a CUDA GPU.*attn=dense"):
        run_config.resolve_device_settings(cfg, cuda=False)
