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
    budget_skips: int = 0             # steps whose copies for this layer the copy budget left out
    miss_path: str = "cpu"            # where a miss computes: the host share on the CPU, or "gpu" (read in place)
    expert_bytes: int = 0             # one expert's stored bytes (what a miss read in place moves)
    prior: np.ndarray | None = None   # f64[E]: calibrated chance each expert is chosen (seeds the scores)
    _chosen: np.ndarray | None = None

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

    def observe(self, combine: np.ndarray) -> None:
        """The routing weights of a step, [M, E] (nonzero for the chosen experts): count hits
        and misses, remember what was chosen for the swap decision."""
        chosen = np.asarray(combine).reshape(-1, self.n_experts) != 0
        self._count(chosen.sum(axis=0))

    def fold(self) -> None:
        """What native programs counted (`counts`, routings per expert, under the mask the step
        ran with: residency changes only between host calls) as `observe` would have it."""
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

    def plan_swaps(self, max_swaps: int | None = None) -> list[tuple[int, int]]:
        """(slot, expert) copies to make now (at most `max_swaps`, default self.max_swaps: 0 only
        updates the scores), and the bookkeeping as if they were made."""
        limit = self.max_swaps if max_swaps is None else max_swaps
        self.fold()
        used = self._chosen if self._chosen is not None else np.zeros(self.n_experts, bool)
        self._chosen = None
        self.step += 1
        self.last_used[used] = self.step
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
    skips = sum(c.budget_skips for c in mine)
    in_place = [c for c in mine if c.miss_path == "gpu"]
    mapped = ([f"  misses: read by the GPU from host memory in place (--miss-path gpu): "
               f"{sum(c.misses for c in in_place)} experts, {sum(c.misses * c.expert_bytes for c in in_place)} B "
               f"host->device"] if in_place else [])
    return [f"  expert cache: {len(mine)} layers, {slots} GPU slots; hit rate {rate:.1%} "
            f"({hits} hits, {misses} misses); {swaps} experts swapped in after a miss; "
            f"{moved} B copied host->device; {skips} layer-steps' copies left out by the copy budget"] + mapped


class CacheGroup:
    """The caches of one plan that share an expert count and a policy, their per-expert arrays
    rows of shared [L, E] arrays (and their slots heads of an [L, S_max] one's rows), so that the bookkeeping
    after a step — hits and misses from what the native programs counted, the scores, one swap
    per layer — runs as a few whole-array operations instead of ~25 small NumPy calls per layer.
    Rows of a C-contiguous array keep their
    addresses, which the native programs read; every update is in place.

    `after_step` does what ExpertCache.plan_swaps does on each cache, and gives the same swaps,
    scores and counts (tests/test_expert_cache.py replays both); it returns None where that needs
    the per-cache path: a trace is on, a Python `observe` left something to fold, more than one
    swap a layer is allowed, or the policy is LRU."""

    def __init__(self, caches: list[ExpertCache]) -> None:
        c0 = caches[0]
        self.caches = caches
        self.ok = all(c.n_experts == c0.n_experts and c.policy == "hybrid" and c.decay == c0.decay
                      and c.recency == c0.recency and c.swap_margin == c0.swap_margin for c in caches)
        if not self.ok:
            return
        for attr in ("score", "last_used", "nonresident", "counts"):
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
                c._chosen is not None or c.max_swaps != 1 for c in cs):
            return None
        self.steps += 1
        counts = self.counts.copy()
        self.counts[:] = 0
        used = counts > 0
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
