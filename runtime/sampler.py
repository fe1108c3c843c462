"""Next-token choice: greedy, or temperature sampling with a seed, filtered by top-k, top-p (nucleus)
and min-p, after an optional repetition penalty on the tokens seen last (as llama.cpp's
--repeat-penalty / --repeat-last-n and vLLM's repetition_penalty: a seen token's positive logit is
divided by it, a negative one multiplied).

The filters keep a prefix of the vocabulary sorted by probability (ties by id): the shortest one
that reaches `top_p` of the mass, at most `top_k` long, none below `min_p` x the top token's
probability; the kept tokens' probabilities are renormalised. That prefix is found without sorting
the vocabulary: the tokens at or above a logit floor (min-p's, exact; else a guessed one, kept only
when it holds the top-k tokens or the top-p mass, else the full vocabulary) are the only ones
sorted. All of it runs in float32 over the vocabulary and float64 over the candidates; B rows share
every vocabulary-wide pass. benchmarks/sampling.py times it against a decode step.

The Sampler's own defaults are plain greedy (the low-level object Session.generate takes); what a
run or request gets when it names nothing is `plan_sampling`'s (strata_compiler/sampling.py).

B = batch rows, V = vocabulary, C = candidate tokens of a row.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass
from typing import Iterator

import numpy as np

from strata_compiler.sampling import FIELDS, TINY_T, Sampling, from_meta, resolve


# Guessed floors, tried in turn: tokens less likely than p x the top token rarely hold what top-k
# or top-p keeps; where none holds it, the row falls back to the exact floor (min-p's, else the whole
# vocabulary): exact, slower.
GUESS_P = (1e-4, 1e-8)


def plan_sampling(meta: dict, **given) -> Sampling:
    """The sampling a run or a request gets: the `given` settings (None: not given) over the plan's
    model's recommendation over Strata's defaults (strata_compiler/sampling.py, docs/sampling.md)."""
    return resolve(from_meta(meta.get("sampling")), **given)


@dataclass
class Sampler:
    temperature: float = 0.0     # 0 = greedy
    top_p: float = 1.0           # 1 = off
    seed: int = 0
    top_k: int = 0               # 0 = off
    min_p: float = 0.0           # 0 = off: keep tokens of probability >= min_p x the largest
    repetition_penalty: float = 1.0   # 1 = off
    repeat_last_n: int = 64      # the penalty's window: the last n tokens seen (-1: all; 0: no penalty)

    @classmethod
    def of(cls, settings: Sampling, seed: int = 0) -> "Sampler":
        return cls(seed=seed, **asdict(settings))

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self._scratch: dict[str, np.ndarray] = {}

    def _buffer(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A scratch array kept across calls: a fresh one of a few MB costs its page faults on every
        step, as much as the arithmetic done in it."""
        a = self._scratch.get(name)
        if a is None or a.shape != shape or a.dtype != dtype:
            a = self._scratch[name] = np.empty(shape, dtype)
        return a

    @property
    def settings(self) -> Sampling:
        return Sampling(**{k: getattr(self, k) for k in FIELDS})

    @property
    def needs_history(self) -> bool:
        return self.repetition_penalty != 1.0 and self.repeat_last_n != 0

    @property
    def greedy(self) -> bool:
        """Argmax: temperature 0, or one so small that 1 / T overflows f32 (its limit is the argmax)."""
        return self.temperature < TINY_T

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits (no penalty): what a device-side greedy loop computes."""
        return self.greedy and not self.needs_history

    def __call__(self, logits: np.ndarray, history=None) -> np.ndarray:
        """logits f32[B, V] -> token ids i64[B]. history: per row, the token ids seen so far
        (prompt and output; only the last `repeat_last_n` count) for the repetition penalty; None:
        no penalty."""
        with self.penalised(logits, history) as x:
            if self.greedy:
                return x.argmax(axis=-1).astype(np.int64)
            u = self.rng.random(len(x))
            out = np.empty(len(x), np.int64)
            for b, (ids, w) in enumerate(self._kept(x)):
                cum = np.cumsum(w)
                out[b] = ids[min(int(np.searchsorted(cum, u[b] * cum[-1], side="right")), len(ids) - 1)]
            return out

    def distribution(self, logits: np.ndarray, history=None) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per row, (the token ids that may be drawn i64[C], their probabilities f64[C]); greedy:
        the argmax with probability 1."""
        with self.penalised(logits, history) as x:
            if self.greedy:
                return [(np.array([t], np.int64), np.ones(1)) for t in x.argmax(axis=-1)]
            return [(ids, w / w.sum()) for ids, w in self._kept(x)]

    @contextlib.contextmanager
    def penalised(self, logits: np.ndarray, history) -> Iterator[np.ndarray]:
        """The logits with the repetition penalty applied, inside the with-block. Only the <= B x
        repeat_last_n seen entries change, so they are changed in the caller's array and put back
        on leaving (a copy of the whole array would cost more than the rest of a call); a read-only
        array is copied into a scratch one instead."""
        if history is None or not self.needs_history:
            yield logits
            return
        x = logits
        if not (isinstance(x, np.ndarray) and x.flags.writeable and x.flags.c_contiguous and x.dtype == np.float32):
            x = self._buffer("penalised", np.shape(logits), np.float32)
            np.copyto(x, logits)
        B, V = x.shape
        flat = x.reshape(-1)                # a view: x is C-contiguous
        n = self.repeat_last_n
        at = []                             # flat indices of the seen ids, row by row
        for b, seen in enumerate(history):
            i = np.asarray(seen[-n:] if n > 0 else seen, np.int64)
            at.append(i[(i >= 0) & (i < V)] + b * V)
        at = np.concatenate(at) if at else np.zeros(0, np.int64)
        saved = flat[at]                    # a repeated id is read, written and put back with the same values
        flat[at] = np.where(saved > 0, saved / self.repetition_penalty, saved * self.repetition_penalty)
        try:
            yield x
        finally:
            if x is logits:
                flat[at] = saved

    def _kept(self, x: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Per row of x [B, V]: the kept token ids i64[C] and their unnormalised weights f64[C]."""
        B, V = x.shape
        T = self.temperature
        inv_t = np.float32(1.0 / T)
        k = self.top_k if 0 < self.top_k < V else 0
        nucleus = self.top_p < 1.0
        m = x.max(axis=-1, keepdims=True).astype(np.float32)                        # [B, 1]

        def weights(b: int, ids) -> np.ndarray:     # exp((x - max) / T) of row b's `ids`, as in _mass
            return np.exp((x[b, ids] - m[b, 0]) * inv_t)

        if not (k or nucleus or self.min_p > 0):    # no filter: every token, as weighted
            for b in range(B):
                yield np.arange(V), weights(b, slice(None)).astype(np.float64)
            return
        # min-p: p >= min_p x p_max  <=>  logit >= max + T log(min_p)
        exact = m + np.float32(T * math.log(self.min_p)) if self.min_p > 0 else np.full_like(m, -np.inf)
        Z = self._mass(x, m, inv_t) if nucleus else None                              # [B]: what top-p measures against
        guesses = [np.maximum(exact, m + np.float32(T * math.log(p))) for p in GUESS_P] if (k or nucleus) else []
        above = np.greater_equal(x, guesses[0] if guesses else exact, out=self._buffer("above", x.shape, bool))
        for b in range(B):
            ids = np.flatnonzero(above[b])
            for i, g in enumerate(guesses):
                if g[b, 0] <= exact[b, 0] or (k and len(ids) >= k) or \
                        (nucleus and weights(b, ids).sum(dtype=np.float64) >= self.top_p * Z[b]):
                    break       # the floor is min-p's own, or the tokens above it hold what is kept
                nxt = guesses[i + 1][b, 0] if i + 1 < len(guesses) else exact[b, 0]
                ids = np.flatnonzero(x[b] >= nxt)
            ids = self._prefix(x[b], ids, k, weights(b, ids) if nucleus else None, Z[b] if nucleus else 0.0)
            yield ids, weights(b, ids).astype(np.float64)

    def _mass(self, x: np.ndarray, m: np.ndarray, inv_t: np.float32) -> np.ndarray:
        """Per row, the sum of exp((x - max) / T) over the whole vocabulary, f64[B] (in float32,
        as `weights` computes each token's)."""
        e = self._buffer("exp", x.shape, np.float32)
        np.subtract(x, m, out=e, casting="same_kind")
        e *= inv_t
        np.exp(e, out=e)
        return e.sum(axis=-1).astype(np.float64)

    def _prefix(self, x: np.ndarray, ids: np.ndarray, k: int, w: np.ndarray | None, Z: float) -> np.ndarray:
        """The kept prefix of `ids` (a row's candidates in id order, holding that prefix) in order of
        logit x, ties by id (equal logits straddling a cut: the lowest ids; backends/xla/sampling.py
        orders them alike): at most k long (0: any), the shortest whose weights `w` (one per id;
        None: no top-p) reach top_p x Z."""
        n = len(ids)
        if w is None and not k:
            return ids
        order = np.argsort(-x[ids], kind="stable")     # by probability, ties by id (as on the device)
        ids = ids[order]
        if k:
            n = min(n, k)
        if w is not None:
            cum = np.cumsum(w[order[:n]], dtype=np.float64)
            n = min(n, int(np.searchsorted(cum, self.top_p * Z)) + 1)
        return ids[:n]
