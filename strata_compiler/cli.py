"""`stratac`: compile a Hugging Face model folder into a plan, and inspect plans."""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import click

from . import settings
from .cli_common import debug_option, run_cli
from .driver import DEFAULT
from .errors import UsageError
from .formats import get_format
from .pass_manager import PASSES, CompileOptions, DumpConfig
from .placement_text import prefill_lines


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="strata", prog_name="stratac")
def stratac() -> None:
    """Strata compiler: Hugging Face MoE model folder -> plan.bin + weights.bin.

    \b
      stratac compile ./Qwen3-30B-A3B --quant int4 -o qwen/
      strata-run qwen/plan.bin --prompt "Explain MoE routing"
    """


@stratac.command("compile")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out_dir", type=click.Path(path_type=Path), required=True,
              help="Directory to write plan.bin and weights.bin into (created if missing).")
@settings.option("quant")
@settings.option("group_size")
@click.option("--calib", type=click.Path(path_type=Path), metavar="FILE",
              help="Calibration text (plain text, or JSONL with a \"text\" field): run the f32 model over it and "
                   "choose quantization scales weighted by the activations each weight sees (llama.cpp's imatrix). "
                   "A plan.bin compiled with --calib reuses its calibration without running the model.")
@settings.option("calib_tokens")
@settings.option("imatrix")
@settings.option("bits", metavar="B")
@settings.option("memory_budget", metavar="SIZE")
@settings.option("tensor_format", metavar="RULES")
@click.option("--dump-dir", type=click.Path(path_type=Path),
              help="Write the IR after each pass as NNN.<level>.<pass>.txt/.dot plus index.json.")
@settings.option("dump_after")
@settings.option("stop_after")
@settings.option("backend", help="Backend ops are bound to: auto = llvm on hosts with AVX2+FMA, else reference; "
                                 "xla = JAX (a GPU at run time when present). strata-run --backend can rebind.")
@settings.option("place", metavar="RULES")
@settings.option("target", metavar="auto|HW.json")
@settings.option("gpu_mem", metavar="SIZE")
@settings.option("host_mem", metavar="SIZE")
@settings.option("gpus")
@settings.option("place_strategy")
@settings.option("gpu_mode")
@settings.option("compile_expert_cache")
@click.option("--chat-template", type=click.Path(path_type=Path), metavar="FILE",
              help="A Jinja chat template (as in tokenizer_config.json) stored in the plan instead of the model's "
                   "own, or where the model has none (strata-run --chat, /v1/chat/completions, Model.chat).")
@click.option("--eval-text", type=click.Path(path_type=Path), metavar="FILE",
              help="For a GGUF whose tensors were quantized again (K-quants, ...): afterwards print the KL of the "
                   "plan against the file's own weights over two chunks of 512 tokens of FILE (stratac eval; the "
                   "reference is compiled at f32 into a temporary folder).")
@debug_option
def compile_cmd(model_dir: Path, out_dir: Path, quant: str, group_size: int, calib: Path | None, calib_tokens: int,
                imatrix: bool, chat_template: Path | None, eval_text: Path | None,
                bits: float | None, memory_budget: str, tensor_format: str, dump_dir: Path | None,
                dump_after: str, stop_after: str | None, backend: str, place: str, target: str, gpu_mem: str,
                host_mem: str, gpus: int, gpu_mode: str, place_strategy: str, expert_cache: bool,
                debug: bool) -> None:
    """Compile MODEL_DIR (a Hugging Face folder: config.json, *.safetensors, tokenizer.json; or a
    llama.cpp .gguf file) into a plan.

    \b
    Pipeline: """
    from .driver import compile_model

    dump = None
    if dump_dir is None and dump_after != "all":
        raise UsageError(f"--dump-after {dump_after}: needs --dump-dir (where the dumps go)")
    if dump_dir is not None:
        after = None
        if dump_after != "all":
            after = frozenset(s.strip() for s in dump_after.split(",") if s.strip())
            unknown = after - set(PASSES)
            if unknown:
                raise UsageError(f"--dump-after: unknown pass(es) {', '.join(sorted(unknown))}; passes: {', '.join(DEFAULT)}")
        dump = DumpConfig(dump_dir, after)
    if stop_after is not None and stop_after not in DEFAULT:
        raise UsageError(f"--stop-after {stop_after}: unknown pass; passes: {', '.join(DEFAULT)}")
    if (bits or memory_budget) and quant not in ("f32", "auto"):
        raise UsageError(f"--quant {quant} and {'--bits' if bits else '--memory-budget'} both choose formats; "
                         f"use one of them")
    if bits and memory_budget:
        raise UsageError("--bits and --memory-budget both set the size; use one of them")
    if not imatrix and (bits or memory_budget):
        raise UsageError(f"--no-imatrix and {'--bits' if bits else '--memory-budget'} conflict: layer-adaptive "
                         f"quantization measures each format's error with the activation weights; drop one")
    if bits or memory_budget:
        quant = "f32"       # layer-adaptive formats replace --quant (the options say so, as before auto)
    opts = CompileOptions(quant=quant, group_size=group_size, backend=backend, place=place,
                          calib=str(calib) if calib else "", calib_tokens=calib_tokens, imatrix=imatrix,
                          bits=bits or 0.0,
                          memory_budget=memory_budget, tensor_format=tensor_format,
                          target=target, gpu_mem=gpu_mem, host_mem=host_mem, expert_cache=expert_cache,
                          gpus=gpus, gpu_mode=gpu_mode, place_strategy=place_strategy,
                          chat_template=str(chat_template) if chat_template else "")
    if gpus > 1 and not target:
        raise UsageError("--gpus: spreading over GPUs is part of the placement; it needs --target")
    if place_strategy != "auto" and not target:
        raise UsageError(f"--place-strategy {place_strategy}: a layout of the place pass; it needs --target")
    if expert_cache and not target:
        raise UsageError("--expert-cache: the cache's slots come from the placement; it needs --target")
    if (gpu_mem or host_mem) and not target:
        raise UsageError(f"{'--gpu-mem' if gpu_mem else '--host-mem'}: plans for a machine's memory; it needs --target "
                         f"auto or --target HW.json")
    if tensor_format:
        from .passes.quantize import parse_tensor_formats

        parse_tensor_formats(tensor_format)   # a bad rule fails before any work
    bar = CompileProgress() if sys.stderr.isatty() else None
    with bar or contextlib.nullcontext():
        g = compile_model(model_dir, out_dir, opts, dump=dump, stop_after=stop_after,
                          progress=bar and bar.on_pass, progress_bytes=bar and bar.on_bytes)
    if stop_after in (None, "emit"):
        plan, weights = out_dir / "plan.bin", out_dir / "weights.bin"
        click.echo(f"wrote {plan} ({plan.stat().st_size} B) and {weights} ({weights.stat().st_size / 2**20:.1f} MiB); "
                   f"{len(g.nodes)} ops, " + (f"quant {_formats(plan) if quant == 'auto' else quant}"
                                               if not (bits or memory_budget) else
                                               f"layer-adaptive formats ({'--bits ' + str(bits) if bits else '--memory-budget ' + memory_budget})"))
        click.echo(_text_support(plan))
        note = _requantized(model_dir, plan)
        if note:
            click.echo(note)
            if eval_text is not None:
                from .runtime.plan import load_plan

                most = load_plan(plan).meta["model"].get("max_position") or 512
                eval_cmd.callback(out_dir, model_dir, eval_text, min(settings.get("eval_ctx"), int(most)), 2,
                                  settings.get("backend"), False, False, debug)
    else:
        click.echo(f"stopped after {stop_after}: {len(g.nodes)} {g.level.value}-level nodes")


# (GGUF type, Strata format) pairs a compile keeps without a second rounding, besides f32 (which
# holds any type exactly) and the stored formats of gguf_reader.NATIVE
_EXACT = {("BF16", "bf16")}


def _requantized(model: Path, plan: Path) -> str:
    """For a GGUF input: one line naming the tensor types that were dequantized and quantized again
    (K-quants, ...) and how to measure what that cost; '' when none were."""
    from .frontend.gguf_reader import NATIVE, is_gguf, open_gguf

    if not is_gguf(model):
        return ""
    from .passes.quantize import source_type
    from .runtime.plan import load_plan

    exact = {**{pair: 32 for pair in _EXACT}, **{(t, f): g for t, f, g in NATIVE}}     # -> its group size
    store = open_gguf(model)[0]
    moved: dict[tuple[str, str], int] = {}
    for w in load_plan(plan).graph.weights:
        for key in w.sources:
            t = source_type(store, key)
            if (t is not None and len(w.shape) >= 2 and w.fmt != "f32"       # f32 holds every type exactly
                    and ((t, w.fmt) not in exact or w.group_size not in (0, exact[t, w.fmt]))):
                moved[t, w.fmt] = moved.get((t, w.fmt), 0) + 1
    if not moved:
        return ""
    what = ", ".join(f"{t} -> {f} ({n})" for (t, f), n in sorted(moved.items()))
    return (f"requantized from the file's types: {what}; what it costs against the file's own weights: "
            f"stratac eval {plan.parent} --reference {model} --text TEXT")


def _formats(plan: Path) -> str:
    """The formats a plan's weights took (--quant auto), as `stratac inspect` labels them."""
    from .runtime.evaluate import quant_label
    from .runtime.plan import load_plan

    return quant_label(load_plan(plan), groups=True)


def _text_support(plan: Path) -> str:
    """One line: whether the plan holds a tokenizer (text in and out) and a chat template, and where
    its default sampling comes from."""
    from .plan_format import PLAN_MAGIC, Container
    from .sampling import source_of
    from .untrusted import load_json

    with Container.open(plan, PLAN_MAGIC) as c:
        tokenizer = "tokenizer" in c
        meta = load_json(c.section("meta"))
    chat = meta.get("chat") if isinstance(meta.get("chat"), dict) else {}
    return (f"tokenizer: {'stored' if tokenizer else 'none (give strata-run --input-ids)'}; chat template: "
            f"{'stored' if chat.get('template') else 'none (add one with --chat-template FILE)'}; sampling: "
            f"{source_of(meta)}")


compile_cmd.help = (compile_cmd.help or "") + ", ".join(DEFAULT)


class CompileProgress:
    """The compile's progress line on a terminal: the pass running, then the share of checkpoint
    bytes emit has converted, with an ETA from the rate since emit began (the passes before it,
    calibration and kernel builds, take time but convert no bytes: timed in, they would make the
    estimate minutes for a few seconds' work)."""

    def __init__(self, stream=None, clock: Callable[[], float] = time.monotonic, width: int = 30) -> None:
        self.stream, self.clock, self.width = stream or sys.stderr, clock, width
        self.done, self.start, self.shown, self.last = 0, None, float("-inf"), 0

    def on_pass(self, name: str) -> None:
        if name == "emit":
            self.start = self.clock()
        self._show(f"compiling: {name}")

    def on_bytes(self, n: int, total: int) -> None:
        now = self.clock()
        if self.start is None:
            self.start = now
        self.done += n
        if now - self.shown < 0.2 and self.done < total:
            return
        self.shown = now
        frac = min(self.done / total, 1.0) if total > 0 else 1.0
        unit, div = ("GiB", 2**30) if total >= 2**30 else ("MiB", 2**20)
        text = (f"converting weights [{'#' * int(frac * self.width):<{self.width}}] {frac:4.0%} "
                f"{self.done / div:.2f}/{total / div:.2f} {unit}")
        elapsed = now - self.start
        if 0 < self.done < total and elapsed > 0:
            eta = int(elapsed * (total - self.done) / self.done + 0.5)
            text += f", {eta // 60}:{eta % 60:02d} left"
        self._show(text)

    def _show(self, text: str) -> None:
        self.stream.write("\r" + text.ljust(self.last))
        self.stream.flush()
        self.last = len(text)

    def __enter__(self) -> "CompileProgress":
        return self

    def __exit__(self, *exc) -> None:
        if self.last:
            self.stream.write("\n")
            self.stream.flush()


def summarize(plan) -> dict:
    from dataclasses import asdict

    from strata_compiler.runtime.evaluate import quant_label

    from .ir import Op
    from .sampling import from_meta, resolve, source_of

    g = plan.graph
    kernels = Counter(f"{n.backend}@{n.device}:{n.op.value}" for n in g.nodes)
    fused = Counter()
    for n in g.nodes:
        if n.op is Op.LINEAR:
            parts = [p for p in (n.attr("prologue", "none"), "matmul", n.attr("epilogue", "none"),
                                 "residual" if len(n.args) == 2 else "none") if p != "none"]
            fused["+".join(parts)] += 1
        elif n.op in (Op.FUSED_ATTENTION, Op.ROUTE) or (n.op is Op.MOE_FFN and n.weight("gate_up")):
            fused[n.op.value + ("+residual" if n.op is Op.MOE_FFN and len(n.args) == 3 else "")] += 1
    on_gpu = {w for n in g.nodes if n.device.startswith("gpu") for _, w in n.weights}
    weights = []
    for w in g.weights:
        nbytes = get_format(w.fmt).nbytes(w.shape, w.group_size or 32)
        tier = "gpu (device memory)" if w.name in on_gpu else "host-ram (mmap)"
        weights.append({"name": w.name, "shape": list(w.shape), "format": w.fmt, "group_size": w.group_size,
                        "bytes": nbytes, "tier": tier})
    tiers = Counter()
    for w in weights:
        tiers[w["tier"]] += w["bytes"]
    layers: dict[str, dict[str, str]] = {}     # layer -> tensor -> format: the layer x tensor table
    shares: dict[tuple[str, str], Counter] = {}  # experts split into shares: formats counted per expert
    for w in g.weights:
        head, _, rest = w.name.partition(".")
        layer, tensor = (head, rest) if head[:1] == "L" and head[1:].isdigit() and rest else ("-", w.name)
        if w.expert_ids and tensor.rpartition(".")[2][:1] == "s":
            shares.setdefault((layer, tensor.rpartition(".")[0]), Counter())[w.fmt] += len(w.expert_ids)
        else:
            layers.setdefault(layer, {})[tensor] = w.fmt
    for (layer, tensor), c in shares.items():   # e.g. int4*8: the formats of the layer's expert shares
        layers.setdefault(layer, {})[tensor] = "+".join(f + (f"*{k}" if k > 1 else "") for f, k in c.most_common())
    return {
        "plan": str(plan.path), "model": plan.meta["model"], "options": plan.meta["options"],
        "quant": quant_label(plan, groups=True),    # from the weights (a layer-adaptive plan's options say f32)
        "kernels": dict(sorted(kernels.items())), "fused_kernels": dict(sorted(fused.items())),
        "bytes_per_tier": dict(tiers), "weights": weights, "formats_by_layer": layers,
        "peak_activation_bytes_per_token": plan.meta["model"].get("peak_activation_bytes_per_token"),
        "placement": json.loads(plan.meta["model"]["placement"]) if "placement" in plan.meta["model"] else None,
        "sampling": {**asdict(resolve(from_meta(plan.meta.get("sampling")))), "source": source_of(plan.meta)},
    }


@stratac.command("inspect")
@click.argument("plan_path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@settings.option("inspect_weights")
@debug_option
def inspect_cmd(plan_path: Path, as_json: bool, weights: bool, debug: bool) -> None:
    """Summarise a plan: kernels per device, bytes per memory tier, format per tensor, fusions."""
    from strata_compiler.runtime.plan import load_plan

    from .sampling import Sampling

    s = summarize(load_plan(plan_path))
    if as_json:
        click.echo(json.dumps(s, indent=1))
        return
    m = s["model"]
    click.echo(f"plan {s['plan']}: {m['architecture']}, {m['n_layers']} layers, vocab {m['vocab_size']}, "
               f"quant {s['quant']}")
    click.echo("\nkernels (backend@device:op)")
    for k, v in s["kernels"].items():
        click.echo(f"  {v:6d}  {k}")
    click.echo("\nfused kernels")
    for k, v in s["fused_kernels"].items():
        click.echo(f"  {v:6d}  {k}")
    click.echo("\nbytes per memory tier")
    for k, v in s["bytes_per_tier"].items():
        click.echo(f"  {v / 2**20:10.2f} MiB  {k}")
    click.echo(f"\npeak activations: {s['peak_activation_bytes_per_token']} B per token")
    sm = {k: v for k, v in s["sampling"].items() if k != "source"}
    click.echo(f"default sampling: {Sampling(**sm).describe()}, from {s['sampling']['source']}")
    pl = s["placement"]
    if pl:
        prof = pl["profile"]
        click.echo(f"\nplacement (--target: {prof['gpu'] or 'no gpu'}, {prof['gpu_mem'] / 2**30:.2f} GiB gpu, "
                   f"{prof['host_mem'] / 2**30:.1f} GiB host): {pl['choice']}")
        for line in prefill_lines(pl):      # as planned, and streamed to the GPU from the break-even
            click.echo("  " + line)
        click.echo(f"  predicted decode: {pl['predicted_tok_s']:.1f} tok/s at batch 1; gpu {pl['gpu_bytes'] / 2**20:.1f} "
                   f"MiB of {pl['gpu_budget_bytes'] / 2**20:.1f} MiB budget (KV reserve {pl['kv_bytes'] / 2**20:.1f} MiB), "
                   f"host {pl['host_bytes'] / 2**20:.1f} MiB, disk {pl['disk_bytes'] / 2**20:.1f} MiB")
        click.echo("  candidates (predicted tok/s): " + ", ".join(f"{k} {v:.1f}" for k, v in pl["candidates"].items()))
        if pl.get("gpu_modes"):
            click.echo(f"  {pl['gpus']} GPUs, mode {pl['gpu_mode']}; " + ", ".join(
                f"{m}: {v['hops_per_token']} {'all-reduces' if m == 'stripe' else 'hops'} between GPUs per token, "
                f"{v['predicted_tok_s']:.1f} tok/s"
                for m, v in pl["gpu_modes"].items()))
        click.echo(f"  {'layer':>6} {'core':>5} {'experts on gpu':>15} {'predicted us':>13} {'all cpu us':>11} "
                   f"{'all gpu us':>11}")
        for k, v in pl["per_layer"].items():
            name = {"-1": "embed"}.get(k, "head" if v["experts"] == 0 and int(k) == len(pl["per_layer"]) - 2 else k)
            ex = f"{v['gpu_experts']}/{v['experts']}" if v["experts"] else "-"
            cpu_us = v.get("seconds_all_cpu")
            gpu_us = v.get("seconds_all_gpu")
            click.echo(f"  {name:>6} {v['core']:>5} {ex:>15} {v['seconds'] * 1e6:13.1f} "
                       f"{'-' if cpu_us is None else f'{cpu_us * 1e6:.1f}':>11} "
                       f"{'-' if gpu_us is None else f'{gpu_us * 1e6:.1f}':>11}")
    table = s["formats_by_layer"]
    cols = sorted({t for lay, ts in table.items() if lay != "-" for t in ts})
    if cols:
        click.echo("\nformat per layer and tensor")
        width = max(6, *(len(c) for c in cols), *(len(f) for lay, ts in table.items() if lay != "-" for f in ts.values()))
        click.echo("  layer " + " ".join(f"{c:>{width}s}" for c in cols))
        for lay in sorted((k for k in table if k != "-"), key=lambda k: int(k[1:])):
            click.echo(f"  {lay:5s} " + " ".join(f"{table[lay].get(c, '-'):>{width}s}" for c in cols))
        if "-" in table:
            click.echo("  other " + ", ".join(f"{t} {f}" for t, f in sorted(table["-"].items())))
    if weights:
        click.echo("\nweights")
        for w in s["weights"]:
            click.echo(f"  {w['name']:40s} {w['format']:5s} {str(w['shape']):>18s} {w['bytes'] / 1024:10.1f} KiB")


# ------------------------------------------------------------------------------------------------
# stratac eval (the scoring: runtime/evaluate.py)


def reference_kind(ref: Path) -> str:
    """'hf' (a model folder), 'gguf' (a llama.cpp file), 'plan' (a plan directory or plan.bin), else
    a UsageError."""
    if not ref.exists():
        raise UsageError(f"--reference {ref}: no such file or directory; pass a Hugging Face model folder or a plan")
    from .frontend.gguf_reader import is_gguf

    if is_gguf(ref):
        return "gguf"
    if ref.is_dir():
        if (ref / "config.json").is_file():
            return "hf"
        if (ref / "plan.bin").is_file():
            return "plan"
        raise UsageError(f"--reference {ref}: neither a Hugging Face model folder (no config.json) nor a plan "
                         f"directory (no plan.bin); pass one of those")
    return "plan"


def check_reference(ref: Path, kind: str, vocab: int, ctx: int, plan_path: Path) -> None:
    """Cheap checks of an HF reference before it is compiled."""
    if kind != "hf":
        return
    from strata_compiler.runtime import evaluate as ev

    from .frontend.hf import read_config

    cfg = read_config(ref)
    if cfg.vocab_size != vocab:
        raise UsageError(f"--reference {ref}: vocabulary of {cfg.vocab_size} tokens, but {plan_path} has {vocab}; "
                         f"compare against the model the plan was compiled from")
    ev.check_ctx(ctx, cfg.max_position, ref / "config.json")


@contextlib.contextmanager
def open_reference(ref: Path, kind: str, backend: str, *, say: Callable[[str], None] | None = None) -> Iterator:
    """The reference as a loaded Plan; a model folder or a GGUF file (its dequantized weights) is
    compiled at f32 into a temporary directory that is deleted afterwards."""
    from strata_compiler.runtime.plan import load_plan

    if kind == "plan":
        yield load_plan(ref)
        return
    from .driver import compile_model

    with tempfile.TemporaryDirectory(prefix="strata-eval-ref-") as tmp:
        if say:
            say(f"compiling reference {ref} at f32")
        compile_model(ref, Path(tmp), CompileOptions(quant="f32", backend=backend))
        yield load_plan(tmp)


def _table(plan, ref: Path, kind: str, r: dict) -> str:
    from strata_compiler.runtime.evaluate import quant_label, scored_range

    quant = quant_label(plan)
    first, last = scored_range(r["ctx"])
    rows = [
        ("plan", f"{plan.path} ({quant}, {r['bits_per_weight']:.3f} bits/weight, "
                 f"{r['weight_bytes'] / 2**20:.2f} MiB of weights)"),
        ("reference", f"{ref}" + (" (compiled at f32)" if kind != "plan" else "")
                      + f" ({r['ref_bits_per_weight']:.3f} bits/weight)"),
        ("scored", f"{r['tokens']} tokens: {r['chunks']} chunks of {r['ctx']}, positions {first}..{last - 1}"),
        ("mean KL", f"{r['mean_kl']:.6f} ± {r['kl_stderr']:.6f}"),
        ("99% KL", f"{r['p99_kl']:.6f}"),
        ("max KL", f"{r['max_kl']:.6f}"),
        ("top-1", f"{100 * r['top1']:.3f} ± {100 * r['top1_stderr']:.3f} %"),
        ("PPL", f"{r['ppl']:.4f} (reference {r['ref_ppl']:.4f}, ratio {r['ppl_ratio']:.4f})"),
        ("backend", r["backend"]),
    ]
    return "\n".join(f"{k:10s} {v}" for k, v in rows)


@stratac.command("eval")
@click.argument("plan_path", type=click.Path(path_type=Path))
@click.option("--reference", "ref", type=click.Path(path_type=Path), required=True,
              help="Reference: a Hugging Face model folder or a GGUF file (its dequantized weights), compiled at "
                   "f32 into a temporary directory; or a plan.")
@click.option("--text", "text_path", type=click.Path(path_type=Path), required=True,
              help="UTF-8 text file, tokenized with the plan's tokenizer.")
@settings.option("eval_ctx")
@settings.option("eval_chunks")
@settings.option("backend", help="Where both models run.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--per-layer", is_flag=True,
              help="Instead: per layer, the error of the plan's hidden state against the reference's and the KL "
                   "it accounts for (both on the reference backend, over the first chunk).")
@debug_option
def eval_cmd(plan_path: Path, ref: Path, text_path: Path, ctx: int, chunks: int | None, backend: str,
             as_json: bool, per_layer: bool, debug: bool) -> None:
    """KL divergence, top-1 agreement and perplexity of PLAN_PATH against a reference (llama.cpp's
    --kl-divergence conventions: chunks of --ctx tokens from an empty cache, second half scored)."""
    import numpy as np

    from strata_compiler.runtime import evaluate as ev
    from strata_compiler.runtime.plan import load_plan

    if ctx < ev.MIN_CTX:
        raise UsageError(f"--ctx {ctx}: use at least {ev.MIN_CTX} tokens per chunk (default 512)")
    text = ev.read_text(text_path)
    plan = load_plan(plan_path)
    tok = ev.plan_tokenizer(plan)
    ev.check_ctx(ctx, plan.meta["model"].get("max_position"), plan.path)
    vocab = plan.meta["model"]["vocab_size"]
    kind = reference_kind(ref)
    check_reference(ref, kind, vocab, ctx, plan.path)
    ids = np.asarray(tok.encode(text, add_special_tokens=False).ids, np.int64)
    if len(ids) < ctx:
        raise UsageError(f"--text {text_path}: {len(ids)} tokens, fewer than one chunk of --ctx {ctx}; "
                         f"give a longer text or a smaller --ctx")
    if ids.max() >= vocab:
        raise UsageError(f"{plan.path}: its tokenizer produced id {int(ids.max())}, outside the model's vocabulary "
                         f"of {vocab}; the plan's tokenizer does not belong to its model")
    n_chunks = min(len(ids) // ctx, chunks or len(ids))
    show = sys.stderr.isatty()
    say = (lambda m: click.echo(m, err=True)) if show else None
    with open_reference(ref, kind, backend, say=say) as ref_plan:
        if kind == "plan":
            ref_vocab = ref_plan.meta["model"]["vocab_size"]
            if ref_vocab != vocab:
                raise UsageError(f"--reference {ref}: vocabulary of {ref_vocab} tokens, but {plan.path} has "
                                 f"{vocab}; compare plans of the same model")
            ev.check_ctx(ctx, ref_plan.meta["model"].get("max_position"), ref_plan.path)
        if per_layer:
            from strata_compiler.runtime import layer_eval

            rows = layer_eval.per_layer(plan, ref_plan, ids[None, :ctx])
            click.echo(json.dumps(rows) if as_json else layer_eval.table(rows))
            return
        bar = click.progressbar(length=n_chunks, label="evaluating chunks", file=sys.stderr, width=30)
        with bar if show else contextlib.nullcontext():
            r = ev.evaluate(plan, ref_plan, ids, ctx, chunks, backend, bos_id=ev.tokenizer_bos(tok, plan),
                         progress=bar.update if show else None)
    if as_json:
        click.echo(json.dumps(r))
    else:
        click.echo(_table(plan, ref, kind, r))


@stratac.command("probe-hw")
@click.option("-o", "--output", type=click.Path(path_type=Path), metavar="FILE",
              help="Where to write the hardware profile (JSON; written atomically).")
@settings.option("probe_quick")
@settings.option("probe_disk_dir", metavar="DIR")
@settings.option("probe_disk_size", metavar="SIZE")
@click.option("--show", type=click.Path(path_type=Path), metavar="FILE",
              help="Check and print an existing profile instead of measuring.")
@debug_option
def probe_hw_cmd(output: Path | None, quick: bool, disk_dir: Path | None, disk_size: str, show: Path | None,
                 debug: bool) -> None:
    """Measure this machine for placement: RAM, memory and disk bandwidth, CPU (and GPU) GEMV speed per format.

    \b
      stratac probe-hw -o hw.json
    """
    import os

    from . import hwprofile
    from .backends import probe as hwprobe

    if show is not None:
        if output is not None:
            raise UsageError("--show reads a profile and -o writes one; use one of them")
        click.echo(hwprofile.describe(hwprofile.HardwareProfile.from_json(show)))
        return
    if output is None:
        raise UsageError("probe-hw: give -o FILE (where the profile goes), or --show FILE")
    if output.is_dir():
        raise UsageError(f"-o {output}: is a directory; give a file name, e.g. {output / 'hw.json'}")
    parent = output.parent
    if not parent.is_dir():
        raise UsageError(f"-o {output}: directory {parent} does not exist")
    disk_dir = disk_dir if disk_dir is not None else parent
    if not disk_dir.is_dir():
        raise UsageError(f"--disk-dir {disk_dir}: not a directory")
    if not os.access(disk_dir, os.W_OK):
        raise UsageError(f"--disk-dir {disk_dir}: not writable (the disk test writes a temporary file there)")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"-o {output}: directory {parent} is not writable")
    disk_bytes = hwprofile.size_bytes(disk_size, "--disk-size") if disk_size else None
    profile = hwprobe.probe(quick=quick, disk_dir=disk_dir, disk_bytes=disk_bytes,
                              progress=lambda msg: click.echo(f"probe-hw: {msg}", err=True))
    profile.save(output)
    click.echo(hwprofile.describe(profile))
    click.echo(f"wrote {output}")


def main() -> None:
    sys.exit(run_cli(stratac))


if __name__ == "__main__":
    main()
