#!/usr/bin/env bash
# Issue 28's 2-core line: prefill of a 512-token prompt, Strata (llvm, 2 threads) beside llama.cpp's
# llama-bench (pp512, -t 2) on the model of make_mixtral_model.py, int4 against Q4_0 and int8 against
# Q8_0 (both --pure, f32 embeddings: the rule of --quant int4/int8), three alternating rounds.
#   bash benchmarks/gguf_roundtrip.sh LLAMACPP_SRC LLAMA_QUANTIZE /tmp/gguf_rt   (the model, Q4_0, the int4 plan)
#   bash benchmarks/prefill_2core.sh      (llama-bench built beside llama-quantize in /tmp/lcb/build/bin)
set -e
W=/tmp/gguf_rt; cd /work/main
[ -f $W/q8_0.gguf ] || { PYTHONPATH=/tmp/lcb/gguf-py .venv/bin/python /tmp/lcb/convert_hf_to_gguf.py $W/hf --outtype bf16 --outfile $W/bf16.gguf > $W/convert2.log 2>&1; /tmp/lcb/build/bin/llama-quantize --pure --token-embedding-type f32 --output-tensor-type q8_0 $W/bf16.gguf $W/q8_0.gguf Q8_0 2 > $W/q80.log 2>&1; rm -f $W/bf16.gguf; }
[ -f $W/p-hf-int8/plan.bin ] || .venv/bin/stratac compile $W/hf -o $W/p-hf-int8 --quant int8 > /dev/null
.venv/bin/python -c "import numpy as np; np.save('/tmp/ids512.npy', np.random.default_rng(0).integers(3, 3000, (1, 512)))"
echo "== $(date +%H:%M:%S) start"
for r in 1 2 3; do
  for q in 4 8; do
    LD_LIBRARY_PATH=/tmp/lcb/build/bin /tmp/lcb/build/bin/llama-bench -m $W/q${q}_0.gguf -p 512 -n 0 -t 2 -r 1 -o csv 2>/dev/null | tail -1 | awk -F, -v q=$q '{print "llama.cpp Q" q "_0 pp512", $(NF-1), $NF}'
    .venv/bin/strata-run $W/p-hf-int$q --input-ids /tmp/ids512.npy -n 1 --backend llvm 2>&1 >/dev/null | grep prefill | sed "s/^/strata int$q: /"
  done
done
echo "== $(date +%H:%M:%S) end"
