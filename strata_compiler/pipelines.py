"""The pipeline assembly: the compile pipeline, each pass one line, and the driver behind
`stratac compile` (model folder -> plan directory). The manager verifies the IR after every pass.

An entry point, above the layers (tests/test_layering.py): it registers the passes and the llvm
backend's own `cpu-codegen` pass, reads the model through a frontend, and gives the passes what
only other layers can make, in the pass context: the hardware profile of `--target` (measured by
the backends' probe for `auto`) and the plan behind `--calib PLAN.bin` (read by the runtime's
plan loader).
"""

from __future__ import annotations

import socket
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Callable

from . import settings
# Importing the pass modules registers them.
from .backends.llvm_cpu import cpu_codegen  # noqa: F401
from .errors import ModelError, UsageError
from .formats import get_format
from .hwprofile import HardwareProfile
from .ir import Graph
from .pass_manager import CompileOptions, DumpConfig, PassContext, run_pipeline
from .passes import (calibrate, cluster_experts, emit, fuse, lower, place, plan_memory,  # noqa: F401
                     quantize, select_kernels)
from .plan_format import is_plan_file

DEFAULT = [
    "lower",           # graph -> tensor: attention, mlp and moe become primitive tensor ops
    "fuse",            # QKV / gate-up merges, SiLU*mul, attention, router, norm prologues, residuals
    "calibrate",       # --calib: input statistics per weight and routing per expert, from real text
    "cluster-experts", # --calib: each MoE layer's experts grouped by co-activation (swap units)
    "quantize",        # weight formats from --quant / --group-size; fused weights share one
    "place",           # --target: GPU or CPU per op and per expert from a cost model and a hardware profile
    "select-kernels",  # tensor -> kernel: bind every op to a device and a backend
    "plan-memory",     # activation buffers by liveness; peak activation bytes per token
    "cpu-codegen",     # LLVM IR for every CPU kernel, compiled into the kernel cache (+ IR/asm dumps)
    "emit",            # write plan.bin and weights.bin
]


def resolve_compile_backend(name: str) -> str:
    """`--backend auto` binds CPU kernels to llvm where this host can run it, else reference."""
    return cpu_backend() if name == "auto" else name


def cpu_backend() -> str:
    from .backends import llvm_available

    return "llvm" if llvm_available()[0] else "reference"


def check_options(opts: CompileOptions) -> None:
    get_format(opts.quant)
    if opts.group_size < 2 or opts.group_size % 2 or opts.group_size > 4096:
        raise UsageError(f"--group-size {opts.group_size}: use an even number between 2 and 4096 (default 32)")


def hardware(target: str, progress: Callable[[str], None] | None = None) -> HardwareProfile:
    """The profile of `--target`: a hw.json from `stratac probe-hw`, or for `auto` this machine,
    measured with the full probe once and cached per host in Strata's cache dir (a quick probe's
    rough figures can change the chosen layout)."""
    if target != "auto":
        return HardwareProfile.from_json(Path(target))
    path = settings.cache_root() / f"hw-full-{socket.gethostname()}.json"
    hw = None
    if path.exists():
        try:
            hw = HardwareProfile.from_json(path)
        except UsageError:
            hw = None
    if hw is None or hw.quick:
        from .backends.probe import probe

        if progress:
            progress("place: measuring this machine once (stratac probe-hw; cached for later compiles)")
        hw = probe(disk_dir=tempfile.gettempdir())
        path.parent.mkdir(parents=True, exist_ok=True)
        hw.save(path)
    return hw


def _runs(name: str, pipeline: list[str], stop_after: str | None) -> bool:
    """Whether pass `name` runs in `pipeline` stopped after `stop_after`."""
    if name not in pipeline:
        return False
    return stop_after is None or (stop_after in pipeline and pipeline.index(stop_after) >= pipeline.index(name))


def compile_model(model_dir: Path, out_dir: Path | None, opts: CompileOptions, *,
                  dump: DumpConfig | None = None, stop_after: str | None = None,
                  pipeline: list[str] | None = None, progress: Callable[[str], None] | None = None,
                  progress_bytes: Callable[[int], None] | None = None) -> Graph:
    from .frontend.chat import hf_chat
    from .frontend.hf import build_graph
    from .frontend.safetensors_reader import TensorStore

    check_options(opts)
    opts = replace(opts, backend=resolve_compile_backend(opts.backend), cpu_backend=cpu_backend())
    pipeline = list(pipeline or DEFAULT)
    if opts.place:
        from .passes.placement_rules import parse_rules

        parse_rules(opts.place)   # a bad rule fails before any work
    if model_dir.suffix.lower() == ".gguf" and model_dir.is_file():
        from .frontend.gguf_reader import open_gguf

        store, cfg, tokenizer_json, chat = open_gguf(model_dir, with_chat=True)
        graph, _ = build_graph(model_dir, store, cfg)
    else:
        if not model_dir.is_dir():
            raise ModelError(f"{model_dir}: not a directory; pass a Hugging Face model folder or a .gguf file")
        store = TensorStore.open(model_dir)
        graph, cfg = build_graph(model_dir, store)
        tok = model_dir / "tokenizer.json"
        tokenizer_json = tok.read_bytes() if tok.exists() else None
        chat = hf_chat(model_dir, cfg.eos_token_ids, cfg.vocab_size)
    ctx = PassContext(opts, model_dir=model_dir, output_dir=out_dir, store=store,
                      tokenizer_json=tokenizer_json, chat=chat,
                      progress=progress, progress_bytes=progress_bytes,
                      dump_dir=dump.directory if dump else None)
    if opts.target and _runs("place", pipeline, stop_after):
        ctx.hardware = hardware(opts.target, progress)
    if opts.calib and is_plan_file(opts.calib) and _runs("calibrate", pipeline, stop_after):
        from .runtime.plan import load_plan

        ctx.calib_plan = load_plan(Path(opts.calib), verify_weights="lazy")
    return run_pipeline(graph, pipeline, ctx, dump=dump, stop_after=stop_after)


def weight_source_bytes(model_dir: Path) -> int:
    """Bytes of checkpoint data the compile will read (for a progress bar)."""
    from .frontend.safetensors_reader import TensorStore

    return sum(t.nbytes for t in TensorStore.open(model_dir).infos.values())
