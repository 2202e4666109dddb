#!/usr/bin/env bash
# End-to-end DSpine vs DFlash for SmolLM2-135M-Instruct (the project's first result table).
#
#   WORK=runs/smollm2 GGUF=models/SmolLM2-135M-Instruct.Q4_1.gguf DSPINE_SHARED=../shared \
#       bash scripts/smollm2/pipeline.sh [convert] [data] [train] [bench]
#
# Stages (default: all, in order; each skips work whose output already exists):
#   convert  GGUF -> HF folder (bf16) with dspine.convert
#   data     prepare the stand-in prompts, regenerate answers with the target (greedy, <= 1024 new
#            tokens, ChatML), tokenize with loss masks
#   train    DSpine (injection residual) and DFlash (injection none) drafts, identical settings,
#            trained side by side on one GPU
#   bench    infer.bench on the five tasks, T=0 and T=1 (top_p 0.95, top_k 20), concurrency 1 and 8
# Knobs (env): REGEN_LIMIT (rows, default all), REGEN_BATCH (engine slots, 256), MAX_NEW (1024),
#   TRAIN_OVERRIDES (extra key=value for both drafts), TRAIN_TIMEOUT (seconds, 0 = none),
#   BENCH_PROMPTS (per task at concurrency 8, 20), BENCH_PROMPTS_C1 (per task at concurrency 1, 8),
#   BENCH_NEW (512), DEVICE_ARGS (extra infer.bench flags).
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-runs/smollm2}
GGUF=${GGUF:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
SHARED=${DSPINE_SHARED:-${SHARED:-../shared}}  # DSPINE_SHARED, as the Python code reads it (SHARED still works)
STAGES=${*:-convert data train bench}
TARGET=$WORK/smollm2-hf
mkdir -p "$WORK"
log() { echo "[$(date +%H:%M:%S)] $*"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has convert && [ ! -f "$TARGET/config.json" ]; then
  log "convert $GGUF -> $TARGET"
  python -m dspine.convert --target "$GGUF" --out "$TARGET" --dtype bf16
fi

if has data; then
  T=$SHARED/data/train
  if [ ! -f "$WORK/prepared/summary.json" ]; then
    log "prepare"
    python -m data.prepare --input standin="$T/perfectblend_standin/perfectblend_schema_standin.jsonl" \
      gsm8k="$T/gsm8k/train.jsonl" codealpaca="$T/codealpaca/code_alpaca_2k.json" \
      --output "$WORK/prepared" --eval-fraction 0.01
  fi
  for split in train eval; do
    log "regenerate $split"
    python -m data.regenerate --target "$TARGET" --input "$WORK/prepared/$split.jsonl" --output "$WORK/regen-$split" \
      --max-new-tokens "${MAX_NEW:-1024}" --temperature 0 --max-turns 1 --max-context 3072 \
      --batch-size "${REGEN_BATCH:-256}" ${REGEN_LIMIT:+--limit $REGEN_LIMIT} --backend auto
    log "tokenize $split"
    python -m data.tokenize --input "$WORK/regen-$split/results.jsonl" --tokenizer "$TARGET" --max-length 2048 \
      --cache-dir "$WORK/tok-$split" --num-proc "${TOK_PROCS:-8}"
  done
fi

if has train; then
  TRAIN_CACHE=$(ls -d "$WORK"/tok-train/*/ | head -1)
  EVAL_CACHE=$(ls -d "$WORK"/tok-eval/*/ | head -1)
  pids=()
  for name in dspine dflash; do
    log "train $name"
    ${TRAIN_TIMEOUT:+timeout $TRAIN_TIMEOUT} accelerate launch --num_processes 1 --num_machines 1 \
      --dynamo_backend no train/distill.py --config "configs/smollm2-135m-$name.yaml" \
      target="$TARGET" train="$TRAIN_CACHE" eval="$EVAL_CACHE" output_dir="$WORK/train-$name" \
      ${TRAIN_OVERRIDES:-} > "$WORK/train-$name.log" 2>&1 &
    pids+=($!)
  done
  status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
  log "train finished (status $status)"; tail -3 "$WORK"/train-*.log
fi

if has bench; then
  for name in dspine dflash; do
    d=$WORK/train-$name
    [ -f "$d/latest" ] && echo "$name: $(cat "$d/latest")"
  done
  latest() { echo "$WORK/train-$1/$(cat "$WORK/train-$1/latest")/draft"; }
  for temp in 0 1; do
    samp=""; [ "$temp" = 1 ] && samp="--top-p 0.95 --top-k 20"
    for conc in 8 1; do
      n=${BENCH_PROMPTS:-20}; [ "$conc" = 1 ] && n=${BENCH_PROMPTS_C1:-8}
      log "bench T=$temp concurrency $conc ($n prompts per task)"
      python -m infer.bench --target "$TARGET" --draft DSpine="$(latest dspine)" --draft DFlash="$(latest dflash)" \
        --datasets gsm8k,math500,humaneval,mbpp,mt-bench --data-dir "$SHARED/data/eval" --num-prompts "$n" \
        --max-new-tokens "${BENCH_NEW:-512}" --temperature "$temp" $samp --concurrency "$conc" \
        --output-json "$WORK/bench/smollm2-T${temp}-c${conc}.json" ${DEVICE_ARGS:-}
    done
  done
fi
log "done"
