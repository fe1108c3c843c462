"""Mixed plans: consecutive ops bound to one backend form a partition; partitions run in order.

Each partition runs on its backend's executor (xla: one jitted function; llvm: its kernels;
reference: the interpreter). Values crossing a partition boundary go through `env` on the
host, which is what the plan's transfer nodes mark; each attention layer's KV cache lives where
its partition runs (device arrays for xla, host arrays otherwise).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from itertools import groupby

import numpy as np

from strata_compiler.backends.xla import cuda_rt
from strata_compiler.ir import Graph, Op

from . import trace

HAND_OFF_SPIN_US = 30.0     # idle CPU workers' spin in plans that hand off to the GPU (default 100 + 1000)
# Expert-cache copies (swaps after a miss, prefetches) are synchronous host->device copies on the
# critical path: their time per step is capped at this share of the step's own time (moving
# average), so a router without temporal locality cannot make the cache slower than the static
# split by more than that. (Measured on an H200 without the cap: 16 layers, one swap and one
# prefetch per layer per step copied ~100 MB per token and decode fell from 45.6 to 12.1 tok/s.)
COPY_SHARE = 0.10
# Chunks per thread of the CPU kernels in plans with GPU partitions (STRATA_POOL_SPLIT overrides).
# H200 host, 16-layer benchmark model at 25 %, one run (2026-11-30 14:04): the split plan 169.4 ->
# 183.2 tok/s, -ngl's layout 142.2 -> 149.3 with 4 instead of 1; all-CPU plans keep 1.
MIXED_POOL_SPLIT = 4


def _spin_us(var: str = "STRATA_HAND_OFF_SPIN_US", default: tuple[float, float] | None = None) -> tuple[float, float]:
    """(spin, yield) microseconds of idle CPU workers in plans that hand off to the GPU:
    STRATA_HAND_OFF_SPIN_US as `US` (both) or `SPIN,YIELD` (A/B runs), else HAND_OFF_SPIN_US.
    For fused decode steps, STRATA_FUSED_SPIN_US the same way, else the pool's defaults (100 us of
    spin, then sched_yield to 1100 us): workers that sleep sooner leave the cores to the thread
    that launches the GPU's work between host calls, and the host call's handler wakes them
    (STRATA_HOST_CALL_WAKE); not yet measured on a GPU."""
    raw = os.environ.get(var)
    if raw is None:
        return default or (HAND_OFF_SPIN_US, HAND_OFF_SPIN_US)
    try:
        vals = [float(v) for v in raw.split(",")]
    except ValueError:
        vals = []
    if len(vals) == 1:
        vals *= 2
    if len(vals) != 2 or not all(0 <= v < 1e7 for v in vals):
        from strata_compiler.errors import UsageError

        raise UsageError(f"{var}={raw!r}: give microseconds >= 0, as US or SPIN,YIELD "
                         f"(default {','.join(f'{v:g}' for v in default or (HAND_OFF_SPIN_US,))})")
    return vals[0], vals[1]


def partitions(g: Graph, mesh: bool = False, cache_cuts: bool = True) -> list[tuple[str, list[int]]]:
    """(backend, node ids) for each maximal run of consecutive nodes bound to one backend (and,
    for xla, one GPU, unless `mesh`: then one run spans the GPUs); an expert cache's GPU share
    starts a partition of its own (unless not `cache_cuts`: misses read in place, no prefetch), so
    that expert copies started by the prefetch (after the partition before it) land before it
    reads its slots."""
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


class MixedExecutor:
    def __init__(self, graph: Graph, weights, device: str = "auto", shrink_caches: bool = False,
                 multi_gpu: str = "mesh", miss_path: str = "cpu") -> None:
        """multi_gpu: a striped plan over several GPUs runs as one sharded computation ("mesh",
        backends/xla/mesh.py) or by partition per GPU through the host ("host"). miss_path:
        where an expert cache's misses compute: "cpu" (the plan's host share, a host call per
        switch) or "gpu" (the GPU reads the missed experts from host memory in place: the whole
        layer on the GPU, runtime/mapped.py; `graph` is then one that mapped.rebind_misses made)."""
        self.g = graph
        self.weights = weights
        from strata_compiler.passes.expert_split import mesh_devices

        # --miss-path gpu: {cached GPU share: host share}, the host shares bound to the GPU
        self.mapped: dict[int, int] = {}
        if miss_path == "gpu" and not (multi_gpu == "mesh" and mesh_devices(graph)):
            from . import mapped

            self.mapped = mapped.in_place_pairs(graph)
        self._cache_of_node: dict = {}      # cached GPU share id -> its ExpertCache
        self._count_rows: dict = {}         # id(xla executor) -> its COUNTS rows in the CacheGroup (fold_counts)
        self.shrunk: dict[str, int] = {}   # expert cache key -> slots it got after running out of memory
        self.caches: list = []      # (ExpertCache, xla executor, GPU node, host node) per cached layer
        self.lookahead: dict = {}   # node id -> the caches whose prefetch its value triggers
        self.prefetch = False       # Session.prefetch (strata-run --prefetch)
        self.async_swaps = False    # enable_expert_cache: STRATA_PINNED_SWAPS
        self.cache_group = None     # enable_expert_cache: expert_cache.CacheGroup
        self._cache_parts: dict = {}
        self.pinned_bytes = 0
        self._copy_plans: dict = {}   # cache key -> raw copy addresses (_copy_rows)
        self.copy_share = COPY_SHARE
        self._step_s = 0.0          # moving average of a step's time (without its copies)
        self._copy_s = 0.0          # copy seconds spent this step (budget: copy_share * _step_s)
        self.parts = []
        self.mesh = mesh_devices(graph) if multi_gpu == "mesh" else 0
        parts = partitions(graph, mesh=bool(self.mesh), cache_cuts=not self.mapped)
        # expert-cache slots that fit the GPU, decided once for all xla partitions
        self._slots = self._gpu_plan(device, shrink_caches) if any(b == "xla" for b, _ in parts) else {}
        for backend, ids in parts:
            if backend == "xla" and self.mesh:      # every xla partition on the mesh (values stay global)
                from strata_compiler.backends.xla.mesh import MeshXLAExecutor

                self.parts.append(("xla", MeshXLAExecutor(graph, weights, ids, self.mesh, device), ids))
            elif backend == "xla":
                if _processes() > 1:
                    from strata_compiler.errors import UsageError

                    raise UsageError("several hosts run a plan striped over all their GPUs as one mesh; this plan "
                                     "has GPU partitions on single GPUs: compile it with --gpus N --gpu-mode stripe")
                self.parts.append(("xla", self._xla(ids, device, shrink_caches), ids))
            elif backend == "llvm":
                from strata_compiler.backends.llvm_cpu.executor import LLVMExecutor

                self.parts.append(("llvm", LLVMExecutor(graph, weights, nodes=ids), ids))
            else:
                from strata_compiler.backends.reference.executor import ReferenceExecutor

                self.parts.append(("reference", ReferenceExecutor(graph, weights), ids))
        kinds = {k for k, _, _ in self.parts}
        if "llvm" in kinds and "xla" in kinds:
            # CPU kernels beside the GPU runtime's threads: more chunks than threads, so that the
            # others take over the chunks of a worker the OS has descheduled (STRATA_POOL_SPLIT)
            from strata_compiler.backends.llvm_cpu.pool import get_pool, split_from_env

            get_pool().split = split_from_env(MIXED_POOL_SPLIT)
        # the GPU results each partition hands to a later CPU partition: their device->host copies
        # start as soon as the partition is dispatched, all at once, instead of one by one when
        # the CPU reads them (each a wait of its own)
        part_of = {nid: i for i, (_, _, ids) in enumerate(self.parts) for nid in ids}
        self.to_host: dict[int, set[int]] = {}
        read_by: dict[int, set[str]] = {}       # xla result -> the kinds of partition that read it
        for i, (kind, _, ids) in enumerate(self.parts):
            for nid in ids:
                for a in graph.node(nid).args:
                    if self.parts[part_of[a]][0] == "xla" and part_of[a] != i:
                        read_by.setdefault(a, set()).add(kind)
                        if kind != "xla":
                            self.to_host.setdefault(part_of[a], set()).add(a)
        # per xla partition: the results only llvm kernels read (what try_hand_off(pack=True) packs)
        self._llvm_only = {i: sorted(a for a in self.to_host.get(i, ()) if read_by[a] == {"llvm"}
                                     and a not in graph.outputs)
                           for i, (kind, _, _) in enumerate(self.parts) if kind == "xla"}
        self.hand_off = any(k == "xla" for k, _, _ in self.parts) and any(k == "llvm" for k, _, _ in self.parts)
        self._spin = _spin_us() if self.hand_off else None     # (spin, yield) of idle workers at a hand-off
        from strata_compiler.backends.llvm_cpu.pool import _DEFAULT_SPIN_US, _DEFAULT_YIELD_US

        self._fused_spin = _spin_us("STRATA_FUSED_SPIN_US", (_DEFAULT_SPIN_US, _DEFAULT_YIELD_US))
        # small host<->GPU hand-offs as raw copies when a CUDA runtime is there (the xla executors
        # turn them on: backends/xla/cuda_rt.py)
        self.raw_copy = not self.mesh and cuda_rt.mode is not None and any(k == "xla" for k, _, _ in self.parts)
        self.step_inputs_on_device = False  # try_hand_off: ids and position once per step and GPU
        # with raw copies, the decode results only CPU kernels read leave each GPU partition as one
        # buffer: one device->host copy per switch instead of one per value (STRATA_PACK_HOST=0: off)
        self._pack(self.raw_copy and os.environ.get("STRATA_PACK_HOST", "1") != "0")
        # STRATA_STEP_INPUTS=1: ids and position go to each GPU once per step (_step_inputs), not
        # staged by every partition (off by default until measured on a GPU with raw copies)
        self._step_stage: dict = {}
        if os.environ.get("STRATA_STEP_INPUTS", "0") == "1":
            self.step_inputs_on_device = True
        # decode steps as one jitted program with the CPU partitions as host calls inside it
        # (runtime/fused_step.py); STRATA_FUSED_STEP=0: partition by partition
        self.fused = None
        if os.environ.get("STRATA_FUSED_STEP", "1") != "0":
            from .fused_step import FusedStep

            if FusedStep.applies(self):
                self.fused = FusedStep(self)

    def _pack(self, on: bool) -> None:
        for i, (kind, exe, _) in enumerate(self.parts):
            if kind == "xla" and hasattr(exe, "pack_for_host"):
                exe.pack_for_host(self._llvm_only.get(i, []) if on else [])

    def legacy_hand_off(self) -> None:
        """The GPU hand-off as it was before 2026-11-29 evening, for side-by-side benchmarks: CPU
        workers keep spinning and results are copied one by one when read, by JAX. Call before the
        first step."""
        self.hand_off, self.to_host = False, {}
        self.jax_hand_off()

    def jax_hand_off(self) -> None:
        """Hand-offs through JAX's own transfers instead of raw copies (side-by-side benchmarks)."""
        cuda_rt.disable()
        self.raw_copy = False
        self._pack(False)

    def try_hand_off(self, step_inputs: bool = True, pack: bool = True) -> None:
        """Two hand-off changes, off by default: side by side on an H200 (2026-11-29, before raw
        copies) they measured 0.89 x the default (106.5 against 120.0 tok/s), and raw copies
        (cuda_rt) now cover the same ground; kept for A/B runs. `step_inputs` puts a step's
        token ids and cache position on each GPU once (device arrays shared by its partitions)
        instead of sending them as NumPy arguments of every jitted call; `pack` makes the results
        only CPU kernels read leave each partition as one buffer, one device->host copy instead
        of one per result (decode steps). Call before the first step."""
        self.step_inputs_on_device = step_inputs
        self._pack(pack)

    def _step_inputs(self, exe, input_ids: np.ndarray, cache) -> tuple:
        """This step's token ids and cache position on exe's GPU, shared by its partitions: raw
        copies into a staging pair of the device when raw copies are on (two copies a step, not
        two a partition), else JAX's device_put."""
        from strata_compiler.backends.xla.executor import RAW_MAX_TOKENS

        if not self.raw_copy or input_ids.size > RAW_MAX_TOKENS or not hasattr(exe, "_home"):
            return exe.step_inputs(input_ids, cache)
        st = self._step_stage.get(exe.device)
        if st is None:
            st = self._step_stage[exe.device] = cuda_rt.Staging(exe._home())
        return (st.stage("ids", np.asarray(input_ids, np.int32)), st.stage("pos", np.asarray(cache.length, np.int32)))

    def _gpu_plan(self, device: str, shrink: bool) -> dict[int, int]:
        """Slots per expert-cache GPU share so that the xla partitions' weights fit the device's
        free memory (STRATA_GPU_MEM_LIMIT, else what JAX reports): halved until they fit."""
        import os

        from strata_compiler.formats import get_format
        from strata_compiler.hwprofile import size_bytes

        g = self.g
        from .mapped import in_place_weights

        silent = set(self.mapped.values())      # host shares read in place: their weights stay on the host
        xla_nodes = [n for n in g.nodes if n.backend == "xla" and n.id not in silent]
        on_host = in_place_weights(g)
        cached = {n.id: n for n in xla_nodes if n.op is Op.MOE_FFN and n.attr("cache", "") and n.attr("experts", ())}
        slots = {i: len(n.attr("experts")) for i, n in cached.items()}
        if not shrink or not cached:
            return slots
        limit = os.environ.get("STRATA_GPU_MEM_LIMIT")
        free = size_bytes(limit, "STRATA_GPU_MEM_LIMIT") if limit else None
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
                                  device_index=int(dev.split(":")[1]) if ":" in dev else 0, mapped=self.mapped)
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
        """Live GPU expert caches for the plan's cached layers (a GPU share on xla, the whole
        layer on the CPU); returns how many. The runtime swaps experts into the slots after each
        step (runtime/expert_cache.py), at most `max_swaps` a layer (default STRATA_CACHE_SWAPS,
        else 1; 0: the slots stay as planned and only the counts run)."""
        from strata_compiler.env import count

        from . import expert_cache

        if max_swaps is None:
            max_swaps = count("STRATA_CACHE_SWAPS", 1, "swaps a layer and step")

        expert_cache.clear(self.g)
        self.caches = []
        self.lookahead = {}
        self._count_rows = {}
        # STRATA_PINNED_SWAPS=1: the cached layers' host weights page-locked, and their copies into
        # GPU slots queued without waiting (the partition reading the slots waits). The default:
        # on with fused decode steps, whose in-step prefetch queues its copies on the program's
        # stream (H200, 2 layers, one process: 426.9 / 414.5 against 390.7 / 305.8 tok/s), off
        # partition by partition (16 layers: 34.4 against 40.4 with 4 prefetches a layer).
        raw = os.environ.get("STRATA_PINNED_SWAPS", "")
        self.async_swaps = raw == "1" or (raw == "" and self.fused is not None)
        # STRATA_PREFETCH_PER_LAYER: copies per layer per step the prediction may start (default 1;
        # cheap copies — pinned, queued — may afford the whole prediction's misses)
        prefetch_per_layer = count("STRATA_PREFETCH_PER_LAYER", 1, "expert copies")
        pinned = []
        part_of = {nid: (kind, exe) for kind, exe, ids in self.parts for nid in ids}
        index = {nid: i for i, (_, _, ids) in enumerate(self.parts) for nid in ids}
        for n in self.g.nodes:
            key = n.attr("cache", "") if n.op is Op.MOE_FFN else ""
            if not key or not n.attr("experts", ()) or part_of[n.id][0] != "xla":
                continue
            host = next(h for h in self.g.nodes if h.op is Op.MOE_FFN and h.attr("cache", "") == key
                        and not h.attr("experts", ()))
            E = self.g.weight(host.weight("down")).shape[0]
            slots = part_of[n.id][1].slots_of[n.id]
            prior = host.attr("prior", ())
            c = expert_cache.ExpertCache(key, E, np.array(n.attr("experts")[:slots], np.int32),
                                         max_swaps=max_swaps, policy=policy,
                                         prior=np.array(prior, np.float64) if len(prior) == E else None)
            c.max_prefetch = prefetch_per_layer
            if self.async_swaps:
                pinned += [a for role, _ in n.weights for a in self._host_arrays(host.weight(role)).values()]
            expert_cache.CACHES[id(self.g), key] = c
            self.caches.append((c, part_of[n.id][1], n, host))
            self._cache_of_node[n.id] = c
            if n.id in self.mapped:
                c.miss_path = "gpu"
            c.expert_bytes = sum(v.nbytes for role, _ in n.weights
                                 for v in self._host_arrays(host.weight(role)).values()) // E
            trig = self._lookahead(n)
            # a copy must land before the layer's shares run: only a hidden state from an earlier
            # partition can trigger it (inside one partition the shares would see a half-made swap)
            if trig is not None and index[trig[0]] < index[n.id] and index[trig[0]] < index[host.id]:
                self.lookahead.setdefault(trig[0], []).append((c, part_of[n.id][1], n, host) + trig[1:])
                kind, exe = part_of[trig[0]]
                if kind in ("xla", "llvm") and trig[0] not in exe.outputs:
                    exe.outputs.append(trig[0])     # its partition hands the hidden state out too (set
                                                    # before the first step: jit traces outputs then)
        from . import disk_tier

        if pinned and not disk_tier.TIERS:     # (pages of the disk tier must stay evictable)
            self.pinned_bytes = cuda_rt.pin(pinned)
        # the caches' bookkeeping after each step as whole-array operations (ExpertCache rows of a
        # CacheGroup's arrays: before any native program reads their addresses)
        self.cache_group = expert_cache.CacheGroup([c for c, *_ in self.caches]) if self.caches else None
        self._cache_parts = {c.key: (xla, n, host) for c, xla, n, host in self.caches}
        return len(self.caches)

    def _host_arrays(self, name: str) -> dict:
        """A cached layer's host weights as its CPU kernels read them: their huge-page copy when
        the llvm executor made one (so the expert copies and the page-locking use that memory,
        not the file's pages a second time), else the plan's mapping. A host share the GPU reads
        in place (--miss-path gpu): the arrays it reads."""
        for kind, exe, _ in self.parts:
            if kind == "xla" and name in exe.mapped_host:
                return exe.mapped_host[name]
        if any(getattr(exe, "hugepages", False) for _, exe, _ in self.parts):
            return self.weights.resident_arrays(name)
        return self.weights.arrays(name)

    def _lookahead(self, n):
        """(trigger node, router weight, router bias, norm weight, eps, k) for the prefetch of
        cached layer n: its router applied to the residual stream entering its layer (the input
        of the attention's output projection's residual), normed as the router's input is."""
        g = self.g
        r = g.node(n.args[1])
        while r.op is Op.TRANSFER:
            r = g.node(r.args[0])
        if r.op is not Op.ROUTE:
            return None
        lin = g.node(r.args[0])
        if lin.op is not Op.LINEAR or lin.attr("prologue", "none") != "none":
            return None
        norm = g.node(lin.args[0])
        if norm.op is not Op.RMS_NORM or norm.attr("group", 0):
            return None
        o = g.node(norm.args[0])
        if o.op is not Op.LINEAR or len(o.args) != 2:
            return None
        trig = o.args[1]
        while g.node(trig).op is Op.TRANSFER:
            trig = g.node(trig).args[0]
        w = self.weights.get(lin.weight("w"))
        b = self.weights.get(lin.weight("b")) if lin.weight("b") else None
        return (trig, w, b, self.weights.get(norm.weight("w")), float(norm.attr("eps")), int(r.attr("k")))

    def _prefetch(self, nid: int, env: dict, in_program: bool = False, stream=None) -> None:
        """The copies the lookahead of value `nid` predicts; `in_program`/`stream`: from a host
        call of a running fused step (XLAExecutor.set_slot); `stream` may be a function of the
        cache (the fused step's copy stream for some caches, the program's for others), called
        after the cache's copies with done=True."""
        for c, xla, gpu_node, host, w, b, nw, eps, k in self.lookahead.get(nid, ()):
            if c.pf_wait:                   # paused by the idle back-off: no router GEMV either
                c.budget_skips += 1
                continue
            if not self._copy_ok(c):
                continue
            s = stream(c) if callable(stream) else stream
            h = cuda_rt.fetch(env[nid]).astype(np.float32, copy=False).reshape(-1, w.shape[1])
            x = h / np.sqrt((h * h).mean(-1, keepdims=True) + eps) * nw
            logits = x @ w.T + (0 if b is None else b)
            top = np.argpartition(-logits, min(k, logits.shape[1]) - 1, axis=-1)[:, :k]
            pred = np.zeros(c.n_experts, bool)
            pred[top.reshape(-1)] = True
            copies = c.prefetch(pred)
            for slot, e in copies:
                self._copy_in(c, xla, gpu_node, host, slot, e, f"prefetch expert {e}", in_program, s)
            if copies and callable(stream):
                stream(c, done=True)

    def _swap_experts(self) -> None:
        for c, slot, e, old in self._decide_swaps():
            self._issue_swap(c, slot, e, old)

    def _issue_swap(self, c, slot: int, e: int, old: int) -> None:
        """Copy a decided swap into its slot, or (over this step's copy budget) undo it: the slot
        still holds `old`, as plan_swaps(max_swaps=0) would have left it."""
        if self._copy_ok(c):
            xla, gpu_node, host = self._cache_parts[c.key]
            self._copy_in(c, xla, gpu_node, host, slot, e, f"expert {e} -> {c.key}[{slot}]")
        else:
            self._undo_swap(c, slot, e, old)

    @staticmethod
    def _undo_swap(c, slot: int, e: int, old: int) -> None:
        c.slots[slot] = old
        c.nonresident[e], c.nonresident[old] = 1.0, 0.0
        c.swaps -= 1

    def _decide_swaps(self, resident: np.ndarray | None = None) -> list[tuple]:
        """The caches' bookkeeping after a step and the swaps it decides, (cache, slot, expert,
        the expert it evicts), their bookkeeping done as if made: the caller copies or undoes
        each (`_issue_swap`). Over the copy budget no swap is decided and the scores still learn.
        `resident`: bool [layers, E] in the CacheGroup's order, the experts the step found in its
        slots where that differs from the caches' own view (decode ahead: slots being swapped
        were masked); only with a CacheGroup."""
        group = self.cache_group
        swaps = group.after_step(resident) if group is not None else None
        if swaps is not None:
            if not (self._step_s and self._copy_s >= self.copy_share * self._step_s):
                return swaps
            for sw in swaps:                # over the budget: as plan_swaps(max_swaps=0) leaves it
                self._undo_swap(*sw)
            for c in group.caches:
                c.budget_skips += 1
            return []
        if resident is not None:
            raise RuntimeError("decode ahead needs the caches' bookkeeping as a CacheGroup")
        out = []
        for c, xla, gpu_node, host in self.caches:
            if not self._copy_ok(c):
                c.plan_swaps(max_swaps=0)      # the scores still learn from this step
                continue
            out += [(c, slot, e, int(c.slots[slot])) for slot, e in c.plan_swaps()]
        return out

    def can_decode_ahead(self, B: int, cache) -> bool:
        """Whether the next decode steps of batch B can run ahead (`decode_ahead`): a fused program
        with no host call that has run once (STRATA_DECODE_AHEAD=0 turns this off), the caches'
        bookkeeping as one CacheGroup with a swap a layer, no trace file (`--stats` alone: each
        step one span, runtime/ahead.py)."""
        from . import ahead

        f = self.fused
        group = self.cache_group
        return (f is not None and ahead.wanted() and not ahead.traced_fully()
                and f.ahead_ok() and f.ready(B, cache) and (not self.caches or (
                    group is not None and group.ok and all(c.max_swaps == 1 for c, *_ in self.caches))))

    def decode_ahead(self, tok: np.ndarray, cache, n: int, stop_ids=(), done: np.ndarray | None = None) -> np.ndarray:
        """Greedy decode of n steps from the tokens `tok` (int64 [B]), each step dispatched before
        the one before it has finished (runtime/ahead.py): its ids are that step's greedy token on
        the device. The tokens of the n steps, int64 [B, <= n].

        Swaps lag: the bookkeeping after step i runs while step i + 1 is in flight, reading the
        slots as they were. A swap decided then is masked (-1, its experts read in place) in the
        maps of step i + 2 and copied once step i + 1 has finished, on the bulk stream (landed
        before step i + 3 is dispatched). Hits and misses count what each step's maps held."""
        from . import ahead

        f = self.fused
        group = self.cache_group
        deferred: list[tuple] = []      # swaps decided, not yet copied: (cache, slot, expert, old)
        row = {id(c): i for i, c in enumerate(group.caches)} if group is not None else {}
        t_prev = [time.perf_counter()]

        def launch(prev):
            masked: dict = {}
            for c, slot, *_ in deferred:
                masked.setdefault(c.key, set()).add(slot)
            step = f.launch(tok if prev is None else prev.token, cache, masked)
            cache.advance(1)
            return step

        def finish(step, use: bool) -> np.ndarray:
            self._copy_s = 0.0
            return f.finish(step, fold=use)

        def after(step) -> None:
            nonlocal deferred
            # the copies of the swaps decided after the step before: the step in flight masks their slots
            close()
            if self.caches:
                res = None
                if group is not None:
                    res = np.zeros(group.counts.shape, bool)
                    for n_id, m in step.maps.items():
                        res[row[id(self._cache_of_node[n_id])], m[m >= 0]] = True
                deferred = self._decide_swaps(res)
            now = time.perf_counter()
            own = now - t_prev[0] - self._copy_s
            self._step_s = own if not self._step_s else 0.8 * self._step_s + 0.2 * own
            t_prev[0] = now

        def close() -> None:        # (and once nothing is in flight: the decided swaps' copies or undoing)
            nonlocal deferred
            for sw in deferred:
                self._issue_swap(*sw)
            deferred = []

        return ahead.run(launch, finish, n, tok.shape[0], stop_ids, done, after, close)

    def _copy_ok(self, c) -> bool:
        """Whether this step's copy budget has time left for cache c's layer (the first steps, with
        no average yet, may copy)."""
        if self._step_s and self._copy_s >= self.copy_share * self._step_s:
            c.budget_skips += 1
            return False
        return True

    def _copy_in(self, c, xla, gpu_node, host, slot: int, e: int, label: str, in_program: bool = False,
                 stream: int | None = None) -> None:
        """Expert e's stored rows (from the host node's whole-layer weights) into GPU slot `slot`."""
        t0 = time.perf_counter()
        bulk = not in_program and self.async_swaps and xla.on_gpu and cuda_rt.bulk_ok()
        plan = self.copy_plan(c, xla, gpu_node, host) if bulk else ()
        if in_program:
            moved = self._copy_rows(c, xla, gpu_node, host, slot, e, stream)
        elif bulk and all(raw for *_, raw in plan):
            moved = 0           # raw copies on the bulk stream; the next step lands them (land_slot_copies)
            for _name, _arr, cur, dst, rb, src, _raw in plan:
                cuda_rt.copy_bulk(dst + slot * rb, src[e].ctypes.data, rb, cur)
                moved += rb
            xla._bulk_pending = True
        else:
            rows = {role: {a: v[e] for a, v in self._host_arrays(host.weight(role)).items()}
                    for role, _ in gpu_node.weights}
            moved = xla.set_slot(gpu_node.id, slot, rows, wait=not self.async_swaps)
        dt = time.perf_counter() - t0
        self._copy_s += dt
        c.bytes_moved += moved
        if trace.ACTIVE is not None:
            trace.ACTIVE.transfer("h2d", moved, dt, name=label)

    def copy_plan(self, c, xla, gpu_node, host) -> list[tuple]:
        """Cache c's in-step copies, per weight array of its GPU share: (param name, array name,
        the device array, its address, bytes per slot, the host array, whether a stored row
        copies as it is), worked out again when the device arrays changed."""
        plan = self._copy_plans.get(c.key)
        if plan is None or any(xla.params[name][arr] is not cur for name, arr, cur, *_ in plan):
            plan = []
            for role, name in gpu_node.weights:
                src_all = self._host_arrays(host.weight(role))
                for arr, cur in xla.params[name].items():
                    src = src_all[arr]
                    rb = cur.nbytes // cur.shape[0]
                    raw = src.dtype == cur.dtype and src[0].nbytes == rb and src[0].flags.c_contiguous
                    plan.append((name, arr, cur, cur.unsafe_buffer_pointer(), rb, src, raw))
            self._copy_plans[c.key] = plan
        return plan

    def _copy_rows(self, c, xla, gpu_node, host, slot: int, e: int, stream: int | None) -> int:
        """Expert e into slot `slot` from inside a running fused step, whose later kernels read the
        slot: raw copies into the GPU share's own buffers, from addresses worked out once per cache
        (the step's critical path: rebuilding the weights' arrays per copy costs ~10 us an array).
        Queued on `stream` on a GPU (from pageable memory the data is staged before the call
        returns); written at once on JAX's CPU platform. Returns the bytes copied."""
        plan = self.copy_plan(c, xla, gpu_node, host)
        moved = 0
        for _name, _arr, cur, dst, rb, src, raw in plan:
            row = src[e] if raw else np.ascontiguousarray(src[e], dtype=cur.dtype)
            if row.nbytes != rb:
                raise ValueError(f"expert cache {c.key}: a stored row of {row.nbytes} B for a slot of {rb} B")
            if xla.on_gpu:
                if stream is None:
                    raise RuntimeError("an in-step expert copy on a GPU needs the program's stream")
                cuda_rt.copy_async(dst + slot * rb, row.ctypes.data, rb, stream)
            else:
                ctypes.memmove(dst + slot * rb, row.ctypes.data, rb)
            moved += rb
        return moved

    def run(self, input_ids: np.ndarray, cache) -> dict[int, np.ndarray]:
        B, T = input_ids.shape
        t_step = time.perf_counter()
        self._copy_s = 0.0
        if T == 1 and self.fused is not None and self.fused.ready(B, cache):
            from strata_compiler.backends.llvm_cpu.pool import set_spin

            # no JAX copy threads to leave cores to: by default workers wait the pool's way
            spin, yld = self._fused_spin
            set_spin(spin_us=spin, yield_us=yld)
            try:
                out = self.fused.run(input_ids, cache)
            except Exception as e:
                from strata_compiler.errors import StrataError

                if isinstance(e, StrataError) or self.fused.steps or self.fused.ran_host_calls:
                    raise
                # the first fused program failed to build (before any of it ran): say so once and
                # decode partition by partition, as with STRATA_FUSED_STEP=0
                print(f"strata-run: warning: decode steps as one program failed ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:160] if str(e) else ''}); running partition by partition",
                      file=sys.stderr)
                self.fused = None
                return self.run(input_ids, cache)
            self._after_step(cache, T, t_step)
            return out
        ids_node = next(n.id for n in self.g.nodes if n.op is Op.INPUT_IDS)
        env: dict = {ids_node: input_ids}
        if self.hand_off:
            # idle CPU workers sleep soon instead of spinning through the GPU's turn: spinning on
            # every core starves the threads that finish JAX's copies (measured on an H200 host:
            # ~0.7 ms per device->host copy against ~0.25 ms with the cores free). It stays set
            # (a repeated set costs nothing); CPU-only executors put the default back.
            from strata_compiler.backends.llvm_cpu.pool import set_spin

            spin, yld = self._spin
            set_spin(spin_us=spin, yield_us=yld, caller_spin_us=spin)
        step_in: dict = {}      # per GPU: this step's ids and position, put there once
        last: dict = {}         # per GPU: the step's last xla partition there
        for i, (kind, exe, ids) in enumerate(self.parts):
            if kind == "reference":
                if trace.ACTIVE is None:
                    exe.run_segment(env, input_ids, cache, ids)
                else:
                    with trace.ACTIVE.span(f"reference partition ({len(ids)} ops)", "cpu"):
                        exe.run_segment(env, input_ids, cache, ids)
            elif kind == "xla":
                if self.step_inputs_on_device and exe.device not in step_in:
                    step_in[exe.device] = self._step_inputs(exe, input_ids, cache)
                exe.run_segment(env, input_ids, cache, step_in.get(exe.device))
                last[exe.device] = exe
                for nid in () if self.raw_copy else self.to_host.get(i, ()):
                    v = env.get(nid)
                    if hasattr(v, "copy_to_host_async"):
                        v.copy_to_host_async()
            else:
                exe.run_segment(env, input_ids, cache)
            if self.lookahead and self.prefetch:   # start the next cached layers' copies early
                for nid in ids:
                    if nid in self.lookahead and nid in env:
                        self._prefetch(nid, env)
        for dev, exe in last.items():   # the step staging of a GPU is rewritten once its last reader is done
            st = self._step_stage.get(dev)
            g = getattr(getattr(exe, "_stage", None), "guard", None)
            if st is not None and g is not None:
                st.guard = g
        # the outputs first: once they are there the step has finished reading the expert slots
        # that the swaps after it rewrite
        out = {o: cuda_rt.fetch(env[o]).reshape(B, T, -1) for o in self.g.outputs}
        for kind, exe, _ in self.parts:
            if kind == "xla" and exe.count_order:
                self.fold_counts(exe, exe.step_counts)
        self._after_step(cache, T, t_step)
        return out

    def fold_counts(self, exe, counts) -> None:
        """The routings per expert that xla partition exe's cached layers counted in a step
        (--miss-path gpu: its COUNTS result, int32 [layers, E]) into their caches' counts, which
        the bookkeeping after the step reads as it reads the CPU kernels' counts."""
        if counts is None or not self._cache_of_node:
            return
        arr = cuda_rt.fetch(counts)
        rows = self._count_rows.get(id(exe))
        if rows is None:        # the caches' rows in the CacheGroup's [L, E] counts, when all have one
            group, cs = self.cache_group, [self._cache_of_node.get(nid) for nid in exe.count_order]
            index = {id(c): i for i, c in enumerate(group.caches)} if group is not None and group.ok else {}
            rows = self._count_rows[id(exe)] = (np.array([index[id(c)] for c in cs]) if all(
                c is not None and id(c) in index for c in cs) else False)
        if rows is not False:
            self.cache_group.counts[rows] += arr        # one operation for every layer (rows are distinct)
            return
        for nid, row in zip(exe.count_order, arr):
            c = self._cache_of_node.get(nid)
            if c is not None:
                c.counts += row

    def _after_step(self, cache, T: int, t_step: float) -> None:
        cache.advance(T)
        if self.caches:
            self._swap_experts()
            if T == 1:      # decode steps set the pace the copies must keep to
                own = time.perf_counter() - t_step - self._copy_s
                self._step_s = own if not self._step_s else 0.8 * self._step_s + 0.2 * own
