"""Mixed plans: consecutive ops bound to one backend form a partition; partitions run in order.

Each partition runs on its backend's executor (xla: one jitted function; llvm: its kernels;
reference: the interpreter). Values crossing a partition boundary go through `env` on the
host, which is what the plan's transfer nodes mark; each attention layer's KV cache lives where
its partition runs (device arrays for xla, host arrays otherwise).

`MixedExecutor.run` runs a step partition by partition: prefill, the first decode step (which
sets up the frames and caches), plans the fused step does not apply to, and every step after a
fused program failed to build. Decode steps of plans with xla partitions on one GPU run as one
program (runtime/fused_step.py); greedy decoding runs those steps ahead of the host where the
program has no host call and no trace file is written (`decode_ahead`). The expert caches'
swaps and copies: runtime/expert_swaps.py.
"""

from __future__ import annotations

import sys
import time
from itertools import groupby

import numpy as np

from strata_compiler import settings, trace
from strata_compiler.backends.xla import cuda_rt
from strata_compiler.backends.xla import sampling as device_sampling
from strata_compiler.execution import Caps, Executor, Segment
from strata_compiler.experts import Residency, mesh_devices
from strata_compiler.ir import Graph, Op
from strata_compiler.prefill_streaming import plan_stream_tokens

from .expert_swaps import ExpertSwaps

# Chunks per thread of the CPU kernels in plans with GPU partitions (the `pool_split` setting
# overrides): more chunks than threads, so that the others take over the chunks of a worker the
# OS has descheduled beside the GPU runtime's threads; all-CPU plans keep 1.
MIXED_POOL_SPLIT = 4


def partitions(g: Graph, mesh: bool = False, cache_cuts: bool = True) -> list[tuple[str, list[int]]]:
    """(backend, node ids) for each maximal run of consecutive nodes bound to one backend (and,
    for xla, one GPU, unless `mesh`: then one run spans the GPUs); an expert cache's GPU share
    starts a partition of its own (unless not `cache_cuts`: misses read in place)."""
    out: list[tuple[str, list[int]]] = []
    for (b, _), grp in groupby(g.nodes, key=lambda n: (n.backend, n.device if n.backend == "xla" and not mesh
                                                       else "")):
        cur: list[int] = []
        for n in grp:
            if cur and cache_cuts and n.op is Op.MOE_FFN and n.attr("cache", "") and n.attr("experts", ()):
                out.append((b, cur))
                cur = []
            cur.append(n.id)
        out.append((b, cur))
    return out


def _processes() -> int:
    """JAX processes (hosts) in this run: 1 unless strata-run --coordinator joined several."""
    if "jax" not in sys.modules:
        return 1
    import jax

    return jax.process_count()


def _device_index(device: str) -> int:
    """The GPU index of a node's device ("gpu:1" -> 1, "gpu" -> 0)."""
    return int(device.split(":")[1]) if ":" in device else 0


def _fetch(v, B: int, T: int, last_only: bool) -> np.ndarray:
    """An output [B*T, ...] of a step (or PaddedRows of it) on the host as [B, T, ...], or its last
    token's [B, 1, ...] with `last_only` (a device array is sliced on the device: only those rows
    are copied)."""
    from strata_compiler.backends.xla.rows import PaddedRows, fetch_last

    rows = T
    if isinstance(v, PaddedRows):
        v, rows = v.v, v.T_pad
    if last_only and hasattr(v, "devices"):
        return fetch_last(v, B, rows, T)
    out = cuda_rt.fetch(v).reshape(B, rows, -1)[:, :T]
    return out[:, T - 1:T] if last_only else out


class MixedExecutor(Executor):
    def __init__(self, graph: Graph, weights, device: str = "auto", shrink_caches: bool = False,
                 multi_gpu: str = "mesh", miss_path: str = "cpu") -> None:
        """multi_gpu: a striped plan over several GPUs runs as one sharded computation ("mesh",
        backends/xla/mesh.py) or by partition per GPU through the host ("host"). miss_path:
        where an expert cache's misses compute: "cpu" (the plan's host share, a host call per
        switch) or "gpu" (the GPU reads the missed experts from host memory in place: the whole
        layer on the GPU, runtime/mapped.py; `graph` is then one that mapped.rebind_misses made)."""
        self.g = graph
        self.weights = weights
        self.residency = Residency()     # the live expert caches (ExpertSwaps), seen by every partition
        # --miss-path gpu: {cached GPU share: host share}, the host shares bound to the GPU
        self.mapped: dict[int, int] = {}
        if miss_path == "gpu" and not (multi_gpu == "mesh" and mesh_devices(graph)):
            from . import mapped

            self.mapped = mapped.in_place_pairs(graph)
        self.shrunk: dict[str, int] = {}   # expert cache key -> slots it got after running out of memory
        self.parts = []
        self.mesh = mesh_devices(graph) if multi_gpu == "mesh" else 0
        parts = partitions(graph, mesh=bool(self.mesh), cache_cuts=not self.mapped)
        # expert-cache slots that fit the GPU, decided once for all xla partitions
        self._slots = self._gpu_plan(device, shrink_caches) if any(b == "xla" for b, _ in parts) else {}
        for backend, ids in parts:
            self.parts.append((*self._executor(backend, ids, device, shrink_caches), ids))
        kinds = {k for k, _, _ in self.parts}
        if "llvm" in kinds and "xla" in kinds:
            from strata_compiler.backends.llvm_cpu.pool import pool_split

            for kind, exe, _ in self.parts:
                if kind == "llvm":
                    exe.pool.split = pool_split(MIXED_POOL_SPLIT)
        # the GPU results each partition hands to a later CPU partition: their device->host copies
        # start as soon as the partition is dispatched, all at once, instead of one by one when
        # the CPU reads them (each a wait of its own)
        self.to_host, read_by = self._xla_reads()
        self.hand_off = "xla" in kinds and "llvm" in kinds
        # long prefills: CPU partitions whose weights go to the GPU for the step (_streamed)
        self._device_kind = device
        self._streamed: dict | None = None
        self.stream_ok = not self.mesh and any(kind == "xla" and exe.on_gpu for kind, exe, _ in self.parts)
        self.streamed_steps = 0
        self.plan_stream_tokens = plan_stream_tokens(graph)    # the threshold when the setting is auto
        # (spin, yield) microseconds of idle CPU workers at a hand-off, and between a fused step's host calls
        self._spin = settings.get("hand_off_spin_us") if self.hand_off else None
        self._fused_spin = settings.get("fused_spin_us")
        # small host<->GPU hand-offs as raw copies when a CUDA runtime is there (the xla executors'
        # Transfers, one platform for all: backends/xla/cuda_rt.py); then the decode results only
        # CPU kernels read leave each GPU partition as one buffer: one device->host copy per switch
        xla = [exe for kind, exe, _ in self.parts if kind == "xla"]
        self.transfers = xla[0].transfers if xla else cuda_rt.Transfers()
        self.raw_copy = not self.mesh and self.transfers.raw
        if self.raw_copy:
            for i, (kind, exe, _) in enumerate(self.parts):
                if kind == "xla" and hasattr(exe, "pack_for_host"):
                    exe.pack_for_host(sorted(a for a in self.to_host.get(i, ()) if read_by[a] == {"llvm"}
                                             and a not in graph.outputs))
        self.swaps = ExpertSwaps(self)      # the expert caches, once enable_expert_cache has made them
        # decode steps as one jitted program with the CPU partitions as host calls inside it
        self.fused = None
        from .fused_step import FusedStep

        if FusedStep.applies(self):
            self.fused = FusedStep(self)

    def _executor(self, backend: str, ids: list[int], device: str, shrink_caches: bool) -> tuple[str, Executor]:
        """(kind, executor) of one partition: its backend's executor, which runs those nodes its own way."""
        graph, weights = self.g, self.weights
        if backend == "xla" and self.mesh:      # every xla partition on the mesh (values stay global)
            from strata_compiler.backends.xla.mesh import MeshXLAExecutor

            return "xla", MeshXLAExecutor(graph, weights, ids, self.mesh, device, residency=self.residency)
        if backend == "xla":
            if _processes() > 1:
                from strata_compiler.errors import UsageError

                raise UsageError("several hosts run a plan striped over all their GPUs as one mesh; this plan "
                                 "has GPU partitions on single GPUs: compile it with --gpus N --gpu-mode stripe")
            return "xla", self._xla(ids, device, shrink_caches)
        if backend == "llvm":
            from strata_compiler.backends.llvm_cpu.executor import LLVMExecutor

            return "llvm", LLVMExecutor(graph, weights, nodes=ids, residency=self.residency,
                                        fetch_into=cuda_rt.fetch_into)
        from strata_compiler.backends.reference.executor import ReferenceExecutor

        return "reference", ReferenceExecutor(graph, weights, residency=self.residency, nodes=ids)

    def _xla_reads(self) -> tuple[dict[int, set[int]], dict[int, set[str]]]:
        """(to_host, read_by): each partition's GPU results a later CPU partition reads, and who reads each."""
        part_of = {nid: i for i, (_, _, ids) in enumerate(self.parts) for nid in ids}
        to_host: dict[int, set[int]] = {}
        read_by: dict[int, set[str]] = {}
        for i, (kind, _, ids) in enumerate(self.parts):
            for nid in ids:
                for a in self.g.node(nid).args:
                    if self.parts[part_of[a]][0] == "xla" and part_of[a] != i:
                        read_by.setdefault(a, set()).add(kind)
                        if kind != "xla":
                            to_host.setdefault(part_of[a], set()).add(a)
        return to_host, read_by

    def _gpu_plan(self, device: str, shrink: bool) -> dict[int, int]:
        """Slots per expert-cache GPU share so that the xla partitions' weights fit the device's
        free memory (the `gpu_mem_limit` setting, else what JAX reports): halved until they fit."""
        from strata_compiler.formats import get_format
        from strata_compiler.experts import in_place_weights
        from strata_compiler.hwprofile import size_bytes

        g = self.g
        silent = set(self.mapped.values())      # host shares read in place: their weights stay on the host
        xla_nodes = [n for n in g.nodes if n.backend == "xla" and n.id not in silent]
        on_host = in_place_weights(g)
        cached = {n.id: n for n in xla_nodes if n.op is Op.MOE_FFN and n.attr("cache", "") and n.attr("experts", ())}
        slots = {i: len(n.attr("experts")) for i, n in cached.items()}
        if not shrink or not cached:
            return slots
        limit = settings.get("gpu_mem_limit")
        free = size_bytes(limit, settings.declared("gpu_mem_limit").env) if limit else None
        if free is None:
            from strata_compiler.backends.xla.device import device as pick

            stats = pick(device).memory_stats() or {}
            if stats.get("bytes_limit"):
                free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        if free is None:
            return slots

        def nbytes(name: str) -> int:
            w = g.weight(name)
            return get_format(w.fmt).nbytes(w.shape, w.group_size or 32)

        fixed = sum(nbytes(w) for w in {w for n in xla_nodes if n.id not in cached for _, w in n.weights} - on_host)
        per_slot = {i: sum(nbytes(w) for _, w in n.weights) // len(n.attr("experts")) for i, n in cached.items()}
        while fixed + sum(per_slot[i] * slots[i] for i in cached) > free and any(v > 1 for v in slots.values()):
            slots = {k: max(1, v // 2) for k, v in slots.items()}
        return slots

    def _xla(self, ids: list[int], device: str, shrink: bool):
        """An xla partition, its expert caches' slots as _gpu_plan chose; a real out-of-memory
        error still halves them (with `shrink`) until it fits."""
        from strata_compiler.backends.xla.executor import GPUOutOfMemory, XLAExecutor

        cached = [self.g.node(i) for i in ids if i in self._slots]
        slots = {n.id: self._slots[n.id] for n in cached}
        while True:
            try:
                dev = self.g.node(ids[0]).device
                exe = XLAExecutor(self.g, self.weights, nodes=ids, device_kind=device, slot_limit=slots,
                                  device_index=_device_index(dev), mapped=self.mapped,
                                  residency=self.residency)
                break
            except GPUOutOfMemory as e:
                if not shrink or not cached or all(v <= 1 for v in slots.values()):
                    raise GPUOutOfMemory(f"the GPU cannot hold the plan's GPU partitions ({e}); compile for less "
                                         f"GPU memory (stratac compile --target ... --gpu-mem SIZE)") from None
                slots = {k: max(1, v // 2) for k, v in slots.items()}
        for n in cached:
            if slots[n.id] < len(n.attr("experts")):
                self.shrunk[n.attr("cache")] = slots[n.id]
                print(f"strata-run: warning: GPU memory: the expert cache of {n.attr('cache')} gets "
                      f"{slots[n.id]} of {len(n.attr('experts'))} slots", file=sys.stderr)
        return exe

    def enable_expert_cache(self, max_swaps: int | None = None, policy: str = "hybrid") -> int:
        """Live GPU expert caches for the plan's cached layers (runtime/expert_swaps.py); returns
        how many."""
        return self.swaps.enable(max_swaps, policy)

    def load_row(self, cache, slot: int, src, row: int = 0) -> None:
        """Row `row` of cache `src` (a sequence prefilled on its own, by this executor) into row
        `slot` of `cache`: the xla partitions' layers on their devices (XLAExecutor.load_row),
        the others' host arrays by NumPy copies; the slot's length becomes the row's."""
        from strata_compiler.errors import UsageError

        n = int(src.lengths[row])
        if n > cache.capacity:
            raise UsageError(f"a sequence of {n} tokens does not fit a KV cache of {cache.capacity}")
        on_device = set()
        for kind, exe, _ in self.parts:
            if kind == "xla":
                exe.load_row(cache, slot, src, row)
                on_device.update(exe.layers)
        for layer in range(len(cache.k)):
            if layer not in on_device:
                for dst, s in ((cache.k, src.k), (cache.v, src.v)):
                    dst[layer][slot, :, :n] = np.asarray(s[layer][row, :, :n])
        cache.lengths[slot] = n

    def kv_room(self) -> int | None:
        """The least room on the GPUs of the partitions that hold KV layers (None: none does)."""
        rooms = [r for kind, exe, _ in self.parts if kind == "xla" and exe.layers
                 for r in (exe.kv_room(),) if r is not None]
        return min(rooms, default=None)

    def can_decode_ahead(self, B: int, cache, sampling=None) -> bool:
        """Whether the next decode steps of batch B can run ahead (`decode_ahead`), greedy or by a
        sampling the device computes (backends/xla/sampling.py): a fused program with no host call
        that has run once, the caches' bookkeeping as one CacheGroup with a swap a layer, no trace
        file (`--stats` alone: each step one span, backends/ahead.py)."""
        from strata_compiler.backends import ahead

        f, sw = self.fused, self.swaps
        vocab = int(self.g.node(self.g.outputs[0]).type.shape[-1])
        return ((sampling is None or device_sampling.supported(sampling, vocab)) and f is not None and not ahead.traced_fully() and f.ahead_ok() and f.ready(B, cache)
                and (not sw.caches or (sw.cache_group is not None and sw.cache_group.ok
                                       and all(c.max_swaps == 1 for c, *_ in sw.caches))))

    def decode_ahead(self, tok: np.ndarray, cache, n: int, stop_ids=(), done: np.ndarray | None = None,
                     sampling=None, on_token=None) -> np.ndarray:
        """Decode of n steps from the tokens `tok` (int64 [B]), each step dispatched before the one
        before it has finished (backends/ahead.py): its ids are that step's token on the device,
        greedy or chosen by `sampling` (AheadSampling). The tokens of the n steps, int64 [B, <= n].

        Swaps lag: the bookkeeping after step i runs while step i + 1 is in flight, reading the
        slots as they were. A swap decided then is masked (-1, its experts read in place) in the
        maps of step i + 2 and copied once step i + 1 has finished, on the bulk stream (landed
        before step i + 3 is dispatched). Hits and misses count what each step's maps held."""
        from strata_compiler.backends import ahead

        f, sw = self.fused, self.swaps
        group = sw.cache_group
        deferred: list[tuple] = []      # swaps decided, not yet copied: (cache, slot, expert, old)
        row = {id(c): i for i, c in enumerate(group.caches)} if group is not None else {}
        t_prev = [time.perf_counter()]

        def launch(prev):
            masked: dict = {}
            for c, slot, *_ in deferred:
                masked.setdefault(c.key, set()).add(slot)
            step = f.launch(tok if prev is None else prev.token, cache, masked, sampling,
                            None if prev is None else prev.state)
            cache.advance(1)
            return step

        def finish(step, use: bool) -> np.ndarray:
            sw.begin_step()
            return f.finish(step, fold=use)

        def after(step) -> None:
            nonlocal deferred
            # the copies of the swaps decided after the step before: the step in flight masks their slots
            close()
            if sw.caches:
                res = None
                if group is not None:
                    res = np.zeros(group.counts.shape, bool)
                    for n_id, m in step.maps.items():
                        res[row[id(sw.cache_of(n_id))], m[m >= 0]] = True
                deferred = sw.decide(res)
            now = time.perf_counter()
            sw.step_time(now - t_prev[0])
            t_prev[0] = now

        def close() -> None:        # (and once nothing is in flight: the decided swaps' copies or undoing)
            nonlocal deferred
            for d in deferred:
                sw.issue(*d)
            deferred = []

        return ahead.run(launch, finish, n, tok.shape[0], stop_ids, done, after, close, on_token)

    def caps(self) -> Caps:
        """Only the last token's outputs cross to the host; a prefill step runs on a GPU where some
        partition does (the CPU's experts streamed to it, or not: Session gives the step more
        tokens either way), with flash attention where every GPU partition's is."""
        xla = [exe.caps() for kind, exe, _ in self.parts if kind == "xla"]
        gpu = any(c.prefills_on_gpu for c in xla)
        return Caps(fetches_last=True, prefills_on_gpu=gpu, flash_prefill=gpu and all(c.flash_prefill for c in xla))

    def run(self, input_ids: np.ndarray, cache, last_only: bool = False) -> dict[int, np.ndarray]:
        """One step of ids i64[B, T]: the outputs [B, T, ...], or [B, 1, ...] of the last token with
        `last_only` (a GPU's outputs are sliced there, so the rest never reach the host)."""
        B, T = input_ids.shape
        t_step = time.perf_counter()
        self.swaps.begin_step()
        if T == 1 and self.fused is not None and self.fused.ready(B, cache):
            from strata_compiler.backends.llvm_cpu.pool import set_spin

            # no JAX copy threads to leave cores to: by default workers wait the pool's way
            spin, yld = self._fused_spin
            set_spin(spin_us=spin, yield_us=yld)
            try:
                out = self.fused.run(input_ids, cache)
            except Exception as e:
                from strata_compiler.errors import StrataError

                if isinstance(e, StrataError) or self.fused.steps or self.fused.calls.ran:
                    raise
                # the first fused program failed to build (before any of it ran): say so once and
                # decode partition by partition
                print(f"strata-run: warning: decode steps as one program failed ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:160] if str(e) else ''}); running partition by partition",
                      file=sys.stderr)
                self.fused = None
                return self.run(input_ids, cache, last_only)
            self._after_step(cache, T, t_step)
            return out
        ids_node = next(n.id for n in self.g.nodes if n.op is Op.INPUT_IDS)
        env: dict = {ids_node: input_ids}
        # a prefill's GPU partitions run at a bucket's length (one program per bucket, not per
        # prompt length); the CPU ones at the prompt's own. Not where a GPU partition counts its
        # expert caches' routings (--miss-path gpu): padding tokens would count.
        xlas = [exe for kind, exe, _ in self.parts if kind == "xla"]
        T_pad = None
        if T > 1 and xlas and all(exe.pads_prefill and not exe.count_order for exe in xlas):
            T_pad = xlas[0].bucket(T, cache.capacity - cache.length)
        seg = Segment(T_pad=T_pad)      # one for every partition: the CPU backends run at the step's length
        streamed = self._streamed_parts(T)
        order = sorted(streamed)
        if order:
            streamed[order[0]].upload()
            self.streamed_steps += 1
        if self.hand_off:
            # idle CPU workers sleep soon instead of spinning through the GPU's turn: spinning on
            # every core starves the threads that finish JAX's copies. It stays set (a repeated
            # set costs nothing); CPU-only executors put the default back.
            from strata_compiler.backends.llvm_cpu.pool import set_spin

            spin, yld = self._spin
            set_spin(spin_us=spin, yield_us=yld, caller_spin_us=spin)
        for i, (kind, exe, ids) in enumerate(self.parts):
            if i in streamed:       # this CPU partition on the GPU; the next one's weights copied meanwhile
                nxt = next((j for j in order if j > i), None)
                if nxt is not None:
                    streamed[nxt].upload()
                streamed[i].run_segment(env, input_ids, cache, seg)
                streamed[i].release()
            elif kind == "reference" and trace.ACTIVE is not None:
                with trace.ACTIVE.span(f"reference partition ({len(ids)} ops)", "cpu"):
                    exe.run_segment(env, input_ids, cache, seg)
            else:
                exe.run_segment(env, input_ids, cache, seg)
                for nid in () if kind != "xla" or self.raw_copy or streamed else self.to_host.get(i, ()):
                    v = env.get(nid)
                    if hasattr(v, "copy_to_host_async"):
                        v.copy_to_host_async()
        # the outputs first: once they are there the step has finished reading the expert slots
        # that the swaps after it rewrite
        out = {o: _fetch(env[o], B, T, last_only) for o in self.g.outputs}
        for kind, exe, _ in self.parts:
            if kind == "xla" and exe.count_order:
                self.swaps.fold_counts(exe, exe.step_counts)
        self._after_step(cache, T, t_step)
        return out

    def _streamed_parts(self, T: int) -> dict:
        """{part index: a streamed XLAExecutor} of the CPU partitions a prefill step of T tokens runs
        on the GPU instead: at least `stream_prefill_tokens` tokens (auto: the plan's predicted
        break-even), a GPU there, partitions of ops the xla backend lowers with no KV cache or
        expert cache of their own. Built once."""
        n = settings.get("stream_prefill_tokens")
        n = self.plan_stream_tokens if n is None else n
        if not n or T < n or not self.stream_ok:
            return {}
        if self._streamed is None:
            from strata_compiler.backends.xla.executor import XLAExecutor
            from strata_compiler.backends.xla.lowering import OPS

            first = next(ids for kind, _, ids in self.parts if kind == "xla")
            dev = self.g.node(first[0]).device
            self._streamed = {}
            for i, (kind, _, ids) in enumerate(self.parts):
                nodes = [self.g.node(j) for j in ids]
                if kind == "llvm" and all(n.op in OPS and n.op is not Op.FUSED_ATTENTION and not n.attr("cache", "")
                                          and n.id not in self.mapped.values() for n in nodes):
                    self._streamed[i] = XLAExecutor(self.g, self.weights, nodes=ids, device_kind=self._device_kind,
                                                    device_index=_device_index(dev), stream=True)
            self._pool_streamed()
        return self._streamed

    def _pool_streamed(self) -> None:
        """On a CUDA GPU the streamed partitions' weights go through a WeightPool: their host
        pages locked once (copies at the link's pinned rate, queued without a host staging copy)."""
        from strata_compiler.backends.xla import cuda_rt

        exes = list(self._streamed.values())
        if not exes or len({e.device for e in exes}) != 1 or not exes[0].transfers.raw:
            return
        from strata_compiler.backends.xla.streaming import WeightPool

        if exes[0].transfers.cuda:
            cuda_rt.pin([v for exe in exes for arrs in exe.host_params.values() for v in arrs.values()])
        pool = WeightPool(exes[0].device, exes[0].transfers)
        for exe in exes:
            exe.pool = pool

    def _after_step(self, cache, T: int, t_step: float) -> None:
        cache.advance(T)
        if self.swaps.caches:
            self.swaps.swap()
            if T == 1:      # decode steps set the pace the copies must keep to
                self.swaps.step_time(time.perf_counter() - t_step)
