#!/usr/bin/env bash
# Issue 39 on the H200 machine: a Q4_K_M GGUF of the Mixtral-shaped model of make_mixtral_model.py
# (llama.cpp's own quantizer) beside its Q4_0, Strata (`--quant auto`: Q4_0 stored as int4, Q4_K as
# int4a, Q6_K as int8) against llama.cpp on the same files, everything on the GPU; and what sampling
# costs a Strata decode step (greedy against the chat defaults).
#   here:   mkdir -p build/llamacpp && cp ../shared/anchors/llamacpp/{build.sh,llama.cpp-src.tar.xz} build/llamacpp/
#   PHASE=1 (carry build/llamacpp): llama.cpp builds at the lowest priority in its own session; the
#           model is made and converted to a bf16 GGUF (llama.cpp's converter needs no build); Strata's
#           Q4_0 side runs meanwhile from `--quant int4` of the same weights (Q4_0 bit for bit, quantizer
#           included: tests/test_gguf_moe.py), decode (3 fresh runs) and prefill 512 (median of 3)
#           (KERNELS=1, the default: also benchmarks/kquant_kernels.py --check and benchmarks/sampling_choice.py)
#   PHASE=2 (right after, the same warm machine): llama.cpp's Q4_0 and Q4_K_M of the bf16 file,
#           Strata compiles the Q4_K_M file and measures it
#           beside the Q4_0 plan, llama-bench on both files, sampling's cost per decode step and the
#           API's step (benchmarks/sampling_step.py, api_step_profile.py; SAMPLING=0 leaves them out),
#           then N requests batched against the same N in turn (benchmarks/batch_vs_serial.py; BATCH=0
#           leaves it out)
# Outputs under $OUT (else /tmp/kqout): summary.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/kqout}; mkdir -p "$OUT"
W=${WORK:-/tmp/kq}; LC=/tmp/llamacpp; M=$W/mx; mkdir -p $W
LIMIT=${LIMIT:-570}; T0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
QUIET='^WARNING\|^I0000\|^W0000\|^E0000'
BIN=$LC/build/bin
LLAMA() { LD_LIBRARY_PATH=$BIN "$BIN/$@"; }

python3 -m pip install -q --no-deps --no-build-isolation -e . > $W/pip.log 2>&1 || { tail $W/pip.log; exit 1; }

decode() {   # label plan [extra strata-run args]: three fresh processes, 128 tokens
  for i in 1 2 3; do
    timeout 120 strata-run $2 -n 128 --ignore-eos --prompt "The history of the city" "${@:3}" 2>&1 \
      | grep -v "$QUIET" | grep "^\[" | tail -1 | sed "s/^/$1 run $i: /" | tee -a "$OUT/summary.txt"
  done
}

if [ "${PHASE:-1}" = 1 ]; then
  mkdir -p $LC/tools/ui && cp benchmarks/llamacpp_ui/ui.h.in benchmarks/llamacpp_ui/ui.cpp.in $LC/tools/ui/
  setsid bash -c "JOBS=16 nice -n 19 bash build/llamacpp/build.sh $LC > $W/build.out 2>&1; echo build rc \$? >> $W/build.out" \
    < /dev/null > /dev/null 2>&1 &
  log "model"
  [ -f $M/config.json ] || python3 benchmarks/make_mixtral_model.py $M > $W/make.log 2>&1 || { tail $W/make.log; exit 1; }
  (while [ ! -f $LC/convert_hf_to_gguf.py ]; do sleep 2; done
   PYTHONPATH=$LC/gguf-py nice -n 10 python3 $LC/convert_hf_to_gguf.py $M --outtype bf16 --outfile $W/mx-bf16.tmp.gguf \
     > $W/convert.log 2>&1 && mv $W/mx-bf16.tmp.gguf $W/mx-bf16.gguf) &
  log "compile int4 (= Q4_0)"
  [ -f $W/p-Q4_0/plan.bin ] || stratac compile $M -o $W/p-Q4_0 --quant int4 2>&1 | grep -v "$QUIET" | tail -2 \
    | tee -a "$OUT/summary.txt"
  decode "strata Q4_0 decode" $W/p-Q4_0 --temperature 0
  timeout $(( $(left) - 10 )) python3 benchmarks/gpu_prefill.py $W/p-Q4_0 --label Q4_0 --lens 512 --repeats 3 \
    2>&1 | grep -v "$QUIET" | tee -a "$OUT/summary.txt"
  if [ "${KERNELS:-1}" = 1 ]; then
    log "the decode kernels per format, compiled by Triton and checked against interpret mode; sampling's choice, timed"
    timeout 150 python3 benchmarks/kquant_kernels.py --check 2>&1 | grep -v "$QUIET" | tee -a "$OUT/summary.txt"
    timeout 120 python3 benchmarks/sampling_choice.py --batches 1 2>&1 | grep -v "$QUIET" | tee -a "$OUT/summary.txt"
  fi
  wait
  log "bf16 GGUF: $(ls -l $W/mx-bf16.gguf 2>&1); llama.cpp build: $(tail -1 $W/build.out 2>&1)"
elif [ "${PHASE:-1}" = 2 ]; then
  # Strata reads GGUF metadata types through the gguf package; the device's Python lacks it: llama.cpp's copy
  export PYTHONPATH=$LC/gguf-py${PYTHONPATH:+:$PYTHONPATH}
  while ! grep -q "build rc" $W/build.out 2>/dev/null && [ $(left) -gt 400 ]; do sleep 5; done
  log "$(tail -1 $W/build.out)"
  for q in Q4_0 Q4_K_M; do
    [ -f $W/mx-$q.gguf ] || LLAMA llama-quantize $W/mx-bf16.gguf $W/mx-$q.gguf $q 16 > $W/quant-$q.log 2>&1
  done
  ls -l $W/*.gguf | tee -a "$OUT/summary.txt"
  grep -c "q6_K\|Q6_K" $W/quant-Q4_K_M.log | sed 's/^/Q6_K lines in the quantizer log: /' | tee -a "$OUT/summary.txt"
  log "compile Q4_K_M"
  stratac compile $W/mx-Q4_K_M.gguf -o $W/p-Q4_K_M 2>&1 | grep -v "$QUIET" | tail -3 | tee -a "$OUT/summary.txt"
  ls -l $W/p-Q4_K_M/weights.bin | tee -a "$OUT/summary.txt"
  decode "strata Q4_K_M decode" $W/p-Q4_K_M --temperature 0
  decode "strata Q4_0 decode (warm)" $W/p-Q4_0 --temperature 0
  decode "strata Q4_K_M decode (warm)" $W/p-Q4_K_M --temperature 0
  timeout 150 python3 benchmarks/gpu_prefill.py $W/p-Q4_K_M --label Q4_K_M --lens 512 --repeats 3 \
    2>&1 | grep -v "$QUIET" | tee -a "$OUT/summary.txt"
  for q in Q4_0 Q4_K_M; do
    LLAMA llama-bench -m $W/mx-$q.gguf -ngl 99 -t 16 -p 512 -n 128 -r 3 -o md > $W/lb-$q.md 2>&1
    log "llama-bench $q"; grep "|" $W/lb-$q.md | tee -a "$OUT/summary.txt"
  done
  if [ "${SAMPLING:-1}" = 1 ]; then      # after the build: a quiet machine
    log "sampling's cost per decode step (greedy against the chat defaults), and the API's step (decode_steps 1, 8)"
    timeout 120 python3 benchmarks/sampling_step.py $W/p-Q4_0 --rounds 3 2>&1 | grep -v "$QUIET" | grep "|" \
      | tee -a "$OUT/summary.txt"
    timeout 120 python3 benchmarks/api_step_profile.py $W/p-Q4_0 --steps 1,8 2>&1 | grep -v "$QUIET" | grep "|" \
      | tee -a "$OUT/summary.txt"
  fi
  [ "${BATCH:-1}" = 1 ] || { log "done ($(left) s left)"; exit 0; }
  log "batching against serial, Q4_0 plan (the Python API's scheduler)"
  timeout $(( $(left) - 10 )) python3 benchmarks/batch_vs_serial.py $W/p-Q4_0 --conc 1,4,16 --tokens 64 --rounds 2 \
    2>&1 | grep -v "$QUIET" | grep "|" | tee -a "$OUT/summary.txt"
fi
log "done ($(left) s left)"
