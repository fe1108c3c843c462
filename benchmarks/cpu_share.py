"""A mixed plan's CPU partitions timed alone, with the MoE op taken apart, on cold experts.

    python benchmarks/cpu_share.py PLAN_DIR [--experts 1,2,4,8] [--reps 200] [--device auto|cpu]

In a fused decode step (runtime/fused_step.py) each CPU partition runs inside a host call; on
the H200 the hot-25 plan's took 330 µs each for ~3 cold experts, about twice what their weight
bytes cost at the CPU's measured GEMV rate. This runs the same partitions outside any GPU
program: after a prompt and two decode steps (so every frame exists), each CPU partition's
`run_segment` is called --reps times with its GPU-made inputs left in its frame buffers and,
for every MoE op in it, k experts of its share chosen at random per call (so the weights come
from DRAM, not the cache, as in a real decode), for each k of --experts. It prints per
partition and k: the segment's median µs, and the MoE op's phases (masking, routing pairs, q8
quantization of x and h, gate/up, down: LLVMExecutor.phase_ns) with the
weight GB/s of the two matrix kernels.

Run it on the machine whose fused step is in question; against switch_breakdown.py's fused
timeline, the gap between the two is what the host call's surroundings cost. "native us" is
the same segment run as one native program (backends/llvm_cpu/pool.py strata_run_program: what a
fused step's host call runs; the phase timer needs the Python path, so the phases are of that).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout, installed or not

PHASES = ("moe.mask", "moe.pairs", "moe.quant_x", "moe.gate_up", "moe.quant_h", "moe.down")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("plan_dir", type=Path)
    ap.add_argument("--experts", default="1,2,4,8", help="experts chosen per MoE op per call (k)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--partitions", type=int, default=2, help="time at most this many CPU partitions")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu"], help="where the plan's xla partitions run")
    a = ap.parse_args()

    from strata_compiler.backends.llvm_cpu import executor as lx
    from strata_compiler.backends.llvm_cpu.pool import get_pool
    from strata_compiler.ir import Op
    from strata_compiler.experts import static_nonresident
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.session import Session

    from strata_compiler.errors import StrataError

    try:
        s = Session(load_plan(a.plan_dir, verify_weights="none"), "auto", device=a.device, expert_cache=False)
    except StrataError as e:
        print(f"cpu_share.py: error: {e}", file=sys.stderr)
        return 2
    parts = [p[1] for p in getattr(s.executor, "parts", []) if isinstance(p[1], lx.LLVMExecutor)]
    if not parts and isinstance(s.executor, lx.LLVMExecutor):
        parts = [s.executor]
    if not parts:
        print(f"cpu_share.py: error: {a.plan_dir} runs nothing on the llvm backend", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    s.reset(1, 64)
    s.step(rng.integers(0, 1000, (1, 8)))
    for _ in range(2):
        s.step(rng.integers(0, 1000, (1, 1)))
    ks = [int(x) for x in a.experts.split(",")]
    print(f"{a.plan_dir}: {len(parts)} CPU partitions, {get_pool().n_threads} threads, {a.reps} calls per row")
    print(f"{'partition':>9s} {'k':>3s} {'segment us':>10s} {'native us':>9s} " + " ".join(f"{p[4:]:>9s}" for p in PHASES)
          + f" {'gate_up GB/s':>12s} {'down GB/s':>9s}")
    for pi, exe in enumerate(parts[:a.partitions]):
        frame, _ = exe.frames[1]
        env = {i: lx.IN_FRAME for i in exe.inputs}
        ids = np.zeros((1, 1), np.int64)
        moes = []
        for n in exe.nodes:
            if n.op is Op.MOE_FFN:
                # the routing weights, and every buffer they are copied through on the way in
                # (a transfer op re-copies its operand each call)
                combs, r = [], exe.g.node(n.args[1])
                while True:
                    combs.append(frame.out(r))
                    if r.op is not Op.TRANSFER:
                        break
                    r = exe.g.node(r.args[0])
                E = exe.g.weight(n.weight("down")).shape[0]
                mine = np.array(n.attr("experts", ()) or range(E))
                if n.attr("cache", ""):     # an expert cache's host side: the experts the plan leaves on the host
                    mine = np.flatnonzero(static_nonresident(exe.g, n))
                moes.append((combs, mine))
        if not moes:
            continue
        # whether the segment runs as one program
        as_program = exe.host_program(frame, exe.frames[1][1], lx.Step(1, 1, s.cache), 0, len(exe.nodes)) is not None
        def segment_ns(k: int) -> list[int]:
            seg = []
            for _ in range(a.reps + 5):
                for combs, mine in moes:
                    pick = rng.choice(mine, min(k, len(mine)), replace=False)
                    for comb in combs:
                        comb[:] = 0
                        comb[0, pick] = 1.0 / k
                t0 = time.perf_counter_ns()
                exe.run_segment(env, ids, s.cache)
                seg.append(time.perf_counter_ns() - t0)
            return seg[5:]

        for k in ks:
            exe.phase_ns = {}                # op by op in Python, the MoE op's phases timed
            seg = segment_ns(k)
            ph = {key: v[5 * len(moes):] for key, v in exe.phase_ns.items()}
            exe.phase_ns = None
            native = statistics.median(segment_ns(k)) / 1e3 if as_program else float("nan")   # one program
            med = {key: statistics.median(v) for key, v in ph.items()}
            gu = sum(ph["moe.gate_up_bytes"]) / max(1, sum(ph["moe.gate_up"]))
            dn = sum(ph["moe.down_bytes"]) / max(1, sum(ph["moe.down"]))
            print(f"{pi:>9d} {k:>3d} {statistics.median(seg) / 1e3:10.1f} {native:9.1f} "
                  + " ".join(f"{med[p] / 1e3:9.1f}" for p in PHASES) + f" {gu:12.2f} {dn:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
