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
from .tile import tile_function, tile_shape

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
    planes: int = 1               # q8 activations in 2 planes: q16 (elementwise.quantize_q8)

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
        return LinearSpec(self.fmt, self.I, self.D, self.group_size, self.q8, silu_mul=True, planes=self.planes)

    def down(self) -> LinearSpec:
        return LinearSpec(self.dfmt, self.D, self.I, self.dgs, self.dq8, planes=self.planes)

    @property
    def tag(self) -> str:
        t = f"{self.fmt}_{'q8' if self.q8 else 'f32'}_d{self.D}_i{self.I}_g{self.group_size}"
        if (self.dfmt, self.dq8, self.dgs) != (self.fmt, self.q8, self.group_size):
            t += f"_dn{self.dfmt}_{'q8' if self.dq8 else 'f32'}_g{self.dgs}"
        if self.planes == 2:
            t += "_q16"
        return t


def h_stride(spec: MoESpec) -> int:
    """Row stride of the f32 intermediate h: whole groups of down's format (padding stays 0)."""
    return -(-spec.I // spec.dgs) * spec.dgs if spec.dgs else spec.I


def _xrow(q8: bool, K: int, group_size: int, base: str, idx: str, ld: str, out: str, planes: int = 1) -> str:
    """Pointers %{out}, %{out}d, %{out}s to row `idx` of an activation matrix (f32, or q8 of
    `planes` planes)."""
    if q8:
        ng = -(-K // group_size)
        return f"""  %{out}.o = mul nuw nsw i64 {idx}, {planes * ng * group_size}
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


def _silu_mul(p: str, g: str, u: str) -> str:
    """IR for %{p}hv = silu(g) * u (canon.py's: the AMX kernels' bits)."""
    from .canon import silu_mul

    return silu_mul(g, u, f"%{p}hv")


_GU_ARGS = ("ptr noalias %h, ptr noalias %x, ptr noalias %xd, ptr noalias %xs, ptr noalias %w, ptr noalias %s, "
            "ptr noalias %pair_tok, i64 %ldx, i64 %e, i64 %n0, i64 %n1, i64 %p0, i64 %p1")
_GU_CALL = "ptr %h, ptr %x, ptr %xd, ptr %xs, ptr %w, ptr %s, ptr %pair_tok, i64 %ldx, i64 %e"


def _gu_span(spec: MoESpec, rb: int, sb: int, dot2: bool) -> str:
    """@gu_span: expert e's gate/up rows [n0, n1) against pairs [p0, p1), one dot each."""
    I = spec.I
    if dot2:   # gate row n and up row n + I in one pass over x
        gate_and_up = """  %gu2 = call [2 x float] @dot2(ptr %gate.w, ptr %gate.s, ptr %up.w, ptr %up.s, ptr %xr, ptr %xrd, ptr %xrs)
  %g = extractvalue [2 x float] %gu2, 0
  %u = extractvalue [2 x float] %gu2, 1"""
    else:
        gate_and_up = """  %g = call float @dot(ptr %gate.w, ptr %gate.s, ptr %xr, ptr %xrd, ptr %xrs)
  %u = call float @dot(ptr %up.w, ptr %up.s, ptr %xr, ptr %xrd, ptr %xrs)"""
    return f"""
define internal void @gu_span({_GU_ARGS}) {{
entry:
  %nempty = icmp sge i64 %n0, %n1
  %pempty = icmp sge i64 %p0, %p1
  %empty = or i1 %nempty, %pempty
  br i1 %empty, label %exit, label %row
row:
  %n = phi i64 [%n0, %entry], [%n.1, %row.next]
  %er = mul nuw nsw i64 %e, {2 * I}
  %gr = add nuw nsw i64 %er, %n
  %ur = add nuw nsw i64 %gr, {I}
{weight_row('%gr', 'gate', rb, sb)}
{weight_row('%ur', 'up', rb, sb)}
  br label %pair
pair:
  %p = phi i64 [%p0, %row], [%p.1, %pair]
  %tp = getelementptr inbounds i64, ptr %pair_tok, i64 %p
  %tok = load i64, ptr %tp, align 8
{_xrow(spec.q8, spec.D, spec.group_size, 'x', '%tok', '%ldx', 'xr', spec.planes)}
{gate_and_up}
{_silu_mul("", "%g", "%u")}
  %ho = mul nuw nsw i64 %p, {h_stride(spec)}
  %ho2 = add nuw nsw i64 %ho, %n
  %hp = getelementptr inbounds float, ptr %h, i64 %ho2
  store float %hv, ptr %hp, align 4
  %p.1 = add nuw nsw i64 %p, 1
  %pdone = icmp eq i64 %p.1, %p1
  br i1 %pdone, label %row.next, label %pair
row.next:
  %n.1 = add nuw nsw i64 %n, 1
  %done = icmp eq i64 %n.1, %n1
  br i1 %done, label %exit, label %row
exit:
  ret void
}}
"""


def _gu_tiles(spec: MoESpec, rb: int, sb: int, R: int, T: int) -> str:
    """@gu_tiles: expert e's gate rows [n0, n0 + R) and their up rows against pairs [p0, p1)
    (a multiple of T) in tiles of 2R weight rows x T pairs."""
    I = spec.I
    ir, args = [f"  %er = mul nuw nsw i64 %e, {2 * I}", "  %gr = add nuw nsw i64 %er, %n0"], []
    for half, off in (("g", 0), ("u", I)):
        for r in range(R):
            ir.append(f"  %{half}{r}.n = add nuw nsw i64 %gr, {off + r}")
            ir.append(weight_row(f"%{half}{r}.n", f"{half}{r}", rb, sb))
            args += [f"ptr %{half}{r}.w", f"ptr %{half}{r}.s"]
    toks = []
    for t in range(T):
        toks.append(f"""  %p.{t} = add nuw nsw i64 %p, {t}
  %tp{t} = getelementptr inbounds i64, ptr %pair_tok, i64 %p.{t}
  %tok{t} = load i64, ptr %tp{t}, align 8
{_xrow(True, spec.D, spec.group_size, 'x', f'%tok{t}', '%ldx', f'xr{t}', spec.planes)}
  %ho{t} = mul nuw nsw i64 %p.{t}, {h_stride(spec)}
  %hb{t} = add nuw nsw i64 %ho{t}, %n0""")
        args += [f"ptr %xr{t}", f"ptr %xr{t}d", f"ptr %xr{t}s"]
    out = []
    for t in range(T):
        for r in range(R):
            q = f"o{t}.{r}."
            out.append(f"""  %{q}gp = getelementptr inbounds float, ptr %buf, i64 {t * 2 * R + r}
  %{q}g = load float, ptr %{q}gp, align 4
  %{q}up = getelementptr inbounds float, ptr %buf, i64 {t * 2 * R + R + r}
  %{q}u = load float, ptr %{q}up, align 4
{_silu_mul(q, f"%{q}g", f"%{q}u")}
  %{q}ho = add nuw nsw i64 %hb{t}, {r}
  %{q}hp = getelementptr inbounds float, ptr %h, i64 %{q}ho
  store float %{q}hv, ptr %{q}hp, align 4""")
    return f"""
define internal void @gu_tiles({_GU_ARGS}) {{
entry:
  %buf = alloca [{2 * R * T} x float], align 64
{chr(10).join(ir)}
  %pempty = icmp sge i64 %p0, %p1
  br i1 %pempty, label %exit, label %pair
pair:
  %p = phi i64 [%p0, %entry], [%p.next, %pair]
{chr(10).join(toks)}
  call void @tile({', '.join(args)}, ptr %buf)
{chr(10).join(out)}
  %p.next = add nuw nsw i64 %p, {T}
  %pdone = icmp sge i64 %p.next, %p1
  br i1 %pdone, label %exit, label %pair
exit:
  ret void
}}
"""


def gate_up(spec: MoESpec, target: Target) -> KernelSource:
    """Rows are taken R at a time where R of one expert's remain: their pairs in tiles of T
    (q8), the pairs left over (and any lone rows) one dot product each."""
    _check("moe_gate_up", spec)
    lin = spec.gate_up()
    rb, sb = lin.row_bytes()
    I = spec.I
    name = f"moe_gate_up_{spec.tag}"
    R, T = tile_shape(target)
    R = R // 2 if spec.q8 else 1      # R weight rows a tile: R / 2 gate rows and their up rows
    fns = (dot_function(target, spec.fmt, spec.D, spec.group_size, spec.q8, planes=spec.planes)
           + _gu_span(spec, rb, sb, spec.q8))
    if spec.q8:
        fns += (dot2_function(target, spec.fmt, spec.D, spec.group_size, planes=spec.planes)
                + tile_function(target, spec.fmt, spec.D, spec.group_size, 2 * R, T, planes=spec.planes)
                + _gu_tiles(spec, rb, sb, R, T))
        tiles = f"""  %pn = sub nuw nsw i64 %p1, %p0
  %pt.q = udiv i64 %pn, {T}
  %pt.r = mul nuw nsw i64 %pt.q, {T}
  %pt.f = add nuw nsw i64 %p0, %pt.r
  %pt = select i1 %full, i64 %pt.f, i64 %p0
  br i1 %full, label %tiled, label %rest
tiled:
  call void @gu_tiles({_GU_CALL}, i64 %n, i64 %nend, i64 %p0, i64 %pt)
  br label %rest
rest:
  call void @gu_span({_GU_CALL}, i64 %n, i64 %nend, i64 %pt, i64 %p1)"""
    else:
        tiles = f"""  br label %rest
rest:
  call void @gu_span({_GU_CALL}, i64 %n, i64 %nend, i64 %p0, i64 %p1)"""
    ir = f"""{fns}
define void @{name}(ptr noalias %args, i64 %begin, i64 %end) #0 {{
entry:
{load_args(GATE_UP_PARAMS, _PTRS)}
  %empty = icmp sge i64 %begin, %end
  br i1 %empty, label %exit, label %row
row:
  %j = phi i64 [%begin, %entry], [%j1, %rest]
  %a = udiv i64 %j, {I}
  %n = urem i64 %j, {I}
  %ep = getelementptr inbounds i64, ptr %active, i64 %a
  %e = load i64, ptr %ep, align 8
  %fp = getelementptr inbounds i64, ptr %first, i64 %a
  %p0 = load i64, ptr %fp, align 8
  %fp1 = getelementptr inbounds i64, ptr %fp, i64 1
  %p1 = load i64, ptr %fp1, align 8
  %left = sub nuw nsw i64 %end, %j
  %inexp = sub nuw nsw i64 {I}, %n
  %lt = icmp slt i64 %left, %inexp
  %avail = select i1 %lt, i64 %left, i64 %inexp
  %full = icmp sge i64 %avail, {R}
  %step = select i1 %full, i64 {R}, i64 1
  %nend = add nuw nsw i64 %n, %step
{tiles}
  %j1 = add nuw nsw i64 %j, %step
  %done = icmp sge i64 %j1, %end
  br i1 %done, label %exit, label %row
exit:
  ret void
}}
"""
    ir = finish_module(ir, target)
    return KernelSource(name, ir, GATE_UP_PARAMS, "active expert rows (nA * I)")


_DN_ARGS = ("ptr noalias %y, ptr noalias %h, ptr noalias %hd, ptr noalias %hs, ptr noalias %w, ptr noalias %s, "
            "ptr noalias %pair_tok, ptr noalias %pair_w, i64 %ldy, i64 %e, i64 %p0, i64 %p1, i64 %c0, i64 %c1")
_DN_CALL = "ptr %y, ptr %h, ptr %hd, ptr %hs, ptr %w, ptr %s, ptr %pair_tok, ptr %pair_w, i64 %ldy, i64 %e"


def _dn_span(spec: MoESpec, rb: int, sb: int) -> str:
    """@dn_span: y[tok_p, c] += w_p * (down_e[c] . h[p]) for pairs [p0, p1) of expert e, rows [c0, c1)."""
    return f"""
define internal void @dn_span({_DN_ARGS}) {{
entry:
  %pempty = icmp sge i64 %p0, %p1
  %cempty = icmp sge i64 %c0, %c1
  %empty = or i1 %pempty, %cempty
  br i1 %empty, label %exit, label %pair
pair:
  %p = phi i64 [%p0, %entry], [%p.1, %pair.next]
  %er = mul nuw nsw i64 %e, {spec.D}
{_xrow(spec.dq8, spec.I, spec.dgs, 'h', '%p', h_stride(spec), 'hr', spec.planes)}
  %pwp = getelementptr inbounds float, ptr %pair_w, i64 %p
  %pw = load float, ptr %pwp, align 4
  %tp = getelementptr inbounds i64, ptr %pair_tok, i64 %p
  %tok = load i64, ptr %tp, align 8
  %to = mul nuw nsw i64 %tok, %ldy
  br label %col
col:
  %c = phi i64 [%c0, %pair], [%c.1, %col]
  %wr = add nuw nsw i64 %er, %c
{weight_row('%wr', 'dn', rb, sb)}
  %v = call float @dot(ptr %dn.w, ptr %dn.s, ptr %hr, ptr %hrd, ptr %hrs)
  %to2 = add nuw nsw i64 %to, %c
  %ypp = getelementptr inbounds float, ptr %y, i64 %to2
  %yv = load float, ptr %ypp, align 4
  %yv1 = call float @llvm.fma.f32(float %pw, float %v, float %yv)
  store float %yv1, ptr %ypp, align 4
  %c.1 = add nuw nsw i64 %c, 1
  %cdone = icmp eq i64 %c.1, %c1
  br i1 %cdone, label %pair.next, label %col
pair.next:
  %p.1 = add nuw nsw i64 %p, 1
  %pdone = icmp eq i64 %p.1, %p1
  br i1 %pdone, label %exit, label %pair
exit:
  ret void
}}
"""


def _dn_tiles(spec: MoESpec, rb: int, sb: int, R: int, T: int) -> str:
    """@dn_tiles: pairs [p0, p0 + T) of expert e (distinct tokens) against rows [c0, c1) (a
    multiple of R) in R x T tiles."""
    toks, args = [f"  %er = mul nuw nsw i64 %e, {spec.D}"], []
    for t in range(T):
        toks.append(f"""  %p.{t} = add nuw nsw i64 %p0, {t}
{_xrow(True, spec.I, spec.dgs, 'h', f'%p.{t}', h_stride(spec), f'hr{t}', spec.planes)}
  %pwp{t} = getelementptr inbounds float, ptr %pair_w, i64 %p.{t}
  %pw{t} = load float, ptr %pwp{t}, align 4
  %tp{t} = getelementptr inbounds i64, ptr %pair_tok, i64 %p.{t}
  %tok{t} = load i64, ptr %tp{t}, align 8
  %to{t} = mul nuw nsw i64 %tok{t}, %ldy""")
    rows, out = [], []
    for r in range(R):
        rows.append(f"  %r{r}.n = add nuw nsw i64 %wr, {r}\n" + weight_row(f"%r{r}.n", f"r{r}", rb, sb))
        args += [f"ptr %r{r}.w", f"ptr %r{r}.s"]
    args += [a for t in range(T) for a in (f"ptr %hr{t}", f"ptr %hr{t}d", f"ptr %hr{t}s")]
    for t in range(T):
        for r in range(R):
            q = f"o{t}.{r}."
            out.append(f"""  %{q}vp = getelementptr inbounds float, ptr %buf, i64 {t * R + r}
  %{q}v = load float, ptr %{q}vp, align 4
  %{q}yo0 = add nuw nsw i64 %to{t}, %c
  %{q}yo = add nuw nsw i64 %{q}yo0, {r}
  %{q}yp = getelementptr inbounds float, ptr %y, i64 %{q}yo
  %{q}yv = load float, ptr %{q}yp, align 4
  %{q}yv1 = call float @llvm.fma.f32(float %pw{t}, float %{q}v, float %{q}yv)
  store float %{q}yv1, ptr %{q}yp, align 4""")
    return f"""
define internal void @dn_tiles({_DN_ARGS}) {{
entry:
  %buf = alloca [{R * T} x float], align 64
{chr(10).join(toks)}
  %cempty = icmp sge i64 %c0, %c1
  br i1 %cempty, label %exit, label %col
col:
  %c = phi i64 [%c0, %entry], [%c.next, %col]
  %wr = add nuw nsw i64 %er, %c
{chr(10).join(rows)}
  call void @tile({', '.join(args)}, ptr %buf)
{chr(10).join(out)}
  %c.next = add nuw nsw i64 %c, {R}
  %cdone = icmp sge i64 %c.next, %c1
  br i1 %cdone, label %exit, label %col
exit:
  ret void
}}
"""


def down(spec: MoESpec, target: Target) -> KernelSource:
    """y's rows [begin, end) start as the residual (or 0); then per pair its expert's rows. With
    q8, T consecutive pairs of one expert (distinct tokens: pairs are sorted by expert, then
    token) go through R x T tiles; the rest one dot product each."""
    _check("moe_down", spec)
    lin = spec.down()
    rb, sb = lin.row_bytes()
    name = f"moe_down_{spec.tag}{'_r' if spec.residual else ''}"
    R, T = tile_shape(target)
    tiled = spec.dq8
    fns = dot_function(target, spec.dfmt, spec.I, spec.dgs, spec.dq8, planes=spec.planes) + _dn_span(spec, rb, sb)
    if tiled:
        fns += (tile_function(target, spec.dfmt, spec.I, spec.dgs, R, T, planes=spec.planes)
                + _dn_tiles(spec, rb, sb, R, T))
        pick = f"""  %pl = add nuw nsw i64 %p, {T - 1}
  %room = icmp slt i64 %pl, %P
  %plc = select i1 %room, i64 %pl, i64 %p
  %elp = getelementptr inbounds i64, ptr %pair_exp, i64 %plc
  %el = load i64, ptr %elp, align 8
  %same = icmp eq i64 %el, %e
  %full = and i1 %room, %same
  %step = select i1 %full, i64 {T}, i64 1
  %pe = add nuw nsw i64 %p, %step
  %cn = sub nuw nsw i64 %end, %begin
  %ct.q = udiv i64 %cn, {R}
  %ct.r = mul nuw nsw i64 %ct.q, {R}
  %ct.f = add nuw nsw i64 %begin, %ct.r
  %ct = select i1 %full, i64 %ct.f, i64 %begin
  br i1 %full, label %tiled, label %rest
tiled:
  call void @dn_tiles({_DN_CALL}, i64 %p, i64 %pe, i64 %begin, i64 %ct)
  br label %rest
rest:
  call void @dn_span({_DN_CALL}, i64 %p, i64 %pe, i64 %ct, i64 %end)"""
    else:
        pick = f"""  %pe = add nuw nsw i64 %p, 1
  br label %rest
rest:
  call void @dn_span({_DN_CALL}, i64 %p, i64 %pe, i64 %begin, i64 %end)"""
    init = ("""  %ro = mul nuw nsw i64 %m, %ldr
  %ro2 = add nuw nsw i64 %ro, %n
  %rp = getelementptr inbounds float, ptr %r, i64 %ro2
  %rv = load float, ptr %rp, align 4""" if spec.residual else "  %rv = fadd float 0.0, 0.0")
    ir = f"""{fns}
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
  %p = phi i64 [0, %pairs], [%pe, %rest]
  %epp = getelementptr inbounds i64, ptr %pair_exp, i64 %p
  %e = load i64, ptr %epp, align 8
{pick}
  %pdone = icmp sge i64 %pe, %P
  br i1 %pdone, label %exit, label %pair
exit:
  ret void
}}
"""
    ir = finish_module(ir, target)
    return KernelSource(name, ir, DOWN_PARAMS, "output rows (D)")
