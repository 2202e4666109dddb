"""Regression tests for defects a fresh-eyes review found (bad input must fail early and clearly)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def test_default_layer_ids_are_distinct_for_shallow_targets():
    from dspine.config import default_target_layer_ids as ids

    assert ids(36, 5) == [1, 9, 17, 25, 33]
    assert ids(5, 5) == [0, 1, 2, 3, 4] and ids(5, 3) == [1, 2, 3]


def test_draft_config_type_errors_name_the_field(tmp_path):
    from dspine.checkpoint import load_config
    from tests.test_config_checkpoint import small_config

    small_config().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "block_size": "eight"}))
    with pytest.raises(ValueError, match="field 'block_size' must be an integer"):
        load_config(tmp_path)
    bad = {**raw, "dflash_config": {"mask_token_id": 0, "target_layer_idz": [1]}}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="unknown dflash_config keys.*target_layer_idz"):
        load_config(tmp_path)


def test_tau_is_undefined_without_verify_steps(stories_dir):
    from dspine.sampling import SamplingParams
    from dspine.spec import ReferenceDecoder
    from dspine.stats import AcceptStats
    from dspine.target import load_target
    from tests.helpers import random_draft

    assert AcceptStats(4).to_dict()["tau"] is None
    target = load_target(str(stories_dir), dtype="fp32")
    res = ReferenceDecoder(target, random_draft(target, mask=0), [2]).generate([[1, 5]], SamplingParams(max_new_tokens=1))
    assert len(res.token_ids[0]) == 1 and res.stats.steps == 0 and res.stats.to_dict()["tau"] is None


def test_init_from_keeps_the_source_layout(stories_dir, tmp_path):
    from dspine import init as init_cli
    from dspine.checkpoint import load_config

    src = tmp_path / "src"
    base = ["--target", str(stories_dir), "--dtype", "fp32"]
    assert init_cli.main([*base, "--out", str(src), "--layers", "1", "--block-size", "8", "--mask-token-id", "3",
                          "--injection", "none"]) == 0
    assert init_cli.main([*base, "--out", str(tmp_path / "ok"), "--init-from", str(src)]) == 0
    cfg = load_config(tmp_path / "ok")
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.mask_token_id) == (1, 8, 3) and cfg.injection == "residual"
    assert init_cli.main([*base, "--out", str(tmp_path / "bad"), "--init-from", str(src), "--block-size", "16"]) == 2
    assert not (tmp_path / "bad").exists()


def test_cli_argument_errors(stories_dir, tmp_path, capsys):
    from infer import bench, generate
    from infer.datasets import load_eval_prompts

    with pytest.raises(ValueError, match="must be >= 1"):
        load_eval_prompts("gsm8k", 0)
    long = "once upon a time " * 200  # ~800 tokens > the 512 positions of stories260K
    assert generate.main(["--target", str(stories_dir), "--prompt", long, "--backend", "reference",
                          "--no-chat-template"]) == 2
    assert "exceeds the target's context" in capsys.readouterr().err
    assert generate.main(["--target", str(stories_dir), "--prompt", "x", "--block-size", "0", "--backend", "reference"]) == 2
    assert bench.main(["--target", str(stories_dir), "--concurrency", "0", "--datasets", "gsm8k"]) == 2
    assert "--concurrency 0" in capsys.readouterr().err


def test_data_tools_fail_early(stories_dir, tmp_path, capsys):
    from data import prepare, regenerate

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}) + "\n")
    with pytest.raises(SystemExit):
        prepare.main(["--input", str(src), "--output", str(tmp_path / "p"), "--limit", "-3"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nope": 1}\n{"conversations": []}\n')
    assert prepare.main(["--input", str(bad), "--output", str(tmp_path / "p2")]) == 1
    assert prepare.main(["--input", str(src), "--output", str(tmp_path / "p3")]) == 0
    # a template the target cannot end (stories260K has no <|im_end|>) is refused before any generation
    rc = regenerate.main(["--target", str(stories_dir), "--tokenizer", str(stories_dir), "--chat-template", "chatml",
                          "--input", str(tmp_path / "p3" / "train.jsonl"), "--output", str(tmp_path / "r")])
    assert rc == 2 and "chat template unusable" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    # another tool's finished folder is not mistaken for a finished regeneration
    rc = regenerate.main(["--target", str(stories_dir), "--input", str(tmp_path / "p3" / "train.jsonl"),
                          "--output", str(tmp_path / "p3")])
    assert rc == 2 and "no data.regenerate run wrote" in capsys.readouterr().err


@pytest.mark.slow
def test_trainer_refuses_bad_data_and_changed_resume(stories_dir, tmp_path):
    from data.sample_target import main as sample_main

    data = tmp_path / "train.jsonl"
    assert sample_main(["--target", str(stories_dir), "--num", "32", "--max-new-tokens", "24", "--batch-size", "32",
                        "--out", str(data)]) == 0
    base = [sys.executable, str(REPO / "train" / "distill.py"), "--config", str(REPO / "configs" / "stories260k-cpu.yaml"),
            f"target={stories_dir}", "eval=null", "eval_prompts=0", "micro_batch_size=4", "log_every=1"]

    def run(*extra):
        return subprocess.run([*base, *extra], capture_output=True, text=True, cwd=REPO, timeout=300)

    rows = [json.loads(x) for x in data.read_text().splitlines()]
    nomask = tmp_path / "nomask.jsonl"
    nomask.write_text("".join(json.dumps({**r, "loss_mask": [0] * len(r["loss_mask"])}) + "\n" for r in rows))
    r = run(f"train={nomask}", f"output_dir={tmp_path / 'a'}", "max_steps=2")
    assert r.returncode == 2 and "nothing to train on" in r.stderr
    oov = tmp_path / "oov.jsonl"
    oov.write_text("".join(json.dumps({**r, "input_ids": [9999] * len(r["input_ids"])}) + "\n" for r in rows))
    r = run(f"train={oov}", f"output_dir={tmp_path / 'b'}", "max_steps=2")
    assert r.returncode == 2 and "token id 9999" in r.stderr
    out = tmp_path / "c"
    assert run(f"train={data}", f"output_dir={out}", "max_steps=4", "save_every=2").returncode == 0
    before = (out / "config.yaml").read_text()
    r = run(f"train={data}", f"output_dir={out}", "max_steps=6", "lr=1.0")
    assert r.returncode == 2 and "lr: 0.003 -> 1.0" in r.stderr
    assert (out / "config.yaml").read_text() == before  # a refused resume changes nothing
    assert run(f"train={data}", f"output_dir={out}", "max_steps=6", "save_every=2").returncode == 0
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_cli_none_is_a_value_not_null():
    """`injection=none` selects the DFlash ablation; only `null` / `~` mean "unset" on the command line."""
    from train import config as run_config

    cfg, _ = run_config.parse_cli(["--config", str(REPO / "configs" / "stories260k-cpu.yaml"), "injection=none",
                                   "eval=null"], "x")
    assert cfg.injection == "none" and cfg.eval is None


def test_provenance_command_line_forms():
    from dspine.provenance import command_line

    assert command_line(["bash", "scripts/stories260k/ablation.sh"]) == "bash scripts/stories260k/ablation.sh"
    assert command_line(["scripts/make_tables.py", "--check"]) == "python scripts/make_tables.py --check"
    assert command_line(["infer/bench.py", "--num-prompts", "4"]) == "python -m infer.bench --num-prompts 4"
    assert command_line(["train/distill.py", "a=1"]) == "accelerate launch train/distill.py a=1"
