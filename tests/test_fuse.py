"""The fuse pass: golden before/after IR per rule, and semantic equality on the reference backend.

Every rule is applied cumulatively to real lowered models of each architecture and the
logits compared with the unfused graph; structural checks say each rule fired where it should.
"""

from __future__ import annotations

import numpy as np
import pytest

import strata_compiler.driver  # noqa: F401  (registers the passes)
from hf_models import ARCHS, build_model
from strata_compiler.backends.reference.executor import ReferenceExecutor
from strata_compiler.frontend.hf import build_graph
from strata_compiler.frontend.safetensors_reader import TensorStore
from strata_compiler.ir import Op
from strata_compiler.ir_text import parse_graph, print_graph
from strata_compiler.pass_manager import CompileOptions, PassContext, run_pipeline
from strata_compiler.passes import fuse
from strata_compiler.kv_cache import KVCache
from strata_compiler.verify import verify
from strata_compiler.weights import materialize_f32


class StoreWeights:
    def __init__(self, g, store):
        self.g, self.store, self.cache = g, store, {}

    def get(self, name):
        if name not in self.cache:
            self.cache[name] = materialize_f32(self.g.weight(name), self.store)
        return self.cache[name]


def run_graph(g, store, ids, split):
    """Logits for ids [B, T], run as a prefill of `split` tokens then one step per token."""
    m = dict(g.meta)
    ex = ReferenceExecutor(g, StoreWeights(g, store))
    kv = KVCache(m["n_layers"], ids.shape[0], m["n_kv_heads"], m["head_dim"], ids.shape[1])
    out = [ex.run(ids[:, :split], kv)[g.outputs[0]]]
    for t in range(split, ids.shape[1]):
        out.append(ex.run(ids[:, t:t + 1], kv)[g.outputs[0]])
    return np.concatenate(out, axis=1)


@pytest.fixture(scope="module", params=ARCHS)
def lowered(request, tmp_path_factory):
    d = build_model(request.param, tmp_path_factory.mktemp(request.param) / "m")
    store = TensorStore.open(d)
    g, cfg = build_graph(d, store)
    g = run_pipeline(g, ["lower"], PassContext(CompileOptions()))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 6))
    return request.param, g, store, ids, run_graph(g, store, ids, 4)


@pytest.mark.parametrize("upto", range(1, len(fuse.RULES) + 1), ids=[r.__name__ for r in fuse.RULES])
def test_each_rule_preserves_semantics(lowered, upto):
    arch, g, store, ids, ref = lowered
    for rule in fuse.RULES[:upto]:
        g = rule(g)
    verify(g)
    out = run_graph(g, store, ids, 4)
    assert np.abs(out - ref).max() <= 1e-5 * ref.std()


def test_fused_graph_has_no_unfused_patterns(lowered):
    arch, g, store, _, _ = lowered
    n_layers = dict(g.meta)["n_layers"]
    f = fuse.fuse(g, None)
    ops = [n.op for n in f.nodes]
    for op in (Op.MATMUL, Op.SDPA, Op.ROPE, Op.SOFTMAX, Op.TOPK_MASK, Op.RENORM, Op.SILU):
        assert op not in ops, f"{arch}: {op.value} left after fuse"
    assert ops.count(Op.FUSED_ATTENTION) == n_layers
    # every attention reads one merged QKV projection with the input norm as its prologue
    for n in f.nodes:
        if n.op is Op.FUSED_ATTENTION:
            qkv = f.node(n.args[0])
            assert qkv.op is Op.LINEAR and qkv.attr("prologue") == "rms_norm"
            assert len(f.weight(qkv.weight("w")).sources) == 3
        if n.op is Op.MOE_FFN:
            assert n.weight("gate_up") and n.weight("gate") is None
    # each layer's attention output projection adds the residual stream in its epilogue
    assert sum(1 for n in f.nodes if n.op is Op.LINEAR and len(n.args) == 2) >= n_layers


HEADER = """strata.ir level=tensor
weight @wq f32[8,4] fmt=f32 g=0 = ("q")
weight @wk f32[4,4] fmt=f32 g=0 = ("k")
weight @n f32[4] fmt=f32 g=0 = ("n")
weight @wg f32[6,4] fmt=f32 g=0 = ("model.layers.0.mlp.gate_proj.weight")
weight @wu f32[6,4] fmt=f32 g=0 = ("model.layers.0.mlp.up_proj.weight")
weight @wd f32[4,6] fmt=f32 g=0 = ("model.layers.0.mlp.down_proj.weight")
"""


def test_golden_mlp_chain():
    before = HEADER + """%0 = input_ids() : i64[B,T]
%1 = embed(%0, table=@wq) : f32[B,T,4]
%2 = rms_norm(%1, w=@n) {eps=1e-05} : f32[B,T,4]
%3 = matmul(%2, w=@wg) : f32[B,T,6]
%4 = matmul(%2, w=@wu) : f32[B,T,6]
%5 = silu(%3) : f32[B,T,6]
%6 = mul(%5, %4) : f32[B,T,6]
%7 = matmul(%6, w=@wd) : f32[B,T,4]
%8 = add(%1, %7) : f32[B,T,4]
return %8
"""
    after = """strata.ir level=tensor
weight @wq f32[8,4] fmt=f32 g=0 = ("q")
weight @n f32[4] fmt=f32 g=0 = ("n")
weight @wd f32[4,6] fmt=f32 g=0 = ("model.layers.0.mlp.down_proj.weight")
weight @wg_wu f32[12,4] fmt=f32 g=0 = ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
%0 = input_ids() : i64[B,T]
%1 = embed(%0, table=@wq) : f32[B,T,4]
%2 = linear(%1, w=@wg_wu, norm=@n) {epilogue="silu_mul", eps=1e-05, prologue="rms_norm"} : f32[B,T,6]
%3 = linear(%2, %1, w=@wd) : f32[B,T,4]
return %3
"""
    g = parse_graph(before)
    verify(g)
    out = fuse.fuse(g, None)
    verify(out)
    assert print_graph(out) == after


def test_golden_router():
    before = """strata.ir level=tensor
weight @r f32[4,4] fmt=f32 g=0 = ("router")
%0 = input_ids() : i64[B,T]
%1 = embed(%0, table=@r) : f32[B,T,4]
%2 = matmul(%1, w=@r) : f32[B,T,4]
%3 = softmax(%2) : f32[B,T,4]
%4 = topk_mask(%3) {k=2} : f32[B,T,4]
%5 = renorm(%4) : f32[B,T,4]
return %5
"""
    after = """strata.ir level=tensor
weight @r f32[4,4] fmt=f32 g=0 = ("router")
%0 = input_ids() : i64[B,T]
%1 = embed(%0, table=@r) : f32[B,T,4]
%2 = matmul(%1, w=@r) : f32[B,T,4]
%3 = route(%2) {k=2, norm=true} : f32[B,T,4]
return %3
"""
    assert print_graph(fuse.route(parse_graph(before))) == after


def test_no_fusion_across_multiple_readers():
    """A norm read by two matmuls of different weight classes is not folded into either."""
    before = """strata.ir level=tensor
weight @n f32[4] fmt=f32 g=0 = ("n")
weight @r f32[4,4] fmt=f32 g=0 = ("model.layers.0.mlp.gate.weight")
weight @w f32[4,4] fmt=f32 g=0 = ("model.layers.0.mlp.shared_expert.up_proj.weight")
%0 = input_ids() : i64[B,T]
%1 = embed(%0, table=@r) : f32[B,T,4]
%2 = rms_norm(%1, w=@n) {eps=1e-05} : f32[B,T,4]
%3 = matmul(%2, w=@r) : f32[B,T,4]
%4 = matmul(%2, w=@w) : f32[B,T,4]
%5 = add(%3, %4) : f32[B,T,4]
return %5
"""
    out = fuse.fuse(parse_graph(before), None)
    verify(out)
    assert [n.op for n in out.nodes].count(Op.RMS_NORM) == 1
    assert not any(n.attr("prologue", "none") == "rms_norm" for n in out.nodes if n.op is Op.LINEAR)
