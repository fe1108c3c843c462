"""Row-wise kernels over [M, C] activations: norms, routing, embedding, element-wise ops, q8 quantization.

Every kernel here is parallel over rows m of its activations ([begin, end) is a range of rows) and
reads/writes rows through element strides (ldx, ldy, ...), so it can work on views into wider
buffers. Compile-time shapes (C, group, E, k, D, K) are baked into the IR and the kernel name.
Semantics are those of backends/reference/executor.py (rms_norm, softmax + topk_mask (+ renorm) for
route, silu, sigmoid, clip, slice); f32 arithmetic mirrors NumPy's order of operations so results
agree to rounding (reductions are `reassoc` and vectorized, so they differ by a few ulps).

Generators and their args (KernelSource.params):
  rms_norm(C, group)        x, w, y, ldx, ldy, eps(f32)
  route(E, k, norm)         x, y, ldx, ldy
  embed(D)                  ids(i64[M]), table(f32[V, D]), y, ldy
  binary(op, C, b_cols)     a, b, y, lda, ldb, ldy          (op: add | mul; b_cols: C or 1)
  unary(op, C)              x, y, ldx, ldy, limit(f32)      (op: silu | sigmoid | clamp)
  slice_copy(start, stop)   x, y, ldx, ldy
  quantize_q8(K)            x, xq(i8[M, Kp]), xd(f32[M, NG]), xs(i32[M, NG]), ldx

The small IR-building helpers (`f32`, `loop`, `row_kernel`, `module`) are shared with attention.py.
"""

from __future__ import annotations

import re
import struct

from ..target import Target
from .common import KernelSource, dims, fn_attrs, lanes, load_args, one_of, require

Q8_BLOCK = 32

_INTRINSICS = {
    "llvm.sqrt.f32": "declare float @llvm.sqrt.f32(float)",
    "llvm.exp.f32": "declare float @llvm.exp.f32(float)",
    "llvm.cos.f32": "declare float @llvm.cos.f32(float)",
    "llvm.sin.f32": "declare float @llvm.sin.f32(float)",
    "llvm.fabs.v32f32": "declare <32 x float> @llvm.fabs.v32f32(<32 x float>)",
    "llvm.roundeven.v32f32": "declare <32 x float> @llvm.roundeven.v32f32(<32 x float>)",
    "llvm.fma.v32f32": "declare <32 x float> @llvm.fma.v32f32(<32 x float>, <32 x float>, <32 x float>)",
    "llvm.vector.reduce.fmax.v32f32": "declare float @llvm.vector.reduce.fmax.v32f32(<32 x float>)",
    "llvm.vector.reduce.add.v32i32": "declare i32 @llvm.vector.reduce.add.v32i32(<32 x i32>)",
    "llvm.memcpy.p0.p0.i64": "declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)",
    "llvm.memset.p0.i64": "declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)",
}


def f32(v: float) -> str:
    """An f32 constant as LLVM IR text (the exact double of the rounded float, in hex)."""
    x = struct.unpack("<f", struct.pack("<f", float(v)))[0]
    return "0x%016X" % struct.unpack("<Q", struct.pack("<d", x))[0]


NEG_INF = "0xFFF0000000000000"


def loop(L: str, idx: str, n, body: str, accs=(), start=0, guard: bool = False) -> str:
    """IR text of a counted loop: %idx runs over [start, n); `body` may hold several blocks.

    Blocks: {L}.pre (entry; with `guard`, skips the loop when start >= n), {L}.body (header, phis),
    {L}.latch, then {L}.x after the loop, where code continues. `accs` are loop-carried values
    (name, type, init, next): %name in the body, %name.out after the loop. Labels and values share
    one namespace: value names must not end in .pre/.body/.latch/.x.
    """
    out = [f"  br label %{L}.pre", f"{L}.pre:"]
    if guard:
        out += [f"  %{L}.ne = icmp slt i64 {start}, {n}", f"  br i1 %{L}.ne, label %{L}.body, label %{L}.x"]
    else:
        out.append(f"  br label %{L}.body")
    out += [f"{L}.body:", f"  %{idx} = phi i64 [{start}, %{L}.pre], [%{idx}.n, %{L}.latch]"]
    out += [f"  %{a} = phi {t} [{init}, %{L}.pre], [{nxt}, %{L}.latch]" for a, t, init, nxt in accs]
    out += [body.rstrip("\n"), f"  br label %{L}.latch", f"{L}.latch:",
            f"  %{idx}.n = add nsw i64 %{idx}, 1",
            f"  %{L}.d = icmp eq i64 %{idx}.n, {n}",
            f"  br i1 %{L}.d, label %{L}.x, label %{L}.body", f"{L}.x:"]
    for a, t, init, nxt in accs:
        srcs = (f"[{init}, %{L}.pre], " if guard else "") + f"[{nxt}, %{L}.latch]"
        out.append(f"  %{a}.out = phi {t} {srcs}")
    return "\n".join(out) + "\n"


def module(body: str, target: Target) -> str:
    """A complete module: the functions, the intrinsic declarations they call, the attributes."""
    used = sorted(set(re.findall(r"@(llvm\.[\w.]+)\(", body)))
    decls = "\n".join(_INTRINSICS[u] for u in used)
    return f"{body}\n{decls}\n\nattributes #0 = {{ {fn_attrs(target)} }}\n"


def row_kernel(name: str, params: tuple[str, ...], pointers: set[str], body: str, target: Target,
               floats: frozenset[str] = frozenset(), prologue: str = "", extra: str = "",
               parallel: str = "rows") -> KernelSource:
    """A kernel looping %m over [begin, end) around `body` (which may use %m and the args)."""
    fn = f"""{extra}
define void @{name}(ptr noalias %args, i64 %begin, i64 %end) #0 {{
entry:
{load_args(params, pointers, floats)}
{prologue}
{loop("row", "m", "%end", body, start="%begin", guard=True)}  ret void
}}
"""
    return KernelSource(name, module(fn, target), params, parallel)


def row_ptr(name: str, base: str, ld: str, ty: str = "float", m: str = "%m") -> str:
    """%name = &base[m * ld]."""
    return (f"  %{name}.o = mul nsw i64 {m}, {ld}\n"
            f"  %{name} = getelementptr inbounds {ty}, ptr %{base}, i64 %{name}.o")


def sumsq(L: str, src: str, n: int, out: str) -> str:
    """%out.out = sum of src[i]^2 over i < n (a reassociable reduction)."""
    return loop(L, f"{L}.i", n, f"""  %{L}.p = getelementptr inbounds float, ptr {src}, i64 %{L}.i
  %{L}.v = load float, ptr %{L}.p, align 4
  %{L}.q = fmul reassoc contract float %{L}.v, %{L}.v
  %{out}.n = fadd reassoc contract float %{out}, %{L}.q""", accs=[(out, "float", "0.0", f"%{out}.n")])


def rsqrt_mean(out: str, ss: str, n: int) -> str:
    """%out = 1 / sqrt(ss / n + eps), as the reference's rms_norm computes it."""
    return f"""  %{out}.ms = fdiv float {ss}, {f32(n)}
  %{out}.me = fadd float %{out}.ms, %eps
  %{out}.rt = call float @llvm.sqrt.f32(float %{out}.me)
  %{out} = fdiv float 1.0, %{out}.rt"""


# --------------------------------------------------------------------------------------- rms_norm

def rms_norm(C: int, group: int, target: Target) -> KernelSource:
    """y = x / sqrt(mean(x^2) + eps) * w over each group of `group` values (group 0: the row)."""
    dims("rms_norm", C=C)
    dims("rms_norm", lo=0, group=group)
    G = group or C
    require("rms_norm", C % G == 0, f"width {C} is not whole groups of {G}")
    params = ("x", "w", "y", "ldx", "ldy", "eps")
    inner = f"""  %go = mul nuw nsw i64 %g, {G}
  %xg = getelementptr inbounds float, ptr %xr, i64 %go
  %yg = getelementptr inbounds float, ptr %yr, i64 %go
{sumsq("ss", "%xg", G, "s")}{rsqrt_mean("r", "%s.out", G)}
""" + loop("ap", "j", G, """  %xp = getelementptr inbounds float, ptr %xg, i64 %j
  %xv = load float, ptr %xp, align 4
  %wp = getelementptr inbounds float, ptr %w, i64 %j
  %wv = load float, ptr %wp, align 4
  %t = fmul float %xv, %r
  %o = fmul float %t, %wv
  %yp = getelementptr inbounds float, ptr %yg, i64 %j
  store float %o, ptr %yp, align 4""")
    body = f"""{row_ptr("xr", "x", "%ldx")}
{row_ptr("yr", "y", "%ldy")}
{loop("grp", "g", C // G, inner)}"""
    return row_kernel(f"rms_norm_c{C}_g{group}", params, {"x", "w", "y"}, body, target, floats=frozenset({"eps"}))


# ------------------------------------------------------------------------------------------ route

def route(E: int, k: int, norm: bool, target: Target) -> KernelSource:
    """Softmax over E logits, keep the k largest probabilities (ties: lower index), optionally renormalised."""
    dims("route", E=E, k=k)
    one_of("route", "norm", norm, (True, False))
    require("route", k <= E, f"top-k {k} of {E} experts")
    params = ("x", "y", "ldx", "ldy")
    body = f"""{row_ptr("xr", "x", "%ldx")}
{row_ptr("yr", "y", "%ldy")}
""" + loop("mx", "i", E, """  %xp = getelementptr inbounds float, ptr %xr, i64 %i
  %xv = load float, ptr %xp, align 4
  %gt = fcmp ogt float %xv, %mx
  %mx.n = select i1 %gt, float %xv, float %mx""", accs=[("mx", "float", NEG_INF, "%mx.n")]) + loop(
        "ex", "i2", E, """  %xp2 = getelementptr inbounds float, ptr %xr, i64 %i2
  %xv2 = load float, ptr %xp2, align 4
  %xs = fsub float %xv2, %mx.out
  %e = call float @llvm.exp.f32(float %xs)
  %sp = getelementptr inbounds float, ptr %scr, i64 %i2
  store float %e, ptr %sp, align 4
  %s.n = fadd reassoc contract float %s, %e""", accs=[("s", "float", "0.0", "%s.n")]) + loop(
        "pr", "i3", E, """  %sp3 = getelementptr inbounds float, ptr %scr, i64 %i3
  %e3 = load float, ptr %sp3, align 4
  %p3 = fdiv float %e3, %s.out
  store float %p3, ptr %sp3, align 4
  %yp3 = getelementptr inbounds float, ptr %yr, i64 %i3
  store float 0.0, ptr %yp3, align 4""")
    # k rounds of "first index of the largest remaining probability"; taken entries become -1
    pick = loop("am", "i4", E, """  %sp4 = getelementptr inbounds float, ptr %scr, i64 %i4
  %v4 = load float, ptr %sp4, align 4
  %gt4 = fcmp ogt float %v4, %best
  %best.n = select i1 %gt4, float %v4, float %best
  %bi.n = select i1 %gt4, i64 %i4, i64 %bi""", accs=[("best", "float", "-2.0", "%best.n"), ("bi", "i64", "0", "%bi.n")])
    pick += """  %ysel = getelementptr inbounds float, ptr %yr, i64 %bi.out
  store float %best.out, ptr %ysel, align 4
  %ssel = getelementptr inbounds float, ptr %scr, i64 %bi.out
  store float -1.0, ptr %ssel, align 4"""
    body += loop("sel", "r", k, pick)
    if norm:
        body += loop("tot", "i5", E, """  %yp5 = getelementptr inbounds float, ptr %yr, i64 %i5
  %y5 = load float, ptr %yp5, align 4
  %t.n = fadd reassoc contract float %t, %y5""", accs=[("t", "float", "0.0", "%t.n")]) + loop(
            "nrm", "i6", E, """  %yp6 = getelementptr inbounds float, ptr %yr, i64 %i6
  %y6 = load float, ptr %yp6, align 4
  %q6 = fdiv float %y6, %t.out
  store float %q6, ptr %yp6, align 4""")
    # logits with NaN or +inf (an overflowing router) leave a NaN sum: every weight NaN, so the
    # MoE routes every expert with it and the NaN reaches the logits (where the runtime reports
    # it) instead of a pick among NaN probabilities choosing some expert with a finite weight
    body += "\n  %bad = fcmp uno float %s.out, 0.0\n" + loop("nan", "i7", E, """  %yp7 = getelementptr inbounds float, ptr %yr, i64 %i7
  %y7 = load float, ptr %yp7, align 4
  %q7 = select i1 %bad, float 0x7FF8000000000000, float %y7
  store float %q7, ptr %yp7, align 4""")
    return row_kernel(f"route_e{E}_k{k}{'_norm' if norm else ''}", params, {"x", "y"}, body, target,
                      prologue=f"  %scr = alloca [{E} x float], align 64")


# ------------------------------------------------------------------------------------------ embed

def embed(D: int, target: Target) -> KernelSource:
    """y[m] = table[ids[m]] (the executor checks the ids against the table's rows first)."""
    dims("embed", D=D)
    params = ("ids", "table", "y", "ldy")
    body = f"""  %idp = getelementptr inbounds i64, ptr %ids, i64 %m
  %id = load i64, ptr %idp, align 8
{row_ptr("tr", "table", D, m="%id")}
{row_ptr("yr", "y", "%ldy")}
""" + loop("cp", "j", D, """  %tp = getelementptr inbounds float, ptr %tr, i64 %j
  %tv = load float, ptr %tp, align 4
  %yp = getelementptr inbounds float, ptr %yr, i64 %j
  store float %tv, ptr %yp, align 4""")
    return row_kernel(f"embed_d{D}", params, {"ids", "table", "y"}, body, target)


# ----------------------------------------------------------------------------------- binary/unary

def binary(op: str, C: int, b_cols: int, target: Target) -> KernelSource:
    """y = a op b, b with C columns or 1 (broadcast along the row)."""
    one_of("binary", "op", op, ("add", "mul"))
    dims("binary", C=C, b_cols=b_cols)
    require("binary", b_cols in (C, 1), f"an operand of {b_cols} columns for a result of {C}")
    params = ("a", "b", "y", "lda", "ldb", "ldy")
    inst = "fadd" if op == "add" else "fmul"
    if b_cols == 1:
        bload, bval = "", "%bv0"
        pre = "  %bv0 = load float, ptr %br, align 4\n"
    else:
        bload = """  %bp = getelementptr inbounds float, ptr %br, i64 %j
  %bv = load float, ptr %bp, align 4\n"""
        bval, pre = "%bv", ""
    body = f"""{row_ptr("ar", "a", "%lda")}
{row_ptr("br", "b", "%ldb")}
{row_ptr("yr", "y", "%ldy")}
{pre}""" + loop("el", "j", C, f"""  %ap = getelementptr inbounds float, ptr %ar, i64 %j
  %av = load float, ptr %ap, align 4
{bload}  %o = {inst} float %av, {bval}
  %yp = getelementptr inbounds float, ptr %yr, i64 %j
  store float %o, ptr %yp, align 4""")
    return row_kernel(f"binary_{op}_c{C}_b{b_cols}", params, {"a", "b", "y"}, body, target)


def _unary_op(op: str, x: str, o: str) -> str:
    if op == "silu":
        return f"""  {o}.ng = fneg float {x}
  {o}.e = call float @llvm.exp.f32(float {o}.ng)
  {o}.d = fadd float {o}.e, 1.0
  {o} = fdiv float {x}, {o}.d"""
    if op == "sigmoid":
        return f"""  {o}.ng = fneg float {x}
  {o}.e = call float @llvm.exp.f32(float {o}.ng)
  {o}.d = fadd float {o}.e, 1.0
  {o} = fdiv float 1.0, {o}.d"""
    one_of("unary", "op", op, ("clamp",))
    return clamp(x, o, "%limit", "%nlimit")


def clamp(x: str, o: str, hi: str, lo: str) -> str:
    """{o} = min(max(x, lo), hi) as np.clip computes it (NaN stays NaN)."""
    return f"""  {o}.lt = fcmp olt float {x}, {lo}
  {o}.a = select i1 {o}.lt, float {lo}, float {x}
  {o}.gt = fcmp ogt float {o}.a, {hi}
  {o} = select i1 {o}.gt, float {hi}, float {o}.a"""


def unary(op: str, C: int, target: Target) -> KernelSource:
    """y = silu(x) | sigmoid(x) | clip(x, -limit, limit) (limit is ignored by silu and sigmoid)."""
    one_of("unary", "op", op, ("silu", "sigmoid", "clamp"))
    dims("unary", C=C)
    params = ("x", "y", "ldx", "ldy", "limit")
    body = f"""{row_ptr("xr", "x", "%ldx")}
{row_ptr("yr", "y", "%ldy")}
""" + loop("el", "j", C, f"""  %xp = getelementptr inbounds float, ptr %xr, i64 %j
  %xv = load float, ptr %xp, align 4
{_unary_op(op, "%xv", "%o")}
  %yp = getelementptr inbounds float, ptr %yr, i64 %j
  store float %o, ptr %yp, align 4""")
    return row_kernel(f"unary_{op}_c{C}", params, {"x", "y"}, body, target, floats=frozenset({"limit"}),
                      prologue="  %nlimit = fneg float %limit")


def slice_copy(start: int, stop: int, target: Target) -> KernelSource:
    """y[m, 0:stop-start] = x[m, start:stop]."""
    dims("slice_copy", lo=0, start=start)
    dims("slice_copy", stop=stop)
    require("slice_copy", start < stop, f"slice [{start}, {stop}) is empty")
    params = ("x", "y", "ldx", "ldy")
    body = f"""  %xo0 = mul nsw i64 %m, %ldx
  %xo = add nsw i64 %xo0, {start}
  %xr = getelementptr inbounds float, ptr %x, i64 %xo
{row_ptr("yr", "y", "%ldy")}
""" + loop("cp", "j", stop - start, """  %xp = getelementptr inbounds float, ptr %xr, i64 %j
  %xv = load float, ptr %xp, align 4
  %yp = getelementptr inbounds float, ptr %yr, i64 %j
  store float %xv, ptr %yp, align 4""")
    return row_kernel(f"slice_copy_{start}_{stop}", params, {"x", "y"}, body, target)


# ------------------------------------------------------------------------------------ quantize_q8

def _splat32(v: str, t: str = "float") -> str:
    return "<" + ", ".join(f"{t} {v}" for _ in range(Q8_BLOCK)) + ">"


def _codes(t: str, out: str) -> str:
    """IR for %{out}.f (rint(%t) clipped to +-127, NaN as 0, f32) and %{out}.q (as i8)."""
    return f"""  %{out}.rn = call <32 x float> @llvm.roundeven.v32f32(<32 x float> %{t})
  %{out}.lo = fcmp olt <32 x float> %{out}.rn, {_splat32("-127.0")}
  %{out}.c1 = select <32 x i1> %{out}.lo, <32 x float> {_splat32("-127.0")}, <32 x float> %{out}.rn
  %{out}.hi = fcmp ogt <32 x float> %{out}.c1, {_splat32("127.0")}
  %{out}.c2 = select <32 x i1> %{out}.hi, <32 x float> {_splat32("127.0")}, <32 x float> %{out}.c1
  %{out}.nan = fcmp uno <32 x float> %{out}.c2, zeroinitializer
  %{out}.f = select <32 x i1> %{out}.nan, <32 x float> zeroinitializer, <32 x float> %{out}.c2
  %{out}.q = fptosi <32 x float> %{out}.f to <32 x i8>"""


# a block's scale d = max|x| / 127 and %t = x / d (0 for an all-zero block)
_BLOCK_SCALE = """  %v = load <32 x float>, ptr %src, align 4
  %a = call <32 x float> @llvm.fabs.v32f32(<32 x float> %v)
  %mx = call float @llvm.vector.reduce.fmax.v32f32(<32 x float> %a)
  %d = fdiv float %mx, 127.0
  %pos = fcmp ogt float %d, 0.0
  %rc = fdiv float 1.0, %d
  %inv = select i1 %pos, float %rc, float 0.0
  %i0 = insertelement <32 x float> poison, float %inv, i64 0
  %iv = shufflevector <32 x float> %i0, <32 x float> poison, <32 x i32> zeroinitializer
  %t = fmul <32 x float> %v, %iv
"""

_Q8_BLOCK_FN = f"""
define internal void @q8_block(ptr noalias %src, ptr noalias %q, ptr noalias %dp, ptr noalias %sp) alwaysinline #0 {{
entry:
{_BLOCK_SCALE}{_codes("t", "c")}
  store <32 x i8> %c.q, ptr %q, align 1
  store float %d, ptr %dp, align 4
  %qw = sext <32 x i8> %c.q to <32 x i32>
  %s = call i32 @llvm.vector.reduce.add.v32i32(<32 x i32> %qw)
  store i32 %s, ptr %sp, align 4
  ret void
}}
"""

_Q16_BLOCK_FN = f"""
define internal void @q16_block(ptr noalias %src, ptr noalias %q, ptr noalias %q2, ptr noalias %dp,
                                ptr noalias %sp) alwaysinline #0 {{
entry:
{_BLOCK_SCALE}{_codes("t", "c")}
  %d0 = insertelement <32 x float> poison, float %d, i64 0
  %dv = shufflevector <32 x float> %d0, <32 x float> poison, <32 x i32> zeroinitializer
  %nc = fneg <32 x float> %c.f
  %r = call <32 x float> @llvm.fma.v32f32(<32 x float> %nc, <32 x float> %dv, <32 x float> %v)
  %inv2 = fmul float %inv, 256.0
  %j0 = insertelement <32 x float> poison, float %inv2, i64 0
  %jv = shufflevector <32 x float> %j0, <32 x float> poison, <32 x i32> zeroinitializer
  %t2 = fmul <32 x float> %r, %jv
{_codes("t2", "e")}
  store <32 x i8> %c.q, ptr %q, align 1
  store <32 x i8> %e.q, ptr %q2, align 1
  %d2 = fmul float %d, 0x3F70000000000000
  store float %d2, ptr %dp, align 4
  %qw = sext <32 x i8> %c.q to <32 x i32>
  %s1 = call i32 @llvm.vector.reduce.add.v32i32(<32 x i32> %qw)
  %qw2 = sext <32 x i8> %e.q to <32 x i32>
  %s2 = call i32 @llvm.vector.reduce.add.v32i32(<32 x i32> %qw2)
  %s1s = shl i32 %s1, 8
  %s = add i32 %s1s, %s2
  store i32 %s, ptr %sp, align 4
  ret void
}}
"""


def quantize_q8(K: int, target: Target, pairs: bool = False, planes: int = 1) -> KernelSource:
    """Per row, blocks of 32 (the last zero-padded): d = max|x| / 127, q = clip(rint(x * (1/d)), +-127).

    Writes xq i8[M, Kp] (row stride Kp), xd f32[M, NG] (d) and xs i32[M, NG] (sum of the block's q).
    `pairs`: xq in the pair layout of int4's AVX2 kernels (codegen/dot.py: pair_layout): per two
    blocks [first[0:16], second[0:16], first[16:32], second[16:32]]; xd and xs keep block order.
    `planes` = 2 (q16): a second plane of codes q2 = clip(rint((x - q d) * 256 / d), +-127) after
    the first (row stride 2 Kp), xd = d / 256 and xs = 256 sum q + sum q2: x = (256 q + q2) xd to
    about 15 bits, and the kernels' integer dots become 256 dot(w, q) + dot(w, q2).
    """
    dims("quantize_q8", K=K)
    one_of("quantize_q8", "pairs", pairs, (True, False))
    dims("quantize_q8", lo=1, hi=2, planes=planes)
    NG = -(-K // Q8_BLOCK)
    Kp = NG * Q8_BLOCK
    NF, rem = divmod(K, Q8_BLOCK)
    params = ("x", "xq", "xd", "xs", "ldx")
    body = f"""{row_ptr("xr", "x", "%ldx")}
{row_ptr("qr", "xq", planes * Kp, ty="i8")}
{row_ptr("dr", "xd", NG)}
{row_ptr("sr", "xs", NG, ty="i32")}
"""

    def block(x: str, q: str, d: str, sm: str) -> str:
        if planes == 1:
            return f"  call void @q8_block(ptr {x}, ptr {q}, ptr {d}, ptr {sm})"
        return (f"  {q}.2 = getelementptr inbounds i8, ptr {q}, i64 {Kp}\n"
                f"  call void @q16_block(ptr {x}, ptr {q}, ptr {q}.2, ptr {d}, ptr {sm})")
    if NF:
        body += loop("blk", "g", NF, f"""  %go = mul nuw nsw i64 %g, 32
  %xg = getelementptr inbounds float, ptr %xr, i64 %go
  %qg = getelementptr inbounds i8, ptr %qr, i64 %go
  %dg = getelementptr inbounds float, ptr %dr, i64 %g
  %sg = getelementptr inbounds i32, ptr %sr, i64 %g
{block("%xg", "%qg", "%dg", "%sg")}""")
    if rem:
        body += f"""  %xt = getelementptr inbounds float, ptr %xr, i64 {NF * Q8_BLOCK}
  call void @llvm.memset.p0.i64(ptr align 64 %buf, i8 0, i64 {4 * Q8_BLOCK}, i1 false)
  call void @llvm.memcpy.p0.p0.i64(ptr align 64 %buf, ptr align 4 %xt, i64 {4 * rem}, i1 false)
  %qt = getelementptr inbounds i8, ptr %qr, i64 {NF * Q8_BLOCK}
  %dt = getelementptr inbounds float, ptr %dr, i64 {NF}
  %st = getelementptr inbounds i32, ptr %sr, i64 {NF}
{block("%buf", "%qt", "%dt", "%st")}
"""
    if pairs and NG >= 2:
        for plane in range(planes):
            body += loop(f"pairs{plane}", f"pp{plane}", NG // 2, f"""  %ppo{plane} = mul nuw nsw i64 %pp{plane}, 64
  %ppo{plane}.k = add nuw nsw i64 %ppo{plane}, {plane * Kp}
  %ppa{plane} = getelementptr inbounds i8, ptr %qr, i64 %ppo{plane}.k
  %ppb{plane} = getelementptr inbounds i8, ptr %ppa{plane}, i64 32
  %ppA{plane} = load <32 x i8>, ptr %ppa{plane}, align 1
  %ppB{plane} = load <32 x i8>, ptr %ppb{plane}, align 1
  %ppL{plane} = shufflevector <32 x i8> %ppA{plane}, <32 x i8> %ppB{plane}, """
                         + lanes(32, list(range(16)) + list(range(32, 48))) + f"""
  %ppH{plane} = shufflevector <32 x i8> %ppA{plane}, <32 x i8> %ppB{plane}, """
                         + lanes(32, list(range(16, 32)) + list(range(48, 64))) + f"""
  store <32 x i8> %ppL{plane}, ptr %ppa{plane}, align 1
  store <32 x i8> %ppH{plane}, ptr %ppb{plane}, align 1""")
    name = f"quantize_q8_k{K}{'_pairs' if pairs else ''}{'_q16' if planes == 2 else ''}"
    return row_kernel(name, params, {"x", "xq", "xd", "xs"}, body, target,
                      prologue=f"  %buf = alloca <{Q8_BLOCK} x float>, align 64" if rem else "",
                      extra=_Q8_BLOCK_FN if planes == 1 else _Q16_BLOCK_FN)
