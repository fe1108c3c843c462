"""Where a decode step's time goes on the GPU: the kernels of one step, from XLA's optimized HLO.

    python benchmarks/gpu_profile.py [--work-dir /tmp/gpu_prof] [--format int4] [--layers 2]
        [--steps 8] [--hlo OUT.txt]

Builds the OLMoE-shaped benchmark model of gpu_decode.py with fewer layers (--layers), compiles it
at --format, and:
  * prints the operations of the decode loop's body that launch kernels (fusions, custom calls,
    copies, ...) by kind, per layer — each costs a launch and a tail, which bounds decode speed
    at batch 1 when there are many of them;
  * times --steps decode steps for 1 and for --layers layers' worth of work (the difference per
    layer is the per-layer cost; the rest is the embedding, lm_head and loop overhead).
Run it under Nsight Compute for per-kernel device times, e.g.
    ncu --metrics gpu__time_duration.sum --csv python benchmarks/gpu_profile.py --steps 2
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402

from common import device_kernels, env_set  # noqa: E402
from gpu_decode import FULL, TINY, build, log  # noqa: E402

KERNEL_OPS = ("fusion", "custom-call", "copy", "dynamic-update-slice", "sort", "reduce", "scatter", "gather",
              "dot", "convolution", "all-reduce", "transpose")


def body_ops(hlo: str) -> collections.Counter:
    """Kernel-launching instructions of the while loop's body computation(s), by kind."""
    comps = re.split(r"\n(?=\S)", hlo)
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    count: collections.Counter = collections.Counter()
    for c in comps:
        m = re.match(r"%?([\w.\-]+)\s", c)
        if not m or m.group(1) not in bodies:
            continue
        for line in c.splitlines()[1:]:
            m = re.search(r"=\s*\S+\s+([\w\-]+)\(", line)
            if not m:
                continue
            op = m.group(1)
            if op in KERNEL_OPS:
                kind = op
                if op == "fusion":
                    k = re.search(r"kind=(\w+)", line)
                    kind = f"fusion:{k.group(1) if k else '?'}"
                if op == "custom-call":
                    k = re.search(r'custom_call_target="([^"]+)"', line)
                    kind = f"custom-call:{k.group(1) if k else '?'}"
                count[kind] += 1
    return count


def kernel_times(exe, m, first, steps: int) -> None:
    """Device kernels of `steps` decode steps from a JAX profiler trace."""
    from strata_compiler.kv_cache import KVCache

    c = KVCache(m["n_layers"], 1, m["n_kv_heads"], m["head_dim"], 256)
    exe.new_cache(c)
    exe.run(np.arange(1, 33)[None], c)
    t0 = time.perf_counter()
    got = device_kernels(lambda: exe.greedy_decode(first, c, steps))
    wall = time.perf_counter() - t0
    if got is None:
        print("kernels: no device events in the trace (no GPU?)")
        return
    per, busy, span = got
    print(f"kernels over {steps} steps: wall {1e6 * wall / steps:.1f} us/step (profiler on); device events span "
          f"{span / steps:.1f} us/step, busy {busy / steps:.1f} us/step ({len(per)} distinct names)")
    print(f"  {'kernel':50s} {'per step':>8s} {'us/step':>8s} {'us each':>8s}")
    for name, (n, dur) in sorted(per.items(), key=lambda kv: -kv[1][1])[:40]:
        print(f"  {name[:50]:50s} {n / steps:8.2f} {dur / steps:8.2f} {dur / n:8.2f}")


GAP = 0.02     # a greedy step is clear when the reference's top-1/top-2 gap is >= GAP x std(logits)


def check(exe, plan, m, batch: int = 1) -> None:
    """Kernels on (exe) against a fresh executor with STRATA_PALLAS=off, for `batch` sequences
    of 32 prompt tokens: one decode step's logits, then 32 greedy tokens each. Then the same 32
    steps teacher-forced with the reference's tokens, one step at a time on both: the top-1
    agreement over all steps and over the sequences whose every step is clear (random models have
    near-ties, where executors that round differently pick different tokens)."""
    from strata_compiler.backends.xla.executor import XLAExecutor
    from strata_compiler.kv_cache import KVCache

    ids = (np.arange(1, 33)[None] + 7 * np.arange(batch)[:, None]) % m["vocab_size"]

    def run(e):
        c = KVCache(m["n_layers"], batch, m["n_kv_heads"], m["head_dim"], 256)
        e.new_cache(c)
        first = e.run(ids, c)[plan.graph.outputs[0]][:, -1].argmax(-1)
        logits = e.run(np.asarray(first)[:, None], c)[plan.graph.outputs[0]][:, -1]
        return logits, e.greedy_decode(logits.argmax(-1), c, 32), first

    got, got_toks, _ = run(exe)
    ref = XLAExecutor(plan.graph, plan.weights)
    with env_set("STRATA_PALLAS", "off"):
        want, want_toks, want_first = run(ref)
    err = float(np.abs(got - want).max() / want.std())
    same = got_toks == want_toks
    first = "" if same.all() else f" (first difference at step {int(np.argmin(same.all(0)))})"
    print(f"check: batch {batch}, decode logits max |kernels - XLA| = {err:.2e} x std; greedy tokens equal "
          f"{int(same.sum())}/{same.size}{first}")
    # teacher forcing: both executors see the reference's tokens, step by step
    caches = [KVCache(m["n_layers"], batch, m["n_kv_heads"], m["head_dim"], 256) for _ in range(2)]
    exe.new_cache(caches[0])
    exe.run(ids, caches[0])
    ref.new_cache(caches[1])
    with env_set("STRATA_PALLAS", "off"):
        ref.run(ids, caches[1])
    feeds = np.concatenate([np.asarray(want_first)[:, None], want.argmax(-1)[:, None], np.asarray(want_toks)[:, :-1]], 1)
    agree, gaps, worst = [], [], 0.0
    for t in range(feeds.shape[1]):
        feed = feeds[:, t:t + 1].astype(np.int64)
        g = exe.run(feed, caches[0])[plan.graph.outputs[0]][:, -1]
        with env_set("STRATA_PALLAS", "off"):
            w = ref.run(feed, caches[1])[plan.graph.outputs[0]][:, -1]
        top2 = np.sort(w, axis=-1)[:, -2:]
        gaps.append((top2[:, 1] - top2[:, 0]) / w.std(axis=-1))
        agree.append(g.argmax(-1) == w.argmax(-1))
        worst = max(worst, float((np.abs(g - w).max(-1) / w.std(-1)).max()))
    agree, gaps = np.stack(agree, 1), np.stack(gaps, 1)          # [batch, steps]
    clear = gaps.min(1) >= GAP
    print(f"check (teacher-forced, {feeds.shape[1]} steps): logits max |kernels - XLA| = {worst:.2e} x std; top-1 "
          f"equal {int(agree.sum())}/{agree.size}; sequences whose every step has a gap >= {GAP} x std: "
          f"{int(clear.sum())}/{batch}, their top-1 equal {int(agree[clear].sum())}/{int(clear.sum()) * agree.shape[1]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/gpu_prof"))
    ap.add_argument("--format", default="int4")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--tiny", action="store_true", help="the small model of gpu_decode.py --tiny (smoke test)")
    ap.add_argument("--hlo", type=Path, help="write the optimized HLO of the decode loop here")
    ap.add_argument("--kernels", action="store_true",
                    help="trace --steps decode steps with the JAX profiler (CUPTI) and print each device kernel's "
                         "time per step, and the device's busy time against the step's wall time")
    ap.add_argument("--check", action="store_true",
                    help="also compare one decode step's logits and 32 greedy tokens with the Pallas kernels "
                         "on against STRATA_PALLAS=off (the XLA path)")
    ap.add_argument("--check-batch", type=int, default=1, help="sequences per --check run (default 1)")
    a = ap.parse_args()
    rates = {}
    for layers in (1, a.layers):
        dims = dict(TINY if a.tiny else FULL, layers=layers)
        plans = build(a.work_dir / f"l{layers}", dims, [a.format])
        import jax
        import jax.numpy as jnp

        from strata_compiler.backends.xla.executor import XLAExecutor
        from strata_compiler.kv_cache import KVCache
        from strata_compiler.runtime.plan import load_plan

        plan = load_plan(plans[a.format], verify_weights="none")
        exe = XLAExecutor(plan.graph, plan.weights)
        m = plan.meta["model"]
        cap = 256
        c = KVCache(m["n_layers"], 1, m["n_kv_heads"], m["head_dim"], cap)
        exe.new_cache(c)
        first = exe.run(np.arange(1, 33)[None], c)[plan.graph.outputs[0]][:, -1].argmax(-1)
        if layers == a.layers:
            ks = {l: c.k[l] for l in exe.layers}
            vs = {l: c.v[l] for l in exe.layers}
            lowered = jax.jit(exe._ahead_chunk, static_argnums=(5,)).lower(
                exe.params, ks, vs, jnp.asarray(first, jnp.int32), jnp.asarray(c.lengths, jnp.int32), a.steps)
            hlo = lowered.compile().as_text()
            if a.hlo:
                a.hlo.write_text(hlo)
            ops = body_ops(hlo)
            total = sum(ops.values())
            print(f"decode loop body, {layers} layers: {total} kernel-launching ops "
                  f"(about {total / layers:.1f} per layer, embedding and lm_head included)")
            for k, v in ops.most_common():
                print(f"  {k:40s} {v:5d}")
        exe.greedy_decode(first, c, 4)
        # greedy_decode compiles for each new n: time the second of two runs of the same n
        for _ in range(2):
            c2 = KVCache(m["n_layers"], 1, m["n_kv_heads"], m["head_dim"], cap)
            exe.new_cache(c2)
            exe.run(np.arange(1, 33)[None], c2)
            t0 = time.perf_counter()
            exe.greedy_decode(first, c2, a.steps)
            rates[layers] = (time.perf_counter() - t0) / a.steps
        log(f"{layers} layer(s): {1e6 * rates[layers]:.1f} us per decode step")
        if a.kernels and layers == a.layers:
            kernel_times(exe, m, first, a.steps)
        if a.check and layers == a.layers:
            check(exe, plan, m, a.check_batch)
        del exe
    per_layer = (rates[a.layers] - rates[1]) / (a.layers - 1)
    print(f"per layer: {1e6 * per_layer:.1f} us; the rest (embedding, lm_head, loop): "
          f"{1e6 * (rates[1] - per_layer):.1f} us per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
