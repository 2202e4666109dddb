#!/usr/bin/env bash
# A/B of the training loss for the SmolLM2 DSpine draft: distill=ce (hard labels) against distill=kl (the
# target's next-token distribution), same data, steps, seed and schedule, one run per GPU at the same time
# (arms beyond the GPU count run one after the other);
# then scripts/smollm2/ab_summary.py compares the in-trainer evals (tau_real, tau_sim, tau_sim_agree, KL).
#
#   GGUF=models/SmolLM2-135M-Instruct.Q4_1.gguf DSPINE_SHARED=../shared bash scripts/smollm2/ab_loss.sh
#   TINY=1 DSPINE_SHARED=../shared bash scripts/smollm2/ab_loss.sh      # CPU smoke: stories260K, 8 steps
#
# Data: TRAIN and EVAL (data.tokenize caches) and TARGET (HF folder) when given; otherwise the recipe's
# stages `convert data regen tokenize` make them in WORK with a reduced regeneration (REGEN_LIMIT prompts,
# greedy + SAMPLES sampled answers, <= MAX_NEW tokens), skipping what exists (a rerun resumes).
# Budget on 2 x H200 (~5 min; recorded in WORK/timings.jsonl): convert ~30 s, data ~20 s, regen ~60-90 s
# (3 jobs of <= 3,000 rows over 2 GPUs, ~1 M tokens per job), tokenize ~20 s, train ~150 s (STEPS=256 at
# ~0.35-0.45 s/step + ~30 s start-up and compilation + 2 evals).
# Knobs (env): WORK (runs/ab-loss), STEPS (256), SEED (0), ARMS ("ce kl": values of `distill`, the first is
#   the baseline), CONFIG (configs/smollm2-135m-dspine.yaml), AB_OVERRIDES (extra key=value for every run),
#   EVAL_PROMPTS (8), REGEN_LIMIT (3000), SAMPLES (1), MAX_NEW (512), NGPU (all visible), OUT (WORK/ab-loss.json).
set -euo pipefail
cd "${DSPINE_REPO:-$(dirname "$0")/../..}"
SHARED=${DSPINE_SHARED:-${SHARED:-../shared}}
export DSPINE_SHARED=$SHARED PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
WORK=${WORK:-runs/ab-loss}
ARMS=${ARMS:-ce kl}
SEED=${SEED:-0}
NGPU=${NGPU:-$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
mkdir -p "$WORK/logs"
log() { echo "[$(date +%H:%M:%S)] $*"; }
timing() {  # timing NAME T0 RC: append {"stage", "seconds", "rc"} to WORK/timings.jsonl
  python - "$1" "$2" "$3" "$WORK/timings.jsonl" <<'EOF'
import json, sys, time
name, t0, rc, path = sys.argv[1:]
row = {"stage": name, "seconds": round(time.time() - float(t0), 1), "rc": int(rc)}
open(path, "a").write(json.dumps(row) + "\n")
print(f"[timing] {name}: {row['seconds']} s (rc {rc})")
EOF
}

# ------------------------------------------------------------------------------------------- data
if [ -n "${TINY:-}" ]; then  # CPU smoke: the stories260K target samples its own rows (no GPU engine)
  TARGET=${TARGET:-$SHARED/models/stories260K/hf}
  CONFIG=${CONFIG:-configs/stories260k-cpu.yaml}
  STEPS=${STEPS:-8}
  for split in train:64:0 eval:8:1; do
    IFS=: read -r name num seed <<< "$split"
    [ -f "$WORK/tiny-$name.jsonl" ] || python -m data.sample_target --target "$TARGET" --num "$num" \
      --max-new-tokens 32 --temperature 1.0 --seed "$seed" --batch-size 64 --out "$WORK/tiny-$name.jsonl" \
      > "$WORK/logs/sample-$name.log" 2>&1
  done
  TRAIN=${TRAIN:-$WORK/tiny-train.jsonl}; EVAL=${EVAL:-$WORK/tiny-eval.jsonl}
  EXTRA="max_length=64 anchors_per_seq=8 eval_max_new_tokens=16 eval_max_rows=8"
elif [ -z "${TRAIN:-}" ] || [ -z "${EVAL:-}" ]; then
  t0=$(date +%s.%N)
  WORK=$WORK REGEN_LIMIT=${REGEN_LIMIT:-3000} SAMPLES=${SAMPLES:-1} MAX_NEW=${MAX_NEW:-512} NGPU=$NGPU \
    bash scripts/smollm2/recipe.sh convert data regen tokenize
  timing data_total "$t0" 0
  TRAIN=$(bash scripts/smollm2/one_cache.sh "$WORK/tok-train"); EVAL=$(bash scripts/smollm2/one_cache.sh "$WORK/tok-eval")
fi
TARGET=${TARGET:-$WORK/smollm2-hf}
CONFIG=${CONFIG:-configs/smollm2-135m-dspine.yaml}
STEPS=${STEPS:-256}

# ------------------------------------------------------------------------------------------- train
t0=$(date +%s.%N)
runs=(); i=0
declare -A queue=()  # GPU -> arms, run one after the other (two runs sharing an H200 are slower than in turn)
for arm in $ARMS; do
  g=$((i % NGPU)); runs+=("--run" "$arm=$WORK/train-$arm"); queue[$g]+=" $arm"; i=$((i + 1))
done
train_arm() {  # train_arm ARM GPU
  local arm=$1 g=$2 out=$WORK/train-$1
  log "train distill=$arm on GPU $g -> $out (log $WORK/logs/train-$arm.log)"
  CUDA_VISIBLE_DEVICES=$g accelerate launch --num_processes 1 --num_machines 1 --dynamo_backend no \
    train/distill.py --config "$CONFIG" target="$TARGET" train="$TRAIN" eval="$EVAL" distill="$arm" seed="$SEED" \
    output_dir="$out" max_steps="$STEPS" save_every=0 keep_last=1 eval_every=$((STEPS / 2)) \
    eval_prompts="${EVAL_PROMPTS:-8}" ${EXTRA:-} ${AB_OVERRIDES:-} > "$WORK/logs/train-$arm.log" 2>&1
}
pids=()
for g in "${!queue[@]}"; do
  ( rc=0; for arm in ${queue[$g]}; do train_arm "$arm" "$g" || rc=$?; done; exit $rc ) & pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
timing train "$t0" "$rc"
for arm in $ARMS; do echo "== $arm"; tr '\r' '\n' < "$WORK/logs/train-$arm.log" | grep -E "step [0-9]+: eval" || tail -n 5 "$WORK/logs/train-$arm.log"; done
[ "$rc" = 0 ] || { log "a training run failed (rc $rc): see $WORK/logs/train-*.log"; exit "$rc"; }

# ------------------------------------------------------------------------------------------- compare
python scripts/smollm2/ab_summary.py "${runs[@]}" --timings "$WORK/timings.jsonl" --out "${OUT:-$WORK/ab-loss.json}" \
  --command "${TINY:+TINY=1 }STEPS=$STEPS ARMS='$ARMS' SEED=$SEED bash scripts/smollm2/ab_loss.sh"
