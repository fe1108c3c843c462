"""GGUF input (llama architecture): tiny GGUF files written here with gguf.GGUFWriter from random
transformers LlamaForCausalLM models, laid out the way llama.cpp's convert_hf_to_gguf.py writes them
(q/k rows permuted per head, GGUF dims innermost first), compiled by stratac and checked against
transformers:

- all-F32, untied output.weight: logits within 1e-4 x std and the same greedy tokens (reference and llvm);
- tied embeddings (no output.weight) with Q8_0, Q4_1 and F16 tensors: logits of transformers run on
  the same dequantized weights;
- the config read from the metadata equals the one read from the HF folder's config.json;
- the tokenizer rebuilt from tokenizer.ggml.* encodes like the BPE it came from and like llama.cpp
  (when llama_cpp is installed), and `strata-run --prompt` works on the plan;
- bad inputs (truncated anywhere, wrong architecture, not GGUF at all): one `error:` line naming
  the file, nonzero exit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from hf_models import (build_model, clear_prompts, hf_greedy, hf_logits, load_model,  # noqa: E402
                       quantize_dequantize_model)
from strata_compiler.cli import stratac  # noqa: E402
from strata_compiler.cli_common import run_cli  # noqa: E402
from strata_compiler.frontend.gguf_reader import _unpermute, open_gguf  # noqa: E402
from strata_compiler.frontend.hf import read_config  # noqa: E402
from strata_compiler.runtime.cli import strata_run  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STRATAC = Path(sys.executable).parent / "stratac"
N_NEW = 8
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = "The quick brown fox jumps over 12 lazy dogs; it's 3.14159 o'clock. <|im_start|>user\nhi  there"

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(key: str) -> str:
    if key in HF_TO_GGUF:
        return HF_TO_GGUF[key]
    parts = key.split(".")          # model.layers.N.<rest>
    return f"blk.{parts[2]}.{BLOCK['.'.join(parts[3:])]}"


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def inverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ------------------------------------------------------------------------------------------------
# fixtures: a byte-level BPE tokenizer, tiny llama models, GGUF files


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # SmolLM2's pre-tokenizer (llama.cpp pre type "smollm"): single digits, then GPT-2's byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((ROOT / "examples" / "demo_corpus.txt").read_text().splitlines(), trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    assert None not in tokens
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tok, tokens, merges


def write_gguf(path: Path, model, tokens, merges, *, qtypes: dict[str, QT] | None = None, arch: str = "llama",
               pre: str = "smollm", drop: tuple[str, ...] = (), chat_template=None) -> dict[str, np.ndarray]:
    """The model as llama.cpp lays it out; returns {HF key: f32 weight as stored, back in HF layout}."""
    qtypes = qtypes or {}
    c = model.config
    H, KV = c.num_attention_heads, c.num_key_value_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]) if getattr(c, "rope_parameters", None)
                         else float(c.rope_theta))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // H)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    stored: dict[str, np.ndarray] = {}
    for key, t in model.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = gguf_name(key)
        if name in drop:
            continue
        a = t.detach().float().numpy()
        heads = H if name.endswith("attn_q.weight") else KV if name.endswith("attn_k.weight") else 0
        if heads:
            a = permute(a, H, None if heads == H else KV)
        qt = qtypes.get(name, QT.F32)
        data = quantize(np.ascontiguousarray(a), qt)
        w.add_tensor(name, data, raw_dtype=qt)
        back = dequantize(data, qt).astype(np.float32).reshape(a.shape)
        stored[key] = inverse_permute(back, heads) if heads else back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("gguf")
    hf_tok, tokens, merges = train_tokenizer()
    V = len(tokens)
    out = {"tokens": tokens, "merges": merges, "hf_tok": hf_tok, "base": base}
    # untied, all F32
    d = build_model("llama", base / "hf_untied", vocab_size=V, seed=3)
    m = load_model(d)
    write_gguf(base / "untied.gguf", m, tokens, merges)
    out.update(hf_untied=d, model_untied=m)
    # tied, some tensors quantized (q: permuted and quantized; k: Q4_1; embedding Q8_0 = the head too)
    d = build_model("llama", base / "hf_tied", vocab_size=V, tie_word_embeddings=True, seed=4)
    m = load_model(d)
    qtypes = {"token_embd.weight": QT.Q8_0, "blk.0.attn_q.weight": QT.Q8_0, "blk.1.attn_k.weight": QT.Q4_1,
              "blk.0.ffn_down.weight": QT.Q8_0, "blk.1.ffn_up.weight": QT.Q4_1, "blk.1.attn_v.weight": QT.F16}
    stored = write_gguf(base / "quant.gguf", m, tokens, merges, qtypes=qtypes)
    assert any(not np.array_equal(stored[k], m.state_dict()[k].numpy()) for k in stored)   # really quantized
    out.update(hf_tied=d, stored_quant=stored, model_quant_ref=with_weights(d, stored))
    return out


def with_weights(hf_dir: Path, weights: dict[str, np.ndarray]):
    """transformers' model of hf_dir with `weights` (HF key -> f32) copied in."""
    model = load_model(hf_dir)
    with torch.no_grad():
        sd = model.state_dict()
        for k, v in weights.items():
            sd[k].copy_(torch.from_numpy(v))
    return model


def compile_ok(src: Path, out: Path, *flags) -> Path:
    assert run_cli(stratac, ["compile", str(src), "-o", str(out), *flags]) == 0
    return out


def run_logits(plan: Path, ids: np.ndarray, tmp: Path, backend: str, n_new: int = N_NEW):
    np.save(tmp / "ids.npy", ids)
    assert run_cli(strata_run, [str(plan), "--input-ids", str(tmp / "ids.npy"), "-n", str(n_new), "--greedy",
                                "--ignore-eos", "--backend", backend, "--logits-out", str(tmp / "l.npy"),
                                "--tokens-out", str(tmp / "t.npy")]) == 0
    return np.load(tmp / "l.npy"), np.load(tmp / "t.npy")


# ------------------------------------------------------------------------------------------------
# the layout


def test_unpermute_inverts_convert_hf_to_gguf_permute():
    rng = np.random.default_rng(0)
    for heads, hd, cols in ((4, 16, 8), (3, 64, 5), (1, 2, 1)):
        w = rng.standard_normal((heads * hd, cols)).astype(np.float32)
        np.testing.assert_array_equal(_unpermute(permute(w, heads), hd), w)
        b = w[:, 0].copy()
        np.testing.assert_array_equal(_unpermute(permute(b, heads), hd), b)


def test_config_matches_hf_config_json(tiny):
    store, cfg, tok = open_gguf(tiny["base"] / "untied.gguf")
    hf = read_config(tiny["hf_untied"])
    # max_position, bos/eos come from GGUF fields the writer set on their own; the rest must agree
    assert cfg.__class__ is hf.__class__
    for f in ("arch", "architecture", "vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim",
              "rms_eps", "rope", "tie_word_embeddings", "moe_layers", "qkv_bias", "o_bias", "max_position"):
        assert getattr(cfg, f) == getattr(hf, f), f
    assert cfg.eos_token_ids == (tiny["tokens"].index("<|im_end|>"),)
    store_t, cfg_t, _ = open_gguf(tiny["base"] / "quant.gguf")
    assert cfg_t.tie_word_embeddings and "lm_head.weight" not in store_t
    # q rows come back in HF order
    q = np.concatenate(list(store.iter_row_blocks("model.layers.1.self_attn.q_proj.weight", block_bytes=256)))
    np.testing.assert_array_equal(q, tiny["model_untied"].model.layers[1].self_attn.q_proj.weight.detach().numpy())


# ------------------------------------------------------------------------------------------------
# numerics against transformers


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_f32_gguf_matches_transformers(tiny, tmp_path, backend):
    if backend == "llvm":
        from strata_compiler.backends import llvm_available

        if not llvm_available()[0]:
            pytest.skip("llvm backend unavailable on this host")
    m = tiny["model_untied"]
    ids = clear_prompts(m, m.config.vocab_size, n_prompts=1, length=7, n_new=N_NEW, batch=2)[0]
    plan = compile_ok(tiny["base"] / "untied.gguf", tmp_path / "plan", "--quant", "f32")
    logits, tokens = run_logits(plan, ids, tmp_path, backend)
    ref = hf_logits(m, ids)
    err = np.abs(logits - ref).max() / ref.std()
    assert err <= 1e-4, f"{backend}: max abs error {err:.2e} x std"
    np.testing.assert_array_equal(tokens, hf_greedy(m, ids, N_NEW)[0])


def test_quantized_gguf_matches_transformers_on_dequantized_weights(tiny, tmp_path):
    ref_model = tiny["model_quant_ref"]
    ids = clear_prompts(ref_model, ref_model.config.vocab_size, n_prompts=1, length=7, n_new=N_NEW, seed=2)[0]
    plan = compile_ok(tiny["base"] / "quant.gguf", tmp_path / "plan", "--quant", "f32")
    logits, tokens = run_logits(plan, ids, tmp_path, "reference")
    ref = hf_logits(ref_model, ids)
    err = np.abs(logits - ref).max() / ref.std()
    assert err <= 1e-4, f"max abs error {err:.2e} x std"
    np.testing.assert_array_equal(tokens, hf_greedy(ref_model, ids, N_NEW)[0])
    # --quant int8 re-packs the dequantized rows: transformers on those weights, int8-roundtripped
    ref8_model = with_weights(tiny["hf_tied"], tiny["stored_quant"])
    quantize_dequantize_model(ref8_model, "int8", 32)
    plan8 = compile_ok(tiny["base"] / "quant.gguf", tmp_path / "plan8", "--quant", "int8")
    l8, _ = run_logits(plan8, ids, tmp_path, "reference", n_new=1)
    ref8 = hf_logits(ref8_model, ids)
    assert np.abs(l8 - ref8).max() / ref8.std() <= 1e-4


# ------------------------------------------------------------------------------------------------
# tokenizer


@pytest.mark.parametrize("pre", ["smollm", "gpt-2", "llama-bpe", "qwen2"])
def test_tokenizer_matches_source_bpe_and_llama_cpp(tiny, tmp_path, pre):
    from tokenizers import Tokenizer

    path = tmp_path / f"{pre}.gguf"
    write_gguf(path, tiny["model_untied"], tiny["tokens"], tiny["merges"], pre=pre)
    _, _, tj = open_gguf(path)
    assert tj is not None
    ours = Tokenizer.from_str(tj.decode())
    texts = [TEXT, (ROOT / "examples" / "demo_corpus.txt").read_text()[:2000], "  x\n\n 007 dogs' 1234"]
    if pre == "smollm":   # same pre-tokenizer as the BPE was trained with: ids must be identical
        for t in texts:
            assert ours.encode(t).ids == tiny["hf_tok"].encode(t).ids
    assert ours.decode(ours.encode(TEXT).ids, skip_special_tokens=False) == TEXT
    digits = [p for p, _ in ours.pre_tokenizer.pre_tokenize_str("x 1234567") if p.isdigit()]
    if pre in ("llama-bpe", "qwen2"):       # llama3 splits numbers in threes, Qwen2 digit by digit
        assert digits == (["123", "456", "7"] if pre == "llama-bpe" else list("1234567")), digits
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for t in texts:
        ref = llm.tokenize(t.encode(), add_bos=False, special=True)
        assert ours.encode(t).ids == ref, (pre, t[:40])


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_chat_template_stored_in_plan(tiny, tmp_path, capsys):
    from strata_compiler.runtime.chat import render_chat, stop_ids
    from strata_compiler.runtime.plan import load_plan

    path = tmp_path / "chat.gguf"
    write_gguf(path, tiny["model_untied"], tiny["tokens"], tiny["merges"], chat_template=CHATML)
    *_, chat = open_gguf(path, with_chat=True)
    assert chat == {"template": CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                    "eos_token_ids": [tiny["tokens"].index("<|im_end|>")]}
    plan = load_plan(compile_ok(path, tmp_path / "plan"))
    assert plan.meta["chat"] == chat and stop_ids(plan) == (tiny["tokens"].index("<|im_end|>"),)
    assert render_chat(plan, [{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert open_gguf(tiny["base"] / "untied.gguf", with_chat=True)[3]["template"] is None   # none in the file
    capsys.readouterr()
    bad = tmp_path / "big.gguf"
    write_gguf(bad, tiny["model_untied"], tiny["tokens"], tiny["merges"], chat_template="x" * (256 * 1024 + 1))
    line = compile_error(capsys, bad, tmp_path / "o")
    assert "tokenizer.chat_template" in line and "256 KiB" in line


def test_prompt_runs_through_plan_tokenizer(tiny, tmp_path, capsys):
    plan = compile_ok(tiny["base"] / "untied.gguf", tmp_path / "plan")
    capsys.readouterr()
    assert run_cli(strata_run, [str(plan), "--prompt", "the model", "-n", "3", "--ignore-eos", "--echo",
                                "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the model") and len(out.strip()) > len("the model")


# ------------------------------------------------------------------------------------------------
# bad input: one line, names the file, nonzero exit


def compile_error(capsys, src: Path, out: Path) -> str:
    capsys.readouterr()
    code = run_cli(stratac, ["compile", str(src), "-o", str(out)])
    o, err = capsys.readouterr()
    assert code != 0 and "Traceback" not in o + err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(src) in lines[0], err
    assert not (out / "plan.bin").exists()
    return lines[0]


def test_wrong_architecture(tiny, tmp_path, capsys):
    path = tmp_path / "qwen.gguf"
    write_gguf(path, tiny["model_untied"], tiny["tokens"], tiny["merges"], arch="qwen2")
    line = compile_error(capsys, path, tmp_path / "out")
    assert "'qwen2'" in line and "architecture" in line
    # the installed console script too
    p = subprocess.run([str(STRATAC), "compile", str(path), "-o", str(tmp_path / "o2")], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode != 0 and p.stderr.count("\n") == 1 and "'qwen2'" in p.stderr and str(path) in p.stderr


def test_truncated_file(tiny, tmp_path, capsys):
    data = (tiny["base"] / "untied.gguf").read_bytes()
    for cut in (3, 10, 200, 4000, len(data) // 2, len(data) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        line = compile_error(capsys, path, tmp_path / f"out{cut}")
        assert "GGUF" in line or "truncated" in line, line


def test_a_gguf_without_its_extension_is_known_by_its_magic(tiny, tmp_path, capsys):
    """Ollama keeps models as blobs named by their digest: no .gguf, the magic says what it is."""
    import shutil

    blob = tmp_path / "sha256-0123abcd"
    shutil.copy(tiny["base"] / "untied.gguf", blob)
    compile_ok(blob, tmp_path / "plan", "--quant", "f32")
    assert (tmp_path / "plan" / "plan.bin").is_file()


def test_not_gguf_and_missing_tensor(tiny, tmp_path, capsys):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    assert "not a GGUF file" in compile_error(capsys, path, tmp_path / "o1")
    path = tmp_path / "missing.gguf"
    write_gguf(path, tiny["model_untied"], tiny["tokens"], tiny["merges"], drop=("blk.1.ffn_up.weight",))
    assert "blk.1.ffn_up.weight is missing" in compile_error(capsys, path, tmp_path / "o2")


def test_unknown_pre_tokenizer_gives_no_tokenizer_and_a_warning(tiny, tmp_path, capsys):
    path = tmp_path / "default.gguf"   # llama.cpp's "default" pre-tokenizer has regexes no HF pre-tokenizer has
    write_gguf(path, tiny["model_untied"], tiny["tokens"], tiny["merges"], pre="default")
    capsys.readouterr()
    _, cfg, tj = open_gguf(path)
    err = capsys.readouterr().err
    assert tj is None and cfg.vocab_size == len(tiny["tokens"])
    assert err.startswith("warning: ") and "'default'" in err and str(path) in err
