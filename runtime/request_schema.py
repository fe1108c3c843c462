"""One schema for a generation request's fields, shared by strata-server's JSON bodies and the Python
API's keyword arguments: each field's type, range, finiteness and caps are checked here once.

A value that does not fit is one SchemaError (a UsageError) whose message starts with the field's
name and says what it takes: the API raises it as it is, the server answers 400 with the field in
`param`. The sampling fields' bounds are strata_compiler/sampling.py's (the ones strata-run and a
plan's recommended defaults are held to). Text must be valid Unicode: a lone surrogate (JSON's
"\\ud800") can be neither tokenized nor written back out as UTF-8.
"""

from __future__ import annotations

import itertools
import numbers
from dataclasses import dataclass, fields
from typing import Any

from strata_compiler import sampling
from strata_compiler.errors import UsageError

MAX_BATCH = 256             # a scheduler's sequences decoded together (strata-server --max-batch, load(max_batch=))
MAX_CHUNK = 8192            # prompt tokens per prefill step (--prefill-chunk, load(prefill_chunk=))
MAX_STOP = 4                # stop strings per request, as OpenAI's API
MAX_STOP_LEN = 256          # characters per stop string
MAX_SEED = (1 << 64) - 1
MAX_TOKENS = (1 << 31) - 1  # a sanity cap on max_tokens; the context bounds it further
MAX_NAME = 256              # characters of a model or user name (the model's is echoed in answers)
MAX_CHARS_PER_TOKEN = 64    # a text prompt longer than this many characters per context position is refused unread


class SchemaError(UsageError):
    """A request field that does not fit the schema; `field` names it (dotted, with list indices)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _shown(value: Any) -> str:
    """A value as a message shows it: short, and printable whatever it holds."""
    return repr(value)[:24].encode("utf-8", "backslashreplace").decode("utf-8")


def _integer(value: Any) -> bool:
    """An int or a NumPy integer, not a bool (numbers.Integral holds NumPy's integers, not its bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not type(value).__name__ == "bool_"


def whole(name: str, value: Any, lo: int, hi: int) -> int:
    """`value` as an int in lo..hi (a bool, a float or a numeric string is refused, a NumPy integer taken)."""
    if _integer(value) and lo <= value <= hi:
        return int(value)
    raise SchemaError(name, f"{name} {_shown(value)}: expected a whole number {lo} to {hi}")


def text(name: str, value: Any, limit: int | None = None) -> str:
    """`value` as a str of valid Unicode (no lone surrogate), at most `limit` characters."""
    if not isinstance(value, str):
        raise SchemaError(name, f"{name}: expected a string, got {type(value).__name__}")
    if limit is not None and len(value) > limit:
        raise SchemaError(name, f"{name}: at most {limit} characters, got {len(value)}")
    bad = surrogate_at(value)
    if bad is not None:
        raise SchemaError(name, f"{name}: a lone UTF-16 surrogate (U+{ord(value[bad]):04X}) at character {bad} "
                                f"is not valid Unicode text")
    return value


def surrogate_at(s: str) -> int | None:
    """The index of the first lone surrogate in s, None when s is valid Unicode."""
    try:
        s.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def find_surrogate(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (a value or an object key) in a JSON-like value that holds
    a lone surrogate; None when there is none. Iterative: a deeply nested body costs no recursion;
    each list or dict is visited once, so one that holds itself (a Python caller's) ends the walk."""
    stack, seen = [(path, value)], set()
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            if surrogate_at(v) is not None:
                return where or "body"
            continue
        if isinstance(v, (dict, list, tuple)):
            if id(v) in seen:
                continue
            seen.add(id(v))
        if isinstance(v, dict):
            for k, x in v.items():
                key = str(k)
                if surrogate_at(key) is not None:
                    return where or "body"
                stack.append((f"{where}.{key}" if where else key, x))
        elif isinstance(v, (list, tuple)):
            stack.extend((f"{where}[{i}]", x) for i, x in enumerate(v))
    return None


def stop_strings(value: Any) -> tuple[str, ...]:
    """`stop`: one string, or a list of at most MAX_STOP strings, each at most MAX_STOP_LEN characters
    (None: none). A str is one stop string, never its characters."""
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, (list, tuple)):
        raise SchemaError("stop", f"stop: expected a string or a list of strings, got {type(value).__name__}")
    if len(stops) > MAX_STOP:
        raise SchemaError("stop", f"stop: at most {MAX_STOP} stop strings, got {len(stops)}")
    return tuple(text(f"stop[{i}]" if stops is value else "stop", s, MAX_STOP_LEN) for i, s in enumerate(stops))


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool) and type(value).__name__ != "bool_":
        raise SchemaError(name, f"{name} {_shown(value)}: expected true or false")
    return bool(value)


def sampling_field(name: str, value: Any) -> int | float:
    """A sampling setting within strata_compiler/sampling.py's bounds (top_k below 0 is off, as vLLM's -1)."""
    if not _number(value):
        raise SchemaError(name, f"{name}: expected a number, got {type(value).__name__}")
    value = int(value) if _integer(value) else float(value)
    if name == "top_k" and value == -1:
        return 0
    try:
        return sampling.check(name, value)
    except ValueError as e:
        raise SchemaError(name, str(e)) from None


@dataclass(frozen=True)
class Generation:
    """A request's generation fields, checked; None: not given (the plan's default, or the caller's)."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    repeat_last_n: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def sampling(self) -> dict:
        """The sampling fields, for runtime/sampler.py's plan_sampling."""
        return {k: getattr(self, k) for k in sampling.FIELDS}


SAMPLING = sampling.FIELDS
FIELDS = tuple(f.name for f in fields(Generation))


def check(name: str, value: Any) -> Any:
    """Field `name`'s value, checked and normalised (None stays None: not given)."""
    if name == "stop":
        return stop_strings(value)
    if value is None:
        return False if name == "ignore_eos" else None
    if name in SAMPLING:
        return sampling_field(name, value)
    if name == "max_tokens":
        return whole(name, value, 1, MAX_TOKENS)
    if name == "seed":
        return whole(name, value, 0, MAX_SEED)
    if name == "ignore_eos":
        return flag(name, value)
    raise SchemaError(name, f"{name}: not a generation field (known: {', '.join(FIELDS)})")


def generation(**given: Any) -> Generation:
    """The fields given, each checked (the first that does not fit: SchemaError)."""
    return Generation(**{name: check(name, value) for name, value in given.items()})


def prompt_ids(value: Any, vocab: int, limit: int | None = None) -> list[int]:
    """A prompt given as token ids: a non-empty sequence of whole numbers in [0, vocab), of at most
    `limit` ids (the context) where given: a longer one (a huge range, an endless generator) is
    refused after reading limit + 1 of them, never made into a list."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise SchemaError("prompt", f"prompt: expected text or a list of token ids, got {type(value).__name__}")
    if limit is None:
        ids = list(value)
    else:
        ids = list(itertools.islice(value, limit + 1))
        if len(ids) > limit:
            raise SchemaError("prompt", f"prompt: more than {limit} token ids, more than the context of {limit} "
                                        f"holds; shorten it")
    if not ids:
        raise SchemaError("prompt", "prompt: the prompt is empty")
    for t in ids:
        if not _integer(t):
            raise SchemaError("prompt", f"prompt: token id {_shown(t)} is not a whole number")
        if not 0 <= t < vocab:
            raise SchemaError("prompt", f"prompt: token id {_shown(t)} is outside the vocabulary [0, {vocab})")
    return [int(t) for t in ids]
