"""The GPU expert cache's policies replayed on a recorded routing trace: hit rate and copies.

    python benchmarks/cache_sim.py PLAN_DIR [--tokens 1200] [--calib 256] [--slots-frac 0.25]
        [--prefetch 0,1,2,4] [--json OUT]

PLAN_DIR is a plan whose MoE layers are whole (not split, no cache): the all-CPU `base` plan of
benchmarks/placement_bench.py, say. It decodes --tokens greedy tokens after a 32-token random
prompt on the llvm backend and records, per token and layer, the experts the router chose and
the experts the runtime's lookahead would predict (the layer's router applied to the residual
stream entering the layer, normed as the router's input is).

The first --calib tokens stand in for calibration: their routing frequencies pick the static
split's GPU experts (the hottest --slots-frac of each layer) and give the cache's prior. The
remaining tokens are replayed through runtime/expert_cache.py's ExpertCache itself, per token:
a simulated prefetch of the predicted experts (up to N copies a layer: `simulate_prefetch`; the
runtime's own prefetch was deleted in issue 41 after it cost more than it saved on the H200), then
the routing (hits and misses), then the reactive swaps after the step. No copy is timed: this
measures what a policy keeps resident and how many expert copies it asks for, which is the same on any machine; what a
copy costs against a CPU miss is the GPU run's business (placement_bench.py's hot-cache rows).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout, installed or not


def record(plan_dir: Path, tokens: int, seed: int = 0, sequences: int = 1
           ) -> tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray | None]:
    """(chosen, predicted) bool[tokens, layers, E], one expert's bytes, the decoded token ids
    i64[tokens], and the plan's calibrated routing frequencies f64[layers, E] (None without
    --calib), from greedy decodes: `sequences` of them, each after its own random 32-token
    prompt, tokens // sequences tokens each, one after the other in one session (as a server
    would run them)."""
    from strata_compiler.errors import UsageError
    from strata_compiler.ir import Op
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.session import Session

    plan = load_plan(plan_dir, verify_weights="none")
    g = plan.graph
    moes = [n for n in g.nodes if n.op is Op.MOE_FFN]
    if not moes:
        raise UsageError(f"{plan_dir}: the plan has no MoE layers")
    if any(n.attr("experts", ()) or n.attr("cache", "") for n in moes):
        raise UsageError(f"{plan_dir}: its MoE layers are split or cached; give a plan with whole layers "
                         f"(placement_bench.py's `base`, or stratac compile without --gpu-mem)")
    s = Session(plan, "llvm")
    exe = s.executor
    info = []
    for n in moes:
        r = g.node(n.args[1])
        lin = g.node(r.args[0])
        norm = g.node(lin.args[0])
        o = g.node(norm.args[0])
        if r.op is not Op.ROUTE or lin.op is not Op.LINEAR or norm.op is not Op.RMS_NORM or o.op is not Op.LINEAR:
            raise UsageError(f"{plan_dir}: moe_ffn %{n.id} is not fed by norm -> router -> route; no lookahead")
        info.append((r.id, o.args[1], plan.weights.get(lin.weight("w")), plan.weights.get(norm.weight("w")),
                     float(norm.attr("eps")), int(r.attr("k"))))
    E = g.weight(moes[0].weight("down")).shape[0]
    expert_bytes = sum(sum(a[0].nbytes for a in plan.weights.arrays(w).values()) for _, w in moes[0].weights)
    cal = (plan.meta.get("calibration") or {}).get("experts") or {}
    calib = np.array([cal[str(i)]["freq"] for i in range(len(moes))]) if len(cal) == len(moes) else None
    rng = np.random.default_rng(seed)
    per = tokens // sequences

    def start() -> int:
        prompt = rng.integers(0, min(1000, int(plan.meta["model"]["vocab_size"])), (1, 32))
        s.reset(1, 32 + per + 8)
        tok = int(np.argmax(s.step(prompt)[0, -1]))
        return int(np.argmax(s.step(np.array([[tok]]))[0, -1]))     # one decode step makes the M = 1 frame

    tok = start()
    # plan-memory reuses buffers within a step: copy each route's and trigger's value as it is made
    frame, ops = exe.frames[1]
    seen: dict[int, np.ndarray] = {}
    pos = {n.id: i for i, n in enumerate(exe.nodes)}
    for rid, trig, *_ in info:
        for nid in (rid, trig):
            i = pos[nid]

            def grab(step, f=ops[i], nid=nid):
                f(step)
                seen[nid] = frame.out(g.node(nid))[0].copy()
            ops[i] = grab
    exe._programs.clear()   # the wrapped ops have no native form: steps now run op by op, past the wrappers
    chosen = np.zeros((per * sequences, len(info), E), bool)
    pred = np.zeros_like(chosen)
    ids = np.zeros(per * sequences, np.int64)
    for t in range(per * sequences):
        if t and t % per == 0:
            tok = start()
        ids[t] = tok
        tok = int(np.argmax(s.step(np.array([[tok]]))[0, -1]))
        for li, (rid, trig, w, nw, eps, k) in enumerate(info):
            chosen[t, li] = seen[rid] != 0
            h = seen[trig].astype(np.float32)
            x = h / np.sqrt((h * h).mean() + eps) * nw
            pred[t, li, np.argpartition(-(x @ w.T), k - 1)[:k]] = True
    return chosen, pred, expert_bytes, ids, calib


def simulate_prefetch(c, predicted: np.ndarray, n: int) -> int:
    """Swap up to `n` predicted, non-resident experts into cache c ahead of the step, each only
    over a victim (a resident the prediction does not name) it would outscore after the step (its
    score plus the step's count and recency bonus; LRU admits always). Returns the copies."""
    margin = np.inf if c.policy == "lru" else 1.0 + c.recency
    copies = 0
    for e in sorted(np.flatnonzero(predicted & (c.nonresident != 0)).tolist(), key=lambda e: -c.score[e]):
        free = [i for i, r in enumerate(c.slots) if not predicted[r]]
        if copies >= n or not free:
            break
        slot = min(free, key=lambda i: c.score[c.slots[i]])
        if not c.score[e] + margin > c.score[c.slots[slot]]:
            break           # the best candidate against the weakest victim: no other pair passes
        c.nonresident[c.slots[slot]], c.nonresident[e] = 1.0, 0.0
        c.slots[slot] = e
        copies += 1
    return copies


def replay(chosen: np.ndarray, pred: np.ndarray, hot: np.ndarray, prior: np.ndarray | None,
           prefetch: int, swaps: int = 1, **cache_kw) -> tuple[float, float]:
    """(hit rate, expert copies per layer per token) of ExpertCache on the trace."""
    from strata_compiler.runtime.expert_cache import ExpertCache

    T, L, E = chosen.shape
    caches = [ExpertCache(f"L{i}", E, hot[i].astype(np.int32), max_swaps=swaps,
                          prior=None if prior is None else prior[i], **cache_kw) for i in range(L)]
    copies = 0
    for t in range(T):
        for i, c in enumerate(caches):
            if prefetch:
                copies += simulate_prefetch(c, pred[t, i], prefetch)
            c.observe(chosen[t, i][None, :].astype(np.float32))
        for c in caches:
            copies += len(c.plan_swaps())
    hits = sum(c.hits for c in caches)
    return hits / max(1, hits + sum(c.misses for c in caches)), copies / T / L


POLICIES = [   # (label, ExpertCache keywords, uses the calibrated prior)
    ("lru", dict(policy="lru"), False),
    ("hybrid, decay 0.9 (before 2026-11-30)", dict(decay=0.9, recency=0.5), False),
    ("hybrid, decay 0.99", dict(decay=0.99, recency=0.5), False),
    ("hybrid, decay 0.99, calibrated prior (default)", dict(decay=0.99, recency=0.5), True),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("plan_dir", type=Path)
    ap.add_argument("--tokens", type=int, default=1200, help="greedy tokens to decode and record")
    ap.add_argument("--calib", type=int, default=256, help="leading tokens used as the calibration")
    ap.add_argument("--sequences", type=int, default=1,
                    help="decode this many generations (each after its own random prompt), --tokens in all")
    ap.add_argument("--calib-plan", action="store_true",
                    help="take the static split and the prior from the plan's own calibration (stratac "
                         "compile --calib: what strata-B's split and the cache's prior use), not from the "
                         "leading --calib tokens of the decode; all --tokens are then replayed")
    ap.add_argument("--topics", type=int, default=0,
                    help="the model's --topics D (make_synthetic_model.py): also print how many decoded "
                         "tokens share the topic (id mod D) of their generation's first")
    ap.add_argument("--slots-frac", type=float, default=0.25, help="GPU slots per layer, as a share of its experts")
    ap.add_argument("--prefetch", default="0,1,2,4", help="prefetch copies per layer per token to try")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args()
    if a.calib >= a.tokens and not a.calib_plan:
        ap.error("--calib must be smaller than --tokens")
    if not 1 <= a.sequences <= a.tokens:
        ap.error("--sequences must be between 1 and --tokens")
    from strata_compiler.errors import StrataError, UsageError

    try:
        chosen, pred, eb, ids, calib = record(a.plan_dir, a.tokens, sequences=a.sequences)
        if a.calib_plan and calib is None:
            raise UsageError(f"{a.plan_dir}: compiled without --calib; drop --calib-plan")
    except StrataError as e:
        print(f"cache_sim.py: error: {e}", file=sys.stderr)
        return 2
    if a.calib_plan:
        test_c, test_p = chosen, pred
        prior = calib                              # chance per token that each expert is chosen
    else:
        cal, test_c, test_p = chosen[:a.calib], chosen[a.calib:], pred[a.calib:]
        prior = cal.sum(0).astype(np.float64) / a.calib
    T, L, E = test_c.shape
    S = max(1, round(E * a.slots_frac))
    hot = np.argsort(-prior, axis=1, kind="stable")[:, :S]
    if a.topics:
        per = len(ids) // a.sequences
        same = (ids.reshape(a.sequences, per) % a.topics == (ids[::per] % a.topics)[:, None]).mean()
        print(f"decoded tokens on their generation's first topic: {same:.1%} (chance {1 / a.topics:.0%})")
    static = sum(test_c[:, i, hot[i]].sum() for i in range(L)) / test_c.sum()
    best = sum(np.sort(test_c[:, i].sum(0))[::-1][:S].sum() for i in range(L)) / test_c.sum()
    acc = (test_p & test_c).sum() / max(1, test_p.sum())
    source = "the plan's calibration" if a.calib_plan else f"the first {a.calib} tokens"
    print(f"{a.plan_dir}: {L} MoE layers x {E} experts, {S} GPU slots a layer, one expert {eb / 2**20:.2f} MiB; "
          f"calibration: {source}; {T} tokens replayed in {a.sequences} generation(s); "
          f"lookahead accuracy {acc:.1%}")
    rows = [dict(policy="static split (calibrated hottest)", prefetch=0, hit_rate=static, copies=0.0),
            dict(policy="static split, best in hindsight", prefetch=0, hit_rate=best, copies=0.0)]
    for pf in [int(x) for x in a.prefetch.split(",")]:
        for label, kw, use_prior in POLICIES:
            hr, cp = replay(test_c, test_p, hot, prior if use_prior else None, pf, **kw)
            rows.append(dict(policy=label, prefetch=pf, hit_rate=hr, copies=cp))
    print(f"{'policy':50s} {'prefetch':>8s} {'hit rate':>9s} {'copies/layer/token':>19s} {'MiB/token':>10s}")
    for r in rows:
        r["mib_per_token"] = r["copies"] * L * eb / 2**20
        print(f"{r['policy']:50s} {r['prefetch']:8d} {r['hit_rate']:9.1%} {r['copies']:19.2f} {r['mib_per_token']:10.1f}")
    if a.json:
        a.json.write_text(json.dumps(dict(plan=str(a.plan_dir), layers=L, experts=E, slots=S, expert_bytes=eb,
                                          lookahead_accuracy=acc, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
