"""Placement side by side (issue 6): Strata's cost-model plan against the usual hand placements,
at GPU budgets that hold a given share of the expert weights, decode tokens/s measured in one run.

    python benchmarks/placement_bench.py [--work-dir /tmp/place_bench] [--layers 16]
        [--router-skew 0.5] [--budgets 25,50,100] [--quant int4] [--n-new 64] [--hw hw.json] [--tiny] [--disk]
        [--trace-dir DIR] [--json OUT.json] [--only VARIANTS] [--profile VARIANTS] [--device cpu]

Model: the OLMoE-shaped synthetic checkpoint of benchmarks/gpu_decode.py (hidden 2048, 64
experts top-8, expert FFN 1024; --layers to shorten it) with a skewed router
(make_synthetic_model.py --router-skew: router rows scaled by exp(S * N(0,1)), so some experts
win the top-k far more often; the realised skew is measured by calibration and printed: at the
default 0.5 the most popular quarter of the experts takes about 55 % of the routings, at 0
about 40 % (sampling noise of the calibration tokens; 25 % is perfectly even); the embedding
values are of order 1 so that tokens' hidden states differ and routing follows the router). The
tiny-moe tokenizer stands in (ids < 4096 index the synthetic embedding). With --topics D the
model also has topics (make_synthetic_model.py Topics: a generation stays on its topic and each
topic routes to its own 1/D of each layer's experts), so the plan's calibration on mixed text sees
the topics' mixture while one generation uses its own topic's experts.

Variants, each compiled from the same folder at --quant with the same calibration:
  gpu-all        the unplaced plan on xla: the whole model on the GPU (the reference tokens)
  cpu-only       the unplaced plan on llvm: the whole model on the CPU
  ktransformers  --place experts=cpu,all=gpu (every expert on the CPU, the rest on the GPU)
  ngl-B          --place 're:^L(0|..|N-1)\\.=gpu,all=cpu': the first N layers whole on the GPU,
                 N the most that fits the budget B (llama.cpp's -ngl)
  strata-B       --target HW --gpu-mem (the dense weights + B% of the expert bytes + the KV reserve)
  cache-B        the same with --expert-cache: the split layers' GPU shares become expert caches
                 (swaps at run time; hit rate, bytes copied); at the smallest budget also with
                 the caches off, and on the CPU alone (what the no-GPU fallback runs), for the
                 greedy-tokens check
  hot-B, hot-cache-B  (smallest budget) `--place-strategy hot-experts`: the dense parts and every
                 layer's most used experts on the GPU (each layer split), static and with
                 `--expert-cache`: the issue-7 cache measured on a
                 layout that has something to cache, whatever the cost model would choose
  cache-B/cpu-misses  (smallest budget) cache-B with its misses computed on the CPU
                 (strata-run --miss-path cpu) instead of read by the GPU in place
  disk-half      (--disk) --host-mem = the dense weights + half the expert bytes: the rest on the
                 disk tier; its own process, peak RSS reported
Decode: a 32-token prompt, then --n-new greedy tokens, batch 1, the mixed runtime (xla on the
GPU, llvm on the CPU); median of --repeats (and of --rounds: the whole list run that many times
in turn). The prompt is the first of up to 256 random prompts (60 s) whose every greedy step
under gpu-all has a top-1/top-2 gap of at least --clear-gap (0.03) x std(logits), else the
clearest of them (random models have near-ties, where kernels that round differently, the GPU's
bf16 against the CPU's q8 activations, pick different tokens); every variant's tokens are
compared with gpu-all's.
With --check-prompts K, a tokens check besides: K more prompts, each clear by --check-gap (0.05)
over --check-new (16) steps, decoded by every variant (untimed) and compared with gpu-all ("checks":
how many agree). "logit dev": the largest, over the timed prompt's steps, of max |logit - gpu-all's|
/ std(gpu-all's), each variant fed gpu-all's tokens (how far its kernels' rounding moves the
logits); a variant whose tokens part from gpu-all's shows gpu-all's gap at that step, in brackets.
Prints predicted vs measured tokens/s and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.common import log, stratac  # noqa: E402
from benchmarks.gpu_decode import FULL  # noqa: E402

TINY = dict(hidden=256, layers=4, heads=4, kv_heads=4, head_dim=64, experts=16, top_k=4, moe_intermediate=128,
            vocab=4096)


def build_model(work: Path, dims: dict, skew: float, topics: int = 0,
                topic_strength: tuple[float, ...] | None = None) -> Path:
    from benchmarks.make_synthetic_model import make_synthetic_model

    model = work / "model"
    if not (model / "config.json").exists():
        t0 = time.time()
        make_synthetic_model(model, arch="olmoe", router_skew=skew, embed_scale=1.0, topics=topics,
                             topic_strength=topic_strength, **dims)
        shutil.copy(HERE.parent / "examples" / "models" / "tiny-moe" / "tokenizer.json", model / "tokenizer.json")
        log(f"model written in {time.time() - t0:.0f} s")
    return model


def weight_split(plan) -> tuple[int, int]:
    """(bytes of the routed experts, bytes of everything else) of a plan."""
    from strata_compiler.formats import get_format

    ex = rest = 0
    for w in plan.graph.weights:
        n = get_format(w.fmt).nbytes(w.shape, w.group_size or 32)
        if w.experts:
            ex += n
        else:
            rest += n
    return ex, rest


def layer_bytes(plan) -> dict[int, int]:
    from strata_compiler.formats import get_format

    out: dict[int, int] = {}
    for w in plan.graph.weights:
        head = w.name.split(".")[0]
        if head[:1] == "L" and head[1:].isdigit():
            out[int(head[1:])] = out.get(int(head[1:]), 0) + get_format(w.fmt).nbytes(w.shape, w.group_size or 32)
    return out


def peak_rss() -> int:
    """This process's peak resident set (VmHWM, bytes). Not getrusage's ru_maxrss: Linux keeps
    that across fork and exec, so a child started from a big parent reports the parent's size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def decode_rate(plan_dir: Path, prompt: np.ndarray, n_new: int, repeats: int, info: dict | None = None,
                trace_out: Path | None = None, backend: str = "auto",
                device: str = "auto", expert_cache: bool = True, miss_path: str = "auto",
                multi_gpu: str = "mesh", checks: list | None = None, check_new: int = 0,
                forced: list[int] | None = None, ref_logits: str | None = None) -> tuple[float, list[int]]:
    """Decode tokens/s (median of `repeats` after a warm-up pass) and the greedy tokens. With
    `trace_out`, one more pass runs under the tracer (not timed): its trace is written there and
    its per-track busy times go into `info["trace"]`. Untimed extras, into `info`: the greedy
    tokens of each of `checks` (prompts, `check_new` tokens each: "check_tokens"), and with
    `ref_logits` (a .npy path) the logits of a pass fed the tokens `forced` (the reference's):
    where that file does not exist yet, this is the reference — fed its own tokens, it saves them
    there — else they are compared with it: per step, max |logit - reference| / std(reference
    logits) ("logit_dev")."""
    from strata_compiler import trace
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.runtime.session import Session

    s = Session(load_plan(plan_dir, verify_weights="none"), backend, device=device,
                expert_cache=expert_cache, multi_gpu=multi_gpu, miss_path=miss_path)
    times, tokens = [], []
    for r in range(repeats + 1 + (trace_out is not None)):
        traced = trace_out is not None and r == repeats + 1
        if traced:      # the decode steps only: the busy times per token are over the same steps as dt
            s.reset(1, s.capacity_for(prompt.shape[1], n_new))     # (generate's: its programs are compiled)
            tok = int(s.step(prompt)[0, -1].argmax())
            trace.ACTIVE = tracer = trace.Tracer()
            seq = [tok]
            t0 = time.perf_counter()
            for _ in range(n_new - 1):
                tok = int(s.step(np.array([[tok]], np.int64))[0, -1].argmax())
                seq.append(tok)
            dt = time.perf_counter() - t0
        else:           # as strata-run decodes: greedy steps dispatched ahead where the plan allows
            before = s.timings.decode_seconds
            _, new = s.generate(prompt, n_new, Sampler())
            dt = s.timings.decode_seconds - before
            seq = new[0].tolist()
        if traced:
            trace.ACTIVE = None
            tracer.write(trace_out)
            if info is not None:
                info["trace"] = {"wall_s": dt, "busy_s": tracer.busy_seconds(), "spans": dict(tracer.counts),
                                 "bytes": dict(tracer.bytes), "cpu_gpu_overlap_s": tracer.overlap("cpu", "gpu")}
        elif r:                     # the first pass compiles (xla) and warms the caches
            times.append(dt)
        tokens = seq
    if info is not None and checks:
        info["check_tokens"] = []
        for cp in checks:
            cp = np.asarray(cp, np.int64).reshape(1, -1)
            s.reset(1, cp.shape[1] + check_new + 8)
            seq = [int(s.step(cp)[0, -1].argmax())]
            for _ in range(check_new - 1):
                seq.append(int(s.step(np.array([[seq[-1]]], np.int64))[0, -1].argmax()))
            info["check_tokens"].append(seq)
    if info is not None and ref_logits:
        path = Path(ref_logits)
        feed = forced if path.exists() else tokens
        s.reset(1, prompt.shape[1] + len(feed) + 8)
        rows = [s.step(prompt)[0, -1]] + [s.step(np.array([[t]], np.int64))[0, -1] for t in feed[:-1]]
        got = np.stack(rows).astype(np.float32)
        if not path.exists():
            tmp = path.with_name(path.name + ".tmp.npy")
            np.save(tmp, got)
            tmp.replace(path)
        else:
            ref = np.load(path, allow_pickle=False)
            info["logit_dev"] = (np.abs(got - ref).max(axis=1) / ref.std(axis=1)).tolist()
    if info is not None:
        swaps = getattr(s.executor, "swaps", None)      # (a mixed plan's live expert caches)
        caches = swaps.caches if swaps is not None else []
        hits = sum(c.hits for c, *_ in caches)
        miss = sum(c.misses for c, *_ in caches)
        info.update(hit_rate=hits / (hits + miss) if hits + miss else None,
                    cache_bytes=sum(c.bytes_moved for c, *_ in caches),
                    peak_rss=peak_rss())
    return (n_new - 1) / statistics.median(times), tokens


def profile_decode(plan_dir: Path, prompt: np.ndarray, n_new: int, **kw) -> None:
    """Decode n_new tokens after a warm-up pass under cProfile; print the top host functions."""
    import cProfile
    import pstats

    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.session import Session

    s = Session(load_plan(plan_dir, verify_weights="none"), kw.pop("backend"), **kw)
    for profiled in (False, True):
        s.reset(1, prompt.shape[1] + n_new + 8)
        tok = int(s.step(prompt)[0, -1].argmax())
        pr = cProfile.Profile()
        t0 = time.perf_counter()
        if profiled:
            pr.enable()
        for _ in range(n_new - 1):
            tok = int(s.step(np.array([[tok]], np.int64))[0, -1].argmax())
        pr.disable()
    dt = (time.perf_counter() - t0) / (n_new - 1)
    print(f"\nprofile of {plan_dir.name}: {1e3 * dt:.2f} ms per token under cProfile")
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)


PROMPT_TRIES = 256
PROMPT_SECONDS = 60     # and no longer than this


def pick_prompt(plan_dir: Path, n_new: int, backend: str, device: str, clear_gap: float,
                want: int = 1, seed: int = 0) -> tuple[list, int]:
    """Random 32-token prompts (ids < 4096) whose greedy continuation is clear (every step's
    top-1/top-2 logit gap >= clear_gap x the logits' std): the first `want` of PROMPT_TRIES
    (PROMPT_SECONDS at most), else with want=1 the one with the largest smallest gap. Random
    models have near-ties, which would make kernels of different rounding pick different tokens.
    Returns ([(prompt, its smallest gap, the gap of each step)], prompts tried)."""
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.session import Session

    s = Session(load_plan(plan_dir, verify_weights="none"), backend, device=device)
    rng = np.random.default_rng(seed)
    best, best_gap, found = None, -1.0, []
    t0 = time.time()
    for tried in range(1, PROMPT_TRIES + 1):
        prompt = rng.integers(0, 4096, (1, 32)).astype(np.int64)
        s.reset(1, prompt.shape[1] + n_new + 8)
        logits, gaps = s.step(prompt)[0, -1], []
        for _ in range(n_new):
            top2 = np.sort(logits)[-2:]
            gaps.append(float((top2[1] - top2[0]) / logits.std()))
            if gaps[-1] < (clear_gap if want > 1 else min(best_gap, clear_gap)):
                break                               # can neither be clear nor beat the best so far
            logits = s.step(np.array([[int(logits.argmax())]], np.int64))[0, -1]
        gap = min(gaps)
        if gap >= clear_gap and len(gaps) == n_new:
            found.append((prompt, gap, gaps))
        if want == 1 and gap > best_gap and len(gaps) == n_new:
            best, best_gap = (prompt, gap, gaps), gap
        if len(found) >= want or time.time() - t0 > PROMPT_SECONDS:
            break
    return (found or ([best] if want == 1 and best else []))[:want], tried


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/place_bench"))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--router-skew", type=float, default=0.5)
    ap.add_argument("--topics", type=int, default=0,
                    help="give the model D topics (make_synthetic_model.py --topics): text stays on its topic and "
                         "each topic routes to its own share of the experts, so one generation's hot experts "
                         "differ from the calibration's mixture (0: none; the work dir's model is reused as it is)")
    from benchmarks.make_synthetic_model import topic_strength_arg

    ap.add_argument("--topic-strength", type=topic_strength_arg, default=None,
                    help="EMBED,HEAD,ROUTER for --topics (make_synthetic_model.py)")
    ap.add_argument("--budgets", default="25,50,100", help="GPU budgets, as %% of the expert bytes on top of the rest")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--n-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the variant list this many times in turn (A B C A B C ...): each variant's figure is "
                         "the median of its rounds, so drift on a noisy machine hits every variant alike")
    ap.add_argument("--calib-tokens", type=int, default=256,
                    help="calibration tokens (routing frequencies for the cost model); 0: none, experts equally likely")
    ap.add_argument("--hw", type=Path, help="a stratac probe-hw profile (default: measured now; --quick with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="a small model (smoke test on any machine)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--disk", action="store_true", help="also a plan with half the experts on the disk tier")
    ap.add_argument("--trace-dir", type=Path, help="also write a trace of one more decode pass per variant here "
                    "(trace-VARIANT.json) and report busy time per track")
    ap.add_argument("--only", help="comma-separated variants to run, in this order (default: all built)")
    ap.add_argument("--profile", default="", help="comma-separated variants to run once more under cProfile "
                    "(decode steps only): the host functions that take the time, top 25 by own time")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu"],
                    help="where xla partitions run (cpu: JAX's CPU platform stands in for the GPU, for a smoke test)")
    ap.add_argument("--build-only", action="store_true",
                    help="build the model and compile the variants (--only's), then stop: plans for other scripts")
    ap.add_argument("--clear-gap", type=float, default=0.03,
                    help="a prompt is clear when every greedy step's top-1/top-2 gap is >= this x std(logits) "
                         "(on the H200, 2026-11-30, a step with a 0.026 x std gap flipped between the GPU's bf16 "
                         "and the CPU's q8 activations)")
    ap.add_argument("--check-prompts", type=int, default=0,
                    help="the greedy-tokens check: this many more prompts, clear by --check-gap over --check-new "
                         "steps under gpu-all, decoded by every variant (untimed) and compared with gpu-all")
    ap.add_argument("--check-new", type=int, default=16)
    ap.add_argument("--check-gap", type=float, default=0.05)
    ap.add_argument("--in-process", dest="own_process", action="store_false",
                    help="run the variants in this process (default: each in a process of its own, after gpu-all)")
    ap.add_argument("--rate-only", type=Path, help=argparse.SUPPRESS)   # internal: one plan, JSON out
    ap.add_argument("--prompt", help=argparse.SUPPRESS)
    ap.add_argument("--trace-out", type=Path, help=argparse.SUPPRESS)    # internal: --rate-only's trace file
    ap.add_argument("--variant", default="{}", help=argparse.SUPPRESS)   # internal: --rate-only's runtime options
    a = ap.parse_args()
    if a.rounds < 1 or a.repeats < 1:
        ap.error("--rounds and --repeats: give 1 or more")
    if a.rate_only:
        info: dict = {}
        prompt = np.array([[int(t) for t in a.prompt.split(",")]], np.int64)
        v = json.loads(a.variant)
        tps, toks = decode_rate(a.rate_only, prompt, a.n_new, a.repeats, info=info, device=a.device,
                                trace_out=a.trace_out, backend=v.get("backend", "auto"),
                                expert_cache=v.get("expert_cache", True),
                                miss_path=v.get("miss_path", "auto"), checks=v.get("checks"), check_new=v.get("check_new", 0),
                                forced=v.get("forced"), ref_logits=v.get("ref_logits"))
        print(json.dumps({"tok_s": tps, "tokens": toks, "info": info}))
        return 0
    dims = dict(TINY if a.tiny else FULL)
    if a.layers:
        dims["layers"] = a.layers
    a.work_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(a.work_dir, dims, a.router_skew, a.topics, a.topic_strength)
    calib_text = HERE.parent / "examples" / "models" / "tiny-moe" / "calib.txt"
    base = a.work_dir / "base"
    if not (base / "plan.bin").exists():
        t0 = time.time()
        # --no-imatrix: the calibration is for the routing statistics; plain scales quantize ~10x faster
        stratac("compile", str(model), "-o", str(base), "--quant", a.quant,
                *(["--calib", str(calib_text), "--calib-tokens", str(a.calib_tokens), "--no-imatrix"]
                  if a.calib_tokens else []))
        log(f"calibrated and compiled the all-CPU plan in {time.time() - t0:.0f} s")
    hw = a.hw
    if hw is None:
        hw = a.work_dir / "hw.json"
        if not hw.exists():
            # the full probe, as `--target auto` takes: the quick one's rough figures changed the
            # chosen layout between H200 machines (BENCHMARKS.md, 2026-11-30 13:30-14:06)
            stratac("probe-hw", "-o", str(hw), *(["--quick"] if a.tiny else []), "--disk-dir", str(a.work_dir))
    from strata_compiler.passes.place import GPU_RESERVE
    from strata_compiler.runtime.plan import load_plan

    bp = load_plan(base, verify_weights="none")
    experts_b, rest_b = weight_split(bp)
    per_layer = layer_bytes(bp)
    cal = bp.meta.get("calibration") or {"experts": {}}
    freqs = [np.sort(np.asarray(v["freq"]))[::-1] for v in cal["experts"].values()]
    top = float(np.mean([f[: max(1, len(f) // 4)].sum() / f.sum() for f in freqs])) if freqs else float("nan")
    log(f"experts {experts_b / 2**30:.2f} GiB, rest {rest_b / 2**30:.2f} GiB; routing skew: the top 25% of "
        f"experts take {top:.0%} of the routings (uniform: 25%)")
    variants: dict[str, dict] = {"gpu-all": {"dir": base, "gpu_bytes": rest_b + experts_b, "backend": "xla"},
                                 "cpu-only": {"dir": base, "gpu_bytes": 0, "backend": "llvm"}}
    common = ["--quant", a.quant] + (["--calib", str(base / "plan.bin"), "--no-imatrix"] if a.calib_tokens else [])
    keep = set(a.only.split(",")) if a.only else None

    def want(name: str) -> bool:     # compile only what --only runs (the strata-B plans always: sizes)
        return keep is None or any(k == name or k.startswith((name + "/", name + "@")) for k in keep)

    out = a.work_dir / "ktransformers"
    if want("ktransformers") and not (out / "plan.bin").exists():
        stratac("compile", str(model), "-o", str(out), *common, "--place", "experts=cpu,all=gpu")
    variants["ktransformers"] = {"dir": out, "gpu_bytes": rest_b}
    kv_guess = 2 * dims["layers"] * dims["kv_heads"] * dims["head_dim"] * 4 * min(4096, 4096)
    for b in (int(x) for x in a.budgets.split(",")):
        gpu_bytes = rest_b + experts_b * b // 100
        mem = int((gpu_bytes + kv_guess) / (1 - GPU_RESERVE)) + (1 << 20)
        out = a.work_dir / f"strata-{b}"
        if not (out / "plan.bin").exists():
            stratac("compile", str(model), "-o", str(out), *common, "--target", str(hw), "--gpu-mem", str(mem),
                    "--dump-dir", str(out / "dump"), "--dump-after", "place")
        pl = json.loads((out / "dump" / "placement.json").read_text())
        variants[f"strata-{b}"] = {"dir": out, "gpu_bytes": pl["gpu_bytes"], "predicted": pl["predicted_tok_s"],
                                   "candidates": pl["candidates"], "choice": pl["choice"]}
        out = a.work_dir / f"cache-{b}"          # the same budget as a GPU expert cache (issue 7)
        if b < 100 and want(f"cache-{b}") and not (out / "plan.bin").exists():
            stratac("compile", str(model), "-o", str(out), *common, "--target", str(hw), "--gpu-mem", str(mem),
                    "--expert-cache")
        if b < 100:
            variants[f"cache-{b}"] = {"dir": out, "gpu_bytes": pl["gpu_bytes"]}
            if b == min(int(x) for x in a.budgets.split(",")):     # the same plan: cache off,
                variants[f"cache-{b}/no-cache"] = {"dir": out, "gpu_bytes": pl["gpu_bytes"], "expert_cache": False}
                variants[f"cache-{b}/no-gpu"] = {"dir": out, "gpu_bytes": 0, "backend": "llvm"}  # the fallback
                variants[f"cache-{b}/cpu-misses"] = {"dir": out, "gpu_bytes": pl["gpu_bytes"], "miss_path": "cpu"}
        n, used = 0, 0
        while n in per_layer and used + per_layer[n] <= gpu_bytes:
            used += per_layer[n]
            n += 1
        if b == min(int(x) for x in a.budgets.split(",")) and b < 100:
            # every layer split: dense parts and hot experts on the GPU, static and as expert caches
            for name, extra in ((f"hot-{b}", []), (f"hot-cache-{b}", ["--expert-cache"])):
                out = a.work_dir / name
                if want(name) and not (out / "plan.bin").exists():
                    stratac("compile", str(model), "-o", str(out), *common, "--target", str(hw), "--gpu-mem",
                            str(mem), "--place-strategy", "hot-experts", *extra,
                            "--dump-dir", str(out / "dump"), "--dump-after", "place")
                if want(name):
                    hp = json.loads((out / "dump" / "placement.json").read_text())
                    variants[name] = {"dir": out, "gpu_bytes": hp["gpu_bytes"], "predicted": hp["predicted_tok_s"]}
        if b >= 100:            # every layer fits: the same as strata-100's own -ngl candidate
            n = 0
        out = a.work_dir / f"ngl-{b}"
        if n and want(f"ngl-{b}") and not (out / "plan.bin").exists():
            rule = "re:^L(" + "|".join(str(i) for i in range(n)) + r")\.=gpu,all=cpu"
            stratac("compile", str(model), "-o", str(out), *common, "--place", rule)
        if n:
            variants[f"ngl-{b}"] = {"dir": out, "gpu_bytes": used, "layers": n}
    if a.disk:      # half the experts beyond --host-mem: the disk tier (issue 7)
        out = a.work_dir / "disk-half"
        host = rest_b + experts_b // 2
        if want("disk-half") and not (out / "plan.bin").exists():
            stratac("compile", str(model), "-o", str(out), *common, "--target", str(hw), "--gpu-mem", "1MiB",
                    "--host-mem", str(host))
        variants["disk-half"] = {"dir": out, "gpu_bytes": 0, "host_budget": host}
    if keep is not None:
        # gpu-all first (the reference tokens), then in --only's order (interleave A/B pairs);
        # NAME@VAR=VALUE[@VAR=VALUE...]: variant NAME run in a process of its own with those
        # environment variables (runtime switches, XLA_FLAGS), for A/Bs beside the defaults
        for k in a.only.split(","):
            base_name, *sets = k.split("@")
            if sets and base_name in variants:
                env = dict(kv.partition("=")[::2] for kv in sets)
                variants[k] = dict(variants[base_name], env=env)
        variants = {k: variants[k] for k in ["gpu-all"] + [k for k in a.only.split(",") if k != "gpu-all"]
                    if k in variants}
    if a.build_only:
        for k, v in variants.items():
            print(f"{k:24} {v['dir']}")
        return 0
    ref_backend = variants["gpu-all"].get("backend", "auto")
    [(prompt, gap, ref_gaps)], tried = pick_prompt(base, a.n_new, ref_backend, a.device, a.clear_gap)
    log(f"prompt: {'clear' if gap >= a.clear_gap else 'not clear'} after {tried} random 32-token prompts: smallest "
        f"top-1/top-2 gap over its {a.n_new} greedy steps {gap:.3f} x std(logits) (clear: >= {a.clear_gap})")
    checks = []
    if a.check_prompts:
        # the tokens check: more prompts, shorter continuations, a wider gap (the timed prompt's 48
        # steps rarely all clear 0.03 x std; the GPU's and CPU's kernels round differently)
        found, tried = pick_prompt(base, a.check_new, ref_backend, a.device, a.check_gap, want=a.check_prompts, seed=1)
        checks = [p[0][0].tolist() for p in found]
        log(f"tokens check: {len(checks)} prompts of {tried} tried clear {a.check_gap} x std over {a.check_new} steps")
    ref_logits = a.work_dir / "ref_logits.npy"
    ref_logits.unlink(missing_ok=True)
    ref_tokens, ref_checks = None, None
    if a.trace_dir:
        a.trace_dir.mkdir(parents=True, exist_ok=True)

    def save_json() -> None:        # after every variant, so a run cut short still leaves its figures
        if a.json:
            tmp = a.json.with_name(a.json.name + ".tmp")
            tmp.write_text(json.dumps({"dims": dims, "skew_top25": top, "topics": a.topics,
                                       "topic_strength": a.topic_strength, "variants": {
                k: {kk: (str(vv) if isinstance(vv, Path) else vv) for kk, vv in v.items()}
                for k, v in variants.items()}}, indent=1))
            tmp.replace(a.json)

    for rnd, (name, v) in ((r, kv) for r in range(a.rounds) for kv in variants.items()):
        # --rounds N: the whole list N times in turn; a variant's figure is the median of its rounds
        t0 = time.time()
        first = rnd == 0
        # untimed, in the first round: the check prompts, and the logits along gpu-all's tokens
        # (gpu-all saves them, the others are compared with them)
        extras = dict(checks=checks, check_new=a.check_new, forced=ref_tokens, ref_logits=str(ref_logits))
        tr = a.trace_dir / f"trace-{re.sub(r'[^A-Za-z0-9._-]+', '-', name)}.json" if a.trace_dir and first else None
        if name == "disk-half" or "env" in v or (a.own_process and name != "gpu-all"):
            # its own process: peak RSS is per process; env at start; and no earlier variant's
            # session still holding memory and threads (on the H200, 2026-11-30, the main process's
            # peak RSS grew from 13 to 50 GiB over six variants, and later ones ran slower)
            env = dict(os.environ, **v.get("env", {}))
            r = subprocess.run([sys.executable, __file__, "--rate-only", str(v["dir"]), "--n-new", str(a.n_new),
                                "--repeats", str(a.repeats), "--prompt", ",".join(map(str, prompt[0].tolist()))]
                               + (["--trace-out", str(tr)] if tr else []) + ["--device", a.device]
                               + ["--variant", json.dumps({**{k: v[k] for k in ("backend", "expert_cache",
                                                                                "miss_path") if k in v},
                                                           **(extras if first else {})})],
                               capture_output=True, text=True, env=env)
            if r.returncode != 0:           # one failed A/B variant does not end the run
                log(f"{name} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
                got = {"info": {"failed": True}, "tok_s": float("nan"), "tokens": []}
            else:
                got = json.loads(r.stdout.strip().splitlines()[-1])
            v.update(got["info"])
            tps, toks = got["tok_s"], got["tokens"]
        else:
            tps, toks = decode_rate(v["dir"], prompt, a.n_new, a.repeats, info=v, trace_out=tr,
                                    backend=v.get("backend", "auto"), device=a.device,
                                    expert_cache=v.get("expert_cache", True),
                                    miss_path=v.get("miss_path", "auto"), **(extras if first else {}))
        v.setdefault("tok_s_rounds", []).append(tps)
        v["tok_s"] = statistics.median(v["tok_s_rounds"])
        if first:
            ref_tokens = ref_tokens or toks
            if checks and "check_tokens" in v:
                ref_checks = ref_checks or v["check_tokens"]
                v["check_same"] = sum(x == y for x, y in zip(v["check_tokens"], ref_checks))
            if toks != ref_tokens and len(toks) == len(ref_tokens):
                i = next(i for i, (x, y) in enumerate(zip(toks, ref_tokens)) if x != y)
                v["gap_at_divergence"] = ref_gaps[i] if i < len(ref_gaps) else None
            v["tokens"] = toks
            v["same_tokens"] = toks == ref_tokens
            v["same_prefix"] = next((i for i, (x, y) in enumerate(zip(toks, ref_tokens)) if x != y), len(toks))
        elif toks != v["tokens"]:
            v["same_tokens"] = False        # a later round that leaves the first round's tokens counts too
        busy = ""
        if "trace" in v and first:
            t = v["trace"]
            busy = "; traced pass " + ", ".join(f"{k} {1e3 * b / (a.n_new - 1):.2f} ms/tok"
                                                for k, b in t["busy_s"].items()) + \
                f" of {1e3 * t['wall_s'] / (a.n_new - 1):.2f} ms/tok; cpu and gpu busy at once " \
                f"{1e3 * t.get('cpu_gpu_overlap_s', 0.0) / (a.n_new - 1):.2f} ms/tok"
        rtag = f" (round {rnd + 1} of {a.rounds})" if a.rounds > 1 else ""
        log(f"{name}{rtag}: {tps:.1f} tok/s ({time.time() - t0:.0f} s){busy}")
        if first and name in a.profile.split(","):
            profile_decode(v["dir"], prompt, a.n_new, backend=v.get("backend", "auto"), device=a.device,
                           expert_cache=v.get("expert_cache", True))
        save_json()
    print(f"\nmodel {dims}, {a.quant}; experts {experts_b / 2**30:.2f} GiB, rest {rest_b / 2**30:.2f} GiB; "
          f"router skew {a.router_skew}: top 25% of experts take {top:.0%} of routings"
          + (f"; {a.topics} topics (strength {','.join(map(str, a.topic_strength)) if a.topic_strength else 'default'})"
             if a.topics else ""))
    print(f"{'variant':24} {'GPU GiB':>8} {'measured tok/s':>15} {'predicted':>10} {'pred/meas':>9} "
          f"{'same tokens':>11} {'hit rate':>8} {'copied MiB':>10} {'logit dev':>9} {'checks':>6}")
    for name, v in variants.items():
        pred = v.get("predicted")
        hr = v.get("hit_rate")
        same = "yes" if v["same_tokens"] else f"{v['same_prefix']}/{a.n_new}"
        if v.get("gap_at_divergence") is not None:      # gpu-all's own margin at the step that differs
            same += f" ({v['gap_at_divergence']:.3f})"
        dev = max(v["logit_dev"]) if v.get("logit_dev") else float("nan")
        chk = f"{v['check_same']}/{len(checks)}" if "check_same" in v else "-"
        print(f"{name:24} {v['gpu_bytes'] / 2**30:8.2f} {v['tok_s']:15.1f} {pred or float('nan'):10.1f} "
              f"{(pred / v['tok_s']) if pred else float('nan'):9.2f} {same:>11} "
              f"{'-' if hr is None else f'{hr:.1%}':>8} "
              f"{v.get('cache_bytes', 0) / 2**20:10.1f} {dev:9.4f} {chk:>6}")
    if "disk-half" in variants:
        v = variants["disk-half"]
        print(f"disk-half: host budget {v['host_budget'] / 2**20:.0f} MiB, peak RSS {v['peak_rss'] / 2**20:.0f} MiB "
              f"(of which the interpreter and libraries: see the cpu-only row's process), {v['tok_s']:.1f} tok/s")
    suffixes = [""] + sorted({k[k.index("@"):] for k in variants if "@" in k})
    for b in (int(x) for x in a.budgets.split(",")):
        for sfx in suffixes:        # the defaults, then each environment the variants were also run in
            s = variants.get(f"strata-{b}{sfx}")
            if not s or "tok_s" not in s:
                continue
            k = variants.get(f"ktransformers{sfx}", {}).get("tok_s")
            g = variants.get(f"ngl-{b}{sfx}", {}).get("tok_s")
            cch = variants.get(f"cache-{b}{sfx}", {}).get("tok_s")
            parts = ([f"strata / ktransformers x{s['tok_s'] / k:.2f}"] if k else []) + \
                ([f"strata / ngl x{s['tok_s'] / g:.2f}"] if g else []) + \
                ([f"cache / static strata x{cch / s['tok_s']:.2f}"] if cch else [])
            print(f"budget {b}%{sfx}: " + ", ".join(parts) + f"  (choice: {s['choice']})")
            if not sfx:
                print("   predicted candidates: " + ", ".join(f"{c} {t:.0f}" for c, t in s["candidates"].items()))
    save_json()
    return 0


if __name__ == "__main__":
    sys.exit(main())
