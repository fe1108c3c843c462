"""`linear` kernels: y[m, n] = epilogue(dot(W[n], x[m])), specialised to shape and format.

Work is split over output rows. Loop order: blocks of RB rows, then tokens, then the rows of the
block — a block of weights stays in cache while every token passes over it (prefill), and
at decode (one token) each row is read once, streaming at memory bandwidth.

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
from .common import KernelSource, dims, group_ok, load_args, one_of
from .dot import dot_function, finish_module, weight_row

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

    def row_bytes(self) -> tuple[int, int]:
        """Bytes of one weight row and of its scales (grouped formats), in the stored layout."""
        from strata_compiler.formats import get_format

        return get_format(self.fmt).row_bytes(self.K, self.group_size or 32)

    @property
    def name(self) -> str:
        flags = "".join(f for f, on in (("b", self.bias), ("s", self.silu_mul), ("r", self.residual)) if on)
        act = "q8" if self.q8 else "f32"
        return f"linear_{self.fmt}_{act}_n{self.N}_k{self.K}_g{self.group_size}{'_' + flags if flags else ''}"


def check(kernel: str, spec: LinearSpec) -> None:
    """The spec's shapes, format and flags, before any of them reaches IR text."""
    dims(kernel, N=spec.N, K=spec.K)
    group_ok(kernel, spec.fmt, spec.group_size)
    for flag in ("q8", "bias", "silu_mul", "residual"):
        one_of(kernel, flag, getattr(spec, flag), (True, False))


def generate(spec: LinearSpec, target: Target) -> KernelSource:
    check("linear", spec)
    rb, sb = spec.row_bytes()
    ng = -(-spec.K // spec.group_size) if spec.group_size else 0
    xrow_bytes = (ng * spec.group_size) if spec.q8 else 0

    def dot_at(n: str, out: str) -> str:
        return (weight_row(n, out[1:], rb, sb)
                + f"\n  {out} = call float @dot(ptr {out}.w, ptr {out}.s, ptr %xrow, ptr %xdrow, ptr %xsrow)")

    x_row = (f"""  %xro = mul nuw nsw i64 %xm, {xrow_bytes}
  %xrow = getelementptr inbounds i8, ptr %x, i64 %xro
  %xdo = mul nuw nsw i64 %xm, {4 * ng}
  %xdrow = getelementptr inbounds i8, ptr %xd, i64 %xdo
  %xsrow = getelementptr inbounds i8, ptr %xs, i64 %xdo""" if spec.q8 else """  %xro = mul nuw nsw i64 %xm, %ldx
  %xrow = getelementptr inbounds float, ptr %x, i64 %xro
  %xdrow = getelementptr inbounds i8, ptr %xd, i64 0
  %xsrow = getelementptr inbounds i8, ptr %xs, i64 0""")
    epi = [dot_at("%n", "%v0")]
    cur = "%v0"
    if spec.bias:
        epi.append(f"""  %bp = getelementptr inbounds float, ptr %b, i64 %n
  %bv = load float, ptr %bp, align 4
  %v1 = fadd float {cur}, %bv""")
        cur = "%v1"
    if spec.silu_mul:
        epi.append(f"  %nu = add nuw nsw i64 %n, {spec.N}")
        epi.append(dot_at("%nu", "%u0"))
        ucur = "%u0"
        if spec.bias:
            epi.append("""  %bup = getelementptr inbounds float, ptr %b, i64 %nu
  %buv = load float, ptr %bup, align 4
  %u1 = fadd float %u0, %buv""")
            ucur = "%u1"
        epi.append(f"""  %ng = fneg float {cur}
  %ex = call float @llvm.exp.f32(float %ng)
  %den = fadd float %ex, 1.0
  %sg = fdiv float {cur}, %den
  %v2 = fmul float %sg, {ucur}""")
        cur = "%v2"
    if spec.residual:
        epi.append(f"""  %ro = mul nuw nsw i64 %m, %ldr
  %ro2 = add nuw nsw i64 %ro, %n
  %rp = getelementptr inbounds float, ptr %r, i64 %ro2
  %rv = load float, ptr %rp, align 4
  %v3 = fadd float {cur}, %rv""")
        cur = "%v3"
    body = "\n".join(epi)
    kernel = f"""
define void @{spec.name}(ptr noalias %args, i64 %begin, i64 %end) #0 {{
entry:
{load_args(PARAMS, POINTERS)}
  %hasidx = icmp ne ptr %xidx, null
  %empty = icmp sge i64 %begin, %end
  br i1 %empty, label %exit, label %block
block:
  %rb = phi i64 [%begin, %entry], [%rb1, %block.next]
  %rb1.0 = add nuw nsw i64 %rb, {ROW_BLOCK}
  %rbfull = icmp slt i64 %rb1.0, %end
  %rend = select i1 %rbfull, i64 %rb1.0, i64 %end
  %mempty = icmp sle i64 %M, 0
  br i1 %mempty, label %block.next, label %tok
tok:
  %m = phi i64 [0, %block], [%m1, %tok.next]
  br i1 %hasidx, label %tok.idx, label %tok.row
tok.idx:
  %ip = getelementptr inbounds i64, ptr %xidx, i64 %m
  %iv = load i64, ptr %ip, align 8
  br label %tok.row
tok.row:
  %xm = phi i64 [%m, %tok], [%iv, %tok.idx]
{x_row}
  %yo = mul nuw nsw i64 %m, %ldy
  br label %row
row:
  %n = phi i64 [%rb, %tok.row], [%n1, %row]
{body}
  %yo2 = add nuw nsw i64 %yo, %n
  %yp = getelementptr inbounds float, ptr %y, i64 %yo2
  store float {cur}, ptr %yp, align 4
  %n1 = add nuw nsw i64 %n, 1
  %rdone = icmp eq i64 %n1, %rend
  br i1 %rdone, label %tok.next, label %row
tok.next:
  %m1 = add nuw nsw i64 %m, 1
  %mdone = icmp eq i64 %m1, %M
  br i1 %mdone, label %block.next, label %tok
block.next:
  %rb1 = add nuw nsw i64 %rb, {ROW_BLOCK}
  %bdone = icmp sge i64 %rb1, %end
  br i1 %bdone, label %exit, label %block
exit:
  ret void
}}
"""
    dot = dot_function(target, spec.fmt, spec.K, spec.group_size, spec.q8)
    ir = dot + kernel
    ir = finish_module(ir, target)
    return KernelSource(spec.name, ir, PARAMS, "rows")
