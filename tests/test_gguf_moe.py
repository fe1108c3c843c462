"""MoE GGUF input: Mixtral (llama with experts), Qwen3-MoE, Qwen2-MoE (shared expert, q/k/v biases)
and OLMoE files written with gguf.GGUFWriter from random transformers models, laid out as llama.cpp's
convert_hf_to_gguf.py writes them (experts stacked per projection, q/k rows permuted for llama),
compiled by stratac and checked against transformers: F32 within 1e-4 x std with the same greedy
tokens; Q8_0, Q4_0, F16 and Q4_K experts against transformers run on the file's own dequantized
weights; Q4_0/Q8_0 stored as they are, and a Q4_0 file's plan byte-identical to the HF folder's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from hf_models import build_model, clear_prompts, hf_greedy, hf_logits, load_model  # noqa: E402
from test_gguf_frontend import (BLOCK, HF_TO_GGUF, N_NEW, SPECIALS, compile_ok, inverse_permute,  # noqa: E402
                                permute, run_logits, train_tokenizer)

from strata_compiler.frontend.gguf_reader import open_gguf  # noqa: E402
from strata_compiler.frontend.hf import read_config  # noqa: E402

# per-architecture: (GGUF architecture, the layer's MoE prefix, HF names of gate/up/down, q/k permuted)
ARCHS = {
    "mixtral": ("llama", "block_sparse_moe.", ("w1", "w3", "w2"), True),
    "qwen3_moe": ("qwen3moe", "mlp.", ("gate_proj", "up_proj", "down_proj"), False),
    "qwen2_moe": ("qwen2moe", "mlp.", ("gate_proj", "up_proj", "down_proj"), False),
    "olmoe": ("olmoe", "mlp.", ("gate_proj", "up_proj", "down_proj"), False),
}
EXTRA = {    # HF key (after the layer prefix) -> GGUF name, beyond test_gguf_frontend's BLOCK
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
STACKS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def _block_name(rest: str, pre: str) -> str | None:
    if rest in BLOCK:
        return BLOCK[rest]
    if rest == pre + "gate.weight":
        return "ffn_gate_inp.weight"
    return EXTRA.get(rest)


def write_moe_gguf(path: Path, hf_dir: Path, hf_arch: str, tokens, merges, qtype=QT.F32) -> dict[str, np.ndarray]:
    """The HF folder's checkpoint as a GGUF of `hf_arch`, experts stacked (in `qtype`, the rest F32);
    returns {HF key: f32 weight as stored, back in HF layout}."""
    arch, pre, names, permuted = ARCHS[hf_arch]
    c = json.loads((hf_dir / "config.json").read_text())
    sd = load_file(str(hf_dir / "model.safetensors"))
    H, KV, L = c["num_attention_heads"], c["num_key_value_heads"], c["num_hidden_layers"]
    E = c.get("num_local_experts") or c["num_experts"]
    hd = c.get("head_dim") or c["hidden_size"] // H
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(float((c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    w.add_rope_dimension_count(hd)
    w.add_expert_count(E)
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    stored: dict[str, np.ndarray] = {}

    def put(name: str, a: np.ndarray, qt=QT.F32, heads: int = 0):
        if heads:
            a = permute(a, H, None if heads == H else KV)
        if qt == QT.Q4_K:       # gguf-py cannot quantize K-quants: random blocks of valid structure
            data = _random_q4_k(a.shape)
        else:
            data = quantize(np.ascontiguousarray(a), qt)
        w.add_tensor(name, data, raw_dtype=qt)
        back = dequantize(data, qt).astype(np.float32).reshape(a.shape)
        return inverse_permute(back, heads) if heads else back

    for key, a in sd.items():
        if key in HF_TO_GGUF:
            stored[key] = put(HF_TO_GGUF[key], a.astype(np.float32))
            continue
        parts = key.split(".")
        i, rest = parts[2], ".".join(parts[3:])
        if ".experts." in rest:
            continue
        name = _block_name(rest, pre)
        heads = (H if name == "attn_q.weight" else KV if name == "attn_k.weight" else 0) if permuted else 0
        stored[key] = put(f"blk.{i}.{name}", a.astype(np.float32), heads=heads)
    for i in range(L):
        for proj, stack in zip(names, STACKS):
            keys = [f"model.layers.{i}.{pre}experts.{e}.{proj}.weight" for e in range(E)]
            if keys[0] not in sd:       # a dense layer (Qwen's mlp_only_layers)
                continue
            back = put(f"blk.{i}.{stack}", np.stack([sd[k].astype(np.float32) for k in keys]), qtype)
            for e, k in enumerate(keys):
                stored[k] = back[e]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _random_q4_k(shape) -> np.ndarray:
    """Q4_K blocks (f16 d and dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles per 256
    values) for a tensor of `shape`, random but of sane magnitude: a K-quant tensor as a file
    holds it."""
    *lead, k = shape
    n = int(np.prod(lead)) * (k // 256)
    rng = np.random.default_rng(n)
    blocks = rng.integers(0, 256, (n, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full((n, 1), 0.002, np.float16).view(np.uint8)
    blocks[:, 2:4] = np.full((n, 1), 0.001, np.float16).view(np.uint8)
    return blocks.reshape(*lead, (k // 256) * 144)


def hf_with(hf_dir: Path, weights: dict[str, np.ndarray], out: Path) -> Path:
    """A copy of the HF folder holding `weights` (the GGUF's dequantized tensors)."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(hf_dir / "config.json", out / "config.json")
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    base = tmp_path_factory.mktemp("gguf_moe")
    _, tokens, merges = train_tokenizer()
    out = {"tokens": tokens, "merges": merges, "base": base}
    for hf_arch in ARCHS:
        d = build_model(hf_arch, base / f"hf_{hf_arch}", vocab_size=len(tokens), seed=7)
        write_moe_gguf(base / f"{hf_arch}.gguf", d, hf_arch, tokens, merges)
        out[hf_arch] = d
    return out


@pytest.mark.parametrize("hf_arch", list(ARCHS))
def test_config_matches_hf(moe, hf_arch):
    _, cfg, _ = open_gguf(moe["base"] / f"{hf_arch}.gguf")
    hf = read_config(moe[hf_arch])
    for f in ("arch", "architecture", "vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim",
              "rms_eps", "moe_layers", "n_experts", "top_k", "norm_topk_prob", "qk_norm", "qkv_bias", "o_bias",
              "shared_expert"):
        assert getattr(cfg, f) == getattr(hf, f), f


@pytest.mark.parametrize("hf_arch,backend", [("mixtral", "reference"), ("mixtral", "llvm"), ("qwen3_moe", "reference"),
                                             ("qwen2_moe", "reference"), ("olmoe", "reference")])
def test_f32_moe_gguf_matches_transformers(moe, tmp_path, hf_arch, backend):
    m = load_model(moe[hf_arch])
    ids = clear_prompts(m, m.config.vocab_size, n_prompts=1, length=7, n_new=N_NEW, batch=2)[0]
    plan = compile_ok(moe["base"] / f"{hf_arch}.gguf", tmp_path / "plan", "--quant", "f32")
    logits, tokens = run_logits(plan, ids, tmp_path, backend)
    ref = hf_logits(m, ids)
    assert np.abs(logits - ref).max() / ref.std() <= 1e-4
    np.testing.assert_array_equal(tokens, hf_greedy(m, ids, N_NEW)[0])


@pytest.mark.parametrize("qtype,width,seed", [(QT.Q8_0, 64, 3), (QT.Q4_0, 64, 3), (QT.F16, 64, 3), (QT.Q4_K, 256, 4)])
def test_quantized_experts_match_transformers_on_dequantized_weights(moe, tmp_path, qtype, width, seed):
    """Q8_0, Q4_0, F16 and Q4_K (Q4_K_M files' kind) experts, dequantized as gguf-py does, match
    transformers on those weights (--quant f32 keeps them exactly). Rows are whole blocks: 64
    values, 256 for the K-quant."""
    path = tmp_path / "q.gguf"
    dims = dict(intermediate_size=width) if width == 64 else dict(hidden_size=width, intermediate_size=width)
    d = build_model("mixtral", tmp_path / "hf", vocab_size=len(moe["tokens"]), seed=seed + 6, **dims)
    stored = write_moe_gguf(path, d, "mixtral", moe["tokens"], moe["merges"], qtype)
    ref_model = load_model(hf_with(d, stored, tmp_path / "hf_deq"))
    ids = clear_prompts(ref_model, ref_model.config.vocab_size, n_prompts=1, length=7, n_new=N_NEW, seed=seed)[0]
    plan = compile_ok(path, tmp_path / "plan", "--quant", "f32")
    logits, tokens = run_logits(plan, ids, tmp_path, "reference")
    ref = hf_logits(ref_model, ids)
    assert np.abs(logits - ref).max() / ref.std() <= 1e-4
    np.testing.assert_array_equal(tokens, hf_greedy(ref_model, ids, N_NEW)[0])


def test_q4_0_q4_1_and_q8_0_are_stored_as_they_are(moe, tmp_path):
    """A GGUF's Q4_0 / Q4_1 / Q8_0 experts compile to --quant int4 / int4a / int8 without a second
    rounding: the plan's expert arrays are the file's blocks (f16 scale, or Q4_1's f16 scale and
    minimum, then the 16 nibble bytes / 32 int8), split into Strata's qs and scales."""
    from strata_compiler.plan_format import WEIGHTS_MAGIC, Container

    d = build_model("mixtral", tmp_path / "hf", vocab_size=len(moe["tokens"]), intermediate_size=64, seed=9)
    sd = load_file(str(d / "model.safetensors"))
    for qt, fmt, block, head in ((QT.Q4_0, "int4", 18, 2), (QT.Q4_1, "int4a", 20, 4), (QT.Q8_0, "int8", 34, 2)):
        write_moe_gguf(tmp_path / f"{fmt}.gguf", d, "mixtral", moe["tokens"], moe["merges"], qt)
        for plan in (compile_ok(tmp_path / f"{fmt}.gguf", tmp_path / fmt, "--quant", fmt),
                     compile_ok(tmp_path / f"{fmt}.gguf", tmp_path / f"{fmt}-auto")):
            with Container.open(plan / "weights.bin", WEIGHTS_MAGIC) as c:
                qs, sc = np.array(c.section("L1.moe.down:qs")), np.array(c.section("L1.moe.down:scales"))
            E, D = 4, sd["model.layers.1.block_sparse_moe.experts.0.w2.weight"].shape[0]
            raw = np.stack([quantize(sd[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"].astype(np.float32),
                                     qt) for e in range(E)]).reshape(E, D, -1, block)
            np.testing.assert_array_equal(sc.view(np.uint8).reshape(E, D, -1, head), raw[..., :head])
            np.testing.assert_array_equal(qs.view(np.uint8).reshape(E, D, -1, block - head), raw[..., head:])


def test_placed_gguf_plan_matches_transformers(moe, tmp_path):
    """A GGUF-sourced plan placed like an HF one (experts on the CPU, the rest on the "GPU": JAX's
    CPU platform here) runs mixed and still matches transformers."""
    m = load_model(moe["mixtral"])
    ids = clear_prompts(m, m.config.vocab_size, n_prompts=1, length=7, n_new=N_NEW, batch=1)[0]
    plan = compile_ok(moe["base"] / "mixtral.gguf", tmp_path / "plan", "--quant", "f32", "--place",
                      "experts=cpu,all=gpu")
    logits, tokens = run_logits(plan, ids, tmp_path, "auto")
    ref = hf_logits(m, ids)
    assert np.abs(logits - ref).max() / ref.std() <= 1e-4
    np.testing.assert_array_equal(tokens, hf_greedy(m, ids, N_NEW)[0])


def test_q4_0_gguf_stores_the_bytes_an_hf_int4_compile_does(moe, tmp_path):
    """Q4_0 experts are taken as they are (Strata's int4 is Q4_0 bit for bit, quantizer included):
    the plan of the GGUF and the plan of the HF folder it was made from hold the same weight bytes."""
    from strata_compiler.plan_format import WEIGHTS_MAGIC, Container

    d = build_model("mixtral", tmp_path / "hf", vocab_size=len(moe["tokens"]), intermediate_size=64, seed=9)
    write_moe_gguf(tmp_path / "q.gguf", d, "mixtral", moe["tokens"], moe["merges"], QT.Q4_0)
    plans = [compile_ok(tmp_path / "q.gguf", tmp_path / "g", "--quant", "int4"),
             compile_ok(d, tmp_path / "h", "--quant", "int4")]
    secs = []
    for p in plans:
        with Container.open(p / "weights.bin", WEIGHTS_MAGIC) as c:
            secs.append({n: bytes(c.section(n)) for n in c.names()})
    assert secs[0].keys() == secs[1].keys() and any(".moe.gate_up:qs" in n for n in secs[0])
    assert [n for n in secs[0] if secs[0][n] != secs[1][n]] == []


def test_int4_and_int8_are_q4_0_and_q8_0_bit_for_bit():
    from strata_compiler.formats import get_format

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 256)) * rng.random((64, 1)) * 3).astype(np.float32)
    w[0, :32] = 0                                   # an all-zero block
    w[1, 5] = -w[1, :32].__abs__().max() * 1.5       # a negative extreme: a negative scale
    for qt, fmt in ((QT.Q4_0, "int4"), (QT.Q8_0, "int8")):
        g = quantize(w, qt).reshape(64, 8, -1)
        a = get_format(fmt).quantize(w, 32)
        np.testing.assert_array_equal(np.ascontiguousarray(g[:, :, :2]).view(np.uint16).reshape(64, 8),
                                      a["scales"].view(np.uint16))
        np.testing.assert_array_equal(np.ascontiguousarray(g[:, :, 2:]).reshape(64, -1), a["qs"].view(np.uint8))


def test_chat_template_flag_supplies_one(moe, tmp_path, capsys):
    """A GGUF without tokenizer.chat_template: chat is refused naming --chat-template; compiled
    with --chat-template FILE the plan renders messages with it; a missing file is one error."""
    from strata_compiler.cli import stratac
    from strata_compiler.cli_common import run_cli
    from strata_compiler.errors import UsageError
    from strata_compiler.runtime.chat import render_chat
    from strata_compiler.runtime.plan import load_plan

    src = moe["base"] / "mixtral.gguf"
    capsys.readouterr()
    plan = load_plan(compile_ok(src, tmp_path / "plain", "--quant", "f32"))
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        "tokenizer: stored; chat template: none (add one with --chat-template FILE); sampling: ")
    with pytest.raises(UsageError, match="--chat-template FILE"):
        render_chat(plan, [{"role": "user", "content": "hi"}])
    tpl = tmp_path / "chat.jinja"
    tpl.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")
    plan = load_plan(compile_ok(src, tmp_path / "chat", "--quant", "f32", "--chat-template", str(tpl)))
    assert render_chat(plan, [{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"
    assert capsys.readouterr().out.splitlines()[-1].startswith("tokenizer: stored; chat template: stored; sampling: ")
    assert run_cli(stratac, ["compile", str(src), "-o", str(tmp_path / "bad"), "--chat-template",
                             str(tmp_path / "missing.jinja")]) != 0


@pytest.mark.parametrize("qtype,fmt", [(QT.Q4_0, "int4"), (QT.Q4_1, "int4a"), (QT.Q8_0, "int8"), (QT.F16, "f32"),
                                       (QT.Q4_K, "int4a")])
def test_quant_auto_keeps_the_files_formats(moe, tmp_path, qtype, fmt):
    """Without --quant a GGUF compiles in its own formats: Q4_0 / Q4_1 / Q8_0 experts as the --quant
    int4 / int4a / int8 plan's bytes (taken as they are), F16 exactly (f32), a K-quant as the
    nearest format at least as precise (Q4_K: int4a); the F32 tensors stay f32."""
    from strata_compiler.plan_format import WEIGHTS_MAGIC, Container
    from strata_compiler.runtime.plan import load_plan

    width = 256 if qtype == QT.Q4_K else 64
    dims = dict(intermediate_size=width) if width == 64 else dict(hidden_size=width, intermediate_size=width)
    d = build_model("mixtral", tmp_path / "hf", vocab_size=len(moe["tokens"]), seed=11, **dims)
    write_moe_gguf(tmp_path / "q.gguf", d, "mixtral", moe["tokens"], moe["merges"], qtype)
    auto = load_plan(compile_ok(tmp_path / "q.gguf", tmp_path / "auto"))
    experts = {w.fmt for w in auto.graph.weights if ".moe." in w.name and w.name.split(".")[-1] in ("gate_up", "down")}
    assert experts == {fmt}
    assert {w.fmt for w in auto.graph.weights if ".attn." in w.name} == {"f32"}     # written F32 in the file
    if qtype != QT.Q4_K:
        plans = [tmp_path / "auto", compile_ok(tmp_path / "q.gguf", tmp_path / "explicit", "--quant", fmt)]
        secs = []
        for p in plans:     # the experts' arrays (--quant int4 also quantizes the file's F32 attention)
            with Container.open(p / "weights.bin", WEIGHTS_MAGIC) as c:
                secs.append({n: bytes(c.section(n)) for n in c.names() if ".moe." in n and ".router" not in n})
        assert secs[0] == secs[1] and len(secs[0]) >= 4


def test_a_k_quant_file_says_what_was_requantized_and_eval_measures_it(moe, tmp_path, capsys):
    """A K-quant GGUF compiles with one line naming the types quantized again, and `stratac eval`
    takes the GGUF itself as the reference (its dequantized weights at f32): the KL is small."""
    import json as _json

    from strata_compiler.cli import stratac
    from test_gguf_frontend import run_cli

    d = build_model("mixtral", tmp_path / "hf", vocab_size=len(moe["tokens"]), seed=12, hidden_size=256,
                    intermediate_size=256)
    write_moe_gguf(tmp_path / "k.gguf", d, "mixtral", moe["tokens"], moe["merges"], QT.Q4_K)
    capsys.readouterr()
    compile_ok(tmp_path / "k.gguf", tmp_path / "plan")
    out = capsys.readouterr().out
    assert "requantized from the file's types: Q4_K -> int4a" in out and "--reference" in out, out
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat. " * 40)
    assert run_cli(stratac, ["eval", str(tmp_path / "plan"), "--reference", str(tmp_path / "k.gguf"), "--text",
                             str(text), "--ctx", "64", "--chunks", "2", "--json", "--backend", "reference"]) == 0
    r = _json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 <= r["mean_kl"] < 0.05, r
    compile_ok(tmp_path / "k.gguf", tmp_path / "plan2", "--eval-text", str(text))     # the KL printed by compile
    out = capsys.readouterr().out
    assert "requantized from the file's types" in out and "mean KL" in out, out


def test_expert_cache_and_laq_take_gguf_plans(moe, tmp_path, monkeypatch):
    """A GGUF-sourced plan goes through the placement's expert cache (split layers, slots on "the
    GPU", JAX's CPU here) and layer-adaptive quantization as an HF-sourced one: the cached plan
    matches transformers, the --bits plan picks several formats and runs."""
    from test_expert_cache import cached_plan

    from strata_compiler.runtime.plan import load_plan

    m = load_model(moe["mixtral"])
    ids = clear_prompts(m, m.config.vocab_size, n_prompts=1, length=7, n_new=N_NEW, batch=1)[0]
    src = moe["base"] / "mixtral.gguf"
    (tmp_path / "cache").mkdir()
    cached = cached_plan(src, tmp_path / "cache", monkeypatch, 0.5)
    moes = [n for n in load_plan(cached).graph.nodes if n.op.value == "moe_ffn" and n.attr("cache", "")]
    assert {n.device for n in moes} == {"gpu", "cpu"}
    logits, tokens = run_logits(cached, ids, tmp_path, "auto")
    ref = hf_logits(m, ids)
    assert np.abs(logits - ref).max() / ref.std() <= 1e-4
    np.testing.assert_array_equal(tokens, hf_greedy(m, ids, N_NEW)[0])
    laq = load_plan(compile_ok(src, tmp_path / "laq", "--bits", "5"))
    assert len({w.fmt for w in laq.graph.weights if w.fmt != "f32"}) >= 1
    logits, _ = run_logits(tmp_path / "laq", ids, tmp_path, "reference")
    assert np.isfinite(logits).all() and logits.shape[-1] == m.config.vocab_size
