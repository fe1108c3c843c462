"""Graphviz DOT text for an IR graph (written by hand; networkx's writers need pydot)."""

from __future__ import annotations

import json

from .ir import Graph

_COLORS = {"cpu": "lightblue", "gpu": "palegreen", "": "white"}   # gpu:N as gpu


def _q(s: str) -> str:
    return json.dumps(s)


def graph_to_dot(g: Graph, title: str = "") -> str:
    lines = [f"digraph strata {{", f"  label={_q(title or g.level.value)};", "  node [shape=box, fontname=monospace, style=filled];"]
    for n in g.nodes:
        ws = "\\n".join(f"{r}=@{w}" for r, w in n.weights)
        label = f"%{n.id} {n.op.value}\\n{n.type}" + (f"\\n{ws}" if ws else "")
        if n.backend:
            label += f"\\n{n.backend}@{n.device}"
        lines.append(f"  n{n.id} [label={_q(label).replace(chr(92) * 2, chr(92))}, fillcolor={_q(_COLORS.get(n.device, 'white'))}];")
        for a in n.args:
            lines.append(f"  n{a} -> n{n.id};")
    for o in g.outputs:
        lines.append(f"  out{o} [label=\"return\", shape=oval];\n  n{o} -> out{o};")
    lines.append("}")
    return "\n".join(lines) + "\n"
