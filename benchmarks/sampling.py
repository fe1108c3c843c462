"""What choosing the next token costs (runtime/sampler.py), beside a decode step:

    python benchmarks/sampling.py [--plan PLAN_DIR] [--backend llvm] [--tokens 64] [--rounds 5]

Table 1, per vocabulary (32000, 49152, 151936) and batch (1, 8): microseconds per Sampler call for
greedy, for the default chat sampling (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat
penalty 1.1 over the last 64 of 300 tokens seen: strata_compiler.sampling.DEFAULTS), and for the
brute-force way the sampler worked before (float64 softmax and a full sort per row: what
tests/test_sampler.py checks the sampler against). The logits are synthetic and shaped like a
trained model's: a Zipf-like head of 2000 tokens (the top token's probability from ~0.3 to ~0.9)
over a normal tail of std 3; best of 5 runs of 20 calls, over 20 different rows.

Table 2, with --plan: strata's own decode (Session.generate, as strata-run and the scheduler step,
EOS ignored) per token at batch 1 and 8, greedy and with the default chat sampling; the ratio;
and the share of the sampled decode spent in the sampler (its calls timed inside the run). Each
value is the best of --rounds runs of --tokens tokens after a 300-token prompt, the greedy and the
sampled runs interleaved.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402

VOCABS = (32000, 49152, 151936)
BATCHES = (1, 8)
ROWS = 20           # distinct logit rows a measurement cycles through
SEEN = 300          # tokens of history per row (the penalty reads the last 64)


def synthetic_logits(V: int, n: int, seed: int = 0) -> np.ndarray:
    """n rows f32[n, V] shaped like a trained model's next-token logits (see the module docstring)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, V)) * 3).astype(np.float32)
    H = 2000
    for r in range(n):
        head = rng.choice(V, H, replace=False)
        x[r, head] = np.maximum(x[r, head], 16 - rng.uniform(0.9, 3.5) * np.log(np.arange(1, H + 1)))
    return x


def brute_force(logits: np.ndarray, history, s) -> np.ndarray:
    """The sampler as it was: a penalty over every id seen, float64 softmax, a full stable sort and
    rng.choice per row (the reference of tests/test_sampler.py)."""
    logits = np.array(logits, np.float32)
    for b, seen in enumerate(history):
        ids = np.unique(np.asarray(seen[-s.repeat_last_n:], np.int64))
        v = logits[b, ids]
        logits[b, ids] = np.where(v > 0, v / s.repetition_penalty, v * s.repetition_penalty)
    z = (logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)) / s.temperature
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    out = np.empty(len(p), np.int64)
    for b, row in enumerate(p):
        order = np.argsort(-row, kind="stable")
        n = min(int(np.searchsorted(np.cumsum(row[order]), s.top_p) + 1), s.top_k,
                max(1, int((row[order] >= s.min_p * row[order[0]]).sum())))
        keep = order[:n]
        out[b] = keep[s.rng.choice(n, p=row[keep] / row[keep].sum())]
    return out


def per_call_us(fn, batches: list, calls: int = 20, runs: int = 5) -> float:
    best = float("inf")
    fn(*batches[0])
    for _ in range(runs):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(*batches[i % len(batches)])
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def sampler_table() -> list[dict]:
    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.sampling import DEFAULTS

    rows = []
    for V in VOCABS:
        x = synthetic_logits(V, ROWS)
        hist = np.random.default_rng(1).integers(0, V, (ROWS, SEEN))
        for B in BATCHES:
            batches = [(x[np.arange(i, i + B) % ROWS], hist[np.arange(i, i + B) % ROWS]) for i in range(ROWS)]
            greedy, chat = Sampler(), Sampler.of(DEFAULTS, seed=0)
            rows.append({"V": V, "B": B,
                         "greedy": per_call_us(lambda lg, h: greedy(lg), batches),
                         "chat": per_call_us(lambda lg, h: chat(lg, h), batches),
                         "before": per_call_us(lambda lg, h: brute_force(lg, h, chat), batches, calls=4, runs=3)})
    return rows


def decode_table(plan_dir: Path, backend: str, tokens: int, rounds: int) -> tuple[int, list[dict]]:
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.runtime.session import Session
    from strata_compiler.sampling import DEFAULTS

    plan = load_plan(plan_dir)
    V = plan.meta["model"]["vocab_size"]
    session = Session(plan, backend)
    rng = np.random.default_rng(2)
    out = []
    for B in BATCHES:
        prompt = rng.integers(0, V, (B, 300))
        best = {"greedy": (float("inf"), 0.0), "sampled": (float("inf"), 0.0)}
        for _ in range(rounds):         # the two interleaved: a busy moment of the host hits both alike
            for name, sampler in (("greedy", Sampler()), ("sampled", Sampler.of(DEFAULTS, seed=0))):
                spent = [0.0]

                def timed(logits, history=None, sampler=sampler, spent=spent):
                    t0 = time.perf_counter()
                    try:
                        return sampler(logits, history)
                    finally:
                        spent[0] += time.perf_counter() - t0

                t = session.timings
                d0, n0 = t.decode_seconds, t.decode_tokens
                session.generate(prompt, tokens, _Timed(sampler, timed), (), keep_logits=False)
                steps = (t.decode_tokens - n0) / B
                ms = (t.decode_seconds - d0) / steps * 1e3
                if ms < best[name][0]:
                    best[name] = (ms, spent[0] / steps * 1e3)
        (g, _), (s, in_sampler) = best["greedy"], best["sampled"]
        out.append({"B": B, "greedy_ms": g, "sampled_ms": s, "ratio": s / g, "sampler_ms": in_sampler,
                    "share": in_sampler / s})
    return V, out


class _Timed:
    """A Sampler whose calls go through `timed` (Session.generate reads its flags, then calls it)."""

    def __init__(self, sampler, timed) -> None:
        self.sampler, self.timed = sampler, timed

    def __getattr__(self, name):
        return getattr(self.sampler, name)

    def __call__(self, logits, history=None):
        return self.timed(logits, history)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", type=Path, help="a compiled plan: time its decode greedy and sampled")
    ap.add_argument("--backend", default="llvm")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    step = None
    if a.plan:
        V, dec = decode_table(a.plan, a.backend, a.tokens, a.rounds)
        step = {(V, r["B"]): r["sampled_ms"] for r in dec}
    print("| vocab | batch | greedy µs | chat sampling µs | before (full sort) µs | chat sampling, "
          "% of a decode step |")
    print("|---|---|---|---|---|---|")
    for r in sampler_table():
        ms = (step or {}).get((r["V"], r["B"]))
        share = f"{r['chat'] / 1e3 / ms * 100:.1f} %" if ms else ""
        print(f"| {r['V']} | {r['B']} | {r['greedy']:.0f} | {r['chat']:.0f} | {r['before']:.0f} | {share} |")
    if a.plan:
        print()
        print(f"decode on {a.plan} ({a.backend}, vocab {V}): ms per step, best of {a.rounds} x {a.tokens} tokens")
        print()
        print("| batch | greedy ms | chat sampling ms | ratio | in the sampler ms | sampler share |")
        print("|---|---|---|---|---|---|")
        for r in dec:
            print(f"| {r['B']} | {r['greedy_ms']:.2f} | {r['sampled_ms']:.2f} | {r['ratio']:.3f} | "
                  f"{r['sampler_ms']:.3f} | {r['share'] * 100:.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
