"""Prefill (and a short decode) of a compiled plan through the Python API, for the GPU's prefill work:

    python benchmarks/gpu_prefill.py PLAN_DIR [--lens 512,4096] [--repeats 3] [--n-new 0]
        [--backend auto] [--chunk N] [--profile] [--all-logits] [--json OUT]

Per prompt length: one untimed warm-up (compilation), then --repeats timed prefills of a random
prompt (token ids 3..vocab-1); prints the median prefill tok/s [min-max]. Only the last token's
logits reach the host, as in strata-run and the server (and llama-bench's pp); --all-logits
copies every token's. --profile adds the GPU
kernels of one prefill from a JAX profiler trace (the 15 costliest by device time), to see where
the time goes. Settings (e.g. STRATA_PALLAS=off for XLA's paths only) come from the
environment, one process per variant.
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
    ap.add_argument("--lens", default="512,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-new", type=int, default=0, help="decode steps after each prefill (their tok/s too)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--chunk", type=int, default=None, help="prompt tokens per prefill step (default: Session's)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--all-logits", action="store_true", help="every prompt token's logits to the host")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from common import device_kernels

    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.runtime.session import Session, Timings

    t0 = time.perf_counter()
    plan = load_plan(args.plan)
    session = Session(plan, args.backend)
    print(f"loaded {args.plan} on {session.backend} in {time.perf_counter() - t0:.1f} s", flush=True)
    vocab = int(plan.meta["model"]["vocab_size"])
    rng = np.random.default_rng(0)
    out = []
    for T in (int(t) for t in args.lens.split(",")):
        prompt = rng.integers(3, max(4, vocab - 1), (1, T))

        def once():
            session.timings = Timings()
            t = time.perf_counter()
            session.generate(prompt, args.n_new + 1 if args.n_new else 0, Sampler(), (), keep_logits=args.all_logits,
                             **({"prefill_chunk": args.chunk} if args.chunk else {}))
            wall = time.perf_counter() - t
            return session.timings.rates(), wall

        once()
        runs = [once() for _ in range(args.repeats)]
        pre = sorted(r[0][0] for r in runs)
        dec = sorted(r[0][1] for r in runs if r[0][1])
        row = dict(label=args.label, plan=str(args.plan), tokens=T, prefill_tok_s=float(np.median(pre)),
                   prefill_min=pre[0], prefill_max=pre[-1], decode_tok_s=float(np.median(dec)) if dec else None)
        out.append(row)
        print(f"{args.label} prefill {T}: {row['prefill_tok_s']:.1f} tok/s [{pre[0]:.1f}-{pre[-1]:.1f}]"
              + (f"  decode {row['decode_tok_s']:.1f} tok/s" if dec else ""), flush=True)
        if args.profile:
            got = device_kernels(once)
            if got is None:
                print("  (no GPU events)")
                continue
            per, busy, span = got
            print(f"  kernels of one prefill: busy {busy / 1e3:.2f} ms over a {span / 1e3:.2f} ms span")
            for name, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:15]:
                print(f"    {us / 1e3:8.2f} ms {100 * us / busy:5.1f} %  x{n:<5d} {name[:90]}")
            row["kernels"] = {k: v for k, v in sorted(per.items(), key=lambda kv: -kv[1][1])[:30]}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
