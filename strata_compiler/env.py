"""Runtime switches read from the environment (STRATA_*=0|1): one parser, one error line."""

from __future__ import annotations

import os

from .errors import UsageError


def switch(name: str, default: bool) -> bool:
    """Environment variable `name` as an on/off switch: "1" on, "0" off, unset the default; any
    other value is a UsageError naming the variable."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw not in ("0", "1"):
        raise UsageError(f"{name}={raw!r}: expected 0 or 1")
    return raw == "1"
