"""The StrataError hierarchy.

A user-facing error is one line that names the file, tensor, field, flag or pass at fault and
says what to do. The CLIs print `str(err)` and exit nonzero; the traceback appears only with
`--debug`. Anything that is not a StrataError is a bug in Strata and keeps its traceback.
"""

from __future__ import annotations


class StrataError(Exception):
    """Base class of every error a user can cause (bad input, bad flags, corrupt files)."""

    exit_code = 1


class ModelError(StrataError):
    """A model folder is missing something or holds something Strata cannot read."""


class PlanError(StrataError):
    """A plan.bin or its weight file is corrupt, truncated, or from an incompatible version."""


class IRError(StrataError):
    """IR text that does not parse, or an IR that fails verification."""


class PassError(StrataError):
    """A pass failed; the message names the pass and shows the IR around the failing node."""


class BackendError(StrataError):
    """A backend is unavailable on this host, or cannot run the op it was given."""


class UsageError(StrataError):
    """A flag value or combination of flags that cannot work."""

    exit_code = 2
