#!/usr/bin/env bash
# Issue 26's speed check in one device call: a baseline commit's tree ("before") against this
# checkout ("after"), side by side on one machine (benchmarks/before_after.py): whole-GPU int4
# decode, the static split at 25 %, the expert cache at 25 %, on the 16-layer OLMoE-shaped model
# with topic-following routing (the model of h200_topics.sh); each tree its own install and plans,
# ROUNDS rounds in alternating order, medians, greedy tokens compared. The device gets no .git:
# pack the baseline here first, into an ignored file the call carries.
#   here:    bash benchmarks/h200_before_after.sh pack [COMMIT]     (writes build/before.tgz; default f95d830)
#   device:  bash benchmarks/h200_before_after.sh                   (carry build/before.tgz; outputs under $OUT,
#            else /tmp/baout; BEFORE: a folder or .tgz, LAYERS, ROUNDS, VARIANTS, LIMIT, PROMPT_SECONDS;
#            EXTRA: more before_after.py options: "--reuse" in a second call to a still-warm machine adds
#            ROUNDS rounds to the first call's; "--tiny --device cpu" with LAYERS=2 is a smoke test on the VM)
if [ "${1:-}" = pack ]; then
  set -euo pipefail
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  mkdir -p build
  # the product, the benchmarks the driver runs in the tree, the tokenizer and calibration text
  git archive "${2:-f95d830}" -- . ':(exclude)tests' ':(exclude)benchmarks/traces' \
    ':(exclude)examples/models/tiny-moe/model.safetensors' | gzip > build/before.tgz
  ls -l build/before.tgz
  exit 0
fi
# as h200_setup.sh, less its editable install: each tree gets its own install under /tmp/ba
set -euo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/baout}
mkdir -p "$OUT"
BEFORE=${BEFORE:-build/before.tgz}
if [ -f "$BEFORE" ]; then
  rm -rf /tmp/before_tree && mkdir -p /tmp/before_tree && tar xzf "$BEFORE" -C /tmp/before_tree
  BEFORE=/tmp/before_tree
fi
LIMIT=${LIMIT:-550}
timeout $LIMIT python benchmarks/before_after.py --tree before=$BEFORE --tree after=. --work-dir /tmp/ba \
  --layers ${LAYERS:-16} --router-skew 0.5 --topics 4 --topic-strength 1.0,0.2,0.03 --quant int4 \
  --hw benchmarks/profiles/h200-2026-11-29-raw.json --calib-tokens 256 --n-new 48 --repeats 2 \
  --rounds ${ROUNDS:-3} --variants ${VARIANTS:-gpu-all,strata-25,cache-25} --prompt-seconds ${PROMPT_SECONDS:-20} \
  --deadline $((LIMIT - 20)) --json "$OUT/before_after.json" ${EXTRA:-} 2>&1 | tee "$OUT/before_after.log"
