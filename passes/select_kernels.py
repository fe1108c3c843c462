"""`select-kernels`: tensor -> kernel. Bind every op to a device and a backend; insert transfers.

Without placement every op runs where `--backend` says (llvm or reference on the CPU, xla on the
GPU). Ops the `place` pass gave a device (--target) go there, and `--place RULES`
(placement_rules.py) override both: gpu ops bind to xla, cpu ops to the CPU backend. Where an operand lives on another device, an
explicit `transfer` node moves it. Each node starts with a buffer of its own; plan-memory then
shares buffers between values whose lifetimes do not overlap.
"""

from __future__ import annotations

from dataclasses import replace

from strata_compiler.ir import Graph, Level, Node, Op, make_attrs, renumber
from strata_compiler.pass_manager import PassContext, register

from .placement_rules import parse_rules, place

DEVICE_OF = {"xla": "gpu", "llvm": "cpu", "reference": "cpu"}


@register("select-kernels", Level.TENSOR, Level.KERNEL)
def select_kernels(g: Graph, ctx: PassContext) -> Graph:
    """Bind each op to a device and backend (--backend, or --place rules); insert transfers."""
    default = ctx.options.backend
    cpu_backend = default if DEVICE_OF[default] == "cpu" else ctx.options.cpu_backend
    placed = place(g, parse_rules(ctx.options.place)) if ctx.options.place else {}
    nodes: list[Node] = []
    where: dict[int, str] = {}
    moved: dict[tuple[int, str], int] = {}
    next_id = max((n.id for n in g.nodes), default=-1) + 1
    for n in g.nodes:
        dev = placed.get(n.id, n.device or DEVICE_OF[default])   # rules, then the place pass, then --backend
        backend = "xla" if dev.startswith("gpu") else cpu_backend
        args = []
        for a in n.args:
            if where[a] != dev:
                if (a, dev) not in moved:
                    src = next(x for x in nodes if x.id == a)
                    t = Node(next_id, Op.TRANSFER, (a,), src.type, device=dev, backend=backend)
                    nodes.append(t)
                    moved[a, dev] = next_id
                    where[next_id] = dev
                    next_id += 1
                a = moved[a, dev]
            args.append(a)
        nodes.append(replace(n, args=tuple(args), device=dev, backend=backend))
        where[n.id] = dev
    nodes = [replace(n, buffer=i) for i, n in enumerate(nodes)]
    out = g.with_(level=Level.KERNEL, nodes=tuple(nodes))
    by = "rules" if placed else ("cost model" if any(n.device for n in g.nodes) else "")
    if by:      # strata-run --backend auto then runs the plan as placed, even when it is all on one device
        out = out.with_(meta=make_attrs(**dict(out.meta, placed_by=by)))
    return renumber(out)
