"""`lower`: graph -> tensor. Model ops become primitive tensor ops.

  attention -> matmul q/k/v [+bias] -> [q/k rms_norm] -> [clamp] -> rope q,k -> sdpa -> matmul o
  mlp       -> matmul gate, matmul up -> silu -> mul -> matmul down
  moe       -> matmul router -> softmax -> topk_mask [-> renorm] -> moe_ffn
               [+ shared expert: an mlp scaled by sigmoid(matmul shared_expert_gate)]
"""

from __future__ import annotations

from strata_compiler.ir import Graph, GraphBuilder, Level, Node, Op, f32
from strata_compiler.pass_manager import PassContext, register

_ROPE_KEYS = ("rope_theta", "rope_type", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max")


def _lower_attention(b: GraphBuilder, n: Node, x: int) -> int:
    B, T = n.type.shape[0], n.type.shape[1]
    H, KV, hd = n.attr("n_heads"), n.attr("n_kv_heads"), n.attr("head_dim")
    eps, qk_norm = n.attr("eps"), n.attr("qk_norm")
    rope = {k: v for k, v in n.attrs if k in _ROPE_KEYS}
    outs = []
    for proj, heads in (("q", H), ("k", KV), ("v", KV)):
        t = f32(B, T, heads * hd)
        y = b.add(Op.MATMUL, (x,), t, weights={"w": n.weight(proj), "b": n.weight("b" + proj)})
        if proj != "v" and qk_norm != "none":
            y = b.add(Op.RMS_NORM, (y,), t, weights={"w": n.weight(proj + "_norm")},
                      attrs={"eps": eps, "group": hd if qk_norm == "head" else None})
        if n.has_attr("clip_qkv"):
            y = b.add(Op.CLAMP, (y,), t, attrs={"limit": n.attr("clip_qkv")})
        if proj != "v":
            y = b.add(Op.ROPE, (y,), t, attrs=dict(rope, head_dim=hd))
        outs.append(y)
    a = b.add(Op.SDPA, tuple(outs), f32(B, T, H * hd),
              attrs={"layer": n.attr("layer"), "n_heads": H, "n_kv_heads": KV, "head_dim": hd})
    return b.add(Op.MATMUL, (a,), n.type, weights={"w": n.weight("o"), "b": n.weight("bo")})


def _lower_mlp(b: GraphBuilder, n: Node, x: int, gate: str, up: str, down: str, rows: int) -> int:
    B, T = n.type.shape[0], n.type.shape[1]
    t = f32(B, T, rows)
    g = b.add(Op.MATMUL, (x,), t, weights={"w": gate})
    u = b.add(Op.MATMUL, (x,), t, weights={"w": up})
    h = b.add(Op.MUL, (b.add(Op.SILU, (g,), t), u), t)
    return b.add(Op.MATMUL, (h,), n.type, weights={"w": down})


def _lower_moe(b: GraphBuilder, g: Graph, n: Node, x: int) -> int:
    B, T = n.type.shape[0], n.type.shape[1]
    E = g.weight(n.weight("router")).shape[0]
    te = f32(B, T, E)
    r = b.add(Op.MATMUL, (x,), te, weights={"w": n.weight("router")})
    c = b.add(Op.TOPK_MASK, (b.add(Op.SOFTMAX, (r,), te),), te, attrs={"k": n.attr("top_k")})
    if n.attr("norm_topk_prob"):
        c = b.add(Op.RENORM, (c,), te)
    y = b.add(Op.MOE_FFN, (x, c), n.type, weights={k: n.weight(k) for k in ("gate", "up", "down")})
    if n.weight("shared_gate"):
        rows = g.weight(n.weight("shared_gate")).shape[0]
        s = _lower_mlp(b, n, x, n.weight("shared_gate"), n.weight("shared_up"), n.weight("shared_down"), rows)
        sg = b.add(Op.MATMUL, (x,), f32(B, T, 1), weights={"w": n.weight("shared_expert_gate")})
        s = b.add(Op.MUL, (b.add(Op.SIGMOID, (sg,), f32(B, T, 1)), s), n.type)
        y = b.add(Op.ADD, (y, s), n.type)
    return y


@register("lower", Level.GRAPH, Level.TENSOR)
def lower(g: Graph, ctx: PassContext) -> Graph:
    """Lower model ops (graph level) to primitive tensor ops."""
    b = GraphBuilder()
    value: dict[int, int] = {}
    for n in g.nodes:
        args = tuple(value[a] for a in n.args)
        if n.op is Op.ATTENTION:
            value[n.id] = _lower_attention(b, n, args[0])
        elif n.op is Op.MLP:
            rows = g.weight(n.weight("gate")).shape[0]
            value[n.id] = _lower_mlp(b, n, args[0], n.weight("gate"), n.weight("up"), n.weight("down"), rows)
        elif n.op is Op.MOE:
            value[n.id] = _lower_moe(b, g, n, args[0])
        else:  # input_ids, embed, rms_norm, add, matmul are tensor ops already
            value[n.id] = b.add(n.op, args, n.type, weights=dict(n.weights), attrs=dict(n.attrs))
    return Graph(Level.TENSOR, tuple(b.nodes), g.weights, tuple(value[o] for o in g.outputs), g.meta)
