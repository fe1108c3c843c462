#!/usr/bin/env bash
# Issue 27's serving comparison on the H200 machine in two back-to-back device calls (the second
# must reach the still-warm machine: /tmp survives between them), strata-server beside llama-server
# on the model of make_mixtral_model.py (defaults), Strata int4 against Q4_0, everything on the GPU
# and the experts of 8 of 16 layers on the CPU; benchmarks/serve_bench.py with the same seeded mix.
#   here:   mkdir -p build/llamacpp && cp ../shared/anchors/llamacpp/{build.sh,llama.cpp-src.tar.xz} build/llamacpp/
#   call 1: PHASE=1 bash benchmarks/h200_serve.sh   (carry build/llamacpp): llama.cpp builds in the background
#           while the model is made and converted, Strata's plans compile and strata-server is measured
#   call 2: PHASE=2 bash benchmarks/h200_serve.sh   Q4_0, llama-server measured; SOAK=SECONDS adds the
#           concurrency-64 soak of strata-server (gpu placement)
#   or:     PHASE=strata [PLACEMENTS="gpu cpu8"] bash benchmarks/h200_serve.sh   Strata's side alone, in one call
# Outputs under $OUT (else /tmp/serveout): serve-*.json / .log, summary.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/serveout}
mkdir -p "$OUT"
W=${WORK:-/tmp/sv}; LC=/tmp/llamacpp; M=$W/mx
mkdir -p $W
LIMIT=${LIMIT:-560}; T0=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
VOCAB_OF() { python3 -c "import json;print(json.load(open('$M/config.json'))['vocab_size'])"; }
MIX() { echo "--concurrency ${CONC:-1,4,16,64} --prompt-lens 32,128,512 --output-lens 16,64,128 --vocab $(VOCAB_OF) --seed 0 --ignore-eos"; }
TTFT() { echo "--concurrency 1 --requests 6 --prompt-lens 512 --output-lens 16 --vocab $(VOCAB_OF) --seed 1 --ignore-eos"; }
PLACE8='re:^L(0|1|2|3|4|5|6|7)\.moe\.(gate|up|down)=cpu,all=gpu'
SARGS="--server-arg=--max-batch=64 --server-arg=--ctx=1024 --server-arg=--prefill-chunk=512 --startup-timeout 300"

strata_bench() {   # name plan
  log "strata $1: serve_bench"
  timeout $(( $(left) - 10 )) python3 benchmarks/serve_bench.py --plan $2 $SARGS $(MIX) --json "$OUT/serve-strata-$1.json" \
    > "$OUT/serve-strata-$1.log" 2>&1; tail -8 "$OUT/serve-strata-$1.log" | tee -a "$OUT/summary.txt"
  [ "${TTFT_RUN:-1}" = 0 ] || { timeout $(( $(left) - 10 )) python3 benchmarks/serve_bench.py --plan $2 $SARGS $(TTFT) \
    --json "$OUT/ttft-strata-$1.json" > "$OUT/ttft-strata-$1.log" 2>&1; tail -3 "$OUT/ttft-strata-$1.log" | tee -a "$OUT/summary.txt"; }
}

llama_bench() {    # name extra-args
  log "llama-server $1"
  LD_LIBRARY_PATH=$LC/build/bin $LC/build/bin/llama-server -m $W/mx-Q4_0.gguf -ngl 99 $2 --parallel 64 -c $((64 * 1024)) \
    --port 8081 -t 16 > "$OUT/llama-server-$1.log" 2>&1 &
  pid=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8081/health > /dev/null && break; sleep 1; done
  timeout $(( $(left) - 10 )) python3 benchmarks/serve_bench.py --base-url http://127.0.0.1:8081/v1 $(MIX) \
    --json "$OUT/serve-llama-$1.json" > "$OUT/serve-llama-$1.log" 2>&1; tail -8 "$OUT/serve-llama-$1.log" | tee -a "$OUT/summary.txt"
  timeout $(( $(left) - 10 )) python3 benchmarks/serve_bench.py --base-url http://127.0.0.1:8081/v1 $(TTFT) \
    --json "$OUT/ttft-llama-$1.json" > "$OUT/ttft-llama-$1.log" 2>&1; tail -3 "$OUT/ttft-llama-$1.log" | tee -a "$OUT/summary.txt"
  kill $pid; wait $pid 2>/dev/null
}

# the serving libraries, where the machine's Python lacks them (it has no network): wheels carried in build/wheels
# (pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 fastapi uvicorn openai httpx jinja2)
python3 -c "import fastapi, uvicorn, openai, httpx, jinja2" 2>/dev/null || [ ! -d build/wheels ] || \
  python3 -m pip install -q --no-index --find-links build/wheels fastapi uvicorn openai httpx jinja2 > "$OUT/wheels.log" 2>&1 \
  || tail -3 "$OUT/wheels.log"
if [ "${PHASE:-1}" = strata ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
  log "model"
  [ -f $M/config.json ] || python3 benchmarks/make_mixtral_model.py $M ${MODEL_ARGS:-} > $W/make.log 2>&1 || { tail $W/make.log; exit 1; }
  for pl in ${PLACEMENTS:-gpu}; do
    log "compile $pl"
    extra=""; [ $pl = cpu8 ] && extra="--place $PLACE8"
    stratac compile $M -o $W/p-$pl --quant int4 $extra > $W/c-$pl.log 2>&1 || { tail -3 $W/c-$pl.log | tee -a "$OUT/summary.txt"; continue; }
    [ $pl = gpu ] && [ "${RAGGED:-1}" = 1 ] && { log "ragged check"; python3 benchmarks/ragged_check.py $W/p-gpu 2>&1 | tail -2 | tee -a "$OUT/summary.txt"; }
    strata_bench $pl $W/p-$pl
  done
elif [ "${PHASE:-1}" = 1 ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
  (JOBS=8 bash build/llamacpp/build.sh $LC > $W/build.out 2>&1; echo "build rc $?" >> $W/build.out) &
  log "model"
  [ -f $M/config.json ] || python3 benchmarks/make_mixtral_model.py $M ${MODEL_ARGS:-} > $W/make.log 2>&1 || { tail $W/make.log; exit 1; }
  log "gguf conversion (background) and Strata's plans"
  (PYTHONPATH=$LC/gguf-py python3 $LC/convert_hf_to_gguf.py $M --outtype bf16 --outfile $W/mx-bf16.gguf > $W/convert.log 2>&1;
   echo "convert rc $?" >> $W/convert.log) &
  stratac compile $M -o $W/p-gpu --quant int4 > $W/c1.log 2>&1 || tail -3 $W/c1.log
  stratac compile $M -o $W/p-cpu8 --quant int4 --place "$PLACE8" > $W/c2.log 2>&1 || tail -3 $W/c2.log
  log "ragged check on the GPU"
  python3 benchmarks/ragged_check.py $W/p-gpu --backend auto 2>&1 | tail -4 | tee -a "$OUT/summary.txt"
  strata_bench gpu $W/p-gpu
  strata_bench cpu8 $W/p-cpu8
  log "waiting for the llama.cpp build ($(left) s left)"
  while ! grep -q "build rc" $W/build.out 2>/dev/null && [ $(left) -gt 20 ]; do sleep 5; done
  tail -2 $W/build.out | tee -a "$OUT/summary.txt"; tail -1 $W/convert.log | tee -a "$OUT/summary.txt"
else
  log "Q4_0"
  while ! grep -q "convert rc" $W/convert.log 2>/dev/null && [ $(left) -gt 20 ]; do sleep 5; done
  [ -f $W/mx-Q4_0.gguf ] || LD_LIBRARY_PATH=$LC/build/bin $LC/build/bin/llama-quantize $W/mx-bf16.gguf $W/mx-Q4_0.gguf Q4_0 16 \
    > $W/quant.log 2>&1 || tail -3 $W/quant.log
  llama_bench gpu ""
  llama_bench cpu8 "--n-cpu-moe 8"
  if [ -n "${SOAK:-}" ]; then
    log "strata soak ${SOAK}s at concurrency 64"
    timeout $(( $(left) - 5 )) python3 benchmarks/serve_bench.py --plan $W/p-gpu $SARGS --soak $SOAK --concurrency 64 \
      --prompt-lens 32,128,512 --output-lens 16,64,128 --vocab $(VOCAB_OF) --ignore-eos --json "$OUT/soak.json" \
      > "$OUT/soak.log" 2>&1; tail -6 "$OUT/soak.log" | tee -a "$OUT/summary.txt"
  fi
fi
log "done ($(left) s left)"
