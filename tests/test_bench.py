"""infer.bench end to end on the CPU (stories260K target, random draft) and its bootstrap interval."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dspine.checkpoint import save_draft
from dspine.target import load_target
from infer import bench
from tests.conftest import shared_path
from tests.helpers import random_draft


def test_bootstrap_ci_brackets_tau_and_collapses_for_equal_prompts():
    assert bench.bootstrap_ci([6, 6, 6], [3, 3, 3]) == pytest.approx([2.0, 2.0])
    lo, hi = bench.bootstrap_ci([10, 2, 30, 4, 8], [5, 2, 6, 4, 4])
    assert lo < 54 / 21 < hi and lo >= 1.0 and hi <= 5.0
    assert all(math.isnan(x) for x in bench.bootstrap_ci([3], [0]))  # no verify step: no interval


@pytest.fixture(scope="module")
def draft_dir(stories_dir, tmp_path_factory):
    target = load_target(str(stories_dir), dtype="fp32")
    return save_draft(random_draft(target, block_size=8, mask=0), tmp_path_factory.mktemp("bench_draft"))


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_bench_json_on_the_cpu(stories_dir, draft_dir, tmp_path, backend, capsys):
    out = tmp_path / "b.json"
    extra = ["--device", "cpu", "--dtype", "fp32"] if backend == "cuda" else ["--dtype", "fp32"]
    code = bench.main(["--target", str(stories_dir), "--draft", f"A={draft_dir}", "--draft", f"B={draft_dir}",
                       "--datasets", "gsm8k,mbpp,humaneval", "--data-dir", str(shared_path("data", "eval")),
                       "--num-prompts", "2", "--max-new-tokens", "12", "--no-chat-template", "--backend", backend,
                       "--concurrency", "2", "--output-json", str(out), *extra])
    assert code == 0
    res = json.loads(out.read_text())
    orders = [t["run_order"] for t in res["tasks"]]
    assert orders == [["AR", "A", "B"], ["A", "B", "AR"], ["B", "AR", "A"]]  # rotated per task
    assert res["args"]["warmup"] == "start"  # auto: the per-task warm-up only on a CUDA device
    assert res["finished"] >= res["date"]  # provenance taken when the run started; "finished" when written
    assert res["args"]["device"] == ("cpu" if backend == "cuda" else None)  # the reference backend places nothing
    footer = {"cuda": "[engine on the CPU (--device cpu), T=0.0", "reference": "[reference backend on the CPU, T=0.0"}
    assert footer[backend] in capsys.readouterr().out  # where it ran, not only which backend
    for t in res["tasks"]:
        for d in t["drafts"].values():
            assert d["tau"] == pytest.approx(1 + sum(d["accept_at_pos"]))
            assert sum(d["per_prompt_committed"]) == d["committed_tokens"]
            assert sum(d["per_prompt_steps"]) == d["verify_steps"]
            lo, hi = d["tau_ci95"]
            assert lo <= d["tau"] + 1e-9 and d["tau"] <= hi + 1e-9
            assert d["greedy_equal"] == d["greedy_compared"] == 2  # fp32: lossless
            if backend == "cuda":  # the engine's time split: prefill and the decode loop
                assert set(d["profile"]) == set(bench.PROFILE_KEYS) and d["profile"]["prefill_s"] > 0
                disjoint = ("prefill_s", "launch_s", "wait_s", "host_s")  # admit_* are parts of prefill_s
                assert sum(d["profile"][k] for k in disjoint) <= d["seconds"] + 1e-6
            else:
                assert "profile" not in d
    for label in ("A", "B"):
        s = res["summary"][label]
        lo, hi = s["mean_tau_ci95"]
        assert lo <= s["mean_tau"] + 1e-9 <= hi + 2e-9
    assert res["summary"]["A"]["mean_tau"] == pytest.approx(res["summary"]["B"]["mean_tau"])  # same draft
    assert torch.isfinite(torch.tensor(res["summary"]["A"]["mean_speedup"]))


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


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield 1 if n != 1 else 2  # a thread count other than the current one
    torch.set_num_threads(n)


def test_reference_backend_threads_verify_width_and_plot_path(stories_dir, stories_draft, tmp_path, keep_threads):
    """--threads sets torch's CPU threads (recorded); the CPU verify width and the plot path come from one
    place each (dspine.reference.reference_verify_size, check_args)."""
    from infer.generate import build_parser

    res = _bench(stories_dir, stories_draft, tmp_path, "--no-ar", "--threads", str(keep_threads))
    assert res["args"]["threads"] == keep_threads == torch.get_num_threads()
    assert res["args"]["block_size"] == 4 and res["tasks"][0]["drafts"]["D"]["verified_tokens_per_step"] == 4
    assert res["args"]["plot"] == str(tmp_path / "bench.png") and (tmp_path / "bench.png").stat().st_size > 1000
    assert "--threads" in build_parser().format_help()


def test_reference_verify_size_is_one_rule():
    from dspine.reference import CPU_VERIFY_WIDTH, reference_verify_size

    assert reference_verify_size(None, "chain", [16]) == CPU_VERIFY_WIDTH == 4
    assert reference_verify_size(None, "chain", [16, 2]) == 2  # the smallest draft block caps it
    assert reference_verify_size(5, "chain", [16]) == 5  # given: kept
    assert reference_verify_size(None, "tree", [16]) is None  # a tree's size is its budget
    assert reference_verify_size(None, "chain", []) is None  # autoregressive: no block


def test_bench_refuses_the_ar_label_and_a_task_twice(stories_dir, stories_draft, tmp_path, capsys):
    base = ["--target", str(stories_dir), "--backend", "reference", "--data-dir", str(shared_path("data", "eval"))]
    for extra, msg in ((["--draft", f"AR={stories_draft}"], "the label 'AR' names the autoregressive baseline"),
                       (["--draft", f"D={stories_draft}", "--draft", f"D={stories_draft}"], "label 'D' given twice"),
                       (["--datasets", "gsm8k,mt_bench,mt-bench"], "mt-bench given twice")):
        assert bench.main(base + extra) == 2
        assert msg in capsys.readouterr().err


def test_datasets_help_names_the_tasks():
    from infer.datasets import TASKS

    (action,) = [a for a in bench.build_parser()._actions if a.dest == "datasets"]
    assert action.help and all(t in action.help for t in TASKS), action.help


def _stopped_at_mbpp(tmp_path, monkeypatch, stop):
    """An eval folder under ``tmp_path`` (returned) of 2 gsm8k prompts and mbpp's file, and bench.run_task patched to
    call ``stop()`` when it reaches mbpp (after gsm8k finished)."""
    data = tmp_path / "eval"
    (data / "gsm8k").mkdir(parents=True)
    rows = (shared_path("data", "eval") / "gsm8k" / "test.jsonl").read_text().splitlines()[:2]
    (data / "gsm8k" / "test.jsonl").write_text("\n".join(rows) + "\n")
    (data / "mbpp").mkdir()
    mbpp = shared_path("data", "eval") / "mbpp" / "sanitized-mbpp.json"
    (data / "mbpp" / "sanitized-mbpp.json").write_text(mbpp.read_text())
    real = bench.run_task

    def run_task(runner, task, *a, **kw):
        if task == "mbpp":
            stop()
        return real(runner, task, *a, **kw)

    monkeypatch.setattr(bench, "run_task", run_task)
    return data


def test_bench_notes_a_short_task_and_ctrl_c_keeps_the_finished_tasks(stories_dir, stories_draft, tmp_path,
                                                                        monkeypatch, capsys):
    def ctrl_c():
        raise KeyboardInterrupt

    data = _stopped_at_mbpp(tmp_path, monkeypatch, ctrl_c)
    out = tmp_path / "b.json"
    code = bench.main(["--target", str(stories_dir), "--draft", f"D={stories_draft}", "--datasets", "gsm8k,mbpp",
                       "--num-prompts", "5", "--max-new-tokens", "4", "--backend", "reference", "--no-chat-template",
                       "--data-dir", str(data), "--output-json", str(out)])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    assert "note: gsm8k has 2 prompts; --num-prompts 5 runs all 2" in err
    assert f"interrupted: tasks finished: gsm8k; wrote them to {out}" in err
    res = json.loads(out.read_text())
    assert res["interrupted"] is True and [t["task"] for t in res["tasks"]] == ["gsm8k"]
    assert res["tasks"][0]["num_prompts"] == 2 and res["tasks"][0]["drafts"]["D"]["greedy_compared"] == 2


def test_sigterm_keeps_the_finished_tasks_and_an_overwritten_file_stays(stories_dir, stories_draft, tmp_path,
                                                                          monkeypatch, capsys):
    """SIGTERM (kill) stops the run as Ctrl-C does (status 143, the finished tasks kept), and a run that would
    --overwrite a finished results file writes its finished tasks beside it (X.interrupted.json): the finished file
    is not replaced by a partial one (newcomer review: it was)."""
    import os
    import signal

    data = _stopped_at_mbpp(tmp_path, monkeypatch, lambda: os.kill(os.getpid(), signal.SIGTERM))
    out = tmp_path / "b.json"
    out.write_text('{"finished": "a complete run"}')
    before = signal.getsignal(signal.SIGTERM)
    code = bench.main(["--target", str(stories_dir), "--draft", f"D={stories_draft}", "--datasets", "gsm8k,mbpp",
                       "--num-prompts", "2", "--max-new-tokens", "4", "--backend", "reference", "--no-chat-template",
                       "--data-dir", str(data), "--output-json", str(out), "--overwrite", "--plot",
                       str(tmp_path / "b.png")])
    err = capsys.readouterr().err
    kept = tmp_path / "b.interrupted.json"
    assert code == 143 and "Traceback" not in err, err
    assert f"terminated: tasks finished: gsm8k; wrote them to {kept}" in err and f"{out} is left as it was" in err
    assert out.read_text() == '{"finished": "a complete run"}'
    res = json.loads(kept.read_text())
    assert res["interrupted"] is True and [t["task"] for t in res["tasks"]] == ["gsm8k"]
    assert signal.getsignal(signal.SIGTERM) is before  # main() put the previous handler back


def test_sigterm_after_the_last_task_writes_the_whole_results_then_exits_143(stories_dir, stories_draft, tmp_path,
                                                                             monkeypatch, capsys):
    """A SIGTERM that comes once every task has finished (while the summary and the JSON are made) no longer ends
    in a traceback with nothing written: the results are written whole (``"interrupted": false``), status 143."""
    import os
    import signal

    data = _stopped_at_mbpp(tmp_path, monkeypatch, lambda: None)
    real = bench.summarize
    calls = []

    def summarize(rows):
        if not calls:
            os.kill(os.getpid(), signal.SIGTERM)
        calls.append(1)
        return real(rows)

    monkeypatch.setattr(bench, "summarize", summarize)
    out = tmp_path / "b.json"
    code = bench.main(["--target", str(stories_dir), "--draft", f"D={stories_draft}", "--datasets", "gsm8k,mbpp",
                       "--num-prompts", "1", "--max-new-tokens", "4", "--backend", "reference", "--no-chat-template",
                       "--data-dir", str(data), "--output-json", str(out)])
    err = capsys.readouterr().err
    assert code == 143 and "Traceback" not in err, err
    res = json.loads(out.read_text())
    assert res["interrupted"] is False and [t["task"] for t in res["tasks"]] == ["gsm8k", "mbpp"]


def test_results_never_replace_a_file_written_during_the_run(stories_dir, stories_draft, tmp_path, monkeypatch,
                                                            capsys):
    """A results file that another run wrote after this one checked the name stays, and this run's go beside it
    (b.2.json); an interrupted --overwrite run keeps an earlier run's b.interrupted.json (newcomer review: both were
    silently replaced)."""
    out = tmp_path / "b.json"
    data = _stopped_at_mbpp(tmp_path, monkeypatch, lambda: (out.write_text("another run"),
                                                            (tmp_path / "b.png").write_text("its plot")))
    argv = ["--target", str(stories_dir), "--draft", f"D={stories_draft}", "--datasets", "gsm8k,mbpp", "--num-prompts",
            "2", "--max-new-tokens", "4", "--backend", "reference", "--no-chat-template", "--data-dir", str(data),
            "--output-json", str(out), "--plot", str(tmp_path / "b.png")]
    assert bench.main(argv) == 0
    assert out.read_text() == "another run"
    res = json.loads((tmp_path / "b.2.json").read_text())
    assert res["interrupted"] is False and [t["task"] for t in res["tasks"]] == ["gsm8k", "mbpp"]
    assert f"results are in {tmp_path / 'b.2.json'}" in capsys.readouterr().err
    assert (tmp_path / "b.png").read_text() == "its plot"  # was replaced by this run's plot
    assert (tmp_path / "b.2.png").read_bytes().startswith(b"\x89PNG")
    assert res["args"]["plot"] == str(tmp_path / "b.2.png")  # it recorded b.png, the other run's plot

    def ctrl_c():
        raise KeyboardInterrupt

    _stopped_at_mbpp(tmp_path / "again", monkeypatch, ctrl_c)
    earlier = tmp_path / "b.interrupted.json"
    earlier.write_text('{"tasks": "an earlier interrupted run"}')
    assert bench.main([*argv, "--overwrite"]) == 130
    assert f"wrote them to {tmp_path / 'b.interrupted.2.json'}" in capsys.readouterr().err
    assert earlier.read_text() == '{"tasks": "an earlier interrupted run"}' and out.read_text() == "another run"
    res = json.loads((tmp_path / "b.interrupted.2.json").read_text())
    assert res["interrupted"] is True and [t["task"] for t in res["tasks"]] == ["gsm8k"]
    assert not list(tmp_path.glob("*.tmp"))


def test_concurrency_above_the_prompts_sizes_caches_and_warm_up_to_them(stories_dir, stories_draft, tmp_path,
                                                                      monkeypatch, capsys):
    """--concurrency 64 with 2 prompts a task: the engines' caches and the start-up warm-up are for batch 2, the
    batch every task runs (newcomer review: 64 rows were allocated per configuration and 64 prompts warmed up: 5 GB
    and 93 s for one SmolLM2 prompt against 1.4 GB and 19 s at concurrency 1)."""
    made, warmed = [], []

    class Runner(bench.Runner):
        def __init__(self, args):
            super().__init__(args)
            made.append(self)

        def run(self, prompts, params, label, tag=None):
            if (tag or {}).get("pass") == "start":
                warmed.append(len(prompts))
            return super().run(prompts, params, label, tag)

    monkeypatch.setattr(bench, "Runner", Runner)
    out = tmp_path / "b.json"
    assert bench.main(["--target", str(stories_dir), "--draft", f"D={stories_draft}", "--datasets", "gsm8k,mbpp",
                       "--num-prompts", "2", "--max-new-tokens", "4", "--backend", "cuda", "--device", "cpu",
                       "--dtype", "fp32", "--no-chat-template", "--concurrency", "64", "--data-dir",
                       str(shared_path("data", "eval")), "--output-json", str(out)]) == 0
    assert "note: --concurrency 64, but no task has more than 2 prompts: batches of at most 2" in capsys.readouterr().err
    assert [d.max_batch for d in made[0].decoders.values()] == [2, 2] and warmed == [2, 2]
    res = json.loads(out.read_text())
    assert res["args"]["concurrency"] == 64 and res["args"]["max_batch"] == 2
    assert [t["drafts"]["D"]["greedy_compared"] for t in res["tasks"]] == [2, 2]


def test_a_later_task_that_fails_keeps_the_finished_tasks(stories_dir, stories_draft, tmp_path, monkeypatch, capsys):
    """An error in a later task (here non-finite logits) ends the run with status 2 and writes the tasks finished
    before it, as Ctrl-C does, with the error (newcomer review: they were dropped)."""
    def non_finite():
        raise FloatingPointError("non-finite logits")

    data = _stopped_at_mbpp(tmp_path, monkeypatch, non_finite)
    out = tmp_path / "b.json"
    code = bench.main(["--target", str(stories_dir), "--draft", f"D={stories_draft}", "--datasets", "gsm8k,mbpp",
                       "--num-prompts", "2", "--max-new-tokens", "4", "--backend", "reference", "--no-chat-template",
                       "--data-dir", str(data), "--output-json", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"error: non-finite logits\ntasks finished: gsm8k; wrote them to {out}" in err
    res = json.loads(out.read_text())
    assert res["interrupted"] is True and res["error"] == "non-finite logits"
    assert [t["task"] for t in res["tasks"]] == ["gsm8k"] and res["tasks"][0]["drafts"]["D"]["greedy_compared"] == 2


def test_a_task_without_prompts_fails_before_any_task_runs(stories_dir, stories_draft, tmp_path, monkeypatch, capsys):
    """Every task's prompts load before the models: an eval folder without mbpp fails at once naming it, not after
    gsm8k ran (newcomer review: gsm8k decoded, then the run ended with nothing written)."""
    import infer.datasets

    def offline(task):
        raise ConnectionError("offline")

    monkeypatch.setattr(infer.datasets, "_hub_rows", offline)
    ran = []
    monkeypatch.setattr(bench, "Runner", lambda args: ran.append(args))
    data = tmp_path / "eval"
    (data / "gsm8k").mkdir(parents=True)
    (data / "gsm8k" / "test.jsonl").write_text((shared_path("data", "eval") / "gsm8k" / "test.jsonl").read_text())
    for mix in ([], ["--mix"]):
        code = bench.main(["--target", str(stories_dir), "--draft", f"D={stories_draft}", "--datasets", "gsm8k,mbpp",
                           "--num-prompts", "2", "--max-new-tokens", "4", "--backend", "reference",
                           "--data-dir", str(data), "--output-json", str(tmp_path / "b.json"), *mix])
        err = capsys.readouterr().err
        assert code == 2 and f"error: mbpp: no local file {data / 'mbpp' / 'sanitized-mbpp.json'}" in err, err
    assert ran == [] and not (tmp_path / "b.json").exists()


def test_output_paths_that_would_clobber_each_other_are_refused(stories_dir, stories_draft, tmp_path, monkeypatch,
                                                                capsys):
    """Before any model is read: an --output-json whose derived plot is itself (X.png), a --plot in a format
    matplotlib does not write by suffix, --plot and --output-json naming one file, and DSPINE_PLAN_LOG naming the
    results file; nothing is created (newcomer review: the plot replaced the JSON, a .json plot crashed after the
    whole run, the step log was appended to the results)."""
    base = ["--target", str(stories_dir), "--draft", f"D={stories_draft}", "--datasets", "gsm8k", "--no-chat-template",
            "--data-dir", str(shared_path("data", "eval")), "--backend", "cuda", "--device", "cpu"]
    png, js = tmp_path / "r.png", tmp_path / "r.json"
    cases = [([*base, "--output-json", str(png)], "the plot would be written over it"),
             ([*base, "--output-json", str(js), "--plot", str(tmp_path / "p.json")], "give a file ending in .png"),
             ([*base, "--output-json", str(js), "--plot", str(js)], "give a file ending in .png"),
             ([*base, "--output-json", str(tmp_path / "r.svg"), "--plot", str(tmp_path / "r.svg")], "name the same file")]
    for argv, msg in cases:
        assert bench.main(argv) == 2
        assert msg in capsys.readouterr().err
    monkeypatch.setenv("DSPINE_PLAN_LOG", str(js))
    assert bench.main([*base, "--budget", "auto", "--output-json", str(js)]) == 2
    assert f"DSPINE_PLAN_LOG={js} and --output-json {js} name the same file" in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == []


def test_generate_ctrl_c_is_one_line(monkeypatch, capsys):
    from infer import generate

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "run", interrupted)
    assert generate.main(["--prompt", "hi"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted: nothing generated was printed"


def test_bench_task_warmup_times_a_second_identical_pass(stories_dir, stories_draft, monkeypatch):
    """--warmup task: every configuration decodes the task twice, the first pass untimed, and the row
    holds the second pass (same prompts, same tokens at T = 0); --warmup start: once."""
    import argparse

    from dspine.sampling import SamplingParams
    from dspine.stats import AcceptStats

    calls = []

    class Runner:
        drafts = {"D": str(stories_draft)}
        planner_steps: dict = {}
        tokenizer = type("T", (), {"decode": staticmethod(lambda ids, **kw: " ".join(map(str, ids)))})()
        spec = type("S", (), {"eos_ids": {0}})()
        verified_per_step = {"D": 4}
        vocab_info = {"D": None}
        configs = {"D": {"verify": "chain", "tree_budget": None, "budget": None, "chain_first": None, "plan_trees": None, "plan_chains": None, "width": None, "confidence": None, "conf_slope": None, "drain": None, "state": None, "draft_vocab": None}}
        args = argparse.Namespace(num_prompts=2, data_dir=str(shared_path("data", "eval")), verify="chain",
                                  exact=False, concurrency=8)

        def capture_prefill(self, batch):  # the prefill graphs of the task's batch size, before any pass
            calls.append(("capture", batch))

        def planner_memory(self, label, memory=None):
            if memory is None:
                return dict(self.memory.get(label, {}))
            self.memory[label] = memory

        def run(self, prompts, params, label, tag=None):
            import gc

            self.tags.append(tag)

            calls.append(label)
            self.gc.append(gc.isenabled())  # off during every pass (infer.bench decode)
            self.seen.append(dict(self.memory.get(label, {})))
            if label == "D":
                self.memory["D"] = {"learned": calls.count(label)}
            secs = 10.0 if calls.count(label) == 1 else 1.0  # the first pass pays a one-time cost
            stats = AcceptStats(4, [0, 2 * len(prompts), 0, 0, 0])  # two steps of one token per prompt
            return [[5, 6, 7]] * len(prompts), stats, secs, [2] * len(prompts), {"prefill_s": secs / 2}

    monkeypatch.setattr(bench, "encode", lambda runner, text, history=None: [1, 2, 3])
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    for warm, runs, secs in ((True, 2, 1.0), (False, 1, 10.0)):
        calls.clear()
        runner = Runner()
        runner.memory = {"D": {"before": 1}}  # a planner's acceptance memory: the warm-up must leave it as it was
        runner.seen = []  # the memory each pass started from
        runner.gc = []
        runner.tags = []
        row = bench.run_task(runner, "gsm8k", params, do_ar=True, warmup=warm)
        import gc

        # what each call is, for a DSPINE_PLAN_LOG line: the untimed pass first, then the timed one
        assert runner.tags == ([{"task": "gsm8k", "turn": 0, "pass": "warmup"}] * 2 if warm else []) + [
            {"task": "gsm8k", "turn": 0, "pass": "timed"}] * 2

        assert runner.gc == [False] * (2 * runs) and gc.isenabled()
        assert calls == [("capture", 2)] + [None, "D"] * runs  # concurrency 8, 2 prompts: batches of 2
        calls.pop(0)
        # each pass of D starts from the memory before the task: the timed one does not see the warm-up's
        assert [m for m, c in zip(runner.seen, calls) if c == "D"] == [{"before": 1}] * runs
        assert row["ar"]["seconds"] == row["drafts"]["D"]["seconds"] == secs
        assert row["drafts"]["D"]["profile"] == {"prefill_s": secs / 2}
        if warm:  # the untimed pass is recorded beside the timed one
            assert row["ar"]["warmup_seconds"] == row["drafts"]["D"]["warmup_seconds"] == 10.0
            assert row["drafts"]["D"]["warmup_profile"] == {"prefill_s": 5.0}
        else:
            assert "warmup_seconds" not in row["ar"]
        assert row["drafts"]["D"]["speedup"] == pytest.approx(1.0)
        assert row["drafts"]["D"]["greedy_equal"] == 2


def test_bench_device_is_checked_and_planner_counts_skip_the_warmup(stories_dir, draft_dir, tmp_path, capsys):
    """--device names a torch device the engine runs on; cuda:N without a GPU gets the CUDA message. The
    planner's choices count the timed runs only: the start-up warm-up's steps are not added to the first task."""
    base = ["--target", str(stories_dir), "--data-dir", str(shared_path("data", "eval")), "--no-chat-template",
            "--backend", "cuda", "--datasets", "gsm8k", "--num-prompts", "2", "--max-new-tokens", "12"]
    for dev, msg in (("bogus", "--device 'bogus': not a torch device"), ("meta", "--device 'meta': the engine runs on")):
        assert bench.main(base + ["--device", dev]) == 2 and msg in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert bench.main(base + ["--device", "cuda:0"]) == 2
        assert "--backend cuda needs a CUDA GPU" in capsys.readouterr().err
    steps = {}
    for warm in ("start", "task"):
        out = tmp_path / f"{warm}.json"
        assert bench.main(base + ["--device", "cpu", "--dtype", "fp32", "--draft", f"D={draft_dir}", "--budget", "auto",
                                  "--temperature", "1", "--concurrency", "2", "--warmup", warm,
                                  "--output-json", str(out)]) == 0
        d = json.loads(out.read_text())["tasks"][0]["drafts"]["D"]
        steps[warm] = sum(e["steps"] for e in d["planner_choices"].values())  # batched loop steps
        assert 0 < steps[warm] <= d["verify_steps"]  # verify_steps: per prompt, summed over the rows
    assert steps["start"] == steps["task"]  # the same timed run; before the fix "start" added the warm-up's


def test_config_gives_each_draft_label_its_verify_mode(stories_dir, draft_dir, tmp_path):
    """--config: one run times the chain, a tree and the planner of one draft, alternated per task; each row
    records its own verify mode and verified tokens per step, the planner's row its choices; greedy fp32
    output equals AR for all three (lossless whatever the mode)."""
    out = tmp_path / "c.json"
    code = bench.main(["--target", str(stories_dir), "--draft", f"chain={draft_dir}", "--draft", f"tree={draft_dir}",
                       "--draft", f"auto={draft_dir}", "--config", "tree:verify=tree,tree_budget=12,chain_first=yes",
                       "--config", "auto:budget=auto,plan_trees=12/6,confidence=always,conf_slope=0.5,drain=own,state=kv", "--datasets", "gsm8k,mbpp",
                       "--data-dir", str(shared_path("data", "eval")), "--num-prompts", "2", "--max-new-tokens", "10",
                       "--no-chat-template", "--backend", "cuda", "--device", "cpu", "--dtype", "fp32",
                       "--concurrency", "2", "--output-json", str(out)])
    assert code == 0
    res = json.loads(out.read_text())
    assert [t["run_order"] for t in res["tasks"]] == [["AR", "chain", "tree", "auto"], ["chain", "tree", "auto", "AR"]]
    assert res["args"]["configs"] == {
        "chain": {"verify": "chain", "tree_budget": None, "budget": None, "chain_first": None, "plan_trees": None, "plan_chains": None, "width": None, "confidence": None, "conf_slope": None, "drain": None, "state": None, "draft_vocab": None},
        "tree": {"verify": "tree", "tree_budget": 12, "budget": None, "chain_first": True, "plan_trees": None, "plan_chains": None, "width": None, "confidence": None, "conf_slope": None, "drain": None, "state": None, "draft_vocab": None},
        "auto": {"verify": "chain", "tree_budget": None, "budget": "auto", "chain_first": None, "plan_trees": [12, 6], "plan_chains": None, "width": None, "confidence": "always", "conf_slope": 0.5, "drain": "own", "state": "kv", "draft_vocab": None}}
    for t in res["tasks"]:
        d = t["drafts"]
        assert (d["chain"]["verify"], d["chain"]["verified_tokens_per_step"]) == ("chain", 8)  # the draft's block
        assert (d["tree"]["verify"], d["tree"]["verified_tokens_per_step"]) == ("tree", 12)
        assert d["tree"]["tree_chain_first"] is True and "tree_chain_first" not in d["chain"]
        assert d["auto"]["verified_tokens_per_step"] == "auto" and d["auto"]["budget"] == "auto"
        assert sum(e["steps"] for e in d["auto"]["planner_choices"].values()) > 0
        for e in d["auto"]["planner_choices"].values():  # observed steps commit 1 .. 8 tokens per request each
            assert e["observed"] <= e["steps"] and e["observed"] <= e["realized_tokens"] <= 8 * e["observed"]
            assert e["timed_steps"] <= e["observed"] and (e["timed_ms"] > 0) == (e["timed_steps"] > 0)
        assert sum(e["timed_steps"] for e in d["auto"]["planner_choices"].values()) > 0
        for lab in ("chain", "tree", "auto"):  # the loop's steps, for ms per step (planner_points.py)
            assert d[lab]["profile"]["steps"] >= 1
        assert d["auto"]["plan_drain"] == "own" and d["auto"]["plan_conf_slope"] == 0.5
        assert d["auto"]["plan_state"] == "kv" and d["chain"].get("plan_state") is None
        assert d["auto"]["planner_choices"]["chain8"]["conf_slope"] == 0.5  # reached the planner
        assert d["auto"]["plan_confidence"] == "always" and d["auto"]["plan_trees"] == [6, 12]
        # the default narrower chains (Engine.PLAN_CHAINS below the block of 8) are planner modes too
        assert d["auto"]["plan_chains"] == [2, 4]
        assert set(d["auto"]["planner_choices"]) == {"ar", "chain2", "chain4", "chain8", "tree6", "tree12"}
        assert "planner_choices" not in d["chain"] and "budget" not in d["chain"]
        for row in d.values():
            assert row["greedy_equal"] == row["greedy_compared"] == 2


@pytest.mark.parametrize("config, msg", [
    (["--config", "X:budget=auto"], "'X' is not a --draft label (labels: D)"),
    (["--config", "D"], "give LABEL:KEY=VALUE"),
    (["--config", "D:speed=fast"], "'speed=fast' is not KEY=VALUE with a key of verify, tree_budget, budget"),
    (["--config", "D:verify=graph"], "verify='graph'; expected chain or tree"),
    (["--config", "D:budget=2"], "budget='2'; expected auto or none"),
    (["--config", "D:tree_budget=8"], "tree_budget applies to verify=tree only"),
    (["--config", "D:verify=tree,tree_budget=99"], "tree_budget=99 must be in 2..64"),
    (["--config", "D:verify=tree,tree_budget=x"], "tree_budget='x' is not an integer"),
    (["--config", "D:verify=tree,tree_budget=1_6"], "tree_budget='1_6' is not an integer"),
    (["--config", "D:budget=auto,verify=tree,tree_budget=48"], "'D:budget=auto,verify=tree,tree_budget=48': tree_budget "
     "with budget=auto: the planner picks its own tree sizes (give them with --config D:plan_trees=16/32)"),
    (["--config", "D:verify=tree,tree_budget=48", "--budget", "auto"], "tree_budget with budget=auto"),
    (["--verify", "tree", "--tree-budget", "48", "--config", "D:budget=auto"], "draft 'D': --tree-budget 48 with "
     "budget=auto: the planner picks its own tree sizes (give them with --config D:plan_trees=16/32, or drop "
     "--tree-budget)"),
    (["--verify", "tree", "--tree-budget", "32", "--config", "D:budget=auto,plan_trees=16"],  # the default's value
     "draft 'D': --tree-budget 32 with budget=auto"),
    (["--config", "D:budget=auto", "--config", "D:verify=tree"], "label 'D' given twice"),
    (["--config", "D:verify=tree", "--draft-temperature", "0"], "--draft-temperature 0 with verify=tree"),
    # the planner runs no tree from a one-hot draft (Engine.planner_modes): tree sizes given for it are refused
    (["--config", "D:budget=auto,plan_trees=16", "--temperature", "1", "--draft-temperature", "0"],
     "draft 'D': plan_trees with --draft-temperature 0"),
    (["--config", "D:budget=auto", "--plan-trees", "32", "--temperature", "1", "--draft-temperature", "0"],
     "--plan-trees 32 with --draft-temperature 0"),
    (["--config", "D:budget=auto", "--backend", "reference"], "--config needs the engine"),
    (["--config", "D:verify=tree,verify=chain"], "key 'verify' given twice"),
    (["--config", "D:verify=tree,chain_first=maybe"], "chain_first='maybe'; expected auto, yes or no"),
    (["--config", "D:verify=tree,chain_first=no", "--temperature", "1"], "chain_first=no at --temperature 1.0"),
    (["--config", "D:chain_first=yes"], "chain_first applies to verify=tree or budget=auto"),
    (["--config", "D:budget=auto,plan_trees=16,32"], "'32' is not KEY=VALUE"),
    (["--config", "D:budget=auto,plan_trees=a/b"], "plan_trees='a/b'; expected tree sizes joined by '/'"),
    (["--config", "D:budget=auto,plan_trees=16/99"], "plan_trees='16/99'; each size must be in 2..64"),
    (["--config", "D:budget=auto,plan_trees=16/16"], "plan_trees='16/16'; each size must be in 2..64, none repeated"),
    (["--config", "D:plan_trees=16"], "plan_trees applies to budget=auto"),
    (["--plan-trees", "16"], "--plan-trees 16: applies to --budget auto only (no configuration has it)"),
    (["--plan-trees", "16/99", "--budget", "auto"], "--plan-trees: plan_trees='16/99'; each size must be in 2..64"),
    (["--plan-trees", "16", "--config", "D:budget=auto,plan_trees=32"], "--plan-trees 16: every budget=auto label "
     "gives its own plan_trees in --config, so it would apply to none"),
    (["--config", "D:budget=auto,confidence=maybe"], "confidence='maybe'; expected greedy, always, never"),
    (["--config", "D:confidence=never"], "confidence applies to budget=auto"),
    (["--config", "D:budget=auto,drain=tail"], "drain='tail'; expected off, scaled, own"),
    (["--config", "D:drain=own"], "drain applies to budget=auto"),
    # the drain models "relative" (H100) and "lead" (H200) were removed after their A/Bs: refused, the models named
    (["--config", "D:budget=auto,drain=relative"], "drain='relative'; expected off, scaled, own, persist, persist_cap\n"),
    (["--config", "D:budget=auto,drain=lead"], "drain='lead'; expected off, scaled, own, persist, persist_cap\n"),
    # the settle rule "estimate", the cost model "age" and the ceilings "headroom" and "lead_age" were removed after
    # their A/Bs: unknown keys now
    (["--config", "D:budget=auto,settle=estimate"], "'settle=estimate' is not KEY=VALUE with a key of verify"),
    (["--config", "D:budget=auto,ceiling=headroom"], "'ceiling=headroom' is not KEY=VALUE with a key of verify"),
    (["--config", "D:budget=auto,cost=age"], "'cost=age' is not KEY=VALUE with a key of verify"),
    (["--config", "D:budget=auto,conf_slope=steep"], "conf_slope='steep'; expected auto or a number in 0..2"),
    (["--config", "D:budget=auto,conf_slope=-0.5"], "conf_slope='-0.5'; expected auto or a number in 0..2"),
    (["--config", "D:budget=auto,conf_slope=nan"], "conf_slope='nan'; expected auto"),
    (["--config", "D:conf_slope=1"], "conf_slope applies to budget=auto"),
    (["--config", "D:budget=auto,confidence=never,conf_slope=1"], "conf_slope with confidence=never"),
    (["--config", "D:budget=auto,conf_slope=1", "--temperature", "1"], "conf_slope with confidence=greedy at --temperature 1"),
    # the reference backend names the flag too (it said "verify_size=17 must be in 2..16")
    (["--backend", "reference", "--block-size", "17", "--max-new-tokens", "32"], "--block-size 17: must be in 2..8 (draft 'D''s block size)"),
])
def test_config_errors_name_the_item(stories_dir, draft_dir, capsys, config, msg):
    argv = ["--target", str(stories_dir), "--draft", f"D={draft_dir}", "--datasets", "gsm8k", "--no-chat-template",
            "--data-dir", str(shared_path("data", "eval"))]
    if "--backend" not in config:
        argv += ["--backend", "cuda", "--device", "cpu"]
    assert bench.main(argv + config) == 2
    assert msg in capsys.readouterr().err


def test_config_none_overrides_a_run_wide_budget():
    """budget=none takes one label back to the fixed mode of a run-wide --budget auto; verify=chain drops a
    run-wide tree budget; the default tree budget (--verify tree --budget auto) is not recorded for the planner."""
    import argparse

    args = argparse.Namespace(verify="tree", tree_budget=32, budget="auto", exact=None, draft_temperature=None,
                              backend="cuda")  # as check_decode_args leaves --verify tree --budget auto
    c = bench.parse_configs(["a:budget=none,verify=chain"], {"a": "p", "b": "p"}, args, tree_budget_given=False)
    assert c == {"a": {"verify": "chain", "tree_budget": None, "budget": None, "chain_first": None, "plan_trees": None, "plan_chains": None, "width": None, "confidence": None, "conf_slope": None, "drain": None, "state": None, "draft_vocab": None},
                 "b": {"verify": "tree", "tree_budget": None, "budget": "auto", "chain_first": None, "plan_trees": None, "plan_chains": None, "width": None, "confidence": None, "conf_slope": None, "drain": None, "state": None, "draft_vocab": None}}


def test_run_wide_plan_trees_fill_the_budget_auto_labels_without_their_own():
    """--plan-trees goes to every budget=auto label that gives no plan_trees of its own; a label's own wins, and a
    fixed-mode label keeps none (it runs no planner)."""
    import argparse

    args = argparse.Namespace(verify="chain", tree_budget=None, budget=None, exact=None, draft_temperature=None,
                              backend="cuda", plan_trees="16/32/64")
    c = bench.parse_configs(["a:budget=auto", "b:budget=auto,plan_trees=none"], {"a": "p", "b": "p", "c": "p"}, args)
    assert (c["a"]["plan_trees"], c["b"]["plan_trees"], c["c"]["plan_trees"]) == ((16, 32, 64), (), None)
    assert (c["a"]["budget"], c["b"]["budget"], c["c"]["budget"]) == ("auto", "auto", None)


def test_config_budget_auto_records_no_default_tree_budget(stories_dir, draft_dir):
    """A run-wide --verify tree (default --tree-budget) and one label's budget=auto: that label ran the planner's
    trees (plan_trees), so its config records no tree budget; the other label keeps the default's."""
    args = bench.build_parser().parse_args([
        "--target", str(stories_dir), "--draft", f"C={draft_dir}", "--draft", f"P={draft_dir}", "--verify", "tree",
        "--config", "P:budget=auto", "--datasets", "gsm8k", "--no-chat-template", "--backend", "cuda", "--device",
        "cpu", "--data-dir", str(shared_path("data", "eval"))])
    bench.check_args(args)
    assert (args.configs["C"]["tree_budget"], args.configs["C"]["budget"]) == (32, None)
    assert (args.configs["P"]["tree_budget"], args.configs["P"]["budget"]) == (None, "auto")


def test_config_is_never_dropped_by_the_reference_backend(stories_dir, draft_dir, capsys, monkeypatch):
    """--backend auto without a GPU runs the reference backend, which has no per-label settings: refused, not
    run as the chain while the JSON says tree."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--target", str(stories_dir), "--draft", f"c={draft_dir}", "--draft", f"t={draft_dir}",
            "--config", "t:verify=tree", "--datasets", "gsm8k", "--no-chat-template",
            "--data-dir", str(shared_path("data", "eval"))]
    assert bench.main(argv) == 2
    assert "--config needs the engine, and this run uses the reference backend" in capsys.readouterr().err


def test_config_label_with_colon_and_block_size_for_chain_labels(stories_dir, draft_dir, tmp_path):
    """A label may hold ':' (the last ':' splits); --block-size sets the chain label's width and leaves the tree
    label alone."""
    out = tmp_path / "c.json"
    assert bench.main(["--target", str(stories_dir), "--draft", f"a:b={draft_dir}", "--draft", f"t={draft_dir}",
                       "--config", "t:verify=tree,tree_budget=6", "--config", "a:b:budget=none", "--block-size", "4",
                       "--datasets", "gsm8k", "--data-dir", str(shared_path("data", "eval")), "--num-prompts", "2",
                       "--max-new-tokens", "8", "--no-chat-template", "--backend", "cuda", "--device", "cpu",
                       "--dtype", "fp32", "--no-ar", "--output-json", str(out)]) == 0
    d = json.loads(out.read_text())["tasks"][0]["drafts"]
    assert (d["a:b"]["verify"], d["a:b"]["verified_tokens_per_step"]) == ("chain", 4)
    assert (d["t"]["verify"], d["t"]["verified_tokens_per_step"]) == ("tree", 6)
    assert len(d["a:b"]["accept_hist"]) == 4  # accept lengths 0..3 of a 4-wide chain


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_a_run_without_verify_steps_is_summarized_and_written(stories_dir, draft_dir, tmp_path, capsys, backend):
    """--max-new-tokens 1: every output ends at its prefill token, so no draft makes a verify step. The run
    used to die in summarize (None τ summed) and lose its JSON; now τ is n/a, the JSON is written, and a
    task without steps is left out of a mean that other tasks have."""
    out = tmp_path / "none.json"
    argv = ["--target", str(stories_dir), "--draft", f"chain={draft_dir}", "--datasets", "gsm8k",
            "--data-dir", str(shared_path("data", "eval")), "--num-prompts", "2", "--max-new-tokens", "1",
            "--no-chat-template", "--backend", backend, "--output-json", str(out)]
    if backend == "cuda":
        argv += ["--device", "cpu", "--dtype", "fp32", "--draft", f"tree={draft_dir}", "--config", "tree:verify=tree,tree_budget=8"]
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())
    for label, e in res["summary"].items():
        assert e["mean_tau"] is None and e["pooled_tau"] is None and e["tasks_without_steps"] == 1, label
        assert "mean_tau_ci95" not in e
        assert res["tasks"][0]["drafts"][label]["verify_steps"] == 0
        # the draft never ran: no speedup (newcomer review: a ratio of two timings of the prefill was reported)
        assert res["tasks"][0]["drafts"][label]["speedup"] is None and e["mean_speedup"] is None
    printed = capsys.readouterr().out
    assert "mean tau n/a (no verify step)" in printed and "speedup n/a (no verify step)" in printed
    assert "mean speedup" not in printed
    # one task with steps and one without: the means are the stepped task's
    rows = [{"task": "a", "drafts": {"D": {"tau": 3.0, "accept_hist": [0, 0, 1], "per_prompt_committed": [3],
                                           "per_prompt_steps": [1], "speedup": 1.5}}},
            {"task": "b", "drafts": {"D": {"tau": None, "accept_hist": [0, 0, 0], "per_prompt_committed": [0],
                                           "per_prompt_steps": [0], "speedup": None}}}]
    s = bench.summarize(rows)["D"]
    assert s["mean_tau"] == 3.0 and s["pooled_tau"] == 3.0 and s["tasks_without_steps"] == 1
    assert s["mean_speedup"] == 1.5
    assert s["mean_tau_ci95"] == [3.0, 3.0]


def test_a_plan_log_that_cannot_be_written_fails_before_the_models(stories_dir, draft_dir, tmp_path, capsys,
                                                                   monkeypatch):
    """DSPINE_PLAN_LOG naming a folder or a file in a missing folder: refused by name before any model is read
    (it used to fail after the first decode)."""
    argv = ["--target", str(stories_dir), "--draft", f"D={draft_dir}", "--datasets", "gsm8k", "--no-chat-template",
            "--data-dir", str(shared_path("data", "eval")), "--backend", "cuda", "--device", "cpu", "--budget", "auto"]
    results = tmp_path / "results.json"
    results.write_text('{"tasks": []}\n')
    for bad, msg in ((tmp_path, "a folder"), (tmp_path / "no" / "p.jsonl", "cannot create it"),
                     (results, "an existing file that is not a plan log")):
        monkeypatch.setenv("DSPINE_PLAN_LOG", str(bad))
        assert bench.main(argv) == 2
        assert f"DSPINE_PLAN_LOG={bad}: {msg}" in capsys.readouterr().err
    assert results.read_text() == '{"tasks": []}\n' and not (tmp_path / "no").exists()
    # an empty file, a plan log and a new file in an existing folder pass the check, which creates nothing
    from infer.planner import plan_log_path

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "log.jsonl").write_text('{"batch": 1, "temperature": 0.0, "log": [["ar:1"]]}\n')
    for good in ("empty.jsonl", "log.jsonl", "new.jsonl"):
        monkeypatch.setenv("DSPINE_PLAN_LOG", str(tmp_path / good))
        assert plan_log_path() == str(tmp_path / good)
    assert not (tmp_path / "new.jsonl").exists()


def test_config_checks_keys_in_one_order_whatever_the_order_given():
    """Two bad values in one --config item: the error names the same one whatever order they were typed in (the
    keys in CONFIG_KEYS order, tree_budget last), as before the parsers went into a table."""
    import argparse

    args = argparse.Namespace(verify="chain", tree_budget=None, budget=None, draft_vocab=None, plan_trees=None,
                              draft_temperature=None, invariant=False, temperature=0.0)
    for item in ("a:tree_budget=x,verify=Tree", "a:verify=Tree,tree_budget=x"):
        with pytest.raises(ValueError, match="verify='Tree'; expected chain or tree"):
            bench.parse_configs([item], {"a": "p"}, args)
    for item in ("a:drain=q,budget=z", "a:budget=z,drain=q"):
        with pytest.raises(ValueError, match="budget='z'; expected auto or none"):
            bench.parse_configs([item], {"a": "p"}, args)


def test_config_takes_every_drain_model_of_the_planner():
    """drain= takes off and each of infer.planner.DRAIN_MODELS (persist, the default, and scaled, the default before,
    included; relative, lead and persist_len, removed, not), as the label's plan_drain_model."""
    import argparse

    from infer.planner import DRAIN_MODELS

    args = argparse.Namespace(verify="chain", tree_budget=None, budget=None, exact=None, draft_temperature=None,
                              backend="cuda")
    assert bench.DRAIN == ("off", *DRAIN_MODELS) and {"persist", "scaled"} <= set(DRAIN_MODELS)  # the planner's
    assert "relative" not in bench.DRAIN and "lead" not in bench.DRAIN
    for gone in ("relative", "lead", "persist_len"):
        with pytest.raises(ValueError, match=f"drain='{gone}'; expected off, scaled, own, persist, persist_cap$"):
            bench.parse_configs([f"a:budget=auto,drain={gone}"], {"a": "p"}, args)
    for model in bench.DRAIN:
        c = bench.parse_configs([f"a:budget=auto,drain={model}"], {"a": "p"}, args)
        assert c["a"]["drain"] == model and c["a"]["budget"] == "auto"


def test_mix_runs_every_task_in_one_stream_of_mixed_batches(stories_dir, draft_dir, tmp_path):
    """--mix: one task "mixed" whose prompts are the tasks' taken in turn (every batch of 3 holds one of each), MT-Bench's
    second turns included; each prompt decodes what it decodes in its own task's run (fp32 greedy: the batch does not
    change a prompt's output), so the per-prompt counts are the per-task runs' interleaved."""
    common = ["--target", str(stories_dir), "--draft", f"A={draft_dir}", "--datasets", "gsm8k,mbpp,mt-bench",
              "--data-dir", str(shared_path("data", "eval")), "--num-prompts", "2", "--max-new-tokens", "10",
              "--no-chat-template", "--backend", "cuda", "--device", "cpu", "--dtype", "fp32", "--concurrency", "3"]
    assert bench.main([*common, "--output-json", str(tmp_path / "t.json")]) == 0
    assert bench.main([*common, "--mix", "--output-json", str(tmp_path / "m.json")]) == 0
    per_task = json.loads((tmp_path / "t.json").read_text())["tasks"]
    mixed = json.loads((tmp_path / "m.json").read_text())
    assert [t["task"] for t in mixed["tasks"]] == ["mixed"] and mixed["args"]["mix"] is True
    (m,) = mixed["tasks"]
    assert m["num_prompts"] == 6 and m["mixed_tasks"] == [t["task"] for t in per_task] * 2
    assert m["ar"]["num_tokens"] == sum(t["ar"]["num_tokens"] for t in per_task)
    a = [t["drafts"]["A"]["per_prompt_committed"] for t in per_task]
    assert m["drafts"]["A"]["per_prompt_committed"] == [a[k][i] for i in range(2) for k in range(3)]
    assert m["drafts"]["A"]["greedy_equal"] == m["drafts"]["A"]["greedy_compared"] == 8  # 6 first turns, 2 second


def test_interleave_takes_the_lists_in_turn():
    """infer.datasets.interleave (--mix): the first of each list, then the second of each, a shorter list dropping out."""
    from infer.datasets import interleave

    assert interleave([[1, 2, 3], [4], [5, 6]]) == [1, 4, 5, 2, 6, 3]
    assert interleave([]) == [] and interleave([[], [7]]) == [7]
