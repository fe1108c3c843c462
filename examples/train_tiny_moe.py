"""Train a small Qwen3-MoE language model on CPU with JAX and save it as a Hugging Face folder.

    python examples/extract_pydoc_corpus.py python3.11-doc_*.deb /tmp/pydoc_corpus
    python examples/train_tiny_moe.py /tmp/pydoc_corpus examples/models/tiny-moe --minutes 45
    python examples/train_tiny_moe.py /tmp/pydoc_corpus examples/models/tiny-moe --verify --heldout-loss

The corpus folder holds train.txt, calib.txt and heldout.txt (see extract_pydoc_corpus.py).
Training writes into OUT: tokenizer.json, tokenizer_config.json, config.json,
generation_config.json, model.safetensors (bf16, transformers' Qwen3-MoE checkpoint key names),
calib.txt, heldout.txt, corpus_split.json and train_log.json (losses, timing).

The run is budgeted by wall time, not steps: after a 30-step warmup the cosine learning rate
follows the fraction of --minutes used (minus --eval-reserve for saving and evaluation), so the
schedule ends with the budget however busy the machine is; the step count is logged.

Everything here is a plain implementation of exactly what transformers' Qwen3MoeForCausalLM
computes: RMSNorm (f32, eps inside the rsqrt, weight after), per-head q/k RMSNorm before RoPE,
rotate-half RoPE with inv_freq = theta^(-2i/hd), GQA attention scaled by hd^-0.5, router softmax
over all experts then top-k with the top-k weights renormalised (norm_topk_prob), SwiGLU experts
(down(silu(gate(x)) * up(x))), untied lm_head. Training adds the Switch-Transformer load-balancing
loss. The optimiser is a hand-written AdamW with warmup + cosine learning rate and global-norm
gradient clipping.

For speed, training routes tokens to experts with a fixed capacity (capacity factor CAP_FACTOR,
first choices before second choices); the few assignments beyond an expert's capacity are
dropped for that step only (the fraction is logged). Evaluation, the reported losses and the
comparison with transformers use the exact, drop-free computation (every expert on every token,
weighted by the top-k routing weights, zero elsewhere).

--verify loads OUT with transformers (AutoModelForCausalLM, f32, eager attention/experts),
compares its logits with this file's forward on held-out sequences, and compares greedy
continuations of a prompt.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from functools import partial
from importlib import metadata
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # deterministic BPE merges

import numpy as np  # noqa: E402

# ----------------------------------------------------------------------------- configuration

VOCAB = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, the classic Qwen template: each message "<|im_start|>{role}\n{content}<|im_end|>\n", then
# "<|im_start|>assistant\n" when a reply is wanted (stored in tokenizer_config.json's chat_template)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
HIDDEN = 256
LAYERS = 6
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
EXPERTS = 8
TOP_K = 2
MOE_INTERMEDIATE = 384
MAX_POS = 1024
RMS_EPS = 1e-6
ROPE_THETA = 10000.0
SEQ = 256

CAP_FACTOR = 1.25         # expert capacity during training: CAP_FACTOR * tokens * top_k / experts
AUX_COEF = 0.01           # load-balancing loss weight
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
CLIP_NORM = 1.0
INIT_STD = 0.02


def _transformers_version() -> str:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "5.0.0"


# ----------------------------------------------------------------------------- data


def read_docs(path: Path, sep: str) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [d.strip() for d in text.split(sep) if d.strip()]


def train_tokenizer(train_docs: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, min_frequency=2, show_progress=False, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    paragraphs = [p for d in train_docs for p in d.split("\n\n") if p.strip()]
    tok.train_from_iterator(paragraphs, trainer=trainer, length=len(paragraphs))
    return tok


def encode_stream(tok, docs: list[str]) -> np.ndarray:
    """Documents -> one id stream, each document followed by <|endoftext|>."""
    eot = tok.token_to_id("<|endoftext|>")
    out = []
    for enc in tok.encode_batch(docs):
        out.extend(enc.ids)
        out.append(eot)
    return np.asarray(out, dtype=np.int32)


def windows(stream: np.ndarray, seq: int = SEQ) -> np.ndarray:
    """Non-overlapping [n, seq + 1] windows (inputs = [:, :-1], targets = [:, 1:])."""
    n = (len(stream) - 1) // seq
    idx = np.arange(n)[:, None] * seq + np.arange(seq + 1)[None, :]
    return stream[idx]


# ----------------------------------------------------------------------------- model


def init_params(seed: int, vocab: int) -> dict:
    rng = np.random.default_rng(seed)
    d, hd, i_e = HIDDEN, HEAD_DIM, MOE_INTERMEDIATE
    out_std = INIT_STD / math.sqrt(2 * LAYERS)

    def n(*shape, std=INIT_STD):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    L = LAYERS
    return {
        "embed": n(vocab, d),
        "lm_head": n(vocab, d),
        "norm": np.ones(d, np.float32),
        # per-layer tensors stacked on a leading [L] axis; experts [L, E, out, in]
        "ln1": np.ones((L, d), np.float32),
        "ln2": np.ones((L, d), np.float32),
        "q": n(L, HEADS * hd, d),
        "k": n(L, KV_HEADS * hd, d),
        "v": n(L, KV_HEADS * hd, d),
        "o": n(L, d, HEADS * hd, std=out_std),
        "q_norm": np.ones((L, hd), np.float32),
        "k_norm": np.ones((L, hd), np.float32),
        "router": n(L, EXPERTS, d),
        "gate": n(L, EXPERTS, i_e, d),
        "up": n(L, EXPERTS, i_e, d),
        "down": n(L, EXPERTS, d, i_e, std=out_std),
    }


def _jax():
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_default_matmul_precision", "highest")
    return jax, jnp


def make_model(vocab: int):
    jax, jnp = _jax()

    def rms_norm(x, w):
        var = jnp.mean(x * x, axis=-1, keepdims=True)
        return w * (x * jax.lax.rsqrt(var + RMS_EPS))

    inv_freq = 1.0 / (ROPE_THETA ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM))

    def rope(x, pos):  # x [B, T, H, hd], rotate-half as transformers does it
        freqs = pos[:, None].astype(jnp.float32) * inv_freq[None, :]       # [T, hd/2]
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        cos, sin = jnp.cos(emb)[None, :, None, :], jnp.sin(emb)[None, :, None, :]
        x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
        rot = jnp.concatenate([-x2, x1], axis=-1)
        return x * cos + rot * sin

    def attention(x, lp):
        B, T, _ = x.shape
        q = (x @ lp["q"].T).reshape(B, T, HEADS, HEAD_DIM)
        k = (x @ lp["k"].T).reshape(B, T, KV_HEADS, HEAD_DIM)
        v = (x @ lp["v"].T).reshape(B, T, KV_HEADS, HEAD_DIM)
        q, k = rms_norm(q, lp["q_norm"]), rms_norm(k, lp["k_norm"])
        pos = jnp.arange(T)
        q, k = rope(q, pos), rope(k, pos)
        g = HEADS // KV_HEADS
        q = q.reshape(B, T, KV_HEADS, g, HEAD_DIM)
        s = jnp.einsum("btkgd,bskd->bkgts", q, k) * (HEAD_DIM ** -0.5)
        mask = jnp.tril(jnp.ones((T, T), bool))
        s = jnp.where(mask, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(B, T, HEADS * HEAD_DIM)
        return o @ lp["o"].T

    def route(h, router):
        logits = h @ router.T                                  # [N, E]
        probs = jax.nn.softmax(logits, axis=-1)
        topv, topi = jax.lax.top_k(probs, TOP_K)               # [N, k]
        topv = topv / jnp.sum(topv, axis=-1, keepdims=True)    # norm_topk_prob
        return probs, topv, topi

    def experts_dense(h, lp, topv, topi):
        """Exact: every expert on every token, combined with the (zero-elsewhere) top-k weights."""
        N = h.shape[0]
        comb = jnp.zeros((N, EXPERTS), h.dtype).at[jnp.arange(N)[:, None], topi].add(topv)
        gate = jnp.einsum("nd,eid->eni", h, lp["gate"])
        up = jnp.einsum("nd,eid->eni", h, lp["up"])
        y = jnp.einsum("eni,edi->end", jax.nn.silu(gate) * up, lp["down"])
        return jnp.einsum("end,ne->nd", y, comb), jnp.zeros((), h.dtype)

    def experts_capacity(h, lp, topv, topi):
        """Fixed-capacity dispatch: [E, C, D] buffers, first choices before second choices."""
        N, D = h.shape
        cap = int(math.ceil(CAP_FACTOR * N * TOP_K / EXPERTS))
        e_flat = topi.T.reshape(-1)                               # [k*N]: all first choices first
        w_flat = topv.T.reshape(-1)
        tok = jnp.tile(jnp.arange(N), TOP_K)
        onehot = jax.nn.one_hot(e_flat, EXPERTS, dtype=jnp.int32)
        pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
        keep = pos < cap
        slot = jnp.where(keep, e_flat * cap + pos, EXPERTS * cap)  # dropped -> dummy slot
        buf = jnp.zeros((EXPERTS * cap + 1, D), h.dtype).at[slot].set(h[tok])
        xb = buf[: EXPERTS * cap].reshape(EXPERTS, cap, D)
        gate = jnp.einsum("ecd,eid->eci", xb, lp["gate"])
        up = jnp.einsum("ecd,eid->eci", xb, lp["up"])
        y = jnp.einsum("eci,edi->ecd", jax.nn.silu(gate) * up, lp["down"]).reshape(EXPERTS * cap, D)
        y = jnp.concatenate([y, jnp.zeros((1, D), h.dtype)], axis=0)
        contrib = y[slot] * (w_flat * keep)[:, None]
        out = jnp.zeros((N, D), h.dtype).at[tok].add(contrib)
        return out, 1.0 - jnp.mean(keep.astype(h.dtype))

    def forward(params, ids, exact=True):
        """ids [B, T] -> logits [B, T, V], aux loss, dropped fraction."""
        B, T = ids.shape
        x = params["embed"][ids]
        layer_keys = ("ln1", "ln2", "q", "k", "v", "o", "q_norm", "k_norm", "router", "gate", "up", "down")
        stacked = {k: params[k] for k in layer_keys}
        experts = experts_dense if exact else experts_capacity

        def layer(x, lp):
            x = x + attention(rms_norm(x, lp["ln1"]), lp)
            h = rms_norm(x, lp["ln2"]).reshape(B * T, HIDDEN)
            probs, topv, topi = route(h, lp["router"])
            y, dropped = experts(h, lp, topv, topi)
            # Switch-Transformer balance: E * sum_e (fraction of top-k slots to e) * (mean prob of e)
            frac = jnp.mean(jax.nn.one_hot(topi, EXPERTS, dtype=h.dtype).sum(1), axis=0) / TOP_K
            aux = EXPERTS * jnp.sum(frac * jnp.mean(probs, axis=0))
            return x + y.reshape(B, T, HIDDEN), (aux, dropped)

        x, (aux, dropped) = jax.lax.scan(layer, x, stacked)
        x = rms_norm(x, params["norm"])
        return x @ params["lm_head"].T, jnp.mean(aux), jnp.mean(dropped)

    def token_nll(params, batch, exact=True):
        logits, aux, dropped = forward(params, batch[:, :-1], exact)
        tgt = batch[:, 1:]
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]
        return lse - picked, aux, dropped

    return jax, jnp, forward, token_nll


def is_decayed(name: str) -> bool:
    return name in ("embed", "lm_head", "q", "k", "v", "o", "router", "gate", "up", "down")


def make_train_step(token_nll):
    jax, jnp = _jax()

    def loss_fn(params, batch):
        nll, aux, dropped = token_nll(params, batch, exact=False)
        ce = jnp.mean(nll)
        return ce + AUX_COEF * aux, (ce, aux, dropped)

    @partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, m, v, batch, t, lr):
        (_, (ce, aux, dropped)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        gnorm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
        scale = jnp.minimum(1.0, CLIP_NORM / (gnorm + 1e-6))
        b1, b2 = BETAS
        tf = t.astype(jnp.float32) + 1.0
        new_p, new_m, new_v = {}, {}, {}
        for k in params:
            g = grads[k] * scale
            m_k = b1 * m[k] + (1 - b1) * g
            v_k = b2 * v[k] + (1 - b2) * g * g
            mhat = m_k / (1 - b1 ** tf)
            vhat = v_k / (1 - b2 ** tf)
            upd = mhat / (jnp.sqrt(vhat) + ADAM_EPS)
            if is_decayed(k):
                upd = upd + WEIGHT_DECAY * params[k]
            new_p[k] = params[k] - lr * upd
            new_m[k], new_v[k] = m_k, v_k
        return new_p, new_m, new_v, {"ce": ce, "aux": aux, "dropped": dropped, "gnorm": gnorm, "lr": lr}

    return step


def lr_at(peak: float, step: int, warmup: int, progress: float, floor: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine from peak to floor * peak over progress 0..1.

    progress is the fraction of the wall-clock training budget used, so the schedule ends when
    the budget does, however fast the (shared) machine turns out to be.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = min(max(progress, 0.0), 1.0)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * prog)))


_EVAL_FNS: dict = {}


def evaluate(token_nll, params, wins: np.ndarray, batch: int = 8) -> float:
    """Mean next-token NLL (nats) over all windows, exact routing."""
    jax, jnp = _jax()
    f = _EVAL_FNS.setdefault(id(token_nll), jax.jit(lambda p, b: jnp.sum(token_nll(p, b, exact=True)[0])))
    total, count = 0.0, 0
    for s in range(0, len(wins), batch):
        b = wins[s:s + batch]
        total += float(f(params, jnp.asarray(b)))
        count += b.shape[0] * (b.shape[1] - 1)
    return total / count


# ----------------------------------------------------------------------------- HF folder


def hf_tensors(params: dict) -> dict[str, np.ndarray]:
    """Stacked training params -> {transformers checkpoint key: [out, in] f32 array}."""
    p = {k: np.asarray(v, dtype=np.float32) for k, v in params.items()}
    w = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["norm"], "lm_head.weight": p["lm_head"]}
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        w[pre + "input_layernorm.weight"] = p["ln1"][i]
        w[pre + "post_attention_layernorm.weight"] = p["ln2"][i]
        for k in ("q", "k", "v", "o"):
            w[pre + f"self_attn.{k}_proj.weight"] = p[k][i]
        w[pre + "self_attn.q_norm.weight"] = p["q_norm"][i]
        w[pre + "self_attn.k_norm.weight"] = p["k_norm"][i]
        w[pre + "mlp.gate.weight"] = p["router"][i]
        for e in range(EXPERTS):
            for k in ("gate", "up", "down"):
                w[pre + f"mlp.experts.{e}.{k}_proj.weight"] = p[k][i, e]
    return {k: np.ascontiguousarray(v) for k, v in w.items()}


def params_from_hf(w: dict[str, np.ndarray]) -> dict:
    """Inverse of hf_tensors (f32)."""
    f = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    L = range(LAYERS)
    lay = lambda fmt: np.stack([f(w[fmt.format(i=i)]) for i in L])  # noqa: E731
    exp = lambda k: np.stack([np.stack([f(w[f"model.layers.{i}.mlp.experts.{e}.{k}_proj.weight"])  # noqa: E731
                                        for e in range(EXPERTS)]) for i in L])
    return {
        "embed": f(w["model.embed_tokens.weight"]), "lm_head": f(w["lm_head.weight"]),
        "norm": f(w["model.norm.weight"]),
        "ln1": lay("model.layers.{i}.input_layernorm.weight"),
        "ln2": lay("model.layers.{i}.post_attention_layernorm.weight"),
        "q": lay("model.layers.{i}.self_attn.q_proj.weight"),
        "k": lay("model.layers.{i}.self_attn.k_proj.weight"),
        "v": lay("model.layers.{i}.self_attn.v_proj.weight"),
        "o": lay("model.layers.{i}.self_attn.o_proj.weight"),
        "q_norm": lay("model.layers.{i}.self_attn.q_norm.weight"),
        "k_norm": lay("model.layers.{i}.self_attn.k_norm.weight"),
        "router": lay("model.layers.{i}.mlp.gate.weight"),
        "gate": exp("gate"), "up": exp("up"), "down": exp("down"),
    }


def bf16_round(params: dict) -> dict:
    import ml_dtypes

    return {k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in params.items()}


def hf_config(vocab: int, eot: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": eot,
        "decoder_sparse_step": 1,
        "dtype": "bfloat16",
        "eos_token_id": eot,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": INIT_STD,
        "intermediate_size": 2 * MOE_INTERMEDIATE,  # unused: every layer is an MoE layer
        "max_position_embeddings": MAX_POS,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "norm_topk_prob": True,
        "num_attention_heads": HEADS,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "output_router_logits": False,
        "pad_token_id": eot,
        "rms_norm_eps": RMS_EPS,
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "router_aux_loss_coef": AUX_COEF,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": _transformers_version(),
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_tokenizer_files(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"), pretty=True)
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    _write_json(out / "tokenizer_config.json", {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "chat_template": CHATML_TEMPLATE, "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "errors": "replace",
        "model_max_length": MAX_POS, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": None,
    })


def save_model(params: dict, out: Path, vocab: int, eot: int, im_end: int) -> None:
    import ml_dtypes
    from safetensors.numpy import save_file

    w = {k: np.ascontiguousarray(v.astype(ml_dtypes.bfloat16)) for k, v in hf_tensors(params).items()}
    st = out / "model.safetensors"
    save_file(w, str(st), metadata={"format": "pt"})
    st.chmod(0o644)
    _write_json(out / "config.json", hf_config(vocab, eot))
    _write_json(out / "generation_config.json", {
        "bos_token_id": eot, "do_sample": False, "eos_token_id": [eot, im_end], "pad_token_id": eot,
        "transformers_version": _transformers_version(),
    })


def load_folder_params(out: Path) -> dict:
    from safetensors.numpy import load_file
    import ml_dtypes  # noqa: F401  (registers bfloat16 for numpy)

    return params_from_hf(load_file(str(out / "model.safetensors")))


# ----------------------------------------------------------------------------- commands


def prepare(corpus: Path, out: Path, vocab_size: int):
    from tokenizers import Tokenizer

    train_docs = read_docs(corpus / "train.txt", "<|endoftext|>")
    calib_docs = read_docs(corpus / "calib.txt", "\n\n\n")
    held_docs = read_docs(corpus / "heldout.txt", "\n\n\n")
    out.mkdir(parents=True, exist_ok=True)
    if (out / "tokenizer.json").exists():
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    else:
        t0 = time.time()
        tok = train_tokenizer(train_docs, vocab_size)
        write_tokenizer_files(tok, out)
        print(f"tokenizer: vocab {tok.get_vocab_size()} trained in {time.time() - t0:.1f}s", flush=True)
    for name in ("calib.txt", "heldout.txt"):
        (out / name).write_bytes((corpus / name).read_bytes())
    if (corpus / "split.json").exists():  # which documents went where
        (out / "corpus_split.json").write_bytes((corpus / "split.json").read_bytes())
    train = encode_stream(tok, train_docs)
    held = encode_stream(tok, held_docs)
    calib = encode_stream(tok, calib_docs)
    return tok, train, held, calib


def spread(wins: np.ndarray, n: int) -> np.ndarray:
    """n windows evenly spaced over wins (all of them if there are fewer)."""
    if len(wins) <= n:
        return wins
    return wins[np.linspace(0, len(wins) - 1, n).round().astype(int)]


def train(args) -> None:
    t_begin = time.time()
    deadline = t_begin + args.minutes * 60 - args.eval_reserve
    tok, train_ids, held_ids, calib_ids = prepare(args.corpus, args.out, args.vocab)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    print(f"tokens: train {len(train_ids):,} | heldout {len(held_ids):,} | calib {len(calib_ids):,}", flush=True)

    jax, jnp, forward, token_nll = make_model(vocab)
    params = {k: jnp.asarray(v) for k, v in init_params(args.seed, vocab).items()}
    n_params = sum(int(np.prod(v.shape)) for v in params.values())
    active = n_params - EXPERTS * LAYERS * 3 * HIDDEN * MOE_INTERMEDIATE * (1 - TOP_K / EXPERTS)
    print(f"parameters: {n_params:,} total, {int(active):,} active per token", flush=True)

    rng = np.random.default_rng(args.seed + 1)

    def sample_batch():
        starts = rng.integers(0, len(train_ids) - SEQ - 1, size=args.batch)
        return jnp.asarray(train_ids[starts[:, None] + np.arange(SEQ + 1)[None, :]])

    step = make_train_step(token_nll)
    m = jax.tree_util.tree_map(jnp.zeros_like, params)
    v = jax.tree_util.tree_map(jnp.zeros_like, params)
    log = {"batch": args.batch, "seq": SEQ, "peak_lr": args.lr, "warmup_steps": args.warmup,
           "minutes_budget": args.minutes, "cap_factor": CAP_FACTOR, "aux_coef": AUX_COEF, "history": []}
    t = 0
    t_train = None  # set after the first (compiling) step
    while True:
        now = time.time()
        progress = 0.0 if t_train is None else (now - t_train) / max(1e-9, deadline - t_train)
        if t > 0 and (progress >= 1.0 or (args.max_steps and t >= args.max_steps)):
            break
        lr = lr_at(args.lr, t, args.warmup, progress)
        params, m, v, met = step(params, m, v, sample_batch(), jnp.asarray(t), jnp.asarray(lr, jnp.float32))
        if t_train is None:
            jax.block_until_ready(met["ce"])
            t_train = time.time()
            print(f"first step (compile) {t_train - now:.1f}s; training until "
                  f"{time.strftime('%H:%M:%S', time.localtime(deadline))}", flush=True)
        if t % args.log_every == 0:
            met = {k: float(x) for k, x in met.items()}
            el = time.time() - t_begin
            print(f"step {t:5d} ce {met['ce']:.4f} aux {met['aux']:.4f} drop {met['dropped']:.4f} "
                  f"gnorm {met['gnorm']:.2f} lr {lr:.2e} | {el / 60:.1f} min, progress {progress:.3f}", flush=True)
            log["history"].append({"step": t, "elapsed_s": round(el, 1), "lr": lr,
                                   **{k: round(x, 5) for k, x in met.items()}})
        t += 1
    jax.block_until_ready(params)
    train_s = time.time() - t_train
    print(f"trained {t} steps ({t * args.batch * SEQ:,} tokens) in {(time.time() - t_begin) / 60:.1f} min", flush=True)

    # Save (bf16), then evaluate exactly what was saved.
    save_model({k: np.asarray(x) for k, x in params.items()}, args.out, vocab, eot, im_end)
    saved = {k: jnp.asarray(x) for k, x in load_folder_params(args.out).items()}
    held_w = spread(windows(held_ids), args.eval_windows)
    train_w = spread(windows(train_ids), args.eval_windows)
    t0 = time.time()
    held_loss = evaluate(token_nll, saved, held_w)
    train_loss = evaluate(token_nll, saved, train_w)
    held_text = (args.out / "heldout.txt").read_text(encoding="utf-8")
    log.update({
        "steps": t,
        "train_loop_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - t_begin, 1),
        "tokens_seen": t * args.batch * SEQ,
        "train_tokens": int(len(train_ids)),
        "heldout_tokens": int(len(held_ids)),
        "calib_tokens": int(len(calib_ids)),
        "parameters": n_params,
        "eval_windows": {"train": int(len(train_w)), "heldout": int(len(held_w)), "seq": SEQ},
        "final_train_loss": round(train_loss, 4), "final_train_ppl": round(math.exp(train_loss), 2),
        "heldout_loss": round(held_loss, 4), "heldout_ppl": round(math.exp(held_loss), 2),
        "heldout_bytes_per_token": round(len(held_text.encode()) / len(held_ids), 3),
    })
    print(f"eval ({time.time() - t0:.0f}s, bf16 weights, exact routing, {len(held_w)} + {len(train_w)} windows): "
          f"train loss {train_loss:.4f} (ppl {math.exp(train_loss):.2f}) | held-out loss {held_loss:.4f} "
          f"(ppl {math.exp(held_loss):.2f}) | total {(time.time() - t_begin) / 60:.1f} min", flush=True)
    _write_json(args.out / "train_log.json", log)


def verify(args) -> None:
    """transformers vs this file's forward on held-out text, and greedy continuations."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.utils.logging.set_verbosity_error()
    tok = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    jax, jnp, forward, token_nll = make_model(vocab)
    params = {k: jnp.asarray(x) for k, x in load_folder_params(args.out).items()}
    held = encode_stream(tok, read_docs(args.out / "heldout.txt", "\n\n\n"))
    ids = windows(held)[:: max(1, len(held) // SEQ // 4)][:4, :SEQ].astype(np.int64)

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(args.out), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).float().eval()
    with torch.no_grad():
        hf = model(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()
    ours = np.asarray(jax.jit(lambda p, x: forward(p, x, True)[0])(params, jnp.asarray(ids)))
    rel = np.abs(hf - ours).max() / np.abs(hf).max()
    rel_l2 = np.linalg.norm(hf - ours) / np.linalg.norm(hf)
    agree = float(np.mean(hf.argmax(-1) == ours.argmax(-1)))
    print(f"logits {ids.shape}: max|diff|/max|hf| {rel:.2e}, ||diff||/||hf|| {rel_l2:.2e}, argmax agree {agree:.4f}")

    if args.heldout_loss:  # transformers' loss over every held-out window (its sparse expert loop)
        wins = windows(held).astype(np.int64)
        total, count = 0.0, 0
        with torch.no_grad():
            for s0 in range(0, len(wins), 8):
                b = torch.from_numpy(wins[s0:s0 + 8])
                logits = model(input_ids=b[:, :-1], use_cache=False).logits
                total += float(torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1), reduction="sum"))
                count += b[:, 1:].numel()
        loss = total / count
        print(f"transformers held-out loss over all {len(wins)} windows ({count:,} tokens): {loss:.4f} "
              f"(ppl {math.exp(loss):.2f})")

    prompt = tok.encode(args.prompt).ids
    seq = list(prompt)
    with torch.no_grad():  # greedy, full forward per step, never stopping at EOS
        for _ in range(args.n):
            seq.append(int(model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    new = seq[len(prompt):]
    ours_seq = list(prompt)
    fwd = jax.jit(lambda p, x: forward(p, x, True)[0])
    for _ in range(args.n):
        ours_seq.append(int(np.asarray(fwd(params, jnp.asarray([ours_seq])))[0, -1].argmax()))
    print(f"JAX greedy ids == transformers greedy ids: {ours_seq == seq}")
    print(f"transformers greedy ids: {new}")
    print(f"transformers greedy text: {args.prompt + tok.decode(new)!r}")
    if rel > 1e-4 and rel_l2 > 1e-4:
        sys.exit("error: logits disagree beyond 1e-4 relative")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus", type=Path, help="folder with train.txt, calib.txt, heldout.txt")
    ap.add_argument("out", type=Path, help="HF model folder to write")
    ap.add_argument("--minutes", type=float, default=45.0,
                    help="wall-time budget for everything (the cosine schedule follows the clock)")
    ap.add_argument("--eval-reserve", type=float, default=330.0, help="seconds kept for saving + evaluation")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: budget only)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--eval-windows", type=int, default=96, help="256-token windows scored per split")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--verify", action="store_true", help="compare the saved folder with transformers")
    ap.add_argument("--heldout-loss", action="store_true", help="--verify: also score all of heldout.txt")
    ap.add_argument("--prompt", default="The Python")
    ap.add_argument("-n", type=int, default=40)
    args = ap.parse_args(argv)
    if args.verify:
        verify(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
