"""`stratac eval`: how far a plan's next-token distributions are from a reference's.

The conventions are llama.cpp's `perplexity --kl-divergence`: the text is tokenized once, cut
into consecutive chunks of `ctx` tokens (the incomplete tail is dropped), every chunk runs from
an empty KV cache, and only the second half of each chunk is scored: for i in [ctx/2, ctx-1)
the distribution at position i predicts token i+1. When the tokenizer adds a BOS token, each
chunk's first token is replaced by it (as llama.cpp does). Per scored position:

    KL(ref || plan) = sum_v p_ref(v) * (log p_ref(v) - log p_plan(v))     (float64 log-softmax)
    top-1 agreement = argmax p_ref == argmax p_plan
    NLL             = -log p(actual next token), for both models; perplexity = exp(mean NLL)

`evaluate` is the testable core (plans and token ids in, a dict of numbers out), run through the
runtime's sessions; `stratac eval` (strata_compiler/cli.py) reads its inputs and prints the result.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np

from strata_compiler.errors import UsageError
from strata_compiler.formats import get_format

from .session import Session

MIN_CTX = 4
# Logits of one batch (f32 [B, ctx, V]) per model stay under this many bytes (B >= 1).
_BATCH_LOGIT_BYTES = 256 << 20
_MAX_BATCH = 8
# float64 rows of [V] scored at a time (bounds the log-softmax temporaries).
_SCORE_ELEMS = 1 << 22

REQUIRED_KEYS = ("mean_kl", "p99_kl", "top1", "ppl", "ref_ppl", "tokens", "bits_per_weight", "weight_bytes")


# ------------------------------------------------------------------------------------------------
# the core


def weight_stats(plan) -> tuple[int, int]:
    """(bytes of every stored weight array, weight parameters = sum of logical shape products)."""
    nbytes = params = 0
    for w in plan.graph.weights:
        nbytes += get_format(w.fmt).nbytes(w.shape, w.group_size or 32)
        params += int(np.prod(w.shape, dtype=np.int64))
    return nbytes, params


def quant_label(plan, groups: bool = False) -> str:
    """What a plan's weights are stored as, for `stratac inspect` and `stratac eval`, read from the
    weights themselves (a layer-adaptive plan's options say `quant f32`): the one quantized format
    of a --quant plan (f32 when none is; embeddings, norms and routers always stay f32), else
    `laq: ...` for --bits / --memory-budget and `mixed: ...` for other mixes, listing the
    quantized formats by the bytes they hold (e.g. `laq: int4+int8+bf16`). `groups`: with the
    group sizes of the grouped formats, e.g. `int8 (group 32)`."""
    held: dict[str, int] = {}
    for w in plan.graph.weights:
        if w.fmt != "f32":
            held[w.fmt] = held.get(w.fmt, 0) + get_format(w.fmt).nbytes(w.shape, w.group_size or 32)
    formats = sorted(held, key=lambda f: (-held[f], f))
    opts = plan.meta.get("options")
    laq = isinstance(opts, dict) and bool(opts.get("bits") or opts.get("memory_budget"))
    if not laq and len(formats) <= 1:
        label = formats[0] if formats else "f32"
    else:
        label = f"{'laq' if laq else 'mixed'}: {'+'.join(formats) or 'f32'}"
    sizes = sorted({w.group_size for w in plan.graph.weights if w.group_size})
    if groups and sizes:
        label += f" (group{'s' if len(sizes) > 1 else ''} {', '.join(map(str, sizes))})"
    return label


def make_chunks(token_ids: np.ndarray, ctx: int, chunks: int | None = None,
                bos_id: int | None = None) -> np.ndarray:
    """Consecutive chunks i64[N, ctx] of `token_ids` (tail dropped, at most `chunks` of them);
    with `bos_id`, each chunk's first token becomes BOS."""
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    n = len(ids) // ctx
    if chunks is not None:
        n = min(n, chunks)
    out = ids[: n * ctx].reshape(n, ctx).copy()
    if bos_id is not None and n:
        out[:, 0] = bos_id
    return out


def scored_range(ctx: int) -> tuple[int, int]:
    """Positions [first, last) whose distributions are scored (position i predicts token i+1)."""
    return ctx // 2, ctx - 1


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def score_rows(logits: np.ndarray, ref_logits: np.ndarray, targets: np.ndarray) -> dict[str, np.ndarray]:
    """Per row of f[N, V] logits (plan, reference) and i64[N] next tokens: KL(ref || plan),
    whether the argmaxes agree, and both negative log-likelihoods (all float64 / bool [N])."""
    n, vocab = logits.shape
    step = max(1, _SCORE_ELEMS // max(vocab, 1))
    kl, same, nll, ref_nll = (np.empty(n, np.float64), np.empty(n, bool), np.empty(n, np.float64),
                              np.empty(n, np.float64))
    for s in range(0, n, step):
        e = min(n, s + step)
        lq, lp = _log_softmax(logits[s:e]), _log_softmax(ref_logits[s:e])
        kl[s:e] = (np.exp(lp) * (lp - lq)).sum(axis=-1)
        same[s:e] = logits[s:e].argmax(axis=-1) == ref_logits[s:e].argmax(axis=-1)
        rows, t = np.arange(e - s), targets[s:e]
        nll[s:e] = -lq[rows, t]
        ref_nll[s:e] = -lp[rows, t]
    return {"kl": kl, "same": same, "nll": nll, "ref_nll": ref_nll}


def default_batch(ctx: int, vocab: int, n_chunks: int) -> int:
    return max(1, min(n_chunks, _MAX_BATCH, _BATCH_LOGIT_BYTES // max(ctx * vocab * 4, 1)))


def cache_capacity(ctx: int) -> int:
    """KV capacity for one prefill of ctx tokens, with room for the xla backend's power-of-two
    prefill bucket (the same rounding as Session.generate)."""
    bucket = 1 << max(4, (ctx - 1).bit_length())
    return -(-max(ctx, bucket) // 64) * 64


def run_logits(session, ids: np.ndarray) -> np.ndarray:
    """Logits f32[B, T, V] of ids i64[B, T] from an empty KV cache."""
    session.reset(ids.shape[0], cache_capacity(ids.shape[1]))
    return np.asarray(session.step(ids))


def evaluate(plan, reference_plan, token_ids: np.ndarray, ctx: int, chunks: int | None = None,
             backend: str = "auto", *, device: str = "auto", batch: int | None = None,
             bos_id: int | None = None, progress: Callable[[int], None] | None = None) -> dict:
    """Compare `plan` with `reference_plan` (runtime Plans of one vocabulary) on `token_ids`.

    Returns a dict: mean_kl, p99_kl, top1, ppl, ref_ppl, tokens, bits_per_weight, weight_bytes
    (of `plan`), then kl_stderr, median_kl, max_kl, top1_stderr, ppl_ratio, ref_bits_per_weight,
    ref_weight_bytes, ctx, chunks, backend. `progress(n)` is called after each batch of n chunks.
    """
    if ctx < MIN_CTX:
        raise UsageError(f"--ctx {ctx}: use at least {MIN_CTX} tokens per chunk (default 512)")
    vocab, ref_vocab = plan.meta["model"]["vocab_size"], reference_plan.meta["model"]["vocab_size"]
    if vocab != ref_vocab:
        raise UsageError(f"{reference_plan.path}: vocabulary of {ref_vocab} tokens, but {plan.path} has "
                         f"{vocab}; compare plans of the same model")
    data = make_chunks(token_ids, ctx, chunks, bos_id)
    if len(data) == 0:
        raise UsageError(f"{len(np.asarray(token_ids).reshape(-1))} tokens are fewer than one chunk of "
                         f"--ctx {ctx}; give a longer text or a smaller --ctx")
    batch = batch or default_batch(ctx, vocab, len(data))
    first, last = scored_range(ctx)
    sess = Session(plan, backend, device=device)
    ref_sess = Session(reference_plan, backend, device=device)
    parts: dict[str, list[np.ndarray]] = {"kl": [], "same": [], "nll": [], "ref_nll": []}
    for s in range(0, len(data), batch):
        ids = data[s: s + batch]
        logits = run_logits(sess, ids)
        ref_logits = run_logits(ref_sess, ids)
        for b in range(ids.shape[0]):
            r = score_rows(logits[b, first:last], ref_logits[b, first:last], ids[b, first + 1: last + 1])
            for k, v in r.items():
                parts[k].append(v)
        if progress is not None:
            progress(ids.shape[0])
    kl, same, nll, ref_nll = (np.concatenate(parts[k]) for k in ("kl", "same", "nll", "ref_nll"))
    n = len(kl)
    wbytes, params = weight_stats(plan)
    ref_bytes, ref_params = weight_stats(reference_plan)
    top1 = float(same.mean())
    return {
        "mean_kl": float(kl.mean()),
        "p99_kl": float(np.percentile(kl, 99)),
        "top1": top1,
        "ppl": float(math.exp(nll.mean())),
        "ref_ppl": float(math.exp(ref_nll.mean())),
        "tokens": int(n),
        "bits_per_weight": 8.0 * wbytes / params if params else 0.0,
        "weight_bytes": int(wbytes),
        "kl_stderr": float(kl.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
        "median_kl": float(np.median(kl)),
        "max_kl": float(kl.max()),
        "top1_stderr": float(math.sqrt(top1 * (1.0 - top1) / (n - 1))) if n > 1 else 0.0,
        "ppl_ratio": float(math.exp(nll.mean() - ref_nll.mean())),
        "ref_bits_per_weight": 8.0 * ref_bytes / ref_params if ref_params else 0.0,
        "ref_weight_bytes": int(ref_bytes),
        "ctx": int(ctx),
        "chunks": int(len(data)),
        "backend": sess.backend,
    }


# ------------------------------------------------------------------------------------------------
# inputs: the text, the tokenizer


def read_text(path: Path) -> str:
    if not path.exists():
        raise UsageError(f"--text {path}: no such file; give a UTF-8 text file")
    if not path.is_file():
        raise UsageError(f"--text {path}: not a file; give a UTF-8 text file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--text {path}: not UTF-8 text (byte {e.start}: {e.reason}); convert it to UTF-8") from None
    except OSError as e:
        raise UsageError(f"--text {path}: cannot read it ({e.strerror or e})") from None
    if not text.strip():
        raise UsageError(f"--text {path}: the file is empty; give a UTF-8 text file of at least one --ctx chunk")
    return text


def plan_tokenizer(plan):
    if plan.tokenizer_json is None:
        raise UsageError(f"{plan.path}: the plan has no tokenizer (the model folder had no tokenizer.json); "
                         f"recompile it from a folder with tokenizer.json")
    from tokenizers import Tokenizer

    return Tokenizer.from_str(plan.tokenizer_json.decode())


def tokenizer_bos(tok, plan) -> int | None:
    """The BOS id when the tokenizer prepends one (llama.cpp's add_bos), else None."""
    bos = plan.meta["model"].get("bos_token_id")
    if not isinstance(bos, int) or bos < 0:
        return None
    with_special = tok.encode("a", add_special_tokens=True).ids
    plain = tok.encode("a", add_special_tokens=False).ids
    return bos if len(with_special) > len(plain) and with_special[0] == bos else None


def check_ctx(ctx: int, max_position, source) -> None:
    if isinstance(max_position, int) and 0 < max_position < ctx:
        raise UsageError(f"--ctx {ctx}: larger than the {max_position} positions of {source} "
                         f"(max_position_embeddings); use --ctx {max_position} or less")
