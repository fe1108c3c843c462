#!/usr/bin/env bash
# Issues 27 and 28 on the H200 machine in back-to-back device calls (each must reach the still-warm
# machine: /tmp survives between them): Strata beside llama.cpp on the model of make_mixtral_model.py
# (defaults), Strata int4 against Q4_0, everything on the GPU ("gpu") and the experts of 8 of 16
# layers on the CPU ("cpu8": --n-cpu-moe 8 beside the matching --place).
#   here:   mkdir -p build/llamacpp && cp ../shared/anchors/llamacpp/{build.sh,llama.cpp-src.tar.xz} build/llamacpp/
#           (and build/wheels: pip download --only-binary=:all: --python-version 3.12
#            --platform manylinux2014_x86_64 fastapi uvicorn openai httpx jinja2 -d build/wheels)
#   call 1: PHASE=1 bash benchmarks/h200_serve.sh  (carry build/llamacpp build/wheels): llama.cpp builds
#           at the lowest priority in the background while the model is made and converted and Strata's
#           plans compile; then, as asked: SOAK=300 the concurrency-64 soak (it checks that nothing is lost,
#           so it may share the machine with the build), PLACEMENTS="gpu cpu8" each server started once (its
#           programs into the persistent cache: call 2 starts fast), PREFILL_PLACEMENTS="gpu cpu8" prefill
#           (gpu_prefill.py), STARTUP=1 a second process's start-up, BATCH_STEPS=1 benchmarks/batch_steps.py;
#           Q4_0 is made in the background once the build is done
#   call 2: PHASE=2 ...: llama-server and strata-server side by side on each placement (PAIRS, default
#           "gpu cpu8", on the
#           idle machine); LLAMA_BENCH=1 adds llama-bench (prefill 512/4096, decode); CPU_DIAG=1 the
#           CPU-only prefill's thread scaling and a trace of its kernels (benchmarks/trace_ops.py)
#   call 3: PHASE=3 SOAK=300 ...: strata-server (gpu) at concurrency 64 for SOAK seconds
#   PHASE=0 LIMIT=S (carry build/wheels): the model, its gpu plan and strata-server under py-spy (a profile)
# Outputs under $OUT (else /tmp/serveout): summary.txt and details-PHASE.tgz (the *.json / *.log).
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/serveout}
mkdir -p "$OUT"
W=${WORK:-/tmp/sv}; LC=/tmp/llamacpp; M=$W/mx
mkdir -p $W
D=$W/details-${PHASE:-1}; mkdir -p $D
SOAK=${SOAK:-$([ "${PHASE:-1}" = 3 ] && echo 300 || echo 0)}
LIMIT=${LIMIT:-$([ "${PHASE:-1}" = 3 ] && echo $((SOAK + 180)) || echo 560)}; T0=$(date +%s)   # PHASE=3: the soak's server's start too
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
VOCAB_OF() { python3 -c "import json;print(json.load(open('$M/config.json'))['vocab_size'])"; }
MIX() { echo "--concurrency $CONC --prompt-lens 32,128,512 --output-lens 16,64,128 --vocab $(VOCAB_OF) --seed 0 --ignore-eos"; }
TTFT() { echo "--concurrency 1 --requests 6 --prompt-lens 512 --output-lens 16 --vocab $(VOCAB_OF) --seed 1 --ignore-eos"; }
PLACE8='re:^L(0|1|2|3|4|5|6|7)\.moe\.(gate|up|down)=cpu,all=gpu'
SARGS="--server-arg=--max-batch=64 --server-arg=--ctx=1024 --server-arg=--prefill-chunk=512 --startup-timeout 300"   # the soak
QUIET='^WARNING\|^I0000\|^W0000\|^E0000'

conc_of() { [ "$1" = gpu ] && echo "${CONC_GPU:-1,4,16,64}" || echo "${CONC_CPU8:-1,4,16}"; }

strata_bench() {   # name plan: one server for the mix and the TTFT run (its start-up logged)
  log "strata-server $1 ($(left) s left)"
  CONC=$(conc_of $1)
  local t0=$(date +%s)
  strata-server $2 --port 8082 --max-batch 64 --ctx 1024 --prefill-chunk 512 --log-level warning \
    > "$D/strata-server-$1.log" 2>&1 &
  local pid=$!
  until curl -sf http://127.0.0.1:8082/health > /dev/null; do
    kill -0 $pid 2>/dev/null || { log "strata-server exited: $(tail -1 "$D/strata-server-$1.log")"; return; }
    [ $(left) -gt 30 ] || { log "strata-server $1 not ready in time"; kill $pid; return; }; sleep 1; done
  log "strata-server $1 ready after $(( $(date +%s) - t0 )) s"
  timeout $(( $(left) - 10 )) python3 benchmarks/serve_bench.py --base-url http://127.0.0.1:8082/v1 $(MIX) \
    --json "$D/serve-strata-$1.json" > "$D/serve-strata-$1.log" 2>&1; tail -8 "$D/serve-strata-$1.log" | tee -a "$OUT/summary.txt"
  timeout $(( $(left) - 10 )) python3 benchmarks/serve_bench.py --base-url http://127.0.0.1:8082/v1 $(TTFT) \
    --json "$D/ttft-strata-$1.json" > "$D/ttft-strata-$1.log" 2>&1; tail -3 "$D/ttft-strata-$1.log" | tee -a "$OUT/summary.txt"
  curl -s http://127.0.0.1:8082/stats >> "$D/strata-server-$1.log"
  kill -TERM $pid; wait $pid; log "strata-server $1 exit status $?"
}

soak() {
  log "strata soak ${SOAK}s at concurrency 64"
  timeout $(( $(left) - 5 )) python3 benchmarks/serve_bench.py --plan $W/p-gpu $SARGS --soak $SOAK --concurrency 64 \
    --prompt-lens 32,128,512 --output-lens 16,64,128 --vocab $(VOCAB_OF) --ignore-eos --json "$D/soak.json" \
    > "$D/soak.log" 2>&1; tail -6 "$D/soak.log" | tee -a "$OUT/summary.txt"
}

warm_server() {    # name plan: start, wait until ready, stop (programs compiled on the way)
  local t0=$(date +%s)
  strata-server $2 --port 8083 --max-batch 64 --ctx 1024 --prefill-chunk 512 --log-level warning > "$D/warm-$1.log" 2>&1 &
  local pid=$!
  until curl -sf http://127.0.0.1:8083/health > /dev/null; do
    kill -0 $pid 2>/dev/null || { log "strata-server $1 exited: $(tail -1 "$D/warm-$1.log")"; return; }
    [ $(left) -gt 20 ] || { log "strata-server $1 not ready in time"; kill $pid; return; }; sleep 1; done
  kill -TERM $pid; wait $pid; log "strata-server $1 ready after $(( $(date +%s) - t0 )) s on a fresh machine (exit $?)"
}

llama_bench() {    # name extra-args
  log "llama-server $1"
  CONC=$(conc_of $1)
  LD_LIBRARY_PATH=$LC/build/bin $LC/build/bin/llama-server -m $W/mx-Q4_0.gguf -ngl 99 $2 --parallel 64 -c $((64 * 1024)) \
    --port 8081 -t 16 > "$D/llama-server-$1.log" 2>&1 &
  pid=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8081/health > /dev/null && break
    kill -0 $pid 2>/dev/null || { log "llama-server exited: $(tail -1 "$D/llama-server-$1.log")"; return; }; sleep 1; done
  timeout $(( $(left) - 10 )) python3 benchmarks/serve_bench.py --base-url http://127.0.0.1:8081/v1 $(MIX) \
    --json "$D/serve-llama-$1.json" > "$D/serve-llama-$1.log" 2>&1; tail -8 "$D/serve-llama-$1.log" | tee -a "$OUT/summary.txt"
  timeout $(( $(left) - 10 )) python3 benchmarks/serve_bench.py --base-url http://127.0.0.1:8081/v1 $(TTFT) \
    --json "$D/ttft-llama-$1.json" > "$D/ttft-llama-$1.log" 2>&1; tail -3 "$D/ttft-llama-$1.log" | tee -a "$OUT/summary.txt"
  kill $pid; wait $pid 2>/dev/null
}

# the serving libraries, where the machine's Python lacks them (it has no network): wheels carried in build/wheels
python3 -c "import fastapi, uvicorn, openai, httpx, jinja2" 2>/dev/null || [ ! -d build/wheels ] || \
  python3 -m pip install -q --no-index --find-links build/wheels fastapi uvicorn openai httpx jinja2 > "$D/wheels.log" 2>&1 \
  || tail -3 "$D/wheels.log"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$D/pip.log" 2>&1 || { tail "$D/pip.log"; exit 1; }
if [ "${PHASE:-1}" = 5 ]; then
  # the cpu8 plan's prefill with its CPU experts streamed to the GPU (stream_prefill_tokens)
  log "model"
  [ -f $M/config.json ] || python3 benchmarks/make_mixtral_model.py $M ${MODEL_ARGS:-} > $W/make.log 2>&1 || { tail $W/make.log; exit 1; }
  log "compile cpu8"
  [ -f $W/p-cpu8/plan.bin ] || stratac compile $M -o $W/p-cpu8 --quant int4 --place "$PLACE8" > $W/c2.log 2>&1 || tail -3 $W/c2.log
  log "strata prefill cpu8, experts streamed"
  timeout $(( $(left) - 5 )) python3 benchmarks/gpu_prefill.py $W/p-cpu8 --lens ${LENS:-512,4096} --repeats 3 \
    --label cpu8-stream --json "$D/prefill-stream.json" 2>&1 | grep -v "$QUIET" | tee -a "$OUT/summary.txt"
elif [ "${PHASE:-1}" = 0 ]; then
  # a look inside strata-server on the GPU placement: the mix under py-spy (carried in build/wheels)
  log "model"
  [ -f $M/config.json ] || python3 benchmarks/make_mixtral_model.py $M ${MODEL_ARGS:-} > $W/make.log 2>&1 || { tail $W/make.log; exit 1; }
  log "compile"
  [ -f $W/p-gpu/plan.bin ] || stratac compile $M -o $W/p-gpu --quant int4 > $W/c1.log 2>&1 || tail -3 $W/c1.log
  python3 -m pip install -q --no-index --find-links build/wheels py-spy > /dev/null 2>&1
  log "strata-server gpu under py-spy"
  t0=$(date +%s)
  py-spy record --idle --threads -r 100 -f raw -o "$D/spy-gpu.txt" -- strata-server $W/p-gpu --port 8082 --max-batch 64 \
    --ctx 1024 --prefill-chunk 512 --log-level warning > "$D/strata-server-spy.log" 2>&1 &
  spy=$!
  until curl -sf http://127.0.0.1:8082/health > /dev/null; do
    kill -0 $spy 2>/dev/null || { log "exited: $(tail -2 "$D/strata-server-spy.log")"; break; }
    [ $(left) -gt 60 ] || break; sleep 1; done
  log "ready after $(( $(date +%s) - t0 )) s"
  CONC=${CONC_GPU:-1,4,16,64}
  timeout $(( $(left) - 40 )) python3 benchmarks/serve_bench.py --base-url http://127.0.0.1:8082/v1 $(MIX) \
    --json "$D/serve-strata-gpu.json" > "$D/serve-strata-gpu.log" 2>&1; tail -8 "$D/serve-strata-gpu.log" | tee -a "$OUT/summary.txt"
  timeout $(( $(left) - 30 )) python3 benchmarks/serve_bench.py --base-url http://127.0.0.1:8082/v1 $(TTFT) \
    --json "$D/ttft-strata-gpu.json" > "$D/ttft-strata-gpu.log" 2>&1; tail -3 "$D/ttft-strata-gpu.log" | tee -a "$OUT/summary.txt"
  curl -s http://127.0.0.1:8082/stats | tee -a "$OUT/summary.txt"; echo
  kill -TERM $(pgrep -P $spy) 2>/dev/null; wait $spy
  log "py-spy: $(ls -la $D/spy-gpu.txt 2>&1)"
elif [ "${PHASE:-1}" = 1 ]; then
  # the anchor's trimmed source lacks the web UI's templates, without which llama-server does not build:
  # stand-ins (no embedded UI) placed first; build.sh's extraction leaves them there
  mkdir -p $LC/tools/ui && cp benchmarks/llamacpp_ui/ui.h.in benchmarks/llamacpp_ui/ui.cpp.in $LC/tools/ui/
  (JOBS=16 nice -n 19 bash build/llamacpp/build.sh $LC > $W/build.out 2>&1; echo "build rc $?" >> $W/build.out) &
  log "model"
  [ -f $M/config.json ] || python3 benchmarks/make_mixtral_model.py $M ${MODEL_ARGS:-} > $W/make.log 2>&1 || { tail $W/make.log; exit 1; }
  log "gguf conversion (background, lowest priority) and Strata's plans"
  (while [ ! -f $LC/convert_hf_to_gguf.py ]; do sleep 2; done
   PYTHONPATH=$LC/gguf-py nice -n 19 python3 $LC/convert_hf_to_gguf.py $M --outtype bf16 --outfile $W/mx-bf16.gguf \
     > $W/convert.log 2>&1; echo "convert rc $?" >> $W/convert.log) &
  stratac compile $M -o $W/p-gpu --quant int4 > $W/c1.log 2>&1 || tail -3 $W/c1.log
  (nice -n 10 stratac compile $M -o $W/p-cpu8 --quant int4 --place "$PLACE8" > $W/c2.log 2>&1 || tail -3 $W/c2.log) &
  for pl in ${PREFILL_PLACEMENTS:-}; do     # issue 28's prefill side (gpu cpu8), when asked
    log "strata prefill $pl"
    timeout $(( $(left) - 10 )) python3 benchmarks/gpu_prefill.py $W/p-$pl --lens 512,4096 --repeats 3 --n-new 64 \
      --label $pl --json "$D/prefill-strata-$pl.json" 2>&1 | grep -v "$QUIET" | tee -a "$OUT/summary.txt"
  done
  [ "${STARTUP:-0}" = 1 ] && log "start-up: two fresh processes decoding 64 tokens (gpu plan)"
  for i in $([ "${STARTUP:-0}" = 1 ] && echo 1 2); do
    /usr/bin/time -f "wall %e s" strata-run $W/p-gpu --greedy -n 64 --prompt "The history of the city" > /dev/null 2> $W/run$i.err
    grep -v "$QUIET" $W/run$i.err | tail -2 | tee -a "$OUT/summary.txt"
  done
  if [ "${BATCH_STEPS:-0}" = 1 ]; then
    log "batch steps and prefills on the device (benchmarks/batch_steps.py)"
    timeout $(( $(left) - 200 )) python3 benchmarks/batch_steps.py $W/p-gpu --rows 1,2,4,8,16,32,64 --profile 16,64 \
      --json "$D/batch-steps.json" 2>&1 | grep -v "$QUIET" | tee -a "$OUT/summary.txt"
  fi
  if [ "${SOAK:-0}" -gt 0 ]; then   # the soak while llama.cpp builds: it checks that nothing is lost, not speed
    soak
  fi
  for pl in ${PLACEMENTS:-}; do   # each server's programs into the persistent cache: call 2 starts fast
    [ $(left) -gt 60 ] || { log "no time left to warm strata-server $pl"; continue; }
    warm_server $pl $W/p-$pl
  done
  log "waiting for the llama.cpp build ($(left) s left)"
  while ! grep -q "build rc" $W/build.out 2>/dev/null && [ $(left) -gt 20 ]; do sleep 5; done
  tail -2 $W/build.out | tee -a "$OUT/summary.txt"; tail -1 $W/convert.log | tee -a "$OUT/summary.txt"
  if grep -q "convert rc 0" $W/convert.log && [ -x $LC/build/bin/llama-quantize ]; then
    log "Q4_0 (background: call 2 finds it made)"
    (LD_LIBRARY_PATH=$LC/build/bin $LC/build/bin/llama-quantize $W/mx-bf16.gguf $W/mx-Q4_0.tmp.gguf Q4_0 16 \
      > $W/quant.log 2>&1 && mv $W/mx-Q4_0.tmp.gguf $W/mx-Q4_0.gguf; echo "quant rc $?" >> $W/quant.log) &
  fi
elif [ "${PHASE:-1}" = 2 ]; then
  log "Q4_0"
  while ! grep -q "convert rc" $W/convert.log 2>/dev/null && [ $(left) -gt 20 ]; do sleep 5; done
  while [ -f $W/quant.log ] && ! grep -q "quant rc" $W/quant.log && [ $(left) -gt 20 ]; do sleep 2; done
  [ -f $W/mx-Q4_0.gguf ] || LD_LIBRARY_PATH=$LC/build/bin $LC/build/bin/llama-quantize $W/mx-bf16.gguf $W/mx-Q4_0.gguf Q4_0 16 \
    > $W/quant.log 2>&1 || tail -3 $W/quant.log
  [ "${LLAMA_BENCH:-0}" = 1 ] && log "llama-bench"
  for cfg in $([ "${LLAMA_BENCH:-0}" = 1 ] && echo "gpu|-ngl_99" "cpu8|-ngl_99_-ncmoe_8"); do
    cfg=${cfg//_/ }
    name=${cfg%%|*}; args=${cfg#*|}
    LD_LIBRARY_PATH=$LC/build/bin timeout 120 $LC/build/bin/llama-bench -m $W/mx-Q4_0.gguf $args -t 16 -p 512,4096 -n 64 \
      -r 3 -o md > "$D/llama-bench-$name.md" 2>&1; grep "|" "$D/llama-bench-$name.md" | tee -a "$OUT/summary.txt"
  done
  # side by side on the idle machine, each placement's pair back to back
  for pl in ${PAIRS:-gpu cpu8}; do
    [ $(left) -gt 60 ] || { log "no time left for $pl"; continue; }
    llama_bench $pl "$([ $pl = cpu8 ] && echo --n-cpu-moe 8)"
    strata_bench $pl $W/p-$pl
  done
  if [ "${CPU_DIAG:-0}" = 1 ]; then   # issue 28's CPU-only prefill: thread scaling and where its time goes
    python3 -c "import numpy as np; np.save('$W/ids512.npy', np.random.default_rng(0).integers(3, 3000, (1, 512)))"
    for t in 16 2 4 8 16; do
      [ $(left) -gt 40 ] || break
      STRATA_NUM_THREADS=$t timeout 90 strata-run $W/p-gpu --backend llvm --input-ids $W/ids512.npy -n 1 2>&1 \
        | grep "^\[llvm\]" | sed "s/^/threads $t: /" | tee -a "$OUT/summary.txt"
    done
    [ $(left) -gt 30 ] && timeout 60 strata-run $W/p-gpu --backend llvm --input-ids $W/ids512.npy -n 1 \
      --trace "$D/cpu-trace.json" > /dev/null 2>&1 && python3 benchmarks/trace_ops.py "$D/cpu-trace.json" | tee -a "$OUT/summary.txt"
  fi
else
  soak
fi
log "done ($(left) s left)"
tar czf "$OUT/details-${PHASE:-1}.tgz" -C $W "details-${PHASE:-1}"
