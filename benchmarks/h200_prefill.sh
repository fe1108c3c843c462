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
#   PHASE=2: llama-bench on each configuration, llama.cpp's load + first token (the built binaries,
#           128 MB as tar.xz, are too large to bring back and carry: each call that needs them builds them)
#   PHASE=3 (carry build/llamacpp build/wheels): both sides in one call, as the acceptance asks: llama.cpp
#           builds at the lowest priority while Strata's side runs (start-up, prefill, the streamed
#           logits against the CPU kernels'), then llama-bench and the CPU-only prefill of both
#   PHASE=5 (carry build/wheels): start-up alone (four fresh processes, one more under py-spy)
#   PHASE=6: the many-token MoE kernels' two forms and tunings, start-up, the GPU prefill by 512 and default steps
#   PHASE=7 (carry build/llamacpp): the GPU and cpu8 rows and start-up, both sides in one call
#   PHASE=4 (carry build/llamacpp): the CPU-only prefill alone, side by side: llama.cpp built without
#           CUDA, Strata's llvm backend, alternating rounds on the idle machine; and CPU-only decode
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
BIN=$LC/build/bin
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

startup() {   # N fresh processes decoding 64 tokens (the first may compile; the rest load the programs)
  for i in $(seq 1 ${1:-2}); do
    /usr/bin/time -f "wall %e s" strata-run $W/p-gpu --greedy -n 64 --prompt "The history of the city" --tokens-out $W/tok$i.npy \
      > /dev/null 2> $W/run$i.err
    log "start-up run $i: $(grep -v "$QUIET" $W/run$i.err | tail -3 | tr '\n' ' ')"
  done
}

llama_bench() {   # name args...
  LLAMA llama-bench -m $W/mx-Q4_0.gguf "${@:2}" -o md > "$D/llama-bench-$1.md" 2>&1
  log "llama-bench $1"; grep "|" "$D/llama-bench-$1.md" | tee -a "$OUT/summary.txt"
}

build_and_plans() {   # llama.cpp built, then its Q4_0 made, in process sessions of their own; Strata's plans
  mkdir -p $LC/tools/ui && cp benchmarks/llamacpp_ui/ui.h.in benchmarks/llamacpp_ui/ui.cpp.in $LC/tools/ui/
  setsid bash -c "JOBS=16 nice -n 19 bash build/llamacpp/build.sh $LC > $W/build.out 2>&1; echo build rc \$? >> $W/build.out" \
    < /dev/null > /dev/null 2>&1 &
  model_and_plans
  setsid bash -c "$(declare -f gguf LLAMA); W=$W M=$M LC=$LC BIN=$BIN gguf" < /dev/null > /dev/null 2>&1 &
}

if [ "${PHASE:-1}" = 1 ]; then
  build_and_plans
  strata_prefill gpu $W/p-gpu --lens 512,4096 --repeats 3 --profile
  startup
  log "start-up run 3 under py-spy"
  py-spy record -r 200 -f raw -o "$D/spy-startup.txt" -- strata-run $W/p-gpu --greedy -n 64 --prompt "The history of the city" \
    > /dev/null 2> $W/run3.err
  while ! grep -q "^rc" $W/c2.log 2>/dev/null && [ $(left) -gt 60 ]; do sleep 2; done
  strata_prefill cpu8 $W/p-cpu8 --lens 512,4096 --repeats 3 --profile
  log "strata cpu (llvm) prefill 512, a trace of its kernels"
  timeout $(( $(left) - 5 )) strata-run $W/p-gpu --backend llvm --input-ids $W/ids512.npy -n 1 --trace "$D/cpu-trace.json" \
    --stats 2>&1 | grep -v "$QUIET" | tail -12 | tee -a "$OUT/summary.txt"
  timeout $(( $(left) - 5 )) strata-run $W/p-gpu --backend llvm --input-ids $W/ids512.npy -n 1 2>&1 | grep -v "$QUIET" \
    | tail -3 | tee -a "$OUT/summary.txt"
  log "llama.cpp build: $(tail -1 $W/build.out 2>&1)"
elif [ "${PHASE:-1}" = 2 ]; then   # (PHASE=3 below: both sides in one call)
  while ! grep -q "gguf rc" $W/quant.log 2>/dev/null && [ $(left) -gt 200 ]; do sleep 5; done
  log "$(tail -1 $W/build.out) $(tail -1 $W/quant.log)"
  llama_bench gpu -ngl 99 -t 16 -p 512,4096 -n 64 -r 3
  llama_bench cpu8 -ngl 99 -ncmoe 8 -t 16 -p 512,4096 -n 64 -r 3
  llama_bench cpu -ngl 0 -t 16 -p 512 -n 0 -r 3
  log "llama.cpp load + first token (llama-bench -p 0 -n 1 -r 1, wall)"
  for i in 1 2; do /usr/bin/time -f "wall %e s" $BIN/llama-bench -m $W/mx-Q4_0.gguf -ngl 99 -p 0 -n 1 -r 1 \
    > /dev/null 2> $W/lt$i.err; tail -1 $W/lt$i.err | tee -a "$OUT/summary.txt"; done
elif [ "${PHASE:-1}" = 3 ]; then
  build_and_plans
  log "start-up: three fresh processes decoding 64 tokens (the first compiles and stores the programs)"
  startup 3
  py-spy record -r 200 -f raw -o "$D/spy-startup.txt" -- strata-run $W/p-gpu --greedy -n 64 --prompt "The history of the city" \
    > /dev/null 2> $W/run4.err
  python3 -c "import numpy as np; a,b,c=[np.load('$W/tok%d.npy' % i) for i in (1,2,3)]; print('tokens equal across the processes:', (a==b).all() and (a==c).all())" | tee -a "$OUT/summary.txt"
  strata_prefill gpu $W/p-gpu --lens 512,4096 --repeats 3 --profile
  while ! grep -q "^rc" $W/c2.log 2>/dev/null && [ $(left) -gt 60 ]; do sleep 2; done
  strata_prefill cpu8 $W/p-cpu8 --lens 512,4096 --repeats 3 --profile
  log "cpu8 logits of a 512-token prompt, streamed against the CPU kernels"
  for s in 0 16; do STRATA_STREAM_PREFILL_TOKENS=$s strata-run $W/p-cpu8 --input-ids $W/ids512.npy -n 1 --logits-out $W/lg$s.npy \
    > /dev/null 2> $W/lg$s.err; tail -1 $W/lg$s.err | tee -a "$OUT/summary.txt"; done
  python3 -c "import numpy as np; a=np.load('$W/lg0.npy')[0,-64:]; b=np.load('$W/lg16.npy')[0,-64:]; print('max |streamed - cpu| / std over the last 64 tokens: %.3g; argmax equal %d/64' % (np.abs(a-b).max()/a.std(), (a.argmax(-1)==b.argmax(-1)).sum()))" | tee -a "$OUT/summary.txt"
  log "waiting for llama.cpp ($(left) s left)"
  while ! grep -q "gguf rc" $W/quant.log 2>/dev/null && [ $(left) -gt 150 ]; do sleep 3; done
  log "$(tail -1 $W/build.out) $(tail -1 $W/quant.log 2>/dev/null)"
  llama_bench gpu -ngl 99 -t 16 -p 512,4096 -n 64 -r 3
  llama_bench cpu8 -ngl 99 -ncmoe 8 -t 16 -p 512,4096 -n 64 -r 3
  CUDA_VISIBLE_DEVICES= llama_bench cpu -ngl 0 -t 16 -p 512 -n 0 -r 3
  log "strata cpu (llvm, 16 threads) prefill 512, three runs"
  for i in 1 2 3; do timeout 60 strata-run $W/p-gpu --backend llvm --input-ids $W/ids512.npy -n 1 2>&1 | grep "^\[llvm\]" \
    | tee -a "$OUT/summary.txt"; done
  log "llama.cpp load + first token (llama-bench -p 0 -n 1 -r 1, wall)"
  for i in 1 2; do /usr/bin/time -f "wall %e s" $BIN/llama-bench -m $W/mx-Q4_0.gguf -ngl 99 -p 0 -n 1 -r 1 \
    > /dev/null 2> $W/lt$i.err; tail -1 $W/lt$i.err | tee -a "$OUT/summary.txt"; done
elif [ "${PHASE:-1}" = 5 ]; then
  # start-up alone: the GPU plan's first process stores its programs, then fresh processes decode
  # 64 tokens (programs prefetched while the weights go up, JAX started beside the plan's reading)
  log "model"
  [ -f $M/config.json ] || python3 benchmarks/make_mixtral_model.py $M > $W/make.log 2>&1 || { tail $W/make.log; exit 1; }
  [ -f $W/p-gpu/plan.bin ] || stratac compile $M -o $W/p-gpu --quant int4 > $W/c1.log 2>&1 || tail -3 $W/c1.log
  log "start-up: four fresh processes decoding 64 tokens (the first compiles and stores the programs)"
  startup 4
  python3 -c "import numpy as np; t=[np.load('$W/tok%d.npy' % i) for i in (1,2,3,4)]; print('tokens equal across the processes:', all((x==t[0]).all() for x in t))" | tee -a "$OUT/summary.txt"
  py-spy record --idle --threads -r 200 -f raw -o "$D/spy-startup.txt" -- strata-run $W/p-gpu --greedy -n 64 \
    --prompt "The history of the city" > /dev/null 2> $W/run5.err
  log "under py-spy: $(grep -v "$QUIET" $W/run5.err | tail -1)"
  python3 - "$D/spy-startup.txt" <<'PY' | tee -a "$OUT/summary.txt"
import sys
from collections import Counter
inc, tot = Counter(), 0
for line in open(sys.argv[1]):
    stack, n = line.rsplit(" ", 1)
    n = int(n)
    tot += n
    frames = stack.split(";")
    if not any("MainThread" in f for f in frames[:2]):
        continue
    for f in set(frames):
        inc[f[:100]] += n
for k, v in inc.most_common(40):
    print(f"{v / 200:7.2f} s  {k}")
PY
elif [ "${PHASE:-1}" = 6 ]; then
  # the many-token MoE kernels' two forms by tuning (gpu_gemm.py), start-up, then the whole GPU prefill
  # by 512-token steps and by the default ones (the best tuning of the dequantized-first form)
  log "model and plan (background); kernel forms"
  ( [ -f $M/config.json ] || python3 benchmarks/make_mixtral_model.py $M > $W/make.log 2>&1
    stratac compile $M -o $W/p-gpu --quant int4 > $W/c1.log 2>&1; echo "rc $?" >> $W/c1.log ) &
  timeout 220 python3 benchmarks/gpu_gemm.py --rows ${ROWS:-64,128,256,512,4096} --json "$D/gemm.json" \
    --tunes ${TUNES:-64.128.4.4.3,128.128.2.8.4,64.128.2.4.4} 2>&1 | grep -v "$QUIET" | tee -a "$OUT/summary.txt"
  BEST=$(python3 - "$D/gemm.json" <<'PY'
import json, sys
tot = {}
for r in json.load(open(sys.argv[1])):
    tot.setdefault(r["tune"], {})[r["rows"], r["form"]] = r["us"]
ok = {t: v[512, "first"] + v[4096, "first"] for t, v in tot.items() if (512, "first") in v and (4096, "first") in v}
print((min(ok, key=ok.get) if ok else "128.128.2.8.4"))
PY
)
  log "best tuning of the dequantized-first form by 512 + 4096: $BEST"
  BT=$(echo $BEST | tr . ,)
  while ! grep -q "^rc" $W/c1.log 2>/dev/null && [ $(left) -gt 60 ]; do sleep 2; done
  log "start-up: three fresh processes (the first compiles and stores the programs)"
  startup 3
  py-spy record --idle --threads -r 200 -f raw -o "$D/spy-startup.txt" -- strata-run $W/p-gpu --greedy -n 64 \
    --prompt "The history of the city" > /dev/null 2> $W/run5.err
  log "under py-spy: $(grep -v "$QUIET" $W/run5.err | tail -1)"
  strata_prefill c512 $W/p-gpu --lens 512,4096 --repeats 3 --chunk 512
  STRATA_PALLAS_GEMM_BF16_TUNE=$BT strata_prefill best $W/p-gpu --lens 512,4096 --repeats 3 --profile
elif [ "${PHASE:-1}" = 7 ]; then
  # the acceptance rows in one call: llama.cpp builds at the lowest priority while Strata's side runs
  # (start-up, GPU and cpu8 prefill by the default steps and the GPU's by 512, decode), then llama-bench
  build_and_plans
  log "start-up: three fresh processes decoding 64 tokens (the first compiles and stores the programs)"
  startup 3
  strata_prefill gpu $W/p-gpu --lens 512,4096 --repeats 3
  strata_prefill gpu-c512 $W/p-gpu --lens 4096 --repeats 3 --chunk 512
  while ! grep -q "^rc" $W/c2.log 2>/dev/null && [ $(left) -gt 60 ]; do sleep 2; done
  strata_prefill cpu8 $W/p-cpu8 --lens 512,4096 --repeats 3
  log "cpu8 decode, 64 tokens, two fresh processes"
  for i in 1 2; do strata-run $W/p-cpu8 --greedy -n 64 --prompt "The history of the city" 2>&1 | grep "^\[" | tail -1 \
    | tee -a "$OUT/summary.txt"; done
  log "waiting for llama.cpp ($(left) s left)"
  while ! grep -q "gguf rc" $W/quant.log 2>/dev/null && [ $(left) -gt 100 ]; do sleep 3; done
  log "$(tail -1 $W/build.out) $(tail -1 $W/quant.log 2>/dev/null)"
  llama_bench gpu -ngl 99 -t 16 -p 512,4096 -n 64 -r 3
  llama_bench cpu8 -ngl 99 -ncmoe 8 -t 16 -p 512,4096 -n 64 -r 3
  log "llama.cpp load + first token (llama-bench -p 0 -n 1 -r 1, wall)"
  for i in 1 2; do /usr/bin/time -f "wall %e s" $BIN/llama-bench -m $W/mx-Q4_0.gguf -ngl 99 -p 0 -n 1 -r 1 \
    > /dev/null 2> $W/lt$i.err; tail -1 $W/lt$i.err | tee -a "$OUT/summary.txt"; done
elif [ "${PHASE:-1}" = 4 ]; then
  # the CPU-only line alone: llama.cpp built for the CPU only (no CUDA: minutes, not eight), Strata's
  # llvm backend (AMX tiles), both on the idle machine in alternating rounds
  sed -e 's/&& cuda=ON/\&\& cuda=OFF/' -e 's/--target llama-bench llama-quantize llama-batched-bench llama-server/--target llama-bench llama-quantize/' \
    build/llamacpp/build.sh > $W/build-cpu.sh
  cp build/llamacpp/llama.cpp-src.tar.xz $W/
  setsid bash -c "JOBS=16 bash $W/build-cpu.sh $LC > $W/build.out 2>&1; echo build rc \$? >> $W/build.out" < /dev/null > /dev/null 2>&1 &
  log "model"
  [ -f $M/config.json ] || python3 benchmarks/make_mixtral_model.py $M > $W/make.log 2>&1 || { tail $W/make.log; exit 1; }
  (while [ ! -f $LC/convert_hf_to_gguf.py ]; do sleep 1; done; sleep 2
   PYTHONPATH=$LC/gguf-py python3 $LC/convert_hf_to_gguf.py $M --outtype bf16 --outfile $W/mx-bf16.gguf \
     > $W/convert.log 2>&1; echo "convert rc $?" >> $W/convert.log) &
  log "compile (llama.cpp builds and converts beside it)"
  [ -f $W/p-gpu/plan.bin ] || stratac compile $M -o $W/p-gpu --quant int4 > $W/c1.log 2>&1 || tail -3 $W/c1.log
  python3 -c "import numpy as np, json; v=json.load(open('$M/config.json'))['vocab_size']; \
np.save('$W/ids512.npy', np.random.default_rng(0).integers(3, v - 1, (1, 512)))"
  while ! grep -q "convert rc" $W/convert.log 2>/dev/null || ! grep -q "build rc" $W/build.out 2>/dev/null; do
    [ $(left) -gt 120 ] || break; sleep 2; done
  log "$(tail -1 $W/convert.log) $(tail -1 $W/build.out)"
  LLAMA llama-quantize $W/mx-bf16.gguf $W/mx-Q4_0.gguf Q4_0 16 > $W/quant.log 2>&1; echo "quant rc $?" >> $W/quant.log
  log "$(tail -1 $W/build.out) $(tail -1 $W/quant.log 2>/dev/null)"
  timeout 120 strata-run $W/p-gpu --backend llvm --input-ids $W/ids512.npy -n 1 --trace "$D/cpu-trace.json" 2>&1 \
    | grep "^\[llvm\]" | tee -a "$OUT/summary.txt"      # kernels compiled and cached here
  python3 benchmarks/trace_ops.py "$D/cpu-trace.json" --top 6 | tee -a "$OUT/summary.txt"
  log "CPU only, 16 threads, prefill 512: three alternating rounds"
  for i in 1 2 3; do
    CUDA_VISIBLE_DEVICES= LLAMA llama-bench -m $W/mx-Q4_0.gguf -ngl 0 -t 16 -p 512 -n 0 -r 1 -o md 2>&1 | grep "pp512" \
      | tee -a "$OUT/summary.txt"
    timeout 60 strata-run $W/p-gpu --backend llvm --input-ids $W/ids512.npy -n 1 2>&1 | grep "^\[llvm\]" \
      | tee -a "$OUT/summary.txt"
  done
  log "decode, CPU only, 64 tokens (llama-bench tg64; strata-run -n 64)"
  CUDA_VISIBLE_DEVICES= LLAMA llama-bench -m $W/mx-Q4_0.gguf -ngl 0 -t 16 -p 0 -n 64 -r 2 -o md 2>&1 | grep "tg64" \
    | tee -a "$OUT/summary.txt"
  timeout 60 strata-run $W/p-gpu --backend llvm --greedy --prompt "The history of the city" -n 64 2>&1 | grep "^\[llvm\]" \
    | tee -a "$OUT/summary.txt"
fi
log "done ($(left) s left)"
tar czf "$OUT/details-${PHASE:-1}.tgz" -C $W "details-${PHASE:-1}"
