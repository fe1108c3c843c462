#!/usr/bin/env bash
# Where the expert cache's prefetch time goes on the H200 (issue 7; BENCHMARKS.md, 2026-11-30:
# cache-25 with the prefetch decoded 1.2–2.8 ms a token slower than without, for ≈ 2 MiB a token
# more copies): the same plans as h200_runtime.sh, then switch_breakdown.py on the static split
# and on the cache with the prefetch on and off — the fused step's host call work and gaps, and
# the host threads' CUDA API time under the JAX profiler (--host-trace).
#   bash benchmarks/h200_prefetch_cost.sh      (outputs under $OUT, else /tmp/pcout; LAYERS, DEVICE)
source "$(dirname "$0")/h200_setup.sh" /tmp/pcout
python benchmarks/placement_bench.py --work-dir /tmp/pb --layers ${LAYERS:-16} --router-skew 0.5 --budgets 25 \
  --calib-tokens 256 --hw benchmarks/profiles/h200-2026-11-29-raw.json --device ${DEVICE:-auto} \
  --only "strata-25,cache-25" --build-only 2>&1 | tee "$OUT/build.log"
for args in "/tmp/pb/strata-25" "/tmp/pb/cache-25 --prefetch both"; do
  timeout 240 python benchmarks/switch_breakdown.py $args --n-new 48 --host-trace 8 --device ${DEVICE:-auto} \
    2>&1 | tee -a "$OUT/breakdown.log" || true
done
