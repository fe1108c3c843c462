"""Timeline of a run: Chrome / Perfetto trace events (`strata-run --trace trace.json`) and the
per-device busy time and bytes moved behind `--stats`.

Events are the trace-event format's complete events (ph "X": name, cat, ts and dur in µs, pid,
tid) plus metadata events naming each track (ph "M", thread_name). One track per device and
per copy direction: the CPU kernels, the GPU partitions, host->device and device->host copies,
and the step driver; the expert caches' hits and misses are instant events (ph "i") on a track
of their own, one per cached layer and step, naming the experts that hit and missed (the
prefetches and swaps are host->device spans). Times are host wall clock: a GPU partition's span
runs from its dispatch to the moment its results are ready on the device (a watcher thread waits
for them, so the host is not held up and the CPU work it does meanwhile shows beside it); a
device->host span is the host's wait for a GPU result it needs plus the copy.

The backends record their kernels and copies here and the runtime its steps and caches, so the
recorder sits in the ground, below both.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

TRACKS = {"step": 0, "cpu": 1, "gpu": 2, "h2d": 3, "d2h": 4, "cache": 5}
TRACK_NAMES = {"step": "steps (host)", "cpu": "cpu kernels (llvm / reference)", "gpu": "gpu partitions (xla)",
               "h2d": "copy host->device", "d2h": "copy device->host", "cache": "expert cache (hits, misses)"}
PID = 1

ACTIVE: "Tracer | None" = None     # set by strata-run --trace/--stats; executors check it


class Tracer:
    def __init__(self, full: bool = True) -> None:
        """full=False: for `--stats` alone (no trace file): the runtime may then skip what only
        the timeline shows (per-layer hit/miss instants) and decode ahead, each step one span."""
        self.full = full
        self.t0 = time.perf_counter_ns()
        self.events: list[dict] = []
        self.bytes: dict[str, int] = defaultdict(int)        # link -> bytes moved
        self.counts: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self.watchers: list = []      # threads waiting for GPU work to finish (joined before writing)

    def _us(self, ns: int) -> float:
        return (ns - self.t0) / 1000.0

    @contextmanager
    def span(self, name: str, track: str, cat: str = "kernel", **args):
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            end = time.perf_counter_ns()
            ev = {"name": name, "cat": cat, "ph": "X", "ts": self._us(start), "dur": (end - start) / 1000.0,
                  "pid": PID, "tid": TRACKS[track]}
            if args:
                ev["args"] = args
            self.events.append(ev)
            self.counts[track] += 1

    def add_span(self, name: str, track: str, start_ns: int, end_ns: int, cat: str = "kernel", **args) -> None:
        """A span measured elsewhere (e.g. by a thread that waited for the GPU to finish)."""
        ev = {"name": name, "cat": cat, "ph": "X", "ts": self._us(start_ns), "dur": (end_ns - start_ns) / 1000.0,
              "pid": PID, "tid": TRACKS[track]}
        if args:
            ev["args"] = args
        with self._lock:
            self.events.append(ev)
            self.counts[track] += 1

    def instant(self, name: str, track: str, **args) -> None:
        """A moment (ph "i", thread scope): no busy time, no span count."""
        ev = {"name": name, "cat": track, "ph": "i", "s": "t", "ts": self._us(time.perf_counter_ns()),
              "pid": PID, "tid": TRACKS[track]}
        if args:
            ev["args"] = args
        with self._lock:
            self.events.append(ev)

    def transfer(self, direction: str, nbytes: int, seconds: float, name: str = "activation",
                 end_ns: int | None = None) -> None:
        """A copy that already happened (ended at end_ns, default now; lasted `seconds`) on track
        h2d or d2h."""
        end = time.perf_counter_ns() if end_ns is None else end_ns
        start = end - int(seconds * 1e9)
        self.events.append({"name": name, "cat": "transfer", "ph": "X", "ts": self._us(start),
                            "dur": seconds * 1e6, "pid": PID, "tid": TRACKS[direction], "args": {"bytes": nbytes}})
        self.bytes[direction] += nbytes
        self.counts[direction] += 1

    def join(self) -> None:
        for t in self.watchers:
            t.join()
        self.watchers.clear()

    def document(self) -> dict:
        self.join()
        meta = [{"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": "strata-run"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": TRACK_NAMES[t]}}
                 for t, tid in TRACKS.items()]
        return {"traceEvents": meta + self.events, "displayTimeUnit": "ms"}

    def write(self, path: Path) -> None:
        """Atomically (temp file, then rename)."""
        path = Path(path)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.document()))
        os.replace(tmp, path)

    def overlap(self, a: str = "cpu", b: str = "gpu") -> float:
        """Seconds during which tracks a and b were both busy."""
        self.join()
        with self._lock:
            return overlap_seconds(self.events, TRACKS[a], TRACKS[b])

    def busy_seconds(self) -> dict[str, float]:
        """Per track, the seconds during which at least one of its spans ran (the union: spans of
        one track may overlap, e.g. GPU partitions in flight at once, or nested spans), not the
        sum of their durations."""
        self.join()
        with self._lock:
            out = {}
            for t in TRACKS:
                if self.counts.get(t):
                    tid = TRACKS[t]
                    m = merged([(e["ts"], e["ts"] + e["dur"]) for e in self.events
                                if e.get("ph") == "X" and e.get("tid") == tid])
                    out[t] = sum(b - a for a, b in m) / 1e6
            return out

    def stats_lines(self, wall_seconds: float) -> list[str]:
        busy = self.busy_seconds()
        lines = [f"busy time per track over {wall_seconds:.3f} s of run:"]
        for t in TRACKS:
            if self.counts.get(t):
                lines.append(f"  {TRACK_NAMES[t]:32s} {busy[t]:9.4f} s  {self.counts[t]:7d} spans  "
                             f"({100 * busy[t] / max(wall_seconds, 1e-12):5.1f} %)")
        if self.counts.get("cpu") and self.counts.get("gpu"):
            both = self.overlap("cpu", "gpu")
            lines.append(f"  cpu kernels and gpu partitions at once: {both:.4f} s "
                         f"({100 * both / max(busy['gpu'], 1e-12):.1f} % of the gpu's busy time)")
        for link in ("h2d", "d2h"):
            if self.counts.get(link):
                lines.append(f"  bytes moved {link}: {self.bytes[link]} B in {self.counts[link]} copies")
        return lines


def merged(spans) -> list[tuple]:
    """(start, end) intervals, sorted, with overlapping or touching ones joined."""
    out: list[list] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap_seconds(events: list[dict], tid_a: int, tid_b: int) -> float:
    """Seconds during which a complete ("X") event of track tid_a and one of tid_b run at once
    (each track's spans merged first, so nested or touching spans count once)."""
    def spans(tid):
        return merged([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e.get("tid") == tid])
    A, B = spans(tid_a), spans(tid_b)
    i = j = 0
    total = 0.0
    while i < len(A) and j < len(B):
        lo, hi = max(A[i][0], B[j][0]), min(A[i][1], B[j][1])
        if hi > lo:
            total += hi - lo
        if A[i][1] < B[j][1]:
            i += 1
        else:
            j += 1
    return total / 1e6


def validate(doc: dict) -> None:
    """Raise ValueError unless doc follows the trace-event format (the JSON-object form)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError("a trace is an object with a traceEvents list")
    for i, ev in enumerate(doc["traceEvents"]):
        if not isinstance(ev, dict) or ev.get("ph") not in ("X", "M", "i", "B", "E", "C"):
            raise ValueError(f"event {i}: missing or unknown ph")
        for key, kind in (("name", str), ("pid", int), ("tid", int)):
            if not isinstance(ev.get(key), kind):
                raise ValueError(f"event {i}: {key} must be {kind.__name__}")
        if ev["ph"] != "M" and not isinstance(ev.get("ts"), (int, float)):
            raise ValueError(f"event {i}: ts must be a number (µs)")
        if ev["ph"] == "i" and ev.get("s", "t") not in ("g", "p", "t"):
            raise ValueError(f"event {i}: an instant's scope s is g, p or t")
        if ev["ph"] == "X":
            for key in ("ts", "dur"):
                if not isinstance(ev.get(key), (int, float)) or ev[key] < 0:
                    raise ValueError(f"event {i}: {key} must be a non-negative number (µs)")
        if ev["ph"] == "M" and not isinstance(ev.get("args", {}).get("name"), str):
            raise ValueError(f"event {i}: metadata events carry args.name")
