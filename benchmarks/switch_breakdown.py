"""Where a mixed plan's decode step goes on the host, by category, in µs per token.

    python benchmarks/switch_breakdown.py PLAN_DIR [PLAN_DIR ...] [--n-new 48] [--device auto|cpu]
        [--ab VAR=V1,V2,... | --ab 'VAR=V1|V2|...']

A plan that splits layers between the GPU and the CPU crosses between them about twice per
layer. This decodes --n-new greedy tokens after a 32-token prompt (one warm-up pass first) and
times, with perf_counter wrappers around the runtime's own functions (not cProfile, whose
per-call overhead swamps calls of a few µs):

  xla call      the jitted partition calls (the dispatch: argument handling, launch)
  xla stage     host values written into the partitions' device staging arrays (raw copies)
  fetch wait    a CPU kernel's GPU operand: waiting for the partition that makes it
  fetch copy    ... and its device->host copy
  llvm          the CPU partitions' kernels (and their Python glue)
  cache copy    expert-cache copies into GPU slots (swaps after a miss)
  other         the rest of the step (the runtime's loop, sampling glue, expert-cache work)

with the number of calls per token of each, and the values that cross per token (count, bytes).
Decode steps of plans on one GPU run as one program (runtime/fused_step.py): there the jitted
calls, staging and fetches are gone and the program's time shows as "other", with the CPU
partitions still under "llvm"; the plan's line then adds the fused step's own timeline (dispatch,
the host calls' work and the stretches between them, medians).
Prints one table per plan, then one row per plan side by side. With --ab, each plan runs once per
value of the environment variable (in this process, a fresh session each: for settings the
runtime reads when a session starts, such as STRATA_HAND_OFF_SPIN_US), and each run's decode
logits are compared with the first value's: max |difference| and greedy tokens equal.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout, installed or not

CATS = ("xla call", "xla stage", "fetch wait", "fetch copy", "llvm", "cache copy", "other")


class Meter:
    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        self.on = False

    def add(self, cat: str, dt: float) -> None:
        if self.on:
            self.s[cat] += dt
            self.n[cat] += 1


def instrument(m: Meter):
    """Wrap the runtime's functions; returns an undo callable."""
    from strata_compiler.backends.llvm_cpu import executor as lx
    from strata_compiler.backends.xla import cuda_rt
    from strata_compiler.backends.xla import executor as xx

    saved = []

    def patch(obj, name, make):
        orig = getattr(obj, name)
        saved.append((obj, name, orig))
        setattr(obj, name, make(orig))

    def timed(cat, sub=()):
        def make(orig):
            def f(*a, **k):
                before = {c: m.s[c] for c in sub}
                t0 = time.perf_counter()
                try:
                    return orig(*a, **k)
                finally:
                    dt = time.perf_counter() - t0 - sum(m.s[c] - before[c] for c in sub)
                    m.add(cat, dt)
            return f
        return make

    patch(cuda_rt.Staging, "stage", timed("xla stage"))
    patch(xx.XLAExecutor, "run_partition", timed("xla call", ("xla stage",)))
    patch(cuda_rt, "to_host", timed("fetch copy"))
    patch(cuda_rt, "fetch_into", timed("fetch wait", ("fetch copy",)))
    patch(lx.LLVMExecutor, "_fetch", timed("_fetch", ("fetch wait", "fetch copy")))   # the fallback path
    patch(lx.LLVMExecutor, "run_segment", timed("llvm", ("fetch wait", "fetch copy", "_fetch")))
    from strata_compiler.runtime.expert_swaps import ExpertSwaps

    patch(ExpertSwaps, "_copy_in", timed("cache copy", ("xla stage", "fetch wait", "fetch copy")))

    def undo():
        for obj, name, orig in reversed(saved):
            setattr(obj, name, orig)
    return undo


def crossings(executor) -> tuple[int, int]:
    """(values, bytes) per decode token that cross between partitions of different kinds."""
    parts = getattr(executor, "parts", [])
    if not parts:
        return 0, 0
    g = executor.g
    part_of = {nid: i for i, (_, _, ids) in enumerate(parts) for nid in ids}
    seen, nbytes = set(), 0
    for i, (kind, _, ids) in enumerate(parts):
        for nid in ids:
            for a in g.node(nid).args:
                j = part_of[a]
                if j != i and parts[j][0] != kind and (a, i) not in seen:
                    seen.add((a, i))
                    nbytes += g.node(a).type.bytes_per_token()
    return len(seen), nbytes


def fused_summary(tl: list) -> str:
    """A fused step's timeline (runtime/fused_step.py) in medians per step: the dispatch call,
    dispatch to the first host call, the host calls' Python work, the gaps between host calls (the
    GPU's share of a layer, the handler's copies and the callback's entry), last call to done."""
    steps, cur = [], None
    for ev, _, t in tl:
        if ev == "dispatch":
            cur = {"t0": t, "enter": [], "leave": []}
            steps.append(cur)
        elif cur is not None:
            cur.setdefault(ev, t) if ev in ("dispatched", "done") else cur[ev].append(t)
    rows = [st for st in steps if st["enter"] and "done" in st]
    if not rows:
        return ""
    med = lambda xs: float(np.median(xs)) / 1e3 if xs else float("nan")     # noqa: E731
    disp = med([st["dispatched"] - st["t0"] for st in rows])
    first = med([st["enter"][0] - st["t0"] for st in rows])
    work = med([b - a for st in rows for a, b in zip(st["enter"], st["leave"])])
    gaps = med([b - a for st in rows for a, b in zip(st["leave"][:-1], st["enter"][1:])])
    tail = med([st["done"] - st["leave"][-1] for st in rows])
    return (f"; fused step: dispatch {disp:.0f} us, to first host call {first:.0f} us, host call work "
            f"{work:.0f} us x {len(rows[0]['enter'])}, gap between host calls {gaps:.0f} us, last call to done {tail:.0f} us")


def measure(plan_dir: Path, n_new: int, device: str, ref: list | None = None, host_trace: int = 0) -> dict:
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.session import Session

    s = Session(load_plan(plan_dir, verify_weights="none"), "auto", device=device)
    m = Meter()
    undo = instrument(m)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, min(4096, s.plan.meta["model"]["vocab_size"]), (1, 32)).astype(np.int64)
    logits: list[np.ndarray] = []
    fused = getattr(s.executor, "fused", None)
    try:
        for timed_pass in (False, True):
            s.reset(1, prompt.shape[1] + n_new + 8 + host_trace)
            tok = int(s.step(prompt)[0, -1].argmax())
            m.on = timed_pass
            if fused is not None and timed_pass:
                fused.timeline = []
            t0 = time.perf_counter()
            for _ in range(n_new - 1):
                out = s.step(np.array([[tok]], np.int64))[0, -1]
                tok = int(out.argmax())
                if timed_pass:
                    logits.append(np.array(out, np.float32))
            dt = time.perf_counter() - t0
            m.on = False
        host = None
        if host_trace:      # more steps under the JAX profiler: the host threads' time by event
            from benchmarks.common import host_self_times, profile_events

            def more():
                nonlocal tok
                for _ in range(host_trace):
                    tok = int(s.step(np.array([[tok]], np.int64))[0, -1].argmax())
            got = profile_events(more)
            host = host_self_times(*got) if got else {}
    finally:
        undo()
    steps = n_new - 1
    fused_line = fused_summary(fused.timeline) if fused is not None and fused.timeline else ""
    us = {c: 1e6 * m.s.get(c, 0.0) / steps for c in CATS[:-1]}
    us["fetch copy"] += 1e6 * m.s.get("_fetch", 0.0) / steps     # np.asarray fallback copies (no raw copy)
    us["other"] = 1e6 * dt / steps - sum(us.values())
    calls = {c: m.n.get(c, 0) / steps for c in CATS[:-1]}
    kinds = [k for k, _, _ in getattr(s.executor, "parts", [])]
    swaps = getattr(s.executor, "swaps", None)
    caches = swaps.caches if swaps is not None else []
    hits, miss = sum(c.hits for c, *_ in caches), sum(c.misses for c, *_ in caches)
    cache = (f"; expert caches: hit rate {hits / max(hits + miss, 1):.1%}, "
             f"{sum(c.bytes_moved for c, *_ in caches) / 2**20:.0f} MiB copied over both passes, "
             f"{swaps.pinned_bytes / 2**20:.0f} MiB pinned") if caches else ""
    nvals, nb = crossings(s.executor)
    diff = same = None
    if ref:         # the first A/B value's logits (teacher forcing differs once tokens do: count those)
        diff = max(float(np.abs(a - b).max()) for a, b in zip(logits, ref))
        same = sum(int(a.argmax() == b.argmax()) for a, b in zip(logits, ref))
    return {"name": plan_dir.name, "cache": cache + fused_line, "tok_s": steps / dt, "logits": logits, "diff": diff, "same": same, "us": us,
            "calls": calls, "host": host, "host_steps": host_trace, "parts": len(kinds), "xla_parts": kinds.count("xla"), "cross": nvals, "cross_bytes": nb, "step_us": 1e6 * dt / steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plans", type=Path, nargs="+")
    ap.add_argument("--n-new", type=int, default=48)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu"])
    ap.add_argument("--host-trace", type=int, default=0, metavar="N",
                    help="then N more decode steps under the JAX profiler: each host thread's self time by "
                         "event (XLA's dispatch and thunks, CUDA API calls), top 30, in us per step")
    ap.add_argument("--ab", help="VAR=V1,V2,... (or VAR=V1|V2|... for values holding commas): run each plan "
                                 "once per value of this environment variable")
    a = ap.parse_args()
    import os

    from strata_compiler.errors import StrataError

    var, values = None, [None]
    if a.ab:
        var, eq, vals = a.ab.partition("=")
        if not eq or not var or not vals:
            print(f"error: --ab {a.ab!r}: expected VAR=V1,V2,...", file=sys.stderr)
            return 2
        values = vals.split("|") if "|" in vals else vals.split(",")     # '|' for values holding commas
    rows = []
    for p in a.plans:
        ref = None
        for v in values:
            if var is not None:
                os.environ[var] = v
            try:
                r = measure(p, a.n_new, a.device, ref, a.host_trace)
            except StrataError as e:
                print(f"error: {p}: {e}", file=sys.stderr)
                return 2
            if var is not None:
                r["name"] = f"{p.name} {var}={v}"
                ref = ref or r["logits"]
            rows.append(r)
            report(r)
    width = max(16, *(len(r["name"]) for r in rows))
    print("\n" + f"{'plan':{width}} {'tok/s':>7} " + " ".join(f"{c:>10}" for c in CATS))
    for r in rows:
        print(f"{r['name']:{width}} {r['tok_s']:7.1f} " + " ".join(f"{r['us'][c]:10.0f}" for c in CATS)
              + (f"   logits max |diff| {r['diff']:.3g}, argmax equal {r['same']}/{len(r['logits'])}"
                 if r["diff"] is not None else ""))
    return 0


def report(r: dict) -> None:
    print(f"\n{r['name']}: {r['tok_s']:.1f} tok/s, {r['step_us']:.0f} us per token; {r['parts']} partitions "
          f"({r['xla_parts']} xla); {r['cross']} values cross devices per token ({r['cross_bytes']} B){r['cache']}")
    print(f"{'category':12} {'us/token':>9} {'calls/token':>12} {'us/call':>8}")
    for c in CATS:
        n = r["calls"].get(c, 0.0)
        print(f"{c:12} {r['us'][c]:9.0f} {n:12.1f} {r['us'][c] / n if n else float('nan'):8.1f}")
    if r.get("host") is not None:
        n = r["host_steps"]
        print(f"host threads under the profiler, {n} steps: self time by event, top 30")
        print(f"  {'thread':24} {'event':56} {'per step':>8} {'us/step':>8}")
        for (th, name), (cnt, us) in sorted(r["host"].items(), key=lambda kv: -kv[1][1])[:30]:
            print(f"  {th[:24]:24} {name[:56]:56} {cnt / n:8.1f} {us / n:8.1f}")


if __name__ == "__main__":
    sys.exit(main())
