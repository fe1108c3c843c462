"""Write a synthetic Mixtral-architecture Hugging Face folder with a SentencePiece tokenizer.

    python benchmarks/make_mixtral_model.py OUT_DIR [--hidden 2048] [--layers 16] [--experts 8]
        [--top-k 2] [--ffn 5632] [--heads 16] [--kv-heads 8] [--vocab 32000] [--seed 0]
        [--dtype bf16] [--shard-gb 2.0]

This is the model of benchmarks/decode_vs_llamacpp.py: one folder that both llama.cpp (through
its own convert_hf_to_gguf.py) and `stratac compile` read. The defaults give ~4.6 B total and
~1.3 B active parameters per token (16 layers x 8 experts of 3 x 2048 x 5632, top-2):

    hidden 2048, 16 layers, 16 query heads / 8 KV heads of 128, 8 experts (top-2) of FFN 5632

Output (what a Hub Mixtral checkpoint holds):
  config.json                         MixtralForCausalLM, the fields transformers 5 writes
  model-0000i-of-0000n.safetensors    bf16 (or --dtype) weights, transformers' key names
  model.safetensors.index.json
  tokenizer.model                     SentencePiece BPE (byte fallback, Llama-style settings)
                                      trained on examples/demo_corpus.txt
  tokenizer.json                      the same tokenizer as a HF fast tokenizer (`tokenizers`)
  tokenizer_config.json, special_tokens_map.json, generation_config.json

Weights: random, N(0, 1/sqrt(fan_in))-sized (norm weights ~1, embeddings ~0.02), written tensor
by tensor with a hand-written safetensors header by benchmarks/make_synthetic_model.py, so memory
stays at a few tens of MB whatever the size. Everything is deterministic given the arguments.

Vocabulary: the demo corpus is small (~9 KB), so SentencePiece can only learn a few thousand
pieces. When --vocab is more than the corpus supports, the largest vocabulary that trains is used
instead (a note is printed) and config.json's vocab_size is set to exactly the tokenizer's size.

Needs numpy and sentencepiece; tokenizer.json is built with transformers' SentencePiece converter
(transformers + protobuf). All are benchmark-only dependencies, not the product's.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "examples" / "demo_corpus.txt"
GB = 1_000_000_000

SPECIALS = ("<unk>", "<s>", "</s>")   # ids 0, 1, 2 (Llama / Mixtral layout)


def _load_sibling(name: str):
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod   # dataclasses look the module up while the class is created
        spec.loader.exec_module(mod)
    return mod


msm = _load_sibling("make_synthetic_model")


# ----------------------------------------------------------------------------- tokenizer


def _spm_train(lines: list[str], vocab_size: int) -> bytes:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, split_digits=True, character_coverage=1.0,
        normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, max_sentence_length=1 << 16,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        unk_piece=SPECIALS[0], bos_piece=SPECIALS[1], eos_piece=SPECIALS[2],
        num_threads=1, shuffle_input_sentence=False, input_sentence_size=0, minloglevel=2)
    return buf.getvalue()


def train_sentencepiece(vocab_size: int, corpus: Path = CORPUS) -> tuple[bytes, int]:
    """SentencePiece BPE model bytes and its vocabulary size (<= vocab_size: the most that trains)."""
    lines = [ln for ln in corpus.read_text(encoding="utf-8").splitlines() if ln.strip()]
    try:
        proto = _spm_train(lines, vocab_size)
    except RuntimeError as e:  # "Vocabulary size too high (N). Please set it to a value <= M."
        m = re.search(r"<= (\d+)", str(e))
        if not m:
            raise
        proto = _spm_train(lines, int(m.group(1)))
    import sentencepiece as spm

    n = spm.SentencePieceProcessor(model_proto=proto).vocab_size()
    return proto, n


def tokenizer_json_from_spm(proto_bytes: bytes) -> str:
    """The SentencePiece model as a `tokenizers` JSON that encodes like SentencePiece does.

    Uses transformers' SpmConverter.build_tokenizer_from_spm_proto (legacy=True: the Llama /
    Mixtral behaviour), plus the specials as added tokens and a `<s> $A` post-processor (Llama's
    add_bos_token=True)."""
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    pb = import_protobuf()
    m = pb.ModelProto()
    m.ParseFromString(proto_bytes)
    vocab = {p.piece: i for i, p in enumerate(m.pieces)}
    try:
        tok = SpmConverter.build_tokenizer_from_spm_proto(m, vocab, legacy=True)
    except TypeError:       # transformers 5.17's SpmConverter has no `legacy` argument
        tok = SpmConverter.build_tokenizer_from_spm_proto(m, vocab)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIALS[1]} $A", pair=f"{SPECIALS[1]} $A {SPECIALS[1]} $B",
        special_tokens=[(SPECIALS[1], 1)])
    return tok.to_str(pretty=True)


def tokenizer_config() -> dict:
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, s in enumerate(SPECIALS)}
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": SPECIALS[1],
        "clean_up_tokenization_spaces": False,
        "eos_token": SPECIALS[2],
        "legacy": True,
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": None,
        "sp_model_kwargs": {},
        "spaces_between_special_tokens": False,
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": SPECIALS[0],
        "use_default_system_prompt": False,
    }


def write_tokenizer(out_dir: Path, vocab_size: int) -> int:
    proto, n = train_sentencepiece(vocab_size)
    (out_dir / "tokenizer.model").write_bytes(proto)
    (out_dir / "tokenizer.json").write_text(tokenizer_json_from_spm(proto) + "\n", encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": SPECIALS[1], "eos_token": SPECIALS[2], "unk_token": SPECIALS[0]}, indent=2) + "\n",
        encoding="utf-8")
    return n


# ----------------------------------------------------------------------------- counts


def param_counts(d) -> dict:
    """Total and per-token-active parameter counts for Mixtral dims `d` (a msm.Dims)."""
    D, V, H, KV, hd, E, I, k, L = (d.hidden, d.vocab, d.heads, d.kv_heads, d.head_dim, d.experts,
                                   d.moe_intermediate, d.top_k, d.layers)
    attn = D * H * hd * 2 + D * KV * hd * 2
    expert = 3 * D * I
    router = E * D
    norms = 2 * D
    per_layer_total = attn + E * expert + router + norms
    per_layer_active = attn + k * expert + router + norms
    embed, head = V * D, V * D
    total = L * per_layer_total + embed + head + D
    return {
        "attention_per_layer": attn,
        "expert": expert,
        "experts_total": L * E * expert,
        "total": total,
        # active per token: everything but the unchosen experts (the embedding table counted
        # whole, as model cards do) and the same without the embedding table (one row is read)
        "active": total - L * (E - k) * expert,
        "active_no_embedding": total - L * (E - k) * expert - embed,
    }


def mixtral_config(d, dtype: str) -> dict:
    cfg = msm.make_config("mixtral", d, dtype)
    cfg.update({
        "pad_token_id": None,            # Llama/Mixtral tokenizers have no pad token
        "router_aux_loss_coef": 0.001,   # MixtralConfig() default
        "transformers_version": "5.24.0",
    })
    return dict(sorted(cfg.items()))


# ----------------------------------------------------------------------------- main


def make_mixtral_model(out_dir: Path, *, hidden: int = 2048, layers: int = 16, experts: int = 8,
                       top_k: int = 2, ffn: int = 5632, heads: int = 16, kv_heads: int = 8,
                       head_dim: int | None = None, vocab: int = 32000, seed: int = 0,
                       dtype: str = "bf16", shard_gb: float = 2.0) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    n_vocab = write_tokenizer(out_dir, vocab)
    t_tok = time.perf_counter() - t0
    s = msm.make_synthetic_model(
        out_dir, arch="mixtral", dtype=dtype, shard_gb=shard_gb, seed=seed, layers=layers,
        hidden=hidden, experts=experts, moe_intermediate=ffn, vocab=n_vocab, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, top_k=top_k)
    d = msm.Dims(**s["dims"])
    (out_dir / "config.json").write_text(json.dumps(mixtral_config(d, dtype), indent=2) + "\n",
                                         encoding="utf-8")
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "transformers_version": "5.24.0"}, indent=2) + "\n",
        encoding="utf-8")
    s.update(requested_vocab=vocab, vocab=n_vocab, params=param_counts(d),
             tokenizer_seconds=t_tok, seconds=time.perf_counter() - t0)
    return s


def describe(s: dict) -> str:
    d, p = s["dims"], s["params"]
    itemsize = msm.DTYPES[s["dtype"]][1]
    lines = [
        f"{s['out_dir']}: MixtralForCausalLM {s['dtype']}, {len(s['files'])} shard(s), {s['seconds']:.1f} s",
        f"  hidden {d['hidden']}, {d['layers']} layers, heads {d['heads']} (kv {d['kv_heads']}, head_dim "
        f"{d['head_dim']}), {d['experts']} experts top-{d['top_k']}, expert FFN {d['moe_intermediate']}, "
        f"vocab {d['vocab']}",
        f"  params: total {p['total']:,} ({p['total'] / 1e9:.3f} B); active/token {p['active']:,} "
        f"({p['active'] / 1e9:.3f} B; {p['active_no_embedding'] / 1e9:.3f} B without the embedding table)",
        f"  bytes: {s['total_bytes']:,} ({s['total_bytes'] / GB:.2f} GB {s['dtype']}); active "
        f"{p['active_no_embedding'] * itemsize / GB:.2f} GB/token {s['dtype']}, ~"
        f"{p['active_no_embedding'] * 4.5 / 8 / GB:.2f} GB at 4.5 bit (Q4_0/int4-g32), ~"
        f"{p['active_no_embedding'] * 8.5 / 8 / GB:.2f} GB at 8.5 bit (Q8_0/int8-g32)",
    ]
    if s["vocab"] != s["requested_vocab"]:
        lines.append(f"  note: --vocab {s['requested_vocab']} is more than the demo corpus trains; "
                     f"used the largest SentencePiece vocabulary that does ({s['vocab']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write a synthetic Mixtral HF folder with a SentencePiece tokenizer.")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=5632, help="expert FFN (intermediate) size")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=None, help="default hidden / heads")
    ap.add_argument("--vocab", type=int, default=32000,
                    help="tokenizer vocabulary; capped at what the demo corpus can train")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=sorted(msm.DTYPES), default="bf16")
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--json", type=Path, help="also write the summary here")
    a = ap.parse_args(argv)
    s = make_mixtral_model(a.out_dir, hidden=a.hidden, layers=a.layers, experts=a.experts, top_k=a.top_k,
                           ffn=a.ffn, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
                           vocab=a.vocab, seed=a.seed, dtype=a.dtype, shard_gb=a.shard_gb)
    print(describe(s))
    if a.json:
        a.json.write_text(json.dumps(s, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
