"""`--miss-path gpu`: an expert cache's host share rebound to its GPU share's device, the GPU reading
the missed experts' weights from host memory in place (backends/xla/mapped.py makes those views).

A GPU share's MoE kernels then read a resident expert from its slot and a missed one from the
layer's whole host array, so a cached layer needs no host call, against a split layer's two host
calls and the CPU's share of the experts.
"""

from __future__ import annotations

from strata_compiler.experts import IN_PLACE


def _shares(graph) -> list[tuple]:
    """(GPU share, host share) of each expert cache: the moe_ffn nodes sharing `cache=<key>`, the
    one with `experts` bound to xla."""
    from strata_compiler.ir import Op

    gpu, host = {}, {}
    for n in graph.nodes:
        key = n.attr("cache", "") if n.op is Op.MOE_FFN else ""
        if key and n.attr("experts", ()):
            if n.backend == "xla":
                gpu[key] = n
        elif key:
            host[key] = n
    return [(g, host[key]) for key, g in gpu.items() if key in host]


def rebind_misses(graph):
    """The graph with every expert cache's host share on its GPU share's device, for `--miss-path
    gpu`: the GPU share then computes the whole layer (its slots for the hits, the host share's
    arrays, read in place, for the misses) and the host share contributes nothing. Moves the host
    share, the transfers that feed it, the add that combines the two shares and the transfers
    feeding that add (a split layer's CPU side), so that the layer stays in one GPU partition.

    An embedding the plan left on the CPU ahead of the first GPU op moves too, its table read in
    place (a row per token): else the step would open with a host call and the GPU wait for the
    program's launch to reach it, and a plan whose other CPU ops were cached layers' shares now
    runs a program without host calls, which may decode ahead (MixedExecutor.decode_ahead)."""
    from dataclasses import replace

    from strata_compiler.ir import Op

    users = graph.users()
    shares = _shares(graph)
    moved: dict[int, tuple[str, str]] = {}
    for g, h in shares:
        nodes = [h] + [graph.node(a) for a in h.args if graph.node(a).op is Op.TRANSFER]
        for u in users[h.id]:
            if u != -1 and graph.node(u).op is Op.ADD:
                add = graph.node(u)
                nodes += [add] + [graph.node(a) for a in add.args if graph.node(a).op is Op.TRANSFER]
        for n in nodes:
            moved[n.id] = (g.backend, g.device)
    if not moved:
        return graph
    in_place = sorted({w for _, h in shares for _, w in h.weights})
    first = next(i for i, n in enumerate(graph.nodes) if n.backend == "xla")
    head = graph.nodes[:first]
    gpu_weights = {w for n in graph.nodes[first:] if n.backend == "xla" for _, w in n.weights}
    if head and all(n.op in (Op.INPUT_IDS, Op.EMBED, Op.TRANSFER) for n in head) \
            and not {w for n in head for _, w in n.weights} & gpu_weights:
        for n in head:
            moved[n.id] = (graph.nodes[first].backend, graph.nodes[first].device)
        in_place += sorted({w for n in head for _, w in n.weights})
    return graph.with_(nodes=tuple(replace(n, backend=moved[n.id][0], device=moved[n.id][1]) if n.id in moved else n
                                   for n in graph.nodes),
                       meta=tuple(graph.meta) + ((IN_PLACE, tuple(in_place)),))


def in_place_pairs(graph) -> dict[int, int]:
    """{GPU share id: host share id} of the expert caches whose host share `rebind_misses` put on
    the GPU share's device."""
    return {g.id: h.id for g, h in _shares(graph) if h.backend == g.backend and h.device == g.device}
