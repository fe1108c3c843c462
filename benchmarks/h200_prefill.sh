#!/usr/bin/env bash
# Issue 28 on the H200 machine: prefill and start-up of the model of make_mixtral_model.py (defaults),
# Strata int4 beside llama.cpp Q4_0, everything on the GPU ("gpu"), the experts of 8 of 16 layers on
# the CPU ("cpu8": --n-cpu-moe 8 beside the matching --place), and the CPU alone ("cpu", 16 threads).
#   here:   mkdir -p build/llamacpp && cp ../shared/anchors/llamacpp/{build.sh,llama.cpp-src.tar.xz} build/llamacpp/
#           build/wheels: the py-spy wheel (pip download --only-binary=:all: --python-version 3.12 py-spy)
#   PHASE=1 (carry build/llamacpp build/wheels): llama.cpp builds in the background (its own process
#           session, lowest priority: a back-to-back PHASE=2 call finds it), then its GGUF Q4_0; Strata's
#           side: prefill with kernel profiles (gpu, cpu8 with its CPU experts streamed), a second
#           process's start-up (and one under py-spy), the CPU's prefill with a trace of its kernels
#   PHASE=2: llama-bench on each configuration, llama.cpp's load + first token; the built binaries
#           packed into $OUT (llamacpp-bin.tar.xz.*) to be carried by a later call as build/llamacpp-bin
#   PHASE=3 (carry build/llamacpp-bin build/wheels): both sides in one run, as the acceptance asks
# Outputs under $OUT (else /tmp/prefillout): summary.txt, details-PHASE.tgz.
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/prefillout}; mkdir -p "$OUT"
W=${WORK:-/tmp/pf}; LC=/tmp/llamacpp; M=$W/mx; mkdir -p $W
D=$W/details-${PHASE:-1}; mkdir -p $D
LIMIT=${LIMIT:-560}; T0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
QUIET='^WARNING\|^I0000\|^W0000\|^E0000'
PLACE8='re:^L(0|1|2|3|4|5|6|7)\.moe\.(gate|up|down)=cpu,all=gpu'
BIN=$LC/build/bin; [ -d build/llamacpp-bin ] && BIN=$PWD/build/llamacpp-bin
LLAMA() { LD_LIBRARY_PATH=$BIN "$BIN/$@"; }

python3 -m pip install -q --no-deps --no-build-isolation -e . > "$D/pip.log" 2>&1 || { tail "$D/pip.log"; exit 1; }
python3 -m pip install -q --no-index --find-links build/wheels py-spy > /dev/null 2>&1

model_and_plans() {
  log "model"
  [ -f $M/config.json ] || python3 benchmarks/make_mixtral_model.py $M > $W/make.log 2>&1 || { tail $W/make.log; exit 1; }
  log "compile gpu (cpu8 in the background)"
  (nice -n 10 stratac compile $M -o $W/p-cpu8 --quant int4 --place "$PLACE8" > $W/c2.log 2>&1; echo "rc $?" >> $W/c2.log) &
  [ -f $W/p-gpu/plan.bin ] || stratac compile $M -o $W/p-gpu --quant int4 > $W/c1.log 2>&1 || tail -3 $W/c1.log
  python3 -c "import numpy as np, json; v=json.load(open('$M/config.json'))['vocab_size']; \
np.save('$W/ids512.npy', np.random.default_rng(0).integers(3, v - 1, (1, 512)))"
}

gguf() {   # the HF folder through llama.cpp's converter and quantizer (waits for the build)
  while [ ! -x $BIN/llama-quantize ] && ! grep -q "build rc" $W/build.out 2>/dev/null; do sleep 5; done
  [ -f $W/mx-bf16.gguf ] || PYTHONPATH=$LC/gguf-py python3 $LC/convert_hf_to_gguf.py $M --outtype bf16 \
    --outfile $W/mx-bf16.gguf > $W/convert.log 2>&1
  [ -f $W/mx-Q4_0.gguf ] || { LLAMA llama-quantize $W/mx-bf16.gguf $W/mx-Q4_0.tmp.gguf Q4_0 16 > $W/quant.log 2>&1 \
    && mv $W/mx-Q4_0.tmp.gguf $W/mx-Q4_0.gguf; }
  echo "gguf rc $?" >> $W/quant.log
}

strata_prefill() {   # label plan extra-args
  log "strata prefill $1 ($(left) s left)"
  timeout $(( $(left) - 10 )) python3 benchmarks/gpu_prefill.py $2 --label $1 --json "$D/prefill-$1.json" "${@:3}" \
    2>&1 | grep -v "$QUIET" | tee -a "$OUT/summary.txt"
}

startup() {   # two fresh processes decoding 64 tokens (the second: programs from the caches)
  for i in 1 2; do
    /usr/bin/time -f "wall %e s" strata-run $W/p-gpu -n 64 --prompt "The history of the city" > /dev/null 2> $W/run$i.err
    log "start-up run $i: $(grep -v "$QUIET" $W/run$i.err | tail -2 | tr '\n' ' ')"
  done
}

llama_bench() {   # name args...
  LLAMA llama-bench -m $W/mx-Q4_0.gguf "${@:2}" -o md > "$D/llama-bench-$1.md" 2>&1
  log "llama-bench $1"; grep "|" "$D/llama-bench-$1.md" | tee -a "$OUT/summary.txt"
}

if [ "${PHASE:-1}" = 1 ]; then
  mkdir -p $LC/tools/ui && cp benchmarks/llamacpp_ui/ui.h.in benchmarks/llamacpp_ui/ui.cpp.in $LC/tools/ui/
  setsid bash -c "JOBS=16 nice -n 19 bash build/llamacpp/build.sh $LC > $W/build.out 2>&1; echo build rc \$? >> $W/build.out" \
    < /dev/null > /dev/null 2>&1 &
  model_and_plans
  setsid bash -c "$(declare -f gguf LLAMA); W=$W M=$M LC=$LC BIN=$BIN gguf" < /dev/null > /dev/null 2>&1 &
  strata_prefill gpu $W/p-gpu --lens 512,4096 --repeats 3 --profile
  startup
  log "start-up run 3 under py-spy"
  py-spy record -r 200 -f raw -o "$D/spy-startup.txt" -- strata-run $W/p-gpu -n 64 --prompt "The history of the city" \
    > /dev/null 2> $W/run3.err
  while ! grep -q "^rc" $W/c2.log 2>/dev/null && [ $(left) -gt 60 ]; do sleep 2; done
  strata_prefill cpu8 $W/p-cpu8 --lens 512,4096 --repeats 3 --profile
  log "strata cpu (llvm) prefill 512, a trace of its kernels"
  timeout $(( $(left) - 5 )) strata-run $W/p-gpu --backend llvm --input-ids $W/ids512.npy -n 1 --trace "$D/cpu-trace.json" \
    --stats 2>&1 | grep -v "$QUIET" | tail -12 | tee -a "$OUT/summary.txt"
  timeout $(( $(left) - 5 )) strata-run $W/p-gpu --backend llvm --input-ids $W/ids512.npy -n 1 2>&1 | grep -v "$QUIET" \
    | tail -3 | tee -a "$OUT/summary.txt"
  log "llama.cpp build: $(tail -1 $W/build.out 2>&1)"
elif [ "${PHASE:-1}" = 2 ]; then
  while ! grep -q "gguf rc" $W/quant.log 2>/dev/null && [ $(left) -gt 200 ]; do sleep 5; done
  log "$(tail -1 $W/build.out) $(tail -1 $W/quant.log)"
  llama_bench gpu -ngl 99 -t 16 -p 512,4096 -n 64 -r 3
  llama_bench cpu8 -ngl 99 -ncmoe 8 -t 16 -p 512,4096 -n 64 -r 3
  llama_bench cpu -ngl 0 -t 16 -p 512 -n 0 -r 3
  log "llama.cpp load + first token (llama-bench -p 0 -n 1 -r 1, wall)"
  for i in 1 2; do /usr/bin/time -f "wall %e s" $BIN/llama-bench -m $W/mx-Q4_0.gguf -ngl 99 -p 0 -n 1 -r 1 \
    > /dev/null 2> $W/lt$i.err; tail -1 $W/lt$i.err | tee -a "$OUT/summary.txt"; done
  mkdir -p $W/pack/llamacpp-bin && cp $BIN/llama-bench $BIN/llama-server $BIN/llama-quantize $BIN/*.so* $W/pack/llamacpp-bin/ 2>/dev/null
  strip $W/pack/llamacpp-bin/* 2>/dev/null
  tar cJf $W/llamacpp-bin.tar.xz -C $W/pack llamacpp-bin && split -b 15M $W/llamacpp-bin.tar.xz "$OUT/llamacpp-bin.tar.xz."
  log "packed: $(ls -la $W/llamacpp-bin.tar.xz)"
fi
log "done ($(left) s left)"
tar czf "$OUT/details-${PHASE:-1}.tgz" -C $W "details-${PHASE:-1}"
