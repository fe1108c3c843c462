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
from .untrusted import load_json, printable

# Limits on IR text, checked before any other work on a line (a plan's IR is untrusted input).
# Every pattern below is matched once per line and cannot backtrack more than linearly, so
# parsing is linear in the text; numbers are bounded in digits before int() sees them.
MAX_TEXT = 16 << 20           # characters of IR text (a 1T-parameter MoE prints ~2 MB)
MAX_LINES = 1 << 17           # lines (such a model prints ~10^4)
MAX_ITEMS = 1024              # operands or attributes of one line
MAX_SYMBOLS = 1 << 16         # brackets and commas (outside strings) on one line
MAX_LINE = 4 << 20            # characters on one line (meta carries the placement: ~0.3 MB at 61x256 experts)
MAX_NESTING = 32              # brackets inside one attribute value
MAX_RANK = 16                 # dimensions of a type
_INT = r"[0-9]{1,9}"          # node ids, buffers, group sizes, expert counts and ids
_DIM = re.compile(r"[0-9]{1,15}|[A-Z][A-Za-z0-9_]{0,63}")

_NAME = r"[A-Za-z0-9_.\-]+"
_TYPE = r"(?P<dtype>[a-z0-9]{1,16})\[(?P<shape>[^\]]*)\]"
_WEIGHT_RE = re.compile(
    rf"weight @(?P<name>{_NAME}) {_TYPE} fmt=(?P<fmt>\w+) g=(?P<g>{_INT}) = "
    rf"(?:experts\[(?P<experts>{_INT})\](?:\{{(?P<ids>{_INT}(?:,{_INT})*)\}})?)?\(")
_NODE_HEAD_RE = re.compile(rf"%(?P<id>{_INT}) = (?P<op>\w+)\((?P<args>[^)]*)\)")
_NODE_TAIL_RE = re.compile(
    rf" : {_TYPE}(?: @(?P<device>[\w:]+))?(?: (?P<backend>[a-z_]+))?(?: -> %b(?P<buffer>{_INT}))?")
_OPERAND_RE = re.compile(rf"%({_INT})|(\w+)=@({_NAME})")
_PLAIN = re.compile(r'[^"\[\]{},]*')
_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)   # one way to match each character: linear


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


def _scan(s: str, where: str) -> tuple[list[int], int]:
    """One pass over `s`: the positions of its commas outside brackets and JSON strings, and the
    index of the first closing bracket that closes nothing (len(s) if none), i.e. where the text
    at depth 0 ends. Runs of plain characters and string bodies are skipped by regex (C speed);
    more than MAX_SYMBOLS brackets and commas, or nesting deeper than MAX_NESTING, is an IRError."""
    commas, depth, i, n, symbols = [], 0, 0, len(s), 0
    while True:
        i = _PLAIN.match(s, i).end()
        if i >= n:
            return commas, n
        c = s[i]
        if c == '"':
            i = _STRING_BODY.match(s, i + 1).end()
            if i >= n or s[i] != '"':   # unterminated (or ends in a lone backslash)
                return commas, n
            i += 1
            continue
        symbols += 1
        if symbols > MAX_SYMBOLS:
            raise IRError(f"{where}: more than {MAX_SYMBOLS} brackets and commas on one line")
        if c in "[{":
            depth += 1
            if depth > MAX_NESTING:
                raise IRError(f"{where}: brackets nested deeper than {MAX_NESTING} levels")
        elif c in "]}":
            if depth == 0:
                return commas, i
            depth -= 1
        elif depth == 0:   # a comma
            commas.append(i)
        i += 1


def _split_top(s: str, where: str) -> list[str]:
    """Split on commas that are not inside brackets or JSON strings."""
    commas, end = _scan(s, where)
    if end != len(s):
        raise IRError(f"{where}: unbalanced {s[end]!r}")
    if len(commas) >= MAX_ITEMS:
        raise IRError(f"{where}: {len(commas) + 1} operands or attributes (at most {MAX_ITEMS})")
    bounds = [-1, *commas, len(s)]
    parts = [s[a + 1:b].strip() for a, b in zip(bounds, bounds[1:])]
    return [] if parts == [""] else parts


def _to_attr(v: object) -> Attr:
    if isinstance(v, list):
        return tuple(_to_attr(x) for x in v)
    if isinstance(v, (int, float, str, bool)):
        return v
    raise ValueError(f"unsupported attribute value {v!r}"[:200])


def _parse_attrs(s: str, where: str) -> tuple[tuple[str, Attr], ...]:
    out = []
    for part in _split_top(s, where):
        key, eq, raw = part.partition("=")
        if not eq or not re.fullmatch(r"\w{1,64}", key.strip()):
            raise IRError(f"{where}: bad attribute {printable(part, 120)!r} (expected key=value)")
        try:
            out.append((key.strip(), _to_attr(load_json(raw, max_depth=MAX_NESTING, allow_nonfinite=True))))
        except ValueError as e:
            raise IRError(f"{where}: bad value for attribute {key.strip()!r}: {printable(str(e), 200)}") from None
    return tuple(out)


def _parse_type(dtype: str, shape: str, where: str) -> TensorType:
    try:
        dt = DType(dtype)
    except ValueError:
        raise IRError(f"{where}: unknown dtype {dtype!r}") from None
    parts = shape.split(",") if shape else []
    if len(parts) > MAX_RANK:
        raise IRError(f"{where}: type of rank {len(parts)} (at most {MAX_RANK})")
    for d in parts:
        if not _DIM.fullmatch(d):
            raise IRError(f"{where}: bad dimension {printable(d, 40)!r}")
    return TensorType(dt, tuple(int(d) if d[0].isdigit() else d for d in parts))


def _parse_weight(line: str, where: str) -> WeightSpec:
    m = _WEIGHT_RE.match(line)
    if not m or not line.endswith(")"):
        raise IRError(f"{where}: malformed weight declaration: {printable(line, 120)}")
    t = _parse_type(m["dtype"], m["shape"], where)
    try:
        sources = load_json("[" + line[m.end():-1] + "]", max_depth=2)
    except ValueError:
        raise IRError(f"{where}: malformed weight sources") from None
    if not all(isinstance(s, str) for s in sources) or any(isinstance(d, str) for d in t.shape):
        raise IRError(f"{where}: weight sources must be strings and shapes concrete")
    ids = tuple(int(i) for i in m["ids"].split(",")) if m["ids"] else ()
    if ids and len(ids) != int(m["experts"]):
        raise IRError(f"{where}: weight @{m['name']}: {len(ids)} expert ids for experts[{m['experts']}]")
    return WeightSpec(m["name"], t.shape, tuple(sources), int(m["experts"] or 0), m["fmt"], int(m["g"]), ids)


def _parse_node(line: str, where: str) -> Node:
    head = _NODE_HEAD_RE.match(line)
    rest = line[head.end():] if head else ""
    attrs: tuple = ()
    if head and rest.startswith(" {"):
        _, end = _scan(rest[2:], where)   # the brace closing the attributes (strings may hold braces)
        if 2 + end < len(rest) and rest[2 + end] == "}":
            attrs = _parse_attrs(rest[2:2 + end], where)
            rest = rest[3 + end:]
    tail = _NODE_TAIL_RE.fullmatch(rest) if head else None
    if not tail:
        raise IRError(f"{where}: malformed node: {printable(line, 120)}")
    try:
        op = Op(head["op"])
    except ValueError:
        raise IRError(f"{where}: unknown op {printable(head['op'], 60)!r}") from None
    args, ws = [], []
    for a in _split_top(head["args"], where):
        om = _OPERAND_RE.fullmatch(a)
        if not om:
            raise IRError(f"{where}: bad operand {printable(a, 120)!r}")
        if om[1] is not None:
            args.append(int(om[1]))
        else:
            ws.append((om[2], om[3]))
    return Node(int(head["id"]), op, tuple(args), _parse_type(tail["dtype"], tail["shape"], where), tuple(ws), attrs,
                tail["device"] or "", tail["backend"] or "", int(tail["buffer"]) if tail["buffer"] else -1)


def _check_size(text: str, source: str) -> None:
    """The limits on the whole text, before it is split into lines."""
    if len(text) > MAX_TEXT:
        raise IRError(f"{source}: IR text of {len(text)} characters (at most {MAX_TEXT})")
    breaks = sum(map(text.count, "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"))   # what splitlines splits on
    if breaks >= MAX_LINES:
        raise IRError(f"{source}: IR text of {breaks + 1} lines (at most {MAX_LINES})")


def parse_graph(text: str, source: str = "<ir>") -> Graph:
    """The Graph `text` describes; IRError naming the line for anything malformed or over a limit."""
    source = printable(source)
    _check_size(text, source)
    lines = [(i, ln) for i, ln in enumerate(text.splitlines(), start=1)
             if ln.strip() and not ln.lstrip().startswith("#")]
    for lineno, line in lines:
        if len(line) > MAX_LINE:
            raise IRError(f"{source}: line {lineno}: {len(line)} characters long (at most {MAX_LINE})")
    if not lines or not lines[0][1].startswith("strata.ir level="):
        first = lines[0][0] if lines else 1
        raise IRError(f"{source}: line {first}: expected 'strata.ir level=graph|tensor|kernel'")
    try:
        level = Level(lines[0][1].split("=", 1)[1].strip())
    except ValueError:
        raise IRError(f"{source}: line {lines[0][0]}: unknown level "
                      f"{printable(lines[0][1].split('=', 1)[1], 60)!r}") from None
    meta: tuple = ()
    weights: list[WeightSpec] = []
    nodes: list[Node] = []
    outputs: tuple[int, ...] | None = None
    for lineno, line in lines[1:]:
        where = f"{source}: line {lineno}"
        if line.startswith("meta {") and line.endswith("}"):
            meta = _parse_attrs(line[6:-1], where)
        elif line.startswith("weight "):
            weights.append(_parse_weight(line, where))
        elif line.startswith("%"):
            nodes.append(_parse_node(line, where))
        elif line.startswith("return"):
            outs = [o.strip() for o in line[len("return"):].split(",") if o.strip()]
            if not all(re.fullmatch(rf"%{_INT}", o) for o in outs):
                raise IRError(f"{where}: malformed return")
            outputs = tuple(int(o[1:]) for o in outs)
        else:
            raise IRError(f"{where}: cannot parse: {printable(line, 120)}")
    if outputs is None:
        raise IRError(f"{source}: missing 'return' line")
    return Graph(level, tuple(nodes), tuple(weights), outputs, meta)
