"""Binders of the llvm executor: for each op, Node -> (Frame -> step function). A binder generates
and compiles the op's kernels once per plan; what it returns sets up their argument arrays once
per step shape; the step function launches them (and carries its segment-program form).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from strata_compiler.errors import BackendError
from strata_compiler.ir import Node, Op
from strata_compiler.rope import rope_inv_freq

from .codegen import amx as amx_gen
from .codegen import attention as attn_gen
from .codegen import elementwise as ew
from .codegen.common import float_slot
from .codegen.dot import needs_q8
from .codegen.linear import LinearSpec, generate as linear_gen
from .codegen.moe import MoESpec, down as moe_down_gen, gate_up as moe_gate_up_gen, h_stride, pairs as moe_pairs_gen
from .frame import COPY, GATHER, MASK, ONE, SET, ExecutorView, Frame, Kernel, Step, ld, ins, step_fn

#: Node -> (Frame -> step function)
Binder = Callable[[ExecutorView, Node], Callable[[Frame], Callable[[Step], None]]]


def _no_clock() -> int:
    return 0


#: tokens of a step from which MoE and linear ops run on AMX tiles where the CPU has them (fewer:
#: the row-by-row kernels, which read each weight once without unpacking it; BENCHMARKS.md)
AMX_MIN_TOKENS = 16

_PHASES = ("moe.mask", "moe.pairs", "moe.quant_x", "moe.gate_up", "moe.quant_h", "moe.down")


def _record_phases(phases: dict, t: list[int], active: np.ndarray, gate_up: tuple, down: tuple) -> None:
    """A MoE call's phase times (t: the clock before, between and after its steps) and the weight
    bytes of its active experts, into `phases`."""
    for k, a, b in zip(_PHASES, t, t[1:]):
        phases.setdefault(k, []).append(b - a)
    for key, (w, s) in (("moe.gate_up_bytes", gate_up), ("moe.down_bytes", down)):
        phases.setdefault(key, []).append(int(sum(w[e].nbytes + (s[e].nbytes if s is not None else 0)
                                                  for e in active)))


def _src(frame: Frame, n: Node, i: int = 0) -> np.ndarray:
    """Operand i of n: the f32[M, C] result of the node that defines it."""
    return frame.out(frame.exe.g.node(n.args[i]))


def _bind_input(exe: ExecutorView, n: Node):
    return lambda frame: step_fn(lambda step: None, lambda step: [])


def _bind_embed(exe: ExecutorView, n: Node):
    spec = exe.g.weight(n.weight("table"))
    if spec.fmt != "f32":   # a quantized table: gather the stored rows, decode them with formats.py
        from strata_compiler.formats import get_format
        f, arrays = get_format(spec.fmt), exe.w.arrays(spec.name)

        def prepare_q(frame: Frame):
            out = frame.out(n)
            return lambda step: out.__setitem__(slice(None), f.dequantize(
                {k: v[frame.ids] for k, v in arrays.items()}, spec.shape[-1], spec.group_size or 32))
        return prepare_q
    table, _ = exe.weight(n.weight("table"))
    D = table.shape[1]
    k = Kernel(exe.lib, ew.embed(D, exe.target))

    def prepare(frame: Frame):
        a = k.args(ids=frame.ids, table=table, y=frame.out(n), ldy=D)
        return a.go_op(exe.pool, frame.M, 16)
    return prepare


def _norm_args(exe: ExecutorView, C: int, group: int, weight: str, eps: float):
    w, _ = exe.weight(weight)
    k = Kernel(exe.lib, ew.rms_norm(C, group, exe.target))
    return lambda x, y: k.args(x=x, w=w, y=y, ldx=ld(x), ldy=ld(y), eps=float_slot(eps))


def _bind_rms_norm(exe: ExecutorView, n: Node):
    C = n.type.shape[-1]
    mk = _norm_args(exe, C, n.attr("group", 0), n.weight("w"), n.attr("eps"))

    def prepare(frame: Frame):
        a = mk(_src(frame, n), frame.out(n))
        return a.go_op(exe.pool, frame.M, 4)
    return prepare


def _bind_linear(exe: ExecutorView, n: Node):
    spec_w = exe.g.weight(n.weight("w"))
    fmt, G = spec_w.fmt, spec_w.group_size
    K = spec_w.shape[1]
    N = n.type.shape[-1]
    q8 = exe.act != "f32" and needs_q8(fmt, G)
    spec = LinearSpec(fmt, N, K, G, q8, bias=n.weight("b") is not None,
                      silu_mul=n.attr("epilogue", "none") == "silu_mul", residual=len(n.args) == 2, planes=exe.planes)
    k = Kernel(exe.lib, linear_gen(spec, exe.target))
    w, s = exe.weight(n.weight("w"))
    b, _ = exe.weight(n.weight("b"))
    norm = (_norm_args(exe, K, 0, n.weight("norm"), n.attr("eps"))
            if n.attr("prologue", "none") == "rms_norm" else None)
    quant = exe.q8(K, fmt, G) if q8 else None
    kp = -(-K // G) * G if G else K
    amx = q8 and amx_gen.linear_supported(exe.target, fmt, G, N, K)
    amx_kernel: list = []       # compiled at the first step that takes it

    def prepare(frame: Frame):
        M = frame.M
        pool = exe.pool
        x = _src(frame, n)
        before: list[Callable[[], None]] = []    # what must run ahead of the matrix kernel
        prog: list | None = []                   # ... as program instructions (None: not expressible)
        if norm is not None:
            xn = frame.temp("norm", (M, kp))    # columns past K stay zero (whole groups)
            na = norm(x, xn[:, :K] if kp != K else xn)
            before.append(lambda: na.go(pool, M, min_chunk=4))
            prog.append(na.par(M, 4))
            x = xn
        elif kp != K and not q8:
            xp, src = frame.temp("pad", (M, kp)), x
            before.append(lambda: np.copyto(xp[:, :K], src))
            prog = None
            x = xp
        xd = xs = None
        tiled = amx and M >= AMX_MIN_TOKENS
        if quant is not None:       # (AMX tiles: q8 rows up to whole tiles, the padding's scale 0)
            (x, xd, xs), qrun = quant.prepare(frame, x[:, :K] if x.shape[1] != K else x, "x",
                                              rows=-(-M // amx_gen.T) * amx_gen.T if tiled else None)
            before.append(qrun)
            if prog is not None:
                prog.append(qrun.args.par(M, 4))
        r = _src(frame, n, 1) if len(n.args) == 2 else None
        if tiled:
            if not amx_kernel:
                amx_kernel.append(Kernel(exe.lib, amx_gen.linear(amx_gen.AmxLinearSpec(
                    fmt, N, K, bias=spec.bias, silu_mul=spec.silu_mul, residual=spec.residual, planes=exe.planes),
                    exe.target)))
            at = amx_kernel[0].args(y=frame.out(n), x=x, xd=xd, xs=xs, w=w, s=s, b=b, r=r, M=M, ldy=N, ldr=N)

            def run_tiles(step: Step) -> None:
                for f in before:
                    f()
                at.go(pool, N // amx_gen.T)
            return step_fn(run_tiles, None)
        a = k.args(y=frame.out(n), x=x, xd=xd, xs=xs, w=w, s=s, b=b, r=r, xidx=None, M=M,
                   ldx=ld(x), ldy=N, ldr=N)

        def run(step: Step) -> None:
            for f in before:
                f()
            a.go(pool, N, min_chunk=16)
        return step_fn(run, None if prog is None else lambda step: prog + [a.par(N, 16)])
    return prepare


def _bind_attention(exe: ExecutorView, n: Node):
    H, KV, hd = n.attr("n_heads"), n.attr("n_kv_heads"), n.attr("head_dim")
    prep = Kernel(exe.lib, attn_gen.attn_prep(H, KV, hd, n.attr("qk_norm"), n.has_attr("clip_qkv"), exe.target))
    core = Kernel(exe.lib, attn_gen.attn_core(H, KV, hd, exe.target))
    inv = np.ascontiguousarray(rope_inv_freq(hd, dict(n.attrs)), np.float32)
    qn, _ = exe.weight(n.weight("q_norm"))
    kn, _ = exe.weight(n.weight("k_norm"))
    layer = n.attr("layer")

    def prepare(frame: Frame):
        qkv = _src(frame, n)
        q = frame.temp("attn.q", (frame.M, H * hd))
        o = frame.out(n)
        pasts = frame.temp("attn.pasts", (frame.M,), np.int64)   # each batch row's position (B <= M)
        ap = prep.args(qkv=qkv, qnw=qn, knw=kn, qout=q, ldq=ld(qkv), inv_freq=inv, pasts=pasts,
                       eps=float_slot(n.attr("eps", 1e-6)), clip=float_slot(n.attr("clip_qkv", 0.0)))
        ac = core.args(qout=q, o=o, ldo=H * hd, pasts=pasts)
        pool = exe.pool

        def pre(step: Step) -> None:
            c = step.cache
            pasts[:step.B] = c.positions(step.T)     # checks the capacity; T > 1 needs uniform rows
            kc, vc = c.k[layer], c.v[layer]
            ap.set(kc=kc, vc=vc, T=step.T, cap=c.capacity)
            ac.set(kc=kc, vc=vc, T=step.T, cap=c.capacity)

        def run(step: Step) -> None:
            pre(step)
            ap.go(pool, frame.M, min_chunk=2)
            ac.go(pool, step.B * H)
        return step_fn(run, lambda step: [ap.par(frame.M, 2), ac.par(step.B * H)], pre)
    return prepare


def _moe_spec(exe: ExecutorView, n: Node) -> tuple[MoESpec, int]:
    """The MoE kernels' spec, from the node's fused gate_up (the fuse pass's) and down weights, and
    its expert count."""
    if n.weight("gate_up") is None:
        raise BackendError(f"moe_ffn %{n.id} has separate gate and up weights; the llvm backend needs the fused "
                           f"gate_up of the fuse pass — recompile the plan")
    gu_spec = exe.g.weight(n.weight("gate_up"))
    fmt, G = gu_spec.fmt, gu_spec.group_size
    E, I2, D = gu_spec.shape
    q8 = exe.act != "f32" and needs_q8(fmt, G)
    dn_spec = exe.g.weight(n.weight("down"))
    dG = dn_spec.group_size
    spec = MoESpec(fmt, D, I2 // 2, G, q8, residual=len(n.args) == 3, down_fmt=dn_spec.fmt,
                   down_q8=exe.act != "f32" and needs_q8(dn_spec.fmt, dG), down_group_size=dG, planes=exe.planes)
    return spec, E


def _bind_moe(exe: ExecutorView, n: Node):
    spec, E = _moe_spec(exe, n)
    fmt, G, D, I, q8 = spec.fmt, spec.group_size, spec.D, spec.I, spec.q8
    dfmt, dG = spec.down_fmt, spec.down_group_size
    ku = Kernel(exe.lib, moe_gate_up_gen(spec, exe.target))
    kd = Kernel(exe.lib, moe_down_gen(spec, exe.target))
    kp = Kernel(exe.lib, moe_pairs_gen(E, exe.target))
    wu, su = exe.weight(n.weight("gate_up"))
    wd, sd = exe.weight(n.weight("down"))
    qx = exe.q8(D, fmt, G) if q8 else None
    qh = exe.q8(I, dfmt, dG) if spec.dq8 else None
    dp = -(-D // G) * G if (G and not q8) else D     # f32 rows padded to whole groups
    ip = h_stride(spec)
    ids = tuple(n.attr("experts", ()))
    idx = np.array(ids, np.int64)
    from strata_compiler.experts import static_nonresident

    cache_key = n.attr("cache", "") if not ids else ""    # an expert cache's host side
    plan_mask = static_nonresident(exe.g, n) if cache_key else None
    weight_names = [w for _, w in n.weights]
    amx = (q8 and spec.dq8 and not cache_key
           and amx_gen.supported(exe.target, fmt, G, dfmt, dG, D, I))
    amx_kernels: list = []      # compiled at the first step that takes them

    def prepare(frame: Frame):
        M = frame.M
        x, comb = _src(frame, n, 0), _src(frame, n, 1)
        full, comb, gather = _moe_routing(exe, frame, n, comb, E, ids, idx, cache_key, plan_mask)
        tiled = amx and M >= AMX_MIN_TOKENS
        tok, exp, pw, first, active, count, h = _moe_pairs(frame, E, ip, tiled)
        (xin, xd, xs, qxrun), (hin, hd, hs, qhrun) = _moe_inputs(frame, x, h, qx, qh, (D, dp, I, ip))
        r = _src(frame, n, 2) if len(n.args) == 3 else None
        au = ku.args(h=h, x=xin, xd=xd, xs=xs, w=wu, s=su, pair_tok=tok, first=first, active=active,
                     ldx=ld(xin))
        ad = kd.args(y=frame.out(n), r=r, h=hin, hd=hd, hs=hs, w=wd, s=sd, pair_tok=tok, pair_exp=exp, pair_w=pw,
                     M=M, ldy=D, ldr=D)
        ap = kp.args(comb=comb, ldc=ld(comb), M=M, tok=tok, exp=exp, pw=pw, first=first, active=active, count=count)
        native = None
        if not (xin is not x and qxrun is None):      # (an f32 x padded in Python: no program)
            prog = _moe_program(M, E, I, D, (full, comb, gather, cache_key), idx, (kp, ap, count), (au, ad),
                                (qxrun, qhrun))
            native = (_moe_masked_program(exe, cache_key, plan_mask, M, E, full, comb, prog) if cache_key
                      else lambda step: prog)
        tiles = None
        if tiled:
            if not amx_kernels:
                aspec = amx_gen.AmxMoESpec(fmt, dfmt, D, I, residual=spec.residual, planes=exe.planes)
                amx_kernels[:] = [Kernel(exe.lib, amx_gen.gate_up(aspec, exe.target)),
                                  Kernel(exe.lib, amx_gen.down(aspec, exe.target))]
            tiles = _amx_tiles(frame, n, amx_kernels, (h, hin, hd, hs, qhrun), I, D, E, ip, (xd, xs), (wu, su),
                               (wd, sd), r)
        run = _moe_run(exe, gather, (kp, ap, count), (tok, pw, first, active), (x, xin, qxrun), qhrun, (au, ad),
                       tiles, (I, D), (weight_names, (wu, su), (wd, sd)))
        return step_fn(run, native if tiles is None else None)
    return prepare


def _moe_routing(exe: ExecutorView, frame: Frame, n: Node, comb: np.ndarray, E: int, ids: tuple, idx: np.ndarray,
                 cache_key: str, plan_mask) -> tuple:
    """The routing weights a MoE op's kernels read: every expert's but those resident in the GPU
    cache (an expert cache's host side: the live cache's mask, else the plan's), or the columns of
    this node's share of the layer's experts. Returns (the node's full routing weights, those read,
    what fills them each step or None)."""
    full, gather = comb, None
    if cache_key:
        full, comb = comb, frame.temp(f"moe.comb{n.id}", (frame.M, E))

        def masked():
            live = exe.residency.get(cache_key)
            np.multiply(full, (plan_mask if live is None else live.nonresident)[None, :], out=comb)
            if live is not None:
                live.observe(full)
        gather = masked
    elif ids:
        if ids == tuple(range(ids[0], ids[0] + E)):
            comb = comb[:, ids[0]:ids[0] + E]          # a strided view: the kernel takes ldc
        else:
            full, comb = comb, frame.temp(f"moe.comb{n.id}", (frame.M, E))
            gather = lambda: np.take(full, idx, axis=1, out=comb)  # noqa: E731
    return full, comb, gather


def _moe_pairs(frame: Frame, E: int, ip: int, tiled: bool) -> tuple:
    """The buffers the pairs kernel writes (each pair's token, expert and weight, each expert's first
    pair, the active experts, count = [pairs, active experts]) and h: one row per pair, the AMX
    form (`tiled`) padding each active expert's to whole tiles."""
    Pmax = frame.M * E
    tok = frame.temp("moe.tok", (Pmax,), np.int64)
    exp = frame.temp("moe.exp", (Pmax,), np.int64)
    pw = frame.temp("moe.w", (Pmax,), np.float32)
    first = frame.temp("moe.first", (E + 1,), np.int64)
    active = frame.temp("moe.active", (E,), np.int64)
    count = frame.temp("moe.count", (2,), np.int64)
    h = frame.temp("moe.h", (Pmax + (amx_gen.T - 1) * E if tiled else Pmax, ip))
    return tok, exp, pw, first, active, count, h


def _moe_inputs(frame: Frame, x: np.ndarray, h: np.ndarray, qx, qh, dims: tuple) -> tuple:
    """x and h as the matrix kernels read them: x's rows padded to whole groups (f32; copied in each
    step) or its q8 form, and h's q8 form for down; each with its quantizer (None: not quantized).
    Returns (xin, xd, xs, qxrun), (hin, hd, hs, qhrun)."""
    D, dp, I, ip = dims
    xin = x
    if dp != D:
        xin = frame.temp("moe.xpad", (frame.M, dp))
    xd = xs = hd = hs = None
    qxrun = qhrun = None
    hin = h
    if qx is not None:
        (xin, xd, xs), qxrun = qx.prepare(frame, x, "moe.x")
    if qh is not None:
        (hin, hd, hs), qhrun = qh.prepare(frame, h[:, :I] if ip != I else h, "moe.h")
    return (xin, xd, xs, qxrun), (hin, hd, hs, qhrun)


def _moe_program(M: int, E: int, I: int, D: int, routing: tuple, idx: np.ndarray, pairs: tuple, mats: tuple,
                 quant: tuple) -> list:
    """A MoE op's row-by-row form as program instructions: count = [P pairs, nA active experts],
    written by the pairs kernel, sizes the rest."""
    full, comb, gather, cache_key = routing
    kp, ap, count = pairs
    au, ad = mats
    qxrun, qhrun = quant
    prog = []
    if gather is not None and not cache_key:      # the share's routing columns (32-bit values)
        prog.append(ins(GATHER, f3=M, src=full.ctypes.data, f5=ld(full), f6=ld(comb),
                        dst=comb.ctypes.data, f8=idx.ctypes.data, f9=E))
    prog.append(ins(ONE, kp.addr, ap.addr, 0, f8=1))
    if qxrun is not None:
        prog.append(qxrun.args.par(M, 4))
    prog.append(au.par(0, 8, src=count.ctypes.data + 8, mult=I))
    if qhrun is not None:
        prog.append(qhrun.args.par(0, 4, src=count.ctypes.data, mult=1))
    prog.append(ins(SET, src=count.ctypes.data, f5=1, dst=ad.slot("P")))
    prog.append(ad.par(D, 16))
    return prog


def _moe_masked_program(exe: ExecutorView, cache_key: str, plan_mask, M: int, E: int, full: np.ndarray,
                        comb: np.ndarray, prog: list) -> Callable:
    """An expert cache's host side as a program: the routing weights masked, then `prog`."""
    keep: list = []     # the counts of a plan without a live cache, alive as long as its program

    def masked_native(step):
        """The routing weights of the experts the GPU does not hold (the live cache's mask,
        read as the program runs: its swaps change it between steps), counted per
        expert into the cache's counts (ExpertCache.fold turns them into hits, misses and
        what the swaps learn from); looked up when the program is built, after the
        session registered its caches."""
        live = exe.residency.get(cache_key)
        mask = plan_mask if live is None else live.nonresident
        counts = np.zeros(E, np.int64) if live is None else live.counts
        keep.append((mask, counts))
        return [ins(MASK, fn=counts.ctypes.data, f3=M, src=full.ctypes.data, f5=ld(full), f6=ld(comb),
                    dst=comb.ctypes.data, f8=mask.ctypes.data, f9=E)] + prog
    return masked_native


def _moe_run(exe: ExecutorView, gather, route: tuple, pairs: tuple, xq: tuple, qhrun, mats: tuple, tiles,
             dims: tuple, weights: tuple) -> Callable[[Step], None]:
    """A MoE op's step function: routing weights, pairs, x's kernel form, then the two matrix
    products (row by row, or `tiles`); each phase timed where the step asks."""
    pool = exe.pool
    kp, ap, count = route
    tok, pw, first, active = pairs
    x, xin, qxrun = xq
    au, ad = mats
    I, D = dims
    weight_names, (wu, su), (wd, sd) = weights

    def run(step: Step) -> None:
        clock = _no_clock if step.phases is None else time.perf_counter_ns
        t = [clock()]
        if gather is not None:
            gather()
        t.append(clock())
        pool.run(kp.addr, ap.addr, 0, 1)                    # routing pairs, grouped by expert
        P, nA = int(count[0]), int(count[1])
        t.append(clock())
        if xin is not x and qxrun is None:
            xin[:, :D] = x
        if qxrun is not None:
            qxrun()
        t.append(clock())
        if tiles is not None:
            tiles(pool, xin, tok, pw, first, active, P, nA, t, clock)
        else:
            _rows(P, nA, t, clock)
        tier = getattr(exe.w, "disk_tier", None)
        if tier is not None:                 # experts on the disk tier (runtime/disk_tier.py): their pages go now
            tier.after(weight_names)
        if step.phases is not None:
            _record_phases(step.phases, t, active[:nA], (wu, su), (wd, sd))

    def _rows(P: int, nA: int, t: list, clock) -> None:
        au.go(pool, nA * I, min_chunk=8)
        t.append(clock())
        if qhrun is not None:
            qhrun(P)
        t.append(clock())
        ad.set(P=P).go(pool, D, min_chunk=16)
        t.append(clock())
    return run


def _amx_tiles(frame: Frame, n: Node, kernels: list, hs: tuple, I: int, D: int, E: int, ip: int, xq8: tuple,
               gate_up: tuple, down: tuple, r):
    """The AMX form of a MoE op's two matrix products (codegen/amx.py): each active expert's
    pairs gathered into q8 rows padded to whole tiles, then gate_up, h quantized, down. `hs`: the
    op's h (rows for the padding included), its q8 scratch and quantizer; `xq8`: x's q8 scales
    and block sums. Returns the function a step calls after its routing pairs and its quantized
    x are made."""
    T = amx_gen.T
    h, hq, hd, hsum, qrun = hs
    xd, xs = xq8
    rows = h.shape[0]
    ku, kd = kernels
    ng = D // 32
    xg = frame.temp("moe.amx.x", (rows, 32 * ng * frame.exe.planes), np.int8)
    xgd = frame.temp("moe.amx.xd", (rows, ng), np.float32)
    xgs = frame.temp("moe.amx.xs", (rows, ng), np.int32)
    ptok = frame.temp("moe.amx.tok", (rows,), np.int64)
    pwr = frame.temp("moe.amx.w", (rows,), np.float32)
    act = frame.temp("moe.amx.act", (E,), np.int64)
    start = frame.temp("moe.amx.start", (E,), np.int64)
    ntiles = frame.temp("moe.amx.tiles", (E,), np.int64)
    au = ku.args(h=h, x=xg, xd=xgd, xs=xgs, w=gate_up[0], s=gate_up[1], act=act, pstart=start, ptiles=ntiles,
                 ldh=ip)
    ad = kd.args(y=frame.out(n), r=r, h=hq, hd=hd, hs=hsum, w=down[0], s=down[1], act=act, pstart=start, ptiles=ntiles,
                 ptok=ptok, pw=pwr, nA=0, M=frame.M, ldy=D, ldr=D)

    def run(pool, xq, tok, pw, first, active, P: int, nA: int, t: list, clock) -> None:
        counts = np.diff(first[:nA + 1])
        nt = (counts + T - 1) // T
        st = T * (np.cumsum(nt) - nt)
        Pp = int(T * nt.sum())
        prow = np.repeat(st - first[:nA], counts) + np.arange(P)      # pair -> its padded row
        act[:nA], start[:nA], ntiles[:nA] = active[:nA], st, nt
        ptok[:Pp] = -1
        ptok[prow] = tok[:P]
        pwr[prow] = pw[:P]
        xgd[:Pp] = 0.0                  # pad rows: scale 0, whatever their bytes
        xg[prow] = xq[tok[:P]]
        xgd[prow] = xd[tok[:P]]
        xgs[prow] = xs[tok[:P]]
        au.go(pool, nA * (I // T))
        t.append(clock())
        qrun(Pp)
        t.append(clock())
        ad.set(nA=nA).go(pool, D // T)
        t.append(clock())
    return run


def _bind_route(exe: ExecutorView, n: Node):
    E = n.type.shape[-1]
    k = Kernel(exe.lib, ew.route(E, n.attr("k"), bool(n.attr("norm")), exe.target))

    def prepare(frame: Frame):
        x = _src(frame, n)
        a = k.args(x=x, y=frame.out(n), ldx=ld(x), ldy=E)
        return a.go_op(exe.pool, frame.M, 16)
    return prepare


def _bind_binary(op: str):
    def bind(exe: ExecutorView, n: Node):
        C = n.type.shape[-1]
        a_cols, b_cols = (exe.g.node(a).type.shape[-1] for a in n.args)
        swap = a_cols != C                               # the kernel broadcasts its second operand
        k = Kernel(exe.lib, ew.binary(op, C, a_cols if swap else b_cols, exe.target))

        def prepare(frame: Frame):
            a, b = _src(frame, n, 0), _src(frame, n, 1)
            if swap:
                a, b = b, a
            args = k.args(a=a, b=b, y=frame.out(n), lda=ld(a), ldb=ld(b), ldy=C)
            return args.go_op(exe.pool, frame.M, 16)
        return prepare
    return bind


def _bind_unary(op: str):
    def bind(exe: ExecutorView, n: Node):
        C = n.type.shape[-1]
        k = Kernel(exe.lib, ew.unary(op, C, exe.target))

        def prepare(frame: Frame):
            x = _src(frame, n)
            a = k.args(x=x, y=frame.out(n), ldx=ld(x), ldy=C, limit=float_slot(n.attr("limit", 0.0)))
            return a.go_op(exe.pool, frame.M, 16)
        return prepare
    return bind


def _bind_transfer(exe: ExecutorView, n: Node):
    """An activation arriving from another device: its operand was copied into place already."""
    def prepare(frame: Frame):
        dst, src = frame.out(n), _src(frame, n)
        same = dst.flags.c_contiguous and src.flags.c_contiguous and dst.dtype == src.dtype and dst.shape == src.shape
        native = (lambda step: [ins(COPY, f3=dst.nbytes, src=src.ctypes.data, dst=dst.ctypes.data)]) if same else None
        return step_fn(lambda step: np.copyto(dst, src), native)
    return prepare


def _bind_slice(exe: ExecutorView, n: Node):
    start, stop = n.attr("start"), n.attr("stop")
    k = Kernel(exe.lib, ew.slice_copy(start, stop, exe.target))

    def prepare(frame: Frame):
        x = _src(frame, n)
        a = k.args(x=x, y=frame.out(n), ldx=ld(x), ldy=stop - start)
        return a.go_op(exe.pool, frame.M, 16)
    return prepare


BINDERS: dict[Op, Binder] = {
    Op.INPUT_IDS: _bind_input,
    Op.EMBED: _bind_embed,
    Op.RMS_NORM: _bind_rms_norm,
    Op.LINEAR: _bind_linear,
    Op.FUSED_ATTENTION: _bind_attention,
    Op.MOE_FFN: _bind_moe,
    Op.ROUTE: _bind_route,
    Op.ADD: _bind_binary("add"),
    Op.MUL: _bind_binary("mul"),
    Op.SIGMOID: _bind_unary("sigmoid"),
    Op.SILU: _bind_unary("silu"),
    Op.CLAMP: _bind_unary("clamp"),
    Op.SLICE: _bind_slice,
    Op.TRANSFER: _bind_transfer,
}
