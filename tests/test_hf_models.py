"""Tests of the test-side oracle (tests/hf_models.py) itself."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file

from hf_models import (
    ARCHS,
    build_model,
    checkpoint_tensors,
    clear_prompts,
    hf_greedy,
    hf_logits,
    load_model,
    quantize_dequantize_model,
    step_gaps,
)
from strata_compiler.formats import get_format, quantizes


def _load_checkpoint(path) -> dict[str, np.ndarray]:
    """All tensors of a (possibly sharded) safetensors checkpoint, as f32 numpy."""
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out: dict[str, np.ndarray] = {}
    for f in files:
        with safe_open(str(path / f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k).to(torch.float32).numpy()
    return out


@pytest.fixture(scope="module", params=ARCHS)
def built(request, tmp_path_factory):
    arch = request.param
    path = build_model(arch, tmp_path_factory.mktemp(arch))
    return arch, path, load_model(path)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = build_model("qwen2_moe", tmp_path_factory.mktemp("qwen2_ref"))
    return path, load_model(path)


# ---------------------------------------------------------------------------------------------
# build / load / logits


def test_build_save_reload_logits(built):
    arch, path, model = built
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    assert not (path / "tokenizer.json").exists()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == arch
    assert cfg["rope_parameters"]["rope_theta"] == 10000.0
    assert cfg["hidden_size"] == 64 and cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
    v = cfg["vocab_size"]
    assert 96 <= v <= 128
    for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert cfg.get(tok) is None or 0 <= cfg[tok] < v
    assert next(model.parameters()).dtype == torch.float32 and not model.training

    ids = np.random.default_rng(0).integers(0, v, size=(2, 12))
    logits = hf_logits(model, ids)
    assert logits.shape == (2, 12, v) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert logits.std(axis=-1).min() > 1.0  # far from uniform
    # Rows are independent: batch of two == each alone.
    np.testing.assert_allclose(logits[1:], hf_logits(model, ids[1:]), atol=1e-4, rtol=1e-4)


def test_norms_and_biases_perturbed(built):
    arch, path, _ = built
    ck = load_file(str(path / "model.safetensors"))
    norms = [k for k in ck if "norm" in k]
    biases = [k for k in ck if k.endswith(".bias")]
    assert norms
    for k in norms:
        assert np.abs(ck[k] - 1.0).max() > 0.1, k
    for k in biases:
        assert np.abs(ck[k]).min() > 0 and np.abs(ck[k]).max() > 0.1, k
    assert bool(biases) == (arch == "qwen2_moe")


def test_arch_specifics(built):
    arch, path, model = built
    ck = load_file(str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    shapes = {k: v.shape for k, v in ck.items()}
    if arch == "llama":
        assert not any("bias" in k for k in ck)
        assert shapes["model.layers.0.mlp.gate_proj.weight"] == (96, 64)
    elif arch == "mixtral":
        assert "head_dim" in cfg and cfg["head_dim"] is None
        assert cfg["num_local_experts"] == 4 and cfg["num_experts_per_tok"] == 2
        assert shapes["model.layers.0.block_sparse_moe.gate.weight"] == (4, 64)
        assert shapes["model.layers.1.block_sparse_moe.experts.3.w1.weight"] == (40, 64)
        assert shapes["model.layers.1.block_sparse_moe.experts.3.w3.weight"] == (40, 64)
        assert shapes["model.layers.1.block_sparse_moe.experts.3.w2.weight"] == (64, 40)
    elif arch == "qwen2_moe":
        assert cfg["mlp_only_layers"] == [1] and cfg["num_hidden_layers"] == 3
        for p in ("q", "k", "v"):
            assert f"model.layers.0.self_attn.{p}_proj.bias" in ck
        assert "model.layers.0.self_attn.o_proj.bias" not in ck
        assert shapes["model.layers.1.mlp.gate_proj.weight"] == (80, 64)  # dense layer
        assert not any(k.startswith("model.layers.1.mlp.experts") for k in ck)
        assert "model.layers.1.mlp.shared_expert_gate.weight" not in ck
        for layer in (0, 2):
            assert shapes[f"model.layers.{layer}.mlp.experts.5.gate_proj.weight"] == (24, 64)
            assert shapes[f"model.layers.{layer}.mlp.shared_expert.up_proj.weight"] == (40, 64)
            assert shapes[f"model.layers.{layer}.mlp.shared_expert_gate.weight"] == (1, 64)
    elif arch == "qwen3_moe":
        assert cfg["head_dim"] == 24 and cfg["norm_topk_prob"] is True
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (96, 64)
        assert shapes["model.layers.0.self_attn.k_proj.weight"] == (48, 64)
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 96)
        assert shapes["model.layers.0.self_attn.q_norm.weight"] == (24,)
        assert shapes["model.layers.1.mlp.experts.7.down_proj.weight"] == (64, 32)
    elif arch == "olmoe":
        assert cfg["norm_topk_prob"] is False
        assert shapes["model.layers.0.self_attn.q_norm.weight"] == (64,)
        assert shapes["model.layers.0.self_attn.k_norm.weight"] == (32,)
        assert shapes["model.layers.0.mlp.experts.5.up_proj.weight"] == (48, 64)


def test_sharded_checkpoint(tmp_path, qwen2):
    ref_path, ref_model = qwen2
    path = build_model("qwen2_moe", tmp_path / "sharded", shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (path / "model.safetensors").exists()
    for s in shards:
        assert (path / s).exists()
    ref = load_file(str(ref_path / "model.safetensors"))
    got = _load_checkpoint(path)
    assert set(got) == set(ref) == set(index["weight_map"])
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)  # same seed -> same weights
    ids = np.arange(10, dtype=np.int64)[None]
    np.testing.assert_allclose(hf_logits(load_model(path), ids), hf_logits(ref_model, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tdtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_low_precision_checkpoint(tmp_path, qwen2, dtype, tdtype):
    ref_path, ref_model = qwen2
    path = build_model("qwen2_moe", tmp_path / dtype, dtype=dtype)
    assert json.loads((path / "config.json").read_text())["dtype"] == dtype
    ref = load_file(str(ref_path / "model.safetensors"))
    with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
        assert set(fh.keys()) == set(ref)
        for k in fh.keys():
            t = fh.get_tensor(k)
            assert t.dtype == tdtype, k
            # The same weights, rounded.
            np.testing.assert_array_equal(t.numpy() if tdtype == torch.float16 else t.float().numpy(),
                                          torch.from_numpy(ref[k]).to(tdtype).float().numpy())
    model = load_model(path)
    assert next(model.parameters()).dtype == torch.float32
    ids = np.arange(8, dtype=np.int64)[None]
    a, b = hf_logits(model, ids), hf_logits(ref_model, ids)
    assert np.isfinite(a).all() and np.abs(a - b).max() < 0.5


def test_tied_embeddings(tmp_path):
    path = build_model("llama", tmp_path / "tied", tie_word_embeddings=True)
    ck = load_file(str(path / "model.safetensors"))
    assert "lm_head.weight" not in ck and "model.embed_tokens.weight" in ck
    model = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in checkpoint_tensors(model)
    logits = hf_logits(model, np.arange(6, dtype=np.int64)[None])
    assert np.isfinite(logits).all() and logits.std() > 1.0
    before = model.model.embed_tokens.weight.detach().clone()
    quantize_dequantize_model(model, "int4")
    assert torch.equal(model.model.embed_tokens.weight, before)  # embeddings / tied head stay f32


def test_overrides_and_seed(tmp_path):
    a = build_model("olmoe", tmp_path / "a", num_hidden_layers=3, seed=5)
    b = build_model("olmoe", tmp_path / "b", seed=6)
    assert json.loads((a / "config.json").read_text())["num_hidden_layers"] == 3
    ka, kb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert "model.layers.2.mlp.gate.weight" in ka and "model.layers.2.mlp.gate.weight" not in kb
    assert not np.array_equal(ka["model.embed_tokens.weight"], kb["model.embed_tokens.weight"])
    with pytest.raises(ValueError):
        build_model("gpt2", tmp_path / "c")


# ---------------------------------------------------------------------------------------------
# greedy decoding and clear prompts


def test_hf_greedy_matches_recompute(built):
    _, _, model = built
    v = model.config.vocab_size
    prompt = np.random.default_rng(1).integers(0, v, size=(2, 7))
    n = 5
    tokens, step_logits = hf_greedy(model, prompt, n)
    assert tokens.shape == (2, n) and tokens.dtype == np.int64
    assert step_logits.shape == (2, n, v) and step_logits.dtype == np.float32
    np.testing.assert_array_equal(tokens, step_logits.argmax(-1))
    for i in range(n):
        seq = np.concatenate([prompt, tokens[:, :i]], axis=1)
        ref = hf_logits(model, seq)[:, -1]
        np.testing.assert_allclose(step_logits[:, i], ref, atol=1e-4, rtol=1e-4)
        np.testing.assert_array_equal(tokens[:, i], ref.argmax(-1))


def test_hf_greedy_does_not_stop_at_eos(qwen2):
    _, model = qwen2
    prompt = np.arange(3, 9, dtype=np.int64)[None]
    tokens, _ = hf_greedy(model, prompt, 6)
    old = (model.config.eos_token_id, model.generation_config.eos_token_id)
    model.config.eos_token_id = model.generation_config.eos_token_id = int(tokens[0, 0])
    try:
        again, logits = hf_greedy(model, prompt, 6)
    finally:
        model.config.eos_token_id, model.generation_config.eos_token_id = old
    np.testing.assert_array_equal(again, tokens)
    assert logits.shape[1] == 6


@pytest.mark.parametrize("batch", [1, 2])
def test_clear_prompts(qwen2, batch):
    _, model = qwen2
    v = model.config.vocab_size
    prompts = clear_prompts(model, v, n_prompts=3, length=6, n_new=8, rel_gap=0.05, seed=3, batch=batch)
    assert len(prompts) == 3
    rows = set()
    for p in prompts:
        assert p.shape == (batch, 6) and p.dtype == np.int64
        assert p.min() >= 0 and p.max() < v
        _, logits = hf_greedy(model, p, 9)  # prompt's last position + 8 generated tokens
        assert (step_gaps(logits) >= 0.05).all()
        rows.update(map(tuple, p))
    assert len(rows) == 3 * batch
    again = clear_prompts(model, v, n_prompts=3, length=6, n_new=8, rel_gap=0.05, seed=3, batch=batch)
    assert all(np.array_equal(a, b) for a, b in zip(prompts, again))


def test_clear_prompts_raises_when_impossible(qwen2):
    _, model = qwen2
    with pytest.raises(RuntimeError, match="clear_prompts"):
        clear_prompts(model, model.config.vocab_size, n_prompts=1, length=4, n_new=2, rel_gap=1e6, max_candidates=16)


# ---------------------------------------------------------------------------------------------
# checkpoint mapping and quantize/dequantize


def test_checkpoint_tensors_match_saved_checkpoint(built):
    _, path, model = built
    ck = load_file(str(path / "model.safetensors"))
    live = checkpoint_tensors(model)
    assert set(live) == set(ck)
    for k, v in ck.items():
        np.testing.assert_array_equal(live[k].numpy(), v, err_msg=k)


@pytest.mark.parametrize("fmt", ["int4", "int8", "bf16"])
def test_quantize_dequantize_model_matches_numpy(built, tmp_path, fmt):
    arch, path, _ = built
    model = load_model(path)  # a private copy: quantization is in place
    ck = load_file(str(path / "model.safetensors"))
    f = get_format(fmt)
    expected = {k: f.roundtrip(v, 32) if quantizes(k) else v for k, v in ck.items()}
    n_quantized = sum(quantizes(k) for k in ck)
    assert n_quantized >= 7 * model.config.num_hidden_layers  # attention + MLP/expert matrices
    quantize_dequantize_model(model, fmt, group_size=32)
    model.save_pretrained(tmp_path / "q", safe_serialization=True)
    got = load_file(str(tmp_path / "q" / "model.safetensors"))
    assert set(got) == set(expected)
    for k in expected:
        np.testing.assert_array_equal(got[k], expected[k], err_msg=k)
        if quantizes(k) and fmt == "int4":
            assert not np.array_equal(got[k], ck[k]), k  # the roundtrip really changed it
    # The quantized model still runs and stays close to the original.
    ids = np.arange(8, dtype=np.int64)[None] % model.config.vocab_size
    q_logits = hf_logits(model, ids)
    assert np.isfinite(q_logits).all()
