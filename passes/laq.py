"""Layer-adaptive quantization: a storage format per weight tensor, from measured error, under a
size budget (`stratac compile --bits B` or `--memory-budget SIZE`).

For every weight t whose format it decides (`formats.adaptive`: the linear layers' matrices —
fused weights such as q_k_v or gate_up are one tensor, so their parts share a format — and the
token embedding table, which is the lm_head too in tied models) and every candidate format f,
the pass measures

    err(t, f) = sum_e  a_e  sum_{n,k}  imp[e, k] * (W[e, n, k] - Q_f(W)[e, n, k])^2

— the expected squared error f adds to t's output on the calibration activations: imp is the
mean square of each input column (the calibration probe's imatrix; 1 without --calib), and a_e
weighs expert e by its routing frequency x mean squared routing weight (1 for dense weights).
Q_f uses the same importance for its scales. Big tensors are measured on an evenly spaced subset
of their rows (`max_rows` per expert) and scaled up.

Then it solves the multiple-choice knapsack  min sum_t err(t, f_t)  s.t.  sum_t bytes(t, f_t) <=
budget  exactly up to the budget's discretisation (a dynamic program over 20000 budget units),
and a greedy pass spends what the rounding left on the best error drop per byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from strata_compiler.errors import UsageError
from strata_compiler.formats import get_format

CANDIDATES = ("int2", "int3", "int4", "int4a", "fp8", "int8", "bf16")


def candidates(spec) -> tuple[str, ...]:
    """The formats the allocator may give a weight: every candidate, and for the embedding
    table also f32 (it starts there; a generous budget may keep it)."""
    return CANDIDATES + ("f32",) if spec.name == "embed" else CANDIDATES


@dataclass(frozen=True)
class Option:
    fmt: str
    nbytes: int
    error: float


def _sample_rows(spec, store, max_rows: int):
    """[(expert or None, f32 rows [n, K], scale = all rows / sampled rows)] for the weight."""
    from strata_compiler.weights import iter_blocks

    per = spec.shape[-2]
    step = max(1, per // max_rows)
    out: dict = {}
    seen: dict = {}
    for e, block in iter_blocks(spec, store, with_expert=True):
        k = seen.get(e, 0)
        idx = [i for i in range(block.shape[0]) if (k + i) % step == 0]
        seen[e] = k + block.shape[0]
        out.setdefault(e, []).append(block[idx])
    return [(e, np.concatenate(b, 0), per / sum(len(x) for x in b)) for e, b in out.items()]


def measure(spec, store, calib, group_size: int, candidates=CANDIDATES, max_rows: int = 256) -> list[Option]:
    """err(t, f) and bytes(t, f) for each candidate format (module docstring)."""
    imp = calib.importance(spec.name) if calib is not None else None
    a = calib.expert_weight(spec.name) if calib is not None else None
    rows = _sample_rows(spec, store, max_rows)
    opts = []
    for name in candidates:
        f = get_format(name)
        gs = group_size if f.grouped else 32
        errs = np.zeros(max(spec.experts, 1))          # per expert, summed as one array
        for e, w, scale in rows:
            ie = None if imp is None else (imp[e] if imp.ndim == 2 else imp)
            r = f.roundtrip(w, gs, ie)
            d2 = (w.astype(np.float64) - r) ** 2
            s = float((d2 * (1.0 if ie is None else ie[None, :])).sum()) * scale
            errs[e or 0] += s * (1.0 if a is None or e is None else float(a[e]))
        opts.append(Option(name, f.nbytes(spec.shape, gs), float(errs.sum())))
    return opts


PROBE_FORMAT = "int3"


def calibrate_errors(options: dict[str, list[Option]], sens: dict[str, float],
                     probe: str = PROBE_FORMAT) -> dict[str, list[Option]]:
    """Scale each tensor's proxy errors so that its error at the probe format equals the KL
    measured there: the proxy orders formats within a tensor, the probe says how much the
    tensor matters to the output."""
    out = {}
    for name, opts in options.items():
        at = next((o.error for o in opts if o.fmt == probe), 0.0)
        s = sens.get(name)
        k = s / at if (s is not None and at > 0) else 1.0
        out[name] = [Option(o.fmt, o.nbytes, o.error * k) for o in opts]
    return out


def allocate(options: dict[str, list[Option]], budget: int, resolution: int = 20000) -> dict[str, Option]:
    """Pick one option per tensor: minimal total error with total bytes <= budget.

    A dynamic program over the budget in `resolution` units (each option's bytes rounded up, so
    its answer always fits) solves the multiple-choice knapsack; a greedy pass then spends the
    bytes the rounding left over on the upgrades with the best error drop per byte."""
    names = sorted(options)
    smallest = sum(min(o.nbytes for o in options[n]) for n in names)
    if smallest > budget:
        raise UsageError(f"size budget of {budget} bytes is below the smallest possible ({smallest} bytes: every "
                         f"tensor at its smallest format); raise --bits / --memory-budget")
    unit = max(1.0, budget / resolution)
    B = int(budget // unit)
    inf = float("inf")
    dp = np.zeros(B + 1)                           # best error using at most b units
    picks = []
    for n in names:
        new = np.full(B + 1, inf)
        arg = np.zeros(B + 1, np.int16)
        for i, o in enumerate(options[n]):
            c = int(math.ceil(o.nbytes / unit))
            if c > B:
                continue
            cand = np.full(B + 1, inf)
            cand[c:] = dp[:B + 1 - c] + o.error
            better = cand < new
            new[better] = cand[better]
            arg[better] = i
        dp = new
        picks.append(arg)
    if not np.isfinite(dp[B]):                     # rounding up made it infeasible: smallest formats
        choice = {n: min(options[n], key=lambda o: o.nbytes) for n in names}
    else:
        choice, b = {}, B
        for n, arg in zip(reversed(names), reversed(picks)):
            o = options[n][int(arg[b])]
            choice[n] = o
            b -= int(math.ceil(o.nbytes / unit))
    left = budget - sum(o.nbytes for o in choice.values())
    while True:
        best = None
        for n in names:
            cur = choice[n]
            for o in options[n]:
                extra = o.nbytes - cur.nbytes
                gain = cur.error - o.error
                if gain > 0 and extra <= left and (best is None or gain / max(extra, 1) > best[0]):
                    best = (gain / max(extra, 1), n, o)
        if best is None:
            return choice
        _, n, o = best
        left -= o.nbytes - choice[n].nbytes
        choice[n] = o
