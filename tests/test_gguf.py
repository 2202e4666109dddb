"""A truncated or corrupt GGUF target is one error line naming the file, in every CLI that takes one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO

REAL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def small_gguf(path: Path) -> Path:
    """A valid GGUF of 672 bytes: two metadata entries (one a string array) and two tensors."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "tiny")
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    w.add_tensor("w1", np.arange(64, dtype=np.float32).reshape(8, 8))
    w.add_tensor("w2", np.ones((4, 16), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_truncation_of_a_gguf_is_refused(tmp_path):
    from dspine.gguf_file import check_gguf

    data = small_gguf(tmp_path / "ok.gguf").read_bytes()
    check_gguf(tmp_path / "ok.gguf")
    for cut in range(len(data)):  # inside the header, the metadata, the tensor infos and the data
        bad = tmp_path / f"cut-{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"{bad}: truncated or corrupt GGUF file"):
            check_gguf(bad)
    for name, blob in [("text", b"not a gguf file at all"), ("version", data[:4] + b"\x09" + data[5:])]:
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(blob)
        with pytest.raises(ValueError, match="truncated or corrupt GGUF file"):
            check_gguf(bad)


def test_a_missing_gguf_package_is_named_with_the_file(tmp_path, monkeypatch, capsys):
    """Without the gguf package check_gguf raises GGUFPackageMissing (an ImportError and a ValueError) naming the file
    and the install command (a bare ModuleNotFoundError from deep inside the size check before) and caches nothing;
    a CLI given that GGUF prints it as one error line and exits 2."""
    import re
    import sys

    from dspine import convert
    from dspine.gguf_file import GGUFPackageMissing, check_gguf

    path = small_gguf(tmp_path / "ok.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    want = rf"{re.escape(str(path))}: reading a GGUF file needs the gguf package, .*pip install 'gguf>=0\.10'"
    with pytest.raises(GGUFPackageMissing, match=want) as e:
        check_gguf(path)
    assert isinstance(e.value, ImportError) and isinstance(e.value, ValueError)
    assert convert.main(["--target", str(path), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(want, err[0]) and "Traceback" not in err[0]
    assert not (tmp_path / "hf").exists()
    monkeypatch.undo()
    check_gguf(path)


def test_the_real_target_passes_and_its_first_megabyte_does_not(tmp_path):
    from dspine.gguf_file import check_gguf

    if not REAL.is_file():
        pytest.skip(f"missing {REAL} (python -m infer.fetch)")
    check_gguf(REAL)
    cut = tmp_path / REAL.name
    with open(REAL, "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    with pytest.raises(ValueError, match="truncated or corrupt GGUF file"):
        check_gguf(cut)


@pytest.fixture(scope="module")
def truncated(tmp_path_factory) -> Path:
    """The first 1 MB of the real target when fetched (the case of the issue), else a cut small GGUF."""
    folder = tmp_path_factory.mktemp("truncated")
    out = folder / "model.gguf"
    if REAL.is_file():
        with open(REAL, "rb") as f:
            out.write_bytes(f.read(1 << 20))
    else:
        out.write_bytes(small_gguf(folder / "full.gguf").read_bytes()[:400])
    return out


def _cli_cases(gguf: Path, tmp: Path):
    conv = tmp / "conv.jsonl"
    conv.write_text(json.dumps({"id": "a", "conversations": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "yo"}]}) + "\n")
    return {
        "infer.generate": ["--target", str(gguf), "--prompt", "hi", "--draft", "none"],
        "infer.generate-gguf-file": ["--target", str(gguf.parent), "--gguf-file", gguf.name, "--prompt", "hi"],
        "infer.bench": ["--target", str(gguf), "--datasets", "gsm8k", "--backend", "reference"],
        "dspine.check": ["--target", str(gguf), "--draft", str(REPO / "checkpoints" / "smollm2-135m-dspine")],
        "dspine.init": ["--target", str(gguf), "--out", str(tmp / "draft")],
        "dspine.convert": ["--target", str(gguf), "--out", str(tmp / "hf")],
        "data.regenerate": ["--target", str(gguf), "--input", str(conv), "--output", str(tmp / "regen")],
        "data.tokenize": ["--input", str(conv), "--tokenizer", str(gguf), "--max-length", "64",
                          "--cache-dir", str(tmp / "tok")],
        "data.sample_target": ["--target", str(gguf), "--num", "1", "--max-new-tokens", "2",
                               "--out", str(tmp / "s.jsonl")],
    }


@pytest.mark.parametrize("cli", ["infer.generate", "infer.generate-gguf-file", "infer.bench", "dspine.check",
                                 "dspine.init", "dspine.convert", "data.regenerate", "data.tokenize",
                                 "data.sample_target"])
def test_clis_name_a_truncated_gguf(cli, truncated, tmp_path, capsys):
    import importlib

    argv = _cli_cases(truncated, tmp_path)[cli]
    module = importlib.import_module(cli.split("-")[0])
    assert module.main(argv) == 2
    # one error line; infer.generate / infer.bench may add their CPU-thread note first on a busy machine
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("note: ")]
    assert len(err) == 1 and err[0].startswith("error: ") and f"{truncated}: truncated or corrupt GGUF" in err[0], err


@pytest.mark.slow
def test_distill_names_a_truncated_gguf(truncated, tmp_path, capsys, monkeypatch):
    """train/distill.py's main() in this process (the target is refused before the trainer starts); an exception
    escaping main() would fail the test as a traceback would."""
    from train.distill import main

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": list(range(1, 40)), "loss_mask": [0] + [1] * 38}) + "\n"
                            for _ in range(8)))
    monkeypatch.chdir(REPO)
    rc = main(["--config", str(REPO / "configs" / "stories260k-cpu.yaml"), f"target={truncated}", f"train={rows}",
               "eval=null", f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    assert f"{truncated}: truncated or corrupt GGUF" in err


def test_convert_writes_a_partial_folder_and_renames_it_when_whole(tmp_path, monkeypatch):
    """A conversion stopped after the weights (here: the tokenizer's save fails) leaves OUT.partial, not an OUT with a
    config.json that a recipe would take as finished; the next run starts the partial folder over and renames it."""
    import transformers

    from dspine import convert, paths

    class Model:
        config = type("C", (), {"quantization_config": None})()

        def to(self, dtype):
            return self

        def save_pretrained(self, d, safe_serialization=True):
            Path(d).mkdir(parents=True, exist_ok=True)
            (Path(d) / "config.json").write_text("{}")
            (Path(d) / "model.safetensors").write_bytes(b"w")

    class Tok:
        fail = True

        def save_pretrained(self, d):
            if Tok.fail:
                raise KeyboardInterrupt
            (Path(d) / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Model())
    monkeypatch.setattr(paths, "load_tokenizer", lambda *a: Tok())
    gguf, out = small_gguf(tmp_path / "m.gguf"), tmp_path / "hf"
    with pytest.raises(KeyboardInterrupt):
        convert.convert(str(gguf), out)
    assert not out.exists() and (tmp_path / "hf.partial" / "config.json").is_file()
    Tok.fail = False
    assert convert.convert(str(gguf), out) == out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert not (tmp_path / "hf.partial").exists()
