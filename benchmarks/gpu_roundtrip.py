"""What one CPU<->GPU partition switch costs through JAX: the floor under every mixed plan.

    python benchmarks/gpu_roundtrip.py [--hidden 2048] [--reps 200]

A decode step of a mixed plan crosses between the xla and the CPU partitions a few times per
layer (a split layer: into the GPU share, back for the CPU share, the combine). Each crossing is
some of: a jitted call (dispatch), a host->device copy of the activation, a device->host copy
of the result and a wait for the GPU. This measures each on its own, at one token's activation
(f32[1, hidden]), median of --reps after warm-up, and prints a table in microseconds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout, installed or not

from benchmarks.common import median_seconds  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    import jax

    dev = jax.devices()[0]
    x_host = np.ones((1, a.hidden), np.float32)
    x_dev = jax.block_until_ready(jax.device_put(x_host, dev))
    f = jax.jit(lambda x, pos: (x * 2.0 + 1.0, pos + 1))
    leaves = {n: {f"w{i}": jax.device_put(np.ones((a.hidden,), np.float32), dev) for i in range(n)}
              for n in (30, 100, 400)}
    g = jax.jit(lambda p, x: x + sum(v[0] for v in p.values()))
    pos_dev = jax.block_until_ready(jax.device_put(np.int32(3), dev))
    rows = [
        ("jitted call, every input on the device, no wait (dispatch alone)", lambda: f(x_dev, pos_dev)),
        ("jitted call, every input on the device, wait", lambda: jax.block_until_ready(f(x_dev, pos_dev))),
        ("jitted call, device input + a NumPy scalar, wait",
         lambda: jax.block_until_ready(f(x_dev, np.int32(3)))),
        ("jitted call, device input + a NumPy scalar, no wait", lambda: f(x_dev, np.int32(3))),
        ("jitted call with 30 weight leaves, wait", lambda: jax.block_until_ready(g(leaves[30], x_dev))),
        ("jitted call with 100 weight leaves, wait", lambda: jax.block_until_ready(g(leaves[100], x_dev))),
        ("jitted call with 400 weight leaves, wait", lambda: jax.block_until_ready(g(leaves[400], x_dev))),
        ("device_put of the activation, wait", lambda: jax.block_until_ready(jax.device_put(x_host, dev))),
        ("NumPy in, jitted call, np.asarray out (stratac probe-hw's partition figure)",
         lambda: np.asarray(f(x_host, np.int32(3))[0])),
        ("np.asarray of a fresh device result (d2h + wait)",
         lambda: np.asarray(f(x_dev, np.int32(3))[0])),
    ]
    from jax.experimental import io_callback

    def host_fn(x):
        return np.asarray(x) + np.float32(1.0)

    shape = jax.ShapeDtypeStruct((1, a.hidden), np.float32)

    def chain(n, kind):
        def fn(x):
            for _ in range(n):
                x = x * 1.0001
                x = (jax.pure_callback(host_fn, shape, x) if kind == "pure"
                     else io_callback(host_fn, shape, x, ordered=kind == "ordered"))
            return x
        return jax.jit(fn)

    cb = {(n, k): chain(n, k) for n in (1, 16) for k in ("pure", "io", "ordered")}
    for k in ("pure", "io", "ordered"):
        rows.append((f"one program, 1 host callback ({k}), wait", lambda k=k: jax.block_until_ready(cb[1, k](x_dev))))
        rows.append((f"one program, 16 host callbacks ({k}), wait", lambda k=k: jax.block_until_ready(cb[16, k](x_dev))))
    from strata_compiler.backends.xla import cuda_rt

    if dev.platform == "gpu" and cuda_rt.available():
        host = np.empty((1, a.hidden), np.float32)
        y = jax.block_until_ready(f(x_dev, pos_dev)[0])
        cuda_rt.to_host(y, host)
        assert np.array_equal(host, np.asarray(y)), "cudaMemcpy device->host differs from np.asarray"
        buf = jax.block_until_ready(jax.device_put(np.zeros((1, a.hidden), np.float32), dev))
        src = np.arange(a.hidden, dtype=np.float32)[None]
        cuda_rt.to_device(src, buf)
        assert np.array_equal(np.asarray(f(buf, pos_dev)[0]), src * 2 + 1), "cudaMemcpy host->device not seen"

        def raw_trip():
            y = f(x_dev, pos_dev)[0]
            y.block_until_ready()
            cuda_rt.to_host(y, host)

        def raw_trip_sync():
            y = f(x_dev, pos_dev)[0]
            cuda_rt.sync()
            cuda_rt.to_host(y, host)

        def raw_in_out():
            cuda_rt.to_device(src, buf)
            y = f(buf, pos_dev)[0]
            cuda_rt.sync()
            cuda_rt.to_host(y, host)

        rows += [("cudaMemcpy of a finished result (d2h alone)", lambda: cuda_rt.to_host(y, host)),
                 ("cudaMemcpy into a device buffer (h2d alone)", lambda: cuda_rt.to_device(src, buf)),
                 ("cudaDeviceSynchronize, idle device", cuda_rt.sync),
                 ("jitted call, block_until_ready, cudaMemcpy out", raw_trip),
                 ("jitted call, cudaDeviceSynchronize, cudaMemcpy out", raw_trip_sync),
                 ("cudaMemcpy in, jitted call, cudaDeviceSynchronize, cudaMemcpy out", raw_in_out)]
    else:
        print(f"(no CUDA runtime library: cudaMemcpy rows skipped; tried {cuda_rt._find()[:3]})")
    out = f(x_dev, np.int32(3))[0]
    rows.append(("copy_to_host_async then np.asarray",
                 lambda: (lambda y: (y.copy_to_host_async(), np.asarray(y)))(f(x_dev, np.int32(3))[0])))
    del out
    print(f"device {dev.device_kind} ({dev.platform}), activation f32[1, {a.hidden}], median of {a.reps}")
    print(f"{'what':78} {'us':>8}")
    for name, fn in rows:
        print(f"{name:78} {1e6 * median_seconds(fn, a.reps, warmup=5):8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
