"""Row-times-activation dot products, one generator per weight format and activation kind.

`dot_function` returns an internal, always-inlined LLVM function

    float @dot(ptr w, ptr s, ptr x, ptr xd, ptr xs)

computing one output element: weight row `w` (its scales `s` for grouped formats) against one
activation row. Activations are either f32 (`x`, exact: every backend agrees with the reference
to rounding) or q8 (`x` = int8 blocks of 32 with f32 scales `xd` and int32 block sums `xs`, as
llama.cpp's Q8_0: the fast path for int8/int4 weights, whose integer dot products run on
pmaddubsw/pmaddwd (AVX2) or vpdpbusd (AVX-512 VNNI)).

Legend: K = row length, G = group size, NG = groups per row, Kp = NG * G (rows are padded).
Formats and layouts are defined in strata_compiler/formats.py.
"""

from __future__ import annotations

from ..target import Target
from .common import dims, fn_attrs, group_ok, lanes, require, splat, vec

Q8_BLOCK = 32


def _reduce(n: int, acc: str, out: str) -> str:
    return f"  {out} = call reassoc float @llvm.vector.reduce.fadd.v{n}f32(float 0.0, {vec(n, 'float')} {acc})"


def _scalar_loop(K: int, load_w: str) -> str:
    """Scalar f32 dot over K with fast-math reductions, left to the loop vectorizer."""
    return f"""
entry:
  br label %loop
loop:
  %k = phi i64 [0, %entry], [%k1, %loop]
  %acc = phi float [0.0, %entry], [%acc1, %loop]
{load_w}
  %xp = getelementptr inbounds float, ptr %x, i64 %k
  %xv = load float, ptr %xp, align 4
  %p = fmul reassoc contract float %wv, %xv
  %acc1 = fadd reassoc contract float %acc, %p
  %k1 = add nuw nsw i64 %k, 1
  %done = icmp eq i64 %k1, {K}
  br i1 %done, label %exit, label %loop
exit:
  ret float %acc1
}}"""


def _f32_dot(K: int) -> str:
    return _scalar_loop(K, """  %wp = getelementptr inbounds float, ptr %w, i64 %k
  %wv = load float, ptr %wp, align 4""")


def _bf16_dot(K: int) -> str:
    return _scalar_loop(K, """  %wp = getelementptr inbounds i16, ptr %w, i64 %k
  %wh = load i16, ptr %wp, align 2
  %wz = zext i16 %wh to i32
  %ws = shl i32 %wz, 16
  %wv = bitcast i32 %ws to float""")


def _grouped_f32act_dot(fmt: str, NG: int, G: int) -> str:
    """int8/int4 weights against f32 activations: dequantize a group, dot, scale, accumulate."""
    H = G // 2
    if fmt == "int8":
        body = f"""  %qp = getelementptr inbounds i8, ptr %w, i64 %g{G}
  %q = load {vec(G, 'i8')}, ptr %qp, align 1
  %qf = sitofp {vec(G, 'i8')} %q to {vec(G, 'float')}
  %xp = getelementptr inbounds float, ptr %x, i64 %g{G}
  %xv = load {vec(G, 'float')}, ptr %xp, align 4
  %t = fmul {vec(G, 'float')} %qf, %xv"""
        n = G
    else:
        body = f"""  %qp = getelementptr inbounds i8, ptr %w, i64 %g{H}
  %q = load {vec(H, 'i8')}, ptr %qp, align 1
  %lo = and {vec(H, 'i8')} %q, {splat(H, 'i8', '15')}
  %hi = lshr {vec(H, 'i8')} %q, {splat(H, 'i8', '4')}
  %lof0 = uitofp {vec(H, 'i8')} %lo to {vec(H, 'float')}
  %hif0 = uitofp {vec(H, 'i8')} %hi to {vec(H, 'float')}
  %lof = fsub {vec(H, 'float')} %lof0, {splat(H, 'float', '8.0')}
  %hif = fsub {vec(H, 'float')} %hif0, {splat(H, 'float', '8.0')}
  %xp = getelementptr inbounds float, ptr %x, i64 %g{G}
  %xl = load {vec(H, 'float')}, ptr %xp, align 4
  %xp2 = getelementptr inbounds float, ptr %xp, i64 {H}
  %xh = load {vec(H, 'float')}, ptr %xp2, align 4
  %t0 = fmul {vec(H, 'float')} %lof, %xl
  %t = call {vec(H, 'float')} @llvm.fma.v{H}f32({vec(H, 'float')} %hif, {vec(H, 'float')} %xh, {vec(H, 'float')} %t0)"""
        n = H
    return _group_loop(n, NG, f"""  %g{G} = mul nuw nsw i64 %g, {G}
  %g{H} = mul nuw nsw i64 %g, {H}
{body}
  %sp = getelementptr inbounds half, ptr %s, i64 %g
  %sh = load half, ptr %sp, align 2
  %d = fpext half %sh to float
  %d0 = insertelement {vec(n, 'float')} poison, float %d, i64 0
  %dv = shufflevector {vec(n, 'float')} %d0, {vec(n, 'float')} poison, {vec(n, 'i32')} zeroinitializer""", "%t", "%dv")


def _group_loop(n: int, NG: int, body: str, a: str, b: str) -> str:
    """A loop over the NG groups of a row: `body` (which may use %g) defines the <n x float>
    values a and b, accumulated as acc += a * b; the function returns the sum of acc."""
    V = vec(n, "float")
    return f"""
entry:
  br label %loop
loop:
  %g = phi i64 [0, %entry], [%g1, %loop]
  %acc = phi {V} [zeroinitializer, %entry], [%acc1, %loop]
{body}
  %acc1 = call {V} @llvm.fma.v{n}f32({V} {a}, {V} {b}, {V} %acc)
  %g1 = add nuw nsw i64 %g, 1
  %done = icmp eq i64 %g1, {NG}
  br i1 %done, label %exit, label %loop
exit:
{_reduce(n, '%acc1', '%r')}
  ret float %r
}}"""


def _f32(v: float) -> str:
    import struct

    return "0x%016X" % struct.unpack("<Q", struct.pack("<d", float(v)))[0]


def _decode_group(fmt: str, G: int) -> str:
    """IR defining %wv = <G x float>: group %g of weight row %w (scales %s) dequantized, as
    formats.py defines int4a, int3, int2 and fp8 (%qb = the group's byte offset)."""
    V, B = vec(G, "float"), vec(G, "i8")
    pair = fmt in ("int4a", "int2")                  # (scale, min) per group
    if pair:
        scale = """  %si = mul nuw nsw i64 %g, 2
  %sp = getelementptr inbounds half, ptr %s, i64 %si
  %sh = load half, ptr %sp, align 2
  %d = fpext half %sh to float
  %mp = getelementptr inbounds half, ptr %sp, i64 1
  %mh = load half, ptr %mp, align 2
  %mn = fpext half %mh to float"""
    else:
        scale = """  %sp = getelementptr inbounds half, ptr %s, i64 %g
  %sh = load half, ptr %sp, align 2
  %d = fpext half %sh to float"""
    per = {"int4a": G // 2, "int3": 3 * G // 8, "int2": G // 4, "fp8": G}[fmt]
    load = f"""  %qb = mul nuw nsw i64 %g, {per}
  %qp = getelementptr inbounds i8, ptr %w, i64 %qb"""
    if fmt == "int4a":
        H = G // 2
        body = f"""  %q = load {vec(H, 'i8')}, ptr %qp, align 1
  %lo = and {vec(H, 'i8')} %q, {splat(H, 'i8', '15')}
  %hi = lshr {vec(H, 'i8')} %q, {splat(H, 'i8', '4')}
  %qq = shufflevector {vec(H, 'i8')} %lo, {vec(H, 'i8')} %hi, {lanes(G, range(G))}
  %qf = uitofp {B} %qq to {V}"""
    elif fmt in ("int3", "int2"):
        Q4 = G // 4
        body = f"""  %lowv = load {vec(Q4, 'i8')}, ptr %qp, align 1
  %lowr = shufflevector {vec(Q4, 'i8')} %lowv, {vec(Q4, 'i8')} poison, {lanes(G, [i % Q4 for i in range(G)])}
  %lows = lshr {B} %lowr, <{', '.join(f'i8 {2 * (i // Q4)}' for i in range(G))}>
  %low = and {B} %lows, {splat(G, 'i8', '3')}"""
        if fmt == "int3":
            Q8 = G // 8
            body += f"""
  %hp = getelementptr inbounds i8, ptr %qp, i64 {Q4}
  %hiv = load {vec(Q8, 'i8')}, ptr %hp, align 1
  %hir = shufflevector {vec(Q8, 'i8')} %hiv, {vec(Q8, 'i8')} poison, {lanes(G, [i % Q8 for i in range(G)])}
  %his = lshr {B} %hir, <{', '.join(f'i8 {i // Q8}' for i in range(G))}>
  %hib = and {B} %his, {splat(G, 'i8', '1')}
  %hi2 = shl {B} %hib, {splat(G, 'i8', '2')}
  %qq = or {B} %low, %hi2
  %qu = uitofp {B} %qq to {V}
  %qf = fsub {V} %qu, {splat(G, 'float', '4.0')}"""
        else:
            body += f"""
  %qf = uitofp {B} %low to {V}"""
    else:   # fp8 e4m3fn: normal = 2^(e-7) * (1 + m/8), subnormal (e = 0) = m * 2^-9
        I = vec(G, "i32")
        body = f"""  %q = load {B}, ptr %qp, align 1
  %b = zext {B} %q to {I}
  %e0 = lshr {I} %b, {splat(G, 'i32', '3')}
  %e = and {I} %e0, {splat(G, 'i32', '15')}
  %mt = and {I} %b, {splat(G, 'i32', '7')}
  %eb = add {I} %e, {splat(G, 'i32', '120')}
  %ebs = shl {I} %eb, {splat(G, 'i32', '23')}
  %mts = shl {I} %mt, {splat(G, 'i32', '20')}
  %nb = or {I} %ebs, %mts
  %nf = bitcast {I} %nb to {V}
  %mf = uitofp {I} %mt to {V}
  %sf = fmul {V} %mf, {splat(G, 'float', _f32(2.0 ** -9))}
  %isub = icmp eq {I} %e, zeroinitializer
  %mag = select {vec(G, 'i1')} %isub, {V} %sf, {V} %nf
  %neg = fneg {V} %mag
  %sgn = and {I} %b, {splat(G, 'i32', '128')}
  %isneg = icmp ne {I} %sgn, zeroinitializer
  %qf = select {vec(G, 'i1')} %isneg, {V} %neg, {V} %mag"""
    out = f"""{load}
{body}
{scale}
  %d0 = insertelement {V} poison, float %d, i64 0
  %dv = shufflevector {V} %d0, {V} poison, {vec(G, 'i32')} zeroinitializer"""
    if pair:
        out += f"""
  %m0 = insertelement {V} poison, float %mn, i64 0
  %mv = shufflevector {V} %m0, {V} poison, {vec(G, 'i32')} zeroinitializer
  %wv = call {V} @llvm.fma.v{G}f32({V} %qf, {V} %dv, {V} %mv)"""
    else:
        out += f"""
  %wv = fmul {V} %qf, %dv"""
    return out


def _decoded_f32act_dot(fmt: str, NG: int, G: int) -> str:
    """Formats decoded group by group to f32 (int4a, int3, int2, fp8) against f32 activations."""
    return _group_loop(G, NG, f"""{_decode_group(fmt, G)}
  %xo = mul nuw nsw i64 %g, {G}
  %xp = getelementptr inbounds float, ptr %x, i64 %xo
  %xv = load {vec(G, 'float')}, ptr %xp, align 4""", "%wv", "%xv")


def _idot(target: Target, width: int, u: str, s: str, out: str) -> str:
    """Integer dot of u8 x s8 bytes summed in groups of 4 into i32 lanes: width = 32 or 64 bytes."""
    if width == 32:
        return (f"  {out}.p = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {u}, <32 x i8> {s})\n"
                f"  {out} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {out}.p, <16 x i16> {splat(16, 'i16', '1')})")
    if target.vnni:
        return (f"  {out}.u = bitcast <64 x i8> {u} to <16 x i32>\n"
                f"  {out}.s = bitcast <64 x i8> {s} to <16 x i32>\n"
                f"  {out} = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> zeroinitializer, <16 x i32> {out}.u, <16 x i32> {out}.s)")
    return (f"  {out}.p = call <32 x i16> @llvm.x86.avx512.pmaddubs.w.512(<64 x i8> {u}, <64 x i8> {s})\n"
            f"  {out} = call <16 x i32> @llvm.x86.avx512.pmaddw.d.512(<32 x i16> {out}.p, <32 x i16> {splat(32, 'i16', '1')})")


def _q8_operands(fmt: str, P: int, g: str, t: str, w: str = "%w") -> str:
    """Load P consecutive groups of weights and activations as (u8 %{t}.u, s8 %{t}.s) bytes."""
    nb = 32 * P
    xs = f"""  %{t}.xp = getelementptr inbounds i8, ptr %x, i64 %{g}.x
  %{t}.x = load <{nb} x i8>, ptr %{t}.xp, align 1"""
    if fmt in ("int4", "int4a"):
        # bytes of P groups: per group 16 bytes -> low nibbles are values 0..15, high 16..31
        mask = [m for q in range(P) for m in [q * 16 + i for i in range(16)] + [16 * P + q * 16 + i for i in range(16)]]
        return f"""  %{t}.qp = getelementptr inbounds i8, ptr {w}, i64 %{g}.w
  %{t}.q = load <{16 * P} x i8>, ptr %{t}.qp, align 1
  %{t}.lo = and <{16 * P} x i8> %{t}.q, {splat(16 * P, 'i8', '15')}
  %{t}.hi = lshr <{16 * P} x i8> %{t}.q, {splat(16 * P, 'i8', '4')}
  %{t}.u = shufflevector <{16 * P} x i8> %{t}.lo, <{16 * P} x i8> %{t}.hi, {lanes(nb, mask)}
{xs}
  %{t}.s = add <{nb} x i8> %{t}.x, zeroinitializer"""
    # int8: |w| as the unsigned operand, x carrying w's sign as the signed one
    return f"""  %{t}.qp = getelementptr inbounds i8, ptr {w}, i64 %{g}.x
  %{t}.q = load <{nb} x i8>, ptr %{t}.qp, align 1
  %{t}.u = call <{nb} x i8> @llvm.abs.v{nb}i8(<{nb} x i8> %{t}.q, i1 false)
{xs}
  %{t}.neg = icmp slt <{nb} x i8> %{t}.q, zeroinitializer
  %{t}.nx = sub <{nb} x i8> zeroinitializer, %{t}.x
  %{t}.s = select <{nb} x i1> %{t}.neg, <{nb} x i8> %{t}.nx, <{nb} x i8> %{t}.x"""


NIBBLES = ("int4", "int4a")     # formats of 16 nibble bytes per group (int4's order)
PAIRED = ("int4a",)             # formats with a (scale, min) pair per group


def second_plane(fmt: str, nb: int, t: str, off: str, neg: str | None = None) -> str:
    """IR for %{t}.s2: the second plane's activation bytes (q16 activations: `off` = the first
    plane's byte offset + Kp) as the signed operand of an integer dot, carrying int8 weights'
    signs (`neg`, the first plane's mask) as the first plane's does."""
    load = f"""  %{t}.x2p = getelementptr inbounds i8, ptr %x, i64 {off}
  %{t}.x2 = load <{nb} x i8>, ptr %{t}.x2p, align 1"""
    if fmt in NIBBLES:
        return load + f"\n  %{t}.s2 = add <{nb} x i8> %{t}.x2, zeroinitializer"
    return load + f"""
  %{t}.nx2 = sub <{nb} x i8> zeroinitializer, %{t}.x2
  %{t}.s2 = select <{nb} x i1> {neg or f'%{t}.neg'}, <{nb} x i8> %{t}.nx2, <{nb} x i8> %{t}.x2"""


def combine_planes(target: Target, width: int, first: str, u: str, s2: str, out: str) -> str:
    """IR for out = (first << 8) + the integer dot of (u, s2): the two planes of q16 activations
    (x = (256 q + q2) d / 256) in one i32 total, exact (|256 dot| < 2^31 for 32 byte pairs)."""
    L = width // 4
    shl = f"  {out}.h = shl <{L} x i32> {first}, {splat(L, 'i32', '8')}"
    if width == 64 and target.vnni:
        return shl + (f"\n  {out}.u = bitcast <64 x i8> {u} to <16 x i32>\n  {out}.s = bitcast <64 x i8> {s2} to <16 x i32>\n"
                      f"  {out} = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> {out}.h, <16 x i32> {out}.u, "
                      f"<16 x i32> {out}.s)")
    return shl + "\n" + _idot(target, width, u, s2, f"{out}.d") + f"\n  {out} = add <{L} x i32> {out}.h, {out}.d"


def _part(target: Target, fmt: str, n: int, base: str, t: str, w: str, kp2: int) -> tuple[str, int]:
    """IR for %{t}.i: the integer dot of n (1 or 2) consecutive groups from group %{base} of
    weight row w against the activation row %x (plain layout; kp2 > 0: q16 activations, the
    second plane kp2 bytes after the first): (ir, its i32 lanes)."""
    ir = f"""  %{t}g.w = mul nuw nsw i64 %{base}, {16 if fmt in NIBBLES else 32}
  %{t}g.x = mul nuw nsw i64 %{base}, 32
{_q8_operands(fmt, n, f'{t}g', t, w)}
{_idot(target, 32 * n, f'%{t}.u', f'%{t}.s', f'%{t}.i1' if kp2 else f'%{t}.i')}"""
    if kp2:
        ir += f"""
  %{t}g.x2 = add nuw nsw i64 %{t}g.x, {kp2}
{second_plane(fmt, 32 * n, t, f'%{t}g.x2')}
{combine_planes(target, 32 * n, f'%{t}.i1', f'%{t}.u', f'%{t}.s2', f'%{t}.i')}"""
    return ir, 8 * n


def _row_parts(target: Target, fmt: str, n: int, g: str, t: str, w: str, pairs: bool,
               kp2: int = 0) -> tuple[str, list[str], int, int]:
    """The integer dots of n <= 8 groups of weight row w from group %{g} (absent groups: zero
    parts): (ir, parts, lanes per part, lanes per group) for canon.group_totals."""
    ir, parts = [], []
    P = 1 if pairs or not target.avx512 else 2      # groups of one part (the pair layout: 2 in 8 lanes)
    step = 2 if pairs else P
    for j in range(0, 8, step):
        k = min(step, n - j)
        tag = f"{t}.v{j}"
        if k <= 0:
            parts.append("zeroinitializer")
            continue
        ir.append(f"  %{tag}.b = add nuw nsw i64 %{g}, {j}")
        if pairs and k == 2:
            ir.append(_q8_pair_pair(tag, f"{tag}.b", w, kp2))
            parts.append(f"%{tag}.i")
            continue
        body, L = _part(target, fmt, k, f"{tag}.b", tag, w, kp2)
        ir.append(body)
        want = 8 * step if not pairs else 8
        if pairs:         # a lone last group in the plain layout: its 8 lanes as 4, then 4 zeros
            ir.append(f"""  %{tag}.e = shufflevector <8 x i32> %{tag}.i, <8 x i32> poison, <4 x i32> <i32 0, i32 2, i32 4, i32 6>
  %{tag}.o = shufflevector <8 x i32> %{tag}.i, <8 x i32> poison, <4 x i32> <i32 1, i32 3, i32 5, i32 7>
  %{tag}.f = add <4 x i32> %{tag}.e, %{tag}.o
  %{tag}.z = shufflevector <4 x i32> %{tag}.f, <4 x i32> zeroinitializer, {lanes(8, range(8))}""")
            parts.append(f"%{tag}.z")
        elif L < want:    # one group where a part holds two: the other half zero
            ir.append(f"  %{tag}.z = shufflevector <{L} x i32> %{tag}.i, <{L} x i32> zeroinitializer, {lanes(want, range(want))}")
            parts.append(f"%{tag}.z")
        else:
            parts.append(f"%{tag}.i")
    return "\n".join(ir), parts, (8 if pairs else 8 * P), (4 if pairs else 8)


def _lanes8(n: int, g: str, t: str, ptr: str, ty: str, stride: int = 1, off: int = 0) -> tuple[str, str]:
    """IR for %{t}: <8 x ty> of ptr[(g + j) * stride + off] for j < n (a vector load when n = 8
    and stride 1), zeros in the other lanes. ty: half, float or i32."""
    if n == 8 and stride == 1 and off == 0:
        return (f"  %{t}.p = getelementptr inbounds {ty}, ptr {ptr}, i64 %{g}\n"
                f"  %{t} = load <8 x {ty}>, ptr %{t}.p, align {2 if ty == 'half' else 4}"), f"%{t}"
    out, prev = [], "zeroinitializer"
    for j in range(n):
        out.append(f"""  %{t}.i{j} = add nuw nsw i64 %{g}, {j}
  %{t}.o{j} = mul nuw nsw i64 %{t}.i{j}, {stride}
  %{t}.k{j} = add nuw nsw i64 %{t}.o{j}, {off}
  %{t}.p{j} = getelementptr inbounds {ty}, ptr {ptr}, i64 %{t}.k{j}
  %{t}.l{j} = load {ty}, ptr %{t}.p{j}, align {2 if ty == 'half' else 4}
  %{t}.v{j} = insertelement <8 x {ty}> {prev}, {ty} %{t}.l{j}, i64 {j}""")
        prev = f"%{t}.v{j}"
    return "\n".join(out), prev


def _weight_scales(fmt: str, n: int, g: str, t: str, s: str) -> tuple[str, str, str | None]:
    """IR for the f32 scales (and minima, PAIRED formats) of n groups from %{g} of one row."""
    if fmt in PAIRED:
        if n == 8:
            return f"""  %{t}.sg = mul nuw nsw i64 %{g}, 2
  %{t}.sp = getelementptr inbounds half, ptr {s}, i64 %{t}.sg
  %{t}.sh = load <16 x half>, ptr %{t}.sp, align 2
  %{t}.sf = fpext <16 x half> %{t}.sh to <16 x float>
  %{t}.dw = shufflevector <16 x float> %{t}.sf, <16 x float> poison, {lanes(8, range(0, 16, 2))}
  %{t}.mw = shufflevector <16 x float> %{t}.sf, <16 x float> poison, {lanes(8, range(1, 16, 2))}""", f"%{t}.dw", f"%{t}.mw"
        a, dh = _lanes8(n, g, f"{t}.dh", s, "half", 2, 0)
        b, mh = _lanes8(n, g, f"{t}.mh", s, "half", 2, 1)
        return f"""{a}
{b}
  %{t}.dw = fpext <8 x half> {dh} to <8 x float>
  %{t}.mw = fpext <8 x half> {mh} to <8 x float>""", f"%{t}.dw", f"%{t}.mw"
    a, dh = _lanes8(n, g, f"{t}.dh", s, "half")
    return f"{a}\n  %{t}.dw = fpext <8 x half> {dh} to <8 x float>", f"%{t}.dw", None


def _batch(target: Target, fmt: str, n: int, g: str, t: str, rows: list[tuple[str, str, str]], pairs: bool,
           kp2: int = 0) -> str:
    """IR adding n <= 8 groups from %{g} to each row's accumulator (canon.py's order); rows:
    (weight data, scales, accumulator in -> the name of the accumulator out); kp2 > 0: q16."""
    from .canon import accumulate, group_totals

    a, dx = _lanes8(n, g, f"{t}.dx", "%xd", "float")
    out = [a]
    bs = None
    if fmt in NIBBLES:
        b, bs = _lanes8(n, g, f"{t}.bs", "%xs", "i32")
        out.append(b)
    for r, (w, s, acc) in enumerate(rows):
        q = f"{t}r{r}"
        ir, parts, width, run = _row_parts(target, fmt, n, g, q, w, pairs, kp2)
        tir, tot = group_totals(parts, width, run, q)
        sir, dw, mw = _weight_scales(fmt, n, g, q, s)
        out += [ir, tir, sir, f"  %{q}.d = fmul <8 x float> {dw}, {dx}"]
        if fmt == "int4":       # the nibbles carry +8: sum (q - 8) x = sum q x - 8 sum x, in integers
            out.append(f"  %{q}.b8 = shl <8 x i32> {bs}, <i32 3, i32 3, i32 3, i32 3, i32 3, i32 3, i32 3, i32 3>\n"
                       f"  %{q}.t = sub <8 x i32> {tot}, %{q}.b8")
            tot = f"%{q}.t"
        out.append(accumulate(acc, tot, f"%{q}.d", f"%{q}.acc"))
        if mw is not None:      # w = q d + m: sum w x = d sum q x + m sum x
            out.append(f"  %{q}.m = fmul <8 x float> {mw}, {dx}")
            out.append(accumulate(f"%{q}.acc", bs, f"%{q}.m", f"%{q}.acm"))
    return "\n".join(out)


def _q8_dot(target: Target, fmt: str, NG: int, R: int = 1, pairs: bool = False, planes: int = 1) -> str:
    """int8/int4/int4a weights against q8 activations, R weight rows against one activation row,
    in canon.py's order: batches of 8 groups in a loop (each row's integer dots folded to one
    total per group, scaled, added to the group's accumulator lane), a last partial batch after
    it, then the fixed fold of the 8 lanes. With R > 1 the rows share the activation loads.
    Returns float (R = 1) or [R x float].

    `pairs` (int4 on AVX2, pair_layout): the activations are in the pair layout: two groups'
    nibbles dot them as they come (_q8_pair_pair); an odd last group is in the plain layout.
    `planes` = 2: q16 activations (elementwise.quantize_q8), each integer dot over both planes."""
    from .canon import fold

    require("dot", not (pairs and target.avx512), "the pair layout is an AVX2 path")
    require("dot", fmt in NIBBLES + ("int8",), f"no q8 dot for {fmt}")
    main, rem = divmod(NG, 8)
    kp2 = 32 * NG if planes == 2 else 0
    names = [((f"%w{r}", f"%s{r}") if R > 1 else ("%w", "%s")) for r in range(R)]
    V = "<8 x float>"
    parts = ["\nentry:"]
    accs = ["zeroinitializer"] * R
    if main:
        last = "acm" if fmt in PAIRED else "acc"
        phis = [f"  %acc{r} = phi {V} [zeroinitializer, %entry], [%mr{r}.{last}, %loop]" for r in range(R)]
        body = _batch(target, fmt, 8, "g", "m", [(w, s, f"%acc{r}") for r, (w, s) in enumerate(names)], pairs, kp2)
        parts.append(f"""  br label %loop
loop:
  %g = phi i64 [0, %entry], [%g1, %loop]
{chr(10).join(phis)}
{body}
  %g1 = add nuw nsw i64 %g, 8
  %done = icmp eq i64 %g1, {8 * main}
  br i1 %done, label %tail, label %loop
tail:""")
        accs = [f"%mr{r}.{last}" for r in range(R)]
    if rem:
        parts.append(f"  %gt = add i64 0, {8 * main}")
        parts.append(_batch(target, fmt, rem, "gt", "t", [(w, s, accs[r]) for r, (w, s) in enumerate(names)], pairs,
                            kp2))
        accs = [f"%tr{r}.{'acm' if fmt in PAIRED else 'acc'}" for r in range(R)]
    for r in range(R):
        parts.append(fold(accs[r], f"%out{r}"))
    if R == 1:
        parts.append("  ret float %out0")
    else:
        agg = "undef"
        for r in range(R):
            parts.append(f"  %agg{r} = insertvalue [{R} x float] {agg}, float %out{r}, {r}")
            agg = f"%agg{r}"
        parts.append(f"  ret [{R} x float] {agg}")
    return "\n".join(parts) + "\n}"


DECLS = """
declare float @llvm.fma.f32(float, float, float)
declare float @llvm.exp.f32(float)
"""


def pair_layout(target: Target, fmt: str, group_size: int) -> bool:
    """Whether int4 weights read their q8 activations in the *pair* layout: per two blocks
    (2p, 2p+1) the 64 bytes are [x(2p)[0:16], x(2p+1)[0:16], x(2p)[16:32], x(2p+1)[16:32]] (an odd
    last block stays as it is). int4 stores a group's values 0..15 in the low nibbles of its 16
    bytes and 16..31 in the high ones, so with the activations in that order two groups' low
    and high nibbles dot against them as they come: no weight shuffle per group, and the two
    halves' products add in 16 bits before one widening (6.5 instead of 8.5 vector ops per
    group on AVX2). AVX2 hosts only (AVX-512 packs two groups per vector already)."""
    return fmt == "int4" and group_size == Q8_BLOCK and not target.avx512


def _q8_pair_pair(t: str, base: str, w: str, kp2: int = 0) -> str:
    """One pair of int4 groups (%{base}, %{base}+1) against pair-layout activations: %{t}.i, the
    <8 x i32> dots (lanes 0-3: the first group's, 4-7: the second's). |a product pair| <= 2*15*127,
    so the low and high halves' 16-bit sums add without overflow. kp2 > 0: q16 activations, the
    second plane kp2 bytes after the first."""
    ir = f"""  %{t}.wo = mul nuw nsw i64 %{base}, 16
  %{t}.qp = getelementptr inbounds i8, ptr {w}, i64 %{t}.wo
  %{t}.q = load <32 x i8>, ptr %{t}.qp, align 1
  %{t}.lo = and <32 x i8> %{t}.q, {splat(32, 'i8', '15')}
  %{t}.hi = lshr <32 x i8> %{t}.q, {splat(32, 'i8', '4')}
  %{t}.xo = mul nuw nsw i64 %{base}, 32
{pair_plane_dot(t, '', f'%{t}.xo', f'%{t}.i1' if kp2 else f'%{t}.i')}"""
    if kp2:
        ir += f"""
  %{t}.xo2 = add nuw nsw i64 %{t}.xo, {kp2}
{pair_plane_dot(t, '2', f'%{t}.xo2', f'%{t}.i2')}
  %{t}.ih = shl <8 x i32> %{t}.i1, {splat(8, 'i32', '8')}
  %{t}.i = add <8 x i32> %{t}.ih, %{t}.i2"""
    return ir


def pair_plane_dot(t: str, sfx: str, off: str, out: str) -> str:
    """IR for `out`: the nibbles %{t}.lo / %{t}.hi of a pair of int4 groups against one plane's
    pair-layout activations at byte offset `off` of %x (values named with suffix sfx)."""
    return f"""  %{t}.xlp{sfx} = getelementptr inbounds i8, ptr %x, i64 {off}
  %{t}.xl{sfx} = load <32 x i8>, ptr %{t}.xlp{sfx}, align 1
  %{t}.xhp{sfx} = getelementptr inbounds i8, ptr %{t}.xlp{sfx}, i64 32
  %{t}.xh{sfx} = load <32 x i8>, ptr %{t}.xhp{sfx}, align 1
  %{t}.pl{sfx} = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> %{t}.lo, <32 x i8> %{t}.xl{sfx})
  %{t}.ph{sfx} = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> %{t}.hi, <32 x i8> %{t}.xh{sfx})
  %{t}.ps{sfx} = add <16 x i16> %{t}.pl{sfx}, %{t}.ph{sfx}
  {out} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> %{t}.ps{sfx}, <16 x i16> {splat(16, 'i16', '1')})"""


def needs_q8(fmt: str, group_size: int) -> bool:
    """Whether the q8-activation path exists for this weight format (int8/int4/int4a, groups of 32)."""
    return fmt in ("int8", "int4", "int4a") and group_size == Q8_BLOCK


def dot_function(target: Target, fmt: str, K: int, group_size: int, q8: bool, name: str = "dot",
                 planes: int = 1) -> str:
    head = (f"define internal float @{name}(ptr noalias %w, ptr noalias %s, ptr noalias %x, "
            f"ptr noalias %xd, ptr noalias %xs) alwaysinline {{")
    dims("dot", K=K)
    group_ok("dot", fmt, group_size)
    NG = -(-K // group_size) if group_size else 0
    if fmt == "f32":
        body = _f32_dot(K)
    elif fmt == "bf16":
        body = _bf16_dot(K)
    elif q8:
        require("dot", needs_q8(fmt, group_size), f"no q8-activation path for {fmt} in groups of {group_size}")
        body = _q8_dot(target, fmt, NG, pairs=pair_layout(target, fmt, group_size), planes=planes)
    elif fmt in ("int8", "int4"):
        body = _grouped_f32act_dot(fmt, NG, group_size)
    else:
        body = _decoded_f32act_dot(fmt, NG, group_size)
    return head + body + "\n"


def dot2_function(target: Target, fmt: str, K: int, group_size: int, planes: int = 1) -> str:
    """[2 x float] @dot2(w0, s0, w1, s1, x, xd, xs): two weight rows against one q8 activation
    row in one pass (the merged gate/up weight: gate row n and up row n + I share x)."""
    dims("dot2", K=K)
    group_ok("dot2", fmt, group_size)
    require("dot2", needs_q8(fmt, group_size), f"no q8-activation path for {fmt} in groups of {group_size}")
    NG = -(-K // group_size)
    head = ("define internal [2 x float] @dot2(ptr noalias %w0, ptr noalias %s0, ptr noalias %w1, "
            "ptr noalias %s1, ptr noalias %x, ptr noalias %xd, ptr noalias %xs) alwaysinline {")
    return head + _q8_dot(target, fmt, NG, R=2, pairs=pair_layout(target, fmt, group_size), planes=planes) + "\n"


def weight_row(row: str, out: str, rb: int, sb: int) -> str:
    """IR for %{out}.w / %{out}.s: row `row` of the weight data %w and of its scales %s."""
    return f"""  %{out}.wo = mul nuw nsw i64 {row}, {rb}
  %{out}.w = getelementptr inbounds i8, ptr %w, i64 %{out}.wo
  %{out}.so = mul nuw nsw i64 {row}, {sb}
  %{out}.s = getelementptr inbounds i8, ptr %s, i64 %{out}.so"""


def finish_module(ir: str, target: Target) -> str:
    """Kernel IR plus the declarations it calls and the #0 function attributes."""
    return ir + DECLS + intrinsic_decls(ir) + f"\nattributes #0 = {{ {fn_attrs(target)} }}\n"


def intrinsic_decls(ir: str) -> str:
    """`declare` lines for the overloaded intrinsics the IR text calls."""
    import re

    decls = set()
    for m in re.finditer(r"call (?:reassoc )?(<\d+ x \w+>|float|i32) @(llvm\.[\w.]+)\(([^)]*)\)", ir):
        ret, name, args = m.groups()
        if name in ("llvm.fma.f32", "llvm.exp.f32"):
            continue
        types = []
        depth = 0
        cur = ""
        for ch in args:
            if ch == "<":
                depth += 1
            if ch == ">":
                depth -= 1
            if ch == "," and depth == 0:
                types.append(cur.strip())
                cur = ""
            else:
                cur += ch
        types.append(cur.strip())
        tys = []
        for a in types:
            a = a.strip()
            if a.startswith("<"):
                tys.append(a[: a.index(">") + 1])
            else:
                tys.append(a.split(" ")[0])
        decls.add(f"declare {ret} @{name}({', '.join(tys)})")
    return "\n".join(sorted(decls))
