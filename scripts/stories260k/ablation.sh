#!/usr/bin/env bash
# DSpine vs the DFlash ablation on a real (tiny) model, entirely on the CPU: Karpathy's stories260K
# target, drafts trained on the target's own samples with identical settings except `injection`,
# τ measured by the reference speculative decoder on held-out prompts (and τ_sim next to it).
#
#   DSPINE_SHARED=../shared bash scripts/stories260k/ablation.sh            # ~10 min on 2 CPU cores
#
# Writes runs/stories260k-ablation/{dspine,dflash}/metrics.jsonl and results/stories260k-ablation.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED=${DSPINE_SHARED:-${SHARED:-../shared}}  # DSPINE_SHARED, as the Python code reads it (SHARED still works)
T=$SHARED/models/stories260K/hf
W=${WORK:-runs/stories260k-ablation}
STEPS=${STEPS:-1000}
mkdir -p "$W"
[ -f "$W/train.jsonl" ] || python -m data.sample_target --target "$T" --num 4096 --max-new-tokens 128 \
  --temperature 1.0 --seed 0 --batch-size 512 --out "$W/train.jsonl"
[ -f "$W/eval.jsonl" ] || python -m data.sample_target --target "$T" --num 64 --max-new-tokens 128 \
  --temperature 1.0 --seed 1 --batch-size 512 --out "$W/eval.jsonl"
for name in dspine dflash; do
  inj=residual; [ "$name" = dflash ] && inj=none
  python train/distill.py --config configs/stories260k-cpu.yaml target="$T" train="$W/train.jsonl" \
    eval="$W/eval.jsonl" output_dir="$W/$name" injection=$inj block_size=16 max_steps="$STEPS" \
    save_every=0 eval_every=250 eval_prompts=16 eval_max_new_tokens=96 resume_from=none
done
python scripts/stories260k/summarize.py "$W" results/stories260k-ablation.json
