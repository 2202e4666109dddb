"""Config, checkpoints, compatibility checks and the command-line contracts of the model core."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dspine import check as check_cli
from dspine import init as init_cli
from dspine.checkpoint import load_config, load_draft, save_draft
from dspine.config import DSpineConfig, default_target_layer_ids
from dspine.model import DSpineDraftModel
from dspine.target import TargetSpec, assert_compatible, check_compat
from tests.conftest import REPO


def small_config(**over) -> DSpineConfig:
    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, head_dim=8, block_size=8, num_target_layers=5,
              dflash_config={"mask_token_id": 0, "target_layer_ids": [1, 3]})
    kw.update(over)
    return DSpineConfig(**kw)


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, docs/method.md §2
    assert default_target_layer_ids(30, 3) == [1, 14, 27]


def test_config_roundtrip_and_auto_registration(tmp_path):
    from transformers import AutoConfig

    cfg = small_config(dspine_config={"injection": "kv", "injection_rank": 0, "block_attention": "causal"})
    cfg.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [1, 3]}
    assert raw["dspine_config"]["injection"] == "kv" and raw["block_size"] == 8 and raw["model_type"] == "dspine"
    again = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(again, DSpineConfig) and again.block_attention == "causal"


def test_dflash_ablation_writes_the_dflash_header(tmp_path):
    model = DSpineDraftModel(small_config(dspine_config={"injection": "none"}))
    save_draft(model, tmp_path)
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # not safetensors' 0600
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "qwen3" and raw["architectures"] == ["DFlashDraftModel"]
    again = load_draft(tmp_path)
    assert again.config.injection == "none" and torch.equal(again.fc.weight, model.fc.weight)


@pytest.mark.parametrize("over,field", [
    ({"dspine_config": {"injection": "cross"}}, "dspine_config.injection"),
    ({"dspine_config": {"block_attention": "sideways"}}, "dspine_config.block_attention"),
    ({"dspine_config": {"injection_rank": -1}}, "dspine_config.injection_rank"),
    ({"dspine_config": {"injection_layers": [7]}}, "dspine_config.injection_layers"),
    ({"dspine_config": {"gates": 1}}, "unknown dspine_config keys"),
    ({"dflash_config": {"mask_token_id": 600, "target_layer_ids": [1]}}, "mask_token_id=600"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_window"),
    ({"block_size": 1}, "block_size"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
])
def test_bad_config_fields_name_the_field(over, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.").replace("=", "=")):
        small_config(**over)


def test_compat_checks(stories_dir, tiny_qwen3_dir):
    spec = TargetSpec.from_pretrained(str(stories_dir))
    assert all(r.ok for r in check_compat(spec, small_config(), max_context=400))
    cases = {
        "dflash_config.target_layer_ids": small_config(dflash_config={"mask_token_id": 0, "target_layer_ids": [1, 5]}),
        "hidden_size": small_config(hidden_size=128, head_dim=16),
        "vocab_size": small_config(vocab_size=600),
        "max_position_embeddings": small_config(max_position_embeddings=256),
    }
    for field, cfg in cases.items():
        bad = {r.field for r in check_compat(spec, cfg, max_context=400) if not r.ok}
        assert field in bad, (field, bad)
    eos_mask = small_config(dflash_config={"mask_token_id": 2, "target_layer_ids": [1, 3]})
    with pytest.raises(ValueError, match="mask_token_id.*eos"):
        assert_compatible(spec, eos_mask)
    # a padded target vocabulary (Qwen3: 151,669 tokens, 151,936 rows) is fine
    qspec = TargetSpec.from_pretrained(str(tiny_qwen3_dir))
    qcfg = DSpineConfig(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_target_layers=4,
                        dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 2]})
    rows = {r.field: r for r in check_compat(qspec, qcfg)}
    assert all(r.ok for r in rows.values()) and "padded" in rows["vocab_size"].note
    with pytest.raises(ValueError, match="outside the embedding"):
        qcfg.dflash_config["mask_token_id"] = 151936 + 5
        qcfg.vocab_size = 151936
        assert_compatible(qspec, qcfg)


def test_checkpoint_errors_name_the_file(tmp_path):
    model = DSpineDraftModel(small_config())
    folder = save_draft(model, tmp_path / "ok")
    assert torch.equal(load_draft(folder).fc.weight, model.fc.weight)
    # missing weights
    (tmp_path / "noweights").mkdir()
    small_config().save_pretrained(tmp_path / "noweights")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_draft(tmp_path / "noweights")
    # corrupt weights
    save_draft(model, tmp_path / "corrupt")
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match=r"corrupt/model\.safetensors: not a readable safetensors"):
        load_draft(tmp_path / "corrupt")
    # no config
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_config(tmp_path)
    # a stored embedding (target weights must never be in a draft) or injection tensors the config lacks
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_draft(model, tmp_path / "extra")
    save_file({**state, "embed_tokens.weight": torch.zeros(512, 64)}, str(tmp_path / "extra" / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensors.*embed_tokens"):
        load_draft(tmp_path / "extra")
    save_file({k: v for k, v in state.items() if "adjacent" not in k}, str(tmp_path / "extra" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors.*adjacent"):
        load_draft(tmp_path / "extra")
    # broken JSON
    (tmp_path / "ok" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_draft(tmp_path / "ok")


def test_init_and_check_cli(stories_dir, tiny_qwen3_dir, tmp_path, capsys):
    out = tmp_path / "draft"
    assert init_cli.main(["--target", str(stories_dir), "--out", str(out), "--layers", "2", "--block-size", "8",
                          "--mask-token-id", "3", "--dtype", "fp32"]) == 0
    cfg = load_config(out)
    assert cfg.hidden_size == 64 and cfg.num_target_layers == 5 and cfg.injection == "residual"
    assert init_cli.main(["--target", str(stories_dir), "--out", str(out)]) == 2  # never overwrite
    # warm start from a DFlash-style (injection none) folder: the new draft equals it
    dflash = tmp_path / "dflash"
    assert init_cli.main(["--target", str(stories_dir), "--out", str(dflash), "--layers", "2", "--block-size", "8",
                          "--mask-token-id", "3", "--injection", "none", "--dtype", "fp32"]) == 0
    warm = tmp_path / "warm"
    assert init_cli.main(["--target", str(stories_dir), "--out", str(warm), "--layers", "2", "--block-size", "8",
                          "--mask-token-id", "3", "--init-from", str(dflash), "--dtype", "fp32"]) == 0
    a, b = load_draft(dflash), load_draft(warm)
    assert torch.equal(a.fc.weight, b.fc.weight) and torch.equal(b.layers[0].adjacent.gate, torch.zeros(64))
    capsys.readouterr()
    assert check_cli.main(["--target", str(stories_dir), "--draft", str(out)]) == 0
    assert "MISMATCH" not in capsys.readouterr().out
    # a draft sized for another target
    assert check_cli.main(["--target", str(tiny_qwen3_dir), "--draft", str(out)]) == 1
    text = capsys.readouterr().out
    assert "MISMATCH" in text and "hidden_size" in text
    # stories260K has no unused embedding row: the mask token must be chosen explicitly
    assert init_cli.main(["--target", str(stories_dir), "--out", str(tmp_path / "nomask")]) == 2
    assert "mask-token-id" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # an argparse choice: refused before the target loads
        init_cli.main(["--target", str(stories_dir), "--out", str(tmp_path / "x"), "--injection", "sideways",
                       "--mask-token-id", "3"])
    assert e.value.code == 2 and "invalid choice: 'sideways'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_generate_cli_json(stories_dir, tmp_path, capsys):
    from infer import generate

    threads = torch.get_num_threads()
    want = 1 if threads != 1 else 2  # --threads: a count other than the current one, restored below

    out = tmp_path / "draft"
    assert init_cli.main(["--target", str(stories_dir), "--out", str(out), "--layers", "1", "--block-size", "8",
                          "--mask-token-id", "3", "--dtype", "fp32"]) == 0
    capsys.readouterr()
    rc = generate.main(["--target", str(stories_dir), "--draft", str(out), "--prompt", "Once upon",
                        "--max-new-tokens", "24", "--backend", "reference", "--json", "--compare-ar",
                        "--threads", str(want)])
    assert rc == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    got = torch.get_num_threads()
    torch.set_num_threads(threads)
    assert res["threads"] == want == got
    for key in ("text", "token_ids", "num_tokens", "accept_len", "accept_at_pos", "accept_hist", "verify_steps", "tok_per_s"):
        assert key in res
    assert res["num_tokens"] == 24 and res["ar_equal"] is True
    assert res["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 24, "seed": 0,
                               "draft_temperature": None, "invariant": False}
    assert res["text"].startswith("a time, there was")
    assert abs(res["accept_len"] - 1 - sum(res["accept_at_pos"])) < 1e-9
    assert sum(res["accept_hist"]) == res["verify_steps"] == 23
    assert generate.main(["--target", str(stories_dir), "--draft", str(tmp_path / "missing"), "--prompt", "x",
                          "--backend", "reference"]) == 2


def test_generate_cli_prints_both_speeds_with_compare_ar(stories_dir, tmp_path, capsys):
    """The text summary of --compare-ar gives tok/s with the draft, the speedup, tok/s without it (the three
    agree: speedup = with ÷ without, up to the printed rounding) and that the greedy outputs are the same."""
    import re

    from infer import generate

    out = tmp_path / "draft"
    assert init_cli.main(["--target", str(stories_dir), "--out", str(out), "--layers", "1", "--block-size", "8",
                          "--mask-token-id", "3", "--dtype", "fp32"]) == 0
    capsys.readouterr()
    assert generate.main(["--target", str(stories_dir), "--draft", str(out), "--prompt", "Once upon",
                          "--max-new-tokens", "24", "--backend", "reference", "--compare-ar"]) == 0
    text = capsys.readouterr()
    line = next(x for x in (text.out + text.err).splitlines() if "over AR" in x)
    m = re.search(r"([\d.]+) tok/s  speedup ([\d.]+)x over AR \(([\d.]+) tok/s without the draft, same output\)",
                  line)  # fp32 reference decoding: lossless, so the same tokens
    assert m, line
    with_draft, speedup, without = (float(x) for x in m.groups())
    assert without > 0 and abs(with_draft / without - speedup) <= 0.01 * speedup + 0.006, line


def test_save_draft_stores_no_absolute_paths(tmp_path, monkeypatch):
    from safetensors import safe_open

    monkeypatch.chdir(tmp_path)
    save_draft(DSpineDraftModel(small_config()), tmp_path / "d", metadata={
        "target": str(tmp_path / "runs" / "target"), "train": "/elsewhere/tok/abc/", "init_from": "z-lab/Qwen3-8B-DFlash-b16",
        "step": "3"})
    with safe_open(str(tmp_path / "d" / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert meta["target"] == "runs/target" and not meta["train"].startswith("/") and meta["train"].endswith("elsewhere/tok/abc")
    assert meta["init_from"] == "z-lab/Qwen3-8B-DFlash-b16" and meta["step"] == "3"


def test_default_layer_ids_are_distinct_for_shallow_targets():
    from dspine.config import default_target_layer_ids as ids

    assert ids(36, 5) == [1, 9, 17, 25, 33]
    assert ids(5, 5) == [0, 1, 2, 3, 4] and ids(5, 3) == [1, 2, 3]


def test_draft_config_type_errors_name_the_field(tmp_path):
    small_config().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "block_size": "eight"}))
    with pytest.raises(ValueError, match="field 'block_size' must be an integer"):
        load_config(tmp_path)
    bad = {**raw, "dflash_config": {"mask_token_id": 0, "target_layer_idz": [1]}}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="unknown dflash_config keys.*target_layer_idz"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": raw["num_hidden_layers"] + 1}))
    with pytest.raises(ValueError, match=rf"validate_layer_type': ValueError: `num_hidden_layers` \({raw['num_hidden_layers'] + 1}\) "
                       rf"must be equal to the number of `layer_types` \({raw['num_hidden_layers']}\)"):
        load_config(tmp_path)  # the strict-dataclass reason is on the message's second line; it was cut off


def test_draft_config_null_or_wrong_type_number_names_file_field_and_value(tmp_path):
    small_config().save_pretrained(tmp_path)
    cfg_file = tmp_path / "config.json"
    raw = json.loads(cfg_file.read_text())
    for key, value, want in (("rms_norm_eps", None, "a number"), ("hidden_size", None, "an integer"),
                             ("initializer_range", "0.02", "a number"), ("sliding_window", "4", "an integer")):
        cfg_file.write_text(json.dumps({**raw, key: value}))
        with pytest.raises(ValueError) as e:
            load_config(tmp_path)
        assert str(e.value) == f"{cfg_file}: field {key!r} must be {want}, got {value!r}"
    cfg_file.write_text(json.dumps({**raw, "head_dim": None, "sliding_window": None}))
    cfg = load_config(tmp_path)  # null here means "derive from hidden_size" / "no sliding layers"
    assert (cfg.head_dim, cfg.sliding_window) == (64 // 8, None)


def test_init_from_keeps_the_source_layout(stories_dir, tmp_path):
    src = tmp_path / "src"
    base = ["--target", str(stories_dir), "--dtype", "fp32"]
    assert init_cli.main([*base, "--out", str(src), "--layers", "1", "--block-size", "8", "--mask-token-id", "3",
                          "--injection", "none"]) == 0
    assert init_cli.main([*base, "--out", str(tmp_path / "ok"), "--init-from", str(src)]) == 0
    cfg = load_config(tmp_path / "ok")
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.mask_token_id) == (1, 8, 3) and cfg.injection == "residual"
    assert init_cli.main([*base, "--out", str(tmp_path / "bad"), "--init-from", str(src), "--block-size", "16"]) == 2
    assert not (tmp_path / "bad").exists()


def test_init_refuses_bad_sliding_layers_and_a_file_as_out(stories_dir, tmp_path, capsys):
    base = ["--target", str(stories_dir), "--layers", "2", "--mask-token-id", "0", "--dtype", "fp32"]
    for bad in ("7", "-1"):
        assert init_cli.main([*base, "--out", str(tmp_path / bad), "--sliding-layers", bad]) == 2
        assert f"--sliding-layers [{bad}] outside [0, 2)" in capsys.readouterr().err
        assert not (tmp_path / bad).exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert init_cli.main([*base, "--out", str(afile)]) == 2
    assert f"--out {afile} is an existing file" in capsys.readouterr().err


def test_check_table_hidden_size_mismatch_shows_both_values(stories_dir):
    spec = TargetSpec.from_pretrained(str(stories_dir))
    cfg = small_config()
    cfg.hidden_size = spec.hidden_size + 8
    row = next(r for r in check_compat(spec, cfg) if r.field == "hidden_size")
    assert not row.ok and row.note.startswith(f"target {spec.hidden_size} != draft {spec.hidden_size + 8}")
    with pytest.raises(ValueError) as e:
        assert_compatible(spec, cfg)
    assert "()" not in str(e.value) and f"hidden_size: target={spec.hidden_size} draft={spec.hidden_size + 8} (" in str(e.value)


def test_stories_config_comment_matches_its_values():
    import yaml

    text = (REPO / "configs" / "stories260k-cpu.yaml").read_text()
    cfg = yaml.safe_load(text)
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    assert f"block_size {cfg['block_size']}, set below" in header and f"{cfg['layers']}-layer" in header
    assert "python train/distill.py --config configs/stories260k-cpu.yaml" in header
