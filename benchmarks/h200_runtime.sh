#!/usr/bin/env bash
# The H200 run of issue 7 in one device call: the expert cache against the static placement at
# 25 % (same model and profile as h200_placement.sh) — misses read by the GPU in place (the
# default, decoding ahead), misses on the CPU (cache-25/cpu-misses) — and the
# greedy-tokens check: cache on / off, the no-GPU fallback, on the timed prompt and on CHECKS more prompts clear by
# 0.05 x std over 16 steps, with each variant's logit deviation from gpu-all along its tokens;
# traces of the decode steps (Perfetto JSON; CPU and GPU busy at once per token).
#   bash benchmarks/h200_runtime.sh      (outputs under $OUT, else /tmp/rtout; LAYERS, DEVICE, LIMIT,
#                                         CHECKS, VARIANTS, ROUNDS)
source "$(dirname "$0")/h200_setup.sh" /tmp/rtout
mkdir -p "$OUT/traces"
timeout ${LIMIT:-540} python benchmarks/placement_bench.py --work-dir /tmp/pb --layers ${LAYERS:-16} --router-skew 0.5 \
  --budgets 25 --n-new 48 --repeats 2 --calib-tokens 256 --hw benchmarks/profiles/h200-2026-11-29-raw.json \
  --device ${DEVICE:-auto} --trace-dir "$OUT/traces" --json "$OUT/rt.json" --check-prompts ${CHECKS:-4} --rounds ${ROUNDS:-1} \
  --only "${VARIANTS:-strata-25,cache-25,cache-25/cpu-misses,cache-25/no-cache,cache-25/no-gpu}" \
  2>&1 | tee "$OUT/rt.log" || true
