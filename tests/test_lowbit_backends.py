"""The low-bit formats (int4a, int3, int2, fp8) through every backend, end to end: each backend
runs the same plan as transformers on the same quantize-dequantized weights (llvm on its exact
f32-activation path: int4a's default q8 activations are checked in test_llvm_linear_moe.py)."""

from __future__ import annotations

import numpy as np
import pytest

from hf_models import build_model, clear_prompts, hf_greedy, hf_logits, load_model, quantize_dequantize_model
from test_e2e_transformers import compile_plan, run_plan

FORMATS = ["int4a", "int3", "int2", "fp8"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen3_moe", tmp_path_factory.mktemp("lowbit") / "model")


@pytest.fixture(scope="module", params=FORMATS)
def quantized(request, model_dir, tmp_path_factory):
    fmt = request.param
    model = load_model(model_dir)
    quantize_dequantize_model(model, fmt, 32)
    ids = clear_prompts(model, model.config.vocab_size, n_prompts=1, length=6, n_new=8, seed=2)[0]
    plan = tmp_path_factory.mktemp(fmt) / "plan"
    compile_plan(model_dir, plan, "--quant", fmt)
    return fmt, plan, ids, hf_logits(model, ids), hf_greedy(model, ids, 8)[0]


@pytest.mark.parametrize("backend", ["reference", "llvm", "xla"])
def test_lowbit_plan_matches_transformers_on_dequantized_weights(quantized, backend, tmp_path, monkeypatch):
    fmt, plan, ids, ref, ref_tokens = quantized
    monkeypatch.setenv("STRATA_CPU_ACT", "f32")
    logits, tokens = run_plan(plan, ids, tmp_path, n_new=8, backend=backend)
    err = np.abs(logits - ref).max() / ref.std()
    assert err <= 1e-4, f"{fmt} on {backend}: {err:.2e} x std"
    np.testing.assert_array_equal(tokens, ref_tokens)


@pytest.fixture(scope="module")
def quantized_embedding(tmp_path_factory):
    """A tied Llama with its embedding table (and so its lm_head) at int4a, the rest int3
    (formats whose llvm kernels take f32 activations, so 1e-4 holds)."""
    model_dir = build_model("llama", tmp_path_factory.mktemp("tied") / "model", tie_word_embeddings=True)
    model = load_model(model_dir)
    quantize_dequantize_model(model, "int3", 32, embed_fmt="int4a")
    ids = clear_prompts(model, model.config.vocab_size, n_prompts=1, length=6, n_new=8, seed=3)[0]
    plan = tmp_path_factory.mktemp("tied_plan") / "plan"
    compile_plan(model_dir, plan, "--quant", "int3", "--tensor-format", "^embed$=int4a")
    return plan, ids, hf_logits(model, ids), hf_greedy(model, ids, 8)[0]


@pytest.mark.parametrize("backend", ["reference", "llvm", "xla"])
def test_quantized_embedding_table_matches_transformers(quantized_embedding, backend, tmp_path, monkeypatch):
    plan, ids, ref, ref_tokens = quantized_embedding
    monkeypatch.setenv("STRATA_CPU_ACT", "f32")
    logits, tokens = run_plan(plan, ids, tmp_path, n_new=8, backend=backend)
    err = np.abs(logits - ref).max() / ref.std()
    assert err <= 1e-4, f"int4a embedding on {backend}: {err:.2e} x std"
    np.testing.assert_array_equal(tokens, ref_tokens)
