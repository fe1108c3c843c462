"""Decode and prefill throughput of Strata beside llama.cpp, in one run, on one model folder.

    python benchmarks/decode_vs_llamacpp.py [--model-dir DIR] [--work-dir /tmp/llamacpp_bench]
        [--widths int4,int8] [--n-new 128] [--prompt-len 32] [--prefill-len 512] [--threads 2]
        [--repeats 3] [--wait-idle SECONDS] [--skip-strata] [--skip-llamacpp] [--json OUT.json]

Needs (benchmark-only, not the product's dependencies): llama-cpp-python built from source, and
for the conversion torch, transformers, sentencepiece, protobuf and gguf.

The model is a synthetic Mixtral-architecture HF folder (benchmarks/make_mixtral_model.py;
built into WORK_DIR/mixtral-5b when --model-dir is not given or does not exist yet): hidden 2048,
16 layers, 16 query / 8 KV heads of 128, 8 experts top-2 with expert FFN 5632, SentencePiece
vocabulary of 3038 pieces -> 4.64 B total, 1.32 B active parameters per token, 9.3 GB bf16.

llama.cpp side (llama-cpp-python): the folder is converted with llama.cpp's own
convert_hf_to_gguf.py (from the llama-cpp-python sdist of the installed version, fetched into
WORK_DIR/sdist if needed) to a bf16 GGUF, which `llama_model_quantize` (the C API) turns into
Q4_0 and Q8_0 files, all cached in WORK_DIR/gguf and rebuilt only when missing or older than the
model folder. llama.cpp's own Q4_0 recipe keeps output.weight at Q6_K and, for 8-expert models,
attn_k/attn_v at Q8_0 (~1 % of the active weights); Q8_0 is Q8_0 throughout. The model is
loaded with use_mmap and, by default, use_extra_bufts=True (llama.cpp's default: CPU weight
repacking into its interleaved AVX2 layouts; --llamacpp-extra-bufts off disables it, the
workaround for the AMX crash of builds with GGML AMX on).

Strata side: `stratac compile DIR -o WORK_DIR/strata-<width> --quant <width>` (skipped when
plan.bin is newer than the folder), run through the Python API (`strata_measure`) with the llvm
backend and STRATA_NUM_THREADS=--threads; if that backend raises, the table says so.

Widths pair up as int4 <-> Q4_0 and int8 <-> Q8_0 (blocks of 32 weights with one scale each).

Measurements (batch 1, --threads threads in each engine, greedy, identical random prompt token
ids for both engines, each engine/width in its own fresh process):
  decode   prefill a --prompt-len prompt (timed separately: "prompt"), then --n-new single-token
           decode steps, each one forward pass + argmax of the last logits; decode tok/s =
           n_new / time of those steps.
  prefill  one forward pass over a --prefill-len prompt; tok/s = prefill_len / time.
One untimed warm-up of each shape comes first, then --repeats timed runs.

Noise: on a 2-core machine anyone else's work wrecks these numbers (llama.cpp's spinning thread
barrier is hit hardest: a busy core can cut its decode rate 10x). Each timed run records how
much CPU other processes used meanwhile (/proc/stat minus this process); the table reports the
median over the runs where that stayed below --clean-below cores (all runs if none did) with
the min-max of all runs, and --wait-idle makes each run wait for a quiet moment first. The JSON
keeps every run. Compare figures from one run.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.metadata
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
WIDTHS = {"int4": "Q4_0", "int8": "Q8_0"}
LLAMA_FTYPES = {"Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _load_sibling(name: str):
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod


def newest_mtime(folder: Path) -> float:
    return max(p.stat().st_mtime for p in Path(folder).iterdir() if p.is_file())


def is_fresh(path: Path, source_dir: Path) -> bool:
    return path.exists() and path.stat().st_mtime >= newest_mtime(source_dir)


def run_in_child(fn, *args, env: dict | None = None, **kwargs):
    """fn(*args, **kwargs) in a fresh spawned process (own thread pools, nothing left behind)."""
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})  # a spawned child inherits the parent's environment at start
    try:
        with cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as ex:
            return ex.submit(fn, *args, **kwargs).result()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def summarize(runs: list[float]) -> float | None:
    runs = [r for r in runs if r]
    return statistics.median(runs) if runs else None


# ----------------------------------------------------------------------------- noise

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_stat() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, steal seconds) since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return 0.0, 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = v
    return (user + nice + system + irq + softirq) / _HZ, steal / _HZ


class CpuMeter:
    """CPU used by *other* processes (in cores) and hypervisor steal while a block runs.

    foreign = (machine busy CPU time - this process's CPU time) / wall time; on this 2-core box
    anything much above 0 means the timing is contaminated by someone else's work."""

    def __enter__(self):
        self.t = time.perf_counter()
        self.busy, self.steal = _proc_stat()
        ot = os.times()
        self.own = ot.user + ot.system
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t
        busy, steal = _proc_stat()
        ot = os.times()
        own = ot.user + ot.system - self.own
        self.wall = wall
        self.foreign = max(0.0, (busy - self.busy - own) / wall) if wall > 0 else 0.0
        self.steal_cores = (steal - self.steal) / wall if wall > 0 else 0.0
        return False

    def as_dict(self) -> dict:
        return {"foreign_cores": round(self.foreign, 3), "steal_cores": round(self.steal_cores, 3)}


def wait_for_idle(max_wait_s: float, threshold_cores: float = 0.2, window_s: float = 2.0) -> float:
    """Sleep until other processes use < threshold_cores over a window_s window (or max_wait_s
    passes); returns the seconds waited. max_wait_s <= 0 does not wait."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait_s:
        b0, _ = _proc_stat()
        time.sleep(window_s)
        b1, _ = _proc_stat()
        if (b1 - b0) / window_s < threshold_cores:
            break
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- model


def ensure_model(model_dir: Path, a) -> Path:
    if (model_dir / "config.json").exists():
        return model_dir
    mmm = _load_sibling("make_mixtral_model")
    log(f"building the synthetic Mixtral folder {model_dir} ...")
    t0 = time.perf_counter()
    s = mmm.make_mixtral_model(model_dir, hidden=a.hidden, layers=a.layers, experts=a.experts,
                               top_k=a.top_k, ffn=a.ffn, heads=a.heads, kv_heads=a.kv_heads)
    print(mmm.describe(s))
    log(f"model folder written in {time.perf_counter() - t0:.1f} s")
    return model_dir


def model_summary(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    mmm = _load_sibling("make_mixtral_model")
    msm = mmm.msm
    d = msm.Dims(hidden=cfg["hidden_size"], vocab=cfg["vocab_size"], heads=cfg["num_attention_heads"],
                 kv_heads=cfg["num_key_value_heads"],
                 head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                 experts=cfg["num_local_experts"], moe_intermediate=cfg["intermediate_size"],
                 top_k=cfg["num_experts_per_tok"], layers=cfg["num_hidden_layers"])
    return {"dir": str(model_dir), "dims": d.__dict__, "params": mmm.param_counts(d),
            "dtype": cfg.get("dtype") or cfg.get("torch_dtype")}


# ----------------------------------------------------------------------------- llama.cpp


def find_convert_script(work_dir: Path, given: Path | None) -> Path:
    """convert_hf_to_gguf.py from the llama-cpp-python sdist of the installed version."""
    if given:
        return given
    ver = _version("llama_cpp_python")
    if ver is None:  # not installed (yet): any unpacked sdist will do for converting
        found = sorted((work_dir / "sdist").glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
        if found:
            return found[-1]
        raise SystemExit("llama-cpp-python is not installed; pip install llama-cpp-python (see --help)")
    root = work_dir / "sdist" / f"llama_cpp_python-{ver}"
    script = root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    if script.exists():
        return script
    sdist_dir = work_dir / "sdist"
    tgz = sdist_dir / f"llama_cpp_python-{ver}.tar.gz"
    if not tgz.exists():
        log(f"fetching the llama-cpp-python {ver} sdist for convert_hf_to_gguf.py ...")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={ver}", "-d", str(sdist_dir)], check=True)
    with tarfile.open(tgz) as tf:
        tf.extractall(sdist_dir, filter="data")
    if not script.exists():
        raise SystemExit(f"{script}: not in the llama-cpp-python {ver} sdist")
    return script


def convert_to_gguf(model_dir: Path, out: Path, script: Path, outtype: str = "bf16") -> float:
    """llama.cpp's convert_hf_to_gguf.py (uses its vendored gguf-py); returns seconds taken."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    log(f"converting {model_dir} -> {out} ({outtype}) with {script} ...")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(script), str(model_dir), "--outfile", str(tmp),
                    "--outtype", outtype], check=True)
    tmp.replace(out)
    dt = time.perf_counter() - t0
    log(f"converted in {dt:.1f} s ({out.stat().st_size / 1e9:.2f} GB)")
    return dt


def _import_llama_cpp(verbose: bool = False):
    import llama_cpp
    from llama_cpp import _logger

    _logger.set_verbose(verbose)   # llama.cpp's own log goes through this logger's level
    return llama_cpp


def _quantize_child(src: str, dst: str, qtype: str, nthread: int, verbose: bool = False) -> int:
    L = _import_llama_cpp(verbose)
    L.llama_backend_init()
    p = L.llama_model_quantize_default_params()
    p.ftype = getattr(L, LLAMA_FTYPES[qtype])
    p.nthread = nthread
    return int(L.llama_model_quantize(src.encode(), dst.encode(), p))


def quantize_gguf(src: Path, dst: Path, qtype: str, nthread: int = 0, verbose: bool = False) -> float:
    tmp = dst.with_name(dst.name + ".part")
    log(f"quantizing {src.name} -> {dst.name} ({qtype}) ...")
    t0 = time.perf_counter()
    rc = run_in_child(_quantize_child, str(src), str(tmp), qtype, nthread, verbose)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({src}, {qtype}) returned {rc}")
    tmp.replace(dst)
    dt = time.perf_counter() - t0
    log(f"quantized in {dt:.1f} s ({dst.stat().st_size / 1e9:.2f} GB)")
    return dt


def prepare_gguf(model_dir: Path, work_dir: Path, widths: list[str], script: Path | None,
                 verbose: bool = False) -> tuple[dict, dict]:
    """{width: gguf path} (converted/quantized as needed) and {step: seconds} for steps run."""
    gdir = work_dir / "gguf"
    steps: dict[str, float] = {}
    src = gdir / "model-bf16.gguf"
    if not is_fresh(src, model_dir):
        steps["convert_bf16"] = convert_to_gguf(model_dir, src, find_convert_script(work_dir, script))
    out = {}
    for w in widths:
        q = WIDTHS[w]
        dst = gdir / f"model-{q}.gguf"
        if not (dst.exists() and dst.stat().st_mtime >= src.stat().st_mtime):
            steps[f"quantize_{q}"] = quantize_gguf(src, dst, q, verbose=verbose)
        out[w] = dst
    return out, steps


def llamacpp_measure(gguf: str, decode_prompt: list[int], n_new: int, prefill_prompt: list[int],
                     threads: int, repeats: int, extra_bufts: bool, n_ctx: int, verbose: bool = False,
                     wait_idle_s: float = 0.0) -> dict:
    """Decode / prefill tok/s of one GGUF with llama-cpp-python's low-level (C) API."""
    import ctypes

    L = _import_llama_cpp(verbose)
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mparams.use_mmap = True
    has_extra = "use_extra_bufts" in dict(L.llama_model_params._fields_)
    if has_extra:
        mparams.use_extra_bufts = extra_bufts
    t0 = time.perf_counter()
    model = L.llama_model_load_from_file(gguf.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama_model_load_from_file({gguf}) failed")
    cparams = L.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = max(512, len(prefill_prompt), len(decode_prompt))
    cparams.n_ubatch = cparams.n_batch
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    cparams.no_perf = False
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    load_s = time.perf_counter() - t0
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    mem = L.llama_get_memory(ctx)

    def decode(tokens: list[int]) -> None:
        arr = (L.llama_token * len(tokens))(*tokens)
        rc = L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tokens)))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax_last() -> int:
        ptr = L.llama_get_logits_ith(ctx, -1)   # synchronizes
        return int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax())

    def decode_run(n: int) -> dict:
        waited = wait_for_idle(wait_idle_s)
        L.llama_memory_clear(mem, True)
        L.llama_perf_context_reset(ctx)
        with CpuMeter() as m:
            t0 = time.perf_counter()
            decode(decode_prompt)
            tok = argmax_last()
            t1 = time.perf_counter()
            out, steps = [], []
            for _ in range(n):
                ts = time.perf_counter()
                decode([tok])
                tok = argmax_last()
                steps.append(time.perf_counter() - ts)
                out.append(tok)
            t2 = time.perf_counter()
        perf = L.llama_perf_context(ctx)
        return {"prompt_tok_s": len(decode_prompt) / (t1 - t0), "decode_tok_s": n / (t2 - t1) if n else 0.0,
                "decode_s": t2 - t1, "perf_eval_tok_s": perf.n_eval * 1e3 / perf.t_eval_ms if perf.t_eval_ms else None,
                # 1 / median step time: robust to a burst of someone else's work during the run
                "decode_tok_s_median_step": 1.0 / statistics.median(steps) if steps else None,
                "waited_s": round(waited, 1), **m.as_dict(), "tokens": out[:16]}

    def prefill_run() -> dict:
        waited = wait_for_idle(wait_idle_s)
        L.llama_memory_clear(mem, True)
        with CpuMeter() as m:
            t0 = time.perf_counter()
            decode(prefill_prompt)
            L.llama_synchronize(ctx)
            argmax_last()
            dt = time.perf_counter() - t0
        return {"prefill_tok_s": len(prefill_prompt) / dt, "prefill_s": dt, "waited_s": round(waited, 1),
                **m.as_dict()}

    decode_run(min(n_new, 4))        # warm-up (graph allocation, page faults of the mmap)
    prefill_run()
    runs_d = [decode_run(n_new) for _ in range(repeats)]
    runs_p = [prefill_run() for _ in range(repeats)]
    info = ctypes.string_at(L.llama_print_system_info()).decode(errors="replace")
    flash = getattr(cparams, "flash_attn_type", None)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return {
        "engine": "llama.cpp", "file": gguf, "load_s": load_s,
        "decode_tok_s": summarize([r["decode_tok_s"] for r in runs_d]),
        "prompt_tok_s": summarize([r["prompt_tok_s"] for r in runs_d]),
        "prefill_tok_s": summarize([r["prefill_tok_s"] for r in runs_p]),
        "decode_tok_s_median_step": summarize([r["decode_tok_s_median_step"] for r in runs_d]),
        "decode_runs": runs_d, "prefill_runs": runs_p,
        "settings": {"n_threads": threads, "n_threads_batch": threads, "n_ctx": n_ctx,
                     "n_batch": int(cparams.n_batch), "use_mmap": True,
                     "use_extra_bufts": extra_bufts if has_extra else "n/a",
                     "flash_attn_type": None if flash is None else int(flash)},
        "system_info": info.strip(),
    }


# ----------------------------------------------------------------------------- Strata


def stratac_compile(model_dir: Path, plan_dir: Path, width: str) -> float | None:
    """`stratac compile` unless plan.bin is newer than the folder; seconds taken (None: cached)."""
    if is_fresh(plan_dir / "plan.bin", model_dir) and (plan_dir / "weights.bin").exists():
        return None
    log(f"stratac compile {model_dir} -o {plan_dir} --quant {width} ...")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import sys; from strata_compiler.cli import main; "
                    "sys.argv[0] = 'stratac'; main()", "compile", str(model_dir), "-o", str(plan_dir),
                    "--quant", width], check=True)
    dt = time.perf_counter() - t0
    log(f"compiled in {dt:.1f} s")
    return dt


def strata_measure(plan_dir, prompt_ids, n_new: int, *, backend: str = "llvm", repeats: int = 1,
                   warmup: bool = True, wait_idle_s: float = 0.0) -> dict:
    """Prefill and decode tok/s of a Strata plan, batch 1, greedy, through the Python API.

    prompt_ids: int token ids [T] or [1, T]. n_new decode steps are timed (generate() is asked
    for n_new + 1 tokens: the first comes from the prompt's logits); n_new = 0 measures prefill
    only. Returns medians over `repeats` runs (after one untimed warm-up of the same shapes,
    which also absorbs any JIT compilation) and every run. Raises whatever Session raises when
    the backend is unavailable."""
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.runtime.session import Session, Timings

    prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(1, -1)
    plan = load_plan(plan_dir)
    session = Session(plan, backend)

    def once(n: int, wait: float = 0.0) -> dict:
        waited = wait_for_idle(wait)
        session.timings = Timings()
        with CpuMeter() as m:
            t0 = time.perf_counter()
            _, new = session.generate(prompt, n + 1 if n else 0, Sampler(), ())
            wall = time.perf_counter() - t0
        prefill, decode = session.timings.rates()
        return {"prefill_tok_s": prefill, "decode_tok_s": decode, "wall_s": wall,
                "decode_steps": session.timings.decode_tokens, "waited_s": round(waited, 1), **m.as_dict(),
                "tokens": new[0, :16].tolist()}

    if warmup:
        once(min(n_new, 4))
    runs = [once(n_new, wait_idle_s) for _ in range(repeats)]
    return {"engine": "strata", "plan": str(plan_dir), "backend": session.backend,
            "prefill_tok_s": summarize([r["prefill_tok_s"] for r in runs]),
            "decode_tok_s": summarize([r["decode_tok_s"] for r in runs]) if n_new else None,
            "runs": runs}


def _strata_child(plan_dir: str, decode_prompt: list[int], n_new: int, prefill_prompt: list[int],
                  repeats: int, backend: str, wait_idle_s: float = 0.0) -> dict:
    d = strata_measure(plan_dir, decode_prompt, n_new, backend=backend, repeats=repeats, wait_idle_s=wait_idle_s)
    p = strata_measure(plan_dir, prefill_prompt, 0, backend=backend, repeats=repeats, wait_idle_s=wait_idle_s)
    return {"engine": "strata", "plan": plan_dir, "backend": d["backend"],
            "decode_tok_s": d["decode_tok_s"], "prompt_tok_s": d["prefill_tok_s"],
            "prefill_tok_s": p["prefill_tok_s"], "decode_runs": d["runs"], "prefill_runs": p["runs"],
            "settings": {"STRATA_NUM_THREADS": os.environ.get("STRATA_NUM_THREADS")}}


# ----------------------------------------------------------------------------- report


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


MEASURES = (("decode_tok_s", "decode_runs"), ("prompt_tok_s", "decode_runs"), ("prefill_tok_s", "prefill_runs"))


def finalize(r: dict, clean_below: float) -> dict:
    """Medians over the 'clean' timed runs: those during which other processes used less than
    clean_below cores (all runs when none was clean). The plain medians stay as *_all_runs."""
    for key, runs_key in MEASURES:
        runs = r.get(runs_key) or []
        src = "prefill_tok_s" if key == "prompt_tok_s" else key   # strata's prompt rate is its prefill rate
        vals = [(x.get(key, x.get(src)), x.get("foreign_cores", 0.0)) for x in runs]
        vals = [(v, f) for v, f in vals if v]
        if not vals:
            continue
        clean = [v for v, f in vals if f < clean_below]
        r[key + "_all_runs"] = summarize([v for v, _ in vals])
        r[key] = summarize(clean or [v for v, _ in vals])
        r.setdefault("clean_runs", {})[runs_key.split("_")[0]] = f"{len(clean)}/{len(vals)}"
    return r


def _cell(r: dict, key: str, runs_key: str, spec: str) -> str:
    """median, with the [min-max] of the runs and how many were clean when there are several."""
    vals = [x[key] for x in r.get(runs_key, []) if x.get(key)]
    med = fmt(r.get(key), spec)
    if len(vals) > 1:
        med += f" [{format(min(vals), spec)}-{format(max(vals), spec)}]"
        clean = r.get("clean_runs", {}).get(runs_key.split("_")[0])
        if clean:
            med += f" {clean}"
    return med


def print_table(rows: list[dict]) -> None:
    by = {(r["engine"], r["width"]): r for r in rows}
    hdr = ("engine", "width", "decode tok/s", "prompt tok/s", "prefill tok/s", "other load",
           "strata/llama.cpp")
    table, errors = [], []
    for r in rows:
        width = r["width"] if r["engine"] == "strata" else f"{r['width']} ({WIDTHS[r['width']]})"
        if r.get("error"):
            errors.append((r["engine"], width, r["error"]))
            continue
        ratio = ""
        ref = by.get(("llama.cpp", r["width"]))
        if r["engine"] == "strata" and ref and not ref.get("error"):
            parts = [f"{k} {r[k + '_tok_s'] / ref[k + '_tok_s']:.2f}x" for k in ("decode", "prefill")
                     if r.get(k + "_tok_s") and ref.get(k + "_tok_s")]
            ratio = ", ".join(parts)
        foreign = [x.get("foreign_cores", 0.0) for k in ("decode_runs", "prefill_runs") for x in r.get(k, [])]
        table.append((r["engine"], width, _cell(r, "decode_tok_s", "decode_runs", ".2f"),
                      fmt(r.get("prompt_tok_s"), ".1f"), _cell(r, "prefill_tok_s", "prefill_runs", ".1f"),
                      f"<= {max(foreign):.2f} cores" if foreign else "-", ratio))
    w = [max([len(hdr[i])] + [len(t[i]) for t in table]) for i in range(len(hdr))]
    w[0] = max([w[0]] + [len(e[0]) for e in errors])
    w[1] = max([w[1]] + [len(e[1]) for e in errors])
    print("  ".join(h.ljust(w[i]) for i, h in enumerate(hdr)).rstrip())
    for t in table:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(t)).rstrip())
    for e in errors:
        print(f"{e[0].ljust(w[0])}  {e[1].ljust(w[1])}  {e[2]}")
    if table:
        print("(median of the clean timed runs [min-max of all] clean/all; a run is clean when other "
              "processes used < --clean-below cores during it; 'other load': the most they used in any run)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, help="HF folder (default WORK_DIR/mixtral-5b, built if missing)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/llamacpp_bench"))
    ap.add_argument("--widths", default="int4,int8")
    ap.add_argument("--n-new", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median reported)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids")
    ap.add_argument("--skip-strata", action="store_true")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--strata-backend", default="llvm")
    ap.add_argument("--llamacpp-extra-bufts", choices=("on", "off"), default="on",
                    help="llama_model_params.use_extra_bufts (CPU weight repacking, e.g. Q4_0 -> "
                         "interleaved AVX2 layout); 'off' was the workaround for the AMX crash of "
                         "builds with GGML AMX on")
    ap.add_argument("--convert-script", type=Path, help="llama.cpp's convert_hf_to_gguf.py "
                    "(default: from the installed llama-cpp-python's sdist, fetched into WORK_DIR/sdist)")
    ap.add_argument("--json", type=Path, help="write all results here")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's own log")
    ap.add_argument("--clean-below", type=float, default=0.1, metavar="CORES",
                    help="medians use only the runs during which other processes used less CPU than this "
                         "(all runs when none did); the JSON keeps every run and the plain medians")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                    help="before each timed run, wait up to this long for other processes to use < 0.2 "
                         "cores (the JSON records each run's foreign CPU load either way)")
    g = ap.add_argument_group("model shape, used only when the folder is built")
    for flag, default in (("hidden", 2048), ("layers", 16), ("experts", 8), ("top-k", 2), ("ffn", 5632),
                          ("heads", 16), ("kv-heads", 8)):
        g.add_argument(f"--{flag}", type=int, default=default)
    a = ap.parse_args(argv)

    widths = [w.strip() for w in a.widths.split(",") if w.strip()]
    for w in widths:
        if w not in WIDTHS:
            raise SystemExit(f"--widths: {w!r} is not one of {', '.join(WIDTHS)}")
    a.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model(a.model_dir or a.work_dir / "mixtral-5b", a)
    model = model_summary(model_dir)
    vocab = model["dims"]["vocab"]
    rng = np.random.default_rng(a.seed)
    decode_prompt = rng.integers(3, vocab, a.prompt_len).tolist()     # 0-2: <unk> <s> </s>
    prefill_prompt = rng.integers(3, vocab, a.prefill_len).tolist()
    n_ctx = max(1024, a.prompt_len + a.n_new + 1, a.prefill_len)
    p = model["params"]
    print(f"model {model_dir}: {p['total'] / 1e9:.2f} B params, {p['active'] / 1e9:.2f} B active/token; "
          f"batch 1, {a.threads} threads, decode {a.n_new} tokens after {a.prompt_len}, prefill "
          f"{a.prefill_len}; median of {a.repeats}", flush=True)

    rows: list[dict] = []
    steps: dict[str, float] = {}
    if not a.skip_llamacpp:
        ggufs, st = prepare_gguf(model_dir, a.work_dir, widths, a.convert_script, a.verbose)
        steps.update(st)
        for w in widths:
            log(f"llama.cpp {WIDTHS[w]}: measuring ...")
            t0 = time.perf_counter()
            try:
                r = run_in_child(llamacpp_measure, str(ggufs[w]), decode_prompt, a.n_new, prefill_prompt,
                                 a.threads, a.repeats, a.llamacpp_extra_bufts == "on", n_ctx, a.verbose,
                                 a.wait_idle)
            except Exception as e:  # noqa: BLE001 - report and go on with the other width/engine
                r = {"engine": "llama.cpp", "error": f"llama.cpp: failed ({type(e).__name__}: {e})"}
            steps[f"measure_llamacpp_{w}"] = time.perf_counter() - t0
            r["width"] = w
            r["loadavg_1m_after"] = os.getloadavg()[0]
            rows.append(finalize(r, a.clean_below))
            log(f"llama.cpp {WIDTHS[w]}: decode {fmt(r.get('decode_tok_s'))} tok/s, "
                f"prefill {fmt(r.get('prefill_tok_s'), '.1f')} tok/s")
    if not a.skip_strata:
        for w in widths:
            plan_dir = a.work_dir / f"strata-{w}"
            r = {"engine": "strata", "width": w}
            try:
                dt = stratac_compile(model_dir, plan_dir, w)
                if dt is not None:
                    steps[f"stratac_compile_{w}"] = dt
            except subprocess.CalledProcessError as e:
                r["error"] = f"strata: compile failed (exit {e.returncode})"
                rows.append(r)
                continue
            log(f"strata {w}: measuring ...")
            t0 = time.perf_counter()
            try:
                r.update(run_in_child(_strata_child, str(plan_dir), decode_prompt, a.n_new, prefill_prompt,
                                      a.repeats, a.strata_backend, a.wait_idle,
                                      env={"STRATA_NUM_THREADS": str(a.threads)}))
            except Exception as e:  # noqa: BLE001 - the llvm backend may not be built yet
                why = str(e).splitlines()[0] if str(e) else type(e).__name__
                r["error"] = f"strata: {a.strata_backend} backend unavailable ({type(e).__name__}: {why})"
            steps[f"measure_strata_{w}"] = time.perf_counter() - t0
            r["loadavg_1m_after"] = os.getloadavg()[0]
            rows.append(finalize(r, a.clean_below))
    print()
    print_table(rows)
    if a.json:
        out = {
            "model": model,
            "settings": {"batch": 1, "threads": a.threads, "n_new": a.n_new, "prompt_len": a.prompt_len,
                         "prefill_len": a.prefill_len, "repeats": a.repeats, "seed": a.seed, "n_ctx": n_ctx},
            "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                     "llama_cpp_python": _version("llama_cpp_python"), "date": time.strftime("%Y-%m-%d %H:%M:%S")},
            "steps_s": steps,
            "results": rows,
        }
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
        print(f"\nwrote {a.json}")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
