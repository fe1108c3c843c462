"""The compile driver: the compile pipeline, each pass one line, and what runs it behind
`stratac compile` (model folder -> plan directory). The manager verifies the IR after every pass.

In the entry layer with the `stratac` CLI, above every other layer and imported by none
(tests/test_layering.py): it registers the passes and the llvm backend's own `cpu-codegen` pass,
reads the model through a frontend, and gives the passes what only other layers can make, in the
pass context: the hardware profile of `--target` (measured by the backends' probe for `auto`) and
the plan behind `--calib PLAN.bin` (read by the runtime's plan loader). Everything a compile can
check is checked before the passes run: the flags, the config (frontend), the tokenizer (parsed),
and the output folder, which the compile holds locked and leaves as it was when it fails.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import socket
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

from . import settings
# Importing the pass modules registers them.
from .backends.llvm_cpu import cpu_codegen  # noqa: F401
from .errors import ModelError, StrataError, UsageError
from .formats import check_group_size, get_format
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
    """Flag values that cannot work, before any work: the format names, and the group size against
    every grouped format the compile may write (--quant, --tensor-format's, and with --bits or
    --memory-budget every candidate of the allocator)."""
    from .passes.laq import CANDIDATES
    from .passes.quantize import parse_tensor_formats

    if opts.quant != "auto":
        get_format(opts.quant)
    if opts.group_size < 2 or opts.group_size % 2 or opts.group_size > 4096:
        raise UsageError(f"--group-size {opts.group_size}: use an even number between 2 and 4096 (default 32)")
    used = [opts.quant] * (opts.quant != "auto") + [fmt for _, fmt in parse_tensor_formats(opts.tensor_format)]
    for name in used:
        check_group_size(name, opts.group_size)
    if opts.bits or opts.memory_budget:
        try:
            for name in CANDIDATES:
                check_group_size(name, opts.group_size)
        except UsageError as e:
            raise UsageError(f"{e}, one of the formats {'--bits' if opts.bits else '--memory-budget'} "
                             f"chooses from") from None


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
                  progress_bytes: Callable[[int, int], None] | None = None) -> Graph:
    """Compile a model folder (or .gguf file) into `out_dir`; `progress` gets each pass's name,
    `progress_bytes` (bytes read, bytes in all) the checkpoint bytes emit converts."""
    check_options(opts)
    opts = replace(opts, backend=resolve_compile_backend(opts.backend), cpu_backend=cpu_backend())
    pipeline = list(pipeline or DEFAULT)
    if opts.place:
        from .passes.placement_rules import parse_rules

        parse_rules(opts.place)   # a bad rule fails before any work
    writes = out_dir is not None and _runs("emit", pipeline, stop_after)
    with output_folder(out_dir) if writes else contextlib.nullcontext():
        graph, ctx = _read_model(model_dir, out_dir, opts)
        ctx.progress, ctx.progress_bytes = progress, progress_bytes
        ctx.dump_dir = dump.directory if dump else None
        if opts.target and _runs("place", pipeline, stop_after):
            ctx.hardware = hardware(opts.target, progress)
        if opts.calib and is_plan_file(opts.calib) and _runs("calibrate", pipeline, stop_after):
            from .runtime.plan import load_plan

            ctx.calib_plan = load_plan(Path(opts.calib), verify_weights="lazy")
        return run_pipeline(graph, pipeline, ctx, dump=dump, stop_after=stop_after)


def _read_model(model_dir: Path, out_dir: Path | None, opts: CompileOptions) -> tuple[Graph, PassContext]:
    """The frontend's graph, and the pass context holding its tensor store, tokenizer, chat and
    recommended sampling."""
    from .frontend.chat import hf_chat
    from .frontend.generation import gguf_sampling, hf_sampling
    from .frontend.gguf_reader import is_gguf, open_gguf
    from .frontend.hf import build_graph
    from .frontend.safetensors_reader import TensorStore

    if is_gguf(model_dir):
        store, cfg, tokenizer_json, chat = open_gguf(model_dir, with_chat=True)
        sampling = gguf_sampling(model_dir, store.reader)
        graph, _ = build_graph(model_dir, store, cfg)
        if tokenizer_json is not None:
            check_tokenizer(tokenizer_json, f"{model_dir}: the tokenizer its metadata describes")
    else:
        if not os.path.lexists(model_dir):
            raise ModelError(f"{model_dir}: no such file or directory; pass a Hugging Face model folder or a "
                             f".gguf file")
        if not model_dir.is_dir():
            raise ModelError(f"{model_dir}: neither a model folder nor a GGUF file; pass a Hugging Face model "
                             f"folder (config.json, *.safetensors) or a .gguf file")
        store = TensorStore.open(model_dir)
        graph, cfg = build_graph(model_dir, store)
        tokenizer_json = read_tokenizer_json(model_dir / "tokenizer.json")
        chat = hf_chat(model_dir, cfg.eos_token_ids, cfg.vocab_size)
        sampling = hf_sampling(model_dir)
    if opts.chat_template:
        from .frontend.chat import MAX_TEMPLATE_BYTES, check_template
        from .untrusted import read_regular

        where = f"--chat-template {opts.chat_template}"
        try:
            text = read_regular(Path(opts.chat_template), MAX_TEMPLATE_BYTES).decode("utf-8")
        except (OSError, ValueError) as e:
            raise UsageError(f"{where}: cannot be read as a UTF-8 file of at most {MAX_TEMPLATE_BYTES} bytes "
                             f"({getattr(e, 'strerror', None) or e})") from None
        chat = {**(chat or {}), "template": check_template(text, where)}
    return graph, PassContext(opts, model_dir=model_dir, output_dir=out_dir, store=store,
                              tokenizer_json=tokenizer_json, chat=chat, sampling=sampling)


MAX_TOKENIZER_BYTES = 128 << 20     # the largest real tokenizer.json files are ~35 MB


def read_tokenizer_json(path: Path) -> bytes | None:
    """tokenizer.json's bytes, parsed here as the runtime will parse them (a file `tokenizers`
    cannot load would compile, then fail every run); None when the folder has none."""
    from .untrusted import read_regular

    if not path.exists():
        return None
    try:
        data = read_regular(path, MAX_TOKENIZER_BYTES)
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror or e.__class__.__name__})") from None
    check_tokenizer(data, str(path))
    return data


def check_tokenizer(data: bytes, where: str) -> None:
    """ModelError naming `where` unless `data` is UTF-8 JSON that tokenizers.Tokenizer loads."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ModelError(f"{where}: not UTF-8 text; fix or re-download it") from None
    except Exception as e:  # the tokenizers library raises plain Exceptions from Rust
        why = (str(e).splitlines() or [e.__class__.__name__])[0][:160]
        raise ModelError(f"{where}: not a tokenizer the `tokenizers` library can load ({why}); "
                         f"fix or re-download it") from None


_STALE = re.compile(r"(?:(?:plan|weights)\.bin\.tmp-(\d{1,9})(?:\.tmp-\d{1,9})?|weights\.bin\.old-(\d{1,9}))")


@contextlib.contextmanager
def output_folder(out_dir: Path) -> Iterator[None]:
    """Hold the output folder for one compile. An existing file there is refused; the folder is
    created if missing, and removed again (with the parents made for it) when the compile fails
    and leaves it empty. It is locked (flock on the folder itself, so no lock file stays behind):
    a second compile into it fails at once instead of both reporting success. Temporary files of
    compiles that died (`weights.bin.tmp-PID`, PID gone) are removed."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"-o {out_dir}: is a file, not a folder; give the folder to write plan.bin and "
                         f"weights.bin into")
    created = []            # the folders made here, deepest first
    p = out_dir.absolute()
    while not os.path.lexists(p) and p != p.parent:
        created.append(p)
        p = p.parent
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        _remove_empty(created)
        raise UsageError(f"-o {out_dir}: cannot create or open the folder ({e.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UsageError(f"-o {out_dir}: cannot lock the folder ({e.strerror})") from None
            created = []    # the compile holding it may have made it: leave it be
            raise UsageError(f"-o {out_dir}: another stratac compile is writing into this folder; wait for it "
                             f"to finish or choose another folder") from None
        _remove_stale_temps(out_dir)
        for name in ("plan.bin", "weights.bin"):       # replaced by rename at the end: plain files only
            q = out_dir / name
            if os.path.lexists(q) and (q.is_symlink() or not q.is_file()):
                raise UsageError(f"-o {out_dir}: {name} there is not a regular file; remove it or choose another folder")
        yield
    except BaseException:
        _remove_empty(created)
        raise
    finally:
        os.close(fd)


def _remove_empty(folders: list[Path]) -> None:
    for d in folders:
        try:
            d.rmdir()
        except OSError:
            return


def _restore_weights(out_dir: Path, kept: Path) -> bool:
    """Whether `kept` (weights.bin.old-PID of a compile killed between emit's two renames) is the
    weights plan.bin names while weights.bin is not; then it is put back as weights.bin."""
    from .plan_format import PLAN_MAGIC, WEIGHTS_MAGIC, Container
    from .untrusted import load_json

    try:
        with Container.open(out_dir / "plan.bin", PLAN_MAGIC, verify="full") as c:
            ref = load_json(c.section("meta"))["weights"]
        want = (int(ref["size"]), int(ref["checksum"]))
        match = []
        for p in (out_dir / "weights.bin", kept):
            with Container.open(p, WEIGHTS_MAGIC, verify="none") as c:
                match.append((c.total_size, c.body_checksum) == want)
    except (OSError, StrataError, ValueError, KeyError, TypeError):
        return False
    if match != [False, True]:
        return False
    os.replace(kept, out_dir / "weights.bin")
    return True


def _remove_stale_temps(out_dir: Path) -> None:
    """Temporary plan/weights files whose compile is gone: with the folder locked no live compile
    writes here, but a PID still running is left alone all the same (an older stratac's). The old
    weights a compile killed between its two renames kept (`weights.bin.old-PID`) are put back
    when they are what plan.bin names."""
    for p in out_dir.iterdir():
        m = _STALE.fullmatch(p.name)
        if not m or p.is_symlink() or not p.is_file():
            continue
        pid = int(m.group(1) or m.group(2))
        if pid != os.getpid():
            try:
                os.kill(pid, 0)
                continue
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        if p.name.startswith("weights.bin.old-") and _restore_weights(out_dir, p):
            continue
        p.unlink(missing_ok=True)
