"""What the device's choice of a token costs (backends/xla/sampling.py `choose`), its pieces, and
faster variants of it that choose the same tokens:

    python3 benchmarks/sampling_choice.py [--batches 1,16] [--runs 50] [--steps 64]
    python3 benchmarks/sampling_choice.py --check [--seeds 8]

The table: microseconds on JAX's default device (the GPU on the device machine, else the CPU) for
V = 32000 logits shaped like a trained model's (benchmarks/sampling.py's synthetic ones), k = 40, a
penalty window of 64 tokens (ids from the logits' head, some repeated), the chat defaults' knobs
(Sampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1)), at each
batch B. Three columns per B:

  call  the median of --runs jitted calls after a warm-up, each followed by block_until_ready:
        host dispatch included.
  step  the median over --runs / 5 (at least 10) calls of a jitted lax.fori_loop of --steps
        iterations, per iteration: each iteration's logits are x + s, s a zero made from all of
        the previous iteration's outputs (so nothing is hoisted out of the loop or left dead; a
        piece that returns logits passes them on as the next x), as the fused decode step runs
        `choose` with no dispatch of its own. The "loop: x + s alone" row is that scaffolding's
        own cost.
  kernels  the GPU's busy time per call (the sum of its kernels' durations, from a JAX profiler
        trace of 20 calls: what the choice adds inside a fused step, launch gaps aside) and, in
        brackets, kernels per call; "-" on the CPU.

Rows: `choose` sampled and with all_greedy; its pieces alone (lax.top_k(x, 40), the penalty's
[B, V] int8 scatter and select, jnp.argmax, sum(exp(x - max))); the variants defined here:

  top-k two-stage S=...  exact: x padded with -inf to C chunks of S, lax.top_k(min(k, S)) per
                chunk, lax.top_k(k) over the C x min(k, S) candidates in chunk order, their ids
                mapped back. Equal values keep lax.top_k's order (the lower id first): a chunk's
                candidates precede a later chunk's, within a chunk the lower id comes first, and
                the -inf padding comes after every real id.
  top-k staged S=..., fan F  the same with further stages over groups of F chunks' candidates
                (F x k) while there are more than that, before the last lax.top_k.
  penalty W     the penalty without a [B, V] scatter: the W window logits gathered, penalised and
                written back with one W-wide .at[].set (mode="drop"); a token repeated in the
                window and an id outside [0, V) get a distinct out-of-range index, so each distinct
                seen token is penalised once (the host's rule) and the indices are unique.
  choose_fast   choose with that penalty, that top-k (S=1024 where none is named: the fastest on
                an H100), and the max and the greedy rows' argmax from the top-k's first entry.

`choose` itself now takes the two-stage top-k (S = 1024), the max and argmax from its first
entry, and -0.0 as +0.0 (what choose_fast measured first; BENCHMARKS.md has the figures before).

On an H100 (jax 0.11.2), lax.top_k(x, 40) was nearly all of choose's cost: over a [1, 32000] row
it runs CUB's radix sort (4 passes and memsets, ~50 µs), over [16, 32000] XLA's sort of 32768
(10 kernels, ~110 µs); the penalty, argmax and exp-sum are a few µs each. lax.top_k with k <= 16
runs XLA's TopK kernel instead.

Signed zeros: lax.top_k's order of -0.0 and +0.0 depends on how it runs (XLA's sort: +0.0 first,
as on the CPU; CUB's radix sort and the TopK kernel: equal, by id), so `choose`'s order of such a
tie depends on the backend, B and k. choose_fast reads -0.0 as +0.0 in its top-k: equal logits
by id, the host sampler's order, everywhere; --check gives choose the logits with -0.0 as +0.0.

--check compares choose_fast's tokens with choose's on random inputs (ties, -inf logits, signed
zeros, windows with repeats, -1 and out-of-range ids, greedy rows mixed with sampled ones, several
knob sets, k in 1, 40, 64, 1024, several chunk sizes and fans) and exits 1 on any difference;
tests/test_sampling_choice_bench.py runs it on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))   # run from a checkout, installed or not

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from benchmarks.common import device_kernels  # noqa: E402
from benchmarks.sampling import synthetic_logits  # noqa: E402
from strata_compiler.backends.xla import sampling as ds  # noqa: E402
from strata_compiler.sampling import Sampling  # noqa: E402

V, K, W = 32000, 40, 64
CHAT = Sampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1, repeat_last_n=W)
CHUNKS = (256, 512, 1024, 2048, 4096)
TREES = ((256, 4), (512, 4), (1024, 4), (1024, 8))     # (chunk, fan) of the staged top-k's rows
FAST = ((1024, 0), (2048, 0), (512, 4), (1024, 4))       # choose_fast's rows
CHUNK = 1024        # choose_fast's chunk where none is named: the fastest two-stage top-k on an H100


# ----- the variants ---------------------------------------------------------------------------

def penalised(x, hist, p):
    """x f32 [B, V] with each distinct valid id of hist int32 [B, W] penalised by p f32 [B, 1]
    (a positive logit divided, another multiplied), as `choose` does, without a [B, V] scatter:
    W values gathered and set back."""
    B, Vx = x.shape
    Wh = hist.shape[1]
    if not Wh:
        return x
    i = jnp.arange(Wh)
    ok = (hist >= 0) & (hist < Vx)
    seen_before = ((hist[:, :, None] == hist[:, None, :]) & (i[None, :] < i[:, None])[None]).any(-1)
    at = jnp.where(ok & ~seen_before, hist, Vx + i[None, :])        # dropped: distinct, out of range
    v = jnp.take_along_axis(x, jnp.clip(hist, 0, Vx - 1), axis=1, mode="promise_in_bounds")
    v = jnp.where(v > 0, v / p, v * p)
    return x.at[jnp.arange(B)[:, None], at].set(v, mode="drop", unique_indices=True)


def top_k_chunked(x, k: int, chunk: int, fan: int = 0):
    """lax.top_k(x, k) (values and ids, equal values by id) in stages: lax.top_k(min(k, chunk))
    over each chunk of `chunk` ids (x padded with -inf), then lax.top_k(k) over the candidates in
    chunk order; with `fan`, the candidates first go through further such stages over groups of
    `fan` chunks' candidates (fan x k) while there are more than that."""
    vals, ids, S = x, None, chunk
    while True:
        B, n = vals.shape
        if n <= S or (ids is not None and not fan):
            v, j = lax.top_k(vals, k)
            return v, (j if ids is None else jnp.take_along_axis(ids, j, axis=1))
        C = -(-n // S)
        if C * S > n:       # -inf past the end: after every real entry, -inf ones too, in order
            vals = jnp.pad(vals, ((0, 0), (0, C * S - n)), constant_values=-jnp.inf)
            ids = None if ids is None else jnp.pad(ids, ((0, 0), (0, C * S - n)))
        kk = min(k, S)
        v, j = lax.top_k(vals.reshape(B, C, S), kk)                      # [B, C, kk]
        pos = (j + (jnp.arange(C, dtype=j.dtype) * S)[None, :, None]).reshape(B, C * kk)
        ids = pos if ids is None else jnp.take_along_axis(ids, pos, axis=1)
        vals, S = v.reshape(B, C * kk), fan * k


def top_k(x, k: int, chunk: int | None = None, fan: int = 0):
    """The exact top-k: staged over chunks (of CHUNK where None) when that cuts the candidates at
    least fourfold (k <= chunk / 4), else lax.top_k; a named chunk is always used."""
    if chunk is None:
        chunk = CHUNK
        if 4 * k > chunk or chunk >= x.shape[1]:
            return lax.top_k(x, k)
    return top_k_chunked(x, k, chunk, fan)


def choose_fast(x, hist, u, kn, k: int, all_greedy: bool, chunk: int | None = None, fan: int = 0):
    """backends/xla/sampling.py's `choose` (same arguments, same tokens) with the penalty of
    `penalised`, the top-k of `top_k`, and the max and argmax from its first entry (one pass over
    V fewer). A zero logit of either sign counts as +0 in the top-k: equal logits by id, as the
    host orders them (lax.top_k puts -0.0 below +0.0 where it sorts with XLA's own sort, and not
    where it uses CUB's radix sort or the small-k TopK kernel, so `choose`'s order of such a tie
    depends on the backend, B and k). NaN rows differ (the callers mark them; see decoding.py)."""
    x = x.astype(jnp.float32)
    if hist.shape[1]:
        x = penalised(x, hist, kn[:, 0:1])
    if all_greedy:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    vals, ids = top_k(jnp.where(x == 0, 0.0, x), k, chunk, fan)
    return ds.from_candidates(x, vals, ids, u, kn, k)


def penalty_scatter(x, hist, p):
    """`choose`'s penalty alone: a [B, V] int8 mark of the seen ids, then a select over V."""
    B, Vx = x.shape
    ok = (hist >= 0) & (hist < Vx)
    seen = jnp.zeros((B, Vx), jnp.int8).at[jnp.arange(B)[:, None], jnp.where(ok, hist, 0)].max(ok.astype(jnp.int8))
    return jnp.where(seen > 0, jnp.where(x > 0, x / p, x * p), x)


# ----- the check ------------------------------------------------------------------------------

# (V, W, k, chunk, fan, all_greedy): the shapes the check runs (choose_fast's arguments); each compiles once
CASES = (
    (32000, 64, 40, None, 0, False), (32000, 64, 40, 256, 0, False), (32000, 64, 40, 1000, 0, False),
    (32000, 64, 40, 1024, 4, False), (32000, 64, 1, None, 0, False), (32000, 64, 64, 2048, 0, False),
    (32000, 64, 64, 512, 2, False), (32000, 8, 1024, None, 0, False), (32000, 64, 1024, 2048, 0, False),
    (32000, 64, 40, None, 0, True), (1999, 8, 40, 128, 0, False), (1999, 0, 64, None, 0, False),
    (1999, 16, 1024, 512, 0, False), (1999, 8, 40, 64, 3, False), (1999, 0, 1, 100, 0, True),
)

SAMPLED = (CHAT, Sampling(), Sampling(top_p=1.0), Sampling(min_p=0.0), Sampling(top_k=5, temperature=1.5),
           Sampling(temperature=0.05, top_p=0.5, min_p=0.5), Sampling(temperature=5.0, min_p=0.0, top_p=0.99),
           Sampling(repetition_penalty=0.7), Sampling(repetition_penalty=1.0), Sampling(repetition_penalty=3.0),
           Sampling(min_p=1.0), Sampling(top_p=1.0, min_p=0.0, temperature=1.0))
GREEDY = (Sampling(temperature=0.0, repetition_penalty=1.2), Sampling(temperature=0.0, repetition_penalty=1.0),
          Sampling(temperature=0.0, repetition_penalty=0.8))


def case_inputs(r: np.random.Generator, B: int, Vx: int, Wh: int, k: int, all_greedy: bool):
    """Random (x, hist, u, kn) for `choose`: rows of ties, -inf logits, signed zeros; windows with
    repeats of head ids, -1 and ids past V; each row's knobs from SAMPLED (top-k capped at k) or
    GREEDY."""
    x = np.round(r.standard_normal((B, Vx)) * 3, 1).astype(np.float32)        # many equal logits
    for b in range(B):
        kind = r.integers(6)
        if kind == 1:       # several ids share the top logit
            x[b, r.choice(Vx, 1 + r.integers(1, 70), replace=False)] = x[b].max() + r.integers(0, 2)
        elif kind == 2:     # masked ids
            x[b, r.random(Vx) < r.choice([0.5, 0.99, 0.9995])] = -np.inf
        elif kind == 3:     # the top logit a zero of either sign, among many
            x[b] = -np.abs(x[b])
            z = r.choice(Vx, 80, replace=False)
            x[b, z] = np.where(r.random(80) < 0.5, -0.0, 0.0)
        elif kind == 4:     # a peaked row (shaped like a model's)
            x[b, r.choice(Vx, 50, replace=False)] += np.float32(12) - np.log1p(np.arange(50, dtype=np.float32)) * 3
    head = np.argsort(-x, axis=1, kind="stable")[:, :80]
    hist = np.where(r.random((B, Wh)) < 0.6, np.take_along_axis(head, r.integers(0, 80, (B, Wh)), 1),
                    r.integers(-1, Vx + 3, (B, Wh))).astype(np.int32)
    hist[r.random((B, Wh)) < 0.1] = -1
    u = r.random(B).astype(np.float32)
    u[r.random(B) < 0.15] = 0.0
    u[r.random(B) < 0.15] = np.float32(1 - 2 ** -24)
    rows = []
    for b in range(B):
        if all_greedy or r.random() < 0.25:
            rows.append(GREEDY[r.integers(len(GREEDY))])
            continue
        s = SAMPLED[r.integers(len(SAMPLED))]
        top = min(s.top_k, k) if r.random() < 0.7 else int(r.integers(1, k + 1))
        rows.append(replace(s, top_k=top))
    if all_greedy and r.random() < 0.5:     # all_greedy ignores sampled knobs too
        rows[0] = CHAT
    kn = np.stack([ds.knobs(s) for s in rows])
    return x, hist, u, kn


_jit_choose = jax.jit(ds.choose, static_argnums=(4, 5))
_jit_fast = jax.jit(choose_fast, static_argnums=(4, 5, 6, 7))


def check(seeds=range(8), cases=CASES, B: int = 8, device=None, out=sys.stdout) -> int:
    """Runs choose and choose_fast on each case's inputs for each seed (on `device`, else JAX's
    default); prints each difference and returns how many tokens differed. choose reads the
    logits with -0.0 as +0.0 (its order of a tie of signed zeros depends on the backend, B and
    k; choose_fast's is the host's)."""
    bad = total = 0
    with jax.default_device(device):
        for seed in seeds:
            for ci, (Vx, Wh, k, chunk, fan, greedy) in enumerate(cases):
                x, hist, u, kn = case_inputs(np.random.default_rng([seed, ci]), B, Vx, Wh, k, greedy)
                rest = [jnp.asarray(a) for a in (hist, u, kn)]
                want = np.asarray(_jit_choose(jnp.asarray(np.where(x == 0, np.float32(0), x)), *rest, k, greedy))
                got = np.asarray(_jit_fast(jnp.asarray(x), *rest, k, greedy, chunk, fan))
                total += B
                for b in np.flatnonzero(want != got):
                    bad += 1
                    print(f"seed {seed} V={Vx} W={Wh} k={k} chunk={chunk} fan={fan} greedy={greedy} row {b}: "
                          f"choose {want[b]}, choose_fast {got[b]}", file=out)
    print(f"check: {total - bad} of {total} tokens the same ({len(cases)} shapes x {len(seeds)} seeds)", file=out)
    return bad


# ----- the timings ----------------------------------------------------------------------------

def _block(out):
    return jax.block_until_ready(out)


def call_us(f, args, runs: int) -> float:
    jf = jax.jit(f)
    for _ in range(5):
        _block(jf(*args))
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        _block(jf(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def step_us(f, args, runs: int, steps: int) -> float:
    def loop(x, *rest):
        def body(_, c):
            x, s = c
            out = jax.tree.leaves(f(x + s, *rest))
            if out[0].shape == x.shape:         # logits out (a penalty): the next iteration's
                return out[0], s
            # every output read in full (no part of it left dead), times a zero XLA cannot fold away
            return x, sum(jnp.sum(o.astype(jnp.float32)) for o in out) * 0.0
        return lax.fori_loop(0, steps, body, (x, jnp.float32(0)))
    return call_us(loop, args, max(10, runs // 5)) / steps


def kernel_us(f, args, calls: int = 20) -> tuple[float, float] | None:
    """(GPU busy µs, kernels) per call over `calls` jitted calls, from a profiler trace; None
    where the device has no kernel events (the CPU)."""
    jf = jax.jit(f)
    _block(jf(*args))
    got = device_kernels(lambda: [_block(jf(*args)) for _ in range(calls)])
    if got is None:
        return None
    per, busy, _ = got
    return busy / calls, sum(n for n, _ in per.values()) / calls


def variants() -> list[tuple[str, object]]:
    """(label, f(x, hist, u, kn)) of each row of the table."""
    rows = [
        ("choose, sampled", lambda x, h, u, kn: ds.choose(x, h, u, kn, K, False)),
        ("choose, all_greedy", lambda x, h, u, kn: ds.choose(x, h, u, kn, K, True)),
        ("piece: lax.top_k(x, 40)", lambda x, h, u, kn: lax.top_k(x, K)),
        ("piece: penalty, [B, V] int8 scatter + select", lambda x, h, u, kn: penalty_scatter(x, h, kn[:, :1])),
        ("piece: jnp.argmax", lambda x, h, u, kn: jnp.argmax(x, axis=-1)),
        ("piece: sum(exp(x - max))", lambda x, h, u, kn: jnp.sum(jnp.exp(x - x.max(-1, keepdims=True)), -1)),
        ("loop: x + s alone", lambda x, h, u, kn: x[:, :1]),
    ]
    rows += [(f"variant: top-k two-stage S={s}", lambda x, h, u, kn, s=s: top_k_chunked(x, K, s)) for s in CHUNKS]
    rows += [(f"variant: top-k staged S={s}, fan {f}", lambda x, h, u, kn, s=s, f=f: top_k_chunked(x, K, s, f))
             for s, f in TREES]
    rows += [("variant: penalty, W gather + W set", lambda x, h, u, kn: penalised(x, h, kn[:, :1]))]
    rows += [(f"choose_fast, sampled, S={s}" + (f", fan {f}" if f else ""),
              lambda x, h, u, kn, s=s, f=f: choose_fast(x, h, u, kn, K, False, s, f)) for s, f in FAST]
    rows += [("choose_fast, all_greedy", lambda x, h, u, kn: choose_fast(x, h, u, kn, K, True))]
    return rows


def bench_inputs(B: int):
    x = synthetic_logits(V, B, seed=B)
    r = np.random.default_rng(B)
    head = np.argsort(-x, axis=1)[:, :200]
    hist = np.take_along_axis(head, r.integers(0, 200, (B, W)), 1).astype(np.int32)     # repeats too
    u = r.random(B).astype(np.float32)
    kn = np.tile(ds.knobs(CHAT), (B, 1))
    return [jnp.asarray(a) for a in (x, hist, u, kn)]


def table(batches, runs: int, steps: int) -> str:
    rows = variants()
    res = {}
    for B in batches:
        args = bench_inputs(B)
        a = [jax.jit(lambda *a: ds.choose(*a, K, False))(*args), jax.jit(lambda *a: choose_fast(*a, K, False))(*args)]
        assert np.array_equal(*map(np.asarray, a)), "choose_fast chose other tokens than choose"
        for label, f in rows:
            res[label, B] = (call_us(f, args, runs), step_us(f, args, runs, steps), kernel_us(f, args))
    head = "| what | " + " | ".join(f"B={B} call | B={B} step | B={B} kernels" for B in batches) + " |"
    lines = [(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; "
             f"V={V}, k={K}, window {W}, the chat defaults; µs, median"), "", head,
             "|---|" + "---:|---:|---:|" * len(batches)]

    def kernels(got):
        return "-" if got is None else f"{got[0]:.1f} ({got[1]:g})"
    for label, _ in rows:
        lines.append(f"| {label} | " + " | ".join(f"{res[label, B][0]:.1f} | {res[label, B][1]:.1f} | "
                                                   f"{kernels(res[label, B][2])}" for B in batches) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare choose_fast's tokens with choose's; exit 1 on a difference")
    ap.add_argument("--seeds", type=int, default=8, help="--check: seeds per shape")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--runs", type=int, default=50, help="timed calls per row (at least 50 counts)")
    ap.add_argument("--steps", type=int, default=64, help="iterations of the step column's loop")
    a = ap.parse_args(argv)
    if a.check:
        return 1 if check(range(a.seeds)) else 0
    print(table([int(b) for b in a.batches.split(",")], a.runs, a.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
