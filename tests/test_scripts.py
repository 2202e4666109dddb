"""Shell scripts find the shared assets where the Python code does: $DSPINE_SHARED."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPTS = sorted(p for p in (REPO / "scripts").rglob("*.sh") if "SHARED" in p.read_text())


@pytest.fixture(scope="module")
def fail_fast_path(tmp_path_factory) -> str:
    """PATH for recipe.sh in which the queued runs (``accelerate launch ... train/distill.py``, ``python -m
    infer.bench``, ``python -m data.regenerate``) fail at once, as the real ones fail in these tests (no target
    here), without each starting torch first; every other ``python`` (the stages' helpers, data.pack) is this
    interpreter. The tests check the queue files and the exit status, which do not depend on why a run fails."""
    bin_dir = tmp_path_factory.mktemp("fail-fast-bin")
    (bin_dir / "accelerate").write_text("#!/bin/sh\necho 'accelerate: stub, the run fails (no target)' >&2\nexit 1\n")
    (bin_dir / "python").write_text(f'#!/bin/sh\ncase "$1 $2" in "-m infer.bench"|"-m data.regenerate") '
                                    f"echo 'stub: the run fails (no target)' >&2; exit 1;; esac\n"
                                    f'exec {sys.executable} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_read_dspine_shared(script):
    line = next(x for x in script.read_text().splitlines() if re.match(r"SHARED=", x))
    resolve = lambda env: subprocess.run(["bash", "-c", f"{line}\necho $SHARED"], capture_output=True, text=True,
                                         env={"PATH": "/usr/bin:/bin", **env}).stdout.strip()
    assert resolve({"DSPINE_SHARED": "/x/shared"}) == "/x/shared"
    assert resolve({"SHARED": "/y"}) == "/y" and resolve({}) == "../shared"
    assert "DSPINE_SHARED=" in script.read_text().split("set -euo pipefail")[0]  # the usage line names it


def test_one_cache_refuses_none_and_several_finished_caches(tmp_path):
    """recipe.sh / ab_loss.sh pick the tokenize cache with one_cache.sh: dot (temp) folders and folders without
    summary.json are not caches; none or several finished ones are refused by name."""
    pick = lambda: subprocess.run(["bash", str(REPO / "scripts/smollm2/one_cache.sh"), str(tmp_path)],
                                  capture_output=True, text=True)
    (tmp_path / ".aaaa.tmp-12").mkdir()  # a build in progress
    (tmp_path / ".aaaa.tmp-12" / "summary.json").write_text("{}")
    (tmp_path / "bbbb").mkdir()  # a killed build of the old, non-dot temp name: no summary.json
    r = pick()
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (f"error: no finished data.tokenize cache (a folder with summary.json) in {tmp_path}; "
                        "run the tokenize or unpack stage\n")
    (tmp_path / "cccc").mkdir()
    (tmp_path / "cccc" / "summary.json").write_text("{}")
    r = pick()
    assert (r.returncode, r.stdout, r.stderr) == (0, f"{tmp_path}/cccc\n", "")
    (tmp_path / "dddd").mkdir()
    (tmp_path / "dddd" / "summary.json").write_text("{}")
    r = pick()
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (f"error: 2 finished data.tokenize caches in {tmp_path} ({tmp_path}/cccc {tmp_path}/dddd); "
                        "which one to use is ambiguous: delete the ones not wanted\n")


def test_all_caches_joins_the_finished_caches_in_name_order(tmp_path):
    """one_cache.sh --all (recipe.sh TRAIN_CACHES=all): every finished cache of DIR, sorted by folder name and
    joined by commas (the trainer's train=a,b list); temp folders, unfinished and 0-sequence caches skipped."""
    pick = lambda d: subprocess.run(["bash", str(REPO / "scripts/smollm2/one_cache.sh"), "--all", str(d)],
                                    capture_output=True, text=True)
    (tmp_path / ".aaaa.tmp-12").mkdir()
    (tmp_path / ".aaaa.tmp-12" / "summary.json").write_text("{}")
    (tmp_path / "bbbb").mkdir()  # no summary.json
    r = pick(tmp_path)
    assert r.returncode == 1 and r.stdout == "" and r.stderr.startswith(f"error: no finished data.tokenize cache "
                                                                        f"(a folder with summary.json) in {tmp_path}")
    for name, n in (("f0", 4), ("Zz", 2), ("c1", 0), ("a9", 3)):  # created out of order; C collation: Z < a
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"sequences": n, "tokens": 7 * n}, indent=1))
    r = pick(tmp_path)
    assert (r.returncode, r.stdout) == (0, f"{tmp_path}/Zz,{tmp_path}/a9,{tmp_path}/f0\n")
    assert r.stderr == f"note: {tmp_path}/c1 holds 0 sequences; skipped\n"
    comma = tmp_path / "x,y"
    (comma / "k").mkdir(parents=True)
    (comma / "k" / "summary.json").write_text("{}")
    r = pick(comma)
    assert r.returncode == 1 and "holds a comma, which separates the trainer's train= list" in r.stderr
    r = subprocess.run(["bash", str(REPO / "scripts/smollm2/one_cache.sh"), str(tmp_path), "--all"],
                       capture_output=True, text=True)  # --all after DIR: refused, not ignored
    assert r.returncode == 2 and r.stdout == "" and "unexpected arguments after DIR: --all" in r.stderr


def test_recipe_unpacks_several_packs_and_trains_on_all_caches(tmp_path, fail_fast_path):
    """PACK_DIR="p1 p2": unpack imports both train caches and p1's eval cache; a second unpack skips every
    pack whose cache is there (by pack.json's cache_name) and imports a newly listed one; the train stage
    passes train=<every cache, name order> with TRAIN_CACHES=all and refuses several with the default."""
    from data.pack import export
    from tests.test_data_pack import _cache, _rows

    w = tmp_path / "w"
    packs = []
    for k in (1, 2, 3):
        p = tmp_path / f"p{k}"
        export(_cache(tmp_path / "src" / f"tr{k}", _rows(300, n=8, seed=k), name=f"train{k}"), p / "tok-train")
        export(_cache(tmp_path / "src" / f"ev{k}", _rows(300, n=4, seed=10 + k), name=f"eval{k}"), p / "tok-eval")
        packs.append(p)
    env = {**os.environ, "PATH": fail_fast_path, "WORK": str(w),
           "NGPU": "1", "PACK_DIR": f"{packs[0]}  {packs[1]}"}
    recipe = lambda *stages, **extra: subprocess.run(["bash", str(REPO / "scripts/smollm2/recipe.sh"), *stages],
                                                     env={**env, **extra}, capture_output=True, text=True, cwd=REPO)
    r = recipe("unpack")
    assert r.returncode == 0, r.stderr
    listing = lambda split: sorted(p.name for p in (w / f"tok-{split}").iterdir())
    assert listing("train") == ["train1", "train2"] and listing("eval") == ["eval1"]
    mtime = (w / "tok-train" / "train1" / "data.arrow").stat().st_mtime_ns
    r = recipe("unpack", PACK_DIR=" ".join(map(str, packs)))
    assert r.returncode == 0, r.stderr
    assert f"{w}/tok-train/train1 exists; {packs[0]}/tok-train not unpacked" in r.stdout
    assert f"{w}/tok-eval holds a cache; not unpacked" in r.stdout
    assert listing("train") == ["train1", "train2", "train3"] and listing("eval") == ["eval1"]
    assert (w / "tok-train" / "train1" / "data.arrow").stat().st_mtime_ns == mtime
    r = recipe("unpack", PACK_DIR=str(tmp_path / "nowhere"))
    assert r.returncode == 1 and f"error: PACK_DIR: {tmp_path}/nowhere/tok-train/pack.json not found" in r.stderr

    r = recipe("train", RECIPE_ALLOW_CPU="1", ARMS="dspine")  # TRAIN_CACHES=one: three caches are ambiguous
    assert r.returncode == 1 and "3 finished data.tokenize caches" in r.stderr and not (w / "train.gpu0").exists()
    r = recipe("train", RECIPE_ALLOW_CPU="1", ARMS="dspine", TRAIN_CACHES="all")
    assert r.returncode != 0  # no target here: the run itself fails, its queue file stays
    queue = (w / "train.gpu0").read_text()
    assert f" train={w}/tok-train/train1,{w}/tok-train/train2,{w}/tok-train/train3 eval={w}/tok-eval/eval1 " in queue
    # two seeds of both arms, TRAIN_PAR=2: two queues side by side on the one GPU, two runs each, in order
    r = recipe("train", RECIPE_ALLOW_CPU="1", TRAIN_CACHES="all", SEEDS="0 1", TRAIN_PAR="2")
    assert r.returncode != 0
    runs = lambda q: [line.split("output_dir=")[1].split()[0].rsplit("/", 1)[1]
                      for line in (w / f"train.gpu{q}").read_text().splitlines()]
    assert runs(0) == ["train-dspine-s0", "train-dspine-s1"] and runs(1) == ["train-dflash-s0", "train-dflash-s1"]
    assert not (w / "train.gpu2").exists()


def test_recipe_refuses_bad_knobs_and_summary_keeps_results(tmp_path, capsys):
    """recipe.sh refuses unknown stages, ARMS and REGEN_PAR values before any work (exit 2, one error line);
    one_cache.sh skips a cache with 0 sequences; summarize refuses an empty work folder and never replaces an
    existing results file without --overwrite."""
    env = {**os.environ, "WORK": str(tmp_path / "w"), "RECIPE_ALLOW_CPU": "1"}
    for extra, stage, msg in (({}, "tokenise", "error: unknown stage 'tokenise'"),
                              ({"ARMS": "bogus"}, "data", "error: ARMS='bogus': unknown draft 'bogus'"),
                              ({"ARMS": "  "}, "data", "error: ARMS is empty"),
                              ({"REGEN_PAR": "0"}, "regen", "error: REGEN_PAR='0': must be an integer >= 1"),
                              ({"REGEN_PAR": "x"}, "regen", "error: REGEN_PAR='x': must be an integer >= 1"),
                              ({"SAMPLE_SEED0": "-1"}, "regen", "error: SAMPLE_SEED0='-1': must be an integer >= 0"),
                              ({"SAMPLE_SEED0": "08"}, "regen", "error: SAMPLE_SEED0='08': must be an integer >= 0"),
                              ({"SAMPLE_SEED0": "9223372036854775807"}, "regen", "error: SAMPLE_SEED0='9223372036854775807'"),
                              ({"SAMPLES": "010"}, "regen", "error: SAMPLES='010': must be an integer from 0 to 999"),
                              ({"REGEN_PAR": "04"}, "regen", "error: REGEN_PAR='04': must be an integer >= 1"),
                              ({"TRAIN_PAR": "0"}, "train", "error: TRAIN_PAR='0': must be an integer >= 1"),
                              ({"SEEDS": "0 x"}, "train", "error: SEEDS='0 x': 'x' is not an integer >= 0"),
                              ({"SEEDS": "  "}, "train", "error: SEEDS is empty"),
                              ({"GREEDY": "2"}, "regen", "error: GREEDY='2': must be 0 or 1"),
                              ({"GREEDY": "0", "SAMPLES": "0"}, "regen", "error: GREEDY=0 and SAMPLES=0"),
                              ({"TRAIN_CACHES": "bad"}, "unpack", "error: TRAIN_CACHES='bad': must be one (the single "
                                                                  "cache in $WORK/tok-train) or all"),
                              ({"VARIANTS": "kv"}, "train", "error: VARIANTS='kv': 'kv' is not NAME:key=value"),
                              ({"VARIANTS": "s1:injection=kv"}, "train", "error: VARIANTS='s1:injection=kv'"),
                              ({"VARIANTS": "KV:injection=kv"}, "train", "error: VARIANTS='KV:injection=kv'"),
                              ({"VARIANTS": "kv:injection=kv+"}, "train", "error: VARIANTS='kv:injection=kv+'")):
        r = subprocess.run(["bash", str(REPO / "scripts/smollm2/recipe.sh"), stage], env={**env, **extra, "NGPU": "1"},
                           capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr.startswith(msg), (extra, stage, r.stderr)
    caches = tmp_path / "tok"
    for name, n in (("a", 0), ("b", 5)):
        (caches / name).mkdir(parents=True)
        (caches / name / "summary.json").write_text(json.dumps({"sequences": n, "tokens": 7 * n}, indent=1))
    r = subprocess.run(["bash", str(REPO / "scripts/smollm2/one_cache.sh"), str(caches)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == f"{caches / 'b'}\n" and "holds 0 sequences; skipped" in r.stderr
    from scripts.smollm2.summarize import main as summarize  # in this process: no torch start per call

    summ = ["--work", str(tmp_path / "empty"), "--out", str(tmp_path / "res")]
    capsys.readouterr()
    assert summarize(summ) == 2
    assert "holds no recipe run" in capsys.readouterr().err and not (tmp_path / "res").exists()
    work = tmp_path / "empty"
    (work / "train-dspine-s0").mkdir(parents=True)
    (work / "timings.jsonl").write_text(json.dumps({"stage": "train", "seconds": 1.0, "rc": 0}) + "\n")
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "smollm2-recipe-h200.json").write_text("{}")
    assert summarize(summ) == 2
    assert "summarize does not replace results" in capsys.readouterr().err
    assert (tmp_path / "res" / "smollm2-recipe-h200.json").read_text() == "{}"


def test_recipe_benches_every_seed_of_both_arms(tmp_path, fail_fast_path):
    """SEEDS="0 3": the bench stage puts both seeds' latest drafts of both arms into one infer.bench run per
    setting, seed 0 under the plain labels and seed 3 under DSpine-s3 / DFlash-s3."""
    w = tmp_path / "w"
    for name in ("dspine", "dflash"):
        for seed, step in ((0, 16), (3, 24)):
            (w / f"train-{name}-s{seed}" / f"step-{step}" / "draft").mkdir(parents=True)
            (w / f"train-{name}-s{seed}" / "latest").write_text(f"step-{step}\n")
    env = {**os.environ, "PATH": fail_fast_path, "WORK": str(w), "RECIPE_ALLOW_CPU": "1", "NGPU": "1", "SEEDS": "0 3"}
    r = subprocess.run(["bash", str(REPO / "scripts/smollm2/recipe.sh"), "bench"], env=env, capture_output=True, text=True)
    assert r.returncode != 0  # no target here: the bench runs fail, their queue file stays
    lines = (w / "bench.gpu0").read_text().splitlines()
    assert len(lines) == 4  # T = 0 / 1 x concurrency 1 / 8
    for line in lines:
        drafts = [x.split("=", 1) for x in line.split(" --draft ")[1:]]
        drafts = {k: v.split()[0] for k, v in drafts}
        assert drafts == {"DSpine": f"{w}/train-dspine-s0/step-16/draft", "DFlash": f"{w}/train-dflash-s0/step-16/draft",
                          "DSpine-s3": f"{w}/train-dspine-s3/step-24/draft",
                          "DFlash-s3": f"{w}/train-dflash-s3/step-24/draft"}, line


def test_recipe_trains_and_benches_injection_variants(tmp_path, fail_fast_path):
    """VARIANTS="kv:injection=kv r0:injection_rank=0+lr=0.002": per seed, dspine-kv and dspine-r0 runs after the
    two arms, their overrides last (so they win over injection=residual), no warm start even with DRAFT_INIT; the
    bench stage adds DSpine-kv[-s<k>] and DSpine-r0[-s<k>]."""
    w = tmp_path / "w"
    tok = w / "tok-train" / "c"
    tok.mkdir(parents=True)
    (tok / "summary.json").write_text(json.dumps({"sequences": 5, "tokens": 35}))
    (w / "tok-eval" / "e").mkdir(parents=True)
    (w / "tok-eval" / "e" / "summary.json").write_text(json.dumps({"sequences": 2, "tokens": 14}))
    env = {**os.environ, "PATH": fail_fast_path, "WORK": str(w),
           "RECIPE_ALLOW_CPU": "1", "NGPU": "1", "SEEDS": "0 1", "STEPS": "16", "DRAFT_INIT": str(tmp_path / "init"),
           "VARIANTS": "kv:injection=kv r0:injection_rank=0+lr=0.002"}
    r = subprocess.run(["bash", str(REPO / "scripts/smollm2/recipe.sh"), "train"], env=env, capture_output=True,
                       text=True, cwd=REPO)
    assert r.returncode != 0  # no target here: the runs fail, their queue file stays
    lines = (w / "train.gpu0").read_text().splitlines()
    runs = [x.split("output_dir=")[1].split()[0].rsplit("/", 1)[1] for x in lines]
    assert runs == ["train-dspine-s0", "train-dflash-s0", "train-dspine-kv-s0", "train-dspine-r0-s0",
                    "train-dspine-s1", "train-dflash-s1", "train-dspine-kv-s1", "train-dspine-r0-s1"]
    kv, r0 = lines[2], lines[3]
    assert kv.index("injection=residual") < kv.index("injection=kv") and "draft_init=" not in kv
    assert "injection_rank=0 lr=0.002" in r0 and "draft_init=" not in r0
    assert f"draft_init={tmp_path}/init/dspine" in lines[0] and "injection=" not in lines[0]  # the draft's own
    for name in ("dspine", "dflash", "dspine-kv", "dspine-r0"):
        for seed in (0, 1):
            (w / f"train-{name}-s{seed}" / "step-16" / "draft").mkdir(parents=True)
            (w / f"train-{name}-s{seed}" / "latest").write_text("step-16\n")
    r = subprocess.run(["bash", str(REPO / "scripts/smollm2/recipe.sh"), "bench"], env=env, capture_output=True,
                       text=True, cwd=REPO)
    labels = [x.split("=", 1)[0] for x in (w / "bench.gpu0").read_text().splitlines()[0].split(" --draft ")[1:]]
    assert labels == ["DSpine", "DFlash", "DSpine-kv", "DSpine-r0", "DSpine-s1", "DFlash-s1", "DSpine-kv-s1",
                      "DSpine-r0-s1"]


def test_recipe_fresh_samples_skip_the_greedy_job(tmp_path, fail_fast_path):
    """GREEDY=0 SAMPLE_SEED0=3 SAMPLES=2: the regen queue holds the sampled jobs with seeds 4 and 5 (new output
    folders) and the eval job, not the train greedy job that would repeat an earlier lease's answers."""
    env = {**os.environ, "PATH": fail_fast_path, "WORK": str(tmp_path / "w"), "RECIPE_ALLOW_CPU": "1", "NGPU": "1", "GREEDY": "0",
           "SAMPLE_SEED0": "3", "SAMPLES": "2"}
    r = subprocess.run(["bash", str(REPO / "scripts/smollm2/recipe.sh"), "regen"], env=env, capture_output=True, text=True)
    assert r.returncode != 0  # no target or prompts here: the jobs themselves fail, the queue file stays
    queue = (tmp_path / "w" / "regen.gpu0").read_text().splitlines()
    outs = [line.split("--output ")[1].split()[0] for line in queue]
    seeds = [line.split("--seed ")[1].split()[0] for line in queue]
    w = tmp_path / "w"
    assert outs == [f"{w}/regen-train-sample4", f"{w}/regen-train-sample5", f"{w}/regen-eval-greedy"]
    assert seeds == ["4", "5", "0"]


def test_summarize_reports_the_union_of_several_train_caches(tmp_path):
    """TRAIN_CACHES=all trains on every cache in tok-train: the recipe summary counts all of them (it took
    the first one only), and one cache is reported as it is."""
    import json

    from scripts.smollm2.summarize import data_report

    for name, seqs, toks in (("aaa", 24, 1000), ("bbb", 16, 700)):
        d = tmp_path / "tok-train" / name
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"sequences": seqs, "tokens": toks, "rows": seqs}))
    (tmp_path / "tok-eval" / "ccc").mkdir(parents=True)
    (tmp_path / "tok-eval" / "ccc" / "summary.json").write_text(json.dumps({"sequences": 5, "tokens": 50}))
    rep = data_report(tmp_path)
    assert rep["tokenize_train"]["caches"] == ["aaa", "bbb"]
    assert (rep["tokenize_train"]["sequences"], rep["tokenize_train"]["tokens"]) == (40, 1700)
    assert [p["sequences"] for p in rep["tokenize_train"]["parts"]] == [24, 16]
    assert rep["tokenize_eval"] == {"sequences": 5, "tokens": 50}


def _recipe_train(tmp_path, fail_fast_path, **env_extra):
    w = tmp_path / "w"
    for sub in ("tok-train/c", "tok-eval/e"):
        (w / sub).mkdir(parents=True, exist_ok=True)
        (w / sub / "summary.json").write_text(json.dumps({"sequences": 2, "tokens": 14}))
    env = {**os.environ, "PATH": fail_fast_path, "WORK": str(w),
           "RECIPE_ALLOW_CPU": "1", "NGPU": "1", "STEPS": "16", **env_extra}
    r = subprocess.run(["bash", str(REPO / "scripts/smollm2/recipe.sh"), "train"], env=env, capture_output=True,
                       text=True, cwd=REPO)
    assert r.returncode != 0  # no target here: the runs fail (or a value is refused)
    queue = w / "train.gpu0"
    return r, queue.read_text().splitlines() if queue.exists() else None


@pytest.mark.parametrize("inj, want", [(None, "kv"), ("residual", "residual"), ("bogus", None), ("kv residual", None),
                                       ("", None)])
def test_recipe_dspine_arm_injection_from_scratch(tmp_path, fail_fast_path, inj, want):
    """From scratch the DSpine arm trains with DSPINE_INJECTION (default kv: +8.4% / +6.4% over DFlash at two
    seeds, results/smollm2-kv2seeds-h200.json), DFlash with none; anything else is refused before a run starts."""
    r, lines = _recipe_train(tmp_path, fail_fast_path, **({} if inj is None else {"DSPINE_INJECTION": inj}))
    if want is None:
        assert r.returncode == 2 and f"error: DSPINE_INJECTION='{inj}': give kv or residual" in r.stderr
        assert lines is None
        return
    dspine, dflash = lines
    assert f" injection={want} " in dspine and "draft_init=" not in dspine
    assert " injection=none " in dflash


def test_recipe_warm_starts_keep_or_check_the_injection(tmp_path, fail_fast_path):
    """A DSpine warm start keeps its draft's injection (no injection= passed) and is refused when that draft has
    none or when DSPINE_INJECTION names another; a DFlash warm start always passes injection=none, so the trainer
    refuses a draft with an injection (its draft_init check)."""
    res, dfl = tmp_path / "res", tmp_path / "dfl"
    for folder, cfg in ((res, {"dspine_config": {"injection": "residual"}}), (dfl, {})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg))
    r, lines = _recipe_train(tmp_path / "a", fail_fast_path, DSPINE_INIT=str(res), DFLASH_INIT=str(res))
    dspine, dflash = lines
    assert f"draft_init={res}" in dspine and "injection=" not in dspine
    assert f"draft_init={res}" in dflash and " injection=none " in dflash
    r, lines = _recipe_train(tmp_path / "b", fail_fast_path, DSPINE_INIT=str(res), DSPINE_INJECTION="residual")
    assert "injection=" not in lines[0]  # agrees: kept
    r, lines = _recipe_train(tmp_path / "c", fail_fast_path, DSPINE_INIT=str(res), DSPINE_INJECTION="kv")
    assert r.returncode == 2 and lines is None
    assert f"error: DSPINE_INJECTION=kv but the warm start {res} has injection residual" in r.stderr
    r, lines = _recipe_train(tmp_path / "d", fail_fast_path, DSPINE_INIT=str(dfl))
    assert r.returncode == 2 and lines is None and f"the DSpine warm start {dfl} is a DFlash draft" in r.stderr


def test_summarize_names_a_warm_started_run_injection(tmp_path):
    """A warm start passes no injection= (its draft's is kept): train_report reads it from the saved draft."""
    from scripts.smollm2.summarize import train_report

    run = tmp_path / "train-dspine-s0"
    (run / "step-8" / "draft").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"injection": None, "seed": 0}))
    (run / "latest").write_text("step-8\n")
    (run / "step-8" / "draft" / "config.json").write_text(json.dumps({"dspine_config": {"injection": "residual"}}))
    assert train_report(run)["config"]["injection"] == "residual"
    (run / "step-8" / "draft" / "config.json").write_text(json.dumps({}))  # a DFlash draft
    assert train_report(run)["config"]["injection"] == "none"
    (run / "config.json").write_text(json.dumps({"injection": "kv"}))  # given: kept
    assert train_report(run)["config"]["injection"] == "kv"


def test_planner_points_from_bench_runs(tmp_path):
    """benchmarks/engine/planner_points.py: per-task tok/s averaged per label, best fixed among AR and the labels
    without a budget, each planner's ratios, greedy counts and planner steps summed; bad input named by file."""
    import json as _json

    from benchmarks.engine import planner_points as pp

    def row(tok, tau, budget=None, choices=None):
        r = {"tok_per_s": tok, "tau": tau, "greedy_equal": 2, "greedy_compared": 2, "budget": budget}
        return r | ({"planner_choices": choices} if choices else {})

    run = {"args": {"concurrency": 8, "temperature": 0.0, "exact": True, "num_prompts": 2, "max_new_tokens": 64},
           "tasks": [{"task": "a", "ar": row(100.0, 1.0),
                      "drafts": {"chain": row(300.0, 3.0), "t": row(200.0, 4.0),
                                 "p": row(270.0, 3.5, "auto", {"ar": {"steps": 2}, "chain16": {"steps": 5}})}},
                     {"task": "b", "ar": row(100.0, 1.0),
                      "drafts": {"p": row(330.0, 3.5, "auto", {"ar": {"steps": 1}, "tree32": {"steps": 4}}),
                                 "t": row(400.0, 5.0), "chain": row(200.0, 2.0)}}]}  # fmt: skip
    p = pp.point(run)
    assert p["tok_per_s"] == {"AR": 100.0, "chain": 250.0, "t": 300.0, "p": 300.0}
    assert p["best_fixed"] == "t" and p["planner_over_best_fixed"] == {"p": 1.0} and p["planner_over_ar"] == {"p": 3.0}
    assert p["greedy_equal"]["chain"] == [4, 4] and p["mean_tau"]["t"] == 4.5
    assert p["planner_steps"]["p"] == {"ar": 3, "chain16": 5, "tree32": 4}
    assert "planner_tau_by_mode" not in p  # runs before the planner reported what each mode realized
    # a planner that reports its observed steps and their committed tokens: τ per mode pooled over the tasks
    run["tasks"][0]["drafts"]["p"]["planner_choices"]["chain16"] |= {"observed": 4, "realized_tokens": 12.0}
    run["tasks"][1]["drafts"]["p"]["planner_choices"]["tree32"] |= {"observed": 4, "realized_tokens": 18.0}
    run["tasks"][1]["drafts"]["p"]["planner_choices"]["chain16"] = {"steps": 1, "observed": 1, "realized_tokens": 5.0}
    run["tasks"][1]["drafts"]["p"]["planner_choices"]["tree16"] = {"steps": 0, "observed": 0, "realized_tokens": 0.0}
    assert pp.point(run)["planner_tau_by_mode"] == {"p": {"chain16": 3.4, "tree32": 4.5}}
    assert "planner_step_ms_over_fixed" not in pp.point(run)  # no loop steps in the fixed runs' profiles
    # the planner's mean step time per mode against the fixed run of that mode: both summed over the tasks
    for t, (chain_s, tree_s) in zip(run["tasks"], ((1.2, 2.0), (1.8, 2.6))):
        t["drafts"]["chain"] |= {"verify": "chain", "verified_tokens_per_step": 16, "seconds": chain_s,
                                 "profile": {"prefill_s": 0.2, "steps": 500}}
        t["drafts"]["t"] |= {"verify": "tree", "verified_tokens_per_step": 32, "seconds": tree_s,
                             "profile": {"prefill_s": 0.2, "steps": 600}}
    run["tasks"][0]["drafts"]["p"]["planner_choices"]["chain16"] |= {"timed_steps": 4, "timed_ms": 10.0}
    run["tasks"][1]["drafts"]["p"]["planner_choices"]["tree32"] |= {"timed_steps": 3, "timed_ms": 11.0}
    run["tasks"][1]["drafts"]["p"]["planner_choices"]["chain16"] |= {"timed_steps": 1, "timed_ms": 2.6}
    got = pp.point(run)["planner_step_ms_over_fixed"]["p"]
    assert got["chain16"] == {"planner_ms": 2.52, "fixed": "chain", "fixed_ms": 2.6, "ratio": round(2.52 / 2.6, 4)}
    assert got["tree32"]["fixed"] == "t" and got["tree32"]["fixed_ms"] == pytest.approx(1e3 * 4.2 / 1200)
    assert got["tree32"]["ratio"] == pytest.approx(11.0 / 3 / (1e3 * 4.2 / 1200), abs=1e-4) and set(got) == {"chain16", "tree32"}
    # a second chain of 16 with a draft vocabulary: the planner (full vocabulary) is compared with the plain chain
    for t in run["tasks"]:
        t["drafts"]["chainv"] = {**t["drafts"]["chain"], "seconds": 0.7}
    run["args"]["configs"] = {"chain": {}, "t": {}, "p": {}, "chainv": {"draft_vocab": "v.safetensors"}}
    got = pp.point(run)["planner_step_ms_over_fixed"]["p"]
    assert got["chain16"]["fixed"] == "chain" and got["chain16"]["fixed_ms"] == 2.6
    run["args"]["configs"]["chainv"] = {}  # two chains of the same setup: which one is meant is unknown, no ratio
    assert set(pp.point(run)["planner_step_ms_over_fixed"]["p"]) == {"tree32"}
    f = tmp_path / "run.json"
    f.write_text(_json.dumps(run))
    out = tmp_path / "points.json"
    assert pp.main([str(f), "--output", str(out)]) == 0
    assert _json.loads(out.read_text())["points"][str(f)]["best_fixed"] == "t"
    assert pp.main([str(f), "--output", str(out)]) == 2  # exists: refused without --overwrite
    del run["tasks"][1]["ar"]
    f.write_text(_json.dumps(run))
    assert pp.main([str(f)]) == 2
    with pytest.raises(ValueError, match="no AR row"):
        pp.point(run)
    with pytest.raises(ValueError, match="interrupted"):  # a stopped infer.bench run holds part of its tasks
        pp.point({**run, "interrupted": True})


def test_planner_points_refuses_what_it_cannot_compare(tmp_path, capsys):
    """planner_points.py: a file without args prints '?' for them; an AR tok/s of 0, a draft label named AR and a
    file given twice are errors naming the file (exit status 2), not a traceback or a silent merge."""
    import json as _json

    from benchmarks.engine import planner_points as pp

    def run(ar_tok=100.0, fixed="chain"):
        rows = {fixed: {"tok_per_s": 300.0, "tau": 3.0}, "p": {"tok_per_s": 250.0, "tau": 3.0, "budget": "auto"}}
        return {"tasks": [{"task": "a", "ar": {"tok_per_s": ar_tok, "tau": 1.0}, "drafts": rows}]}

    f = tmp_path / "run.json"
    f.write_text(_json.dumps(run()))  # no "args": concurrency and temperature unknown
    assert pp.main([str(f)]) == 0
    assert f"{f}: c? T? best fixed chain 300 tok/s" in capsys.readouterr().out
    for bad, msg in ((run(ar_tok=0.0), "AR tok/s is 0"), (run(fixed="AR"), "a draft label is named 'AR'")):
        f.write_text(_json.dumps(bad))
        assert pp.main([str(f)]) == 2
        assert f"error: {f}: {msg}" in capsys.readouterr().err
    f.write_text(_json.dumps(run()))
    for twice in (str(f), f"{tmp_path}/./run.json"):  # the same file, spelt differently
        assert pp.main([str(f), twice]) == 2
        assert f"error: {twice}: given twice (as {f})" in capsys.readouterr().err
