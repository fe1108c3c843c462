"""Per-level IR verifier, run after every pass that changed the graph.

Checks structure (unique ids, operands defined before use, outputs exist), that each op is
legal at the graph's level with the operands, weight roles and attributes it needs, that weight
shapes agree with the activations they touch, and at kernel level that every node is bound to a
device, a backend and a buffer. Failures raise IRError with the IR around the failing node.

Plans are untrusted input (their IR text is parsed at load), so before anything computes with
them every weight declaration and every known attribute is checked for its type and range
(`_check_weight`, `ATTR_KINDS`): an attribute that reaches generated kernel code, an allocation
or an index is an int, a finite float, a bool or one of a few words, never whatever the text
held. The runtime's facts-against-weights step is runtime/validate.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import IRError, UsageError
from .ir import LEVEL_OPS, DType, Graph, Level, Node, Op, WeightSpec


@dataclass(frozen=True)
class Signature:
    nargs: tuple[int, ...]                 # allowed operand counts
    roles: frozenset[str] = frozenset()    # required weight roles
    optional: frozenset[str] = frozenset() # optional weight roles
    attrs: frozenset[str] = frozenset()    # required attributes


def _sig(nargs, roles=(), optional=(), attrs=()) -> Signature:
    return Signature(tuple(nargs), frozenset(roles), frozenset(optional), frozenset(attrs))


_ATTN_ATTRS = ("layer", "n_heads", "n_kv_heads", "head_dim", "rope_theta", "rope_type")
SIGNATURES: dict[Op, Signature] = {
    Op.INPUT_IDS: _sig([0]),
    Op.EMBED: _sig([1], ["table"]),
    Op.RMS_NORM: _sig([1], ["w"], attrs=["eps"]),
    Op.ATTENTION: _sig([1], ["q", "k", "v", "o"], ["bq", "bk", "bv", "bo", "q_norm", "k_norm"], _ATTN_ATTRS + ("qk_norm",)),
    Op.MLP: _sig([1], ["gate", "up", "down"]),
    Op.MOE: _sig([1], ["router", "gate", "up", "down"],
                 ["shared_gate", "shared_up", "shared_down", "shared_expert_gate"], ["top_k", "norm_topk_prob"]),
    Op.ADD: _sig([2]),
    Op.MATMUL: _sig([1], ["w"], ["b"]),
    Op.MUL: _sig([2]),
    Op.SILU: _sig([1]),
    Op.SIGMOID: _sig([1]),
    Op.SLICE: _sig([1], attrs=["start", "stop"]),
    Op.CLAMP: _sig([1], attrs=["limit"]),
    Op.ROPE: _sig([1], attrs=["head_dim", "rope_theta", "rope_type"]),
    Op.SDPA: _sig([3], attrs=["layer", "n_heads", "n_kv_heads", "head_dim"]),
    Op.SOFTMAX: _sig([1]),
    Op.TOPK_MASK: _sig([1], attrs=["k"]),
    Op.RENORM: _sig([1]),
    Op.MOE_FFN: _sig([2, 3], ["down"], ["gate", "up", "gate_up"]),
    Op.LINEAR: _sig([1, 2], ["w"], ["b", "norm"]),
    Op.ROUTE: _sig([1], attrs=["k", "norm"]),
    Op.FUSED_ATTENTION: _sig([1], optional=["q_norm", "k_norm"], attrs=_ATTN_ATTRS + ("qk_norm",)),
    Op.TRANSFER: _sig([1]),
}


MAX_DIM = 1 << 26        # any weight or activation dimension (the largest vocabularies are ~2**18)
MAX_HEADS = 1 << 12      # heads of an attention layer
MAX_HEAD_DIM = 1 << 12   # values per head
MAX_LAYER = 1 << 16      # attention layers of a model
MAX_EXPERTS = 1 << 16    # experts of a MoE layer
_F32_MAX = 3.4028234663852886e38
ROPE_TYPES = ("default", "linear", "llama3")
MAX_GROUP = 4096         # a grouped format's group size: 2..4096, a multiple of formats.GROUP_MULTIPLE's


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) <= _F32_MAX


def _int_in(lo: int, hi: int):
    return lambda v: _is_int(v) and lo <= v <= hi, f"an integer in {lo}..{hi}"


def _num_at_least(lo: float, strict: bool = False):
    ok = (lambda v: _is_num(v) and v > lo) if strict else (lambda v: _is_num(v) and v >= lo)
    return ok, f"a finite number {'>' if strict else '>='} {lo:g}"


def _one_of(*words: str):
    return lambda v: isinstance(v, str) and v in words, "one of " + ", ".join(repr(w) for w in words)


def _int_tuple(lo: int, hi: int):
    return (lambda v: isinstance(v, tuple) and all(_is_int(x) and lo <= x <= hi for x in v),
            f"a list of integers in {lo}..{hi}")


#: attribute -> (check, what it must be): the attributes kernels, allocations and indexing read
ATTR_KINDS: dict[str, tuple] = {
    "layer": _int_in(0, MAX_LAYER - 1),
    "n_heads": _int_in(1, MAX_HEADS),
    "n_kv_heads": _int_in(1, MAX_HEADS),
    "head_dim": _int_in(1, MAX_HEAD_DIM),
    "k": _int_in(1, MAX_EXPERTS),
    "top_k": _int_in(1, MAX_EXPERTS),
    "n_experts": _int_in(1, MAX_EXPERTS),
    "start": _int_in(0, MAX_DIM),
    "stop": _int_in(1, MAX_DIM),
    "group": _int_in(1, MAX_DIM),
    "eps": _num_at_least(0.0),
    "limit": _num_at_least(0.0),
    "clip_qkv": _num_at_least(0.0),
    "rope_theta": _num_at_least(0.0, strict=True),
    "rope_factor": _num_at_least(0.0, strict=True),
    "rope_low_freq_factor": _num_at_least(0.0, strict=True),
    "rope_high_freq_factor": _num_at_least(0.0, strict=True),
    "rope_original_max": _num_at_least(0.0, strict=True),
    "rope_type": _one_of(*ROPE_TYPES),
    "qk_norm": _one_of("none", "head", "full"),
    "prologue": _one_of("none", "rms_norm"),
    "epilogue": _one_of("none", "silu_mul"),
    "norm": (lambda v: isinstance(v, bool), "true or false"),
    "norm_topk_prob": (lambda v: isinstance(v, bool), "true or false"),
    "experts": _int_tuple(0, MAX_EXPERTS - 1),
    "prior": (lambda v: isinstance(v, tuple) and all(_is_num(x) for x in v), "a list of finite numbers"),
    "cache": (lambda v: isinstance(v, str), "a string"),
}


def group_size_problem(fmt: str, group_size: object) -> str | None:
    """Why `group_size` cannot be the group size of weights stored as `fmt` (None: it can)."""
    from .formats import FORMATS, GROUP_MULTIPLE

    f = FORMATS.get(fmt)
    if f is None:
        return f"unknown weight format {fmt!r} (known: {', '.join(FORMATS)})"
    if not _is_int(group_size):
        return f"group size {group_size!r} is not an integer"
    if not f.grouped:
        return None if group_size == 0 else f"format {fmt} takes no group size (got {group_size})"
    mult = GROUP_MULTIPLE.get(fmt, 2)
    if not (2 <= group_size <= MAX_GROUP and group_size % mult == 0):
        return f"format {fmt} needs a group size that is a multiple of {mult} in 2..{MAX_GROUP} (got {group_size})"
    return None


def _check_weight(w: WeightSpec) -> str | None:
    """Why weight declaration `w` is unusable (None: it is sound): concrete dimensions in range,
    a known format with a group size it can take, expert stacks that agree with their shape."""
    if not (len(w.shape) <= 3 and all(_is_int(d) and 1 <= d <= MAX_DIM for d in w.shape)):
        return f"shape {list(w.shape)}: expected at most 3 dimensions, each in 1..{MAX_DIM}"
    why = group_size_problem(w.fmt, w.group_size)
    if why:
        return why
    if not _is_int(w.experts) or w.experts < 0:
        return f"experts[{w.experts}] is not a count"
    if w.experts and (len(w.shape) != 3 or w.shape[0] != w.experts):
        return f"experts[{w.experts}] but shape {list(w.shape)}: expected stacked experts [{w.experts}, N, K]"
    if w.expert_ids and (len(w.expert_ids) != w.experts or len(set(w.expert_ids)) != len(w.expert_ids)
                         or not all(_is_int(e) and 0 <= e < MAX_EXPERTS for e in w.expert_ids)):
        return f"expert ids {list(w.expert_ids)[:8]}: expected {w.experts} distinct ids"
    return None


def check_token_ids(ids, rows: int, table: str) -> None:
    """Token ids (an integer array) against the embedding table's real row count `rows`: every
    backend calls it before it gathers rows, so an id past the table never reads memory beyond
    it (a UsageError naming the id and the table)."""
    if ids.size == 0:
        return
    if ids.dtype.kind not in "iu":
        raise UsageError(f"token ids of dtype {ids.dtype}: expected integers")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= rows:
        bad = lo if lo < 0 else hi
        raise UsageError(f"token id {bad} is outside the vocabulary [0, {rows}) of the embedding table @{table}")


def ir_window(g: Graph, idx: int, radius: int = 3) -> str:
    """The printed IR lines around the node at position `idx`, the failing one marked '>>'."""
    from .ir_text import print_graph

    lines = [ln for ln in print_graph(g).splitlines() if ln.startswith("%")]
    lo, hi = max(0, idx - radius), min(len(lines), idx + radius + 1)
    return "\n".join(("  >> " if i == idx else "     ") + lines[i] for i in range(lo, hi))


class _Fail(Exception):
    def __init__(self, nid: int, msg: str) -> None:
        self.nid, self.msg = nid, msg
        self.pos = -1   # position in g.nodes, filled in by verify()


def _check_node(g: Graph, n: Node, seen: set[int]) -> None:
    if n.op not in LEVEL_OPS[g.level]:
        raise _Fail(n.id, f"op {n.op.value!r} is not legal at level {g.level.value}")
    sig = SIGNATURES[n.op]
    if len(n.args) not in sig.nargs:
        raise _Fail(n.id, f"{n.op.value} takes {' or '.join(map(str, sig.nargs))} operands, got {len(n.args)}")
    for a in n.args:
        if a not in seen:
            raise _Fail(n.id, f"operand %{a} is not defined before use")
    roles = [r for r, _ in n.weights]
    if len(set(roles)) != len(roles):
        raise _Fail(n.id, "a weight role appears twice")
    missing = sig.roles - set(roles)
    if missing:
        raise _Fail(n.id, f"{n.op.value} needs weight role(s) {sorted(missing)}")
    extra = set(roles) - sig.roles - sig.optional
    if extra:
        raise _Fail(n.id, f"{n.op.value} takes no weight role(s) {sorted(extra)}")
    for _, w in n.weights:
        if not g.has_weight(w):
            raise _Fail(n.id, f"weight @{w} is not declared")
    keys = {k for k, _ in n.attrs}
    if list(k for k, _ in n.attrs) != sorted(keys) or len(keys) != len(n.attrs):
        raise _Fail(n.id, "attributes must be unique and sorted")
    if not sig.attrs <= keys:
        raise _Fail(n.id, f"{n.op.value} needs attribute(s) {sorted(sig.attrs - keys)}")
    for k, v in n.attrs:
        kind = ATTR_KINDS.get(k)
        if kind is not None and not kind[0](v):
            raise _Fail(n.id, f"{n.op.value} attribute {k}={_short(v)}: expected {kind[1]}")
    if n.op is Op.MOE_FFN and not ({"gate", "up"} <= set(roles)) ^ ("gate_up" in roles):
        raise _Fail(n.id, "moe_ffn takes either gate+up or gate_up")
    _check_shapes(g, n)
    if g.level is Level.KERNEL:
        if not n.device or not n.backend:
            raise _Fail(n.id, "kernel-level node without a device and backend")
        if n.buffer < 0:
            raise _Fail(n.id, "kernel-level node without a buffer (run plan-memory)")


def _last(g: Graph, nid: int):
    shape = g.node(nid).type.shape
    if not shape:
        raise _Fail(nid, "an activation of rank 0 (expected [B, T, ...])")
    return shape[-1]


def _check_shapes(g: Graph, n: Node) -> None:
    if n.op is Op.INPUT_IDS:
        if n.type.dtype is not DType.I64:
            raise _Fail(n.id, "input_ids must be i64")
        return
    if n.type.dtype is not DType.F32:
        raise _Fail(n.id, "activations are f32")
    if not n.type.shape:
        raise _Fail(n.id, "an activation of rank 0 (expected [B, T, ...])")
    if n.op in (Op.MATMUL, Op.LINEAR):
        w = g.weight(n.weight("w"))
        k_in = _last(g, n.args[0])
        if len(w.shape) != 2 or w.shape[1] != k_in:
            raise _Fail(n.id, f"weight @{w.name} {list(w.shape)} does not take an input of width {k_in}")
        out = w.shape[0] // 2 if n.attr("epilogue", "none") == "silu_mul" else w.shape[0]
        if n.type.shape[-1] != out:
            raise _Fail(n.id, f"result width {n.type.shape[-1]} != {out} from @{w.name}")
    if n.op in (Op.ADD, Op.MUL):
        a, b = (g.node(x).type.shape for x in n.args)
        # MUL broadcasts a [..., 1] gate (Qwen2-MoE's shared-expert gate) over the last axis.
        if a != b and not (n.op is Op.MUL and a[:-1] == b[:-1] and 1 in (a[-1], b[-1])):
            raise _Fail(n.id, f"operand shapes differ: {a} vs {b}")
    if n.op is Op.MOE_FFN:
        E = _last(g, n.args[1])
        ids = tuple(n.attr("experts", ()))
        for role, name in n.weights:
            w = g.weight(name)
            if tuple(w.expert_ids) != ids:
                raise _Fail(n.id, f"@{name} holds experts {list(w.expert_ids) or 'all'}, the node computes "
                                  f"{list(ids) or 'all'}")
            if len(w.shape) != 3:
                raise _Fail(n.id, f"@{name} {list(w.shape)}: expected stacked experts [E, N, K]")
            if w.shape[0] != (len(ids) if ids else E):
                raise _Fail(n.id, f"@{name} stacks {w.shape[0]} experts; the router gives {E}")
        if ids and (len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= E):
            raise _Fail(n.id, f"experts {list(ids)}: expected distinct ids below {E}")
    if n.op is Op.EMBED:
        w = g.weight(n.weight("table"))
        if len(w.shape) != 2:
            raise _Fail(n.id, f"embedding table @{w.name} {list(w.shape)}: expected [vocab, width]")
        if n.type.shape[-1] != w.shape[1]:
            raise _Fail(n.id, "embedding width mismatch")


def _short(v: object) -> str:
    """An attribute value for a one-line message: repr, control characters escaped, at most 40 characters."""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def verify(g: Graph) -> None:
    seen: set[int] = set()
    pos = 0
    for w in g.weights:
        why = _check_weight(w)
        if why:
            raise IRError(f"{g.level.value} IR invalid: weight @{w.name}: {why}")
    try:
        for pos, n in enumerate(g.nodes):
            if n.id in seen:
                raise _Fail(n.id, f"duplicate id %{n.id}")
            _check_node(g, n, seen)
            seen.add(n.id)
        pos = len(g.nodes) - 1
        for o in g.outputs:
            if o not in seen:
                raise _Fail(g.nodes[-1].id if g.nodes else 0, f"output %{o} is not defined")
        names = [w.name for w in g.weights]
        if len(set(names)) != len(names):
            pos = 0
            raise _Fail(g.nodes[0].id if g.nodes else 0, "duplicate weight names")
    except _Fail as f:
        raise IRError(f"{g.level.value} IR invalid at %{f.nid}: {f.msg}\n{ir_window(g, pos)}") from None
