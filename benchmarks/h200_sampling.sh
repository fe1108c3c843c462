#!/usr/bin/env bash
# Issues 39 and 42 on the device, one call: what sampling costs a GPU decode step (strata-run's
# decode ahead with tokens chosen on the device, against greedy, and against sampling on the host:
# --top-k 0, which the device does not sort), the API's batch-1 step beside strata-run's
# (benchmarks/api_step_profile.py) and batching against serial at 1, 4 and 16 requests, greedy and
# sampled (benchmarks/batch_vs_serial.py), on the Mixtral-shaped model of make_mixtral_model.py as
# int4 (Q4_0's layout). Outputs under $OUT (else /tmp/spout): summary.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/spout}; mkdir -p "$OUT"
W=${WORK:-/tmp/kq}; M=$W/mx; P=$W/p-Q4_0; mkdir -p $W
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
QUIET='^WARNING\|^I0000\|^W0000\|^E0000'
python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/pip.log 2>&1 || { tail $W/pip.log; exit 1; }
[ -f $M/config.json ] || python3 benchmarks/make_mixtral_model.py $M > $W/make.log 2>&1 || { tail $W/make.log; exit 1; }
[ -f $P/plan.bin ] || stratac compile $M -o $P --quant int4 2>&1 | grep -v "$QUIET" | tail -2 | tee -a "$OUT/summary.txt"
runs() {   # label [strata-run args]: fresh processes (RUNS, default 3), 256 tokens each
  for i in $(seq ${RUNS:-3}); do
    timeout 120 strata-run $P -n 256 --ignore-eos --prompt "The history of the city" "${@:2}" 2>&1 \
      | grep -v "$QUIET" | grep "^\[" | tail -1 | sed "s/^/$1 run $i: /" | tee -a "$OUT/summary.txt"
  done
}
log "strata-run: greedy, the chat defaults (sampled on the device), and top-k 0 (sampled on the host)"
runs greedy --temperature 0
runs sampled
RUNS=2 runs "host-sampled" --top-k 0
log "the API at batch 1"
timeout 150 python3 benchmarks/api_step_profile.py $P --tokens 256 2>&1 | grep -v "$QUIET" | grep "|" | tee -a "$OUT/summary.txt"
for how in "" --sampled; do
  log "batching against serial ${how:-greedy}"
  timeout 200 python3 benchmarks/batch_vs_serial.py $P --conc 1,4,16 --tokens 64 --rounds 2 $how 2>&1 \
    | grep -v "$QUIET" | grep "|\|Error" | tee -a "$OUT/summary.txt"
done
log done
