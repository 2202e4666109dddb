"""Build the README result tables (and plots) from the files in ``results/``.

    python scripts/make_tables.py            # rewrite the README block between the RESULTS markers
    python scripts/make_tables.py --check    # exit 1 if the README block is stale (used by the tests)

Every number in the README's results section comes from a JSON file in ``results/`` that records the
command, device, date and commit that produced it; this script is the only writer of that block.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- RESULTS:BEGIN (scripts/make_tables.py) -->", "<!-- RESULTS:END -->"
TASKS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")


def read_json(path: Path):
    """The JSON in ``path``. Raises SystemExit naming the file when it is not valid JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"make_tables: {path}: not valid JSON ({e})") from None


def load(name: str) -> dict | None:
    p = RESULTS / name
    return read_json(p) if p.is_file() else None


def fmt(x, nd=2):
    return "–" if x is None else f"{x:.{nd}f}"


def _link(name: str) -> str:
    return f"[`{name}`](results/{name})"


def _summary(r: dict, name: str) -> dict:
    """The shipped draft's summary of an infer.bench file: label DSpine, or its only label."""
    s = r["summary"]
    if "DSpine" in s:
        return s["DSpine"]
    if len(s) == 1:
        return next(iter(s.values()))
    raise ValueError(f"results/{name}: no DSpine label among {sorted(s)}")


def glance_section() -> list[str]:
    """One row per goal of the open and closed issues: the goal, the measured value, whether it is met, the file.
    A row whose file is missing is left out; every number is read from the file named in its row. A file without
    a key its row reads raises ValueError naming the file."""
    reading = {"file": None}

    def tracked(name: str) -> dict | None:  # load, remembering the file for the error message
        reading["file"] = name
        return load(name)

    try:
        return _glance_rows(tracked)
    except (KeyError, IndexError, TypeError, StopIteration, ZeroDivisionError) as e:
        raise ValueError(f"make_tables.py, goals table: results/{reading['file']} lacks what its row reads "
                         f"({type(e).__name__}: {e})") from e


# planner points on the same text in every mode (scripts/reproduce_h200.sh planfair), with what makes it the same
# (the drainfed files: the same points with the narrower chains feeding the drain statistics; the refresh files: the
# same points with a drain refresh's host time left out of the step, commit fd30777 and later; the persist files: the
# eight points' stage with persist the default drain model, commit a0f4220; the again files: the two points that
# missed at a0f4220, run twice at 3bfb1d4; the statekv files: the stage with PLAN_STATE=kv at 8e4681c)
FAIR_FILES = [(f"verify-{run}{kind}-{gpu}.json", how) for run, gpus in (
    ("", ("h200", "h100")), ("drainfed-", ("h100",)), ("refresh-", ("h100",)), ("persist-", ("h100",)), ("again-", ("h100",)),
    ("again2-", ("h100",)), ("statekv-", ("h100",)))
              for gpu in gpus for kind, how in (
    ("exact", "exact mode: every mode decodes AR's greedy text"),
    ("invariant", "drafter-invariant verification: the chain and the planner decode AR's sampled text, no tree"))]


def _settings(pts: list[dict]) -> str:
    """The planner settings of ``pts`` not the engine's defaults (bench_tree.py --plan-state, --plan-drain-model), as a
    caption's clause: ``"; planner state kv at every point"``, ``"; planner state kv at concurrency 32 T = 1"``; ""
    with none."""
    out = []
    for key, what in (("plan_state", "planner state"), ("plan_drain_model", "drain model")):
        vals = dict.fromkeys(p[key] for p in pts if p.get(key))
        for v in vals:
            at = [p for p in pts if p.get(key) == v]
            where = "every point" if len(at) == len(pts) else ", ".join(
                f"concurrency {p['concurrency']} T = {p['temperature']:g}" for p in at)
            out.append(f"{what} {v} at {where}")
    return "".join(f"; {x}" for x in out)


def _commit(p: dict) -> str:
    """The commit a planner point ran at (its provenance; "?" when not recorded)."""
    return str((p.get("provenance") or {}).get("commit") or "?")


def _point_key(p: dict) -> tuple:
    """A planner point's identity across files: concurrency, temperature and when it ran."""
    return p["concurrency"], p["temperature"], p.get("provenance", {}).get("date")


def _vs_goal(x: float, goal: float = 0.98) -> str:
    """``x`` to three decimals, or as many more (up to 6) as it takes for a miss not to read as the goal (0.9798 is
    not 0.980)."""
    n = 3
    while n < 6 and x < goal <= round(x, n):
        n += 1
    return f"{x:.{n}f}"


def _planner_row(pts: list[dict], name: str, where: str = "",
                 what: str = "concurrency 1 / 8 / 32 / 64 × T = 0, 1") -> tuple | None:
    """The goals table's row for the planner points of one file (bench_tree.py --planner), or None without any;
    ``what``: the points the file is meant to hold."""
    if not pts:
        return None
    good = sum(p["planner_over_best_static"] >= 0.98 for p in pts)
    below_ar = [p for p in pts if p["planner_over_ar"] < 1]
    short = ", ".join(f"{_vs_goal(p['planner_over_best_static'])} at concurrency {p['concurrency']}, T = "
                      f"{p['temperature']:g}" for p in pts if p["planner_over_best_static"] < 0.98)
    trees = next((p["plan_trees"] for p in pts if p["temperature"] == 0 and p.get("plan_trees")), None)
    return ("Planner (`--budget auto`) ÷ the best fixed mode, " + what + where
            + (f" (trees of {' and '.join(map(str, trees))} at T = 0)" if trees else ""),
            "≥ 0.98, never below AR",
            f"{good} of {len(pts)} points ≥ 0.98" + (f"; below: {short}" if short else "")
            + (f"; below AR at {len(below_ar)} point{'s' * (len(below_ar) > 1)}"
               + (", where AR is the best mode" if all(abs(p["planner_over_ar"] - p["planner_over_best_static"])
                                                       < 1e-9 for p in below_ar) else "")
               + f" (lowest {min(p['planner_over_ar'] for p in pts):.3f} × AR)" if below_ar else ""),
            "yes" if good == len(pts) and not below_ar else "**no**", name)


def _glance_rows(load) -> list[str]:
    rows: list[tuple[str, str, str, str, str]] = []  # (what, goal, measured, met, file)

    def met(ok: bool) -> str:
        return "yes" if ok else "**no**"

    for name, conc, goal_sp in (("smollm2-h200-shipped-T0-c1.json", 1, 2.0), ("smollm2-h200-shipped-T0-c8.json", 8, 1.4)):
        r = load(name)
        if r:
            s = _summary(r, name)
            lo, hi = s["mean_tau_ci95"]
            if conc == 1:
                rows.append(("SmolLM2, shipped draft: τ at T = 0", "≥ 3", f"{s['mean_tau']:.2f} [{lo:.2f}, {hi:.2f}]",
                             met(s["mean_tau"] >= 3), name))
            rows.append((f"SmolLM2, shipped draft: speedup over AR, T = 0, concurrency {conc}", f"≥ {goal_sp:g}×",
                         f"{s['mean_speedup']:.2f}×", met(s["mean_speedup"] >= goal_sp), name))
    ver = load("verify-h200.json")  # the T = 1 tree run, the tree goals and the planner points
    r, vt = load("smollm2-h200-shipped-T1-c1.json"), (ver or {}).get("smollm2_T1")
    if r:
        s = _summary(r, "smollm2-h200-shipped-T1-c1.json")
        value, ok = f"{s['mean_tau']:.2f} (chain)", met(s["mean_tau"] >= 2.5)
        files = "smollm2-h200-shipped-T1-c1.json"
        if vt:  # the newest chain-vs-tree run at T = 1 (verify-h200.json smollm2_T1, its own file named there)
            tree, chain = vt["summary"]["tree"]["mean_tau"], vt["summary"]["chain"]["mean_tau"]
            value += f"; `--verify tree` of 32 nodes: {tree:.2f} against the chain's {chain:.2f} in the same run"
            if s["mean_tau"] < 2.5 <= tree:
                ok = "with `--verify tree` only"
            files += ", verify-h200.json"
        rows.append(("SmolLM2, shipped draft: τ at T = 1, concurrency 1", "≥ 2.5", value, ok, files))
    k = load("smollm2-kv2seeds-h200.json")
    if k:
        cells = []
        for c in k["comparisons"]:
            a = c["variants"]["kv"]["all_seeds"]
            cells.append(f"T = {c['temperature']:g}: {100 * a['rel']:+.1f}% [{100 * a['rel_ci95'][0]:+.1f}, "
                         f"{100 * a['rel_ci95'][1]:+.1f}]")
        ok = all(c["variants"]["kv"]["all_seeds"]["rel"] >= k["goal_rel"] for c in k["comparisons"])
        rows.append(("DSpine (`kv`) ÷ DFlash − 1 in τ, equal data and steps, two seeds", f"≥ +{100 * k['goal_rel']:g}%",
                     "; ".join(cells), met(ok), "smollm2-kv2seeds-h200.json"))
    e = load("engine-smollm2-h200.json")
    if e:
        cells, worst = [], 0.0
        for shape, label in (("smollm2", "SmolLM2"), ("qwen3-8b", "Qwen3-8B shape")):
            v = [e["shapes"][shape][b]["dspine_kv_step_over_dflash_step"] for b in ("batch1", "batch8")]
            worst = max(worst, *v)
            cells.append(f"{label} {v[0]:.3f} / {v[1]:.3f}")
        rows.append(("DSpine (`kv`) step ÷ DFlash step in the engine, batch 1 / 8", "≤ 1.03", "; ".join(cells),
                     met(worst <= 1.03), "engine-smollm2-h200.json"))
    if ver:
        rows.append(("Tree τ ÷ chain τ, T = 0, concurrency 1", "≥ 1.3", f"{ver['tree_tau_over_chain_tau']:.2f}",
                     met(ver["tree_tau_over_chain_tau"] >= 1.3), "verify-h200.json"))
        rows.append(("Tree tok/s ÷ chain tok/s, T = 0, concurrency 1", "≥ 1.15", f"{ver['tree_speedup_over_chain']:.2f}",
                     met(ver["tree_speedup_over_chain"] >= 1.15), "verify-h200.json"))
        row = _planner_row(ver.get("planner") or [], "verify-h200.json", " (H200)")
        if row:
            rows.append(row)
    in_ver = {_point_key(p) for p in (ver or {}).get("planner") or []}
    latest: dict[tuple, dict] = {}  # other cards: (gpu, how) -> (concurrency, T) -> [(point, file)], every run
    for name, how in FAIR_FILES:  # the planner points with every mode decoding AR's text
        hx = load(name)
        pts = (hx or {}).get("planner") or []
        if pts and all(_point_key(p) in in_ver for p in pts):
            continue  # verify-h200.json's row holds them
        if not name.endswith("-h200.json"):  # one row per card and mode: each point as last measured
            for p in pts:
                latest.setdefault(((hx or {}).get("gpu") or "?", how), {}).setdefault(
                    (p["concurrency"], p["temperature"]), []).append((p, name))
            continue
        commit = ", ".join(dict.fromkeys(_commit(p)[:7] for p in pts))
        row = _planner_row(pts, name, f" ({(hx or {}).get('gpu') or '?'}, {str((hx or {}).get('date', ''))[:10]}, "
                           f"commit {commit}, {how}{_settings(pts)})",
                           what=", ".join(f"concurrency {p['concurrency']} T = {p['temperature']:g}" for p in pts))
        if row:
            rows.append(row)
    for (gpu, how), runs in latest.items():  # a point's runs at the commit of its latest run: the lowest of them
        got = []  # per point, by T then concurrency
        for _, rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            last = _commit(max(rs, key=lambda x: str(_point_key(x[0])[2]))[0])
            got.append(min((x for x in rs if _commit(x[0]) == last), key=lambda x: x[0]["planner_over_best_static"]))
        pts = [p for p, _ in got]
        commit = ", ".join(dict.fromkeys(_commit(p)[:7] for p in pts))
        row = _planner_row(pts, ", ".join(dict.fromkeys(name for _, name in got)),
                           f" ({gpu}, each point at the commit of its latest run, the lowest of its runs there: commit "
                           f"{commit}; {how}{_settings(pts)})",
                           what=", ".join(f"concurrency {p['concurrency']} T = {p['temperature']:g}" for p in pts))
        if row:
            rows.append(row)
    cells, files, vals, commits = [], [], [], set()
    for name, mode in (("planner-default-h200.json", "fast"), ("planner-default-exact-h200.json", "exact")):
        d = load(name)
        if d:  # planner_points.py over infer.bench runs: label p is the planner with the defaults of its commit
            pts = sorted(d["points"].values(), key=lambda p: p["concurrency"])
            vals += [p["planner_over_best_fixed"]["p"] for p in pts]
            commits |= {str(p.get("commit") or "?")[:7] for p in pts}  # the GPU runs' (the file's: planner_points.py's)
            cells.append(f"{mode} " + " / ".join(_vs_goal(p['planner_over_best_fixed']['p']) for p in pts) + " at concurrency "
                         + " / ".join(str(p["concurrency"]) for p in pts))
            files.append(name)
    if vals:
        commit = "/".join(sorted(commits))
        rows.append((f"Planner, trees of 16 and 32 (the default trees now; measured at {commit}, before "
                     "`conf_slope=auto`), T = 0, ÷ the best fixed mode of the same run", "≥ 0.98",
                     "; ".join(cells), met(min(vals) >= 0.98), ", ".join(files)))
    x = load("exact-h200.json")
    if x:
        same = sum(r["identical"] for r in x["runs"])
        total = sum(r["compared"] for r in x["runs"])
        worst = max(x["exact_over_fast"].values())
        if total:  # no compared output: no verdict
            rows.append(("`--exact`: greedy bf16 output bitwise equal to the engine's AR output", "all",
                         f"{same} / {total} outputs", met(same == total), "exact-h200.json"))
        rows.append(("`--exact` step ÷ fast step, Qwen3-8B shape, batch 1 and 8", "≤ 1.05", f"at most {worst:.3f}",
                     met(worst <= 1.05), "exact-h200.json"))
    g = load("engine-h200.json")
    if g:
        b1, b8 = g["batch1"], g["batch8"]
        rows += [
            ("Qwen3-8B shape: AR batch 1 ÷ the bandwidth floor", "≥ 0.85", f"{b1['ar_fraction_of_floor']:.4f} "
             f"({b1['ar_tok_per_s']:.0f} tok/s)", met(b1["ar_fraction_of_floor"] >= 0.85), "engine-h200.json"),
            ("Qwen3-8B shape: spec step ÷ AR step, batch 1 / 8", "≤ 1.20 / 1.35",
             f"{b1['spec_step_over_ar_step']:.2f} / {b8['spec_step_over_ar_step']:.2f}",
             met(b1["spec_step_over_ar_step"] <= 1.20 and b8["spec_step_over_ar_step"] <= 1.35), "engine-h200.json"),
            ("Qwen3-8B shape: oracle τ = 7 speedup, batch 1", "≥ 5.5×", f"{b1['oracle_speedup_tau7']:.2f}×",
             met(b1["oracle_speedup_tau7"] >= 5.5), "engine-h200.json"),
        ]
        if b1.get("compiled_hf_tok_per_s"):
            rows.append(("Qwen3-8B shape: transformers, static cache + `torch.compile`, batch 1", "reported",
                         f"{b1['compiled_hf_tok_per_s']:.0f} tok/s (the engine's AR: {b1['ar_tok_per_s']:.0f})", "yes",
                         "engine-h200.json"))
    c = load("smollm2-continue4-h200.json")
    if c and c.get("regen"):
        rate = c["regen"]["tokens_per_s_stage"]
        rows.append(("Regeneration, SmolLM2, one H200 (four sampled answer sets, start-ups included)", "≥ 60k tok/s",
                     f"{rate / 1e3:.0f}k tok/s", met(rate >= 60e3), "smollm2-continue4-h200.json"))
    rec = load("smollm2-recipe-h200.json")
    if c and rec and c.get("train"):
        base, got = rec["train"]["dspine-s0"]["median_tokens_per_s"], c["train"]["median_tokens_per_s"]
        rows.append(("Training, SmolLM2 DSpine draft: target tokens/s per H200 against the recipe run's", "≥ 2×",
                     f"{got / 1e3:.1f}k against {base / 1e3:.1f}k: {got / base:.2f}×", met(got >= 2 * base),
                     "smollm2-continue4-h200.json, smollm2-recipe-h200.json"))
    if not rows:
        return []
    out = ["### Goals at a glance", "",
           "Every goal the issues set, with the value of the file in its row (the tables below give each run in full; "
           "docs/status.md says what is behind each open one).", "",
           "| goal | target | measured | met | file |", "|---|---|---|---|---|"]
    for what, goal, value, ok, names in rows:
        out.append(f"| {what} | {goal} | {value} | {ok} | " + ", ".join(_link(n) for n in names.split(", ")) + " |")
    return out + [""]


def smollm2_section() -> list[str]:
    runs = sorted((p for p in RESULTS.glob("smollm2*-T*-c*.json")  # the arms' files: arms_section
                   if not p.stem.endswith("-divergence")
                   and not any(x in p.stem for x in ("-arms-", "-variants-", "-kv2seeds-", "-kvcont-", "-draft-vocab-"))),
                  key=lambda p: ("-cpu-" in p.name, "-shipped-" not in p.name, p.name))  # shipped draft, GPU, CPU
    if not runs:
        return []
    out = ["### SmolLM2-135M-Instruct: the shipped draft, and DSpine vs the DFlash ablation", ""]
    for path in runs:
        r = read_json(path)
        a = r["args"]
        samp = "greedy" if a["temperature"] == 0 else f"T={a['temperature']:g}, top_p {a['top_p']:g}, top_k {a['top_k']}"
        if a.get("draft_temperature") is not None:
            samp += f", draft temperature {a['draft_temperature']:g}" + (" (argmax)" if a["draft_temperature"] == 0 else "")
        if a.get("budget"):
            samp += f", planner (`--budget {a['budget']}`)"
        cfg = a.get("configs") or {}
        first = {True: ", chain first", False: ", best first"}
        trees = {lab: f"`--verify tree` of {c['tree_budget']} nodes{first.get(c.get('chain_first'), '')}"
                 for lab, c in cfg.items() if c.get("verify") == "tree" and not c.get("budget")}
        auto = {lab: f"the planner (`budget=auto`{first.get(c.get('chain_first'), '')})"
                for lab, c in cfg.items() if c.get("budget")}
        if trees or auto:
            samp += ", " + ", ".join(f"`{lab}` = {d}" for lab, d in {**trees, **auto}.items()) + " (the others a chain of 16)"
        trained = ("The shipped DSpine draft (the recipe's, trained further four times: continuations below)" if "-shipped-" in path.name
                   else "GPU-trained drafts (recipe below)" if "-h200-" in path.name else "CPU-trained drafts")
        out.append(f"**{trained}, {samp}, concurrency {a['concurrency']}, {a['num_prompts']} prompts per task, "
                   f"{a['max_new_tokens']} new tokens, backend `{r['backend']}` on {r['device']}** "
                   f"([`{path.relative_to(ROOT)}`]({path.relative_to(ROOT)}), commit `{r['commit'][:10]}`)")
        out.append("")
        labels = sorted({lab for t in r["tasks"] for lab in t["drafts"]})
        head = "| draft | " + " | ".join(t["task"] for t in r["tasks"]) + " | mean τ | mean speedup |"
        out += [head, "|" + "---|" * (len(r["tasks"]) + 3)]
        for lab in labels:
            cells = [fmt(t["drafts"][lab]["tau"]) for t in r["tasks"]]
            s = r["summary"][lab]
            sp = s.get("mean_speedup")
            out.append(f"| {lab} | " + " | ".join(cells) + f" | **{fmt(s['mean_tau'])}** | "
                       + (f"{fmt(sp)}× |" if sp is not None else "– (no AR in this run) |"))
        ar = [t.get("ar", {}).get("tok_per_s") for t in r["tasks"]]
        if any(x is not None for x in ar):
            out.append("| AR tok/s | " + " | ".join(fmt(x, 1) for x in ar) + " | | |")
        for lab in labels:
            out.append(f"| {lab} tok/s | " + " | ".join(fmt(t["drafts"][lab]["tok_per_s"], 1) for t in r["tasks"]) + " | | |")
        eq = [f"{lab}: {r['summary'][lab]['greedy_equal']}/{r['summary'][lab]['greedy_compared']}"
              for lab in labels if "greedy_compared" in r["summary"][lab]]
        out.append("")
        if eq:
            out.append("Greedy output identical to the autoregressive output of the same backend: " + ", ".join(eq) + ".")
        div = path.with_name(path.stem + "-divergence.json")
        if div.is_file():
            rows = [x for x in read_json(div)["divergences"] if x.get("position") is not None]
            top2 = sum(x["both_in_fp32_top2"] for x in rows)
            out.append(f"Each of the {len(rows)} differing outputs parts from AR at a near-tie of the target: both tokens "
                       f"are the fp32 top-2 in {top2}/{len(rows)} cases, top-2 margin ≤ "
                       f"{max(x['fp32_margin'] for x in rows):.3f} (fp32) and ≤ {max(x['bf16_margin'] for x in rows):.3f} "
                       f"(bf16, one bf16 step at these logit sizes); the 16-slot verify pass rounds differently from the "
                       f"1-token AR pass in bf16 ([`{div.relative_to(ROOT)}`]({div.relative_to(ROOT)})). In fp32 the "
                       "outputs are identical (tests/test_shipped_draft.py).")
        if r["backend"] == "cuda" and a.get("warmup") != "task" and any("ar" in t for t in r["tasks"]):
            out.append("Timed after the start-up warm-up only (before `--warmup task`): the first configuration of "
                       "each task may carry a one-time cost, so these speedups are biased (docs/status.md, the benchmark order bias).")
        out.append(f"Command: `{r['command']}`")
        if "-cpu-" in path.name:
            out.append("(Its `checkpoints/smollm2-135m-dspine` is the CPU-trained draft shipped until the GPU one replaced "
                       "it: `git checkout b2029e2 -- checkpoints/smollm2-135m-dspine` restores it.)")
        out.append("")
        png = path.with_suffix(".png")
        if png.is_file():
            out += [f"Per-position acceptance: ![accept_at_pos]({png.relative_to(ROOT)})", ""]
    return out


def recipe_section() -> list[str]:
    r = load("smollm2-recipe-h200.json")
    if not r:
        return []
    out = ["#### The SmolLM2 recipe on an H200 pair (`scripts/smollm2/recipe.sh`)", "",
           f"{r['device']}, commit `{r['commit'][:10]}` ([`results/smollm2-recipe-h200.json`]"
           f"(results/smollm2-recipe-h200.json); {r.get('commit_note', '')}). The two drafts trained side by side, "
           "one per GPU of a two-GPU machine, for the same number of steps.", "",
           "| stage | wall clock |", "|---|---|"]
    for t in r["timings"]:
        if "seconds" in t:
            out.append(f"| {t['stage']} | {t['seconds']:.0f} s |")
    out.append(f"| **total** | **{r['total_seconds'] / 60:.1f} min** |")
    d = r["data"]
    dec = d["decontaminate_train"]
    by_task = ", ".join(f"{k} {v}" for k, v in dec["contaminated_by_task"].items())
    out += ["", f"Data: {dec['read']:,} training prompts after `data.prepare`; `data.decontaminate` (13-gram word overlap "
            f"with every eval set) dropped {dec['contaminated']} ({by_task}) and {dec['duplicates']} duplicate prompts; "
            f"{d['train_answers']:,} target answers, {d['train_answer_tokens'] / 1e6:.1f} M answer tokens, "
            f"{d['tokenize_train']['tokens'] / 1e6:.1f} M tokens after `data.tokenize`.", "",
            "| regeneration run | temperature | answers | tokens | truncated at max_new | wall clock | tok/s |",
            "|---|---|---|---|---|---|---|"]
    for name, g in d["regenerate"].items():
        out.append(f"| {name} | {g['temperature']:g} | {g['results']:,} | {g['generated_tokens']:,} | "
                   f"{100 * g['truncation_rate']:.1f}% | {g['wall_s']:.0f} s | {g.get('generated_tokens_per_s', 0):,.0f} |")
    out += ["", "| draft | steps | target tokens | tokens/s (median) | anchor blocks/s | final eval loss | τ_sim | "
            "τ_real (eval prompts) |", "|---|---|---|---|---|---|---|---|"]
    for name, t in r["train"].items():
        f = t["evals"][-1] if t["evals"] else {}
        out.append(f"| {name} (injection `{t['config']['injection']}`) | {t['steps']} | {t['tokens'] / 1e6:.1f} M | "
                   f"{t['median_tokens_per_s']:,.0f} | {t['median_anchor_blocks_per_s']:,.0f} | "
                   f"{fmt(f.get('eval/loss'), 3)} | {fmt(f.get('eval/tau_sim'))} | {fmt(f.get('eval/tau_real'))} |")
    out += ["", "Training curves: ![curves](results/smollm2-h200-curves.png)", ""]
    sc = load("smollm2-scaling.json")
    if sc:
        out += ["Scaling: mean τ (5 tasks, T = 0) of the checkpoints along each run "
                "([`results/smollm2-scaling.json`](results/smollm2-scaling.json)):", "",
                "| step | target tokens | DSpine mean τ [95% CI] | DFlash mean τ [95% CI] |", "|---|---|---|---|"]
        fl = {p["step"]: p for p in sc["points"].get("dflash", [])}
        for p in sc["points"].get("dspine", []):
            q = fl.get(p["step"], {})
            ci = lambda x: f"{x['mean_tau']:.2f} [{x['mean_tau_ci95'][0]:.2f}, {x['mean_tau_ci95'][1]:.2f}]" if x else "–"
            tok = f"{p['target_tokens'] / 1e6:.1f} M" if p.get("target_tokens") else "–"
            out.append(f"| {p['step']} | {tok} | {ci(p)} | {ci(q)} |")
        out += ["", "![scaling](results/smollm2-scaling.png)", ""]
    out += [f"Command: `{r['command']}`", ""]
    return out


def arms_section() -> list[str]:
    """DSpine against DFlash, paired per prompt (scripts/smollm2/compare_arms.py): the two-seed run
    (smollm2-arms2-h200.json, drafts trained for the comparison) and the recipe's seed 0 (smollm2-arms-h200.json)."""
    two, one = load("smollm2-arms2-h200.json"), load("smollm2-arms-h200.json")
    variants = [(tag, v) for tag in ("kv2seeds", "variants") if (v := load(f"smollm2-{tag}-h200.json"))]
    if not (two or one or variants):
        return []
    r = two or one or variants[0][1]
    out = ["#### DSpine against DFlash, paired by prompt", "",
           "`scripts/smollm2/compare_arms.py`: both drafts decoded the same prompts in one run, so prompts are "
           "resampled in pairs (within each task) and the spread both drafts share cancels; the mean of seeds "
           f"resamples both seeds' prompts together. Goal: DSpine ≥ +{100 * r['goal_rel']:.0f}%.", ""]

    def table(r: dict) -> list[str]:
        rows = ["| T | concurrency | prompts per task | seed | DSpine mean τ | DFlash mean τ | DSpine ÷ DFlash − 1 [95% CI] |",
                "|---|---|---|---|---|---|---|"]
        for c in r["comparisons"]:
            seeds = {**c["seeds"], **({"mean of seeds": c["all_seeds"]} if "all_seeds" in c else {})}
            for v, g in c.get("variants", {}).items():  # recipe.sh VARIANTS: DSpine-NAME against DFlash
                seeds |= {f"{seed} (DSpine-{v})": e for seed, e in g["seeds"].items()}
                if "all_seeds" in g:
                    seeds[f"mean of seeds (DSpine-{v})"] = g["all_seeds"]
            for seed, e in seeds.items():
                rows.append(f"| {c['temperature']:g} | {c['concurrency']} | {c['num_prompts']} | {seed} | "
                            f"{e['dspine_mean_tau']:.3f} | {e['dflash_mean_tau']:.3f} | {100 * e['rel']:+.1f}% "
                            f"[{100 * e['rel_ci95'][0]:+.1f}, {100 * e['rel_ci95'][1]:+.1f}] |")
        return rows + ["", f"Command: `{r['command']}`", ""]

    if two:
        t = two["train"]
        last = {k: v[-1] for k, v in t["evals"].items() if v}
        out += [f"Two seeds, drafts trained for the comparison ({two['comparisons'][0]['gpu']}, commit "
                f"`{two['commit'][:10]}`, [`results/smollm2-arms2-h200.json`](results/smollm2-arms2-h200.json)): "
                f"DSpine and DFlash × seeds 0 and 1 from scratch, side by side on one GPU, on the same "
                f"{t['data']['train_rows']:,} sampled answers ({t['data']['train_tokens'] / 1e6:.1f} M tokens), "
                f"{t['steps']} steps each ({t['wall_s']:.0f} s). {t['note']}. Final in-trainer evals (τ_sim / "
                "τ_sim_sample): " + ", ".join(f"{k} {e['tau_sim']:.3f} / {e['tau_sim_sample']:.3f}"
                                               for k, e in sorted(last.items())) + ".", ""]
        out += table(two) + [f"Training: `{t['command']}`", ""]
    for tag, var in variants:
        t = var["train"]
        last = {k: v[-1] for k, v in t["evals"].items() if v}
        seeds = sorted({k for c in var["comparisons"] for g in [c, *c.get("variants", {}).values()] for k in g["seeds"]},
                       key=int)
        out += [f"Injection variants, seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)} ({var['comparisons'][0]['gpu']}, commit `{var['commit'][:10]}`, "
                f"[`results/smollm2-{tag}-h200.json`](results/smollm2-{tag}-h200.json)): "
                f"{t['what']}; {t['steps']} steps each on the same {t['data']['train_rows']:,} sampled answers. "
                f"{t['note']}. Final in-trainer evals (eval loss / τ_sim / τ_real): "
                + ", ".join(f"{k} {e['loss']:.3f} / {e['tau_sim']:.3f} / {e['tau_real']:.3f}" for k, e in sorted(last.items()))
                + ". Wall clock per run side by side: " + ", ".join(f"{k} {v} s" for k, v in t["wall_s_per_run"].items())
                + f" ({t['wall_note']}).", ""]
        out += table(var) + [f"Training: `{t['command']}`; benchmarks: "
                             + "; ".join(f"`{c}`" for c in var["bench_commands"].values()), ""]
        out += [f"Per-position acceptance, T = {T}: ![accept_at_pos](results/smollm2-h200-{tag}-T{T}-c8.png)"
                for T in (0, 1) if (RESULTS / f"smollm2-h200-{tag}-T{T}-c8.png").is_file()] + [""]
    if one:
        out += [f"Seed 0 of the recipe (the benchmark files of the 1,592-step drafts; {one['comparisons'][0]['gpu']}, "
                f"commit `{str(one['comparisons'][0]['bench_commit'])[:10]}`; comparison at commit `{one['commit'][:10]}`, "
                "[`results/smollm2-arms-h200.json`](results/smollm2-arms-h200.json)):", ""]
        out += table(one)
    return out


def _continuation_tables(r: dict) -> list[str]:
    """A continuation run's stage timings, its in-trainer evaluations and its command."""
    out = ["| stage | wall clock |", "|---|---|"]
    out += [f"| {x['stage']} | {x['seconds']:.0f} s |" for x in r["timings"]]
    sample = any("eval/tau_sim_sample" in e for e in r["train"]["evals"])  # T > 0 proxy, logged since 04788e6
    out += ["", "| step | eval loss | τ_sim | τ_real (eval prompts) |" + (" τ_sim_sample |" if sample else ""),
            "|---|---|---|---|" + ("---|" if sample else "")]
    out += [f"| {e['step']} | {fmt(e['eval/loss'], 3)} | {fmt(e['eval/tau_sim'])} | {fmt(e['eval/tau_real'])} |"
            + (f" {fmt(e.get('eval/tau_sim_sample'))} |" if sample else "") for e in r["train"]["evals"]]
    return out + ["", f"Command: `{r['command']}`", ""]


def _continuation_facts(r: dict, name: str, init: str) -> tuple[str, str]:
    """(provenance, training sentence) of a continuation run: device, date, commit and the results link; its
    steps warm-started from ``init``, learning rate and throughput."""
    t = r["train"]
    note = f"; {r['commit_note']}" if r.get("commit_note") else ""
    prov = f"{r['device']}, {r['date'][:10]}, commit `{r['commit'][:10]}` ([`results/{name}`](results/{name}){note})"
    train = (f"{t['steps']} steps warm-started from {init} (same settings, cosine from lr {t['config']['lr']:g}), "
             f"{t['median_step_s']:.2f} s/step, {t['median_tokens_per_s']:,.0f} tokens/s, "
             f"{t['median_anchor_blocks_per_s']:,.0f} anchor blocks/s")
    return prov, train


def _shipped_before(r: dict, commit: str) -> str:
    """The H200 benchmark of a continuation's draft that is no longer the shipped one."""
    b = r["bench"]["T0-c1"]
    return (f"Its draft on the H200 benchmark (T = 0, concurrency 1, 20 prompts per task): mean τ {b['mean_tau']:.2f}, "
            f"{b['mean_speedup']:.2f}× (`bench` in the JSON; `git show {commit}:checkpoints/smollm2-135m-dspine` is "
            "that draft).")


def continue_section() -> list[str]:
    """The shipped draft's warm-started continuations of the recipe's DSpine draft, newest first."""
    out = []
    r = load("smollm2-continue4-h200.json")
    if r:
        g, b, (new, _) = r["regen"], r["bench"]["T0-c1"], r["data"]["packs"]
        prov, train = _continuation_facts(r, "smollm2-continue4-h200.json", "the third continuation's draft")
        out += ["#### The shipped draft: the recipe's DSpine draft trained further, four times, on one H200", "",
                f"Fourth continuation (the shipped draft): {prov}. "
                f"Fresh answers: the recipe's data stages with `GREEDY=0 SAMPLE_SEED0=7 SAMPLES=4 REGEN_PAR=4` (T = 0.8 "
                f"seeds 8-11), {g['answer_tokens'] / 1e6:.1f} M answer tokens in a {g['regen_stage_s']:.0f} s "
                f"regeneration stage, {g['tokens_per_s_stage']:,} tok/s including start-ups ({new['sequences']:,} "
                f"sequences, {new['tokens'] / 1e6:.1f} M tokens, a {new['compressed_bytes'] / 1e6:.1f} MB pack), trained "
                f"together with the third continuation's answers (seeds 4-7, its pack unpacked beside it; "
                f"`TRAIN_CACHES=all`): {r['data']['train_rows']:,} sequences, {r['data']['train_tokens'] / 1e6:.1f} M "
                f"tokens. Then {train}. Steps so far: "
                + ", ".join(f"{k} {v:,}" for k, v in r["steps_total"].items()) + ". Its benchmark when it was shipped "
                f"(T = 0, concurrency 1: mean τ {b['mean_tau']:.2f}, {b['mean_speedup']:.2f}×, timed before "
                f"`infer.bench`'s per-task warm-up) was re-run for the shipped-draft tables above.", ""]
        out += _continuation_tables(r)
    r = load("smollm2-continue3-h200.json")
    if r:
        g, pack = r["regen"], r["data"]["pack"]
        prov, train = _continuation_facts(r, "smollm2-continue3-h200.json", "the second continuation's draft")
        out += [("#### Third continuation (the draft shipped before the fourth; its data is reused by the fourth)" if out
                 else "#### The shipped draft: the recipe's DSpine draft trained further, three times, on one H200"), "",
                f"{prov}. Fresh answers: the recipe's data stages with `GREEDY=0 SAMPLE_SEED0=3 SAMPLES=4 REGEN_PAR=4` "
                f"(four new T = 0.8 seeds, no greedy job), {g['answer_tokens'] / 1e6:.1f} M answer tokens in a "
                f"{g['regen_stage_s']:.0f} s regeneration stage, {g['tokens_per_s_stage']:,} tok/s including start-ups; "
                f"{pack['sequences']:,} sequences, {pack['tokens'] / 1e6:.1f} M tokens, a "
                f"{pack['compressed_bytes'] / 1e6:.1f} MB pack. Then {train}. {_shipped_before(r, '8f1ea67')}", ""]
        out += _continuation_tables(r)
    r = load("smollm2-continue2-h200.json")
    if r:
        pack = r["data"]["pack"]
        prov, train = _continuation_facts(r, "smollm2-continue2-h200.json", "the first continuation's draft")
        out += [("#### Second continuation (the draft shipped before the third)" if out else
                 "#### The shipped draft: the recipe's DSpine draft trained further, twice, on one H200"), "",
                f"{prov}. The first continuation's tokenized data again ({pack['sequences']:,} sequences, "
                f"{pack['tokens'] / 1e6:.1f} M tokens, unpacked from its {pack['compressed_bytes'] / 1e6:.1f} MB pack, "
                f"no regeneration), {train}. {_shipped_before(r, 'e39ad58')}", ""]
        out += _continuation_tables(r)
    r = load("smollm2-continue-h200.json")
    if not r:
        return out
    g = r["regen"]
    prov, train = _continuation_facts(r, "smollm2-continue-h200.json", "the recipe's DSpine draft")
    out += ["#### First continuation (the draft shipped before the second; its data is reused by the second)" if out else
            "#### The shipped draft: the recipe's DSpine draft trained further on one H200", "",
            f"{prov}. Fresh data from the recipe's data stages (regeneration with `REGEN_PAR=4`: "
            f"{g['answer_tokens'] / 1e6:.1f} M answer tokens in {g['regen_stage_s']:.0f} s, {g['tokens_per_s_stage']:,} "
            f"tok/s including start-ups, against 544 s one job at a time), then {train}. {_shipped_before(r, '33657e2')}",
            ""]
    return out + _continuation_tables(r)


def lm_head_section() -> list[str]:
    r = load("lm-head-h200.json")
    if not r:
        return []
    out = ["#### LM-head GEMM per row count (`benchmarks/kernels/bench_lm_head.py`)", "",
           f"{r['device']}, {r['date'][:10]}, commit `{r['commit'][:10]}`, [`results/lm-head-h200.json`](results/lm-head-h200.json): "
           "bf16, CUDA-graph replay medians; the engine's start-up pick (`dspine.ops.lm_head.pick`) against `F.linear` "
           "and the fastest candidate.", "",
           "| LM head | M | pick | pick µs | F.linear µs | fastest | fastest µs |", "|---|---|---|---|---|---|---|"]
    best = {}
    for row in r["rows"]:
        k = (row["shape"], row["M"])
        if k not in best or row["us"] < best[k]["us"]:
            best[k] = row
    for p in r["pick"]:
        b = best[(p["shape"], p["M"])]
        out.append(f"| {p['shape']} | {p['M']} | {p['pick']} | {p['pick_graph_us']:.1f} | {p['linear_graph_us']:.1f} | "
                   f"{b['impl']} | {b['us']:.1f} |")
    out += ["", f"Command: `{r['command']}`", ""]
    return out


def hybrid_bench_section() -> list[str]:
    r = load("hybrid-bench-h200.json")
    if not r:
        return []
    keys = ("ar_tok_per_s", "bandwidth_floor_tok_per_s", "ar_fraction_of_floor", "ar_step_ms", "spec_step_ms",
            "oracle_tau", "oracle_speedup_tau7", "cuda_graphs")
    out = ["#### Hybrid target in the engine (27B-class Qwen3.5 layout, random bf16, `benchmarks/engine/bench_hybrid.py`)", "",
           f"{r['device']}, {r['date'][:10]}, commit `{r['commit'][:10]}`, [`results/hybrid-bench-h200.json`](results/hybrid-bench-h200.json).", "",
           "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys),
           "| " + " | ".join(str(round(r[k], 3)) if isinstance(r.get(k), float) else str(r.get(k)) for k in keys) + " |",
           "", f"Command: `{r['command']}`", ""]
    return out


def training_section() -> list[str]:
    t = load("smollm2-cpu-training.json")
    if not t:
        return []
    out = ["#### How the CPU-trained SmolLM2 drafts were made (the drafts shipped before the GPU recipe)", "", t["note"], "",
           "| draft | parameters | steps | final eval loss | τ_sim | τ_real (eval prompts) |", "|---|---|---|---|---|---|"]
    for label, r in t["runs"].items():
        f = r["final_eval"]
        out.append(f"| {label} | {r['parameters']:,} | {r['steps']} | {fmt(f.get('eval/loss'), 3)} | "
                   f"{fmt(f.get('eval/tau_sim'))} | {fmt(f.get('eval/tau_real'))} |")
    out += ["", f"Training curves: ![curves]({t['curves']})", ""]
    out.append("`$SHARED` below is `$DSPINE_SHARED` (default `../shared`).")
    out += [f"- {k}: `{v}`" for k, v in t["commands"].items()]
    out.append("")
    return out


def stories_section() -> list[str]:
    d = load("stories260k-ablation.json")
    if not d:
        return []
    out = ["### stories260K (CPU): DSpine vs the DFlash ablation", "",
           f"Karpathy's stories260K as the target, 2-layer drafts (block 16) trained on 4,096 of the target's own "
           f"samples with identical settings except `injection`; τ_real decodes 16 held-out prompts with the "
           f"reference speculative decoder ({d['device']}, commit `{d['commit'][:10]}`, "
           f"[`results/stories260k-ablation.json`](results/stories260k-ablation.json)).", "",
           "| draft | eval loss | τ_sim | τ_real | accept_at_pos k=1..4 (decoded) |", "|---|---|---|---|---|"]
    for name, label in (("dspine", "DSpine (residual)"), ("dflash", "DFlash (none)")):
        f = d["runs"][name]["final"]
        acc = ", ".join(f"{x:.2f}" for x in f.get("eval/real_accept_at_pos", [])[:4])
        out.append(f"| {label} | {fmt(f['eval/loss'], 3)} | {fmt(f['eval/tau_sim'])} | {fmt(f['eval/tau_real'])} | {acc} |")
    out += ["", f"Command: `{d['command']}`", ""]
    return out


def engine_section() -> list[str]:
    e = load("engine-h200.json")
    if not e:
        return []
    b1, b8 = e["batch1"], e["batch8"]
    c = e["ceilings"]
    ok = lambda good: "met" if good else "**missed**"
    out = [
        "### Engine at Qwen3-8B shape (random bf16 weights, 512-token prompt, 256 new tokens)",
        "",
        f"{e['gpu']}, {e['date'][:10]}, commit `{e['commit'][:10]}`, [`results/engine-h200.json`](results/engine-h200.json). "
        f"Measured ceilings: copy {c['copy_bw_GBps'] / 1000:.2f} TB/s, bf16 GEMM {c['bf16_gemm_tflops']:.0f} TFLOP/s; "
        f"bandwidth floor {e['bandwidth_floor_tok_per_s']:.0f} tok/s ({e['weight_bytes'] / 1e9:.1f} GB of weights).",
        "",
        "| | batch 1 | batch 8 | goal |",
        "|---|---|---|---|",
        f"| AR tok/s (engine, CUDA graphs) | {b1['ar_tok_per_s']:.0f} ({b1['ar_fraction_of_floor']:.0%} of floor) | "
        f"{b8['ar_tok_per_s']:.0f} ({b8['ar_fraction_of_floor']:.0%}) | batch 1 ≥ 85% of floor — "
        f"{ok(b1['ar_fraction_of_floor'] >= 0.85)} |",
        f"| spec step ÷ AR step (draft 16 + verify 16 + accept) | {b1['spec_step_over_ar_step']:.2f} | "
        f"{b8['spec_step_over_ar_step']:.2f} | ≤ 1.20 / ≤ 1.35 — {ok(b1['spec_step_over_ar_step'] <= 1.20)} / "
        f"{ok(b8['spec_step_over_ar_step'] <= 1.35)} |",
        f"| oracle draft, τ = 7: speedup over the engine's AR | {b1['oracle_speedup_tau7']:.2f}× | "
        f"{b8['oracle_speedup_tau7']:.2f}× | batch 1 ≥ 5.5× — {ok(b1['oracle_speedup_tau7'] >= 5.5)} |",
    ]
    if "dspine_step_over_dflash_step" in b1:
        out.append(f"| DSpine step ÷ DFlash step (see the injection table below) | {b1['dspine_step_over_dflash_step']:.3f} | "
                   f"{b8['dspine_step_over_dflash_step']:.3f} | ≤ 1.03 — {ok(b1['dspine_step_over_dflash_step'] <= 1.03)} |")
    carried = e.get("carried_over", {})
    mark = "¹" if carried else ""
    if b1.get("compiled_hf_tok_per_s") is not None:
        out.append(f"| transformers static cache + `torch.compile`, same weights{mark} | "
                   f"{b1['compiled_hf_tok_per_s']:.0f} tok/s | | |")
    if "hf_generate_tok_per_s" in b1:
        b8_hf = f"{b8['hf_generate_tok_per_s']:.1f} tok/s" if "hf_generate_tok_per_s" in b8 else ""
        out.append(f"| transformers `generate`, same weights{mark} | {b1['hf_generate_tok_per_s']:.1f} tok/s | {b8_hf} | |")
    out += ["", f"Command: `{e['command']}`"]
    if e.get("before"):
        b = e["before"]
        out.append(f"Before (commit `{b['commit'][:10]}`, {b['date'][:10]}; {b['note']}): AR batch 1 {b['batch1_ar_tok_per_s']:.0f} "
                   f"tok/s ({b['batch1_ar_fraction_of_floor']:.0%} of floor), spec ÷ AR {b['batch1_spec_step_over_ar_step']:.2f} / "
                   f"{b['batch8_spec_step_over_ar_step']:.2f}, oracle {b['batch1_oracle_speedup_tau7']:.2f}× / "
                   f"{b['batch8_oracle_speedup_tau7']:.2f}×.")
    pdl = load("engine-pdl-h200.json")
    if pdl:
        sm = pdl["summary"]
        ar, orc, ab = sm["batch1_ar_tok_per_s"], sm["batch1_oracle_tok_per_s"], sm["same_machine_ab_batch1"]
        out.append(f"Programmatic dependent launch ([`results/engine-pdl-h200.json`](results/engine-pdl-h200.json), "
                   f"`DSPINE_PDL` 0 off / 1 / 2 / 3, the default's mode at this shape): batch-1 AR {ar['0']:.1f} / {ar['1']:.1f} / {ar['2']:.1f} / "
                   f"{ar['3']:.1f} tok/s, oracle loop {orc['0']} / {orc['1']} / {orc['2']} / {orc['3']} tok/s; off vs "
                   f"default alternated on this run's machine: AR {ab['off_ar_tok_per_s']} → {ab['default_ar_tok_per_s']}, "
                   f"oracle {ab['off_oracle_tok_per_s']} → {ab['default_oracle_tok_per_s']} tok/s. Same bits in every mode. "
                   "The default (`auto`) turns it on for targets of hidden size ≥ 2048 only: at SmolLM2's shape it "
                   "slowed the speculative step (next table's file, `pdl_modes`).")
        ra = e.get("rerun_auto")
        if ra:
            out.append(f"Re-run at `{ra['commit']}` (`auto`, mode {ra['batch1_pdl_mode']} here), another lease: AR batch 1 "
                       f"{ra['batch1_ar_tok_per_s']:.1f} tok/s ({ra['batch1_ar_fraction_of_floor']:.1%} of that run's floor, "
                       f"{ra['bandwidth_floor_tok_per_s']:.0f} tok/s), spec ÷ AR {ra['batch1_spec_step_over_ar_step']:.2f} / "
                       f"{ra['batch8_spec_step_over_ar_step']:.2f}, oracle {ra['batch1_oracle_speedup_tau7']:.2f}×.")
    if carried:
        out.append(f"¹ Not from this command (`--skip-peers` leaves the transformers peers out): carried over from "
                   f"{carried['from']}.")
    if "ar_device_step_ms_in_loop" in b1:
        out += ["", f"Decode loop at batch 1: {b1['ar_decode_ms_per_step']:.2f} ms a token (wall), the device's span of the loop "
                f"{b1['ar_device_loop_ms_per_step']:.2f} ms and its steps {b1['ar_device_step_ms_in_loop']:.2f} ms a step "
                f"(CUDA events around each step), against {b1['ar_step_ms']:.2f} ms for the same graph timed alone. "
                + e.get("loop_note", "")]
    return out + [""]


def tree_extra_rows(v: dict) -> list[str]:
    """The same chain-vs-tree comparison at T = 1, the run before the fused tree kernels, and those kernels' times."""
    out = []
    bud = v.get("smollm2_budgets")
    if bud:
        sm = v["smollm2"]
        out += [f"Every tree in that run (same prompts, alternated per task; {'chain first' if sm.get('chain_first', True) else 'best first'}"
                f" unless marked, `{sm['file']}`): " + ", ".join(
                    f"{e['tree_budget']} nodes{' chain first' if e['chain_first'] else ''}: τ {e['tree_mean_tau']:.2f} "
                    f"({e['tree_tau_over_chain_tau']:.2f}×), tok/s {e['tree_speedup_over_chain']:.2f}×"
                    for e in bud.values()) + ".", ""]
    pol = load(v["tree_policy_cpu"].removeprefix("results/")) if v.get("tree_policy_cpu") else None
    if pol:
        r = pol["tau_over_chain"]
        out += [f"The same rules replayed offline at T = 0 on the CPU ([`{v['tree_policy_cpu']}`]({v['tree_policy_cpu']}), "
                f"`benchmarks/reference/tree_policy.py`, fp32, {pol['num_prompts']} prompts per task, up to "
                f"{pol['max_new_tokens']} tokens; the target's greedy output, the draft's q at every anchor of it): "
                "τ ÷ chain τ with the chain first / best first / best first on calibrated probabilities (Platt scaling "
                "per depth, two folds) at " + ", ".join(
                    f"{n} nodes {r[f'product_forced_N{n}']:.2f} / {r[f'product_free_N{n}']:.2f} / "
                    f"{r[f'calibrated_free_N{n}']:.2f}" for n in pol["budgets"]) + ".", ""]
    before = v.get("smollm2_before")
    for b in before if isinstance(before, list) else [before] if before else []:
        out += [f"{b.get('label', 'Before the fused tree kernels')} (commit `{b['provenance']['commit'][:10]}`, "
                f"{b['num_prompts']} prompts per task): τ {b['chain_mean_tau']:.2f} → {b['tree_mean_tau']:.2f} "
                f"({b['tree_tau_over_chain_tau']:.2f}×), tree tok/s {b['tree_speedup_over_chain']:.2f}× the chain's.", ""]
    t = load(v["tune_file"].removeprefix("results/")) if v.get("tune_file") else None
    if t:
        cand = {(r["B"], r["V"], r["N"]): r for r in t["candidates"]}
        build = {(r["B"], r["N"], r["warps"]): r["us"] for r in t["build"]}
        att = [r for r in t["attention"] if r.get("ok") and r["shape"] == "smollm2" and r["B"] == 1]
        pick = lambda op, T, chunk: min(r["us"] for r in att if (r["op"], r["T"], r["chunk"], r["bm"], r["bn"], r["warps"],
                                                                  r["stages"]) == (op, T, chunk, 64, 64, 4, 3))
        dflt = {(r["op"], r["T"]): r["default_us"] for r in att}
        c32 = cand[(1, 49152, 32)]
        out += [f"What made the tree step faster at 1b55f86 ([`{v['tune_file']}`]({v['tune_file']}), "
                f"`python benchmarks/kernels/tune_tree_step.py`, CUDA-graph µs at batch 1): the per-depth candidates in two "
                f"Triton launches ({c32['fused_us']:.0f} µs against {c32['torch_us']:.0f} for torch's scatter and top-k at "
                f"32 nodes, V 49,152; same candidates, ties to the lower token id); attention split into chunks of 64 keys "
                f"and row tiles of at most 64 (SmolLM2 heads, 600-token context: tree of 32 {dflt[('tree', 32)]:.1f} → "
                f"{pick('tree', 32, 64):.1f} µs a layer, chain verify {dflt[('verify', 16)]:.1f} → {pick('verify', 16, 64):.1f}); "
                f"the tree build with 8 warps from 32 nodes ({build[(1, 32, 4)]:.0f} → {build[(1, 32, 8)]:.0f} µs, "
                f"candidates included).", ""]
    t1 = v.get("smollm2_T1")
    if t1:
        s = t1["summary"]
        mean = lambda n: sum(t[n]["tok_per_s"] for t in t1["tasks"]) / len(t1["tasks"])
        out += [f"Same draft at T = 1 (top_p {t1['top_p']}, top_k {t1['top_k']}), concurrency 1, {t1['num_prompts']} prompts "
                f"per task (commit `{t1['commit'][:10]}`): chain τ {s['chain']['mean_tau']:.2f} "
                f"[{s['chain']['mean_tau_ci95'][0]:.2f}, {s['chain']['mean_tau_ci95'][1]:.2f}], tree τ "
                f"{s['tree']['mean_tau']:.2f} [{s['tree']['mean_tau_ci95'][0]:.2f}, {s['tree']['mean_tau_ci95'][1]:.2f}] "
                f"(95% bootstrap over prompts); tok/s {mean('chain'):.0f} chain, {mean('tree'):.0f} tree. `{t1['command']}`", ""]
    tb = load(v["tree_build_rules"].removeprefix("results/")) if v.get("tree_build_rules") else None
    if tb:
        rows = {(r["B"], r["N"], r["chain_first"]): r for r in tb["rows"]}
        out += [f"Tree build under both rules ([`{v['tree_build_rules']}`]({v['tree_build_rules']}), commit "
                f"`{tb['commit'][:7]}`, `benchmarks/kernels/bench_tree_build.py`: candidates and tree kernel as the engine "
                "runs them, CUDA-graph µs, SmolLM2 vocabulary, K 15), chain first / best first: " + "; ".join(
                    f"B {b}: " + ", ".join(f"{n} nodes {rows[(b, n, True)]['fused_graph_us']:.0f} / "
                                           f"{rows[(b, n, False)]['fused_graph_us']:.0f}" for n in (16, 32, 64))
                    for b in (1, 8)) + f" (the trees equal torch's in {sum(r['equal'] for r in tb['rows'])} of "
                f"{len(tb['rows'])} cases).", ""]
    k = v.get("tree_kernels")
    if k:
        b1 = {r["N"]: r for r in k["build"]["rows"] if r["B"] == 1}
        vs = {(r["N"], r["op"]): r for r in k["verify"]["rows"] if r["B"] == 1}
        out += [f"Tree kernels at batch 1 (commit `{k['build']['commit'][:10]}`, "
                "before the fused candidates above), SmolLM2 vocabulary, inside CUDA graphs (`benchmarks/kernels/bench_tree_build.py`, "
                "`bench_tree_verify.py`; results bitwise equal to the torch references):", "",
                "| nodes | build: torch | build: top-k candidates + fused kernel | of which the kernel | verify T>0: torch | verify T>0: Triton |",
                "|---|---|---|---|---|---|"]
        for n in sorted(b1):
            r = b1[n]
            out.append(f"| {n} | {r['torch_graph_us']:.0f} µs | {r['fused_graph_us']:.0f} µs | {r['kernel_graph_us']:.0f} µs | "
                       f"{vs[(n, 'sample')]['torch_graph_us']:.0f} µs | {vs[(n, 'sample')]['triton_graph_us']:.0f} µs |")
        out.append("")
    return out


def _step_share(steps: dict) -> str:
    """``"chain16 9%, tree16 60%"``: each mode's share of a planner's steps (modes without a step left out)."""
    total = sum(steps.values()) or 1
    return ", ".join(f"{m} {100 * n / total:.0f}%" for m, n in steps.items() if n)


def _planner_steps(p: dict) -> dict:
    """A bench_tree.py planner point's steps per mode, summed over its tasks (``planner_choices_per_task``)."""
    steps: dict = {}
    for task in p.get("planner_choices_per_task", []):
        for mode, e in task.items():
            steps[mode] = steps.get(mode, 0) + e["steps"]
    return steps


def _planner_points_table(pts: list[dict]) -> list[str]:
    """Markdown table of bench_tree.py --planner points: tok/s of each configuration, the planner's ratios, its steps."""
    out = ["| concurrency | T | AR | chain 16 | tree 16 | tree 32 | planner | planner ÷ best fixed (goal ≥ 0.98) | "
           "planner ÷ AR | planner's steps | commit |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in pts:
        steps = _planner_steps(p)
        share = _step_share(steps)
        t16 = (p.get("fixed_tree_tok_per_s") or {}).get("16")
        t32 = p.get("tree_tok_per_s")  # None: no tree ran (bench_tree.py --invariant)
        ok = "met" if p["planner_over_best_static"] >= 0.98 else "**missed**"
        seeds = p.get("seeds") or [0]  # bench_tree.py --seeds: tok/s are the means over that many runs
        temp = (f"{p['temperature']:g}" + (f" ({len(seeds)} seeds)" if len(seeds) > 1 else "")
                + (", invariant" if p.get("invariant") else ""))
        out.append(f"| {p['concurrency']} | {temp} | {p['ar_tok_per_s']:.0f} | {p['chain_tok_per_s']:.0f} | "
                   f"{'–' if t16 is None else f'{t16:.0f}'} | {'–' if t32 is None else f'{t32:.0f}'} | "
                   f"{p['planner_tok_per_s']:.0f} | "
                   f"{_vs_goal(p['planner_over_best_static'])} — {ok} | "
                   f"{p['planner_over_ar']:.3f} | {share} | `{p['provenance']['commit'][:7]}` |")
    return out


def verify_section() -> list[str]:
    v = load("verify-h200.json")
    if not v:
        return []
    sm, sc = v["smollm2"], v["step_cost"]
    ok = lambda good: "met" if good else "**missed**"
    out = ["### Tree verification and the verify-budget planner (issue 16)", "",
           f"{v['gpu']}, [`results/verify-h200.json`](results/verify-h200.json). Chain against tree ({sm['provenance']['date'][:10]}, "
           f"commit `{sm['provenance']['commit'][:10]}`): SmolLM2-135M with the shipped DSpine draft (`checkpoints/smollm2-135m-dspine`), T = 0, concurrency 1, {sm['num_prompts']} prompts per task, "
           f"{sm['max_new_tokens']} new tokens, tree of {sm['tree_budget']} nodes "
           f"({'chain first' if sm.get('chain_first', True) else 'best first, the default at T = 0'}) against the chain of 16:", "",
           "| chain τ | tree τ | tree τ ÷ chain τ (goal ≥ 1.3) | tree tok/s ÷ chain tok/s (goal ≥ 1.15) |", "|---|---|---|---|",
           f"| {sm['chain_mean_tau']:.2f} | {sm['tree_mean_tau']:.2f} | {sm['tree_tau_over_chain_tau']:.2f} — "
           f"{ok(sm['tree_tau_over_chain_tau'] >= 1.3)} | {sm['tree_speedup_over_chain']:.2f} — "
           f"{ok(sm['tree_speedup_over_chain'] >= 1.15)} |", "", *tree_extra_rows(v),
           f"Whole speculative step at Qwen3-8B shape ({sc['provenance']['date'][:10]}, commit `{sc['provenance']['commit'][:10]}`; "
           f"random weights, oracle draft, {sc['prompt_tokens']}-token prompt), "
           "tree step ÷ chain-16 step:", "",
           "| batch | chain 16 | tree 16 | tree 32 | tree 64 |", "|---|---|---|---|---|"]
    for b in ("batch1", "batch8"):
        r = sc[b]
        out.append(f"| {b[5:]} | {r['chain16_step_ms']:.2f} ms | " + " | ".join(
            f"{r[f'tree{n}_step_over_chain16']:.2f}" for n in (16, 32, 64)) + " |")
    out += ["", "Planner (`--budget auto`) against AR, the fixed chain and the fixed trees, the latest run of each point (mean "
            "tok/s over the 5 tasks; best fixed: the best of AR, the chain and every fixed tree of the run; T = 1: top_p "
            "0.95, top_k 20; commit and command of each point in the JSON):", "",
            *_planner_points_table(v["planner"]), "",
            "Command: " + "; ".join(dict.fromkeys(f"`{p.get('provenance', {}).get('command', '?')}`" for p in v["planner"]))]
    if v.get("planner_note"):
        out += ["", v["planner_note"]]
    history = (("planner_2026_12_03", "Each mode decoding its own text (2026-12-03), the eight points before the "
                "same-text runs"),
               ("planner_before_calibration_fix", "T = 0, before the confidence scaling of led trees (same runs' "
                "layout: fixed trees of 16 and 32)"),
               ("planner_plan_trees_16_32", "T = 0, the planner with trees of 16 and 32 (`plan_trees=16/32`), same runs"),
               ("planner_no_confidence", "T = 0, the planner without the draft's confidence (`confidence=never`), same runs"),
               ("planner_plan_trees_16_32_before_fix", "T = 0, trees of 16 and 32, before the confidence fix"),
               ("planner_plan_trees_16_32_64_before_fix", "T = 0, trees of 16, 32 and 64, before the confidence fix"),
               ("planner_before_tree16_in_best", "T = 0, best fixed without the tree of 16 (the previous points)"),
               ("planner_chain_first_in_planner", "T = 0, the planner's trees chain first, the fixed tree best first"),
               ("planner_c8_T0_rerun", "Concurrency 8, T = 0 re-run a minute later (same code)"),
               ("planner_chain_first_trees", "T = 0 with the chain first in every tree (the rule before 69597a3)"),
               ("planner_c8_T0_tree_lead_in_drain", "Concurrency 8, T = 0 on d11cfd7, the trees valued as the chain plus "
                "the batch's lead in the drain"),
               ("planner_session19", "Before the drain rule's spread prior and the probing ceiling narrowed by requests per "
                "step (previous session)"),
               ("planner_c32_c64_before_sync_free_admission", "Concurrency 32 and 64 half an hour earlier, admissions "
                "still waiting for the step in flight"),
               ("planner_drain_2d9218a", "The drain rule, before the step-overhead work (previous session)"),
               ("planner_buckets_every_admission", "Same code an hour earlier, bucketed prefill on every admission"),
               ("planner_c32_T1_no_buckets", "Eager packed prefill"),
               ("planner_before_drain", "Before the drain rule"),
               ("planner_first_paired", "The first paired planner (a bonus on the lead, the confidence at T = 1)"),
               ("planner_before_paired", "Before paired observations"))
    def points(ps):  # one commit for the line, or one per point where they differ
        commits = {p["provenance"]["commit"][:7] for p in ps}
        each = len(commits) > 1
        line = ", ".join(f"c{p['concurrency']} T{p['temperature']:g} {_vs_goal(p['planner_over_best_static'])}"
                         + (f" (`{p['provenance']['commit'][:7]}`)" if each else "") for p in ps)
        return line + ("" if each else f" (`{commits.pop()}`)")

    lines = [f"- {label}: {points(v[key])}" for key, label in history if v.get(key)]
    r = load("verify-planner-h200.json")
    if r:
        lines.append(f"- The rewritten planner before the tree-step speed-ups ([`results/verify-planner-h200.json`]"
                     f"(results/verify-planner-h200.json); {r.get('commit_note', r['commit'][:7])}): " + ", ".join(
                         f"c{p['concurrency']} T{p['temperature']:g} {_vs_goal(p['planner_over_best_static'])}" for p in r["planner"]))
    if lines:
        out += ["", "Planner ÷ best fixed in earlier runs (same points, same JSON unless linked):", "", *lines]
    out += ["", v.get("note", ""), "", "Commands: " + "; ".join(f"`{c}`" for c in v["commands"]), ""]
    return out


def planner_h100_section() -> list[str]:
    """The H100 lease of 2026-12-05: the planner points (verify-h100.json), what its loop costs per mode and per switch
    (planner-switch-h100.json) and the confidence slope A/B (planner-slope-h100.json). Each part is left out when its
    file or its points are missing; a missing value shows as –."""
    v, sw, sl = load("verify-h100.json"), load("planner-switch-h100.json"), load("planner-slope-h100.json")
    pts = (v or {}).get("planner") or []
    loops = (sw or {}).get("points") or []
    slopes = list(((sl or {}).get("points") or {}).values())
    if not (pts or loops or slopes):
        return []
    f3 = lambda x: "–" if x is None else f"{x:.3f}"  # noqa: E731
    first = v if pts else sw if loops else sl
    out = [f"#### The planner on the {first.get('gpu') or first.get('device') or '?'} ({str(first.get('date', ''))[:10]})", ""]
    if pts:
        out += ["[`results/verify-h100.json`](results/verify-h100.json) (`reproduce_h200.sh planner` with `GPU_TAG=h100`; "
                "the file's `commit_note` says what ran): SmolLM2-135M-Instruct with the shipped draft, the planner with its "
                "default trees against AR, the chain and the fixed trees of 16 and 32 in one `infer.bench` run per point, "
                "alternated per task (T = 1: top_p 0.95, top_k 20)." + (f" {v['note']}" if v.get("note") else ""), "",
                *_planner_points_table(pts), "",
                "Command: " + "; ".join(dict.fromkeys(f"`{p.get('provenance', {}).get('command', '?')}`" for p in pts)), ""]
    shown = {_point_key(p) for p in (load("verify-h200.json") or {}).get("planner") or []}
    for name, how in FAIR_FILES:
        vx = load(name)
        fair = (vx or {}).get("planner") or []
        if fair and not all(_point_key(p) in shown for p in fair):  # else verify-h200.json's table shows them
            out += [f"The planner on the same text in every mode, {vx.get('gpu') or '?'} ([`results/{name}`](results/{name}), "
                    f"`reproduce_h200.sh planfair`): {how}, so the ratios compare the same work."
                    + (f" {vx['note']}" if vx.get("note") else ""), "", *_planner_points_table(fair), "",
                    "Command: " + "; ".join(dict.fromkeys(f"`{p.get('provenance', {}).get('command', '?')}`"
                                                          for p in fair)), ""]
    if loops:
        swx = load("planner-switch-exact-h100.json")  # the same in exact mode (stage planexact), where it ran
        runs = [("fast", sw, "planner-switch-h100.json")] + ([("exact", swx, "planner-switch-exact-h100.json")]
                                                             if swx and swx.get("points") else [])
        ratios = [p.get(k) for _, r, _ in runs for p in r["points"]
                  for k in ("planner_ar_over_ar", "planner_chain_over_chain", "planner_tree_over_tree")]
        ratios = [x for x in ratios if x is not None]
        out += [f"What the planner's loop costs with one mode and with two in turn ({sw.get('gpu') or sw.get('device')}, "
                f"random weights at SmolLM2 shape, {sw.get('context')}-token prompts, {sw.get('new_tokens')} new tokens, "
                f"median of {sw.get('reps')}): the "
                f"planner's loop running only AR, only the chain or only the tree of {sw.get('switch_tree')} against the "
                "engine running that mode without it, and the chain and the tree in turn against the mean of each alone "
                "(decode tok/s ratios, wall time on both sides)"
                + (f"; one mode costs the loop at most {1 - min(ratios):.1%} of a step" if ratios else "")
                + ":", "",
                "| mode | batch | planner AR ÷ AR | planner chain ÷ chain | planner tree ÷ tree | switch ÷ mean | file, commit |",
                "|---|---|---|---|---|---|---|"]
        for how, r, name in runs:
            for p in r["points"]:
                out.append(f"| {how} | {p.get('batch')} | {f3(p.get('planner_ar_over_ar'))} | "
                           f"{f3(p.get('planner_chain_over_chain'))} | {f3(p.get('planner_tree_over_tree'))} | "
                           f"{f3(p.get('switch_over_mean'))} | [`{name}`](results/{name}) `{r['commit'][:7]}` |")
        out += ["", "Commands: " + "; ".join(f"`{r.get('command')}`" for _, r, _ in runs), ""]
    if slopes:
        out += ["The confidence slope A/B (`p`: `conf_slope=auto`, the default; `p1`: `conf_slope=1`, the rule before "
                "it), each ÷ the best fixed label of the same run (AR, chain, trees of 16 and 32), and the planner's mean "
                "step time per mode (CUDA events) ÷ the fixed run's wall time per step of that mode, admissions included "
                "(two statistics: the loop's own cost is the table above) "
                "([`results/planner-slope-h100.json`](results/planner-slope-h100.json), T = 0):", "",
                "| mode | concurrency | best fixed | p ÷ best | p1 ÷ best | p's steps | p's step ms ÷ fixed, per mode |",
                "|---|---|---|---|---|---|---|"]
        for p in slopes:
            rel, steps = p.get("planner_over_best_fixed") or {}, (p.get("planner_steps") or {}).get("p", {})
            share = _step_share(steps)
            ratios = (p.get("planner_step_ms_over_fixed") or {}).get("p", {})
            ms = ", ".join(f"{m} {r['ratio']:.3f}" for m, r in ratios.items())
            out.append(f"| {'exact' if p.get('exact') else 'fast'} | {p.get('concurrency')} | {p.get('best_fixed')} | "
                       f"{f3(rel.get('p'))} | {f3(rel.get('p1'))} | {share or '–'} | {ms or '–'} |")
        out += ["", f"Command: `{sl.get('command')}` over the `infer.bench` runs of `reproduce_h200.sh planslope` (their "
                "commands in the files).", ""]
    return out


def _chain_points_table(files: tuple[str, ...], before_files: tuple[str, ...], before_col: str) -> list[str]:
    """One row per planner point of ``files`` (bench_tree.py records): AR tok/s, the full chain, the fixed narrower
    chains and the planner ÷ AR, the planner ÷ best fixed against the 0.98 goal, its steps, and the planner ÷ AR of the
    same point in ``before_files`` (column ``before_col``). Empty without points."""
    pts = [(name, p) for name in files for p in ((load(name) or {}).get("planner") or [])]
    if not pts:
        return []
    before = {(p["concurrency"], p["temperature"]): p for name in before_files
              for p in ((load(name) or {}).get("planner") or [])}
    widths = sorted({int(n) for _, p in pts for n in (p.get("fixed_chain_tok_per_s") or {})})
    r = lambda x, a: "–" if x is None else f"{x / a:.3f}"  # noqa: E731
    out = ["| concurrency | T | AR tok/s | chain 16 ÷ AR | " + " | ".join(f"chain {n} ÷ AR" for n in widths)
           + f" | planner ÷ AR | planner ÷ best fixed (goal ≥ 0.98) | planner's steps | {before_col} | file, commit |",
           "|---|---|---|---|" + "---|" * len(widths) + "---|---|---|---|---|"]
    for name, p in pts:
        a, fixed = p["ar_tok_per_s"], p.get("fixed_chain_tok_per_s") or {}
        old = before.get((p["concurrency"], p["temperature"]))
        seeds = p.get("seeds") or [0]
        temp = (f"{p['temperature']:g}" + (f" ({len(seeds)} seeds)" if len(seeds) > 1 else "")
                + (", invariant" if p.get("invariant") else ", exact" if p.get("exact") else ""))
        ok = "met" if p["planner_over_best_static"] >= 0.98 else "**missed**"
        out.append(f"| {p['concurrency']} | {temp} | {a:.0f} | {r(p['chain_tok_per_s'], a)} | "
                   + " | ".join(r(fixed.get(str(n)), a) for n in widths)
                   + f" | {p['planner_over_ar']:.3f} | {_vs_goal(p['planner_over_best_static'])} — {ok} | "
                   f"{_step_share(_planner_steps(p))} | "
                   f"{r(None if old is None else old['planner_tok_per_s'], (old or {}).get('ar_tok_per_s', 1))} | "
                   f"[`{name}`](results/{name}) `{p['provenance']['commit'][:7]}` |")
    out += ["", "Command: " + "; ".join(dict.fromkeys(f"`{p.get('provenance', {}).get('command', '?')}`" for _, p in pts)),
            ""]
    return out


CHAINS_FILES = ("verify-chains-invariant-h100.json", "verify-chains-exact-h100.json")


def planner_chains_section() -> list[str]:
    """The planner's narrower chains (``plan_chains``) on the H100 (verify-chains-{invariant,exact}-h100.json), beside
    the planner of the same card without narrower chains (verify-invariant-h100.json / verify-exact-h100.json, same
    point) where one ran. Empty without those files."""
    table = _chain_points_table(CHAINS_FILES, ("verify-invariant-h100.json", "verify-exact-h100.json"),
                                  "planner ÷ AR without narrower chains")
    if not table:
        return []
    return ["#### Narrower chains in the planner (issue 16)", "",
            "A chain narrower than the draft's block (`plan_chains`, default 2/4/8; `infer.bench --config LABEL:width=N` "
            "for a fixed one) drafts the whole block and verifies its first N slots: at high concurrency the verify "
            "rows (batch × width) set the step's time and a weak draft's deep slots are seldom accepted. SmolLM2-135M-"
            "Instruct with the shipped draft, 5 tasks, 512 new tokens, every configuration in one `infer.bench` run per "
            "point, alternated per task; tok/s ÷ AR's of the same run, and the planner of the same card without narrower "
            "chains at the same point (an earlier run, other commit):", ""] + table


TOPK_FILES = ("verify-topk-invariant-h100.json", "verify-topk-exact-h100.json")


def planner_topk_section() -> list[str]:
    """The top-k kernel (``dspine.ops.topk``): its microbenchmark (topk-h100.json, topk-qwen3-vocab-h100.json) and the
    planner points measured with it (verify-topk-{invariant,exact}-h100.json) beside the same card's points before it
    (the narrower-chains files). Empty without the files."""
    out = []
    benches = [(name, r) for name in ("topk-h100.json", "topk-qwen3-vocab-h100.json") if (r := load(name))]
    if benches:
        out += ["#### The top-k cut at T > 0 in one kernel", "",
                "At T > 0 with top_k, every verified row's logits go through the top-k cut (the target's batch × width "
                "rows, the draft's batch × (width - 1), an AR step's batch). The torch path ran `topk` over int64 "
                "order keys, 32 radix passes over 8 bytes per vocabulary entry; `dspine.ops.topk` reads the logits "
                "once and keeps each chunk's k largest keys in registers, the same ids (checked before timing). µs per "
                "call in CUDA graph replays, bf16 logits, k = 20; whole `logits_to_probs` in the last two columns:", "",
                "| vocabulary | rows | torch top-k µs | kernel µs | × | torch `logits_to_probs` µs | kernel µs | × | file |",
                "|---|---|---|---|---|---|---|---|---|"]
        for name, r in benches:
            for p in r["points"]:
                out.append(f"| {r['vocab']:,} | {p['rows']} | {p['torch_topk_us']:.0f} | {p['kernel_topk_us']:.0f} | "
                           f"{p['topk_speedup']:.2f} | {p['torch_probs_us']:.0f} | {p['kernel_probs_us']:.0f} | "
                           f"{p['probs_speedup']:.2f} | [`{name}`](results/{name}) `{r['commit'][:7]}` {r['gpu']} |")
        out += ["", "Commands: " + "; ".join(f"`{r['command']}`" for _, r in benches), ""]
    table = _chain_points_table(TOPK_FILES, CHAINS_FILES,
                                  "planner ÷ AR before the kernel")
    if table:
        out += ["The planner points with the kernel (H100, one lease; T = 1 with one seed; AR and every fixed mode take "
                "the kernel too, so AR's tok/s moved as well; the T = 0 points run no top-k: they are this card's first "
                "full T = 0 set with the narrower chains, and the step after deferred prompts timed without their "
                "write):", ""] + table
    return out


DRAINFED_FILES = ("verify-drainfed-invariant-h100.json", "verify-drainfed-exact-h100.json")


def planner_drainfed_section() -> list[str]:
    """The planner points with the narrower chains' steps feeding the drain statistics (DRAINFED_FILES) beside the
    same card's points before that change (TOPK_FILES). Empty without the files."""
    table = _chain_points_table(DRAINFED_FILES, TOPK_FILES, "planner ÷ AR before")
    if not table:
        return []
    return ["#### The drain rule with the narrower chains' statistics", "",
            "With as many prompts as slots, all are admitted at once and the drain rule (finish the batch's slowest "
            "request soonest) is in force from the first step. Its per-request acceptance statistics counted full-width "
            "chain steps only, so where the planner ran only narrower chains it judged every mode on the prior spread "
            "and chose AR. Narrower chains' steps now feed those statistics, cut at the chain's width. Same setting as "
            "the table above (H100, one lease, T = 1 with one seed); last column: the planner of the top-k kernel's "
            "lease at the same point:", ""] + table


# the eight points at the drain refresh timing fix, then a repeat of one point in the same lease
REFRESH_FILES = ("verify-refresh-invariant-h100.json", "verify-refresh-exact-h100.json",
                 "verify-refresh-exact-rep2-h100.json")


def _gpu_tests_sentence(name: str, what: str) -> str:
    """The sentence naming a GPU test record of results/ (``name``): ``what``, then its commit, passed and failed counts
    and a link; ``what`` opens the parenthesis the commit closes. Empty without the file."""
    g = load(name)
    return (f" {what}, commit `{g['commit'][:7]}`): {g['passed']} passed, {g['failed']} failed "
            f"([`{name}`](results/{name})).") if g else ""


def planner_refresh_section() -> list[str]:
    """The planner points with a drain refresh's host time left out of the step (REFRESH_FILES, commit fd30777 and
    later) beside the same card's points before (DRAINFED_FILES), and the CUDA case of that fix's test
    (gpu-tests-refresh-h100.json) where it ran. Empty without the points."""
    table = _chain_points_table(REFRESH_FILES, DRAINFED_FILES, "planner ÷ AR before")
    if not table:
        return []
    test = _gpu_tests_sentence("gpu-tests-refresh-h100.json", "The CUDA case of the fix's test "
                               "(`tests/test_planner_defer.py::test_a_drain_refresh_is_no_steps_time`")
    return ["#### The drain refresh's host time left out of the step", "",
            "A drain refresh (the drain rule's host work before a step's launch, every 8 steps once no prompt waits) "
            "can outlast the step in flight and leave the GPU waiting; that wait was charged to the mode chosen with "
            "the refresh. Since commit fd30777 the wait, up to the refresh's host time, is left out of that step's "
            "time. Same setting as the two tables above (H100, one lease, T = 1 with one seed; a file with `rep2` "
            "repeats one point in the same lease); last column: the planner of the drain-statistics lease at the "
            "same point." + test, ""] + table


FUSED_FILES = ("verify-fused-exact-h100.json",)  # the same-text points at T = 0 with the inner-tree count fused


def planner_fused_section() -> list[str]:
    """The same-text planner points at concurrency 1 and 8, T = 0, exact (FUSED_FILES, commit 3ada141: the inner-tree
    count in plan_stats' one launch, a8c8de2) beside the refresh fix's points (REFRESH_FILES). Empty without them."""
    table = _chain_points_table(FUSED_FILES, REFRESH_FILES, "planner ÷ AR at the refresh fix")
    if not table:
        return []
    test = _gpu_tests_sentence("gpu-tests-plan-stats-h100.json", "The GPU tests of the fused count "
                               "(`tests/test_kernels_plan_stats.py`, `tests/test_engine_confidence.py`")
    return ["#### The planner with the inner-tree count fused into one launch", "",
            "A planner tree step counted what its smaller trees inside it accepted in about 10 torch launches inside "
            "the step's graph; since a8c8de2 `dspine.ops.plan_stats` writes them in its one launch. The two T = 0 "
            "points where the planner's own cost mattered most, exact mode (every mode decodes AR's greedy text; H100, "
            "one lease); last column: the planner of the refresh fix's lease at the same point." + test, ""] + table


def _pooled_rates(r: dict | None, labels: tuple[str, ...]) -> tuple[dict, dict] | None:
    """An infer.bench file's tok/s per label pooled over its tasks (their tokens over their seconds, AR included), and
    per task ``{task: {label: (tokens, tok/s)}}``. None for a missing file, a run cut short, or a task without AR and
    every label of ``labels`` (its labels would pool other tasks)."""
    if not r or r.get("interrupted") or not r.get("tasks") or not all(
            "ar" in t and all(k in t["drafts"] for k in labels) for t in r["tasks"]):
        return None
    tok, sec, per_task = {}, {}, {}
    for t in r["tasks"]:
        for label, d in [*t["drafts"].items(), ("ar", t["ar"])]:
            tok[label] = tok.get(label, 0) + d["num_tokens"]
            sec[label] = sec.get(label, 0.0) + d["seconds"]
            per_task.setdefault(t["task"], {})[label] = (d["num_tokens"], d["num_tokens"] / d["seconds"])
    return {k: tok[k] / sec[k] for k in tok}, per_task


def _ab_table(names: dict, runs: tuple[str, ...], labels: tuple[str, ...], heads: tuple[str, ...],
              optional: tuple[str, ...] = ()) -> tuple[list, list]:
    """The table of a planner A/B over ``infer.bench`` files (AR, ``chain``, ``chain4`` and the planner labels
    ``labels``, headed ``heads``): one row per run that holds every label but the ``optional`` ones (– where a run
    lacks one; a mean only over more than one run) (``names``: {(concurrency, run): file name},
    concurrencies in the order given), each label's pooled tok/s and each planner ÷ the chain of 4, then a mean row per
    concurrency of more than one run. Returns (the rows, [(concurrency, run, name, file, rate, per_task)]); ([], [])
    without a run."""
    rows = []
    for (c, run), name in names.items():
        r = load(name)
        got = _pooled_rates(r, ("chain", "chain4", *(a for a in labels if a not in optional)))
        if got:
            rows.append((c, run, name, r, *got))
    if not rows:
        return [], []
    n = len(labels)
    out = ["| concurrency | run | AR | chain 16 | chain 4 | " + " | ".join(heads) + " | "
           + " | ".join(f"{a} ÷ chain 4" for a in labels) + " | file, commit |", "|---" * (5 + 2 * n) + "|---|"]
    for c, run, name, r, rate, _ in rows:
        out.append(f"| {c} | {runs.index(run) + 1} | {rate['ar']:.0f} | {rate['chain']:.0f} | {rate['chain4']:.0f} | "
                   + " | ".join(f"{rate[a]:.0f}" if a in rate else "–" for a in labels) + " | "
                   + " | ".join(f"{rate[a] / rate['chain4']:.3f}" if a in rate else "–" for a in labels)
                   + f" | [`{name}`](results/{name}) `{r['commit'][:7]}` |")
    for c in dict.fromkeys(c for c, _ in names):
        sel = [rate for cc, _, _, _, rate, _ in rows if cc == c]
        if len(sel) > 1:  # one run: its row is the mean
            mean = {k: [x[k] / x["chain4"] for x in sel if k in x] for k in labels}
            out.append(f"| {c} | mean of {len(sel)} | | | |" + " |" * n + " "
                       + " | ".join(f"{sum(m) / len(m):.3f}" if len(m) > 1 else "–" for m in mean.values()) + " | |")
    return out, rows


PERSIST_RUNS = ("", "-rep2", "-rep3")  # planner-persist-h100-exact-T0-c{C}{RUN}.json: one lease, three runs a point


def planner_persist_section() -> list[str]:
    """The drain model A/B (``p``: the default; ``pp``: ``drain=persist``) beside AR and the fixed chains of 16 and 4,
    T = 0, exact, concurrency 64 and 32, three runs a point (results/planner-persist-h100-exact-T0-c*.json). Each run's
    tok/s pools the five tasks: their tokens over their seconds. Empty without the files."""
    names = {(c, run): f"planner-persist-h100-exact-T0-c{c}{run}.json" for c in (64, 32) for run in PERSIST_RUNS}
    table, rows = _ab_table(names, PERSIST_RUNS, ("p", "pp"), ("p (scaled, the default then)", "pp (persist)"))
    if not rows:
        return []
    return ["#### The drain model `persist` against the default then, `scaled` (A/B, three runs a point)", "",
            "`--config pp:budget=auto,drain=persist` judges the spread in acceptance between a batch's requests by how "
            "much of each request's early acceptance persists later (covariance of the two means) instead of by the "
            "early spread itself. With as many prompts as slots the drain rule is in force from the first step. "
            "SmolLM2-135M-Instruct with the shipped draft, T = 0, `--exact` (every label decodes AR's greedy text), 64 "
            "prompts a task, 512 new tokens, one H100 lease, each point run three times; tok/s pools the five tasks "
            "(their tokens over their seconds). `persist` became the default after the A/B of 2026-12-07 (below), so "
            "`p:budget=auto` in these commands now runs `persist`; `drain=scaled` reproduces this `p`:", "", *table,
            "", "Commands: " + "; ".join(dict.fromkeys(f"`{r['command']}`" for _, _, _, r, _, _ in rows))
            + ". Step logs: [`plan-logs-h100-2026-12-06-persist.tar.xz`](results/plan-logs-h100-2026-12-06-persist.tar.xz).",
            ""]


MIX_RUNS = ("", "-r2")  # planner-mix-GPU-exact-T0-c{C}{RUN}.json: a0f4220, then 3bfb1d4 (persist_cap added)


def planner_mix_section() -> list[str]:
    """Stage planmix (results/planner-mix-GPU-exact-T0-c{64,32}{RUN}.json, the H200's if there, else the H100's): the
    default drain model p (persist), ps (drain=scaled) and, where a file has it, pc (drain=persist_cap) ÷ the chain
    of 4 on mixed batches (``infer.bench --mix``), a row per run. Empty without the files."""
    gpu = "h200" if load("planner-mix-h200-exact-T0-c64.json") else "h100"
    names = {(c, run): f"planner-mix-{gpu}-exact-T0-c{c}{run}.json" for c in (64, 32) for run in MIX_RUNS}
    heads = {"p": "p (persist, the default)", "ps": "ps (scaled)", "pc": "pc (persist_cap)"}
    if not any("pc" in t["drafts"] for n in names.values() for t in (load(n) or {}).get("tasks") or []):
        heads.pop("pc")  # runs before persist_cap (a0f4220)
    table, rows = _ab_table(names, MIX_RUNS, tuple(heads), tuple(heads.values()), optional=("pc",))
    if not rows:
        return []
    return ["#### The drain models on mixed batches", "",
            "`infer.bench --mix` takes the five tasks' prompts in turn, so every batch holds requests of every task, as "
            "a server's traffic does (the tables above run each task alone). The default `persist` (`p`) against "
            "`scaled` (`ps`, `--config ps:budget=auto,drain=scaled`) beside AR and the fixed chains of 16 and 4; stage "
            f"`planmix` of `scripts/reproduce_h200.sh` (SmolLM2-135M-Instruct with the shipped draft, T = 0, `--exact`, "
            f"64 prompts a task, 512 new tokens, each run a {gpu.upper()} lease of its own). `persist`'s loss at 64 is in "
            "mt-bench's second-turn call, a batch of one task that starts from the spread the mixed call left as its "
            "prior (docs/planner.md, \"Drain\"); `persist_cap` (opt-in, `pc`) takes that prior only up to the "
            "no-call one:", "", *table, "",
            "Commands: " + "; ".join(dict.fromkeys(f"`{r['command']}`" for _, _, _, r, _, _ in rows)), ""]


def planner_state_section() -> list[str]:
    """Stage planstate (results/planner-state-h100-{exact-T0-c64,invariant-T1-c32}.json): the planner's state and
    drain lengths, p (the default), pk (state=kv), pl (drain=persist_len, since removed) and pkl (both) beside AR and
    the fixed chains of 16 and 4, one run a point. Empty without the files."""
    names = {(64, ""): "planner-state-h100-exact-T0-c64.json", (32, ""): "planner-state-h100-invariant-T1-c32.json"}
    labels = ("p", "pk", "pl", "pkl")
    table, rows = _ab_table(names, ("",), labels, ("p (steps, persist)", "pk (kv)", "pl (persist_len)", "pkl (both)"))
    if not rows:
        return []
    c64 = load(names[(64, "")])
    share = ""
    if c64:  # each planner's seconds over the chain of 4, and the part of them spent on mt-bench
        over = {lab: [(t["task"], t["drafts"][lab]["seconds"] - t["drafts"]["chain4"]["seconds"]) for t in c64["tasks"]]
                for lab in labels if all(lab in t["drafts"] and "chain4" in t["drafts"] for t in c64["tasks"])}
        parts = [f"{lab} {sum(x for k, x in v if k == 'mt-bench') / sum(x for _, x in v):.0%}" for lab, v in over.items()
                 if sum(x for _, x in v) > 0]
        share = f" ({', '.join(parts)} of each planner's seconds over the chain of 4)" if parts else ""
    return ["#### The planner's state and drain lengths at the two points the default missed (A/B, one run a point)", "",
            "Stage `planstate` of `scripts/reproduce_h200.sh` with `RUNS=1` on one H100 (2026-12-07; an H200 was asked "
            "for): concurrency 64 at T = 0 in exact mode and concurrency 32 at T = 1 with drafter-invariant "
            "verification (top-p 0.95, top-k 20), SmolLM2-135M-Instruct with the shipped draft, 64 prompts a task, 512 "
            "new tokens; tok/s pools the five tasks. The chain of 4 is the best fixed mode at both. `persist_len` lost "
            "at 64 and gained nothing at 32, and was removed. At 64 most of the planners' loss is on mt-bench"
            f"{share}, whose first turn every planner ran on the chain of 2 (324 steps; pk 2 of them on AR): the "
            "chain of 4 was priced as the chain of 2 plus a lead "
            "of 0.23 tokens carried from the last steps of mbpp's call, where one to four requests were left "
            "(`plan_log.py LOG --leads`: 0.89 with each step weighed by its requests; replayed under `rows_kv`, "
            "`plan_log.py LOG --label p --replay-state rows_kv`, the turn opens with the chain of 4; docs/planner.md, "
            "\"State\"). "
            "The planfair points with `PLAN_STATE=kv` follow in the table above (`verify-statekv-*-h100.json`).", "",
            *table, "", "Commands: " + "; ".join(dict.fromkeys(f"`{r['command']}`" for _, _, _, r, _, _ in rows))
            + ". Step logs: [`plan-logs-h100-2026-12-07-state.tar.xz`](results/plan-logs-h100-2026-12-07-state.tar.xz).",
            "", *_state_replay_sentence()]


def _state_replay_sentence() -> list[str]:
    """The states replayed over the CPU trace at the concurrency-64 run's step times (results/state-replay-c64-cpu.json,
    benchmarks/reference/planner_trace.py replay --state); empty without the file."""
    r, low = load("state-replay-c64-cpu.json"), load("state-replay-c1-c8-cpu.json")
    if not r:
        return []
    pts = ", ".join(f"`{p['state']}` {p['planner_over_best_fixed']:.4f}" for p in r["points"])
    out = [f"Replayed over the CPU trace of the shipped draft's acceptance (16 prompts a task, each decoded 4 times "
           f"over, constant step times: the run's): planner ÷ the chain of 4 {pts} "
           f"([`state-replay-c64-cpu.json`](results/state-replay-c64-cpu.json); its mbpp tail does not drag the lead "
           f"down as the GPU run's did). Command: `{r['command']}`."]
    if low:  # the same trace at concurrency 1 and 8 with the H200 runs' step times (trees 16 and 32, no narrow chains)
        pts = "; ".join(f"concurrency {p['concurrency']} ({Path(p['costs']).name}) `{p['state']}` "
                        f"{p['planner_over_best_fixed']:.4f}" for p in low["points"])
        out.append(f"At concurrency 1 and 8 with H200 step times, planner ÷ the best fixed mode: {pts} "
                   f"([`state-replay-c1-c8-cpu.json`](results/state-replay-c1-c8-cpu.json); command: "
                   f"`{low['command']}`).")
    return [" ".join(out), ""]


COST_RUNS = ("", "-r2", "-r3")  # planner-cost{RUN}-h100-exact-T0-c{C}.json: one lease, three runs a point


def _range(xs: list[float], f: str = ".3f") -> str:
    lo, hi = format(min(xs), f), format(max(xs), f)
    return lo if lo == hi else f"{lo}-{hi}"


def _per_task_sentence(c: int, sel: list[tuple[dict, dict]], label: str) -> str:
    """Per task, ``label`` ÷ the chain of 4 over the runs ``sel`` ([(rate, per_task)]) at concurrency ``c``, the
    tok/s of both on the task where it is lowest, and that task's share of the tokens and of ``label``'s seconds over
    the chain of 4's (each task's seconds less its tokens at the chain of 4's tok/s on that task: exact mode, every
    label decodes the same tokens)."""
    tasks = [t for t in sel[0][1] if all(t in pt for _, pt in sel)]  # the tasks of every run
    ratio = {t: [pt[t][label][1] / pt[t]["chain4"][1] for _, pt in sel] for t in tasks}
    worst = min(tasks, key=lambda t: min(ratio[t]))
    shares = []
    for _, pt in sel:
        extra = {t: pt[t][label][0] / pt[t][label][1] - pt[t][label][0] / pt[t]["chain4"][1] for t in tasks}
        if sum(extra.values()) > 0:
            shares.append(100 * extra[worst] / sum(extra.values()))
    total = sum(sel[0][1][t][label][0] for t in tasks)
    return (f"Concurrency {c}, {label} ÷ chain 4 per task over the {len(sel)} runs: "
            + ", ".join(f"{t} {_range(ratio[t])}" for t in tasks)
            + f". On {worst} {label} ran {_range([pt[worst][label][1] for _, pt in sel], ',.0f')} tok/s against the "
            f"chain of 4's {_range([pt[worst]['chain4'][1] for _, pt in sel], ',.0f')}; {worst} holds "
            f"{sel[0][1][worst][label][0]:,} of the {total:,} tokens"
            + (f" and {_range(shares, '.0f')}% of the time {label} lost to the chain of 4" if shares else "") + ".")


def planner_cost_section() -> list[str]:
    """The cost model A/B (``p``: the default, cost model ``own``; ``pc``: ``cost=age``) beside AR and the fixed
    chains of 16 and 4, T = 0, exact, concurrency 64 and 32, three runs a point
    (results/planner-cost{,-r2,-r3}-h100-exact-T0-c*.json), tasks pooled as in planner_persist_section, and per task
    where the default loses to the chain of 4. Empty without the files."""
    names = {(c, run): f"planner-cost{run}-h100-exact-T0-c{c}.json" for c in (64, 32) for run in COST_RUNS}
    table, rows = _ab_table(names, COST_RUNS, ("p", "pc"), ("p (own)", "pc (age)"))
    if not rows:
        return []
    per_task = [x for c in (64, 32) if (sel := [(rate, pt) for cc, _, _, _, rate, pt in rows if cc == c])
                for x in (_per_task_sentence(c, sel, "p"), "")]
    return ["#### The cost model `age` against the default `own` (A/B, three runs a point)", "",
            "The planner prices each mode by its measured ÷ table step time, updated only when the mode is timed, so a "
            "price a burst of slow steps set stays while the mode is not chosen. `--config pc:budget=auto,cost=age` "
            "moved an untimed mode's price towards the median of its own last 64 timings (weight 1 − exp(−age ÷ 32 "
            "steps)); it was removed after this A/B, and the commit in each file still has it. Same setting as the table above (SmolLM2-135M-Instruct with the shipped draft, T = 0, `--exact`, "
            "64 prompts a task, 512 new tokens, one H100 lease; `reproduce_h200.sh plancost` with `RUNS=2`, then "
            "`RUNS=3`, which ran the third run only); tok/s pools the five tasks:", "", *table, "", *per_task,
            "The step logs of the three concurrency 64 runs "
            "([`plan-logs-h100-2026-12-07-cost.tar.xz`](results/plan-logs-h100-2026-12-07-cost.tar.xz), "
            "`plan_log.py LOG --pass timed --per-call`) show where: on mt-bench's first turn both planners ran AR and "
            "the chain of 2 under the drain rule, never the chain of 4 (the step counts and why: docs/status.md, "
            "\"Why the default misses at concurrency 64, T = 0\").", "",
            "Commands: " + "; ".join(dict.fromkeys(f"`{r['command']}`" for _, _, _, r, _, _ in rows)), ""]


EST_RUNS = ("", "-r2", "-r3")  # planner-est{RUN}-{gpu}-exact-T0-c{C}.json: stage planest, up to three runs a point


def _est_c1_table(gpu: str) -> tuple[list, list]:
    """Concurrency 1 of stage planest: AR, the chain of 16, the fixed tree of 32 and the planner p per run, p ÷ the
    tree of 32 pooled and on the task where it is lowest. Returns (rows, files)."""
    out, files = [], []
    for run in EST_RUNS:
        name = f"planner-est{run}-{gpu}-exact-T0-c1.json"
        r = load(name)
        got = _pooled_rates(r, ("chain", "tree32", "p"))
        if not got:
            continue
        rate, pt = got
        files.append(r)
        worst = min(pt, key=lambda t: pt[t]["p"][1] / pt[t]["tree32"][1])
        out.append(f"| 1 | {EST_RUNS.index(run) + 1} | {rate['ar']:.0f} | {rate['chain']:.0f} | {rate['tree32']:.0f} | "
                   f"{rate['p']:.0f} | {rate['p'] / rate['tree32']:.3f} | {worst} "
                   f"{pt[worst]['p'][1] / pt[worst]['tree32'][1]:.3f} | [`{name}`](results/{name}) `{r['commit'][:7]}` |")
    if out:
        out = ["| concurrency | run | AR | chain 16 | tree 32 | p | p ÷ tree 32 | lowest task | file, commit |",
               "|---|---|---|---|---|---|---|---|---|", *out]
    return out, files


def planner_est_section(gpu: str | None = None) -> list[str]:
    """Stage planest (results/planner-est{,-r2,-r3}-GPU-exact-T0-c{64,1}.json): at concurrency 64 the default planner
    p, pp (drain=persist) and pr (drain=relative) ÷ the chain of 4, tasks pooled as in planner_persist_section; at
    concurrency 1 the planner ÷ the fixed tree of 32 with the inner-tree count fused into plan_stats. ``gpu`` None:
    the H200's files, else the H100's. Empty without the files."""
    if gpu is None:
        return planner_est_section("h200") or planner_est_section("h100")
    names = {(64, run): f"planner-est{run}-{gpu}-exact-T0-c64.json" for run in EST_RUNS}
    table, rows = _ab_table(names, EST_RUNS, ("p", "pp", "pr"), ("p (scaled)", "pp (persist)", "pr (relative)"))
    c1, c1_files = _est_c1_table(gpu)
    if not rows and not c1:
        return []
    per_task = [x for lab in ("p", "pp", "pr") if rows
                for x in (_per_task_sentence(64, [(rate, pt) for _, _, _, _, rate, pt in rows], lab), "")]
    files = [r for _, _, _, r, _, _ in rows] + c1_files
    return ["#### The drain models `persist` and `relative` against `scaled`, and the planner at concurrency 1 with the "
            "inner-tree count fused", "",
            "At commit 3ada141 the default drain model was `scaled`; `pp` is `--config pp:budget=auto,drain=persist` (the "
            "spread between requests from the covariance of their early and later acceptance), `pr` "
            "`--config pr:budget=auto,drain=relative` (`scaled` with the spread carried to the next call relative to the "
            "pooled acceptance squared, not in tokens²). `persist` led `scaled` in all three runs and `relative` in all "
            "three, and became the default; `relative` was removed (docs/planner.md, \"Drain\"), so these commands' "
            "`drain=relative` is refused now and their `p:budget=auto` runs `persist`. Stage `planest` of "
            "`scripts/reproduce_h200.sh` (SmolLM2-135M-Instruct with the shipped draft, T = 0, `--exact`, 512 new "
            f"tokens, one {gpu.upper()} lease; 64 prompts a task at concurrency 64, 5 at concurrency 1); tok/s pools "
            "the five tasks:", "", *table, "", *per_task, *c1, "",
            "Commands: " + "; ".join(dict.fromkeys(f"`{r['command']}`" for r in files)), ""]


def drain_model_replay_section() -> list[str]:
    """The drain models replayed over the CPU trace at the H100's concurrency 32 and 64 step times
    (results/replay-drain-c{64,32}-cpu.json, and replay-persist-c{64,32}-mix-cpu.json: ``--mix``, every batch
    mixing the tasks; planner_trace.py replay --plan-chains 2/4/8 --repeat K), and at the H200's concurrency 8 exact
    step times with the trees of 16 and 32 (replay-persist-c8-cpu.json): per concurrency, batches, step-time
    source and drain model, the planner ÷ its best fixed mode per cost file and their mean, and mt-bench's. Empty
    without the files."""
    rows, cmds, best = [], [], set()
    for c in (64, 32, 8):
        for name in (f"replay-drain-c{c}-cpu.json", f"replay-persist-c{c}-mix-cpu.json",
                     f"replay-persist-c{c}-cpu.json"):
            r = load(name)
            if not r or not r.get("points"):
                continue
            cmds.append(f"`{r['command']}`")
            groups: dict = {}
            for p in r["points"]:
                groups.setdefault((p["times"], p["drain_model"]), []).append(p)
                best.add(p["best_fixed"])
            for (times, model), pts in groups.items():
                vals = [p["planner_over_best_fixed"] for p in pts]
                mt = [p["per_task_tok_per_s"]["mt-bench"]["planner"]
                      / p["per_task_tok_per_s"]["mt-bench"][p["best_fixed"]]
                      for p in pts if "mt-bench" in p["per_task_tok_per_s"]]
                mixed = any(p.get("mix") for p in pts)
                rows.append(f"| {c} | {'mixed' if mixed else 'one task'} | {times} | {model} | "
                            f"{' / '.join(f'{v:.3f}' for v in vals)} | {sum(vals) / len(vals):.3f} | "
                            f"{_range(mt) if mt else '–'} | [`{name}`](results/{name}) |")
    if not rows:
        return []
    return ["#### The drain models replayed over the CPU trace (simulated)", "",
            "`benchmarks/reference/planner_trace.py replay` over the shipped draft's per-anchor acceptance "
            "(`planner-trace16-cpu.json`: 16 prompts a task, fp32 on the CPU, each task's prompts 4 times over at "
            "concurrency 64 and twice at 32) with the step times of the three H100 runs of the cost A/B "
            "(`planner-cost{,-r2,-r3}-h100-exact-T0-c*.json`: the online estimates, `measured`, or the start-up table), "
            "the planner with the chains of 2, 4, 8 and 16 and no tree, the planner's memory carried from task to "
            "task; at "
            "concurrency 8 the step times of the H200's exact run of 2026-12-03 (`planner-exact-h200-T0-c8.json`), "
            "the planner with the chain of 16 and the trees of 16 and 32, each prompt once. "
            "Batches of one task, as `infer.bench` runs them, or mixed (`--mix`: the tasks' prompts in turn, a "
            "server's traffic, where the spread between requests persists more). Planner ÷ the best fixed mode ("
            + ", ".join(sorted(best)) + "), per cost file and their mean, and on mt-bench. Not a GPU measurement: the "
            "content is one greedy output, step times are constants. `persist` is the default drain model since the "
            "H100 A/B of 2026-12-07 (table \"The drain models `persist` and `relative` against `scaled`\"); `relative` "
            "was removed.", "",
            "| concurrency | batches | step times | drain model | planner ÷ best fixed (runs 1 / 2 / 3) | mean | "
            "mt-bench | file |",
            "|---|---|---|---|---|---|---|---|", *rows, "", "Commands: " + "; ".join(cmds), ""]


def planner_exact_section() -> list[str]:
    """Planner points with every configuration decoding the same tokens (``--exact``; planner_points.py)."""
    r = load("planner-exact-h200.json")
    if not r:
        return []
    ok = lambda good: "met" if good else "**missed**"
    pts = list(r["points"].values())
    first = pts[0]
    out = ["#### The planner on identical outputs (exact mode)", "",
           f"{first['gpu']}, {first['date'][:10]}, commit `{first['commit'][:10]}`, SmolLM2-135M-Instruct with the shipped "
           "draft, T = 0, `--exact` (issue 13's row-invariant kernels, trees and the planner included since this "
           "commit): every configuration's greedy output equals AR's on every prompt (last column), so "
           "unlike the table above the configurations decode the same tokens and the ratios measure the planner's "
           "choices, not bf16 near-ties. Exact mode prices a tree step higher from batch 8 on (this commit's exact "
           "tree kernel ran one program per node over the whole prefix; the later two-launch kernel is timed in "
           "results/tree-exact-h200.json), so the best fixed mode moves to the chain there. Mean tok/s over the tasks; "
           "p: the planner with that commit's default (trees 32 and 64, drain model scaled), p16: trees 16 and 32, pl: drain model lead "
           "(`--config pl:budget=auto,drain=lead`).", "",
           "| concurrency | prompts × tokens | AR | chain 16 | tree 16 | tree 32 | best fixed | p ÷ best (goal ≥ 0.98) | "
           "p16 ÷ best | pl ÷ best | p ÷ AR | p's steps | greedy outputs == AR (each label) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, f=".0f": "–" if x is None else format(x, f)
    for p in pts:
        t, rel = p["tok_per_s"], p["planner_over_best_fixed"]
        steps = p["planner_steps"].get("p", {})
        share = _step_share(steps)
        counts = {tuple(c) for c in p["greedy_equal"].values()}
        same = (f"{counts.pop()[0]}/{p['greedy_equal']['chain'][1]}" if len(counts) == 1 else
                ", ".join(f"{x} {a}/{b}" for x, (a, b) in p["greedy_equal"].items()))  # fmt: skip
        out.append(f"| {p['concurrency']} | {p['num_prompts']} × {p['max_new_tokens']} per task | {fmt(t.get('AR'))} | "
                   f"{fmt(t.get('chain'))} | {fmt(t.get('t16'))} | {fmt(t.get('t32'))} | {p['best_fixed']} | "
                   f"{'–' if rel.get('p') is None else _vs_goal(rel['p'])} — {ok((rel.get('p') or 0) >= 0.98)} | {fmt(rel.get('p16'), '.3f')} | "
                   f"{fmt(rel.get('pl'), '.3f')} | {fmt(p['planner_over_ar'].get('p'), '.3f')} | {share} | {same} |")
    out += ["", "Commands: `" + "`; `".join(x["command"] for x in
                                          (read_json(ROOT / f) for f in r["points"])) + "`; then `"
            + r["command"] + "`.", ""]
    return (out + planner_exact_rerun() + planner_default_section() + planner_replay_section() + pairing_replay_section()
            + drain_replay_section())


def planner_default_section() -> list[str]:
    """The planner's default trees (16 and 32) on the H200 against the tree of 32 alone and the former default
    (32 and 64), fast and exact mode, one run each: results/planner-default-h200.json, planner-default-exact-h200.json."""
    files = [(m, load(f)) for m, f in (("fast", "planner-default-h200.json"), ("exact", "planner-default-exact-h200.json"))]
    files = [(m, r) for m, r in files if r]
    if not files:
        return []
    first = next(iter(files[0][1]["points"].values()))
    pts = {(m, p["concurrency"]): p for m, r in files for p in r["points"].values()}
    sizes = ", ".join(sorted({f"{p['num_prompts']} prompts per task × {p['max_new_tokens']} new tokens at concurrency "
                              f"{c}" for (_, c), p in pts.items()}))
    t32 = {m: pts[(m, 1)]["mean_tau"].get("t32") for m in ("fast", "exact") if (m, 1) in pts}
    out = ["#### The default trees of 16 and 32 on the H200", "",
           f"{first['gpu']}, {first['date'][:10]}, commit `{first['commit'][:10]}`, SmolLM2-135M-Instruct with the shipped "
           f"draft, T = 0, {sizes}: p is the planner with the "
           "default trees (16 and 32, chosen by the replay below), p32 the tree of 32 alone, p64 the former default "
           "(32 and 64), each ÷ the best fixed label of the same run (AR, chain, trees of 16 and 32). In fast mode the "
           "labels part from AR at bf16 near-ties and decode different text, so their τ differ by content as well"
           + (f" (the fixed tree of 32 at concurrency 1: mean τ {t32['fast']:.2f} fast, {t32['exact']:.2f} exact)"
              if len(t32) == 2 and None not in t32.values() else "")
           + "; exact mode decodes AR's tokens everywhere.", "",
           "| mode | concurrency | AR | chain 16 | tree 16 | tree 32 | best fixed | p ÷ best (goal ≥ 0.98) | p32 ÷ best "
           "| p64 ÷ best | p ÷ AR | p's steps | greedy outputs == AR (p) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, f=".0f": "–" if x is None else format(x, f)  # noqa: E731
    for mode, r in files:
        for p in r["points"].values():
            t, rel = p["tok_per_s"], p["planner_over_best_fixed"]
            steps = p["planner_steps"].get("p", {})
            share = _step_share(steps)
            a, b = p["greedy_equal"]["p"]
            out.append(f"| {mode} | {p['concurrency']} | {fmt(t.get('AR'))} | {fmt(t.get('chain'))} | "
                       f"{fmt(t.get('t16'))} | {fmt(t.get('t32'))} | {p['best_fixed']} | {'–' if rel.get('p') is None else _vs_goal(rel['p'])} — "
                       f"{'met' if (rel.get('p') or 0) >= 0.98 else '**missed**'} | {fmt(rel.get('p32'), '.3f')} | "
                       f"{fmt(rel.get('p64'), '.3f')} | {fmt(p['planner_over_ar'].get('p'), '.3f')} | {share} | "
                       f"{a}/{b} |")
    out += ["", "Commands: " + "; ".join(
        "`" + "`; `".join(read_json(ROOT / f)["command"] for f in r["points"]) + "`; then `"
        + r["command"] + "`" for _, r in files) + ". Paths as in the repo; each file's `command_as_run` has the GPU machine's.", ""]
    return out


def pairing_replay_section() -> list[str]:
    """The nested tree pairing A/B replayed over the CPU trace (results/pairing-replay16*-cpu.json: planner_trace.py
    replay --pair-trees on,off), one row per step-time file and trace variant; left out without the files."""
    files = [f for f in (RESULTS / "pairing-replay16-cpu.json", RESULTS / "pairing-replay16-treelike-cpu.json")
             if f.exists()]
    if not files:
        return []
    out = ["#### Pairing the smaller tree inside the run tree (replay, CPU)", "",
           "`planner_trace.py replay --pair-trees on,off` over the trace above, trees of 16 and 32: with pairing on (the "
           "engine's since d9ee403) a step of the tree of 32 also gives the planner what the tree of 16 inside it "
           "accepted (`dspine.tree.inner_accepted`), and the tree of 32's lead is learned over the tree of 16 on the same "
           "steps. `--tree-like 32=16` replays the tree of 32 with the tree of 16's acceptance (a larger tree that gains "
           "nothing at a higher step price). Planner ÷ best fixed mode of the same replay:", "",
           "| trace | step times from | concurrency | best fixed | pairing on | pairing off |", "|---|---|---|---|---|---|"]
    for f in files:
        d = read_json(f)
        kind = ", ".join("tree {} = tree {}".format(*x.split("=")) for x in d.get("tree_like") or []) or "as recorded"
        rows: dict = {}
        for p in d["points"]:  # on and off of one point side by side (the other settings as the point ran them)
            key = (p["costs"], p["concurrency"], p["best_fixed"], p.get("plan_trees"), p.get("times"), p.get("conf_slope"))
            rows.setdefault(key, {})[p.get("pair_trees", True)] = p["planner_over_best_fixed"]
        for (costs, conc, best, trees, times, slope), v in rows.items():
            on, off = (f"{v[k]:.3f}" if k in v else "–" for k in (True, False))
            out.append(f"| {kind} | `{Path(costs).name}` ({times}, trees {trees}, conf_slope {slope}) | {conc} | {best} "
                       f"| {on} | {off} |")
        out.append("")
        out.append(f"Command ([{f.name}](results/{f.name})): `{d.get('command')}`")
        out.append("")
    return out


def drain_replay_section() -> list[str]:
    """The drain rule before and after 3ed918f replayed over the CPU trace (results/drain-replay16-cpu.json: points,
    and before.points from the same command at the earlier commit); left out without the file."""
    f = RESULTS / "drain-replay16-cpu.json"
    if not f.exists():
        return []
    d = read_json(f)
    before = {(p["costs"], p["concurrency"]): p["planner_over_best_fixed"] for p in d["before"]["points"]}
    out = ["#### The drain rule's one factor and spread cap (replay, CPU)", "",
           "`planner_trace.py replay` over the trace above, trees of 16 and 32, at "
           f"{d['before']['commit'][:7]} and at {d['commit'][:7]}, which under the drain rule scales every speculative "
           "mode by one factor (that of the mode whose mapped drain rate is the highest: the drain decides between AR "
           "and speculation, the throughput rule orders the speculative modes) and caps the spread between requests "
           "at a standard deviation of 0.5 × the pooled acceptance (`infer/planner.py`, \"Drain\"). Planner ÷ best "
           "fixed mode of the same replay:", "",
           "| step times from | concurrency | best fixed | before | after |", "|---|---|---|---|---|"]
    for p in d["points"]:
        b = before.get((p["costs"], p["concurrency"]))
        out.append(f"| `{Path(p['costs']).name}` | {p['concurrency']} | {p['best_fixed']} | "
                   f"{'–' if b is None else f'{b:.3f}'} | {_vs_goal(p['planner_over_best_fixed'])} |")
    out += ["", f"Command ([{f.name}](results/{f.name})): `{d.get('command')}`", ""]
    return out


def planner_replay_section() -> list[str]:
    """The planner replayed over the shipped draft's real per-anchor acceptance with H200 step times (CPU;
    benchmarks/reference/planner_trace.py): results/planner-replay*-cpu.json."""
    files = sorted(RESULTS.glob("planner-replay*-cpu.json"))
    if not files:
        return []
    # a file whose points carry conf_slope replays both slopes over the same trace and cost files as the earlier
    # ones (whose points ran the rule of their time, conf_slope 1): the earlier ones are listed, not tabulated
    data = {f: read_json(f) for f in files}  # each file read once
    sloped = [f for f in files if any("conf_slope" in p for p in data[f]["points"])]
    superseded = [f for f in files if f not in sloped] if sloped else []
    files = sloped or files
    out = ["#### The planner replayed over real acceptance (CPU)", "",
           "`benchmarks/reference/planner_trace.py record` decodes each prompt's greedy output once with the target and "
           "stores, at every anchor of it, what the chain of 16 and best-first trees of 16, 32 and 64 nodes would commit "
           "there, the chain nodes on each tree's accepted path and the draft's chain confidence (SmolLM2-135M-Instruct "
           "from the GGUF and the shipped draft, fp32 on this CPU). `replay` then drives `infer.planner.StepPlanner` as "
           "`Engine._decode_planned` does (choices one step ahead of observations, paired chain tokens after tree steps, "
           "the drain rule once the queue is empty, the step in which a finish is seen, a warm-up pass per task and the "
           "planner's memory across tasks) with the step times an H200 run measured (`--costs`: its planner labels' "
           "`measured_ms` per mode; at concurrency 1 also a fixed tree's seconds per step, scaled to them, for a size no "
           "planner ran). "
           "Not a GPU measurement: it isolates the planner's choices on real content; prefill, the planner's host "
           "time, the AR steps' deferred draft context and bf16 near-ties are not modelled, and it reads above the H200 "
           "run whose step times it uses at most points (not at fast concurrency 8). Each planner cell: replay / that H200 run (its planner label with those trees "
           "and its default confidence and drain settings, ÷ its best fixed label; – where it ran none). At concurrency 1 the clairvoyant schedule "
           "(the best mode at every step, knowing what each commits) bounds what any planner can reach. Planner ÷ "
           "best fixed mode (AR, chain, trees 16/32/64 of the same replay, those with a step time). Step times "
           "`measured`: the run's online estimate of each mode after its steps (what its planner saw, flushes and host "
           "waits included); `table`: its start-up table (bare graph replays). The two disagree on the trees at "
           "concurrency 8 in fast mode (planner-sizes-h200-T0-c8.json: tree 32 ÷ tree 16 1.145 measured, 1.076 table; the run's fixed trees of 16 and "
           "32 gave equal tok/s), which moves that row by up to 4 points:", ""]
    head = ["| trace (prompts per task × tokens) | H200 step times from | concurrency | step times | best fixed (replay) "
            "| trees 32 and 64 (the default until 2026-12-05): replay / H200 | trees 16 and 32 (the default) | tree 32 "
            "| clairvoyant ÷ best |",
            "|---|---|---|---|---|---|---|---|---|"]
    if sloped:
        names = {1.0: "1 (the proportional confidence rule, with which every H200 run so far ran)",
                 "auto": "auto (the default since 2026-12-05: `infer.planner`, \"Calibration\")"}
        given = sorted({p.get("conf_slope", 1.0) for f in sloped for p in data[f]["points"]},
                       key=lambda x: (x == "auto", str(x)))
        out[-2] = out[-2][:-1] + (". Each replay cell: conf_slope " + " → ".join(
            names[k] if k in names else f"{k:g}" for k in given) + ".")
        out += ["Earlier replays of the same trace with conf_slope 1 only: "
                + ", ".join(f"[{f.name}](results/{f.name})" for f in superseded) + " (their points are the "
                "conf_slope 1 values below where costs and trees agree).", ""]

    def measured(costs: str) -> dict:
        """{plan trees "a/b": that planner's tok/s ÷ the best fixed label's (AR included)} of the infer.bench run
        itself (mean tok/s over its tasks), for its planner labels with the same confidence and drain settings as
        its label p (pl, pn and the like vary those)."""
        run = read_json(ROOT / costs)
        tps: dict = {}
        for t in run["tasks"]:
            tps.setdefault("AR", []).append(t["ar"]["tok_per_s"])
            for k, d in t["drafts"].items():
                tps.setdefault(k, []).append(d["tok_per_s"])
        mean = {k: sum(v) / len(v) for k, v in tps.items()}
        rows = run["tasks"][0]["drafts"]
        planners = {k: d for k, d in rows.items() if d.get("budget")}
        best = max(v for k, v in mean.items() if k not in planners)
        ref = planners.get("p", {})
        same = lambda d: all(d.get(x) == ref.get(x) for x in ("plan_confidence", "plan_drain"))  # noqa: E731
        out: dict = {}
        for k in sorted(planners, key=lambda k: k != "p"):  # label p first where two run the same trees
            key = "/".join(map(str, planners[k].get("plan_trees") or []))
            if same(planners[k]) and key not in out:
                out[key] = mean[k] / best
        return out

    for f in files:
        r = data[f]
        out += head
        pts: dict = {}
        for p in r["points"]:
            pts.setdefault((p["costs"], p["concurrency"], p.get("times", "measured")), {}).setdefault(
                p["plan_trees"], {})[p.get("conf_slope", 1.0)] = p
        slopes = sorted({p.get("conf_slope", 1.0) for p in r["points"]}, key=lambda x: (x == "auto", str(x)))

        def rep(by_slope: dict, slopes: list = slopes) -> str:
            return " → ".join(_vs_goal(by_slope[k]['planner_over_best_fixed']) if k in by_slope else "–" for k in slopes)

        for (costs, c, times), by in pts.items():
            any_p = next(iter(next(iter(by.values())).values()))
            h200 = measured(costs)
            cell = {k: (rep(by[k]) if k in by else "–") + " / " +
                       (f"{h200[k]:.3f}" if k in h200 else "–") for k in ("32/64", "16/32", "32")}  # fmt: skip
            cl = any_p["clairvoyant_over_best_fixed"]
            out.append(f"| [{f.name}](results/{f.name}) ({r['trace_prompts_per_task']} × {r['max_new_tokens']}) | "
                       f"`{Path(costs).name}`{' (exact)' if any_p['exact'] else ''} | {c}"
                       f" | {times} | {any_p['best_fixed']} | "
                       f"{cell['32/64']} | {cell['16/32']} | {cell['32']} | "
                       f"{'–' if cl is None else f'{cl:.3f}'} |")
        if len(slopes) > 1:  # the mean and lowest planner ÷ best fixed per tree set and slope, by concurrency
            out += ["", "Over those rows, planner ÷ best fixed (mean, lowest) per conf_slope: " + "; ".join(
                f"trees {t}, concurrency {c}: " + ", ".join(
                    f"conf_slope {k if k == 'auto' else f'{k:g}'} {sum(v) / len(v):.3f} ({min(v):.3f})"
                    for k in slopes
                    for v in [[p["planner_over_best_fixed"] for p in r["points"] if p["plan_trees"] == t
                               and p["concurrency"] == c and p.get("conf_slope", 1.0) == k]] if v)
                for t in ("16/32", "32/64", "32") for c in sorted({p["concurrency"] for p in r["points"]})
                if any(p["plan_trees"] == t and p["concurrency"] == c for p in r["points"])) + "."]
        out += ["", f"Command: `{r['command']}` (trace: `{read_json(ROOT / r['trace'])['command']}`).",
                ""]
    return out


def planner_exact_rerun() -> list[str]:
    """The same exact-mode points re-run on a later commit (planner-exact2-h200.json): current exact tree kernel."""
    r = load("planner-exact2-h200.json")
    if not r:
        return []
    pts = list(r["points"].values())
    first = pts[0]
    t1 = load("planner-fast-h200-T1-c64.json")
    out = [f"Re-run ({first['gpu']}, {first['date'][:10]}, commit `{first['commit'][:10]}`, "
           "[`results/planner-exact2-h200.json`](results/planner-exact2-h200.json)): the same points with the "
           "two-launch exact tree kernel (7ccce64) and the fused split-K reduce, labels AR, chain, t16, t32 and p only.",
           "", "| concurrency | AR | chain 16 | tree 16 | tree 32 | best fixed | p ÷ best (goal ≥ 0.98) | p ÷ AR | "
           "p's steps | greedy outputs == AR |", "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, f=".0f": "–" if x is None else format(x, f)
    for p in pts:
        t, rel = p["tok_per_s"], p["planner_over_best_fixed"].get("p")
        steps = p["planner_steps"].get("p", {})
        share = _step_share(steps)
        eq = p["greedy_equal"]
        same = "all" if all(a == b for a, b in eq.values()) else ", ".join(f"{x} {a}/{b}" for x, (a, b) in eq.items())
        out.append(f"| {p['concurrency']} | {fmt(t.get('AR'))} | {fmt(t.get('chain'))} | {fmt(t.get('t16'))} | "
                   f"{fmt(t.get('t32'))} | {p['best_fixed']} | {'–' if rel is None else _vs_goal(rel)} — "
                   f"{'met' if (rel or 0) >= 0.98 else '**missed**'} | {fmt(p['planner_over_ar'].get('p'), '.3f')} | "
                   f"{share} | {same} |")
    out += ["", "Commands: `" + "`; `".join(read_json(ROOT / f)["command"] for f in r["points"])
            + "`; then `" + r["command"] + "`."]
    if t1:
        sp = t1["summary"]["p"]["mean_speedup"]
        out += ["", f"Fast mode, T = 1, concurrency 64, same commit "
                "([`results/planner-fast-h200-T1-c64.json`](results/planner-fast-h200-T1-c64.json), "
                f"`{t1['command']}`): the planner {sp:.3f} × AR (mean over the tasks of its speedup; "
                f"mean τ {t1['summary']['p']['mean_tau']:.3f}, the chain's {t1['summary']['chain']['mean_tau']:.2f} at "
                f"{t1['summary']['chain']['mean_speedup']:.2f} × AR): still below AR."]
    return out + [""]


def planner_loop_section() -> list[str]:
    """The planner's own cost against the fixed configuration it runs (bench_planner_loop.py, bench_planner_ar.py)."""
    lp, ar = load("planner-loop-h200.json"), load("planner-ar-h200.json")
    if not lp:
        return []
    out = ["#### What the planner's loop costs (SmolLM2-135M shape, random weights)", "",
           f"{lp['gpu'] or lp['device']}, {lp['date'][:10]}, commit `{lp['commit'][:10]}`, "
           "[`results/planner-loop-h200.json`](results/planner-loop-h200.json): `--budget auto` restricted to one mode "
           "(every step AR, or every step the chain) against the engine running that mode without the planner, "
           f"{lp['context']}-token prompts, {lp['new_tokens']} new tokens, one request per slot, decode tok/s "
           f"(median of {lp['reps']}). `planner AR, immediate` appends the draft context in every AR step (as before "
           f"the deferral); `planner AR` leaves it pending and flushes every {lp.get('flush_rows', 16)} steps.", "",
           "| batch | T | AR tok/s | planner AR ÷ AR | planner AR, immediate ÷ AR | chain tok/s | planner chain ÷ chain |",
           "|---|---|---|---|---|---|---|"]
    for p in lp["points"]:
        out.append(f"| {p['batch']} | {p['temperature']:g} | {p['ar']['tok_per_s']:,.0f} | {p['planner_ar_over_ar']:.3f} | "
                   f"{p['planner_ar_immediate_over_ar']:.3f} | {p['chain']['tok_per_s']:,.0f} | "
                   f"{p['planner_chain_over_chain']:.3f} |")
    if lp.get("note"):
        out += ["", f"Note: {lp['note']}."]
    befores = lp.get("before") or []
    for b in [befores] if isinstance(befores, dict) else befores:
        for what, label in (("planner_ar_over_ar", "planner AR ÷ AR"), ("planner_chain_over_chain", "planner chain ÷ chain")):
            if b.get(what):
                out += ["", f"Before (commit `{b['commit'][:10]}`, {b['note']}), {label}: "
                        + ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in b[what].items()) + "."]
    out += ["", f"Command: `{lp['command']}`", ""]
    if ar:
        rows = [(b, t, ar[f"batch{b}"][f"T{t:g}"]) for b in ar["batches"] for t in ar["temperatures"]
                if f"T{t:g}" in ar.get(f"batch{b}", {})]
        out += [f"One AR step alone (CUDA-graph replays, {ar['context']}-token context, "
                "[`results/planner-ar-h200.json`](results/planner-ar-h200.json)), ÷ the plain AR step:", "",
                f"| batch | T | plain AR step | with the append | deferred | flush (once per {ar['flush_rows']}) | "
                f"deferred + flush ÷ {ar['flush_rows']} |",
                "|---|---|---|---|---|---|---|"]
        for b, t, r in rows:
            out.append(f"| {b} | {t:g} | {r['plain_ar_ms']:.3f} ms | {r['immediate_ar_over_plain_ar']:.3f} | "
                       f"{r['deferred_ar_over_plain_ar']:.3f} | {1000 * r['flush_ms']:.0f} µs | "
                       f"{r['deferred_plus_flush_over_F_over_plain_ar']:.3f} |")
        for b in ar.get("before", []):
            out += ["", f"Before (commit `{b['commit'][:10]}`, {b['note']}), deferred ÷ plain: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in b["deferred_ar_over_plain_ar"].items()) + "."]
        out += ["", f"Command: `{ar['command']}`", ""]
    return out


def exact_section() -> list[str]:
    x = load("exact-h200.json")
    if not x:
        return []
    r = x["exact_over_fast"]
    out = ["### Exact mode: speculative output bitwise equal to the engine's own AR output in bf16 (issue 13)", "",
           f"{x['gpu']}, {x['date'][:10]}, commit `{x['commit'][:10]}`, [`results/exact-h200.json`](results/exact-h200.json). "
           "`--exact`: row-invariant GEMM for decode/verify (K chunks fixed per weight, tile configuration by M from the "
           "device's tuned file `dspine/ops/tuned/`), fixed 256-key attention chunks with an ordered combine, "
           "one prefill per prompt; greedy, bf16.", "",
           "| target | batch | CUDA graphs | identical to AR | τ |", "|---|---|---|---|---|"]
    for run in x["runs"]:
        out.append(f"| {run['target']} | {run['batch']} | {'on' if run['cuda_graphs'] else 'off'} | "
                   f"{run['identical']}/{run['compared']} | {run['tau']:.2f} |")
    worst = max(r.values())
    if x.get("summary"):
        out += ["", x["summary"]]
    for b in x.get("before", []):
        out += ["", f"Before (commit `{b['commit'][:10]}`, {b['date']}; {b['note']}): "
                + ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in b["exact_over_fast"].items()) + "."]
    out += ["", "Cost at Qwen3-8B shape, exact ÷ fast step time (same run): AR batch 1 "
            f"{r['ar_step_bs1']:.2f}, spec batch 1 {r['spec_step_bs1']:.2f}, AR batch 8 {r['ar_step_bs8']:.2f}, "
            f"spec batch 8 {r['spec_step_bs8']:.2f} (goal ≤ 1.05: {'met' if worst <= 1.05 else '**missed**'}; "
            "exact mode stays opt-in).", "", "Commands: " + "; ".join(f"`{c}`" for c in x.get("commands", [x["command"]])), ""]
    g = load("gpu-tests-h200.json")
    if g:
        out += [f"GPU test suite ({g['gpu']}, {g['date'][:10]}, commit `{g['commit'][:10]}`, "
                f"[`results/gpu-tests-h200.json`](results/gpu-tests-h200.json)): {g['passed']} passed, {g['failed']} failed — "
                + "; ".join(f"`{r['command']}` {r['passed']} passed in {r['seconds']:.0f} s" for r in g["runs"]) + ".", ""]
        for r in g.get("later", []):
            out += [f"Later run (commit `{r['commit'][:10]}`, {r['date']}): `{r['command']}` {r['passed']} passed, "
                    f"{r['failed']} failed in {r['seconds']:.0f} s — {r['note']}.", ""]
    return out


def hybrid_section() -> list[str]:
    h = load("hybrid-h200.json")
    if not h:
        return []
    out = ["### Sliding-window and hybrid (gated delta-rule) targets: lossless check", "",
           f"{h['gpu']}, {h['date'][:10]}, commit `{h['commit'][:10]}`, [`results/hybrid-h200.json`](results/hybrid-h200.json): "
           f"tiny random fp32 configs, {h['num_prompts']} prompts, {h['max_new_tokens']} new tokens, against transformers' "
           "greedy `generate`.", "", "| config | path | identical |", "|---|---|---|"]
    for r in h["lossless"]:
        out.append(f"| {r['config']} | {r['path']} | {r['identical']}/{r['compared']} |")
    out += ["", f"Command: `{h['command']}`", ""]
    t = h.get("gpu_pytest")
    if t:
        out += [f"GPU tests (`{t['command']}`, {t['seconds']} s): {len(t['passed'])} passed (fla-core's kernels in fp32, "
                f"with and without CUDA graphs, equal transformers), {len(t['failed'])} failed: {t['failed_note']}.", ""]
    return out


def kvcont_section() -> list[str]:
    """The shipped draft warm-started into the kv injection (smollm2-kvcont-h200.json) and the bench order effect."""
    k = load("smollm2-kvcont-h200.json")
    if not k:
        return []
    b = k["bench"]
    last = k["evals"][-1]
    out = ["#### The shipped draft continued with the kv injection", "",
           f"{k['gpu']}, {k['date'][:10]}, commit `{k['commit'][:10]}`, "
           "[`results/smollm2-kvcont-h200.json`](results/smollm2-kvcont-h200.json): " + k["what"]
           + f". Final in-trainer eval: loss {last['loss']:.3f}, τ_sim {last['tau_sim']:.3f}, τ_real {last['tau_real']:.3f}"
           f" ({k['shipped_draft_in_trainer']}). Concurrency 8, 40 prompts per task, 512 new tokens:", "",
           "| draft | mean τ, T = 0 | mean τ, T = 1 | speedup, T = 0 (shipped listed first) | speedup, T = 0 (kv listed first) |",
           "|---|---|---|---|---|"]
    for lab in b["T0_c8"]["mean_tau"]:
        out.append(f"| {lab} | {b['T0_c8']['mean_tau'][lab]:.3f} | {b['T1_c8']['mean_tau'][lab]:.3f} | "
                   f"{b['T0_c8']['mean_speedup'][lab]:.2f}× | {b['T0_c8_drafts_swapped']['mean_speedup'][lab]:.2f}× |")
    out += ["", k["conclusion"][0].upper() + k["conclusion"][1:] + ".", "", f"Training: `{k['command']}`", ""]
    return out


def draft_step_section() -> list[str]:
    d = load("engine-smollm2-h200.json")
    if not d:
        return []
    out = ["### What the adjacent injection costs in the engine (DSpine step ÷ DFlash step)", "",
           f"{d['gpu']}, {d['date'][:10]}, commit `{d['commit'][:10]}`, "
           "[`results/engine-smollm2-h200.json`](results/engine-smollm2-h200.json): random bf16 weights, "
           f"{d['context']}-token context per row, whole speculative step (draft block + verify + accept + commit + "
           "context append) as one CUDA graph replay; DFlash and DSpine timed in the same run, alternating, "
           "warm-up rounds dropped, medians.", "",
           "| shape | batch | DFlash step | DSpine step | ratio | draft alone: ratio | DSpine-kv step | ratio | draft alone: ratio |",
           "|---|---|---|---|---|---|---|---|---|"]
    for shape, r in d["shapes"].items():
        for key in sorted(k for k in r if k.startswith("batch")):
            b = r[key]
            alone = f"{b['dspine_draft_over_dflash_draft']:.3f}" if "dspine_draft_over_dflash_draft" in b else ""
            kv = (f"{b['dspine_kv_step_ms']:.3f} ms | {b['dspine_kv_step_over_dflash_step']:.3f} | "
                  f"{b['dspine_kv_draft_over_dflash_draft']:.3f}") if "dspine_kv_step_ms" in b else "| |"
            out.append(f"| {shape} | {key[5:]} | {b['dflash_step_ms']:.3f} ms | {b['dspine_step_ms']:.3f} ms | "
                       f"{b['dspine_step_over_dflash_step']:.3f} | {alone} | {kv} |")
    ok = "met" if d["dspine_step_over_dflash_step"] <= 1.03 else "**missed**"
    out += ["", f"Largest step ratio {d['dspine_step_over_dflash_step']:.3f} for the residual injection (target ≤ 1.03: {ok})"]
    if "dspine_kv_step_over_dflash_step" in d:
        kv = d["dspine_kv_step_over_dflash_step"]
        out[-1] += f", {kv:.3f} for the kv injection ({'met' if kv <= 1.03 else '**missed**'})"
    out[-1] += f". Command: `{d['command']}`"
    out.append("")
    return out


def prefill_section() -> list[str]:
    """Prefill of prompt lengths seen for the first time against repeated ones (bench_prefill.py)."""
    d = load("prefill-h200.json")
    if not d:
        return []
    out = ["### Prefill of a prompt length the engine has not seen before (time to first token)", "",
           f"{d['gpu']}, {d['date'][:10]}, commit `{d['commit'][:10]}`, "
           "[`results/prefill-h200.json`](results/prefill-h200.json): random bf16 SmolLM2-135M-shape target, one "
           f"fresh process per setting, {d['lengths']} prompts of distinct lengths up to {d['max_len']} tokens, each "
           "prefilled once (first) and again (repeat); packed: groups of 8 prompts admitted together. Median ms; "
           "the setting is the set of SDPA backends the prompt attention may use.", "",
           "| SDPA backends | new length | repeated length | packed 8, new | packed 8, repeated |", "|---|---|---|---|---|"]
    names = {"torch_default": "torch's choice (cuDNN on the H200; the engine before)",
             "no_cudnn": "flash, memory-efficient, math (**the engine now**)", "flash": "flash only"}
    for k, r in d["runs"].items():
        if "error" in r:
            continue
        out.append(f"| {names.get(k, k)} | {r['c1_first_median_ms']:.1f} | {r['c1_repeat_median_ms']:.1f} | "
                   f"{r['c8_first_median_ms']:.1f} | {r['c8_repeat_median_ms']:.1f} |")
    out += ["", d["conclusion"] + f" ({d['commit_note']}.) Command: `{d['command']}`", ""]
    return out


def trainer_section() -> list[str]:
    t = load("train-h200.json")
    if not t:
        return []
    r, c = t["results"], t["config"]
    return [
        "### Trainer at Qwen3-8B shape (random bf16 target, 5-layer DSpine draft, max length 3072)",
        "",
        f"{t['gpu']}, {t['date'][:10]}, commit `{t['git_commit'][:10]}`, DeepSpeed ZeRO-{c['zero_stage']} on one GPU, "
        f"{r['timed_steps']} timed steps after {r['warmup_steps']} warm-up, {c['anchors']} anchors × block {c['block_size']} "
        f"per sequence, flex_attention ([`results/train-h200.json`](results/train-h200.json)).",
        "",
        "| tokens/s | step | peak memory | model TFLOP/s | MFU vs 989 datasheet | MFU vs measured GEMM |",
        "|---|---|---|---|---|---|",
        f"| {r['tokens_per_s']:.0f} | {r['step_time_s_median'] * 1e3:.0f} ms | {r['peak_memory_gib']:.1f} GiB | "
        f"{r['model_tflops_per_s']:.0f} | {r['mfu_vs_datasheet']:.1%} | {r['mfu_vs_measured_matmul']:.1%} "
        f"({r['measured_matmul_tflops']:.0f} TFLOP/s) |",
        "",
        "FLOPs counted: target forward, draft forward + backward, frozen lm_head forward + input-gradient "
        "(formula in `benchmarks/train/bench_train.py`).",
        *ab_rows(t),
        f"Command: `{t['command']}`",
        "",
        *launcher_rows(t),
    ]


def launcher_rows(t: dict) -> list[str]:
    """The same step under other launchers (``launchers``: label -> a bench_train.py --ab result), beside ZeRO-2."""
    runs = t.get("launchers")
    if not runs:
        return []
    out = ["The same step under other launchers, one GPU each (separate runs: timed steps and commits in each run's "
           "line below); per launcher the step without options and the fastest of its A/B. Peak memory: of the "
           "option's timed steps, or, marked *, of the whole A/B process (runs before bench_train.py measured it per "
           "option):", "",
           "| launcher | options | step | tokens/s | anchor-blocks/s | MFU vs datasheet | peak memory |",
           "|---|---|---|---|---|---|---|"]
    first = f"ZeRO-{t['config']['zero_stage']}"
    zero2 = [(first, n, v) for n, v in t["ab"].items() if n in ("base", t["results"]["variant"])]
    best = {label: r["results"]["variant"] for label, r in runs.items()}
    rows = zero2 + [(label, n, v) for label, r in runs.items() for n, v in r["ab"].items() if n in ("base", best[label])]
    for label, name, v in rows:
        out.append(f"| {label} | {name} | {v['step_time_s_median'] * 1e3:.0f} ms | {v['tokens_per_s']:.0f} | "
                   f"{v['anchor_blocks_per_s']:.0f} | {v['mfu_vs_datasheet']:.1%} | {v['peak_memory_gib']:.1f} GiB"
                   f"{'' if v.get('peak_memory_scope') == 'variant' else '*'} |")
    out += [""] + [f"{label}: {r['gpu']}, {r['date'][:10]}, commit `{r['git_commit'][:10]}`, {r['results']['timed_steps']} timed "
                   f"steps (ZeRO-2 row: {t['results']['timed_steps']}): `{r['command']}`" for label, r in runs.items()]
    z3 = t.get("zero3_attempt")
    if z3:
        out += ["", f"ZeRO-3 (commit `{z3['commit'][:10]}`, {z3['date']}; `{z3['command']}`): {z3['result']}."]
    return out + [""]


def ab_rows(t: dict) -> list[str]:
    """The A/B of the step options in one process (bench_train.py --ab), if the file holds one."""
    ab = t.get("ab")
    if not ab:
        return []
    names = {"ce": "fused-CE chunk compiled", "fa": "fused AdamW", "tc": "target layers compiled", "dc": "draft layers compiled"}
    out = ["", f"Step options, timed in interleaved rounds in one process (the row above is the fastest, `{t['results']['variant']}`; "
           "the trainer's defaults on CUDA):", "",
           "| options | step | tokens/s | anchor-blocks/s | MFU vs datasheet | loss at init |", "|---|---|---|---|---|---|"]
    for name, v in ab.items():
        label = "none" if name == "base" else " + ".join(names.get(p, p) for p in name.split("+"))
        out.append(f"| {label} | {v['step_time_s_median'] * 1e3:.0f} ms | {v['tokens_per_s']:.0f} | {v['anchor_blocks_per_s']:.0f} | "
                   f"{v['mfu_vs_datasheet']:.1%} | {v['loss_at_init']:.4f} |")
    b = t.get("before")
    if b:
        out += ["", f"Before (commit `{b['git_commit'][:10]}`, {b['date'][:10]}; {b['note']}): {b['tokens_per_s']:.0f} tok/s, "
                f"MFU {b['mfu_vs_datasheet']:.1%}."]
    return out + [""]


def lossless_section() -> list[str]:
    d = load("engine-lossless-h200.json")
    if not d:
        return []
    out = ["### Lossless check of the CUDA engine", "",
           f"{d['gpu']}, commit `{d['commit'][:10]}`, [`results/engine-lossless-h200.json`](results/engine-lossless-h200.json): "
           "64 prompts from the five sets, 64 greedy tokens, against transformers fp32 autoregressive decoding.", "",
           "| target | dtype | CUDA graphs | draft | batch | identical | τ |", "|---|---|---|---|---|---|---|"]
    for r in d["runs"]:
        out.append(f"| {r['target']} | {r['dtype']} | {'on' if r['cuda_graphs'] else 'off'} | {r['draft']} | {r['batch']} | "
                   f"{r['identical']}/{r['prompts']} | {r['tau']:.2f} |")
    out += ["", d["note"], ""]
    return out


def ab_loss_section() -> list[str]:
    r = load("smollm2-ab-loss-h200.json")
    if not r:
        return []
    out = ["#### Training loss A/B: hard labels (`distill=ce`) against the target's distribution (`distill=kl`)", "",
           f"{r['device']}, commit `{r['commit'][:10]}`, [`results/smollm2-ab-loss-h200.json`](results/smollm2-ab-loss-h200.json). "
           + r["note"], "",
           "| loss | steps | step time (s, median) | τ_real | τ_sim | τ_sim (argmax agreement) | eval CE | eval KL |",
           "|---|---|---|---|---|---|---|---|"]
    for name, run in r["runs"].items():
        e = run["evals"][-1]
        out.append(f"| {name} | {run['steps']} | {run['step_s_median']:.2f} | {fmt(e['tau_real'], 3)} | {fmt(e['tau_sim'], 3)} | "
                   f"{fmt(e['tau_sim_agree'], 3)} | {fmt(e['ce'], 3)} | {fmt(e['kl'], 3)} |")
    out += ["", r["conclusion"], "", f"Command: `{r['command']}`", ""]
    return out


def draft_temperature_section() -> list[str]:
    r = load("smollm2-draft-temperature-h200.json")
    if not r:
        return []
    st = r["settings"]
    out = [f"#### Draft temperature at T = {st['temperature']:g} (`--draft-temperature`)", "",
           f"{r['device']}, {r['date'][:10]}, commit `{r['commit'][:10]}`, "
           "[`results/smollm2-draft-temperature-h200.json`](results/smollm2-draft-temperature-h200.json): the shipped "
           f"draft's tokens sampled at their own temperature (0: its argmax) while the target samples at T = {st['temperature']:g}, "
           f"top_p {st['top_p']:g}, top_k {st['top_k']}; lossless at any value (docs/method.md §5). Sweep at concurrency "
           f"{st['sweep_concurrency']}, {st['sweep_num_prompts']} prompts per task, {st['max_new_tokens']} new tokens:", "", "| draft temperature | " + " | ".join(r["sweep_c8_20_prompts"][0]["tau_per_task"]) + " | mean τ [95% CI] |",
           "|---|" + "---|" * (len(r["sweep_c8_20_prompts"][0]["tau_per_task"]) + 1)]
    for e in r["sweep_c8_20_prompts"]:
        lo, hi = e["mean_tau_ci95"]
        out.append(f"| {e['draft_temperature']:g} | " + " | ".join(f"{v:.2f}" for v in e["tau_per_task"].values())
                   + f" | {e['mean_tau']:.3f} [{lo:.3f}, {hi:.3f}] |")
    out += ["", "The best value with the AR baseline, against the default (the target's temperature) from the shipped-draft "
            "tables:", "", "| concurrency | prompts per task | draft temperature | mean τ | speedup | default: mean τ | "
            "default: speedup |", "|---|---|---|---|---|---|---|"]
    for c, e in r["best_with_ar"].items():
        out.append(f"| {c[1:]} | {st['best_num_prompts'][c]} | {e['draft_temperature']:g} | {e['mean_tau']:.3f} | "
                   f"{e['mean_speedup']:.2f}× | {e['default_mean_tau']:.3f} | {e['default_mean_speedup']:.2f}× |")
    out += ["", r["conclusion"], "", f"Commands: `{r['command']}`; then "
            + "; ".join(f"`{c}`" for c in r["best_commands"]), ""]
    return out


def draft_vocab_section() -> list[str]:
    runs = {t: load(f"smollm2-cpu-draft-vocab-T{t}.json") for t in (0, 1)}
    if not all(runs.values()):
        return []
    r0 = runs[0]
    labels = list(r0["summary"])
    info = {lab: r0["tasks"][0]["drafts"][lab]["draft_vocab"] for lab in labels}
    a = r0["args"]
    out = ["### Draft vocabulary (`--draft-vocab`): the shipped SmolLM2 draft over its most frequent answer tokens (CPU)", "",
           f"{r0['device']}, {r0['date'][:10]}, "
           + (f"commit `{r0['commit'][:10]}`" if runs[1]["commit"] == r0["commit"] else
              f"commits `{r0['commit'][:10]}` (T = 0) and `{runs[1]['commit'][:10]}` (T = 1)")
           + ", engine on the CPU (fp32, one thread), "
           f"{a['num_prompts']} prompts per task, {a['max_new_tokens']} new tokens, concurrency {a['concurrency']}, the "
           "5 tasks ([`results/smollm2-cpu-draft-vocab-T0.json`](results/smollm2-cpu-draft-vocab-T0.json), "
           "[`-T1.json`](results/smollm2-cpu-draft-vocab-T1.json); T = 1 with top_p 0.95, top_k 20). The vocabularies "
           "are the 4k / 8k / 16k most frequent answer tokens of the Open-PerfectBlend stand-in's 10,564 training rows "
           "in SmolLM2's chat template (their original answers, not regenerated ones; `python -m data.draft_vocab`); "
           "coverage = their share of those answer tokens. Speedup = spec ÷ AR tok/s of the same run on this shared "
           "2-core machine: indicative only.", "",
           "| draft vocabulary | coverage | T = 0 mean τ [95% CI] | τ ÷ whole | speedup | T = 1 mean τ [95% CI] | τ ÷ whole | speedup |",
           "|---|---|---|---|---|---|---|---|"]
    full = {t: runs[t]["summary"]["full"]["mean_tau"] for t in (0, 1)}
    for lab in sorted(labels, key=lambda x: (info[x] or {"size": 10**9})["size"]):
        v = info[lab]
        name = "whole (49,152)" if v is None else f"{v['size']:,}"
        cov = "—" if v is None else f"{100 * v['coverage']:.2f}%"
        cells = []
        for t in (0, 1):
            e = runs[t]["summary"][lab]
            lo, hi = e["mean_tau_ci95"]
            cells += [f"{e['mean_tau']:.3f} [{lo:.3f}, {hi:.3f}]", f"{e['mean_tau'] / full[t]:.3f}", f"{e['mean_speedup']:.2f}×"]
        out.append(f"| {name} | {cov} | " + " | ".join(cells) + " |")
    eq = [f"{runs[0]['summary'][lab]['greedy_equal']}/{runs[0]['summary'][lab]['greedy_compared']}" for lab in labels]
    loss = {t: ", ".join(f"{100 * (1 - runs[t]['summary'][lab]['mean_tau'] / full[t]):.1f}%"
                         for lab in sorted((x for x in labels if info[x]), key=lambda x: info[x]["size"])) for t in (0, 1)}
    out += ["", f"Greedy output equal to AR on {', '.join(sorted(set(eq)))} prompts for every vocabulary (lossless). τ "
            f"lost to the smaller vocabularies (4k, 8k, 16k): {loss[0]} at T = 0, {loss[1]} at T = 1. The CPU speedups say "
            "nothing either way: a first T = 0 run of the same settings (two threads, tests running beside it) read "
            f"{r0.get('first_run_speedups', 'other values')}, apart by more than the vocabularies are here; the CPU step "
            "is bound by the 16-position verify, not by the head. The head's share is large where the step is "
            "bandwidth-bound, at Qwen3-8B shape on a GPU (Engine CLI section: 1.24 of 18.6 GB per step): the H200 "
            "tables below.",
            "", f"Commands: `{runs[0]['command']}`; `{runs[1]['command']}`; the vocabularies: "
            + "; ".join(f"`{c}`" for c in r0.get("vocab_commands", [])), ""]
    return out + draft_vocab_h200_section()


def draft_vocab_h200_section() -> list[str]:
    """The draft vocabulary on the H200: the step at Qwen3-8B shape, and the shipped SmolLM2 draft end to end."""
    e = load("engine-draft-vocab-h200.json")
    out = []
    if e:
        out += ["#### Draft vocabulary on the H200 at Qwen3-8B shape (`bench_engine.py --draft-vocab-size N`)", "",
                f"{e['device']}, {e['date'][:10]}, commit `{e['commit'][:10]}`"
                + (f" ({e['commit_note']})" if e.get("commit_note") else "")
                + ", random bf16 weights, 5-layer DSpine draft, block 16; median of the runs per size, sizes "
                "alternated, on two machines "
                "([`results/engine-draft-vocab-h200.json`](results/engine-draft-vocab-h200.json)). Floor = the weight "
                "bytes a speculative step reads at batch 1 over an AR step's (target without its embedding table, draft, "
                "N head rows).", "",
                "| draft vocabulary | runs | floor | spec ÷ AR step, batch 1 | ÷ floor | spec ÷ AR step, batch 8 "
                "| oracle τ=7 speedup, batch 1 (end to end) | from the step ratio |", "|---|---|---|---|---|---|---|---|"]
        for v, s in sorted(e["summary"].items(), key=lambda kv: -int(kv[0])):
            b1, b8 = s["batch1"], s["batch8"]
            name = f"whole ({int(v):,})" if int(v) >= 151936 else f"{int(v):,}"
            out.append(f"| {name} | {len(s['runs'])} | {s['spec_weight_bytes_over_ar']:.3f} | "
                       f"{b1['spec_step_over_ar_step']:.3f} | {b1['spec_over_ar_over_floor']:.3f} | "
                       f"{b8['spec_step_over_ar_step']:.3f} | {b1['oracle_speedup_tau7']:.2f}× | "
                       f"{b1['oracle_speedup_from_steps']:.2f}× |")
        out += ["", e["finding"], "", f"Command: `{e['command']}`", ""]
    runs = {c: load(f"smollm2-h200-draft-vocab-T0-c{c}.json") for c in (1, 8, 64)}
    if all(runs.values()):
        r1 = runs[1]
        out += ["#### Draft vocabulary on the H200: the shipped SmolLM2 draft, 16,384 ids", "",
                f"{r1['device']}, {r1['date'][:10]}, commit `{r1['commit'][:10]}`, the 5 tasks, 512 new tokens, T = 0, "
                "fast mode (labels decode different text at bf16 near-ties: differences of a few percent are content). "
                "`chain` / `p` = the chain and the planner (`budget=auto`) over the whole vocabulary, `…16k` the same "
                "over the 16k vocabulary of the CPU table ([`results/smollm2-h200-draft-vocab-T0-c1.json`]"
                "(results/smollm2-h200-draft-vocab-T0-c1.json), `-c8`, `-c64`).", "",
                "| concurrency | prompts per task | " + " | ".join(f"{lab} τ / speedup" for lab in r1["summary"]) + " |",
                "|---|---|" + "---|" * len(r1["summary"])]
        for c, r in runs.items():
            cells = [f"{e['mean_tau']:.2f} / {e['mean_speedup']:.2f}×" for e in r["summary"].values()]
            out.append(f"| {c} | {r['args']['num_prompts']} | " + " | ".join(cells) + " |")
        loss = [100 * (1 - r["summary"]["chain16k"]["mean_tau"] / r["summary"]["chain"]["mean_tau"]) for r in runs.values()]
        out += ["", "At SmolLM2 size the head (49,152 × 576, 57 MB in bf16) reads in about 15 µs of a 1.2-1.7 ms step, which is bound by launches, not bytes: "
                f"the 16k vocabulary costs the chain {min(loss):.1f}-{max(loss):.1f}% of its τ and gains nothing measurable "
                "at concurrency 1, 8 or 64. "
                "The planner's τ mixes its AR, chain and tree steps (an AR step commits 1), so its τ and speedups "
                "differ with the modes it ran (at concurrency 64 mostly AR either way): their differences cannot be put down to the vocabulary"
                ".", "",
                f"Command (per concurrency C, N prompts): `{r1['command']}`", ""]
    return out


def profile_section() -> list[str]:
    r = load("profile-step-h200.json")
    if not r:
        return []
    out = ["#### Where an engine step spends its time (Qwen3-8B shape, `benchmarks/engine/profile_step.py`)", "",
           f"{r['device']}, commit `{r['commit'][:10]}`, [`results/profile-step-h200.json`](results/profile-step-h200.json): "
           f"random bf16 weights, {r['context']}-token context, {r['draft_layers']}-layer draft, block {r['block_size']}, "
           "CUDA graphs off so that every kernel shows (kernel times are the graph's; wall time is the eager loop's).", "",
           "| batch | step | kernel time per step | launches | largest kernel (share) |", "|---|---|---|---|---|"]
    for b in ("batch1", "batch8"):
        for kind in ("ar", "spec"):
            d = r.get(b, {}).get(kind)
            if not d:
                continue
            top = d["top"][0]
            out.append(f"| {b[5:]} | {kind} | {d['kernel_us_per_step'] / 1000:.2f} ms | {d['kernels_per_step']:.0f} | "
                       f"`{top['name']}` x{top['count_per_step']:.0f} ({100 * top['fraction']:.0f}%) |")
    b8, a8 = r.get("batch8", {}).get("spec"), r.get("batch8", {}).get("ar")
    single = [t for t in b8["top"] if t["count_per_step"] == 1] if b8 else []
    before = r.get("before_flatten")
    if single and a8 and before:
        t = single[0]
        out += ["", f"Batch 8 spec step ÷ batch 8 AR step: {b8['kernel_us_per_step'] / a8['kernel_us_per_step']:.2f} "
                f"(issue 12's goal: 1.35). The draft rows' LM head (vocabulary 151,936, M = 120 rows) is one 2-D GEMM "
                f"now, {t['us_per_step'] / 1000:.2f} ms (`{t['name']}`). In the run before the fix (commit "
                f"`{before['commit'][:10]}`) the same call ran as `aten::bmm` over the strided slice `hidden[:, 1:16]`: "
                f"8 GEMMs of 15 rows, each reading the 1.24 GB weight, {before['batch8_spec_lm_head_us'] / 1000:.2f} ms, "
                f"and the batch 8 spec step took {before['batch8_spec_kernel_us_per_step'] / 1000:.2f} ms of kernels "
                f"({before['batch8_spec_kernel_us_per_step'] / before['batch8_ar_kernel_us_per_step']:.2f} × AR). "
                "`dspine.ops.lm_head` flattens the rows first (tests/test_kernels_lm_head.py asserts `aten::mm`). "
                "What is left is mostly the linears (cuBLAS `nvjet` GEMMs and the engine's `_linear_kernel`): "
                f"{_linear_ms(b8):.2f} ms of the spec step against {_linear_ms(a8):.2f} ms of the AR step (the layers "
                "at 128 rows, 8 of them the target's verify block of 16, against 8)."]
    if r.get("reading"):
        out += ["", r["reading"]]
    combine = _combine_sentences(r, b8)
    if combine:
        out += ["", combine]
    out += ["", f"Command: `{r['command']}`", ""]
    return out


def _linear_ms(step: dict) -> float:
    """Milliseconds per step of a profiled step's linears among its top kernels: cuBLAS (``nvjet``) GEMMs and
    split-K reductions, and the engine's GEMV (``_linear_kernel``, ``_linear_reduce_kernel``)."""
    return sum(x["us_per_step"] for x in step["top"]
               if x["name"].startswith(("nvjet", "_linear")) or "splitKreduce" in x["name"]) / 1000


def _combine_sentences(r: dict, b8: dict | None) -> str:
    """The split-K combine in the batch-8 spec profile, its previous profile and the launch sweep
    (results/combine-sweep-h200.json: a dict with ``rows``, or the bare list of its first version)."""
    comb = next((x for x in (b8 or {}).get("top", []) if x["name"] == "_combine_kernel"), None)
    if not comb:
        return ""
    text = (f"The split-K attention combine in that profile: {comb['us_per_call']:.1f} µs a call "
            f"({comb['count_per_step']:.0f} calls, {comb['us_per_step'] / 1000:.2f} ms a step)")
    prev = r.get("before_one_warp_combine") or {}
    cb = prev.get("batch8_spec_combine")
    if cb:
        text += (f", against {cb['us_per_call']:.1f} µs ({cb['us_per_step'] / 1000:.2f} ms a step) with the 4-warp launch "
                 f"of commit `{str(prev.get('commit', '?'))[:10]}`; the batch 8 spec step's kernel time went from "
                 f"{prev['batch8_spec_kernel_us_per_step'] / 1000:.2f} to {r['batch8']['spec']['kernel_us_per_step'] / 1000:.2f} ms")
    text += "."
    sw = load("combine-sweep-h200.json")
    rows = sw.get("rows", []) if isinstance(sw, dict) else (sw or [])
    timed = [x for x in rows if "us" in x and x.get("ok")]
    spec = [x for x in timed if x.get("TG") == 64 and x.get("BH", 64) == 64 and not x.get("ordered")]
    if not spec:
        return text
    span = lambda ws: (lambda v: f"{min(v):.1f}-{max(v):.1f} µs" if v else None)([x["us"] for x in spec if x["warps"] in ws])
    parts = [f"{span(ws)} with {name}" for ws, name in (((4, 8), "4 or 8 warps"), ((2,), "2"), ((1,), "1"))
             if span(ws)]
    best = min(spec, key=lambda x: x["us"])
    commit = sw.get("commit", "?") if isinstance(sw, dict) else "?"
    text += (f" The kernel alone at the batch-8 spec shape ([`results/combine-sweep-h200.json`](results/combine-sweep-h200.json), "
             f"CUDA-graph replays, commit `{commit[:10]}`): " + ", ".join(parts) + f" (best {best['us']:.1f} µs: "
             f"{best['br']} rows per program, {best['warps']} warp{'s' if best['warps'] > 1 else ''}): the warps, not "
             "the program count, made it slow, and the default launch is one warp per 4,096 fp32 of the tile.")
    shape = lambda x: (x.get("BH"), x.get("TG"), x.get("NS"), x.get("ordered"))
    b1 = next((x for x in rows if shape(x) == (8, 64, 17, True) and "default_us" in x), None)
    runs1 = [x for x in timed if shape(x) == (8, 64, 17, True) and "br" in x and "warps" in x]
    if b1 and runs1 and "default_block_r" in b1:
        best1 = min(runs1, key=lambda x: x["us"])
        text += (f" The ordered combine of exact mode at the batch-1 shape (B·Hkv = 8, 17 splits) took "
                 f"{b1['default_us']:.1f} µs with that commit's {b1['default_block_r']} rows per program against "
                 f"{best1['us']:.1f} µs at {best1['br']} row{'s' if best1['br'] > 1 else ''} and {best1['warps']} "
                 f"warp{'s' if best1['warps'] > 1 else ''}: its default is now 4 rows, 4 warps (within 3% of the best "
                 "at the three measured shapes), not yet profiled in a step.")
    return text


def render() -> str:
    lines = [BEGIN, ""]
    for section in (glance_section, smollm2_section, continue_section, recipe_section, arms_section, kvcont_section, ab_loss_section, draft_temperature_section, training_section, stories_section, draft_vocab_section,
                    engine_section, draft_step_section, prefill_section, profile_section, lm_head_section, verify_section, planner_h100_section, planner_chains_section, planner_topk_section, planner_drainfed_section, planner_refresh_section, planner_fused_section, planner_persist_section, planner_mix_section, planner_state_section, planner_cost_section, drain_model_replay_section, planner_est_section, planner_exact_section, planner_loop_section, exact_section,
                    hybrid_section, hybrid_bench_section, trainer_section, lossless_section):
        lines += section()
    lines.append(END)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    text = README.read_text()
    if BEGIN not in text or END not in text:
        print(f"{README}: no {BEGIN} ... {END} block", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = head + render() + tail
    if args.check:
        if new != text:
            print("README results block is stale: run python scripts/make_tables.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
