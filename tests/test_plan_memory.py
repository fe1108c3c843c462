"""`plan-memory`: buffer sharing by liveness, and the recorded peak, checked by brute force.

Live range of a value: [index of its node, index of its last reader], both ends inclusive
(graph outputs live to len(nodes)); a value nobody reads lives only at its own node.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import strata_compiler.driver  # noqa: F401  (registers the passes)
from strata_compiler.frontend.hf import build_graph
from strata_compiler.ir import DType, Graph, Level, Node, Op, TensorType, f32
from strata_compiler.pass_manager import PASSES, CompileOptions, PassContext, run_pipeline
from strata_compiler.verify import verify
from test_ir import KERNEL_PIPELINE, VARIANTS, write_model


def live_ranges(g: Graph) -> dict[int, tuple[int, int]]:
    start = {n.id: i for i, n in enumerate(g.nodes)}
    end = dict(start)
    for i, n in enumerate(g.nodes):
        for a in n.args:
            end[a] = max(end[a], i)
    for o in g.outputs:
        end[o] = len(g.nodes)
    return {nid: (start[nid], end[nid]) for nid in start}


def brute_force_peak(g: Graph) -> int:
    r = live_ranges(g)
    return max((sum(n.type.bytes_per_token() for n in g.nodes if r[n.id][0] <= i <= r[n.id][1])
                for i in range(len(g.nodes))), default=0)


def check_plan(g: Graph) -> None:
    """Every property plan-memory promises, on a planned kernel-level graph."""
    assert g.level is Level.KERNEL
    r = live_ranges(g)
    nodes = list(g.nodes)
    assert all(n.buffer >= 0 for n in nodes)
    size_of: dict[int, int] = {}
    for n in nodes:
        size = n.type.bytes_per_token()
        # buffers are only shared between values of equal bytes_per_token
        assert size_of.setdefault(n.buffer, size) == size, (n.id, n.buffer)
        # a node never writes over one of its own operands
        assert all(g.node(a).buffer != n.buffer for a in n.args), n.id
    # values whose live ranges overlap never share a buffer
    for i, u in enumerate(nodes):
        for v in nodes[i + 1:]:
            (su, eu), (sv, ev) = r[u.id], r[v.id]
            if su <= ev and sv <= eu:
                assert u.buffer != v.buffer, (u.id, v.id, u.buffer)
    meta = dict(g.meta)
    assert meta["activation_buffers"] == len(size_of)
    assert sorted(size_of) == list(range(len(size_of)))  # dense buffer ids 0..n-1
    assert meta["peak_activation_bytes_per_token"] == brute_force_peak(g)


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> dict[str, Graph]:
    root = tmp_path_factory.mktemp("plan_models")
    out = {}
    for name, (arch, kw) in VARIANTS.items():
        g, _ = build_graph(write_model(root / name, arch, **kw))
        for quant in ("f32", "int4"):
            out[f"{name}-{quant}"] = run_pipeline(g, KERNEL_PIPELINE, PassContext(CompileOptions(quant=quant)))
    return out


@pytest.mark.parametrize("name", [f"{v}-{q}" for v in VARIANTS for q in ("f32", "int4")])
def test_plan_on_real_graphs(planned, name):
    g = planned[name]
    verify(g)
    check_plan(g)
    meta = dict(g.meta)
    assert "activation_buffers" in meta and "peak_activation_bytes_per_token" in meta
    # for 2+ layer models, liveness sharing saves buffers
    assert dict(g.meta)["n_layers"] >= 2
    assert meta["activation_buffers"] < len(g.nodes)
    # the peak is at least the largest single value and at most the sum of all
    sizes = [n.type.bytes_per_token() for n in g.nodes]
    assert max(sizes) <= meta["peak_activation_bytes_per_token"] <= sum(sizes)


def test_buffer_count_does_not_grow_with_depth(tmp_path):
    """Layers reuse the same buffers: 2 and 4 layers plan the same number of buffers and peak."""
    plans = []
    for layers in (2, 4):
        g, _ = build_graph(write_model(tmp_path / f"m{layers}", "mixtral", n_layers=layers))
        plans.append(run_pipeline(g, KERNEL_PIPELINE, PassContext(CompileOptions())))
    a, b = (dict(p.meta) for p in plans)
    assert len(plans[1].nodes) > len(plans[0].nodes)
    assert a["activation_buffers"] == b["activation_buffers"]
    assert a["peak_activation_bytes_per_token"] == b["peak_activation_bytes_per_token"]


# -- handcrafted kernel graphs ---------------------------------------------------------------------


def _kernel(nodes: list[tuple[int, tuple[int, ...], int]], outputs: tuple[int, ...]) -> Graph:
    """(id, args, width) triples as kernel nodes (ops irrelevant to plan-memory); width 0 = i64[B,T]."""
    out = []
    for nid, args, width in nodes:
        t = TensorType(DType.I64, ("B", "T")) if width == 0 else f32("B", "T", width)
        out.append(Node(nid, Op.ADD, args, t, device="cpu", backend="reference", buffer=nid))
    return Graph(Level.KERNEL, tuple(out), (), outputs)


def plan(g: Graph) -> Graph:
    return PASSES["plan-memory"].fn(g, PassContext(CompileOptions()))


def test_hand_graph_dead_values_duplicate_operands_and_outputs():
    g = _kernel([
        (0, (), 0),          # i64: 8 bytes per token
        (1, (0,), 8),
        (2, (1,), 8),        # dead: nobody reads it
        (3, (1, 1), 8),      # the same operand twice
        (4, (3,), 16),
        (5, (3,), 8),        # an output, also read later
        (6, (5, 4), 8),
        (7, (6,), 8),
    ], outputs=(5, 7))
    p = plan(g)
    check_plan(p)
    bufs = {n.id: n.buffer for n in p.nodes}
    assert bufs[2] != bufs[1]          # %2 is written while %1 is still live
    assert bufs[3] == bufs[2]          # %2 died at once; %3 reuses its buffer
    assert len({bufs[5], bufs[6], bufs[7]}) == 3   # %5 is an output: it lives to the end
    assert dict(p.meta)["peak_activation_bytes_per_token"] == brute_force_peak(p)


def test_chain_reuses_two_buffers_and_meta_is_merged():
    g = _kernel([(0, (), 8)] + [(i, (i - 1,), 8) for i in range(1, 10)], outputs=(9,))
    g = g.with_(meta=(("arch", "chain"),))
    p = plan(g)
    check_plan(p)
    assert dict(p.meta) == {"arch": "chain", "activation_buffers": 2, "peak_activation_bytes_per_token": 64}
    assert [n.buffer for n in p.nodes] == [0, 1] * 5
    assert [k for k, _ in p.meta] == sorted(k for k, _ in p.meta)


def test_different_sizes_never_share():
    g = _kernel([(0, (), 4), (1, (0,), 8), (2, (1,), 4), (3, (2,), 8), (4, (3,), 4)], outputs=(4,))
    p = plan(g)
    check_plan(p)
    assert p.nodes[2].buffer == p.nodes[0].buffer and p.nodes[3].buffer == p.nodes[1].buffer


def test_plan_memory_is_deterministic_and_idempotent(planned):
    g = planned["qwen2_moe-f32"]
    stripped = g.with_(nodes=tuple(replace(n, buffer=i) for i, n in enumerate(g.nodes)))
    assert plan(stripped) == plan(stripped)
    assert plan(g) == g


def test_checker_rejects_broken_plans(planned):
    """check_plan itself catches overlapping sharing, size mixing and a wrong peak."""
    g = planned["llama-f32"]
    # %1 (embed) is read by the next node; giving the reader the same buffer must be caught
    reader = next(n for n in g.nodes if 1 in n.args)
    bad = g.with_(nodes=tuple(replace(n, buffer=g.node(1).buffer) if n.id == reader.id else n for n in g.nodes))
    with pytest.raises(AssertionError):
        check_plan(bad)
    bad = g.with_(nodes=tuple(replace(n, buffer=g.nodes[-1].buffer) if n.id == 0 else n for n in g.nodes))
    with pytest.raises(AssertionError):
        check_plan(bad)
    meta = tuple((k, v + 4 if k == "peak_activation_bytes_per_token" else v) for k, v in g.meta)
    with pytest.raises(AssertionError):
        check_plan(g.with_(meta=meta))


@st.composite
def dags(draw):
    n = draw(st.integers(1, 40))
    nodes = []
    for i in range(n):
        k = draw(st.integers(0, min(3, i)))
        args = tuple(draw(st.lists(st.integers(0, i - 1), min_size=k, max_size=k))) if i else ()
        nodes.append((i, args, draw(st.sampled_from([0, 1, 2, 8, 16]))))
    outs = tuple(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3, unique=True)))
    return _kernel(nodes, outs)


@settings(max_examples=200, deadline=None)
@given(g=dags())
def test_plan_memory_on_random_dags(g):
    check_plan(plan(g))
