#!/usr/bin/env bash
# Issue 28's small-machine line on a 2-vCPU VM: prefill of 512 tokens, Strata (llvm, every core)
# beside llama.cpp's llama-bench (pp512, -t 2; built for the CPU alone) on the model of
# make_mixtral_model.py, int4 against Q4_0 and int8 against Q8_0 (--pure, f32 embeddings), three
# alternating rounds. Paths: LCB (the GGUFs), BIN (llama-bench of a CPU-only build; on a VM whose
# AMX llama.cpp cannot use - its AMX kernels stop with SIGILL there - one built without AMX), the plans.
#   LCB=/tmp/lcb BIN=/tmp/lcb/src/build-noamx/bin PLANS=/tmp/mx-int bash benchmarks/prefill_2core_amx.sh
set -u
LCB=${LCB:-/tmp/lcb}; PLANS=${PLANS:-/tmp/mx-int}; B=${BIN:-$LCB/src/build/bin}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
.venv/bin/python -c "import numpy as np; np.save('/tmp/ids512.npy', np.random.default_rng(0).integers(3, 3000, (1, 512)))"
for r in 1 2 3; do
  for q in 4 8; do
    LD_LIBRARY_PATH=$B $B/llama-bench -m $LCB/mx-q${q}_0.gguf -p 512 -n 0 -t 2 -r 1 -o csv 2>/dev/null | tail -1 \
      | awk -F, -v q=$q '{gsub(/"/, ""); print "llama.cpp Q" q "_0 pp512", $(NF-1)}'
    .venv/bin/strata-run $PLANS$q --input-ids /tmp/ids512.npy -n 1 --backend llvm 2>&1 >/dev/null \
      | grep -o "prefill 512 tokens at [0-9.]* tok/s" | sed "s/^/strata int$q /"
  done
done
