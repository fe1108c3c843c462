"""Where the host time of one GPU partition call goes: the floor under a split layer.

    python benchmarks/gpu_dispatch.py PLAN_DIR [--part N] [--reps 200] [--device cpu]

A plan that splits a layer between the devices calls a jitted GPU partition per layer per token.
On an H200 host such a call (a layer's attention, router and hot experts: ~17 kernels, ~20 weight
arrays, the donated KV cache) took ~300 us of host time in a cProfile of the mixed runtime,
against ~40 us for a tiny jitted call (benchmarks/gpu_roundtrip.py). This runs the plan's
partition N (default: the first xla partition with an attention layer) one decode step at a time
and times the call as the runtime makes it, then with one thing changed at a time:
  runtime        exe._fn as the mixed runtime calls it (KV donated, inputs already on the device)
  no-donation    the same function jitted without donating the KV cache
  compiled       the ahead-of-time compiled executable (jit(...).lower(...).compile()) called directly
  trivial-body   the same arguments and outputs, a body that computes nothing (argument handling alone)
  tiny           a 2-argument jitted call (the dispatch floor)
  after-host-work  "runtime" right after the calling thread streamed 8 MiB (its caches evicted, as
                 after its share of the CPU kernels in the mixed runtime's loop, where the call
                 measured 175-380 us against ~95 here: benchmarks/switch_breakdown.py)
each as "dispatch" (the call returns) and "wait" (block_until_ready), median us.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout, installed or not


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan", type=Path)
    ap.add_argument("--part", type=int, default=-1, help="index of the xla partition (default: the first with attention)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu"])
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp

    from strata_compiler.errors import StrataError
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.session import Session

    try:
        s = Session(load_plan(a.plan), "auto", device=a.device)
    except StrataError as e:        # a bad plan path or file: one line, as the CLIs do
        print(f"error: {e}", file=sys.stderr)
        return 2
    s.reset(1, 512)
    s.step(np.arange(1, 9, dtype=np.int64)[None])
    for t in (3, 5):
        s.step(np.array([[t]], np.int64))
    parts = [(i, exe) for i, (k, exe, _) in enumerate(getattr(s.executor, "parts", [])) if k == "xla"]
    if not parts:
        print("the plan has no xla partition inside a mixed plan", file=sys.stderr)
        return 2
    idx, exe = next(((i, e) for i, e in parts if e.layers), parts[0]) if a.part < 0 else parts[a.part]
    cache = s.cache
    dev = exe.device
    leaves = len(jax.tree_util.tree_leaves(exe.params))
    ext = {i: jax.device_put(np.zeros(exe.g.node(i).type.shape[-1:], np.float32)[None], dev) for i in exe.inputs}
    ids = jax.device_put(np.zeros((1, 1), np.int32), dev)
    pos = jax.device_put(cache.positions(1).astype(np.int32), dev)     # each row's position (int32[B])
    state = [{l: jnp.array(cache.k[l]) for l in exe.layers}, {l: jnp.array(cache.v[l]) for l in exe.layers}]

    def timed(call, before=None):
        d, w = [], []
        for i in range(a.reps + 5):
            if before is not None:
                before()
            t0 = time.perf_counter()
            out = call()
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            t2 = time.perf_counter()
            if i >= 5:
                d.append(t1 - t0)
                w.append(t2 - t0)
        return 1e6 * float(np.median(d)), 1e6 * float(np.median(w))

    def with_kv(fn, *rest):
        def call():
            outs, k, v = fn(exe.params, state[0], state[1], ext, ids, *rest)
            if isinstance(k, tuple):      # exe._fn's results are tuples in exe.layers order
                k, v = dict(zip(exe.layers, k)), dict(zip(exe.layers, v))
            state[0], state[1] = k, v
            return outs
        return call

    rows = [("runtime", with_kv(exe._fn, 1, 1, pos))]
    nod = jax.jit(exe._forward, static_argnums=(5, 6))
    rows.append(("no-donation", lambda: nod(exe.params, state[0], state[1], ext, ids, 1, 1, pos)[0]))
    comp = exe._fn.lower(exe.params, state[0], state[1], ext, ids, 1, 1, pos).compile()
    rows.append(("compiled", with_kv(comp, pos)))

    def trivial(params, ks, vs, ext, ids, B, T, pos):
        return {o: jnp.zeros(exe.g.node(o).type.shape[-1:], jnp.float32)[None] + pos for o in exe.outputs}, ks, vs
    triv = jax.jit(trivial, static_argnums=(5, 6), donate_argnums=(1, 2))
    rows.append(("trivial-body", with_kv(triv, 1, 1, pos)))
    x = jax.device_put(np.ones((1, 2048), np.float32), dev)
    tiny = jax.jit(lambda x, p: x * 2.0 + p)
    rows.append(("tiny", lambda: tiny(x, pos)))
    junk = np.ones(1 << 21, np.float32)         # 8 MiB: more than the core's L2
    rows.append(("after-host-work", with_kv(exe._fn, 1, 1, pos), lambda: float(junk.sum())))
    kinds = [n.op.value for n in exe.nodes]
    print(f"partition {idx} on {dev.device_kind} ({dev.platform}): {len(exe.nodes)} ops {kinds}, {leaves} weight "
          f"arrays, {len(exe.layers)} attention layer(s), {len(exe.inputs)} input(s), {len(exe.outputs)} output(s); "
          f"median of {a.reps}")
    print(f"{'call':14} {'dispatch us':>12} {'wait us':>10}")
    for name, call, *before in rows:
        d, w = timed(call, *before)
        print(f"{name:14} {d:12.1f} {w:10.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
