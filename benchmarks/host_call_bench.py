"""What a round trip GPU -> CPU -> GPU costs per layer, five ways, side by side in one process.

A chain of L "layers", each a matrix-vector product on the device (H x H, fp32) followed by a small
CPU operation on its result (out = 0.5 * in, H floats) whose output the next layer adds back:

  device-only    the device layers alone, one jitted program (the floor)
  split          a jitted call per layer, the result copied out (np.asarray), the CPU op, the
                 next call's operand copied in: what a partition per device costs through JAX
  pure-callback  one jitted program, the CPU op as jax.pure_callback
  host-call-py   one jitted program, the CPU op behind backends/xla/host_call.py's native FFI
                 handler, as a Python callback (ctypes; takes the GIL)
  host-call      the same with a native CPU op (JIT-compiled, no Python)

Prints the median microseconds per step and per layer; all five must agree on the result.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout, installed or not


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import llvmlite.binding as llvm

    from strata_compiler.backends.llvm_cpu.jit import optimize
    from strata_compiler.backends.llvm_cpu.target import Target
    from strata_compiler.backends.xla.host_call import HostCall, python_work

    L, H = a.layers, a.hidden
    dev = jax.devices()[0]
    platform = "gpu" if dev.platform == "gpu" else "cpu"
    rng = np.random.default_rng(0)
    Ws = [jax.device_put((rng.standard_normal((H, H)) / np.sqrt(H)).astype(np.float32), dev) for _ in range(L)]
    x0 = jax.device_put(np.full((1, H), 0.1, np.float32), dev)

    hin, hout = np.zeros((1, H), np.float32), np.zeros((1, H), np.float32)
    ir = f"""
define void @half(i64 %arg, ptr %stream) {{
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%i1, %loop]
  %pi = getelementptr float, ptr inttoptr (i64 {hin.ctypes.data} to ptr), i64 %i
  %po = getelementptr float, ptr inttoptr (i64 {hout.ctypes.data} to ptr), i64 %i
  %v = load float, ptr %pi
  %h = fmul float %v, 0.5
  store float %h, ptr %po
  %i1 = add i64 %i, 1
  %c = icmp ult i64 %i1, {H}
  br i1 %c, label %loop, label %end
end:
  ret void
}}"""
    mod, tm = optimize(ir, Target.host())
    ee = llvm.create_mcjit_compiler(mod, tm)
    ee.finalize_object()
    native = HostCall([hin], [hout], ee.get_function_address("half"), platform=platform)
    addr, _keep = python_work(lambda _stream: np.multiply(hin, 0.5, out=hout))
    pyhc = HostCall([hin], [hout], addr, platform=platform)

    spec = jax.ShapeDtypeStruct((1, H), jnp.float32)

    def chain(cpu):
        def f(x, Ws):
            for W in Ws:
                h = jnp.tanh(x @ W)
                x = h + cpu(h)
            return x
        return jax.jit(f)

    progs = {
        "device-only": jax.jit(lambda x, Ws: [x := jnp.tanh(x @ W) for W in Ws][-1]),
        "pure-callback": chain(lambda h: jax.pure_callback(lambda v: np.asarray(v) * np.float32(0.5), spec, h)),
        "host-call-py": chain(lambda h: pyhc(h)[0]),
        "host-call": chain(lambda h: native(h)[0]),
    }
    layer = jax.jit(lambda x, W: jnp.tanh(x @ W))
    add = jax.jit(lambda h, c: h + c)

    def split(x, Ws):
        for W in Ws:
            h = layer(x, W)
            x = add(h, jax.device_put(np.asarray(h) * np.float32(0.5), dev))
        return x

    progs["split"] = split
    ref = np.asarray(progs["pure-callback"](x0, Ws))
    for name, f in progs.items():
        if name != "device-only":
            d = float(np.abs(np.asarray(f(x0, Ws)) - ref).max())
            if d > 1e-5:
                print(f"{name}: result differs from pure-callback by {d:g}", file=sys.stderr)
                return 1

    def bench(f):
        for _ in range(10):
            jax.block_until_ready(f(x0, Ws))
        ts = []
        for _ in range(a.reps):
            t = time.perf_counter()
            jax.block_until_ready(f(x0, Ws))
            ts.append(time.perf_counter() - t)
        return float(np.median(ts)) * 1e6

    print(f"{L} layers, hidden {H}, on {dev.device_kind} ({dev.platform}), jax {jax.__version__}; median of {a.reps}")
    print(f"{'variant':14} {'us/step':>10} {'us/layer':>10}")
    order = ["device-only", "split", "pure-callback", "host-call-py", "host-call"]
    for rnd in range(2):                 # twice, interleaved: the machines are noisy
        for name in order:
            t = bench(progs[name])
            print(f"{name:14} {t:10.1f} {t / L:10.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
