"""The compile driver behind `stratac compile`: model folder -> plan directory."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from .errors import ModelError, UsageError
from .formats import get_format
from .frontend.hf import build_graph
from .frontend.safetensors_reader import TensorStore
from .ir import Graph
from .pass_manager import CompileOptions, DumpConfig, PassContext, run_pipeline
from .pipelines import DEFAULT


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


def compile_model(model_dir: Path, out_dir: Path | None, opts: CompileOptions, *,
                  dump: DumpConfig | None = None, stop_after: str | None = None,
                  pipeline: list[str] | None = None, progress: Callable[[str], None] | None = None,
                  progress_bytes: Callable[[int], None] | None = None) -> Graph:
    check_options(opts)
    opts = replace(opts, backend=resolve_compile_backend(opts.backend), cpu_backend=cpu_backend())
    if opts.place:
        from .passes.placement_rules import parse_rules

        parse_rules(opts.place)   # a bad rule fails before any work
    if model_dir.suffix.lower() == ".gguf" and model_dir.is_file():
        from .frontend.gguf_reader import open_gguf

        store, cfg, tokenizer_json = open_gguf(model_dir)
        graph, _ = build_graph(model_dir, store, cfg)
    else:
        if not model_dir.is_dir():
            raise ModelError(f"{model_dir}: not a directory; pass a Hugging Face model folder or a .gguf file")
        store = TensorStore.open(model_dir)
        graph, _ = build_graph(model_dir, store)
        tok = model_dir / "tokenizer.json"
        tokenizer_json = tok.read_bytes() if tok.exists() else None
    ctx = PassContext(opts, model_dir=model_dir, output_dir=out_dir, store=store,
                      tokenizer_json=tokenizer_json,
                      progress=progress, progress_bytes=progress_bytes,
                      dump_dir=dump.directory if dump else None)
    return run_pipeline(graph, list(pipeline or DEFAULT), ctx, dump=dump, stop_after=stop_after)


def weight_source_bytes(model_dir: Path) -> int:
    """Bytes of checkpoint data the compile will read (for a progress bar)."""
    return sum(t.nbytes for t in TensorStore.open(model_dir).infos.values())
