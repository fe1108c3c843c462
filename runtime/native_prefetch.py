"""The expert cache's prefetch as native code, run by a fused step's host call after its program.

The Python prefetch (runtime/expert_swaps.py `ExpertSwaps.prefetch_from`) applies the next
cached layer's router to the hidden state a CPU partition made (`lookahead`), copies the experts
it picks that the GPU does not hold into the slots of the lowest-scoring residents it does not
pick (ExpertCache.prefetch), and hands the slot maps back to the GPU. Inside a host call that
Python takes the GIL and keeps the call from running natively, so a prefetching cache would
neither run its CPU share without Python nor overlap it with the GPU's.

`Prefetch` JIT-compiles one function per host call that does the same for each of the call's
caches, its sizes and addresses baked in:

- rms-norm the hidden state's rows, the router's logits (f32), the top k of each row: the
  prediction (`native_pred`);
- while fewer than `max_prefetch` copies: the predicted non-resident expert of highest score,
  into the slot of the lowest-scoring resident the prediction does not name (ties: lowest index,
  as the Python policy's stable sort and min give), if it would outscore that resident after
  the step (ExpertCache.admit_margin); each of its weight arrays' rows copied by
  `memcpy(dst, src, bytes, 1, stream)` — cudaMemcpyAsync on the call's stream on a GPU, a memmove
  on JAX's CPU platform;
- residency (`nonresident`, `slots`) updated in place, the slots written to the call's slot-map
  result, the counters in `native_stats` ([copies allowed, prefetches, bytes, prediction made,
  budget skips, first copy error]) that ExpertCache.fold adds up after the step.

The destinations of the copies (the GPU share's weight buffers) are read from cells the fused
step refreshes before every step (`Prefetch.refresh`): JAX may move an array between steps. The
router's math runs in f32 in another order than NumPy's matmul: a prediction can differ from the
Python one where two logits tie to rounding.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass, field

import numpy as np

_IDS = itertools.count()


@dataclass
class Entry:
    """One cache's prefetch in a host call: the hidden state rows `h` (a frame buffer, rows of
    `ldh` floats), the router (`w` [E, D], `b`, the norm's `nw` and `eps`, top `k`), the cache
    (`c`: ExpertCache), the copies' sources (per weight array: base address, bytes per expert
    row) and the slot-map result buffer `maps_out` (or None)."""

    h: np.ndarray
    w: np.ndarray
    b: np.ndarray | None
    nw: np.ndarray
    eps: float
    k: int
    c: object
    srcs: list[tuple[int, int, int]]     # (address of expert 0's row, bytes between rows, bytes per row) per array
    dst_of: list                         # per array: a function giving the destination array now
    maps_out: np.ndarray | None = None
    dst_cells: np.ndarray = field(default=None)

    def __post_init__(self) -> None:
        self.w = np.ascontiguousarray(self.w, np.float32)
        self.nw = np.ascontiguousarray(self.nw, np.float32)
        self.b = None if self.b is None else np.ascontiguousarray(self.b, np.float32)
        self.dst_cells = np.zeros(len(self.srcs), np.int64)
        self._dsts: list = [None] * len(self.srcs)


class Prefetch:
    """The native prefetch of one host call: `address` is a `void (ptr stream)` function."""

    def __init__(self, entries: list[Entry], memcpy: int = 0) -> None:
        """memcpy: the address of cudaMemcpyAsync, or 0 on JAX's CPU platform (a memmove)."""
        from strata_compiler.backends.llvm_cpu.jit import optimize
        from strata_compiler.backends.llvm_cpu.target import Target

        import llvmlite.binding as llvm

        self.entries = entries
        self.refresh()
        name = f"strata_prefetch_{next(_IDS)}"
        ir = _module(name, entries, memcpy)
        mod, tm = optimize(ir, Target.host())
        ee = llvm.create_mcjit_compiler(mod, tm)
        ee.finalize_object()
        # held by this object, not for the process: the host call handler that calls `address`
        # runs only inside the fused step's program, which goes with the step that holds this
        self._engine = (ee, tm)
        self.address = ee.get_function_address(name)

    def refresh(self) -> None:
        """Before a step: where each copy goes now (an array JAX replaced: its new address), and
        whether each cache's prediction runs (not while its idle back-off pauses it)."""
        for e in self.entries:
            for j, dst in enumerate(e.dst_of):
                a = dst()
                if a is not e._dsts[j]:
                    e._dsts[j] = a
                    e.dst_cells[j] = a.unsafe_buffer_pointer()
            e.c.native_stats[0] = 0 if e.c.pf_wait else 1    # (paused: ExpertCache.prefetch_outcome)

    def check(self) -> None:
        """After a step: a copy that failed is an error (its slot map already names the expert)."""
        from strata_compiler.errors import BackendError

        for e in self.entries:
            err = int(e.c.native_stats[5])
            if err:
                e.c.native_stats[5] = 0
                raise BackendError(f"expert cache {e.c.key}: a prefetch copy failed (CUDA error {err})")


def _addr(a) -> int:
    return 0 if a is None else int(a.ctypes.data)


def _first_best(L: str, i: str, n: int, pre: str, ok: str, scores: str, at: str, cmp: str, best: str,
                arg: str) -> str:
    """IR of a loop over %i < n leaving in %{arg}.out the first index where `ok` (an i1 the IR
    `pre` computes from %i) holds with the best score (f64 `scores` at index `at`; `cmp` ogt: the
    highest, olt: the lowest), -1 where it holds nowhere."""
    from strata_compiler.backends.llvm_cpu.codegen.elementwise import loop

    return loop(L, i, n, pre + f"""
  %{L}.sp = getelementptr double, ptr {scores}, i64 {at}
  %{L}.sv = load double, ptr %{L}.sp, align 8
  %{L}.none = icmp slt i64 %{arg}, 0
  %{L}.cmp = fcmp {cmp} double %{L}.sv, %{best}
  %{L}.bet = or i1 %{L}.none, %{L}.cmp
  %{L}.tk = and i1 {ok}, %{L}.bet
  %{best}.n = select i1 %{L}.tk, double %{L}.sv, double %{best}
  %{arg}.n = select i1 %{L}.tk, i64 %{i}, i64 %{arg}""",
                accs=[(best, "double", "0.0", f"%{best}.n"), (arg, "i64", "-1", f"%{arg}.n")])


def _module(name: str, entries: list[Entry], memcpy: int) -> str:
    from strata_compiler.backends.llvm_cpu.codegen.elementwise import NEG_INF, f32, loop

    copy_fn = "@host_copy" if not memcpy else f"inttoptr (i64 {memcpy} to ptr)"
    body = []
    D_max = max(int(e.w.shape[1]) for e in entries)
    E_max = max(int(e.w.shape[0]) for e in entries)
    for j, e in enumerate(entries):
        c = e.c
        E, D = (int(x) for x in e.w.shape)
        M, ldh = int(e.h.shape[0]), int(e.h.strides[0] // 4)
        S = int(len(c.slots))
        p = f"p{j}"
        P = lambda a: f"inttoptr (i64 {a} to ptr)"     # noqa: E731 - a baked address
        st = P(_addr(c.native_stats))
        body.append(f"""  %{p}.allow = load i64, ptr {st}, align 8
  %{p}.ok = icmp ne i64 %{p}.allow, 0
  br i1 %{p}.ok, label %{p}.go, label %{p}.skip
{p}.skip:
  %{p}.skp = getelementptr i64, ptr {st}, i64 4
  %{p}.sk = load i64, ptr %{p}.skp, align 8
  %{p}.sk1 = add i64 %{p}.sk, 1
  store i64 %{p}.sk1, ptr %{p}.skp, align 8
  br label %{p}.end
{p}.go:
  call void @llvm.memset.p0.i64(ptr {P(_addr(c.native_pred))}, i8 0, i64 {E}, i1 false)""")
        # the prediction: per row, rms-norm, logits, top k
        row = f"""  %{p}.ro = mul i64 %{p}.m, {ldh}
  %{p}.hr = getelementptr float, ptr {P(_addr(e.h))}, i64 %{p}.ro
""" + loop(f"{p}.ss", f"{p}.i", D, f"""  %{p}.hp = getelementptr float, ptr %{p}.hr, i64 %{p}.i
  %{p}.hv = load float, ptr %{p}.hp, align 4
  %{p}.q = fmul reassoc contract float %{p}.hv, %{p}.hv
  %{p}.acc.n = fadd reassoc contract float %{p}.acc, %{p}.q""", accs=[(f"{p}.acc", "float", "0.0", f"%{p}.acc.n")]) + \
            f"""  %{p}.ms = fdiv float %{p}.acc.out, {f32(D)}
  %{p}.me = fadd float %{p}.ms, {f32(e.eps)}
  %{p}.rt = call float @llvm.sqrt.f32(float %{p}.me)
  %{p}.r = fdiv float 1.0, %{p}.rt
""" + loop(f"{p}.nx", f"{p}.d", D, f"""  %{p}.hp2 = getelementptr float, ptr %{p}.hr, i64 %{p}.d
  %{p}.hv2 = load float, ptr %{p}.hp2, align 4
  %{p}.nwp = getelementptr float, ptr {P(_addr(e.nw))}, i64 %{p}.d
  %{p}.nwv = load float, ptr %{p}.nwp, align 4
  %{p}.x1 = fmul float %{p}.hv2, %{p}.r
  %{p}.x2 = fmul float %{p}.x1, %{p}.nwv
  %{p}.xp = getelementptr float, ptr %xs, i64 %{p}.d
  store float %{p}.x2, ptr %{p}.xp, align 4""") + loop(f"{p}.lg", f"{p}.e", E, f"""  %{p}.wo = mul i64 %{p}.e, {D}
  %{p}.wr = getelementptr float, ptr {P(_addr(e.w))}, i64 %{p}.wo
""" + loop(f"{p}.dt", f"{p}.dd", D, f"""  %{p}.wp = getelementptr float, ptr %{p}.wr, i64 %{p}.dd
  %{p}.wv = load float, ptr %{p}.wp, align 4
  %{p}.xp3 = getelementptr float, ptr %xs, i64 %{p}.dd
  %{p}.xv3 = load float, ptr %{p}.xp3, align 4
  %{p}.pr = fmul reassoc contract float %{p}.wv, %{p}.xv3
  %{p}.dot.n = fadd reassoc contract float %{p}.dot, %{p}.pr""", accs=[(f"{p}.dot", "float", "0.0", f"%{p}.dot.n")]) +
            (f"""  %{p}.bp = getelementptr float, ptr {P(_addr(e.b))}, i64 %{p}.e
  %{p}.bv = load float, ptr %{p}.bp, align 4
  %{p}.lv = fadd float %{p}.dot.out, %{p}.bv
""" if e.b is not None else f"  %{p}.lv = fadd float %{p}.dot.out, 0.0\n") +
            f"""  %{p}.lp = getelementptr float, ptr %ls, i64 %{p}.e
  store float %{p}.lv, ptr %{p}.lp, align 4""") + loop(f"{p}.tk", f"{p}.t", e.k, loop(
                f"{p}.am", f"{p}.a", E, f"""  %{p}.ap = getelementptr float, ptr %ls, i64 %{p}.a
  %{p}.av = load float, ptr %{p}.ap, align 4
  %{p}.gt = fcmp ogt float %{p}.av, %{p}.best
  %{p}.best.n = select i1 %{p}.gt, float %{p}.av, float %{p}.best
  %{p}.bi.n = select i1 %{p}.gt, i64 %{p}.a, i64 %{p}.bi""",
                accs=[(f"{p}.best", "float", NEG_INF, f"%{p}.best.n"), (f"{p}.bi", "i64", "0", f"%{p}.bi.n")]) +
            f"""  %{p}.pp = getelementptr i8, ptr {P(_addr(c.native_pred))}, i64 %{p}.bi.out
  store i8 1, ptr %{p}.pp, align 1
  %{p}.lsel = getelementptr float, ptr %ls, i64 %{p}.bi.out
  store float {NEG_INF}, ptr %{p}.lsel, align 4""")
        body.append(loop(f"{p}.row", f"{p}.m", M, row))
        body.append(f"""  %{p}.pvp = getelementptr i64, ptr {st}, i64 3
  store i64 1, ptr %{p}.pvp, align 8
  br label %{p}.polpre
{p}.polpre:
  br label %{p}.pol
{p}.pol:
  %{p}.n = phi i64 [0, %{p}.polpre], [%{p}.n1, %{p}.copied]
  %{p}.more = icmp slt i64 %{p}.n, {int(c.max_prefetch)}
  br i1 %{p}.more, label %{p}.sel, label %{p}.maps
{p}.sel:""")
        sc, nr, sl, pd = (P(_addr(a)) for a in (c.score, c.nonresident, c.slots, c.native_pred))
        # the predicted non-resident expert of highest score (first on ties)
        body.append(_first_best(f"{p}.se", f"{p}.x", E, f"""  %{p}.pdp = getelementptr i8, ptr {pd}, i64 %{p}.x
  %{p}.pdv = load i8, ptr %{p}.pdp, align 1
  %{p}.isp = icmp ne i8 %{p}.pdv, 0
  %{p}.nrp = getelementptr float, ptr {nr}, i64 %{p}.x
  %{p}.nrv = load float, ptr %{p}.nrp, align 4
  %{p}.isn = fcmp une float %{p}.nrv, 0.0
  %{p}.want = and i1 %{p}.isp, %{p}.isn""", f"%{p}.want", sc, f"%{p}.x", "ogt", f"{p}.eb", f"{p}.ei"))
        body.append(f"""  %{p}.hase = icmp sge i64 %{p}.ei.out, 0
  br i1 %{p}.hase, label %{p}.vic, label %{p}.maps
{p}.vic:""")
        # the lowest-scoring resident the prediction does not name (first on ties)
        body.append(_first_best(f"{p}.sv", f"{p}.y", S, f"""  %{p}.slp = getelementptr i32, ptr {sl}, i64 %{p}.y
  %{p}.slv = load i32, ptr %{p}.slp, align 4
  %{p}.sle = sext i32 %{p}.slv to i64
  %{p}.pdp2 = getelementptr i8, ptr {pd}, i64 %{p}.sle
  %{p}.pdv2 = load i8, ptr %{p}.pdp2, align 1
  %{p}.free = icmp eq i8 %{p}.pdv2, 0""", f"%{p}.free", sc, f"%{p}.sle", "olt", f"{p}.vb", f"{p}.vi"))
        copies = []
        total = 0
        for a, (src, stride, rb) in enumerate(e.srcs):
            total += rb
            copies.append(f"""  %{p}.dc{a} = load i64, ptr {P(_addr(e.dst_cells) + 8 * a)}, align 8
  %{p}.do{a} = mul i64 %{p}.vi.out, {rb}
  %{p}.da{a} = add i64 %{p}.dc{a}, %{p}.do{a}
  %{p}.dptr{a} = inttoptr i64 %{p}.da{a} to ptr
  %{p}.so{a} = mul i64 %{p}.ei.out, {stride}
  %{p}.sa{a} = add i64 {src}, %{p}.so{a}
  %{p}.sptr{a} = inttoptr i64 %{p}.sa{a} to ptr
  %{p}.rc{a} = call i32 {copy_fn}(ptr %{p}.dptr{a}, ptr %{p}.sptr{a}, i64 {rb}, i32 1, ptr %stream)
  call void @note_error(ptr {st}, i32 %{p}.rc{a})""")
        # admitted only where the expert would outscore its victim after the step (admit_margin)
        margin = c.admit_margin()
        admit = "" if not np.isfinite(margin) else f"""
  %{p}.esp = getelementptr double, ptr {sc}, i64 %{p}.ei.out
  %{p}.esv = load double, ptr %{p}.esp, align 8
  %{p}.esm = fadd double %{p}.esv, 0x{struct.pack('>d', float(margin)).hex().upper()}
  %{p}.vsi = select i1 %{p}.hasv0, i64 %{p}.vi.out, i64 0
  %{p}.vsp = getelementptr i32, ptr {sl}, i64 %{p}.vsi
  %{p}.vse = load i32, ptr %{p}.vsp, align 4
  %{p}.vsx = sext i32 %{p}.vse to i64
  %{p}.vsq = getelementptr double, ptr {sc}, i64 %{p}.vsx
  %{p}.vsv = load double, ptr %{p}.vsq, align 8
  %{p}.adm = fcmp ogt double %{p}.esm, %{p}.vsv
  %{p}.go2 = and i1 %{p}.hasv0, %{p}.adm"""
        body.append(f"""  %{p}.hasv0 = icmp sge i64 %{p}.vi.out, 0""" + (admit if admit else f"""
  %{p}.go2 = and i1 %{p}.hasv0, true""") + f"""
  br i1 %{p}.go2, label %{p}.copied, label %{p}.maps
{p}.copied:
""" + "\n".join(copies) + f"""
  %{p}.ovp = getelementptr i32, ptr {sl}, i64 %{p}.vi.out
  %{p}.ov = load i32, ptr %{p}.ovp, align 4
  %{p}.ove = sext i32 %{p}.ov to i64
  %{p}.onr = getelementptr float, ptr {nr}, i64 %{p}.ove
  store float 1.0, ptr %{p}.onr, align 4
  %{p}.nnr = getelementptr float, ptr {nr}, i64 %{p}.ei.out
  store float 0.0, ptr %{p}.nnr, align 4
  %{p}.e32 = trunc i64 %{p}.ei.out to i32
  store i32 %{p}.e32, ptr %{p}.ovp, align 4
  %{p}.cp = getelementptr i64, ptr {st}, i64 1
  %{p}.cv = load i64, ptr %{p}.cp, align 8
  %{p}.cv1 = add i64 %{p}.cv, 1
  store i64 %{p}.cv1, ptr %{p}.cp, align 8
  %{p}.bp2 = getelementptr i64, ptr {st}, i64 2
  %{p}.bv2 = load i64, ptr %{p}.bp2, align 8
  %{p}.bv3 = add i64 %{p}.bv2, {total}
  store i64 %{p}.bv3, ptr %{p}.bp2, align 8
  %{p}.n1 = add i64 %{p}.n, 1
  br label %{p}.pol
{p}.maps:""")
        body.append(f"  br label %{p}.end\n{p}.end:")
        if e.maps_out is not None:      # the slot maps the GPU share reads: also when nothing ran
            body.append(f"  call void @llvm.memcpy.p0.p0.i64(ptr {P(_addr(e.maps_out))}, ptr {sl}, i64 {4 * S}, i1 false)")
    return f"""
define internal i32 @host_copy(ptr %d, ptr %s, i64 %n, i32 %kind, ptr %stream) {{
  call void @llvm.memmove.p0.p0.i64(ptr %d, ptr %s, i64 %n, i1 false)
  ret i32 0
}}

define internal void @note_error(ptr %st, i32 %rc) {{
  %bad = icmp ne i32 %rc, 0
  br i1 %bad, label %set, label %ok
set:
  %ep = getelementptr i64, ptr %st, i64 5
  %r64 = sext i32 %rc to i64
  store i64 %r64, ptr %ep, align 8
  br label %ok
ok:
  ret void
}}

define void @{name}(ptr %stream) {{
entry:
  %xs = alloca [{D_max} x float], align 64
  %ls = alloca [{E_max} x float], align 64
""" + "\n".join(body) + """
  ret void
}

declare float @llvm.sqrt.f32(float)
declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)
declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)
declare void @llvm.memmove.p0.p0.i64(ptr, ptr, i64, i1)
"""
