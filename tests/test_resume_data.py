"""A resume over other training rows is refused (fresh-clone review: a cut or reordered train file at the same path
resumed silently, past the end of the new file)."""

import pytest

from train.config import ConfigError, load
from train.distill import check_resume


def test_resume_refuses_changed_rows_and_keeps_old_checkpoints_working():
    cfg = load(None, ["target=t", "train=rows.jsonl", "max_steps=100"])
    same = {"train_rows": 200, "train_digest": "abc"}
    state = {"step": 20, **same}
    check_resume(state, cfg, 1, 100, same)
    with pytest.raises(ConfigError, match=r"training rows changed .*train_rows was 200, now 100, train=rows.jsonl"):
        check_resume(state, cfg, 1, 100, {"train_rows": 100, "train_digest": "def"})
    with pytest.raises(ConfigError, match=r"train_digest was 'abc', now 'xyz'"):  # same count, reordered or edited
        check_resume(state, cfg, 1, 100, {"train_rows": 200, "train_digest": "xyz"})
    check_resume({"step": 20}, cfg, 1, 100, same)  # a checkpoint from before these keys: no data check


def test_distill_help_lists_every_key_with_its_default_and_meaning(capsys):
    """``train/distill.py --help`` exits 0 and prints each RunConfig key with its default and the comment beside
    its field (fresh-clone review: exit 1 and bare names)."""
    import dataclasses

    from train.config import RunConfig, parse_cli

    with pytest.raises(SystemExit) as e:
        parse_cli(["--help"], "train/distill.py")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: train/distill.py [--config FILE] [key=value ...]")
    lines = {line.split()[0]: line for line in out.splitlines()[3:] if line.strip()}
    assert set(lines) == {f.name for f in dataclasses.fields(RunConfig)}
    assert "'auto'" in lines["target_dtype"] and "bf16 on CUDA" in lines["target_dtype"]
    assert "None" in lines["block_size"] and "anchor included" in lines["block_size"]
