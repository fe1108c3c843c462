"""Reading files that may be hostile: regular files only, symlinks kept inside their folder, bounded JSON.

Plans, weight files, checkpoints and their JSON are shared and downloaded, so a reader must not
block forever on a FIFO, read a device, follow a symlink out of a plan's folder to /etc/shadow,
or let a deeply nested or out-of-range JSON document escape as a RecursionError or an infinity.
Every file Strata reads as input opens through `open_regular`, every such JSON parses through
`load_json`; their errors are OSError / ValueError subclasses, so the callers' existing handlers
turn them into their one-line StrataError naming the file. A JSON document is bounded before it is
parsed (its values, counted as commas and brackets: `[[],[],...]` costs 64 bytes of Python objects
per 3 bytes of text) and may not name a key twice (which value a reader takes differs between
readers; json.dumps never writes one).
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import stat
from typing import BinaryIO

MAX_JSON_DEPTH = 64   # deepest nesting of any JSON Strata reads (tokenizer.json: ~6; meta, configs: ~4)
# values of one document, counted before parsing as its commas and opening brackets (an overcount:
# those inside strings count too). A safetensors header is ~6 a tensor, an added token of
# tokenizer_config.json ~7, a plan's meta ~1 a source tensor; 2M values cost at most ~250 MB, 2 s.
MAX_JSON_ITEMS = 1 << 21

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class FileRefused(OSError):
    """A path that names no regular file, or one that leaves its folder; `strerror` says which."""

    def __init__(self, why: str, code: int = errno.EINVAL) -> None:
        super().__init__(code, why)


def is_count(v: object) -> bool:
    """A JSON integer >= 0: not a bool, a float or a string of digits (offsets, sizes, dimensions)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def printable(text: str, limit: int = 300) -> str:
    """`text` (a path, a name from a file) safe inside a one-line message: control characters
    escaped, at most `limit` characters."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return out + ("..." if len(text) > limit else "")


def _kind(mode: int) -> str | None:
    """What a non-regular file is, or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike[str], *, within: str | os.PathLike[str] | None = None) -> BinaryIO:
    """Open `path` for binary reading if it is a regular file (symlinks to one are followed).

    With `within`, the file must really lie inside that folder: a symlink from there to anywhere
    outside it is refused. FIFOs, devices, sockets and directories are refused before they are
    opened, and the opened file is checked again (O_NONBLOCK, so a FIFO swapped in meanwhile
    cannot block the open). Raises FileNotFoundError, PermissionError, ... or FileRefused.
    """
    p = os.fsdecode(path)
    if "\0" in p:
        raise FileRefused("its name contains a NUL byte")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if within is not None:
        folder = os.path.realpath(within)
        p = os.path.realpath(p)
        if os.path.commonpath([folder, p]) != folder:
            raise FileRefused("it is a symbolic link to a file outside its folder", errno.ELOOP)
        flags |= getattr(os, "O_NOFOLLOW", 0)   # all resolved: a symlink here now was swapped in since
    what = _kind(os.stat(p).st_mode)
    if what:
        raise FileRefused(f"it is {what}, not a regular file",
                          errno.EISDIR if what == "a directory" else errno.EINVAL)
    try:
        fd = os.open(p, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and within is not None:
            raise FileRefused("it was replaced by a symbolic link while being opened", errno.ELOOP) from None
        raise
    try:
        what = _kind(os.fstat(fd).st_mode)
        if what:
            raise FileRefused(f"it is {what}, not a regular file")
        if flags & getattr(os, "O_NONBLOCK", 0):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of regular file `path`, refusing one larger than `limit` bytes (FileRefused)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise FileRefused(f"it is larger than {limit} bytes ({size}); refusing to read it", errno.EFBIG)
        data = f.read(limit + 1)
    if len(data) > limit:   # grew while being read
        raise FileRefused(f"it is larger than {limit} bytes; refusing to read it", errno.EFBIG)
    return data


class JSONLimitError(ValueError):
    """JSON that parses but is nested too deeply or holds a number out of range."""


def _finite_float(text: str) -> float:
    v = float(text)
    if math.isinf(v):
        raise JSONLimitError(f"number {text[:40]} is out of range")
    return v


def _no_constant(name: str) -> float:
    raise JSONLimitError(f"{name} is not a number Strata accepts here")


def _check_depth(obj: object, max_depth: int) -> None:
    level, depth = [obj], 1         # one level at a time: ~0.1 us a value
    while level:
        if depth > max_depth:
            raise JSONLimitError(f"nested deeper than {max_depth} levels")
        below: list = []
        for o in level:
            below += [c for c in (o.values() if o.__class__ is dict else o) if c.__class__ in _CONTAINERS]
        level, depth = below, depth + 1


_CONTAINERS = (dict, list)


def _unique_keys(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise JSONLimitError(f"key {printable(key, 60)!r} appears twice in one object")
    return out


_DECODERS = {False: json.JSONDecoder(parse_float=_finite_float, parse_constant=_no_constant,
                                     object_pairs_hook=_unique_keys),
             True: json.JSONDecoder(parse_float=_finite_float, parse_constant=float,
                                    object_pairs_hook=_unique_keys)}   # made once: cheap calls


def load_json(data: str | bytes | bytearray | memoryview, *, max_depth: int = MAX_JSON_DEPTH,
              allow_nonfinite: bool = False) -> object:
    """json.loads for untrusted text: nesting at most `max_depth` deep, at most MAX_JSON_ITEMS
    values, each key once per object; numbers that overflow a float (`1e400`) refused, and
    NaN/Infinity too unless `allow_nonfinite`. Raises ValueError (json.JSONDecodeError for bad
    syntax, UnicodeDecodeError for bad bytes, JSONLimitError)."""
    if not isinstance(data, str):
        data = bytes(data)
        data = data.decode(json.detect_encoding(data), "surrogatepass")   # as json.loads does
    items = data.count(",") + data.count("[") + data.count("{")
    if items > MAX_JSON_ITEMS:
        raise JSONLimitError(f"holds more than {MAX_JSON_ITEMS} values ({items} commas and brackets)")
    try:
        obj = _DECODERS[allow_nonfinite].decode(data)
    except RecursionError:
        raise JSONLimitError(f"nested deeper than {max_depth} levels") from None
    if isinstance(obj, (dict, list)):
        _check_depth(obj, max_depth)
    return obj
