"""Host KV cache: per layer K and V as f32[B, KV, S, hd], S = the cache's capacity.

The runtime owns one per session; the CPU backends and the calibration probe read and write it.
"""

from __future__ import annotations

import numpy as np

from .errors import UsageError


class KVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, capacity: int) -> None:
        shape = (batch, n_kv_heads, capacity, head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(n_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(n_layers)]
        self.capacity = capacity
        self.length = 0   # tokens already in the cache (the position of the next token)

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write k, v f32[B, KV, T, hd] at positions [length, length+T); return the filled prefix."""
        t = k.shape[2]
        end = self.length + t
        if end > self.capacity:
            raise UsageError(f"sequence of {end} tokens exceeds the KV cache capacity {self.capacity}; raise --max-seq-len")
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, t: int) -> None:
        self.length += t
