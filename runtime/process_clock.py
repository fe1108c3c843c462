"""How long this process has run, from the kernel's record of its start: a first token's time
then counts Python's start-up and the program's imports too (Session.timings.first_token_at)."""

from __future__ import annotations

import os


def process_seconds() -> float | None:
    """Seconds since this process started, from /proc (Linux); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
