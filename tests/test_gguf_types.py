"""Every GGUF tensor type a user meets, compiled as `--quant auto` takes it, against gguf-py's own
dequantization: stored bit for bit (Q4_0, Q4_1, Q8_0, BF16; F16 exactly as f32), or converted to a
format whose error against the file is smaller than the file's own error against the f32 weights
it was made from (KL of next-token distributions on a small llama, reference backend).

gguf-py quantizes only the legacy types, so each file here is random blocks of the type's own
structure (every bit pattern is a valid block; the f16 scales set to a weight-like magnitude) and
its "f32 origin" is those values moved by a uniform amount within half a quantization step of
their sub-block (the error a rounding quantizer leaves): the file's own KL is that origin's.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file, save_file

from hf_models import build_model
from test_gguf_frontend import SPECIALS, gguf_name, permute, train_tokenizer

# type -> (values per sub-block, levels per sub-block, byte offsets of its f16 scale fields)
RANDOM = {
    QT.Q2_K: (16, 4, (80, 82)), QT.Q3_K: (16, 8, (108,)), QT.Q4_K: (32, 16, (0, 2)), QT.Q5_K: (32, 32, (0, 2)),
    QT.Q6_K: (16, 64, (208,)), QT.IQ4_NL: (32, 16, (0,)), QT.IQ4_XS: (32, 16, (0,)),
}
# types gguf-py quantizes itself (the origin is then the checkpoint's own f32)
LEGACY = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.F16, QT.BF16)
STORED = {QT.Q4_0: "int4", QT.Q4_1: "int4a", QT.Q8_0: "int8", QT.F16: "f32", QT.BF16: "bf16"}
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _random_file_values(qt: QT, shape: tuple[int, int], std: float, rng) -> np.ndarray:
    """Random blocks of type qt for a [N, K] tensor, the f16 fields scaled so the values' std is `std`."""
    qk, nbytes = gguf.GGML_QUANT_SIZES[qt]
    n = shape[0] * shape[1] // qk
    blocks = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    fields = RANDOM[qt][2]
    for off in fields:
        blocks[:, off:off + 2] = np.full((n, 1), 1.0, np.float16).view(np.uint8)
    scale = std / dequantize(blocks, qt).std()
    for off in fields:
        v = blocks[:, off:off + 2].copy().view(np.float16).astype(np.float32) * scale
        blocks[:, off:off + 2] = v.astype(np.float16).view(np.uint8)
    return blocks.reshape(shape[0], -1)


def _origin(values: np.ndarray, sub: int, levels: int, rng) -> np.ndarray:
    """values moved uniformly within half a step of their sub-block's grid ((max - min) / (levels - 1))."""
    g = values.reshape(-1, sub)
    step = (g.max(axis=1, keepdims=True) - g.min(axis=1, keepdims=True)) / (levels - 1)
    return (g + rng.uniform(-0.5, 0.5, g.shape).astype(np.float32) * step).reshape(values.shape).astype(np.float32)


def _write(path, cfg: dict, tensors: dict[str, tuple[np.ndarray, QT]], tokens, merges) -> None:
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["hidden_size"] // H)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    for name, (data, qt) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_types")
    _, tokens, merges = train_tokenizer()
    d = build_model("llama", root / "hf", vocab_size=len(tokens), hidden_size=256, intermediate_size=512,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, seed=5)
    ids = np.random.default_rng(0).integers(0, len(tokens), (2, 24))
    return root, d, tokens, merges, ids


def _compile(src, out, *flags):
    from strata_compiler.cli import stratac
    from test_gguf_frontend import run_cli

    assert run_cli(stratac, ["compile", str(src), "-o", str(out), *flags]) == 0
    return out


def _logits(plan_dir, ids) -> np.ndarray:
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.runtime.session import Session

    return Session(load_plan(plan_dir), "reference").generate(ids, 1, Sampler(0.0))[0]


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    def logp(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    lp, lq = logp(p_logits), logp(q_logits)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


@pytest.mark.parametrize("qt", list(LEGACY) + list(RANDOM), ids=lambda q: q.name)
def test_each_type_is_stored_or_converted_within_the_files_own_error(base, tmp_path, qt, capsys):
    root, d, tokens, merges, ids = base
    cfg = json.loads((d / "config.json").read_text())
    sd = load_file(str(d / "model.safetensors"))
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rng = np.random.default_rng(int(qt))
    tensors, origin, file_values = {}, {}, {}
    for key, a in sd.items():
        a = a.astype(np.float32)
        name = gguf_name(key)
        if not any(p in key for p in LINEAR):
            tensors[name] = (a, QT.F32)
            origin[key] = file_values[key] = a
            continue
        if qt in RANDOM:
            sub, levels, _ = RANDOM[qt]
            blocks = _random_file_values(qt, a.shape, float(a.std()), rng)
            f = dequantize(blocks, qt).astype(np.float32).reshape(a.shape)
            origin[key], file_values[key] = _origin(f, sub, levels, rng), f
        else:
            blocks = quantize(np.ascontiguousarray(a), qt)
            origin[key] = a
            file_values[key] = dequantize(blocks, qt).astype(np.float32).reshape(a.shape)
        heads = H if name.endswith("attn_q.weight") else KV if name.endswith("attn_k.weight") else 0
        if heads:
            blocks = permute(blocks, H, None if heads == H else KV)
        tensors[name] = (blocks, qt)
    _write(tmp_path / "f.gguf", cfg, tensors, tokens, merges)
    (tmp_path / "origin").mkdir()
    (tmp_path / "origin" / "config.json").write_text(json.dumps(cfg))
    save_file(origin, str(tmp_path / "origin" / "model.safetensors"))
    ref = _logits(_compile(tmp_path / "origin", tmp_path / "p_origin", "--quant", "f32"), ids)
    file = _logits(_compile(tmp_path / "f.gguf", tmp_path / "p_file", "--quant", "f32"), ids)
    capsys.readouterr()
    auto = _compile(tmp_path / "f.gguf", tmp_path / "p_auto")
    out = capsys.readouterr().out
    conv = _logits(auto, ids)
    own, cost = _kl(ref, file), _kl(file, conv)
    print(f"{qt.name}: the file's own KL {own:.3g}, the conversion's {cost:.3g}")
    assert own > 0 or qt in (QT.F16, QT.BF16)
    from strata_compiler.runtime.plan import load_plan

    fmts = {w.fmt for w in load_plan(auto).graph.weights if any(p in w.name for p in (".attn.", ".mlp."))
            and len(w.shape) == 2}
    if qt in STORED:          # the file's own values, bit for bit
        assert fmts == {STORED[qt]}
        assert cost == 0.0 and "requantized" not in out
    else:
        assert "requantized from the file's types" in out
        assert cost <= own, f"{qt.name} -> {fmts}: the conversion's KL {cost:.3g} > the file's own {own:.3g}"
