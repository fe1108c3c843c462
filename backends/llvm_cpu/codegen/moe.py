"""Mixture-of-experts FFN kernels: the experts chosen by some token, and only those.

Routing is given as (token, expert, weight) pairs sorted by expert — P = tokens x top_k pairs,
nA active experts, pairs [first[a], first[a+1]) belong to active expert a. Two kernels:

  moe_gate_up  h[p, n] = silu(gate_e[n] . x[tok_p]) * (up_e[n] . x[tok_p])
               parallel over the nA x I rows of the active experts' merged gate/up weights;
               each weight row is read once and applied to all of that expert's tokens.
  moe_down     y[m, n] = residual[m, n] + sum_p [tok_p == m] w_p * (down_{e_p}[n] . h[p])
               parallel over the D output rows: every task owns its columns of y, so there
               are no write conflicts and the residual add is fused.

Legend: M tokens, D hidden, I expert intermediate, E experts, P pairs, nA active experts.
Weights are stacked [E, rows, K] in a format of formats.py; `dot` is dot.py's row dot product.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..target import Target
from .common import KernelSource, dims, load_args, one_of
from .dot import dot2_function, dot_function, finish_module, weight_row
from .linear import LinearSpec, check

GATE_UP_PARAMS = ("h", "x", "xd", "xs", "w", "s", "pair_tok", "first", "active", "ldx")
DOWN_PARAMS = ("y", "r", "h", "hd", "hs", "w", "s", "pair_tok", "pair_exp", "pair_w", "P", "M", "ldy", "ldr")
_PTRS = {"h", "x", "xd", "xs", "w", "s", "pair_tok", "first", "active", "y", "r", "hd", "hs", "pair_exp", "pair_w"}


@dataclass(frozen=True)
class MoESpec:
    fmt: str         # gate_up's format (down's too unless down_fmt says otherwise)
    D: int           # hidden size (gate/up input, down output rows)
    I: int           # expert intermediate size
    group_size: int
    q8: bool = False          # gate_up reads q8 activations
    residual: bool = False
    down_fmt: str = ""        # layer-adaptive plans may store down in another format
    down_q8: bool | None = None
    down_group_size: int = -1

    @property
    def dfmt(self) -> str:
        return self.down_fmt or self.fmt

    @property
    def dq8(self) -> bool:
        return self.q8 if self.down_q8 is None else self.down_q8

    @property
    def dgs(self) -> int:
        return self.group_size if self.down_group_size < 0 else self.down_group_size

    def gate_up(self) -> LinearSpec:
        return LinearSpec(self.fmt, self.I, self.D, self.group_size, self.q8, silu_mul=True)

    def down(self) -> LinearSpec:
        return LinearSpec(self.dfmt, self.D, self.I, self.dgs, self.dq8)

    @property
    def tag(self) -> str:
        t = f"{self.fmt}_{'q8' if self.q8 else 'f32'}_d{self.D}_i{self.I}_g{self.group_size}"
        if (self.dfmt, self.dq8, self.dgs) != (self.fmt, self.q8, self.group_size):
            t += f"_dn{self.dfmt}_{'q8' if self.dq8 else 'f32'}_g{self.dgs}"
        return t


def h_stride(spec: MoESpec) -> int:
    """Row stride of the f32 intermediate h: whole groups of down's format (padding stays 0)."""
    return -(-spec.I // spec.dgs) * spec.dgs if spec.dgs else spec.I


def _xrow(q8: bool, K: int, group_size: int, base: str, idx: str, ld: str, out: str) -> str:
    """Pointers %{out}, %{out}d, %{out}s to row `idx` of an activation matrix (f32 or q8)."""
    if q8:
        ng = -(-K // group_size)
        return f"""  %{out}.o = mul nuw nsw i64 {idx}, {ng * group_size}
  %{out} = getelementptr inbounds i8, ptr %{base}, i64 %{out}.o
  %{out}.so = mul nuw nsw i64 {idx}, {4 * ng}
  %{out}d = getelementptr inbounds i8, ptr %{base}d, i64 %{out}.so
  %{out}s = getelementptr inbounds i8, ptr %{base}s, i64 %{out}.so"""
    return f"""  %{out}.o = mul nuw nsw i64 {idx}, {ld}
  %{out} = getelementptr inbounds float, ptr %{base}, i64 %{out}.o
  %{out}d = getelementptr inbounds i8, ptr %{base}, i64 0
  %{out}s = getelementptr inbounds i8, ptr %{base}, i64 0"""


PAIRS_PARAMS = ("comb", "ldc", "M", "tok", "exp", "pw", "first", "active", "count")


def pairs(E: int, target: Target) -> KernelSource:
    """Routing pairs from the dense routing weights comb[M, ldc] (0 = not routed), by a counting
    pass over experts: pairs sorted by expert, then token (the order the other kernels expect).
    Writes tok/exp/pw[P], active[nA], first[nA + 1] and count = (P, nA). Serial: one call with
    [begin, end) = [0, 1); O(M * E), a few microseconds at decode."""
    from .elementwise import loop, module

    dims("moe_pairs", E=E)
    body = loop("ex", "e", E, loop("tk", "m", "%M", f"""  %co = mul nsw i64 %m, %ldc
  %ci = add nsw i64 %co, %e
  %cp = getelementptr inbounds float, ptr %comb, i64 %ci
  %cv = load float, ptr %cp, align 4
  %routed = fcmp une float %cv, 0.0
  br i1 %routed, label %put, label %tk.latch
put:
  %pc = load i64, ptr %count, align 8
  %tp = getelementptr inbounds i64, ptr %tok, i64 %pc
  store i64 %m, ptr %tp, align 8
  %xp = getelementptr inbounds i64, ptr %exp, i64 %pc
  store i64 %e, ptr %xp, align 8
  %wp = getelementptr inbounds float, ptr %pw, i64 %pc
  store float %cv, ptr %wp, align 4
  %pc1 = add nsw i64 %pc, 1
  store i64 %pc1, ptr %count, align 8""", guard=True) + f"""  %P = load i64, ptr %count, align 8
  %grew = icmp ne i64 %P, %P0
  br i1 %grew, label %add, label %ex.latch
add:
  %na = load i64, ptr %nap, align 8
  %ap = getelementptr inbounds i64, ptr %active, i64 %na
  store i64 %e, ptr %ap, align 8
  %na1 = add nsw i64 %na, 1
  store i64 %na1, ptr %nap, align 8
  %fp = getelementptr inbounds i64, ptr %first, i64 %na1
  store i64 %P, ptr %fp, align 8""", accs=[("P0", "i64", "0", "%P")])
    fn = f"""
define void @moe_pairs_e{E}(ptr noalias %args, i64 %begin, i64 %end) #0 {{
entry:
{load_args(PAIRS_PARAMS, set(PAIRS_PARAMS) - {"M", "ldc"})}
  store i64 0, ptr %count, align 8
  %nap = getelementptr inbounds i64, ptr %count, i64 1
  store i64 0, ptr %nap, align 8
  store i64 0, ptr %first, align 8
{body}  ret void
}}
"""
    return KernelSource(f"moe_pairs_e{E}", module(fn, target), PAIRS_PARAMS, "one call")


def _check(kernel: str, spec: MoESpec) -> None:
    check(kernel, spec.gate_up())
    check(kernel, spec.down())
    one_of(kernel, "residual", spec.residual, (True, False))


def gate_up(spec: MoESpec, target: Target) -> KernelSource:
    _check("moe_gate_up", spec)
    lin = spec.gate_up()
    rb, sb = lin.row_bytes()
    I = spec.I
    name = f"moe_gate_up_{spec.tag}"
    dot = dot_function(target, spec.fmt, spec.D, spec.group_size, spec.q8)
    if spec.q8:   # gate row n and up row n + I in one pass over x
        dot += dot2_function(target, spec.fmt, spec.D, spec.group_size)
        gate_and_up = """  %gu2 = call [2 x float] @dot2(ptr %gate.w, ptr %gate.s, ptr %up.w, ptr %up.s, ptr %xr, ptr %xrd, ptr %xrs)
  %g = extractvalue [2 x float] %gu2, 0
  %u = extractvalue [2 x float] %gu2, 1"""
    else:
        gate_and_up = """  %g = call float @dot(ptr %gate.w, ptr %gate.s, ptr %xr, ptr %xrd, ptr %xrs)
  %u = call float @dot(ptr %up.w, ptr %up.s, ptr %xr, ptr %xrd, ptr %xrs)"""
    ir = f"""{dot}
define void @{name}(ptr noalias %args, i64 %begin, i64 %end) #0 {{
entry:
{load_args(GATE_UP_PARAMS, _PTRS)}
  %empty = icmp sge i64 %begin, %end
  br i1 %empty, label %exit, label %row
row:
  %j = phi i64 [%begin, %entry], [%j1, %row.next]
  %a = udiv i64 %j, {I}
  %n = urem i64 %j, {I}
  %ep = getelementptr inbounds i64, ptr %active, i64 %a
  %e = load i64, ptr %ep, align 8
  %fp = getelementptr inbounds i64, ptr %first, i64 %a
  %p0 = load i64, ptr %fp, align 8
  %fp1 = getelementptr inbounds i64, ptr %fp, i64 1
  %p1 = load i64, ptr %fp1, align 8
  %er = mul nuw nsw i64 %e, {2 * I}
  %gr = add nuw nsw i64 %er, %n
  %ur = add nuw nsw i64 %gr, {I}
{weight_row('%gr', 'gate', rb, sb)}
{weight_row('%ur', 'up', rb, sb)}
  %none = icmp sge i64 %p0, %p1
  br i1 %none, label %row.next, label %pair
pair:
  %p = phi i64 [%p0, %row], [%p.1, %pair]
  %tp = getelementptr inbounds i64, ptr %pair_tok, i64 %p
  %tok = load i64, ptr %tp, align 8
{_xrow(spec.q8, spec.D, spec.group_size, 'x', '%tok', '%ldx', 'xr')}
{gate_and_up}
  %ng = fneg float %g
  %ex = call float @llvm.exp.f32(float %ng)
  %den = fadd float %ex, 1.0
  %sg = fdiv float %g, %den
  %hv = fmul float %sg, %u
  %ho = mul nuw nsw i64 %p, {h_stride(spec)}
  %ho2 = add nuw nsw i64 %ho, %n
  %hp = getelementptr inbounds float, ptr %h, i64 %ho2
  store float %hv, ptr %hp, align 4
  %p.1 = add nuw nsw i64 %p, 1
  %pdone = icmp eq i64 %p.1, %p1
  br i1 %pdone, label %row.next, label %pair
row.next:
  %j1 = add nuw nsw i64 %j, 1
  %done = icmp eq i64 %j1, %end
  br i1 %done, label %exit, label %row
exit:
  ret void
}}
"""
    ir = finish_module(ir, target)
    return KernelSource(name, ir, GATE_UP_PARAMS, "active expert rows (nA * I)")


def down(spec: MoESpec, target: Target) -> KernelSource:
    _check("moe_down", spec)
    lin = spec.down()
    rb, sb = lin.row_bytes()
    D = spec.D
    name = f"moe_down_{spec.tag}{'_r' if spec.residual else ''}"
    dot = dot_function(target, spec.dfmt, spec.I, spec.dgs, spec.dq8)
    init = ("""  %ro = mul nuw nsw i64 %m, %ldr
  %ro2 = add nuw nsw i64 %ro, %n
  %rp = getelementptr inbounds float, ptr %r, i64 %ro2
  %rv = load float, ptr %rp, align 4""" if spec.residual else "  %rv = fadd float 0.0, 0.0")
    ir = f"""{dot}
define void @{name}(ptr noalias %args, i64 %begin, i64 %end) #0 {{
entry:
{load_args(DOWN_PARAMS, _PTRS)}
  %empty = icmp sge i64 %begin, %end
  br i1 %empty, label %exit, label %row
row:
  %n = phi i64 [%begin, %entry], [%n1, %row.next]
  %mempty = icmp sle i64 %M, 0
  br i1 %mempty, label %row.next, label %init
init:
  %m = phi i64 [0, %row], [%m1, %init]
{init}
  %yo = mul nuw nsw i64 %m, %ldy
  %yo2 = add nuw nsw i64 %yo, %n
  %yp = getelementptr inbounds float, ptr %y, i64 %yo2
  store float %rv, ptr %yp, align 4
  %m1 = add nuw nsw i64 %m, 1
  %mdone = icmp eq i64 %m1, %M
  br i1 %mdone, label %row.next, label %init
row.next:
  %n1 = add nuw nsw i64 %n, 1
  %done = icmp eq i64 %n1, %end
  br i1 %done, label %pairs, label %row
pairs:
  %pnone = icmp sle i64 %P, 0
  br i1 %pnone, label %exit, label %pair
pair:
  %p = phi i64 [0, %pairs], [%p.1, %pair.next]
  %epp = getelementptr inbounds i64, ptr %pair_exp, i64 %p
  %e = load i64, ptr %epp, align 8
  %er = mul nuw nsw i64 %e, {D}
{_xrow(spec.dq8, spec.I, spec.dgs, 'h', '%p', h_stride(spec), 'hr')}
  %pwp = getelementptr inbounds float, ptr %pair_w, i64 %p
  %pw = load float, ptr %pwp, align 4
  %tp = getelementptr inbounds i64, ptr %pair_tok, i64 %p
  %tok = load i64, ptr %tp, align 8
  %to = mul nuw nsw i64 %tok, %ldy
  br label %col
col:
  %c = phi i64 [%begin, %pair], [%c1, %col]
  %wr = add nuw nsw i64 %er, %c
{weight_row('%wr', 'dn', rb, sb)}
  %v = call float @dot(ptr %dn.w, ptr %dn.s, ptr %hr, ptr %hrd, ptr %hrs)
  %to2 = add nuw nsw i64 %to, %c
  %ypp = getelementptr inbounds float, ptr %y, i64 %to2
  %yv = load float, ptr %ypp, align 4
  %yv1 = call float @llvm.fma.f32(float %pw, float %v, float %yv)
  store float %yv1, ptr %ypp, align 4
  %c1 = add nuw nsw i64 %c, 1
  %cdone = icmp eq i64 %c1, %end
  br i1 %cdone, label %pair.next, label %col
pair.next:
  %p.1 = add nuw nsw i64 %p, 1
  %pdone = icmp eq i64 %p.1, %P
  br i1 %pdone, label %exit, label %pair
exit:
  ret void
}}
"""
    ir = finish_module(ir, target)
    return KernelSource(name, ir, DOWN_PARAMS, "output rows (D)")
