"""Decode and prefill throughput of the xla backend on a GPU, against the memory roofline.

    python benchmarks/gpu_decode.py [--work-dir /tmp/gpu_bench] [--formats int4,bf16]
        [--batches 1,16] [--prefill 512,2048] [--n-new 128] [--json OUT] [--tiny]

Builds (once) a synthetic OLMoE-shaped model: hidden 2048, 16 layers, 16 heads of 128, 64
experts top-8 with expert FFN 1024, vocab 50304 — about 7 B total and 1.3 B active parameters —
compiles it at each format, and measures on the first GPU JAX sees (JAX-CPU with --tiny, for a
smoke test):

  decode   after a 32-token prompt, --n-new greedy tokens generated in one XLA computation (the
           step captured in a device-side loop: no host round trip per token); tok/s = B * n / time.
  prefill  one forward pass over the prompt; tok/s = B * T / time.
  roofline the bytes one batch-1 decode step must read (every non-expert weight, one embedding
           row, top_k of E experts per layer, the KV cache) divided by the device's copy
           bandwidth measured in the same run (y = x * a over 2 GiB: read + write).
Each figure is the median of --repeats timed runs after one untimed warm-up of the same shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))   # run from a checkout, installed or not

from benchmarks.common import env_set, log, median_seconds  # noqa: E402

FULL = dict(hidden=2048, layers=16, heads=16, kv_heads=16, head_dim=128, experts=64, top_k=8, moe_intermediate=1024,
            vocab=50304)
TINY = dict(hidden=256, layers=2, heads=4, kv_heads=4, head_dim=64, experts=8, top_k=2, moe_intermediate=128,
            vocab=1000)


def build(work: Path, dims: dict, formats: list[str]) -> dict[str, Path]:
    model = work / "model"
    if not (model / "config.json").exists():
        args = [sys.executable, str(HERE / "make_synthetic_model.py"), str(model), "--arch", "olmoe"]
        for k, v in dims.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        t0 = time.time()
        subprocess.run(args, check=True)
        log(f"model written in {time.time() - t0:.0f} s")
    plans = {}
    for fmt in formats:
        out = work / f"plan-{fmt}"
        if not (out / "plan.bin").exists():
            t0 = time.time()
            subprocess.run([sys.executable, "-m", "strata_compiler.cli", "compile", str(model), "-o", str(out),
                            "--quant", fmt, "--backend", "reference"], check=True)
            log(f"compiled {fmt} in {time.time() - t0:.0f} s")
        plans[fmt] = out
    return plans


def copy_bandwidth(jax, jnp, dev) -> float:
    x = jax.device_put(jnp.ones((1 << 29,), jnp.float32), dev)     # 2 GiB
    f = jax.jit(lambda x: x * 1.0001)
    f(x).block_until_ready()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / statistics.median(times) / 1e9


def decode_bytes(plan, dims: dict, context: int) -> int:
    """Bytes one batch-1 decode step reads: packed weights it touches plus the KV cache."""
    from strata_compiler.formats import get_format

    total = 0
    for w in plan.graph.weights:
        nbytes = get_format(w.fmt).nbytes(w.shape, w.group_size or 32)
        if w.name == "embed":
            nbytes //= w.shape[0]
        elif w.experts:
            nbytes = nbytes * dims["top_k"] // w.experts
        total += nbytes
    kv = 2 * dims["layers"] * dims["kv_heads"] * dims["head_dim"] * 4 * context
    return total + kv


def ab(exe, decode, a, fmt: str, B: int = 1) -> list[dict]:
    """Batch-B decode with each setting of a.ab, the settings alternated twice (A B C A B C), each
    run a fresh trace and compile of the decode loop (the switch is read while tracing)."""
    import jax

    name, values = ab_settings(a.ab)
    got: dict[str, list[float]] = {v: [] for v in values}
    try:
        for setting in values * 2:
            with env_set(name, setting):
                exe._loop = jax.jit(lambda *args: exe._ahead_chunk(*args), static_argnums=(5,), donate_argnums=(1, 2))
                decode()                       # compile
                secs = []
                for _ in range(a.repeats):
                    decode()
                    secs.append(decode.seconds)
            got[setting].append(B * a.n_new / statistics.median(secs))
            log(f"{fmt} decode B={B} {name}={setting}: {got[setting][-1]:.1f} tok/s")
    finally:
        del exe._loop
    return [dict(format=fmt, phase=f"decode {name}={s}", batch=B, tokens=a.n_new, tok_s=statistics.median(v),
                 roofline_tok_s=None, ratio=None) for s, v in got.items()]


def ab_settings(spec: str) -> tuple[str, tuple[str, ...]]:
    """'ENV' -> (ENV, ('1', '0')); 'ENV=A,B[,C...]' or 'ENV=A|B[|C...]' (values with commas) ->
    (ENV, (A, B, ...)); anything else (fewer than two values, repeats, empties): ValueError."""
    name, _, vals = spec.partition("=")
    values = tuple(vals.split("|" if "|" in vals else ",")) if vals else ("1", "0")
    if not name or len(values) < 2 or not all(values) or len(set(values)) != len(values):
        raise ValueError(f"--ab {spec!r}: give ENV or ENV=A,B[,C...] (different values; | between values "
                         f"that hold commas)")
    return name, values


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/gpu_bench"))
    ap.add_argument("--formats", default="int4,bf16")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prefill", default="512,2048")
    ap.add_argument("--n-new", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="a small model on whatever device (smoke test)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--ab", metavar="ENV[=A,B,...]",
                    help="also time decode (each batch) with ENV=A, ENV=B, ... (default 1 and 0) alternately, twice each, "
                         "in this process, e.g. STRATA_PALLAS_ATTN=on,off or STRATA_PALLAS_LINEAR_TUNE='32,8|64,8': a "
                         "side-by-side A/B of a kernel switch ('ENV=A|B' when the values hold commas)")
    a = ap.parse_args()
    if a.ab:
        try:
            ab_settings(a.ab)
        except ValueError as e:
            ap.error(str(e))
    dims = TINY if a.tiny else FULL
    a.work_dir.mkdir(parents=True, exist_ok=True)
    plans = build(a.work_dir, dims, a.formats.split(","))

    import jax
    import jax.numpy as jnp

    from strata_compiler.backends.xla.device import device
    from strata_compiler.backends.xla.executor import XLAExecutor
    from strata_compiler.kv_cache import KVCache
    from strata_compiler.runtime.plan import load_plan

    dev = device("auto")
    bw = copy_bandwidth(jax, jnp, dev)
    log(f"device {dev}, copy bandwidth {bw:.0f} GB/s")
    rng = np.random.default_rng(0)
    rows = []
    for fmt, pdir in plans.items():
        plan = load_plan(pdir, verify_weights="none")
        t0 = time.time()
        exe = XLAExecutor(plan.graph, plan.weights)
        log(f"{fmt}: weights on the device in {time.time() - t0:.0f} s")
        m = plan.meta["model"]

        def cache(B: int, cap: int) -> KVCache:
            c = KVCache(m["n_layers"], B, m["n_kv_heads"], m["head_dim"], cap)
            exe.new_cache(c)
            return c

        for B in (int(b) for b in a.batches.split(",")):
            ids = rng.integers(0, m["vocab_size"], (B, a.prompt_len))
            cap = -(-(a.prompt_len + a.n_new + 16) // 64) * 64

            def decode() -> None:
                c = cache(B, cap)
                first = exe.run(ids, c)[plan.graph.outputs[0]][:, -1].argmax(-1)
                t1 = time.perf_counter()
                exe.greedy_decode(first, c, a.n_new)
                decode.seconds = time.perf_counter() - t1

            decode()
            secs = []
            for _ in range(a.repeats):
                decode()
                secs.append(decode.seconds)
            tps = B * a.n_new / statistics.median(secs)
            if a.ab:
                ab_rows = ab(exe, decode, a, fmt, B)
                rows.extend(ab_rows)
            roof = bw * 1e9 / decode_bytes(plan, dims, a.prompt_len + a.n_new // 2) if B == 1 else None
            rows.append(dict(format=fmt, phase="decode", batch=B, tokens=a.n_new, tok_s=tps,
                             roofline_tok_s=roof, ratio=tps / roof if roof else None))
            log(f"{fmt} decode B={B}: {tps:.1f} tok/s" + (f" ({tps / roof:.0%} of {roof:.0f} roofline)" if roof else ""))
        for T in (int(t) for t in a.prefill.split(",")):
            ids = rng.integers(0, m["vocab_size"], (1, T))

            def prefill() -> None:
                c = cache(1, T + 64)
                out = exe.run(ids, c)[plan.graph.outputs[0]]
                assert np.isfinite(out[0, -1]).all()

            s = median_seconds(prefill, a.repeats)
            rows.append(dict(format=fmt, phase="prefill", batch=1, tokens=T, tok_s=T / s))
            log(f"{fmt} prefill T={T}: {T / s:.0f} tok/s")
        del exe
    print(f"\ndevice: {dev}; copy bandwidth {bw:.0f} GB/s; model dims {dims}")
    print(f"{'format':6} {'phase':8} {'batch':>5} {'tokens':>6} {'tok/s':>10} {'roofline':>9} {'ratio':>6}")
    for r in rows:
        roof = f"{r['roofline_tok_s']:.0f}" if r.get("roofline_tok_s") else "-"
        ratio = f"{r['ratio']:.0%}" if r.get("ratio") else "-"
        print(f"{r['format']:6} {r['phase']:8} {r['batch']:5d} {r['tokens']:6d} {r['tok_s']:10.1f} {roof:>9} {ratio:>6}")
    if a.json:
        a.json.write_text(json.dumps({"device": str(dev), "copy_bandwidth_gbps": bw, "dims": dims, "rows": rows},
                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
