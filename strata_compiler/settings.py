"""Every setting of Strata, declared once: name, type, default, allowed values, one line of help and
where it applies.

A value comes from, first found: an override made in this process (a test: `override`), the
environment variable STRATA_<NAME>, the declared default. A setting with a `flag` is also the
command-line option `option` makes for every command that has it: the flag given comes first. It is
parsed here and nowhere else; a bad value is one UsageError naming the variable. Product code
reads the environment only through this module (tests/test_settings.py enforces it), and
docs/settings.md is generated from this table (`python -m strata_compiler.settings`).

`user` settings are the few a user may need (README lists them); the rest are tuning constants and
debugging aids, overridable for experiments and listed in docs/settings.md.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterator

from .errors import UsageError

PREFIX = "STRATA_"
_OFF = ("0", "off", "false", "no")
_ON = ("1", "on", "true", "yes")


@dataclass(frozen=True)
class Setting:
    """One declared setting. kind: bool | int | float | choice | pow2s | tune | floats | path | str.
    `pow2s`, `tune` and `floats` are comma-separated tuples of `length` values (`tune`: a GPU
    kernel's powers of two, then its pipeline stages, any whole number; `floats` with length 2 also
    takes one value, used for both). `min_open`: `minimum` itself is refused (a number above it);
    `unset`: what a default of None or "" means, as docs/settings.md and an error line show it."""

    name: str
    kind: str
    default: Any
    help: str
    where: str
    choices: tuple[str, ...] = ()
    length: int = 1
    minimum: float | None = None
    user: bool = False
    flag: str | None = None         # the command-line option that sets it, e.g. "--max-batch" (see `option`)
    maximum: float | None = None
    min_open: bool = False
    unset: str = "auto"

    @property
    def env(self) -> str:
        return PREFIX + self.name.upper()

    def parse(self, raw: str) -> Any:
        """`raw` (an environment value or a flag's text) as this setting's value, else UsageError."""
        text = raw.strip()
        low = text.lower()
        bad = f"{self.env}={raw!r}: {self.expects()} (default {self.shown_default()})"
        if self.kind == "bool":
            if low in _ON or low in _OFF:
                return low in _ON
            raise UsageError(bad)
        if self.kind == "choice":
            if low in self.choices:
                return low
            raise UsageError(bad)
        if self.kind in ("path", "str"):
            if "\0" in text:
                raise UsageError(bad)
            return Path(text).expanduser() if self.kind == "path" else text
        try:
            if self.kind == "int":
                vals = (int(text),)
            elif self.kind == "float":
                vals = (float(text),)
            else:
                vals = tuple((int if self.kind in ("pow2s", "tune") else float)(v) for v in text.split(","))
        except ValueError:
            raise UsageError(bad) from None
        if self.kind == "floats" and self.length == 2 and len(vals) == 1:
            vals = vals * 2
        ok = len(vals) == (1 if self.kind in ("int", "float") else self.length)
        ok = ok and all(v == v and abs(v) < 1e12 for v in vals)          # no nan, no inf
        if self.minimum is not None:
            ok = ok and all(v > self.minimum if self.min_open else v >= self.minimum for v in vals)
        if self.maximum is not None:
            ok = ok and all(v <= self.maximum for v in vals)
        if self.kind in ("pow2s", "tune"):
            ok = ok and all(v > 0 and v & (v - 1) == 0 for v in (vals[:-1] if self.kind == "tune" else vals))
            ok = ok and vals[-1] > 0
        if not ok:
            raise UsageError(bad)
        return vals[0] if self.kind in ("int", "float") else vals

    def expects(self) -> str:
        n = self.length
        lo, hi, gt = self.minimum, self.maximum, ">" if self.min_open else ">="
        bound = (f" {gt} {lo:g} and <= {hi:g}" if self.min_open and hi is not None else
                 f" from {lo:g} to {hi:g}" if lo is not None and hi is not None else f" {gt} {lo:g}" if lo is not None
                 else f" <= {hi:g}" if hi is not None else "")
        return {
            "bool": "give 1 or 0",
            "choice": "give one of " + ", ".join(self.choices),
            "int": "give a whole number" + bound,
            "float": "give a number" + bound,
            "pow2s": "give a power of two" if n == 1 else f"give {n} comma-separated powers of two",
            "tune": f"give {n} comma-separated whole numbers, powers of two but the last (pipeline stages)",
            "floats": f"give {n} comma-separated numbers" + (f" >= {self.minimum:g}" if self.minimum is not None else ""),
            "path": "give a path",
            "str": "give a string",
        }[self.kind]

    def shown_default(self) -> str:
        d = self.default
        if d is None or d == "":
            return self.unset
        if isinstance(d, bool):
            return "1" if d else "0"
        if isinstance(d, tuple):
            return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in d)
        return f"{d:g}" if isinstance(d, float) else str(d)


# `stratac compile --quant`: auto, then every weight format (formats.FORMATS, which this module may
# not import; tests/test_cli_settings.py checks the two agree)
QUANT_CHOICES = ("auto", "f32", "bf16", "int8", "int4", "int4a", "int3", "int2", "fp8")


def _s(name: str, kind: str, default: Any, where: str, help: str, **kw: Any) -> Setting:
    return Setting(name, kind, default, help, where, **kw)


# One line each. `where`: cli | compile | llvm | xla | runtime | tests, or the commands (and the
# Python API) whose option it is. A setting with a `flag` is that option of every command that has it.
SETTINGS: tuple[Setting, ...] = (
    # -- for users (README) ------------------------------------------------------------------
    _s("num_threads", "int", None, "llvm", "CPU threads of the llvm kernels (default: every CPU this process may use)",
       minimum=1, user=True),
    _s("cache_dir", "path", None, "llvm, xla",
       "compiled-kernel and XLA caches (default: $XDG_CACHE_HOME/strata, else ~/.cache/strata)", user=True),
    _s("debug", "bool", False, "every command", "show Python tracebacks for errors", user=True, flag="--debug"),
    _s("cpu_features", "choice", "", "llvm", "avx2 forces the AVX2 code path on an AVX-512 CPU (default: what this CPU has)",
       choices=("avx2", "native"), user=True),
    _s("cpu_act", "choice", "q16", "llvm",
       "activations against int8/int4/int4a weights: q16 (blocks of 32 as two planes of int8 codes, about 15 bits, "
       "on integer dot products), q8 (one plane, as llama.cpp: faster prefill, KL ~3e-3 on a real model), "
       "or f32 (exact, slowest)",
       choices=("q16", "q8", "f32"), user=True),
    _s("xla_compute", "choice", "bf16", "xla", "compute type of non-f32 weights on a GPU: bf16, or f32 (exact, slower)",
       choices=("bf16", "f32"), user=True),
    _s("compile_threads", "int", None, "compile", "threads that quantize weights (default: every usable CPU)",
       minimum=1, user=True),
    # -- tuning constants and debugging aids (docs/settings.md) -------------------------------
    _s("gpu_preallocate", "bool", False, "xla",
       "let JAX reserve 75 % of the GPU's memory when it starts (its default; on a 141 GB GPU that costs ~1.4 s of "
       "start-up), instead of growing its pool as arrays need (XLA_PYTHON_CLIENT_PREALLOCATE, if set, wins)"),
    _s("gpu_mem_limit", "str", "", "runtime",
       "bytes of GPU memory the expert caches may assume free, e.g. 2GiB (default: what the device reports)"),
    _s("pool_split", "int", None, "llvm",
       "chunks per thread of a CPU kernel's parallel loop (default: 1 in all-CPU plans, 4 beside a GPU)", minimum=1),
    _s("hand_off_spin_us", "floats", (30.0, 30.0), "runtime",
       "idle CPU workers' spin and yield microseconds in plans that hand off to the GPU (US or SPIN,YIELD)",
       length=2, minimum=0),
    _s("fused_spin_us", "floats", (100.0, 1000.0), "runtime",
       "idle CPU workers' spin and yield microseconds between a fused step's host calls (US or SPIN,YIELD)",
       length=2, minimum=0),
    _s("stream_prefill_tokens", "int", None, "runtime",
       "prefill steps of at least this many tokens run a mixed plan's CPU-placed experts on the GPU, "
       "their weights copied there partition by partition (0: never; default: the break-even the plan's "
       "placement predicted, `stratac inspect` shows it, else 128)", minimum=0),
    _s("swap_margin", "float", 1.0, "runtime",
       "expert cache: uses by which a missed expert must beat the weakest resident before it is swapped in",
       minimum=0),
    _s("cache_swaps", "int", 1, "runtime", "expert cache: copies per cached layer per step after a miss (0 keeps the planned slots)",
       minimum=0),
    _s("xla_executables", "bool", True, "xla",
       "keep each compiled JAX program of a plan in the cache directory, so a later process runs it without "
       "tracing or compiling it (backends/xla/aot.py)"),
    _s("pallas", "choice", "auto", "xla",
       "decode kernels: auto (Pallas on a GPU), off (XLA's reductions only), interpret (Pallas interpret mode anywhere: tests)",
       choices=("auto", "off", "interpret")),
    _s("pallas_attn", "choice", "auto", "xla",
       "decode attention as one Pallas kernel: auto (caches of at most 512 rows), on, off",
       choices=("auto", "on", "off")),
    _s("pallas_max_rows", "pow2s", (16,), "xla", "tokens per step up to which the MoE runs on the Pallas kernels"),
    _s("pallas_linear_rows", "pow2s", (4,), "xla", "tokens per step up to which dense int4 projections run on the Pallas kernel"),
    _s("pallas_tune", "pow2s", (32, 4, 4, 4), "xla", "MoE kernels: rows per program and warps of gate_up, down (bn1,bn2,w1,w2)",
       length=4),
    _s("pallas_linear_tune", "pow2s", (32, 8), "xla", "dense int4 kernel: rows per program, warps", length=2),
    _s("pallas_gemm_tune", "tune", (64, 128, 4, 4, 3), "xla",
       "many-row kernels: most rows and columns per program, groups per step, warps, pipeline stages", length=5),
    _s("pallas_gemm_bf16_tune", "tune", (128, 128, 2, 8, 4), "xla",
       "many-row kernels over experts dequantized first: as pallas_gemm_tune (groups of 32 per step)", length=5),
    _s("pallas_dense_tune", "pow2s", (2, 4), "xla", "router kernel: rows per program, warps", length=2),
    _s("pallas_flash_tune", "tune", (128, 64, 8, 3), "xla",
       "prefill attention kernel: query rows per block, key rows per step, warps, pipeline stages", length=4),
    _s("pallas_attn_tune", "pow2s", (64, 4, 256), "xla", "attention kernel: rows per block, warps, rows per split",
       length=3),
    _s("template_timeout", "float", 5.0, "compile, runtime",
       "seconds a chat template may take to render (the check at compile time, each chat prompt at run time) "
       "before its worker process is killed and the template refused (strata_compiler/template_sandbox.py)",
       minimum=0.01),
    _s("template_memory", "int", 1024, "compile, runtime",
       "MiB of address space of the process that renders chat templates (RLIMIT_AS; Python and jinja2 take ~25 of them); "
       "a template that needs more is refused", minimum=64),
    _s("raw_copy", "choice", "auto", "runtime",
       "hand-offs between xla and CPU partitions: auto (raw cudaMemcpy on a GPU), host (raw copies on JAX's CPU platform: tests)",
       choices=("auto", "host")),
    # -- command-line options (`flag`), declared once for every command that has them ---------------
    _s("backend", "choice", "auto", "strata-run, strata-server, stratac compile, stratac eval, API",
       "where kernels run: auto runs a placed plan (--target, --place) as placed and any other on the best "
       "available backend (xla on a GPU, else llvm); a name runs every op there",
       choices=("auto", "reference", "llvm", "xla"), flag="--backend"),
    _s("device", "choice", "auto", "strata-run, strata-server, API",
       "where xla partitions run: auto = a CUDA GPU when JAX sees one, else JAX's CPU platform",
       choices=("auto", "gpu", "cpu"), flag="--device"),
    _s("ctx", "int", None, "strata-server, API",
       "context length per sequence (prompt + generated tokens); the KV cache holds --max-batch of them. Default: "
       "the model's, as far as the KV cache of --max-batch of them fits in half the memory available (the same "
       "as strata-run --chat and the Python API)", minimum=2, flag="--ctx"),
    _s("max_batch", "int", 8, "strata-server, API",
       "sequences decoded together (each its own KV row of --ctx positions); more requests wait",
       minimum=1, maximum=256, flag="--max-batch"),
    _s("prefill_chunk", "int", 256, "strata-server, API; strata-run (default auto there)",
       "prompt tokens prefilled between two decode steps: running streams wait at most one chunk",
       minimum=1, maximum=8192, flag="--prefill-chunk"),
    _s("queue_size", "int", 64, "strata-server, API",
       "requests that may wait; beyond it the server answers 429",
       minimum=1, flag="--queue-size"),
    _s("decode_steps", "int", 8, "strata-server, API",
       "decode steps per device dispatch of the batch (xla, a whole plan on one device) while no request waits to "
       "be admitted and each has that many tokens left: the host's launch then counts once per that many tokens "
       "(1: one step a dispatch)", minimum=1, maximum=64),
    _s("eval_ctx", "int", 512, "stratac eval", "tokens per chunk; the second half of each chunk is scored",
       flag="--ctx"),
    # -- the options of one command each (where a flag names two settings, each command's own) ------
    _s("quant", "choice", "auto", "stratac compile",
       "storage format of the linear layers' weights (embeddings, norms, biases and routers stay f32). auto: a GGUF "
       "file's own (Q4_0 and Q8_0 kept bit for bit as int4 and int8, K-quants as the nearest format at least as "
       "precise, BF16 as bf16, the embedding table too); f32 for a Hugging Face folder",
       choices=QUANT_CHOICES, flag="--quant"),
    _s("group_size", "int", 32, "stratac compile",
       "values per quantization scale of grouped formats (even; int3/fp8 need multiples of 8, int2 of 4)",
       flag="--group-size"),
    _s("calib_tokens", "int", 16384, "stratac compile", "use at most this many tokens of --calib text",
       minimum=2, flag="--calib-tokens"),
    _s("imatrix", "bool", True, "stratac compile",
       "with --calib and --quant: weight each quantization scale by the activations (the importance search tries 18 "
       "scales per group). --no-imatrix uses the plain scale rule, several times faster on large models, and keeps "
       "--calib for the routing statistics (placement, clustering)", flag="--imatrix"),
    _s("bits", "float", None, "stratac compile",
       "layer-adaptive quantization: a format per tensor (int2 ... bf16) minimising the measured error, at B bits per "
       "weight on average over the linear layers and the embedding table (scales included). Best with --calib. "
       "Replaces --quant", minimum=2.0, maximum=16.0, unset="none", flag="--bits"),
    _s("memory_budget", "str", "", "stratac compile",
       "layer-adaptive quantization within SIZE bytes of weights in all (e.g. 800MiB); replaces --quant",
       unset="none", flag="--memory-budget"),
    _s("tensor_format", "str", "", "stratac compile",
       "per-weight format overrides, applied last: REGEX=FORMAT,... on weight names as `stratac inspect` shows them, "
       "first match wins (e.g. 'L0\\.=int8,moe.down=int4')", unset="none", flag="--tensor-format"),
    _s("dump_after", "str", "all", "stratac compile", "passes to dump after: 'all' or a comma-separated list of pass names",
       flag="--dump-after"),
    _s("stop_after", "str", None, "stratac compile",
       "stop the pipeline after this pass (no plan is written unless it is 'emit')", unset="none", flag="--stop-after"),
    _s("place", "str", "", "stratac compile",
       "manual placement, first match wins: CATEGORY=gpu|cpu or re:REGEX=gpu|cpu, comma-separated (categories: embed, "
       "attention, router, experts, shared, dense, head, all), e.g. 'experts=cpu,all=gpu'. gpu ops run on xla, cpu "
       "ops on the CPU backend", unset="none", flag="--place"),
    _s("target", "str", "", "stratac compile",
       "place ops and experts on the GPU or the CPU with the cost model, for this machine (auto: measured once with "
       "the full probe and cached per host) or the one a `stratac probe-hw` profile describes",
       unset="none", flag="--target"),
    _s("gpu_mem", "str", "", "stratac compile", "with --target: plan for this much GPU memory (e.g. 16GiB)",
       unset="the profile's", flag="--gpu-mem"),
    _s("host_mem", "str", "", "stratac compile",
       "with --target: plan for this much host RAM; experts beyond it go to the disk tier",
       unset="the profile's", flag="--host-mem"),
    _s("gpus", "int", 1, "stratac compile", "with --target: the machine has this many of the profile's GPU (each with "
       "--gpu-mem)", minimum=1, flag="--gpus"),
    _s("place_strategy", "choice", "auto", "stratac compile",
       "with --target: auto = the layout the cost model predicts fastest (refined by a local search); or one of its "
       "candidates as it is: cpu (everything on the CPU), greedy (units by time saved per GPU byte), ktransformers "
       "(dense parts on the GPU, experts on the CPU), hot-experts (dense parts and the most used experts of every "
       "layer on the GPU; with --expert-cache those become caches), ngl (whole layers from the first, llama.cpp's "
       "-ngl)", choices=("auto", "cpu", "greedy", "ktransformers", "hot-experts", "ngl"), flag="--place-strategy"),
    _s("gpu_mode", "choice", "auto", "stratac compile",
       "with --gpus > 1: layer = each GPU a contiguous block of layers; stripe = each layer's GPU experts dealt over "
       "all GPUs by popularity, the dense parts on GPU 0; auto = the one the cost model predicts faster (it prices "
       "each hop between GPUs: a partition switch plus the activation's trip through host memory)",
       choices=("auto", "layer", "stripe"), flag="--gpu-mode"),
    _s("compile_expert_cache", "bool", False, "stratac compile",
       "with --target: layers whose experts the placement splits get a GPU expert cache instead of a static split: "
       "slots first holding the placed experts, the whole layer on the CPU, and strata-run swapping experts into "
       "the slots as routing shifts", flag="--expert-cache"),
    _s("inspect_weights", "bool", True, "stratac inspect", "list every weight with its format", flag="--weights"),
    _s("eval_chunks", "int", None, "stratac eval", "evaluate at most this many chunks (default all)",
       minimum=1, unset="all", flag="--chunks"),
    _s("probe_quick", "bool", False, "stratac probe-hw", "small sizes and few repetitions: seconds, rough figures",
       flag="--quick"),
    _s("probe_disk_dir", "path", None, "stratac probe-hw", "measure the read bandwidth of the filesystem holding DIR "
       "(default: the output file's directory)", flag="--disk-dir"),
    _s("probe_disk_size", "str", "", "stratac probe-hw",
       "size of the disk test file (default 256MiB, 16MiB with --quick)", flag="--disk-size"),
    _s("max_new_tokens", "int", 32, "strata-run",
       "tokens to generate after the prompt (fewer if every sequence reaches EOS)", minimum=0, flag="--max-new-tokens"),
    _s("temperature", "float", None, "strata-run",
       "sampling temperature; 0 is greedy (exact argmax, no repeat penalty unless given). "
       "[default: the model's, else 0.8; every sampling default: docs/sampling.md]",
       minimum=0, unset="the model's", flag="--temperature"),
    _s("top_p", "float", None, "strata-run", "nucleus sampling: keep the most likely tokens whose probabilities sum to "
       "this (1: off). [default: the model's, else 0.95]",
       minimum=0, maximum=1, min_open=True, unset="the model's", flag="--top-p"),
    _s("top_k", "int", None, "strata-run",
       "sample among the k most likely tokens only (0: off). [default: the model's, else 40]",
       minimum=0, unset="the model's", flag="--top-k"),
    _s("min_p", "float", None, "strata-run", "drop tokens less likely than this fraction of the most likely one "
       "(0: off). [default: the model's, else 0.05]", minimum=0, maximum=1, unset="the model's", flag="--min-p"),
    _s("repeat_penalty", "float", None, "strata-run",
       "penalise tokens among the last --repeat-last-n of the prompt and output: a positive logit is divided by this, "
       "a negative one multiplied (1: off). [default: the model's, else 1.1; none with --greedy / --temperature 0 "
       "unless given]", minimum=0, min_open=True, unset="the model's", flag="--repeat-penalty"),
    _s("repeat_last_n", "int", None, "strata-run",
       "the repeat penalty's window of tokens (-1: all, 0: off). [default: the model's, else 64]",
       minimum=-1, unset="the model's", flag="--repeat-last-n"),
    _s("seed", "int", 0, "strata-run", "seed of the sampler", minimum=0, flag="--seed"),
    _s("ignore_eos", "bool", False, "strata-run", "keep generating past end-of-sequence tokens", flag="--ignore-eos"),
    _s("echo", "bool", False, "strata-run", "print the prompt before the generated text", flag="--echo"),
    _s("stats", "bool", False, "strata-run", "print busy time per device, bytes moved per link and the expert caches' "
       "hit rate after the run", flag="--stats"),
    _s("expert_cache", "bool", True, "strata-run",
       "swap experts into the GPU slots of layers compiled with --expert-cache as routing shifts (off: the plan's "
       "split stays static)", flag="--expert-cache"),
    _s("miss_path", "choice", "auto", "strata-run",
       "with an expert cache: where a missed expert computes. gpu: the GPU reads its weights from host memory in "
       "place (page-locked, over PCIe) and the whole layer runs on the GPU, no host call; cpu: the plan's CPU share "
       "computes it (two host calls per cached layer and token); auto: gpu on a CUDA GPU unless experts stream from "
       "disk (--host-mem plans), else cpu", choices=("auto", "cpu", "gpu"), flag="--miss-path"),
    _s("cache_policy", "choice", "hybrid", "strata-run",
       "expert cache replacement: decayed use counts plus recency (hybrid), or least recently used",
       choices=("hybrid", "lru"), flag="--cache-policy"),
    _s("multi_gpu", "choice", "mesh", "strata-run",
       "a plan striped over several GPUs (--gpus N --gpu-mode stripe): one sharded computation over a device mesh, "
       "the shares joined by an all-reduce (mesh), or one partition per GPU driven from the host (host)",
       choices=("mesh", "host"), flag="--multi-gpu"),
    _s("coordinator", "str", None, "strata-run",
       "several hosts: the address of process 0's coordinator; start the same command on every host with "
       "--num-processes and its own --process-id (runtime/distributed.py). The plan must be striped over the GPUs of "
       "all hosts (stratac compile --gpus N --gpu-mode stripe)", unset="none", flag="--coordinator"),
    _s("num_processes", "int", None, "strata-run", "with --coordinator: how many hosts", minimum=1, unset="none",
       flag="--num-processes"),
    _s("process_id", "int", None, "strata-run", "with --coordinator: this host's index (0 prints the output)",
       minimum=0, unset="none", flag="--process-id"),
    _s("host", "str", "127.0.0.1", "strata-server", "address to bind (0.0.0.0 serves other machines too)",
       flag="--host"),
    _s("port", "int", 8080, "strata-server", "TCP port to listen on", minimum=0, maximum=65535, flag="--port"),
    _s("prompt_cache", "int", 1024, "strata-server",
       "host memory for the KV of prompts seen (a shared system prompt, earlier chat turns), reused by later requests "
       "that start with them; 0 turns it off", minimum=0, flag="--prompt-cache"),
    _s("kv_cache_dir", "path", None, "strata-server",
       "keep the prompt cache in this folder across restarts (written at shutdown, read at start)",
       unset="none", flag="--kv-cache-dir"),
    _s("api_key", "str", None, "strata-server", "require `Authorization: Bearer KEY` on every endpoint but /health",
       unset="none", flag="--api-key"),
    _s("model_name", "str", None, "strata-server", "the model id /v1/models reports. Default: the plan's folder name",
       unset="the plan's folder name", flag="--model-name"),
    _s("log_level", "choice", "info", "strata-server", "uvicorn's log level",
       choices=("critical", "error", "warning", "info", "debug"), flag="--log-level"),
)

_BY_NAME = {s.name: s for s in SETTINGS}
_BY_ENV = {s.env: s for s in SETTINGS}
_OVERRIDES: dict[str, Any] = {}


def declared(name: str) -> Setting:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"setting {name!r} is not declared in strata_compiler/settings.py") from None


def names() -> list[str]:
    """Every declared setting's name."""
    return list(_BY_NAME)


def get(name: str) -> Any:
    """The value of setting `name`: an override, else STRATA_<NAME> parsed, else the default."""
    return _lookup(declared(name))[1]


def _lookup(s: Setting) -> tuple[bool, Any]:
    """(given, value): an override or STRATA_<NAME> (parsed by `s`, a command's variant of the
    declaration where `option` made one) is given; else the default."""
    if s.name in _OVERRIDES:
        return True, _OVERRIDES[s.name]
    raw = os.environ.get(s.env)
    if raw is None or raw.strip() == "":
        return False, s.default
    return True, s.parse(raw)


def set_value(name: str, value: Any) -> None:
    """Override `name` for this process (a CLI flag); a string is parsed as the variable would be."""
    s = declared(name)
    _OVERRIDES[name] = s.parse(value) if isinstance(value, str) else value


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Settings overridden inside a with-block (tests, A/B runs in one process)."""
    old = {k: _OVERRIDES[k] for k in values if k in _OVERRIDES}
    try:
        for k, v in values.items():
            set_value(k, v)
        yield
    finally:
        for k in values:
            _OVERRIDES.pop(k, None)
        _OVERRIDES.update(old)


_FIELDS = {f.name for f in fields(Setting)} - {"name", "kind", "flag"}


def option(name: str, *decls: str, **overrides: Any) -> Any:
    """The click option of setting `name`: its flag (and any `decls`, e.g. a short "-n", listed
    first), type, default and help from the declaration, the help naming STRATA_<NAME>. `overrides`:
    a declared field changed for one command (default, help, minimum, maximum), else a click
    argument (metavar, callback, a narrower click type).

    Its value: the flag given, else the command's --config file (click's default map), else an
    override or STRATA_<NAME>, else the default; a bad variable is one UsageError naming it."""
    import click

    s = declared(name)
    if s.flag is None or s.kind not in ("bool", "choice", "int", "float", "path", "str"):
        raise KeyError(f"setting {name!r} has no flag (or a kind no flag can take)")
    s = replace(s, **{k: overrides.pop(k) for k in list(overrides) if k in _FIELDS})
    kw: dict[str, Any] = dict(cls=_option_class(), setting=s, default=s.default, envvar=s.env, show_envvar=True,
                              show_default=s.default not in (None, "", False),
                              help=s.help[:1].upper() + s.help[1:] + ("" if s.help.endswith((".", "]")) else "."))
    flag = s.flag
    if s.kind == "bool":
        kw["is_flag"] = True
        if s.default:
            flag = f"{s.flag}/--no-{s.flag[2:]}"
    elif s.kind == "choice":
        kw["type"] = click.Choice(s.choices)
    elif s.kind in ("int", "float"):
        rng = click.IntRange if s.kind == "int" else click.FloatRange
        kw["type"] = rng(s.minimum, s.maximum, min_open=s.min_open) if (s.minimum, s.maximum) != (None, None) \
            else (click.INT if s.kind == "int" else click.FLOAT)
    elif s.kind == "path":
        kw["type"] = click.Path(path_type=Path)
    kw.update(overrides)
    return click.option(*(d for d in decls if not d.startswith("--")), flag, *(d for d in decls if d.startswith("--")),
                        **kw)


@functools.cache
def _option_class() -> type:
    """click.Option reading the registry, not the environment, for a value the command line did not give."""
    import click
    from click.core import ParameterSource

    class SettingOption(click.Option):
        def __init__(self, *args: Any, setting: Setting, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self.setting = setting

        def resolve_envvar_value(self, ctx: click.Context) -> None:
            return None     # `envvar` is set for --help's "[env var: ...]" only; consume_value reads it

        def value_from_envvar(self, ctx: click.Context) -> None:
            return None

        def consume_value(self, ctx: click.Context, opts: Any) -> tuple[Any, Any]:
            value, source = super().consume_value(ctx, opts)
            if source == ParameterSource.DEFAULT:
                given, setting_value = _lookup(self.setting)
                if given:
                    return setting_value, ParameterSource.ENVIRONMENT
            return value, source

        def get_error_hint(self, ctx: click.Context | None) -> str:
            """The flag, naming STRATA_<NAME> only where the bad value came from it."""
            if ctx is not None and ctx.get_parameter_source(self.name) == ParameterSource.ENVIRONMENT:
                return super().get_error_hint(ctx)
            return click.Parameter.get_error_hint(self, ctx)

    return SettingOption


def is_setting_option(param: Any) -> bool:
    """Whether a click parameter was made by `option` (tests/test_cli_settings.py)."""
    return isinstance(param, _option_class())


def cache_root() -> Path:
    """Where compiled kernels and XLA executables are cached."""
    d = get("cache_dir")
    if d is not None:
        return Path(d)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "strata"


def environ(key: str, default: str | None = None) -> str | None:
    """A process environment variable that is not Strata's (e.g. XLA_FLAGS, TMPDIR)."""
    if key.startswith(PREFIX):
        raise KeyError(f"{key}: read Strata's settings with settings.get")
    return os.environ.get(key, default)


def jax_client_env() -> None:
    """Set what JAX's GPU client reads from the environment when it starts, from these settings:
    no 75 % reservation of the device's memory unless `gpu_preallocate` (a value the user put in
    XLA_PYTHON_CLIENT_PREALLOCATE is left alone)."""
    if "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ and not get("gpu_preallocate"):
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"


def markdown() -> str:
    """The reference table of docs/settings.md."""
    lines = [
        "# Settings",
        "",
        "Generated from `strata_compiler/settings.py` by `python -m strata_compiler.settings > docs/settings.md`;",
        "a test fails when this file and the registry differ. Each setting is read from the environment",
        "variable shown. One with a flag is that option of every command that has it (and, where it",
        "applies to the API, `strata.load`'s keyword of the same name): the flag given wins (or",
        "strata-server's --config file), then the variable, then the default. Every option of the",
        "commands that carries a setting is here; those that do not (input and output files, the prompt,",
        "modes such as --chat or --json) are listed with the reason in tests/test_cli_settings.py. README",
        "lists the ones a user may need; the others are tuning constants and debugging aids for experiments.",
        "",
        "| variable | flag | type | default | applies to | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for s in sorted(SETTINGS, key=lambda s: (not s.user, s.name)):
        kind = "one of " + "\\|".join(s.choices) if s.kind == "choice" else s.kind
        flag = f"`{s.flag}`" if s.flag else ""
        lines.append(f"| `{s.env}` | {flag} | {kind} | `{s.shown_default()}` | {s.where} | {s.help.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":      # pragma: no cover - exercised through tests/test_settings.py
    sys.stdout.write(markdown())
