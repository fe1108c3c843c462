"""A layer's experts split over several moe_ffn nodes (passes/expert_split.py): the chain gives the
unsplit layer's result on every backend, with shares in different formats and non-contiguous ids."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hf_models import build_model, clear_prompts, hf_greedy, hf_logits, load_model
from strata_compiler.driver import DEFAULT, compile_model
from strata_compiler.errors import IRError
from strata_compiler.ir import Level, Op
from strata_compiler.ir_text import parse_graph, print_graph
from strata_compiler.pass_manager import PASSES, CompileOptions, register
from strata_compiler.experts import moe_key
from strata_compiler.passes.expert_split import Share, split_experts
from strata_compiler.verify import verify
from test_e2e_transformers import run_plan

SHARE_FORMATS: dict = {}


def _shares(g):
    """Layer 0: experts {0, 2, ...} and the rest (non-contiguous); layer 1: two halves; other
    layers unsplit."""
    out, layer = {}, 0
    for n in g.nodes:
        if n.op is not Op.MOE_FFN:
            continue
        E = g.weight(n.weight("down")).shape[0]
        if layer == 0:
            out[moe_key(n)] = [Share(tuple(range(0, E, 2))), Share(tuple(range(1, E, 2)))]
        elif layer == 1:
            out[moe_key(n)] = [Share(tuple(range(E // 2))), Share(tuple(range(E // 2, E)))]
            if SHARE_FORMATS:
                SHARE_FORMATS["weights"] = [f"{w}.s1" for _, w in n.weights]
        layer += 1
    return out


if "test-split-experts" not in PASSES:
    @register("test-split-experts", Level.TENSOR)
    def _test_split(g, ctx):
        """Split the first two MoE layers' experts into shares (tests only); with SHARE_FORMATS,
        layer 1's second share is stored in that format."""
        g = split_experts(g, _shares(g), ctx.analyses.calibration)
        if not SHARE_FORMATS:
            return g
        fmt, gs = SHARE_FORMATS["fmt"]
        own = set(SHARE_FORMATS["weights"])
        return g.with_(weights=tuple(replace(w, fmt=fmt, group_size=gs) if w.name in own else w
                                     for w in g.weights))


def _compile(model_dir, out, quant="f32", backend="reference"):
    pipe = list(DEFAULT)
    pipe.insert(pipe.index("quantize") + 1, "test-split-experts")
    return compile_model(model_dir, out, CompileOptions(quant=quant, backend=backend), pipeline=pipe)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def model(request, tmp_path_factory):
    d = build_model(request.param, tmp_path_factory.mktemp(request.param) / "model")
    m = load_model(d)
    ids = clear_prompts(m, m.config.vocab_size, n_prompts=1, length=6, n_new=8, seed=4)[0]
    return d, m, ids


@pytest.mark.parametrize("backend", ["reference", "llvm", "xla"])
def test_split_f32_plan_matches_transformers(model, backend, tmp_path):
    d, m, ids = model
    SHARE_FORMATS.clear()
    g = _compile(d, tmp_path / "plan")
    moes = [n for n in g.nodes if n.op is Op.MOE_FFN]
    assert any(n.attr("experts", ()) for n in moes)
    logits, tokens = run_plan(tmp_path / "plan", ids, tmp_path, n_new=8, backend=backend)
    ref = hf_logits(m, ids)
    assert np.abs(logits - ref).max() / ref.std() <= 1e-4
    np.testing.assert_array_equal(tokens, hf_greedy(m, ids, 8)[0])


@pytest.mark.parametrize("backend", ["llvm", "xla"])
def test_shares_in_their_own_format_agree_with_reference(model, backend, tmp_path, monkeypatch):
    d, m, ids = model
    SHARE_FORMATS["fmt"] = ("int3", 32)
    try:
        g = _compile(d, tmp_path / "plan", quant="int4a")
    finally:
        SHARE_FORMATS.clear()
    fmts = {w.name: w.fmt for w in g.weights}
    assert "int3" in fmts.values() and "int4a" in fmts.values()
    monkeypatch.setenv("STRATA_CPU_ACT", "f32")
    ref, ref_tokens = run_plan(tmp_path / "plan", ids, tmp_path, n_new=8, backend="reference")
    logits, tokens = run_plan(tmp_path / "plan", ids, tmp_path, n_new=8, backend=backend)
    assert np.abs(logits - ref).max() / ref.std() <= 1e-4
    np.testing.assert_array_equal(tokens, ref_tokens)


def test_split_ir_prints_parses_and_verifies(model, tmp_path):
    d, _, _ = model
    g = compile_model(d, None, CompileOptions(), stop_after="test-split-experts",
                      pipeline=["lower", "fuse", "test-split-experts"])
    assert parse_graph(print_graph(g)) == g
    sub = [w for w in g.weights if w.expert_ids]
    assert sub and all(w.shape[0] == len(w.expert_ids) for w in sub)
    # a share whose weights hold other experts than the node says is refused
    n = next(n for n in g.nodes if n.op is Op.MOE_FFN and n.attr("experts", ()))
    bad_attrs = tuple((k, tuple(reversed(v)) if k == "experts" else v) for k, v in n.attrs)
    bad = g.with_(nodes=tuple(replace(x, attrs=bad_attrs) if x.id == n.id else x for x in g.nodes))
    with pytest.raises(IRError, match="holds experts"):
        verify(bad)


def test_shares_must_partition_the_experts(model):
    d, _, _ = model
    g = compile_model(d, None, CompileOptions(), stop_after="fuse", pipeline=["lower", "fuse"])
    n = next(n for n in g.nodes if n.op is Op.MOE_FFN)
    with pytest.raises(ValueError, match="partition"):
        split_experts(g, {moe_key(n): [Share((0, 1))]})
