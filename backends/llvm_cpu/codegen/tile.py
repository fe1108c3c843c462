"""Register-blocked q8 micro-kernel for prefill: R weight rows x T activation rows in one pass.

`tile_function` returns an internal, always-inlined LLVM function

    void @tile(ptr w0, ptr s0, ..., ptr w{R-1}, ptr s{R-1},
               ptr x0, ptr xd0, ptr xs0, ..., ptr x{T-1}, ptr xd{T-1}, ptr xs{T-1}, ptr out)

writing out[t * R + r] = dot(W row r, activation row t) for int8/int4/int4a weights (groups of
32) against q8 activations, bit for bit as dot.py's `_q8_dot` computes one element (canon.py's
order). Per unit of groups each weight row is unpacked once (nibbles, int8 |w|) and each
activation block loaded once, for R * T integer dot products (pmaddubsw/pmaddwd on AVX2, vpdpbusd
on AVX-512 VNNI); `_q8_dot` redoes the unpacking for every token and the loads for every row.

The loop takes one batch of 8 groups per iteration, so the R * T accumulators stay in registers:
each (row, token)'s integer dots are folded to one total per group, scaled by weight scale x
activation scale and added to the group's lane. A last partial batch follows the loop.

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
    if fmt in ("int4", "int4a"):
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


def _token_operand(kind: str, p: str, x: str, g: str, off: int = 0) -> tuple[str, list[str]]:
    """IR loading one activation row's bytes of a unit starting at group %{g} (off: of the plane
    that many bytes into the row)."""
    nb = {"pair": 32, "two": 64, "one": 32}[kind]
    ir = f"""  %{p}.xo0 = mul nuw nsw i64 %{g}, 32
  %{p}.xo = add nuw nsw i64 %{p}.xo0, {off}
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
    if fmt in ("int4", "int4a"):
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


def _part(kind: str, ir: list[str], v: str, L: int, pairs: bool, wide: bool, tag: str) -> str:
    """A unit's integer dot as a part of canon.group_totals' shape (AVX-512: 16 lanes, runs of 8;
    the pair layout: 8 lanes, runs of 4; else 8 lanes, one group): a lone group widened with zeros."""
    if kind == "one" and pairs:        # its 8 lanes as 4, then 4 zeros
        ir.append(f"""  %{tag}.e = shufflevector <8 x i32> {v}, <8 x i32> poison, <4 x i32> <i32 0, i32 2, i32 4, i32 6>
  %{tag}.o = shufflevector <8 x i32> {v}, <8 x i32> poison, <4 x i32> <i32 1, i32 3, i32 5, i32 7>
  %{tag}.f = add <4 x i32> %{tag}.e, %{tag}.o
  %{tag}.z = shufflevector <4 x i32> %{tag}.f, <4 x i32> zeroinitializer, {lanes(8, range(8))}""")
        return f"%{tag}.z"
    if kind == "one" and L == 8 and wide:
        ir.append(f"  %{tag}.z = shufflevector <8 x i32> {v}, <8 x i32> zeroinitializer, {lanes(16, range(16))}")
        return f"%{tag}.z"
    return v


def _batch(target: Target, fmt: str, R: int, T: int, n: int, g: str, u: str, acc: dict, kp2: int) -> list[str]:
    """IR adding n <= 8 groups from %{g} to every (row, token) accumulator acc[(r, t)] in
    canon.py's order: per unit the rows are unpacked once and the tokens loaded once (kp2 > 0:
    q16 activations, a second plane kp2 bytes into each row, dotted on top of the first)."""
    from .canon import accumulate, group_totals
    from .dot import PAIRED, _lanes8, _weight_scales

    pairs = pair_layout(target, fmt, 32)
    units = _unit_kinds(fmt, target, n)
    step = 2 if (pairs or target.avx512) else 1
    out: list[str] = []
    toks = []
    for t in range(T):
        x = f"{u}x{t}"
        a, dx = _lanes8(n, g, f"{x}.dx", f"%xd{t}", "float")
        out.append(a)
        bs = None
        if fmt in ("int4", "int4a"):
            b, bs = _lanes8(n, g, f"{x}.bs", f"%xs{t}", "i32")
            out.append(b)
        ops = []
        for j, kind in units:
            out.append(f"  %{x}.g{j} = add nuw nsw i64 %{g}, {j}")
            ir, tok = _token_operand(kind, f"{x}.u{j}", f"%x{t}", f"{x}.g{j}")
            out.append(ir)
            if kp2:
                ir, tok2 = _token_operand(kind, f"{x}.v{j}", f"%x{t}", f"{x}.g{j}", kp2)
                out.append(ir)
                tok = (tok, tok2)
            ops.append(tok)
        toks.append((dx, bs, ops))
    parts: dict = {}
    rows = []
    for r in range(R):
        w = f"{u}w{r}"
        sir, dw, mw = _weight_scales(fmt, n, g, w, f"%s{r}")
        out.append(sir)
        rows.append((dw, mw))
        for k, (j, kind) in enumerate(units):
            out.append(f"  %{w}.g{j} = add nuw nsw i64 %{g}, {j}")
            ir, row = _row_operand(fmt, kind, f"{w}.u{j}", f"%w{r}", f"{w}.g{j}")
            out.append(ir)
            for t, (_, _, ops) in enumerate(toks):
                p = f"{u}r{r}t{t}.u{j}"
                if kp2:     # (first plane << 8) + second plane
                    ir, L = _dot(target, fmt, kind, p, row, ops[k][0], "zeroinitializer")
                    ir2, _ = _dot(target, fmt, kind, p + "b", row, ops[k][1], f"%{p}.h")
                    out += [ir, f"  %{p}.h = shl <{L} x i32> %{p}.i, {splat(L, 'i32', '8')}", ir2]
                    v = f"%{p}b.i"
                else:
                    ir, L = _dot(target, fmt, kind, p, row, ops[k], "zeroinitializer")
                    out.append(ir)
                    v = f"%{p}.i"
                parts.setdefault((r, t), {})[j // step] = _part(kind, out, v, L, pairs, target.avx512, p)
    width, run = (8, 4) if pairs else ((16, 8) if target.avx512 else (8, 8))
    for r, (dw, mw) in enumerate(rows):
        for t, (dx, bs, _) in enumerate(toks):
            q = f"{u}r{r}t{t}"
            got = parts[(r, t)]
            tir, tot = group_totals([got.get(i, "zeroinitializer") for i in range(8 // step)], width, run, q)
            out += [tir, f"  %{q}.d = fmul <8 x float> {dw}, {dx}"]
            if fmt == "int4":
                out.append(f"  %{q}.b8 = shl <8 x i32> {bs}, <i32 3, i32 3, i32 3, i32 3, i32 3, i32 3, i32 3, i32 3>\n"
                           f"  %{q}.t = sub <8 x i32> {tot}, %{q}.b8")
                tot = f"%{q}.t"
            out.append(accumulate(acc[(r, t)], tot, f"%{q}.d", f"%{q}.acc"))
            acc[(r, t)] = f"%{q}.acc"
            if fmt in PAIRED:
                out.append(f"  %{q}.m = fmul <8 x float> {mw}, {dx}")
                out.append(accumulate(f"%{q}.acc", bs, f"%{q}.m", f"%{q}.acm"))
                acc[(r, t)] = f"%{q}.acm"
    return out


def tile_function(target: Target, fmt: str, K: int, group_size: int, R: int, T: int, name: str = "tile",
                  planes: int = 1) -> str:
    from .canon import fold

    dims("tile", K=K)
    dims("tile", hi=16, R=R, T=T)
    group_ok("tile", fmt, group_size)
    require("tile", needs_q8(fmt, group_size), f"no q8 tile for {fmt} in groups of {group_size}")
    NG = -(-K // group_size)
    main, rem = divmod(NG, 8)
    kp2 = 32 * NG if planes == 2 else 0
    params = [f"ptr noalias %{v}{r}" for r in range(R) for v in ("w", "s")]
    params += [f"ptr noalias %{v}{t}" for t in range(T) for v in ("x", "xd", "xs")]
    head = f"define internal void @{name}({', '.join(params)}, ptr noalias %out) alwaysinline {{\nentry:\n"
    parts = []
    keys = [(r, t) for r in range(R) for t in range(T)]
    acc = {k: "zeroinitializer" for k in keys}
    if main:        # one batch of 8 groups per iteration: the R x T accumulators stay in registers
        start = {k: f"%phi.{k[0]}.{k[1]}" for k in keys}
        acc = dict(start)
        lines = _batch(target, fmt, R, T, 8, "g", "m", acc, kp2)
        phis = [f"  {start[k]} = phi <8 x float> [zeroinitializer, %entry], [{acc[k]}, %loop]" for k in keys]
        parts.append(f"""  br label %loop
loop:
  %g = phi i64 [0, %entry], [%g.next, %loop]
{chr(10).join(phis)}
{chr(10).join(lines)}
  %g.next = add nuw nsw i64 %g, 8
  %done = icmp eq i64 %g.next, {8 * main}
  br i1 %done, label %tail, label %loop
tail:""")
    if rem:
        parts.append(f"  %gt = add i64 0, {8 * main}")
        parts += _batch(target, fmt, R, T, rem, "gt", "t", acc, kp2)
    for r, t in keys:
        parts.append(fold(acc[(r, t)], f"%red.{r}.{t}"))
        parts.append(f"""  %op.{r}.{t} = getelementptr inbounds float, ptr %out, i64 {t * R + r}
  store float %red.{r}.{t}, ptr %op.{r}.{t}, align 4""")
    return head + "\n".join(parts) + "\n  ret void\n}\n"
