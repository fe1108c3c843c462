"""Run a hostile-input case in a child process under `resource` limits, and say what it cost.

Issue 40's bar: no hostile input hangs past 10 s or grows past 1 GiB. A case runs as its own
process (a command, or Python code), its address space capped by RLIMIT_AS (set in the child
before exec, so a runaway allocation fails fast instead of swapping the box) and its wall time by
a deadline; the parent reads the child's peak resident memory from wait4.

    r = run_limited([sys.executable, "-m", "strata_compiler.cli", "compile", str(bad), "-o", str(out)])
    r.check()                       # within 10 s and 1 GiB resident
    assert r.rc == 1 and r.stderr.startswith("error:")
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

TIMEOUT_S = 10.0
MAX_RSS = 1 << 30
# the cap on address space, not resident memory: JAX alone maps ~1.5 GiB it never touches
ADDRESS_SPACE = 6 << 30

_PRELUDE = ("import os, resource, sys; n = int(sys.argv[1]); "
            "resource.setrlimit(resource.RLIMIT_AS, (n, n)); os.execvp(sys.argv[2], sys.argv[2:])")


@dataclass
class Limited:
    argv: list
    rc: int | None          # None when it was killed at the deadline
    stdout: str
    stderr: str
    seconds: float
    max_rss: int            # bytes
    timed_out: bool

    def check(self, timeout: float = TIMEOUT_S, max_rss: int = MAX_RSS) -> "Limited":
        """Within the time and memory bar (an AssertionError saying which and how much otherwise)."""
        tail = self.stderr[-600:]
        assert not self.timed_out, f"{self.argv[-1][:80]!r} ran past {timeout} s; stderr: {tail}"
        assert self.seconds <= timeout, f"took {self.seconds:.1f} s (> {timeout}); stderr: {tail}"
        assert self.max_rss <= max_rss, f"peak RSS {self.max_rss >> 20} MiB (> {max_rss >> 20}); stderr: {tail}"
        return self


def run_limited(argv: list, *, timeout: float = TIMEOUT_S, address_space: int = ADDRESS_SPACE,
                input: bytes | None = None, env: dict | None = None, cwd=None) -> Limited:
    """Run `argv` with RLIMIT_AS = address_space, killed (its process group) after `timeout` s; its
    peak resident memory comes from wait4 on it alone (not the maximum over every child so far)."""
    argv = [str(a) for a in argv]
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", _PRELUDE, str(address_space), *argv], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True)
    chunks: dict = {"out": [], "err": []}

    def drain(f, into):
        for block in iter(lambda: f.read1(1 << 16), b""):
            into.append(block)

    readers = [threading.Thread(target=drain, args=(p.stdout, chunks["out"]), daemon=True),
               threading.Thread(target=drain, args=(p.stderr, chunks["err"]), daemon=True)]
    for t in readers:
        t.start()
    try:
        p.stdin.write(input or b"")
        p.stdin.close()
    except OSError:
        pass
    timed_out, status, usage = False, 0, None
    while True:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() - t0 > timeout:
            timed_out = True
            os.killpg(p.pid, signal.SIGKILL)
            _, status, usage = os.wait4(p.pid, 0)
            break
        time.sleep(0.01)
    seconds = time.monotonic() - t0
    p.returncode = os.waitstatus_to_exitcode(status)        # so Popen does not wait for it again
    for t in readers:
        t.join(5)
    return Limited(argv, None if timed_out else p.returncode, b"".join(chunks["out"]).decode(errors="replace"),
                   b"".join(chunks["err"]).decode(errors="replace"), seconds, usage.ru_maxrss * 1024, timed_out)


def run_python(code: str, **kw) -> Limited:
    """run_limited of `python -c code`."""
    return run_limited([sys.executable, "-c", code], **kw)
