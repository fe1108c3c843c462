"""passes/cluster_experts.py and the routing trace of passes/calibrate.py."""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

from strata_compiler.cli_common import run_cli
from strata_compiler.driver import DEFAULT, compile_model
from strata_compiler.frontend.hf import build_graph
from strata_compiler.frontend.safetensors_reader import TensorStore
from strata_compiler.ir import Op
from strata_compiler.ir_text import parse_graph, print_graph
from strata_compiler.pass_manager import CompileOptions, DumpConfig, PassContext, run_pipeline
from strata_compiler.passes import cluster_experts as ce
from strata_compiler.passes.calibrate import Calibration, Recorder, _F32Weights
from strata_compiler.runtime.cli import strata_run
from strata_compiler.runtime.plan import load_plan
from test_calibrate import demo  # noqa: F401  (fixture)

def _calibrated(d: Path, calib: Path, **opts):
    """(graph, ctx) after lower .. cluster-experts, in process (the analyses stay reachable)."""
    store = TensorStore.open(d)
    g, _ = build_graph(d, store)
    ctx = PassContext(CompileOptions(calib=str(calib), **opts), model_dir=d, store=store,
                      tokenizer_json=(d / "tokenizer.json").read_bytes())
    return run_pipeline(g, DEFAULT[:DEFAULT.index("cluster-experts") + 1], ctx), ctx


# --- the routing trace ------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_trace_matches_transformers_routing(arch, tmp_path):
    """The recorded top-k ids are transformers' router choices, layer by layer (qwen2_moe's
    config has a dense layer: MoE layers are counted without it)."""
    import torch
    from hf_models import build_model, load_model

    from strata_compiler.backends.reference.executor import ReferenceExecutor
    from strata_compiler.kv_cache import KVCache

    d = build_model(arch, tmp_path / "model")
    cfg = json.loads((d / "config.json").read_text())
    store = TensorStore.open(d)
    g, _ = build_graph(d, store)
    g = run_pipeline(g, ["lower", "fuse"], PassContext(CompileOptions()))
    calib = Calibration()
    rec = Recorder(g, calib)
    assert set(rec.k.values()) == {cfg["num_experts_per_tok"]}
    exe = ReferenceExecutor(g, _F32Weights(g, store), observer=rec)
    ids = np.random.default_rng(0).integers(0, cfg["vocab_size"], (1, 24))
    m = dict(g.meta)
    for chunk in (ids[:, :10], ids[:, 10:]):        # two chunks: the trace concatenates them
        exe.run(chunk, KVCache(m["n_layers"], 1, m["n_kv_heads"], m["head_dim"], chunk.shape[1]))
        calib.tokens += chunk.shape[1]

    model = load_model(d)
    routers = [mod for name, mod in model.named_modules()
               if name.endswith("mlp.gate") and "TopKRouter" in type(mod).__name__]
    got = []
    hooks = [r.register_forward_hook(lambda mod, i, o: got.append(o)) for r in routers]
    with torch.no_grad():
        for chunk in (ids[:, :10], ids[:, 10:]):    # the same chunks, each from position 0
            model(torch.from_numpy(chunk))
    for h in hooks:
        h.remove()
    n_moe = len(routers)
    assert sorted(calib.routes) == list(range(n_moe))
    for layer in range(n_moe):
        t = calib.trace(layer)
        assert t.dtype == np.int16 and t.shape == (24, cfg["num_experts_per_tok"])
        logits = torch.cat([got[layer][0], got[n_moe + layer][0]]).numpy()
        want = torch.cat([got[layer][2], got[n_moe + layer][2]]).numpy()
        p = np.sort(logits, axis=-1)[:, ::-1]
        gaps = -np.diff(p[:, :t.shape[1] + 1], axis=-1).min(axis=-1)   # near ties may flip
        clear = gaps > 1e-4
        assert clear.sum() >= 20
        np.testing.assert_array_equal(t[clear], want[clear])
        # the trace agrees with the per-expert token counts the calibration already keeps
        np.testing.assert_array_equal(np.bincount(t.ravel(), minlength=logits.shape[1]), calib.freq[layer])


def test_trace_through_the_calibrate_pass(demo):
    d, calib = demo
    cfg = json.loads((d / "config.json").read_text())
    g, ctx = _calibrated(d, calib, calib_tokens=300, calib_ctx=128)
    c = ctx.analyses.calibration
    E, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    assert sorted(c.routes) == list(range(cfg["num_hidden_layers"]))
    for layer in c.routes:
        t = c.trace(layer)
        assert t.shape == (300, k) and t.dtype == np.int16
        assert (t >= 0).all() and (t < E).all()
        assert all(len(set(row)) == k for row in t.tolist())      # k distinct experts per token
        np.testing.assert_array_equal(np.bincount(t.ravel(), minlength=E), c.freq[layer])
    s = c.route_summary()
    assert s["0"]["tokens"] == 300 and s["0"]["k"] == k
    assert sum(n for _, n in s["0"]["top_sets"]) <= 300 and 1 <= s["0"]["distinct_sets"] <= 300


# --- matrices ---------------------------------------------------------------------------------

TRACE = np.array([[0, 1], [1, 2], [0, 1], [3, -1], [2, 0]], np.int16)


def test_coactivation_counts_by_hand():
    C = ce.coactivation(TRACE, 4)
    want = np.zeros((4, 4), np.int64)
    for row in TRACE.tolist():
        row = [e for e in row if e >= 0]
        for e in row:
            want[e, e] += 1
        for e, f in combinations(row, 2):
            want[e, f] += 1
            want[f, e] += 1
    np.testing.assert_array_equal(C, want)
    np.testing.assert_array_equal(C, C.T)
    assert C[0, 1] == 2 and C[1, 2] == 1 and C[0, 2] == 1 and C[3, 3] == 1 and C[0, 3] == 0
    assert list(np.diag(C)) == [3, 3, 2, 1]


def test_transitions_by_hand():
    nxt = np.array([[2], [2], [0], [1], [2]], np.int16)
    T = ce.transitions(TRACE, nxt, 4, 3)
    want = np.zeros((4, 3), np.int64)
    for a, b in zip(TRACE.tolist(), nxt.tolist()):
        for e in a:
            if e >= 0:
                want[e, b[0]] += 1
    np.testing.assert_array_equal(T, want)
    assert T[1, 2] == 2 and T[3, 1] == 1


# --- clustering and metrics -------------------------------------------------------------------

def _planted(E=16, groups=4, k=2, tokens=4000, stay=0.95, noise=0.1, seed=0):
    """Tokens in runs within one planted group (topic persistence); each picks k experts of its
    group, an expert from anywhere now and then."""
    rng = np.random.default_rng(seed)
    members = rng.permutation(E).reshape(groups, -1)
    out, gi = [], 0
    for _ in range(tokens):
        if rng.random() > stay:
            gi = rng.integers(groups)
        row = list(rng.choice(members[gi], k, replace=False))
        if rng.random() < noise:
            other = [e for e in range(E) if e not in row]
            row[-1] = rng.choice(other)
        out.append(row)
    return np.array(out, np.int16), [sorted(int(e) for e in m) for m in members]


@pytest.mark.parametrize("E,k,size", [(8, 2, None), (12, 3, 4), (60, 4, None), (64, 8, None), (5, 2, None),
                                      (7, 2, 2), (3, 1, None)])
@pytest.mark.parametrize("weighting", ce.WEIGHTINGS)
def test_clusters_cover_every_expert_once(E, k, size, weighting):
    rng = np.random.default_rng(E)
    trace = np.stack([rng.choice(E, k, replace=False) for _ in range(500)]).astype(np.int16)
    cl = ce.cluster_layer(ce.coactivation(trace, E), 500, size, weighting=weighting)
    assert sorted(e for c in cl for e in c) == list(range(E))
    sizes = [len(c) for c in cl]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 2
    assert len(cl) == len(ce.balanced_sizes(E, size or ce.default_cluster_size(E)))


def test_default_cluster_size():
    assert ce.default_cluster_size(8) == 2 and ce.default_cluster_size(64) == 8 and ce.default_cluster_size(128) == 16
    assert ce.balanced_sizes(60, 8) == [8] * 4 + [7] * 4 and ce.balanced_sizes(60, 9) == [9] * 4 + [8] * 3
    assert ce.balanced_sizes(8, 2) == [2, 2, 2, 2] and ce.balanced_sizes(3, 2) == [3] and ce.balanced_sizes(7, 2) == [3, 2, 2]


def test_planted_clusters_are_found_and_beat_random():
    trace, planted = _planted()
    C = ce.coactivation(trace, 16)
    for weighting in ce.WEIGHTINGS:
        for method in ("louvain", "greedy"):
            cl = ce.cluster_layer(C, len(trace), 4, weighting=weighting, method=method)
            assert cl == sorted(planted), (weighting, method)
    m = ce.layer_metrics(trace, sorted(planted), 16, expert_bytes=1000, C=C)
    assert m["in_cluster_share"] > 0.85
    assert m["random_share"] == pytest.approx(3 / 15, abs=0.03)     # 4 clusters of 4: 3 of 15 partners
    for p in m["prefetch"]:
        assert p["cluster_fetch"]["transfers"] < p["expert_fetch"]["transfers"]
        a, b = p["expert_fetch"]["bytes"], p["cluster_fetch"]["bytes"]
        assert p["cheaper"] == ("cluster" if b < a else "expert" if a < b else "equal")
        assert a % 1000 == 0 and p["expert_fetch"]["bytes_per_token"] == a / len(trace)


def test_refinement_is_optimal_on_small_pairings():
    """E=6 in pairs: 15 partitions; the clustering finds the best in-cluster share."""
    def pairings(s):
        if not s:
            yield []
            return
        for i in range(1, len(s)):
            for rest in pairings(s[1:i] + s[i + 1:]):
                yield [[s[0], s[i]]] + rest
    for seed in range(5):
        rng = np.random.default_rng(seed)
        p = rng.dirichlet(np.ones(6) * 0.5)
        trace = np.stack([rng.choice(6, 2, replace=False, p=p) for _ in range(300)]).astype(np.int16)
        C = ce.coactivation(trace, 6)
        best = max(ce.in_cluster_share(C, q) for q in pairings(list(range(6))))
        assert ce.in_cluster_share(C, ce.cluster_layer(C, 300, 2)) == pytest.approx(best)


def test_random_share_equals_any_share_when_pairs_are_uniform():
    C = np.ones((8, 8), np.int64) * 5
    cl = [[0, 1, 2], [3, 4, 5], [6, 7]]
    want = (3 + 3 + 1) / 28
    assert ce.in_cluster_share(C, cl) == pytest.approx(want)
    assert ce.random_share(C, [3, 3, 2]) == pytest.approx(want)


def test_lru_simulation_by_hand():
    trace = np.array([[0, 1], [2, 0], [1, -1]], np.int16)
    # single experts, room for 2: 0, 1, 2 (evicts 0), 0 (evicts 1), 1 (evicts 2): 5 misses
    assert ce.simulate_fetch(trace, np.arange(3), np.ones(3, np.int64), 2) == (5, 5)
    # units {0, 1} and {2}, room for 3: {0,1} (2 experts), 2 (1 expert), then hits only
    assert ce.simulate_fetch(trace, np.array([0, 0, 1]), np.array([2, 1]), 3) == (3, 2)
    # room for 2 only: {0,1}, then 2 evicts {0,1}, then 0 evicts 2, 1 hits
    assert ce.simulate_fetch(trace, np.array([0, 0, 1]), np.array([2, 1]), 2) == (5, 3)


# --- the pass in the pipeline -----------------------------------------------------------------

def test_no_op_without_calib(demo, tmp_path):
    d, _ = demo
    g = compile_model(d, None, CompileOptions(), dump=DumpConfig(tmp_path / "dump"), stop_after="cluster-experts")
    assert "expert_clusters" not in dict(g.meta)
    assert not (tmp_path / "dump" / "expert_clusters.json").exists()
    rec = next(r for r in json.loads((tmp_path / "dump" / "index.json").read_text())["passes"]
               if r["pass"] == "cluster-experts")
    assert rec["changed"] is False


def test_no_op_on_a_dense_model(tmp_path):
    from hf_models import build_model

    d = build_model("llama", tmp_path / "model")
    g, _ = build_graph(d, TensorStore.open(d))
    g = run_pipeline(g, ["lower", "fuse"], PassContext(CompileOptions()))
    ctx = PassContext(CompileOptions(calib="x"))
    ctx.analyses.calibration = Calibration(tokens=10)
    assert ce.cluster_experts(g, ctx) is g and ctx.analyses.expert_clusters is None


def test_pass_with_calib_meta_dump_and_identical_outputs(demo, tmp_path):
    d, calib = demo
    cfg = json.loads((d / "config.json").read_text())
    opts = CompileOptions(quant="int8", calib=str(calib), calib_tokens=300)
    dump = tmp_path / "dump"
    compile_model(d, tmp_path / "a", opts, dump=DumpConfig(dump))
    compile_model(d, tmp_path / "b", opts, pipeline=[p for p in DEFAULT if p != "cluster-experts"])
    a, b = load_plan(tmp_path / "a"), load_plan(tmp_path / "b")

    # the clusters: in the plan's model meta, one list of clusters per MoE layer, each a partition
    clusters = a.meta["model"]["expert_clusters"]
    assert len(clusters) == cfg["num_hidden_layers"] and "expert_clusters" not in b.meta["model"]
    for layer in clusters:
        assert sorted(e for c in layer for e in c) == list(range(cfg["num_experts"]))
    # dumps: the IR with the nested-tuple meta parses back to the identical graph
    index = json.loads((dump / "index.json").read_text())
    rec = next(r for r in index["passes"] if r["pass"] == "cluster-experts")
    assert rec["changed"] is True
    for r in index["passes"]:
        text = (dump / r["text"]).read_text()
        g = parse_graph(text)
        assert print_graph(g) == text and parse_graph(print_graph(g)) == g
    g = parse_graph((dump / rec["text"]).read_text())
    assert [[list(c) for c in layer] for layer in g.meta_value("expert_clusters")] == clusters
    rep = json.loads((dump / "expert_clusters.json").read_text())
    assert rep["tokens"] == 300 and rep["bytes_format"] == "int8"
    for key, ent in rep["layers"].items():
        assert ent["clusters"] == clusters[int(key)] and ent["block"] == int(key)
        C = np.array(ent["coactivation"])
        assert C.shape == (cfg["num_experts"],) * 2 and (C == C.T).all()
        assert np.trace(C) == 300 * cfg["num_experts_per_tok"]
        assert 0 <= ent["random_share"] <= 1 and 0 <= ent["in_cluster_share"] <= 1
        assert [p["capacity"] for p in ent["prefetch"]] == list(ce.CAPACITIES)
        if int(key) + 1 < len(clusters):
            assert np.sum(ent["transitions"]) == 300 * cfg["num_experts_per_tok"] ** 2
    assert "transitions" not in rep["layers"][str(len(clusters) - 1)]
    summary = json.loads((dump / "calibration.json").read_text())
    assert summary["routes"]["0"]["tokens"] == 300

    # clustering changes nothing the plan computes: same weights, same ops, same greedy decode
    assert (tmp_path / "a" / "weights.bin").read_bytes() == (tmp_path / "b" / "weights.bin").read_bytes()
    assert a.graph.with_(meta=()) == replace(b.graph, meta=())
    ids = np.array([[5, 17, 42, 7, 99, 3]], np.int64)
    np.save(tmp_path / "ids.npy", ids)
    outs = []
    for name in ("a", "b"):
        assert run_cli(strata_run, [str(tmp_path / name / "plan.bin"), "--input-ids", str(tmp_path / "ids.npy"),
                                    "-n", "8", "--greedy", "--ignore-eos", "--backend", "reference",
                                    "--tokens-out", str(tmp_path / f"{name}.npy")]) == 0
        outs.append(np.load(tmp_path / f"{name}.npy"))
    np.testing.assert_array_equal(outs[0], outs[1])
    assert not any(n.op is Op.MOE_FFN and n.has_attr("clusters") for n in a.graph.nodes)
