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
