"""JSON files the tools read (draft and target configs, indexes, manifests, run arguments): valid JSON
of the wrong shape is an error naming the file, never a traceback."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from tests.conftest import REPO

NOT_OBJECTS = ["[1]", '"config"', "null", "3", "true"]
DRAFT = REPO / "checkpoints" / "smollm2-135m-dspine"


@pytest.mark.parametrize("text", NOT_OBJECTS)
def test_read_json_object_names_the_file(tmp_path, text):
    from dspine.paths import read_json_object

    p = tmp_path / "x.json"
    p.write_text(text)
    with pytest.raises(ValueError, match=f"{p}: expected a JSON object"):
        read_json_object(p)
    p.write_text("{nope")
    with pytest.raises(ValueError, match=f"{p}: not valid JSON"):
        read_json_object(p)


def _draft_copy(tmp_path, config_text: str):
    d = tmp_path / "draft"
    d.mkdir()
    shutil.copy(DRAFT / "model.safetensors", d / "model.safetensors")
    (d / "config.json").write_text(config_text)
    return d


@pytest.mark.parametrize("text", NOT_OBJECTS)
def test_draft_config_that_is_not_an_object(tmp_path, text):
    from dspine.checkpoint import load_config, load_draft

    d = _draft_copy(tmp_path, text)
    for load in (load_config, load_draft):
        with pytest.raises(ValueError, match=f"{d / 'config.json'}: expected a JSON object"):
            load(d)


@pytest.mark.parametrize("field,value", [
    ("dspine_config", [1]), ("rope_scaling", "yarn"), ("rope_parameters", 3), ("num_attention_heads", 0),
    ("num_key_value_heads", 0), ("hidden_size", -64), ("layer_types", 5), ("dflash_config", [1]),
])
def test_draft_config_fields_of_the_wrong_shape(tmp_path, field, value):
    from dspine.checkpoint import load_config

    raw = json.loads((DRAFT / "config.json").read_text())
    d = _draft_copy(tmp_path, json.dumps({**raw, field: value}))
    with pytest.raises(ValueError, match=str(d / "config.json")):
        load_config(d)


def test_clis_name_a_draft_config_that_is_not_an_object(stories_dir, tmp_path, capsys):
    from dspine import check, init
    from infer import generate

    d = _draft_copy(tmp_path, "[1]")
    want = f"{d / 'config.json'}: expected a JSON object"
    assert check.main(["--target", str(stories_dir), "--draft", str(d)]) == 2
    assert want in capsys.readouterr().err
    assert generate.main(["--target", str(stories_dir), "--draft", str(d), "--prompt", "hi", "--backend",
                          "reference"]) == 2
    assert want in capsys.readouterr().err
    assert init.main(["--target", str(stories_dir), "--out", str(tmp_path / "new"), "--init-from", str(d)]) == 2
    assert want in capsys.readouterr().err


def test_a_target_config_that_is_not_an_object(stories_dir, tmp_path, capsys):
    from dspine import check
    from infer import generate

    t = tmp_path / "target"
    shutil.copytree(stories_dir, t)
    (t / "config.json").write_text("[1]")
    want = f"{t / 'config.json'}: expected a JSON object"
    assert generate.main(["--target", str(t), "--prompt", "hi", "--draft", "none", "--backend", "reference"]) == 2
    assert want in capsys.readouterr().err
    assert check.main(["--target", str(t), "--draft", str(DRAFT)]) == 2
    assert want in capsys.readouterr().err


def test_a_safetensors_index_without_a_weight_map(tmp_path):
    from dspine.checkpoint import load_draft
    from infer.model import read_safetensors

    d = tmp_path / "draft"
    d.mkdir()
    shutil.copy(DRAFT / "config.json", d / "config.json")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [1]}))
    with pytest.raises(ValueError, match="no 'weight_map' object"):
        load_draft(d)
    with pytest.raises(ValueError, match="no 'weight_map' object"):
        read_safetensors(d, "cpu")


def test_one_safetensors_reader_names_a_truncated_file(stories_dir, tmp_path):
    """Drafts and targets go through one reader (dspine.io.read_safetensors): a truncated target weights file is
    one ValueError naming it for the engine's loader and the reference backend's too (they gave safetensors' own
    error, the reference one as a traceback without the file's name); out of memory while reading stays itself;
    a folder without weights is named."""
    from dspine.io import open_each_weight_file, read_safetensors
    from dspine.target import load_target

    t = tmp_path / "target"
    shutil.copytree(stories_dir, t)
    w = t / "model.safetensors"
    state = read_safetensors(t)
    assert state and all(isinstance(v, torch.Tensor) for v in state.values())
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(ValueError, match=re.escape(f"{w}: not a readable safetensors file")):
        read_safetensors(t, "cpu")
    with pytest.raises(ValueError, match=re.escape(f"{w}: not a readable safetensors file")):
        load_target(str(t))  # the reference backend's loader checks the headers before transformers reads them

    def out_of_memory(fh):
        raise torch.OutOfMemoryError("CUDA out of memory")

    shutil.copy(stories_dir / "model.safetensors", w)  # a good file: running out of memory is not "not readable"
    with pytest.raises(torch.OutOfMemoryError):
        open_each_weight_file(t, out_of_memory)
    w.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"{t}: no model.safetensors (or model.safetensors.index")):
        read_safetensors(t)


def test_data_run_arguments_that_are_not_an_object(stories_dir, tmp_path, capsys):
    from data import regenerate, tokenize

    conv = tmp_path / "regen" / "results.jsonl"
    conv.parent.mkdir()
    conv.write_text(json.dumps({"id": "a", "conversations": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "yo"}]}) + "\n")
    (tmp_path / "regen" / "run_args.json").write_text("[1]")
    want = f"{tmp_path / 'regen' / 'run_args.json'}: expected a JSON object"
    assert tokenize.main(["--input", str(conv), "--tokenizer", str(stories_dir), "--max-length", "32"]) == 2
    assert want in capsys.readouterr().err
    assert regenerate.main(["--target", str(stories_dir), "--input", str(conv), "--output", str(tmp_path / "regen"),
                            "--chat-template", "chatml", "--max-new-tokens", "8"]) == 2
    assert want in capsys.readouterr().err


def test_train_manifests_that_are_not_an_object(tmp_path):
    from train.data import CaptureRows, open_rows

    (tmp_path / "manifest.json").write_text("[1]")
    with pytest.raises(ValueError, match=f"{tmp_path / 'manifest.json'}: expected a JSON object"):
        open_rows(tmp_path)
    with pytest.raises(ValueError, match=f"{tmp_path / 'manifest.json'}: expected a JSON object"):
        CaptureRows(tmp_path)


@pytest.mark.parametrize("case", ["truncated_weights", "nan_eps", "layer_types_mismatch"])
def test_check_refuses_what_generate_would_refuse(stories_dir, tmp_path, capsys, case):
    """dspine.check said OK for a truncated weights file and a NaN eps, and a config whose layer_types
    disagree with num_hidden_layers was a traceback; each is now one error line naming the file."""
    from dspine import check

    d = tmp_path / "draft"
    shutil.copytree(DRAFT, d)
    cfg = json.loads((d / "config.json").read_text())
    if case == "truncated_weights":
        w = d / "model.safetensors"
        w.write_bytes(w.read_bytes()[: 1 << 20])
        want = f"{w}: not a readable safetensors file"
    elif case == "nan_eps":
        cfg["rms_norm_eps"] = float("nan")
        want = "rms_norm_eps=nan must be finite and > 0"
    else:
        cfg["num_hidden_layers"] = 2  # layer_types still lists 3
        want = f"{d / 'config.json'}: "
    (d / "config.json").write_text(json.dumps(cfg))
    assert check.main(["--target", str(stories_dir), "--draft", str(d)]) == 2
    err = capsys.readouterr().err
    assert want in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
