#!/usr/bin/env bash
# Every engine result in results/ on one GPU, in one command (the SmolLM2 recipe is scripts/smollm2/recipe.sh).
#
#   GGUF=models/SmolLM2-135M-Instruct.Q4_1.gguf DSPINE_SHARED=../shared bash scripts/reproduce_h200.sh [STAGE ...]
#
# Stages (default: all, in order). convert, engine, exact, hybrid, profile, linear, lmhead, hybridbench, linearwide,
# fusion, linearfusion, planslope, planswitch and planexact skip when their output
# exists (planslope and planswitch: a whole run's; a killed run resumes; delete a results file to measure it again); steps, tree and planner always
# measure and --merge their part into results/verify-h200.json. Minutes on one H200 (2026-12-01):
#   convert   GGUF -> $WORK/smollm2-hf (bf16), the SmolLM2 target of the later stages          ~0.5
#   engine    benchmarks/engine/bench_engine.py  -> results/engine-h200.json                  ~2
#   steps     bench_tree.py step costs at Qwen3-8B shape -> results/verify-h200.json           ~0.5
#   tree      bench_tree.py SmolLM2 chain vs tree (T=0, concurrency 1) -> same file            ~1
#   planner   bench_tree.py --planner at concurrency 1, 8, 32, 64 x T 0, 1, fixed trees of 16 and 32 -> same file ~13
#             (and the planner's step log, results/plan-log-h200-<UTC time>.jsonl.gz: benchmarks/engine/plan_log.py)
#   planfair  the planner points on the same text in every mode: T = 0 in exact mode (bench_tree.py --exact, every mode
#             decodes AR's greedy text) -> results/verify-exact-h200.json, T = 1 at concurrency 32 and 64 with
#             drafter-invariant verification (--invariant: AR's sampled text, no tree) -> results/verify-invariant-h200.json
#             (the planner stage's fast-mode ratios compare texts that part at bf16 near-ties: H100, 2026-12-05) ~13;
#             PLAN_STATE and PLAN_DRAIN (bench_tree.py --plan-state, --plan-drain-model) set the planner's, else the engine's
#             (checked before any stage runs; the points --merge into the same two files, replacing the points there
#             of the same concurrency and T: set RESULTS, or rename the files after, to keep both)
#   exact     bench_exact.py (8B identity, SmolLM2 identity, cost) -> results/exact-h200.json ~7
#   hybrid    hybrid_lossless.py -> results/hybrid-h200.json                                   ~0.7
#   profile   profile_step.py -> results/profile-step-h200.json                                ~1
#   linear    bench_linear.py (exact-mode GEMM tiles vs cuBLAS) -> results/exact-kernels-h200.json
#   lmhead    bench_lm_head.py (LM-head candidates per row count, the start-up pick) -> results/lm-head-h200.json ~1
#   hybridbench bench_hybrid.py (27B-class qwen3_5 layout, random bf16: AR vs floor, oracle tau=7) -> ~1
#             results/hybrid-bench-h200.json; it and the hybrid stage need fla-core (pip install fla-core einops)
#   linearwide tune_linear_fast.py --wide (fast-mode tiles at 32-128 rows vs cuBLAS; fast_wide entries into
#             dspine/ops/tuned/linear-<GPU>.json) -> results/linear-fast-wide-h200.json                 ~8
#   fusion    bench_engine.py --skip-peers --ab-fusion 2 (norms and SiLU-mul folded into the linears, off/on
#             alternated in one process) -> results/engine-fusion-h200.json                          ~2.5
#   linearfusion bench_linear_fusion.py (each fusion's µs per linear call, the SiLU-mul prologue over K splits)
#             -> results/linear-fusion-h200.json                                                      ~1
#   planslope infer.bench A/B of the planner's confidence slope (p: conf_slope=auto, the default; p1: conf_slope=1,
#             the rule before 2026-12-05) beside AR, the chain and fixed trees of 16 and 32, T=0, fast and exact at
#             concurrency 1 and 8, fast at 32 and 64 -> results/planner-slope-h200-{fast,exact}-T0-c*.json and
#             their points (planner_points.py) -> results/planner-slope-h200.json                  ~14
#   plandrain infer.bench A/B of the planner's drain model (p: drain=scaled, the default when it ran; po: own, issue
#             16's math500 drain) beside AR and the chain, T=0, concurrency 8, exact and fast -> results/planner-drain-h200-{exact,fast}-T0-c8.json ~6
#   planpersist infer.bench A/B of the drain rule's spread between requests (p: drain=scaled, the default when it
#             ran; pp: drain=persist, the covariance of early and later acceptance, the default since) beside AR and
#             the fixed chains of 4 and 16, T=0, exact, concurrency 64 and 32, 64 prompts ->
#             results/planner-persist-h200-exact-T0-c{64,32}.json, step logs $WORK/logs/plan-log-persist-c{64,32}.jsonl ~5
#   planest   the planner with its estimates logged (each choice's tokens per mode before the drain rule and the
#             engine's confidence: plan_log.py --estimates): at concurrency 64 p (the default, drain=persist) and ps
#             (drain=scaled, the default before) beside AR and the chains of 4 and 16 (the H100 files of this stage
#             before, planner-est*: p = scaled, pp = persist, pr = relative, since removed); at concurrency 1 p beside AR, the chain
#             and the fixed tree of 32; T=0, exact, each point RUNS times (default 2) -> results/planner-est2[-rK]-h200-exact-T0-c{64,1}.json,
#             step logs $WORK/logs/plan-log-est2*-c*.jsonl                                           ~10
#   planmix   the drain models on mixed batches (infer.bench --mix: the five tasks' prompts taken in turn, every batch
#             mixing them, as a server's traffic): p (the default, persist), ps (drain=scaled) and pc
#             (drain=persist_cap) beside AR and the chains of 4 and 16, T=0, exact, concurrency 64 and 32, 64
#             prompts a task ->
#             results/planner-mix-h200-exact-T0-c{64,32}.json, step logs $WORK/logs/plan-log-mix-c{64,32}.jsonl     ~5
#   planstate the planner's state: p (the default, "steps"), pk (state=kv: a step-time term in the live requests'
#             context tokens) and pr (state=rows_kv: that, and averages and leads weighed by live requests; infer.planner
#             "State") beside AR and the chains of 4 and 16, 64 prompts a task, RUNS times (default 2) each: T=0 exact
#             at concurrency 64 and T=1 drafter-invariant (top-p 0.95, top-k 20) at 32, the two points the default
#             missed on the H100 -> results/planner-state2[-rK]-h200-{exact-T0-c64,invariant-T1-c32}.json, step logs
#             $WORK/logs/plan-log-state2*.jsonl (results/planner-state-h100-*.json: the stage before, with
#             drain=persist_len, since removed)                                                         ~7 a run
#   planswitch bench_planner_loop.py --switch 32 (the planner's loop running the chain and the tree of 32 in turn,
#             against each alone, and the fixed tree of 32 against the planner's loop with that tree alone; batch
#             1 and 8, T=0) -> results/planner-switch-h200.json                                       ~2.5
#   planexact the same in exact mode (--exact; the same-text points' mode, where the planner's chain steps ran 3%
#             slower than the fixed chain's at concurrency 8, T=0) -> results/planner-switch-exact-h200.json ~2.5
#   tables    scripts/make_tables.py (README results block)
# Runs `python` from PATH (the environment with the project installed). An unknown stage, or a GPU stage without
# CUDA, or a PLAN_STATE / PLAN_DRAIN outside infer.planner's, stops the script before anything runs.
# Every stage's wall clock goes to $WORK/timings.jsonl. Knobs (env): WORK (runs/reproduce), GGUF, DRAFT
# (checkpoints/smollm2-135m-dspine), RESULTS (results), GPU_TAG (h200: the suffix of every results file), SEEDS (the
# planner stage's sampling seeds at T = 1, default one run: see the planner stage), RUNS (planest, planstate: runs a
# point, 2), PLAN_STATE and PLAN_DRAIN (planfair),
# WIDE_WEIGHTS (linearwide: the weights tuned, default all four; "gate_up down", three quarters of a layer's bytes,
# takes about half the time).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-runs/reproduce}
GGUF=${GGUF:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
DRAFT=${DRAFT:-checkpoints/smollm2-135m-dspine}
R=${RESULTS:-results}
G=${GPU_TAG:-h200}  # results file suffix: name the card when it is not an H200 (GPU_TAG=h100)
SHARED=${DSPINE_SHARED:-${SHARED:-../shared}}
export DSPINE_SHARED=$SHARED PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ALL="convert engine steps tree planner planfair exact hybrid profile linear lmhead hybridbench linearwide fusion linearfusion planslope plandrain planpersist planest planmix planstate planswitch planexact tables"
STAGES=${*:-$ALL}
for s in $STAGES; do
  [[ " $ALL " == *" $s "* ]] || { echo "reproduce_h200.sh: unknown stage '$s' (stages: $ALL)" >&2; exit 2; }
done
# RUNS (planest, planstate) is a count: `seq bogus` would stop those stages after the ones before them
[[ -z "${RUNS:-}" || "${RUNS}" =~ ^[1-9][0-9]*$ ]] || { echo "reproduce_h200.sh: RUNS=${RUNS}: expected a count >= 1" >&2; exit 2; }
# a bad PLAN_STATE or PLAN_DRAIN would stop the run at planfair, after the stages before it
if [[ " $STAGES " == *" planfair "* ]] && [ -n "${PLAN_STATE:-}${PLAN_DRAIN:-}" ]; then
  python -c 'import sys; from infer.planner import PLAN_STATES as S, DRAIN_MODELS as D
for env, v, ok in (("PLAN_STATE", sys.argv[1], S), ("PLAN_DRAIN", sys.argv[2], D)):
    if v and v not in ok:
        sys.exit(f"reproduce_h200.sh: {env}={v!r}: expected one of " + ", ".join(ok))' "${PLAN_STATE:-}" "${PLAN_DRAIN:-}" || exit 2
fi
for s in $STAGES; do  # every stage but convert and tables measures on the GPU: refuse to start without one
  if [[ $s != convert && $s != tables ]]; then
    python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2> /dev/null || {
      echo "reproduce_h200.sh: stage '$s' needs a CUDA GPU and a python with torch (python here: $(command -v python ||
        echo none)); convert and tables run without one" >&2
      exit 2
    }
    break
  fi
done
HF=$WORK/smollm2-hf
mkdir -p "$WORK/logs" "$R"
has() { [[ " $STAGES " == *" $1 "* ]]; }
timed() {  # timed NAME CMD...: log to $WORK/logs/NAME.log, wall clock to timings.jsonl
  local name=$1 t0 rc=0; shift
  t0=$(date +%s)
  echo "[$(date +%T)] start $name"
  "$@" > "$WORK/logs/$name.log" 2>&1 || rc=$?
  echo "{\"stage\": \"$name\", \"seconds\": $(($(date +%s) - t0)), \"rc\": $rc}" | tee -a "$WORK/timings.jsonl"
  return $rc
}
tree=(python benchmarks/engine/bench_tree.py --smollm2 "$HF" --draft "$DRAFT" --output "$R/verify-$G.json" --merge)
planner=("${tree[@]}" --skip-steps --skip-smollm2 --fixed-trees 16,32)  # the engine's default plan trees, each also fixed
# SEEDS=0,1,2: the T = 1 planner points run once per sampling seed, averaged (bench_tree.py --seeds; each seed adds
# about 7 of the planner stage's 13 minutes)
if [ -n "${SEEDS:-}" ]; then planner+=(--seeds "$SEEDS"); fi

if has convert && [ ! -f "$HF/config.json" ]; then
  timed convert python -m dspine.convert --target "$GGUF" --out "$HF" --dtype bf16
fi
if has engine && [ ! -f "$R/engine-$G.json" ]; then
  timed engine python benchmarks/engine/bench_engine.py --output "$R/engine-$G.json"
fi
if has steps; then timed steps python benchmarks/engine/bench_tree.py --output "$R/verify-$G.json" --merge; fi
if has tree; then timed tree "${tree[@]}" --skip-steps --num-prompts 10; fi
if has planner; then  # prompts per task so that every batch fills (64 for concurrency 32/64)
  # the planner's step log of this run (DSPINE_PLAN_LOG; benchmarks/engine/plan_log.py), a new file per run, gzipped
  plog="$R/plan-log-$G-$(date -u +%Y%m%dT%H%M%S).jsonl"
  DSPINE_PLAN_LOG=$plog timed planner-c1 "${planner[@]}" --planner 1:0,1:1 --num-prompts 5
  DSPINE_PLAN_LOG=$plog timed planner-c8 "${planner[@]}" --planner 8:0,8:1 --num-prompts 16
  DSPINE_PLAN_LOG=$plog timed planner-c64 "${planner[@]}" --planner 32:0,64:0,32:1,64:1 --num-prompts 64
  if [ -s "$plog" ]; then gzip "$plog"; fi
fi
if has planfair; then  # the same text in every mode: exact at T = 0, drafter-invariant at T = 1 (no tree runs there)
  fair=(python benchmarks/engine/bench_tree.py --smollm2 "$HF" --draft "$DRAFT" --merge --skip-steps --skip-smollm2
        ${PLAN_STATE:+--plan-state "$PLAN_STATE"} ${PLAN_DRAIN:+--plan-drain-model "$PLAN_DRAIN"})
  exact=("${fair[@]}" --output "$R/verify-exact-$G.json" --fixed-trees 16,32 --exact)
  timed planfair-exact-c1 "${exact[@]}" --planner 1:0 --num-prompts 5
  timed planfair-exact-c8 "${exact[@]}" --planner 8:0 --num-prompts 16
  timed planfair-exact-c64 "${exact[@]}" --planner 32:0,64:0 --num-prompts 64
  timed planfair-invariant "${fair[@]}" --output "$R/verify-invariant-$G.json" --invariant --planner 32:1,64:1 \
    --num-prompts 64 ${SEEDS:+--seeds "$SEEDS"}
fi
if has exact && [ ! -f "$R/exact-$G.json" ]; then
  timed exact-8b python benchmarks/engine/bench_exact.py --parts 8b --output "$R/exact-$G.json"
  timed exact-smollm2 python benchmarks/engine/bench_exact.py --parts smollm2 --smollm2-target "$HF" --append \
    --output "$R/exact-$G.json"
  timed exact-cost python benchmarks/engine/bench_exact.py --parts cost --append --output "$R/exact-$G.json"
fi
if has hybrid && [ ! -f "$R/hybrid-$G.json" ]; then
  timed hybrid python benchmarks/engine/hybrid_lossless.py --output "$R/hybrid-$G.json"
fi
if has profile && [ ! -f "$R/profile-step-$G.json" ]; then
  timed profile python benchmarks/engine/profile_step.py --output "$R/profile-step-$G.json"
fi
if has linear && [ ! -f "$R/exact-kernels-$G.json" ]; then
  timed linear python benchmarks/kernels/bench_linear.py --output "$R/exact-kernels-$G.json"
fi
if has lmhead && [ ! -f "$R/lm-head-$G.json" ]; then
  timed lmhead python benchmarks/kernels/bench_lm_head.py --output "$R/lm-head-$G.json"
fi
if has hybridbench && [ ! -f "$R/hybrid-bench-$G.json" ]; then
  timed hybridbench python benchmarks/engine/bench_hybrid.py --prompt 256 --new-tokens 64 --iters 5 \
    --output "$R/hybrid-bench-$G.json"
fi
linearwide() {  # the device's tuned file by its name, as dspine.ops.linear.tuned spells it
  local name
  name=$(python -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))") || return
  # shellcheck disable=SC2086  # WIDE_WEIGHTS: one word a weight
  python benchmarks/kernels/tune_linear_fast.py --wide ${WIDE_WEIGHTS:+--weights $WIDE_WEIGHTS} \
    --output "$R/linear-fast-wide-$G.json" --write-tuned "dspine/ops/tuned/linear-$name.json"
}
if has linearwide && [ ! -f "$R/linear-fast-wide-$G.json" ]; then timed linearwide linearwide || true; fi
if has fusion && [ ! -f "$R/engine-fusion-$G.json" ]; then
  timed fusion python benchmarks/engine/bench_engine.py --skip-peers --ab-fusion 2 --output "$R/engine-fusion-$G.json"
fi
if has linearfusion && [ ! -f "$R/linear-fusion-$G.json" ]; then
  timed linearfusion python benchmarks/kernels/bench_linear_fusion.py --output "$R/linear-fusion-$G.json"
fi
finished() {  # finished FILE: it exists and is a whole run (infer.bench: not "interrupted"; bench_planner_loop: "complete")
  [ -f "$1" ] && python -c 'import json, sys; d = json.load(open(sys.argv[1]))
sys.exit(0 if not d.get("interrupted") and d.get("complete", True) else 1)' "$1"
}
planslope() {  # planslope MODE CONCURRENCY PROMPTS TOKENS: one infer.bench run of the A/B, skipped once finished
  local out="$R/planner-slope-$G-$1-T0-c$2.json" exact=()
  finished "$out" && return 0
  [ "$1" = exact ] && exact=(--exact)
  python -m infer.bench --backend cuda --target "$HF" --data-dir "$SHARED/data/eval" "${exact[@]}" --temperature 0 \
    --draft chain="$DRAFT" --draft t16="$DRAFT" --draft t32="$DRAFT" --draft p="$DRAFT" --draft p1="$DRAFT" \
    --config t16:verify=tree,tree_budget=16 --config t32:verify=tree,tree_budget=32 --config p:budget=auto \
    --config p1:budget=auto,conf_slope=1 --concurrency "$2" --num-prompts "$3" --max-new-tokens "$4" --output-json "$out" \
    --overwrite
}
if has planslope; then
  timed planslope-fast-c1 planslope fast 1 10 512
  timed planslope-fast-c8 planslope fast 8 16 512
  timed planslope-exact-c1 planslope exact 1 10 512
  timed planslope-exact-c8 planslope exact 8 16 512
  timed planslope-fast-c32 planslope fast 32 64 256
  timed planslope-fast-c64 planslope fast 64 64 256
  inputs=()  # the finished runs; their points again whenever one is newer than the points file
  for f in "$R"/planner-slope-$G-{fast,exact}-T0-c{1,8}.json "$R"/planner-slope-$G-fast-T0-c{32,64}.json; do
    if finished "$f"; then inputs+=("$f"); fi
  done
  if [ ${#inputs[@]} -gt 0 ] && { [ ! -f "$R/planner-slope-$G.json" ] ||
       [ -n "$(find "${inputs[@]}" -newer "$R/planner-slope-$G.json")" ]; }; then
    timed planslope-points python benchmarks/engine/planner_points.py "${inputs[@]}" --output "$R/planner-slope-$G.json" \
      --overwrite
  fi
fi
plandrain() {  # plandrain MODE: one infer.bench run of the drain-model A/B at concurrency 8, skipped once finished
  local out="$R/planner-drain-$G-$1-T0-c8.json" exact=()
  finished "$out" && return 0
  [ "$1" = exact ] && exact=(--exact)
  python -m infer.bench --backend cuda --target "$HF" --data-dir "$SHARED/data/eval" "${exact[@]}" --temperature 0 \
    --draft chain="$DRAFT" --draft p="$DRAFT" --draft po="$DRAFT" --config p:budget=auto,drain=scaled \
    --config po:budget=auto,drain=own \
    --concurrency 8 --num-prompts 16 --max-new-tokens 512 --output-json "$out" --overwrite
}
if has plandrain; then
  timed plandrain-exact-c8 plandrain exact
  timed plandrain-fast-c8 plandrain fast
fi
planab() {  # planab NAME CONCURRENCY PROMPTS LABEL-ARGS...: one infer.bench run of a planner A/B (exact, T=0) with
  # the --draft / --config items given -> planner-NAME-$G-exact-T0-cC.json, skipped once finished
  local out="$R/planner-$1-$G-exact-T0-c$2.json" c=$2 n=$3
  shift 3
  finished "$out" && return 0
  python -m infer.bench --backend cuda --target "$HF" --data-dir "$SHARED/data/eval" --exact --temperature 0 "$@" \
    --concurrency "$c" --num-prompts "$n" --max-new-tokens 512 --output-json "$out" --overwrite
}
if has planpersist; then
  ab=(--draft chain="$DRAFT" --draft chain4="$DRAFT" --draft p="$DRAFT" --draft pp="$DRAFT"
      --config chain4:width=4 --config p:budget=auto,drain=scaled --config pp:budget=auto,drain=persist)
  for c in 64 32; do  # with the step logs (plan_log.py --persistence reads them)
    DSPINE_PLAN_LOG="$WORK/logs/plan-log-persist-c$c.jsonl" timed "planpersist-exact-c$c" planab persist "$c" 64 "${ab[@]}"
  done
fi
if has planest; then  # what the planner estimated against what it committed (the concurrency-64 gap is mt-bench's)
  ab64=(--draft chain="$DRAFT" --draft chain4="$DRAFT" --draft p="$DRAFT" --draft ps="$DRAFT"
        --config chain4:width=4 --config p:budget=auto --config ps:budget=auto,drain=scaled)
  ab1=(--draft chain="$DRAFT" --draft tree32="$DRAFT" --draft p="$DRAFT"
       --config tree32:verify=tree,tree_budget=32 --config p:budget=auto)
  for k in $(seq 1 "${RUNS:-2}"); do
    name=est2$([ "$k" = 1 ] || echo "-r$k")  # est2: labels p = persist, ps = scaled (est: p = scaled, pp, pr)
    DSPINE_PLAN_LOG="$WORK/logs/plan-log-$name-c64.jsonl" timed "plan$name-exact-c64" planab "$name" 64 64 "${ab64[@]}"
    DSPINE_PLAN_LOG="$WORK/logs/plan-log-$name-c1.jsonl" timed "plan$name-exact-c1" planab "$name" 1 5 "${ab1[@]}"
  done
fi
if has planmix; then  # the drain models on mixed batches (--mix: every batch holds every task's prompts, as a server's)
  abmix=(--mix --draft chain="$DRAFT" --draft chain4="$DRAFT" --draft p="$DRAFT" --draft ps="$DRAFT" --draft pc="$DRAFT"
         --config chain4:width=4 --config p:budget=auto --config ps:budget=auto,drain=scaled
         --config pc:budget=auto,drain=persist_cap)
  for c in 64 32; do
    DSPINE_PLAN_LOG="$WORK/logs/plan-log-mix-c$c.jsonl" timed "planmix-exact-c$c" planab mix "$c" 64 "${abmix[@]}"
  done
fi
if has planstate; then  # the planner's states at the two points "steps" (the default) missed on the H100
  st=(--draft chain="$DRAFT" --draft chain4="$DRAFT" --draft p="$DRAFT" --draft pk="$DRAFT" --draft pr="$DRAFT"
      --config chain4:width=4 --config p:budget=auto --config pk:budget=auto,state=kv
      --config pr:budget=auto,state=rows_kv)
  for k in $(seq 1 "${RUNS:-2}"); do
    r=$([ "$k" = 1 ] || echo "-r$k")
    DSPINE_PLAN_LOG="$WORK/logs/plan-log-state2$r-c64.jsonl" timed "planstate2$r-exact-c64" planab "state2$r" 64 64 "${st[@]}"
    out="$R/planner-state2$r-$G-invariant-T1-c32.json"
    finished "$out" || DSPINE_PLAN_LOG="$WORK/logs/plan-log-state2$r-inv-c32.jsonl" timed "planstate2$r-invariant-c32" \
      python -m infer.bench --backend cuda --target "$HF" --data-dir "$SHARED/data/eval" --invariant --temperature 1 \
      --top-p 0.95 --top-k 20 "${st[@]}" --concurrency 32 --num-prompts 64 --max-new-tokens 512 --output-json "$out" \
      --overwrite
  done
fi
if has planswitch && ! finished "$R/planner-switch-$G.json"; then
  timed planswitch python benchmarks/engine/bench_planner_loop.py --switch 32 --batches 1,8 --temperatures 0 \
    --new 128 --context 256 --reps 3 --output "$R/planner-switch-$G.json" --overwrite
fi
if has planexact && ! finished "$R/planner-switch-exact-$G.json"; then
  timed planexact python benchmarks/engine/bench_planner_loop.py --exact --switch 32 --batches 1,8 --temperatures 0 \
    --new 128 --context 256 --reps 3 --output "$R/planner-switch-exact-$G.json" --overwrite
fi
if has tables; then timed tables python scripts/make_tables.py; fi
echo "[$(date +%T)] done; timings in $WORK/timings.jsonl"
