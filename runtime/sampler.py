"""Next-token choice: greedy, or temperature + nucleus (top-p) sampling with a seed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Sampler:
    temperature: float = 0.0     # 0 = greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        """logits f32[B, V] -> token ids i64[B]."""
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
            keep = order[: int(np.searchsorted(cum, self.top_p) + 1)]
            q = row[keep] / row[keep].sum()
            out[b] = keep[self.rng.choice(len(keep), p=q)]
        return out
