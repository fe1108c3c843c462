"""Shared pieces of the kernel generators: the calling convention and IR text helpers.

Every kernel has the C signature `void name(const int64_t *args, int64_t begin, int64_t end)`:
`args` holds the kernel's operands (pointers and integers, in the order of `KernelSource.params`),
and [begin, end) is the slice of its parallel dimension this call computes, so the thread pool
can split any kernel. Generated IR uses opaque pointers (`ptr`), as LLVM >= 17 requires.

Generators bake shapes and attributes into the IR text, so each checks what it is given first
(`dims`, `one_of`, `group_ok`): only integers in range and known words ever reach the IR, with a
BackendError otherwise — explicit checks, not asserts, so they hold under python -O too.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata_compiler.errors import BackendError
from strata_compiler.verify import MAX_DIM, MAX_GROUP, group_size_problem

from ..target import Target


@dataclass(frozen=True)
class KernelSource:
    name: str                # the exported function
    ir: str                  # a complete LLVM module
    params: tuple[str, ...]  # names of the args[] slots, in order
    parallel: str            # what [begin, end) ranges over (e.g. "rows", "heads")


def _refuse(kernel: str, what: str) -> BackendError:
    return BackendError(f"llvm kernel {kernel}: {what}; the plan is corrupt or was edited — recompile it")


def dims(kernel: str, lo: int = 1, hi: int = MAX_DIM, **values: int) -> None:
    """Each of `values` is an int (not a bool) in [lo, hi]."""
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise _refuse(kernel, f"{name}={str(v)[:40]!r} is not an integer in {lo}..{hi}")


def one_of(kernel: str, name: str, v: object, allowed: tuple) -> None:
    if not isinstance(v, (str, bool)) or v not in allowed:
        raise _refuse(kernel, f"{name}={str(v)[:40]!r} is not one of {', '.join(map(str, allowed))}")


def group_ok(kernel: str, fmt: str, group_size: int) -> None:
    """`fmt` is a known weight format and `group_size` one it can be stored with (formats
    without groups ignore it: any small integer)."""
    from strata_compiler.formats import FORMATS

    if fmt in FORMATS and not FORMATS[fmt].grouped:
        dims(kernel, lo=0, hi=MAX_GROUP, group_size=group_size)
        return
    why = group_size_problem(fmt, group_size)
    if why:
        raise _refuse(kernel, why)


def require(kernel: str, cond: bool, what: str) -> None:
    """A relation between already checked values (e.g. heads divisible by kv heads)."""
    if not cond:
        raise _refuse(kernel, what)


def fn_attrs(target: Target) -> str:
    """Function attributes asking for full-width vectors on AVX-512 hosts."""
    width = target.vector_bits
    return (f'"target-cpu"="{target.cpu}" "target-features"="{target.features}" '
            f'"prefer-vector-width"="{width}" "min-legal-vector-width"="{width}" "no-trapping-math"="true"')


def load_args(params: tuple[str, ...], pointers: set[str], floats: frozenset[str] = frozenset()) -> str:
    """IR that loads each args[] slot into %<name>: a ptr, a float (f32 bits in the slot's low
    32 bits, see `float_slot`), or an i64."""
    out = []
    for i, p in enumerate(params):
        out.append(f"  %{p}.slot = getelementptr inbounds i64, ptr %args, i64 {i}")
        out.append(f"  %{p}.i = load i64, ptr %{p}.slot, align 8")
        if p in pointers:
            out.append(f"  %{p} = inttoptr i64 %{p}.i to ptr")
        elif p in floats:
            out.append(f"  %{p}.t = trunc i64 %{p}.i to i32")
            out.append(f"  %{p} = bitcast i32 %{p}.t to float")
        else:
            out.append(f"  %{p} = add i64 %{p}.i, 0")
    return "\n".join(out)


def float_slot(v: float) -> int:
    """An f32 argument as the i64 args[] slot value `load_args` decodes."""
    import struct

    return struct.unpack("<I", struct.pack("<f", v))[0]


def vec(n: int, t: str) -> str:
    return f"<{n} x {t}>"


def splat(n: int, t: str, v: str) -> str:
    return "<" + ", ".join(f"{t} {v}" for _ in range(n)) + ">"


def lanes(n: int, values) -> str:
    """A constant shufflevector mask: `<n x i32> <i32 a, ...>`."""
    vals = list(values)
    require("lanes", len(vals) == n, f"a mask of {len(vals)} lanes for a vector of {n}")
    return f"<{n} x i32> <" + ", ".join(f"i32 {v}" for v in vals) + ">"
