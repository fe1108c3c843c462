# Sourced by the H200 scripts (h200_placement.sh, h200_runtime.sh): strict mode, the checkout's
# root, $OUT (the device tool's, else $1), and the project installed into the machine's Python.
set -euo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$1}
mkdir -p "$OUT"
pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
# the device tool brings back at most 8 files from $OUT: each trace folder leaves as one archive,
# and the install log only when the install failed
bundle() {
  cd "$OUT" || return
  for d in traces*; do [ -d "$d" ] && tar czf "$d.tgz" "$d" && rm -rf "$d"; done
  rm -f pip.log
}
trap bundle EXIT
