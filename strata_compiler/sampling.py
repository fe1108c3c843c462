"""Sampling settings: what a model recommends, Strata's defaults where it says nothing, and the one
resolution every entry point uses (strata-run --prompt and --chat, strata-server's endpoints, the
Python API), so that a request that names no setting samples alike everywhere.

A setting's value, first found: the caller's (a flag, a request field, a keyword argument); the
model's own recommendation, stored in the plan at compile time (meta["sampling"], from a Hugging
Face folder's generation_config.json or a GGUF's general.sampling.* keys: frontend/generation.py);
DEFAULTS (llama.cpp's). Greedy stays exact: temperature 0 is the plain argmax unless whoever set it
(the caller, or else the model) also names a repetition penalty.

meta["sampling"] = {"source": where the values came from, and any of FIELDS with its value}. A plan
is untrusted input: `from_meta` checks every key, type and bound. docs/sampling.md is the user's page.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .errors import UsageError


TINY_T = 1.0 / 3.4028234663852886e38    # 1 / float32's largest: below it 1 / T is not a finite f32


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8        # 0: greedy
    top_k: int = 40                 # 0: off
    top_p: float = 0.95             # 1: off
    min_p: float = 0.05             # 0: off
    repetition_penalty: float = 1.1     # 1: off
    repeat_last_n: int = 64         # the penalty's window of tokens seen last (-1: all; 0: off)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def argmax(self) -> bool:
        """Whether tokens are the (penalised) argmax: temperature 0, or one so small that 1 / T
        overflows f32 (its limit is the argmax) — the host sampler and the device's alike."""
        return self.temperature < TINY_T

    @property
    def window(self) -> int:
        """Tokens seen last that the repetition penalty reads (-1: all; 0: no penalty)."""
        return self.repeat_last_n if self.repetition_penalty != 1 and self.repeat_last_n != 0 else 0

    def describe(self) -> str:
        """One phrase for a human: `temperature 0.8, top-k 40, ...` or `greedy`."""
        parts = ["greedy"] if self.greedy else [f"temperature {self.temperature:g}"] + [
            f"{name} {value:g}" for name, value, off in (("top-k", self.top_k, 0), ("top-p", self.top_p, 1),
                                                         ("min-p", self.min_p, 0)) if value != off]
        if self.repetition_penalty != 1 and self.repeat_last_n != 0:
            window = "all tokens" if self.repeat_last_n < 0 else f"the last {self.repeat_last_n} tokens"
            parts.append(f"repeat penalty {self.repetition_penalty:g} over {window}")
        return ", ".join(parts)


DEFAULTS = Sampling()
FIELDS = tuple(asdict(DEFAULTS))
MAX_SOURCE = 64     # characters of meta["sampling"]["source"]

# field -> (type, low, high, low excluded, what the edge values mean)
BOUNDS = {
    "temperature": (float, 0.0, 100.0, False, "0 is greedy"),
    "top_k": (int, 0, 1 << 31, False, "0 is off"),
    "top_p": (float, 0.0, 1.0, True, "1 is off"),
    "min_p": (float, 0.0, 1.0, False, "0 is off"),
    "repetition_penalty": (float, 0.0, 100.0, True, "1 is off"),
    "repeat_last_n": (int, -1, 1 << 31, False, "-1 is every token seen, 0 is off"),
}


def check(name: str, value: object) -> int | float:
    """`value` as field `name`'s type, or ValueError saying what the field takes."""
    kind, lo, hi, lo_open, means = BOUNDS[name]
    # an int is compared as it is: one beyond a float's range (10**400 in a JSON file) has no float
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) \
        and (isinstance(value, int) or (math.isfinite(value) and (kind is float or value.is_integer()))) \
        and (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        span = f"{'above ' if lo_open else ''}{lo:g} to {hi:g}" if kind is float else f"a whole number {lo} to {hi}"
        big = isinstance(value, int) and abs(value) > 1 << 64
        shown = f"of {len(str(abs(value)))} digits" if big else str(value)[:24]
        raise ValueError(f"{name} {shown}: expected {span} ({means})")
    return kind(value)


def from_meta(value: object) -> dict:
    """The model's recommendation from a plan's meta["sampling"] (None: the plan has none): the
    fields it gives, checked; ValueError naming what is wrong."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError("meta.sampling is not an object")
    unknown = sorted(str(k)[:32] for k in value if k not in FIELDS and k != "source")
    if unknown:
        raise ValueError(f"meta.sampling has unknown key {unknown[0]!r}")
    src = value.get("source", "")
    if not isinstance(src, str) or len(src) > MAX_SOURCE:
        raise ValueError(f"meta.sampling.source is not a string of at most {MAX_SOURCE} characters")
    try:
        return {k: check(k, v) for k, v in value.items() if k != "source"}
    except ValueError as e:
        raise ValueError(f"meta.sampling.{e}") from None


def resolve(model: dict, **given: object) -> Sampling:
    """The settings in effect: the caller's `given` values (None: not given; top_k <= 0 is off)
    over the model's `model` (from_meta) over DEFAULTS. A given value out of range is one
    UsageError naming it."""
    mine = {}
    for name, v in given.items():
        if v is None:
            continue
        if name == "top_k" and isinstance(v, int) and not isinstance(v, bool) and v < 0:
            v = 0       # vLLM's and llama.cpp's -1: off
        try:
            mine[name] = check(name, v)
        except ValueError as e:
            raise UsageError(str(e)) from None
    values = {**asdict(DEFAULTS), **model, **mine}
    # greedy is the exact argmax unless whoever set the temperature to 0 also names a penalty
    if values["temperature"] == 0 and "repetition_penalty" not in mine and \
            ("temperature" in mine or "repetition_penalty" not in model):
        values["repetition_penalty"] = 1.0
    return Sampling(**values)


def source_of(meta: dict) -> str:
    """Where a plan's sampling defaults come from, for `stratac inspect` and the docs' wording."""
    s = meta.get("sampling")
    given = [k for k in FIELDS if isinstance(s, dict) and k in s]
    if not given:
        return "Strata's defaults (the model recommends none)"
    rest = "; the rest Strata's defaults" if len(given) < len(FIELDS) else ""
    return f"the model's ({s.get('source') or 'its files'}: {', '.join(given)}){rest}"
