"""scripts/smollm2/compare_arms.py: the paired DSpine-vs-DFlash difference of mean τ per seed."""

from __future__ import annotations

import json

import pytest

from scripts.smollm2 import compare_arms


def _bench(path, drafts: dict[str, list[tuple[list[int], list[int]]]], tasks=("gsm8k", "mbpp")):
    """A minimal infer.bench file: drafts[label][task index] = (per-prompt committed, per-prompt steps)."""
    rec = {"command": "x", "commit": "abc", "gpu": "NVIDIA H200",
           "args": {"temperature": 0.0, "concurrency": 8, "num_prompts": 3, "max_new_tokens": 64},
           "tasks": [{"task": t, "drafts": {lab: {"per_prompt_committed": rows[i][0], "per_prompt_steps": rows[i][1]}
                                            for lab, rows in drafts.items()}} for i, t in enumerate(tasks)]}
    path.write_text(json.dumps(rec))
    return path


def test_a_constant_ratio_is_exact_and_its_interval_collapses(tmp_path):
    fl = [([20, 30, 10], [10, 10, 5]), ([8, 12, 40], [4, 6, 10])]
    sp = [([22, 33, 11], s) for (c, s) in fl[:1]] + [([8.8, 13.2, 44.0], fl[1][1])]
    r = compare_arms.compare(_bench(tmp_path / "b.json", {"DSpine": sp, "DFlash": fl}))
    e = r["seeds"]["0"]
    assert e["labels"] == ["DSpine", "DFlash"]
    # DFlash: task τ = 60/25 = 2.4 and 60/20 = 3.0 -> mean 2.7; DSpine 1.1x of each
    assert e["dflash_mean_tau"] == pytest.approx(2.7) and e["dspine_mean_tau"] == pytest.approx(2.97)
    assert e["rel"] == pytest.approx(0.1) and e["rel_ci95"] == pytest.approx([0.1, 0.1])
    assert e["goal_met"] and e["interval_excludes_zero"] and "all_seeds" not in r
    assert (r["temperature"], r["concurrency"], r["bench_commit"]) == (0.0, 8, "abc")


def test_two_seeds_and_their_average(tmp_path):
    base = [([20, 30, 10], [10, 10, 5]), ([8, 12, 40], [4, 6, 10])]
    same = lambda f: [([f * x for x in c], s) for c, s in base]
    r = compare_arms.compare(_bench(tmp_path / "b.json", {"DSpine": same(1.0), "DFlash": base,
                                                          "DSpine-s1": same(0.9), "DFlash-s1": base}))
    assert set(r["seeds"]) == {"0", "1"} and r["seeds"]["1"]["labels"] == ["DSpine-s1", "DFlash-s1"]
    assert r["seeds"]["0"]["rel"] == pytest.approx(0.0) and not r["seeds"]["0"]["interval_excludes_zero"]
    assert r["seeds"]["1"]["rel"] == pytest.approx(-0.1) and r["seeds"]["1"]["interval_excludes_zero"]
    assert r["all_seeds"]["rel"] == pytest.approx(-0.05) and not r["all_seeds"]["goal_met"]
    assert r["all_seeds"]["dspine_mean_tau"] == pytest.approx(2.7 * 0.95)


def test_the_paired_interval_is_narrower_than_the_arms_spread(tmp_path):
    """Prompts differ a lot (τ 1.5 to 6) but DSpine is 2% above DFlash on each: the paired interval stays
    near +2% and excludes 0, while each arm's own mean would move by far more under resampling."""
    steps = [10] * 12
    fl = [[15, 60, 20, 55, 18, 40, 16, 58, 22, 35, 30, 45]]
    sp = [[round(1.02 * c, 6) for c in fl[0]]]
    r = compare_arms.compare(_bench(tmp_path / "b.json", {"DSpine": [(sp[0], steps)], "DFlash": [(fl[0], steps)]},
                                    tasks=("gsm8k",)))
    lo, hi = r["seeds"]["0"]["rel_ci95"]
    assert 0.0199 < lo <= hi < 0.0201


def test_refusals_name_the_file_and_field(tmp_path):
    fl = [([20, 30], [10, 10])]
    with pytest.raises(SystemExit, match=r"b1.json: no DSpine / DFlash pair"):
        compare_arms.compare(_bench(tmp_path / "b1.json", {"DSpine": fl, "Other": fl}, tasks=("gsm8k",)))
    with pytest.raises(SystemExit, match=r"b2.json: task gsm8k: the drafts .* different prompt counts \[2, 3\]"):
        compare_arms.compare(_bench(tmp_path / "b2.json", {"DSpine": fl, "DFlash": [([1, 2, 3], [1, 1, 1])]},
                                    tasks=("gsm8k",)))
    p = _bench(tmp_path / "b3.json", {"DSpine": fl, "DFlash": fl}, tasks=("gsm8k",))
    rec = json.loads(p.read_text())
    del rec["tasks"][0]["drafts"]["DFlash"]["per_prompt_steps"]
    p.write_text(json.dumps(rec))
    with pytest.raises(SystemExit, match=r"b3.json: task gsm8k, draft DFlash: no per_prompt_committed"):
        compare_arms.compare(p)
    out = tmp_path / "out.json"
    out.write_text("{}")
    good = _bench(tmp_path / "b4.json", {"DSpine": fl, "DFlash": fl}, tasks=("gsm8k",))
    with pytest.raises(SystemExit):
        compare_arms.main(["--bench", str(good), "--output", str(out)])
    assert out.read_text() == "{}"
    with pytest.raises(SystemExit):
        compare_arms.main(["--bench", str(tmp_path / "missing.json")])
    for name, text in (("notjson.json", "tau 2.1"), ("list.json", "[1, 2]"), ("empty.json", "{}"),
                       ("other.json", json.dumps({"batches": [1], "batch1": {}})),
                       ("bad-task.json", json.dumps({"tasks": [{"task": "gsm8k"}]}))):
        (tmp_path / name).write_text(text)
        what = "not JSON" if name == "notjson.json" else "no 'tasks' list of objects with 'drafts'"
        with pytest.raises(SystemExit, match=rf"{name}: {what}"):
            compare_arms.compare(tmp_path / name)


def test_main_writes_provenance_and_every_file(tmp_path, capsys):
    fl = [([20, 30], [10, 10])]
    files = [str(_bench(tmp_path / f"b{k}.json", {"DSpine": fl, "DFlash": fl}, tasks=("gsm8k",))) for k in (1, 2)]
    out = tmp_path / "res" / "arms.json"
    assert compare_arms.main(["--bench", *files, "--output", str(out), "--resamples", "200"]) == 0
    rec = json.loads(out.read_text())
    assert rec["command"] and rec["date"] and rec["goal_rel"] == 0.05
    assert [c["bench"] for c in rec["comparisons"]] == files
    assert capsys.readouterr().out.count("seed 0: DSpine 2.500 vs DFlash 2.500: +0.0%") == 2


def test_injection_variants_pair_with_the_dflash_of_their_seed(tmp_path, capsys):
    """DSpine-kv / DSpine-kv-s1 (recipe.sh VARIANTS) are compared with DFlash / DFlash-s1 under variants.kv; the
    plain pairs keep their place and their numbers; a label like DSpine-s1 is a seed, never a variant."""
    base = [([20, 30, 10], [10, 10, 5]), ([8, 12, 40], [4, 6, 10])]
    scaled = lambda f: [([f * x for x in c], st) for c, st in base]
    drafts = {"DSpine": scaled(1.0), "DFlash": base, "DSpine-s1": scaled(0.9), "DFlash-s1": base,
              "DSpine-kv": scaled(1.2), "DSpine-kv-s1": scaled(1.1)}
    path = _bench(tmp_path / "v.json", drafts)
    r = compare_arms.compare(path)
    plain = compare_arms.compare(_bench(tmp_path / "p.json", {k: v for k, v in drafts.items() if "kv" not in k}))
    assert r["seeds"] == plain["seeds"] and r["all_seeds"] == plain["all_seeds"]
    kv = r["variants"]["kv"]
    assert kv["seeds"]["0"]["labels"] == ["DSpine-kv", "DFlash"] and kv["seeds"]["1"]["labels"] == ["DSpine-kv-s1", "DFlash-s1"]
    assert kv["seeds"]["0"]["rel"] == pytest.approx(0.2) and kv["seeds"]["1"]["rel"] == pytest.approx(0.1)
    assert kv["all_seeds"]["rel"] == pytest.approx(0.15) and kv["all_seeds"]["rel_ci95"] == pytest.approx([0.15, 0.15])
    only = compare_arms.compare(_bench(tmp_path / "o.json", {"DSpine-r0": scaled(0.5), "DFlash": base}))
    assert only["seeds"] == {} and only["variants"]["r0"]["seeds"]["0"]["rel"] == pytest.approx(-0.5)
    compare_arms.main(["--bench", str(path)])
    out = capsys.readouterr().out
    assert "seed all: DSpine-kv 3.105 vs DFlash 2.700: +15.0% [+15.0, +15.0]" in out
