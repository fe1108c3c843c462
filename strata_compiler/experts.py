"""Which experts are where: a layer's expert shares and the experts resident in an expert cache.

A layer's experts may be split over several moe_ffn nodes (passes/expert_split.py), each
computing the routing columns its `experts` attribute names. An expert cache is two of them
sharing `cache=<key>`: the GPU share (the cache's slots, first holding the plan's experts) and a
`whole` host share that holds every expert and computes those not resident in the slots. The
compiler, the backends and the runtime all read these facts, so they live here.

While a plan runs, the runtime's expert caches move experts in and out of the slots; the
executors of the whole shares see it through a `Residency`, one object per running plan handed
to each of its executors.
"""

from __future__ import annotations

import numpy as np

from .ir import Graph, Node, Op

IN_PLACE = "in_place_weights"    # graph meta (runtime only): weights the GPU reads from host memory in place


def moe_key(n: Node) -> str:
    """A stable name for a moe_ffn node across passes: its down weight's name."""
    return n.weight("down")


class Residency:
    """The live expert caches of one running plan, by cache key: each has `nonresident`, f32[E],
    1 for an expert its host share computes (the runtime's ExpertCache). A layer without a live
    cache keeps the plan's static split."""

    def __init__(self) -> None:
        self.caches: dict[str, object] = {}

    def get(self, key: str):
        return self.caches.get(key)


def static_residents(g: Graph, key: str) -> tuple[int, ...]:
    """The experts the plan puts in cache `key`'s GPU slots (its share node's `experts`)."""
    for n in g.nodes:
        if n.op is Op.MOE_FFN and n.attr("cache", "") == key and n.attr("experts", ()):
            return tuple(n.attr("experts"))
    return ()


def nonresident_mask(g: Graph, n: Node, residency: Residency | None = None) -> np.ndarray | None:
    """f32[E] for a cache's `whole` node: 0 for the experts resident in the cache's slots (the
    live cache's current ones when `residency` has it, else the plan's), 1 for the rest; None
    for other nodes."""
    key = n.attr("cache", "")
    if not key or n.attr("experts", ()):
        return None
    live = residency.get(key) if residency is not None else None
    return live.nonresident if live is not None else static_nonresident(g, n)


def static_nonresident(g: Graph, n: Node) -> np.ndarray:
    """nonresident_mask as the plan has it (no live cache): the share node's experts are 0."""
    mask = np.ones(g.weight(n.weight("down")).shape[0], np.float32)
    mask[list(static_residents(g, n.attr("cache")))] = 0.0
    return mask


def in_place_weights(graph: Graph) -> set[str]:
    """The weights the runtime left in host memory for the GPU to read in place (runtime/mapped.py)."""
    return set(graph.meta_value(IN_PLACE, ()))


def share_groups(graph: Graph, nodes: list[Node]) -> list[list[Node]]:
    """The moe_ffn shares of one layer on different GPUs (same x and routing inputs after
    transfers), in node order; only groups with one share per device and one storage format."""

    def origin(i: int) -> int:
        while graph.node(i).op is Op.TRANSFER:
            i = graph.node(i).args[0]
        return i

    groups: dict[tuple[int, int], list[Node]] = {}
    for n in nodes:
        if n.op is Op.MOE_FFN and n.attr("experts", ()) and not n.attr("cache", "") and n.device.startswith("gpu"):
            groups.setdefault((origin(n.args[0]), origin(n.args[1])), []).append(n)
    out = []
    for members in groups.values():
        devs = [m.device for m in members]
        specs = {(graph.weight(m.weight(r)).fmt, graph.weight(m.weight(r)).group_size,
                  graph.weight(m.weight(r)).shape[1:]) for m in members for r in ("gate_up", "down")}
        if len(members) > 1 and len(set(devs)) == len(devs) and len(specs) == 2 \
                and all(m.weight("gate_up") and m.weight("down") for m in members):
            out.append(members)
    return out


def mesh_devices(graph: Graph) -> int:
    """How many GPUs a striped plan's mesh spans (backends/xla/mesh.py; 0: the plan is not one
    for a mesh: its GPU nodes are on one device, or off gpu:0 are other nodes than expert shares)."""
    xla = [n for n in graph.nodes if n.device.startswith("gpu")]
    devs = {n.device for n in xla}
    if len(devs) < 2 or not all(d.startswith("gpu:") for d in devs):
        return 0
    grouped = {m.id for grp in share_groups(graph, xla) for m in grp}
    for n in xla:
        if n.device != "gpu:0" and n.id not in grouped and n.op is not Op.TRANSFER:
            return 0
    return 1 + max(int(d.split(":")[1]) for d in devs) if grouped else 0
