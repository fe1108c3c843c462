"""`fuse`: kernel fusion on the tensor level, as a sequence of rewrite rules.

Rules, in order (each is checked for semantic equality on the reference backend in tests):
  merge_siblings   matmuls reading the same input (Q/K/V; gate/up) -> one matmul + slices
  silu_mul         mul(silu(slice h[:I]), slice h[I:]) of a merged gate/up -> linear{epilogue=silu_mul}
  attention        slices of a merged QKV -> [norm] -> [clamp] -> rope -> sdpa -> fused_attention
  route            softmax -> topk_mask [-> renorm] -> route
  expert_gate_up   moe_ffn's per-expert gate and up -> one stacked gate_up weight
  linear           every remaining matmul -> linear
  norm_prologue    rms_norm whose only reader is a linear -> linear{prologue=rms_norm}
  residual         add(r, y) where y is a linear or moe_ffn read only there -> y gets r as residual
Weights merged by a rule are concatenated along their output axis; they later share a format.
"""

from __future__ import annotations

from dataclasses import replace

from strata_compiler.formats import quantizes
from strata_compiler.ir import Graph, Level, Node, Op, WeightSpec, f32, make_attrs
from strata_compiler.pass_manager import PassContext, register

from .rewrite import Rewriter


def _merged_weight(rw: Rewriter, names: list[str]) -> str:
    specs = [rw.weights[n] for n in names]
    prefix = names[0][: names[0].rfind(".") + 1]   # "L0.attn." of "L0.attn.q"; "" without a dot
    name = prefix + "_".join(n[len(prefix):] if n.startswith(prefix) else n for n in names)
    ax = 1 if specs[0].experts else 0   # the output-row axis; stacked weights lead with E
    rows = sum(s.shape[ax] for s in specs)
    shape = specs[0].shape[:ax] + (rows,) + specs[0].shape[ax + 1:]
    spec = WeightSpec(name, shape, tuple(k for s in specs for k in s.sources), specs[0].experts,
                      expert_ids=specs[0].expert_ids)
    rw.weights[name] = spec
    return name


def _quant_class(rw: Rewriter, name: str) -> bool:
    return all(quantizes(k) for k in rw.weights[name].sources)


def merge_siblings(g: Graph) -> Graph:
    rw = Rewriter(g)
    groups: dict[tuple, list[Node]] = {}
    for n in g.nodes:
        if n.op is Op.MATMUL:
            key = (n.args[0], n.weight("b") is not None, _quant_class(rw, n.weight("w")))
            groups.setdefault(key, []).append(n)
    for (x, has_bias, _), nodes in groups.items():
        if len(nodes) < 2:
            continue
        w = _merged_weight(rw, [n.weight("w") for n in nodes])
        b = _merged_weight(rw, [n.weight("b") for n in nodes]) if has_bias else None
        rows = rw.weights[w].shape[0]
        t = nodes[0].type
        merged = Node(rw.fresh(), Op.MATMUL, (x,), f32(*t.shape[:-1], rows),
                      tuple((r, v) for r, v in (("w", w), ("b", b)) if v))
        rw.insert_before(nodes[0].id, merged)
        start = 0
        for n in nodes:
            stop = start + n.type.shape[-1]
            rw.replace(n.id, Node(rw.fresh(), Op.SLICE, (merged.id,), n.type, attrs=make_attrs(start=start, stop=stop)))
            start = stop
    return rw.finish()


def _slices_of(rw: Rewriter, h: int) -> list[Node] | None:
    """The slices that read h, if they are its only readers and tile it exactly, in order."""
    users = rw.users[h]
    if -1 in users or any(rw.node(u).op is not Op.SLICE for u in users):
        return None
    sl = sorted((rw.node(u) for u in users), key=lambda n: n.attr("start"))
    bounds = [(s.attr("start"), s.attr("stop")) for s in sl]
    width = rw.node(h).type.shape[-1]
    if bounds[0][0] != 0 or bounds[-1][1] != width or any(a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
        return None
    return sl


def silu_mul(g: Graph) -> Graph:
    rw = Rewriter(g)
    for n in g.nodes:
        if n.op is not Op.MUL:
            continue
        a, b = (rw.node(x) for x in n.args)
        if a.op is not Op.SILU or b.op is not Op.SLICE or rw.single_user(a.id) != n.id:
            continue
        gs = rw.node(a.args[0])
        if gs.op is not Op.SLICE or gs.args[0] != b.args[0] or rw.node(gs.args[0]).op is not Op.MATMUL:
            continue
        h = rw.node(gs.args[0])
        sl = _slices_of(rw, h.id)
        if sl is None or [s.id for s in sl] != [gs.id, b.id] or rw.single_user(gs.id) != a.id or rw.single_user(b.id) != n.id:
            continue
        rw.replace(n.id, Node(rw.fresh(), Op.LINEAR, h.args, n.type, h.weights,
                              make_attrs(epilogue="silu_mul")))
    return rw.finish()


def _chain_to_slice(rw: Rewriter, nid: int, want: tuple[Op, ...]) -> tuple[Node, dict] | None:
    """Walk back from nid through single-reader ops of kinds `want` to a slice; collect them."""
    seen: dict = {}
    n = rw.node(nid)
    while n.op is not Op.SLICE:
        if n.op not in want or n.op in seen:
            return None
        seen[n.op] = n
        nxt = rw.node(n.args[0])
        if rw.single_user(nxt.id) != n.id:
            return None
        n = nxt
    return n, seen


def attention(g: Graph) -> Graph:
    rw = Rewriter(g)
    for n in g.nodes:
        if n.op is not Op.SDPA:
            continue
        chains = [_chain_to_slice(rw, a, w) for a, w in zip(n.args, [(Op.ROPE, Op.RMS_NORM, Op.CLAMP)] * 2 + [(Op.CLAMP,)])]
        if any(c is None for c in chains):
            continue
        slices = [c[0] for c in chains]
        h = slices[0].args[0]
        if rw.node(h).op is not Op.MATMUL or _slices_of(rw, h) != slices:
            continue
        (_, q_ops), (_, k_ops), _ = chains
        if Op.ROPE not in q_ops or Op.ROPE not in k_ops or (Op.RMS_NORM in q_ops) != (Op.RMS_NORM in k_ops):
            continue
        attrs = dict(n.attrs)
        attrs.update({k: v for k, v in q_ops[Op.ROPE].attrs if k.startswith("rope_")})
        weights = []
        if Op.RMS_NORM in q_ops:
            qn, kn = q_ops[Op.RMS_NORM], k_ops[Op.RMS_NORM]
            attrs.update(eps=qn.attr("eps"), qk_norm="head" if qn.has_attr("group") else "full")
            weights = [("q_norm", qn.weight("w")), ("k_norm", kn.weight("w"))]
        else:
            attrs["qk_norm"] = "none"
        if Op.CLAMP in q_ops:
            attrs["clip_qkv"] = q_ops[Op.CLAMP].attr("limit")
        rw.replace(n.id, Node(rw.fresh(), Op.FUSED_ATTENTION, (h,), n.type, tuple(weights), make_attrs(**attrs)))
    return rw.finish()


def route(g: Graph) -> Graph:
    rw = Rewriter(g)
    for n in g.nodes:
        norm = n.op is Op.RENORM
        top = rw.node(n.args[0]) if norm else n
        if top.op is not Op.TOPK_MASK or (norm and rw.single_user(top.id) != n.id):
            continue
        if not norm and (u := rw.single_user(top.id)) is not None and rw.node(u).op is Op.RENORM:
            continue  # the renorm is the root of this pattern
        sm = rw.node(top.args[0])
        if sm.op is not Op.SOFTMAX or rw.single_user(sm.id) != top.id:
            continue
        rw.replace(n.id, Node(rw.fresh(), Op.ROUTE, sm.args, n.type, attrs=make_attrs(k=top.attr("k"), norm=norm)))
    return rw.finish()


def expert_gate_up(g: Graph) -> Graph:
    rw = Rewriter(g)
    for n in g.nodes:
        if n.op is Op.MOE_FFN and n.weight("gate"):
            gu = _merged_weight(rw, [n.weight("gate"), n.weight("up")])
            rw.replace(n.id, replace(n, id=rw.fresh(), weights=(("gate_up", gu), ("down", n.weight("down")))))
    return rw.finish()


def linear(g: Graph) -> Graph:
    return g.with_(nodes=tuple(replace(n, op=Op.LINEAR) if n.op is Op.MATMUL else n for n in g.nodes))


def norm_prologue(g: Graph) -> Graph:
    rw = Rewriter(g)
    for n in g.nodes:
        if n.op is not Op.RMS_NORM or n.has_attr("group"):
            continue
        u = rw.single_user(n.id)
        if u is None:
            continue
        lin = rw.node(u)
        if lin.op is not Op.LINEAR or lin.args[0] != n.id or lin.attr("prologue", "none") != "none":
            continue
        attrs = dict(lin.attrs, prologue="rms_norm", eps=n.attr("eps"))
        rw.replace(lin.id, replace(lin, id=rw.fresh(), args=(n.args[0],) + lin.args[1:],
                                   weights=lin.weights + (("norm", n.weight("w")),), attrs=make_attrs(**attrs)))
    return rw.finish()


def residual(g: Graph) -> Graph:
    rw = Rewriter(g)
    fusable = {Op.LINEAR: 1, Op.MOE_FFN: 2}   # op -> operand count without a residual
    for n in g.nodes:
        if n.op is not Op.ADD:
            continue
        for y_id, r_id in ((n.args[1], n.args[0]), (n.args[0], n.args[1])):
            y = rw.node(y_id)
            if fusable.get(y.op) == len(y.args) and rw.single_user(y_id) == n.id and y.type == n.type:
                # the fused op moves to the add's place, where the residual is defined
                rw.replace(n.id, replace(y, id=rw.fresh(), args=y.args + (r_id,)))
                break
    return rw.finish()


RULES = (merge_siblings, silu_mul, attention, route, expert_gate_up, linear, norm_prologue, residual)


@register("fuse", Level.TENSOR)
def fuse(g: Graph, ctx: PassContext) -> Graph:
    """Kernel fusion: QKV and gate/up merges, SiLU*mul, attention, router, norms and residuals."""
    for rule in RULES:
        g = rule(g)
    return g
