#!/usr/bin/env bash
# The many-token MoE kernels on the H200 in one device call: benchmarks/gpu_gemm.py (kernels against XLA's
# path, by tuning) and the prefill of a 2-layer Mixtral-shaped int4 plan with its GPU kernels
# (benchmarks/gpu_prefill.py --profile). Outputs under $OUT (else /tmp/gemmout).
#   bash benchmarks/h200_gemm.sh   [ROWS=16,64,512,4096 TUNES=... LAYERS=2 LENS=512,4096]
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/gemmout}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
M=/tmp/mxg; P=/tmp/pxg
( python3 benchmarks/make_mixtral_model.py $M --layers ${LAYERS:-2} > "$OUT/make.log" 2>&1 &&
  stratac compile $M -o $P --quant int4 > "$OUT/compile.log" 2>&1; echo "plan rc $?" >> "$OUT/compile.log" ) &
timeout ${GEMM_LIMIT:-170} python3 benchmarks/gpu_gemm.py --rows ${ROWS:-16,64,512,4096} \
  --tunes ${TUNES:-64.128.4.4.3,128.128.4.8.3} --json "$OUT/gemm.json" \
  2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee "$OUT/gemm.log"
wait
tail -1 "$OUT/compile.log"
timeout 120 python3 benchmarks/gpu_prefill.py $P --lens ${LENS:-512,4096} --repeats 3 --n-new 16 --profile \
  --json "$OUT/prefill.json" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee "$OUT/prefill.log"
