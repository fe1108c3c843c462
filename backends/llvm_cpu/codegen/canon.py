"""The one order of arithmetic every q8 matrix kernel follows, so a token's result does not depend
on which kernel computed it (row dot, register tile, AMX tile) — nor, therefore, on how many other
tokens shared its step: greedy decoding is batch-invariant.

For one output (weight row n, token m) over groups g of 32:

    t_g  = the group's integer dot product (exact in i32; int4's -8 offset as -8 * block sum)
    d_g  = f32(weight scale_g) * activation scale_g            (one f32 rounding)
    acc[g mod 8] = fma(f32(t_g), d_g, acc[g mod 8])            (g ascending; 8 lanes start at +0)
    [asymmetric formats, then:  acc[g mod 8] = fma(f32(bsum_g), f32(min_g) * activation scale_g, ...)]
    out  = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7))

A lane no group reaches stays +0; adding 0 * 0 to it changes nothing (an accumulator that starts
at +0 never becomes -0), so a kernel may add zeros for absent groups or skip them. The integer
partial sums a kernel's instructions produce (pmaddwd's or vpdpbusd's lanes, an AMX tile's
totals) differ, but their totals are exact: `group_totals` folds any of them to t_g.
"""

from __future__ import annotations

from .common import lanes, vec

LANES = 8       # groups whose sums a batch holds, one per accumulator lane


def group_totals(parts: list[str], width: int, run: int, tag: str) -> tuple[str, str]:
    """(ir, %t) with %t = <8 x i32>, lane j the total of group j, from `parts`: equal vectors of
    `width` i32 lanes whose consecutive runs of `run` lanes each belong to one group, the groups in
    order across the parts (8 groups in all; absent ones as zeroinitializer parts)."""
    out, level = [], 0
    vs, w, k = list(parts), width, run
    while len(vs) > 1 or k > 1:
        nxt = []
        if len(vs) > 1:      # two vectors -> one of the same width, runs halved
            for i in range(0, len(vs), 2):
                a, b, t = vs[i], vs[i + 1], f"%{tag}.r{level}.{i // 2}"
                out.append(f"  {t}.e = shufflevector {vec(w, 'i32')} {a}, {vec(w, 'i32')} {b}, {lanes(w, range(0, 2 * w, 2))}")
                out.append(f"  {t}.o = shufflevector {vec(w, 'i32')} {a}, {vec(w, 'i32')} {b}, {lanes(w, range(1, 2 * w, 2))}")
                out.append(f"  {t} = add {vec(w, 'i32')} {t}.e, {t}.o")
                nxt.append(t)
        else:                # one vector -> half its width
            a, t, h = vs[0], f"%{tag}.r{level}.h", w // 2
            out.append(f"  {t}.e = shufflevector {vec(w, 'i32')} {a}, {vec(w, 'i32')} poison, {lanes(h, range(0, w, 2))}")
            out.append(f"  {t}.o = shufflevector {vec(w, 'i32')} {a}, {vec(w, 'i32')} poison, {lanes(h, range(1, w, 2))}")
            out.append(f"  {t} = add {vec(h, 'i32')} {t}.e, {t}.o")
            nxt.append(t)
            w = h
        vs, k, level = nxt, k // 2, level + 1
    if w != LANES:
        raise ValueError(f"group_totals: {len(parts)} parts of {width} lanes (runs of {run}) are not 8 groups")
    return "\n".join(out), vs[0]


def accumulate(acc: str, t: str, d: str, out: str, n: int = LANES) -> str:
    """IR for out = fma(sitofp(t), d, acc) over <n x float> (t: <n x i32> group totals)."""
    V = vec(n, "float")
    return (f"  {out}.f = sitofp {vec(n, 'i32')} {t} to {V}\n"
            f"  {out} = call {V} @llvm.fma.v{n}f32({V} {out}.f, {V} {d}, {V} {acc})")


def fold(acc: str, out: str) -> str:
    """IR for the float `out`: the fixed sum of an <8 x float> accumulator's lanes."""
    return f"""  {out}.h0 = shufflevector <8 x float> {acc}, <8 x float> poison, <4 x i32> <i32 0, i32 1, i32 2, i32 3>
  {out}.h1 = shufflevector <8 x float> {acc}, <8 x float> poison, <4 x i32> <i32 4, i32 5, i32 6, i32 7>
  {out}.h = fadd <4 x float> {out}.h0, {out}.h1
  {out}.q0 = shufflevector <4 x float> {out}.h, <4 x float> poison, <2 x i32> <i32 0, i32 1>
  {out}.q1 = shufflevector <4 x float> {out}.h, <4 x float> poison, <2 x i32> <i32 2, i32 3>
  {out}.q = fadd <2 x float> {out}.q0, {out}.q1
  {out}.a = extractelement <2 x float> {out}.q, i64 0
  {out}.b = extractelement <2 x float> {out}.q, i64 1
  {out} = fadd float {out}.a, {out}.b"""


def fold_vectors(accs: list[str], out: str, V: str) -> str:
    """IR for `out` = the same fixed sum as `fold`, lane by lane over 8 vectors of type V (the
    accumulators of lanes 0..7 of many outputs side by side)."""
    h = [f"{out}.h{i}" for i in range(4)]
    q = [f"{out}.q{i}" for i in range(2)]
    return "\n".join([f"  {h[i]} = fadd {V} {accs[i]}, {accs[i + 4]}" for i in range(4)]
                     + [f"  {q[i]} = fadd {V} {h[i]}, {h[i + 2]}" for i in range(2)]
                     + [f"  {out} = fadd {V} {q[0]}, {q[1]}"])


# -- exp and silu: one polynomial for scalars and vectors ------------------------------------------

_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _c(v: float, n: int) -> str:
    """A float constant (as a double's hex: exact for f32 values), splatted over n lanes if n > 1."""
    import struct

    f32 = struct.unpack("<f", struct.pack("<f", v))[0]
    h = "0x%016X" % struct.unpack("<Q", struct.pack("<d", f32))[0]
    return f"float {h}" if n == 1 else "<" + ", ".join([f"float {h}"] * n) + ">"


def _i(v: int, n: int) -> str:
    return f"i32 {v}" if n == 1 else "<" + ", ".join([f"i32 {v}"] * n) + ">"


def exp(x: str, out: str, n: int) -> str:
    """IR for out = exp(x) over float (n = 1) or <n x float> (Cephes' expf: x = k ln2 + r, a
    degree-6 polynomial in r, 2^k by the exponent bits; within 2 ulp over the clamped range
    [-87, 88]). Scalar and vector forms are the same operations, lane by lane, so a silu gives
    the same bits in every kernel."""
    T = "float" if n == 1 else vec(n, "float")
    I = "i32" if n == 1 else vec(n, "i32")
    sfx = "f32" if n == 1 else f"v{n}f32"

    def c(v: float) -> str:
        return _c(v, n).split(" ", 1)[1] if n == 1 else _c(v, n)
    lines = [f"  {out}.c0 = call {T} @llvm.maxnum.{sfx}({T} {x}, {T} {c(-87.0)})",
             f"  {out}.c = call {T} @llvm.minnum.{sfx}({T} {out}.c0, {T} {c(88.0)})",
             f"  {out}.t = fmul {T} {out}.c, {c(1.4426950408889634)}",
             f"  {out}.n = call {T} @llvm.rint.{sfx}({T} {out}.t)",
             f"  {out}.r0 = call {T} @llvm.fma.{sfx}({T} {out}.n, {T} {c(-0.693359375)}, {T} {out}.c)",
             f"  {out}.r = call {T} @llvm.fma.{sfx}({T} {out}.n, {T} {c(2.12194440e-4)}, {T} {out}.r0)",
             f"  {out}.p0 = fadd {T} {'0.0' if n == 1 else 'zeroinitializer'}, {c(_EXP_POLY[0])}"]
    for i, k in enumerate(_EXP_POLY[1:], 1):
        lines.append(f"  {out}.p{i} = call {T} @llvm.fma.{sfx}({T} {out}.p{i - 1}, {T} {out}.r, {T} {c(k)})")
    k = len(_EXP_POLY) - 1
    one = _i(127, n).split(" ", 1)[1] if n == 1 else _i(127, n)
    sh = _i(23, n).split(" ", 1)[1] if n == 1 else _i(23, n)
    lines += [f"  {out}.rr = fmul {T} {out}.r, {out}.r",
              f"  {out}.e0 = call {T} @llvm.fma.{sfx}({T} {out}.p{k}, {T} {out}.rr, {T} {out}.r)",
              f"  {out}.e = fadd {T} {out}.e0, {c(1.0)}",
              f"  {out}.ni = fptosi {T} {out}.n to {I}",
              f"  {out}.nb = add {I} {out}.ni, {one}",
              f"  {out}.sb = shl {I} {out}.nb, {sh}",
              f"  {out}.s = bitcast {I} {out}.sb to {T}",
              f"  {out} = fmul {T} {out}.e, {out}.s"]
    return "\n".join(lines)


def silu_mul(g: str, u: str, out: str, n: int = 1) -> str:
    """IR for out = silu(g) * u = g / (1 + exp(-g)) * u over float (n = 1) or <n x float>."""
    T = "float" if n == 1 else vec(n, "float")
    one = _c(1.0, n).split(" ", 1)[1] if n == 1 else _c(1.0, n)
    return f"""  {out}.n = fneg {T} {g}
{exp(out + '.n', out + '.e', n)}
  {out}.d = fadd {T} {out}.e, {one}
  {out}.s = fdiv {T} {g}, {out}.d
  {out} = fmul {T} {out}.s, {u}"""
