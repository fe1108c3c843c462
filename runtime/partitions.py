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
        return {o: np.asarray(env[o]).reshape(B, T, -1) for o in self.g.outputs}
