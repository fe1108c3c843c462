"""Host KV cache: per layer K and V as f32[B, KV, S, hd], S = the cache's capacity.

The runtime owns one per session; the CPU backends and the calibration probe read and write it.
Each row (sequence) has its own length, the position of its next token: a batch of independent
sequences (the server's continuous batching) decodes one token per row at ragged positions. A
step of several tokens per row needs equal lengths (prefill runs in a cache of its own).
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
        self.lengths = np.zeros(batch, np.int64)    # tokens already in each row (its next position)

    @property
    def length(self) -> int:
        """The longest row's length (the rows' common one when uniform): what capacity checks use."""
        return int(self.lengths.max()) if self.lengths.size else 0

    @length.setter
    def length(self, value: int) -> None:
        self.lengths[:] = value

    @property
    def uniform(self) -> bool:
        """Whether every row is at the same position (a step of T > 1 tokens needs it)."""
        return bool(self.lengths.size == 0 or (self.lengths == self.lengths[0]).all())

    def positions(self, T: int) -> np.ndarray:
        """The positions i64[B] of a step of T tokens per row (each row's length), checked against
        the capacity; T > 1 needs uniform rows."""
        if self.length + T > self.capacity:
            raise UsageError(f"sequence of {self.length + T} tokens exceeds the KV cache capacity {self.capacity}; "
                             f"raise --max-seq-len")
        if T > 1 and not self.uniform:
            raise UsageError(f"a step of {T} tokens per row needs rows of one length (got {self.lengths.tolist()})")
        return self.lengths.copy()

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write k, v f32[B, KV, T, hd] at each row's positions [length_b, length_b + T); return the
        rows' caches up to the longest end (positions past a row's own end are not its keys)."""
        t, B = k.shape[2], len(self.lengths)
        pos = self.positions(t)
        if self.uniform:
            p = int(pos[0]) if pos.size else 0
            self.k[layer][:B, :, p:p + t] = k
            self.v[layer][:B, :, p:p + t] = v
        else:
            for b, p in enumerate(pos):
                self.k[layer][b, :, p:p + t] = k[b]
                self.v[layer][b, :, p:p + t] = v[b]
        end = self.length + t
        return self.k[layer][:B, :, :end], self.v[layer][:B, :, :end]

    def advance(self, t: int) -> None:
        self.lengths += t

    def load_row(self, slot: int, src: "KVCache", row: int = 0) -> None:
        """Row `row` of cache `src` (host arrays, same layers, heads and capacity) into row `slot`:
        its keys, values and length (the batch's slot takes a sequence prefilled on its own)."""
        n = int(src.lengths[row])
        if n > self.capacity:
            raise UsageError(f"a sequence of {n} tokens does not fit a KV cache of {self.capacity}")
        for dst, s in ((self.k, src.k), (self.v, src.v)):
            for layer in range(len(dst)):
                dst[layer][slot, :, :n] = s[layer][row, :, :n]
        self.lengths[slot] = n

    def populate(self) -> bool:
        """Give every page of the arrays memory now, their contents unchanged (madvise
        MADV_POPULATE_WRITE, Linux >= 5.14; False where that is not available): reserved when
        the cache is made, not page by page as sequences first reach rows and positions (a batch's
        first sequences in its other rows would otherwise pay that inside their decode steps).
        Safe beside steps that use the cache."""
        return all(_populate(a) for a in (*self.k, *self.v) if a.nbytes)

    def head(self, rows: int) -> "KVCache":
        """The first `rows` rows as a cache of their own: the same per-layer lists of arrays (a
        backend that replaces a layer's array replaces it here too) and a view of their lengths.
        A step on it runs `rows` sequences over arrays of this cache's batch: backends index rows,
        they do not assume the arrays' batch is the step's."""
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k, self.v
        view.capacity = self.capacity
        view.lengths = self.lengths[:rows]
        return view


_PAGE = 4096
_MADV_POPULATE_WRITE = 23


def _populate(a: np.ndarray) -> bool:
    """madvise(MADV_POPULATE_WRITE) over the whole pages of `a`; False where that is not possible."""
    import ctypes
    import sys

    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = -(-a.ctypes.data // _PAGE) * _PAGE
    length = (a.ctypes.data + a.nbytes - start) // _PAGE * _PAGE
    return length <= 0 or madvise(start, length, _MADV_POPULATE_WRITE) == 0
