"""`plan-memory`: activation buffers by liveness, and the peak activation footprint.

Linear scan in node order: a value lives from its definition to its last reader (graph
outputs to the end). A node's result takes a free buffer of its size class (bytes per token),
or a new one; its operands' buffers are freed after it is assigned, so no kernel writes over
an input it is still reading. Sizes scale with the tokens in a step (B*T), so they are kept
per token; the meta records the buffer count and the peak live bytes per token.
"""

from __future__ import annotations

from dataclasses import replace

from strata_compiler.ir import Graph, Level, make_attrs
from strata_compiler.pass_manager import PassContext, register


@register("plan-memory", Level.KERNEL)
def plan_memory(g: Graph, ctx: PassContext) -> Graph:
    """Assign activation buffers by liveness; record peak activation bytes per token."""
    last = g.last_use()
    free: dict[int, list[int]] = {}          # size class -> free buffer ids
    size_of: list[int] = []                  # buffer id -> bytes per token
    assigned: dict[int, int] = {}
    live = peak = 0
    nodes = []
    for i, n in enumerate(g.nodes):
        size = n.type.bytes_per_token()
        pool = free.setdefault(size, [])
        buf = pool.pop() if pool else len(size_of)
        if buf == len(size_of):
            size_of.append(size)
        assigned[n.id] = buf
        live += size
        peak = max(peak, live)
        nodes.append(replace(n, buffer=buf))
        for a in set(n.args) | ({n.id} if last[n.id] == i else set()):
            if last[a] == i:
                free[size_of[assigned[a]]].append(assigned[a])
                live -= size_of[assigned[a]]
    meta = dict(g.meta, activation_buffers=len(size_of), peak_activation_bytes_per_token=peak)
    return g.with_(nodes=tuple(nodes), meta=make_attrs(**meta))
