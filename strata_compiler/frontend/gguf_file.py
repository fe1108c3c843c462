"""A GGUF file's header, metadata and tensor directory, read by Strata's own parser: every count and
length is checked against the bytes left in the file and against the caps below *before* anything
is allocated for it, so a hostile file costs at most what its bytes and the caps allow (gguf-py's
GGUFReader grows without bound on an array that claims 2^40 entries, and holds ~1.4 KB of numpy
views per string of an array). Tensor bytes are views of a read-only mmap of the file.

The format (llama.cpp's ggml/include/gguf.h; version 2 and 3 share the layout; little-endian):

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x      key: string | u32 value type | value
                  string: u64 length + UTF-8 bytes; array: u32 item type | u64 count | items
    n_tensors x name: string | u32 n_dims | n_dims x u64 dims (innermost first) | u32 ggml type | u64 offset
    padding to general.alignment (a u32 power of two, default 32)
    tensor data: each tensor at data start + its offset, a multiple of the alignment

Metadata values come back as plain Python objects (int, float, bool, str, lists of them): a short
string of a vocabulary costs ~60-100 bytes (a CPython str and its list slot). Every failure is one
ModelError naming the file and the key or tensor.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelError
from ..untrusted import open_regular

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Caps, each far above what real files hold (noted) and low enough that a file at every cap at once
# stays within Strata's hostile-input bar (10 s, 1 GiB resident).
MAX_TENSORS = 1 << 16          # DeepSeek-V3: ~1,100 tensors (experts stacked per layer)
MAX_KV = 1 << 14               # real files: under 100 keys
MAX_NAME_BYTES = 256           # keys and tensor names (llama.cpp's GGML_MAX_NAME is 64)
MAX_STRING_BYTES = 1 << 20     # one metadata string (chat templates are capped at 256 KiB later)
MAX_ARRAY = 1 << 20            # items of one array: vocabularies are <= 262,144 tokens, merges <= ~450k
MAX_ITEMS = 1 << 22            # items of all arrays: tokens, types, scores and merges of a vocabulary at the cap
MAX_METADATA_BYTES = 1 << 27   # the metadata section: a 262k vocabulary with merges is ~15 MiB
MAX_DIMS = 4                   # GGML_MAX_DIMS

_STRING, _ARRAY, _BOOL = 8, 9, 7
# value type -> numpy dtype of one item (strings and arrays apart)
_SCALARS = {0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"), 4: np.dtype("<u4"),
            5: np.dtype("<i4"), 6: np.dtype("<f4"), _BOOL: np.dtype("<u1"), 10: np.dtype("<u8"),
            11: np.dtype("<i8"), 12: np.dtype("<f8")}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_CORRUPT = "the file is truncated or corrupt"


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    ggml_type: Any              # gguf.GGMLQuantizationType
    shape: tuple[int, ...]      # numpy order, outermost first (GGUF lists dims innermost first)
    offset: int                 # of its first byte in the file
    nbytes: int


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: Path
    version: int
    alignment: int
    data_offset: int            # where tensor data starts
    metadata: dict[str, Any]    # key -> plain Python value (lists for arrays)
    tensors: dict[str, GGUFTensor]
    _map: Any                   # the read-only mmap every tensor view is taken from

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """Bytes [offset, offset + nbytes) of the tensor data as a read-only uint8 view of the mapped file."""
        if not self.data_offset <= offset <= offset + nbytes <= len(self._map):
            raise ValueError(f"{self.path}: bytes [{offset}, {offset + nbytes}) lie outside the tensor data")
        return np.frombuffer(self._map, np.uint8, nbytes, offset)


class _Cursor:
    """A read position in the mapped file; every read checks the bytes left first."""

    def __init__(self, path: Path, buf: Any, size: int) -> None:
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def fail(self, what: str) -> ModelError:
        return ModelError(f"{self.path}: {what}"[:400])

    def need(self, n: int, what: str) -> int:
        """The current position, after checking that `n` bytes follow it; moves past them."""
        if n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, the file has {self.size - self.pos} "
                            f"left; {_CORRUPT}")
        at, self.pos = self.pos, self.pos + n
        return at

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buf, self.need(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buf, self.need(8, what))[0]

    def string(self, what: str, cap: int) -> str:
        n = self.u64(what)
        if n > cap:
            raise self.fail(f"{what} is {n} bytes long, more than the {cap} Strata reads; {_CORRUPT}")
        at = self.need(n, what)
        try:
            return str(self.buf[at:at + n], "utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8; {_CORRUPT}") from None

    def name(self, what: str) -> str:
        """A key or tensor name: short, and printable, as it goes into messages as it is."""
        name = self.string(what, MAX_NAME_BYTES)
        if not name.isprintable():
            raise self.fail(f"{what} holds unprintable characters ({name[:60]!r}); {_CORRUPT}")
        return name


def read_gguf(path: Path) -> GGUFFile:
    """The header, metadata and tensor directory of the GGUF file at `path`, checked (ModelError)."""
    try:
        with open_regular(path) as f:   # a FIFO or device would block or never end
            size = os.fstat(f.fileno()).st_size
            magic = f.read(4)
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size and magic == GGUF_MAGIC else None
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror or e})") from None
    except ValueError as e:         # mmap of a file that shrank to nothing meanwhile
        raise ModelError(f"{path}: cannot map ({e})") from None
    if magic != GGUF_MAGIC:         # the file's own bytes stay out of the message
        raise ModelError(f"{path}: not a GGUF file (it does not start with magic {GGUF_MAGIC!r})")
    size = len(buf)
    cur = _Cursor(path, buf, size)
    cur.need(4, "the magic")
    version = cur.u32("the version")
    if version not in VERSIONS:
        why = (" (a big-endian file: Strata reads little-endian GGUF)" if version and not version & 0xFFFF
               else f" (Strata reads versions {', '.join(map(str, VERSIONS))})")
        raise cur.fail(f"GGUF version {version} is not supported{why}")
    n_tensors, n_kv = cur.u64("the tensor count"), cur.u64("the metadata count")
    # the smallest entries: a 1-byte key, type and a 1-byte value; a 1-byte name, 1 dim, type, offset
    for what, n, cap, least in (("tensor count", n_tensors, MAX_TENSORS, 8 + 1 + 4 + 8 + 4 + 8),
                                ("metadata count", n_kv, MAX_KV, 8 + 1 + 4 + 1)):
        if n > cap:
            raise cur.fail(f"GGUF {what} {n} is more than the {cap} Strata reads; {_CORRUPT}")
        if n * least > size - cur.pos:
            raise cur.fail(f"GGUF {what} {n} is more than the file's {size} bytes can hold; {_CORRUPT}")
    metadata = _read_metadata(cur, n_kv)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    tensors = _read_tensor_infos(cur, n_tensors)
    data_offset = -(-cur.pos // alignment) * alignment
    placed = {}
    for name, (ggml_type, shape, offset, nbytes) in tensors.items():
        if offset % alignment:
            # GGUF places every tensor at a multiple of general.alignment from the data start; one off
            # it would be read shifted (llama.cpp refuses it too)
            raise cur.fail(f"tensor {name} at offset {offset} is not a multiple of the file's alignment "
                           f"{alignment}; the file is corrupt")
        if data_offset + offset + nbytes > size:
            raise cur.fail(f"tensor {name} data lies outside the file (bytes {offset}..{offset + nbytes} after the "
                           f"data start {data_offset}, file size {size}); {_CORRUPT}")
        placed[name] = GGUFTensor(name, ggml_type, shape, data_offset + offset, nbytes)
    _refuse_overlaps(cur, placed)
    return GGUFFile(path, version, alignment, data_offset, metadata, placed, buf)


def _refuse_overlaps(cur: _Cursor, tensors: dict[str, GGUFTensor]) -> None:
    """No two tensors share a byte: llama.cpp writes each after the last (and refuses a file whose
    offsets say otherwise), so one that overlaps another would silently be read as the other's
    bytes (two weights made one by a crafted directory)."""
    end, last = 0, None
    for t in sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes)):
        if last is not None and t.offset < end:
            raise cur.fail(f"tensors {last.name} and {t.name} share bytes {t.offset}..{min(end, t.offset + t.nbytes)} "
                           f"of the file (each tensor has its own bytes); {_CORRUPT}")
        if t.offset + t.nbytes > end:
            end, last = t.offset + t.nbytes, t


def _read_metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    start, items, out = cur.pos, [0], {}
    for i in range(n_kv):
        key = cur.name(f"metadata key #{i}")
        if key in out:
            raise cur.fail(f"GGUF metadata {key!r} appears twice; {_CORRUPT}")
        where = f"GGUF metadata {key!r}"
        vtype = cur.u32(where + " (its type)")
        if vtype == _ARRAY:
            out[key] = _array(cur, where, items)
        else:
            out[key] = _value(cur, vtype, where)
        if cur.pos - start > MAX_METADATA_BYTES:
            raise cur.fail(f"the metadata is more than {MAX_METADATA_BYTES >> 20} MiB (at {where}); {_CORRUPT}")
    a = out.get("general.alignment")
    if a is not None and (type(a) is not int or not 0 < a < 1 << 32 or a & (a - 1)):
        raise cur.fail(f"GGUF metadata 'general.alignment' is {a!r}; it should be a u32 power of two")
    return out


def _value(cur: _Cursor, vtype: int, where: str) -> Any:
    if vtype == _STRING:
        return cur.string(where, MAX_STRING_BYTES)
    dt = _SCALARS.get(vtype)
    if dt is None:
        raise cur.fail(f"{where} has value type {vtype}, which GGUF does not define; {_CORRUPT}")
    v = np.frombuffer(cur.buf, dt, 1, cur.need(dt.itemsize, where))[0].item()
    if vtype == _BOOL:
        if v > 1:
            raise cur.fail(f"{where} is a bool holding {v}; {_CORRUPT}")
        return bool(v)
    return v


def _array(cur: _Cursor, where: str, items: list[int]) -> list:
    """An array's items as a list; `items` counts the items of every array read so far."""
    itype, count = cur.u32(where + " (its item type)"), cur.u64(where + " (its length)")
    if itype == _ARRAY:
        raise cur.fail(f"{where} is an array of arrays, which Strata does not read; {_CORRUPT}")
    if itype != _STRING and itype not in _SCALARS:
        raise cur.fail(f"{where} is an array of value type {itype}, which GGUF does not define; {_CORRUPT}")
    if count > MAX_ARRAY or items[0] + count > MAX_ITEMS:
        raise cur.fail(f"{where} holds {count} items, more than the {MAX_ARRAY} Strata reads in one array "
                       f"({MAX_ITEMS} in all)")
    items[0] += count
    if itype == _STRING:
        return _strings(cur, where, count)
    dt = _SCALARS[itype]
    a = np.frombuffer(cur.buf, dt, count, cur.need(count * dt.itemsize, where))
    if itype == _BOOL:
        if count and a.max() > 1:
            raise cur.fail(f"{where} is an array of bools holding {int(a.max())}; {_CORRUPT}")
        a = a.astype(bool)
    return a.tolist()


def _strings(cur: _Cursor, where: str, count: int) -> list[str]:
    """`count` strings: each at least its 8-byte length, so the file must hold count x 8 bytes first."""
    if count * 8 > cur.size - cur.pos:
        raise cur.fail(f"{where} claims {count} strings, more than the {cur.size - cur.pos} bytes left hold; "
                       f"{_CORRUPT}")
    buf, pos, size, unpack, out = cur.buf, cur.pos, cur.size, _U64.unpack_from, []
    append = out.append
    for i in range(count):      # the loop of _Cursor.string, inlined: a vocabulary is up to MAX_ARRAY strings
        n = unpack(buf, pos)[0] if pos + 8 <= size else -1
        if not 0 <= n <= min(MAX_STRING_BYTES, size - pos - 8):
            cur.pos = pos
            cur.string(f"{where} item {i}", MAX_STRING_BYTES)   # the same bounds: raises, naming the one broken
        try:
            append(str(buf[pos + 8:pos + 8 + n], "utf-8"))
        except UnicodeDecodeError:
            raise cur.fail(f"{where} item {i} is not UTF-8; {_CORRUPT}") from None
        pos += 8 + n
    cur.pos = pos
    return out


def _read_tensor_infos(cur: _Cursor, n_tensors: int) -> dict[str, tuple]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    out: dict[str, tuple] = {}
    for i in range(n_tensors):
        name = cur.name(f"the name of tensor #{i}")
        if name in out:
            raise cur.fail(f"tensor {name} appears twice in the tensor directory; {_CORRUPT}")
        n_dims = cur.u32(f"tensor {name} (its number of dimensions)")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS}); {_CORRUPT}")
        at = cur.need(8 * n_dims, f"tensor {name} (its dimensions)")
        dims = struct.unpack_from(f"<{n_dims}Q", cur.buf, at)
        raw_type = cur.u32(f"tensor {name} (its type)")
        offset = cur.u64(f"tensor {name} (its offset)")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise cur.fail(f"tensor {name} has GGML type {raw_type}, which Strata does not know") from None
        if min(dims) < 1 or dims[0] % block:
            raise cur.fail(f"tensor {name} has dimensions {list(dims)} (innermost first): each must be >= 1 and "
                           f"the first a multiple of {ggml_type.name}'s block of {block}; {_CORRUPT}")
        n = 1
        for d in dims:
            n *= d
        nbytes = n // block * type_size
        if nbytes > cur.size:       # before anything is sized by it (bounds are checked against the data start)
            raise cur.fail(f"tensor {name} of dimensions {list(dims)} needs {nbytes} bytes, more than the file's "
                           f"{cur.size}; {_CORRUPT}")
        out[name] = (ggml_type, tuple(reversed(dims)), offset, nbytes)
    return out
