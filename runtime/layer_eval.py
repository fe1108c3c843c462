"""`stratac eval --per-layer`: where along the layers a plan parts from its reference.

Both plans run on the reference backend (the NumPy oracle, whatever their placement) over the same
token ids. After each layer the residual stream (the hidden state the next layer reads) is
compared: max |plan - reference| / std(reference) and the relative RMS error. And each layer's KL
contribution: the reference model is run again with its hidden state after that layer replaced by
the plan's; KL(reference || that run) is the KL the layers up to it account for, and its increase
over the previous layer's is the layer's own share. The plan's own KL is the last line.
"""

from __future__ import annotations

import numpy as np

from strata_compiler.errors import UsageError
from strata_compiler.ir import Graph, Op

from .evaluate import _log_softmax, run_logits
from .session import Session


def _residual_into(g: Graph, nid: int) -> int:
    """The residual stream a projection (or its RMS norm) reads: its input, or the norm's input
    when a standalone norm feeds it."""
    n = g.node(nid)
    x = n.args[0]
    if n.attr("prologue", "none") == "rms_norm":
        return x
    src = g.node(x)
    return src.args[0] if src.op is Op.RMS_NORM else x


def layer_outputs(g: Graph) -> list[int]:
    """Node ids holding the hidden state after each layer, in layer order: the residual stream
    entering layer i + 1, and for the last layer the one the final norm reads."""
    attn = sorted(((n.attr("layer"), n) for n in g.nodes if n.op in (Op.ATTENTION, Op.FUSED_ATTENTION)),
                  key=lambda p: p[0])
    if not attn or [i for i, _ in attn] != list(range(len(attn))):
        raise UsageError("the plan's layers are not numbered 0..L-1; recompile it")
    into = [_residual_into(g, n.args[0]) for _, n in attn[1:]]
    return into + [_residual_into(g, g.outputs[0])]


def _kl(ref: np.ndarray, other: np.ndarray) -> float:
    p = _log_softmax(ref.reshape(-1, ref.shape[-1]).astype(np.float64))
    q = _log_softmax(other.reshape(-1, other.shape[-1]).astype(np.float64))
    return float((np.exp(p) * (p - q)).sum(-1).mean())


def per_layer(plan, reference_plan, ids: np.ndarray) -> list[dict]:
    """One row per layer (layer, max_err, rel_rms, kl_upto, kl_layer) and a last row (layer
    "logits") with the plan's own KL, for token ids i64[B, T]."""
    outs, ref_outs = layer_outputs(plan.graph), layer_outputs(reference_plan.graph)
    if len(outs) != len(ref_outs):
        raise UsageError(f"{plan.path} has {len(outs)} layers, the reference {len(ref_outs)}; compare plans of "
                         f"the same model")
    sess, ref = Session(plan, "reference"), Session(reference_plan, "reference")
    sess.executor.keep, ref.executor.keep = frozenset(outs), frozenset(ref_outs)
    logits, ref_logits = run_logits(sess, ids), run_logits(ref, ids)
    hidden, ref_hidden = sess.executor.kept, ref.executor.kept
    ref.executor.keep = frozenset()
    rows, prev = [], 0.0
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        h, hr = hidden[o].astype(np.float64), ref_hidden[r].astype(np.float64)
        if h.shape != hr.shape:
            raise UsageError(f"layer {i}: hidden states of shapes {h.shape} and {hr.shape}; compare plans of "
                             f"the same model")
        ref.executor.inject = {r: hidden[o].astype(np.float32).reshape(ref_hidden[r].shape)}
        try:
            kl = _kl(ref_logits, run_logits(ref, ids))
        finally:
            ref.executor.inject = {}
        scale = hr.std() or 1.0
        rows.append({"layer": i, "max_err": float(np.abs(h - hr).max() / scale),
                     "rel_rms": float(np.sqrt(((h - hr) ** 2).mean()) / (np.sqrt((hr ** 2).mean()) or 1.0)),
                     "kl_upto": kl, "kl_layer": kl - prev})
        prev = kl
    rows.append({"layer": "logits", "max_err": float(np.abs(logits - ref_logits).max() / (ref_logits.std() or 1.0)),
                 "rel_rms": float(np.sqrt(((logits - ref_logits) ** 2).mean()) / (np.sqrt((ref_logits ** 2).mean()) or 1.0)),
                 "kl_upto": _kl(ref_logits, logits), "kl_layer": _kl(ref_logits, logits) - prev})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["layer    max |err|/std   rel RMS    KL up to here   KL of this layer"]
    for r in rows:
        lines.append(f"{str(r['layer']):8s} {r['max_err']:13.3e} {r['rel_rms']:10.3e} {r['kl_upto']:15.4e} "
                     f"{r['kl_layer']:17.4e}")
    return "\n".join(lines)
