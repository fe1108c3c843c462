"""Materialising WeightSpecs from a checkpoint: streamed for the plan writer, whole for tests.

A WeightSpec's rows are its source tensors concatenated along axis 0, per expert when stacked.
Group-wise formats quantize each row on its own, so a weight can be converted one row block of
one source tensor at a time and written as it goes: peak memory is one block, whatever the
model's size. Blocks are checked finite as they are read, and hashed where the caller asks
(`--calib PLAN.bin` reuses a plan's quantized weights only for source tensors of the same hash).
"""

from __future__ import annotations

import hashlib
from typing import Callable, Iterator, Protocol

import numpy as np

from .errors import ModelError
from .formats import get_format
from .ir import WeightSpec


class TensorStore(Protocol):
    """A checkpoint's tensors by key, as the frontends read them (frontend/safetensors_reader.py,
    frontend/gguf_reader.py)."""

    def iter_row_blocks(self, key: str, block_bytes: int) -> Iterator[np.ndarray]: ...


def iter_blocks(spec: WeightSpec, store: TensorStore, block_bytes: int = 16 << 20, with_expert: bool = False,
                hashes: dict[str, str] | None = None, progress: Callable[[int], None] | None = None,
                native: bool = False):
    """f32 row blocks of the logical tensor, in storage order (expert-major, then sources);
    with_expert: (expert index or None, block) pairs.

    Every block is checked on the way: a NaN or an infinity in the checkpoint is one ModelError
    naming the tensor and row (it would compile, and run to NaN logits). With `hashes`, each source
    tensor's SHA-256 (of its shape and every value read; 32 hex digits) is stored there under its
    key once its last block has been taken; `progress(n)` gets the checkpoint bytes each block was
    read from. `native`: (expert, block, arrays) triples, arrays the block already in the spec's
    stored format where the store holds it so (a GGUF's Q4_0 for int4: no second rounding), else
    None."""
    fmt = (spec.fmt, spec.group_size or 32)
    take = native and getattr(store, "takes_native", False)
    for e in range(spec.experts) if spec.experts else (None,):
        for key in spec.source_keys(e):
            info = store.info(key)
            h = hashlib.sha256(repr(tuple(info.shape)).encode()) if hashes is not None else None
            elems, done, row = max(int(np.prod(info.shape, dtype=np.int64)), 1), 0, 0
            pairs = store.iter_row_blocks(key, block_bytes, native=fmt) if take else None
            for block in pairs if pairs is not None else store.iter_row_blocks(key, block_bytes):
                arrays = None
                if pairs is not None:
                    block, arrays = block
                _check_finite(block, key, info, row)
                row += block.shape[0] if block.ndim > 1 else 1
                if h is not None:
                    h.update(np.ascontiguousarray(block, np.float32))
                if progress:
                    before, done = done, done + block.size
                    progress(done * info.nbytes // elems - before * info.nbytes // elems)
                if native:
                    yield e, block, arrays
                else:
                    yield (e, block) if with_expert else block
            if h is not None:
                hashes[key] = h.hexdigest()[:32]


def _check_finite(block: np.ndarray, key: str, info, row0: int) -> None:
    finite = np.isfinite(block)
    if finite.all():
        return
    where = (f"row {row0 + int(np.argmin(finite.reshape(block.shape[0], -1).all(axis=1)))}" if block.ndim > 1
             else f"element {int(np.argmin(finite))}")
    raise ModelError(f"{getattr(info, 'file', '')}: tensor {key} holds NaN or infinite values ({where}); "
                     f"the checkpoint is corrupt: re-download or repair it")


def materialize_f32(spec: WeightSpec, store: TensorStore) -> np.ndarray:
    """The whole logical tensor as f32, rounded through its format (for tests and references)."""
    w = np.concatenate(list(iter_blocks(spec, store)), axis=0).reshape(spec.shape)
    if spec.fmt != "f32":
        w = get_format(spec.fmt).roundtrip(w, spec.group_size or 32)
    return w.astype(np.float32, copy=False)
