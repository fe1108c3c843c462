"""The GPU expert cache: which of a layer's experts sit in the GPU's slots, and which to swap in.

A cached layer is two moe_ffn nodes sharing `cache=<key>` (passes/expert_split.py): the GPU
share computes the routing columns of the experts in its slots; the host's `whole` share holds
every expert and computes the others (a miss computes on the CPU: Fiddler's rule, since the copy
of one expert costs more than its CPU GEMV at batch 1). After each step the cache scores the
experts the tokens chose — an LRU/LFU hybrid: a decayed use count plus a recency bonus — and
swaps a missed expert into the slot of the lowest-scoring resident when it scores higher, at
most `max_swaps` per layer per step (the copy budget), so the next tokens hit.

The scores start from the plan's calibrated expert probabilities where it has them (the whole
share's `prior`: p_e / (1 - decay), the score an expert chosen with probability p_e settles at),
and decay slowly (0.99 a step): a fast-forgetting count lets one-off misses evict the hot
experts, so reactive swaps fall below the static split's hit rate (benchmarks/cache_sim.py
replays recorded routing traces against each policy).

A mixed run's caches sit in its MixedExecutor's Residency (strata_compiler/experts.py), handed to
every partition's executor; a layer without a live cache keeps the plan's static split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strata_compiler import settings, trace

# the prefetch's idle back-off (ExpertCache.prefetch_outcome): predictions in a row that admit no
# copy before a layer's prediction pauses, and the longest pause in steps
PF_IDLE = 4
PF_BACKOFF_MAX = 64


@dataclass
class ExpertCache:
    key: str
    n_experts: int
    slots: np.ndarray                 # i32[S]: the expert in each GPU slot
    decay: float = 0.99               # per step, of the use counts (LFU that forgets slowly)
    recency: float = 0.5              # bonus of an expert used in the last step (LRU)
    max_swaps: int = 1                # copies per layer per step
    # a missed expert replaces the weakest resident only when its score beats the resident's by
    # more than this (hysteresis: near-equal scores of a stationary router otherwise trade places
    # step after step, each trade a copy); the `swap_margin` setting
    swap_margin: float = field(default_factory=lambda: settings.get("swap_margin"))
    policy: str = "hybrid"            # hybrid | lru
    score: np.ndarray = field(default=None)
    last_used: np.ndarray = field(default=None)
    nonresident: np.ndarray = field(default=None)   # f32[E]: 1 for experts the host computes
    step: int = 0
    hits: int = 0
    misses: int = 0
    swaps: int = 0
    bytes_moved: int = 0
    max_prefetch: int = 1             # copies per layer per step started by the prediction
    predicted: np.ndarray | None = None   # experts the lookahead router predicted for this step
    pf_predicted: int = 0
    pf_correct: int = 0
    prefetches: int = 0
    budget_skips: int = 0             # steps whose copies for this layer the copy budget left out
    miss_path: str = "cpu"            # where a miss computes: the host share on the CPU, or "gpu" (read in place)
    expert_bytes: int = 0             # one expert's stored bytes (what a miss read in place moves)
    prior: np.ndarray | None = None   # f64[E]: calibrated chance each expert is chosen (seeds the scores)
    _chosen: np.ndarray | None = None
    # the prefetch's idle back-off (prefetch_outcome; the `prefetch_backoff` setting)
    backoff: bool = field(default_factory=lambda: settings.get("prefetch_backoff"))
    pf_wait: int = 0                  # steps the prediction still sits out (0: it runs)
    pf_paused: int = 0                # layer-steps it sat out
    pf_idle: int = 0
    pf_backoff: int = 1
    _pf_step: tuple[bool, int] = (False, 0)   # this step's prediction: (made, copies it admitted)

    def __post_init__(self) -> None:
        E = self.n_experts
        self.slots = np.asarray(self.slots, np.int32).copy()
        if self.score is None:
            if self.prior is not None and len(self.prior) == E:
                self.prior = np.asarray(self.prior, np.float64)
                self.score = self.prior / (1.0 - self.decay) if self.policy != "lru" else np.zeros(E)
            else:
                self.score = np.zeros(E)
        self.last_used = np.full(E, -1, np.int64)
        self.nonresident = np.ones(E, np.float32)
        self.nonresident[self.slots] = 0.0
        # i64[E]: routings per expert that native programs counted (pool.py MASK) since `fold`
        self.counts = np.zeros(E, np.int64)
        self.score = np.ascontiguousarray(self.score, np.float64)
        # a native prefetch's (runtime/native_prefetch.py) prediction and counters since `fold`:
        # [copies allowed this step, prefetches, bytes copied, prediction made, budget skips, copy error]
        self.native_pred = np.zeros(E, np.uint8)
        self.native_stats = np.zeros(6, np.int64)

    def observe(self, combine: np.ndarray) -> None:
        """The routing weights of a step, [M, E] (nonzero for the chosen experts): count hits
        and misses, remember what was chosen for the swap decision."""
        chosen = np.asarray(combine).reshape(-1, self.n_experts) != 0
        self._take_native_prediction()
        self._count(chosen.sum(axis=0))

    def _take_native_prediction(self) -> None:
        """A native prefetch's prediction for this step, as `prefetch` would have left it."""
        if self.native_stats[3]:
            self.predicted = self.native_pred.astype(bool)
            self.native_stats[3] = 0
            self._pf_step = (True, self._pf_step[1] + int(self.native_stats[1]))

    def fold(self) -> None:
        """What native programs counted (`counts`, routings per expert, under the mask the step
        ran with: residency changes only between host calls) as `observe` would have it, after a
        native prefetch's prediction and counters (`native_pred`, `native_stats`)."""
        st = self.native_stats
        self._take_native_prediction()
        if st[1] or st[2] or st[4]:
            self.prefetches += int(st[1])
            self.bytes_moved += int(st[2])
            self.budget_skips += int(st[4])
            st[1:3] = 0
            st[4] = 0
        if self.counts.any():
            c = self.counts.copy()
            self.counts[:] = 0
            self._count(c)

    def _count(self, per_expert: np.ndarray) -> None:
        resident = self.nonresident == 0
        hits, misses = int(per_expert[resident].sum()), int(per_expert[~resident].sum())
        self.hits += hits
        self.misses += misses
        if trace.ACTIVE is not None and trace.ACTIVE.full and hits + misses:     # one instant per layer and step
            trace.ACTIVE.instant(f"expert cache {self.key}: {hits} hits, {misses} misses", "cache",
                                 hit=np.flatnonzero(resident & (per_expert > 0)).tolist(),
                                 miss=np.flatnonzero(~resident & (per_expert > 0)).tolist())
        used = per_expert > 0
        self._chosen = used if self._chosen is None else (self._chosen | used)
        if self.predicted is not None:           # how good was the lookahead?
            self.pf_predicted += int(self.predicted.sum())
            self.pf_correct += int((self.predicted & used).sum())
            self.predicted = None

    def admit_margin(self) -> float:
        """What a predicted expert's score gains if the step uses it (its count, its recency
        bonus): the prefetch admits it only over a victim it would outscore after the step, the
        rule the reactive swap applies then. So the prefetch makes the swaps the policy would make
        anyway, one step early (the step hits), and never evicts an expert the policy keeps for a
        one-off prediction (without the rule the prefetch copies several times the bytes of the
        reactive swaps for little more hit rate). LRU admits always (the newest use outranks all)."""
        return np.inf if self.policy == "lru" else 1.0 + self.recency

    def prefetch(self, predicted: np.ndarray) -> list[tuple[int, int]]:
        """The lookahead: the experts the next layer's router picks from this layer's hidden
        state (bool[E]). Swaps in up to `max_prefetch` predicted experts that are not resident,
        evicting the lowest-scoring residents the prediction does not name, where the expert
        would outscore its victim after the step (`admit_margin`)."""
        if self.pf_wait:                # paused by the idle back-off (prefetch_outcome)
            self.budget_skips += 1
            return []
        self.predicted = predicted.copy()
        out = []
        want = [int(e) for e in np.flatnonzero(predicted & (self.nonresident != 0))]
        margin = self.admit_margin()
        for e in sorted(want, key=lambda e: -self.score[e]):
            if len(out) >= self.max_prefetch:
                break
            free = [i for i, r in enumerate(self.slots) if not predicted[r]]
            if not free:
                break
            slot = min(free, key=lambda i: self.score[self.slots[i]])
            if not self.score[e] + margin > self.score[self.slots[slot]]:
                break       # the best candidate against the weakest victim: no other pair passes
            out.append((slot, e))
            self.nonresident[self.slots[slot]] = 1.0
            self.nonresident[e] = 0.0
            self.slots[slot] = e
            self.prefetches += 1
        self._pf_step = (True, self._pf_step[1] + len(out))
        return out

    def prefetch_outcome(self, predicted: bool, copies: int) -> None:
        """After a step, the prefetch's idle back-off: PF_IDLE predictions in a row that admitted
        no copy pause the layer's prediction for `pf_backoff` steps (then 2x, up to
        PF_BACKOFF_MAX; back to 1 once a prediction copies). A prediction is the router's GEMV on
        the host call's critical path, spent every step even where the admission rule lets
        nothing through, as at high hit rates. While paused, `pf_wait` > 0: the native prefetch
        is not allowed to run (native_stats[0] = 0, counted as a budget skip) nor the Python one."""
        if self.pf_wait:
            self.pf_wait -= 1
            self.pf_paused += 1
            return
        if not predicted or not self.backoff:
            return
        if copies:
            self.pf_idle, self.pf_backoff = 0, 1
            return
        self.pf_idle += 1
        if self.pf_idle >= PF_IDLE:
            self.pf_wait, self.pf_idle = self.pf_backoff, 0
            self.pf_backoff = min(2 * self.pf_backoff, PF_BACKOFF_MAX)

    def _end_prefetch_step(self) -> None:
        made, copies = self._pf_step
        self._pf_step = (False, 0)
        self.prefetch_outcome(made, copies)

    def plan_swaps(self, max_swaps: int | None = None) -> list[tuple[int, int]]:
        """(slot, expert) copies to make now (at most `max_swaps`, default self.max_swaps: 0 only
        updates the scores), and the bookkeeping as if they were made."""
        limit = self.max_swaps if max_swaps is None else max_swaps
        self.fold()
        self._end_prefetch_step()
        used = self._chosen if self._chosen is not None else np.zeros(self.n_experts, bool)
        self._chosen = None
        self.step += 1
        self.last_used[used] = self.step
        # in place: a native prefetch (runtime/native_prefetch.py) reads the scores by address
        if self.policy == "lru":
            self.score[:] = self.last_used
        else:
            self.score *= self.decay
            self.score += used
            self.score += self.recency * (self.last_used == self.step)
        out = []
        missed = [int(e) for e in np.flatnonzero(used & (self.nonresident != 0))]
        for e in sorted(missed, key=lambda e: -self.score[e]):
            if len(out) >= limit:
                break
            res = self.slots
            victim_slot = int(np.argmin(self.score[res]))
            if self.score[e] <= self.score[res[victim_slot]] + self.swap_margin:
                continue
            out.append((victim_slot, e))
            self.nonresident[res[victim_slot]] = 1.0
            self.nonresident[e] = 0.0
            self.slots[victim_slot] = e
            self.swaps += 1
        return out

    def hit_rate(self) -> float:
        self.fold()
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


def stats_lines(residency) -> list[str]:
    """`--stats` lines of a run's live expert caches (its executor's Residency)."""
    mine = list(residency.caches.values()) if residency is not None else []
    for c in mine:
        c.fold()
    if not mine:
        return ["  expert cache: none (static placement: experts stay where the plan put them)"]
    hits = sum(c.hits for c in mine)
    misses = sum(c.misses for c in mine)
    swaps = sum(c.swaps for c in mine)
    moved = sum(c.bytes_moved for c in mine)
    slots = sum(len(c.slots) for c in mine)
    rate = hits / (hits + misses) if hits + misses else 0.0
    pred = sum(c.pf_predicted for c in mine)
    good = sum(c.pf_correct for c in mine)
    pf = sum(c.prefetches for c in mine)
    skips = sum(c.budget_skips for c in mine)
    paused = sum(c.pf_paused for c in mine)
    in_place = [c for c in mine if c.miss_path == "gpu"]
    mapped = ([f"  misses: read by the GPU from host memory in place (--miss-path gpu): "
               f"{sum(c.misses for c in in_place)} experts, {sum(c.misses * c.expert_bytes for c in in_place)} B "
               f"host->device"] if in_place else [])
    return [f"  expert cache: {len(mine)} layers, {slots} GPU slots; hit rate {rate:.1%} "
            f"({hits} hits, {misses} misses); {swaps} experts swapped in after a miss, {pf} prefetched; "
            f"{moved} B copied host->device; {skips} layer-steps' copies left out by the copy budget "
            f"or the prefetch's idle back-off",
            f"  prefetch: the next layer's router on this layer's hidden state named {pred} experts, "
            f"{good} were chosen (accuracy {good / pred if pred else 0.0:.1%}); paused {paused} layer-steps "
            f"after predictions that admitted no copy"] + mapped


class CacheGroup:
    """The caches of one plan that share an expert count and a policy, their per-expert arrays
    rows of shared [L, E] arrays (and their slots heads of an [L, S_max] one's rows), so that the bookkeeping
    after a step — hits and misses from what the native programs counted, the scores, one swap
    per layer — runs as a few whole-array operations instead of ~25 small NumPy calls per layer.
    Rows of a C-contiguous array keep their
    addresses, which the native programs and prefetch read; every update is in place.

    `after_step` does what ExpertCache.plan_swaps does on each cache (with what a native prefetch
    counted: its predictions and copies), and gives the same swaps, scores and counts
    (tests/test_expert_cache.py replays both); it returns None where that needs the per-cache
    path: a trace is on, a Python `observe` or prefetch left something to fold, more than one
    swap a layer is allowed, or the policy is LRU."""

    def __init__(self, caches: list[ExpertCache]) -> None:
        c0 = caches[0]
        self.caches = caches
        self.ok = all(c.n_experts == c0.n_experts and c.policy == "hybrid" and c.decay == c0.decay
                      and c.recency == c0.recency and c.swap_margin == c0.swap_margin for c in caches)
        if not self.ok:
            return
        for attr in ("score", "last_used", "nonresident", "counts", "native_pred", "native_stats"):
            big = np.ascontiguousarray(np.stack([getattr(c, attr) for c in caches]))
            setattr(self, attr, big)
            for i, c in enumerate(caches):
                setattr(c, attr, big[i])
        # layers may hold different numbers of slots (the placement sizes each split): [L, S_max],
        # each cache's slots the head of its row, the rest never a victim
        n = np.array([len(c.slots) for c in caches])
        self.slots = np.zeros((len(caches), max(1, int(n.max()))), np.int32)
        self.pad = np.arange(self.slots.shape[1])[None, :] >= n[:, None]
        for i, c in enumerate(caches):
            self.slots[i, :n[i]] = c.slots
            c.slots = self.slots[i, :n[i]]
        self.rows = np.arange(len(caches))
        self.steps = 0                  # steps whose bookkeeping ran as whole arrays

    def after_step(self, resident: np.ndarray | None = None) -> list[tuple[ExpertCache, int, int, int]] | None:
        """The step's bookkeeping for every cache; the swaps to copy now: (cache, slot, expert,
        the expert it evicts). `resident` (bool [L, E]): the experts the step found in its slots,
        for its hits and misses, where the step ran with other maps than the caches hold now
        (decode ahead: a step dispatched before the swaps after the one before it)."""
        cs = self.caches
        if not self.ok or (trace.ACTIVE is not None and trace.ACTIVE.full) or any(
                c._chosen is not None or c.predicted is not None or c.max_swaps != 1 for c in cs):
            return None
        self.steps += 1
        counts = self.counts.copy()
        self.counts[:] = 0
        used = counts > 0
        st = self.native_stats         # a native prefetch's: [allowed, prefetches, bytes, predicted, skips, error]
        if st[:, 1:5].any():
            made = st[:, 3] != 0
            pred = (self.native_pred != 0) & made[:, None]
            for c, n, ok, row in zip(cs, pred.sum(1).tolist(), (pred & used).sum(1).tolist(), st[:, 1:5].tolist()):
                c.prefetches += row[0]
                c.bytes_moved += row[1]
                c.budget_skips += row[3]
                c.pf_predicted += n
                c.pf_correct += ok
                c._pf_step = (bool(row[2]), row[0])
            st[:, 1:5] = 0
        for c in cs:
            c._end_prefetch_step()
        res = self.nonresident == 0
        hits = np.where(res if resident is None else resident, counts, 0).sum(1).tolist()
        total = counts.sum(1).tolist()
        for c, h, t in zip(cs, hits, total):
            c.hits += h
            c.misses += t - h
            c.step += 1
        steps = np.array([c.step for c in cs], np.int64)
        np.copyto(self.last_used, steps[:, None], where=used)
        c0 = cs[0]
        self.score *= c0.decay
        self.score += (1.0 + c0.recency) * used
        missed = used & ~res
        if not missed.any():
            return []
        cand = np.argmax(np.where(missed, self.score, -np.inf), axis=1)
        held = np.take_along_axis(self.score, self.slots, axis=1)
        held[self.pad] = np.inf
        vslot = np.argmin(held, axis=1)
        rows = self.rows
        win = missed.any(1) & (self.score[rows, cand] > held[rows, vslot] + c0.swap_margin)
        out = []
        for i in np.flatnonzero(win).tolist():
            c, e, s = cs[i], int(cand[i]), int(vslot[i])
            old = int(c.slots[s])
            c.nonresident[old] = 1.0
            c.nonresident[e] = 0.0
            c.slots[s] = e
            c.swaps += 1
            out.append((c, s, e, old))
        return out
