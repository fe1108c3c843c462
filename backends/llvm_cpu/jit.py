"""Compile LLVM IR to host code, with an on-disk object cache; load and resolve kernels.

A kernel module is LLVM IR text. It is optimised with the new pass manager at O3 for the
target, emitted as an object file, and cached on disk under a key that hashes the IR, the
target (CPU name, features, LLVM version) and llvmlite's version: a second run of the same plan
compiles nothing. Cache entries carry a header with a length and SHA-256; a corrupt entry is
rebuilt. Cache directory: `kernels` under settings.cache_root() (the `cache_dir` setting).
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

from strata_compiler import settings
from strata_compiler.errors import BackendError

from .target import Target

_ENTRY_MAGIC = b"STRATAOB"
_HEADER = struct.Struct("<8sQ32s")   # magic, body length, sha256(body)


def cache_dir() -> Path:
    """Where compiled kernel objects are cached."""
    return settings.cache_root() / "kernels"


def optimize(ir_text: str, target: Target) -> tuple[llvm.ModuleRef, llvm.TargetMachine]:
    tm = target.machine()
    try:
        mod = llvm.parse_assembly(ir_text)
        mod.verify()
    except RuntimeError as e:
        raise BackendError(f"generated LLVM IR does not verify (a Strata bug): {str(e).splitlines()[0]}") from None
    mod.triple = tm.triple
    mod.data_layout = str(tm.target_data)
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pto.loop_vectorization = True
    pto.slp_vectorization = True
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(mod, pb)
    return mod, tm


@dataclass
class CompileStats:
    compiled: int = 0     # modules built by LLVM in this process
    cached: int = 0       # modules loaded from the disk cache


@dataclass
class KernelLibrary:
    """All JIT-loaded kernels of a process for one target; modules loaded at most once."""

    target: Target
    use_disk_cache: bool = True
    stats: CompileStats = field(default_factory=CompileStats)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[str, llvm.ExecutionEngine] = {}
        self._addrs: dict[tuple[str, str], int] = {}

    def key(self, ir_text: str) -> str:
        h = hashlib.sha256()
        for part in (ir_text, self.target.key(), llvmlite.__version__):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def _object(self, ir_text: str, key: str) -> bytes:
        body, cached = object_code(ir_text, self.target, key, self.use_disk_cache)
        if cached:
            self.stats.cached += 1
        else:
            self.stats.compiled += 1
        return body

    def load(self, ir_text: str) -> str:
        """Make the module's functions callable; returns its key."""
        key = self.key(ir_text)
        with self._lock:
            if key not in self._engines:
                obj = self._object(ir_text, key)
                ee = llvm.create_mcjit_compiler(llvm.parse_assembly(""), self.target.machine())
                ee.add_object_file(llvm.ObjectFileRef.from_data(obj))
                ee.finalize_object()
                self._engines[key] = ee
        return key

    def address(self, ir_text: str, name: str) -> int:
        key = self.load(ir_text)
        if (key, name) not in self._addrs:
            addr = self._engines[key].get_function_address(name)
            if not addr:
                raise BackendError(f"kernel {name} not found in its module (a Strata bug)")
            self._addrs[key, name] = addr
        return self._addrs[key, name]


def object_code(ir_text: str, target: Target, key: str, use_disk_cache: bool = True) -> tuple[bytes, bool]:
    """Object code for the module (from the disk cache when a valid entry exists); (bytes, cached)."""
    path = cache_dir() / f"{key}.o"
    if use_disk_cache and path.exists():
        try:
            data = path.read_bytes()
        except OSError:
            data = b""
        if len(data) >= _HEADER.size:
            magic, n, digest = _HEADER.unpack_from(data)
            body = data[_HEADER.size:]
            if magic == _ENTRY_MAGIC and n == len(body) and hashlib.sha256(body).digest() == digest:
                return body, True
    mod, tm = optimize(ir_text, target)
    body = tm.emit_object(mod)
    if use_disk_cache:
        _write_atomic(path, _HEADER.pack(_ENTRY_MAGIC, len(body), hashlib.sha256(body).digest()) + body)
    return body, False


def _write_atomic(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass   # an unwritable cache only costs a recompile next time


def emit_artifacts(ir_text: str, target: Target) -> dict[str, str]:
    """The IR before and after optimisation and the assembly (for `stratac compile --dump-dir`)."""
    mod, tm = optimize(ir_text, target)
    return {"ll": ir_text, "opt.ll": str(mod), "s": tm.emit_assembly(mod)}


_LIBRARIES: dict[Target, KernelLibrary] = {}


def library(target: Target | None = None) -> KernelLibrary:
    target = target or Target.host()
    if target not in _LIBRARIES:
        _LIBRARIES[target] = KernelLibrary(target)
    return _LIBRARIES[target]
