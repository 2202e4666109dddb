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
    from dspine.reference import ReferenceDecoder
    from dspine.sampling import SamplingParams
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
    # a template that writes no end-of-turn token after an answer is refused before any generation
    # (ChatML itself is accepted for stories260K: tests/test_chat_text.py)
    no_end = tmp_path / "no-end.jinja"
    no_end.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    rc = regenerate.main(["--target", str(stories_dir), "--tokenizer", str(stories_dir), "--chat-template", str(no_end),
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
    from tests.helpers import distill_cases

    data = tmp_path / "train.jsonl"
    assert sample_main(["--target", str(stories_dir), "--num", "32", "--max-new-tokens", "24", "--batch-size", "32",
                        "--out", str(data)]) == 0
    base = ["--config", str(REPO / "configs" / "stories260k-cpu.yaml"), f"target={stories_dir}", "eval=null",
            "eval_prompts=0", "micro_batch_size=4", "log_every=1"]

    def run(*extra):
        return [*base, *extra]

    rows = [json.loads(x) for x in data.read_text().splitlines()]
    nomask = tmp_path / "nomask.jsonl"
    nomask.write_text("".join(json.dumps({**r, "loss_mask": [0] * len(r["loss_mask"])}) + "\n" for r in rows))
    oov = tmp_path / "oov.jsonl"
    oov.write_text("".join(json.dumps({**r, "input_ids": [9999] * len(r["input_ids"])}) + "\n" for r in rows))
    out = tmp_path / "c"
    # the runs up to the truncated checkpoint one after the other in one child process (tests.helpers.distill_cases),
    # out/config.yaml and out/metrics.jsonl read after each
    runs = distill_cases([run(f"train={nomask}", f"output_dir={tmp_path / 'a'}", "max_steps=2"),
                          run(f"train={oov}", f"output_dir={tmp_path / 'b'}", "max_steps=2"),
                          run(f"train={data}", f"output_dir={out}", "max_steps=4", "save_every=2"),
                          run(f"train={data}", f"output_dir={out}", "max_steps=6", "lr=1.0"),
                          run(f"train={data}", f"output_dir={out}", "max_steps=6", "save_every=2"),
                          run(f"train={data}", f"output_dir={out}", "max_steps=3")],
                         read_after=[out / "config.yaml", out / "metrics.jsonl"])
    r = runs[0]
    assert r.returncode == 2 and "nothing to train on" in r.stderr
    r = runs[1]
    assert r.returncode == 2 and "token id 9999" in r.stderr
    assert runs[2].returncode == 0
    before = runs[2].files[str(out / "config.yaml")]
    r = runs[3]
    assert r.returncode == 2 and "lr: 0.003 -> 1.0" in r.stderr
    assert r.files[str(out / "config.yaml")] == before  # a refused resume changes nothing
    assert runs[4].returncode == 0
    steps = [json.loads(x)["step"] for x in runs[4].files[str(out / "metrics.jsonl")].splitlines() if '"loss"' in x]
    assert steps == [1, 2, 3, 4, 5, 6]
    # was: a warning and exit 0 without training
    r = runs[5]
    assert r.returncode == 2 and "checkpoint is at step 6 but this run has 3 total steps" in r.stderr
    weights = out / "step-6" / "state" / "model.safetensors"  # was: a SafetensorError traceback
    weights.write_bytes(weights.read_bytes()[:100])
    r = subprocess.run([sys.executable, str(REPO / "train" / "distill.py"), *run(f"train={data}", f"output_dir={out}",
                        "max_steps=8")], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"resume from {out / 'step-6'}: cannot read its state/" in r.stderr
    assert f"resume_from=<step-N folder> (available: {out / 'step-4'})" in r.stderr  # keep_last=2


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


def test_provenance_records_the_engine_switches_that_are_set(monkeypatch):
    """A result made with DSPINE_FUSE_NORM=auto says so (the command line does not); unset or empty ones are left
    out, and without any the key is absent (older files' schema)."""
    from dspine.provenance import ENGINE_ENV, provenance

    for k in ENGINE_ENV:
        monkeypatch.delenv(k, raising=False)
    assert "env" not in provenance(["x"])
    monkeypatch.setenv("DSPINE_FUSE_NORM", "auto")
    monkeypatch.setenv("DSPINE_PDL", "")
    assert provenance(["x"])["env"] == {"DSPINE_FUSE_NORM": "auto"}


# ------------------------------------------------------------------------------ second review: CLI inputs

GGUF = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_missing_or_non_model_paths_are_named(stories_dir, tmp_path, capsys):
    from data import tokenize
    from dspine import check, init
    from infer import generate

    assert generate.main(["--target", "/nope/model", "--prompt", "hi"]) == 2
    assert "/nope/model: no such file or folder, and not a Hub id" in capsys.readouterr().err
    assert generate.main(["--target", str(REPO / "pyproject.toml"), "--prompt", "hi"]) == 2
    assert "pyproject.toml: not a model folder" in capsys.readouterr().err
    # --gguf-file with a file as the target (the default target is a .gguf file): the message says what to give
    assert generate.main(["--target", str(REPO / "pyproject.toml"), "--gguf-file", "m.gguf", "--prompt", "hi"]) == 2
    assert "a GGUF file name (m.gguf) was given too; with it give the folder" in capsys.readouterr().err
    assert generate.main(["--target", str(tmp_path), "--prompt", "hi", "--draft", "none"]) == 2
    assert f"{tmp_path}: not a model folder (no config.json)" in capsys.readouterr().err
    # a folder one level above the model (as ../shared/models/stories260K holds hf/): the message names the model
    (tmp_path / "up" / "hf").mkdir(parents=True)
    (tmp_path / "up" / "hf" / "config.json").write_text("{}")
    assert generate.main(["--target", str(tmp_path / "up"), "--prompt", "hi", "--draft", "none"]) == 2
    assert f"not a model folder (no config.json); it holds {tmp_path / 'up' / 'hf'}: give one of those" in \
        capsys.readouterr().err
    assert check.main(["--target", "./nope", "--draft", str(stories_dir)]) == 2
    assert "./nope: no such file or folder" in capsys.readouterr().err
    assert init.main(["--target", "~/nope-dspine", "--out", str(tmp_path / "d")]) == 2
    assert "~/nope-dspine: no such file or folder" in capsys.readouterr().err
    src = tmp_path / "in.jsonl"
    src.write_text("")
    assert tokenize.main(["--input", str(src), "--tokenizer", "runs/nope/tok", "--max-length", "8"]) == 2
    assert "tokenizer runs/nope/tok: no such file or folder" in capsys.readouterr().err


def _distill_argv(*extra):
    return ["--config", str(REPO / "configs" / "stories260k-cpu.yaml"), "eval=null", "eval_prompts=0", "max_steps=1",
            *extra]


def _distill(*extra):
    cmd = [sys.executable, str(REPO / "train" / "distill.py"), *_distill_argv(*extra)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)


def test_distill_config_values_are_checked_when_read():
    from train import config as run_config

    for override, message in [("lr=nan", "'lr': must be a finite number, got nan"),
                              ("warmup_ratio=1.5", "'warmup_ratio': must be in [0, 1], got 1.5"),
                              ("betas=[0.9,.inf]", "'betas': must be a finite number"),
                              ("max_length=4", "'max_length': 4 is shorter than one block (block_size 8)"),
                              ("mask_token_id=-1", "'mask_token_id': must be >= 0")]:
        with pytest.raises(run_config.ConfigError) as e:
            run_config.load(REPO / "configs" / "stories260k-cpu.yaml", ["target=x", override])
        assert message in str(e.value), override
    cfg = run_config.load(REPO / "configs" / "stories260k-cpu.yaml", ["target=x", "attn=flex"])
    with pytest.raises(run_config.ConfigError, match="'attn': flex needs a CUDA GPU.*attn=dense"):
        run_config.resolve_device_settings(cfg, cuda=False)


def test_distill_checks_every_train_row_before_step_1(stories_dir, tmp_path):
    """A row with a token id outside the target's vocabulary, deep in the file, stops the run before the
    first step with file:line and the field (it used to surface only when a step drew that row)."""
    rows = [json.dumps({"input_ids": [1] + [(7 * i + k) % 500 + 1 for k in range(30)], "loss_mask": [0] + [1] * 30})
            for i in range(40)]
    rows[33] = json.dumps({"input_ids": [1, 5, 99999, 6], "loss_mask": [0, 1, 1, 1]})
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(rows) + "\n")
    r = _distill(f"target={stories_dir}", f"train={data}", "micro_batch_size=4", f"output_dir={tmp_path / 'out'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"config key 'train': {data}:34: field 'input_ids' holds token id 99999 >= the target's vocabulary" \
        in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # refused before the loop opened it


@pytest.mark.slow
def test_distill_value_errors_are_one_line(stories_dir, tmp_path):
    from dspine import init as init_cli
    from tests.helpers import distill_cases

    conv = tmp_path / "conv.jsonl"
    conv.write_text(json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    few = tmp_path / "few.jsonl"
    few.write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n")
    other = tmp_path / "other-draft"
    assert init_cli.main(["--target", str(stories_dir), "--out", str(other), "--layers", "1", "--mask-token-id", "0",
                          "--block-size", "8", "--dtype", "fp32"]) == 0
    broken = tmp_path / "broken"
    (broken / "step-2").mkdir(parents=True)
    (broken / "step-2" / "trainer_state.json").write_text("{}")
    (broken / "latest").write_text("step-2")
    from data.sample_target import main as sample_main

    data = tmp_path / "train.jsonl"
    assert sample_main(["--target", str(stories_dir), "--num", "16", "--max-new-tokens", "16", "--batch-size", "16",
                        "--out", str(data)]) == 0
    cases = [
        (("mask_token_id=9999",), "mask_token_id=9999 is outside the vocabulary"),
        (("target_layer_ids=[1,99]",), "[99] outside [0, "),
        (("block_size=300", "max_length=512"), "draft RoPE range shorter than the requested context"),
        ((f"train={conv}",), f"{conv}:1 is a conversation, not tokenized rows: run python -m data.tokenize first"),
        ((f"train={few}",), "config key 'train': 1 rows are fewer than one global batch of 4"),
        ((f"init_from={other}",), f"config key 'init_from': {other}: layers 1 in the source, 2 in the model"),
        ((f"output_dir={broken}",), f"points to {broken / 'step-2'}, an incomplete checkpoint (no state)"),
    ]
    runs = distill_cases([_distill_argv(f"target={stories_dir}", f"train={data}", "micro_batch_size=4",
                                        f"output_dir={tmp_path / 'out'}", *extra) for extra, _ in cases])
    for (extra, message), r in zip(cases, runs, strict=True):  # one child process for all the cases
        assert r.returncode == 2 and "Traceback" not in r.stderr, (extra, r.stderr[-2000:])
        assert message in r.stderr, (extra, r.stderr[-2000:])


def test_generate_and_check_refuse_bad_arguments_before_loading(stories_dir, capsys):
    import time

    from dspine import check
    from infer import generate

    base = ["--target", str(stories_dir), "--backend", "reference"]
    cases = [(["--prompt", "hi", "--temperature", "nan"], "--temperature=nan must be a finite number >= 0"),
             (["--prompt", "hi", "--top-p", "1.5"], "--top-p=1.5 must be in (0, 1]"),
             (["--prompt", "hi", "--top-k", "-2"], "--top-k=-2 must be >= 0"),
             (["--prompt", "hi", "--num-prompts", "3"], "--num-prompts 3 applies to --dataset only"),
             (["--prompt", "hi", "--block-size", "4", "--draft", "none"], "--block-size 4 needs a draft")]
    for extra, message in cases:
        t0 = time.perf_counter()
        assert generate.main([*base, *extra]) == 2
        assert message in capsys.readouterr().err and time.perf_counter() - t0 < 1.0, extra
    with pytest.raises(SystemExit) as e:
        check.main(["--target", str(stories_dir), "--draft", str(stories_dir), "--max-context", "-5"])
    assert e.value.code == 2 and "--max-context -5: must be >= 1" in capsys.readouterr().err


def test_init_refuses_bad_sliding_layers_and_a_file_as_out(stories_dir, tmp_path, capsys):
    from dspine import init as init_cli

    base = ["--target", str(stories_dir), "--layers", "2", "--mask-token-id", "0", "--dtype", "fp32"]
    for bad in ("7", "-1"):
        assert init_cli.main([*base, "--out", str(tmp_path / bad), "--sliding-layers", bad]) == 2
        assert f"--sliding-layers [{bad}] outside [0, 2)" in capsys.readouterr().err
        assert not (tmp_path / bad).exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert init_cli.main([*base, "--out", str(afile)]) == 2
    assert f"--out {afile} is an existing file" in capsys.readouterr().err


def test_prepare_leaves_no_tmp_files_and_names_the_output(tmp_path, capsys):
    from data import prepare

    txt = tmp_path / "x.txt"
    txt.write_text("hi\n")
    (tmp_path / "empty").mkdir()
    for src in (txt, tmp_path / "empty"):
        out = tmp_path / f"out-{src.name}"
        assert prepare.main(["--input", str(src), "--output", str(out)]) == 2
        assert str(src) in capsys.readouterr().err
        assert not list(out.glob("*.tmp")), list(out.iterdir())
    assert prepare.main(["--input", str(txt), "--output", str(txt)]) == 2
    assert f"--output {txt} is an existing file" in capsys.readouterr().err


def test_check_table_hidden_size_mismatch_shows_both_values(stories_dir):
    from dspine.target import TargetSpec, assert_compatible, check_compat
    from tests.test_config_checkpoint import small_config

    spec = TargetSpec.from_pretrained(str(stories_dir))
    cfg = small_config()
    cfg.hidden_size = spec.hidden_size + 8
    row = next(r for r in check_compat(spec, cfg) if r.field == "hidden_size")
    assert not row.ok and row.note.startswith(f"target {spec.hidden_size} != draft {spec.hidden_size + 8}")
    with pytest.raises(ValueError) as e:
        assert_compatible(spec, cfg)
    assert "()" not in str(e.value) and f"hidden_size: target={spec.hidden_size} draft={spec.hidden_size + 8} (" in str(e.value)


def test_tokenize_says_the_input_has_no_rows(qwen3_tokenizer_dir, tmp_path, capsys):
    from data import tokenize

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert tokenize.main(["--input", str(empty), "--tokenizer", str(qwen3_tokenizer_dir), "--max-length", "32"]) == 1
    err = capsys.readouterr().err
    assert f"{empty} has no rows" in err and "every row failed" not in err


@pytest.mark.slow
def test_data_tools_accept_a_gguf_path(tmp_path, capsys, gguf_memo):
    from data import regenerate, tokenize

    if not GGUF.is_file():
        pytest.skip(f"missing {GGUF} (python -m infer.fetch)")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "conversations": [{"role": "user", "content": "hi there, how are you?"},
                                                            {"role": "assistant", "content": "fine"}]}) + "\n")
    assert tokenize.main(["--input", str(src), "--tokenizer", str(GGUF), "--max-length", "64",
                          "--cache-dir", str(tmp_path / "tok")]) == 0
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert tokenize.main(["--input", str(empty), "--tokenizer", str(GGUF), "--max-length", "64",
                          "--cache-dir", str(tmp_path / "tok")]) == 1
    assert f"{empty} has no rows" in capsys.readouterr().err
    # every row is longer than --max-context: all skipped, so nothing was regenerated -> exit 1
    rc = regenerate.main(["--target", str(GGUF), "--input", str(src), "--output", str(tmp_path / "r"),
                          "--max-context", "8", "--max-new-tokens", "4"])
    assert rc == 1 and "no row was regenerated (1 skipped" in capsys.readouterr().err
    assert not (tmp_path / "r" / "run_args.json").exists()  # a run that regenerated nothing pins nothing
    # the corrected retry (another --max-context) runs in the same folder and records the GGUF path split
    assert regenerate.main(["--target", str(GGUF), "--input", str(src), "--output", str(tmp_path / "r"),
                            "--max-context", "64", "--max-new-tokens", "4"]) == 0
    run_args = json.loads((tmp_path / "r" / "run_args.json").read_text())
    assert (run_args["target"], run_args["gguf_file"]) == (str(GGUF.parent), GGUF.name)


def test_stories_config_comment_matches_its_values():
    import yaml

    text = (REPO / "configs" / "stories260k-cpu.yaml").read_text()
    cfg = yaml.safe_load(text)
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    assert f"block_size {cfg['block_size']}, set below" in header and f"{cfg['layers']}-layer" in header
    assert "python train/distill.py --config configs/stories260k-cpu.yaml" in header
