"""Prefill kernels on AMX tiles (MoE and linear): int4/int8/int4a weights (group 32) against q8
activations, bit for bit as the row kernels compute each output (canon.py's order).

A prefill gives each expert many tokens, so its weights are worth unpacking once into the tile
layout and running through the matrix unit for every 16 of them. Each active expert's pairs are
gathered (by the binder) into contiguous q8 rows padded to a multiple of 16 (pad rows have scale 0).
A task owns 16 weight rows: it unpacks them into B tiles (per group of 32: 8 rows of 64 bytes,
four consecutive k of each of the 16 rows per dword: the layout tdpbssd reads), then for each
16-token tile, per group, one tdpbssd gives the 16 x 16 integer dot products; they are scaled by
weight scale x activation scale and summed in f32 in canon.py's lanes (the scales differ per
group, so every group is its own tile product, as llama.cpp's AMX kernels do).

  amx_moe_gate_up  h[r, n] = silu(gate_e[n] . x[r]) * (up_e[n] . x[r]), r over the padded rows
                   of expert e; tasks: nA * I/16 blocks of rows
  amx_moe_down     y[tok_r, n] = residual + sum_r pw[r] * down_e[n] . h[r]; tasks: D/16 blocks
                   of output columns (a task owns them: no write conflicts)
  amx_linear       y[m, n] = epilogue(W[n] . x[m]) (bias, silu_mul, residual as linear.py's);
                   tasks: N/16 blocks of output rows

Legend: NG groups of a row, Kp = 32 NG bytes of a q8 row, rb / sb bytes of a weight row / its
scales, nA active experts. The AMX state must be granted to the process (target.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..target import Target
from .common import KernelSource, dims, load_args, require
from .dot import PAIRED, finish_module

T = 16          # tokens of a tile (A rows), weight rows of a task (B columns)
GATE_UP_PARAMS = ("h", "x", "xd", "xs", "w", "s", "act", "pstart", "ptiles", "ldh")
DOWN_PARAMS = ("y", "r", "h", "hd", "hs", "w", "s", "act", "pstart", "ptiles", "ptok", "pw", "nA", "M", "ldy", "ldr")
_PTRS = {"h", "x", "xd", "xs", "w", "s", "act", "pstart", "ptiles", "y", "r", "hd", "hs", "ptok", "pw"}
FORMATS = ("int4", "int8", "int4a")
CHUNK = 64      # groups whose tile products a pass of tile_gemm keeps (64 KiB of i32 on the stack)

_DECLS = """
declare x86_amx @llvm.x86.tileloadd64.internal(i16, i16, ptr, i64)
declare x86_amx @llvm.x86.tilezero.internal(i16, i16)
declare x86_amx @llvm.x86.tdpbssd.internal(i16, i16, i16, x86_amx, x86_amx, x86_amx)
declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, x86_amx)
declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)
"""


@dataclass(frozen=True)
class AmxMoESpec:
    fmt: str          # gate_up's weight format
    dfmt: str         # down's
    D: int
    I: int
    residual: bool = False
    planes: int = 1     # q8 activations in 2 planes: q16 (elementwise.quantize_q8)

    @property
    def tag(self) -> str:
        return f"{self.fmt}_{self.dfmt}_d{self.D}_i{self.I}{'_r' if self.residual else ''}{'_q16' if self.planes == 2 else ''}"


def supported(target: Target, fmt: str, G: int, dfmt: str, dG: int, D: int, I: int) -> bool:
    """Whether the AMX kernels take this MoE op (q8 activations assumed)."""
    return (target.amx and fmt in FORMATS and dfmt in FORMATS and G == 32 and dG == 32
            and D % 32 == 0 and I % 32 == 0)


def _check(kernel: str, spec: AmxMoESpec) -> None:
    dims(kernel, D=spec.D, I=spec.I)
    require(kernel, spec.fmt in FORMATS and spec.dfmt in FORMATS, f"formats {spec.fmt}/{spec.dfmt} (int4, int8)")
    require(kernel, spec.D % 32 == 0 and spec.I % 32 == 0, "D and I multiples of 32")


def _row_bytes(fmt: str, ng: int) -> tuple[int, int]:
    return (32 if fmt == "int8" else 16) * ng, (4 if fmt == "int4a" else 2) * ng


def unpack_function(fmt: str, ng: int, name: str) -> str:
    """`void name(ptr w, ptr s, ptr B, ptr dsc, ptr msc)`: 16 rows from w (stride rb) into ng B
    tiles of 512 bytes at B (signed values; int4's 0..15 become -8..7, int4a's stay 0..15), their
    scales as f32 [ng][16] at dsc (int4a: and its minima at msc)."""
    rb, sb = _row_bytes(fmt, ng)
    nib = fmt != "int8"
    per = 16 if nib else 32
    off = "8" if fmt == "int4" else "0"
    out = [f"""define internal void @{name}(ptr %w, ptr %s, ptr %B, ptr %dsc, ptr %msc) #0 {{
entry:
  br label %loop
loop:
  %g = phi i64 [0, %entry], [%g1, %loop]
  %wo = mul nuw nsw i64 %g, {per}
  %bo = mul nuw nsw i64 %g, 512
  %bp = getelementptr inbounds i8, ptr %B, i64 %bo"""]
    for n in range(T):
        out.append(f"""  %o{n} = add nuw nsw i64 %wo, {n * rb}
  %p{n} = getelementptr inbounds i8, ptr %w, i64 %o{n}
  %c{n} = load <{per} x i8>, ptr %p{n}, align 1""")
    if nib:
        # rows n..n+3 in one 64-byte vector (16 bytes each); low nibbles are k 0..15, high 16..31
        for q in range(8):
            out.append(f"  %q{q} = shufflevector <16 x i8> %c{2 * q}, <16 x i8> %c{2 * q + 1}, "
                       f"<32 x i32> <{', '.join(f'i32 {i}' for i in range(32))}>")
        for z in range(4):
            out.append(f"""  %z{z} = shufflevector <32 x i8> %q{2 * z}, <32 x i8> %q{2 * z + 1}, <64 x i32> <{', '.join(f'i32 {i}' for i in range(64))}>
  %l{z}.0 = and <64 x i8> %z{z}, <{', '.join(['i8 15'] * 64)}>
  %l{z}.1 = sub <64 x i8> %l{z}.0, <{', '.join([f'i8 {off}'] * 64)}>
  %l{z} = bitcast <64 x i8> %l{z}.1 to <16 x i32>
  %h{z}.0 = lshr <64 x i8> %z{z}, <{', '.join(['i8 4'] * 64)}>
  %h{z}.1 = sub <64 x i8> %h{z}.0, <{', '.join([f'i8 {off}'] * 64)}>
  %h{z} = bitcast <64 x i8> %h{z}.1 to <16 x i32>""")
        for kk in range(8):
            src, j = ("l" if kk < 4 else "h"), kk % 4
            m8 = ", ".join(f"i32 {4 * i + j}" for i in range(8))
            out.append(f"""  %a{kk} = shufflevector <16 x i32> %{src}0, <16 x i32> %{src}1, <8 x i32> <{m8}>
  %b{kk} = shufflevector <16 x i32> %{src}2, <16 x i32> %{src}3, <8 x i32> <{m8}>
  %r{kk} = shufflevector <8 x i32> %a{kk}, <8 x i32> %b{kk}, <16 x i32> <{', '.join(f'i32 {i}' for i in range(16))}>""")
    else:
        # row n: 8 dwords of 4 k each; B row kk = dword kk of rows 0..15
        for q in range(8):
            out.append(f"  %d{2 * q} = bitcast <32 x i8> %c{2 * q} to <8 x i32>\n"
                       f"  %d{2 * q + 1} = bitcast <32 x i8> %c{2 * q + 1} to <8 x i32>\n"
                       f"  %pp{q} = shufflevector <8 x i32> %d{2 * q}, <8 x i32> %d{2 * q + 1}, "
                       f"<16 x i32> <{', '.join(f'i32 {i}' for i in range(16))}>")
        for kk in range(8):
            m4 = ", ".join(f"i32 {v}" for v in (kk, 8 + kk, 16 + kk, 24 + kk))
            out.append(f"""  %e{kk}.0 = shufflevector <16 x i32> %pp0, <16 x i32> %pp1, <4 x i32> <{m4}>
  %e{kk}.1 = shufflevector <16 x i32> %pp2, <16 x i32> %pp3, <4 x i32> <{m4}>
  %e{kk}.2 = shufflevector <16 x i32> %pp4, <16 x i32> %pp5, <4 x i32> <{m4}>
  %e{kk}.3 = shufflevector <16 x i32> %pp6, <16 x i32> %pp7, <4 x i32> <{m4}>
  %f{kk}.0 = shufflevector <4 x i32> %e{kk}.0, <4 x i32> %e{kk}.1, <8 x i32> <{', '.join(f'i32 {i}' for i in range(8))}>
  %f{kk}.1 = shufflevector <4 x i32> %e{kk}.2, <4 x i32> %e{kk}.3, <8 x i32> <{', '.join(f'i32 {i}' for i in range(8))}>
  %r{kk} = shufflevector <8 x i32> %f{kk}.0, <8 x i32> %f{kk}.1, <16 x i32> <{', '.join(f'i32 {i}' for i in range(16))}>""")
    for kk in range(8):
        out.append(f"""  %rp{kk} = getelementptr inbounds i8, ptr %bp, i64 {64 * kk}
  store <16 x i32> %r{kk}, ptr %rp{kk}, align 64""")
    # the 16 rows' scales (and minima) of group g
    for arr, at in (("d", 0), ("m", 2)) if fmt == "int4a" else (("d", 0),):
        out.append(f"  %{arr}so = mul nuw nsw i64 %g, {sb // ng}")
        prev = "poison"
        for n in range(T):
            out.append(f"""  %{arr}p{n}.o = add nuw nsw i64 %{arr}so, {n * sb + at}
  %{arr}p{n} = getelementptr inbounds i8, ptr %s, i64 %{arr}p{n}.o
  %{arr}h{n} = load half, ptr %{arr}p{n}, align 2
  %{arr}v{n} = insertelement <16 x half> {prev}, half %{arr}h{n}, i64 {n}""")
            prev = f"%{arr}v{n}"
        out.append(f"""  %{arr}f = fpext <16 x half> {prev} to <16 x float>
  %{arr}o = mul nuw nsw i64 %g, 64
  %{arr}dp = getelementptr inbounds i8, ptr {'%dsc' if arr == 'd' else '%msc'}, i64 %{arr}o
  store <16 x float> %{arr}f, ptr %{arr}dp, align 64""")
    out.append(f"""{_next('g', ng, 'loop', 'exit')}
exit:
  ret void
}}
""")
    return "\n".join(out)


def gemm_function(ng: int, name: str, paired: bool, planes: int = 1) -> str:
    """`void name(ptr x, ptr xd, ptr xs, ptr B, ptr dsc, ptr msc, ptr out)`: out[m][n] (16 x 16 f32)
    = the dot of x row m and B column n over ng groups in canon.py's order: per group one tile
    product (exact i32 sums), then per token m its 8 accumulator lanes (vectors over the 16
    columns) take fma(sum, dsc[g] * xd[m][g]) in lane g mod 8 (paired formats: then fma(xs[m][g],
    msc[g] * xd[m][g])); the lanes are folded at the end. x rows of Kp = 32 ng bytes (planes = 2,
    q16: 2 Kp, the second plane's product added to 256 x the first's in i32), xd / xs rows of ng
    values. Tile products are kept for CHUNK groups at a time (CHUNK / 2 with two planes), the
    accumulators between chunks in memory."""
    from .canon import fold_vectors

    kp = 32 * ng
    stride = planes * kp
    chunk = CHUNK // planes
    tb = 1024 * planes        # bytes of a group's tile products

    def planes_sum(t: str) -> str:
        """The two planes' i32 products as 256 x first + second (a group's second tile follows its first)."""
        if planes == 1:
            return f"\n  {t}.ci = add <16 x i32> {t}.c1, zeroinitializer"
        return f"""
  {t}.cp2 = getelementptr inbounds i8, ptr {t}.cp, i64 1024
  {t}.c2 = load <16 x i32>, ptr {t}.cp2, align 64
  {t}.ch = shl <16 x i32> {t}.c1, <{', '.join(['i32 8'] * 16)}>
  {t}.ci = add <16 x i32> {t}.ch, {t}.c2"""

    def second_tile(c: str) -> str:
        """The second plane's tile product of the group, stored after the first's."""
        if planes == 1:
            return ""
        return f"""
  %{c}.xa2 = getelementptr inbounds i8, ptr %{c}.ap, i64 {kp}
  %{c}.ta2 = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 32, ptr %{c}.xa2, i64 {stride})
  %{c}.tz2 = call x86_amx @llvm.x86.tilezero.internal(i16 16, i16 64)
  %{c}.tc2 = call x86_amx @llvm.x86.tdpbssd.internal(i16 16, i16 64, i16 32, x86_amx %{c}.tz2, x86_amx %{c}.ta2, x86_amx %{c}.tb)
  %{c}.cp2 = getelementptr inbounds i8, ptr %{c}.cp, i64 1024
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %{c}.cp2, i64 64, x86_amx %{c}.tc2)"""
    V = "<16 x float>"
    out = [f"""define internal void @{name}(ptr %x, ptr %xd, ptr %xs, ptr %B, ptr %dsc, ptr %msc, ptr %out) #0 {{
entry:
  %cbuf = alloca [{256 * planes * min(ng, chunk)} x i32], align 64
  %abuf = alloca [2048 x float], align 64
  call void @llvm.memset.p0.i64(ptr align 64 %abuf, i8 0, i64 8192, i1 false)
  br label %c0"""]

    def group(c: str, j: int, gl: str, acc: str) -> str:
        """IR for group (chunk-local index gl) of token %{c}.m into lane j's accumulator."""
        t = f"%{c}.j{j}"
        ir = f"""  {t}.g = add nuw nsw i64 {gl}, %{c}.c0
  {t}.co0 = mul nuw nsw i64 {gl}, {tb}
  {t}.co = add nuw nsw i64 {t}.co0, %{c}.mo
  {t}.cp = getelementptr inbounds i8, ptr %cbuf, i64 {t}.co
  {t}.c1 = load <16 x i32>, ptr {t}.cp, align 64{planes_sum(t)}
  {t}.cf = sitofp <16 x i32> {t}.ci to {V}
  {t}.wo = mul nuw nsw i64 {t}.g, 64
  {t}.wp = getelementptr inbounds i8, ptr %dsc, i64 {t}.wo
  {t}.dw = load {V}, ptr {t}.wp, align 64
  {t}.xo = add nuw nsw i64 %{c}.xr, {t}.g
  {t}.xp = getelementptr inbounds float, ptr %xd, i64 {t}.xo
  {t}.dx = load float, ptr {t}.xp, align 4
  {t}.dv = insertelement {V} poison, float {t}.dx, i64 0
  {t}.ds = shufflevector {V} {t}.dv, {V} poison, <16 x i32> zeroinitializer
  {t}.sc = fmul {V} {t}.dw, {t}.ds
  {t}.a = call {V} @llvm.fma.v16f32({V} {t}.cf, {V} {t}.sc, {V} {acc})"""
        if paired:
            ir += f"""
  {t}.mp = getelementptr inbounds i8, ptr %msc, i64 {t}.wo
  {t}.mw = load {V}, ptr {t}.mp, align 64
  {t}.ms = fmul {V} {t}.mw, {t}.ds
  {t}.bp = getelementptr inbounds i32, ptr %xs, i64 {t}.xo
  {t}.bs = load i32, ptr {t}.bp, align 4
  {t}.bf = sitofp i32 {t}.bs to float
  {t}.bv = insertelement {V} poison, float {t}.bf, i64 0
  {t}.bb = shufflevector {V} {t}.bv, {V} poison, <16 x i32> zeroinitializer
  {t}.am = call {V} @llvm.fma.v16f32({V} {t}.bb, {V} {t}.ms, {V} {t}.a)"""
        return ir, f"{t}.{'am' if paired else 'a'}"

    chunks = list(range(0, ng, chunk))
    for ci, c0 in enumerate(chunks):
        c = f"c{ci}"
        n = min(chunk, ng - c0)
        nb, rem = divmod(n, 8)
        after = f"c{ci + 1}" if ci + 1 < len(chunks) else "fold"
        out.append(f"""{c}:
  %{c}.c0 = add i64 0, {c0}
  br label %{c}.t
{c}.t:
  %{c}.i = phi i64 [0, %{c}], [%{c}.i1, %{c}.t]
  %{c}.g = add nuw nsw i64 %{c}.i, {c0}
  %{c}.ao = mul nuw nsw i64 %{c}.g, 32
  %{c}.ap = getelementptr inbounds i8, ptr %x, i64 %{c}.ao
  %{c}.bo = mul nuw nsw i64 %{c}.g, 512
  %{c}.bp = getelementptr inbounds i8, ptr %B, i64 %{c}.bo
  %{c}.ta = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 32, ptr %{c}.ap, i64 {stride})
  %{c}.tb = call x86_amx @llvm.x86.tileloadd64.internal(i16 8, i16 64, ptr %{c}.bp, i64 64)
  %{c}.tz = call x86_amx @llvm.x86.tilezero.internal(i16 16, i16 64)
  %{c}.tc = call x86_amx @llvm.x86.tdpbssd.internal(i16 16, i16 64, i16 32, x86_amx %{c}.tz, x86_amx %{c}.ta, x86_amx %{c}.tb)
  %{c}.co = mul nuw nsw i64 %{c}.i, {tb}
  %{c}.cp = getelementptr inbounds i8, ptr %cbuf, i64 %{c}.co
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %{c}.cp, i64 64, x86_amx %{c}.tc){second_tile(c)}
  %{c}.i1 = add nuw nsw i64 %{c}.i, 1
  %{c}.td = icmp eq i64 %{c}.i1, {n}
  br i1 %{c}.td, label %{c}.row, label %{c}.t
{c}.row:
  %{c}.m = phi i64 [0, %{c}.t], [%{c}.m1, %{c}.end]
  %{c}.mo = mul nuw nsw i64 %{c}.m, 64
  %{c}.xr = mul nuw nsw i64 %{c}.m, {ng}
  %{c}.ao2 = mul nuw nsw i64 %{c}.m, 512
  %{c}.abp = getelementptr inbounds i8, ptr %abuf, i64 %{c}.ao2""")
        accs = []
        for j in range(8):
            out.append(f"""  %{c}.ap{j} = getelementptr inbounds i8, ptr %{c}.abp, i64 {64 * j}
  %{c}.l{j} = load {V}, ptr %{c}.ap{j}, align 64""")
            accs.append(f"%{c}.l{j}")
        if nb:
            out.append(f"  br label %{c}.b\n{c}.b:\n  %{c}.bi = phi i64 [0, %{c}.row], [%{c}.bi1, %{c}.b]")
            phis = [f"%{c}.p{j}" for j in range(8)]
            body, new = [], []
            for j in range(8):
                body.append(f"  %{c}.b8.{j} = mul nuw nsw i64 %{c}.bi, 8\n  %{c}.gl{j} = add nuw nsw i64 %{c}.b8.{j}, {j}")
                ir, a = group(c, j, f"%{c}.gl{j}", phis[j])
                body.append(ir.replace(f"%{c}.j{j}", f"%{c}.bj{j}"))
                new.append(a.replace(f"%{c}.j{j}", f"%{c}.bj{j}"))
            for j in range(8):
                out.append(f"  {phis[j]} = phi {V} [{accs[j]}, %{c}.row], [{new[j]}, %{c}.b]")
            out += body
            out.append(f"""  %{c}.bi1 = add nuw nsw i64 %{c}.bi, 1
  %{c}.bd = icmp eq i64 %{c}.bi1, {nb}
  br i1 %{c}.bd, label %{c}.r, label %{c}.b
{c}.r:""")
            accs = new
        for j in range(rem):
            ir, a = group(c, j, f"{8 * nb + j}", accs[j])
            out.append(ir)
            accs[j] = a
        for j in range(8):
            out.append(f"  store {V} {accs[j]}, ptr %{c}.ap{j}, align 64")
        out.append(f"""  br label %{c}.end
{c}.end:
  %{c}.m1 = add nuw nsw i64 %{c}.m, 1
  %{c}.md = icmp eq i64 %{c}.m1, {T}
  br i1 %{c}.md, label %{after}, label %{c}.row""")
    vs = [f"%f.l{j}" for j in range(8)]
    out.append(f"""fold:
  br label %f
f:
  %f.m = phi i64 [0, %fold], [%f.m1, %f]
  %f.ao = mul nuw nsw i64 %f.m, 512
  %f.abp = getelementptr inbounds i8, ptr %abuf, i64 %f.ao""")
    for j in range(8):
        out.append(f"""  %f.ap{j} = getelementptr inbounds i8, ptr %f.abp, i64 {64 * j}
  %f.l{j} = load {V}, ptr %f.ap{j}, align 64""")
    out.append(f"""{fold_vectors(vs, '%f.s', V)}
  %f.oo = mul nuw nsw i64 %f.m, 64
  %f.op = getelementptr inbounds i8, ptr %out, i64 %f.oo
  store {V} %f.s, ptr %f.op, align 64
  %f.m1 = add nuw nsw i64 %f.m, 1
  %f.d = icmp eq i64 %f.m1, {T}
  br i1 %f.d, label %exit, label %f
exit:
  ret void
}}
""")
    return "\n".join(out)


def _silu_mul(g: str, u: str, out: str) -> str:
    """IR for out = silu(g) * u over <16 x float> (canon.py's, as the row kernels compute it)."""
    from .canon import silu_mul

    return silu_mul(g, u, out, 16)


def _unpack_rows(row: str, tag: str, rb: int, sb: int, B: str, dsc: str, msc: str) -> str:
    """IR that unpacks the 16 weight rows from row `row` on (their data %w, scales %s) into B,
    dsc, msc."""
    return f"""  %{tag}.wo = mul nuw nsw i64 {row}, {rb}
  %{tag}.w = getelementptr inbounds i8, ptr %w, i64 %{tag}.wo
  %{tag}.so = mul nuw nsw i64 {row}, {sb}
  %{tag}.s = getelementptr inbounds i8, ptr %s, i64 %{tag}.so
  call void @unpack(ptr %{tag}.w, ptr %{tag}.s, ptr {B}, ptr {dsc}, ptr {msc})"""


def _q8_rows(a: str, r: str, ng: int, planes: int = 1) -> str:
    """%{a}p / %{a}dp / %{a}sp: the q8 activation rows from row `r` (32 bytes per group and plane,
    one f32 scale, one i32 block sum)."""
    return (f"  %{a}o = mul nuw nsw i64 {r}, {32 * ng * planes}\n  %{a}p = getelementptr inbounds i8, ptr %{a}, i64 %{a}o\n"
            f"  %{a}do = mul nuw nsw i64 {r}, {ng}\n  %{a}dp = getelementptr inbounds float, ptr %{a}d, i64 %{a}do\n"
            f"  %{a}sp = getelementptr inbounds i32, ptr %{a}s, i64 %{a}do")


def _tile_rows(pred: str) -> str:
    """A MoE tile's header: %t counts the expert's tiles (entered from `pred`), %r0 its first row."""
    return (f"  %t = phi i64 [0, %{pred}], [%t1, %tile.next]\n  %t16 = mul nuw nsw i64 %t, {T}\n"
            f"  %r0 = add nuw nsw i64 %ps, %t16")


def _next(i: str, bound, back: str, out: str) -> str:
    """A counted loop's latch: %{i}1 = %{i} + 1, then to `back` until it reaches `bound`, else `out`."""
    return (f"  %{i}1 = add nuw nsw i64 %{i}, 1\n  %{i}done = icmp eq i64 %{i}1, {bound}\n"
            f"  br i1 %{i}done, label %{out}, label %{back}")


def _finish(ir: str, target: Target) -> str:
    require("amx", target.amx, "a CPU with AMX-INT8 (granted to this process)")
    return finish_module(ir + _DECLS, target)


def gate_up(spec: AmxMoESpec, target: Target) -> KernelSource:
    _check("amx_moe_gate_up", spec)
    D, I = spec.D, spec.I
    ng = D // 32
    rb, sb = _row_bytes(spec.fmt, ng)
    name = f"amx_moe_gate_up_{spec.tag}"
    ir = unpack_function(spec.fmt, ng, "unpack") + gemm_function(ng, "tile_gemm", spec.fmt in PAIRED, spec.planes) + f"""
define void @{name}(ptr noalias %args, i64 %begin, i64 %end) #0 {{
entry:
{load_args(GATE_UP_PARAMS, _PTRS)}
  %Bg = alloca [{512 * ng} x i8], align 64
  %Bu = alloca [{512 * ng} x i8], align 64
  %dg = alloca [{16 * ng} x float], align 64
  %du = alloca [{16 * ng} x float], align 64
  %mg = alloca [{16 * ng} x float], align 64
  %mu = alloca [{16 * ng} x float], align 64
  %go = alloca [256 x float], align 64
  %uo = alloca [256 x float], align 64
  %empty = icmp sge i64 %begin, %end
  br i1 %empty, label %exit, label %blk
blk:
  %j = phi i64 [%begin, %entry], [%j1, %blk.next]
  %a = udiv i64 %j, {I // T}
  %nb = urem i64 %j, {I // T}
  %n0 = mul nuw nsw i64 %nb, {T}
  %ep = getelementptr inbounds i64, ptr %act, i64 %a
  %e = load i64, ptr %ep, align 8
  %psp = getelementptr inbounds i64, ptr %pstart, i64 %a
  %ps = load i64, ptr %psp, align 8
  %ntp = getelementptr inbounds i64, ptr %ptiles, i64 %a
  %nt = load i64, ptr %ntp, align 8
  %er = mul nuw nsw i64 %e, {2 * I}
  %gr = add nuw nsw i64 %er, %n0
  %ur = add nuw nsw i64 %gr, {I}
{_unpack_rows('%gr', 'gate', rb, sb, '%Bg', '%dg', '%mg')}
{_unpack_rows('%ur', 'up', rb, sb, '%Bu', '%du', '%mu')}
  %none = icmp sle i64 %nt, 0
  br i1 %none, label %blk.next, label %tile
tile:
{_tile_rows('blk')}
{_q8_rows('x', '%r0', ng, spec.planes)}
  call void @tile_gemm(ptr %xp, ptr %xdp, ptr %xsp, ptr %Bg, ptr %dg, ptr %mg, ptr %go)
  call void @tile_gemm(ptr %xp, ptr %xdp, ptr %xsp, ptr %Bu, ptr %du, ptr %mu, ptr %uo)
  br label %row
row:
  %m = phi i64 [0, %tile], [%m1, %row]
  %vo = mul nuw nsw i64 %m, {T}
  %gvp = getelementptr inbounds float, ptr %go, i64 %vo
  %gv = load <16 x float>, ptr %gvp, align 64
  %uvp = getelementptr inbounds float, ptr %uo, i64 %vo
  %uv = load <16 x float>, ptr %uvp, align 64
{_silu_mul('%gv', '%uv', '%hv')}
  %hr = add nuw nsw i64 %r0, %m
  %ho = mul nuw nsw i64 %hr, %ldh
  %ho2 = add nuw nsw i64 %ho, %n0
  %hp = getelementptr inbounds float, ptr %h, i64 %ho2
  store <16 x float> %hv, ptr %hp, align 4
{_next('m', T, 'row', 'tile.next')}
tile.next:
{_next('t', '%nt', 'tile', 'blk.next')}
blk.next:
{_next('j', '%end', 'blk', 'exit')}
exit:
  ret void
}}
"""
    return KernelSource(name, _finish(ir, target), GATE_UP_PARAMS, f"active experts x {T}-row blocks (nA * I/{T})")


def down(spec: AmxMoESpec, target: Target) -> KernelSource:
    _check("amx_moe_down", spec)
    D, I = spec.D, spec.I
    ng = I // 32
    rb, sb = _row_bytes(spec.dfmt, ng)
    name = f"amx_moe_down_{spec.tag}"
    init = ("""  %ro = mul nuw nsw i64 %m, %ldr
  %ro2 = add nuw nsw i64 %ro, %n0
  %rp = getelementptr inbounds float, ptr %r, i64 %ro2
  %rv = load <16 x float>, ptr %rp, align 4""" if spec.residual else
            "  %rv = fadd <16 x float> zeroinitializer, zeroinitializer")
    ir = unpack_function(spec.dfmt, ng, "unpack") + gemm_function(ng, "tile_gemm", spec.dfmt in PAIRED, spec.planes) + f"""
define void @{name}(ptr noalias %args, i64 %begin, i64 %end) #0 {{
entry:
{load_args(DOWN_PARAMS, _PTRS)}
  %B = alloca [{512 * ng} x i8], align 64
  %dsc = alloca [{16 * ng} x float], align 64
  %msc = alloca [{16 * ng} x float], align 64
  %ob = alloca [256 x float], align 64
  %empty = icmp sge i64 %begin, %end
  br i1 %empty, label %exit, label %blk
blk:
  %nb = phi i64 [%begin, %entry], [%nb1, %blk.next]
  %n0 = mul nuw nsw i64 %nb, {T}
  %mnone = icmp sle i64 %M, 0
  br i1 %mnone, label %experts, label %init
init:
  %m = phi i64 [0, %blk], [%m1, %init]
{init}
  %yo = mul nuw nsw i64 %m, %ldy
  %yo2 = add nuw nsw i64 %yo, %n0
  %yp = getelementptr inbounds float, ptr %y, i64 %yo2
  store <16 x float> %rv, ptr %yp, align 4
{_next('m', '%M', 'init', 'experts')}
experts:
  %anone = icmp sle i64 %nA, 0
  br i1 %anone, label %blk.next, label %expert
expert:
  %a = phi i64 [0, %experts], [%a1, %expert.next]
  %ep = getelementptr inbounds i64, ptr %act, i64 %a
  %e = load i64, ptr %ep, align 8
  %psp = getelementptr inbounds i64, ptr %pstart, i64 %a
  %ps = load i64, ptr %psp, align 8
  %ntp = getelementptr inbounds i64, ptr %ptiles, i64 %a
  %nt = load i64, ptr %ntp, align 8
  %er = mul nuw nsw i64 %e, {D}
  %wr = add nuw nsw i64 %er, %n0
  %wo = mul nuw nsw i64 %wr, {rb}
  %wp = getelementptr inbounds i8, ptr %w, i64 %wo
  %so = mul nuw nsw i64 %wr, {sb}
  %sp = getelementptr inbounds i8, ptr %s, i64 %so
  %tnone = icmp sle i64 %nt, 0
  br i1 %tnone, label %expert.next, label %unpack
unpack:
  call void @unpack(ptr %wp, ptr %sp, ptr %B, ptr %dsc, ptr %msc)
  br label %tile
tile:
{_tile_rows('unpack')}
{_q8_rows('h', '%r0', ng, spec.planes)}
  call void @tile_gemm(ptr %hp, ptr %hdp, ptr %hsp, ptr %B, ptr %dsc, ptr %msc, ptr %ob)
  br label %row
row:
  %i = phi i64 [0, %tile], [%i1, %row.next]
  %pr = add nuw nsw i64 %r0, %i
  %tp = getelementptr inbounds i64, ptr %ptok, i64 %pr
  %tok = load i64, ptr %tp, align 8
  %pad = icmp slt i64 %tok, 0
  br i1 %pad, label %row.next, label %add
add:
  %pwp = getelementptr inbounds float, ptr %pw, i64 %pr
  %pwv = load float, ptr %pwp, align 4
  %pw0 = insertelement <16 x float> poison, float %pwv, i64 0
  %pws = shufflevector <16 x float> %pw0, <16 x float> poison, <16 x i32> zeroinitializer
  %vo = mul nuw nsw i64 %i, {T}
  %vp = getelementptr inbounds float, ptr %ob, i64 %vo
  %v = load <16 x float>, ptr %vp, align 64
  %to = mul nuw nsw i64 %tok, %ldy
  %to2 = add nuw nsw i64 %to, %n0
  %typ = getelementptr inbounds float, ptr %y, i64 %to2
  %yv = load <16 x float>, ptr %typ, align 4
  %yv1 = call <16 x float> @llvm.fma.v16f32(<16 x float> %pws, <16 x float> %v, <16 x float> %yv)
  store <16 x float> %yv1, ptr %typ, align 4
  br label %row.next
row.next:
{_next('i', T, 'row', 'tile.next')}
tile.next:
{_next('t', '%nt', 'tile', 'expert.next')}
expert.next:
{_next('a', '%nA', 'expert', 'blk.next')}
blk.next:
{_next('nb', '%end', 'blk', 'exit')}
exit:
  ret void
}}
"""
    return KernelSource(name, _finish(ir, target), DOWN_PARAMS, f"{T}-column blocks of the output (D/{T})")


LINEAR_PARAMS = ("y", "x", "xd", "xs", "w", "s", "b", "r", "M", "ldy", "ldr")


@dataclass(frozen=True)
class AmxLinearSpec:
    fmt: str
    N: int            # output rows (silu_mul: the merged weight has 2N)
    K: int
    bias: bool = False
    silu_mul: bool = False
    residual: bool = False
    planes: int = 1     # q8 activations in 2 planes: q16

    @property
    def name(self) -> str:
        flags = "".join(f for f, on in (("b", self.bias), ("s", self.silu_mul), ("r", self.residual)) if on)
        q16 = "_q16" if self.planes == 2 else ""
        return f"amx_linear_{self.fmt}_n{self.N}_k{self.K}{'_' + flags if flags else ''}{q16}"


def linear_supported(target: Target, fmt: str, G: int, N: int, K: int) -> bool:
    return target.amx and fmt in FORMATS and G == 32 and K % 32 == 0 and N % T == 0


def linear(spec: AmxLinearSpec, target: Target) -> KernelSource:
    """y[m, n] = epilogue(W[n] . x[m]) for m < M, x in q8 rows padded to whole tiles (pad rows
    scale 0); tasks: N/16 blocks of output rows, each unpacked once for every token tile."""
    dims("amx_linear", N=spec.N, K=spec.K)
    require("amx_linear", spec.fmt in FORMATS and spec.K % 32 == 0 and spec.N % T == 0,
            "int4/int8/int4a weights, K whole groups of 32, N a multiple of 16")
    N, ng = spec.N, spec.K // 32
    rb, sb = _row_bytes(spec.fmt, ng)
    two = spec.silu_mul

    def bias(v: str, off: str, out: str) -> str:
        if not spec.bias:
            return f"  {out} = fadd <16 x float> {v}, zeroinitializer"
        return f"""  {out}.p = getelementptr inbounds float, ptr %b, i64 {off}
  {out}.b = load <16 x float>, ptr {out}.p, align 4
  {out} = fadd <16 x float> {v}, {out}.b"""
    epi = ["  %gv = load <16 x float>, ptr %gvp, align 64", bias("%gv", "%n0", "%g1")]
    cur = "%g1"
    if two:
        epi += ["  %uvp = getelementptr inbounds float, ptr %uo, i64 %vo",
                "  %uv = load <16 x float>, ptr %uvp, align 64",
                bias("%uv", "%nu", "%u1"),
                _silu_mul("%g1", "%u1", "%v2")]
        cur = "%v2"
    if spec.residual:
        epi.append(f"""  %ro = mul nuw nsw i64 %m, %ldr
  %ro2 = add nuw nsw i64 %ro, %n0
  %rp = getelementptr inbounds float, ptr %r, i64 %ro2
  %rv = load <16 x float>, ptr %rp, align 4
  %v3 = fadd <16 x float> {cur}, %rv""")
        cur = "%v3"
    up = _unpack_rows("%nu", "up", rb, sb, "%Bu", "%du", "%mu") if two else ""
    ir = unpack_function(spec.fmt, ng, "unpack") + gemm_function(ng, "tile_gemm", spec.fmt in PAIRED, spec.planes) + f"""
define void @{spec.name}(ptr noalias %args, i64 %begin, i64 %end) #0 {{
entry:
{load_args(LINEAR_PARAMS, {"y", "x", "xd", "xs", "w", "s", "b", "r"})}
  %Bg = alloca [{512 * ng} x i8], align 64
  %dg = alloca [{16 * ng} x float], align 64
  %mg = alloca [{16 * ng} x float], align 64
  %go = alloca [256 x float], align 64
  %Bu = alloca [{512 * ng if two else 64} x i8], align 64
  %du = alloca [{16 * ng if two else 16} x float], align 64
  %mu = alloca [{16 * ng if two else 16} x float], align 64
  %uo = alloca [256 x float], align 64
  %empty = icmp sge i64 %begin, %end
  %mnone = icmp sle i64 %M, 0
  %skip = or i1 %empty, %mnone
  br i1 %skip, label %exit, label %blk
blk:
  %nb = phi i64 [%begin, %entry], [%nb1, %blk.next]
  %n0 = mul nuw nsw i64 %nb, {T}
  %nu = add nuw nsw i64 %n0, {N}
{_unpack_rows('%n0', 'gate', rb, sb, '%Bg', '%dg', '%mg')}
{up}
  br label %tile
tile:
  %m0 = phi i64 [0, %blk], [%m0.1, %tile.next]
{_q8_rows('x', '%m0', ng, spec.planes)}
  call void @tile_gemm(ptr %xp, ptr %xdp, ptr %xsp, ptr %Bg, ptr %dg, ptr %mg, ptr %go)
{"  call void @tile_gemm(ptr %xp, ptr %xdp, ptr %xsp, ptr %Bu, ptr %du, ptr %mu, ptr %uo)" if two else ""}
  br label %row
row:
  %i = phi i64 [0, %tile], [%i1, %row.next]
  %m = add nuw nsw i64 %m0, %i
  %real = icmp slt i64 %m, %M
  br i1 %real, label %store, label %tile.next
store:
  %vo = mul nuw nsw i64 %i, {T}
  %gvp = getelementptr inbounds float, ptr %go, i64 %vo
{chr(10).join(epi)}
  %yo = mul nuw nsw i64 %m, %ldy
  %yo2 = add nuw nsw i64 %yo, %n0
  %yp = getelementptr inbounds float, ptr %y, i64 %yo2
  store <16 x float> {cur}, ptr %yp, align 4
  br label %row.next
row.next:
{_next('i', T, 'row', 'tile.next')}
tile.next:
  %m0.1 = add nuw nsw i64 %m0, {T}
  %mdone = icmp sge i64 %m0.1, %M
  br i1 %mdone, label %blk.next, label %tile
blk.next:
{_next('nb', '%end', 'blk', 'exit')}
exit:
  ret void
}}
"""
    return KernelSource(spec.name, _finish(ir, target), LINEAR_PARAMS, f"{T}-row blocks of the output (N/{T})")
