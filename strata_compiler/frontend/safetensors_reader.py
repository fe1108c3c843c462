"""Lazy reader for safetensors checkpoints (single file or sharded with an index).

Only headers are read up front; tensor data is mapped when asked for, a block of rows at a
time, converted to f32 and unmapped again, so compiling never keeps the model resident and the
compiler's RSS stays near one block. (safetensors' own numpy loader copies whole tensors and
has no bf16 in numpy, hence this small reader; the format is a u64 header length, a JSON
header, then raw little-endian data.)
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import ModelError
from ..formats import bf16_bits_to_f32
from ..untrusted import JSONLimitError, is_count, load_json, open_regular, printable, read_regular

_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_MAX_HEADER = 100 * 1024 * 1024     # safetensors' own cap; its values are capped by load_json too
_MAX_INDEX = 64 * 1024 * 1024       # model.safetensors.index.json: one line per tensor
_MAX_RANK = 8
# tensors of a checkpoint, all shards together: DeepSeek-V3 has ~91k (weights and their scales),
# Kimi K2 ~70k weights; each costs ~10 us and ~300 bytes to check and hold (as GGUF's MAX_STORE_KEYS)
MAX_TENSORS = 1 << 18


@dataclass(frozen=True, slots=True)
class TensorInfo:
    key: str
    file: Path
    dtype: str            # safetensors dtype name: F32 | F16 | BF16
    shape: tuple[int, ...]
    offset: int           # absolute byte offset of the data in `file`
    nbytes: int


def _read_header(path: Path) -> dict[str, TensorInfo]:
    try:
        with open_regular(path) as f:   # a FIFO or device named as a shard would block or never end
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(_MAX_HEADER, size - 8):
                raise ModelError(f"{path}: not a safetensors file (header length {n} exceeds the file)")
            header = load_json(f.read(n))
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror or e})") from None
    except JSONLimitError as e:
        raise ModelError(f"{path}: safetensors header {e}; the file is corrupt") from None
    except ValueError:
        raise ModelError(f"{path}: safetensors header is not valid JSON; the file is corrupt") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path}: safetensors header is not a JSON object")
    if len(header) > MAX_TENSORS:
        raise ModelError(f"{path}: safetensors header lists {len(header)} tensors, more than the {MAX_TENSORS} "
                         "Strata reads in a checkpoint; the file is corrupt")
    base = 8 + n
    out = {}
    for key, v in header.items():
        if key == "__metadata__":
            continue
        shape = v.get("shape") if isinstance(v, dict) else None
        offsets = v.get("data_offsets") if isinstance(v, dict) else None
        if (not isinstance(shape, list) or len(shape) > _MAX_RANK or not all(map(is_count, shape))
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(map(is_count, offsets))):
            raise ModelError(f"{path}: malformed header entry for tensor {printable(key, 200)!r} (needs integer "
                             "'shape' and two integer 'data_offsets'); the file is corrupt")
        dtype, shape, (b, e) = v.get("dtype"), tuple(shape), offsets
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise ModelError(f"{path}: tensor {printable(key, 200)} has dtype {printable(str(dtype), 20)}; Strata "
                             "reads F32, F16 and BF16 weights")
        nbytes = _DTYPES[dtype].itemsize * math.prod(shape)   # Python ints: no overflow
        if not (0 <= b <= e) or e - b != nbytes or base + e > size:
            raise ModelError(f"{path}: tensor {printable(key, 200)} data lies outside the file or has the wrong size; "
                             "the file is truncated or corrupt")
        out[key] = TensorInfo(key, path, dtype, shape, base + b, nbytes)
    _check_disjoint(path, out.values(), base)
    return out


def _check_disjoint(path: Path, infos, base: int) -> None:
    """No two tensors share bytes: the format forbids it (safetensors' own loader refuses such a
    file), and a header that points many tensors at the same bytes would pass one tensor off as
    several, or make a small file compile to a plan many times its size."""
    end, last = base, None
    for t in sorted((t for t in infos if t.nbytes), key=lambda t: t.offset):
        if t.offset < end:
            raise ModelError(f"{path}: tensors {printable(last.key, 120)} and {printable(t.key, 120)} share bytes "
                             f"{t.offset - base}..{min(end, t.offset + t.nbytes) - base} of the data; the file is corrupt")
        end, last = t.offset + t.nbytes, t


class TensorStore:
    """All tensors of a model folder by key, read lazily."""

    def __init__(self, infos: dict[str, TensorInfo]) -> None:
        self.infos = infos

    @classmethod
    def open(cls, model_dir: Path) -> "TensorStore":
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = load_json(read_regular(index, _MAX_INDEX))["weight_map"]
                files = sorted(set(weight_map.values()))
                if not all(isinstance(f, str) and f and "/" not in f and "\0" not in f for f in files):
                    raise TypeError
            except OSError as e:
                raise ModelError(f"{index}: cannot read ({e.strerror or e})") from None
            except JSONLimitError as e:
                raise ModelError(f"{index}: {e}; fix or re-download it") from None
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ModelError(f"{index}: not a valid safetensors index (needs a 'weight_map' object of tensor -> shard file name)") from None
        elif (model_dir / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
            if not files:
                raise ModelError(f"{model_dir}: no *.safetensors weights found (Strata reads safetensors checkpoints)")
        infos: dict[str, TensorInfo] = {}
        for name in files:
            path = model_dir / name
            if not path.exists():
                raise ModelError(f"{path}: missing weight shard (listed in model.safetensors.index.json)")
            infos.update(_read_header(path))
            if len(infos) > MAX_TENSORS:
                raise ModelError(f"{path}: the checkpoint's shards list more than {MAX_TENSORS} tensors, more than "
                                 "Strata reads (no model it compiles has that many)")
        return cls(infos)

    def __contains__(self, key: str) -> bool:
        return key in self.infos

    def info(self, key: str) -> TensorInfo:
        return self.infos[key]

    def read_rows(self, key: str, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) of the tensor (along axis 0) as f32; 1-D tensors read whole."""
        t = self.infos[key]
        dt = _DTYPES[t.dtype]
        row = int(np.prod(t.shape[1:], dtype=np.int64)) * dt.itemsize if len(t.shape) > 1 else t.nbytes
        if len(t.shape) <= 1:
            r0, r1 = 0, 1
        start, length = t.offset + r0 * row, (r1 - r0) * row
        if length == 0:
            return np.zeros((0,) + t.shape[1:], np.float32)
        page = start - start % mmap.ALLOCATIONGRANULARITY
        with open_regular(t.file) as f:
            mm = mmap.mmap(f.fileno(), start - page + length, offset=page, access=mmap.ACCESS_READ)
            try:
                raw = np.frombuffer(mm, dtype=dt, count=length // dt.itemsize, offset=start - page)
                out = bf16_bits_to_f32(raw) if t.dtype == "BF16" else raw.astype(np.float32)
                del raw
            finally:
                mm.close()
        return out.reshape((-1,) + t.shape[1:]) if len(t.shape) > 1 else out.reshape(t.shape)

    def iter_row_blocks(self, key: str, block_bytes: int = 16 << 20) -> Iterator[np.ndarray]:
        """The tensor as f32 row blocks of about `block_bytes` (of f32) each."""
        yield from row_blocks(self, key, self.infos[key].shape, block_bytes)


def row_blocks(store, key: str, shape, block_bytes: int, align: int = 1, read=None) -> Iterator:
    """store.read_rows(key, r0, r1) (or read(key, r0, r1)) over consecutive row ranges of about
    `block_bytes` of f32 each, a multiple of `align` rows (a 1-D tensor is one block)."""
    read = read or store.read_rows
    if len(shape) <= 1:
        yield read(key, 0, 1)
        return
    row_f32 = 4 * int(np.prod(shape[1:], dtype=np.int64))
    step = max(1, block_bytes // max(row_f32, 1))
    if align > 1:
        step = max(align, step - step % align)
    for r0 in range(0, shape[0], step):
        yield read(key, r0, min(shape[0], r0 + step))
