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
    leaves = {f"w{i}": jax.device_put(np.ones((a.hidden,), np.float32), dev) for i in range(100)}
    g = jax.jit(lambda p, x: x + sum(v[0] for v in p.values()))
    pos_dev = jax.block_until_ready(jax.device_put(np.int32(3), dev))
    rows = [
        ("jitted call, every input on the device, no wait (dispatch alone)", lambda: f(x_dev, pos_dev)),
        ("jitted call, every input on the device, wait", lambda: jax.block_until_ready(f(x_dev, pos_dev))),
        ("jitted call, device input + a NumPy scalar, wait",
         lambda: jax.block_until_ready(f(x_dev, np.int32(3)))),
        ("jitted call, device input + a NumPy scalar, no wait", lambda: f(x_dev, np.int32(3))),
        ("jitted call with 100 weight leaves, wait", lambda: jax.block_until_ready(g(leaves, x_dev))),
        ("device_put of the activation, wait", lambda: jax.block_until_ready(jax.device_put(x_host, dev))),
        ("NumPy in, jitted call, np.asarray out (stratac probe-hw's partition figure)",
         lambda: np.asarray(f(x_host, np.int32(3))[0])),
        ("np.asarray of a fresh device result (d2h + wait)",
         lambda: np.asarray(f(x_dev, np.int32(3))[0])),
    ]
    out = f(x_dev, np.int32(3))[0]
    rows.append(("copy_to_host_async then np.asarray",
                 lambda: (lambda y: (y.copy_to_host_async(), np.asarray(y)))(f(x_dev, np.int32(3))[0])))
    del out
    print(f"device {dev.device_kind} ({dev.platform}), activation f32[1, {a.hidden}], median of {a.reps}")
    print(f"{'what':78} {'us':>8}")
    for name, fn in rows:
        print(f"{name:78} {1e6 * median_seconds(fn, a.reps, warmup=5):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
