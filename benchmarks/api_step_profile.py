"""Where a batch-1 decode step's time goes through the Python API (the server's scheduler) beside
strata-run's: the host's share of each scheduler method per step, and tokens/s.

    python benchmarks/api_step_profile.py PLAN [--tokens 128] [--backend auto] [--steps 1,8]

Per sampling (greedy; the plan's default sampling): one request of --tokens tokens (EOS ignored)
after a warm-up request; prints tokens/s and, per step, the microseconds spent in the scheduler's
methods (inclusive: _decode holds _launch and _finish, _finish holds the device wait `fetch`,
_launch the dispatch `batch_step`). What is not `fetch` is the host's: at batch 1 on a GPU it
must stay under the device's step for the API to decode as fast as strata-run. --steps: each
value of the batch step's decode steps per dispatch (the `decode_steps` setting) gets its rows,
side by side in one process; "per step" is per decode step (a dispatch of 8 counts 8).
"""

from __future__ import annotations

import argparse
import collections
import time


def main() -> None:
    import strata
    from strata_compiler.runtime import batching

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--steps", default="1", help="decode steps per dispatch to compare, e.g. 1,8")
    a = ap.parse_args()
    spent: collections.Counter = collections.Counter()

    def timed(fn, name):
        def run(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[name] += time.perf_counter() - t
        return run

    for name in ("_decode", "_launch", "_finish", "_admit", "_deliver", "_emit"):
        setattr(batching.BatchScheduler, name, timed(getattr(batching.BatchScheduler, name), name))
    prompt = "The history of the city"
    with strata.load(a.plan, backend=a.backend, max_batch=1) as m:
        st = m.engine.stepper
        if st is not None:
            for name in ("batch_step", "fetch"):
                setattr(st, name, timed(getattr(st, name), name))
        print("| sampling | steps a dispatch | tok/s | steps | host us/step by method (inclusive) |")
        print("|---|---|---|---|---|")
        for label, how, k in [(lb, h, int(k)) for k in a.steps.split(",")
                              for lb, h in (("greedy", {"temperature": 0}), ("plan default", {}))]:
            m.engine.decode_steps = k
            m.generate(prompt, max_tokens=a.tokens, ignore_eos=True, **how)
            spent.clear()
            s0 = m.engine.stats["steps"]
            t = time.perf_counter()
            m.generate(prompt, max_tokens=a.tokens, ignore_eos=True, **how)
            dt = time.perf_counter() - t
            steps = max(m.engine.stats["steps"] - s0, 1)
            parts = ", ".join(f"{k} {v / steps * 1e6:.0f}" for k, v in spent.most_common())
            print(f"| {label} | {k} | {a.tokens / dt:.1f} | {steps} | {parts} |")


if __name__ == "__main__":
    main()
