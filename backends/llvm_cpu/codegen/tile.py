"""Register-blocked q8 micro-kernel for prefill: R weight rows x T activation rows in one pass.

`tile_function` returns an internal, always-inlined LLVM function

    void @tile(ptr w0, ptr s0, ..., ptr w{R-1}, ptr s{R-1},
               ptr x0, ptr xd0, ptr xs0, ..., ptr x{T-1}, ptr xd{T-1}, ptr xs{T-1}, ptr out)

writing out[t * R + r] = dot(W row r, activation row t) for int8/int4 weights (groups of 32)
against q8 activations, as dot.py's `_q8_dot` computes one element. Per pair of groups each
weight row is unpacked once (int4 nibbles, int8 |w|) and each activation block loaded once, for
R * T integer dot products (pmaddubsw/pmaddwd on AVX2, vpdpbusd on AVX-512 VNNI) into R * T
float accumulators: `_q8_dot` redoes the unpacking for every token and the loads for every row.

The loop takes one pair of groups per iteration, so the R * T sums stay in registers: the
scales of a pair are broadcast to its lanes, an integer dot is scaled as (dot * xd) * wd, and
int4's -8 offset enters the integer dot as -8 * block sum in each group's first lane (free on
VNNI: vpdpbusd's accumulator operand). An odd last group takes a one-group step.

Legend: NG = groups per row, L = lanes of one pair's integer dot (8 on AVX2, 16 on AVX-512),
R = weight rows, T = activation rows (tokens) of the tile.
"""

from __future__ import annotations

from ..target import Target
from .common import dims, group_ok, lanes, require, splat, vec
from .dot import _idot, needs_q8, pair_layout

# Best of the shapes measured (benchmarks/cpu_kernels.py --tokens 512, 2048x5632): R x T sums
# plus the tokens' operands must fit the register file (16 ymm on AVX2, 32 zmm on AVX-512).
TILE_AVX2 = (4, 2)
TILE_AVX512 = (4, 4)


def tile_shape(target: Target) -> tuple[int, int]:
    """(R, T): weight rows and tokens per tile on this target."""
    return TILE_AVX512 if target.avx512 else TILE_AVX2


def _unit_kinds(fmt: str, target: Target, n: int) -> list[tuple[int, str]]:
    """(first group, kind) covering n groups: 'pair' (int4 pair layout, AVX2), 'two' (two groups
    in one 512-bit vector) or 'one' (a single group, 256-bit)."""
    if pair_layout(target, fmt, 32):
        return [(j, "pair") for j in range(0, n - 1, 2)] + ([(n - 1, "one")] if n % 2 else [])
    if target.avx512:
        return [(j, "two") for j in range(0, n - 1, 2)] + ([(n - 1, "one")] if n % 2 else [])
    return [(j, "one") for j in range(n)]


def _unit_lanes(kind: str) -> list[int]:
    """The group (0 or 1 of the unit) of each lane of a unit's integer dot."""
    return {"pair": [0] * 4 + [1] * 4, "two": [0] * 8 + [1] * 8, "one": [0] * 8}[kind]


def _row_operand(fmt: str, kind: str, p: str, w: str, g: str) -> tuple[str, list[str]]:
    """IR unpacking one row's weights of a unit starting at group %{g}: (ir, operand values)."""
    if fmt == "int4":
        nq = 16 if kind == "one" else 32
        ir = f"""  %{p}.wo = mul nuw nsw i64 %{g}, 16
  %{p}.qp = getelementptr inbounds i8, ptr {w}, i64 %{p}.wo
  %{p}.q = load <{nq} x i8>, ptr %{p}.qp, align 1
  %{p}.lo = and <{nq} x i8> %{p}.q, {splat(nq, 'i8', '15')}
  %{p}.hi = lshr <{nq} x i8> %{p}.q, {splat(nq, 'i8', '4')}"""
        if kind == "pair":     # low nibbles dot x's first halves, high nibbles the second halves
            return ir, [f"%{p}.lo", f"%{p}.hi"]
        groups = 1 if kind == "one" else 2
        mask = [m for q in range(groups) for m in [q * 16 + i for i in range(16)] + [nq + q * 16 + i for i in range(16)]]
        ir += f"\n  %{p}.u = shufflevector <{nq} x i8> %{p}.lo, <{nq} x i8> %{p}.hi, {lanes(32 * groups, mask)}"
        return ir, [f"%{p}.u"]
    nb = 32 if kind == "one" else 64
    return f"""  %{p}.wo = mul nuw nsw i64 %{g}, 32
  %{p}.qp = getelementptr inbounds i8, ptr {w}, i64 %{p}.wo
  %{p}.q = load <{nb} x i8>, ptr %{p}.qp, align 1
  %{p}.u = call <{nb} x i8> @llvm.abs.v{nb}i8(<{nb} x i8> %{p}.q, i1 false)
  %{p}.neg = icmp slt <{nb} x i8> %{p}.q, zeroinitializer""", [f"%{p}.u", f"%{p}.neg"]


def _token_operand(kind: str, p: str, x: str, g: str) -> tuple[str, list[str]]:
    """IR loading one activation row's bytes of a unit starting at group %{g}."""
    nb = {"pair": 32, "two": 64, "one": 32}[kind]
    ir = f"""  %{p}.xo = mul nuw nsw i64 %{g}, 32
  %{p}.xp = getelementptr inbounds i8, ptr {x}, i64 %{p}.xo
  %{p}.x = load <{nb} x i8>, ptr %{p}.xp, align 1"""
    if kind != "pair":
        return ir, [f"%{p}.x"]
    return ir + f"""
  %{p}.xhp = getelementptr inbounds i8, ptr %{p}.xp, i64 32
  %{p}.xh = load <32 x i8>, ptr %{p}.xhp, align 1""", [f"%{p}.x", f"%{p}.xh"]


def _dot(target: Target, fmt: str, kind: str, p: str, row: list[str], tok: list[str], init: str) -> tuple[str, int]:
    """IR for %{p}.i = init + one row's and one token's integer dots of a unit: (ir, lanes)."""
    if kind == "pair":
        return f"""  %{p}.pl = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {row[0]}, <32 x i8> {tok[0]})
  %{p}.ph = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {row[1]}, <32 x i8> {tok[1]})
  %{p}.ps = add <16 x i16> %{p}.pl, %{p}.ph
  %{p}.d = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> %{p}.ps, <16 x i16> {splat(16, 'i16', '1')})
  %{p}.i = add <8 x i32> %{p}.d, {init}""", 8
    nb = 32 if kind == "one" else 64
    if fmt == "int4":
        signed, ir = tok[0], ""
    else:       # int8: |w| unsigned, x carrying w's sign signed
        signed = f"%{p}.s"
        ir = f"""  %{p}.nx = sub <{nb} x i8> zeroinitializer, {tok[0]}
  %{p}.s = select <{nb} x i1> {row[1]}, <{nb} x i8> %{p}.nx, <{nb} x i8> {tok[0]}
"""
    if nb == 64 and target.vnni:      # the accumulator operand takes init for free
        return ir + f"""  %{p}.u = bitcast <64 x i8> {row[0]} to <16 x i32>
  %{p}.sv = bitcast <64 x i8> {signed} to <16 x i32>
  %{p}.i = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> {init}, <16 x i32> %{p}.u, <16 x i32> %{p}.sv)""", 16
    L = nb // 4
    return ir + _idot(target, nb, row[0], signed, f"%{p}.d") + f"\n  %{p}.i = add <{L} x i32> %{p}.d, {init}", L


def _unit(target: Target, fmt: str, R: int, T: int, kind: str, g: str, u: str, acc: dict) -> list[str]:
    """IR for one unit (a pair of groups, or one group) starting at group %{g}, for every row and
    token: acc[(r, t, lanes)] += (dot * xd) * wd, int4's -8 offset inside the integer dot."""
    lane = _unit_lanes(kind)
    L = len(lane)
    ng = 2 if kind != "one" else 1
    F, FL, IL = vec(ng, "float"), vec(L, "float"), vec(L, "i32")
    out = []
    firsts = [i for i in range(L) if i == 0 or lane[i] != lane[i - 1]]     # each group's first lane
    for t in range(T):
        x = f"{u}x{t}"
        out.append(f"""  %{x}.dp = getelementptr inbounds float, ptr %xd{t}, i64 %{g}
  %{x}.d = load {F}, ptr %{x}.dp, align 4
  %{x}.dv = shufflevector {F} %{x}.d, {F} poison, {lanes(L, lane)}""")
        if fmt == "int4":   # -8 * block sum in each group's first lane: sum (q - 8) x = sum q x - 8 sum x
            out.append(f"""  %{x}.bp = getelementptr inbounds i32, ptr %xs{t}, i64 %{g}
  %{x}.b = load {vec(ng, 'i32')}, ptr %{x}.bp, align 4
  %{x}.b8 = mul {vec(ng, 'i32')} %{x}.b, {splat(ng, 'i32', '-8')}
  %{x}.c = shufflevector {vec(ng, 'i32')} %{x}.b8, {vec(ng, 'i32')} zeroinitializer, {lanes(L, [firsts.index(i) if i in firsts else ng for i in range(L)])}""")
        ir, ops = _token_operand(kind, x, f"%x{t}", g)
        out.append(ir)
        out.append((x, ops))
    toks = [o for o in out if isinstance(o, tuple)]
    out = [o for o in out if isinstance(o, str)]
    for r in range(R):
        w = f"{u}w{r}"
        out.append(f"""  %{w}.sp = getelementptr inbounds half, ptr %s{r}, i64 %{g}
  %{w}.sh = load {vec(ng, 'half')}, ptr %{w}.sp, align 2
  %{w}.d = fpext {vec(ng, 'half')} %{w}.sh to {F}
  %{w}.dv = shufflevector {F} %{w}.d, {F} poison, {lanes(L, lane)}""")
        ir, row = _row_operand(fmt, kind, w, f"%w{r}", g)
        out.append(ir)
        for t, (x, tok) in enumerate(toks):
            p = f"{u}r{r}t{t}"
            ir, width = _dot(target, fmt, kind, p, row, tok, f"%{x}.c" if fmt == "int4" else "zeroinitializer")
            prev = acc.get((r, t, L), "zeroinitializer")
            out.append(f"""{ir}
  %{p}.f = sitofp {IL} %{p}.i to {FL}
  %{p}.fx = fmul {FL} %{p}.f, %{x}.dv
  %{p}.acc = call {FL} @llvm.fma.v{L}f32({FL} %{p}.fx, {FL} %{w}.dv, {FL} {prev})""")
            acc[(r, t, L)] = f"%{p}.acc"
    return out


def tile_function(target: Target, fmt: str, K: int, group_size: int, R: int, T: int, name: str = "tile") -> str:
    dims("tile", K=K)
    dims("tile", hi=16, R=R, T=T)
    group_ok("tile", fmt, group_size)
    require("tile", needs_q8(fmt, group_size), f"no q8 tile for {fmt} in groups of {group_size}")
    NG = -(-K // group_size)
    kinds = _unit_kinds(fmt, target, 2)
    params = [f"ptr noalias %{v}{r}" for r in range(R) for v in ("w", "s")]
    params += [f"ptr noalias %{v}{t}" for t in range(T) for v in ("x", "xd", "xs")]
    head = f"define internal void @{name}({', '.join(params)}, ptr noalias %out) alwaysinline {{\nentry:\n"
    parts = []
    acc: dict = {}
    if NG >= 2:     # one pair of groups per iteration: R x T sums stay in registers
        keys = [(r, t, len(_unit_lanes(kinds[0][1]))) for r in range(R) for t in range(T)]
        start = {k: f"%phi.{k[0]}.{k[1]}" for k in keys}
        acc = dict(start)
        lines = []
        for j, kind in kinds:
            lines.append(f"  %g{j} = add nuw nsw i64 %g, {j}")
            lines += _unit(target, fmt, R, T, kind, f"g{j}", f"m{j}", acc)
        phis = [f"  {start[k]} = phi {vec(k[2], 'float')} [zeroinitializer, %entry], [{acc[k]}, %loop]" for k in keys]
        parts.append(f"""  br label %loop
loop:
  %g = phi i64 [0, %entry], [%g.next, %loop]
{chr(10).join(phis)}
{chr(10).join(lines)}
  %g.next = add nuw nsw i64 %g, 2
  %done = icmp eq i64 %g.next, {NG // 2 * 2}
  br i1 %done, label %tail, label %loop
tail:""")
    if NG % 2:
        parts.append(f"  %gt = add i64 0, {NG - 1}")
        parts += _unit(target, fmt, R, T, "one", "gt", "t", acc)
    for r in range(R):
        for t in range(T):
            total = "0.0"
            for k in sorted(k for k in acc if k[:2] == (r, t)):
                red = f"%red.{r}.{t}.{k[2]}"
                parts.append(f"  {red} = call reassoc float @llvm.vector.reduce.fadd.v{k[2]}f32(float {total}, "
                             f"{vec(k[2], 'float')} {acc[k]})")
                total = red
            parts.append(f"""  %op.{r}.{t} = getelementptr inbounds float, ptr %out, i64 {t * R + r}
  store float {total}, ptr %op.{r}.{t}, align 4""")
    return head + "\n".join(parts) + "\n  ret void\n}\n"
