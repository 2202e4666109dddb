"""The README's results block is generated from results/*.json and must be up to date."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_readme_results_block_is_current():
    r = subprocess.run([sys.executable, "scripts/make_tables.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_result_file_names_its_command_and_device():
    import json

    for path in (ROOT / "results").glob("*.json"):
        d = json.loads(path.read_text())
        meta = d.get("meta", d)
        assert meta.get("command"), path
        assert meta.get("gpu") or meta.get("device"), path
        assert meta.get("date"), path


def _two_commands() -> list[str]:
    """The bash blocks of the README's "Two commands" section: the main job, then the tests."""
    import re

    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_ci_runs_the_readme_commands_in_order():
    """.ci/run runs the README's main command (core install only) and then its test command, verbatim, in one
    fresh venv."""
    main, tests = _two_commands()
    assert "pip install -e . " in main and "[" not in main.split("&&")[1]  # the core install, no extras
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert main in lines and tests in lines
    assert lines.index(main) < lines.index(tests)
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    venvs = [i for i, line in enumerate(lines) if line.startswith("python3 -m venv")]
    assert len(venvs) == 1 and venvs[0] < lines.index(main), venvs  # one fresh venv, created before the main command
    assert f"/{lines[venvs[0]].split()[-1]}/" in ignored


def test_tables_survive_results_written_without_optional_keys(tmp_path, monkeypatch):
    """make_tables renders result files as their scripts write them: bench_engine --skip-peers (no transformers
    peers), a verify-planner or continuation file without the hand-added commit_note, a combine sweep in its
    first bare-list format without BH, and a profile without the before_* blocks."""
    import json
    import shutil

    sys.path.insert(0, str(ROOT))
    from scripts import make_tables

    res = tmp_path / "results"
    shutil.copytree(ROOT / "results", res)
    e = json.loads((res / "engine-h200.json").read_text())
    for b in ("batch1", "batch8"):
        for k in ("hf_generate_tok_per_s", "compiled_hf_tok_per_s"):
            e[b].pop(k, None)
    e.pop("carried_over")
    (res / "engine-h200.json").write_text(json.dumps(e))
    for name in ("verify-planner-h200.json", "smollm2-continue4-h200.json"):
        d = json.loads((res / name).read_text())
        d.pop("commit_note")
        if "continue4" in name:  # a run that logged the T > 0 proxy at its first evaluation only
            d["train"]["evals"][0]["eval/tau_sim_sample"] = 2.5
        (res / name).write_text(json.dumps(d))
    sw = json.loads((res / "combine-sweep-h200.json").read_text())["rows"]
    sw = [x for x in sw if x.get("BH") == 64]  # the first version: the batch-8 shape only, rows without BH
    for x in sw:
        x.pop("BH", None)
    (res / "combine-sweep-h200.json").write_text(json.dumps(sw))
    p = json.loads((res / "profile-step-h200.json").read_text())
    p.pop("before_flatten"), p.pop("before_combine_rewrite"), p.pop("before_one_warp_combine")
    (res / "profile-step-h200.json").write_text(json.dumps(p))
    v = json.loads((res / "verify-h100.json").read_text())  # bench_tree.py without --planner: no points
    v.pop("planner")
    (res / "verify-h100.json").write_text(json.dumps(v))
    s = json.loads((res / "planner-switch-h100.json").read_text())  # bench_planner_loop.py without --switch
    for x in s["points"]:
        x.pop("planner_tree_over_tree"), x.pop("switch_over_mean")
    s.pop("switch_tree")
    (res / "planner-switch-h100.json").write_text(json.dumps(s))
    monkeypatch.setattr(make_tables, "RESULTS", res)
    monkeypatch.setattr(make_tables, "ROOT", tmp_path)
    text = make_tables.render()
    assert "transformers `generate`" not in text and "¹" not in text
    assert "The split-K attention combine in that profile: 2.6 µs a call (41 calls, 0.11 ms a step)." in text
    assert "(best 2.4 µs: 8 rows per program, 1 warp)" in text and "commit `?`" in text
    assert "Fourth continuation (the shipped draft)" in text
    assert "| τ_real (eval prompts) | τ_sim_sample |" in text and "| 2.97 | 2.64 | 2.50 |" in text
    assert "| 2.90 | – |" in text  # an evaluation without it
    assert "#### The planner on the NVIDIA H100 80GB HBM3 (2026-12-07)" in text  # no points: the loop file's date
    assert not any("(NVIDIA H100 80GB HBM3, 2026-12-05)" in x for x in text.splitlines())  # no goals row without points
    assert "| fast | 1 | 0.995 | 1.001 | – | – | [`planner-switch-h100.json`]" in text  # the exact file keeps its own
    assert "| exact | 1 | 0.997 | 1.003 | 0.998 | 1.001 |" in text and "one mode costs the loop at most 0.8% of a step" in text


def test_goals_at_a_glance_read_their_files(tmp_path, monkeypatch):
    """The goals table (make_tables.glance_section): each row's value is its file's, its verdict follows the
    value, and a row whose file is missing is left out."""
    import json
    import shutil

    sys.path.insert(0, str(ROOT))
    from scripts import make_tables

    res = tmp_path / "results"
    res.mkdir()
    for name in ("engine-h200.json", "verify-h200.json"):
        shutil.copy(ROOT / "results" / name, res / name)
    monkeypatch.setattr(make_tables, "RESULTS", res)
    text = "\n".join(make_tables.glance_section())
    e = json.loads((res / "engine-h200.json").read_text())
    frac = e["batch1"]["ar_fraction_of_floor"]
    row = next(x for x in text.splitlines() if "AR batch 1 ÷ the bandwidth floor" in x)
    assert f"| {frac:.4f} (" in row and row.split(" | ")[3] == ("yes" if frac >= 0.85 else "**no**")
    v = json.loads((res / "verify-h200.json").read_text())
    assert f"| {v['tree_tau_over_chain_tau']:.2f} | " in text
    good = sum(p["planner_over_best_static"] >= 0.98 for p in v["planner"])
    assert f"{good} of {len(v['planner'])} points ≥ 0.98" in text
    assert "shipped draft" not in text and "Regeneration" not in text  # their files are missing: no rows
    e["batch1"]["ar_fraction_of_floor"] = 0.86
    (res / "engine-h200.json").write_text(json.dumps(e))
    row = next(x for x in "\n".join(make_tables.glance_section()).splitlines() if "bandwidth floor" in x)
    assert "| 0.8600 (" in row and row.split(" | ")[3] == "yes"
    (res / "engine-h200.json").unlink()
    (res / "verify-h200.json").unlink()
    assert make_tables.glance_section() == []


def test_goals_row_of_another_card_takes_each_points_latest_run(empty_results):
    """The same-text planner points of a card other than the H200 (FAIR_FILES) make one goals row per mode: each
    (concurrency, T) point at the commit of its latest run, the lowest of its runs there, every file it read named,
    the verdict over those points."""
    import json

    make_tables, res = empty_results

    def pt(c, ratio, date, commit):
        return {"concurrency": c, "temperature": 1.0, "planner_over_best_static": ratio, "planner_over_ar": 1.1,
                "provenance": {"date": date, "commit": commit}}

    old = [pt(1, 0.99, "2026-12-06T23:50", "5b56be1aa"), pt(32, 0.97, "2026-12-06T23:55", "5b56be1aa")]
    new = [pt(32, 0.985, "2026-12-07T16:00", "a0f4220bb")]
    for name, pts in (("verify-refresh-invariant-h100.json", old), ("verify-persist-invariant-h100.json", new)):
        (res / name).write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "planner": pts}))
    rows = [x for x in make_tables.glance_section() if x.startswith("| Planner")]
    assert len(rows) == 1 and "concurrency 1 T = 1, concurrency 32 T = 1 (NVIDIA H100 80GB HBM3" in rows[0]
    assert "commit 5b56be1, a0f4220" in rows[0] and "| 2 of 2 points ≥ 0.98 | yes |" in rows[0]
    assert "verify-refresh-invariant-h100.json" in rows[0] and "verify-persist-invariant-h100.json" in rows[0]
    new[0]["planner_over_best_static"] = 0.975
    (res / "verify-persist-invariant-h100.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "planner": new}))
    row = next(x for x in make_tables.glance_section() if x.startswith("| Planner"))
    assert "1 of 2 points ≥ 0.98; below: 0.975 at concurrency 32, T = 1" in row and "| **no** |" in row
    again = [pt(32, 0.99, "2026-12-07T19:00", "a0f4220bb")]  # a later run at the same commit: the lowest stands
    (res / "verify-again-invariant-h100.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "planner": again}))
    row = next(x for x in make_tables.glance_section() if x.startswith("| Planner"))
    assert "below: 0.975 at concurrency 32" in row and "verify-again-invariant-h100.json" not in row
    again[0]["provenance"]["commit"] = "3bfb1d4cc"  # at a later commit: that run alone
    (res / "verify-again-invariant-h100.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "planner": again}))
    row = next(x for x in make_tables.glance_section() if x.startswith("| Planner"))
    assert "2 of 2 points ≥ 0.98" in row and "verify-again-invariant-h100.json" in row
    assert "planner state" not in row  # every point at the engine's defaults
    again[0]["plan_state"] = "kv"  # a point run with bench_tree.py --plan-state: the row says so
    (res / "verify-again-invariant-h100.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "planner": again}))
    row = next(x for x in make_tables.glance_section() if x.startswith("| Planner"))
    assert "no tree; planner state kv at concurrency 32 T = 1)" in row


def test_planner_table_names_the_seeds_of_a_point():
    """A bench_tree.py --seeds point (tok/s the means over several sampling seeds) says so in its T column; a point of
    one run (no seeds key: files from before --seeds, or [0]) shows the temperature alone."""
    import json

    sys.path.insert(0, str(ROOT))
    from scripts import make_tables

    v = json.loads((ROOT / "results" / "verify-h100.json").read_text())
    one, many = dict(v["planner"][-1]), {**v["planner"][-1], "seeds": [0, 1, 2]}
    one.pop("seeds", None)
    rows = make_tables._planner_points_table([one, many, {**one, "seeds": [0]}])[2:]
    t = f"{one['temperature']:g}"
    assert [r.split(" | ")[1] for r in rows] == [t, f"{t} (3 seeds)", t]
    assert all(f"| {one['planner_over_best_static']:.3f} — " in r for r in rows)


@pytest.fixture
def empty_results(tmp_path, monkeypatch):
    """scripts.make_tables reading an empty results folder under tmp_path: (the module, the folder)."""
    sys.path.insert(0, str(ROOT))
    from scripts import make_tables

    res = tmp_path / "results"
    res.mkdir()
    monkeypatch.setattr(make_tables, "RESULTS", res)
    return make_tables, res


def test_a_results_file_that_is_not_json_is_named(empty_results):
    make_tables, res = empty_results
    (res / "verify-h200.json").write_text('{"planner": [')
    with pytest.raises(SystemExit, match=r"verify-h200\.json: not valid JSON"):
        make_tables.load("verify-h200.json")


def test_persist_section_pools_the_tasks(empty_results):
    """make_tables.planner_persist_section: a run's tok/s is its tasks' tokens over their seconds (not the mean of
    the tasks' tok/s), each label ÷ the chain of 4 of the same run, a mean row per concurrency over its runs; a
    missing run is left out and no file gives no section."""
    import json

    make_tables, res = empty_results
    assert make_tables.planner_persist_section() == []

    def task(chain4_s, p_s, pp_s):  # 1,000 tokens per label per task
        d = lambda s: {"num_tokens": 1000, "seconds": s}  # noqa: E731
        return {"task": "t", "ar": d(1.0), "drafts": {"chain": d(2.0), "chain4": d(chain4_s), "p": d(p_s),
                                                       "pp": d(pp_s)}}

    run = {"command": "python -m infer.bench X", "commit": "abcdef1234", "tasks": [task(0.5, 0.5, 0.5),
                                                                                   task(0.5, 1.5, 0.5)]}
    (res / "planner-persist-h100-exact-T0-c64.json").write_text(json.dumps(run))
    run2 = {**run, "tasks": [task(0.5, 0.5, 1.0), task(0.5, 0.5, 1.0)]}
    (res / "planner-persist-h100-exact-T0-c64-rep3.json").write_text(json.dumps(run2))
    rows = [r for r in make_tables.planner_persist_section() if r.startswith("| 64 |")]
    # run 1: p 2000 tokens in 2.0 s = 1000 tok/s against chain 4's 2000 in 1.0 s: 0.500 (a mean of the tasks'
    # ratios would read 0.667); pp 1.000. Run 3 (rep2 missing): p 1.000, pp 0.500. Means 0.750 and 0.750.
    assert rows[0].split(" | ")[1:9] == ["1", "1000", "500", "2000", "1000", "2000", "0.500", "1.000"]
    assert rows[1].split(" | ")[1] == "3" and rows[1].split(" | ")[7:9] == ["1.000", "0.500"]
    assert rows[2].startswith("| 64 | mean of 2 |") and "| 0.750 | 0.750 |" in rows[2]
    assert "`abcdef1`" in rows[0] and len(rows) == 3
    # a run cut short, or one whose task lacks a label, is left out
    (res / "planner-persist-h100-exact-T0-c64-rep2.json").write_text(json.dumps({**run, "interrupted": True}))
    short = {**run, "tasks": [run["tasks"][0], {**run["tasks"][1], "drafts": {"chain4": run["tasks"][1]["drafts"]["chain4"]}}]}
    (res / "planner-persist-h100-exact-T0-c32.json").write_text(json.dumps(short))
    assert [r for r in make_tables.planner_persist_section() if r.startswith("| ")][1:] == rows


def test_cost_section_pools_the_tasks_and_names_the_task_that_loses(empty_results):
    """make_tables.planner_cost_section: tasks pooled as in the persist section, p and pc ÷ the chain of 4 per run and
    as a mean, and per concurrency p ÷ the chain of 4 per task over the runs with the lowest task's share of the
    tokens and of p's seconds over the chain of 4's rate."""
    import json

    make_tables, res = empty_results
    assert make_tables.planner_cost_section() == []

    def task(name, tokens, c4_s, p_s):
        d = lambda s: {"num_tokens": tokens, "seconds": s}  # noqa: E731
        return {"task": name, "ar": d(4.0), "drafts": {"chain": d(2.0), "chain4": d(c4_s), "p": d(p_s), "pc": d(c4_s)}}

    # run 1: task a as fast as the chain of 4, task b (3,000 of the 4,000 tokens) 1.5 s over its 1.0 s
    run = {"command": "python -m infer.bench X", "commit": "abcdef1234",
           "tasks": [task("a", 1000, 0.5, 0.5), task("b", 3000, 1.0, 2.5)]}
    (res / "planner-cost-h100-exact-T0-c64.json").write_text(json.dumps(run))
    # run 2: 0.1 s over on a, 0.3 s over on b
    run2 = {**run, "tasks": [task("a", 1000, 0.5, 0.6), task("b", 3000, 1.0, 1.3)]}
    (res / "planner-cost-r2-h100-exact-T0-c64.json").write_text(json.dumps(run2))
    text = make_tables.planner_cost_section()
    rows = [r for r in text if r.startswith("| 64 |")]
    # run 1: p 4000 tokens in 3.0 s against the chain of 4's 4000 in 1.5 s: 0.500; pc 1.000
    assert rows[0].split(" | ")[1:9] == ["1", "500", "1000", "2667", "1333", "2667", "0.500", "1.000"]
    assert rows[1].split(" | ")[7:9] == ["0.789", "1.000"]  # 1.5 s ÷ 1.9 s
    assert rows[2].startswith("| 64 | mean of 2 |") and "| 0.645 | 1.000 |" in rows[2] and len(rows) == 3
    line = next(x for x in text if x.startswith("Concurrency 64,"))
    assert "a 0.833-1.000, b 0.400-0.769" in line  # per task over the two runs
    assert "On b p ran 1,200-2,308 tok/s against the chain of 4's 3,000" in line
    assert "b holds 3,000 of the 4,000 tokens and 75-100% of the time p lost to the chain of 4" in line
    assert not any(x.startswith("Concurrency 32,") for x in text)  # no file at 32


def test_est_section_compares_three_planners_and_the_c1_tree(empty_results):
    """make_tables.planner_est_section: at concurrency 64 p, pp and pr ÷ the chain of 4 per run (tasks pooled) and as a
    mean; at concurrency 1 p ÷ the fixed tree of 32 pooled and on its lowest task; either half alone makes a section."""
    import json

    make_tables, res = empty_results
    assert make_tables.planner_est_section() == []
    d = lambda tokens, s: {"num_tokens": tokens, "seconds": s}  # noqa: E731
    c1 = {"command": "python -m infer.bench C1", "commit": "1234567abc", "tasks": [
        {"task": "a", "ar": d(100, 2.0), "drafts": {"chain": d(100, 1.0), "tree32": d(100, 0.5), "p": d(100, 0.5)}},
        {"task": "b", "ar": d(300, 6.0), "drafts": {"chain": d(300, 3.0), "tree32": d(300, 1.0), "p": d(300, 1.25)}}]}
    (res / "planner-est-h100-exact-T0-c1.json").write_text(json.dumps(c1))
    text = make_tables.planner_est_section()
    row = next(r for r in text if r.startswith("| 1 |"))
    # p 400 tokens in 1.75 s against the tree's 400 in 1.5 s: 0.857; its lowest task b, 1.0 ÷ 1.25 = 0.800
    assert row.split(" | ")[1:8] == ["1", "50", "100", "267", "229", "0.857", "b 0.800"]
    assert not any(r.startswith("| 64 |") for r in text) and "`python -m infer.bench C1`" in text[-2]

    def task(name, c4_s, p_s, pp_s, pr_s):
        return {"task": name, "ar": d(1000, 4.0), "drafts": {"chain": d(1000, 2.0), "chain4": d(1000, c4_s),
                                                             "p": d(1000, p_s), "pp": d(1000, pp_s), "pr": d(1000, pr_s)}}

    run = {"command": "python -m infer.bench C64", "commit": "abcdef1234",
           "tasks": [task("a", 0.5, 0.5, 0.5, 0.5), task("mt", 0.5, 1.5, 1.0, 0.5)]}
    (res / "planner-est-h100-exact-T0-c64.json").write_text(json.dumps(run))
    (res / "planner-est-r2-h100-exact-T0-c64.json").write_text(json.dumps(
        {**run, "tasks": [task("a", 0.5, 0.5, 0.5, 0.5), task("mt", 0.5, 0.5, 0.5, 1.5)]}))
    text = make_tables.planner_est_section()
    rows = [r for r in text if r.startswith("| 64 |")]
    # run 1: chain 4 2000 tokens in 1.0 s; p in 2.0 s (0.500), pp in 1.5 s (0.667), pr in 1.0 s (1.000)
    assert rows[0].split(" | ")[1:11] == ["1", "250", "500", "2000", "1000", "1333", "2000", "0.500", "0.667", "1.000"]
    assert rows[0].endswith("`abcdef1` |")
    assert rows[1].split(" | ")[8:11] == ["1.000", "1.000", "0.500"]
    assert rows[2].startswith("| 64 | mean of 2 |") and "| 0.750 | 0.833 | 0.750 | |" in rows[2] and len(rows) == 3
    assert any(x.startswith("Concurrency 64, pr ÷ chain 4 per task over the 2 runs: a 1.000, mt 0.333-1.000") for x in text)


def test_drain_model_replay_section_groups_points_by_step_times_and_model(empty_results):
    """make_tables.drain_model_replay_section: one row per (step-time source, drain model) with each cost file's
    planner ÷ best fixed, their mean and mt-bench's planner ÷ best fixed range; no file gives no section."""
    import json

    make_tables, res = empty_results
    assert make_tables.drain_model_replay_section() == []

    def point(times, model, ratio, mt):
        return {"times": times, "drain_model": model, "best_fixed": "chain4", "planner_over_best_fixed": ratio,
                "per_task_tok_per_s": {"gsm8k": {"planner": 1.0, "chain4": 1.0},
                                       "mt-bench": {"planner": mt, "chain4": 1.0}}}

    pts = [point("measured", "scaled", 0.97, 0.9), point("measured", "scaled", 0.99, 0.95),
           point("measured", "relative", 0.99, 1.0)]
    (res / "replay-drain-c64-cpu.json").write_text(json.dumps({"command": "python replay X", "points": pts}))
    text = make_tables.drain_model_replay_section()
    rows = [r for r in text if r.startswith("| 64 |")]
    link = "[`replay-drain-c64-cpu.json`](results/replay-drain-c64-cpu.json) |"
    assert rows == ["| 64 | one task | measured | scaled | 0.970 / 0.990 | 0.980 | 0.900-0.950 | " + link,
                    "| 64 | one task | measured | relative | 0.990 | 0.990 | 1.000 | " + link]
    assert any("(chain4)" in x for x in text) and text[-2] == "Commands: `python replay X`"
    mixed = [{**point("measured", "persist", 0.995, 0), "mix": True, "per_task_tok_per_s": {"mixed": {}}}]
    (res / "replay-persist-c64-mix-cpu.json").write_text(json.dumps({"command": "python replay M", "points": mixed}))
    rows = [r for r in make_tables.drain_model_replay_section() if r.startswith("| 64 |")]
    assert rows[-1] == ("| 64 | mixed | measured | persist | 0.995 | 0.995 | – | "
                        "[`replay-persist-c64-mix-cpu.json`](results/replay-persist-c64-mix-cpu.json) |")
