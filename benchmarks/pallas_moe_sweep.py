"""Device time of the decode-MoE kernels of one layer, by variant: the Pallas kernels (rows per
program and warps) against XLA's multiply-reduce.

    python benchmarks/pallas_moe_sweep.py [--layers 8] [--reps 20] [--variants V;V;...]

A variant is `xla`, or `pallas:BN1,BN2,W1,W2` (STRATA_PALLAS_TUNE). Each layer is
x + MoE(rms_norm(x)); the Pallas variants take the norm and the residual add inside their kernels
(as the executor runs them; BN1 is then the group size, h passing between the kernels in q8), XLA
around them. Each variant's output after the --layers layers is compared with the first variant's
(of what the layers add to x: max |difference| / max |value|; the kernels round activations to q8,
so they come near XLA's f32 result, not to its rounding). The model is the OLMoE shape of gpu_decode.py (D 2048, I 1024, 64 experts
top-8, int4, group 32), batch 1, routing inside the kernels; --layers distinct random layers
(more than the L2 holds) run one after another in one jitted call. Device kernel times come from a
JAX profiler trace (CUPTI): per layer, each kernel's time and the total, and the bytes the layer's
chosen experts hold divided by that total (the kernels' effective read bandwidth). Needs a GPU
(--tiny: a small shape in Pallas interpret mode on the CPU, a smoke test of the script).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import device_kernels, log  # noqa: E402

DEFAULT = ("xla;pallas:32,4,4,4;pallas:32,4,8,4;pallas:32,4,16,4;pallas:32,2,4,2;pallas:32,4,4,8;pallas:32,8,8,8;"
           "pallas:32,4,2,4")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default=DEFAULT)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    for v in a.variants.split(";"):
        parts = v.split(":")
        if not (v == "xla" or (len(parts) == 2 and parts[0] == "pallas" and len(parts[1].split(",")) == 4
                               and all(t.isdigit() for t in parts[1].split(",")))):
            ap.error(f"--variants: {v!r} is not `xla` or `pallas:BN1,BN2,W1,W2`")

    import jax
    import jax.numpy as jnp

    from strata_compiler.backends.xla import pallas_moe
    from strata_compiler.backends.xla.dequant import matvec, silu
    from strata_compiler.ir import WeightSpec

    E, D, I, k, G = (8, 64, 32, 2, 32) if a.tiny else (64, 2048, 1024, 8, 32)
    gs = WeightSpec("gu", (E, 2 * I, D), (), E, "int4", G)
    ds = WeightSpec("dn", (E, D, I), (), E, "int4", G)
    rng = np.random.default_rng(0)

    def arrays(N, K):
        return {"qs": jnp.asarray(rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)),
                "scales": jnp.asarray((rng.random((E, N, K // G)) * 0.02).astype(np.float16))}

    layers = [(arrays(2 * I, D), arrays(D, I), jnp.asarray(rng.standard_normal((1, E)).astype(np.float32)))
              for _ in range(a.layers)]
    # bytes of the chosen experts per layer: int4 nibbles and f16 scales of gate_up and down
    chosen = k * (2 * I * D // 2 + 2 * (2 * I) * (D // G) + D * I // 2 + 2 * D * (I // G))
    x0 = jnp.asarray(rng.standard_normal((1, D)).astype(np.float32))
    nw = jnp.asarray((1 + 0.1 * rng.standard_normal(D)).astype(np.float32))      # the norm's weight
    rows = []
    first = None
    for v in a.variants.split(";"):
        parts = v.split(":")
        if parts[0] == "pallas":
            os.environ["STRATA_PALLAS_TUNE"] = parts[1]

        def layer(x, gu, dn, logits, v=v):
            """x + MoE(rms_norm(x)), as a decoder layer's MoE block (the norm and the residual
            inside the Pallas kernels, as the executor runs them; around XLA's)."""
            if v != "xla":
                return pallas_moe.moe_decode(x, None, None, gs, gu, ds, dn, interpret=a.tiny, logits=logits, k=k,
                                             rms=(nw, 1e-6), residual=x)
            xn = x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * nw
            topw, topi = jax.lax.top_k(jax.nn.softmax(logits, -1), k)
            g = matvec(jnp, gs, {r: t[topi] for r, t in gu.items()}, xn[:, None, :])
            h = silu(jnp, g[..., :I]) * g[..., I:]
            y = matvec(jnp, ds, {r: t[topi] for r, t in dn.items()}, h)
            return x + (y * topw[..., None]).sum(axis=1)

        @jax.jit
        def run(x, layers):
            for gu, dn, logits in layers:
                x = layer(x, gu, dn, logits)
            return x

        try:
            y = np.asarray(run(x0, layers))
        except Exception as e:          # a variant Triton cannot compile: say so, go on
            print(f"{v}: failed: {str(e).splitlines()[0][:300]}")
            continue
        y = y - np.asarray(x0)          # what the MoE layers added
        if first is None:
            first = y
        diff = float(np.abs(y - first).max() / np.abs(first).max())
        t0 = time.perf_counter()
        for _ in range(a.reps):
            out = run(x0, layers)
        out.block_until_ready()
        wall = (time.perf_counter() - t0) / a.reps / a.layers
        got = device_kernels(lambda: [run(x0, layers).block_until_ready() for _ in range(a.reps)])
        n = a.reps * a.layers
        if got is None:
            rows.append((v, wall * 1e6, None, None, diff, ""))
            continue
        per, busy, _ = got
        kern = ", ".join(f"{name} {dur / n:.1f}" for name, (c, dur) in sorted(per.items(), key=lambda kv: -kv[1][1])
                         if dur / n >= 0.5)
        rows.append((v, wall * 1e6, busy / n, chosen / (busy / n * 1e-6) / 1e9, diff, kern))
        log(f"{v}: {busy / n:.1f} us per layer on the device")
    print(f"\nMoE of one layer, batch 1, {E} experts top-{k}, D {D}, I {I}, int4 G{G}: {chosen / 1e6:.1f} MB "
          f"of chosen experts per layer; {a.layers} layers x {a.reps} calls")
    print(f"{'variant':28s} {'wall us':>8s} {'device us':>9s} {'GB/s':>7s} {'vs first':>9s}  kernels (us per layer)")
    for v, wall, dev, bw, diff, kern in rows:
        print(f"{v:28s} {wall:8.1f} {dev if dev is not None else float('nan'):9.1f} "
              f"{bw if bw is not None else float('nan'):7.0f} {diff:9.1e}  {kern}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
