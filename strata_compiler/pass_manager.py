"""Pass registry, pass context and the pass manager (timing, verification, dumps).

A pass is a named function `(Graph, PassContext) -> Graph`. The manager runs a pipeline (a list
of names, see driver.py), verifies the IR after every pass that changed it, times each pass,
and with a dump directory writes `NNN.<level>.<pass>.txt` + `.dot` and `index.json`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import settings
from .dot import graph_to_dot
from .errors import PassError, StrataError
from .hwprofile import HardwareProfile
from .ir import Graph, Level
from .ir_text import print_graph
from .verify import verify


def _setting(name: str):
    """A field whose default is stratac compile's setting `name` (strata_compiler/settings.py)."""
    return field(default_factory=lambda: settings.get(name))


@dataclass(frozen=True)
class CompileOptions:
    quant: str = "f32"           # (the library's default; stratac compile's --quant is auto)
    group_size: int = _setting("group_size")
    backend: str = "reference"   # what select-kernels binds: reference | llvm | xla
    place: str = ""              # --place rules (passes/placement_rules.py)
    cpu_backend: str = "reference"  # the CPU backend for cpu-placed ops when --backend is xla
    calib: str = ""              # --calib: calibration text file (passes/calibrate.py)
    calib_tokens: int = _setting("calib_tokens")   # at most this many calibration tokens
    calib_ctx: int = 512         # tokens per calibration chunk
    imatrix: bool = _setting("imatrix")   # --no-imatrix: --calib for routing statistics only, plain scales
    calib_probe_tokens: int = 128  # tokens of the per-tensor sensitivity probe (--bits with --calib)
    bits: float = 0.0            # --bits: layer-adaptive formats at this average bits per weight
    memory_budget: str = ""      # --memory-budget: layer-adaptive formats within this many weight bytes
    tensor_format: str = ""      # --tensor-format REGEX=FMT,...: per-weight overrides, applied last
    target: str = ""             # --target auto|hw.json: the place pass's hardware profile ("" = no placement)
    gpu_mem: str = ""            # --gpu-mem SIZE: plan for this much GPU memory
    host_mem: str = ""           # --host-mem SIZE: plan for this much host RAM
    plan_ctx: int = 4096         # tokens of KV cache the placement reserves GPU memory for
    plan_prompt: int = 512       # prompt tokens of the prefill time the placement also predicts
    expert_cache: bool = _setting("compile_expert_cache")   # split layers become GPU expert caches
    chat_template: str = ""      # --chat-template: a Jinja file replacing (or supplying) the model's template
    gpus: int = _setting("gpus")                # --gpus N: the target has N such GPUs
    gpu_mode: str = _setting("gpu_mode")        # --gpu-mode auto|layer|stripe: how work spreads over them
    place_strategy: str = _setting("place_strategy")   # force one of the place pass's candidate layouts


@dataclass
class Analyses:
    """What passes hand to later passes (and to the driver, the dumps and tests); each field
    names the pass that sets it. Objects of the passes' own types are typed `object` here."""

    pass_records: list[dict] = field(default_factory=list)  # the manager: one per pass (time, nodes, changed)
    calibration: object | None = None          # calibrate: a passes/calibrate.Calibration (--calib)
    calibration_weights: object | None = None  # calibrate: the f32 weights it ran (the sensitivity probe reuses them)
    donor_plan: object | None = None           # calibrate, --calib PLAN: the plan whose quantized weights emit copies
    expert_clusters: dict | None = None        # cluster-experts: {moe layer: [[expert ids], ...]}
    laq: dict | None = None                    # quantize, --bits / --memory-budget: the formats chosen and why
    placement: dict | None = None              # place, --target: the prediction (also in the graph meta)
    cpu_kernels: dict | None = None            # cpu-codegen: kernels generated, compiled, found in the cache
    reused_weights: int = 0                    # emit: weights copied from donor_plan


@dataclass
class PassContext:
    options: CompileOptions
    model_dir: Path | None = None
    output_dir: Path | None = None
    store: object | None = None         # frontend TensorStore, for passes that read weights
    tokenizer_json: bytes | None = None
    chat: dict | None = None            # meta["chat"]: chat template and special tokens (frontend/chat.py)
    sampling: dict | None = None        # meta["sampling"]: the model's recommended sampling (frontend/generation.py)
    dump_dir: Path | None = None         # set with --dump-dir: passes may write extra artifacts
    analyses: Analyses = field(default_factory=Analyses)
    progress: Callable[[str], None] | None = None        # called with each pass's name
    progress_bytes: Callable[[int, int], None] | None = None  # (bytes, of total): as emit reads the checkpoint
    # inputs the compile driver (driver.compile_model) reads or measures for the passes
    hardware: HardwareProfile | None = None   # --target: the profile read, or measured for `auto` (place)
    calib_plan: object | None = None          # --calib PLAN.bin: that plan, loaded (calibrate reuses its statistics)


@dataclass(frozen=True)
class Pass:
    name: str
    fn: Callable[[Graph, PassContext], Graph]
    level_in: Level
    level_out: Level
    doc: str


PASSES: dict[str, Pass] = {}


def register(name: str, level_in: Level, level_out: Level | None = None):
    def deco(fn: Callable[[Graph, PassContext], Graph]):
        PASSES[name] = Pass(name, fn, level_in, level_out or level_in, (fn.__doc__ or "").strip().split("\n")[0])
        return fn
    return deco


@dataclass(frozen=True)
class DumpConfig:
    directory: Path
    after: frozenset[str] | None = None   # None = every pass

    def wants(self, name: str) -> bool:
        return self.after is None or name in self.after


def _write_dump(d: DumpConfig, seq: int, g: Graph, name: str) -> tuple[str, str]:
    stem = f"{seq:03d}.{g.level.value}.{name}"
    text, dot = d.directory / f"{stem}.txt", d.directory / f"{stem}.dot"
    text.write_text(print_graph(g))
    dot.write_text(graph_to_dot(g, title=f"{name} ({g.level.value})"))
    return text.name, dot.name


def run_pipeline(g: Graph, pipeline: list[str], ctx: PassContext, *, dump: DumpConfig | None = None,
                 stop_after: str | None = None) -> Graph:
    for name in pipeline + ([stop_after] if stop_after else []):
        if name not in PASSES:
            raise PassError(f"unknown pass {name!r}; passes: {', '.join(PASSES)}")
    if stop_after and stop_after not in pipeline:
        raise PassError(f"--stop-after {stop_after}: not in the pipeline ({', '.join(pipeline)})")
    records = ctx.analyses.pass_records = []   # filled as passes run; emit records the pipeline
    if dump:
        dump.directory.mkdir(parents=True, exist_ok=True)
        txt, dot = _write_dump(dump, 0, g, "input")
        records.append({"pass": "input", "level": g.level.value, "nodes": len(g.nodes), "text": txt, "dot": dot})
    for seq, name in enumerate(pipeline, start=1):
        p = PASSES[name]
        if g.level is not p.level_in:
            raise PassError(f"pass {name} expects {p.level_in.value} IR, got {g.level.value}")
        if ctx.progress:
            ctx.progress(name)
        t0 = time.perf_counter()
        try:
            out = p.fn(g, ctx)
        except StrataError:
            raise
        except Exception as e:  # a bug in a pass: say which pass, keep the traceback chained
            raise PassError(f"internal error in pass {name}: {e.__class__.__name__}: {e}") from e
        records.append({"pass": name})
        changed = out != g
        if changed:
            try:
                verify(out)
            except StrataError as e:
                raise PassError(f"after pass {name}: {e}") from None
        rec = records[-1]
        rec.update({"level": out.level.value, "seconds": round(time.perf_counter() - t0, 6),
               "nodes_before": len(g.nodes), "nodes_after": len(out.nodes), "changed": changed})
        g = out
        if dump and dump.wants(name):
            rec["text"], rec["dot"] = _write_dump(dump, seq, g, name)
        if name == stop_after:
            break
    if dump:
        (dump.directory / "index.json").write_text(json.dumps({"passes": records}, indent=2) + "\n")
    return g
