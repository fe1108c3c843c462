"""What the benchmark scripts share: a timestamped log line on stderr, and `stratac` as a child
process (a failure ends the benchmark with its stderr)."""

from __future__ import annotations

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
