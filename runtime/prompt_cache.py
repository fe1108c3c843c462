"""The server's prompt cache: KV of token prefixes already computed (a system prompt, earlier turns
of a chat), reused by later requests that start with them.

Entries are copies of one sequence's keys and values, an LRU bounded in bytes, kept where the
cache's layers live (host arrays, or device arrays: no trip to the host per request). A request
takes the longest prefix it shares with any entry (a shared start of an entry counts, not only
whole entries), so its prefill computes only the rest. With a folder (`--kv-cache-dir`), entries
are written there at shutdown and read at start: one file per entry, its header naming the plan
it belongs to and the SHA-256 of its payload; a file that does not check out is skipped with one
warning. Files are read with explicit bounds (never unpickled).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"STRATAKV"
VERSION = 1
MAX_HEADER = 1 << 16
PAD = 64            # rows move to and from a device cache in blocks of PAD positions (bounded program count)


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
        """shape: (layers, kv heads, head dim) of the plan's caches (checked on files read)."""
        self.max_bytes = max_bytes
        self.plan_id = plan_id
        self.dir = directory
        self.min_tokens = min_tokens
        self.shape = shape
        self.entries: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()
        self.bytes = 0
        if directory is not None:
            self._read_dir()

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
                (self.dir / f"{key.hex()[:32]}.kv").unlink()
            except OSError:
                pass

    # -- the folder --------------------------------------------------------------------------------

    def save(self) -> int:
        """Write the entries not yet in the folder (temp file + rename); returns how many."""
        if self.dir is None:
            return 0
        self.dir.mkdir(parents=True, exist_ok=True)
        n = 0
        for key, e in self.entries.items():
            if e.saved:
                continue
            t = len(e.tokens)
            payload = b"".join([e.tokens.astype("<i8").tobytes()]
                               + [np.ascontiguousarray(np.asarray(a)[:, :t], "<f4").tobytes()
                                  for pair in zip(e.k, e.v) for a in pair])
            head = json.dumps({"version": VERSION, "plan": self.plan_id, "n": int(t),
                               "layers": len(e.k), "kv_heads": int(e.k[0].shape[0]), "head_dim": int(e.k[0].shape[2]),
                               "sha256": hashlib.sha256(payload).hexdigest()}).encode()
            path = self.dir / f"{key.hex()[:32]}.kv"
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(head)) + head + payload)
            os.replace(tmp, path)
            e.saved = True
            n += 1
        return n

    def _read_dir(self) -> None:
        if not self.dir.is_dir():
            return
        files = sorted(self.dir.glob("*.kv"), key=lambda p: p.stat().st_mtime)
        for path in files:          # oldest first: the newest end up most recently used
            try:
                e = self._read_file(path)
            except ValueError as err:
                print(f"strata-server: warning: prompt cache file {path} ignored: {err}", file=sys.stderr)
                continue
            if e is not None:
                e.saved = True
                self._add(e)

    def _read_file(self, path: Path) -> _Entry | None:
        """One entry file, checked: None when it belongs to another plan; ValueError when damaged."""
        if not path.is_file():
            raise ValueError("not a regular file")
        size = path.stat().st_size
        with open(path, "rb") as f:
            if f.read(8) != MAGIC:
                raise ValueError("not a Strata prompt-cache file (bad magic)")
            (hl,) = struct.unpack("<I", f.read(4) or b"\0\0\0\0")
            if not 0 < hl <= MAX_HEADER:
                raise ValueError(f"header length {hl} out of range")
            try:
                head = json.loads(f.read(hl).decode())
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"header is not JSON ({err})") from None
            if not isinstance(head, dict) or head.get("version") != VERSION:
                raise ValueError("unknown version")
            if head.get("plan") != self.plan_id:
                return None         # another plan's: not ours to judge
            fields = [head.get(k) for k in ("n", "layers", "kv_heads", "head_dim")]
            if not all(type(x) is int and 0 < x < (1 << 24) for x in fields):
                raise ValueError("bad sizes in the header")
            n, L, KV, hd = fields
            if self.shape is not None and (L, KV, hd) != tuple(self.shape):
                raise ValueError(f"shape {(L, KV, hd)} is not the plan's {tuple(self.shape)}")
            per = KV * n * hd * 4
            want = 8 * n + 2 * L * per
            if size != 12 + hl + want or want > self.max_bytes:
                raise ValueError("size does not match its header (truncated?)")
            payload = f.read(want)
        if hashlib.sha256(payload).hexdigest() != head.get("sha256"):
            raise ValueError("checksum mismatch")
        tokens = np.frombuffer(payload, "<i8", n).astype(np.int64)
        arrays = [np.frombuffer(payload, "<f4", KV * n * hd, 8 * n + i * per).reshape(KV, n, hd).copy()
                  for i in range(2 * L)]
        return _Entry(tokens, arrays[0::2], arrays[1::2])
