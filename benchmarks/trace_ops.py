"""Where a run's time went, per op: the spans of a `strata-run --trace` file summed by track and name.

    python benchmarks/trace_ops.py trace.json [--top 20]

Prints, per track (cpu kernels, gpu partitions, copies, steps), each span name's count, total
milliseconds and share of the track's sum, largest first; and each step span's wall time beside
the kernels' busy time inside it (the rest is the host's work between kernels).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata_compiler import trace  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--top", type=int, default=20, help="names shown per track")
    a = ap.parse_args()
    doc = json.loads(a.trace.read_text())
    trace.validate(doc)
    names = {tid: t for t, tid in trace.TRACKS.items()}
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    per: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for e in spans:
        row = per[e["tid"]][e["name"]]
        row[0] += 1
        row[1] += e["dur"] / 1000.0
    for tid in sorted(per):
        rows = sorted(per[tid].items(), key=lambda kv: -kv[1][1])
        total = sum(r[1] for _, r in rows)
        print(f"{names.get(tid, tid)}: {total:.1f} ms in {sum(r[0] for _, r in rows)} spans")
        for name, (n, ms) in rows[:a.top]:
            print(f"  {name:28s} {n:6d} {ms:10.2f} ms {100 * ms / max(total, 1e-9):5.1f} %")
    steps = [e for e in spans if e["tid"] == trace.TRACKS["step"]]
    for s in steps[:8]:
        lo, hi = s["ts"], s["ts"] + s["dur"]
        inner = trace.merged([(max(e["ts"], lo), min(e["ts"] + e["dur"], hi)) for e in spans
                              if e["tid"] in (trace.TRACKS["cpu"], trace.TRACKS["gpu"]) and e["ts"] < hi
                              and e["ts"] + e["dur"] > lo])
        busy = sum(b - x for x, b in inner) / 1000.0
        print(f"step {s['name']}: {s['dur'] / 1000.0:.1f} ms wall, kernels busy {busy:.1f} ms "
              f"({100 * busy / max(s['dur'] / 1000.0, 1e-9):.0f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
