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
from .common import lanes, splat, vec

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
    V = vec(n, "float")
    return f"""
entry:
  br label %loop
loop:
  %g = phi i64 [0, %entry], [%g1, %loop]
  %acc = phi {V} [zeroinitializer, %entry], [%acc1, %loop]
  %g{G} = mul nuw nsw i64 %g, {G}
  %g{H} = mul nuw nsw i64 %g, {H}
{body}
  %sp = getelementptr inbounds half, ptr %s, i64 %g
  %sh = load half, ptr %sp, align 2
  %d = fpext half %sh to float
  %d0 = insertelement {V} poison, float %d, i64 0
  %dv = shufflevector {V} %d0, {V} poison, {vec(n, 'i32')} zeroinitializer
  %acc1 = call {V} @llvm.fma.v{n}f32({V} %t, {V} %dv, {V} %acc)
  %g1 = add nuw nsw i64 %g, 1
  %done = icmp eq i64 %g1, {NG}
  br i1 %done, label %exit, label %loop
exit:
{_reduce(n, '%acc1', '%r')}
  ret float %r
}}"""


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


def _q8_operands(fmt: str, P: int, g: str, t: str) -> str:
    """Load P consecutive groups of weights and activations as (u8 %{t}.u, s8 %{t}.s) bytes."""
    nb = 32 * P
    xs = f"""  %{t}.xp = getelementptr inbounds i8, ptr %x, i64 %{g}.x
  %{t}.x = load <{nb} x i8>, ptr %{t}.xp, align 1"""
    if fmt == "int4":
        # bytes of P groups: per group 16 bytes -> low nibbles are values 0..15, high 16..31
        mask = [m for q in range(P) for m in [q * 16 + i for i in range(16)] + [16 * P + q * 16 + i for i in range(16)]]
        return f"""  %{t}.qp = getelementptr inbounds i8, ptr %w, i64 %{g}.w
  %{t}.q = load <{16 * P} x i8>, ptr %{t}.qp, align 1
  %{t}.lo = and <{16 * P} x i8> %{t}.q, {splat(16 * P, 'i8', '15')}
  %{t}.hi = lshr <{16 * P} x i8> %{t}.q, {splat(16 * P, 'i8', '4')}
  %{t}.u = shufflevector <{16 * P} x i8> %{t}.lo, <{16 * P} x i8> %{t}.hi, {lanes(nb, mask)}
{xs}
  %{t}.s = add <{nb} x i8> %{t}.x, zeroinitializer"""
    # int8: |w| as the unsigned operand, x carrying w's sign as the signed one
    return f"""  %{t}.qp = getelementptr inbounds i8, ptr %w, i64 %{g}.x
  %{t}.q = load <{nb} x i8>, ptr %{t}.qp, align 1
  %{t}.u = call <{nb} x i8> @llvm.abs.v{nb}i8(<{nb} x i8> %{t}.q, i1 false)
{xs}
  %{t}.neg = icmp slt <{nb} x i8> %{t}.q, zeroinitializer
  %{t}.nx = sub <{nb} x i8> zeroinitializer, %{t}.x
  %{t}.s = select <{nb} x i1> %{t}.neg, <{nb} x i8> %{t}.nx, <{nb} x i8> %{t}.x"""


def _q8_scale(g: str, t: str, off: int) -> str:
    """d = weight scale * activation scale of group g+off; c = d * block sum (int4's -8 offset)."""
    return f"""  %{t}.gi{off} = add nuw nsw i64 %{g}, {off}
  %{t}.sp{off} = getelementptr inbounds half, ptr %s, i64 %{t}.gi{off}
  %{t}.sh{off} = load half, ptr %{t}.sp{off}, align 2
  %{t}.dw{off} = fpext half %{t}.sh{off} to float
  %{t}.dp{off} = getelementptr inbounds float, ptr %xd, i64 %{t}.gi{off}
  %{t}.dx{off} = load float, ptr %{t}.dp{off}, align 4
  %{t}.d{off} = fmul float %{t}.dw{off}, %{t}.dx{off}
  %{t}.bp{off} = getelementptr inbounds i32, ptr %xs, i64 %{t}.gi{off}
  %{t}.bs{off} = load i32, ptr %{t}.bp{off}, align 4
  %{t}.bf{off} = sitofp i32 %{t}.bs{off} to float"""


def _q8_dot(target: Target, fmt: str, NG: int) -> str:
    """int8/int4 weights against q8 activations, P groups per vector (2 on AVX-512, else 1)."""
    P = 2 if target.avx512 else 1
    L = 8 * P
    V = vec(L, "float")
    main_groups = (NG // P) * P
    parts = []
    if main_groups:
        dvec = (f"  %m.dv0 = insertelement {vec(P, 'float')} poison, float %m.d0, i64 0\n"
                + (f"  %m.dv1 = insertelement {vec(P, 'float')} %m.dv0, float %m.d1, i64 1\n" if P == 2 else "")
                + f"  %m.dv = shufflevector {vec(P, 'float')} %m.dv{P - 1}, {vec(P, 'float')} poison, "
                  f"{lanes(L, [i // 8 for i in range(L)])}")
        csum = "  %m.c = fmul float %m.d0, %m.bf0" + (
            "\n  %m.c1 = call float @llvm.fma.f32(float %m.d1, float %m.bf1, float %m.c)" if P == 2 else "")
        cout = "%m.c1" if P == 2 else "%m.c"
        parts.append(f"""
entry:
  br label %loop
loop:
  %g = phi i64 [0, %entry], [%g1, %loop]
  %acc = phi {V} [zeroinitializer, %entry], [%acc1, %loop]
  %corr = phi float [0.0, %entry], [%corr1, %loop]
  %g.w = mul nuw nsw i64 %g, 16
  %g.x = mul nuw nsw i64 %g, 32
{_q8_operands(fmt, P, 'g', 'm')}
{_idot(target, 32 * P, '%m.u', '%m.s', '%m.i')}
  %m.f = sitofp {vec(L, 'i32')} %m.i to {V}
{_q8_scale('g', 'm', 0)}
{_q8_scale('g', 'm', 1) if P == 2 else ''}
{dvec}
  %acc1 = call {V} @llvm.fma.v{L}f32({V} %m.f, {V} %m.dv, {V} %acc)
{csum}
  %corr1 = fadd float %corr, {cout}
  %g1 = add nuw nsw i64 %g, {P}
  %done = icmp eq i64 %g1, {main_groups}
  br i1 %done, label %main.exit, label %loop
main.exit:
{_reduce(L, '%acc1', '%main.r')}
  br label %tail""")
        pre, r0, c0 = "main.exit", "%main.r", "%corr1"
    else:
        parts.append("\nentry:\n  br label %tail")
        pre, r0, c0 = "entry", "0.0", "0.0"
    if main_groups < NG:   # one leftover group on AVX-512: 256-bit ops
        parts.append(f"""
tail:
  %tg = add i64 0, {main_groups}
  %tg.w = mul nuw nsw i64 %tg, 16
  %tg.x = mul nuw nsw i64 %tg, 32
{_q8_operands(fmt, 1, 'tg', 't')}
{_idot(target, 32, '%t.u', '%t.s', '%t.i')}
  %t.f = sitofp <8 x i32> %t.i to <8 x float>
{_q8_scale('tg', 't', 0)}
  %t.r0 = call reassoc float @llvm.vector.reduce.fadd.v8f32(float 0.0, <8 x float> %t.f)
  %t.r = call float @llvm.fma.f32(float %t.r0, float %t.d0, float {r0})
  %t.c = call float @llvm.fma.f32(float %t.d0, float %t.bf0, float {c0})
  br label %exit""")
        r, c = "%t.r", "%t.c"
    else:
        parts.append("\ntail:\n  br label %exit")
        r, c = r0, c0
    if fmt == "int4":   # the nibbles carry +8: sum (q - 8) x = sum q x - 8 sum x
        fin = f"  %out = call float @llvm.fma.f32(float {c}, float -8.0, float {r})\n  ret float %out"
    else:
        fin = f"  %out = fadd float {r}, 0.0\n  ret float %out"
    parts.append(f"\nexit:\n{fin}\n}}")
    del pre
    return "".join(parts)


DECLS = """
declare float @llvm.fma.f32(float, float, float)
declare float @llvm.exp.f32(float)
"""


def needs_q8(fmt: str, group_size: int) -> bool:
    """Whether the q8-activation path exists for this weight format (int8/int4, groups of 32)."""
    return fmt in ("int8", "int4") and group_size == Q8_BLOCK


def dot_function(target: Target, fmt: str, K: int, group_size: int, q8: bool, name: str = "dot") -> str:
    head = (f"define internal float @{name}(ptr noalias %w, ptr noalias %s, ptr noalias %x, "
            f"ptr noalias %xd, ptr noalias %xs) alwaysinline {{")
    NG = -(-K // group_size) if group_size else 0
    if fmt == "f32":
        body = _f32_dot(K)
    elif fmt == "bf16":
        body = _bf16_dot(K)
    elif q8:
        assert needs_q8(fmt, group_size)
        body = _q8_dot(target, fmt, NG)
    else:
        body = _grouped_f32act_dot(fmt, NG, group_size)
    return head + body + "\n"


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
