"""Run a hostile-input case in a child process under `resource` limits, and say what it cost.

Issue 40's bar: no hostile input hangs past 10 s or grows past 1 GiB. A case runs as its own
process (a command, or Python code), its address space capped by RLIMIT_AS (set in the child
before exec, so a runaway allocation fails fast instead of swapping the box) and its wall time by
a deadline; its peak resident memory comes from wait4 in a small prelude process that forked it
(a process forked from pytest would count pytest's pages as its own).

    r = run_limited([sys.executable, "-m", "strata_compiler.cli", "compile", str(bad), "-o", str(out)])
    r.check()                       # within 10 s and 1 GiB resident
    assert r.rc == 1 and r.stderr.startswith("error:")
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

TIMEOUT_S = 10.0
MAX_RSS = 1 << 30
# the cap on address space, not resident memory: JAX alone maps ~1.5 GiB it never touches
ADDRESS_SPACE = 6 << 30

# The child sets the limit, then forks the case and reports the case's own peak RSS (wait4) on a pipe:
# a process's ru_maxrss counts the pages of the process it was forked from (pytest's), so the
# case runs one fork away from a small interpreter.
_PRELUDE = """import os, resource, signal, struct, sys
n, fd = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (n, n))
pid = os.fork()
if pid == 0:
    os.close(fd)
    try:
        os.execvp(sys.argv[3], sys.argv[3:])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
os.write(fd, struct.pack("<q", usage.ru_maxrss * 1024))
code = os.waitstatus_to_exitcode(status)
if code < 0:                    # killed by a signal: die of it too, so the parent sees the same
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code)
"""


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
    peak resident memory comes from wait4 on it alone, reported by the prelude."""
    argv = [str(a) for a in argv]
    t0 = time.monotonic()
    rfd, wfd = os.pipe()
    try:
        p = subprocess.Popen([sys.executable, "-c", _PRELUDE, str(address_space), str(wfd), *argv],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
                             start_new_session=True, pass_fds=(wfd,))
    finally:
        os.close(wfd)
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
    timed_out, status = False, 0
    while True:
        pid, status = os.waitpid(p.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() - t0 > timeout:
            timed_out = True
            os.killpg(p.pid, signal.SIGKILL)
            _, status = os.waitpid(p.pid, 0)
            break
        time.sleep(0.01)
    seconds = time.monotonic() - t0
    p.returncode = os.waitstatus_to_exitcode(status)        # so Popen does not wait for it again
    for t in readers:
        t.join(5)
    with os.fdopen(rfd, "rb") as f:
        report = f.read(8)
    # the case's own peak, as the prelude reported it (none when killed at the deadline)
    rss = struct.unpack("<q", report)[0] if len(report) == 8 else 0
    return Limited(argv, None if timed_out else p.returncode, b"".join(chunks["out"]).decode(errors="replace"),
                   b"".join(chunks["err"]).decode(errors="replace"), seconds, rss, timed_out)


def run_python(code: str, **kw) -> Limited:
    """run_limited of `python -c code`."""
    return run_limited([sys.executable, "-c", code], **kw)
