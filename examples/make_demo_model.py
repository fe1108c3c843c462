"""Write a small, deterministic Qwen3-MoE Hugging Face model folder (no download needed).

    python examples/make_demo_model.py OUT_DIR [--seed 0]

or, from Python::

    from examples.make_demo_model import make_demo_model
    make_demo_model(Path("demo"), seed=0)

The folder holds what a real Hub checkpoint holds: config.json (Qwen3MoeConfig fields, as
transformers 5 writes them), model.safetensors (bf16, transformers' checkpoint key names),
tokenizer.json (a byte-level BPE trained on examples/demo_corpus.txt), tokenizer_config.json
and generation_config.json.

The weights are random but not pure noise: the token embeddings and lm_head are a low-rank
factorisation of the corpus' bigram log-probabilities, and the layers write into the residual
stream with a small scale, so greedy decoding wanders through plausible-looking word pairs
instead of repeating one token. Everything is a pure function of the seed (and the corpus).

Only numpy, ml_dtypes, safetensors and tokenizers are used: torch/transformers are test-only.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# BPE training uses rayon; one thread removes any doubt about merge-order ties.
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

CORPUS = Path(__file__).resolve().with_name("demo_corpus.txt")

TOKENIZER_VOCAB = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, the classic Qwen template: each message "<|im_start|>{role}\n{content}<|im_end|>\n", then
# "<|im_start|>assistant\n" when a reply is wanted (stored in tokenizer_config.json's chat_template)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TRANSFORMERS_VERSION = "5.0.0"

# Model dimensions (Qwen3-MoE, tiny).
HIDDEN = 256
INTERMEDIATE = 512
MOE_INTERMEDIATE = 128
LAYERS = 4
HEADS = 8
KV_HEADS = 2
HEAD_DIM = 32
EXPERTS = 8
TOP_K = 2
MAX_POS = 2048
RMS_EPS = 1e-6
ROPE_THETA = 10000.0

# Scale of what each attention / MoE block writes into the residual stream, relative to a
# variance-preserving init: small, so the token embedding stays visible at the lm_head.
RESIDUAL_WRITE_SCALE = 0.25
# Target standard deviation of the bigram part of the logits.
LOGIT_STD = 3.0


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(corpus: Path = CORPUS, vocab_size: int = TOKENIZER_VOCAB) -> Tokenizer:
    """Byte-level BPE trained on `corpus`; deterministic (ties are broken by pair ids)."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = corpus.read_text(encoding="utf-8")
    # Train on paragraphs, in file order (a list iterator, not files=, keeps ordering fixed).
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    tok.train_from_iterator(paragraphs, trainer=trainer, length=len(paragraphs))
    return tok


# ----------------------------------------------------------------------------- weights


def _bigram_factors(tok: Tokenizer, vocab: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank-`rank` factors (E [V, r], W [V, r]) with E @ W.T ~ centred log P(next | cur)."""
    text = CORPUS.read_text(encoding="utf-8")
    counts = np.zeros((vocab, vocab), dtype=np.float64)
    for para in (p for p in text.split("\n\n") if p.strip()):
        ids = np.asarray(tok.encode(para).ids, dtype=np.int64)
        np.add.at(counts, (ids[:-1], ids[1:]), 1.0)
    counts += 0.05  # smoothing
    for s in range(len(SPECIAL_TOKENS)):  # never predict the special tokens
        counts[:, s] = 1e-6
    logp = np.log(counts / counts.sum(axis=1, keepdims=True))
    logp -= logp.mean(axis=1, keepdims=True)
    u, s, vt = np.linalg.svd(logp)
    u, s, vt = u[:, :rank], s[:rank], vt[:rank]
    # Fix the SVD's sign ambiguity so the result does not depend on the LAPACK build.
    flip = np.sign(u[np.abs(u).argmax(axis=0), np.arange(rank)])
    flip[flip == 0] = 1.0
    u, vt = u * flip, vt * flip[:, None]
    root = np.sqrt(s)
    return u * root, vt.T * root


def _bf16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.astype(np.float32).astype(ml_dtypes.bfloat16))


def build_weights(tok: Tokenizer, vocab: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, hd = HIDDEN, HEAD_DIM

    def linear(out_f: int, in_f: int, scale: float = 1.0) -> np.ndarray:
        return rng.standard_normal((out_f, in_f), dtype=np.float32) * (scale / np.sqrt(in_f))

    def norm(n: int) -> np.ndarray:
        return 1.0 + 0.05 * rng.standard_normal(n, dtype=np.float32)

    emb_f, head_f = _bigram_factors(tok, vocab, min(d, vocab))
    r = emb_f.shape[1]
    # Embeddings: the bigram factor (unit RMS per row) plus a little per-token noise.
    emb = np.zeros((vocab, d), dtype=np.float64)
    emb[:, :r] = emb_f
    emb /= np.sqrt((emb**2).mean(axis=1, keepdims=True)) + 1e-12
    emb += 0.1 * rng.standard_normal((vocab, d))
    emb /= np.sqrt((emb**2).mean(axis=1, keepdims=True))
    # lm_head: logits = head @ normed(h) ~ bigram log-probs (scaled to LOGIT_STD).
    head = np.zeros((vocab, d), dtype=np.float64)
    head[:, :r] = head_f
    logits = emb @ head.T
    head *= LOGIT_STD / logits.std()
    head += 0.02 * rng.standard_normal((vocab, d))

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": _bf16(emb)}
    res = RESIDUAL_WRITE_SCALE
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = _bf16(norm(d))
        w[p + "self_attn.q_proj.weight"] = _bf16(linear(HEADS * hd, d))
        w[p + "self_attn.k_proj.weight"] = _bf16(linear(KV_HEADS * hd, d))
        w[p + "self_attn.v_proj.weight"] = _bf16(linear(KV_HEADS * hd, d))
        w[p + "self_attn.o_proj.weight"] = _bf16(linear(d, HEADS * hd, res))
        w[p + "self_attn.q_norm.weight"] = _bf16(norm(hd))
        w[p + "self_attn.k_norm.weight"] = _bf16(norm(hd))
        w[p + "post_attention_layernorm.weight"] = _bf16(norm(d))
        w[p + "mlp.gate.weight"] = _bf16(linear(EXPERTS, d))
        for e in range(EXPERTS):
            q = f"{p}mlp.experts.{e}."
            w[q + "gate_proj.weight"] = _bf16(linear(MOE_INTERMEDIATE, d))
            w[q + "up_proj.weight"] = _bf16(linear(MOE_INTERMEDIATE, d))
            w[q + "down_proj.weight"] = _bf16(linear(d, MOE_INTERMEDIATE, 2.0 * res))
    w["model.norm.weight"] = _bf16(norm(d))
    w["lm_head.weight"] = _bf16(head)
    return w


# ----------------------------------------------------------------------------- folder


def _config(vocab: int, bos: int, eos: int, pad: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "decoder_sparse_step": 1,
        "dtype": "bfloat16",
        "eos_token_id": eos,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POS,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "norm_topk_prob": True,
        "num_attention_heads": HEADS,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "num_local_experts": EXPERTS,  # transformers 5 spelling (num_experts is its alias)
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "output_router_logits": False,
        "pad_token_id": pad,
        "rms_norm_eps": RMS_EPS,
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_demo_model(out_dir: Path, seed: int = 0, quiet: bool = False) -> Path:
    """Write the demo model folder to `out_dir` (created if needed) and return it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eot = tok.token_to_id("<|endoftext|>")
    im_start = tok.token_to_id("<|im_start|>")
    im_end = tok.token_to_id("<|im_end|>")
    tok.save(str(out_dir / "tokenizer.json"), pretty=True)

    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in ((t, tok.token_to_id(t)) for t in SPECIAL_TOKENS)
    }
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": added,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "bos_token": None,
            "chat_template": CHATML_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|endoftext|>",
            "errors": "replace",
            "model_max_length": MAX_POS,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": None,
        },
    )
    _write_json(out_dir / "config.json", _config(vocab, bos=eot, eos=eot, pad=eot))
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": eot,
            "do_sample": False,
            "eos_token_id": [eot, im_end],
            "pad_token_id": eot,
            "transformers_version": TRANSFORMERS_VERSION,
        },
    )
    del im_start

    weights = build_weights(tok, vocab, seed)
    st = out_dir / "model.safetensors"
    save_file(weights, str(st), metadata={"format": "pt"})
    st.chmod(0o644)  # safetensors creates the file 0600

    if not quiet:
        params = sum(a.size for a in weights.values())
        mb = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file()) / 1e6
        print(f"demo model: {out_dir} | qwen3_moe, {params:,} parameters, vocab {vocab}, "
              f"{mb:.1f} MB")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    make_demo_model(args.out_dir, seed=args.seed)


if __name__ == "__main__":
    main()
