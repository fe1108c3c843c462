"""The live expert caches of a mixed plan: what fills each cached layer's GPU slots, and when.

Each cached layer's ExpertCache (runtime/expert_cache.py) decides after a step which missed
experts to swap in; `ExpertSwaps` copies them into the GPU share's slots from the host share's
weights between steps.

Every copy counts against a copy budget: at most COPY_SHARE of a step's own time (a moving
average), so a router without temporal locality cannot make the cache much slower than the
static split.
"""

from __future__ import annotations

import time

import numpy as np

from strata_compiler import settings, trace
from strata_compiler.backends.xla import cuda_rt
from strata_compiler.ir import Op

from . import expert_cache

COPY_SHARE = 0.10


class ExpertSwaps:
    """The expert caches of MixedExecutor `mixed`'s cached layers, none until `enable`."""

    def __init__(self, mixed) -> None:
        self.m = mixed
        self.caches: list = []      # (ExpertCache, xla executor, GPU share node, host share node) per cached layer
        self.async_swaps = False    # slot copies queued without waiting, from page-locked host weights
        self.cache_group = None     # expert_cache.CacheGroup: the caches' bookkeeping as whole arrays
        self.pinned_bytes = 0
        self.copy_share = COPY_SHARE
        self._of_node: dict = {}    # cached GPU share id -> its ExpertCache
        self._count_rows: dict = {}     # id(xla executor) -> its COUNTS rows in the CacheGroup (fold_counts)
        self._parts: dict = {}      # cache key -> (xla executor, GPU share, host share)
        self._copy_plans: dict = {}     # cache key -> raw copy addresses (copy_plan)
        self._step_s = 0.0          # moving average of a step's time (without its copies)
        self._copy_s = 0.0          # copy seconds spent this step (budget: copy_share * _step_s)

    def enable(self, max_swaps: int | None, policy: str) -> int:
        """Live caches for the plan's cached layers (a GPU share on xla, the whole layer on the
        CPU); returns how many. At most `max_swaps` swaps a layer after each step (default: the
        `cache_swaps` setting; 0: the slots stay as planned and only the counts run)."""
        m, g = self.m, self.m.g
        if max_swaps is None:
            max_swaps = settings.get("cache_swaps")
        m.residency.caches.clear()
        self.caches, self._count_rows = [], {}
        # with fused decode steps the cached layers' host weights are page-locked and their slot
        # copies queued without waiting (the step reading the slots waits); partition by
        # partition each copy waits
        self.async_swaps = m.fused is not None
        pinned = []
        part_of = {nid: (kind, exe) for kind, exe, ids in m.parts for nid in ids}
        for n in g.nodes:
            key = n.attr("cache", "") if n.op is Op.MOE_FFN else ""
            if not key or not n.attr("experts", ()) or part_of[n.id][0] != "xla":
                continue
            host = next(h for h in g.nodes if h.op is Op.MOE_FFN and h.attr("cache", "") == key
                        and not h.attr("experts", ()))
            E = g.weight(host.weight("down")).shape[0]
            xla = part_of[n.id][1]
            prior = host.attr("prior", ())
            c = expert_cache.ExpertCache(key, E, np.array(n.attr("experts")[:xla.slots_of[n.id]], np.int32),
                                         max_swaps=max_swaps, policy=policy,
                                         prior=np.array(prior, np.float64) if len(prior) == E else None)
            if self.async_swaps:
                pinned += [a for role, _ in n.weights for a in self.host_arrays(host.weight(role)).values()]
            m.residency.caches[key] = c
            self.caches.append((c, xla, n, host))
            self._of_node[n.id] = c
            if n.id in m.mapped:
                c.miss_path = "gpu"
            c.expert_bytes = sum(v.nbytes for role, _ in n.weights
                                 for v in self.host_arrays(host.weight(role)).values()) // E
        if pinned and m.transfers.cuda and getattr(m.weights, "disk_tier", None) is None:   # (disk-tier pages stay evictable)
            self.pinned_bytes = cuda_rt.pin(pinned)
        # the caches' bookkeeping after each step as whole-array operations (ExpertCache rows of a
        # CacheGroup's arrays: before any native program reads their addresses)
        self.cache_group = expert_cache.CacheGroup([c for c, *_ in self.caches]) if self.caches else None
        self._parts = {c.key: (xla, n, host) for c, xla, n, host in self.caches}
        return len(self.caches)

    def host_arrays(self, name: str) -> dict:
        """A cached layer's host weights as its CPU kernels read them: their huge-page copy when
        the llvm executor made one (so the expert copies and the page-locking use that memory,
        not the file's pages a second time), else the plan's mapping. A host share the GPU reads
        in place (--miss-path gpu): the arrays it reads."""
        parts = self.m.parts
        for kind, exe, _ in parts:
            if kind == "xla" and name in exe.mapped_host:
                return exe.mapped_host[name]
        if any(getattr(exe, "hugepages", False) for _, exe, _ in parts):
            return self.m.weights.resident_arrays(name)
        return self.m.weights.arrays(name)

    # -- a step's copies -------------------------------------------------------------------------

    def begin_step(self) -> None:
        self._copy_s = 0.0

    def step_time(self, seconds: float) -> None:
        """A decode step's time, its copies included: the pace the copies must keep to."""
        own = seconds - self._copy_s
        self._step_s = own if not self._step_s else 0.8 * self._step_s + 0.2 * own

    def _copy_ok(self, c) -> bool:
        """Whether this step's copy budget has time left for cache c's layer (the first steps, with
        no average yet, may copy)."""
        if self._step_s and self._copy_s >= self.copy_share * self._step_s:
            c.budget_skips += 1
            return False
        return True

    def _copy_in(self, c, xla, gpu_node, host, slot: int, e: int, label: str) -> None:
        """Expert e's stored rows (from the host node's whole-layer weights) into GPU slot `slot`."""
        t0 = time.perf_counter()
        bulk = self.async_swaps and xla.transfers.cuda
        plan = self.copy_plan(c, xla, gpu_node, host) if bulk else ()
        if bulk and all(raw for *_, raw in plan):
            moved = 0           # raw copies on the bulk stream; the next step lands them (land_slot_copies)
            for _name, _arr, cur, dst, rb, src, _raw in plan:
                cuda_rt.copy_bulk(dst + slot * rb, src[e].ctypes.data, rb, cur)
                moved += rb
            xla.slot_copies_queued()
        else:
            rows = {role: {a: v[e] for a, v in self.host_arrays(host.weight(role)).items()}
                    for role, _ in gpu_node.weights}
            moved = xla.set_slot(gpu_node.id, slot, rows, wait=not self.async_swaps)
        dt = time.perf_counter() - t0
        self._copy_s += dt
        c.bytes_moved += moved
        if trace.ACTIVE is not None:
            trace.ACTIVE.transfer("h2d", moved, dt, name=label)

    def copy_plan(self, c, xla, gpu_node, host) -> list[tuple]:
        """Cache c's raw copies, per weight array of its GPU share: (param name, array name,
        the device array, its address, bytes per slot, the host array, whether a stored row
        copies as it is), worked out again when the device arrays changed."""
        plan = self._copy_plans.get(c.key)
        if plan is None or any(xla.params[name][arr] is not cur for name, arr, cur, *_ in plan):
            plan = []
            for role, name in gpu_node.weights:
                src_all = self.host_arrays(host.weight(role))
                for arr, cur in xla.params[name].items():
                    src = src_all[arr]
                    rb = cur.nbytes // cur.shape[0]
                    raw = src.dtype == cur.dtype and src[0].nbytes == rb and src[0].flags.c_contiguous
                    plan.append((name, arr, cur, cur.unsafe_buffer_pointer(), rb, src, raw))
            self._copy_plans[c.key] = plan
        return plan

    # -- after a step ----------------------------------------------------------------------------

    def fold_counts(self, exe, counts) -> None:
        """The routings per expert that xla partition exe's cached layers counted in a step
        (--miss-path gpu: its COUNTS result, int32 [layers, E]) into their caches' counts, which
        the bookkeeping after the step reads as it reads the CPU kernels' counts."""
        if counts is None or not self._of_node:
            return
        arr = cuda_rt.fetch(counts)
        rows = self._count_rows.get(id(exe))
        if rows is None:        # the caches' rows in the CacheGroup's [L, E] counts, when all have one
            group, cs = self.cache_group, [self._of_node.get(nid) for nid in exe.count_order]
            index = {id(c): i for i, c in enumerate(group.caches)} if group is not None and group.ok else {}
            rows = self._count_rows[id(exe)] = (np.array([index[id(c)] for c in cs]) if all(
                c is not None and id(c) in index for c in cs) else False)
        if rows is not False:
            self.cache_group.counts[rows] += arr        # one operation for every layer (rows are distinct)
            return
        for nid, row in zip(exe.count_order, arr):
            c = self._of_node.get(nid)
            if c is not None:
                c.counts += row

    def swap(self) -> None:
        """The bookkeeping after a step, and its swaps copied."""
        for sw in self.decide():
            self.issue(*sw)

    def issue(self, c, slot: int, e: int, old: int) -> None:
        """Copy a decided swap into its slot, or (over this step's copy budget) undo it: the slot
        still holds `old`, as plan_swaps(max_swaps=0) would have left it."""
        if self._copy_ok(c):
            xla, gpu_node, host = self._parts[c.key]
            self._copy_in(c, xla, gpu_node, host, slot, e, f"expert {e} -> {c.key}[{slot}]")
        else:
            self._undo(c, slot, e, old)

    @staticmethod
    def _undo(c, slot: int, e: int, old: int) -> None:
        c.slots[slot] = old
        c.nonresident[e], c.nonresident[old] = 1.0, 0.0
        c.swaps -= 1

    def decide(self, resident: np.ndarray | None = None) -> list[tuple]:
        """The caches' bookkeeping after a step and the swaps it decides, (cache, slot, expert,
        the expert it evicts), their bookkeeping done as if made: the caller copies or undoes
        each (`issue`). Over the copy budget no swap is decided and the scores still learn.
        `resident`: bool [layers, E] in the CacheGroup's order, the experts the step found in its
        slots where that differs from the caches' own view (decode ahead: slots being swapped
        were masked); only with a CacheGroup."""
        group = self.cache_group
        swaps = group.after_step(resident) if group is not None else None
        if swaps is not None:
            if not (self._step_s and self._copy_s >= self.copy_share * self._step_s):
                return swaps
            for sw in swaps:                # over the budget: as plan_swaps(max_swaps=0) leaves it
                self._undo(*sw)
            for c in group.caches:
                c.budget_skips += 1
            return []
        if resident is not None:
            raise RuntimeError("decode ahead needs the caches' bookkeeping as a CacheGroup")
        out = []
        for c, *_ in self.caches:
            if not self._copy_ok(c):
                c.plan_swaps(max_swaps=0)      # the scores still learn from this step
                continue
            out += [(c, slot, e, int(c.slots[slot])) for slot, e in c.plan_swaps()]
        return out

    def cache_of(self, node_id: int):
        """The ExpertCache of a cached GPU share."""
        return self._of_node[node_id]
