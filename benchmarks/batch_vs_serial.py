"""N requests at once against the same N one after another, through the Python API (the server's
scheduler): continuous batching should never be slower than serial.

    python benchmarks/batch_vs_serial.py PLAN [--conc 1,4,8] [--tokens 64] [--rounds 2] [--backend auto] [--sampled]

Each request: a short prompt, `--tokens` greedy tokens (EOS ignored; --sampled: the plan's default
sampling, a seed per request). Per concurrency N: the wall
time of N requests in turn, then of N threads submitting at once (max_batch = N), alternating for
--rounds (the first concurrent round left out of the median); prints the medians and serial / concurrent (> 1: batching is faster), and the first
round's concurrent time apart (its sequences are the first in the batch's other KV rows: memory
the process touches for the first time).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "To make a cup of tea, first", "Water boils at a temperature of",
           "The largest planet in our solar system", "In machine learning, overfitting means"]


def main() -> None:
    import strata

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan")
    ap.add_argument("--conc", default="1,4,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--sampled", action="store_true", help="the plan's default sampling instead of greedy")
    a = ap.parse_args()
    how = {} if a.sampled else {"temperature": 0}
    print("| concurrency | serial s | concurrent s | serial / concurrent | concurrent tok/s | first concurrent s |")
    print("|---|---|---|---|---|---|")
    for n in (int(c) for c in a.conc.split(",")):
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
        with strata.load(a.plan, backend=a.backend, max_batch=n) as m:
            def one(p: str) -> None:
                m.generate(p, max_tokens=a.tokens, ignore_eos=True, seed=len(p), **how)
            one("warm up")
            serial, conc = [], []
            for _ in range(a.rounds):
                t = time.perf_counter()
                for p in prompts:
                    one(p)
                serial.append(time.perf_counter() - t)
                threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
                t = time.perf_counter()
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                conc.append(time.perf_counter() - t)
        s, c = statistics.median(serial), statistics.median(conc[1:] or conc)
        print(f"| {n} | {s:.2f} | {c:.2f} | {s / c:.2f} | {n * a.tokens / c:.1f} | {conc[0]:.2f} |")


if __name__ == "__main__":
    main()
