"""`emit`: write `plan.bin` and `weights.bin` into the output directory.

weights.bin is a container (plan_format) with one 4 KiB-aligned section per stored array,
named `<weight>:<array>` (e.g. `L0.attn.q_k_v:qs`), streamed one row block at a time so the
compiler never holds a whole weight. plan.bin holds the metadata (JSON), the kernel-level IR
(text) and the tokenizer, and names weights.bin with its size and body checksum. Both are
written under temporary names and renamed into place together at the end (`swap_in`: a recompile
leaves the old pair or the new, whatever interrupts it); the same inputs give the same bytes. The metadata records a SHA-256 of every source tensor's values (computed as the
weights stream), so `--calib PLAN.bin` copies a plan's quantized arrays only when the checkpoint
is the one that plan was compiled from.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import numpy as np

from strata_compiler import __version__, settings
from strata_compiler.errors import PassError, UsageError
from strata_compiler.formats import get_format
from strata_compiler.ir import Graph, Level, WeightSpec
from strata_compiler.ir_text import print_graph
from strata_compiler.pass_manager import PassContext, register
from strata_compiler.plan_format import (PLAN_MAGIC, WEIGHTS_ALIGN, WEIGHTS_FILE, WEIGHTS_MAGIC, Container,
                                         ContainerWriter, imatrix_section, section_name)
from strata_compiler.weights import iter_blocks

_POOL = None


def compile_threads() -> int:
    """Threads that quantize weight blocks: the compile_threads setting, else the usable CPUs."""
    n = settings.get("compile_threads")
    if n:
        return n
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _ordered_map(fn, items):
    """fn over items on a thread pool, results in order, at most threads + 1 in flight (bounded
    memory: each holds one row block and its quantized arrays)."""
    global _POOL
    n = compile_threads()
    if n <= 1:
        yield from map(fn, items)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    if _POOL is None or _POOL._max_workers != n:
        _POOL = ThreadPoolExecutor(n, thread_name_prefix="strata-emit")
    pending: deque = deque()
    for it in items:
        pending.append(_POOL.submit(fn, it))
        if len(pending) > n:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _write_weight(w: ContainerWriter, spec: WeightSpec, store, progress, hashes: dict[str, str],
                  importance=None) -> int:
    fmt = get_format(spec.fmt)
    gs = spec.group_size or 32
    names = list(fmt.array_shapes(spec.shape, gs))
    rest: dict[str, list[np.ndarray]] = defaultdict(list)
    if not fmt.grouped:
        importance = None

    def quantize(item):
        e, block, native = item
        if native is not None:      # the checkpoint's own bytes in this format (GGUF Q4_0 -> int4)
            return native
        imp = None if importance is None else (importance[e] if importance.ndim == 2 else importance)
        return fmt.quantize(block, gs, imp)

    def first_array() -> Iterator[np.ndarray]:
        # The first array streams; the others (per-group scales: 1/16 of the size) wait in memory.
        # Blocks are quantized on worker threads (NumPy releases the GIL), written in order.
        blocks = iter_blocks(spec, store, with_expert=True, hashes=hashes, progress=progress, native=True)
        for arrays in _ordered_map(quantize, blocks):
            for n in names[1:]:
                rest[n].append(arrays[n])
            yield arrays[names[0]]

    total = w.add_stream(section_name(spec.name, names[0]), first_array(), align=WEIGHTS_ALIGN).length
    for n in names[1:]:
        total += w.add(section_name(spec.name, n), np.concatenate(rest[n], axis=0), align=WEIGHTS_ALIGN).length
    return total


def _from_donor(donor, spec: WeightSpec, imatrix: bool) -> dict[str, np.ndarray] | None:
    """The stored arrays of `spec` from an earlier plan of the same weights and calibration: the
    same weight, or (for one share of a layer's experts) those experts' rows of the whole layer's
    weight. None when the donor has no such weight in the same format, or chose its scales the
    other way (--imatrix / --no-imatrix)."""
    from dataclasses import replace as dc_replace

    opts = donor.meta.get("options")
    if not isinstance(opts, dict) or opts.get("imatrix", True) != imatrix:
        return None
    dg = donor.graph
    if dg.has_weight(spec.name) and dg.weight(spec.name) == spec:
        return {a: np.asarray(v) for a, v in donor.weights.arrays(spec.name).items()}
    base, _, tail = spec.name.rpartition(".s")
    if spec.expert_ids and tail.isdigit() and dg.has_weight(base):
        whole = dg.weight(base)
        if not whole.expert_ids and max(spec.expert_ids) < whole.experts and \
                dc_replace(whole, name=spec.name, shape=spec.shape, experts=spec.experts,
                           expert_ids=spec.expert_ids) == spec:
            idx = list(spec.expert_ids)
            return {a: np.ascontiguousarray(v[idx]) for a, v in donor.weights.arrays(base).items()}
    return None


def _check_donor_sources(donor, spec: WeightSpec, hashes: dict[str, str]) -> None:
    """--calib PLAN.bin: every source tensor of `spec` must hash as it did when that plan was
    compiled (its calibration, and the arrays emit copies, belong to those weights)."""
    theirs = donor.meta["source_hashes"]
    for key in dict.fromkeys(spec.all_source_keys()):
        if theirs.get(key) != hashes[key]:
            raise UsageError(f"--calib {donor.path}: that plan was compiled from other weights than this model's "
                             f"(tensor {key} differs); calibrate this model (--calib TEXT) or pass a plan of the "
                             f"same checkpoint")


@register("emit", Level.KERNEL)
def emit(g: Graph, ctx: PassContext) -> Graph:
    """Write plan.bin (metadata, kernel IR, tokenizer) and weights.bin (packed weights)."""
    if ctx.output_dir is None or ctx.store is None:
        raise PassError("pass emit needs an output directory and the model's tensors")
    out = ctx.output_dir
    out.mkdir(parents=True, exist_ok=True)
    # Both files are written under temporary names and renamed into place together at the end:
    # a failure anywhere leaves the folder as it was (the compile driver removes what it created).
    staged = {name: out / f"{name}.tmp-{os.getpid()}" for name in (WEIGHTS_FILE, "plan.bin")}
    try:
        sections = _write_weights(g, ctx, staged[WEIGHTS_FILE])
        with ContainerWriter(staged["plan.bin"], PLAN_MAGIC) as p:
            for name, data in sections:
                p.add(name, data)
        swap_in(out, staged[WEIGHTS_FILE], staged["plan.bin"])
    finally:
        for path in staged.values():
            path.unlink(missing_ok=True)
    return g


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP that arrive inside the block take effect at its end (main thread
    only: Python runs signal handlers there, so elsewhere there is nothing to hold)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {s: signal.signal(s, lambda n, _f: got.append(n)) for s in held}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)
        if got:
            signal.raise_signal(got[0])


def swap_in(out: Path, weights: Path, plan: Path) -> None:
    """Rename new weights and plan over the folder's pair so that it holds the old pair or the new,
    never new weights beside the old plan: an interrupt waits for both renames; a failure of the
    second puts the old weights back (kept under a second name, `weights.bin.old-PID`, until the
    plan is in). A process killed between the renames leaves that name for the next compile into
    the folder to restore (driver.output_folder)."""
    keep = out / f"{WEIGHTS_FILE}.old-{os.getpid()}"
    old = out / WEIGHTS_FILE
    kept = False
    if old.is_file() and not old.is_symlink() and (out / "plan.bin").is_file():
        keep.unlink(missing_ok=True)
        try:
            os.link(old, keep)
            kept = True
        except OSError:         # a filesystem without hard links: the signals are still held
            pass
    with _signals_held():
        try:
            os.replace(weights, old)
            try:
                os.replace(plan, out / "plan.bin")
            except BaseException:
                if kept:
                    os.replace(keep, old)
                raise
        finally:
            keep.unlink(missing_ok=True)


def _write_weights(g: Graph, ctx: PassContext, path: Path) -> list[tuple[str, bytes]]:
    """Write weights.bin at `path`; returns the sections of the plan.bin that describes it."""
    store = ctx.store
    keys = dict.fromkeys(k for s in g.weights for k in s.all_source_keys())
    total = sum(store.info(k).nbytes for k in keys)
    progress = (lambda n: ctx.progress_bytes(n, total)) if ctx.progress_bytes else None
    hashes: dict[str, str] = {}           # source key -> sha256 of its values (weights.iter_blocks)
    bytes_by_format: dict[str, int] = defaultdict(int)
    donor = ctx.analyses.donor_plan       # --calib PLAN.bin: its quantized weights, reused
    reused = 0
    calib = ctx.analyses.calibration
    with ContainerWriter(path, WEIGHTS_MAGIC) as w:
        for spec in g.weights:
            arrays = _from_donor(donor, spec, ctx.options.imatrix) if donor is not None else None
            if arrays is not None:
                for _ in iter_blocks(spec, store, hashes=hashes, progress=progress):
                    pass                  # read anyway: the hashes decide whether the copy is right
                _check_donor_sources(donor, spec, hashes)
                n = sum(w.add(section_name(spec.name, a), v, align=WEIGHTS_ALIGN).length for a, v in arrays.items())
                bytes_by_format[spec.fmt] += n
                reused += 1
                continue
            imp = calib.importance(spec.name) if calib is not None and ctx.options.imatrix else None
            bytes_by_format[spec.fmt] += _write_weight(w, spec, store, progress, hashes, imp)
            if donor is not None:
                _check_donor_sources(donor, spec, hashes)
    ctx.analyses.reused_weights = reused
    with Container.open(path, WEIGHTS_MAGIC, verify="none") as c:
        weights_ref = {"file": WEIGHTS_FILE, "size": c.total_size, "checksum": c.body_checksum}
    meta = {
        "strata_version": __version__,
        "options": {"quant": ctx.options.quant, "group_size": ctx.options.group_size, "backend": ctx.options.backend,
                    "place": ctx.options.place, "bits": ctx.options.bits, "memory_budget": ctx.options.memory_budget,
                    "tensor_format": ctx.options.tensor_format, "imatrix": ctx.options.imatrix},
        "model": {k: list(v) if isinstance(v, tuple) else v for k, v in g.meta},
        "weights": dict(weights_ref, bytes_by_format=dict(sorted(bytes_by_format.items()))),
        "passes": [r["pass"] for r in ctx.analyses.pass_records if r["pass"] != "input"],
        "source_hashes": dict(sorted(hashes.items())),
    }
    if ctx.chat is not None:
        meta["chat"] = ctx.chat
    if ctx.sampling is not None:
        meta["sampling"] = ctx.sampling
    if calib is not None:
        meta["calibration"] = dict(calib.summary(), file=Path(ctx.options.calib).name)
    sections = [("meta", json.dumps(meta, sort_keys=True, indent=1).encode()), ("ir", print_graph(g).encode())]
    if ctx.tokenizer_json is not None:
        sections.append(("tokenizer", ctx.tokenizer_json))
    if calib is not None:
        sections.append(("imatrix", imatrix_section({n: calib.importance(n) for n in calib.sumsq})))
    return sections
