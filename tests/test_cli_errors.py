"""CLI inputs a new user gets wrong: one ``error:`` line naming the argument, path or id, never a
traceback, and argument errors before any model is loaded."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests.conftest import REPO

DRAFT = REPO / "checkpoints" / "smollm2-135m-dspine"
NOPE = "nope-org/nope-model"


@pytest.fixture
def offline(monkeypatch):
    """The Hub unreachable, fast (no retries): huggingface_hub and transformers read this at call time."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _conv(tmp_path):
    p = tmp_path / "conv.jsonl"
    p.write_text(json.dumps({"id": "a", "conversations": [{"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": "yo"}]}) + "\n")
    return p


def _hub_cases(stories, tmp):
    return {
        "bench-target": ("infer.bench", ["--target", NOPE, "--datasets", "gsm8k", "--backend", "reference"]),
        "bench-draft": ("infer.bench", ["--target", stories, "--draft", NOPE, "--datasets", "gsm8k", "--max-new-tokens", "8",
                                        "--backend", "reference"]),
        "generate-target": ("infer.generate", ["--target", NOPE, "--prompt", "hi", "--backend", "reference"]),
        "generate-draft": ("infer.generate", ["--target", stories, "--draft", NOPE, "--prompt", "hi",
                                              "--backend", "reference"]),
        "check-target": ("dspine.check", ["--target", NOPE, "--draft", str(DRAFT)]),
        "check-draft": ("dspine.check", ["--target", stories, "--draft", NOPE]),
        "init-target": ("dspine.init", ["--target", NOPE, "--out", str(tmp / "d1")]),
        "init-from": ("dspine.init", ["--target", stories, "--out", str(tmp / "d2"), "--init-from", NOPE]),
        "regenerate": ("data.regenerate", ["--target", NOPE, "--input", str(_conv(tmp)), "--output", str(tmp / "r")]),
        "tokenize": ("data.tokenize", ["--input", str(_conv(tmp)), "--tokenizer", NOPE, "--max-length", "32",
                                       "--cache-dir", str(tmp / "t")]),
        "sample_target": ("data.sample_target", ["--target", NOPE, "--num", "1", "--max-new-tokens", "2",
                                                 "--out", str(tmp / "s.jsonl")]),
    }


@pytest.mark.parametrize("case", ["bench-target", "bench-draft", "generate-target", "generate-draft", "check-target",
                                  "check-draft", "init-target", "init-from", "regenerate", "tokenize", "sample_target"])
def test_unreachable_hub_id_is_one_error_line(case, stories_dir, tmp_path, capsys, offline):
    import importlib

    module, argv = _hub_cases(str(stories_dir), tmp_path)[case]
    assert importlib.import_module(module).main(argv) == 2
    # one error line; infer.generate / infer.bench may add their CPU-thread note first on a busy machine
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("note: ")]
    assert len(err) == 1 and err[0].startswith("error: ") and f"{NOPE}: not a local path, and it could not be loaded " \
        "from the Hugging Face Hub" in err[0], err


def _fast_error(main, argv, capsys, message):
    t0 = time.perf_counter()
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert message in err, (argv, err)
    assert time.perf_counter() - t0 < 2.0, (argv, "checked after loading a model")


def test_generate_checks_arguments_and_paths_before_loading(stories_dir, tmp_path, capsys):
    from infer import generate

    base = ["--target", str(stories_dir), "--backend", "reference"]
    bad_draft = tmp_path / "draft"
    bad_draft.mkdir()
    (bad_draft / "config.json").write_text("[1]")
    cases = [
        (["--draft", str(tmp_path / "nope"), "--prompt", "hi"], f"draft checkpoint folder not found: {tmp_path / 'nope'}"),
        (["--draft", str(bad_draft), "--prompt", "hi"], f"{bad_draft / 'config.json'}: expected a JSON object"),
        (["--draft", "none"], "give --prompt TEXT or --dataset NAME"),
        (["--prompt", "hi", "--dataset", "gsm8k"], "give --prompt TEXT or --dataset NAME (one of them)"),
        (["--dataset", "gsm9k"], "unknown dataset 'gsm9k'"),
        (["--prompt", "hi", "--dtype", "fp8"], "--dtype 'fp8': choose auto, bf16 or fp32"),
        (["--prompt", "hi", "--draft", str(DRAFT), "--block-size", "32"], "--block-size 32 exceeds the draft's block size 16"),
        (["--prompt", "hi", "--draft", str(DRAFT)], "draft/target mismatch"),  # SmolLM2 draft vs stories260K
        (["--prompt", "hi", "--draft", "none", "--temperature", "1", "--draft-temperature", "0.5"],
         "--draft-temperature 0.5 needs a draft"),
    ]
    for extra, message in cases:
        _fast_error(generate.main, [*base, *extra], capsys, message)


def test_bench_checks_arguments_and_paths_before_loading(stories_dir, tmp_path, capsys):
    from infer import bench

    base = ["--target", str(stories_dir), "--backend", "reference"]
    cases = [
        (["--draft", str(tmp_path / "nope")], f"--draft nope={tmp_path / 'nope'}: no such draft folder"),
        (["--draft", f"a={DRAFT}", "--draft", f"a={DRAFT}"], "--draft label 'a' given twice"),
        (["--draft", "X="], "--draft X=: give [LABEL=]PATH with a path and a label"),
        (["--datasets", "gsm8k,nope"], "unknown dataset 'nope'"),
        (["--datasets", ","], "--datasets ',': give comma-separated task names (no empty entries)"),
        (["--num-prompts", "0"], "--num-prompts 0: must be >= 1"),
        (["--max-prompt-tokens", "-5"], "--max-prompt-tokens -5: must be >= 1"),
        (["--temperature", "nan"], "--temperature=nan must be a finite number >= 0"),
        (["--top-p", "inf"], "--top-p=inf must be in (0, 1]"),
        (["--block-size", "1"], "--block-size 1: must be >= 2"),
        (["--data-dir", str(tmp_path / "nope")], f"--data-dir {tmp_path / 'nope'}: no such folder"),
        (["--dtype", "fp16"], "--dtype 'fp16': choose auto, bf16 or fp32"),
        (["--temperature", "1", "--draft-temperature", "-1"], "--draft-temperature=-1.0 must be a finite number >= 0"),
        (["--draft-temperature", "0.5"], "--draft-temperature=0.5 is for sampling (temperature > 0)"),
        (["--temperature", "1e-39"], "--temperature=1e-39 must be 0 (greedy) or >= 1e-06"),
        (["--temperature", "1", "--draft-temperature", "0.5"], "--draft-temperature 0.5 needs a draft"),
        (["--draft", str(stories_dir), "--temperature", "1", "--draft-temperature", "0", "--verify", "tree"],
         "--draft-temperature 0 with --verify tree"),
    ]
    for extra, message in cases:
        _fast_error(bench.main, [*base, *extra], capsys, message)


@pytest.mark.parametrize("flag,value", [("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-1"),
                                        ("--top-p", "nan"), ("--top-p", "inf"), ("--top-k", "-3")])
def test_non_finite_sampling_values_are_refused_by_every_sampling_cli(flag, value, stories_dir, tmp_path, capsys):
    """Every CLI that samples (data.regenerate, data.sample_target, infer.generate, infer.bench) refuses the
    value before writing anything; data.regenerate used to write NaN into run_args.json and sample noise at inf."""
    from data import regenerate, sample_target
    from infer import bench, generate

    conv = _conv(tmp_path)
    cases = [
        (regenerate.main, ["--target", str(stories_dir), "--input", str(conv), "--output", str(tmp_path / "r"),
                           "--chat-template", "chatml", flag, value]),
        (generate.main, ["--target", str(stories_dir), "--prompt", "hi", "--backend", "reference", flag, value]),
        (bench.main, ["--target", str(stories_dir), "--datasets", "gsm8k", "--backend", "reference", flag, value]),
    ]
    if flag == "--temperature":  # sample_target has no top-p / top-k
        cases.append((sample_target.main, ["--target", str(stories_dir), "--num", "1", "--max-new-tokens", "2",
                                           "--out", str(tmp_path / "s.jsonl"), flag, value]))
    for main, argv in cases:
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's p.error
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and f"{flag}" in err and value in err.lower(), (main.__module__, err)
        assert "Traceback" not in err
    assert not (tmp_path / "r").exists() and not (tmp_path / "s.jsonl").exists()


def test_json_writer_refuses_nan(tmp_path):
    from data.rows import atomic_write_json

    with pytest.raises(ValueError):
        atomic_write_json(tmp_path / "x.json", {"temperature": float("nan")})
    assert not list(tmp_path.iterdir())


def test_messages_name_the_argument_file_or_row(stories_dir, qwen3_tokenizer_dir, tmp_path, capsys):
    from data import regenerate, tokenize

    conv = _conv(tmp_path)
    with pytest.raises(SystemExit):
        regenerate.main(["--target", str(stories_dir), "--input", str(conv), "--output", str(tmp_path / "r"),
                         "--limit", "-5"])
    assert "--limit -5: must be >= 1" in capsys.readouterr().err
    assert tokenize.main(["--input", str(conv), "--tokenizer", str(qwen3_tokenizer_dir), "--max-length", "-5"]) == 2
    assert "--max-length -5: must be >= 1" in capsys.readouterr().err
    assert tokenize.main(["--input", str(tmp_path / "nope.jsonl"), "--tokenizer", str(qwen3_tokenizer_dir),
                          "--max-length", "8"]) == 2
    assert f"--input {tmp_path / 'nope.jsonl'}: no such file" in capsys.readouterr().err
    first = tmp_path / "assistant-first.jsonl"
    first.write_text(json.dumps({"id": "r1", "conversations": [{"role": "assistant", "content": "hello"},
                                                               {"role": "user", "content": "hi"}]}) + "\n")
    assert tokenize.main(["--input", str(first), "--tokenizer", str(qwen3_tokenizer_dir), "--max-length", "64",
                          "--cache-dir", str(tmp_path / "tok")]) == 1
    err = capsys.readouterr().err
    assert "row r1: assistant turn 0 has no user turn before it" in err and "empty conversation" not in err


@pytest.mark.slow
def test_distill_names_bad_data_and_paths(stories_dir, tmp_path):
    from tests.helpers import distill_cases

    empty, text = tmp_path / "empty.jsonl", tmp_path / "text.jsonl"
    empty.write_text("")
    text.write_text("not json\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": list(range(1, 40)), "loss_mask": [0] + [1] * 38}) + "\n"
                            for _ in range(8)))
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [
            (empty, [], f"config key 'train': {empty} has no rows"),
            (text, [], f"{text}:1: invalid JSON"),
            (rows, [f"output_dir={afile}"], f"config key 'output_dir': {afile} is an existing file"),
            (rows, [f"draft_init={tmp_path / 'nope'}"], f"config key 'draft_init': {tmp_path / 'nope'} is not a draft folder"),
            # relative, without ./: its first folder exists here, so it is a local path, not a Hub id
            (rows, ["init_from=tests/no-such-draft"], "config key 'init_from': tests/no-such-draft is not a draft folder")]
    runs = distill_cases([["--config", str(REPO / "configs" / "stories260k-cpu.yaml"), f"target={stories_dir}",
                           f"train={train}", "eval=null", f"output_dir={tmp_path / 'out'}", *extra]
                          for train, extra, _ in cases])  # one child process (cwd: the repository) for all
    for (_, _, message), r in zip(cases, runs, strict=True):
        assert r.returncode == 2 and message in r.stderr and "none of the first 0 rows" not in r.stderr, r.stderr[-1500:]
    assert not (tmp_path / "out").exists()  # a run refused on its data leaves no empty output_dir


def test_more_bad_paths_and_values_are_named(stories_dir, tmp_path, capsys):
    """Found by trying every CLI as a new user: each is one error line naming the flag (was a traceback
    or an errno message, or a draft with max_position_embeddings 0 written without complaint). Repeated
    target layer ids stay allowed: the default ids repeat layers for a target shallower than the draft."""
    from data import regenerate, tokenize
    from dspine import convert, init
    from infer import bench

    afile = tmp_path / "afile"
    afile.write_text("x")
    conv = _conv(tmp_path)
    base = ["--target", str(stories_dir), "--mask-token-id", "0", "--dtype", "fp32"]
    for extra, message in [(["--max-position-embeddings", "0"], "--max-position-embeddings 0: must be >= 1"),
                           (["--intermediate-size", "0"], "--intermediate-size 0: must be >= 1"),
                           (["--sliding-window", "-4", "--sliding-layers", "0"], "--sliding-window -4: must be >= 1"),
                           # checked before the target loads (the review saw only the mask-token error first)
                           (["--block-size", "0"], "--block-size 0: must be >= 2"),
                           (["--injection", "bogus"], "argument --injection: invalid choice: 'bogus'"),
                           (["--target-layer-ids", "1,-2"], "--target-layer-ids: negative layer index -2")]:
        out = tmp_path / f"d{len(extra)}{extra[1]}"
        try:
            rc = init.main([*base, "--out", str(out), *extra])
        except SystemExit as e:  # argparse's error
            rc = e.code
        assert rc == 2 and message in capsys.readouterr().err and not out.exists(), extra
    from dspine.config import DSpineConfig

    for key, value in [("max_position_embeddings", 0), ("intermediate_size", -1), ("sliding_window", -4)]:
        with pytest.raises(ValueError, match=f"{key}={value} must be >= 1"):
            DSpineConfig(**{key: value})
    assert convert.main(["--target", str(REPO / "README.md"), "--out", str(afile)]) == 2
    assert f"--out {afile} is an existing file" in capsys.readouterr().err
    cases = [
        (regenerate.main, ["--target", str(stories_dir), "--input", str(tmp_path / "nope.jsonl"), "--output",
                           str(tmp_path / "r")], f"--input {tmp_path / 'nope.jsonl'}: no such file"),
        (regenerate.main, ["--target", str(stories_dir), "--input", str(conv), "--output", str(afile)],
         f"--output {afile} is an existing file"),
        (tokenize.main, ["--input", str(conv), "--tokenizer", str(stories_dir), "--max-length", "16", "--cache-dir",
                         str(afile)], f"--cache-dir {afile} is an existing file"),
        (bench.main, ["--target", str(stories_dir), "--datasets", "gsm8k", "--output-json", str(tmp_path)],
         f"--output-json {tmp_path} is a folder"),
        (bench.main, ["--target", str(stories_dir), "--datasets", "gsm8k", "--max-new-tokens", "0"],
         "--max-new-tokens=0 must be >= 1"),
        # a finished result is never replaced silently, and an unwritable path fails before the benchmark
        (bench.main, ["--target", str(stories_dir), "--datasets", "gsm8k", "--output-json", str(afile)],
         f"--output-json {afile} exists; pass --overwrite"),
        (bench.main, ["--target", str(stories_dir), "--datasets", "gsm8k", "--output-json", str(afile / "x.json")],
         f"--output-json {afile / 'x.json'}: cannot create it under {afile}"),
        (bench.main, ["--target", str(stories_dir), "--datasets", "gsm8k,,mbpp"], "no empty entries"),
    ]
    for main, argv, message in cases:
        _fast_error(main, argv, capsys, message)


def test_prepare_refuses_an_empty_input_path(tmp_path, capsys):
    from data import prepare

    assert prepare.main(["--input", "name=", "--output", str(tmp_path / "p")]) == 2  # was: read the working dir
    assert "input 'name=': no path after the name" in capsys.readouterr().err


def test_options_that_would_be_ignored_are_refused(stories_dir, tmp_path, capsys):
    """An option that another option (or the lack of a draft) makes meaningless is refused, naming both:
    each used to be dropped without a word (a chain run with --tree-budget, --no-ar with nothing else to run)."""
    from infer import bench, generate

    base = ["--target", str(stories_dir), "--backend", "reference"]
    for extra, message in [
            (["--prompt", "hi", "--draft", str(DRAFT), "--tree-budget", "8"], "--tree-budget 8 applies to --verify tree only"),
            (["--prompt", "hi", "--draft", str(DRAFT), "--verify", "tree", "--tree-budget", "48", "--budget", "auto"],
             "--tree-budget 48 with --budget auto: the planner picks its own tree sizes (give them with --plan-trees"),
            (["--prompt", "hi", "--draft", "none", "--compare-ar"], "--compare-ar needs a draft"),
            (["--prompt", "hi", "--compare-ar"], "--compare-ar needs a draft"),  # no --draft for a non-default target
            (["--prompt", "hi", "--draft", "none", "--verify", "tree"], "--verify tree needs a draft"),
            (["--prompt", "hi", "--draft", "none", "--invariant", "--temperature", "1"], "--invariant needs a draft"),
            (["--prompt", "hi", "--draft", str(DRAFT), "--verify", "tree", "--invariant", "--temperature", "1"],
             "--invariant with --verify tree: invariant verification checks the chain only"),
            (["--prompt", "hi", "--draft", str(DRAFT), "--verify", "tree", "--budget", "auto", "--invariant",
              "--temperature", "1"], "--invariant with --verify tree"),
            (["--prompt", "hi", "--draft", str(DRAFT), "--budget", "auto", "--plan-trees", "16", "--invariant",
              "--temperature", "1"], "--plan-trees 16 with --invariant: the planner runs no tree"),
            (["--prompt", "hi", "--no-chat-template", "--system", "be brief"],
             "--system goes into the chat template, which --no-chat-template turns off"),
            (["--prompt", "hi", "--no-chat-template", "--enable-thinking"], "--enable-thinking goes into the chat template"),
            (["--prompt", "hi", "--threads", "0"], "--threads 0: must be >= 1")]:
        _fast_error(generate.main, [*base, *extra], capsys, message)
    for extra, message in [
            (["--draft", str(DRAFT), "--tree-budget", "8"], "--tree-budget 8 applies to --verify tree only"),
            (["--draft", str(DRAFT), "--verify", "tree", "--tree-budget", "48", "--budget", "auto"],
             "--tree-budget 48 with --budget auto: the planner picks its own tree sizes (give them with --plan-trees "
             "16/32 or --config LABEL:plan_trees=16/32)"),
            (["--no-ar"], "--no-ar needs a draft"),
            (["--plot", str(tmp_path / "p.png")], "--plot needs a draft"),
            (["--verify", "tree"], "--verify tree needs a draft"),
            (["--draft", str(DRAFT), "--verify", "tree", "--invariant", "--temperature", "1"],
             "--invariant with --verify tree: invariant verification checks the chain only"),
            (["--draft", f"t={DRAFT}", "--config", "t:verify=tree", "--invariant", "--temperature", "1", "--backend",
              "cuda", "--device", "cpu"],
             "draft 't': --invariant with verify=tree (invariant verification checks the chain only"),
            (["--draft", f"p={DRAFT}", "--config", "p:budget=auto,plan_trees=16", "--invariant", "--temperature", "1",
              "--backend", "cuda", "--device", "cpu"], "draft 'p': plan_trees with --invariant"),
            (["--block-size", "3"], "--block-size 3 needs a draft"),
            (["--device", "cpu"], "--device cpu places the engine: give --backend cuda with it"),
            (["--no-chat-template", "--system", "x"], "--system goes into the chat template"),
            (["--threads", "-1"], "--threads -1: must be >= 1")]:
        _fast_error(bench.main, [*base, *extra], capsys, message)
    assert not (tmp_path / "p.png").exists()


def test_top_p_and_top_k_at_temperature_zero_warn_once(capsys):
    """Greedy decoding ignores --top-p / --top-k: a common, harmless combination, so one warning, not an error."""
    from argparse import Namespace

    from dspine.sampling import sampling_params

    args = lambda t, p, k: Namespace(temperature=t, top_p=p, top_k=k, max_new_tokens=8, seed=0)
    assert sampling_params(args(0.0, 0.95, 20)).greedy
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "--top-p / --top-k apply at --temperature > 0 only" in err, err
    sampling_params(args(0.0, 1.0, 5))
    assert "warning: --top-k applies at --temperature > 0 only" in capsys.readouterr().err
    for t, p, k in [(0.0, 1.0, 0), (1.0, 0.95, 20)]:  # nothing ignored: no warning
        sampling_params(args(t, p, k))
        assert capsys.readouterr().err == ""


def test_data_and_init_options_that_would_be_ignored_are_refused(stories_dir, tmp_path, capsys):
    """data.regenerate --concurrency (engine KV slots) with the hf backend, data.prepare --split with local
    files only, dspine.init --injection-rank/--injection-layers with --injection none: refused, not dropped."""
    from data import prepare, regenerate
    from dspine import init

    conv = _conv(tmp_path)
    _fast_error(regenerate.main, ["--target", str(stories_dir), "--input", str(conv), "--output", str(tmp_path / "r"),
                                  "--chat-template", "chatml", "--backend", "hf", "--concurrency", "4"], capsys,
                "--concurrency 4 sets the engine's KV cache slots; the hf backend decodes --batch-size rows at a time")
    assert not (tmp_path / "r").exists()
    assert prepare.main(["--input", f"mine={conv}", "--output", str(tmp_path / "p"), "--split", "test"]) == 2
    assert "--split test selects the split of a Hub dataset, and no --input is one" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()
    for flag, value in (("--injection-rank", "8"), ("--injection-layers", "0,1")):
        with pytest.raises(SystemExit):
            init.main(["--target", str(stories_dir), "--out", str(tmp_path / "d"), "--injection", "none", flag, value])
        assert f"{flag} shapes the injection, which --injection none leaves out" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_default_cpu_threads_follow_the_idle_cores(monkeypatch, capsys):
    """Without --threads and $OMP_NUM_THREADS, torch's threads drop to the cores other runnable tasks leave idle
    (2 threads on 2 busy cores made speculative decoding 30x slower); --threads and $OMP_NUM_THREADS win."""
    import torch

    import dspine.reference as ref

    assert ref.idle_cores(2, 0) == 2 and ref.idle_cores(2, 1) == 1 and ref.idle_cores(2, 7) == 1
    assert ref.idle_cores(8, 3) == 5
    busy = ref.busy_cores(samples=3, interval_s=0.0)  # this machine's count, read now (None without /proc)
    assert busy is None or busy >= 0
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(ref, "idle_cores", lambda: 1)
        assert ref.set_cpu_threads(None) == 1
        assert "1 torch CPU thread(s) instead of 2" in capsys.readouterr().err
        assert ref.set_cpu_threads(2) == 2  # --threads is taken as given
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert ref.set_cpu_threads(None) == 2 and capsys.readouterr().err == ""
        monkeypatch.setattr("os.cpu_count", lambda: 2)
        torch.set_num_threads(3)  # what $OMP_NUM_THREADS=3 gives torch on a 2-core machine
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert ref.set_cpu_threads(None) == 2
        assert "$OMP_NUM_THREADS=3 is more than this machine's 2 CPU cores; using 2" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_data_tools_state_their_exit_statuses(monkeypatch, tmp_path, capsys):
    """data.prepare / tokenize / regenerate: --help lists the exit statuses (1 no row kept, 2 bad input, 130
    Ctrl-C); data.regenerate on Ctrl-C is one line and 130, not a traceback."""
    from data import prepare, regenerate, tokenize

    for mod in (prepare, tokenize, regenerate):
        with pytest.raises(SystemExit) as e:
            mod.main(["--help"])
        assert e.value.code == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "exit status: 0 done; 1 the input was read but no row was kept" in out and "130 interrupted" in out

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(regenerate, "regenerate", interrupted)
    out_dir = tmp_path / "regen"
    assert regenerate.main(["--target", "t", "--input", "x.jsonl", "--output", str(out_dir)]) == 130
    err = capsys.readouterr().err
    assert f"data.regenerate: interrupted; the batches written to {out_dir} are kept" in err
    assert "Traceback" not in err


def test_fp16_is_refused_for_a_qwen_target_in_both_loaders(tiny_qwen3_dir, stories_dir):
    """One rule (dspine.target.check_target_dtype) for the reference loader and the engine: fp16 with a Qwen-family
    target overflows to NaN and is refused before decoding; other families and dtypes load."""
    import torch

    from dspine.target import check_target_dtype, load_target
    from infer.engine import load_engine

    want = "fp16 with a Qwen-family target overflows to NaN; use bf16 or fp32"
    for dtype, model_type in ((torch.float16, "qwen3"), (torch.float16, "qwen2")):
        with pytest.raises(ValueError, match=want):
            check_target_dtype(dtype, model_type)
    for dtype, model_type in ((torch.bfloat16, "qwen3"), (torch.float16, "llama"), (torch.float16, None)):
        check_target_dtype(dtype, model_type)  # allowed
    with pytest.raises(ValueError, match=want):
        load_target(str(tiny_qwen3_dir), dtype="fp16")
    with pytest.raises(ValueError, match=want):
        load_engine(str(tiny_qwen3_dir), None, None, device="cpu", dtype=torch.float16)
    assert load_target(str(stories_dir), dtype="fp16").dtype == torch.float16


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


def test_cli_none_is_a_value_not_null():
    """`injection=none` selects the DFlash ablation; only `null` / `~` mean "unset" on the command line."""
    from train import config as run_config

    cfg, _ = run_config.parse_cli(["--config", str(REPO / "configs" / "stories260k-cpu.yaml"), "injection=none",
                                   "eval=null"], "x")
    assert cfg.injection == "none" and cfg.eval is None


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


def test_a_missing_shared_folder_is_named_at_once(monkeypatch, tmp_path):
    """DSPINE_SHARED set to a folder that is not there: the eval sets fail at once naming the variable, not after a
    round of Hub retries (newcomer review: about 40 s of retry lines); an empty value counts as unset."""
    from infer.datasets import default_eval_dir

    monkeypatch.delenv("DSPINE_EVAL_DIR", raising=False)
    monkeypatch.setenv("DSPINE_SHARED", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=f"DSPINE_SHARED={tmp_path / 'nowhere'}: no such folder"):
        default_eval_dir()
    monkeypatch.setenv("DSPINE_SHARED", str(tmp_path))
    assert default_eval_dir() == tmp_path / "data" / "eval"
    monkeypatch.setenv("DSPINE_SHARED", "")
    from pathlib import Path

    import infer.datasets

    assert default_eval_dir() == Path(infer.datasets.__file__).resolve().parents[2] / "shared" / "data" / "eval"


def test_invariant_at_temperature_zero_is_noted(capsys):
    """--invariant at T = 0 changes nothing (greedy verification decodes the target's own text already): a note on
    stderr says so rather than taking it in silence; at T > 0 no note."""
    from infer import generate

    for temperature, noted in (("0", True), ("1", False)):
        args = generate.build_parser().parse_args(["--prompt", "hi", "--invariant", "--temperature", temperature])
        generate.check_decode_args(args)
        err = capsys.readouterr().err
        assert ("--invariant has no effect at --temperature 0" in err) is noted


def test_a_named_eval_folder_is_never_replaced_by_the_hub(stories_dir, tmp_path, capsys, offline):
    """An eval folder the user named that does not exist fails at once, naming it, in every tool that takes one
    (newcomer review: data.decontaminate --eval-dir spent 29 s on Hub retries, and with a network would have used the
    Hub's copies); infer.generate takes --data-dir as the README says."""
    from data import decontaminate
    from infer import generate
    from infer.datasets import load_eval_rows
    from tests.conftest import shared_path

    gone = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"eval folder {gone}: no such folder"):
        load_eval_rows("gsm8k", gone)
    t0 = time.monotonic()
    assert decontaminate.main(["--input", str(_conv(tmp_path)), "--output", str(tmp_path / "d"), "--eval-dir",
                               str(gone), "--tasks", "gsm8k"]) == 2
    assert f"error: eval folder {gone}: no such folder" in capsys.readouterr().err and time.monotonic() - t0 < 10
    argv = ["--target", str(stories_dir), "--dataset", "gsm8k", "--max-new-tokens", "2", "--backend", "reference",
            "--no-chat-template", "--json"]
    assert generate.main([*argv, "--data-dir", str(gone)]) == 2
    assert f"eval folder {gone}: no such folder" in capsys.readouterr().err
    local = tmp_path / "eval" / "gsm8k"
    local.mkdir(parents=True)
    row = json.loads((shared_path("data", "eval") / "gsm8k" / "test.jsonl").read_text().splitlines()[3])
    (local / "test.jsonl").write_text(json.dumps(row) + "\n")
    assert generate.main([*argv, "--num-prompts", "2", "--data-dir", str(tmp_path / "eval")]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["num_prompts"] == 1  # the folder's one row, not the shared set's two
    assert "note: gsm8k has 1 prompts; --num-prompts 2 runs all 1\n" in cap.err  # capped: it ran 1 silently
    assert generate.main([*argv, "--num-prompts", "1", "--data-dir", str(tmp_path / "eval")]) == 0
    assert "runs all" not in capsys.readouterr().err  # not capped: no note


def test_ctrl_c_or_sigterm_in_sample_target_is_one_line(stories_dir, tmp_path, capsys, monkeypatch):
    """data.sample_target: Ctrl-C or SIGTERM while sampling exits 130 with one line and no file (newcomer review: a
    30-frame traceback)."""
    import os
    import signal

    from data import sample_target

    out = tmp_path / "s.jsonl"
    argv = ["--target", str(stories_dir), "--num", "2", "--max-new-tokens", "2", "--out", str(out)]
    def ctrl_c(*a):  # what Python's SIGINT handler raises (a test worker's SIGINT may be ignored: not sent)
        raise KeyboardInterrupt

    for stop in (ctrl_c, lambda *a: os.kill(os.getpid(), signal.SIGTERM)):
        monkeypatch.setattr(sample_target, "sample_rows", stop)
        assert sample_target.main(argv) == 130
        err = capsys.readouterr().err
        assert f"data.sample_target: interrupted; nothing was written to {out}" in err and "Traceback" not in err
        assert not out.exists() and not list(tmp_path.glob("s.jsonl*"))


@pytest.mark.parametrize("module, argv, message", [
    ("benchmarks.engine.bench_regen", ["--repeat", "0"], "--repeat 0: must be >= 1"),
    ("benchmarks.train.bench_eval", ["--repeats", "-1", "--output", "x.json"], "--repeats -1: must be >= 1"),
])
def test_benchmark_repeat_counts_below_one_are_refused(module, argv, message, capsys):
    """A run count below 1 wrote a results file with no run in it; now argparse's usage error, before any model."""
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_folder_without_a_tokenizer_is_named(tmp_path, capsys):
    """``--tokenizer`` naming a folder with no tokenizer files: one error line that names the folder (transformers'
    own message, five lines, named none)."""
    from data import tokenize

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": "yo"}]}) + "\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert tokenize.main(["--input", str(rows), "--tokenizer", str(empty), "--max-length", "64",
                          "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {empty}: no tokenizer loads from it (") and err.count("\n") == 1, err
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_a_draft_folder_given_as_the_target_is_one_line(stories_dir, tmp_path, capsys):
    """A draft folder (model_type 'dspine') as the target, e.g. --target and --draft swapped: one line naming the
    folder and its model type, before any weight loads (transformers' own message lists ~250 config classes)."""
    import shutil

    from dspine import init
    from dspine.target import load_target
    from infer import generate

    draft = tmp_path / "draft"
    assert init.main(["--target", str(stories_dir), "--out", str(draft), "--mask-token-id", "0", "--layers", "1"]) == 0
    shutil.copy(stories_dir / "tokenizer.json", draft)
    capsys.readouterr()
    assert generate.main(["--target", str(draft), "--draft", "none", "--prompt", "hi", "--no-chat-template"]) == 2
    err = capsys.readouterr().err
    # (a loaded machine adds a note on the torch threads before it)
    assert err.splitlines()[-1] == f"error: target {draft}: model_type='dspine' is not a causal LM (not a target model)"
    assert "Traceback" not in err and all(x.startswith(("note:", "error:")) for x in err.splitlines()), err
    with pytest.raises(ValueError, match="model_type='dspine' is not a causal LM"):
        load_target(str(draft))


def test_check_refuses_weights_that_do_not_match_the_draft_config(stories_dir, tmp_path, capsys):
    """dspine.check reads the weights' headers too: a tensor missing from model.safetensors or of another shape
    than config.json gives was reported OK (exit 0), then refused by every loader."""
    from safetensors.torch import load_file, save_file

    from dspine import check, init

    draft = tmp_path / "draft"
    assert init.main(["--target", str(stories_dir), "--out", str(draft), "--mask-token-id", "0", "--layers", "1"]) == 0
    assert check.main(["--target", str(stories_dir), "--draft", str(draft)]) == 0
    capsys.readouterr()
    state = load_file(draft / "model.safetensors")
    name = sorted(state)[0]
    for case, changed in (("missing", {k: v for k, v in state.items() if k != name}),
                          ("shape", {**state, name: torch.zeros(state[name].shape[0] + 1, *state[name].shape[1:])})):
        save_file(changed, draft / "model.safetensors")
        assert check.main(["--target", str(stories_dir), "--draft", str(draft)]) == 2, case
        err = capsys.readouterr().err
        want = f"missing tensors ['{name}']" if case == "missing" else f"shape mismatch {name}: file "
        assert err.startswith(f"error: {draft}: ") and want in err and err.count("\n") == 1, err


def test_a_causal_lm_of_another_layout_as_the_target_names_the_folder(tmp_path):
    """A causal LM whose decoder is not Llama/Qwen-style (GPT-2: transformer.h): the error names the target folder
    (it named only the class, GPT2LMHeadModel)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from dspine.target import load_target

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64)).save_pretrained(folder)
    with pytest.raises(ValueError, match=rf"^target {folder}: GPT2LMHeadModel: cannot find the decoder layers .*Llama/Qwen"):
        load_target(str(folder))
    # the config alone already says it (infer.generate, infer.bench and dspine.check read it before any weight): no
    # RoPE, where dspine.check's rope row read "plain"
    from dspine.target import TargetSpec

    spec = TargetSpec.from_pretrained(str(folder), with_tokenizer=False)
    assert spec.rope_problems == ["model_type='gpt2' without rope_theta (positions not by RoPE)"]
    with pytest.raises(ValueError, match=rf"^target {folder}: model_type='gpt2' without rope_theta .* is not implemented"):
        spec.check_supported(engine=True)
