"""What a jitted call costs per array it takes and per array it donates and returns.

A fused decode step (runtime/fused_step.py) passes every GPU partition's weights (~14 arrays a
layer) and KV caches (2 a layer, donated and returned) to one program: on an H200, 16 layers
(~270 arrays) took ~0.9 ms from the call to the first host call and ~0.55 ms from the last host
call to the end, against ~0.23 and ~0.15 ms with 2 layers. This times a program that reads one
small array and ignores the rest (so the device does next to nothing), for N arrays passed
(read-only) and N arrays donated and returned, as the dispatch (the call returns) and the whole
call (block_until_ready), median µs:

    python benchmarks/dispatch_args.py [--counts 1,30,100,300] [--reps 300]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="1,30,100,300")
    ap.add_argument("--reps", type=int, default=300)
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    counts = [int(c) for c in a.counts.split(",")]
    print(f"{dev.device_kind} ({dev.platform}), jax {jax.__version__}; median of {a.reps}")
    print(f"{'arrays':>7} {'kind':>9} {'dispatch us':>12} {'call us':>9} {'us/array':>9}")

    def timed(f, args):
        for _ in range(20):
            args = f(*args)
            jax.block_until_ready(args)
        d, w = [], []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            out = f(*args)
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            t2 = time.perf_counter()
            d.append(t1 - t0)
            w.append(t2 - t0)
            args = out
        return float(np.median(d)) * 1e6, float(np.median(w)) * 1e6

    base = None
    for kind in ("read", "donated"):
        for n in counts:
            xs = [jax.device_put(np.full((256,), i, np.float32), dev) for i in range(n)]
            x0 = jax.device_put(np.zeros((16,), np.float32), dev)
            if kind == "read":
                f = jax.jit(lambda x0, *xs: (x0 + 1.0, *xs[:0]))

                def step(x0, *rest, f=f, xs=xs):
                    return (f(x0, *xs)[0],)
                d, w = timed(step, (x0,))
            else:
                f = jax.jit(lambda x0, *xs: (x0 + 1.0, *(x for x in xs)), donate_argnums=tuple(range(1, n + 1)))
                d, w = timed(lambda *args, f=f: f(*args), (x0, *xs))
            if kind == "read" and n == counts[0]:
                base = w
            per = (w - base) / max(n - counts[0], 1) if base is not None and n != counts[0] else float("nan")
            print(f"{n:7d} {kind:>9} {d:12.1f} {w:9.1f} {per:9.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
