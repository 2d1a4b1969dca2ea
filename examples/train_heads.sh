#!/usr/bin/env bash
# Train EAGLE draft heads for the embedded SmolLM2-135M with `specjax train`, then decode with
# them (EAGLE-2). What `specjax train` does, stage by stage (each resumes if you rerun):
#   1. self-distillation: the base model answers the prompts (its own outputs become the data);
#   2. features: one teacher-forced pass stores the hidden states the heads learn to predict;
#   3. training: a jitted optax loop over the EAGLE loss (the base model stays frozen);
#   4. export: OUT/heads, a specjax head checkpoint that `--heads` loads.
#
#   examples/train_heads.sh [OUT_DIR]   # default runs/example-eagle; ~15 min on a 2-core CPU
#   SPECJAX_EXAMPLES_SMOKE=1 examples/train_heads.sh /tmp/out   # 4 prompts, 6 steps: ~1 min
#
# The prompt slice is examples/data/prompts.jsonl (24 prompts, 4 categories); point PROMPTS at a
# bigger JSONL file ('turns' or 'prompt' per line) for heads that accept more tokens per step.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${1:-runs/example-eagle}"
PROMPTS="${PROMPTS:-examples/data/prompts.jsonl}"
PROMPT="Give me three tips for staying focused while studying."

if [ "${SPECJAX_EXAMPLES_SMOKE:-0}" = "1" ]; then
  # A handful of prompts, short answers, a few optimizer steps: checks the pipeline runs.
  TRAIN=(--max-prompts 4 --max-new-tokens 24 --steps 6 --batch-size 2 --max-len 64
         --save-every 6 --eval-prompts 0)
  NEW_TOKENS=16
else
  # 20 prompts to train on, 4 held out for the evaluation report (OUT/eval.json).
  TRAIN=(--max-prompts 20 --max-new-tokens 128 --steps 200 --batch-size 4 --max-len 256
         --save-every 50 --eval-prompts 4 --eval-max-new-tokens 48)
  NEW_TOKENS=64
fi

echo "== specjax train --method eagle --out $OUT"
specjax train --method eagle --base smollm2-135m --prompts "$PROMPTS" --out "$OUT" \
  --lr 1e-3 --warmup 2 --no-progress "${TRAIN[@]}"

# EAGLE-1/2 share heads: decode with EAGLE-2's dynamic tree, sized for a CPU (a GPU affords the
# paper's --eagle-total-tokens 60 --eagle-depth 6 --eagle-top-k 10).
echo "== specjax generate --method eagle2 --heads $OUT/heads"
specjax generate --method eagle2 --heads "$OUT/heads" --eagle-total-tokens 8 --eagle-depth 3 \
  --eagle-top-k 3 --prompt "$PROMPT" --max-new-tokens "$NEW_TOKENS" --json \
  | tee "$OUT/generate.jsonl"

# One summary line: the text, and tokens per target pass (1.0 would mean no draft accepted).
python - "$OUT/generate.jsonl" <<'EOF'
import json, sys
r = json.loads(open(sys.argv[1]).readline())
print(f"text={r['text']!r}")
print(f"mean_accepted={r['mean_accepted']:.2f} tokens_per_s={r['tokens_per_s']:.1f} "
      f"new_tokens={r['new_tokens']} steps={r['steps']}")
EOF
