"""The layered IR: one small, immutable, typed node model shared by the three levels.

Levels (the strata):
  graph   model ops (attention, moe, mlp, rms_norm, ...), weights named by safetensors keys
  tensor  primitive tensor ops (matmul, rope, sdpa, route, ...) and, after `fuse`, fused ops
  kernel  every op bound to a device and a backend, with activation buffers assigned

A `Graph` is a topologically ordered tuple of `Node`s plus the `WeightSpec`s they name.
Values are node ids (`%7`); weights are names (`@L3.moe.gate_up`). Everything is frozen and
hashable, so passes build new graphs instead of mutating, and two graphs compare with `==`.
Symbolic dims: B = batch, T = tokens in this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Iterator, Union

Attr = Union[int, float, str, bool, tuple]
Dim = Union[int, str]


class Level(str, Enum):
    GRAPH = "graph"
    TENSOR = "tensor"
    KERNEL = "kernel"


class DType(str, Enum):
    F32 = "f32"
    I64 = "i64"


class Op(str, Enum):
    # graph level: model ops
    INPUT_IDS = "input_ids"
    EMBED = "embed"
    RMS_NORM = "rms_norm"
    ATTENTION = "attention"
    MLP = "mlp"
    MOE = "moe"
    ADD = "add"
    MATMUL = "matmul"
    # tensor level: primitives
    MUL = "mul"
    SILU = "silu"
    SIGMOID = "sigmoid"
    SLICE = "slice"
    CLAMP = "clamp"
    ROPE = "rope"
    SDPA = "sdpa"
    SOFTMAX = "softmax"
    TOPK_MASK = "topk_mask"
    RENORM = "renorm"
    MOE_FFN = "moe_ffn"
    # tensor level after `fuse`, and kernel level: fused ops
    LINEAR = "linear"          # [rms_norm prologue] matmul [+bias] [silu*mul epilogue] [+residual]
    ROUTE = "route"            # softmax + top-k mask [+ renormalisation]
    FUSED_ATTENTION = "fused_attention"  # split qkv, [clamp], [q/k norm], rope, sdpa
    # kernel level only: an activation moving between devices
    TRANSFER = "transfer"


GRAPH_OPS = frozenset({Op.INPUT_IDS, Op.EMBED, Op.RMS_NORM, Op.ATTENTION, Op.MLP, Op.MOE, Op.ADD, Op.MATMUL})
PRIMITIVE_OPS = frozenset({
    Op.INPUT_IDS, Op.EMBED, Op.RMS_NORM, Op.ADD, Op.MATMUL, Op.MUL, Op.SILU, Op.SIGMOID, Op.SLICE,
    Op.CLAMP, Op.ROPE, Op.SDPA, Op.SOFTMAX, Op.TOPK_MASK, Op.RENORM, Op.MOE_FFN,
})
FUSED_OPS = frozenset({Op.LINEAR, Op.ROUTE, Op.FUSED_ATTENTION})
LEVEL_OPS = {
    Level.GRAPH: GRAPH_OPS,
    Level.TENSOR: PRIMITIVE_OPS | FUSED_OPS,
    Level.KERNEL: PRIMITIVE_OPS | FUSED_OPS | {Op.TRANSFER},
}


@dataclass(frozen=True, slots=True)
class TensorType:
    dtype: DType
    shape: tuple[Dim, ...]

    def __str__(self) -> str:
        return f"{self.dtype.value}[{','.join(str(d) for d in self.shape)}]"

    def bytes_per_token(self) -> int:
        """Bytes of one [B=1, T=1] slice: the product of the concrete dims times 4 or 8."""
        n = 8 if self.dtype is DType.I64 else 4
        for d in self.shape:
            if isinstance(d, int):
                n *= d
        return n


@dataclass(frozen=True, slots=True)
class WeightSpec:
    """A weight as the IR sees it: a logical f32 tensor built from safetensors keys.

    `sources` are key templates concatenated along axis 0 (output rows); with `experts` > 0
    the result is stacked over a new leading axis E, `{e}` in each template standing for the
    expert index. `expert_ids`, when set, names the model's experts the stack holds, in order
    (a subset: one moe_ffn node's share of a layer); otherwise they are 0..E-1.
    `fmt`/`group_size` say how it is stored in the plan (see formats.py).
    """

    name: str
    shape: tuple[int, ...]
    sources: tuple[str, ...]
    experts: int = 0
    fmt: str = "f32"
    group_size: int = 0
    expert_ids: tuple[int, ...] = ()

    def model_expert(self, index: int) -> int:
        """The model's expert id at position `index` of the stack."""
        return self.expert_ids[index] if self.expert_ids else index

    def source_keys(self, expert: int | None = None) -> tuple[str, ...]:
        """The source keys of the stack's expert at position `expert` (None for plain weights)."""
        if self.experts:
            assert expert is not None
            return tuple(s.replace("{e}", str(self.model_expert(expert))) for s in self.sources)
        return self.sources

    def all_source_keys(self) -> Iterator[str]:
        for e in range(self.experts) if self.experts else (None,):
            yield from self.source_keys(e)


@dataclass(frozen=True, slots=True)
class Node:
    id: int
    op: Op
    args: tuple[int, ...]
    type: TensorType
    weights: tuple[tuple[str, str], ...] = ()   # (role, weight name), in the op's role order
    attrs: tuple[tuple[str, Attr], ...] = ()    # sorted by key
    device: str = ""                            # "" until placed; then "cpu" | "gpu" | "gpu:N" (N-th GPU)
    backend: str = ""                           # kernel level: "reference" | "llvm" | "xla"
    buffer: int = -1                            # kernel level: activation buffer slot

    def attr(self, key: str, default: Attr | None = None) -> Attr:
        for k, v in self.attrs:
            if k == key:
                return v
        if default is None:
            raise KeyError(f"{self.op.value} node %{self.id} has no attribute {key!r}")
        return default

    def has_attr(self, key: str) -> bool:
        return any(k == key for k, _ in self.attrs)

    def weight(self, role: str) -> str | None:
        for r, w in self.weights:
            if r == role:
                return w
        return None


def make_attrs(**kw: Attr) -> tuple[tuple[str, Attr], ...]:
    """Attributes in canonical form: sorted, lists as tuples, None dropped."""
    out = []
    for k in sorted(kw):
        v = kw[k]
        if v is None:
            continue
        if isinstance(v, list):
            v = tuple(v)
        out.append((k, v))
    return tuple(out)


@dataclass(frozen=True)
class Graph:
    level: Level
    nodes: tuple[Node, ...]
    weights: tuple[WeightSpec, ...]
    outputs: tuple[int, ...]
    meta: tuple[tuple[str, Attr], ...] = ()
    _index: dict = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {
            "nodes": {n.id: n for n in self.nodes},
            "weights": {w.name: w for w in self.weights},
        })

    def node(self, nid: int) -> Node:
        return self._index["nodes"][nid]

    def weight(self, name: str) -> WeightSpec:
        return self._index["weights"][name]

    def has_weight(self, name: str) -> bool:
        return name in self._index["weights"]

    def meta_value(self, key: str, default: Attr | None = None) -> Attr:
        for k, v in self.meta:
            if k == key:
                return v
        if default is None:
            raise KeyError(f"graph meta has no {key!r}")
        return default

    def users(self) -> dict[int, list[int]]:
        """Node id -> ids of the nodes that read it (outputs count as a user, id -1)."""
        out: dict[int, list[int]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            for a in n.args:
                out[a].append(n.id)
        for o in self.outputs:
            out[o].append(-1)
        return out

    def last_use(self) -> dict[int, int]:
        """Node id -> index of the last node that reads it (its own index if none; len(nodes) for
        the graph's outputs): the liveness buffer assignment and its check share."""
        last = {n.id: i for i, n in enumerate(self.nodes)}
        for i, n in enumerate(self.nodes):
            for a in n.args:
                last[a] = i
        for o in self.outputs:
            last[o] = len(self.nodes)
        return last

    def with_(self, **changes) -> "Graph":
        return replace(self, **changes)


class GraphBuilder:
    """Appends nodes with fresh ids; used by the frontend and by rewriting passes."""

    def __init__(self, start_id: int = 0) -> None:
        self.nodes: list[Node] = []
        self.next_id = start_id

    def add(self, op: Op, args: tuple[int, ...] | list[int], type: TensorType, *,
            weights: dict[str, str | None] | None = None, attrs: dict[str, Attr] | None = None,
            device: str = "") -> int:
        ws = tuple((r, w) for r, w in (weights or {}).items() if w is not None)
        node = Node(self.next_id, op, tuple(args), type, ws, make_attrs(**(attrs or {})), device)
        self.nodes.append(node)
        self.next_id += 1
        return node.id

    def append(self, node: Node) -> None:
        self.nodes.append(node)
        self.next_id = max(self.next_id, node.id + 1)


def f32(*shape: Dim) -> TensorType:
    return TensorType(DType.F32, tuple(shape))


def renumber(g: Graph) -> Graph:
    """Ids 0..n-1 in node order, so dumps stay readable after rewrites."""
    mapping = {n.id: i for i, n in enumerate(g.nodes)}
    nodes = tuple(replace(n, id=mapping[n.id], args=tuple(mapping[a] for a in n.args)) for n in g.nodes)
    return g.with_(nodes=nodes, outputs=tuple(mapping[o] for o in g.outputs))
