"""Next-token choice: greedy, or temperature sampling with a seed, filtered by top-k, top-p (nucleus)
and min-p, after an optional repetition penalty on the tokens already seen (as llama.cpp's
--repeat-penalty and vLLM's repetition_penalty: a seen token's positive logit is divided by it, a
negative one multiplied)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Sampler:
    temperature: float = 0.0     # 0 = greedy
    top_p: float = 1.0           # 1 = off
    seed: int = 0
    top_k: int = 0               # 0 = off
    min_p: float = 0.0           # 0 = off: keep tokens of probability >= min_p x the largest
    repetition_penalty: float = 1.0   # 1 = off

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits (no penalty): what a device-side greedy loop computes."""
        return self.temperature <= 0 and self.repetition_penalty == 1.0

    @property
    def needs_history(self) -> bool:
        return self.repetition_penalty != 1.0

    def __call__(self, logits: np.ndarray, history=None) -> np.ndarray:
        """logits f32[B, V] -> token ids i64[B]. history: per row, the token ids seen so far
        (prompt and output) for the repetition penalty; None: no penalty."""
        if history is not None and self.repetition_penalty != 1.0:
            logits = np.array(logits, np.float32)
            for b, seen in enumerate(history):
                ids = np.unique(np.asarray(seen, np.int64))
                ids = ids[(ids >= 0) & (ids < logits.shape[-1])]
                v = logits[b, ids]
                logits[b, ids] = np.where(v > 0, v / self.repetition_penalty, v * self.repetition_penalty)
        if self.temperature <= 0:
            return logits.argmax(axis=-1).astype(np.int64)
        with np.errstate(over="ignore", divide="ignore"):
            # shifted first: a tiny temperature sends the others to -inf (exp 0), never inf - inf
            z = (logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)) / self.temperature
        p = np.exp(z)
        p /= p.sum(axis=-1, keepdims=True)
        out = np.empty(len(p), np.int64)
        for b, row in enumerate(p):
            order = np.argsort(-row, kind="stable")
            cum = np.cumsum(row[order])
            n = int(np.searchsorted(cum, self.top_p) + 1)
            if self.top_k > 0:
                n = min(n, self.top_k)
            if self.min_p > 0:
                n = min(n, max(1, int((row[order] >= self.min_p * row[order[0]]).sum())))
            keep = order[:n]
            q = row[keep] / row[keep].sum()
            out[b] = keep[self.rng.choice(len(keep), p=q)]
        return out
