"""Every setting of Strata, declared once: name, type, default, allowed values, one line of help and
where it applies.

A value comes from, first found: an override made in this process (a CLI flag, a test: `override`),
the environment variable STRATA_<NAME>, the declared default. It is parsed here and nowhere else; a
bad value is one UsageError naming the variable. Product code reads the environment only through
this module (tests/test_settings.py enforces it), and docs/settings.md is generated from this table
(`python -m strata_compiler.settings`).

`user` settings are the few a user may need (README lists them); the rest are tuning constants and
debugging aids, overridable for experiments and listed in docs/settings.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .errors import UsageError

PREFIX = "STRATA_"
_OFF = ("0", "off", "false", "no")
_ON = ("1", "on", "true", "yes")


@dataclass(frozen=True)
class Setting:
    """One declared setting. kind: bool | int | float | choice | pow2s | tune | floats | path | str.
    `pow2s`, `tune` and `floats` are comma-separated tuples of `length` values (`tune`: a GPU
    kernel's powers of two, then its pipeline stages, any whole number; `floats` with length 2 also
    takes one value, used for both)."""

    name: str
    kind: str
    default: Any
    help: str
    where: str
    choices: tuple[str, ...] = ()
    length: int = 1
    minimum: float | None = None
    user: bool = False

    @property
    def env(self) -> str:
        return PREFIX + self.name.upper()

    def parse(self, raw: str) -> Any:
        """`raw` (an environment value or a flag's text) as this setting's value, else UsageError."""
        text = raw.strip()
        low = text.lower()
        bad = f"{self.env}={raw!r}: {self.expects()} (default {self.shown_default()})"
        if self.kind == "bool":
            if low in _ON or low in _OFF:
                return low in _ON
            raise UsageError(bad)
        if self.kind == "choice":
            if low in self.choices:
                return low
            raise UsageError(bad)
        if self.kind in ("path", "str"):
            if "\0" in text:
                raise UsageError(bad)
            return Path(text).expanduser() if self.kind == "path" else text
        try:
            if self.kind == "int":
                vals = (int(text),)
            elif self.kind == "float":
                vals = (float(text),)
            else:
                vals = tuple((int if self.kind in ("pow2s", "tune") else float)(v) for v in text.split(","))
        except ValueError:
            raise UsageError(bad) from None
        if self.kind == "floats" and self.length == 2 and len(vals) == 1:
            vals = vals * 2
        ok = len(vals) == (1 if self.kind in ("int", "float") else self.length)
        ok = ok and all(v == v and abs(v) < 1e12 for v in vals)          # no nan, no inf
        if self.minimum is not None:
            ok = ok and all(v >= self.minimum for v in vals)
        if self.kind in ("pow2s", "tune"):
            ok = ok and all(v > 0 and v & (v - 1) == 0 for v in (vals[:-1] if self.kind == "tune" else vals))
            ok = ok and vals[-1] > 0
        if not ok:
            raise UsageError(bad)
        return vals[0] if self.kind in ("int", "float") else vals

    def expects(self) -> str:
        n = self.length
        return {
            "bool": "give 1 or 0",
            "choice": "give one of " + ", ".join(self.choices),
            "int": "give a whole number" + (f" >= {self.minimum:g}" if self.minimum is not None else ""),
            "float": "give a number" + (f" >= {self.minimum:g}" if self.minimum is not None else ""),
            "pow2s": "give a power of two" if n == 1 else f"give {n} comma-separated powers of two",
            "tune": f"give {n} comma-separated whole numbers, powers of two but the last (pipeline stages)",
            "floats": f"give {n} comma-separated numbers" + (f" >= {self.minimum:g}" if self.minimum is not None else ""),
            "path": "give a path",
            "str": "give a string",
        }[self.kind]

    def shown_default(self) -> str:
        d = self.default
        if d is None or d == "":
            return "auto"
        if isinstance(d, bool):
            return "1" if d else "0"
        if isinstance(d, tuple):
            return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in d)
        return f"{d:g}" if isinstance(d, float) else str(d)


def _s(name: str, kind: str, default: Any, where: str, help: str, **kw: Any) -> Setting:
    return Setting(name, kind, default, help, where, **kw)


# One line each. `where`: cli | compile | llvm | xla | runtime | tests.
SETTINGS: tuple[Setting, ...] = (
    # -- for users (README) ------------------------------------------------------------------
    _s("num_threads", "int", None, "llvm", "CPU threads of the llvm kernels (default: every CPU this process may use)",
       minimum=1, user=True),
    _s("cache_dir", "path", None, "llvm, xla",
       "compiled-kernel and XLA caches (default: $XDG_CACHE_HOME/strata, else ~/.cache/strata)", user=True),
    _s("debug", "bool", False, "cli", "show Python tracebacks for errors (as --debug does)", user=True),
    _s("cpu_features", "choice", "", "llvm", "avx2 forces the AVX2 code path on an AVX-512 CPU (default: what this CPU has)",
       choices=("avx2", "native"), user=True),
    _s("cpu_act", "choice", "q16", "llvm",
       "activations against int8/int4/int4a weights: q16 (blocks of 32 as two planes of int8 codes, about 15 bits, "
       "on integer dot products), q8 (one plane, as llama.cpp: faster prefill, KL ~3e-3 on a real model), "
       "or f32 (exact, slowest)",
       choices=("q16", "q8", "f32"), user=True),
    _s("xla_compute", "choice", "bf16", "xla", "compute type of non-f32 weights on a GPU: bf16, or f32 (exact, slower)",
       choices=("bf16", "f32"), user=True),
    _s("compile_threads", "int", None, "compile", "threads that quantize weights (default: every usable CPU)",
       minimum=1, user=True),
    # -- tuning constants and debugging aids (docs/settings.md) -------------------------------
    _s("gpu_preallocate", "bool", False, "xla",
       "let JAX reserve 75 % of the GPU's memory when it starts (its default; on a 141 GB GPU that costs ~1.4 s of "
       "start-up), instead of growing its pool as arrays need (XLA_PYTHON_CLIENT_PREALLOCATE, if set, wins)"),
    _s("gpu_mem_limit", "str", "", "runtime",
       "bytes of GPU memory the expert caches may assume free, e.g. 2GiB (default: what the device reports)"),
    _s("pool_split", "int", None, "llvm",
       "chunks per thread of a CPU kernel's parallel loop (default: 1 in all-CPU plans, 4 beside a GPU)", minimum=1),
    _s("hand_off_spin_us", "floats", (30.0, 30.0), "runtime",
       "idle CPU workers' spin and yield microseconds in plans that hand off to the GPU (US or SPIN,YIELD)",
       length=2, minimum=0),
    _s("fused_spin_us", "floats", (100.0, 1000.0), "runtime",
       "idle CPU workers' spin and yield microseconds between a fused step's host calls (US or SPIN,YIELD)",
       length=2, minimum=0),
    _s("stream_prefill_tokens", "int", None, "runtime",
       "prefill steps of at least this many tokens run a mixed plan's CPU-placed experts on the GPU, "
       "their weights copied there partition by partition (0: never; default: the break-even the plan's "
       "placement predicted, `stratac inspect` shows it, else 128)", minimum=0),
    _s("swap_margin", "float", 1.0, "runtime",
       "expert cache: uses by which a missed expert must beat the weakest resident before it is swapped in",
       minimum=0),
    _s("cache_swaps", "int", 1, "runtime", "expert cache: copies per cached layer per step after a miss (0 keeps the planned slots)",
       minimum=0),
    _s("xla_executables", "bool", True, "xla",
       "keep each compiled JAX program of a plan in the cache directory, so a later process runs it without "
       "tracing or compiling it (backends/xla/aot.py)"),
    _s("pallas", "choice", "auto", "xla",
       "decode kernels: auto (Pallas on a GPU), off (XLA's reductions only), interpret (Pallas interpret mode anywhere: tests)",
       choices=("auto", "off", "interpret")),
    _s("pallas_attn", "choice", "auto", "xla",
       "decode attention as one Pallas kernel: auto (caches of at most 512 rows), on, off",
       choices=("auto", "on", "off")),
    _s("pallas_max_rows", "pow2s", (16,), "xla", "tokens per step up to which the MoE runs on the Pallas kernels"),
    _s("pallas_linear_rows", "pow2s", (4,), "xla", "tokens per step up to which dense int4 projections run on the Pallas kernel"),
    _s("pallas_tune", "pow2s", (32, 4, 4, 4), "xla", "MoE kernels: rows per program and warps of gate_up, down (bn1,bn2,w1,w2)",
       length=4),
    _s("pallas_linear_tune", "pow2s", (32, 8), "xla", "dense int4 kernel: rows per program, warps", length=2),
    _s("pallas_gemm_tune", "tune", (64, 128, 4, 4, 3), "xla",
       "many-row kernels: most rows and columns per program, groups per step, warps, pipeline stages", length=5),
    _s("pallas_gemm_bf16_tune", "tune", (128, 128, 2, 8, 4), "xla",
       "many-row kernels over experts dequantized first: as pallas_gemm_tune (groups of 32 per step)", length=5),
    _s("pallas_dense_tune", "pow2s", (2, 4), "xla", "router kernel: rows per program, warps", length=2),
    _s("pallas_flash_tune", "tune", (128, 64, 8, 3), "xla",
       "prefill attention kernel: query rows per block, key rows per step, warps, pipeline stages", length=4),
    _s("pallas_attn_tune", "pow2s", (64, 4, 256), "xla", "attention kernel: rows per block, warps, rows per split",
       length=3),
    _s("template_timeout", "float", 5.0, "compile, runtime",
       "seconds a chat template may take to render (the check at compile time, each chat prompt at run time) "
       "before its worker process is killed and the template refused (strata_compiler/template_sandbox.py)",
       minimum=0.01),
    _s("template_memory", "int", 1024, "compile, runtime",
       "MiB of address space of the process that renders chat templates (RLIMIT_AS; Python and jinja2 take ~25 of them); "
       "a template that needs more is refused", minimum=64),
    _s("raw_copy", "choice", "auto", "runtime",
       "hand-offs between xla and CPU partitions: auto (raw cudaMemcpy on a GPU), host (raw copies on JAX's CPU platform: tests)",
       choices=("auto", "host")),
)

_BY_NAME = {s.name: s for s in SETTINGS}
_BY_ENV = {s.env: s for s in SETTINGS}
_OVERRIDES: dict[str, Any] = {}


def declared(name: str) -> Setting:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"setting {name!r} is not declared in strata_compiler/settings.py") from None


def names() -> list[str]:
    """Every declared setting's name."""
    return list(_BY_NAME)


def get(name: str) -> Any:
    """The value of setting `name`: an override, else STRATA_<NAME> parsed, else the default."""
    s = declared(name)
    if name in _OVERRIDES:
        return _OVERRIDES[name]
    raw = os.environ.get(s.env)
    if raw is None or raw.strip() == "":
        return s.default
    return s.parse(raw)


def set_value(name: str, value: Any) -> None:
    """Override `name` for this process (a CLI flag); a string is parsed as the variable would be."""
    s = declared(name)
    _OVERRIDES[name] = s.parse(value) if isinstance(value, str) else value


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Settings overridden inside a with-block (tests, A/B runs in one process)."""
    old = {k: _OVERRIDES[k] for k in values if k in _OVERRIDES}
    try:
        for k, v in values.items():
            set_value(k, v)
        yield
    finally:
        for k in values:
            _OVERRIDES.pop(k, None)
        _OVERRIDES.update(old)


def cache_root() -> Path:
    """Where compiled kernels and XLA executables are cached."""
    d = get("cache_dir")
    if d is not None:
        return Path(d)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "strata"


def environ(key: str, default: str | None = None) -> str | None:
    """A process environment variable that is not Strata's (e.g. XLA_FLAGS, TMPDIR)."""
    if key.startswith(PREFIX):
        raise KeyError(f"{key}: read Strata's settings with settings.get")
    return os.environ.get(key, default)


def jax_client_env() -> None:
    """Set what JAX's GPU client reads from the environment when it starts, from these settings:
    no 75 % reservation of the device's memory unless `gpu_preallocate` (a value the user put in
    XLA_PYTHON_CLIENT_PREALLOCATE is left alone)."""
    if "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ and not get("gpu_preallocate"):
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"


def markdown() -> str:
    """The reference table of docs/settings.md."""
    lines = [
        "# Settings",
        "",
        "Generated from `strata_compiler/settings.py` by `python -m strata_compiler.settings > docs/settings.md`;",
        "a test fails when this file and the registry differ. Each setting is read from the environment",
        "variable shown, unless a command-line flag sets it. README lists the ones a user may need; the",
        "others are tuning constants and debugging aids for experiments.",
        "",
        "| variable | type | default | applies to | what it does |",
        "|---|---|---|---|---|",
    ]
    for s in sorted(SETTINGS, key=lambda s: (not s.user, s.name)):
        kind = "one of " + "\\|".join(s.choices) if s.kind == "choice" else s.kind
        lines.append(f"| `{s.env}` | {kind} | `{s.shown_default()}` | {s.where} | {s.help.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":      # pragma: no cover - exercised through tests/test_settings.py
    sys.stdout.write(markdown())
