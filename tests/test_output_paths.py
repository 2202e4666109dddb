"""dspine.paths.check_output_file: an output path is refused before any work when no file can be created there
(fresh-clone review: root passes os.access everywhere, and a benchmark to /proc/x.json ran to its end, then lost
its results in a FileNotFoundError)."""

import os
import stat

import pytest

from dspine.paths import check_output_file


def test_output_file_that_cannot_be_created_is_refused_first(tmp_path):
    check_output_file("--output-json", tmp_path / "new" / "deeper" / "r.json", False)  # missing parents: created later
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []  # the check leaves nothing behind
    (tmp_path / "r.json").write_text("{}")
    with pytest.raises(ValueError, match="--output-json .*r.json exists; pass --overwrite"):
        check_output_file("--output-json", tmp_path / "r.json", False)
    check_output_file("--output-json", tmp_path / "r.json", True)
    with pytest.raises(ValueError, match="is a folder"):
        check_output_file("--plot", tmp_path, False)
    with pytest.raises(ValueError, match="names a folder \\(a trailing slash\\)"):  # not yet a folder either
        check_output_file("--output", f"{tmp_path}/nodir/", False)
    for empty in ("", " "):  # Path("") is ".", a folder: the message names what is missing instead
        with pytest.raises(ValueError, match="^--output: give a file name$"):
            check_output_file("--output", empty, False)
    if os.path.isdir("/proc/self"):  # a pseudo file system: os.access says writable to root, creation fails
        with pytest.raises(ValueError, match=r"--output-json /proc/x.json: cannot create it under /proc"):
            check_output_file("--output-json", "/proc/x.json", False)
    if os.geteuid() == 0:  # root writes into a read-only folder
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(ValueError, match="cannot create it under"):
            check_output_file("--output-json", ro / "r.json", False)
    finally:
        ro.chmod(stat.S_IRWXU)


def test_sample_target_refuses_samples_past_the_context(stories_dir, tmp_path, capsys):
    """data.sample_target --max-new-tokens beyond the target's positions (stories260K: 512) is refused before any
    sampling, naming the limit (fresh-clone review: 700 wrote a 701-token row; 100000 ran for minutes)."""
    from data import sample_target

    out = tmp_path / "s.jsonl"
    argv = ["--target", str(stories_dir), "--num", "1", "--out", str(out)]
    assert sample_target.main([*argv, "--max-new-tokens", "700"]) == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens 700: the BOS token plus 700 samples exceed" in err and "give at most 511" in err
    assert not out.exists()
    assert sample_target.main([*argv, "--max-new-tokens", "511"]) == 0 and out.is_file()


def test_bench_names_the_largest_new_token_count_that_fits(stories_dir, capsys):
    """infer.bench: too many new tokens for the target's context names the limit it enforces (a 16-token prompt and
    64 positions of headroom), not only the refusal (fresh-clone review: 440 of 512 was refused unexplained)."""
    from infer import bench

    argv = ["--target", str(stories_dir), "--datasets", "gsm8k", "--num-prompts", "1", "--backend", "reference"]
    assert bench.main([*argv, "--max-new-tokens", "440"]) == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens 440 leaves no room for a prompt in the target's context of 512 positions" in err
    assert "give at most 432" in err


def test_gguf_metadata_parsed_once_per_unchanged_file(tmp_path, monkeypatch):
    """dspine.gguf_file.memo_gguf_metadata: transformers' metadata-only GGUF parse runs once per (file, size,
    mtime); later calls get equal deep copies; a changed file, a parse with the tensors and other arguments go
    through (infer.generate parsed SmolLM2's GGUF metadata five times: 41.7 -> 29.7 s for the README's main command
    on this 2-core machine)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    import dspine.gguf_file as gf

    calls = []

    def fake(path, return_tensors=False, model_to_load=None, torch_dtype=None):
        calls.append((str(path), return_tensors))
        return {"config": {"n": len(calls)}, "tokenizer": {"tokens": ["a", "b"]}}

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", fake)
    monkeypatch.setattr(gf, "_METADATA", {})
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    assert gf.memo_gguf_metadata() and gf.memo_gguf_metadata()  # idempotent: one wrapper
    load = gguf_utils.load_gguf_checkpoint
    a, b = load(str(f)), load(str(f), return_tensors=False)
    assert a == b == {"config": {"n": 1}, "tokenizer": {"tokens": ["a", "b"]}} and len(calls) == 1
    a["tokenizer"]["tokens"].append("c")  # a caller that edits its copy changes nobody else's
    assert load(str(f))["tokenizer"]["tokens"] == ["a", "b"] and len(calls) == 1
    assert load(str(f), return_tensors=True)["config"] == {"n": 2}  # the tensors: always parsed
    assert load(str(f), model_to_load=object())["config"] == {"n": 3}
    f.write_bytes(b"xy")  # another size: parsed again
    assert load(str(f))["config"] == {"n": 4} and len(calls) == 4


@pytest.mark.parametrize("script,args", [
    ("bench_prefill", ["--tiny", "--device", "cpu"]),
    ("planner_points", ["results/planner-default-h200-T0-c1.json"]),
    ("tree_lead_fit", ["results/planner-default-h200-T0-c1.json"]),
])
def test_benchmark_analyses_refuse_an_empty_output_name(script, args, capsys):
    """An empty --output name is a usage error before any work (these used to skip it and write nothing)."""
    import importlib

    main = importlib.import_module(f"benchmarks.engine.{script}").main
    try:
        code = main([*args, "--output", ""])  # the analyses return 2 with "error: ..."
    except SystemExit as e:  # bench_prefill: argparse's usage error
        code = e.code
    assert code == 2 and "--output: give a file name" in capsys.readouterr().err


def test_an_output_under_a_file_is_refused_before_the_work(stories_dir, tmp_path, capsys):
    """data.sample_target and tree_policy.py check --out / --output before sampling or decoding (second fresh-clone
    review: both ran to their end, then lost the results in NotADirectoryError / FileExistsError)."""
    from benchmarks.reference import tree_policy
    from data import sample_target

    (tmp_path / "f").write_text("a file")
    out = tmp_path / "f" / "sub" / "s.jsonl"
    assert sample_target.main(["--target", str(stories_dir), "--num", "1", "--max-new-tokens", "2", "--out",
                               str(out)]) == 2
    assert f"--out {out}: cannot create it under {tmp_path / 'f'}" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=f"--output {tmp_path / 'f' / 't.json'}: cannot create it under"):
        tree_policy.main(["--target", str(stories_dir), "--draft", str(tmp_path), "--output",
                          str(tmp_path / "f" / "t.json")])


@pytest.mark.parametrize("links", [True, False])
def test_write_json_new_never_replaces_a_file(tmp_path, monkeypatch, links):
    """dspine.io.write_json_new: the name when free, else the first free X.N.json beside it, the file there untouched
    and no temp file left; also where the file system has no hard links (the name is then claimed by creating it)."""
    import json

    from dspine.io import write_json_new

    if not links:
        def no_links(src, dst):
            raise PermissionError("no hard links here")

        monkeypatch.setattr(os, "link", no_links)
    out = tmp_path / "r.json"
    assert write_json_new(out, {"run": 1}) == out
    (tmp_path / "r.2.json").write_text("another run")
    assert write_json_new(out, {"run": 3}) == tmp_path / "r.3.json"
    assert json.loads(out.read_text()) == {"run": 1} and (tmp_path / "r.2.json").read_text() == "another run"
    assert json.loads((tmp_path / "r.3.json").read_text()) == {"run": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.2.json", "r.3.json", "r.json"]


def test_write_json_new_interrupted_while_writing_leaves_no_temp_file(tmp_path, monkeypatch):
    """A Ctrl-C (or SIGTERM through dspine.io.sigterm_as_ctrl_c) during the temp file's write or fsync leaves no
    half-written NAME.PID.tmp (a later run has another pid and never removes it; data.regenerate's summary.json
    had one left beside it for good)."""
    import json

    from dspine.io import atomic_write_json

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    (tmp_path / "s.json").write_text('{"old": 1}')
    with pytest.raises(KeyboardInterrupt):
        atomic_write_json(tmp_path / "s.json", {"new": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]
    assert json.loads((tmp_path / "s.json").read_text()) == {"old": 1}


def test_write_json_removes_a_killed_writers_temp_file(tmp_path):
    """A SIGKILL during the write leaves NAME.PID.tmp (nothing can remove it then): the next write of that name removes
    it where no process of that id runs, and keeps a live writer's temp file and other files."""
    import subprocess
    import sys

    from dspine.io import atomic_write_json

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (tmp_path / f"s.json.{dead}.tmp").write_text('{"half')
    (tmp_path / f"s.json.{os.getpid()}.x.tmp").write_text("not a temp file of ours")
    live = tmp_path / f"s.json.{os.getppid()}.tmp"
    live.write_text("a live writer's")
    atomic_write_json(tmp_path / "s.json", {"new": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["s.json", f"s.json.{os.getpid()}.x.tmp", live.name])
