"""The server's device work, outside the server: decode steps of R rows (XLAExecutor.batch_step,
as strata-server runs them) and one-row prefills of T tokens, per size, on a compiled plan:

    python benchmarks/batch_steps.py PLAN_DIR [--rows 1,4,16,64] [--steps 48] [--context 300]
        [--prefill 32,128,512] [--profile 16,64] [--json OUT]

Per row count: ms per step with each step launched before the last one is read (what the server
does while every sequence is greedy) and with each step read before the next (a sampled
sequence in the batch), and the output tok/s of the first. Per prompt length: ms per prefill
(the last token's logits on the host). --profile R: the costliest GPU kernels of R-row steps
(device time per step, from a JAX profiler trace), to see where a step goes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plan", type=Path)
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--context", type=int, default=300, help="tokens already in each row's cache")
    ap.add_argument("--prefill", default="32,128,512")
    ap.add_argument("--profile", default="", help="row counts whose steps are profiled")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from common import device_kernels

    from strata_compiler.kv_cache import KVCache
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.session import Session

    plan = load_plan(args.plan)
    s = Session(plan, "xla")
    exe = s.batch_stepper()
    if exe is None:
        print("error: the plan does not run whole on one xla device (no batch steps)", file=sys.stderr)
        return 1
    m = plan.meta["model"]
    rows_list = [int(r) for r in args.rows.split(",")]
    Bc = max(rows_list)
    cap = -(-(args.context + 2 * args.steps + 64) // 64) * 64
    kv = KVCache(m["n_layers"], Bc, m["n_kv_heads"], m["head_dim"], cap)
    rng = np.random.default_rng(0)
    host = rng.integers(3, m["vocab_size"] - 1, Bc).astype(np.int32)
    ones, zeros = np.ones(Bc, bool), np.zeros(Bc, bool)
    out = {"decode": [], "prefill": []}

    def chain(R: int, n: int) -> None:
        tok, _ = exe.batch_step(kv, R, host, ones)
        for _ in range(n - 1):
            tok, _ = exe.batch_step(kv, R, host, zeros, tok)
        exe.fetch(tok)

    def sync(R: int, n: int) -> None:
        tok = None
        for _ in range(n):
            tok, logits = exe.batch_step(kv, R, host, ones if tok is None else zeros, tok)
            exe.fetch(tok)

    print(f"{'rows':>5} {'ahead ms/step':>14} {'sync ms/step':>13} {'tok/s (ahead)':>14}", flush=True)
    for R in rows_list:
        kv.length = args.context
        chain(R, 2)         # compile
        res = {}
        for name, fn in (("ahead", chain), ("sync", sync)):
            kv.length = args.context
            t = time.perf_counter()
            fn(R, args.steps)
            res[name] = (time.perf_counter() - t) / args.steps * 1e3
        out["decode"].append({"rows": R, "ahead_ms": res["ahead"], "sync_ms": res["sync"],
                              "tok_s": R * 1e3 / res["ahead"]})
        print(f"{R:>5} {res['ahead']:>14.2f} {res['sync']:>13.2f} {R * 1e3 / res['ahead']:>14.1f}", flush=True)
        if str(R) in args.profile.split(","):
            kv.length = args.context
            got = device_kernels(lambda: chain(R, 8))
            if got is not None:
                per, busy, span = got
                print(f"  8 steps of {R} rows: kernels busy {busy / 8e3:.2f} ms per step over a {span / 8e3:.2f} ms span")
                for name, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:12]:
                    print(f"    {us / 8e3:7.3f} ms/step {100 * us / busy:5.1f} %  x{n // 8:<4d} {name[:90]}")

    pre = KVCache(m["n_layers"], 1, m["n_kv_heads"], m["head_dim"], 1088)
    s.cache = pre
    print(f"{'prompt':>7} {'ms/prefill':>11} {'tok/s':>9}", flush=True)
    for T in (int(t) for t in args.prefill.split(",") if t):
        ids = rng.integers(3, m["vocab_size"] - 1, (1, T))
        times = []
        for i in range(6):
            pre.length = 0
            t = time.perf_counter()
            s.step(ids, last_only=True)
            if i:       # the first compiles
                times.append(time.perf_counter() - t)
        ms = float(np.median(times)) * 1e3
        out["prefill"].append({"tokens": T, "ms": ms, "tok_s": T * 1e3 / ms})
        print(f"{T:>7} {ms:>11.2f} {T * 1e3 / ms:>9.1f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
