"""`select-kernels`: tensor -> kernel. Bind every op to a device and a backend.

Until placement exists (a later pass), every op runs on the CPU with the backend chosen at
compile time; `strata-run --backend` may rebind them. Each node starts with a buffer of its
own; plan-memory then shares buffers between values whose lifetimes do not overlap.
"""

from __future__ import annotations

from dataclasses import replace

from strata_compiler.ir import Graph, Level
from strata_compiler.pass_manager import PassContext, register


@register("select-kernels", Level.TENSOR, Level.KERNEL)
def select_kernels(g: Graph, ctx: PassContext) -> Graph:
    """Bind each op to a device and backend (everything on the CPU for now)."""
    nodes = tuple(replace(n, device="cpu", backend=ctx.options.backend, buffer=i) for i, n in enumerate(g.nodes))
    return g.with_(level=Level.KERNEL, nodes=nodes)
