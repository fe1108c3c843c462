"""What the benchmark scripts share: a timestamped log line on stderr, `stratac` as a child
process (a failure ends the benchmark with its stderr), the median time of a call, and the device
kernels of a call from a JAX profiler trace."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import statistics
import subprocess
import sys
import time


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stratac(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "strata_compiler.cli", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"stratac {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return r.stdout


def median_seconds(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time of `repeats` calls of fn after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


@contextlib.contextmanager
def env_set(name: str, value: str):
    """Environment variable `name` set to `value` inside the block, as it was after it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def profile_events(fn) -> tuple[list[dict], dict, dict] | None:
    """Run fn() under the JAX profiler (CUPTI) and return (complete events, {pid: process name},
    {(pid, tid): thread name}) from its Perfetto trace, or None when it wrote none."""
    import glob
    import gzip
    import json
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        try:
            fn()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(f"{d}/**/*perfetto_trace.json.gz", recursive=True)
        if not files:
            return None
        events = json.loads(gzip.open(files[0]).read())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    procs = {e["pid"]: str(e.get("args", {}).get("name", "")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", "")) for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return [e for e in events if e.get("ph") == "X" and "dur" in e], procs, threads


def device_kernels(fn) -> tuple[dict[str, list], float, float] | None:
    """Run fn() under the JAX profiler (CUPTI) and return ({kernel name: [count, total us]},
    device busy us, device span us) over the GPU's events, or None without device events (no
    GPU). Numbered duplicates of a name (fusion.3) count as one."""
    got = profile_events(fn)
    if got is None:
        return None
    events, procs, _ = got
    gpu = {pid for pid, name in procs.items() if "gpu" in name.lower()}
    per: dict = collections.defaultdict(lambda: [0, 0.0])
    busy, lo, hi = 0.0, None, None
    for e in events:
        if e.get("pid") not in gpu:
            continue
        name = re.sub(r"\.\d+$", "", str(e.get("name", "?")))
        per[name][0] += 1
        per[name][1] += float(e["dur"])
        busy += float(e["dur"])
        lo = e["ts"] if lo is None else min(lo, e["ts"])
        hi = e["ts"] + e["dur"] if hi is None else max(hi, e["ts"] + e["dur"])
    if not per:
        return None
    return dict(per), busy, hi - lo


def host_self_times(events: list[dict], procs: dict, threads: dict) -> dict:
    """{(thread name, event name): [count, self us]} over the host threads' events (not the
    GPU's): an event's self time is its duration less that of the events nested in it on its
    thread. Numbered duplicates of a name count as one."""
    gpu = {pid for pid, name in procs.items() if "gpu" in name.lower()}
    by_thread: dict = collections.defaultdict(list)
    for e in events:
        if e.get("pid") not in gpu and "profiler.py" not in str(e.get("name", "")):   # not the profiler's own
            by_thread[(e["pid"], e.get("tid"))].append(e)
    out: dict = collections.defaultdict(lambda: [0, 0.0])
    for key, evs in by_thread.items():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list = []        # [end, name, child time]
        tname = threads.get(key, str(key[1]))

        def close(item):
            end, name, child, dur = item
            out[(tname, name)][0] += 1
            out[(tname, name)][1] += dur - child
        for e in evs:
            ts, dur = float(e["ts"]), float(e["dur"])
            while stack and stack[-1][0] <= ts:
                close(stack.pop())
            if stack:
                stack[-1][2] += dur
            stack.append([ts + dur, re.sub(r"\.\d+$", "", str(e.get("name", "?"))), 0.0, dur])
        while stack:
            close(stack.pop())
    return dict(out)
