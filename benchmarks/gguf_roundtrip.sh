#!/usr/bin/env bash
# Issue 30: the model of make_mixtral_model.py through llama.cpp's own converter and quantizer, then
# Strata. Q4_0 (with f32 embeddings and a Q4_0 output tensor: the rule `--quant int4` follows) and
# Q4_K_M (llama.cpp's default recipe) GGUF files compile and decode; the Q4_0 plan's greedy tokens
# are compared with the HF folder's `--quant int4` plan's, and its weights file byte for byte.
#   bash benchmarks/gguf_roundtrip.sh LLAMACPP_SRC LLAMA_QUANTIZE [WORK] [MODEL_ARGS...]
# LLAMACPP_SRC: llama.cpp's source (convert_hf_to_gguf.py, gguf-py); LLAMA_QUANTIZE: a built
# llama-quantize (a CPU-only build does). Needs ~30 GB under WORK (default /tmp/gguf_rt) at the defaults.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SRC=$1; Q=$2; W=${3:-/tmp/gguf_rt}; shift $(( $# < 3 ? $# : 3 ))
PY=${PYTHON:-.venv/bin/python}; STRATAC=${STRATAC:-.venv/bin/stratac}; RUN=${STRATA_RUN:-.venv/bin/strata-run}
mkdir -p $W
log() { echo "[$(date +%H:%M:%S)] $*"; }
N=${N_NEW:-24}; PROMPT=${PROMPT:-"The history of the city"}
[ -f $W/hf/config.json ] || { log "model"; $PY benchmarks/make_mixtral_model.py $W/hf "$@" > $W/make.log 2>&1; }
if [ ! -f $W/q4_0.gguf ] || [ ! -f $W/q4_k_m.gguf ]; then
  log "convert_hf_to_gguf.py (bf16)"
  [ -f $W/bf16.gguf ] || PYTHONPATH=$SRC/gguf-py $PY $SRC/convert_hf_to_gguf.py $W/hf --outtype bf16 --outfile $W/bf16.gguf > $W/convert.log 2>&1
  # --pure: every tensor Q4_0 (llama.cpp's recipe would keep attn_k/attn_v of an 8-expert model at Q8_0),
  # with f32 embeddings and a Q4_0 output tensor: what `--quant int4` makes of the HF folder
  log "llama-quantize Q4_0 (--pure, f32 embeddings, Q4_0 output)"
  [ -f $W/q4_0.gguf ] || $Q --pure --token-embedding-type f32 --output-tensor-type q4_0 $W/bf16.gguf $W/q4_0.gguf Q4_0 2 > $W/q40.log 2>&1
  log "llama-quantize Q4_K_M"
  [ -f $W/q4_k_m.gguf ] || $Q $W/bf16.gguf $W/q4_k_m.gguf Q4_K_M 2 > $W/q4km.log 2>&1
  rm -f $W/bf16.gguf
fi
for name in hf-int4 q4_0 q4_k_m; do
  [ -f $W/p-$name/plan.bin ] && continue
  log "stratac compile $name"
  case $name in
    hf-int4) /usr/bin/time -f "  %e s, %M KB max RSS" $STRATAC compile $W/hf -o $W/p-$name --quant int4 2>&1 | tail -3 ;;
    *) /usr/bin/time -f "  %e s, %M KB max RSS" $STRATAC compile $W/$name.gguf -o $W/p-$name 2>&1 | tail -3 ;;
  esac
done
for name in hf-int4 q4_0 q4_k_m; do
  log "strata-run $name: $N greedy tokens"
  $RUN $W/p-$name -n $N --prompt "$PROMPT" --backend llvm --greedy --ignore-eos --tokens-out $W/ids-$name.npy > $W/run-$name.txt 2> $W/run-$name.err \
    || { tail -3 $W/run-$name.err; continue; }
  tail -1 $W/run-$name.err
done
$PY - "$W" <<'EOF'
import sys, filecmp
from pathlib import Path
import numpy as np
w = Path(sys.argv[1])
ids = {n: np.load(w / f"ids-{n}.npy") for n in ("hf-int4", "q4_0", "q4_k_m") if (w / f"ids-{n}.npy").exists()}
for n, a in ids.items():
    print(f"{n}: {a.reshape(-1)[:12].tolist()} ...")
if "hf-int4" in ids and "q4_0" in ids:
    a, b = ids["hf-int4"].reshape(-1), ids["q4_0"].reshape(-1)
    print(f"Q4_0 GGUF against the HF folder's int4 plan: {int((a == b).sum())} of {len(a)} greedy tokens equal")
same = filecmp.cmp(w / "p-hf-int4" / "weights.bin", w / "p-q4_0" / "weights.bin", shallow=False)
print(f"weights.bin byte-identical (HF int4 / Q4_0 GGUF): {same}")
EOF
