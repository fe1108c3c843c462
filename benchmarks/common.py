"""What the benchmark scripts share: a timestamped log line on stderr, `stratac` as a child
process (a failure ends the benchmark with its stderr), and the median time of a call."""

from __future__ import annotations

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
