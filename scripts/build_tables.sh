#!/usr/bin/env bash
# Rebuilds the n-gram table the `recycle` drafter ships in specdraft/heads/MODEL/recycle/, with the settings of
# the shipped one (its CARD.md says what it measured): the target's own answers to training prompts (tokens
# only; a distillation with recorded features, as scripts/build_heads.sh makes, serves as well), then the
# table (seconds), copied into the package, then the dev-suite benchmark. The distillation resumes when rerun.
# Usage: scripts/build_tables.sh smollm2-135m|gemma3-270m [WORK_DIR]
set -euo pipefail
MODEL=${1:?usage: scripts/build_tables.sh MODEL [WORK_DIR]}
WORK=${2:-runs/$MODEL-table}
PROMPTS=${PROMPTS:-../shared/data/prompts-train.jsonl}
SUITE=${SUITE:-../shared/data/specbench-dev.jsonl}
case "$MODEL" in
  smollm2-135m) LIMIT=6000 ;;
  gemma3-270m)  LIMIT=800 ;;
  *) echo "no recipe for $MODEL" >&2; exit 2 ;;
esac
PY=${PY:-.venv/bin/python}
mkdir -p "$WORK"
$PY -m specdraft.cli distill --model "$MODEL" --prompts "$PROMPTS" --out "$WORK/data" --limit "$LIMIT" --shuffle \
    --max-prompt-tokens 768 --max-tokens 256 --max-batch 32 --shard-size 100 --features none
$PY -m specdraft.cli train ngram-table --model "$MODEL" --data "$WORK/data" --out "$WORK/table" --top 4 --min-count 2
mkdir -p "specdraft/heads/$MODEL/recycle"
cp "$WORK/table/table.safetensors" "$WORK/table/config.json" "specdraft/heads/$MODEL/recycle/"
for T in 0 0.7; do
  $PY -m specdraft.cli bench --model "$MODEL" --suite "$SUITE" --per-category 4 --max-tokens 128 --temperature $T \
      --methods "plain,ngram,ngram+tree8,recycle,recycle+tree8" --out "$WORK/bench-t$T"
done
