"""Prefill kernels on AMX tiles (MoE and linear): int4/int8 weights (group 32) against q8 activations.

A prefill gives each expert many tokens, so its weights are worth unpacking once into the tile
layout and running through the matrix unit for every 16 of them. Each active expert's pairs are
gathered (by the binder) into contiguous q8 rows padded to a multiple of 16 (pad rows have scale 0).
A task owns 16 weight rows: it unpacks them into B tiles (per group of 32: 8 rows of 64 bytes,
four consecutive k of each of the 16 rows per dword: the layout tdpbssd reads), then for each
16-token tile, per group, one tdpbssd gives the 16 x 16 integer dot products; they are scaled by
weight scale x activation scale and summed in f32 (the scales differ per group, so every group
is its own tile product, as llama.cpp's AMX kernels do).

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
from .dot import finish_module

T = 16          # tokens of a tile (A rows), weight rows of a task (B columns)
GATE_UP_PARAMS = ("h", "x", "xd", "w", "s", "act", "pstart", "ptiles", "ldh")
DOWN_PARAMS = ("y", "r", "h", "hd", "w", "s", "act", "pstart", "ptiles", "ptok", "pw", "nA", "M", "ldy", "ldr")
_PTRS = {"h", "x", "xd", "w", "s", "act", "pstart", "ptiles", "y", "r", "hd", "ptok", "pw"}
FORMATS = ("int4", "int8")

_DECLS = """
declare x86_amx @llvm.x86.tileloadd64.internal(i16, i16, ptr, i64)
declare x86_amx @llvm.x86.tilezero.internal(i16, i16)
declare x86_amx @llvm.x86.tdpbssd.internal(i16, i16, i16, x86_amx, x86_amx, x86_amx)
declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, x86_amx)
"""


@dataclass(frozen=True)
class AmxMoESpec:
    fmt: str          # gate_up's weight format
    dfmt: str         # down's
    D: int
    I: int
    residual: bool = False

    @property
    def tag(self) -> str:
        return f"{self.fmt}_{self.dfmt}_d{self.D}_i{self.I}{'_r' if self.residual else ''}"


def supported(target: Target, fmt: str, G: int, dfmt: str, dG: int, D: int, I: int) -> bool:
    """Whether the AMX kernels take this MoE op (q8 activations assumed)."""
    return (target.amx and fmt in FORMATS and dfmt in FORMATS and G == 32 and dG == 32
            and D % 32 == 0 and I % 32 == 0)


def _check(kernel: str, spec: AmxMoESpec) -> None:
    dims(kernel, D=spec.D, I=spec.I)
    require(kernel, spec.fmt in FORMATS and spec.dfmt in FORMATS, f"formats {spec.fmt}/{spec.dfmt} (int4, int8)")
    require(kernel, spec.D % 32 == 0 and spec.I % 32 == 0, "D and I multiples of 32")


def _row_bytes(fmt: str, ng: int) -> tuple[int, int]:
    return (16 if fmt == "int4" else 32) * ng, 2 * ng


def unpack_function(fmt: str, ng: int, name: str) -> str:
    """`void name(ptr w, ptr s, ptr B, ptr dsc)`: 16 rows from w (stride rb) into ng B tiles of
    512 bytes at B (signed values; int4's 0..15 become -8..7), their scales as f32 [ng][16] at dsc."""
    rb, sb = _row_bytes(fmt, ng)
    per = 16 if fmt == "int4" else 32
    out = [f"""define internal void @{name}(ptr %w, ptr %s, ptr %B, ptr %dsc) #0 {{
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
    if fmt == "int4":
        # rows n..n+3 in one 64-byte vector (16 bytes each); low nibbles are k 0..15, high 16..31
        for q in range(8):
            out.append(f"  %q{q} = shufflevector <16 x i8> %c{2 * q}, <16 x i8> %c{2 * q + 1}, "
                       f"<32 x i32> <{', '.join(f'i32 {i}' for i in range(32))}>")
        for z in range(4):
            out.append(f"""  %z{z} = shufflevector <32 x i8> %q{2 * z}, <32 x i8> %q{2 * z + 1}, <64 x i32> <{', '.join(f'i32 {i}' for i in range(64))}>
  %l{z}.0 = and <64 x i8> %z{z}, <{', '.join(['i8 15'] * 64)}>
  %l{z}.1 = sub <64 x i8> %l{z}.0, <{', '.join(['i8 8'] * 64)}>
  %l{z} = bitcast <64 x i8> %l{z}.1 to <16 x i32>
  %h{z}.0 = lshr <64 x i8> %z{z}, <{', '.join(['i8 4'] * 64)}>
  %h{z}.1 = sub <64 x i8> %h{z}.0, <{', '.join(['i8 8'] * 64)}>
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
    # the 16 rows' scales of group g
    out.append("  %so = mul nuw nsw i64 %g, 2")
    prev = "poison"
    for n in range(T):
        out.append(f"""  %sp{n}.o = add nuw nsw i64 %so, {n * sb}
  %sp{n} = getelementptr inbounds i8, ptr %s, i64 %sp{n}.o
  %sh{n} = load half, ptr %sp{n}, align 2
  %sv{n} = insertelement <16 x half> {prev}, half %sh{n}, i64 {n}""")
        prev = f"%sv{n}"
    out.append(f"""  %sf = fpext <16 x half> {prev} to <16 x float>
  %dso = mul nuw nsw i64 %g, 64
  %dsp = getelementptr inbounds i8, ptr %dsc, i64 %dso
  store <16 x float> %sf, ptr %dsp, align 64
{_next('g', ng, 'loop', 'exit')}
exit:
  ret void
}}
""")
    return "\n".join(out)


def gemm_function(ng: int, name: str) -> str:
    """`void name(ptr x, ptr xd, ptr B, ptr dsc, ptr out)`: out[m][n] (16 x 16 f32) = sum over the
    ng groups of (x row m . B column n) * xd[m][g] * dsc[g][n]; x rows of Kp = 32 ng bytes, xd rows
    of ng floats. U groups per iteration (two tile products in flight while the last ones are
    scaled), a last odd group alone."""
    kp = 32 * ng
    U = 2 if ng % 2 == 0 else 1
    phis = "\n".join(f"  %acc{m} = phi <16 x float> [zeroinitializer, %entry], [%acc{m}.{U}, %loop]" for m in range(T))
    tiles, body = [], []
    for u in range(U):
        tiles.append(f"""  %g{u} = add nuw nsw i64 %g, {u}
  %ao{u} = mul nuw nsw i64 %g{u}, 32
  %ap{u} = getelementptr inbounds i8, ptr %x, i64 %ao{u}
  %bo{u} = mul nuw nsw i64 %g{u}, 512
  %bp{u} = getelementptr inbounds i8, ptr %B, i64 %bo{u}
  %ta{u} = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 32, ptr %ap{u}, i64 {kp})
  %tb{u} = call x86_amx @llvm.x86.tileloadd64.internal(i16 8, i16 64, ptr %bp{u}, i64 64)
  %tz{u} = call x86_amx @llvm.x86.tilezero.internal(i16 16, i16 64)
  %tc{u} = call x86_amx @llvm.x86.tdpbssd.internal(i16 16, i16 64, i16 32, x86_amx %tz{u}, x86_amx %ta{u}, x86_amx %tb{u})
  %cb{u} = getelementptr inbounds i8, ptr %cbuf, i64 {1024 * u}
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %cb{u}, i64 64, x86_amx %tc{u})""")
        body.append(f"""  %dwo{u} = mul nuw nsw i64 %g{u}, 64
  %dwp{u} = getelementptr inbounds i8, ptr %dsc, i64 %dwo{u}
  %dw{u} = load <16 x float>, ptr %dwp{u}, align 64""")
        for m in range(T):
            body.append(f"""  %cp{m}.{u} = getelementptr inbounds i8, ptr %cb{u}, i64 {64 * m}
  %ci{m}.{u} = load <16 x i32>, ptr %cp{m}.{u}, align 64
  %cf{m}.{u} = sitofp <16 x i32> %ci{m}.{u} to <16 x float>
  %xo{m}.{u} = add nuw nsw i64 %g{u}, {m * ng}
  %xp{m}.{u} = getelementptr inbounds float, ptr %xd, i64 %xo{m}.{u}
  %dx{m}.{u} = load float, ptr %xp{m}.{u}, align 4
  %dv{m}.{u} = insertelement <16 x float> poison, float %dx{m}.{u}, i64 0
  %ds{m}.{u} = shufflevector <16 x float> %dv{m}.{u}, <16 x float> poison, <16 x i32> zeroinitializer
  %sc{m}.{u} = fmul <16 x float> %dw{u}, %ds{m}.{u}
  %acc{m}.{u + 1} = call <16 x float> @llvm.fma.v16f32(<16 x float> %cf{m}.{u}, <16 x float> %sc{m}.{u}, <16 x float> %acc{m}{'' if u == 0 else '.' + str(u)})""")
    stores = "\n".join(f"""  %op{m} = getelementptr inbounds i8, ptr %out, i64 {64 * m}
  store <16 x float> %acc{m}.{U}, ptr %op{m}, align 64""" for m in range(T))
    return f"""define internal void @{name}(ptr %x, ptr %xd, ptr %B, ptr %dsc, ptr %out) #0 {{
entry:
  %cbuf = alloca [{256 * U} x i32], align 64
  br label %loop
loop:
  %g = phi i64 [0, %entry], [%g.next, %loop]
{phis}
{chr(10).join(tiles)}
{chr(10).join(body)}
  %g.next = add nuw nsw i64 %g, {U}
  %done = icmp eq i64 %g.next, {ng}
  br i1 %done, label %exit, label %loop
exit:
{stores}
  ret void
}}
"""


def _c(v: float) -> str:
    """A float constant splatted over 16 lanes (as a double's hex: exact for f32 values)."""
    import struct

    f32 = struct.unpack("<f", struct.pack("<f", v))[0]
    h = "0x%016X" % struct.unpack("<Q", struct.pack("<d", f32))[0]
    return "<" + ", ".join([f"float {h}"] * 16) + ">"


_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _vexp(x: str, out: str) -> str:
    """IR for out = exp(x) over <16 x float> (Cephes' expf: x = n ln2 + r, a degree-6 polynomial
    in r, 2^n by the exponent bits; within 2 ulp over the clamped range [-87, 88]): a vector
    silu without 16 calls of the scalar expf per row."""
    V = "<16 x float>"
    lines = [f"  {out}.c0 = call {V} @llvm.maxnum.v16f32({V} {x}, {V} {_c(-87.0)})",
             f"  {out}.c = call {V} @llvm.minnum.v16f32({V} {out}.c0, {V} {_c(88.0)})",
             f"  {out}.t = fmul {V} {out}.c, {_c(1.4426950408889634)}",
             f"  {out}.n = call {V} @llvm.rint.v16f32({V} {out}.t)",
             f"  {out}.r0 = call {V} @llvm.fma.v16f32({V} {out}.n, {V} {_c(-0.693359375)}, {V} {out}.c)",
             f"  {out}.r = call {V} @llvm.fma.v16f32({V} {out}.n, {V} {_c(2.12194440e-4)}, {V} {out}.r0)",
             f"  {out}.p0 = fadd {V} zeroinitializer, {_c(_EXP_POLY[0])}"]
    for i, c in enumerate(_EXP_POLY[1:], 1):
        lines.append(f"  {out}.p{i} = call {V} @llvm.fma.v16f32({V} {out}.p{i - 1}, {V} {out}.r, {V} {_c(c)})")
    k = len(_EXP_POLY) - 1
    lines += [f"  {out}.rr = fmul {V} {out}.r, {out}.r",
              f"  {out}.e0 = call {V} @llvm.fma.v16f32({V} {out}.p{k}, {V} {out}.rr, {V} {out}.r)",
              f"  {out}.e = fadd {V} {out}.e0, {_c(1.0)}",
              f"  {out}.ni = fptosi {V} {out}.n to <16 x i32>",
              f"  {out}.nb = add <16 x i32> {out}.ni, <{', '.join(['i32 127'] * 16)}>",
              f"  {out}.sb = shl <16 x i32> {out}.nb, <{', '.join(['i32 23'] * 16)}>",
              f"  {out}.s = bitcast <16 x i32> {out}.sb to {V}",
              f"  {out} = fmul {V} {out}.e, {out}.s"]
    return "\n".join(lines)


def _silu_mul(g: str, u: str, out: str) -> str:
    """IR for out = silu(g) * u over <16 x float>."""
    return f"""  {out}.n = fneg <16 x float> {g}
{_vexp(out + '.n', out + '.e')}
  {out}.d = fadd <16 x float> {out}.e, {_c(1.0)}
  {out}.s = fdiv <16 x float> {g}, {out}.d
  {out} = fmul <16 x float> {out}.s, {u}"""


def _unpack_rows(row: str, tag: str, rb: int, sb: int, B: str, dsc: str) -> str:
    """IR that unpacks the 16 weight rows from row `row` on (their data %w, scales %s) into B, dsc."""
    return f"""  %{tag}.wo = mul nuw nsw i64 {row}, {rb}
  %{tag}.w = getelementptr inbounds i8, ptr %w, i64 %{tag}.wo
  %{tag}.so = mul nuw nsw i64 {row}, {sb}
  %{tag}.s = getelementptr inbounds i8, ptr %s, i64 %{tag}.so
  call void @unpack(ptr %{tag}.w, ptr %{tag}.s, ptr {B}, ptr {dsc})"""


def _q8_rows(a: str, r: str, ng: int) -> str:
    """%{a}p / %{a}dp: the q8 activation rows from row `r` (32 bytes per group, one f32 scale)."""
    return (f"  %{a}o = mul nuw nsw i64 {r}, {32 * ng}\n  %{a}p = getelementptr inbounds i8, ptr %{a}, i64 %{a}o\n"
            f"  %{a}do = mul nuw nsw i64 {r}, {ng}\n  %{a}dp = getelementptr inbounds float, ptr %{a}d, i64 %{a}do")


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
    ir = unpack_function(spec.fmt, ng, "unpack") + gemm_function(ng, "tile_gemm") + f"""
define void @{name}(ptr noalias %args, i64 %begin, i64 %end) #0 {{
entry:
{load_args(GATE_UP_PARAMS, _PTRS)}
  %Bg = alloca [{512 * ng} x i8], align 64
  %Bu = alloca [{512 * ng} x i8], align 64
  %dg = alloca [{16 * ng} x float], align 64
  %du = alloca [{16 * ng} x float], align 64
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
{_unpack_rows('%gr', 'gate', rb, sb, '%Bg', '%dg')}
{_unpack_rows('%ur', 'up', rb, sb, '%Bu', '%du')}
  %none = icmp sle i64 %nt, 0
  br i1 %none, label %blk.next, label %tile
tile:
{_tile_rows('blk')}
{_q8_rows('x', '%r0', ng)}
  call void @tile_gemm(ptr %xp, ptr %xdp, ptr %Bg, ptr %dg, ptr %go)
  call void @tile_gemm(ptr %xp, ptr %xdp, ptr %Bu, ptr %du, ptr %uo)
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
    ir = unpack_function(spec.dfmt, ng, "unpack") + gemm_function(ng, "tile_gemm") + f"""
define void @{name}(ptr noalias %args, i64 %begin, i64 %end) #0 {{
entry:
{load_args(DOWN_PARAMS, _PTRS)}
  %B = alloca [{512 * ng} x i8], align 64
  %dsc = alloca [{16 * ng} x float], align 64
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
  call void @unpack(ptr %wp, ptr %sp, ptr %B, ptr %dsc)
  br label %tile
tile:
{_tile_rows('unpack')}
{_q8_rows('h', '%r0', ng)}
  call void @tile_gemm(ptr %hp, ptr %hdp, ptr %B, ptr %dsc, ptr %ob)
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


LINEAR_PARAMS = ("y", "x", "xd", "w", "s", "b", "r", "M", "ldy", "ldr")


@dataclass(frozen=True)
class AmxLinearSpec:
    fmt: str
    N: int            # output rows (silu_mul: the merged weight has 2N)
    K: int
    bias: bool = False
    silu_mul: bool = False
    residual: bool = False

    @property
    def name(self) -> str:
        flags = "".join(f for f, on in (("b", self.bias), ("s", self.silu_mul), ("r", self.residual)) if on)
        return f"amx_linear_{self.fmt}_n{self.N}_k{self.K}{'_' + flags if flags else ''}"


def linear_supported(target: Target, fmt: str, G: int, N: int, K: int) -> bool:
    return target.amx and fmt in FORMATS and G == 32 and K % 32 == 0 and N % T == 0


def linear(spec: AmxLinearSpec, target: Target) -> KernelSource:
    """y[m, n] = epilogue(W[n] . x[m]) for m < M, x in q8 rows padded to whole tiles (pad rows
    scale 0); tasks: N/16 blocks of output rows, each unpacked once for every token tile."""
    dims("amx_linear", N=spec.N, K=spec.K)
    require("amx_linear", spec.fmt in FORMATS and spec.K % 32 == 0 and spec.N % T == 0,
            "int4/int8 weights, K whole groups of 32, N a multiple of 16")
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
    up = _unpack_rows("%nu", "up", rb, sb, "%Bu", "%du") if two else ""
    ir = unpack_function(spec.fmt, ng, "unpack") + gemm_function(ng, "tile_gemm") + f"""
define void @{spec.name}(ptr noalias %args, i64 %begin, i64 %end) #0 {{
entry:
{load_args(LINEAR_PARAMS, {"y", "x", "xd", "w", "s", "b", "r"})}
  %Bg = alloca [{512 * ng} x i8], align 64
  %dg = alloca [{16 * ng} x float], align 64
  %go = alloca [256 x float], align 64
  %Bu = alloca [{512 * ng if two else 64} x i8], align 64
  %du = alloca [{16 * ng if two else 16} x float], align 64
  %uo = alloca [256 x float], align 64
  %empty = icmp sge i64 %begin, %end
  %mnone = icmp sle i64 %M, 0
  %skip = or i1 %empty, %mnone
  br i1 %skip, label %exit, label %blk
blk:
  %nb = phi i64 [%begin, %entry], [%nb1, %blk.next]
  %n0 = mul nuw nsw i64 %nb, {T}
  %nu = add nuw nsw i64 %n0, {N}
{_unpack_rows('%n0', 'gate', rb, sb, '%Bg', '%dg')}
{up}
  br label %tile
tile:
  %m0 = phi i64 [0, %blk], [%m0.1, %tile.next]
{_q8_rows('x', '%m0', ng)}
  call void @tile_gemm(ptr %xp, ptr %xdp, ptr %Bg, ptr %dg, ptr %go)
{"  call void @tile_gemm(ptr %xp, ptr %xdp, ptr %Bu, ptr %du, ptr %uo)" if two else ""}
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
