"""The Strata container: one binary format for `plan.bin` and `weights.bin`, and the plan's layout on it.

(Over 600 lines: the container and the plan's sections on it are one specification, read together.)

A container is a fixed header, named sections (each aligned, checksummed, stored in the order
they were added) and a table of contents (TOC) written last, so a writer can stream multi-GB
weights without knowing the sizes up front. Readers mmap the file read-only and hand out
zero-copy views. Nothing here uses pickle: a container holds bytes, never Python objects.

Legend: u16/u32/u64 = unsigned little-endian integers; [a, b) = byte range; crc32 = zlib.crc32.

Header (HEADER_SIZE = 64 bytes, at offset 0):
  off  size  field            meaning
    0     8  magic            caller-chosen file kind, e.g. b"STRATAPL" (plan), b"STRATAWT" (weights)
    8     2  major   u16      FORMAT_MAJOR; a reader refuses any other major
   10     2  minor   u16      FORMAT_MINOR; a reader accepts every minor of its major
   12     4  flags   u32      caller-defined bits
   16     8  toc_offset u64   where the TOC starts (after the last section)
   24     8  toc_size   u64   TOC length in bytes; toc_offset + toc_size == total_size
   32     8  total_size u64   file size; catches truncation and appended bytes
   40     4  body_checksum    crc32 of [HEADER_SIZE, total_size): sections, padding and TOC
   44     4  toc_checksum     crc32 of [toc_offset, toc_offset + toc_size)
   48    12  reserved         zero when written; ignored when read (room for minor versions)
   60     4  header_checksum  crc32 of header bytes [0, 60)

  magic, major, minor and header_checksum (with what it covers) stay where they are in every
  future major, so any reader can tell a corrupt header from a version it cannot read.

Body (from offset 64): each section starts at the next multiple of its alignment (a power of
two: 64 by default, 4096 for weights so the runtime can mmap pages straight into kernels);
the gaps are zero bytes. After the last section, zero padding up to a multiple of 8, then:

TOC (at toc_offset):
  u32 count, u32 reserved (0)
  count entries, each:
    u64 offset, u64 length, u32 align, u32 crc32 of the section bytes,
    u16 name_len, name_len bytes of UTF-8 name (unique, non-empty)

Readers check, always: magic, header checksum, major version, total_size == file size, TOC
bounds and checksum, that the TOC parses exactly, and that sections are in bounds, aligned,
in file order, non-overlapping and uniquely named. verify="full" also checks body_checksum
and every section checksum (one pass over the file); verify="lazy" checks a section's checksum
on its first access (multi-GB weights); verify="none" never reads section bytes to check them.

The same sections in the same order always give byte-identical files (no timestamps, no pids).

The plan is two containers (end of this file): plan.bin (PLAN_MAGIC; sections "meta" JSON, "ir"
the kernel-level IR as text, "tokenizer", and with --calib "imatrix"; meta["chat"] holds the chat template
and special tokens, frontend/chat.py; meta["sampling"] the model's recommended sampling, checked on
load by strata_compiler/sampling.py) and weights.bin
(WEIGHTS_MAGIC; one 4 KiB-aligned section per stored array, named by `section_name`).
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Union

import numpy as np
import numpy.typing as npt

from .errors import PlanError
from .untrusted import FileRefused, is_count, load_json, open_regular, printable

FORMAT_MAJOR = 1
FORMAT_MINOR = 0

HEADER_SIZE = 64
DEFAULT_ALIGN = 64
WEIGHTS_ALIGN = 4096
MAGIC_SIZE = 8

_HEADER = struct.Struct("<8sHHIQQQII12x")  # everything before header_checksum (60 bytes)
_HEADER_CRC = struct.Struct("<I")
_TOC_HEAD = struct.Struct("<II")
_TOC_ENTRY = struct.Struct("<QQIIH")
_TOC_ALIGN = 8
_MAX_ALIGN = 1 << 31  # largest power of two a u32 holds
_MAX_NAME = 0xFFFF
_CHUNK = 16 << 20  # crc/write granularity: bounded memory, and zlib releases the GIL per call
_ZEROS = bytes(4096)  # reused for padding, so small gaps allocate nothing

_RECOMPILE = "recompile it with `stratac compile`"
_VERIFY_MODES = ("full", "lazy", "none")

assert _HEADER.size + _HEADER_CRC.size == HEADER_SIZE

BytesLike = Union[bytes, bytearray, memoryview, np.ndarray]


@dataclass(frozen=True)
class SectionInfo:
    """Where one section lives in the file, and the crc32 of its bytes."""

    name: str
    offset: int
    length: int
    align: int
    checksum: int


def _err(path: str, problem: str, fix: str = _RECOMPILE) -> PlanError:
    return PlanError(f"{printable(path)}: {problem}; {fix}")


def _crc(view: memoryview, crc: int = 0) -> int:
    for start in range(0, len(view), _CHUNK):
        crc = zlib.crc32(view[start : start + _CHUNK], crc)
    return crc


def _as_bytes(data: BytesLike) -> memoryview:
    """A flat unsigned-byte view of `data` (arrays: their C-order little-endian bytes)."""
    if isinstance(data, np.ndarray):
        if data.dtype.hasobject:
            raise TypeError("cannot store an object array: it holds pointers, not data")
        if data.dtype.byteorder == ">":  # the file is little-endian, whatever the host
            data = data.astype(data.dtype.newbyteorder("<"))
        # via uint8 rather than memoryview(data): extension dtypes (bfloat16) lack a buffer format
        return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    view = memoryview(data)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _check_align(align: int) -> None:
    if isinstance(align, bool) or not isinstance(align, int):
        raise TypeError(f"align must be an int, got {type(align).__name__}")
    if not (1 <= align <= _MAX_ALIGN) or align & (align - 1):
        raise ValueError(f"align must be a power of two in [1, 2**31], got {align}")


def _pad_to(pos: int, align: int) -> int:
    return -pos % align


class ContainerWriter:
    """Writes a container to a temp file next to `path`; close() moves it into place atomically.

    As a context manager, an exception inside the block discards the temp file and leaves
    `path` as it was. Misuse (bad names, alignments, magic) raises ValueError/TypeError, since
    it is a bug in the caller; I/O failures (disk full, no permission) raise PlanError.
    """

    def __init__(self, path: str | os.PathLike[str], magic: bytes, *, flags: int = 0) -> None:
        if not isinstance(magic, bytes) or len(magic) != MAGIC_SIZE:
            raise ValueError(f"magic must be {MAGIC_SIZE} bytes, got {magic!r}")
        if isinstance(flags, bool) or not isinstance(flags, int) or not 0 <= flags < 1 << 32:
            raise ValueError(f"flags must be a u32, got {flags!r}")
        self.path = os.fspath(path)
        self.magic = magic
        self.flags = flags
        # same directory, so os.replace is a rename within one filesystem (atomic)
        self._tmp = f"{self.path}.tmp-{os.getpid()}"
        self._sections: list[SectionInfo] = []
        self._names: set[str] = set()
        self._pos = 0
        self._body_crc = 0
        self._done = False
        try:
            self._f = open(self._tmp, "wb")
        except OSError as e:
            raise _err(self.path, f"cannot create {self._tmp} ({e.strerror or e})",
                       "check that the directory exists and is writable") from e
        try:
            self._f.write(bytes(HEADER_SIZE))  # placeholder; the real header is written last
        except OSError as e:
            raise self._io_error(e) from e
        self._pos = HEADER_SIZE

    # -- writing ------------------------------------------------------------------------------

    def add(self, name: str, data: BytesLike, *, align: int = DEFAULT_ALIGN) -> SectionInfo:
        """Append one section holding `data` (numpy arrays: their raw C-order bytes)."""
        view = _as_bytes(data)  # before writing anything, so a rejected `data` poisons nothing
        return self.add_stream(name, (view,), align=align)

    def add_stream(
        self, name: str, chunks: Iterable[BytesLike], *, align: int = DEFAULT_ALIGN
    ) -> SectionInfo:
        """Append one section written chunk by chunk; only one chunk is in memory at a time.

        If `chunks` raises, the writer is aborted (a half-written section cannot be undone).
        """
        self._check_open()
        self._check_name(name)
        _check_align(align)
        try:
            self._write_raw(memoryview(_zeros(_pad_to(self._pos, align))))
            offset = self._pos
            crc = 0
            for chunk in chunks:
                view = _as_bytes(chunk)
                crc = self._write_raw(view, crc)
        except BaseException as e:
            # a half-written section cannot be taken back: poison the writer so close() refuses
            self._abort()
            if isinstance(e, OSError):
                raise self._io_error(e) from e
            raise
        info = SectionInfo(name, offset, self._pos - offset, align, crc)
        self._sections.append(info)
        self._names.add(name)
        return info

    def close(self) -> None:
        """Write the TOC and header, fsync, and atomically replace `path`. Idempotent."""
        if self._done:
            return
        try:
            self._write_raw(memoryview(_zeros(_pad_to(self._pos, _TOC_ALIGN))))
            toc_offset = self._pos
            toc = bytearray(_TOC_HEAD.pack(len(self._sections), 0))
            for s in self._sections:
                raw = s.name.encode("utf-8")
                toc += _TOC_ENTRY.pack(s.offset, s.length, s.align, s.checksum, len(raw))
                toc += raw
            self._write_raw(memoryview(toc))
            head = _HEADER.pack(
                self.magic, FORMAT_MAJOR, FORMAT_MINOR, self.flags, toc_offset, len(toc),
                self._pos, self._body_crc, zlib.crc32(toc),
            )
            self._f.seek(0)
            self._f.write(head + _HEADER_CRC.pack(zlib.crc32(head)))
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self._tmp, self.path)
        except OSError as e:
            raise self._io_error(e) from e
        except BaseException:
            self._abort()
            raise
        self._done = True
        _fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def abort(self) -> None:
        """Discard everything written so far; `path` is left untouched."""
        self._abort()

    def __enter__(self) -> ContainerWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abort()

    # -- internals ------------------------------------------------------------------------------

    def _write_raw(self, view: memoryview, crc: int = 0) -> int:
        """Write `view`, folding it into the body crc; returns `crc` extended by `view`."""
        for start in range(0, len(view), _CHUNK):
            piece = view[start : start + _CHUNK]
            self._f.write(piece)
            self._body_crc = zlib.crc32(piece, self._body_crc)
            crc = zlib.crc32(piece, crc)
        self._pos += len(view)
        return crc

    def _check_open(self) -> None:
        if self._done:
            raise ValueError(f"{self.path}: writer is closed or aborted")

    def _check_name(self, name: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"section name must be a str, got {type(name).__name__}")
        raw = name.encode("utf-8")  # lone surrogates raise UnicodeEncodeError (a ValueError)
        if not 1 <= len(raw) <= _MAX_NAME:
            raise ValueError(f"section name must be 1..{_MAX_NAME} UTF-8 bytes, got {len(raw)}")
        if name in self._names:
            raise ValueError(f"{self.path}: duplicate section name {name!r}")

    def _abort(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._f.close()
        except (OSError, AttributeError):
            pass
        try:
            os.unlink(self._tmp)
        except OSError:
            pass

    def _io_error(self, e: OSError) -> PlanError:
        """Discard the temp file and describe the failure (disk full, permissions)."""
        self._abort()
        return _err(self.path, f"cannot write ({e.strerror or e})",
                    "check free disk space and permissions, then compile again")


def _zeros(n: int) -> bytes:
    return _ZEROS[:n] if n <= len(_ZEROS) else bytes(n)


def _fsync_dir(directory: str) -> None:
    """Make the rename durable; best effort, since not every OS/filesystem allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_container(
    path: str | os.PathLike[str],
    magic: bytes,
    sections: Iterable[tuple[str, BytesLike]],
    *,
    align: int = DEFAULT_ALIGN,
    flags: int = 0,
) -> None:
    """Write `sections` (name, data) in order, all with the same alignment, atomically."""
    with ContainerWriter(path, magic, flags=flags) as w:
        for name, data in sections:
            w.add(name, data, align=align)


class Container:
    """A read-only, mmapped container. Use `Container.open`; views stay valid until close()."""

    path: str
    magic: bytes
    major: int
    minor: int
    flags: int

    def __init__(self) -> None:  # use Container.open
        self._mm: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._sections: dict[str, SectionInfo] = {}
        self._verified: set[str] = set()
        self._verify = "full"

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], magic: bytes, *, verify: str = "full"
    ) -> Container:
        """Open and check `path`; raises PlanError, naming the file and the fault, if it is bad."""
        if verify not in _VERIFY_MODES:
            raise ValueError(f"verify must be one of {_VERIFY_MODES}, got {verify!r}")
        if not isinstance(magic, bytes) or len(magic) != MAGIC_SIZE:
            raise ValueError(f"magic must be {MAGIC_SIZE} bytes, got {magic!r}")
        self = cls()
        self.path = os.fspath(path)
        self.magic = magic
        self._verify = verify
        self._mm = _map(self.path)
        try:
            self._view = memoryview(self._mm) if self._mm is not None else memoryview(b"")
            self._check_header_and_toc()
            if verify == "full":
                self._check_body()
                self._verified.update(self._sections)
        except BaseException:
            self.close()
            raise
        return self

    # -- access ---------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Section names in file order."""
        return list(self._sections)

    def info(self, name: str) -> SectionInfo:
        try:
            return self._sections[name]
        except (KeyError, TypeError):
            raise _err(
                self.path, f"no section {name!r} (the file has {len(self._sections)} sections)",
                f"{_RECOMPILE} (it may be from a different Strata version)",
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._sections

    def section(self, name: str) -> memoryview:
        """Zero-copy read-only view of a section's bytes (lazy mode checks its crc first)."""
        info = self.info(name)
        if self._view is None:
            raise ValueError(f"{self.path}: container is closed")
        view = self._view[info.offset : info.offset + info.length]
        if name not in self._verified and self._verify == "lazy":
            if _crc(view) != info.checksum:
                raise _err(self.path, f"section {name!r} is corrupt (checksum mismatch)")
            self._verified.add(name)
        return view

    def verify(self, names: Iterable[str], workers: int | None = None) -> None:
        """Check the checksums of sections `names` not checked yet (lazy mode) on `workers`
        threads at once (zlib releases the GIL): a large plan's load is not one core's crc pass."""
        todo = list(dict.fromkeys(n for n in names if n not in self._verified))
        if self._verify != "lazy" or not todo:
            return
        workers = workers or min(16, os.cpu_count() or 1)
        if workers < 2 or len(todo) < 2:
            for n in todo:
                self.section(n)
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(self.section, todo))

    def release(self, offset: int, length: int) -> None:
        """Drop the mapped pages of bytes [offset, offset + length) from this process (whole pages
        inside the range; madvise DONTNEED): they are read back from the file when next touched."""
        if self._mm is None or length <= 0 or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        start = -(-offset // page) * page
        end = (offset + length) // page * page
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def array(self, name: str, dtype: npt.DTypeLike, shape: Iterable[int]) -> np.ndarray:
        """Zero-copy read-only array over a section; its length must match dtype and shape."""
        dt = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        if dt.hasobject or dt.itemsize == 0:
            raise TypeError(f"cannot view section bytes as dtype {dt}")
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        view = self.section(name)
        need = dt.itemsize * math.prod(shape)  # Python ints: no overflow
        if len(view) != need:
            raise _err(
                self.path,
                f"section {name!r} holds {len(view)} bytes but {dt}{list(shape)} needs {need}",
                f"{_RECOMPILE} (plan and weights may be from different compiles)",
            )
        return np.frombuffer(view, dtype=dt).reshape(shape)

    def close(self) -> None:
        """Drop the mapping; if arrays/views are still alive it is freed when the last one goes."""
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # exported views pin the mapping; it unmaps when they are collected
            self._mm = None

    def __enter__(self) -> Container:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Container({self.path!r}, {len(self._sections)} sections)"

    @property
    def body_checksum(self) -> int:
        """The header's crc32 of the body: a cheap identity for a file another one references."""
        return self._body_crc

    @property
    def total_size(self) -> int:
        return len(self._view) if self._view is not None else 0

    # -- checks ---------------------------------------------------------------------------------

    def _check_header_and_toc(self) -> None:
        assert self._view is not None
        buf, path, size = self._view, self.path, len(self._view)
        if size == 0:
            raise _err(path, "empty file (0 bytes)")
        if size < HEADER_SIZE:
            raise _err(path, f"truncated ({size} bytes, shorter than the {HEADER_SIZE}-byte header)")
        head = bytes(buf[:HEADER_SIZE])
        if head[:MAGIC_SIZE] != self.magic:
            # never the file's own bytes: the file may be a secret some link pointed at
            what = _KNOWN_MAGIC.get(head[:MAGIC_SIZE], "not a Strata file")
            raise _err(path, f"wrong file kind ({what}; expected one starting with magic {self.magic!r})",
                       "pass the right file, or " + _RECOMPILE)
        (_, major, minor, flags, toc_offset, toc_size, total_size, body_crc, toc_crc) = (
            _HEADER.unpack_from(head)
        )
        (header_crc,) = _HEADER_CRC.unpack_from(head, _HEADER.size)
        if zlib.crc32(head[: _HEADER.size]) != header_crc:
            raise _err(path, "corrupt header (checksum mismatch)")
        if major > FORMAT_MAJOR:
            raise _err(
                path,
                f"written by a newer Strata (plan format {major}.x); this build reads "
                f"{FORMAT_MAJOR}.x",
                "upgrade Strata or recompile",
            )
        if major < FORMAT_MAJOR:
            raise _err(
                path,
                f"written by an older Strata (plan format {major}.x); this build reads "
                f"{FORMAT_MAJOR}.x",
                _RECOMPILE,
            )
        self.major, self.minor, self.flags = major, minor, flags
        self._body_crc = body_crc
        if total_size > size:
            raise _err(path, f"truncated (header says {total_size} bytes, file has {size})")
        if total_size < size:
            raise _err(
                path, f"{size - total_size} unexpected byte{'s' * (size - total_size > 1)} after the end "
                f"(header says {total_size} bytes, file has {size})",
            )
        if toc_offset < HEADER_SIZE or toc_offset + toc_size != total_size:
            raise _err(
                path, f"corrupt header (table of contents at [{toc_offset}, "
                f"{toc_offset + toc_size}) in a {total_size}-byte file)",
            )
        toc = buf[toc_offset:total_size]
        if zlib.crc32(toc) != toc_crc:
            raise _err(path, "corrupt table of contents (checksum mismatch)")
        self._sections = self._parse_toc(toc, toc_offset)

    def _parse_toc(self, toc: memoryview, toc_offset: int) -> dict[str, SectionInfo]:
        def bad(problem: str) -> PlanError:
            return _err(self.path, f"corrupt table of contents ({problem})")

        if len(toc) < _TOC_HEAD.size:
            raise bad(f"{len(toc)} bytes, too short for its {_TOC_HEAD.size}-byte head")
        count, _ = _TOC_HEAD.unpack_from(toc)
        # bound the loop by what the TOC could hold, before allocating anything per entry
        if count * (_TOC_ENTRY.size + 1) > len(toc) - _TOC_HEAD.size:
            raise bad(f"{count} entries cannot fit in {len(toc)} bytes")
        sections: dict[str, SectionInfo] = {}
        pos, prev_end = _TOC_HEAD.size, HEADER_SIZE
        for i in range(count):
            if pos + _TOC_ENTRY.size > len(toc):
                raise bad(f"entry {i} runs past its end")
            offset, length, align, crc, name_len = _TOC_ENTRY.unpack_from(toc, pos)
            pos += _TOC_ENTRY.size
            if name_len == 0 or pos + name_len > len(toc):
                raise bad(f"entry {i} has a bad name length {name_len}")
            try:
                name = str(toc[pos : pos + name_len], "utf-8")
            except UnicodeDecodeError:
                raise bad(f"entry {i} has a name that is not UTF-8") from None
            pos += name_len
            if name in sections:
                raise bad(f"duplicate section {name!r}")
            if align == 0 or align & (align - 1):
                raise bad(f"section {name!r} has alignment {align}, not a power of two")
            if offset % align:
                raise bad(f"section {name!r} at offset {offset} is not {align}-aligned")
            if offset < prev_end:
                raise bad(f"section {name!r} at offset {offset} overlaps what precedes it")
            if offset + length > toc_offset:
                raise bad(f"section {name!r} at [{offset}, {offset + length}) runs past the "
                          f"sections area (ends at {toc_offset})")
            prev_end = offset + length
            sections[name] = SectionInfo(name, offset, length, align, crc)
        if pos != len(toc):
            raise bad(f"{len(toc) - pos} stray bytes after {count} entries")
        return sections

    def _check_body(self) -> None:
        """One pass over the body: every section's crc, and the crc of everything after the header."""
        assert self._view is not None
        buf = self._view
        body_crc, pos, first_bad = 0, HEADER_SIZE, None
        for s in self._sections.values():
            body_crc = _crc(buf[pos : s.offset], body_crc)  # padding
            crc = 0
            for start in range(s.offset, s.offset + s.length, _CHUNK):
                piece = buf[start : min(start + _CHUNK, s.offset + s.length)]
                crc = zlib.crc32(piece, crc)
                body_crc = zlib.crc32(piece, body_crc)
            if crc != s.checksum and first_bad is None:
                first_bad = s.name
            pos = s.offset + s.length
        body_crc = _crc(buf[pos:], body_crc)  # trailing padding and TOC
        if first_bad is not None:
            raise _err(self.path, f"section {first_bad!r} is corrupt (checksum mismatch)")
        if body_crc != self._body_crc:
            raise _err(self.path, "corrupt bytes between sections (body checksum mismatch)")


def _map(path: str) -> mmap.mmap | None:
    """mmap `path` read-only; None for an empty file (mmap refuses length 0). Only a regular file
    that really lies in the folder it is named in (a symlink out of it is refused): a plan names
    its weights file, and a shared plan's folder must not reach elsewhere on this machine."""
    try:
        f = open_regular(path, within=os.path.dirname(os.path.abspath(path)))
    except FileNotFoundError:
        raise _err(path, "no such file or directory", "check the path, or create it with `stratac compile`") from None
    except FileRefused as e:
        if e.errno == errno.EISDIR:
            raise _err(path, "is a directory, not a file", "pass the plan or weights file") from None
        fix = ("copy the file into that folder instead of linking to it" if e.errno == errno.ELOOP
               else "pass the plan.bin or weights.bin file `stratac compile` wrote")
        raise _err(path, f"cannot open ({e.strerror})", fix) from None
    except OSError as e:
        raise _err(path, f"cannot open ({e.strerror or e})", "check the path and its permissions") from None
    with f:
        try:
            if os.fstat(f.fileno()).st_size == 0:
                return None
            # the mapping keeps its own handle, so the file object can close now
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError, OverflowError) as e:
            raise _err(path, f"cannot map into memory ({e})", "check that it is a regular file") from None


# ------------------------------------------------------------------------------------------------
# the plan's layout

PLAN_MAGIC = b"STRATAPL"
WEIGHTS_MAGIC = b"STRATAWT"
GGUF_MAGIC = b"GGUF"    # llama.cpp's model files: a model, never a plan (runtime/plan.py says to compile it)
WEIGHTS_FILE = "weights.bin"
_KNOWN_MAGIC = {PLAN_MAGIC: f"a Strata plan, magic {PLAN_MAGIC!r}",   # ours: safe to name
                WEIGHTS_MAGIC: f"a Strata weights file, magic {WEIGHTS_MAGIC!r}"}


def section_name(weight: str, array: str) -> str:
    """weights.bin's section of one stored array of a weight, e.g. `L0.attn.q_k_v:qs`."""
    return f"{weight}:{array}"


def is_plan_file(path) -> bool:
    """Whether `path` (a plan.bin, or the directory holding one) starts with PLAN_MAGIC."""
    from pathlib import Path

    p = Path(path)
    p = p / "plan.bin" if p.is_dir() else p
    try:
        with open_regular(p) as f:   # never a FIFO: that would block
            return f.read(len(PLAN_MAGIC)) == PLAN_MAGIC
    except (OSError, ValueError):
        return False


def imatrix_section(importance: dict[str, np.ndarray]) -> bytes:
    """plan.bin's "imatrix" section (--calib): a JSON index line {weight: {offset, shape}}, then
    each weight's mean-square input per column, f32 little-endian, back to back (no pickle)."""
    index, blobs, offset = {}, [], 0
    for name in sorted(importance):
        a = np.ascontiguousarray(importance[name], dtype="<f4")
        index[name] = {"offset": offset, "shape": list(a.shape)}
        blobs.append(a.tobytes())
        offset += a.nbytes
    head = json.dumps(index, sort_keys=True).encode() + b"\n"
    return head + b"".join(blobs)


def parse_imatrix_section(data: bytes) -> dict[str, np.ndarray]:
    """Inverse of imatrix_section; ValueError if the index is malformed or points outside the body."""
    nl = data.index(b"\n")
    index = load_json(data[:nl])
    if not isinstance(index, dict):
        raise ValueError("imatrix index is not an object")
    body = data[nl + 1:]
    out = {}
    for name, ent in index.items():
        shape, off = ent["shape"], ent["offset"]
        if not isinstance(shape, list) or len(shape) > 8 or not all(map(is_count, shape)) or not is_count(off):
            raise ValueError(f"imatrix entry {name!r} has a malformed shape or offset")
        n = math.prod(shape)
        if off % 4 or off + 4 * n > len(body):
            raise ValueError(f"imatrix entry {name!r} lies outside the section")
        out[name] = np.frombuffer(body, "<f4", n, off).reshape(shape)
    return out
