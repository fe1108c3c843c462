"""examples/make_demo_model.py: deterministic, self-consistent Qwen3-MoE demo folder."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy for safetensors)
import numpy as np
import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def _load_module():
    spec = importlib.util.spec_from_file_location(
        "make_demo_model", ROOT / "examples" / "make_demo_model.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_demo_model", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def demo_dirs(tmp_path_factory):
    mod = _load_module()
    a = mod.make_demo_model(tmp_path_factory.mktemp("demo_a"), seed=0, quiet=True)
    b = mod.make_demo_model(tmp_path_factory.mktemp("demo_b"), seed=0, quiet=True)
    return Path(a), Path(b)


EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


def test_deterministic_bytes(demo_dirs):
    a, b = demo_dirs
    names = {p.name for p in a.iterdir()}
    assert names == EXPECTED_FILES
    assert names == {p.name for p in b.iterdir()}
    for name in sorted(names):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_seed_changes_weights_only(tmp_path, demo_dirs):
    mod = _load_module()
    c = Path(mod.make_demo_model(tmp_path / "seed1", seed=1, quiet=True))
    a = demo_dirs[0]
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    assert (a / "config.json").read_bytes() == (c / "config.json").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_config_matches_tensors(demo_dirs):
    d = demo_dirs[0]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["model_type"] == "qwen3_moe"
    assert cfg["dtype"] == "bfloat16"
    assert cfg["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert cfg["tie_word_embeddings"] is False and cfg["attention_bias"] is False
    assert cfg["hidden_act"] == "silu" and cfg["norm_topk_prob"] is True
    assert cfg["decoder_sparse_step"] == 1 and cfg["mlp_only_layers"] == []

    V, D = cfg["vocab_size"], cfg["hidden_size"]
    H, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    E, I, L = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["num_hidden_layers"]
    assert (D, H, KV, hd, E, I, L) == (256, 8, 2, 32, 8, 128, 4)
    assert cfg["num_experts_per_tok"] == 2 and cfg["intermediate_size"] == 512

    expected = {
        "model.embed_tokens.weight": (V, D),
        "model.norm.weight": (D,),
        "lm_head.weight": (V, D),
    }
    for i in range(L):
        p = f"model.layers.{i}."
        expected.update({
            p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (H * hd, D),
            p + "self_attn.k_proj.weight": (KV * hd, D),
            p + "self_attn.v_proj.weight": (KV * hd, D),
            p + "self_attn.o_proj.weight": (D, H * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate.weight": (E, D),
        })
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            expected.update({
                q + "gate_proj.weight": (I, D),
                q + "up_proj.weight": (I, D),
                q + "down_proj.weight": (D, I),
            })

    with safe_open(str(d / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(expected)
        for name, shape in expected.items():
            t = f.get_tensor(name)
            assert t.shape == shape, name
            assert t.dtype == np.dtype(ml_dtypes.bfloat16), name
            x = t.astype(np.float32)
            assert np.isfinite(x).all(), name
            if name.endswith("norm.weight"):
                assert abs(float(x.mean()) - 1.0) < 0.1, name
            else:
                assert 0.0 < float(x.std()) < 2.0, name

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == V
    assert 1024 <= V <= 2048
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert 0 <= cfg[key] < V
    assert tok.id_to_token(cfg["eos_token_id"]) == "<|endoftext|>"
    gen = json.loads((d / "generation_config.json").read_text())
    assert all(0 <= i < V for i in gen["eos_token_id"])
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] == "<|endoftext|>"


@pytest.mark.parametrize(
    "text",
    [
        "The keeper climbed the tower and lit the lamp.",
        "Zebras quietly juggle 2048 kiwis: naïve café — ok? <|endoftext|>",
    ],
)
def test_tokenizer_round_trip(demo_dirs, text):
    tok = Tokenizer.from_file(str(demo_dirs[0] / "tokenizer.json"))
    enc = tok.encode(text)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    if "<|endoftext|>" not in text:
        # Trained merges actually compress in-domain English.
        assert len(enc.ids) < len(text.encode("utf-8")) / 2


@pytest.mark.slow
def test_loads_in_transformers(demo_dirs):
    """Oracle check (test-only deps): transformers loads every weight and decodes sensibly."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d = str(demo_dirs[0])
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.config.num_experts == 8 and model.config.rope_parameters["rope_theta"] == 10000.0
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ids = tok("The lighthouse stood on", return_tensors="pt").input_ids
    assert ids[0].tolist() == Tokenizer.from_file(d + "/tokenizer.json").encode(
        "The lighthouse stood on").ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    assert len(set(new)) > 2  # not a single repeated token
