"""The server's prompt cache: KV of token prefixes already computed (a system prompt, earlier turns
of a chat), reused by later requests that start with them.

Entries are copies of one sequence's keys and values, an LRU bounded in bytes, kept where the
cache's layers live (host arrays, or device arrays: no trip to the host per request). A request
takes the longest prefix it shares with any entry (a shared start of an entry counts, not only
whole entries), so its prefill computes only the rest.

With a folder (`--kv-cache-dir`), entries are written there at shutdown and read at start. A file's
KV becomes the server's answers, so the folder is trusted only as ssh trusts ~/.ssh: it must be
ours and writable by no one else (made with mode 700), else it is refused with one error. Each
file names the plan it belongs to (the SHA-256 of plan.bin) and ends in an HMAC-SHA256 of all its
bytes under a random key that only the server reads (`hmac.key` in the folder, mode 600): reading
plan.bin is not enough to forge an entry. Files are written to a fresh temp file (mkstemp) and
renamed over, and read only as regular files, never through a symlink, never blocking on a FIFO,
with every size bounded (header, file count, bytes in all) and never unpickled; a file that does
not check out is skipped with one warning and the server starts anyway.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import hmac
import json
import os
import secrets
import stat
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from strata_compiler.errors import UsageError
from strata_compiler.untrusted import load_json, printable

MAGIC = b"STRATAKV"
VERSION = 2         # 2: an HMAC under the folder's key (1 had a bare SHA-256 that anyone could recompute)
MAX_HEADER = 4096   # a header is ~150 bytes of JSON
MAX_FILES = 4096    # entry files read at start; the rest are ignored (one warning)
KEY_FILE = "hmac.key"
KEY_BYTES = MAC_BYTES = 32
PAD = 64            # rows move to and from a device cache in blocks of PAD positions (bounded program count)
_FIELDS = {"version", "plan", "n", "layers", "kv_heads", "head_dim"}
# never through a symlink; a FIFO does not block the open (it is refused once fstat says what it is)
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass
class _Entry:
    tokens: np.ndarray          # i64[n]
    k: list                     # per layer [KV, >= n, hd]: host f32, or a device array (padded to PAD positions)
    v: list
    saved: bool = False

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (*self.k, *self.v)) + self.tokens.nbytes


def _padded(n: int, limit: int) -> int:
    return min(-(-n // PAD) * PAD, limit)


_PROGRAMS: dict = {}


def _device_read(arrays: tuple, row: int, n: int) -> tuple:
    """Positions [0, PAD-rounded n) of row `row` of device cache arrays [B, KV, S, hd]: one jitted
    program per rounded length for all of them (no trip to the host)."""
    fn = _PROGRAMS.get("read")
    if fn is None:
        import jax

        def read(arrs, row, m):
            return tuple(jax.lax.dynamic_index_in_dim(a, row, 0, keepdims=False)[:, :m] for a in arrs)
        fn = _PROGRAMS["read"] = jax.jit(read, static_argnums=2)
    return fn(arrays, np.int32(row), _padded(n, arrays[0].shape[2]))


def _device_write(arrays: tuple, blocks: tuple, row: int) -> tuple:
    """Blocks [KV, m, hd] into positions [0, m) of row `row` of device cache arrays (donated: an
    update in place); one program per block length."""
    fn = _PROGRAMS.get("write")
    if fn is None:
        import jax

        def write(arrs, blocks, row):
            return tuple(jax.lax.dynamic_update_slice(a, b[None].astype(a.dtype), (row, 0, 0, 0))
                         for a, b in zip(arrs, blocks))
        fn = _PROGRAMS["write"] = jax.jit(write, donate_argnums=0)
    return fn(arrays, blocks, np.int32(row))


def _host_block(block: np.ndarray, m: int) -> np.ndarray:
    """A host entry's block [KV, n, hd] zero-padded to m positions (written into a device cache)."""
    padded = np.zeros((block.shape[0], m, block.shape[2]), np.float32)
    k = min(m, block.shape[1])
    padded[:, :k] = block[:, :k]
    return padded


def _on_device(a) -> bool:
    return not isinstance(a, np.ndarray)


def _arrays(cache) -> tuple:
    """A cache's per-layer arrays as one tuple, K and V of each layer in turn (the programs' order)."""
    return tuple(a for pair in zip(cache.k, cache.v) for a in pair)


def _set_arrays(cache, arrays: tuple) -> None:
    cache.k[:], cache.v[:] = list(arrays[0::2]), list(arrays[1::2])


class PromptCache:
    def __init__(self, max_bytes: int, plan_id: str, directory: Path | None = None, min_tokens: int = 8,
                 shape: tuple[int, int, int] | None = None) -> None:
        """plan_id: the plan's full identity (plan.digest(): the SHA-256 of plan.bin), which files
        must name; shape: (layers, kv heads, head dim) of the plan's caches (checked on files read).
        A directory that is not ours alone raises UsageError (see the module docstring)."""
        self.max_bytes = max_bytes
        self.plan_id = plan_id
        self.dir = None if directory is None else Path(directory)
        self.min_tokens = min_tokens
        self.shape = shape
        self.entries: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()
        self.bytes = 0
        self._secret = b""
        if self.dir is not None:
            dfd = _open_folder(self.dir)
            try:
                self._secret = _folder_key(dfd, self.dir)
                self._read_dir(dfd)
            finally:
                os.close(dfd)

    @staticmethod
    def _key(tokens: np.ndarray) -> bytes:
        return hashlib.sha256(np.asarray(tokens, np.int64).tobytes()).digest()

    def _common(self, tokens: np.ndarray) -> tuple[int, _Entry | None]:
        best, hit = 0, None
        for e in self.entries.values():
            m = min(len(e.tokens), len(tokens))
            eq = e.tokens[:m] == tokens[:m]
            p = m if eq.all() else int(np.argmin(eq))
            if p > best:
                best, hit = p, e
        return best, hit

    def load(self, tokens, cache, row: int) -> int:
        """Put the longest cached prefix of `tokens` into row `row` of `cache` (its length set);
        returns its length (0 when none of at least min_tokens)."""
        tokens = np.asarray(tokens, np.int64)
        n, e = self._common(tokens)
        if e is None or n < self.min_tokens:
            return 0
        self.entries.move_to_end(self._key(e.tokens))
        L = len(cache.k)
        if _on_device(cache.k[0]):
            # the entry's whole (PAD-rounded) block goes in: positions past n lie past the row's
            # length (masked, then overwritten), and one program per entry length suffices
            m = _padded(len(e.tokens), cache.k[0].shape[2])
            blocks = tuple(b if _on_device(b) else _host_block(b, m) for b in _arrays(e))
            _set_arrays(cache, _device_write(_arrays(cache), blocks, row))
        else:
            for layer in range(L):
                for dst, src in ((cache.k, e.k), (cache.v, e.v)):
                    dst[layer][row, :, :n] = np.asarray(src[layer][:, :n])
        cache.lengths[row] = n
        return n

    def warm(self, cache, *others) -> None:
        """Build, before serving, the programs that move entries in and out of a device cache (one
        per PAD-rounded length; nothing for host caches): into and out of `cache`, out of `others`."""
        if not cache.k or not _on_device(cache.k[0]):
            return
        arrays = _arrays(cache)
        for n in range(PAD, cache.k[0].shape[2] + PAD, PAD):
            arrays = _device_write(arrays, _device_read(arrays, 0, n), 0)
            for c in others:
                _device_read(_arrays(c), 0, n)
        _set_arrays(cache, arrays)

    def store(self, tokens, cache, row: int) -> None:
        """Keep the KV of `tokens` (the first len(tokens) positions of row `row` of `cache`)."""
        tokens = np.asarray(tokens, np.int64)
        n = len(tokens)
        if n < self.min_tokens or int(cache.lengths[row]) < n:
            return
        covered, e = self._common(tokens)
        if covered == n and e is not None:       # already held (as itself or the start of a longer entry)
            self.entries.move_to_end(self._key(e.tokens))
            return
        for key, old in list(self.entries.items()):      # entries that are a prefix of this one: superseded
            if len(old.tokens) <= n and (tokens[:len(old.tokens)] == old.tokens).all():
                self._drop(key)
        if _on_device(cache.k[0]):
            out = _device_read(_arrays(cache), row, n)
            new = _Entry(tokens, list(out[0::2]), list(out[1::2]))
        else:
            new = _Entry(tokens, [a[row, :, :n].copy() for a in cache.k], [a[row, :, :n].copy() for a in cache.v])
        self._add(new)

    def _add(self, e: _Entry) -> None:
        if e.nbytes > self.max_bytes:
            return
        self.entries[self._key(e.tokens)] = e
        self.bytes += e.nbytes
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: bytes) -> None:
        e = self.entries.pop(key)
        self.bytes -= e.nbytes
        if self.dir is not None and e.saved:
            try:
                (self.dir / _file_name(key)).unlink()
            except OSError:
                pass

    # -- the folder --------------------------------------------------------------------------------

    def save(self) -> int:
        """Write the entries not yet in the folder (each to a fresh temp file, synced, then renamed
        over its name: a symlink planted there is replaced, never followed); returns how many."""
        if self.dir is None:
            return 0
        try:
            dfd = _open_folder(self.dir)        # checked again: it may have changed while serving
        except UsageError as err:
            _warn(f"prompt cache not saved: {err}")
            return 0
        n = 0
        try:        # every write is relative to the folder checked (a path swapped meanwhile is not followed)
            for key, e in self.entries.items():
                if e.saved:
                    continue
                try:
                    fd, tmp = _temp_file(dfd, ".tmp")
                    try:
                        _write_synced(fd, self._encode(e))
                        os.replace(tmp, _file_name(key), src_dir_fd=dfd, dst_dir_fd=dfd)
                    except BaseException:
                        _unlink(dfd, tmp)
                        raise
                except OSError as err:
                    _warn(f"prompt cache not saved in {printable(str(self.dir))}: {err.strerror or err}")
                    break
                e.saved = True
                n += 1
        finally:
            os.close(dfd)
        return n

    def _encode(self, e: _Entry) -> list[bytes]:
        """A file's parts: MAGIC, u32 header length, JSON header, payload (tokens i64[n], then K and V
        f32 [KV, n, hd] of each layer), HMAC-SHA256 of all that."""
        t = len(e.tokens)
        head = json.dumps({"version": VERSION, "plan": self.plan_id, "n": int(t), "layers": len(e.k),
                           "kv_heads": int(e.k[0].shape[0]), "head_dim": int(e.k[0].shape[2])}).encode()
        parts = [MAGIC + struct.pack("<I", len(head)) + head, e.tokens.astype("<i8").tobytes()]
        parts += [np.ascontiguousarray(np.asarray(a)[:, :t], "<f4").tobytes() for pair in zip(e.k, e.v) for a in pair]
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(part)
        return parts + [mac.digest()]

    def _read_dir(self, dfd: int) -> None:
        """The folder's *.kv files, newest first while their payloads fit max_bytes (the older ones,
        which would have been evicted, are deleted), then put in the LRU oldest first."""
        found = []
        with os.scandir(dfd) as it:
            for d in it:
                if not d.name.endswith(".kv"):
                    continue
                if len(found) == MAX_FILES:
                    _warn(f"prompt cache folder {printable(str(self.dir))} holds more than {MAX_FILES} "
                          f"*.kv files; only {MAX_FILES} of them were read")
                    break
                found.append(d)
        budget, loaded = self.max_bytes, []
        for d in sorted(found, key=_mtime, reverse=True):
            try:
                e = self._read_file(dfd, d.name, budget)
            except _NoRoom:
                _unlink(dfd, d.name)
                continue
            except FileNotFoundError:       # gone since the folder was listed
                continue
            except (OSError, ValueError, OverflowError, RecursionError, struct.error) as err:
                why = err.strerror if isinstance(err, OSError) and err.strerror else err
                _warn(f"prompt cache file {printable(str(self.dir / d.name))} ignored: {why}")
                continue
            if e is not None:
                e.saved = True
                loaded.append(e)
                budget -= e.nbytes
        for e in reversed(loaded):
            self._add(e)

    def _read_file(self, dfd: int, name: str, budget: int) -> _Entry | None:
        """One entry file, checked: None when it belongs to another plan; ValueError saying why it
        is refused; _NoRoom when it is sound so far but larger than `budget` bytes."""
        f, st = _open_regular(dfd, name)
        with f:
            fixed = f.read(12)
            if len(fixed) < 12 or fixed[:8] != MAGIC:
                raise ValueError("not a Strata prompt-cache file (bad magic)")
            (hl,) = struct.unpack("<I", fixed[8:])
            if not 0 < hl <= MAX_HEADER:
                raise ValueError(f"header length {hl} out of range")
            raw = f.read(hl)
            head = _parse_header(raw)
            if head["plan"] != self.plan_id:
                return None         # another plan's: not ours to judge
            n, L, KV, hd = _sizes(head)
            if self.shape is not None and (L, KV, hd) != tuple(self.shape):
                raise ValueError(f"shape {(L, KV, hd)} is not the plan's {tuple(self.shape)}")
            per = KV * n * hd * 4
            want = 8 * n + 2 * L * per
            if st.st_size != 12 + hl + want + MAC_BYTES:
                raise ValueError("size does not match its header (truncated?)")
            if want > budget:
                raise _NoRoom
            payload = f.read(want)
            tag = f.read(MAC_BYTES + 1)
        if len(raw) != hl or len(payload) != want or len(tag) != MAC_BYTES:
            raise ValueError("it changed while being read")
        mac = hmac.new(self._secret, fixed + raw, hashlib.sha256)
        mac.update(payload)
        if not hmac.compare_digest(mac.digest(), tag):
            raise ValueError("its MAC does not verify under this folder's key (altered, or not written here)")
        tokens = np.frombuffer(payload, "<i8", n).astype(np.int64)
        arrays = [np.frombuffer(payload, "<f4", KV * n * hd, 8 * n + i * per).reshape(KV, n, hd).copy()
                  for i in range(2 * L)]
        return _Entry(tokens, arrays[0::2], arrays[1::2])


class _NoRoom(Exception):
    """A file that would not fit the bytes left: older than those read, so evicted."""


def _warn(text: str) -> None:
    print(f"strata-server: warning: {text}", file=sys.stderr)


def _file_name(key: bytes) -> str:
    return f"{key.hex()[:32]}.kv"


def _parse_header(raw: bytes) -> dict:
    """A header's JSON object, its version this format's and its plan a string (ValueError otherwise)."""
    try:
        head = load_json(raw.decode("utf-8"), max_depth=2)
    except (ValueError, RecursionError) as err:
        raise ValueError(f"header is not JSON ({printable(str(err), 80)})") from None
    if not isinstance(head, dict):
        raise ValueError("header is not a JSON object")
    version = head.get("version")
    if type(version) is not int or version != VERSION:
        raise ValueError(f"format version {printable(repr(version), 20)} is not this server's ({VERSION}); "
                         "delete the file")
    if type(head.get("plan")) is not str:
        raise ValueError("header names no plan")
    return head


def _sizes(head: dict) -> tuple[int, int, int, int]:
    """(n, layers, kv_heads, head_dim) of a header holding exactly the format's fields."""
    if set(head) != _FIELDS:
        raise ValueError(f"header fields are not {sorted(_FIELDS)}")
    sizes = tuple(head[k] for k in ("n", "layers", "kv_heads", "head_dim"))
    if not all(type(x) is int and 0 < x < (1 << 24) for x in sizes):
        raise ValueError("bad sizes in the header")
    return sizes


def _open_regular(dfd: int, name: str) -> tuple[BinaryIO, os.stat_result]:
    """`name` in the folder `dfd`, opened for reading if it is itself a regular file: ValueError
    saying what it is otherwise (a symlink, even to a regular file; a FIFO, which does not block
    here); FileNotFoundError when there is none."""
    try:
        fd = os.open(name, _READ, dir_fd=dfd)
    except FileNotFoundError:
        raise
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ValueError("it is a symbolic link (never followed here)") from None
        raise ValueError(f"cannot open it ({err.strerror or err})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ValueError("it is not a regular file")
    return os.fdopen(fd, "rb"), st


def _mtime(d: os.DirEntry) -> float:
    try:
        return d.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


def _unlink(dfd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError:
        pass


def _open_folder(directory: Path) -> int:
    """An O_DIRECTORY fd of the prompt-cache folder (made, mode 700, when missing), checked as ssh
    checks ~/.ssh: owned by this user and writable by no one else, since whoever can write there
    can change the server's answers. UsageError naming the folder and the fix otherwise."""
    where = f"prompt cache folder {printable(str(directory))}"
    try:
        link = os.lstat(directory)
    except OSError:
        link = None
    if link is not None and stat.S_ISLNK(link.st_mode) and link.st_uid != os.geteuid():
        # whoever owns the link chooses, at any moment, which of our folders the server writes and
        # deletes *.kv files in (in /tmp, anyone): the folder must be reached through our own names
        raise UsageError(f"{where}: it is a symbolic link owned by uid {link.st_uid}, not by this user, who could "
                         f"point it at any folder of ours; give the folder itself")
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as err:
        raise UsageError(f"{where}: cannot create it ({err.strerror or err})") from None
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise UsageError(f"{where}: cannot open it ({err.strerror or err}); give a folder of your own") from None
    st = os.fstat(fd)
    why = None
    if st.st_uid != os.geteuid():
        why = (f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); give a folder of your "
               "own (one that does not exist yet is made with mode 700)")
    elif st.st_mode & 0o022:
        who = "its group and others" if st.st_mode & 0o022 == 0o022 else \
            "its group" if st.st_mode & 0o020 else "others"
        why = (f"it is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}), who could change the server's "
               f"answers; run `chmod 700 {printable(str(directory))}`")
    if why:
        os.close(fd)
        raise UsageError(f"{where}: {why}")
    return fd


def _folder_key(dfd: int, directory: Path) -> bytes:
    """The folder's secret key (KEY_FILE), made when missing: a regular file of KEY_BYTES random
    bytes, ours, readable by no one else. UsageError naming it and the fix otherwise."""
    path = printable(str(directory / KEY_FILE))
    fresh = ("delete it: a new key is made at the next start (the entries written under the old "
             "one are then ignored)")
    for _ in range(2):
        try:
            f, st = _open_regular(dfd, KEY_FILE)
        except FileNotFoundError:
            try:
                _make_key(dfd)
            except OSError as err:
                raise UsageError(f"prompt cache key {path}: cannot make it ({err.strerror or err})") from None
            continue
        except ValueError as err:
            raise UsageError(f"prompt cache key {path}: {err}; {fresh}") from None
        with f:
            key = f.read(KEY_BYTES + 1)
        if st.st_uid != os.geteuid():
            raise UsageError(f"prompt cache key {path}: it is owned by uid {st.st_uid}, not by this user; {fresh}")
        if st.st_mode & 0o077:
            raise UsageError(f"prompt cache key {path}: others may read it (mode {stat.S_IMODE(st.st_mode):o}); "
                             f"{fresh}")
        if len(key) != KEY_BYTES:
            raise UsageError(f"prompt cache key {path}: it is not a key of {KEY_BYTES} bytes; {fresh}")
        return key
    raise UsageError(f"prompt cache key {path}: it vanished while being made")


def _temp_file(dfd: int, suffix: str) -> tuple[int, str]:
    """A fresh file in the folder `dfd` (O_EXCL, O_NOFOLLOW, mode 600): its fd and name."""
    for _ in range(100):
        name = f".{secrets.token_hex(8)}{suffix}"
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                           dir_fd=dfd), name
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no fresh temporary name")


def _write_synced(fd: int, chunks) -> None:
    """The chunks into the new file `fd` (closed after), on the disk before it is renamed or linked."""
    with os.fdopen(fd, "wb") as f:
        f.writelines(chunks)
        f.flush()
        os.fsync(f.fileno())


def _make_key(dfd: int) -> None:
    """KEY_FILE made whole or not at all in the folder `dfd`: written to a temp file (O_EXCL, 0600),
    then hard-linked to its name, which never replaces a file or follows a symlink there (a server
    starting beside this one may have made it first: theirs is kept)."""
    fd, tmp = _temp_file(dfd, ".key")
    try:
        _write_synced(fd, [secrets.token_bytes(KEY_BYTES)])
        os.link(tmp, KEY_FILE, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
    except FileExistsError:
        pass
    finally:
        _unlink(dfd, tmp)
