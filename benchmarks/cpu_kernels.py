"""GEMV bandwidth of the llvm CPU kernels, against a STREAM-style read bandwidth from the same run.

    python benchmarks/cpu_kernels.py [--threads 2] [--reps 20] [--formats f32,bf16,int8,int4]
        [--shapes 2048x1024,4096x14336,14336x4096] [--tokens 1] [--json OUT]

Shapes are N x K (output rows x input columns, as in W[N, K] @ x[K]). For each format and shape
the kernel streams the whole weight once per call (decode: one token); the table reports weight
bytes per second (median of --reps calls) and the ratio to the read bandwidth measured by a
JIT-compiled parallel sum over a 1 GiB array on the same threads. int8/int4 run with q8
activations (one plane; the runtime's default q16 has two) and with f32 activations (exact). --tokens M > 1
times prefill instead: M tokens per call (the MoE rows route each to top_k random experts).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from strata_compiler.backends.probe import read_bandwidth, time_linear


def bench_gemv(pool, lib, target, fmt: str, N: int, K: int, q8: bool, reps: int, M: int = 1) -> tuple[float, int, float]:
    """(weight GB/s, weight bytes, seconds per call) of `linear` over M tokens."""
    t, nbytes = time_linear(pool, lib, target, fmt, N, K, reps, M=M, q8=q8)
    return nbytes / t / 1e9, nbytes, t


def bench_moe(pool, lib, target, fmt: str, E: int, D: int, I: int, top_k: int, reps: int, M: int = 1) -> dict:
    """M tokens through a MoE FFN (q8 activations): gate_up then down, each token over top_k of E
    experts chosen at random per call. Returns GB/s of the weight bytes each kernel reads (each
    active expert's once) and the seconds per call."""
    from strata_compiler.backends.llvm_cpu.codegen.dot import pair_layout
    from strata_compiler.backends.llvm_cpu.codegen.elementwise import quantize_q8
    from strata_compiler.backends.llvm_cpu.codegen.moe import (DOWN_PARAMS, GATE_UP_PARAMS, MoESpec, down,
                                                              gate_up, h_stride)
    from strata_compiler.formats import get_format

    F = get_format(fmt)
    rng = np.random.default_rng(0)

    def stacked(rows: int, K: int):
        parts = [F.quantize(rng.standard_normal((rows, K), dtype=np.float32), 32) for _ in range(E)]
        return np.stack([p["qs"] for p in parts]), np.stack([p["scales"] for p in parts])

    wu, su = stacked(2 * I, D)
    wd, sd = stacked(D, I)
    spec = MoESpec(fmt, D, I, 32, q8=True)
    ku, kd = gate_up(spec, target), down(spec, target)
    au_addr, ad_addr = lib.address(ku.ir, ku.name), lib.address(kd.ir, kd.name)
    x = rng.standard_normal((M, D), dtype=np.float32)
    ng = -(-D // 32)
    xq, xd, xs = np.zeros((M, ng * 32), np.int8), np.zeros((M, ng), np.float32), np.zeros((M, ng), np.int32)
    q = quantize_q8(D, target, pair_layout(target, fmt, 32))
    qa = (ctypes.c_int64 * len(q.params))(*[dict(x=x.ctypes.data, xq=xq.ctypes.data, xd=xd.ctypes.data,
                                                 xs=xs.ctypes.data, ldx=D)[p] for p in q.params])
    pool.run(lib.address(q.ir, q.name), ctypes.addressof(qa), 0, M)
    hs_ = h_stride(spec)
    P = M * top_k
    h = rng.standard_normal((P, hs_), dtype=np.float32)
    hq, hd, hsum = np.zeros((P, hs_), np.int8), np.zeros((P, hs_ // 32), np.float32), np.zeros((P, hs_ // 32), np.int32)
    qh = quantize_q8(I, target, pair_layout(target, fmt, 32))
    qha = (ctypes.c_int64 * len(qh.params))(*[dict(x=h.ctypes.data, xq=hq.ctypes.data, xd=hd.ctypes.data,
                                                   xs=hsum.ctypes.data, ldx=hs_)[p] for p in qh.params])
    qh_addr = lib.address(qh.ir, qh.name)
    tok = np.zeros(P, np.int64)
    exp = np.zeros(P, np.int64)
    pw = np.full(P, 1.0 / top_k, np.float32)
    first = np.zeros(E + 1, np.int64)
    active = np.zeros(E, np.int64)
    y = np.zeros((M, D), np.float32)
    va = dict(h=h.ctypes.data, x=xq.ctypes.data, xd=xd.ctypes.data, xs=xs.ctypes.data, w=wu.ctypes.data,
              s=su.ctypes.data, pair_tok=tok.ctypes.data, first=first.ctypes.data, active=active.ctypes.data, ldx=D)
    vd = dict(y=y.ctypes.data, r=0, h=hq.ctypes.data, hd=hd.ctypes.data, hs=hsum.ctypes.data, w=wd.ctypes.data,
              s=sd.ctypes.data, pair_tok=tok.ctypes.data, pair_exp=exp.ctypes.data, pair_w=pw.ctypes.data,
              P=P, M=M, ldy=D, ldr=D)
    au = (ctypes.c_int64 * len(GATE_UP_PARAMS))(*[va[p] for p in GATE_UP_PARAMS])
    ad = (ctypes.c_int64 * len(DOWN_PARAMS))(*[vd[p] for p in DOWN_PARAMS])
    tu, td, nas = [], [], []
    for _ in range(reps + 2):
        chosen = np.stack([rng.choice(E, top_k, replace=False) for _ in range(M)])   # [M, top_k]
        order = np.lexsort((np.repeat(np.arange(M), top_k), chosen.ravel()))       # by expert, then token
        exp[:] = chosen.ravel()[order]
        tok[:] = np.repeat(np.arange(M), top_k)[order]
        act, counts = np.unique(exp, return_counts=True)
        nA = len(act)
        active[:nA] = act
        first[1:nA + 1] = np.cumsum(counts)
        t0 = time.perf_counter()
        pool.parallel_for(au_addr, ctypes.addressof(au), nA * I, min_chunk=8)
        t1 = time.perf_counter()
        pool.parallel_for(qh_addr, ctypes.addressof(qha), P, min_chunk=4)
        t2 = time.perf_counter()
        pool.parallel_for(ad_addr, ctypes.addressof(ad), D, min_chunk=16)
        t3 = time.perf_counter()
        tu.append(t1 - t0)
        td.append(t3 - t2)
        nas.append(nA)
    nA = statistics.median(nas[2:])
    bu = nA * (wu[0].nbytes + su[0].nbytes)
    bd = nA * (wd[0].nbytes + sd[0].nbytes)
    mu, md = statistics.median(tu[2:]), statistics.median(td[2:])
    return dict(gate_up_gbps=bu / mu / 1e9, down_gbps=bd / md / 1e9, total_gbps=(bu + bd) / (mu + md) / 1e9,
                bytes=bu + bd, gate_up_s=mu, down_s=md)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--formats", default="f32,bf16,fp8,int8,int4a,int4,int3,int2")
    ap.add_argument("--shapes", default="2048x1024,4096x14336,14336x4096")
    ap.add_argument("--moe", default="int4:8x2048x5632:2",
                    help="MoE decode rows FMT:ExDxI:TOPK[,...] (empty: none); the default is the Mixtral-shaped "
                         "model of decode_vs_llamacpp.py")
    ap.add_argument("--tokens", type=int, default=1,
                    help="tokens per call (prefill: many); the table adds each call's time and GFLOP/s")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    a = ap.parse_args()
    os.environ["STRATA_NUM_THREADS"] = str(a.threads)
    from strata_compiler.backends.llvm_cpu.jit import KernelLibrary
    from strata_compiler.backends.llvm_cpu.pool import ThreadPool
    from strata_compiler.backends.llvm_cpu.target import Target

    target = Target.host()
    lib = KernelLibrary(target)
    pool = ThreadPool(a.threads)
    # The machine is shared and noisy: the read bandwidth is measured again beside every kernel,
    # and each ratio uses the median of the two measurements that bracket it.
    bws = [read_bandwidth(pool, lib, target, 1 << 30, max(5, a.reps // 2)) / 1e9]
    print(f"host {target.cpu} ({target.vector_bits}-bit vectors{', VNNI' if target.vnni else ''}), "
          f"{a.threads} threads, Python {platform.python_version()}")
    print(f"{'format':6} {'act':4} {'N x K':>12} {'MiB':>8} {'GB/s':>7} {'read GB/s':>10} {'of read bw':>10}")
    rows = []
    for fmt in a.formats.split(","):
        for shape in a.shapes.split(","):
            N, K = (int(v) for v in shape.lower().split("x"))
            for q8 in ([True, False] if fmt in ("int8", "int4", "int4a") else [False]):
                gbs, nbytes, t = bench_gemv(pool, lib, target, fmt, N, K, q8, a.reps, a.tokens)
                bws.append(read_bandwidth(pool, lib, target, 1 << 30, max(5, a.reps // 2)) / 1e9)
                bw = statistics.median(bws[-2:])
                act = "q8" if q8 else "f32"
                flops = f"  M={a.tokens}: {t * 1e3:8.2f} ms {2 * a.tokens * N * K / t / 1e9:7.1f} GFLOP/s" if a.tokens > 1 else ""
                print(f"{fmt:6} {act:4} {shape:>12} {nbytes / 2**20:8.1f} {gbs:7.2f} {bw:10.2f} {gbs / bw:10.0%}{flops}")
                rows.append(dict(format=fmt, act=act, N=N, K=K, M=a.tokens, bytes=nbytes, gbps=gbs, read_gbps=bw,
                                 ratio=gbs / bw, seconds=t))
    for item in filter(None, a.moe.split(",")):
        fmt, shape, k = item.split(":")
        E, D, I = (int(v) for v in shape.lower().split("x"))
        m = bench_moe(pool, lib, target, fmt, E, D, I, int(k), a.reps, a.tokens)
        bws.append(read_bandwidth(pool, lib, target, 1 << 30, max(5, a.reps // 2)) / 1e9)
        bw = statistics.median(bws[-2:])
        print(f"moe {fmt} E{E} D{D} I{I} top{k}: gate_up {m['gate_up_gbps']:.2f} GB/s, down {m['down_gbps']:.2f} GB/s, "
              f"together {m['total_gbps']:.2f} GB/s = {m['total_gbps'] / bw:.0%} of read bw {bw:.2f}"
              + (f"; M={a.tokens}: gate_up {m['gate_up_s'] * 1e3:.1f} ms, down {m['down_s'] * 1e3:.1f} ms" if a.tokens > 1 else ""))
        rows.append(dict(format=fmt, kind="moe", E=E, D=D, I=I, top_k=int(k), M=a.tokens, read_gbps=bw, **m))
    print(f"read bandwidth over the run: median {statistics.median(bws):.2f} GB/s, "
          f"min {min(bws):.2f}, max {max(bws):.2f} ({len(bws)} measurements)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"read_bandwidth_gbps": bws, "threads": a.threads, "cpu": target.cpu, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
