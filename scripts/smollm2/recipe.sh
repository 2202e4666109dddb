#!/usr/bin/env bash
# The SmolLM2-135M-Instruct recipe in one command: data, regeneration, DSpine + DFlash drafts, benchmark.
#
#   GGUF=models/SmolLM2-135M-Instruct.Q4_1.gguf DSPINE_SHARED=../shared bash scripts/smollm2/recipe.sh [STAGE ...]
#
# Stages (default: all, in order; each one skips work whose output exists, so a killed run resumes):
#   convert   GGUF -> HF folder (bf16), loaded in a second by every later stage
#   data      stand-in prompts (all sources, exact duplicates dropped) -> data.decontaminate against the five
#             eval sets (13-gram overlap, duplicate prompts) -> clean train/eval prompt files
#   regen     answers by the target with the CUDA engine: greedy (T=0) plus SAMPLES sampled answers per
#             prompt (T=SAMPLE_T, one seed each), first user turn, <= MAX_NEW tokens; jobs spread over the GPUs
#   tokenize  all answers -> one data.tokenize cache (ChatML loss masks, <= 2048 tokens)
#   pack      (named only) tok-train and tok-eval -> $WORK/pack/tok-{train,eval}: pack.json + xz parts of
#             <= PART_MIB MiB each (python -m data.pack export; the SmolLM2 set fits in one or two parts)
#   unpack    (named only) the tok-* caches that are missing <- $PACK_DIR/tok-{train,eval} (data.pack import):
#             tok-train gets the cache of every pack folder in PACK_DIR that is not there yet (its pack.json's
#             cache_name), tok-eval the first pack folder's, only when it holds no cache (eval sets are identical)
#   train     DSpine (injection DSPINE_INJECTION, kv) and DFlash (injection none) drafts with identical settings, for each
#             seed in SEEDS; one run per GPU when there are enough GPUs, else one after the other on a GPU, or
#             TRAIN_PAR side by side per GPU (two runs sharing an H200 took 0.66 s/step each against 0.28 s/step
#             alone: results/smollm2-ab-loss-h200.json)
#   bench     infer.bench on the five tasks at T=0 and T=1 (top_p 0.95, top_k 20), concurrency 1 (BENCH_C1
#             prompts per task) and 8 (BENCH_C8), BENCH_NEW new tokens, AR of the same engine; every trained
#             seed's drafts in one run (labels DSpine / DFlash for seed 0, DSpine-s1 / DFlash-s1 ... for the
#             others; scripts/smollm2/compare_arms.py then gives the paired DSpine-vs-DFlash difference per seed)
#   scaling   tau of every saved checkpoint (T=0, concurrency 8, SCALE_PROMPTS per task, 256 tokens, no AR)
#   summary   results JSON + plots (scripts/smollm2/summarize.py)
# Every stage's wall clock goes to $WORK/timings.jsonl (also printed).
# Over two GPU sessions that each return only a few small files (README, "How to reproduce"):
#   session 1: recipe.sh convert data regen tokenize pack          -> bring back $WORK/pack (4-5 files)
#   session 2: PACK_DIR=<carried pack folder> [DRAFT_INIT=<folder with dspine/ and dflash/ drafts>] \
#              recipe.sh convert unpack train bench scaling summary
#   (packs of two regeneration leases: PACK_DIR="<pack 1> <pack 2>" TRAIN_CACHES=all trains on both caches)
# Knobs (env): WORK (runs/smollm2), NGPU (all visible), SAMPLES (3), SAMPLE_T (0.8), MAX_NEW (1024),
#   REGEN_CONC (engine slots per job, 512), REGEN_PAR (regeneration jobs side by side per GPU, 1), TRAIN_PAR
#   (training runs side by side per GPU, 1),
#   REGEN_CHUNK (rows per resumable write, 4096), REGEN_LIMIT (rows), ARMS (drafts to train: "dspine dflash"),
#   VARIANTS (extra DSpine arms for the injection study, each NAME:key=value[+key=value...], e.g.
#   "res:injection=residual r0:injection=residual+injection_rank=0": trained from scratch per seed as train-dspine-NAME-s<k> with those
#   trainer overrides last, benched as DSpine-NAME[-s<k>]; scripts/smollm2/compare_arms.py pairs each with DFlash),
#   STEPS (optimizer steps per draft, 2000) or TRAIN_MINUTES (wall clock per run: STEPS from a 30-step
#   calibration), SEEDS ("0"), TRAIN_OVERRIDES (extra key=value for every run, e.g. "distill=kl"),
#   BENCH_C1 (20), BENCH_C8 (40), BENCH_NEW (512), SCALE_PROMPTS (8), RESULTS (results JSON prefix),
#   PART_MIB (largest pack part, 15), PACK_DIR (where unpack reads, $WORK/pack; several pack folders separated
#   by spaces import one train cache each), TRAIN_CACHES (one: train on the one cache in $WORK/tok-train, refusing
#   several; all: on every finished cache there, as the trainer's train=a,b list sorted by folder name), DRAFT_INIT (warm start:
#   each run starts from DRAFT_INIT/dspine or DRAFT_INIT/dflash through the trainer's draft_init),
#   DSPINE_INIT / DFLASH_INIT (one arm's warm start, a draft folder: it wins over DRAFT_INIT; a warm-started
#   run keeps its draft's injection), DSPINE_INJECTION (kv: the DSpine arm's injection from scratch; residual
#   before 2026-12-02: kv led DFlash by +8.4% / +6.4% at T = 0 / 1 over two seeds, residual by 0-2%,
#   results/smollm2-kv2seeds-h200.json and results/smollm2-variants-h200.json), OVERWRITE
#   (summary: replace existing files under RESULTS; without it summary refuses), SAMPLE_SEED0 (0: the
#   sampled jobs use seeds SAMPLE_SEED0+1 .. SAMPLE_SEED0+SAMPLES, so a later lease with SAMPLE_SEED0=3
#   draws answers the earlier one did not), GREEDY (1; 0 skips the greedy train job, which would repeat
#   the earlier lease's answers token for token).
# The shipped draft checkpoints/smollm2-135m-dspine took four continuations of the recipe's DSpine draft:
#   1. the data stages (with REGEN_PAR=4), then ARMS=dspine STEPS=1728 DSPINE_INIT=<the recipe's draft, git show
#      ebc9baa:checkpoints/smollm2-135m-dspine> recipe.sh train (results/smollm2-continue-h200.json);
#   2. PACK_DIR=<the pack of 1> recipe.sh unpack, then ARMS=dspine STEPS=2656 DSPINE_INIT=<the draft of 1, git show
#      33657e2:checkpoints/smollm2-135m-dspine> recipe.sh train bench (results/smollm2-continue2-h200.json);
#   3. (a fresh WORK) GREEDY=0 SAMPLE_SEED0=3 SAMPLES=4 REGEN_PAR=4 recipe.sh convert data regen tokenize pack, then ARMS=dspine
#      STEPS=2048 DSPINE_INIT=<the draft of 2, git show e39ad58:checkpoints/smollm2-135m-dspine> recipe.sh train
#      bench (results/smollm2-continue3-h200.json);
#   4. (a fresh WORK) GREEDY=0 SAMPLE_SEED0=7 SAMPLES=4 REGEN_PAR=4 recipe.sh convert data regen tokenize pack, then
#      PACK_DIR=<the pack of 3> recipe.sh unpack, then TRAIN_CACHES=all ARMS=dspine STEPS=1600 DSPINE_INIT=<the draft
#      of 3, git show 8f1ea67:checkpoints/smollm2-135m-dspine> recipe.sh train bench (results/smollm2-continue4-h200.json).
#   A folder from `git show`: mkdir -p D && for f in config.json model.safetensors; do
#   git show 33657e2:checkpoints/smollm2-135m-dspine/$f > D/$f; done
# Stages regen/train/bench/scaling refuse to start without a CUDA GPU (RECIPE_ALLOW_CPU=1 lets them try).
set -euo pipefail
cd "${DSPINE_REPO:-$(dirname "$0")/../..}"  # DSPINE_REPO: run a copy of this script from elsewhere
WORK=${WORK:-runs/smollm2}
GGUF=${GGUF:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
SHARED=${DSPINE_SHARED:-${SHARED:-../shared}}
export DSPINE_SHARED=$SHARED
STAGES=${*:-convert data regen tokenize train bench scaling summary}
TARGET=$WORK/smollm2-hf
SAMPLES=${SAMPLES:-3}
SEEDS=${SEEDS:-0}
STEPS_SET=${STEPS:-}
STEPS=${STEPS:-2000}
NGPU=${NGPU:-$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ALL_STAGES="convert data regen tokenize pack unpack train bench scaling summary"
for st in $STAGES; do  # a typo must not skip a stage silently
  [[ " $ALL_STAGES " == *" $st "* ]] || { echo "error: unknown stage '$st' (stages: $ALL_STAGES)" >&2; exit 2; }
done
for arm in ${ARMS:-dspine dflash}; do
  [[ " dspine dflash " == *" $arm "* ]] || { echo "error: ARMS='${ARMS:-}': unknown draft '$arm' (dspine, dflash)" >&2; exit 2; }
done
DSPINE_INJECTION_SET=${DSPINE_INJECTION+x}  # given by the user: a warm start must agree with it
DSPINE_INJECTION=${DSPINE_INJECTION-kv}
[[ "$DSPINE_INJECTION" =~ ^(kv|residual)$ ]] || { echo "error: DSPINE_INJECTION='$DSPINE_INJECTION': give kv or residual" >&2; exit 2; }
arms_set=${ARMS-x}
[ -n "${arms_set//[[:space:]]/}" ] || { echo "error: ARMS is empty: give dspine, dflash or both" >&2; exit 2; }
# integers in decimal without a leading zero (bash arithmetic reads 08 as bad octal, 010 as 8) and at most 9 digits
[[ "${REGEN_PAR:-1}" =~ ^[1-9][0-9]{0,8}$ ]] || { echo "error: REGEN_PAR='${REGEN_PAR}': must be an integer >= 1" >&2; exit 2; }
[[ "${TRAIN_PAR:-1}" =~ ^[1-9][0-9]{0,8}$ ]] || { echo "error: TRAIN_PAR='${TRAIN_PAR}': must be an integer >= 1" >&2; exit 2; }
for seed in $SEEDS; do
  [[ "$seed" =~ ^(0|[1-9][0-9]{0,8})$ ]] || { echo "error: SEEDS='${SEEDS}': '$seed' is not an integer >= 0 (decimal, no leading zero)" >&2; exit 2; }
done
[ -n "${SEEDS//[[:space:]]/}" ] || { echo "error: SEEDS is empty: give at least one seed (e.g. SEEDS=\"0 1\")" >&2; exit 2; }
[[ "${SAMPLE_SEED0:-0}" =~ ^(0|[1-9][0-9]{0,8})$ ]] || { echo "error: SAMPLE_SEED0='${SAMPLE_SEED0}': must be an integer >= 0 (decimal, no leading zero, at most 9 digits)" >&2; exit 2; }
[[ "${GREEDY:-1}" =~ ^[01]$ ]] || { echo "error: GREEDY='${GREEDY}': must be 0 or 1" >&2; exit 2; }
[[ "$SAMPLES" =~ ^(0|[1-9][0-9]{0,2})$ ]] || { echo "error: SAMPLES='${SAMPLES}': must be an integer from 0 to 999 (decimal, no leading zero)" >&2; exit 2; }
for v in ${VARIANTS:-}; do  # NAME:key=value[+key=value...]: extra DSpine arms (injection variants)
  [[ "$v" =~ ^[a-z][a-z0-9]*:[a-z_]+=[^+[:space:]]+(\+[a-z_]+=[^+[:space:]]+)*$ ]] && [[ ! "${v%%:*}" =~ ^s[0-9]+$ ]] || {
    echo "error: VARIANTS='${VARIANTS}': '$v' is not NAME:key=value[+key=value...] (NAME lower-case letters and" \
         "digits, not s<k>; e.g. kv:injection=kv r0:injection_rank=0)" >&2; exit 2; }
done
[[ "${TRAIN_CACHES:-one}" =~ ^(one|all)$ ]] || { echo "error: TRAIN_CACHES='${TRAIN_CACHES}': must be one (the single cache in \$WORK/tok-train) or all (every cache there)" >&2; exit 2; }
for st in regen train bench scaling; do  # the CUDA engine and the trainer's recipe settings need a GPU
  if [[ " $STAGES " == *" $st "* ]] && [ "${RECIPE_ALLOW_CPU:-0}" != 1 ] && \
     ! python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "error: stage '$st' needs a CUDA GPU (no GPU visible to torch); run the data stages alone" \
         "(e.g. recipe.sh convert data) or set RECIPE_ALLOW_CPU=1" >&2
    exit 2
  fi
done
mkdir -p "$WORK/logs"
log() { echo "[$(date +%H:%M:%S)] $*"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
arm() { [[ " ${ARMS:-dspine dflash} " == *" $1 "* ]]; }  # arm NAME: NAME is one of the drafts to train/bench

timed() {  # timed NAME CMD...: run CMD, append {"stage", "seconds", "rc"} to timings.jsonl
  local name=$1; shift
  local t0 rc=0
  t0=$(date +%s.%N)
  log "start $name"
  "$@" || rc=$?
  python - "$WORK/timings.jsonl" "$name" "$t0" "$(date +%s.%N)" "$rc" <<'EOF'
import json, sys
path, name, t0, t1, rc = sys.argv[1:]
row = {"stage": name, "seconds": round(float(t1) - float(t0), 1), "rc": int(rc)}
open(path, "a").write(json.dumps(row) + "\n")
print(f"[timing] {name}: {row['seconds']} s (rc {rc})")
EOF
  return $rc
}

gpu_queue() {  # gpu_queue G CMD-FILE: run the file's lines one after the other on GPU G
  local g=$1 file=$2 rc=0
  while IFS= read -r line; do
    [ -z "$line" ] && continue
    CUDA_VISIBLE_DEVICES=$g bash -c "$line" || rc=$?
  done < "$file"
  return $rc
}

run_queues() {  # run_queues PREFIX [PER_GPU]: $WORK/PREFIX.gpu{q} command files, one background queue each;
  # queue q runs on GPU q % NGPU, so PER_GPU > 1 puts that many queues side by side on every GPU
  local prefix=$1 per=${2:-1} pids=() rc=0 q
  for ((q = 0; q < NGPU * per; q++)); do
    [ -s "$WORK/$prefix.gpu$q" ] || continue
    gpu_queue "$((q % NGPU))" "$WORK/$prefix.gpu$q" & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
  return $rc
}

# ------------------------------------------------------------------------------------------- convert
if has convert && [ ! -f "$TARGET/config.json" ]; then
  timed convert python -m dspine.convert --target "$GGUF" --out "$TARGET" --dtype bf16
fi

# ------------------------------------------------------------------------------------------- data
if has data; then
  T=$SHARED/data/train
  data_stage() {
    [ -f "$WORK/prepared/summary.json" ] || python -m data.prepare \
      --input standin="$T/perfectblend_standin/perfectblend_schema_standin.jsonl" gsm8k="$T/gsm8k/train.jsonl" \
      codealpaca="$T/codealpaca/code_alpaca_2k.json" alpaca="$T/alpaca_demo/alpaca_en_demo.json" \
      dpo="$T/alpaca_demo/dpo_en_demo.json" identity="$T/alpaca_demo/identity.json" \
      --output "$WORK/prepared" --eval-fraction 0.01
    for split in train eval; do
      python -m data.decontaminate --input "$WORK/prepared/$split.jsonl" --output "$WORK/clean-$split" \
        --eval-dir "$SHARED/data/eval" || return 1  # set -e does not apply inside timed
    done
  }
  timed data data_stage
fi

# ------------------------------------------------------------------------------------------- regen
regen_cmd() {  # regen_cmd SPLIT NAME TEMPERATURE SEED
  echo "python -m data.regenerate --target $TARGET --input $WORK/clean-$1/train.jsonl --output $WORK/regen-$1-$2" \
       "--max-new-tokens ${MAX_NEW:-1024} --temperature $3 --seed $4 --max-turns 1 --max-context 2048" \
       "--batch-size ${REGEN_CHUNK:-4096} --concurrency ${REGEN_CONC:-512} --backend engine" \
       "${REGEN_LIMIT:+--limit $REGEN_LIMIT} > $WORK/logs/regen-$1-$2.log 2>&1"
}
if has regen; then
  rm -f "$WORK"/regen.gpu*
  jobs=()
  [ "${GREEDY:-1}" = 1 ] && jobs+=("$(regen_cmd train greedy 0 0)")
  for ((s = ${SAMPLE_SEED0:-0} + 1; s <= ${SAMPLE_SEED0:-0} + SAMPLES; s++)); do
    jobs+=("$(regen_cmd train sample$s "${SAMPLE_T:-0.8}" "$s")")
  done
  [ ${#jobs[@]} -gt 0 ] || { echo "error: GREEDY=0 and SAMPLES=0: no training answers to regenerate" >&2; exit 2; }
  jobs+=("$(regen_cmd eval greedy 0 0)")  # 1% split, seconds
  # REGEN_PAR jobs side by side per GPU: one engine process is bound by its host loop (SmolLM2 at 512 slots
  # kept an H200 busy a fraction of the time), and each holds its own KV cache (512 x 2048 slots: ~24 GB)
  par=${REGEN_PAR:-1}
  for i in "${!jobs[@]}"; do echo "${jobs[$i]}" >> "$WORK/regen.gpu$((i % (NGPU * par)))"; done
  timed regen run_queues regen "$par"
fi

# ------------------------------------------------------------------------------------------- tokenize
if has tokenize; then
  tok_stage() {
    cat "$WORK"/regen-train-*/results.jsonl > "$WORK/answers-train.jsonl"
    for split in train eval; do
      src=$WORK/answers-train.jsonl; [ "$split" = eval ] && src=$WORK/regen-eval-greedy/results.jsonl
      python -m data.tokenize --input "$src" --tokenizer "$TARGET" --max-length 2048 \
        --cache-dir "$WORK/tok-$split" --num-proc "${TOK_PROCS:-8}" > "$WORK/logs/tokenize-$split.log" 2>&1 || return 1
    done
  }
  timed tokenize tok_stage
fi

# ------------------------------------------------------------------------------------------- pack
if has pack; then
  pack_stage() {
    for split in train eval; do
      cache=$(bash scripts/smollm2/one_cache.sh "$WORK/tok-$split") || return 1
      python -m data.pack export --cache "$cache" --out "$WORK/pack/tok-$split" --part-mib "${PART_MIB:-15}" || return 1
    done
  }
  timed pack pack_stage
fi

# ------------------------------------------------------------------------------------------- unpack
if has unpack; then
  unpack_stage() {  # `|| return 1` throughout: set -e does not apply inside `timed`'s `"$@" || rc=$?`
    local packs pack split name
    read -r -a packs <<< "${PACK_DIR:-$WORK/pack}"
    [ ${#packs[@]} -gt 0 ] || { echo "error: PACK_DIR='${PACK_DIR}' names no pack folder" >&2; return 1; }
    for split in train eval; do
      if [ "$split" = eval ] && compgen -G "$WORK/tok-eval/*/summary.json" > /dev/null; then
        log "$WORK/tok-eval holds a cache; not unpacked"
        continue
      fi
      for pack in "${packs[@]}"; do
        [ -f "$pack/tok-$split/pack.json" ] || {
          echo "error: PACK_DIR: $pack/tok-$split/pack.json not found (a data.pack archive, made by the pack stage)" >&2
          return 1; }
        name=$(python - "$pack/tok-$split/pack.json" <<'EOF3'
import json, sys
name = json.load(open(sys.argv[1])).get("cache_name")
sys.exit(f"error: {sys.argv[1]}: no cache_name (not a data.pack archive?)") if not name else print(name)
EOF3
) || return 1
        if [ -f "$WORK/tok-$split/$name/summary.json" ]; then
          log "$WORK/tok-$split/$name exists; $pack/tok-$split not unpacked"
        else
          python -m data.pack import --parts "$pack/tok-$split" --cache-dir "$WORK/tok-$split" || return 1
        fi
        [ "$split" = train ] || break  # eval: the first pack folder's (the eval sets of all runs are identical)
      done
    done
  }
  timed unpack unpack_stage
fi

# ------------------------------------------------------------------------------------------- train
if has train; then  # here, not in train_cmd: a refusal inside $(train_cmd ...) would not stop the script
  if [ "${TRAIN_CACHES:-one}" = all ]; then  # train=a,b,...: every finished cache, sorted by folder name
    TRAIN_CACHE=$(bash scripts/smollm2/one_cache.sh --all "$WORK/tok-train")
  else
    TRAIN_CACHE=$(bash scripts/smollm2/one_cache.sh "$WORK/tok-train")
  fi
  EVAL_CACHE=$(bash scripts/smollm2/one_cache.sh "$WORK/tok-eval")
fi
init_arg() {  # init_arg NAME: the trainer's draft_init for arm NAME (DSPINE_INIT / DFLASH_INIT, else DRAFT_INIT/NAME)
  [[ "$1" == *-* ]] && return 0  # a VARIANTS arm (dspine-NAME) starts from scratch: its shapes may differ
  local var=${1^^}_INIT
  if [ -n "${!var:-}" ]; then echo "draft_init=${!var}"; elif [ -n "${DRAFT_INIT:-}" ]; then echo "draft_init=$DRAFT_INIT/$1"; fi
}
if has train && arm dspine; then  # a DSpine warm start: its draft has an injection, the one DSPINE_INJECTION names
  d_init=$(init_arg dspine); d_init=${d_init#draft_init=}
  if [ -n "$d_init" ] && [ -f "$d_init/config.json" ]; then
    have=$(python -c "import json, sys; print((json.load(open(sys.argv[1])).get('dspine_config') or {}).get('injection', 'none'))" \
           "$d_init/config.json") || { echo "error: $d_init/config.json: not a readable draft config" >&2; exit 2; }
    [ "$have" != none ] || { echo "error: the DSpine warm start $d_init is a DFlash draft (no injection); give a DSpine" \
                             "draft, or train the DSpine arm from scratch" >&2; exit 2; }
    if [ -n "$DSPINE_INJECTION_SET" ] && [ "$have" != "$DSPINE_INJECTION" ]; then
      echo "error: DSPINE_INJECTION=$DSPINE_INJECTION but the warm start $d_init has injection $have (a warm start keeps" \
           "its draft's injection: unset DSPINE_INJECTION, or convert with the trainer's init_from)" >&2; exit 2
    fi
  fi
fi
train_cmd() {  # train_cmd NAME INJECTION SEED [OVERRIDES]: OVERRIDES (a VARIANTS arm's) come last and win
  local init inj
  init=$(init_arg "${1/calib/dspine}")
  # a DSpine warm start keeps its draft's injection (draft_init's config; checked above); DFlash always says none,
  # so the trainer refuses a DFlash warm start from a draft with an injection
  inj="injection=$2"; [ -n "$init" ] && [ "$2" != none ] && inj=""
  echo "accelerate launch --num_processes 1 --num_machines 1 --dynamo_backend no" \
       "train/distill.py --config configs/smollm2-135m-dspine.yaml target=$TARGET train=$TRAIN_CACHE eval=$EVAL_CACHE" \
       "$inj seed=$3 output_dir=$WORK/train-$1-s$3 max_steps=$STEPS save_every=$((STEPS / 8))" \
       "eval_every=$((STEPS / 4)) keep_last=0 $init ${TRAIN_OVERRIDES:-} ${4:-}" \
       "> $WORK/logs/train-$1-s$3.log 2>&1"
}
if has train && [ -z "${STEPS_SET:-}" ] && [ -n "${TRAIN_MINUTES:-}" ]; then
  # calibrate: 30 steps of the DSpine run (the first 10 hold compilation), then STEPS = budget / step time
  calib() {
    local cmd
    cmd=$(STEPS=1000 train_cmd calib "$DSPINE_INJECTION" 0 | sed "s|max_steps=1000|max_steps=1000 stop_after_steps=30 log_every=10 eval=null save_every=0|")
    CUDA_VISIBLE_DEVICES=0 bash -c "$cmd"
  }
  timed calibrate calib
  n_arms=0; arm dspine && n_arms=$((n_arms + 1)); arm dflash && n_arms=$((n_arms + 1))
  STEPS=$(python - "$WORK/train-calib-s0/metrics.jsonl" "$TRAIN_MINUTES" "$NGPU" "$SEEDS" "$n_arms" <<'EOF2'
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if '"loss"' in x]
step_s = sorted(r["step_s"] for r in rows[1:])[len(rows[1:]) // 2]
runs = int(sys.argv[5]) * len(sys.argv[4].split())
share = -(-runs // int(sys.argv[3]))  # runs per GPU (side by side under TRAIN_PAR: about as slow in total)
print(int(float(sys.argv[2]) * 60 / (step_s * share * 1.1)) // 8 * 8)  # 10% for evals and checkpoints
EOF2
)
  log "calibrated: STEPS=$STEPS for TRAIN_MINUTES=$TRAIN_MINUTES"
  echo "{\"stage\": \"calibrated_steps\", \"steps\": $STEPS, \"train_minutes\": $TRAIN_MINUTES}" >> "$WORK/timings.jsonl"
fi
if has train; then
  rm -f "$WORK"/train.gpu*
  i=0
  for seed in $SEEDS; do
    for pair in "dspine:$DSPINE_INJECTION" dflash:none; do
      name=${pair%%:*}; inj=${pair##*:}
      arm "$name" || continue
      # queue i % (NGPU·TRAIN_PAR): TRAIN_PAR queues side by side on each GPU, further runs one after the other
      g=$((i % (NGPU * ${TRAIN_PAR:-1})))
      train_cmd "$name" "$inj" "$seed" >> "$WORK/train.gpu$g"
      i=$((i + 1))
    done
    for v in ${VARIANTS:-}; do  # dspine-NAME: residual injection with the variant's overrides, from scratch
      g=$((i % (NGPU * ${TRAIN_PAR:-1})))
      train_cmd "dspine-${v%%:*}" residual "$seed" "$(echo "${v#*:}" | tr '+' ' ')" >> "$WORK/train.gpu$g"
      i=$((i + 1))
    done
  done
  timed train run_queues train "${TRAIN_PAR:-1}"
  for f in "$WORK"/logs/train-*.log; do echo "== $f"; tail -n 3 "$f"; done
fi

# ------------------------------------------------------------------------------------------- bench
latest() { echo "$WORK/train-$1-s${2:-0}/$(cat "$WORK/train-$1-s${2:-0}/latest")/draft"; }  # latest NAME [SEED]
if has bench; then
  rm -f "$WORK"/bench.gpu*
  mkdir -p "$WORK/bench"
  for temp in 0 1; do
    samp=""; [ "$temp" = 1 ] && samp="--top-p 0.95 --top-k 20"
    for conc in 1 8; do
      n=${BENCH_C8:-40}; [ "$conc" = 1 ] && n=${BENCH_C1:-20}
      out=$WORK/bench/smollm2-h200-T$temp-c$conc.json
      if [ -f "$out" ]; then log "$out exists: not benched again (delete it to bench the current drafts)"; continue; fi
      drafts=""
      for seed in $SEEDS; do  # seed 0 keeps the plain labels; the others get a -s<seed> suffix
        sfx=""; [ "$seed" = 0 ] || sfx="-s$seed"
        arm dspine && drafts+=" --draft DSpine$sfx=$(latest dspine "$seed")"
        arm dflash && drafts+=" --draft DFlash$sfx=$(latest dflash "$seed")"
        for v in ${VARIANTS:-}; do drafts+=" --draft DSpine-${v%%:*}$sfx=$(latest "dspine-${v%%:*}" "$seed")"; done
      done
      echo "python -m infer.bench --target $TARGET$drafts" \
           "--datasets gsm8k,math500,humaneval,mbpp,mt-bench --num-prompts $n --max-new-tokens ${BENCH_NEW:-512}" \
           "--temperature $temp $samp --concurrency $conc --output-json $out > $WORK/logs/bench-T$temp-c$conc.log 2>&1" \
           >> "$WORK/bench.gpu$(((temp + conc / 8) % NGPU))"  # each GPU: one long (c1) and one short run
    done
  done
  timed bench run_queues bench
fi

# ------------------------------------------------------------------------------------------- scaling
if has scaling; then
  rm -f "$WORK"/scaling.gpu*
  i=0
  for name in ${ARMS:-dspine dflash}; do
    out=$WORK/bench/scaling-$name.json
    if [ -f "$out" ]; then log "$out exists: not measured again (delete it to re-measure)"; continue; fi
    drafts=""
    for d in "$WORK"/train-$name-s0/step-*/draft; do drafts+=" --draft $(basename "$(dirname "$d")")=$d"; done
    echo "python -m infer.bench --target $TARGET $drafts --no-ar --datasets gsm8k,math500,humaneval,mbpp,mt-bench" \
         "--num-prompts ${SCALE_PROMPTS:-8} --max-new-tokens ${SCALE_NEW:-256} --temperature 0 --concurrency 8 --output-json $out" \
         "> $WORK/logs/scaling-$name.log 2>&1" >> "$WORK/scaling.gpu$((i % NGPU))"
    i=$((i + 1))
  done
  timed scaling run_queues scaling
fi

if has summary; then
  timed summary python scripts/smollm2/summarize.py --work "$WORK" --out "${RESULTS:-results}" \
    ${OVERWRITE:+--overwrite}
fi
log "done"
