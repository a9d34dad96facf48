#!/usr/bin/env bash
# Rebuilds the draft heads shipped in specdraft/heads/ for one bundled model, with the exact settings of the
# shipped ones (their CARD.md says what each run measured): distillation with recorded target features, then
# an EAGLE-3 head and Medusa heads trained on them, then the dev-suite benchmark. Every step resumes where it
# stopped when rerun. Usage: scripts/build_heads.sh smollm2-135m|gemma3-270m [WORK_DIR]
set -euo pipefail
MODEL=${1:?usage: scripts/build_heads.sh MODEL [WORK_DIR]}
WORK=${2:-runs/$MODEL}
PROMPTS=${PROMPTS:-../shared/data/prompts-train.jsonl}
SUITE=${SUITE:-../shared/data/specbench-dev.jsonl}
case "$MODEL" in
  smollm2-135m) LIMIT=6000; EAGLE_STEPS=1200; EVAL=300; CKPT=100; MEDUSA_STEPS=300; VOCAB=8192 ;;
  gemma3-270m)  LIMIT=900;  EAGLE_STEPS=300; EVAL=100; CKPT=50; MEDUSA_STEPS=200; VOCAB=6144 ;;
  *) echo "no recipe for $MODEL" >&2; exit 2 ;;
esac
PY=${PY:-.venv/bin/python}
mkdir -p "$WORK"
# 1. The target's own answers (half greedy, half T=0.7) with its hidden states, batched 32 at a time.
$PY -m specdraft.cli distill --model "$MODEL" --prompts "$PROMPTS" --out "$WORK/data" --limit "$LIMIT" --shuffle \
    --max-prompt-tokens 768 --max-tokens 256 --max-batch 32 --shard-size 100 --dtype bf16
# 2. The heads (add --resume to continue an interrupted run).
RESUME=$([ -f "$WORK/eagle/checkpoint.pt" ] && echo --resume || true)
$PY -m specdraft.cli train eagle --model "$MODEL" --data "$WORK/data" --out "$WORK/eagle" --steps "$EAGLE_STEPS" \
    --draft-vocab "$VOCAB" --ttt-steps 3 --batch-size 8 --seq-len 512 --lr 1e-3 --eval-every "$EVAL" --checkpoint-every "$CKPT" $RESUME
RESUME=$([ -f "$WORK/medusa/checkpoint.pt" ] && echo --resume || true)
$PY -m specdraft.cli train medusa --model "$MODEL" --data "$WORK/data" --out "$WORK/medusa" --steps "$MEDUSA_STEPS" \
    --draft-vocab "$VOCAB" --heads 4 --batch-size 8 --seq-len 512 --lr 1e-3 --eval-every 100 $RESUME
# 3. Against plain decoding and ngram on the dev suite, greedy and sampled.
for T in 0 0.7; do
  $PY -m specdraft.cli bench --model "$MODEL" --suite "$SUITE" --per-category 4 --max-tokens 128 --temperature $T \
      --methods "plain,ngram,eagle:$WORK/eagle,medusa:$WORK/medusa" --out "$WORK/bench-t$T"
done
