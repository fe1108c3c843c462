"""Loading a plan: checks before use, weights mapped lazily, nothing unpickled.

`load_plan` verifies plan.bin whole (it is small), parses its metadata and kernel-level IR,
verifies the IR, then opens the sibling weights file and checks it is the one the plan was
compiled with (size and body checksum). Checksums prove only who sealed the files, so before a
Plan exists `validate_plan` (runtime/validate.py) checks every fact the kernels rely on against
the weight sections' real sizes. Weight sections are checksummed on first access.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from strata_compiler.errors import IRError, PlanError, UsageError
from strata_compiler.formats import get_format
from strata_compiler.ir import Graph, Level
from strata_compiler.ir_text import parse_graph
from strata_compiler.plan_format import (GGUF_MAGIC, PLAN_MAGIC, WEIGHTS_MAGIC, Container, parse_imatrix_section,
                                        section_name)
from strata_compiler.untrusted import load_json, open_regular
from strata_compiler.verify import verify

from .validate import validate_plan


_MODEL_KEYS = ("n_layers", "n_kv_heads", "head_dim", "vocab_size")   # what the runtime reads


@dataclass
class Plan:
    path: Path
    meta: dict
    graph: Graph                 # kernel level
    tokenizer_json: bytes | None
    weights: "PlanWeights"
    imatrix: dict = field(default_factory=dict)   # weight -> mean-square input per column (--calib)

    def model(self, key: str):
        return self.meta["model"][key]

    @property
    def weights_path(self) -> Path:
        """The weights file beside plan.bin (its plain name, checked by load_plan)."""
        return self.path.parent / str(self.meta["weights"]["file"])

    def digest(self) -> str:
        """SHA-256 of plan.bin (which holds the weights file's checksums): what derived files
        (the server's prompt cache) are keyed by."""
        import hashlib

        return hashlib.sha256(self.path.read_bytes()).hexdigest()


class PlanWeights:
    """Stored arrays by weight name (zero-copy views of the mmap) and f32 dequantized copies
    (every section's size was checked against its weight by validate_plan)."""

    def __init__(self, container: Container, graph: Graph) -> None:
        self.c = container
        self.g = graph
        self._f32: dict[str, np.ndarray] = {}
        self._resident: dict[str, dict[str, np.ndarray]] = {}
        self.disk_tier = None   # the DiskTier of these weights, when experts stay on disk (runtime/disk_tier.py)

    def arrays(self, name: str) -> dict[str, np.ndarray]:
        spec = self.g.weight(name)
        shapes = get_format(spec.fmt).array_shapes(spec.shape, spec.group_size or 32)
        return {a: self.c.array(section_name(name, a), dt, shp) for a, (dt, shp) in shapes.items()}

    def verify(self, names) -> None:
        """The checksums of these weights' sections, checked on all cores at once (else each is
        checked when first read, one after another)."""
        secs = []
        for name in names:
            spec = self.g.weight(name)
            secs += [section_name(name, a) for a in get_format(spec.fmt).array_shapes(spec.shape, spec.group_size or 32)]
        self.c.verify(secs)

    def resident_arrays(self, name: str) -> dict[str, np.ndarray]:
        """arrays(name), copied once into private anonymous memory the kernel may back with 2 MiB
        pages (madvise MADV_HUGEPAGE), the file's mapped pages dropped after the copy: a CPU
        kernel streaming the weights then misses the TLB far less often (the llvm executor
        asks where the OS offers transparent huge pages). Weights with experts on the disk tier
        stay mapped from the file."""
        cached = self._resident.get(name)
        if cached is not None:
            return cached
        tier = self.disk_tier
        src = self.arrays(name)
        if tier is not None and name in tier.by_weight:
            return src
        out = {}
        for key, a in src.items():
            out[key] = _huge_copy(a)
            info = self.c.info(section_name(name, key))
            self.c.release(info.offset, info.length)
        self._resident[name] = out
        return out

    def get(self, name: str) -> np.ndarray:
        """The weight dequantized to f32 in its logical shape (cached)."""
        if name not in self._f32:
            spec = self.g.weight(name)
            w = get_format(spec.fmt).dequantize(self.arrays(name), spec.shape[-1], spec.group_size or 32)
            self._f32[name] = np.ascontiguousarray(w.reshape(spec.shape), dtype=np.float32)
        return self._f32[name]


_HUGE = 2 << 20


def _huge_copy(a: np.ndarray) -> np.ndarray:
    """A writable-never copy of `a` in a private anonymous mapping aligned to 2 MiB and advised
    MADV_HUGEPAGE (where the OS has it; else ordinary pages). The mapping lives as long as the
    array (it is the array's base)."""
    import mmap

    if a.nbytes < _HUGE:
        out = np.array(a, copy=True)
    else:
        m = mmap.mmap(-1, a.nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)
        raw = np.frombuffer(m, np.uint8)
        off = (-raw.ctypes.data) % _HUGE
        out = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
        np.copyto(out, a)
    out.flags.writeable = False
    return out


def _model_not_plan(path: Path) -> None:
    """A model given where a plan is expected (a GGUF file, a Hugging Face folder): one UsageError
    line that says to compile it first, instead of the plan reader's `wrong file kind`."""
    what = None
    if path.is_dir():
        if not (path / "plan.bin").exists() and (path / "config.json").is_file():
            what = "a Hugging Face model folder"
    else:
        try:
            with open_regular(path) as f:
                what = "a GGUF model" if f.read(4) == GGUF_MAGIC else None
        except OSError:         # missing, unreadable, not a regular file: the plan reader says which
            return
    if what:
        raise UsageError(f"{path} is {what}, not a plan: compile it first: stratac compile "
                         f"{shlex.quote(str(path))} -o DIR")


def load_plan(path: str | Path, *, verify_weights: str = "lazy") -> Plan:
    path = Path(path)
    _model_not_plan(path)
    if path.is_dir():
        path = path / "plan.bin"
    c = Container.open(path, PLAN_MAGIC, verify="full")
    for s in ("meta", "ir"):
        if s not in c:
            raise PlanError(f"{path}: missing section {s!r}; recompile it with `stratac compile`")
    try:
        meta = load_json(c.section("meta"))   # bounded depth, no 1e400 (strata_compiler/untrusted.py)
        wref = meta["weights"]
        wfile, wsize, wsum = str(wref["file"]), int(wref["size"]), int(wref["checksum"])
        for key in _MODEL_KEYS:
            if not isinstance(meta["model"][key], int) or isinstance(meta["model"][key], bool):
                raise TypeError(key)
    except (ValueError, KeyError, TypeError):
        raise PlanError(f"{path}: metadata section is malformed; recompile it with `stratac compile`") from None
    try:
        graph = parse_graph(bytes(c.section("ir")).decode(), source=f"{path}:ir")
        if graph.level is not Level.KERNEL:
            raise IRError(f"IR is at level {graph.level.value}, expected kernel")
        verify(graph)
    except (IRError, UnicodeDecodeError) as e:
        raise PlanError(f"{path}: kernel IR is invalid ({str(e).splitlines()[0]}); recompile it") from None
    tok = bytes(c.section("tokenizer")) if "tokenizer" in c else None
    if "/" in wfile or wfile.startswith("."):
        raise PlanError(f"{path}: weights file name {wfile!r} is not a plain file name")
    wpath = path.parent / wfile
    wc = Container.open(wpath, WEIGHTS_MAGIC, verify=verify_weights)
    if wc.total_size != wsize or wc.body_checksum != wsum:
        raise PlanError(f"{wpath}: does not match {path.name} (size or checksum differs); "
                        f"it belongs to another compile — recompile or copy both files together")
    imatrix = {}
    if "imatrix" in c:
        try:
            imatrix = parse_imatrix_section(bytes(c.section("imatrix")))
        except (ValueError, KeyError, TypeError):
            raise PlanError(f"{path}: imatrix section is malformed; recompile it with `stratac compile`") from None
    validate_plan(path, meta, graph, wc)
    return Plan(path, meta, graph, tok, PlanWeights(wc, graph), imatrix)
