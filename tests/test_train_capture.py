"""Offline feature capture: shards + manifest, disk estimate, resumable, manifest checks, same loss as online."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from data.sample_target import main as sample_main
from tests.conftest import REPO
from train.capture import main as capture_main
from train.data import CaptureRows


@pytest.fixture(scope="module")
def setup(tmp_path_factory, stories_dir):
    root = tmp_path_factory.mktemp("capture")
    data = root / "rows.jsonl"
    assert sample_main(["--target", str(stories_dir), "--num", "10", "--max-new-tokens", "30", "--seed", "0",
                        "--out", str(data)]) == 0
    cfg = root / "run.yaml"
    cfg.write_text(f"target: {stories_dir}\ntrain: {data}\nlayers: 2\nblock_size: 4\nmask_token_id: 0\n"
                   "max_length: 24\nanchors_per_seq: 8\nmicro_batch_size: 4\nlr: 1.0e-3\nreport_to: none\n")
    return root, data, cfg


def test_capture_writes_shards_manifest_and_skips_finished(setup, stories_dir, capsys):
    root, data, cfg = setup
    out = root / "feats"
    assert capture_main(["--config", str(cfg), "--out", str(out), "--rows-per-shard", "4"]) == 0
    printed = capsys.readouterr().out
    tokens = 10 * 24  # 31-token rows truncated to max_length
    assert f"disk estimate: 10 rows x 24.0 tokens x 128 (k*H) x 4 bytes = {tokens * 128 * 4 / 2**30:.3f} GiB" in printed
    m = json.loads((out / "manifest.json").read_text())
    assert m["complete"] and m["num_rows"] == 10 and m["total_tokens"] == tokens and m["max_length"] == 24
    assert m["layer_ids"] == [1, 2] and m["target_dtype"] == "fp32" and m["feature_dim"] == 128
    assert [s["file"] for s in m["shards"]] == [f"shard-0000{i}.safetensors" for i in range(3)]
    assert [(s["start"], s["end"]) for s in m["shards"]] == [(0, 4), (4, 8), (8, 10)]
    assert m["data_digest"] and m["target"] == str(stories_dir)

    rows = CaptureRows(out)
    from dspine.target import load_target

    target = load_target(str(stories_dir), dtype="fp32", layer_ids=[1, 2])
    src = [json.loads(line) for line in data.read_text().splitlines()]
    for i in (0, 5, 9):
        r = rows.row(i)
        assert r["input_ids"] == src[i]["input_ids"][:24] and r["loss_mask"] == src[i]["loss_mask"][:24]
        with torch.no_grad():
            want = target.features(torch.tensor([r["input_ids"]]))[0]
        assert r["features"].shape == (24, 128) and torch.allclose(r["features"], want, atol=1e-5)

    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    assert capture_main(["--config", str(cfg), "--out", str(out), "--rows-per-shard", "4"]) == 0
    assert "3 of 3 shards already complete" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")} == mtimes
    (out / "shard-00001.safetensors").unlink()  # an interrupted capture: only that shard is redone
    assert capture_main(["--config", str(cfg), "--out", str(out), "--rows-per-shard", "4"]) == 0
    now = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    assert now["shard-00000.safetensors"] == mtimes["shard-00000.safetensors"]
    assert now["shard-00002.safetensors"] == mtimes["shard-00002.safetensors"]
    assert set(now) == set(mtimes) and not list(out.glob("*.tmp"))

    # a re-run with other settings is refused, naming the field
    assert capture_main(["--config", str(cfg), "--out", str(out), "--rows-per-shard", "4", "max_length=16"]) == 2
    assert "'max_length'" in capsys.readouterr().err
    for bad in ("0", "-5", "abc"):  # before the target loads; -5 wrote an empty manifest marked complete
        assert capture_main(["--config", str(cfg), "--out", str(out.parent / "c2"), "--rows-per-shard", bad]) == 2
        assert f"--rows-per-shard {bad}: expected a whole number of rows, at least 1" in capsys.readouterr().err
    assert not (out.parent / "c2").exists()
    orphan = out.parent / "orphan"  # shards whose manifest is gone: which capture wrote them is unknown
    orphan.mkdir()
    shutil.copy(out / "shard-00000.safetensors", orphan)
    assert capture_main(["--config", str(cfg), "--out", str(orphan), "--rows-per-shard", "4"]) == 2
    assert f"{orphan}: holds shard-*.safetensors but no manifest.json" in capsys.readouterr().err
    assert sorted(p.name for p in orphan.iterdir()) == ["shard-00000.safetensors"]
    (out.parent / "afile").write_text("x")  # a file where the folder goes: named, not a FileExistsError traceback
    assert capture_main(["--config", str(cfg), "--out", str(out.parent / "afile")]) == 2
    assert f"--out {out.parent / 'afile'} is a file, expected a folder" in capsys.readouterr().err


def test_reader_refuses_mismatched_or_incomplete_manifest(setup, tmp_path):
    root, _, cfg = setup
    out = root / "feats"
    if not (out / "manifest.json").is_file():
        assert capture_main(["--config", str(cfg), "--out", str(out), "--rows-per-shard", "4"]) == 0
    rows = CaptureRows(out)
    rows.check({"layer_ids": [1, 2], "max_length": 24, "target_dtype": "fp32"})
    with pytest.raises(ValueError, match="manifest field 'layer_ids'"):
        rows.check({"layer_ids": [0, 2]})
    with pytest.raises(ValueError, match="manifest field 'target_dtype'"):
        rows.check({"layer_ids": [1, 2], "target_dtype": "bf16"})
    broken = tmp_path / "broken"
    broken.mkdir()
    m = json.loads((out / "manifest.json").read_text())
    (broken / "manifest.json").write_text(json.dumps({**m, "complete": False}))
    with pytest.raises(ValueError, match="incomplete"):
        CaptureRows(broken)
    cut = tmp_path / "cut"  # a truncated shard is named by check(), before training reads a row of it
    shutil.copytree(out, cut)
    shard = cut / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"{shard}: missing, truncated or corrupt capture shard"):
        CaptureRows(cut).check({"layer_ids": [1, 2]})


def run_distill(*args, timeout=240):
    r = subprocess.run([sys.executable, str(REPO / "train" / "distill.py"), *args], capture_output=True, text=True,
                       timeout=timeout, cwd=REPO)
    return r


def test_offline_features_train_like_online(setup):
    root, _, cfg = setup
    out = root / "feats"
    if not (out / "manifest.json").is_file():
        assert capture_main(["--config", str(cfg), "--out", str(out), "--rows-per-shard", "4"]) == 0
    common = ["--config", str(cfg), "max_steps=3", "log_every=1", "save_every=0", "keep_last=1", "save_dtype=fp32"]
    on = run_distill(*common, f"output_dir={root / 'on'}")
    off = run_distill(*common, f"output_dir={root / 'off'}", f"feature_source={out}")
    assert on.returncode == 0, on.stderr[-3000:]
    assert off.returncode == 0, off.stderr[-3000:]
    losses = [[json.loads(line)["loss"] for line in (root / d / "metrics.jsonl").read_text().splitlines()]
              for d in ("on", "off")]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    bad = run_distill(*common, f"output_dir={root / 'bad'}", f"feature_source={out}", "target_layer_ids=[0,2]")
    assert bad.returncode == 2 and "manifest field 'layer_ids'" in bad.stderr
    # init_from: weights only (the trained step-3 draft), fresh optimizer and schedule
    warm = run_distill(*common, f"output_dir={root / 'warm'}", f"init_from={root / 'on' / 'step-3' / 'draft'}",
                       "max_steps=1")
    assert warm.returncode == 0, warm.stderr[-3000:]
    first = json.loads((root / "warm" / "metrics.jsonl").read_text().splitlines()[0])
    # same first batch as the fresh "on" run (same seed): the warm-started draft does better on it
    assert first["loss"] < losses[0][0] - 1.0 and first["lr"] == pytest.approx(1e-3)  # new warmup: (0+1)/1


def test_two_tokenize_caches_train_online_and_as_one_capture(tmp_path, stories_dir):
    """train=a,b (two data.tokenize caches of different inputs): one epoch reads every row of both once;
    train.capture of the list records the union's digest, offline training on it gives the online losses,
    and the list in the other order (another data digest) is refused against that capture."""
    import os

    from safetensors import safe_open

    from data import tokenize
    from train.data import open_sources

    words = "once upon a time there was a little girl named lily she liked to play in the park with her dog".split()
    caches = []
    for name, n, shift in (("a", 12, 0), ("b", 8, 3)):
        conv = tmp_path / f"{name}.jsonl"
        conv.write_text("".join(json.dumps({"id": f"{name}{i}", "conversations": [
            {"role": "user", "content": " ".join(words[(i + shift) % 10:][:4])},
            {"role": "assistant", "content": " ".join(words[(i + shift) % 10:] + words[:(i + shift) % 10])}]}) + "\n"
            for i in range(n)))
        assert tokenize.main(["--input", str(conv), "--tokenizer", str(stories_dir), "--chat-template", "chatml",
                              "--max-length", "64", "--cache-dir", str(tmp_path / "tok")]) == 0
        caches.append(next(p for p in (tmp_path / "tok").iterdir() if p not in caches and not p.name.startswith(".")))
    train = f"{caches[0]},{caches[1]}"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"target: {stories_dir}\ntrain: {train}\nlayers: 2\nblock_size: 4\nmask_token_id: 0\n"
                   "max_length: 24\nanchors_per_seq: 8\nmicro_batch_size: 4\nlr: 1.0e-3\nreport_to: none\n")
    common = ["--config", str(cfg), "max_steps=5", "log_every=1", "save_every=0", "keep_last=1", "save_dtype=fp32"]
    on = run_distill(*common, f"output_dir={tmp_path / 'on'}", "log_samples=true")
    assert on.returncode == 0, on.stderr[-3000:]
    assert "data: 20 rows, 5 steps/epoch" in on.stdout
    seen = [i for line in (tmp_path / "on" / "samples-rank0.jsonl").read_text().splitlines()
            for i in json.loads(line)["rows"]]
    assert sorted(seen) == list(range(20))  # rows 0-11 of cache a and 12-19 of cache b, each once
    with safe_open(str(tmp_path / "on" / "step-5" / "draft" / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["train"] == ",".join(os.path.relpath(c, REPO) for c in caches)  # each part portable

    out = tmp_path / "feats"
    assert capture_main(["--config", str(cfg), "--out", str(out), "--rows-per-shard", "8"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert (m["data"], m["num_rows"], m["tokenizer"], m["thinking"]) == (train, 20, str(stories_dir), False)
    assert m["data_digest"] == open_sources(train).metadata()["data_digest"]
    off = run_distill(*common, f"output_dir={tmp_path / 'off'}", f"feature_source={out}")
    assert off.returncode == 0, off.stderr[-3000:]
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
              for d in ("on", "off")]
    assert len(losses[0]) == 5 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    swapped = run_distill(*common, f"output_dir={tmp_path / 'swapped'}", f"feature_source={out}",
                          f"train={caches[1]},{caches[0]}")
    assert swapped.returncode == 2 and "manifest field 'data_digest'" in swapped.stderr
