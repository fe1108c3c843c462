"""The many-token MoE kernels (backends/xla/pallas_gemm.py) against XLA's path on the GPU, one layer
of the Mixtral-shaped benchmark model (make_mixtral_model.py defaults: 8 experts, top-2,
2048 -> 2 x 5632 -> 2048), random packed int4 weights:

    python benchmarks/gpu_gemm.py [--rows 16,64,512,4096] [--tunes 64.128.4.4.3,...] [--forms registers,first]
        [--json OUT]

For each token count, form (weight tiles dequantized in registers, or the experts dequantized to
bf16 first: pallas_gemm.DEQUANT_FIRST_TOKENS decides between them in the product) and tuning
(BM.BN.GB.warps.stages): the kernels' error against XLA's path
(max |diff| / std) and the device time per call (the GPU kernels of a profiler trace of 20 calls,
glue included) beside that of XLA's path (every expert dequantized to bf16, then a ragged dot over
the pairs grouped by expert). Prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402


def _weight(rng, shape, G=32):
    """Random int4 arrays as formats.py stores them ({'qs' u8 [..., N, K/2], 'scales' f16})."""
    *lead, N, K = shape
    qs = rng.integers(0, 256, (*lead, N, K // 2), dtype=np.uint8)
    sc = (rng.random((*lead, N, K // G)) * 0.02 + 0.001).astype(np.float16)
    return {"qs": qs, "scales": sc}


def _time(fn, *args, n=20):
    """Device time per call in us (the GPU's kernels from a profiler trace, summed), else the
    median wall time of n calls (no GPU events: the CPU)."""
    import jax

    from common import device_kernels

    jax.block_until_ready(fn(*args))
    got = device_kernels(lambda: jax.block_until_ready([fn(*args) for _ in range(n)]))
    if got is not None:
        return got[1] / n
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,64,512,4096")
    ap.add_argument("--tunes", default="64.128.4.4.3")
    ap.add_argument("--forms", default="registers,first")
    ap.add_argument("--small", action="store_true", help="a model 8x smaller in every width (a CPU smoke test)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from strata_compiler import settings
    from strata_compiler.backends.xla import pallas_gemm
    from strata_compiler.backends.xla.dequant import dequantize
    from strata_compiler.ir import WeightSpec

    on_gpu = jax.default_backend() == "gpu"
    interpret = not on_gpu
    rng = np.random.default_rng(0)
    D, I, E, k = (256, 704, 8, 2) if args.small else (2048, 5632, 8, 2)
    gs, ds = WeightSpec("gu", (E, 2 * I, D), (), E, "int4", 32), WeightSpec("dn", (E, D, I), (), E, "int4", 32)
    gu = {n: jnp.asarray(v) for n, v in _weight(rng, (E, 2 * I, D)).items()}
    dn = {n: jnp.asarray(v) for n, v in _weight(rng, (E, D, I)).items()}
    bf = jnp.bfloat16

    def xla_moe(x, topi, topw, gu, dn):      # moe.py's many-token XLA path
        M = x.shape[0]
        flat = topi.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        xs = x[order // k].astype(bf)
        h = jax.lax.ragged_dot(xs, dequantize(jnp, gs, gu, bf).transpose(0, 2, 1), sizes,
                               preferred_element_type=jnp.float32)
        h = h[:, :I] / (1 + jnp.exp(-h[:, :I])) * h[:, I:]
        ys = jax.lax.ragged_dot(h.astype(bf), dequantize(jnp, ds, dn, bf).transpose(0, 2, 1), sizes,
                                preferred_element_type=jnp.float32)
        back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        return (ys[back].reshape(M, k, D) * topw[..., None]).sum(axis=1)

    rows_out = []
    for M in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((M, D)).astype(np.float32))
        logits = rng.standard_normal((M, E))
        topi = jnp.asarray(np.argsort(-logits, axis=1)[:, :k].astype(np.int32))
        topw = jnp.asarray(rng.random((M, k)).astype(np.float32))
        ref_moe = jax.jit(xla_moe)
        want = ref_moe(x, topi, topw, gu, dn)
        t_xla = _time(ref_moe, x, topi, topw, gu, dn)
        cases = [("moe", t_xla, want, lambda: jax.jit(lambda x, ti, tw, g, d: pallas_gemm.moe(
            x, ti, tw, gs, g, ds, d, interpret=interpret)), (x, topi, topw, gu, dn))]
        for name, t_ref, want, make, a in cases:
            for form, tune in ((f, t) for f in args.forms.split(",") for t in args.tunes.split(",")):
                tv = tuple(int(t) for t in tune.split("."))
                pallas_gemm.DEQUANT_FIRST_TOKENS = 1 if form == "first" else 1 << 30
                with settings.override(pallas_gemm_tune=tv, pallas_gemm_bf16_tune=tv):
                    pallas_gemm._call.cache_clear()
                    pallas_gemm._wcall.cache_clear()
                    try:
                        f = make()
                        got = f(*a)
                        err = float(jnp.abs(got - want).max() / want.std())
                        t = _time(f, *a)
                    except Exception as e:      # a tuning Triton refuses: say so, go on
                        print(f"{name} M={M} {form} tune {tune}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                        continue
                r = dict(op=name, rows=M, form=form, tune=tune, us=round(t, 1), xla_us=round(t_ref, 1),
                         speedup=round(t_ref / t, 2), err=err)
                rows_out.append(r)
                print(f"{name:8s} M={M:5d} {form:9s} {tune:16s} {t:9.1f} us  xla {t_ref:9.1f} us  "
                      f"x{t_ref / t:6.2f}  err {err:.2e}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows_out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
