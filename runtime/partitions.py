"""Mixed plans: consecutive ops bound to one backend form a partition; partitions run in order.

Each partition runs on its backend's executor (xla: one jitted function; llvm: its kernels;
reference: the interpreter). Values crossing a partition boundary go through `env` on the
host, which is what the plan's transfer nodes mark; each attention layer's KV cache lives where
its partition runs (device arrays for xla, host arrays otherwise).
"""

from __future__ import annotations

from itertools import groupby

import numpy as np

from strata_compiler.ir import Graph, Op


def partitions(g: Graph) -> list[tuple[str, list[int]]]:
    """(backend, node ids) for each maximal run of consecutive nodes bound to one backend."""
    return [(b, [n.id for n in grp]) for b, grp in groupby(g.nodes, key=lambda n: n.backend)]


class MixedExecutor:
    def __init__(self, graph: Graph, weights, device: str = "auto") -> None:
        self.g = graph
        self.weights = weights
        self.caches: list = []      # (ExpertCache, xla executor, GPU node, host node) per cached layer
        self.parts = []
        for backend, ids in partitions(graph):
            if backend == "xla":
                from strata_compiler.backends.xla.executor import XLAExecutor

                self.parts.append(("xla", XLAExecutor(graph, weights, nodes=ids, device_kind=device), ids))
            elif backend == "llvm":
                from strata_compiler.backends.llvm_cpu.executor import LLVMExecutor

                self.parts.append(("llvm", LLVMExecutor(graph, weights, nodes=ids), ids))
            else:
                from strata_compiler.backends.reference.executor import ReferenceExecutor

                self.parts.append(("reference", ReferenceExecutor(graph, weights), ids))

    def enable_expert_cache(self, max_swaps: int = 1, policy: str = "hybrid") -> int:
        """Live GPU expert caches for the plan's cached layers (a GPU share on xla, the whole
        layer on the CPU); returns how many. The runtime swaps experts into the slots after each
        step (runtime/expert_cache.py)."""
        from . import expert_cache

        expert_cache.clear(self.g)
        self.caches = []
        part_of = {nid: (kind, exe) for kind, exe, ids in self.parts for nid in ids}
        for n in self.g.nodes:
            key = n.attr("cache", "") if n.op is Op.MOE_FFN else ""
            if not key or not n.attr("experts", ()) or part_of[n.id][0] != "xla":
                continue
            host = next(h for h in self.g.nodes if h.op is Op.MOE_FFN and h.attr("cache", "") == key
                        and not h.attr("experts", ()))
            E = self.g.weight(host.weight("down")).shape[0]
            c = expert_cache.ExpertCache(key, E, np.array(n.attr("experts"), np.int32), max_swaps=max_swaps,
                                         policy=policy)
            expert_cache.CACHES[id(self.g), key] = c
            self.caches.append((c, part_of[n.id][1], n, host))
        return len(self.caches)

    def _swap_experts(self) -> None:
        from . import trace

        for c, xla, gpu_node, host in self.caches:
            for slot, e in c.plan_swaps():
                rows = {role: {a: v[e] for a, v in self.weights.arrays(host.weight(role)).items()}
                        for role, _ in gpu_node.weights}
                import time

                t0 = time.perf_counter()
                moved = xla.set_slot(gpu_node.id, slot, rows)
                c.bytes_moved += moved
                if trace.ACTIVE is not None:
                    trace.ACTIVE.transfer("h2d", moved, time.perf_counter() - t0, name=f"expert {e} -> {c.key}[{slot}]")

    def run(self, input_ids: np.ndarray, cache) -> dict[int, np.ndarray]:
        B, T = input_ids.shape
        ids_node = next(n.id for n in self.g.nodes if n.op is Op.INPUT_IDS)
        env: dict = {ids_node: input_ids}
        from . import trace

        for kind, exe, ids in self.parts:
            if kind == "reference":
                if trace.ACTIVE is None:
                    exe.run_segment(env, input_ids, cache, ids)
                else:
                    with trace.ACTIVE.span(f"reference partition ({len(ids)} ops)", "cpu"):
                        exe.run_segment(env, input_ids, cache, ids)
            else:
                exe.run_segment(env, input_ids, cache)
        cache.advance(T)
        if self.caches:
            self._swap_experts()
        return {o: np.asarray(env[o]).reshape(B, T, -1) for o in self.g.outputs}
