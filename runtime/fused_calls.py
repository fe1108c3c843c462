"""The host calls of a fused decode step: how each CPU partition runs inside the GPU program.

Each llvm partition becomes a `HostCall` (backends/xla/host_call.py): its handler copies the
partition's GPU-made inputs into the LLVM executor's frame buffers, runs the partition's work and
queues the copies of the results that later GPU partitions read.

The work is native where the partition needs no per-step Python (`_needs_python`): its segment
program (pool.py `strata_run_program`) called from the handler with no callback and no GIL, an
expert cache's mask and counts read and written by the program itself. A partition whose
first GPU-made input is the result of the MoE share that ends the partition before it runs as two
calls around that share (`splits`): the first hands the layer's CPU side to the pool's runner
thread and returns, so the CPU computes its experts while the GPU computes its own; the second
waits for them and runs the combine. Elsewhere the work is a Python callback, as it is for every
call while the MoE phases are timed or experts stream from disk.
"""

from __future__ import annotations

import time

import numpy as np

from strata_compiler.execution import Segment
from strata_compiler.ir import Op


class FusedCalls:
    """The host calls of FusedStep `step`'s CPU partitions, and the host state they share."""

    def __init__(self, step) -> None:
        self.f = step
        self.m = step.m
        self.g = step.g
        self.calls: dict = {}       # (partition, B, part: None, "start" or "finish") -> HostCall
        self.env: dict = {}         # the llvm partitions' host values during a step
        self.cur = None             # (input_ids, cache) of the running step, for the callbacks
        self.error = None           # an exception raised inside a callback (re-raised after the step)
        self.ran = False            # a host call has run (a failure after that is not one of building)
        self._splits = None
        self._works: list = []      # the calls' Python work functions (python_work holds them weakly)
        # [this step's flag for the native calls (0 native, 1 Python, 2 native with time stamps:
        #  `begin`), the pool's chunk count]
        self.cells = np.zeros(2, np.int64)
        self.native: set[int] = set()       # CPU partitions whose host calls run natively
        self._progs: dict = {}              # (partition, B) -> _native_progs
        # their records while the step's `timeline` is on: [on, count, capacity, (partition, TSC in, TSC out)...]
        self.records = np.zeros(3 + 3 * 4096, np.int64)
        self.records[2] = 4096

    # -- the step ------------------------------------------------------------------------------

    def begin(self, input_ids: np.ndarray, cache) -> None:
        """Before a step: the host state its calls share, and whether
        they run natively (0), as Python (1: the MoE phase timer, a disk tier) or natively with
        time stamps between ops (2: tracing)."""
        from strata_compiler import trace
        from strata_compiler.backends.llvm_cpu.executor import IN_FRAME

        # GPU-made inputs arrive in the frame buffers themselves (the host calls copy them there)
        self.env = {a: IN_FRAME for ins in self.f.dev_in.values() for a in ins}
        timed = any(exe.phase_ns is not None for kind, exe, _ in self.m.parts if kind == "llvm")
        self.cells[0] = 1 if timed or getattr(self.m.weights, "disk_tier", None) is not None \
            else 2 if trace.ACTIVE is not None else 0
        pools = [exe.pool for kind, exe, _ in self.m.parts if kind == "llvm"]     # (none: a plan wholly on the GPU)
        self.cells[1] = pools[0].n_threads * pools[0].split if pools else 1
        self.cur = (input_ids, cache)
        self.error = None

    def end(self, B: int) -> None:
        """After a step: an exception a call raised."""
        self.cur = None
        if self.error is not None:
            e, self.error = self.error, None
            raise e

    def call(self, i: int, B: int, after: bool, part: str | None = None):
        """CPU partition i's host call (`part`: "start" / "finish" of a split one, else None)."""
        key = (i, B, part)
        hc = self.calls.get(key)
        if hc is None:
            from strata_compiler.backends.xla.host_call import HostCall, python_work

            exe = self.m.parts[i][1]
            frame, _ = exe.frames[B]
            split = self.splits().get(i)
            dev_in = self.f.dev_in[i] if part is None else split[1] if part == "start" else split[2]
            ins = [frame.out(self.g.node(a)) for a in dev_in]
            outs = [] if part == "start" else [frame.out(self.g.node(o)) for o in self.f.dev_out[i]]
            work = self._work(i, part)
            self._works.append(work)    # the handler holds it weakly: a dropped session is freed
            addr, _keep = python_work(work, weak=True)
            addr = self._native_work(i, B, frame, addr, part)
            platform = "cpu" if self.f.device.platform == "cpu" else "gpu"
            hc = self.calls[key] = HostCall(ins, outs, addr, platform=platform, after=after,
                                            wake=exe.pool.wake_address)
            hc.dev_in = dev_in
        return hc

    # -- what each call runs -------------------------------------------------------------------

    def splits(self) -> dict:
        """CPU partitions that run in two host calls around a GPU expert share: partition i whose
        GPU-made inputs include the result of the MoE share that ends partition i - 1, and whose
        calls run natively. The first call (`start`) hands the ops before the one that reads that
        result (the CPU side of the layer) to the pool's runner thread; the share runs on the GPU
        meanwhile; the second call (`finish`) waits for them and runs the rest.
        i -> (share node, early inputs, late inputs, index of the first op of the finish)."""
        if self._splits is not None:
            return self._splits
        out = {}
        parts = self.m.parts
        for i, dev_in in self.f.dev_in.items():
            if i == 0 or parts[i - 1][0] != "xla":
                continue
            last = parts[i - 1][1].nodes[-1]
            if last.op is not Op.MOE_FFN or last.id not in dev_in or self._needs_python(i):
                continue
            k = next(j for j, f in enumerate(parts[i][1].fetch_at) if last.id in f)
            early = [a for a in dev_in if a != last.id]
            if k and early:
                out[i] = (last, early, [last.id], k)
        self._splits = out
        return out

    def _work(self, i: int, part: str | None = None):
        """CPU partition i's host call work in Python (the fallback of a native call)."""
        exe = self.m.parts[i][1]
        split = self.splits().get(i)
        lo, hi = 0, None
        if part == "start":
            hi = split[3]
        elif part == "finish":
            lo = split[3]

        def run(_stream) -> None:
            if self.error is not None:
                return
            self.ran = True
            tl = self.f.timeline
            if tl is not None:
                tl.append(("enter", i, time.perf_counter_ns()))
            try:
                ids, cache = self.cur
                exe.run_segment(self.env, ids, cache, Segment(lo=lo, hi=hi))
            except BaseException as e:    # noqa: BLE001 - nothing may cross the native frame
                self.error = e
            if tl is not None:
                tl.append(("leave", i, time.perf_counter_ns()))
        return run

    def _native_work(self, i: int, B: int, frame, fallback: int, part: str | None = None) -> int:
        """CPU partition i's host call work without Python where it can be: its segment program
        (backends/llvm_cpu/executor.py) called straight from the handler. Only for a partition
        whose inputs all come from the GPU (the handler copies them into its frame), whose results
        only GPU partitions read, with no per-step Python (attention's cache arguments, the token
        ids). A split partition's "start" call hands its program to the pool's runner thread
        (pool.py `strata_async_start`) and returns; the "finish" call waits for it, then runs the
        combine. Returns the work function's address (`fallback`, the Python work, where the
        partition needs Python)."""
        exe = self.m.parts[i][1]
        progs = self._native_progs(i, B, frame)
        if progs is None:
            return fallback
        from strata_compiler.backends.xla.host_call import native_work

        prog, traced, _rec, _lo = progs[part]
        run = exe.pool.run_program_address
        before = 0
        if part == "start":
            run = exe.pool.async_addresses[0]
        elif part == "finish":
            before = exe.pool.async_addresses[1]
        self.native.add(i)
        return native_work(run, prog.ctypes.data, len(prog), self.cells.ctypes.data + 8, self.cells.ctypes.data,
                           fallback, timeline=self.records.ctypes.data, tag=i, before=before,
                           traced=(traced.ctypes.data, len(traced)))

    def _needs_python(self, i: int) -> bool:
        """Whether CPU partition i's host calls need Python work every step: an input that the
        handler does not copy (another CPU partition's value, the token ids); or a result that
        another CPU partition or the step's outputs read (from the Python env)."""
        exe = self.m.parts[i][1]
        ins = [a for a in exe.inputs if self.g.node(a).op is not Op.INPUT_IDS]
        users = self.g.users()
        part_of = self.f.part_of
        return (set(ins) != set(self.f.dev_in[i])
                or any(n.op in (Op.EMBED, Op.INPUT_IDS) for n in exe.nodes)
                or any(u == -1 or u not in part_of or self.m.parts[part_of[u]][0] != "xla"
                       for o in exe.outputs for u in users[o]))

    def _native_progs(self, i: int, B: int, frame) -> dict | None:
        """The programs of CPU partition i's host calls ({None: all} or {"start", "finish"}), or
        None where it needs Python (see _native_work); decided once per partition and batch, for
        both parts of a split partition together."""
        key = (i, B)
        if key in self._progs:
            return self._progs[key]
        from strata_compiler.backends.llvm_cpu.executor import Step

        exe = self.m.parts[i][1]
        split = self.splits().get(i)
        out = None
        if not self._needs_python(i):
            _, ops = exe.frames[B]
            step = Step(B, 1, None)
            cuts = {None: (0, len(ops))} if split is None else {"start": (0, split[3]), "finish": (split[3], len(ops))}
            progs = {k: exe.host_program(frame, ops, step, lo, hi) for k, (lo, hi) in cuts.items()}
            if all(p is not None and not p[1] for p in progs.values()) and any(len(p[0]) for p in progs.values()):
                # part -> (program, the same with time stamps, its stamps, index of its first op)
                out = {k: (p[0],) + exe.host_program(frame, ops, step, *cuts[k], traced=True)[::2] + (cuts[k][0],)
                       for k, p in progs.items()}
        self._progs[key] = out
        return out

    # -- timelines and traces --------------------------------------------------------------------

    def clock(self) -> tuple:
        """Turn the native calls' records on: (TSC now, perf_counter_ns now, TSC ticks per us)."""
        from strata_compiler.backends.llvm_cpu.pool import native_runtime

        nat = native_runtime()
        self.records[0], self.records[1] = 1, 0
        return nat.rdtsc(), time.perf_counter_ns(), nat.ticks_per_us

    def merge_records(self, tl: list, clock: tuple) -> None:
        """The native calls' entries and exits this step into timeline `tl` (from its last
        "dispatch"), in its clock and in time order; their records off."""
        tsc0, ns0, ticks = clock
        self.records[0] = 0
        k = min(int(self.records[1]), int(self.records[2]))
        if not k:
            return
        rec = self.records[3:3 + 3 * k].reshape(k, 3)
        start = max(j for j, ev in enumerate(tl) if ev[0] == "dispatch")
        # the TSC's rate is calibrated, not exact: a call converted past the step's bounds (it ran
        # between the dispatch and the program's end) is held to them
        lo, hi = tl[start][2], max(t for _, _, t in tl[start:])
        to_ns = lambda t: min(hi, max(lo, ns0 + int((int(t) - tsc0) * 1000 / ticks)))     # noqa: E731
        evs = tl[start:] + [(kind, int(p), to_ns(t)) for p, a, b in rec for kind, t in (("enter", a), ("leave", b))]
        order = {"dispatch": 0, "dispatched": 2, "done": 3}
        tl[start:] = sorted(evs, key=lambda e: (e[2], order.get(e[0], 1)))

    def trace(self, tr, tl: list, B: int, clock: tuple) -> None:
        """A traced step: the stretches between host calls go on the GPU track, measured on the
        host from the dispatch (or a host call's return) to the next host call (or the step's
        end): they hold the launches, the GPU's kernels and the host calls' copies. The ops of the
        calls that ran natively go on the cpu track from their programs' time stamps (op j from
        stamp j to j + 1; a split partition's first part on the pool's runner thread), the
        stamps cleared for the next step; the Python calls traced their ops themselves."""
        enters = [t for ev, _, t in tl if ev == "enter"]
        leaves = [t for ev, _, t in tl if ev == "leave"]
        done = next(t for ev, _, t in reversed(tl) if ev == "done")
        start = tl[0][2]
        for k, t_enter in enumerate(enters):
            if t_enter > start:
                tr.add_span(f"fused step: gpu segment {k}", "gpu", start, t_enter, tokens=B)
            start = leaves[k] if k < len(leaves) else t_enter
        if done > start:
            tr.add_span(f"fused step: gpu segment {len(enters)}", "gpu", start, done, tokens=B)
        tsc0, ns0, ticks = clock
        for (i, b), progs in self._progs.items():
            if b != B or not progs:
                continue
            exe = self.m.parts[i][1]
            for _prog, _traced, rec, lo in progs.values():
                if rec[0] == 0:
                    continue
                ns = [ns0 + int((int(t) - tsc0) * 1000 / ticks) for t in rec]
                for j in range(len(rec) - 1):
                    n = exe.nodes[lo + j]
                    tr.add_span(n.op.value, "cpu", ns[j], ns[j + 1], node=n.id, tokens=B, native=True)
                rec[:] = 0
