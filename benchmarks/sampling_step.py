"""What sampling costs a decode step end to end, and where the cost lands: greedy against a
sampling (the plan's own, by default the chat defaults: temperature 0.8, top-k 40, top-p 0.95,
min-p 0.05, repeat penalty 1.1 over 64) on one plan, as strata-run decodes (Session.generate:
decoding ahead where the plan allows it).

    python benchmarks/sampling_step.py PLAN [--tokens 256] [--rounds 3] [--backend auto]

Per mode, in alternating rounds (medians): decode tokens/s; per step, the wall time, the host's
time inside the launches of the step program (dispatch: when it grows, sampling costs the host),
and, from one more run under the JAX profiler, the GPU's busy time and kernel count (when those
grow, it costs the device). Issue 39 asks sampling under 5 % of a decode step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

from common import device_kernels  # noqa: E402


def _timed_launches(executor, spent: list):
    """Wrap executor._ahead_program so each launch of the step program adds its host time to spent."""
    real = executor._ahead_program

    def program(sampling):
        fn, state, const = real(sampling)

        def timed(*a):
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                spent.append(time.perf_counter() - t)
        return timed, state, const
    executor._ahead_program = program


def main() -> int:
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.sampler import Sampler, plan_sampling
    from strata_compiler.runtime.session import Session

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan", type=Path)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", default=None, help="gpu or cpu (default: the backend's choice)")
    a = ap.parse_args()
    plan = load_plan(a.plan)
    session = Session(plan, a.backend, **({"device": a.device} if a.device else {}))
    sampling = plan_sampling(plan.meta)
    ids = np.random.default_rng(0).integers(3, min(1000, plan.meta.get("vocab_size", 1000)), (1, 16))
    modes = {"greedy": lambda: Sampler(), f"sampled ({sampling.describe()})": lambda: Sampler.of(sampling, 7)}
    spent: list = []
    if hasattr(session.executor, "_ahead_program"):
        _timed_launches(session.executor, spent)
    rows = {m: {"tps": [], "wall": [], "launch": []} for m in modes}
    for r in range(a.rounds + 1):                   # round 0 compiles
        for m, sampler in modes.items():
            spent.clear()
            t = time.perf_counter()
            session.generate(ids, a.tokens, sampler())
            wall = time.perf_counter() - t
            if r:
                rows[m]["tps"].append(a.tokens / wall)
                rows[m]["wall"].append(wall / a.tokens * 1e6)
                rows[m]["launch"].append(sum(spent) / max(1, len(spent)) * 1e6 if spent else float("nan"))
    gpu = {m: device_kernels(lambda: session.generate(ids, a.tokens, s())) for m, s in modes.items()}
    print(f"plan {a.plan}, {a.tokens} tokens after a 16-token prompt, {a.rounds} rounds (medians; prefill "
          "included in the wall time)\n")
    print("| mode | tok/s | wall us/step | launch us/step (host) | GPU busy us/step | GPU kernels/step |")
    print("|---|---:|---:|---:|---:|---:|")
    for m, v in rows.items():
        g = gpu[m]
        busy = f"{g[1] / a.tokens:.0f}" if g else "-"
        kernels = f"{sum(c for c, _ in g[0].values()) / a.tokens:.0f}" if g else "-"
        print(f"| {m} | {statistics.median(v['tps']):.1f} | {statistics.median(v['wall']):.0f} | "
              f"{statistics.median(v['launch']):.0f} | {busy} | {kernels} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
