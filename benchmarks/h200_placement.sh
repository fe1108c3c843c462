#!/usr/bin/env bash
# The H200 side-by-side of issue 6 in one device call (~8 min on a fresh machine):
# the 16-layer OLMoE-shaped int4 model, router skew 0.5, Strata's plan for the committed full
# H200 profile against -ngl and KTransformers' layout at 25 and 50 % GPU budgets, then the
# runtime switches still to be decided, each variant in a process of its own (NAME@VAR=VALUE),
# then the cost model refitted to the run. Fits one 600 s device call (LIMIT, REFIT_LIMIT).
#   bash benchmarks/h200_placement.sh [AB_VARIANTS]   (instead of the A/B list below; outputs under $OUT, else /tmp/pbout)
source "$(dirname "$0")/h200_setup.sh" /tmp/pbout
# preflight: a tiny split plan on this GPU; if native host calls fail here, measure without them
if ! timeout 90 python benchmarks/placement_bench.py --tiny --work-dir /tmp/pbt --n-new 16 --repeats 1 \
    --only "strata-25,ngl-25" > "$OUT/smoke.log" 2>&1; then
  tail -20 "$OUT/smoke.log"; echo "preflight failed: STRATA_NATIVE_HOST_CALLS=0 from here"; export STRATA_NATIVE_HOST_CALLS=0
fi
tail -6 "$OUT/smoke.log"
AB="strata-25@STRATA_NATIVE_HOST_CALLS=0,strata-25@STRATA_FUSED_SPIN_US=0,ngl-25@STRATA_FUSED_SPIN_US=0,strata-25@STRATA_NUM_THREADS=15,strata-25@XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,strata-25@STRATA_FUSED_OVERLAP=1,strata-25@STRATA_HOST_CALL_STAGING=1"
timeout ${LIMIT:-410} python benchmarks/placement_bench.py --work-dir /tmp/pb --layers 16 --router-skew 0.5 \
  --budgets 25,50 --n-new 48 --repeats 2 --calib-tokens 256 --hw benchmarks/profiles/h200-2026-11-29-raw.json \
  --json "$OUT/pb.json" --only "strata-25,ngl-25,ktransformers,strata-50,ngl-50,${1:-$AB}" 2>&1 | tee "$OUT/pb.log" || true
# the place pass's runtime constants refitted to this run (CPU only, the plans' own profile)
timeout ${REFIT_LIMIT:-70} python benchmarks/refit_cost_model.py --json "$OUT/pb.json" --work-dir /tmp/pb \
  --hw benchmarks/profiles/h200-2026-11-29-raw.json 2>&1 | tee "$OUT/refit.log" || true
