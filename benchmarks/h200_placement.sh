#!/usr/bin/env bash
# The H200 side-by-side of issue 6 in one device call (~9 min on a fresh machine): the 16-layer
# OLMoE-shaped int4 model, Strata's plan for the committed full H200 profile against -ngl and
# KTransformers' layout at 25 and 50 % GPU budgets, first with the router skewed (0.5; decode
# traces of each variant) and then uniform (skew 0). Optional A/B variants (NAME@VAR=VALUE, each
# in a process of its own) after the skewed run's; the cost model is refitted on the VM
# (benchmarks/refit_cost_model.py on $OUT/pb.json with the same work dir rebuilt there).
#   AB=strata-25@STRATA_HAND_OFF_SPIN_US=100 bash benchmarks/h200_placement.sh   (outputs under $OUT, else /tmp/pbout;
#   LIMIT, UNIFORM_LIMIT: seconds for each run, UNIFORM_LIMIT=0 skips the uniform one; ROUNDS: the
#   variant list run that many times in turn, medians reported; e.g. ROUNDS=2 LIMIT=520 UNIFORM_LIMIT=0)
source "$(dirname "$0")/h200_setup.sh" /tmp/pbout
H=benchmarks/profiles/h200-2026-11-29-raw.json
run() {   # work dir, skew, json name, time limit, extra variants
  timeout "$4" python benchmarks/placement_bench.py --work-dir "$1" --layers 16 --router-skew "$2" \
    --budgets 25,50 --n-new 48 --repeats 2 --rounds ${ROUNDS:-1} --calib-tokens 256 --hw $H --json "$OUT/$3.json" \
    --only "strata-25,ngl-25,strata-50,ngl-50,ktransformers${5:+,$5}" ${TRACE:+--trace-dir "$OUT/traces-$3"} \
    2>&1 | tee "$OUT/$3.log" || true
}
TRACE=1 run /tmp/pb 0.5 pb ${LIMIT:-320} "${AB:-}"
rm -rf /tmp/pb          # the disk holds one work dir at a time
[ "${UNIFORM_LIMIT:-240}" = 0 ] || run /tmp/pbu 0 uniform ${UNIFORM_LIMIT:-240}
