"""Runtime settings read from the environment (STRATA_*): switches, counts and numbers, one parser
each, one error line naming the variable."""

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


def count(name: str, default: int, what: str) -> int:
    """Environment variable `name` as a whole number >= 0 (`what` it counts, for the error line)."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    if not raw.isdigit():
        raise UsageError(f"{name}={raw!r}: give a whole number of {what} (default {default})")
    return int(raw)


def number(name: str, default: float) -> float:
    """Environment variable `name` as a number >= 0."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not v >= 0:
        raise UsageError(f"{name}={raw!r}: give a number >= 0 (default {default:g})")
    return v
