#!/usr/bin/env bash
# The H200 run of issue 7 in one device call: the expert cache against the static placement at
# 25 % (same model and profile as h200_placement.sh) — with the Python prefetch, the native one
# (STRATA_NATIVE_PREFETCH=1) and none (both native: host calls overlapped like a static split's) —
# the greedy-tokens check (cache on / off, prefetch on / off, the no-GPU fallback), and traces of
# the decode steps (Perfetto JSON; CPU and GPU busy at once per token).
#   bash benchmarks/h200_runtime.sh      (outputs under $OUT, else /tmp/rtout; LAYERS, DEVICE, LIMIT)
source "$(dirname "$0")/h200_setup.sh" /tmp/rtout
mkdir -p "$OUT/traces"
timeout ${LIMIT:-540} python benchmarks/placement_bench.py --work-dir /tmp/pb --layers ${LAYERS:-16} --router-skew 0.5 \
  --budgets 25 --n-new 48 --repeats 2 --calib-tokens 256 --hw benchmarks/profiles/h200-2026-11-29-raw.json \
  --device ${DEVICE:-auto} --trace-dir "$OUT/traces" --json "$OUT/rt.json" \
  --only "strata-25,hot-25,hot-cache-25,hot-cache-25@STRATA_NATIVE_PREFETCH=1,hot-cache-25/no-prefetch,cache-25,cache-25@STRATA_NATIVE_PREFETCH=1,cache-25/no-prefetch,cache-25/no-cache,cache-25/no-gpu,hot-cache-25@STRATA_NATIVE_PREFETCH=1@STRATA_PREFETCH_STREAM=1,hot-cache-25@STRATA_NATIVE_PREFETCH=1@STRATA_PREFETCH_PER_LAYER=3" \
  2>&1 | tee "$OUT/rt.log" || true
