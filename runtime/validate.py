"""The one step between loading a plan and running it: every fact the kernels rely on, checked.

A plan's checksums prove only that its bytes are the ones someone sealed; plans are shared and
downloaded, so that someone may be hostile. The JIT kernels do unchecked pointer arithmetic with
the heads, head size, widths, vocabulary and layer indices a plan declares, and the runtime
allocates the KV cache from its metadata, so `validate_plan` (called by `load_plan`, after the IR
verifier has checked every attribute's type and range) derives those facts from the weight
sections' real sizes and checks that everything else agrees with them:

* each weight's sections hold exactly the bytes its declared shape and format need;
* each activation is f32[B, T, C] (C a concrete width), the token ids i64[B, T], read only by embed;
* each op's widths agree with its weights and attributes (attention: (H + 2 KV) * hd in, H * hd
  out, H % KV == 0, even hd; moe: the stacked experts' [E, 2I, D] / [E, D, I]; route: top-k in
  1..E; slice bounds inside its input; element-wise ops keep their width);
* attention layers are numbered 0..n_layers-1, each once, all with the KV heads and head size
  the KV cache is allocated with; the metadata's n_layers, n_kv_heads, head_dim and vocab_size
  equal those facts (vocab_size: the embedding table's rows and the logits' width);
* activation buffers never overwrite a value that is still to be read; nodes name known backends
  and devices; an expert cache has its one host share;
* meta["sampling"], the defaults every request starts from, has known keys of the right types
  within their bounds (strata_compiler/sampling.py).

Failures are PlanError, one line naming the plan, the node or weight and what is wrong; never
`assert` (it vanishes under python -O).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np

from strata_compiler.errors import PlanError
from strata_compiler.experts import IN_PLACE
from strata_compiler.formats import get_format
from strata_compiler.ir import DType, Graph, Node, Op
from strata_compiler.plan_format import Container, section_name
from strata_compiler.rope import rope_inv_freq
from strata_compiler.sampling import from_meta
from strata_compiler.verify import MAX_DIM

BACKENDS = ("reference", "llvm", "xla")
_DEVICE = re.compile(r"cpu|gpu(:\d{1,3})?")
_ATTENTION = (Op.FUSED_ATTENTION, Op.SDPA)
_SAME_WIDTH = (Op.SOFTMAX, Op.RENORM, Op.SILU, Op.SIGMOID, Op.CLAMP, Op.TRANSFER, Op.ROPE, Op.RMS_NORM,
               Op.ROUTE, Op.TOPK_MASK)


class _Invalid(Exception):
    """One fact that does not hold; validate_plan turns it into the PlanError line."""


def validate_plan(path: Path, meta: dict, g: Graph, weights: Container) -> None:
    """Check the plan's kernel-level graph `g` and metadata against the weights file's real
    sections (see the module docstring); PlanError naming `path` on the first fact that fails."""
    try:
        _check_sections(g, weights)
        _check_activations(g)
        facts = _Facts()
        for n in g.nodes:
            _check_node(g, n, facts)
        _check_buffers(g)
        _check_model_meta(meta.get("model"), g, facts)
        _check_graph_meta(g)
        _check_sampling_meta(meta.get("sampling"))
    except _Invalid as e:
        raise PlanError(f"{path}: {e}; the plan is corrupt or was edited — recompile it with `stratac compile`") \
            from None


class _Facts:
    """What the graph itself says the model is: attention layers, their KV heads and head size,
    the embedding tables' rows."""

    def __init__(self) -> None:
        self.layers: list[int] = []
        self.kv_shapes: set[tuple[int, int]] = set()    # (n_kv_heads, head_dim) of every attention
        self.vocab_rows: set[int] = set()


# ------------------------------------------------------------------------------------------------
# weights and activations


def _check_sections(g: Graph, c: Container) -> None:
    """Every stored array of every weight is a section of exactly the bytes its shape needs."""
    for w in g.weights:
        if not w.shape:
            raise _Invalid(f"weight @{w.name} has no dimensions")
        for arr, (dt, shape) in get_format(w.fmt).array_shapes(w.shape, w.group_size or 32).items():
            name = section_name(w.name, arr)
            if name not in c:
                raise _Invalid(f"weight @{w.name}: no section {name!r} in {os.path.basename(str(c.path))}")
            need = dt.itemsize * math.prod(shape)
            have = c.info(name).length
            if have != need:
                raise _Invalid(f"weight @{w.name} {w.fmt}{list(w.shape)} needs {need} bytes in section {name!r}, "
                               f"which holds {have}")


def _width(g: Graph, nid: int) -> int:
    return g.node(nid).type.shape[-1]


def _check_activations(g: Graph) -> None:
    for n in g.nodes:
        t = n.type
        if n.op is Op.INPUT_IDS:
            if t.dtype is not DType.I64 or t.shape != ("B", "T"):
                raise _Invalid(f"%{n.id}: token ids of type {t}, expected i64[B,T]")
            continue
        C = t.shape[-1] if t.shape else None
        if t.dtype is not DType.F32 or len(t.shape) != 3 or t.shape[:2] != ("B", "T") \
                or not isinstance(C, int) or not 1 <= C <= MAX_DIM:
            raise _Invalid(f"%{n.id} ({n.op.value}): activation of type {t}, expected f32[B,T,C] "
                           f"with C in 1..{MAX_DIM}")
        for a in n.args:
            if g.node(a).op is Op.INPUT_IDS and n.op is not Op.EMBED:
                raise _Invalid(f"%{n.id} ({n.op.value}) reads the token ids; only embed does")


# ------------------------------------------------------------------------------------------------
# ops


def _shape(g: Graph, name: str | None) -> tuple[int, ...] | None:
    return None if name is None else g.weight(name).shape


def _need(cond: bool, n: Node, what: str) -> None:
    if not cond:
        raise _Invalid(f"%{n.id} ({n.op.value}): {what}")


def _check_node(g: Graph, n: Node, facts: _Facts) -> None:
    _need(n.backend in BACKENDS, n, f"backend {n.backend!r} is not one of {', '.join(BACKENDS)}")
    _need(isinstance(n.device, str) and _DEVICE.fullmatch(n.device) is not None, n,
          f"device {n.device[:20]!r} is not cpu, gpu or gpu:N")
    if n.op is Op.INPUT_IDS:
        return
    C = n.type.shape[-1]
    ins = [_width(g, a) for a in n.args]
    if n.op is Op.EMBED:
        _need(g.node(n.args[0]).op is Op.INPUT_IDS, n, "its operand is not the token ids")
        facts.vocab_rows.add(_shape(g, n.weight("table"))[0])
    elif n.op in _SAME_WIDTH:
        _need(ins[0] == C, n, f"result width {C} differs from its input's {ins[0]}")
    if n.op is Op.RMS_NORM:
        group = n.attr("group", 0)
        _need(not group or C % group == 0, n, f"width {C} is not a whole number of groups of {group}")
        _need(_shape(g, n.weight("w")) == ((group or C),), n,
              f"norm weight {list(_shape(g, n.weight('w')))} does not match width {group or C}")
    elif n.op in (Op.LINEAR, Op.MATMUL):
        _check_linear(g, n, C, ins)
    elif n.op is Op.FUSED_ATTENTION:
        _check_attention(g, n, C, ins, facts)
    elif n.op is Op.SDPA:
        H, KV, hd = n.attr("n_heads"), n.attr("n_kv_heads"), n.attr("head_dim")
        _need(H % KV == 0, n, f"{H} heads are not a multiple of {KV} kv heads")
        _need(ins == [H * hd, KV * hd, KV * hd] and C == H * hd, n,
              f"widths {ins} -> {C} do not fit {H} heads, {KV} kv heads of {hd}")
        facts.layers.append(n.attr("layer"))
        facts.kv_shapes.add((KV, hd))
    elif n.op is Op.ROPE:
        hd = n.attr("head_dim")
        _need(hd % 2 == 0 and C % hd == 0, n, f"width {C} is not whole heads of an even size {hd}")
        _check_rope(n, hd)
    elif n.op is Op.MOE_FFN:
        _check_moe(g, n, C, ins)
    elif n.op in (Op.ROUTE, Op.TOPK_MASK):
        _need(n.attr("k") <= C, n, f"top-k {n.attr('k')} of {C} experts")
    elif n.op is Op.SLICE:
        start, stop = n.attr("start"), n.attr("stop")
        _need(start < stop <= ins[0] and C == stop - start, n,
              f"slice [{start}, {stop}) of width {ins[0]} into width {C}")
    elif n.op in (Op.ADD, Op.MUL):
        _need(C == max(ins), n, f"result width {C} for operands of widths {ins}")


def _check_linear(g: Graph, n: Node, C: int, ins: list[int]) -> None:
    """Width and weights (verify checked w against the input and the result)."""
    N, K = _shape(g, n.weight("w"))
    b = _shape(g, n.weight("b"))
    _need(b is None or b == (N,), n, f"bias {list(b or ())} for {N} output rows")
    prologue = n.attr("prologue", "none")
    norm = _shape(g, n.weight("norm"))
    _need((norm is not None) == (prologue == "rms_norm"), n, "a norm weight goes with prologue=\"rms_norm\" only")
    _need(norm is None or (norm == (K,) and n.has_attr("eps")), n, f"norm weight {list(norm or ())} for width {K}")
    _need(n.attr("epilogue", "none") != "silu_mul" or N % 2 == 0, n, f"silu_mul of an odd {N} rows")
    _need(len(ins) == 1 or ins[1] == C, n, f"residual of width {ins[-1]} for a result of width {C}")


def _check_attention(g: Graph, n: Node, C: int, ins: list[int], facts: _Facts) -> None:
    H, KV, hd = n.attr("n_heads"), n.attr("n_kv_heads"), n.attr("head_dim")
    _need(hd % 2 == 0, n, f"head_dim {hd} is odd (RoPE rotates halves)")
    _need(H % KV == 0, n, f"{H} heads are not a multiple of {KV} kv heads")
    _need(ins[0] == (H + 2 * KV) * hd, n, f"input width {ins[0]} is not (n_heads {H} + 2 x n_kv_heads {KV}) x "
                                          f"head_dim {hd} = {(H + 2 * KV) * hd}")
    _need(C == H * hd, n, f"result width {C} is not n_heads {H} x head_dim {hd}")
    mode = n.attr("qk_norm")
    _need(mode == "none" or n.has_attr("eps"), n, f"qk_norm={mode!r} without its eps")
    want = {"none": (None, None), "head": ((hd,), (hd,)), "full": ((H * hd,), (KV * hd,))}[mode]
    got = (_shape(g, n.weight("q_norm")), _shape(g, n.weight("k_norm")))
    _need(got == want, n, f"q/k norm weights {[list(s) if s else None for s in got]} for qk_norm={mode!r} "
                          f"(expected {[list(s) if s else None for s in want]})")
    _check_rope(n, hd)
    facts.layers.append(n.attr("layer"))
    facts.kv_shapes.add((KV, hd))


def _check_rope(n: Node, hd: int) -> None:
    """The rotary frequencies of the node's attributes are finite and positive."""
    attrs = dict(n.attrs)
    try:
        with np.errstate(all="raise"):
            inv = rope_inv_freq(hd, attrs)
        ok = bool(np.isfinite(inv).all() and (inv > 0).all())
    except (KeyError, FloatingPointError, ZeroDivisionError, OverflowError):
        ok = False
    _need(ok, n, f"rope attributes {sorted(k for k in attrs if k.startswith('rope'))} give no finite frequencies")


def _check_moe(g: Graph, n: Node, C: int, ins: list[int]) -> None:
    """x [D], routing [E], stacked experts gate_up [E', 2I, D] (or gate, up [E', I, D]), down [E', D, I]
    (verify checked E' against the routing and the expert ids)."""
    D = ins[0]
    _need(C == D and (len(ins) == 2 or ins[2] == D), n, f"widths {ins} -> {C}: x, result and residual differ")
    down = _shape(g, n.weight("down"))
    _need(down[1] == D, n, f"down {list(down)} does not give width {D}")
    I = down[2]
    if n.weight("gate_up") is not None:
        ups = [(_shape(g, n.weight("gate_up")), 2 * I)]
    else:
        ups = [(_shape(g, n.weight("gate")), I), (_shape(g, n.weight("up")), I)]
    for shape, rows in ups:
        _need(shape == (down[0], rows, D), n, f"experts {list(shape)} do not fit down {list(down)} "
                                              f"(expected {[down[0], rows, D]})")
    prior = n.attr("prior", ())
    _need(not prior or len(prior) == down[0], n, f"{len(prior)} prior shares for {down[0]} experts")


# ------------------------------------------------------------------------------------------------
# buffers, metadata


def _check_buffers(g: Graph) -> None:
    """plan-memory's assignment: one size per buffer, and no result written over a value still to
    be read (its own operands included)."""
    last = g.last_use()
    size: dict[int, int] = {}
    holder: dict[int, int] = {}      # buffer -> the value in it
    for i, n in enumerate(g.nodes):
        b = n.buffer
        _need(0 <= b < len(g.nodes), n, f"buffer %b{b} is not one of the plan's {len(g.nodes)} at most")
        _need(size.setdefault(b, n.type.bytes_per_token()) == n.type.bytes_per_token(), n,
              f"buffer %b{b} holds values of different sizes")
        h = holder.get(b)
        _need(h is None or last[h] < i, n, f"writes buffer %b{b} while %{h} in it is still to be read")
        holder[b] = n.id


def _check_model_meta(m: object, g: Graph, facts: _Facts) -> None:
    if not isinstance(m, dict):
        raise _Invalid("metadata has no model section")
    layers = sorted(facts.layers)
    if m["n_layers"] != len(layers) or layers != list(range(len(layers))):
        raise _Invalid(f"meta.model.n_layers is {m['n_layers']} and the attention layers are numbered "
                       f"{_few(facts.layers)}; expected each of 0..n_layers-1 exactly once")
    if facts.kv_shapes and facts.kv_shapes != {(m["n_kv_heads"], m["head_dim"])}:
        raise _Invalid(f"meta.model n_kv_heads={m['n_kv_heads']}, head_dim={m['head_dim']}, but the attention "
                       f"layers have (kv heads, head size) {sorted(facts.kv_shapes)}")
    if not facts.vocab_rows:
        raise _Invalid("the graph has no embedding")
    if facts.vocab_rows != {m["vocab_size"]}:
        raise _Invalid(f"meta.model.vocab_size is {m['vocab_size']} but the embedding table has "
                       f"{sorted(facts.vocab_rows)} rows")
    if not g.outputs or _width(g, g.outputs[0]) != m["vocab_size"]:
        raise _Invalid(f"the logits' width is not meta.model.vocab_size {m['vocab_size']}")
    for key in ("max_position", "bos_token_id"):
        v = m.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 40):
            raise _Invalid(f"meta.model.{key} is {str(v)[:20]!r}, expected a non-negative integer")
    eos = m.get("eos_token_ids", [])
    if not isinstance(eos, list) or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos):
        raise _Invalid("meta.model.eos_token_ids is not a list of token ids")
    placement = m.get("placement")
    if placement is not None:
        try:
            p = json.loads(placement)
            ok = isinstance(p, dict) and isinstance(p.get("disk_units", []), list) \
                and all(isinstance(u, str) for u in p.get("disk_units", []))
        except (TypeError, ValueError, RecursionError):
            ok = False
        if not ok:
            raise _Invalid("meta.model.placement is not a placement record")


def _check_sampling_meta(s: object) -> None:
    """The sampling defaults every request starts from: known keys, types and bounds."""
    try:
        from_meta(s)
    except ValueError as e:
        raise _Invalid(str(e)) from None


def _check_graph_meta(g: Graph) -> None:
    """The runtime-only IR meta (weights left in host memory) is never part of a plan; expert
    caches have exactly one host share each."""
    if any(k == IN_PLACE for k, _ in g.meta):
        raise _Invalid(f"IR meta {IN_PLACE!r} is set by the runtime, never by a plan")
    whole: dict[str, int] = {}
    shares: set[str] = set()
    for n in g.nodes:
        key = n.attr("cache", "") if n.op is Op.MOE_FFN else ""
        if key and n.attr("experts", ()):
            shares.add(key)
        elif key:
            whole[key] = whole.get(key, 0) + 1
    bad = sorted(k for k in shares | set(whole) if whole.get(k) != 1)
    if bad:
        raise _Invalid(f"expert cache {bad[0][:40]!r} does not have exactly one host share")


def _few(values: list[int]) -> str:
    vs = sorted(values)
    return str(vs) if len(vs) <= 8 else f"[{', '.join(map(str, vs[:8]))}, ...] ({len(vs)} layers)"
