"""Serialized executables: a later process runs a plan's programs without tracing, lowering or
compiling them.

JAX's persistent compilation cache saves XLA's compile, but its key is the lowered module, so a
new process still traces and lowers every program first: seconds for a whole plan (the Pallas
kernels' Triton lowering most of it). A `Program` keeps each executable of one jitted function by
the abstract signature of its arguments: in memory, else loaded from the cache directory, else
compiled and stored there.

An entry's key names everything that shapes the program: the caller's scope (the plan's graph,
the executor's own choices and the settings that change what is traced), the function, its static
arguments, the arguments' tree, shapes, dtypes and devices, the JAX and jaxlib versions and the
digest of Strata's sources; not a setting that changes nothing traced (a temperature given by
STRATA_TEMPERATURE is another program's argument, not another program). A file is `MAGIC`, a
JSON header (the key in full, the argument and output trees, the caller's metadata, the
payload's sha256) and JAX's serialized executable (`serialize_executable`).
`prefetch` starts loading every entry of a program's scope on threads before its first call (a
new process's weights go up meanwhile); the call takes the one of its signature.

Executables are code, so this directory is trusted exactly as JAX's own compilation cache beside
it is: it must belong to this user and be writable by no one else (else nothing is loaded), and a
payload is unpickled only after a scan admits every global it names (JAX's and NumPy's types).
An entry that fails any check or to load is skipped with one warning and the program is compiled
again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickletools
import stat
import sys
import tempfile
import warnings
from pathlib import Path

from strata_compiler import settings

from .device import load_jax

MAGIC = b"STRATA-XLA-EXECUTABLE-1\n"
MAX_HEADER = 1 << 20
MAX_ENTRIES = 512           # the directory keeps the newest this many entries
_GLOBALS = ("jax.", "jaxlib.", "numpy", "ml_dtypes")    # modules a payload may name (prefixes)
_warned: set[str] = set()


def _warn(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=3)


@functools.cache
def source_digest() -> str:
    """sha256 over Strata's Python sources (the package root, backends/, runtime/ and passes/)."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for sub in ("strata_compiler", "backends", "runtime", "passes"):
        for p in sorted((root / sub).rglob("*.py")):
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def directory() -> Path | None:
    """The cache directory of executables, made 0700; None when it is not this user's alone."""
    d = settings.cache_root() / "xla-executables"
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = d.stat()
    except OSError:
        return None
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        _warn(f"{d}: not this user's alone (owner or permissions); serialized executables are not used")
        return None
    return d


def _scan_globals(payload: bytes) -> bool:
    """Whether every global the pickle stream names is in `_GLOBALS` (and it uses no opcode that
    names one another way). STACK_GLOBAL's module and name are the last two strings pushed or
    fetched from the memo."""
    strings: list = []
    memo: dict = {}
    try:
        for op, arg, _ in pickletools.genops(payload):
            name = op.name
            if name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
                strings.append(arg)
            elif name == "MEMOIZE":
                memo[len(memo)] = strings[-1] if strings else None
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[arg] = strings[-1] if strings else None
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                strings.append(memo.get(arg))
            elif name in ("INST", "OBJ", "EXT1", "EXT2", "EXT4"):
                return False
            elif name == "GLOBAL":
                if not _admitted(str(arg).split(" ", 1)[0]):
                    return False
                strings.append(None)
            elif name == "STACK_GLOBAL":
                if len(strings) < 2 or not isinstance(strings[-2], str) or not isinstance(strings[-1], str) \
                        or not _admitted(strings[-2]):
                    return False
                strings.append(None)
            elif name not in ("PROTO", "FRAME", "MARK", "STOP"):
                strings.append(None)        # some other value pushed
    except Exception:       # a damaged stream
        return False
    return True


def _admitted(module: str) -> bool:
    return module == "jax" or module.startswith(_GLOBALS)


def _jax_config():
    """JAX's config states (usable as context managers), or None where this JAX lacks them."""
    try:
        from jax._src import config
    except ImportError:
        return None
    return config


def _tree_spec(tree) -> object:
    """The structure of a program's arguments or output (tuples, lists, dicts and Nones around
    arrays) as JSON."""
    if tree is None:
        return {"n": 0}
    if isinstance(tree, (tuple, list)):
        return {"t": [_tree_spec(v) for v in tree]}
    if isinstance(tree, dict):
        return {"d": [[k, _tree_spec(v)] for k, v in tree.items()]}
    return None


def _from_spec(spec) -> object:
    if spec is None:
        return 0
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError("bad output tree")
    if "t" in spec:
        return tuple(_from_spec(v) for v in spec["t"])
    if "d" in spec:
        return {k: _from_spec(v) for k, v in spec["d"]}
    if "n" in spec:
        return None
    raise ValueError("bad output tree")


def _leaf_sig(x) -> str:
    sh = getattr(x, "sharding", None)
    devs = sorted(d.id for d in x.devices()) if hasattr(x, "devices") and callable(x.devices) else []
    return f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}" \
           f"{'w' if getattr(x, 'weak_type', False) else ''}@{devs}:{type(sh).__name__}"


class Program:
    """A jitted function whose executables persist across processes (see the module docstring).
    Its first argument (the weights) must keep its shapes for as long as it is the same object.

    scope: a function giving a string that names what else shapes the traced program (the caller's graph digest and
    options). `meta_of(static)` (after a compile) gives JSON the caller needs back when the
    executable is loaded instead (its trace-time side results); `restore(static, meta)` takes it
    (and raises on a value it cannot use)."""

    def __init__(self, name: str, fn, scope: str, static_argnums=(), donate_argnums=(),
                 meta_of=None, restore=None) -> None:
        jax = load_jax()
        self.name = name
        self.jit = jax.jit(fn, static_argnums=static_argnums, donate_argnums=donate_argnums)
        self.static = tuple(static_argnums)
        self.scope = scope
        self.meta_of, self.restore = meta_of, restore
        self.exes: dict[tuple, object] = {}
        self._pending: dict[str, tuple] = {}     # signature -> (key, input tree, future of a prefetch)
        self._fixed = None      # (the first argument, its signature): it stays one object

    def lower(self, *args):
        """The traced program, as `jax.jit(...).lower` (benchmarks look inside it)."""
        return self.jit.lower(*args)

    def __call__(self, *args):
        jax = load_jax()
        dyn = tuple(a for i, a in enumerate(args) if i not in self.static)
        static = tuple(args[i] for i in self.static)
        first = dyn[0] if dyn else None
        if self._fixed is None or self._fixed[0] is not first:     # the weights: one signature per object
            leaves0, tree0 = jax.tree_util.tree_flatten(first)
            self._fixed = (first, (tree0, tuple((x.shape, x.dtype) for x in leaves0)))
        leaves, tree = jax.tree_util.tree_flatten(dyn[1:])
        key = (static, self._fixed[1], tree, tuple((x.shape, x.dtype) for x in leaves))
        exe = self.exes.get(key)
        if exe is not None:
            return exe(*dyn)
        sig = f"{static}|{self._fixed[1][0]}|{tree}|" + ",".join(map(_leaf_sig, jax.tree_util.tree_leaves(first) + leaves))
        exe = self._prefetched(sig, dyn, static)
        if exe is None and settings.get("xla_executables"):
            exe = self._load(sig, dyn, static)
        if exe is None:
            exe = self._compile(args)
            out = exe(*dyn)
            self.exes[key] = exe
            if settings.get("xla_executables") and getattr(_jax_config(), "enable_compilation_cache", None) is not None:
                self._store(sig, exe, out, static, dyn)
            return out
        self.exes[key] = exe
        return exe(*dyn)

    def _compile(self, args):
        """Lower and compile, past JAX's persistent cache when the result will be stored: an
        executable loaded from that cache serializes without all of its code (seen on XLA's CPU
        client: "Function ... not found" when the entry is run)."""
        lowered = self.jit.lower(*args)
        state = getattr(_jax_config(), "enable_compilation_cache", None)
        if not settings.get("xla_executables") or state is None:
            return lowered.compile()
        with state(False):
            return lowered.compile()

    def _key(self, sig: str) -> str:
        jax = load_jax()
        import jaxlib

        return "\n".join([self.name, self.scope(), sig, jax.__version__, jaxlib.__version__, source_digest(),
                          sys.version.split()[0]])

    def _path(self, key: str) -> Path | None:
        d = directory()
        return None if d is None else d / (hashlib.sha256(key.encode()).hexdigest() + ".bin")

    def _load(self, sig: str, dyn, static: tuple):
        """The stored executable of this signature, or None (absent, or skipped with a warning)."""
        key = self._key(sig)
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        got = _read_entry(path, key, load_jax().tree_util.tree_structure((dyn, {})))
        return None if got is None else self._restored(got, static, path)

    def _restored(self, got, static: tuple, path: Path):
        exe, meta = got
        try:
            if self.restore is not None:
                self.restore(static, meta)
        except Exception as e:      # noqa: BLE001 - a damaged entry: compile instead
            _warn(f"{path}: a serialized executable was skipped ({e}); compiling it again")
            return None
        os.utime(path)          # recently used: kept longest
        return exe

    def prefetch(self) -> None:
        """Start loading every stored executable of this program (its name and scope, this
        process's settings and versions) on threads: a new process's first calls find them
        loaded or loading, beside whatever else it does meanwhile (its weights' upload)."""
        d = directory() if settings.get("xla_executables") else None
        if d is None:
            return
        want = self._key("").split("\n")
        for path in d.glob("*.bin"):
            head = _read_header(path)
            key = head.get("key") if head else None
            lines = key.split("\n") if isinstance(key, str) else []
            if len(lines) != len(want) or lines[:2] != want[:2] or lines[3:] != want[3:] or "in" not in head:
                continue
            try:
                in_tree = load_jax().tree_util.tree_structure((_from_spec(head["in"]), {}))
            except (ValueError, TypeError):
                continue
            self._pending[lines[2]] = (key, in_tree, _loader().submit(_read_entry, path, key, in_tree))

    def _prefetched(self, sig: str, dyn, static: tuple):
        """The executable a prefetch loaded for this signature (waited for), or None."""
        entry = self._pending.pop(sig, None) if self._pending else None
        if entry is None:
            return None
        key, in_tree, fut = entry
        got = fut.result()
        if got is None or key != self._key(sig) or in_tree != load_jax().tree_util.tree_structure((dyn, {})):
            return None
        return self._restored(got, static, self._path(key))

    def _store(self, sig: str, exe, out, static: tuple, dyn) -> None:
        """Write the executable (temp file + rename); a failure to serialize or write is harmless."""
        key = self._key(sig)
        path = self._path(key)
        if path is None:
            return
        try:
            from jax.experimental import serialize_executable as se

            payload, _, _ = se.serialize(exe)
            head = json.dumps({"key": key, "out": _tree_spec(out), "in": _tree_spec(dyn),
                               "sha256": hashlib.sha256(payload).hexdigest(),
                               "meta": self.meta_of(static) if self.meta_of is not None else None}).encode()
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(MAGIC + len(head).to_bytes(8, "little") + head + payload)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            _prune(path.parent)
        except Exception as e:      # noqa: BLE001 - e.g. an executable JAX cannot serialize
            _warn(f"serialized executables: {self.name} not stored ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})")


def _read_header(path: Path) -> dict | None:
    """An entry's JSON header alone (its payload not read), or None."""
    try:
        with open(path, "rb") as f:
            start = f.read(len(MAGIC) + 8)
            if not start.startswith(MAGIC):
                return None
            n = int.from_bytes(start[len(MAGIC):], "little")
            if not 0 < n <= MAX_HEADER:
                return None
            head = json.loads(f.read(n))
    except (OSError, ValueError):
        return None
    return head if isinstance(head, dict) else None


def _read_entry(path: Path, key: str, in_tree):
    """(executable, caller's metadata) of the entry at path, checked (its key, checksum and the
    globals its payload names), or None with one warning."""
    try:
        data = path.read_bytes()
        if not data.startswith(MAGIC):
            raise ValueError("not an executable entry")
        n = int.from_bytes(data[len(MAGIC):len(MAGIC) + 8], "little")
        if not 0 < n <= MAX_HEADER:
            raise ValueError("header length out of range")
        start = len(MAGIC) + 8
        head = json.loads(data[start:start + n])
        payload = data[start + n:]
        if not isinstance(head, dict) or head.get("key") != key:
            return None             # another key under the same digest: not ours
        if hashlib.sha256(payload).hexdigest() != head.get("sha256"):
            raise ValueError("payload checksum mismatch")
        if not _scan_globals(payload):
            raise ValueError("the payload names a global outside JAX's and NumPy's types")
        jax = load_jax()
        from jax.experimental import serialize_executable as se

        out_tree = jax.tree_util.tree_structure(_from_spec(head["out"]))
        return se.deserialize_and_load(payload, in_tree, out_tree), head.get("meta")
    except Exception as e:      # noqa: BLE001 - any damage: compile instead
        _warn(f"{path}: a serialized executable was skipped ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__}); "
              "compiling it again")
        return None


@functools.cache
def _loader():
    """Threads that load prefetched executables (deserializing releases the GIL for most of it)."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(4, thread_name_prefix="strata-xla-load")


def _prune(d: Path) -> None:
    """Keep the newest MAX_ENTRIES entries (by last use)."""
    entries = sorted(d.glob("*.bin"), key=lambda p: p.stat().st_mtime)
    for p in entries[:max(0, len(entries) - MAX_ENTRIES)]:
        p.unlink(missing_ok=True)
