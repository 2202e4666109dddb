"""infer.generate at the edges (fresh-clone review): no speedup is reported when the draft never ran, and
--threads above the core count is capped with a note."""

import json
import os

from tests.helpers import random_draft


def test_no_speedup_without_a_verify_step_and_a_note_for_too_many_threads(stories_dir, tmp_path, capsys):
    from dspine.checkpoint import save_draft
    from dspine.target import load_target
    from infer import generate

    folder = save_draft(random_draft(load_target(str(stories_dir), dtype="fp32"), block_size=4, mask=0),
                        tmp_path / "draft")
    argv = ["--target", str(stories_dir), "--draft", str(folder), "--prompt", "Once upon", "--no-chat-template",
            "--compare-ar", "--json", "--backend", "reference"]
    assert generate.main([*argv, "--max-new-tokens", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verify_steps"] == 0 and out["speedup"] is None and out["ar_equal"] is True
    assert generate.main([*argv, "--max-new-tokens", "6", "--threads", "100000"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert out["verify_steps"] > 0 and out["speedup"] > 0
    assert "--threads 100000 is more than this machine's" in cap.err
    assert out["threads"] == (os.cpu_count() or 1)  # capped: 100000 threads could not even get their stacks


def test_the_default_target_under_another_name_gets_the_shipped_draft(tmp_path, monkeypatch, capsys):
    """infer.generate's shipped draft goes with the default target however it is named: its path, the folder and
    --gguf-file apart, or a copy elsewhere (same size and sha256 as infer.fetch records); another target without
    --draft decodes autoregressively with a note saying so (newcomer review: both ran AR silently)."""
    import argparse
    import hashlib

    import infer.fetch
    from infer.generate import DEFAULT_DRAFT, DEFAULT_TARGET, is_default_target, resolve_models

    copy, other = tmp_path / "copy.gguf", tmp_path / "other.gguf"
    copy.write_bytes(b"GGUF pretend model bytes")
    other.write_bytes(b"GGUF other model bytes!!")  # the same size, another sha256
    monkeypatch.setitem(infer.fetch.EXPECTED, DEFAULT_TARGET.name,
                        (copy.stat().st_size, hashlib.sha256(copy.read_bytes()).hexdigest()))
    assert is_default_target(str(copy)) and is_default_target(str(tmp_path), "copy.gguf")
    assert is_default_target(str(DEFAULT_TARGET)) and is_default_target(str(DEFAULT_TARGET.parent), DEFAULT_TARGET.name)
    assert not is_default_target(str(other)) and not is_default_target(str(tmp_path))

    def models(target, draft=None, gguf_file=None):
        return resolve_models(argparse.Namespace(target=target, draft=draft, gguf_file=gguf_file))

    assert models(str(copy)) == (str(copy), str(DEFAULT_DRAFT)) and capsys.readouterr().err == ""
    assert models(str(other)) == (str(other), None)
    assert "note: no --draft for this target: decoding autoregressively" in capsys.readouterr().err
    assert models(str(other), "none") == (str(other), None) and capsys.readouterr().err == ""


def test_a_dataset_prompt_too_long_for_the_context_is_named_by_its_index(stories_dir, tmp_path, capsys):
    """--dataset with a prompt that does not fit the target's context: the error names which prompt (it gave only
    the token count, with 164 humaneval prompts to search)."""
    from infer import generate

    (tmp_path / "gsm8k").mkdir()
    questions = ["Once upon a time", "the cat sat " * 300, "Lily"]
    (tmp_path / "gsm8k" / "test.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in questions))
    assert generate.main(["--target", str(stories_dir), "--draft", "none", "--dataset", "gsm8k", "--num-prompts", "3",
                          "--data-dir", str(tmp_path), "--no-chat-template", "--max-new-tokens", "4",
                          "--backend", "reference"]) == 2
    err = capsys.readouterr().err
    assert "error: gsm8k prompt 1 (" in err and "exceeds the target's context of 512 positions" in err, err
