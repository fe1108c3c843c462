"""A small graph rewriter shared by the passes: replace, insert, redirect uses, then rebuild.

Passes never mutate a Graph; they describe edits here and `finish()` builds the new one:
uses are redirected through the alias map, dead nodes dropped (every op is pure except `sdpa`
and `fused_attention`, whose results are always used), ids renumbered in order.
"""

from __future__ import annotations

from dataclasses import replace

from strata_compiler.ir import Graph, Node, Op, renumber

_SIDE_EFFECTS = frozenset({Op.SDPA, Op.FUSED_ATTENTION})


class Rewriter:
    def __init__(self, g: Graph) -> None:
        self.g = g
        self.nodes: dict[int, Node] = {n.id: n for n in g.nodes}
        self.order: list[int] = [n.id for n in g.nodes]
        self.alias: dict[int, int] = {}
        self.weights = {w.name: w for w in g.weights}
        self.next_id = max(self.order, default=-1) + 1
        self.users = g.users()

    def fresh(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def node(self, nid: int) -> Node:
        return self.nodes[nid]

    def single_user(self, nid: int) -> int | None:
        u = self.users.get(nid, [])
        return u[0] if len(u) == 1 and u[0] >= 0 else None

    def insert_after(self, anchor: int, node: Node) -> int:
        self.nodes[node.id] = node
        self.order.insert(self.order.index(anchor) + 1, node.id)
        return node.id

    def insert_before(self, anchor: int, node: Node) -> int:
        self.nodes[node.id] = node
        self.order.insert(self.order.index(anchor), node.id)
        return node.id

    def replace(self, old: int, node: Node) -> int:
        """Put `node` where `old` was; every use of `old` now reads `node`."""
        self.insert_after(old, node)
        self.redirect(old, node.id)
        return node.id

    def redirect(self, old: int, new: int) -> None:
        self.alias[old] = new

    def resolve(self, nid: int) -> int:
        while nid in self.alias:
            nid = self.alias[nid]
        return nid

    def finish(self, **graph_changes) -> Graph:
        nodes = [replace(self.nodes[i], args=tuple(self.resolve(a) for a in self.nodes[i].args))
                 for i in self.order if i not in self.alias]
        outputs = tuple(self.resolve(o) for o in self.g.outputs)
        live = set(outputs)
        kept = []
        for n in reversed(nodes):
            if n.id in live or n.op in _SIDE_EFFECTS:
                kept.append(n)
                live.update(n.args)
        kept.reverse()
        used = {w for n in kept for _, w in n.weights}
        weights = tuple(w for w in self.weights.values() if w.name in used)
        return renumber(self.g.with_(nodes=tuple(kept), outputs=outputs, weights=weights, **graph_changes))
