"""A mixed plan's decode step as one jitted program: CPU partitions run as host calls inside it.

The partition-by-partition runtime (runtime/partitions.py) dispatches one jitted call per GPU
partition and moves every value that crosses devices through Python; on an H200 host a split
layer costs ~400 us of that hand-off (BENCHMARKS.md). Here the whole decode step is traced into
one program for the GPU:

* each xla partition's traced body (`XLAExecutor._flat`) is inlined, in plan order;
* each llvm partition becomes a `HostCall` (backends/xla/host_call.py): its native FFI handler
  copies the partition's GPU-made inputs straight into the LLVM executor's frame buffers on the
  program's stream, runs the partition's kernels (a ctypes callback into the executor; the CPU
  work itself is native), and queues the copies of the results that later GPU partitions read;
* the step's token ids, cache position and the expert caches' slot maps go in as one int32
  array; the xla partitions' KV caches are donated and come back updated; the llvm partitions
  keep theirs on the host, as before.

A step is then one dispatch and one wait, whatever the number of switches (benchmarks/
host_call_bench.py: 47-64 us per layer on an H200, GPU work included, against 430-600 for a
jitted call per side).

It applies to decode steps of plans whose xla partitions share one device, with no reference
partition (and with no CPU partition at all where expert caches read their misses in place,
`--miss-path gpu`: a program without host calls); prefill and the first decode step (which sets up the frames and caches) run partition
by partition. Under `--trace`, the CPU partitions' ops are traced inside their host calls and the
stretches between host calls go on the GPU track (`_trace`).

Expert caches: the swaps happen between steps; the in-step prefetch runs inside the host call of
the CPU partition that makes the triggering hidden state, which hands back the changed slot maps
as results of its own (a prefetch triggered by a GPU partition's value does not run in a fused
step). Where a cached layer's GPU share ends a partition and the next CPU partition reads its
result, that CPU partition may run as two host calls around the share (`_plan_splits`,
STRATA_PREFETCH_STREAM=1, off: slower on the H200, 105.1 against 117.7 tok/s): the CPU side of
the layer before the share, the combine after it. The prefetch's copies for that layer then go
on a copy stream of their own and overlap the layer's attention and CPU side; only the GPU share
waits for them, on the GPU (a CUDA event). Otherwise copies are queued on the program's stream. With
STRATA_FUSED_OVERLAP (`overlap_mode`; by default where both halves run natively) every layer
whose GPU expert share ends a partition splits so, and the first call hands the CPU side to the
pool's runner thread (native: pool.py `strata_async_start`; a Python worker thread where the call
needs Python, with STRATA_FUSED_OVERLAP=1 only): the CPU computes its experts while the GPU
computes its own. STRATA_FUSED_STEP=0 turns fused steps off.

A CPU partition that needs no per-step Python (a split layer's cold experts, cached or not: no
attention cache arguments, token ids or Python prefetch; an expert cache's mask and counts are
read and written by the program itself, and (STRATA_NATIVE_PREFETCH, default on) the prefetch its
result triggers runs as native code after the program, runtime/native_prefetch.py) runs its
segment program (pool.py `strata_run_program`) straight from the handler, with no Python
callback (`_native_work`, STRATA_NATIVE_HOST_CALLS=0 turns it off); under tracing a per-step flag
selects the program with time stamps between its ops, whose spans join the trace after the step
(`_trace_native`), and under the MoE phase timer the Python work. The benchmarks' timeline
(`timeline`) gets the native calls' entry and exit from their time stamps too.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref

import numpy as np

from strata_compiler.ir import Op


def native_host_calls_wanted() -> bool:
    """STRATA_NATIVE_HOST_CALLS (default 1): host calls of CPU partitions that need no per-step
    Python run their segment program straight from the handler (FusedStep._native_work)."""
    from strata_compiler.env import switch

    return switch("STRATA_NATIVE_HOST_CALLS", True)


def _overlap_worker(ref, jobs) -> None:
    """The thread that runs the start calls' CPU work with STRATA_FUSED_OVERLAP=1. It holds its
    fused step weakly, so a dropped session (and its weights) is freed; None on the queue ends it."""
    while True:
        job = jobs.get()
        step = ref() if job is not None else None
        if step is None:
            return
        step._run_job(job)
        del step


def native_prefetch_wanted() -> bool:
    """STRATA_NATIVE_PREFETCH (default 1; 0: the Python prefetch): an expert cache's prefetch runs
    natively after its host call's program (runtime/native_prefetch.py), so the call needs no
    Python and its layer may overlap. H200, 2026-11-30 (BENCHMARKS.md), 16-layer benchmark model
    at 25 %: 129.9 against 89.2 tok/s (hot-cache-25), 148.5 against 103.0 (cache-25)."""
    from strata_compiler.env import switch

    return switch("STRATA_NATIVE_PREFETCH", True)


def overlap_mode() -> str:
    """STRATA_FUSED_OVERLAP: "1" every layer whose GPU expert share ends a partition splits around
    it and its CPU side runs beside the share (on a Python worker thread where the call needs
    Python); "0" never; unset ("auto") only where both halves run as native programs: a static
    share, or a cached one with the prefetch off. Measured on an H200 (BENCHMARKS.md): native
    overlap +10 %, the Python thread -25 %."""
    raw = os.environ.get("STRATA_FUSED_OVERLAP", "") or "auto"
    if raw not in ("0", "1", "auto"):
        from strata_compiler.errors import UsageError

        raise UsageError(f"STRATA_FUSED_OVERLAP={raw!r}: expected 0, 1 or auto")
    return raw


def wake_wanted() -> bool:
    """STRATA_HOST_CALL_WAKE (default 1): a host call's handler wakes the CPU thread pool on entry,
    before it waits for the GPU to finish its operands, so the workers are spinning when the CPU
    partition's first kernel starts instead of being woken from their futex then (idle workers
    sleep after the spin and yield of STRATA_FUSED_SPIN_US)."""
    from strata_compiler.env import switch

    return switch("STRATA_HOST_CALL_WAKE", True)


def _check_room(cache) -> None:
    """A decode step needs one more position in the KV cache: one clear error line where it is full."""
    if cache.length + 1 > cache.capacity:
        from strata_compiler.errors import UsageError

        raise UsageError(f"sequence of {cache.length + 1} tokens exceeds the KV cache capacity {cache.capacity}")


class Ahead:
    """A decode step in flight (FusedStep.launch): its greedy token and expert counts (device
    values) and the slot maps it runs with (cached GPU share id -> int32 [slots], -1 masked)."""

    __slots__ = ("token", "counts", "maps")

    def __init__(self, token, counts, maps) -> None:
        self.token, self.counts, self.maps = token, counts, maps


class FusedStep:
    def __init__(self, mixed) -> None:
        self.m = mixed
        self.g = mixed.g
        parts = mixed.parts
        part_of = {nid: i for i, (_, _, ids) in enumerate(parts) for nid in ids}
        self.part_of = part_of
        xla = [exe for kind, exe, _ in parts if kind == "xla"]
        self.device = xla[0].device
        # per llvm partition: its inputs made by xla partitions (host call operands), and its
        # results that later xla partitions read (host call results)
        self.dev_in: dict[int, list[int]] = {}
        self.dev_out: dict[int, list[int]] = {}
        users = self.g.users()
        for i, (kind, exe, ids) in enumerate(parts):
            if kind != "llvm":
                continue
            self.dev_in[i] = [a for a in exe.inputs if self.g.node(a).op is not Op.INPUT_IDS
                              and parts[part_of[a]][0] == "xla"]
            self.dev_out[i] = [o for o in exe.outputs
                               if any(u != -1 and parts[part_of[u]][0] == "xla" for u in users[o])]
        xla_parts = [(i, exe) for i, (kind, exe, _) in enumerate(parts) if kind == "xla"]
        self._params = {i: exe.params for i, exe in xla_parts}    # (the dicts themselves: swaps show)
        self._layers = [l for _, exe in xla_parts for l in exe.layers]
        self._xla_outs = [o for o in self.g.outputs if parts[part_of[o]][0] == "xla"]
        self.cached = [n for kind, exe, _ in parts if kind == "xla" for n in exe.cached]
        # slots each cached GPU share holds (fewer than its experts when the GPU ran short)
        self.n_slots = {n.id: exe.slots_of[n.id] for kind, exe, _ in parts if kind == "xla" for n in exe.cached}
        self._fn = {}               # B -> jitted step
        self._flat_params = None    # (the executors' params_version, their params' leaves, the tree)
        self._ahead_fn = {}         # B -> jitted step that also returns its greedy token (launch)
        self._ahead_stage = [None, None]    # launch's staging, one per step in flight
        self._ahead_parity = 0
        self._calls = {}            # (partition, B, part: None, "start" or "finish") -> HostCall
        self._env: dict = {}        # the llvm partitions' host values during a step
        self._cur = None            # (input_ids, cache) of the running step, for the callbacks
        self._error = None          # an exception raised inside a callback (re-raised after the step)
        self._stage = None
        self._private = False       # the CPU platform's cached GPU shares copied (run)
        self._splits = None         # _plan_splits
        self.overlap: set[int] = set()  # split CPU partitions whose start call runs beside the GPU share
        self._jobs = None           # the overlap worker's queue
        self._done: dict = {}       # CPU partition -> the event its start call's job sets
        self._split_keys: set = set()
        self._events: dict = {}     # cache key -> CUDA event after its prefetch copies (copy stream)
        self._pending: set = set()  # caches with copies recorded and not yet waited for
        self._maps_of: dict = {}    # CPU partition -> the expert caches whose slot maps its call returns
        self._maps_out: dict = {}   # ... and their host buffers
        self._works: list = []      # the host calls' Python work functions (python_work holds them weakly)
        self.steps = 0
        self._counted: dict = {}    # B -> the xla partitions whose COUNTS results the step returns, in order
        # [this step's flag for the native host calls (0 native, 1 Python, 2 native with time
        #  stamps: run), the pool's chunk count]
        self._cells = np.zeros(2, np.int64)
        self.native_calls: set[int] = set()     # CPU partitions whose host call runs natively
        self._progs: dict = {}                  # (partition, B) -> _native_progs
        self._prefetch: dict = {}               # (partition, B) -> its native prefetch (native_prefetch.py)
        # their records while `timeline` is on: [on, count, capacity, (partition, TSC in, TSC out)...]
        self._native_tl = np.zeros(3 + 3 * 4096, np.int64)
        self._native_tl[2] = 4096
        self.ran_host_calls = False     # (a failure after that is not one of building the program)
        self.timeline: list | None = None   # benchmarks: (event, partition, perf_counter_ns) when a list

    @staticmethod
    def applies(mixed) -> bool:
        """Decode steps of plans with xla and llvm partitions on one GPU; or with xla partitions
        alone where expert caches read their misses in place (--miss-path gpu): a program with no
        host call, whose one packed input carries the slot maps and whose swaps are queued."""
        kinds = {k for k, _, _ in mixed.parts}
        if "reference" in kinds or "xla" not in kinds or mixed.mesh or ("llvm" not in kinds and not mixed.mapped):
            return False
        devs = {exe.device for k, exe, _ in mixed.parts if k == "xla"}
        if len(devs) != 1:
            return False
        from strata_compiler.backends.xla.host_call import available

        return available("cpu" if next(iter(devs)).platform == "cpu" else "gpu")

    def ready(self, B: int, cache) -> bool:
        """Whether a fused step of batch B can run now: the partition runtime has run a decode step
        of that batch (frames, caches and result keys exist)."""
        for kind, exe, _ in self.m.parts:
            if kind == "llvm" and B not in exe.frames:
                return False
            if kind == "xla" and ((B, 1) not in exe._out_keys
                                  or (exe.layers and not hasattr(cache.k[exe.layers[0]], "device"))):
                return False
        return True

    # -- the host side of a CPU partition ------------------------------------------------------

    def _triggers(self, i: int) -> list[int]:
        """Values of CPU partition i that trigger an expert cache's prefetch (runtime/partitions.py
        `lookahead`): on the host in its host call, so the copies can start there. Empty while
        the prefetch is off (set by the session before the first step)."""
        if not self.m.prefetch:
            return []
        ids = set(self.m.parts[i][2])
        return [nid for nid in self.m.lookahead if nid in ids]

    def _slot_maps(self, i: int) -> list:
        """The GPU shares whose slot maps CPU partition i's host call hands back (those its
        prefetch may change), in order."""
        return [gpu_node for nid in self._triggers(i) for _c, _x, gpu_node, *_ in self.m.lookahead[nid]]

    def _plan_splits(self) -> dict:
        """CPU partitions that run in two host calls around a GPU expert share: partition i whose
        GPU-made inputs include the result of the MoE share that ends partition i - 1. Its first
        call (`start`) runs the ops before the one that reads that result (the CPU side of the
        layer), then the share runs on the GPU, then the second call (`finish`) the rest.
        With STRATA_PREFETCH_STREAM=1 (cached shares): the expert copies the prefetch queued for
        that layer on a copy stream of their own run beside the layer's attention and its CPU
        side, and only the GPU share waits for them (`_stream_for`; off until it measures faster on
        a GPU). With overlap (`overlap_mode`: by default static shares whose calls run natively;
        STRATA_FUSED_OVERLAP=1 any share): the start call hands its ops to the pool's runner
        thread (or a Python worker) and returns, so the GPU share runs while the CPU computes its
        side; the finish call waits for them (the split runs on the CPU platform too).
        i -> (share node, early inputs, late inputs, index of the first op of the finish)."""
        if self._splits is not None:
            return self._splits
        out = {}
        parts = self.m.parts
        stream = os.environ.get("STRATA_PREFETCH_STREAM", "0") == "1"
        mode = overlap_mode()
        for i in self.dev_in if stream or mode != "0" else ():
            if i == 0 or parts[i - 1][0] != "xla":
                continue
            last = parts[i - 1][1].nodes[-1]
            cached = bool(last.attr("cache", ""))
            if last.op is not Op.MOE_FFN or last.id not in self.dev_in[i] or not (cached and stream or mode != "0"):
                continue
            k = next(j for j, f in enumerate(parts[i][1].fetch_at) if last.id in f)
            early = [a for a in self.dev_in[i] if a != last.id]
            if k == 0 or not early:
                continue
            out[i] = (last, early, [last.id], k)
        self._splits = out
        self._split_keys = {n.attr("cache") for n, *_ in out.values() if n.attr("cache", "")} if stream else set()
        if mode == "auto":      # only where both halves run natively: a Python worker thread loses
            for i in [i for i, sp in out.items() if self._needs_python(i) and not (stream and sp[0].attr("cache", ""))]:
                del out[i]
            self.overlap = {i for i in out if not self._needs_python(i)}
        else:
            self.overlap = set(out) if mode == "1" else set()
        return out

    def _run_job(self, job) -> None:
        """A start call's CPU work on the overlap thread (STRATA_FUSED_OVERLAP=1, `_overlap_worker`)."""
        exe, lo, hi, done = job
        try:
            ids, cache = self._cur
            exe.run_segment(self._env, ids, cache, lo, hi)
        except BaseException as e:    # noqa: BLE001 - re-raised after the step
            self._error = e
        finally:
            done.set()

    def __del__(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)        # the overlap thread ends

    def _stream_for(self, stream):
        """The prefetch's stream per cache: caches whose GPU share a split partition's start call
        guards get a copy stream and an event the start call makes the program wait for (on the
        GPU); the others copy on the program's stream. None on the CPU platform (copies land at
        once)."""
        if stream is None:
            return None
        from strata_compiler.backends.xla import cuda_rt

        def pick(c, done: bool = False):
            if c.key not in self._split_keys:
                return stream
            cs = cuda_rt.copy_stream(self.device)
            if done:
                cuda_rt.record(self._event(c.key), cs)
                self._pending.add(c.key)
            return cs
        return pick

    def _work(self, i: int, part: str | None = None):
        exe = self.m.parts[i][1]
        triggers = self._triggers(i)
        split = self._plan_splits().get(i)
        lo, hi = 0, None
        if part == "start":
            hi = split[3]
        elif part == "finish":
            lo = split[3]

        def run(stream) -> None:
            if self._error is not None:
                if part == "finish" and i in self._done:    # never leave a worker's job behind
                    self._done.pop(i).wait()
                return
            self.ran_host_calls = True
            tl = self.timeline
            if tl is not None:
                tl.append(("enter", i, time.perf_counter_ns()))
            try:
                ids, cache = self._cur
                if part == "start" and i in self.overlap:    # the CPU side runs while the GPU share does
                    if self._jobs is None:
                        import queue

                        self._jobs = queue.SimpleQueue()
                        threading.Thread(target=_overlap_worker, args=(weakref.ref(self), self._jobs),
                                         name="strata-fused-overlap", daemon=True).start()
                    self._done[i] = done = threading.Event()
                    self._jobs.put((exe, lo, hi, done))
                else:
                    if part == "finish" and i in self._done:
                        self._done.pop(i).wait()
                        if self._error is not None:
                            return
                    exe.run_segment(self._env, ids, cache, lo, hi)
                if part == "start":         # the GPU share after this call waits for its copies
                    key = split[0].attr("cache", "")
                    # (a native prefetch records the event without telling Python: wait whenever it exists)
                    native = key in self._events and native_prefetch_wanted()
                    if stream is not None and (key in self._pending or native):
                        from strata_compiler.backends.xla import cuda_rt

                        cuda_rt.wait_event(stream, self._events[key])
                        self._pending.discard(key)
                else:
                    if triggers and self.m.prefetch:    # the next cached layers' copies
                        for nid in triggers:
                            self.m._prefetch(nid, self._env, in_program=True, stream=self._stream_for(stream))
                    for buf, c in zip(self._maps_out.get(i, ()), self._maps_of.get(i, ())):
                        buf[:] = c.slots
            except BaseException as e:    # noqa: BLE001 - nothing may cross the native frame
                self._error = e
            if tl is not None:
                tl.append(("leave", i, time.perf_counter_ns()))
        return run

    def _host_call(self, i: int, B: int, after: bool, part: str | None = None):
        """CPU partition i's host call (`part`: "start" / "finish" of a split one, else None)."""
        key = (i, B, part)
        hc = self._calls.get(key)
        if hc is None:
            from strata_compiler.backends.xla.host_call import HostCall, python_work

            exe = self.m.parts[i][1]
            frame, _ = exe.frames[B]
            split = self._plan_splits().get(i)
            dev_in = self.dev_in[i] if part is None else split[1] if part == "start" else split[2]
            ins = [frame.out(self.g.node(a)) for a in dev_in]
            outs = [] if part == "start" else [frame.out(self.g.node(o)) for o in self.dev_out[i]]
            if part != "start":
                # the slot maps this call's prefetch may change go back with its results
                from . import expert_cache

                maps = self._slot_maps(i)
                self._maps_of[i] = [expert_cache.lookup(self.g, n.attr("cache")) for n in maps]
                self._maps_out[i] = [np.zeros(self.n_slots[n.id], np.int32) for n in maps]
                outs += self._maps_out[i]
            work = self._work(i, part)
            self._works.append(work)    # the handler holds it weakly: a dropped session is freed
            addr, _keep = python_work(work, weak=True)
            addr = self._native_work(i, B, frame, addr, part, self._maps_out.get(i) if part != "start" else None)
            platform = "cpu" if self.device.platform == "cpu" else "gpu"
            # STRATA_HOST_CALL_STAGING=1: copies through page-locked staging (off until measured)
            staging = os.environ.get("STRATA_HOST_CALL_STAGING", "0") == "1"
            hc = self._calls[key] = HostCall(ins, outs, addr, platform=platform, after=after, staging=staging,
                                             wake=exe.pool.wake_address if wake_wanted() else 0)
            hc.dev_in = dev_in
        return hc

    def _native_work(self, i: int, B: int, frame, fallback: int, part: str | None = None,
                     maps: list | None = None) -> int:
        """CPU partition i's host call work without Python where it can be (STRATA_NATIVE_HOST_CALLS,
        default 1): its segment program (backends/llvm_cpu/executor.py) called straight from the
        handler, no callback, no GIL. Only for a partition whose inputs all come from the GPU (the
        handler copies them into its frame), whose results only GPU partitions read, with no
        per-step Python (attention's cache arguments, the token ids, an expert cache's prefetch).
        A partition split around its layer's GPU share with overlap (`overlap_mode`, `part`
        "start" / "finish") hands its first part to the pool's runner thread (pool.py
        `strata_async_start`) and returns, so the GPU computes its share while the CPU computes
        the rest of the layer; the finish call waits for it, then runs the combine. While tracing,
        the step's flag selects the same program with time stamps between its ops
        (`_trace_native`); while timing the MoE phases or streaming disk-tier experts, the Python
        work (`fallback`). Returns the work function's address."""
        exe = self.m.parts[i][1]
        progs = self._native_progs(i, B, frame)
        if progs is None:
            return fallback
        from strata_compiler.backends.xla.host_call import native_work

        prog, traced, _rec, _lo = progs[part]
        run = exe.pool.run_program_address
        before = 0
        wait = (0, 0)
        if part == "start":
            run = exe.pool.async_addresses[0]
            key = self._plan_splits()[i][0].attr("cache", "")
            if key in self._split_keys and self.device.platform != "cpu":     # the native prefetch's copies
                from strata_compiler.backends.xla import cuda_rt

                wait = (ctypes.cast(cuda_rt.lib().cudaStreamWaitEvent, ctypes.c_void_p).value, self._event(key))
        elif part == "finish":
            before = exe.pool.async_addresses[1]
        after = 0
        if part != "start" and self._triggers(i):       # the prefetch its result triggers, natively
            pf = self._prefetch[i, B] = self._native_prefetch(i, frame, maps or [])
            after = pf.address
        self.native_calls.add(i)
        return native_work(run, prog.ctypes.data, len(prog), self._cells.ctypes.data + 8, self._cells.ctypes.data,
                           fallback, timeline=self._native_tl.ctypes.data, tag=i, before=before,
                           traced=(traced.ctypes.data, len(traced)), after=after, wait_event=wait)

    def _prefetch_entries(self, i: int):
        """The lookahead entries CPU partition i's results trigger, with each cache's copy plan:
        [(trigger, lookahead entry, plan)], or None where one cannot run natively (native
        prefetch off, a copy that converts its rows)."""
        if not native_prefetch_wanted():
            return None
        out = []
        for nid in self._triggers(i):
            for ent in self.m.lookahead[nid]:
                c, xla, gpu_node, host = ent[:4]
                plan = self.m.copy_plan(c, xla, gpu_node, host)
                if not all(raw for *_, raw in plan):
                    return None
                out.append((nid, ent, plan))
        return out

    def _native_prefetch(self, i: int, frame, maps: list):
        """Partition i's prefetch as native code (runtime/native_prefetch.py), its slot maps
        written into `maps` (the host call's results)."""
        from strata_compiler.backends.xla import cuda_rt

        from .native_prefetch import Entry, Prefetch

        entries = []
        for (nid, (c, xla, gpu_node, host, w, b, nw, eps, k), plan), buf in zip(self._prefetch_entries(i), maps):
            srcs = [(src.ctypes.data, src.strides[0], rb) for _n, _a, _cur, _dst, rb, src, _raw in plan]
            dst_of = [lambda xla=xla, name=name, arr=arr: xla.params[name][arr] for name, arr, *_ in plan]
            cs = ev = 0
            if self.device.platform != "cpu" and c.key in self._split_keys:     # STRATA_PREFETCH_STREAM
                cs, ev = cuda_rt.copy_stream(self.device), self._event(c.key)
            entries.append(Entry(h=frame.out(self.g.node(nid)), w=w, b=b, nw=nw, eps=eps, k=k, c=c, srcs=srcs,
                                 dst_of=dst_of, maps_out=buf, copy_stream=cs, event=ev))
        if self.device.platform == "cpu":
            return Prefetch(entries)
        fn = lambda name: ctypes.cast(getattr(cuda_rt.lib(), name), ctypes.c_void_p).value     # noqa: E731
        return Prefetch(entries, fn("cudaMemcpyAsync"), fn("cudaEventRecord"))

    def _event(self, key: str) -> int:
        """The CUDA event after cache `key`'s prefetch copies on the copy stream."""
        from strata_compiler.backends.xla import cuda_rt

        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = cuda_rt.event()
        return ev

    def _needs_python(self, i: int) -> bool:
        """Whether CPU partition i's host calls need Python work every step: native host calls
        off (STRATA_NATIVE_HOST_CALLS=0) or programs off (STRATA_NATIVE_SEGMENTS=0); a prefetch to
        start or slot maps to hand back; an input that the handler does not copy (another CPU
        partition's value, the token ids); a split whose start call waits for a copy stream's
        event (STRATA_PREFETCH_STREAM); or a result that another CPU partition or the step's
        outputs read (from the Python env)."""
        exe = self.m.parts[i][1]
        if not native_host_calls_wanted() or not exe.native or \
                (self._triggers(i) and self._prefetch_entries(i) is None):
            return True
        ins = [a for a in exe.inputs if self.g.node(a).op is not Op.INPUT_IDS]
        split = self._plan_splits().get(i)
        users = self.g.users()
        stream_wait = (split is not None and split[0].attr("cache", "") in self._split_keys
                       and not native_prefetch_wanted())
        return (set(ins) != set(self.dev_in[i]) or stream_wait
                or any(n.op in (Op.EMBED, Op.INPUT_IDS) for n in exe.nodes)
                or any(u == -1 or u not in self.part_of or self.m.parts[self.part_of[u]][0] != "xla"
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
        split = self._plan_splits().get(i)
        out = None
        if not self._needs_python(i):
            _, ops = exe.frames[B]
            step = Step(B, 1, None)
            cuts = {None: (0, len(ops))} if split is None else {"start": (0, split[3]), "finish": (split[3], len(ops))}
            progs = {k: exe._program(frame, ops, step, lo, hi) for k, (lo, hi) in cuts.items()}
            if all(p is not None and not p[1] for p in progs.values()) and any(len(p[0]) for p in progs.values()):
                # part -> (program, the same with time stamps, its stamps, index of its first op)
                out = {k: (p[0],) + exe._program(frame, ops, step, *cuts[k], traced=True)[::2] + (cuts[k][0],)
                       for k, p in progs.items()}
        self._progs[key] = out
        return out

    # -- the traced step -----------------------------------------------------------------------

    def _step(self, params, ks, vs, packed, B: int, ids=None):
        """The decode step of batch B; `packed`: int32 [ids (B) | position | slot maps...];
        `ids` (int32 [B], a device value: the step before's greedy token) in place of packed's."""
        import jax

        from strata_compiler.backends.xla.executor import COUNTS

        parts = self.m.parts
        splits = self._plan_splits()
        ids = packed[:B].reshape(B, 1) if ids is None else ids.reshape(B, 1)
        pos = packed[B]
        off = B + 1
        slots = {}
        for n in self.cached:
            k = self.n_slots[n.id]
            slots[n.id] = packed[off:off + k]
            off += k
        env: dict = {}
        counts: list = []
        ks, vs = dict(ks), dict(vs)
        # the host calls share the host state (values, KV caches of the CPU partitions): each runs
        # after the one before (an ordering token), and the program returns the last token, so
        # that its results are ready only once every host call has run
        tok = [None]

        def call(i, part, sources):
            hc = self._host_call(i, B, after=tok[0] is not None, part=part)
            args = [sources(a).astype(h.dtype).reshape(h.shape) for a, h in zip(hc.dev_in, hc.ins)]
            *res, tok[0] = hc(*args, after=tok[0])
            return res

        for i, (kind, exe, _) in enumerate(parts):
            if kind == "xla":
                ext = {a: env[a] for a in exe.inputs if self.g.node(a).op is not Op.INPUT_IDS}
                for n in exe.cached:
                    ext[-(n.id + 1)] = slots[n.id]
                pk = {l: ks[l] for l in exe.layers}
                pv = {l: vs[l] for l in exe.layers}
                hooks = None
                if i + 1 in splits:      # the next CPU partition's first half runs before the share
                    def before_share(envj, args, cpu=i + 1):
                        call(cpu, "start", lambda a: envj[a] if a in envj else env[a])
                        args, tok[0] = jax.lax.optimization_barrier((args, tok[0]))     # the share after it
                        return args
                    hooks = {splits[i + 1][0].id: before_share}
                flat, kt, vt = exe._flat(params[i], pk, pv, ext, ids, B, 1, pos, hooks)
                for key, v in zip(exe._out_keys[B, 1], flat):
                    if key == COUNTS:       # the expert caches' routings (--miss-path gpu): results of the step
                        counts.append((i, v))
                    else:
                        env[key] = v
                for l, k_, v_ in zip(exe.layers, kt, vt):
                    ks[l], vs[l] = k_, v_
            else:
                res = call(i, "finish" if i in splits else None, env.__getitem__)
                for o, r in zip(self.dev_out[i], res):
                    env[o] = r
                for n, r in zip(self._slot_maps(i), res[len(self.dev_out[i]):]):
                    slots[n.id] = r         # the later GPU share reads the map after the prefetch
        token = tok[0]
        self._counted[B] = [i for i, _ in counts]
        return tuple(env[o] for o in self._xla_outs) + tuple(v for _, v in counts) + (token,), ks, vs

    # -- decode ahead: the next step dispatched before this one finishes ---------------------

    def ahead_ok(self) -> bool:
        """Whether this plan's decode steps can run ahead (`launch` / `finish`): a program with no
        host call (every CPU partition gone: expert caches read their misses in place), so that
        two steps in flight share no host state."""
        return not self.dev_in and all(kind == "xla" for kind, _, _ in self.m.parts)

    def _params_now(self):
        """The weights as one flat tuple, rebuilt only when an executor replaced an array: the
        jitted call then flattens no nested dicts (a few hundred arguments; on the VM 300 arrays
        dispatch in 68 against 98 us as a tuple against nested dicts)."""
        import jax

        ver = tuple(exe.params_version for kind, exe, _ in self.m.parts if kind == "xla")
        if self._flat_params is None or self._flat_params[0] != ver:
            leaves, tree = jax.tree_util.tree_flatten(self._params)
            self._flat_params = (ver, tuple(leaves), tree)
        return self._flat_params

    def _maps(self) -> list[np.ndarray]:
        """The expert caches' slot -> expert maps, in the program's order (the live caches', else
        the plan's slots)."""
        from . import expert_cache

        out = []
        for n in self.cached:
            live = expert_cache.lookup(self.g, n.attr("cache"))
            out.append(live.slots if live is not None else np.asarray(n.attr("experts")[:self.n_slots[n.id]], np.int32))
        return out

    def launch(self, ids, cache, masked: dict | None = None):
        """Dispatch a decode step of the tokens `ids` (NumPy int64 [B], or the device token of the
        step before: `Ahead.token`) at the cache's position and return at once, the step in flight
        (`finish` waits for it). `masked`: {cache key: slots} whose experts are being swapped
        (their copies wait until no step in flight reads the slot): -1 in this step's maps, so
        their experts are read in place like any miss. The program also returns its greedy
        token, which the next launch takes as its ids without a round trip through the host."""
        import jax
        import jax.numpy as jnp

        from strata_compiler.backends.xla import cuda_rt

        B = int(ids.shape[0])
        _check_room(cache)
        ver, flat, tree = self._params_now()
        fn = self._ahead_fn.get(B)
        if fn is None:
            n_out = len(self._xla_outs)

            def fused_ahead(p, k, v, s, t):     # (named: the persistent cache's entry says what it is)
                outs, k, v = self._step(jax.tree_util.tree_unflatten(tree, p), k, v, s, B, ids=t)
                logits = outs[0].reshape(B, -1)
                token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
                return (token,) + tuple(outs[n_out:-1]), k, v

            fn = self._ahead_fn[B] = jax.jit(fused_ahead, donate_argnums=(1, 2))
        maps = []
        for n, s in zip(self.cached, self._maps()):
            drop = (masked or {}).get(n.attr("cache"))
            if drop:
                s = s.copy()
                s[sorted(drop)] = -1
            maps.append(np.asarray(s, np.int32))
        packed = np.concatenate([np.zeros(B, np.int32), [np.int32(cache.length)], *maps]).astype(np.int32)
        if cuda_rt.mode is not None:
            # two staging buffers, one per step in flight: the step two back has finished with its own
            k = self._ahead_parity = 1 - self._ahead_parity
            st = self._ahead_stage[k]
            if st is None:
                st = self._ahead_stage[k] = cuda_rt.Staging(self.device)
            packed = st.stage("step", packed)
        if isinstance(ids, np.ndarray):
            ids = np.asarray(ids, np.int32).reshape(B)
        for kind, exe, _ in self.m.parts:
            exe.land_slot_copies()
        layers = self._layers
        ks = {l: cache.k[l] for l in layers}
        vs = {l: cache.v[l] for l in layers}
        outs, ks, vs = fn(flat, ks, vs, packed, ids)
        for l in layers:
            cache.k[l], cache.v[l] = ks[l], vs[l]
        self.steps += 1
        return Ahead(outs[0], outs[1:], dict(zip([n.id for n in self.cached], maps)))

    def finish(self, step: "Ahead", fold: bool = True) -> np.ndarray:
        """Wait for a launched step; fold its expert routings into the caches (`fold_counts`;
        not with fold=False); its greedy tokens, NumPy int64 [B]."""
        import jax

        from strata_compiler.backends.xla import cuda_rt

        outs = jax.block_until_ready((step.token,) + tuple(step.counts))
        for i, v in zip(self._counted.get(int(step.token.shape[0]), ()) if fold else (), outs[1:]):
            self.m.fold_counts(self.m.parts[i][1], v)
        return np.asarray(cuda_rt.fetch(outs[0])).astype(np.int64)

    @staticmethod
    def _trace(tr, tl: list, tokens: int) -> None:
        """A traced fused step: the CPU partitions traced themselves (their ops' spans, inside the
        host calls); the stretches between host calls go on the GPU track. Those are measured on
        the host: from the dispatch (or a host call's return) to the next host call (or the
        step's end), they hold the launches, the GPU's kernels and the host calls' copies."""
        enters = [t for ev, _, t in tl if ev == "enter"]
        leaves = [t for ev, _, t in tl if ev == "leave"]
        done = next(t for ev, _, t in reversed(tl) if ev == "done")
        start = tl[0][2]
        for k, t_enter in enumerate(enters):
            if t_enter > start:
                tr.add_span(f"fused step: gpu segment {k}", "gpu", start, t_enter, tokens=tokens)
            start = leaves[k] if k < len(leaves) else t_enter
        if done > start:
            tr.add_span(f"fused step: gpu segment {len(enters)}", "gpu", start, done, tokens=tokens)

    def _trace_native(self, tr, B: int, tsc0: int, ns0: int, ticks_per_us: float) -> None:
        """The ops of the host calls that ran natively this step, from their programs' time stamps
        (op j from stamp j to j + 1; a split partition's first part on the pool's runner thread),
        as spans of the cpu track; the stamps are cleared for the next step."""
        for (i, b), progs in self._progs.items():
            if b != B or not progs:
                continue
            exe = self.m.parts[i][1]
            for _prog, _traced, rec, lo in progs.values():
                if rec[0] == 0:
                    continue
                ns = [ns0 + int((int(t) - tsc0) * 1000 / ticks_per_us) for t in rec]
                for j in range(len(rec) - 1):
                    n = exe.nodes[lo + j]
                    tr.add_span(n.op.value, "cpu", ns[j], ns[j + 1], node=n.id, tokens=B, native=True)
                rec[:] = 0

    def run(self, input_ids: np.ndarray, cache) -> dict[int, np.ndarray]:
        import jax

        from strata_compiler.backends.xla import cuda_rt

        B = input_ids.shape[0]
        m = self.m
        _check_room(cache)
        if not self._private and self.device.platform == "cpu":
            # in-step prefetches write the GPU shares' weights in place (MixedExecutor._copy_rows): on
            # JAX's CPU platform an array put there from the plan's read-only mapping may alias it
            import jax.numpy as jnp

            for kind, exe, _ in m.parts:
                for n in exe.cached if kind == "xla" else ():
                    for _, name in n.weights:
                        exe.params[name] = {a: jnp.array(v, copy=True) for a, v in exe.params[name].items()}
                        exe.params_version += 1
            self._private = True
        tree = self._params_now()[2]
        fn = self._fn.get(B)
        if fn is None:
            def fused_step(p, k, v, s):     # (named: the persistent cache's entry says what it is)
                return self._step(jax.tree_util.tree_unflatten(tree, p), k, v, s, B)

            fn = self._fn[B] = jax.jit(fused_step, donate_argnums=(1, 2))
        packed = np.concatenate([np.asarray(input_ids, np.int32).reshape(-1), [np.int32(cache.length)],
                                 *[np.asarray(s, np.int32) for s in self._maps()]]).astype(np.int32)
        if cuda_rt.mode is not None:
            if self._stage is None:
                self._stage = cuda_rt.Staging(self.device)
            packed = self._stage.stage("step", packed)
        if self._pending:                   # prefetch copies a failed step left unwaited
            cuda_rt.lib().cudaStreamSynchronize(ctypes.c_void_p(cuda_rt.copy_stream(self.device)))
            self._pending.clear()
        for kind, exe, _ in m.parts:
            if kind == "xla":
                exe.land_slot_copies()
        layers = self._layers
        ks = {l: cache.k[l] for l in layers}
        vs = {l: cache.v[l] for l in layers}
        from strata_compiler.backends.llvm_cpu.executor import IN_FRAME

        # GPU-made inputs arrive in the frame buffers themselves (the host calls copy them there)
        self._env = {a: IN_FRAME for ins in self.dev_in.values() for a in ins}
        from strata_compiler.backends.llvm_cpu import executor as lx
        from strata_compiler.backends.llvm_cpu.pool import get_pool

        from . import disk_tier, trace

        pool = get_pool()
        # 0: native host calls; 1: their Python work (the MoE phase timer, a disk tier); 2: native
        # with time stamps between ops (tracing: their spans go into the trace after the step)
        prefetches = [pf for (_, b), pf in self._prefetch.items() if b == B]
        # (a traced step takes the Python path where a prefetch runs natively: its copies are traced there)
        self._cells[0] = 1 if lx.PHASE_NS is not None or id(self.g) in disk_tier.TIERS or \
            (prefetches and trace.ACTIVE is not None) else 2 if trace.ACTIVE is not None else 0
        for pf in prefetches:
            pf.refresh()
        self._cells[1] = pool.n_threads * pool.split
        self._cur = (input_ids, cache)
        self._error = None
        from . import trace

        if trace.ACTIVE is not None and self.timeline is None:
            self.timeline = []          # this step's, for the trace's GPU spans (_trace)
            traced = True
        else:
            traced = False
        tl = self.timeline
        if tl is not None:
            from strata_compiler.backends.llvm_cpu.pool import _get_native

            nat = _get_native()
            self._native_tl[0], self._native_tl[1] = 1, 0
            tsc0, ns0 = nat.rdtsc(), time.perf_counter_ns()
            tl.append(("dispatch", -1, time.perf_counter_ns()))
        outs, ks, vs = fn(self._flat_params[1], ks, vs, packed)
        if tl is not None:
            tl.append(("dispatched", -1, time.perf_counter_ns()))
        for l in layers:
            cache.k[l], cache.v[l] = ks[l], vs[l]
        outs = jax.block_until_ready(outs)[:-1]
        n_out = len(self._xla_outs)
        for i, v in zip(self._counted.get(B, ()), outs[n_out:]):
            m.fold_counts(m.parts[i][1], v)
        outs = outs[:n_out]
        if tl is not None:
            tl.append(("done", -1, time.perf_counter_ns()))
            self._native_tl[0] = 0
            k = min(int(self._native_tl[1]), int(self._native_tl[2]))
            if k:       # the native host calls' records, in the timeline's clock, in time order
                rec = self._native_tl[3:3 + 3 * k].reshape(k, 3)
                to_ns = lambda t: ns0 + int((int(t) - tsc0) * 1000 / nat.ticks_per_us)   # noqa: E731
                start = max(j for j, ev in enumerate(tl) if ev[0] == "dispatch")
                evs = tl[start:] + [(kind, int(p), to_ns(t)) for p, a, b in rec for kind, t in (("enter", a), ("leave", b))]
                order = {"dispatch": 0, "dispatched": 2, "done": 3}
                tl[start:] = sorted(evs, key=lambda e: (e[2], order.get(e[0], 1)))
        if traced:
            self._trace(trace.ACTIVE, tl, B)
            self._trace_native(trace.ACTIVE, B, tsc0, ns0, nat.ticks_per_us)
            self.timeline = None
        if self._stage is not None:
            self._stage.guard = None        # the program has finished: the staging may be rewritten
        self._cur = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e
        for pf in prefetches:
            pf.check()
        self.steps += 1
        res = dict(zip(self._xla_outs, outs))
        return {o: (cuda_rt.fetch(res[o]) if o in res else self._env[o]).reshape(B, 1, -1) for o in self.g.outputs}
