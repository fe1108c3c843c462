"""How fast the GPU reads expert weights that stay in page-locked host memory (zero-copy).

An expert cache miss can be served three ways: the CPU computes the expert (the host call the
split layers pay every step), the expert is copied into a GPU slot first, or the GPU's MoE kernel
reads the expert's rows straight from host memory over PCIe (the host pages registered with
cudaHostRegister and mapped into the GPU's address space; the array handed to JAX through
DLPack as a device buffer). This measures the third against the others, one layer of the
benchmark model's shape (OLMoE: D 2048, I 1024, 64 experts, top-8, int4):

  device   the decode MoE kernels (backends/xla/pallas_moe.py) on device arrays
  mapped   the same kernels on the host-mapped arrays: every chosen expert crosses PCIe
  memcpy   cudaMemcpy of one expert's bytes from the pinned pages (the swap's copy)

Each timed call picks fresh random experts (the GPU's L2 would otherwise keep them).

    python benchmarks/mapped_experts.py [--experts 64] [--k 8] [--iters 200]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout, installed or not


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from strata_compiler.backends.xla import cuda_rt, pallas_moe
    from strata_compiler.formats import get_format
    from strata_compiler.ir import WeightSpec
    from strata_compiler.backends.xla import mapped

    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform})")
    if dev.platform != "gpu":
        raise SystemExit("needs a GPU")
    E, D, I, k, G = a.experts, a.dim, a.inter, a.k, 32
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    gu = get_format("int4").quantize(rng.standard_normal((E, 2 * I, D), np.float32) / np.sqrt(D), G)
    dn = get_format("int4").quantize(rng.standard_normal((E, D, I), np.float32) / np.sqrt(I), G)
    gs, ds = WeightSpec("gu", (E, 2 * I, D), (), E, "int4", G), WeightSpec("dn", (E, D, I), (), E, "int4", G)
    per_expert = sum(v.nbytes for v in (*gu.values(), *dn.values())) // E
    print(f"weights: {E} experts of {per_expert / 2**20:.2f} MiB, made in {time.perf_counter() - t0:.1f} s")

    host = {}
    for name, arrs in (("gu", gu), ("dn", dn)):
        host[name] = {}
        for r, v in arrs.items():
            buf = mapped.aligned_copy(v)
            host[name][r] = (buf, mapped.device_view(buf, dev))
    devw = {name: {r: jax.device_put(v, dev) for r, v in arrs.items()} for name, arrs in (("gu", gu), ("dn", dn))}
    hostw = {name: {r: hv for r, (_, hv) in arrs.items()} for name, arrs in host.items()}
    for name in hostw:
        for r in hostw[name]:
            same = np.array_equal(np.asarray(hostw[name][r][3]), np.asarray(devw[name][r][3]))
            print(f"mapped {name}.{r}: aliases host {hostw[name][r].unsafe_buffer_pointer() == host[name][r][0].ctypes.data}"
                  f", reads back equal {same}")

    @jax.jit
    def moe(x, topi, topw, gq, gsc, dq, dsc):
        return pallas_moe.moe_decode(x, topi, topw, gs, {"qs": gq, "scales": gsc}, ds, {"qs": dq, "scales": dsc})

    x = jnp.asarray(rng.standard_normal((1, D), np.float32))
    picks = [jnp.asarray(np.stack([rng.choice(E, k, replace=False)]).astype(np.int32)) for _ in range(a.iters)]
    topw = jnp.asarray(np.full((1, k), 1.0 / k, np.float32))
    rows = []

    def timed(label, w, kk):
        args = (w["gu"]["qs"], w["gu"]["scales"], w["dn"]["qs"], w["dn"]["scales"])
        sel = [p[:, :kk] for p in picks]
        tw = topw[:, :kk]
        jax.block_until_ready(moe(x, sel[0], tw, *args))
        out = []
        for _ in range(3):
            t = time.perf_counter()
            for s in sel:
                y = moe(x, s, tw, *args)
            jax.block_until_ready(y)
            out.append((time.perf_counter() - t) / len(sel) * 1e6)
        us = float(np.median(out))
        rows.append((label, kk, us, kk * per_expert / us / 1e3))
        return y

    y_dev = timed("device", devw, k)
    y_host = timed("mapped", hostw, k)
    print(f"mapped against device, same experts: max |diff| {float(jnp.abs(y_dev - y_host).max()):.3g}")
    for kk in (1, 2, 4):
        timed("device", devw, kk)
        timed("mapped", hostw, kk)
    # the swap's copy: one expert's bytes from the pinned pages into a device buffer
    L = cuda_rt.lib()
    dst = devw["gu"]["qs"].unsafe_buffer_pointer()
    src, n = host["gu"]["qs"][0], host["gu"]["qs"][0][0].nbytes
    ts = []
    for e in range(min(E, 32)):
        t = time.perf_counter()
        L.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src[e].ctypes.data), ctypes.c_size_t(n), 1)
        ts.append(time.perf_counter() - t)
    us = float(np.median(ts)) * 1e6 * per_expert / n
    rows.append(("memcpy (scaled to an expert)", 1, us, per_expert / us / 1e3))
    print(f"\n| path | experts per call | us per call | GB/s |\n|---|---|---|---|")
    for label, kk, us, gbs in rows:
        print(f"| {label} | {kk} | {us:.1f} | {gbs:.1f} |")


if __name__ == "__main__":
    main()
