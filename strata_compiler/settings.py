"""Every setting of Strata, declared once: name, type, default, allowed values, one line of help and
where it applies.

A value comes from, first found: an override made in this process (a test: `override`), the
environment variable STRATA_<NAME>, the declared default. A setting with a `flag` is also the
command-line option `option` makes for every command that has it: the flag given comes first. It is
parsed here and nowhere else; a bad value is one UsageError naming the variable. Product code
reads the environment only through this module (tests/test_settings.py enforces it), and
docs/settings.md is generated from this table (`python -m strata_compiler.settings`).

`user` settings are the few a user may need (README lists them); the rest are tuning constants and
debugging aids, overridable for experiments and listed in docs/settings.md.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass, fields, replace
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
    flag: str | None = None         # the command-line option that sets it, e.g. "--max-batch" (see `option`)
    maximum: float | None = None

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
        if self.maximum is not None:
            ok = ok and all(v <= self.maximum for v in vals)
        if self.kind in ("pow2s", "tune"):
            ok = ok and all(v > 0 and v & (v - 1) == 0 for v in (vals[:-1] if self.kind == "tune" else vals))
            ok = ok and vals[-1] > 0
        if not ok:
            raise UsageError(bad)
        return vals[0] if self.kind in ("int", "float") else vals

    def expects(self) -> str:
        n = self.length
        lo, hi = self.minimum, self.maximum
        bound = (f" from {lo:g} to {hi:g}" if lo is not None and hi is not None else f" >= {lo:g}" if lo is not None
                 else f" <= {hi:g}" if hi is not None else "")
        return {
            "bool": "give 1 or 0",
            "choice": "give one of " + ", ".join(self.choices),
            "int": "give a whole number" + bound,
            "float": "give a number" + bound,
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


# One line each. `where`: cli | compile | llvm | xla | runtime | tests, or the commands (and the
# Python API) whose option it is. A setting with a `flag` is that option of every command that has it.
SETTINGS: tuple[Setting, ...] = (
    # -- for users (README) ------------------------------------------------------------------
    _s("num_threads", "int", None, "llvm", "CPU threads of the llvm kernels (default: every CPU this process may use)",
       minimum=1, user=True),
    _s("cache_dir", "path", None, "llvm, xla",
       "compiled-kernel and XLA caches (default: $XDG_CACHE_HOME/strata, else ~/.cache/strata)", user=True),
    _s("debug", "bool", False, "every command", "show Python tracebacks for errors", user=True, flag="--debug"),
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
    # -- command-line options (`flag`), declared once for every command that has them ---------------
    _s("backend", "choice", "auto", "strata-run, strata-server, stratac compile, stratac eval, API",
       "where kernels run: auto runs a placed plan (--target, --place) as placed and any other on the best "
       "available backend (xla on a GPU, else llvm); a name runs every op there",
       choices=("auto", "reference", "llvm", "xla"), flag="--backend"),
    _s("device", "choice", "auto", "strata-run, strata-server, API",
       "where xla partitions run: auto = a CUDA GPU when JAX sees one, else JAX's CPU platform",
       choices=("auto", "gpu", "cpu"), flag="--device"),
    _s("ctx", "int", None, "strata-server, API",
       "context length per sequence (prompt + generated tokens); the KV cache holds --max-batch of them. Default: "
       "the model's, as far as the KV cache of --max-batch of them fits in half the memory available (the same "
       "as strata-run --chat and the Python API)", minimum=2, flag="--ctx"),
    _s("max_batch", "int", 8, "strata-server, API",
       "sequences decoded together (each its own KV row of --ctx positions); more requests wait",
       minimum=1, maximum=256, flag="--max-batch"),
    _s("prefill_chunk", "int", 256, "strata-server, API; strata-run (default auto there)",
       "prompt tokens prefilled between two decode steps: running streams wait at most one chunk",
       minimum=1, maximum=8192, flag="--prefill-chunk"),
    _s("queue_size", "int", 64, "strata-server, API",
       "requests that may wait; beyond it the server answers 429",
       minimum=1, flag="--queue-size"),
    _s("eval_ctx", "int", 512, "stratac eval", "tokens per chunk; the second half of each chunk is scored",
       flag="--ctx"),
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
    return _lookup(declared(name))[1]


def _lookup(s: Setting) -> tuple[bool, Any]:
    """(given, value): an override or STRATA_<NAME> (parsed by `s`, a command's variant of the
    declaration where `option` made one) is given; else the default."""
    if s.name in _OVERRIDES:
        return True, _OVERRIDES[s.name]
    raw = os.environ.get(s.env)
    if raw is None or raw.strip() == "":
        return False, s.default
    return True, s.parse(raw)


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


_FIELDS = {f.name for f in fields(Setting)} - {"name", "kind", "flag"}


def option(name: str, *decls: str, **overrides: Any) -> Any:
    """The click option of setting `name`: its flag (and any `decls`), type, default and help from
    the declaration, the help naming STRATA_<NAME>. `overrides`: a declared field changed for one
    command (default, help, minimum, maximum), else a click argument (metavar, show_default).

    Its value: the flag given, else the command's --config file (click's default map), else an
    override or STRATA_<NAME>, else the default; a bad variable is one UsageError naming it."""
    import click

    s = declared(name)
    if s.flag is None or s.kind not in ("bool", "choice", "int", "float", "path", "str"):
        raise KeyError(f"setting {name!r} has no flag (or a kind no flag can take)")
    s = replace(s, **{k: overrides.pop(k) for k in list(overrides) if k in _FIELDS})
    kw: dict[str, Any] = dict(cls=_option_class(), setting=s, default=s.default, envvar=s.env, show_envvar=True,
                              show_default=s.default not in (None, "", False),
                              help=s.help[:1].upper() + s.help[1:] + ("" if s.help.endswith(".") else "."))
    flag = s.flag
    if s.kind == "bool":
        kw["is_flag"] = True
        if s.default:
            flag = f"{s.flag}/--no-{s.flag[2:]}"
    elif s.kind == "choice":
        kw["type"] = click.Choice(s.choices)
    elif s.kind in ("int", "float"):
        rng = click.IntRange if s.kind == "int" else click.FloatRange
        kw["type"] = rng(s.minimum, s.maximum) if (s.minimum, s.maximum) != (None, None) else \
            (click.INT if s.kind == "int" else click.FLOAT)
    elif s.kind == "path":
        kw["type"] = click.Path(path_type=Path)
    kw.update(overrides)
    return click.option(flag, *decls, **kw)


@functools.cache
def _option_class() -> type:
    """click.Option reading the registry, not the environment, for a value the command line did not give."""
    import click
    from click.core import ParameterSource

    class SettingOption(click.Option):
        def __init__(self, *args: Any, setting: Setting, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self.setting = setting

        def resolve_envvar_value(self, ctx: click.Context) -> None:
            return None     # `envvar` is set for --help's "[env var: ...]" only; consume_value reads it

        def value_from_envvar(self, ctx: click.Context) -> None:
            return None

        def consume_value(self, ctx: click.Context, opts: Any) -> tuple[Any, Any]:
            value, source = super().consume_value(ctx, opts)
            if source == ParameterSource.DEFAULT:
                given, setting_value = _lookup(self.setting)
                if given:
                    return setting_value, ParameterSource.ENVIRONMENT
            return value, source

    return SettingOption


def is_setting_option(param: Any) -> bool:
    """Whether a click parameter was made by `option` (tests/test_cli_settings.py)."""
    return isinstance(param, _option_class())


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
        "variable shown. One with a flag is that option of every command that has it (and the Python API's",
        "keyword of the same name): the flag given wins (or strata-server's --config file), then the",
        "variable, then the default. README lists the ones a user may need; the others are tuning",
        "constants and debugging aids for experiments.",
        "",
        "| variable | flag | type | default | applies to | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for s in sorted(SETTINGS, key=lambda s: (not s.user, s.name)):
        kind = "one of " + "\\|".join(s.choices) if s.kind == "choice" else s.kind
        flag = f"`{s.flag}`" if s.flag else ""
        lines.append(f"| `{s.env}` | {flag} | {kind} | `{s.shown_default()}` | {s.where} | {s.help.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":      # pragma: no cover - exercised through tests/test_settings.py
    sys.stdout.write(markdown())
