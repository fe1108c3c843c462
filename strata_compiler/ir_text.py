"""Text form of the IR: `print_graph` writes it, `parse_graph` reads it back to an equal Graph.

    strata.ir level=tensor
    meta {arch="MixtralForCausalLM", n_layers=2}
    weight @L0.attn.qkv f32[128,64] fmt=int4 g=32 = ("model.layers.0.self_attn.q_proj.weight", ...)
    weight @L0.moe.gate_up f32[4,32,64] fmt=f32 g=0 = experts[4]("model.layers.0....{e}.w1.weight", ...)
    weight @L0.moe.down.g1 f32[2,64,32] fmt=int4 g=32 = experts[2]{5,7}("model.layers.0....{e}.w2.weight")
    %0 = input_ids() : i64[B,T]
    %5 = linear(%4, w=@L0.attn.qkv, norm=@L0.ln1) {eps=1e-05, prologue="rms_norm"} : f32[B,T,128] @cpu reference -> %b2
    return %42

Attribute values are JSON (lists read back as tuples); dumps double as test fixtures.
"""

from __future__ import annotations

import json
import re

from .errors import IRError
from .ir import Attr, DType, Graph, Level, Node, Op, TensorType, WeightSpec

_NAME = r"[A-Za-z0-9_.\-]+"
_TYPE = r"(?P<dtype>[a-z0-9]+)\[(?P<shape>[^\]]*)\]"
_WEIGHT_RE = re.compile(
    rf"^weight @(?P<name>{_NAME}) {_TYPE} fmt=(?P<fmt>\w+) g=(?P<g>\d+) = "
    rf"(?:experts\[(?P<experts>\d+)\](?:\{{(?P<ids>[\d,]+)\}})?)?\((?P<sources>.*)\)$")
_NODE_RE = re.compile(
    rf"^%(?P<id>\d+) = (?P<op>\w+)\((?P<args>[^)]*)\)(?: \{{(?P<attrs>.*)\}})? : {_TYPE}"
    rf"(?: @(?P<device>[\w:]+))?(?: (?P<backend>[a-z_]+))?(?: -> %b(?P<buffer>\d+))?$")


def _fmt_value(v: Attr) -> str:
    if isinstance(v, tuple):
        return "[" + ",".join(_fmt_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return json.dumps(v)   # repr, except inf/nan as JSON's Infinity/NaN, which parse back
    return json.dumps(v)


def _fmt_attrs(attrs: tuple[tuple[str, Attr], ...]) -> str:
    return ", ".join(f"{k}={_fmt_value(v)}" for k, v in attrs)


def print_graph(g: Graph) -> str:
    lines = [f"strata.ir level={g.level.value}"]
    if g.meta:
        lines.append(f"meta {{{_fmt_attrs(g.meta)}}}")
    for w in g.weights:
        src = ", ".join(json.dumps(s) for s in w.sources)
        ex = f"experts[{w.experts}]" if w.experts else ""
        if w.expert_ids:
            ex += "{" + ",".join(str(i) for i in w.expert_ids) + "}"
        shape = ",".join(str(d) for d in w.shape)
        lines.append(f"weight @{w.name} f32[{shape}] fmt={w.fmt} g={w.group_size} = {ex}({src})")
    for n in g.nodes:
        args = [f"%{a}" for a in n.args] + [f"{r}=@{w}" for r, w in n.weights]
        s = f"%{n.id} = {n.op.value}({', '.join(args)})"
        if n.attrs:
            s += f" {{{_fmt_attrs(n.attrs)}}}"
        s += f" : {n.type}"
        if n.device:
            s += f" @{n.device}"
        if n.backend:
            s += f" {n.backend}"
        if n.buffer >= 0:
            s += f" -> %b{n.buffer}"
        lines.append(s)
    lines.append("return " + ", ".join(f"%{o}" for o in g.outputs))
    return "\n".join(lines) + "\n"


def _split_top(s: str) -> list[str]:
    """Split on commas that are not inside brackets or JSON strings."""
    parts, depth, start, i, in_str = [], 0, 0, 0, False
    while i < len(s):
        c = s[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:i].strip())
            start = i + 1
        i += 1
    tail = s[start:].strip()
    if tail or parts:
        parts.append(tail)
    return parts


def _to_attr(v: object) -> Attr:
    if isinstance(v, list):
        return tuple(_to_attr(x) for x in v)
    if isinstance(v, (int, float, str, bool)):
        return v
    raise ValueError(f"unsupported attribute value {v!r}")


def _parse_attrs(s: str, where: str) -> tuple[tuple[str, Attr], ...]:
    out = []
    for part in _split_top(s):
        key, eq, raw = part.partition("=")
        if not eq or not re.fullmatch(r"\w+", key.strip()):
            raise IRError(f"{where}: bad attribute {part!r} (expected key=value)")
        try:
            out.append((key.strip(), _to_attr(json.loads(raw))))
        except (ValueError, RecursionError) as e:
            raise IRError(f"{where}: bad value for attribute {key.strip()!r}: {e}") from None
    return tuple(out)


def _parse_type(dtype: str, shape: str, where: str) -> TensorType:
    try:
        dt = DType(dtype)
    except ValueError:
        raise IRError(f"{where}: unknown dtype {dtype!r}") from None
    dims = tuple(int(d) if d.isdigit() else d for d in shape.split(",")) if shape else ()
    for d in dims:
        if isinstance(d, str) and not re.fullmatch(r"[A-Z]\w*", d):
            raise IRError(f"{where}: bad dimension {d!r}")
    return TensorType(dt, dims)


def parse_graph(text: str, source: str = "<ir>") -> Graph:
    lines = [(i, ln) for i, ln in enumerate(text.splitlines(), start=1)
             if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines or not lines[0][1].startswith("strata.ir level="):
        first = lines[0][0] if lines else 1
        raise IRError(f"{source}: line {first}: expected 'strata.ir level=graph|tensor|kernel'")
    try:
        level = Level(lines[0][1].split("=", 1)[1].strip())
    except ValueError:
        raise IRError(f"{source}: line {lines[0][0]}: unknown level {lines[0][1].split('=', 1)[1]!r}") from None
    meta: tuple = ()
    weights: list[WeightSpec] = []
    nodes: list[Node] = []
    outputs: tuple[int, ...] | None = None
    for lineno, line in lines[1:]:
        where = f"{source}: line {lineno}"
        if line.startswith("meta {") and line.endswith("}"):
            meta = _parse_attrs(line[6:-1], where)
        elif line.startswith("weight "):
            m = _WEIGHT_RE.match(line)
            if not m:
                raise IRError(f"{where}: malformed weight declaration: {line[:120]}")
            t = _parse_type(m["dtype"], m["shape"], where)
            try:
                sources = tuple(json.loads("[" + m["sources"] + "]"))
            except ValueError:
                raise IRError(f"{where}: malformed weight sources") from None
            if not all(isinstance(s, str) for s in sources) or any(isinstance(d, str) for d in t.shape):
                raise IRError(f"{where}: weight sources must be strings and shapes concrete")
            ids = tuple(int(i) for i in m["ids"].split(",")) if m["ids"] else ()
            if ids and len(ids) != int(m["experts"]):
                raise IRError(f"{where}: weight @{m['name']}: {len(ids)} expert ids for experts[{m['experts']}]")
            weights.append(WeightSpec(m["name"], t.shape, sources, int(m["experts"] or 0), m["fmt"], int(m["g"]),
                                      ids))
        elif line.startswith("%"):
            m = _NODE_RE.match(line)
            if not m:
                raise IRError(f"{where}: malformed node: {line[:120]}")
            try:
                op = Op(m["op"])
            except ValueError:
                raise IRError(f"{where}: unknown op {m['op']!r}") from None
            args, ws = [], []
            for a in _split_top(m["args"]):
                if re.fullmatch(r"%\d+", a):
                    args.append(int(a[1:]))
                elif re.fullmatch(rf"\w+=@{_NAME}", a):
                    role, name = a.split("=@", 1)
                    ws.append((role, name))
                else:
                    raise IRError(f"{where}: bad operand {a!r}")
            attrs = _parse_attrs(m["attrs"], where) if m["attrs"] else ()
            nodes.append(Node(int(m["id"]), op, tuple(args), _parse_type(m["dtype"], m["shape"], where),
                              tuple(ws), attrs, m["device"] or "", m["backend"] or "",
                              int(m["buffer"]) if m["buffer"] else -1))
        elif line.startswith("return"):
            outs = [o.strip() for o in line[len("return"):].split(",") if o.strip()]
            if not all(re.fullmatch(r"%\d+", o) for o in outs):
                raise IRError(f"{where}: malformed return")
            outputs = tuple(int(o[1:]) for o in outs)
        else:
            raise IRError(f"{where}: cannot parse: {line[:120]}")
    if outputs is None:
        raise IRError(f"{source}: missing 'return' line")
    return Graph(level, tuple(nodes), tuple(weights), outputs, meta)
