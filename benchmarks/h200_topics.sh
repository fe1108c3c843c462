#!/usr/bin/env bash
# The expert cache against the static placement when the routing follows the text's topic (issue 7):
# the benchmark model of h200_runtime.sh with --topics 4 (make_synthetic_model.py Topics: a
# generation stays on its topic; each topic routes to its own quarter of each layer's experts, on
# top of the popularity skew), so the plan's calibration on mixed text sees the topics' mixture
# and one generation uses its own topic's experts. Each STRENGTHS entry (EMBED,HEAD,ROUTER) is a
# model of its own.
#   bash benchmarks/h200_topics.sh      (outputs under $OUT, else /tmp/tpout; LAYERS, DEVICE, LIMIT,
#                                        CHECKS, VARIANTS, ROUNDS, STRENGTHS)
source "$(dirname "$0")/h200_setup.sh" /tmp/tpout
for st in ${STRENGTHS:-1.0,0.2,0.03}; do
  tag=${st//,/-}
  timeout ${LIMIT:-540} python benchmarks/placement_bench.py --work-dir /tmp/pbt-$tag --layers ${LAYERS:-16} \
    --router-skew 0.5 --topics 4 --topic-strength $st --budgets 25 --n-new 48 --repeats 2 --calib-tokens 256 \
    --hw benchmarks/profiles/h200-2026-11-29-raw.json --device ${DEVICE:-auto} --json "$OUT/topics-$tag.json" \
    --check-prompts ${CHECKS:-2} --rounds ${ROUNDS:-1} \
    --only "${VARIANTS:-strata-25,cache-25,cache-25/cpu-misses,cache-25/no-gpu}" \
    2>&1 | tee "$OUT/topics-$tag.log" || true
done
