"""Ragged decode check on any plan and backend: sequences prefilled alone, moved into one batch
cache (Session.load_row) at different lengths, then decoded together; each row's logits against
the same sequence decoded alone, as max |difference| / std of its logits, per step.

    python benchmarks/ragged_check.py PLAN_DIR [--backend auto] [--device auto] [--lens 5,9,3,17] [--steps 4]

Prints one line per step and `ok` when every difference is at most --tol (default 1e-3: bf16
compute on a GPU batches rows differently; f32 CPU paths give ~1e-6).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from strata_compiler.kv_cache import KVCache
from strata_compiler.runtime.plan import load_plan
from strata_compiler.runtime.session import Session


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--lens", default="5,9,3,17")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tol", type=float, default=1e-3)
    a = ap.parse_args(argv)
    plan = load_plan(a.plan)
    m = plan.meta["model"]
    lens = [int(x) for x in a.lens.split(",")]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, m["vocab_size"], n) for n in lens]
    s = Session(plan, a.backend, device=a.device)
    cap = 64 * (1 + (max(lens) + a.steps + 16) // 64)
    feed = rng.integers(0, m["vocab_size"], (len(lens), a.steps))
    alone, singles = [], []
    for i, p in enumerate(prompts):
        s.reset(1, cap)
        s.step(p[None])
        singles.append(s.cache)
        s.reset(1, cap)
        s.step(p[None])
        alone.append([s.step(feed[i:i + 1, t:t + 1])[0, -1] for t in range(a.steps)])
    big = KVCache(m["n_layers"], len(lens), m["n_kv_heads"], m["head_dim"], cap)
    s.cache = big
    s.step(np.zeros((len(lens), 1), np.int64))      # the batch cache placed where the executor keeps it
    for i, c in enumerate(singles):
        s.load_row(big, i, c)
    worst = 0.0
    for t in range(a.steps):
        got = s.step(feed[:, t:t + 1])[:, -1]
        errs = [float(np.abs(got[i] - alone[i][t]).max() / alone[i][t].std()) for i in range(len(lens))]
        worst = max(worst, *errs)
        print(f"step {t}: positions {(big.lengths - 1).tolist()}  max|diff|/std per row " +
              " ".join(f"{e:.2e}" for e in errs))
    print(f"backend {s.backend}: worst {worst:.2e} -> {'ok' if worst <= a.tol else 'FAIL'}")
    return 0 if worst <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
