"""`linear` kernels: y[m, n] = epilogue(dot(W[n], x[m])), specialised to shape and format.

Work is split over output rows. Loop order: blocks of RB rows, then tokens, then the rows of the
block — a block of weights stays in cache while every token passes over it (prefill), and
at decode (one token) each row is read once, streaming at memory bandwidth. With q8
activations, a block's first M - M % T tokens and R-row groups go through tile.py's R x T
micro-kernel (@tiles); the rest take one dot product per output (@span).

Epilogues: + bias[n]; silu_mul (row n is the gate, row n + N_out the up projection: the merged
gate/up weight); + residual[m, n].

args: y, x, xd, xs, w, s, b, r, xidx, M, ldx, ldy, ldr
  y    f32[M, ldy]            output
  x    f32[*, ldx] or i8 q8   activations (row xidx[m] when xidx is not null, else m)
  xd   f32[*, NG], xs i32[*, NG]   q8 block scales and sums (q8 path only)
  w, s weight data and scales (formats.py layouts), b f32 bias, r f32[M, ldr] residual
"""

from __future__ import annotations

from dataclasses import dataclass

from ..target import Target
from .canon import silu_mul
from .common import KernelSource, dims, group_ok, load_args, one_of
from .dot import dot_function, finish_module, weight_row
from .tile import tile_function, tile_shape

PARAMS = ("y", "x", "xd", "xs", "w", "s", "b", "r", "xidx", "M", "ldx", "ldy", "ldr")
POINTERS = {"y", "x", "xd", "xs", "w", "s", "b", "r", "xidx"}
ROW_BLOCK = 16


@dataclass(frozen=True)
class LinearSpec:
    fmt: str
    N: int            # output rows (after silu_mul: the gate/up weight has 2N rows)
    K: int
    group_size: int
    q8: bool = False
    bias: bool = False
    silu_mul: bool = False
    residual: bool = False
    planes: int = 1       # q8 activations in 2 planes: q16 (elementwise.quantize_q8)

    def row_bytes(self) -> tuple[int, int]:
        """Bytes of one weight row and of its scales (grouped formats), in the stored layout."""
        from strata_compiler.formats import get_format

        return get_format(self.fmt).row_bytes(self.K, self.group_size or 32)

    @property
    def name(self) -> str:
        flags = "".join(f for f, on in (("b", self.bias), ("s", self.silu_mul), ("r", self.residual)) if on)
        act = ("q16" if self.planes == 2 else "q8") if self.q8 else "f32"
        return f"linear_{self.fmt}_{act}_n{self.N}_k{self.K}_g{self.group_size}{'_' + flags if flags else ''}"


def check(kernel: str, spec: LinearSpec) -> None:
    """The spec's shapes, format and flags, before any of them reaches IR text."""
    dims(kernel, N=spec.N, K=spec.K)
    group_ok(kernel, spec.fmt, spec.group_size)
    for flag in ("q8", "bias", "silu_mul", "residual"):
        one_of(kernel, flag, getattr(spec, flag), (True, False))
    dims(kernel, lo=1, hi=2, planes=spec.planes)


def _epilogue(spec: LinearSpec, p: str, v: str, u: str | None, n: str, m: str) -> tuple[str, str]:
    """IR applying bias, silu_mul (u: the up row's dot) and residual to dot value v of output
    (m, n); SSA names start with %{p}. Returns (ir, the result's value)."""
    out, cur = [], v
    if spec.bias:
        out.append(f"""  %{p}bp = getelementptr inbounds float, ptr %b, i64 {n}
  %{p}bv = load float, ptr %{p}bp, align 4
  %{p}v1 = fadd float {cur}, %{p}bv""")
        cur = f"%{p}v1"
    if spec.silu_mul:
        if spec.bias:
            out.append(f"""  %{p}nb = add nuw nsw i64 {n}, {spec.N}
  %{p}bup = getelementptr inbounds float, ptr %b, i64 %{p}nb
  %{p}buv = load float, ptr %{p}bup, align 4
  %{p}u1 = fadd float {u}, %{p}buv""")
            u = f"%{p}u1"
        out.append(silu_mul(cur, u, f"%{p}v2"))
        cur = f"%{p}v2"
    if spec.residual:
        out.append(f"""  %{p}ro = mul nuw nsw i64 {m}, %ldr
  %{p}ro2 = add nuw nsw i64 %{p}ro, {n}
  %{p}rp = getelementptr inbounds float, ptr %r, i64 %{p}ro2
  %{p}rv = load float, ptr %{p}rp, align 4
  %{p}v3 = fadd float {cur}, %{p}rv""")
        cur = f"%{p}v3"
    return "\n".join(out), cur


def _xrow(spec: LinearSpec, ng: int, m: str, p: str) -> str:
    """Pointers %{p}x, %{p}xd, %{p}xs to token m's activation row (row xidx[m] when given). It
    ends in block %{p}join and must start in a block named %{p}pre."""
    if spec.q8:
        row = f"""  %{p}xro = mul nuw nsw i64 %{p}xm, {spec.planes * ng * spec.group_size}
  %{p}x = getelementptr inbounds i8, ptr %x, i64 %{p}xro
  %{p}xdo = mul nuw nsw i64 %{p}xm, {4 * ng}
  %{p}xd = getelementptr inbounds i8, ptr %xd, i64 %{p}xdo
  %{p}xs = getelementptr inbounds i8, ptr %xs, i64 %{p}xdo"""
    else:
        row = f"""  %{p}xro = mul nuw nsw i64 %{p}xm, %ldx
  %{p}x = getelementptr inbounds float, ptr %x, i64 %{p}xro
  %{p}xd = getelementptr inbounds i8, ptr %xd, i64 0
  %{p}xs = getelementptr inbounds i8, ptr %xs, i64 0"""
    return f"""  br i1 %hasidx, label %{p}idx, label %{p}join
{p}idx:
  %{p}ip = getelementptr inbounds i64, ptr %xidx, i64 {m}
  %{p}iv = load i64, ptr %{p}ip, align 8
  br label %{p}join
{p}join:
  %{p}xm = phi i64 [{m}, %{p}pre], [%{p}iv, %{p}idx]
{row}"""


ARGS = ("ptr noalias %y, ptr noalias %x, ptr noalias %xd, ptr noalias %xs, ptr noalias %w, ptr noalias %s, "
        "ptr noalias %b, ptr noalias %r, ptr noalias %xidx, i1 %hasidx, i64 %ldx, i64 %ldy, i64 %ldr, "
        "i64 %m0, i64 %m1, i64 %n0, i64 %n1")
CALL = ("ptr %y, ptr %x, ptr %xd, ptr %xs, ptr %w, ptr %s, ptr %b, ptr %r, ptr %xidx, i1 %hasidx, "
        "i64 %ldx, i64 %ldy, i64 %ldr")


def _span(spec: LinearSpec, rb: int, sb: int, ng: int) -> str:
    """@span: outputs [m0, m1) x [n0, n1) one dot product each (decode, and what tiles leave)."""
    def dot_at(n: str, out: str) -> str:
        return (weight_row(n, out[1:], rb, sb)
                + f"\n  {out} = call float @dot(ptr {out}.w, ptr {out}.s, ptr %x, ptr %xd, ptr %xs)")

    dots = [dot_at("%n", "%v0")]
    if spec.silu_mul:
        dots.append(f"  %nu = add nuw nsw i64 %n, {spec.N}")
        dots.append(dot_at("%nu", "%u0"))
    epi, cur = _epilogue(spec, "", "%v0", "%u0" if spec.silu_mul else None, "%n", "%m")
    # the row pointers of _xrow are named %tx, %txd, %txs; @dot reads %x..: rename at the call
    body = "\n".join(dots).replace("ptr %x, ptr %xd, ptr %xs", "ptr %tx, ptr %txd, ptr %txs")
    return f"""
define internal void @span({ARGS}) {{
entry:
  %mempty = icmp sge i64 %m0, %m1
  %nempty = icmp sge i64 %n0, %n1
  %empty = or i1 %mempty, %nempty
  br i1 %empty, label %exit, label %tok
tok:
  %m = phi i64 [%m0, %entry], [%m.1, %tok.next]
  br label %tpre
tpre:
{_xrow(spec, ng, "%m", "t")}
  %yo = mul nuw nsw i64 %m, %ldy
  br label %row
row:
  %n = phi i64 [%n0, %tjoin], [%n.1, %row]
{body}
{epi}
  %yo2 = add nuw nsw i64 %yo, %n
  %yp = getelementptr inbounds float, ptr %y, i64 %yo2
  store float {cur}, ptr %yp, align 4
  %n.1 = add nuw nsw i64 %n, 1
  %rdone = icmp eq i64 %n.1, %n1
  br i1 %rdone, label %tok.next, label %row
tok.next:
  %m.1 = add nuw nsw i64 %m, 1
  %mdone = icmp eq i64 %m.1, %m1
  br i1 %mdone, label %exit, label %tok
exit:
  ret void
}}
"""


def _tiles(spec: LinearSpec, rb: int, sb: int, ng: int, R: int, T: int) -> str:
    """@tiles: outputs [m0, m1) x [n0, n1) in R x T tiles (both spans whole multiples); with
    silu_mul a tile's 2R weight rows are the gate rows and their up rows."""
    rows = [("%n", r, f"t.r{r}") for r in range(R)]
    if spec.silu_mul:
        rows += [("%nu", r, f"t.u{r}") for r in range(R)]
    RR = len(rows)
    ir = [f"  %nu = add nuw nsw i64 %n, {spec.N}"] if spec.silu_mul else []
    args = []
    for base, r, p in rows:
        ir.append(f"  %{p}.n = add nuw nsw i64 {base}, {r}")
        ir.append(weight_row(f"%{p}.n", p, rb, sb))
        args += [f"ptr %{p}.w", f"ptr %{p}.s"]
    for t in range(T):
        args += [f"ptr %x{t}x", f"ptr %x{t}xd", f"ptr %x{t}xs"]
    ir.append(f"  call void @tile({', '.join(args)}, ptr %buf)")
    for t in range(T):
        ir.append(f"  %yo{t} = mul nuw nsw i64 %m.{t}, %ldy")
        for r in range(R):
            p = f"e{t}.{r}."
            ir.append(f"""  %{p}n = add nuw nsw i64 %n, {r}
  %{p}vp = getelementptr inbounds float, ptr %buf, i64 {t * RR + r}
  %{p}v = load float, ptr %{p}vp, align 4""")
            u = None
            if spec.silu_mul:
                ir.append(f"""  %{p}up = getelementptr inbounds float, ptr %buf, i64 {t * RR + R + r}
  %{p}u = load float, ptr %{p}up, align 4""")
                u = f"%{p}u"
            epi, cur = _epilogue(spec, p, f"%{p}v", u, f"%{p}n", f"%m.{t}")
            ir.append(epi)
            ir.append(f"""  %{p}yo = add nuw nsw i64 %yo{t}, %{p}n
  %{p}yp = getelementptr inbounds float, ptr %y, i64 %{p}yo
  store float {cur}, ptr %{p}yp, align 4""")
    toks = "\n".join(f"  %m.{t} = add nuw nsw i64 %m, {t}\n  br label %x{t}pre\nx{t}pre:\n" + _xrow(spec, ng, f"%m.{t}", f"x{t}")
                     for t in range(T))
    return f"""
define internal void @tiles({ARGS}) {{
entry:
  %buf = alloca [{RR * T} x float], align 64
  %mempty = icmp sge i64 %m0, %m1
  %nempty = icmp sge i64 %n0, %n1
  %empty = or i1 %mempty, %nempty
  br i1 %empty, label %exit, label %tok
tok:
  %m = phi i64 [%m0, %entry], [%m.next, %tok.next]
{toks}
  br label %row
row:
  %n = phi i64 [%n0, %x{T - 1}join], [%n.next, %row]
{chr(10).join(ir)}
  %n.next = add nuw nsw i64 %n, {R}
  %rdone = icmp sge i64 %n.next, %n1
  br i1 %rdone, label %tok.next, label %row
tok.next:
  %m.next = add nuw nsw i64 %m, {T}
  %mdone = icmp sge i64 %m.next, %m1
  br i1 %mdone, label %exit, label %tok
exit:
  ret void
}}
"""


def tiled(spec: LinearSpec) -> bool:
    """Whether prefill takes the R x T tile kernel (q8 activations: int8/int4 in groups of 32)."""
    return spec.q8


def generate(spec: LinearSpec, target: Target) -> KernelSource:
    check("linear", spec)
    rb, sb = spec.row_bytes()
    ng = -(-spec.K // spec.group_size) if spec.group_size else 0
    R, T = tile_shape(target)
    if spec.silu_mul:       # R weight rows a tile: R / 2 gate rows and their up rows
        R //= 2
    if tiled(spec):     # full tiles of each row block's first tokens, one dot each for the rest
        blocks = f"""  %mt.q = udiv i64 %M, {T}
  %mt = mul nuw nsw i64 %mt.q, {T}
  %nb = sub nuw nsw i64 %rend, %rb
  %nt.q = udiv i64 %nb, {R}
  %nt.r = mul nuw nsw i64 %nt.q, {R}
  %nt = add nuw nsw i64 %rb, %nt.r
  call void @tiles({CALL}, i64 0, i64 %mt, i64 %rb, i64 %nt)
  call void @span({CALL}, i64 0, i64 %mt, i64 %nt, i64 %rend)
  call void @span({CALL}, i64 %mt, i64 %M, i64 %rb, i64 %rend)"""
        fns = (tile_function(target, spec.fmt, spec.K, spec.group_size, 2 * R if spec.silu_mul else R, T,
                             planes=spec.planes)
               + _tiles(spec, rb, sb, ng, R, T))
    else:
        blocks = f"  call void @span({CALL}, i64 0, i64 %M, i64 %rb, i64 %rend)"
        fns = ""
    kernel = f"""
define void @{spec.name}(ptr noalias %args, i64 %begin, i64 %end) #0 {{
entry:
{load_args(PARAMS, POINTERS)}
  %hasidx = icmp ne ptr %xidx, null
  %empty = icmp sge i64 %begin, %end
  br i1 %empty, label %exit, label %block
block:
  %rb = phi i64 [%begin, %entry], [%rb1, %block]
  %rb1 = add nuw nsw i64 %rb, {ROW_BLOCK}
  %rbfull = icmp slt i64 %rb1, %end
  %rend = select i1 %rbfull, i64 %rb1, i64 %end
{blocks}
  %bdone = icmp sge i64 %rb1, %end
  br i1 %bdone, label %exit, label %block
exit:
  ret void
}}
"""
    dot = dot_function(target, spec.fmt, spec.K, spec.group_size, spec.q8, planes=spec.planes)
    ir = dot + _span(spec, rb, sb, ng) + fns + kernel
    ir = finish_module(ir, target)
    return KernelSource(spec.name, ir, PARAMS, "rows")
