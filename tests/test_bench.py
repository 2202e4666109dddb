"""``infer.bench`` end to end on stories260K (reference backend): the table, JSON and the AR baseline."""

from __future__ import annotations

import json

import pytest

from tests.conftest import shared_path


@pytest.fixture(scope="module")
def stories_draft(stories_dir, tmp_path_factory):
    from dspine import init as init_cli

    out = tmp_path_factory.mktemp("bench") / "draft"
    assert init_cli.main(["--target", str(stories_dir), "--out", str(out), "--layers", "1", "--block-size", "4",
                          "--mask-token-id", "0", "--dtype", "fp32"]) == 0
    return out


def _bench(stories_dir, draft, tmp_path, *extra):
    from infer import bench

    out = tmp_path / "bench.json"
    argv = ["--target", str(stories_dir), "--draft", f"D={draft}", "--datasets", "gsm8k", "--num-prompts", "1",
            "--max-new-tokens", "8", "--backend", "reference", "--no-chat-template",
            "--data-dir", str(shared_path("data", "eval")), "--output-json", str(out), *extra]
    assert bench.main(argv) == 0
    return json.loads(out.read_text())


def test_no_ar_prints_no_speedup(stories_dir, stories_draft, tmp_path, capsys):
    res = _bench(stories_dir, stories_draft, tmp_path, "--no-ar")
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("gsm8k"))
    assert row.split()[-2:] == ["-", "-"], row  # AR tok/s and speedup: no baseline, no number
    assert "speedup" not in out.split(row, 1)[1]
    task = res["tasks"][0]
    assert "ar" not in task and "speedup" not in task["drafts"]["D"] and "mean_speedup" not in res["summary"]["D"]


def test_with_ar_reports_the_speedup(stories_dir, stories_draft, tmp_path, capsys):
    res = _bench(stories_dir, stories_draft, tmp_path)
    out = capsys.readouterr().out
    d = res["tasks"][0]["drafts"]["D"]
    assert d["speedup"] > 0 and f"{d['speedup']:.2f}" in out and "mean speedup" in out
