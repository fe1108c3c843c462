"""Splitting a layer's experts over several moe_ffn nodes, each holding its own share.

A moe_ffn node computes  y = residual + sum_e route[:, e] * expert_e(x)  over its experts. The
sum splits: node 1 takes experts S1 and the residual, node 2 takes S2 and node 1's result as its
residual, and so on — the chain gives the same y. Each share's weights are their own
WeightSpecs (`expert_ids` names the model's experts they stack), so each share can have its own
device (placement). The node's `experts` attribute tells the executors which routing columns are
its own.

An expert cache (`stratac compile --expert-cache`) is the dynamic form: the layer becomes its GPU
share (the cache's slots, first holding the hottest experts) and a `whole` share on the host that
holds every expert and computes those not resident in the cache; both carry `cache=<layer key>`,
and the runtime (runtime/expert_cache.py) swaps experts into the slots as routing shifts. What the
backends and the runtime read of these shares (residents, masks, mesh groups) is in
strata_compiler/experts.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from strata_compiler.experts import moe_key
from strata_compiler.ir import Graph, Node, Op, make_attrs
from strata_compiler.passes.rewrite import Rewriter


@dataclass(frozen=True)
class Share:
    """One moe_ffn node's experts and their device ('' keeps the node's); the share's weights keep
    the layer's formats."""

    experts: tuple[int, ...]
    device: str = ""
    whole: bool = False    # an expert cache's host side: all the layer's experts, those resident
                           # in the cache (the layer's other shares) masked out at run time
    prior: tuple[float, ...] = ()   # a whole share: each expert's calibrated share of the tokens
                                    # (the cache's starting scores), else empty


def split_experts(g: Graph, shares: dict[str, list[Share]], calib=None) -> Graph:
    """Replace each moe_ffn named in `shares` (by moe_key) with a chain of nodes, one per share.

    The shares of a node must partition its experts. With `calib` (passes/calibrate.Calibration),
    each new weight gets its experts' rows of the importance statistics, for the quantizer."""
    rw = Rewriter(g)
    for n in g.nodes:
        if n.op is not Op.MOE_FFN or moe_key(n) not in shares:
            continue
        parts = shares[moe_key(n)]
        mine = tuple(n.attr("experts", ())) or tuple(range(g.weight(n.weight("down")).shape[0]))
        flat = sorted(e for s in parts if not s.whole for e in s.experts)
        cached = any(s.whole for s in parts)
        if (not cached and flat != sorted(mine)) or (cached and not set(flat) <= set(mine)) or len(set(flat)) != len(flat):
            raise ValueError(f"shares of {moe_key(n)} do not partition its experts {list(mine)}: {flat}")
        if cached and n.attr("experts", ()):
            raise ValueError(f"{moe_key(n)}: an expert cache needs the whole layer, not a share")
        if len(parts) == 1 and not parts[0].device:
            continue
        pos = {e: i for i, e in enumerate(mine)}      # model expert id -> position in n's stacks
        x, route = n.args[0], n.args[1]
        prev = n.args[2] if len(n.args) == 3 else None
        anchor = n.id
        # shares on one device chain through the residual (no extra op); shares on different
        # devices run side by side and an add joins them, so neither waits for the other
        parallel = len({s.device or n.device for s in parts}) > 1
        outs: list[int] = []
        for si, share in enumerate(parts):
            if parallel and si > 0:
                prev = None
            ws = {}
            attrs = dict(n.attrs)
            if cached:
                attrs["cache"] = moe_key(n)
            if share.whole:       # the layer's own weights, every expert
                if share.prior:
                    attrs["prior"] = tuple(share.prior)
                node = Node(rw.fresh(), Op.MOE_FFN, (x, route) + ((prev,) if prev is not None else ()), n.type,
                            n.weights, make_attrs(**attrs), share.device or n.device, n.backend)
                rw.insert_after(anchor, node)
                anchor = prev = node.id
                outs.append(node.id)
                continue
            for role, name in n.weights:
                spec = rw.weights[name]
                sub = f"{name}.s{si}"
                rw.weights[sub] = replace(spec, name=sub, shape=(len(share.experts),) + spec.shape[1:],
                                          experts=len(share.experts), expert_ids=tuple(share.experts))
                ws[role] = sub
                if calib is not None:
                    _slice_statistics(calib, name, sub, [pos[e] for e in share.experts])
            attrs["experts"] = tuple(share.experts)
            node = Node(rw.fresh(), Op.MOE_FFN, (x, route) + ((prev,) if prev is not None else ()), n.type,
                        tuple(ws.items()), make_attrs(**attrs), share.device or n.device, n.backend)
            rw.insert_after(anchor, node)
            anchor = prev = node.id
            outs.append(node.id)
        if parallel:
            acc = outs[0]
            for o in outs[1:]:
                add = Node(rw.fresh(), Op.ADD, (acc, o), n.type, device=n.device, backend=n.backend)
                rw.insert_after(anchor, add)
                anchor = acc = add.id
            prev = acc
        rw.redirect(n.id, prev)
    return rw.finish()


def _slice_statistics(calib, name: str, sub: str, rows: list[int]) -> None:
    if name in calib.sumsq and getattr(calib.sumsq[name], "ndim", 0) == 2:
        calib.sumsq[sub] = calib.sumsq[name][rows]
        calib.rows[sub] = calib.rows[name][rows]
