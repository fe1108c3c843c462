"""Manual placement rules (`stratac compile --place RULES`), in the spirit of llama.cpp's -ot.

RULES is a comma-separated list, first match wins, of

    CATEGORY=DEVICE      CATEGORY: embed, attention, router, experts, shared, dense, head, all
    re:REGEX=DEVICE      REGEX searched in the names of the node's weights (IR names such as
                         L3.moe.gate_up, and their safetensors keys)

with DEVICE gpu or cpu. e.g. `experts=cpu,attention=gpu` or `re:L(1[2-9]|2\\d)\\.moe=cpu,all=gpu`.
A node with no weights (add, slice, route, ...) takes the category and the weight names (for
regexes) of the node it reads first, so glue ops stay with the layer part they belong to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from strata_compiler.errors import UsageError
from strata_compiler.ir import Graph, Node, Op

CATEGORIES = ("embed", "attention", "router", "experts", "shared", "dense", "head", "all")
DEVICES = ("gpu", "cpu")


@dataclass(frozen=True)
class Rule:
    category: str | None
    pattern: re.Pattern | None
    device: str


def parse_rules(text: str) -> tuple[Rule, ...]:
    rules = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, eq, dev = part.rpartition("=")
        if not eq or dev not in DEVICES:
            raise UsageError(f"--place {part!r}: expected CATEGORY=gpu|cpu or re:REGEX=gpu|cpu")
        if key.startswith("re:"):
            try:
                rules.append(Rule(None, re.compile(key[3:]), dev))
            except re.error as e:
                raise UsageError(f"--place {part!r}: bad regular expression ({e})") from None
        elif key in CATEGORIES:
            rules.append(Rule(key, None, dev))
        else:
            raise UsageError(f"--place {part!r}: unknown category {key!r}; categories: {', '.join(CATEGORIES)}")
    return tuple(rules)


def _category_of_weight(name: str) -> str:
    if name == "embed":
        return "embed"
    if name in ("norm", "lm_head"):
        return "head"
    part = name.split(".")[1] if "." in name else ""
    leaf = name.split(".", 2)[2] if name.count(".") >= 2 else ""
    if part == "attn" or leaf.startswith("ln1"):
        return "attention"
    if part == "mlp":
        return "dense"
    if part == "moe":
        if leaf.startswith("router"):
            return "router"
        return "shared" if leaf.startswith("shared") else "experts"
    return "attention" if name.endswith(".ln1") else "dense"


def categories(g: Graph) -> dict[int, str]:
    out: dict[int, str] = {}
    for n in g.nodes:
        if n.op is Op.FUSED_ATTENTION:
            out[n.id] = "attention"
        elif n.op is Op.ROUTE:
            out[n.id] = "router"
        elif n.op is Op.MOE_FFN:
            out[n.id] = "experts"
        elif n.op is Op.INPUT_IDS:
            out[n.id] = "embed"
        elif n.weights:
            w = n.weight("w") or n.weights[0][1]
            out[n.id] = _category_of_weight(w)
        else:
            out[n.id] = out[n.args[0]] if n.args else "all"
    return out


def place(g: Graph, rules: tuple[Rule, ...]) -> dict[int, str]:
    """Node id -> device ("gpu" | "cpu") for the nodes some rule matches."""
    cats = categories(g)
    out = {}
    names_of: dict[int, list[str]] = {}
    for n in g.nodes:
        names = [w for _, w in n.weights]
        names += [k for w in names for k in g.weight(w).sources]
        if not names and n.args:        # glue ops match regexes by the node they read first, as categories do
            names = names_of[n.args[0]]
        names_of[n.id] = names
        for r in rules:
            if r.pattern is not None:
                hit = any(r.pattern.search(x) for x in names)
            else:
                hit = r.category == "all" or r.category == cats[n.id]
            if hit:
                out[n.id] = r.device
                break
    return out
