"""Materialising WeightSpecs from a checkpoint: streamed for the plan writer, whole for tests.

A WeightSpec's rows are its source tensors concatenated along axis 0, per expert when stacked.
Group-wise formats quantize each row on its own, so a weight can be converted one row block of
one source tensor at a time and written as it goes: peak memory is one block, whatever the
model's size.
"""

from __future__ import annotations

from typing import Iterator, Protocol

import numpy as np

from .formats import get_format
from .ir import WeightSpec


class TensorStore(Protocol):
    """A checkpoint's tensors by key, as the frontends read them (frontend/safetensors_reader.py,
    frontend/gguf_reader.py)."""

    def iter_row_blocks(self, key: str, block_bytes: int) -> Iterator[np.ndarray]: ...


def iter_blocks(spec: WeightSpec, store: TensorStore, block_bytes: int = 16 << 20, with_expert: bool = False):
    """f32 row blocks of the logical tensor, in storage order (expert-major, then sources);
    with_expert: (expert index or None, block) pairs."""
    for e in range(spec.experts) if spec.experts else (None,):
        for key in spec.source_keys(e):
            for block in store.iter_row_blocks(key, block_bytes):
                yield (e, block) if with_expert else block


def materialize_f32(spec: WeightSpec, store: TensorStore) -> np.ndarray:
    """The whole logical tensor as f32, rounded through its format (for tests and references)."""
    w = np.concatenate(list(iter_blocks(spec, store)), axis=0).reshape(spec.shape)
    if spec.fmt != "f32":
        w = get_format(spec.fmt).roundtrip(w, spec.group_size or 32)
    return w.astype(np.float32, copy=False)


def source_fingerprint(store, keys) -> str:
    """A cheap identity of the checkpoint tensors a plan was built from: each key's shape and
    three of its rows (first, middle, last), hashed. Plans store it, so reusing one plan's work
    for another compile (`--calib PLAN.bin`) can check that the weights are the same."""
    import hashlib

    h = hashlib.sha256()
    for key in sorted(set(keys)):
        info = store.info(key)
        shape = tuple(info.shape)
        h.update(f"{key}:{shape};".encode())
        n = shape[0] if shape else 1
        try:
            rows = [store.read_rows(key, r, r + 1) for r in sorted({0, n // 2, max(n - 1, 0)})]
        except ValueError:      # a store that reads whole heads only (GGUF's permuted q/k): its first block
            rows = [next(iter(store.iter_row_blocks(key, 1 << 16)))]
        for r in rows:
            h.update(np.ascontiguousarray(r, np.float32).tobytes())
    return h.hexdigest()[:32]
