"""Sampling on the device: runtime/sampler.py's choice of a token as one traced function, so that a
sampled decode step chooses its token where its logits are and the next step is dispatched before
the host has seen it (decode_ahead), as greedy decoding does. Without it the host fetches each
step's logits, samples and launches the next step while the device idles.

The same rules as the host's: a repetition penalty on each row's last W tokens seen, temperature,
top-k, top-p measured against the whole vocabulary's mass, min-p; the kept tokens in order of logit
(ties by id); one uniform per row and step, drawn by the host's generator. A seed gives the host's
tokens but for float rounding (sums in f32 here, f64 there). Top-k bounds the sort: without one, or
with more than MAX_K, a generation samples on the host. The top-k runs in two stages (the top k of
each chunk of CHUNK logits, then of those): XLA's GPU top-k sorts the whole row for k > 16, and the
chunked form costs about half of that (benchmarks/sampling_choice.py).
"""

from __future__ import annotations

import math

import numpy as np

from strata_compiler.sampling import Sampling

from .dequant import _jnp
from .device import load_jax

MAX_K = 1024        # top-k candidates sorted on the device
MAX_WINDOW = 4096   # tokens of the repetition penalty's window kept on the device
CHUNK = 1024        # logits per chunk of the two-stage top-k


GREEDY = Sampling(temperature=0.0, repetition_penalty=1.0)     # a row no request samples


def supported(s: Sampling, vocab: int) -> bool:
    """Whether `choose` computes this sampling: a bounded penalty window, and greedy or a top-k of
    at most MAX_K (below the vocabulary)."""
    if s.window and not 0 < s.window <= MAX_WINDOW:
        return False
    return s.argmax or 0 < s.top_k <= min(MAX_K, vocab - 1)


def knobs(s: Sampling) -> np.ndarray:
    """A row's traced settings, f32 [5]: penalty, 1 / temperature (0: greedy), top-p, min-p's offset
    below the top logit (temperature x log min-p; -inf when off) and top-k, each as the host
    computes it."""
    if s.argmax:
        return np.array([s.repetition_penalty, 0.0, 1.0, -np.inf, 1.0], np.float32)
    off = np.float32(s.temperature * math.log(s.min_p)) if s.min_p > 0 else -np.inf
    return np.array([s.repetition_penalty, np.float32(1.0 / s.temperature), s.top_p, off, s.top_k], np.float32)


def generation_constants(uniforms: np.ndarray, settings: Sampling) -> tuple[np.ndarray, np.ndarray]:
    """A decode-ahead generation's constants: its uniforms f32 [L, B] (the n x B drawn, zeros past
    them: L a power of two from 64, so that a few lengths share a program) and each row's knobs
    f32 [B, 5]."""
    n, B = uniforms.shape
    U = np.zeros((max(64, 1 << max(0, n - 1).bit_length()), B), np.float32)
    U[:n] = uniforms
    return U, np.tile(knobs(settings), (B, 1))


def static(settings) -> tuple[int, bool]:
    """What shapes the traced function for rows sampled by `settings` (one Sampling or several):
    (candidates sorted: the largest top-k, a power of two where rows differ; every row greedy)."""
    rows = [settings] if isinstance(settings, Sampling) else list(settings)
    ks = [r.top_k for r in rows if not r.argmax]
    if not ks:
        return 0, True
    k = max(ks)
    if len(set(ks)) > 1:
        k = min(1 << (k - 1).bit_length(), MAX_K)
    return k, False


def choose(x, hist, u, kn, k: int, all_greedy: bool):
    """Tokens int32 [B] from logits x f32 [B, V]: hist int32 [B, W] the tokens each row saw last
    (-1 none), u f32 [B] the uniforms, kn f32 [B, 5] each row's `knobs`; k (at least every sampled
    row's top-k) and all_greedy static."""
    jax, jnp = load_jax(), _jnp()
    B, V = x.shape
    x = x.astype(jnp.float32)
    if hist.shape[1]:
        ok = (hist >= 0) & (hist < V)
        seen = jnp.zeros((B, V), jnp.int8).at[jnp.arange(B)[:, None], jnp.where(ok, hist, 0)].max(
            ok.astype(jnp.int8))
        p = kn[:, 0:1]
        x = jnp.where(seen > 0, jnp.where(x > 0, x / p, x * p), x)
    if all_greedy:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    vals, ids = top_k(jax, jnp, jnp.where(x == 0, 0.0, x), k)     # -0.0 as +0.0: ties by id, as the host
    return from_candidates(x, vals, ids, u, kn, k)


def from_candidates(x, vals, ids, u, kn, k: int):
    """`choose`'s token from the penalised logits x [B, V] and their top k (vals, ids [B, k], by
    logit): temperature, top-p against the whole row's mass, min-p, the draw u; greedy rows (no
    temperature) the first candidate."""
    jnp = _jnp()
    inv_t, top_p, floor, k_row = kn[:, 1:2], kn[:, 2], kn[:, 3:4], kn[:, 4].astype(jnp.int32)
    m, best = vals[:, :1], ids[:, 0].astype(jnp.int32)
    w = jnp.exp((vals - m) * inv_t)
    n = jnp.minimum(jnp.sum(vals >= m + floor, axis=-1), k_row)    # min-p: a prefix of the sorted candidates
    z = jnp.sum(jnp.exp((x - m) * inv_t), axis=-1)
    reach = jnp.sum(jnp.cumsum(w, axis=-1) < (top_p * z)[:, None], axis=-1) + 1
    n = jnp.maximum(jnp.minimum(n, jnp.where(top_p < 1, reach, k)), 1)
    c = jnp.cumsum(jnp.where(jnp.arange(k)[None, :] < n[:, None], w, 0.0), axis=-1)
    j = jnp.minimum(jnp.sum(c <= (u * c[:, -1])[:, None], axis=-1), n - 1)
    tok = jnp.take_along_axis(ids, j[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(kn[:, 1] > 0, tok, best)


def top_k(jax, jnp, x, k: int):
    """lax.top_k(x, k) of x [B, V] (values and ids, equal values by id) in two stages where that
    cuts the candidates fourfold: the top k of each chunk of CHUNK (x padded with -inf), then the
    top k of those candidates, kept in chunk order (so equal values stay in id order)."""
    B, n = x.shape
    if 4 * k > CHUNK or CHUNK >= n:
        return jax.lax.top_k(x, k)
    C = -(-n // CHUNK)
    if C * CHUNK > n:
        x = jnp.pad(x, ((0, 0), (0, C * CHUNK - n)), constant_values=-jnp.inf)
    v, j = jax.lax.top_k(x.reshape(B, C, CHUNK), k)                               # [B, C, k]
    pos = (j + (jnp.arange(C, dtype=j.dtype) * CHUNK)[None, :, None]).reshape(B, C * k)
    v, j = jax.lax.top_k(v.reshape(B, C * k), k)
    return v, jnp.take_along_axis(pos, j, axis=1)


def remember(hist, tok):
    """The window after token `tok` int32 [B]: the oldest dropped."""
    jnp = _jnp()
    if not hist.shape[1]:
        return hist
    return jnp.concatenate([hist[:, 1:], tok[:, None].astype(hist.dtype)], axis=1)
