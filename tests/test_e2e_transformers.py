"""End to end against transformers: stratac compile -> strata-run, for every architecture.

Acceptance of the spine: f32 plans give transformers' prompt logits within 1e-4 x std and the
same 16-token greedy continuations; int8 plans match transformers run on the same
quantize-dequantized weights; sharded bf16 checkpoints load and match; compiles are
byte-for-byte deterministic; every dumped IR parses back to the identical graph.
"""

from __future__ import annotations

import numpy as np
import pytest

from hf_models import ARCHS, build_model, clear_prompts, hf_greedy, hf_logits, load_model, quantize_dequantize_model
from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.ir_text import parse_graph, print_graph
from strata_compiler.runtime.cli import strata_run

N_NEW = 16


def compile_plan(model_dir, out_dir, *extra) -> None:
    assert run_cli(stratac, ["compile", str(model_dir), "-o", str(out_dir), *extra]) == 0


def run_plan(plan_dir, ids: np.ndarray, tmp, n_new: int = N_NEW, backend: str = "reference",
             device: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    np.save(tmp / "ids.npy", ids)
    rc = run_cli(strata_run, [str(plan_dir / "plan.bin"), "--input-ids", str(tmp / "ids.npy"), "-n", str(n_new),
                              "--greedy", "--ignore-eos", "--backend", backend, "--device", device,
                              "--logits-out", str(tmp / "logits.npy"), "--tokens-out", str(tmp / "tokens.npy")])
    assert rc == 0
    return np.load(tmp / "logits.npy"), np.load(tmp / "tokens.npy")


@pytest.fixture(scope="module", params=ARCHS)
def f32_model(request, tmp_path_factory):
    arch = request.param
    d = build_model(arch, tmp_path_factory.mktemp(arch) / "model")
    model = load_model(d)
    prompts = clear_prompts(model, model.config.vocab_size, n_prompts=1, length=7, n_new=N_NEW, batch=2)
    return arch, d, model, prompts[0]


@pytest.mark.parametrize("backend", ["reference", "llvm", "llvm-avx2", "xla"])
def test_f32_logits_and_greedy_match_transformers(f32_model, tmp_path, backend, monkeypatch):
    arch, d, model, ids = f32_model
    if backend == "llvm-avx2":   # the AVX2 code path, forced on any host
        monkeypatch.setenv("STRATA_CPU_FEATURES", "avx2")
        backend = "llvm"
    compile_plan(d, tmp_path / "plan", "--quant", "f32")
    logits, tokens = run_plan(tmp_path / "plan", ids, tmp_path, backend=backend)
    ref = hf_logits(model, ids)
    err = np.abs(logits - ref).max() / ref.std()
    assert err <= 1e-4, f"{arch} on {backend}: max abs error {err:.2e} x std"
    ref_tokens, _ = hf_greedy(model, ids, N_NEW)
    np.testing.assert_array_equal(tokens, ref_tokens)


@pytest.fixture(scope="module")
def int8_reference(f32_model):
    """transformers on int8 quantize-dequantized weights: prompts, logits and greedy tokens."""
    _, d, _, _ = f32_model
    model = load_model(d)
    quantize_dequantize_model(model, "int8", 32)
    ids = clear_prompts(model, model.config.vocab_size, n_prompts=1, length=7, n_new=N_NEW, batch=2, seed=1)[0]
    return ids, hf_logits(model, ids), hf_greedy(model, ids, N_NEW)[0]


@pytest.mark.parametrize("backend", ["reference", "llvm-f32act", "xla"])
def test_int8_greedy_matches_transformers_on_dequantized_weights(f32_model, int8_reference, tmp_path, backend,
                                                                 monkeypatch):
    _, d, _, _ = f32_model
    ids, ref, ref_tokens = int8_reference
    if backend == "llvm-f32act":   # exact path: f32 activations against int8 weights
        monkeypatch.setenv("STRATA_CPU_ACT", "f32")
        backend = "llvm"
    compile_plan(d, tmp_path / "plan", "--quant", "int8", "--group-size", "32")
    logits, tokens = run_plan(tmp_path / "plan", ids, tmp_path, backend=backend)
    assert np.abs(logits - ref).max() / ref.std() <= 1e-4
    np.testing.assert_array_equal(tokens, ref_tokens)


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_sharded_bf16_checkpoint_loads_and_matches(arch, tmp_path):
    d = build_model(arch, tmp_path / "model", dtype="bfloat16", shard_size="20KB")
    assert (d / "model.safetensors.index.json").exists()
    model = load_model(d)   # bf16 weights widened to f32: exactly what Strata reads
    ids = clear_prompts(model, model.config.vocab_size, n_prompts=1, length=6, n_new=8)[0]
    compile_plan(d, tmp_path / "plan")
    logits, tokens = run_plan(tmp_path / "plan", ids, tmp_path, n_new=8)
    ref = hf_logits(model, ids)
    assert np.abs(logits - ref).max() / ref.std() <= 1e-4
    np.testing.assert_array_equal(tokens, hf_greedy(model, ids, 8)[0])


def test_tied_embeddings(tmp_path):
    d = build_model("llama", tmp_path / "model", tie_word_embeddings=True)
    model = load_model(d)
    quantize_dequantize_model(model, "int4", 32)   # lm_head shares the f32 embedding table
    ids = clear_prompts(model, model.config.vocab_size, n_prompts=1, length=6, n_new=8)[0]
    compile_plan(d, tmp_path / "plan", "--quant", "int4")
    logits, tokens = run_plan(tmp_path / "plan", ids, tmp_path, n_new=8)
    ref = hf_logits(model, ids)
    assert np.abs(logits - ref).max() / ref.std() <= 1e-4
    np.testing.assert_array_equal(tokens, hf_greedy(model, ids, 8)[0])


def test_compile_is_deterministic(tmp_path):
    d = build_model("qwen3_moe", tmp_path / "model")
    for name in ("a", "b"):
        compile_plan(d, tmp_path / name, "--quant", "int4")
    for f in ("plan.bin", "weights.bin"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_dumps_parse_back_to_identical_ir(tmp_path):
    import json

    d = build_model("qwen2_moe", tmp_path / "model")
    compile_plan(d, tmp_path / "plan", "--quant", "int8", "--dump-dir", str(tmp_path / "dump"))
    index = json.loads((tmp_path / "dump" / "index.json").read_text())
    names = [r["pass"] for r in index["passes"]]
    assert names == ["input", "lower", "fuse", "calibrate", "cluster-experts", "quantize", "place", "select-kernels", "plan-memory", "cpu-codegen", "emit"]
    for rec in index["passes"]:
        text = (tmp_path / "dump" / rec["text"]).read_text()
        assert (tmp_path / "dump" / rec["dot"]).read_text().startswith("digraph")
        g = parse_graph(text)
        assert print_graph(g) == text
        assert parse_graph(print_graph(g)) == g
        if rec["pass"] != "input":
            assert {"seconds", "nodes_before", "nodes_after", "changed"} <= rec.keys()
    # each CPU kernel: LLVM IR before and after optimisation, and its assembly
    kernels = sorted((tmp_path / "dump" / "kernels").iterdir())
    stems = {p.name.split(".")[0] for p in kernels}
    assert any(s.startswith("linear_int8") for s in stems) and any(s.startswith("moe_gate_up") for s in stems)
    for s in stems:
        assert {f"{s}.ll", f"{s}.opt.ll", f"{s}.s"} <= {p.name for p in kernels}


def test_dump_after_and_stop_after(tmp_path):
    d = build_model("olmoe", tmp_path / "model")
    compile_plan(d, tmp_path / "plan", "--dump-dir", str(tmp_path / "dump"), "--dump-after", "fuse", "--stop-after", "fuse")
    files = sorted(p.name for p in (tmp_path / "dump").iterdir())
    assert files == ["000.graph.input.dot", "000.graph.input.txt", "002.tensor.fuse.dot", "002.tensor.fuse.txt", "index.json"]
    assert not (tmp_path / "plan" / "plan.bin").exists()


@pytest.mark.parametrize("rules", ["attention=gpu,experts=cpu", "experts=gpu,router=gpu,dense=gpu,all=cpu"])
def test_mixed_plan_matches_transformers(f32_model, tmp_path, rules):
    """Partitions split between xla (JAX-CPU standing in for the GPU) and llvm, with transfers."""
    arch, d, model, ids = f32_model
    compile_plan(d, tmp_path / "plan", "--place", rules, "--dump-dir", str(tmp_path / "dump"),
                 "--dump-after", "select-kernels")
    ir = next((tmp_path / "dump").glob("*select-kernels.txt")).read_text()
    assert "transfer(" in ir and " xla" in ir
    logits, tokens = run_plan(tmp_path / "plan", ids, tmp_path, backend="auto", device="cpu")
    ref = hf_logits(model, ids)
    assert np.abs(logits - ref).max() / ref.std() <= 1e-4
    np.testing.assert_array_equal(tokens, hf_greedy(model, ids, N_NEW)[0])


def test_layer_regex_keeps_glue_ops_with_their_layer(tmp_path):
    """--place 're:^L0\\.=gpu,all=cpu' (llama.cpp's -ngl 1): the residual adds and other weightless
    ops of L0 follow the ops they read, so the activations cross to the GPU and back once, not
    at every glue op; the plan records that it was placed by rules."""
    from strata_compiler.ir import Op
    from strata_compiler.runtime.plan import load_plan

    d = build_model("olmoe", tmp_path / "model")
    compile_plan(d, tmp_path / "plan", "--place", r"re:^L0\.=gpu,all=cpu")
    g = load_plan(tmp_path / "plan").graph
    transfers = [n for n in g.nodes if n.op is Op.TRANSFER]
    assert len(transfers) == 2 and {t.device for t in transfers} == {"gpu", "cpu"}
    assert g.meta_value("placed_by") == "rules"


def test_mixed_plan_raw_hand_offs_give_the_same_logits(tmp_path, monkeypatch):
    """Raw copies through staging arrays (backends/xla/cuda_rt.py, here with memmove on JAX's CPU
    arrays), the results only CPU kernels read packed into one buffer per partition, change how
    values move, never what is computed: every step's logits are bit-identical to JAX's own
    transfers'."""
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.session import Session

    d = build_model("olmoe", tmp_path / "model")
    compile_plan(d, tmp_path / "plan", "--place", "experts=cpu,all=gpu")
    runs = {}
    for mode in ("jax", "raw"):
        if mode == "raw":
            monkeypatch.setenv("STRATA_RAW_COPY", "host")
        s = Session(load_plan(tmp_path / "plan"), "auto", device="cpu")
        packed = any(exe.packed for kind, exe, _ in s.executor.parts if kind == "xla")
        assert s.executor.raw_copy == packed == (mode == "raw") and s.executor.transfers.raw == (mode == "raw")
        s.reset(1, 32)
        out = [s.step(np.array([[3, 5, 7, 11]], np.int64))]
        for t in (13, 17, 19, 23):
            out.append(s.step(np.array([[t]], np.int64)))
        runs[mode] = out
        if mode == "raw":   # the host values the GPU partitions read went through staging arrays
            staged = [k for kind, exe, _ in s.executor.parts if kind == "xla" and hasattr(exe, "_stage")
                      for k in exe._stage.bufs]
            assert any(isinstance(k, int) for k in staged) and "ids" in staged and "pos" in staged
    for a, b in zip(runs["raw"], runs["jax"]):
        np.testing.assert_array_equal(a, b)


def test_spin_settings_defaults():
    """Idle CPU workers' (spin, yield) microseconds: a short spin at the hand-offs of partition by
    partition steps, the pool's own defaults between a fused step's host calls."""
    from strata_compiler import settings
    from strata_compiler.backends.llvm_cpu.pool import _DEFAULT_SPIN_US, _DEFAULT_YIELD_US

    assert settings.get("hand_off_spin_us") == (30.0, 30.0)
    assert settings.get("fused_spin_us") == (_DEFAULT_SPIN_US, _DEFAULT_YIELD_US)
