"""The GPU expert cache (runtime/expert_cache.py): the replacement policy, and greedy outputs
identical with the cache on and off (JAX on the CPU stands in for the GPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hf_models import build_model, clear_prompts, hf_greedy, hf_logits, load_model
from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.errors import UsageError
from strata_compiler.runtime.cli import strata_run
from strata_compiler.runtime.expert_cache import CacheGroup, ExpertCache
from strata_compiler.runtime.plan import load_plan
from test_place import budget_decides, fake_profile, gpu_mem_for, probe_placement

N_NEW = 12


def test_hits_misses_and_a_swap_of_the_hottest_miss():
    c = ExpertCache("L0", 6, np.array([0, 1], np.int32), decay=0.5, recency=0.0, swap_margin=0.0)
    comb = np.zeros((3, 6), np.float32)
    comb[0, [0, 4]] = 1          # a hit and a miss
    comb[1, [4, 5]] = 1          # two misses
    comb[2, [1, 4]] = 1
    c.observe(comb)
    assert (c.hits, c.misses) == (2, 4)
    swaps = c.plan_swaps()       # 4 was used; the residents 0 and 1 too: scores tie at 1 -> no swap beats them
    assert swaps == []
    c.observe(np.eye(6, dtype=np.float32)[[4, 4]])   # 4 again, 0 and 1 idle: 4 now outscores them
    swaps = c.plan_swaps()
    assert len(swaps) == 1 and swaps[0][1] == 4 and 4 in c.slots
    assert c.nonresident[4] == 0 and c.nonresident.sum() == 4
    assert c.swaps == 1 and 0 < c.hit_rate() < 1


def test_swap_margin_keeps_near_equal_residents():
    """A miss replaces the weakest resident only when it outscores it by more than swap_margin
    (default 1: one more use), so experts of near-equal popularity do not trade slots every step."""
    def run(margin):
        c = ExpertCache("L0", 4, np.array([0, 1], np.int32), decay=0.5, recency=0.0, swap_margin=margin)
        steps = []
        for _ in range(3):       # expert 2 used every step, the residents idle
            c.observe(np.eye(4, dtype=np.float32)[[2]])
            steps.append(c.plan_swaps())
        return steps

    assert [len(s) for s in run(0.0)] == [1, 0, 0]        # 1 > 0: swapped at once
    assert [len(s) for s in run(1.0)] == [0, 1, 0]        # 1.5 > 0 + 1 only after the second use
    assert ExpertCache("L0", 4, np.array([0, 1], np.int32)).swap_margin == 1.0


def test_lru_policy_evicts_the_least_recently_used():
    c = ExpertCache("L0", 4, np.array([0, 1], np.int32), policy="lru", max_swaps=2)
    c.observe(np.eye(4, dtype=np.float32)[[1]])
    assert c.plan_swaps() == []
    c.observe(np.eye(4, dtype=np.float32)[[2]])
    assert c.plan_swaps() == [(0, 2)]          # expert 0 was never used: its slot goes


def test_calibrated_prior_keeps_hot_experts_against_one_off_misses():
    """Scores start at prior / (1 - decay): a miss of a cold expert does not evict a hot resident
    that this step did not use; without the prior (every score 0) it does."""
    prior = np.array([0.9, 0.8, 0.05, 0.05, 0.1, 0.1])
    comb = np.eye(6, dtype=np.float32)[[2]]         # only cold expert 2 is chosen
    with_prior = ExpertCache("L0", 6, np.array([0, 1], np.int32), prior=prior)
    np.testing.assert_allclose(with_prior.score, prior / (1 - with_prior.decay))
    with_prior.observe(comb)
    assert with_prior.plan_swaps() == [] and sorted(with_prior.slots) == [0, 1]
    without = ExpertCache("L0", 6, np.array([0, 1], np.int32))
    without.observe(comb)
    assert len(without.plan_swaps()) == 1 and 2 in without.slots
    # a prior of the wrong length (an old plan, another layer) is ignored, not misapplied
    assert not ExpertCache("L0", 6, np.array([0, 1], np.int32), prior=prior[:4]).score.any()


def test_cache_group_makes_the_swaps_each_cache_would():
    """CacheGroup.after_step (whole-array bookkeeping) against ExpertCache.plan_swaps per cache,
    on a skewed random routing with misses every step, layers with different slot counts: the same
    swaps, scores, hits and misses."""
    rng = np.random.default_rng(3)
    L, E, S, k = 5, 16, 4, 3
    p = rng.dirichlet(np.full(E, 0.3), size=L)

    def caches():       # (the layers hold S, S - 1, ... slots: a placement sizes each split)
        return [ExpertCache(f"L{i}", E, rng2.permutation(E)[:S - i % 3].astype(np.int32), prior=p[i])
                for i, rng2 in ((i, np.random.default_rng(i)) for i in range(L))]

    solo, grouped = caches(), caches()
    group = CacheGroup(grouped)
    assert group.ok and grouped[2].score.base is group.score
    swaps = 0
    for t in range(60):
        for i in range(L):
            counts = np.bincount(rng.choice(E, size=k, replace=False, p=p[i]), minlength=E)
            solo[i].counts[:] = counts
            grouped[i].counts[:] = counts
        want = [(i, s, e) for i, c in enumerate(solo) for s, e in c.plan_swaps()]
        got = group.after_step()
        assert [(grouped.index(c), s, e) for c, s, e, _ in got] == want
        swaps += len(want)
    assert swaps > 10
    for a, b in zip(solo, grouped):
        assert (a.hits, a.misses, a.swaps, a.step) == (b.hits, b.misses, b.swaps, b.step)
        assert (a.bytes_moved, a.budget_skips) == (b.bytes_moved, b.budget_skips)
        np.testing.assert_array_equal(a.slots, b.slots)
        np.testing.assert_allclose(a.score, b.score, rtol=1e-12)
        np.testing.assert_array_equal(a.last_used, b.last_used)
        np.testing.assert_array_equal(a.nonresident, b.nonresident)
    grouped[0].max_swaps = 2            # what the whole-array path does not do: the per-cache path
    assert group.after_step() is None


def cached_plan(d, tmp_path, monkeypatch, share: float) -> Path:
    """`d` compiled with --expert-cache for `share` of its weight bytes on an H200-like GPU
    (latency constants zeroed so that the budget alone decides: layers get split)."""
    budget_decides(monkeypatch)
    hw = fake_profile(tmp_path / "hw.json")
    probe = probe_placement(d, tmp_path, hw)
    mem = gpu_mem_for(probe, probe["gpu_bytes"] * share)
    assert run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "plan"), "--target", str(hw), "--gpu-mem",
                             str(mem), "--expert-cache"]) == 0
    return tmp_path / "plan"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = build_model("qwen3_moe", tmp_path_factory.mktemp("cache") / "model")
    m = load_model(d)
    ids = clear_prompts(m, m.config.vocab_size, n_prompts=1, length=6, n_new=N_NEW, seed=6)[0]
    return d, m, ids


def test_cache_on_and_off_match_transformers(model, tmp_path, monkeypatch, capsys):
    d, m, ids = model
    plan = cached_plan(d, tmp_path, monkeypatch, 0.5)
    g = load_plan(plan).graph
    cached = [n for n in g.nodes if n.op.value == "moe_ffn" and n.attr("cache", "")]
    assert {n.device for n in cached} == {"gpu", "cpu"}
    # no calibration, no prior for the cache's scores (benchmarks' plans with --calib carry one:
    # test_benchmark_helpers.py)
    assert not any(n.has_attr("prior") for n in cached)
    np.save(tmp_path / "ids.npy", ids)
    ref = hf_logits(m, ids)
    ref_tokens = hf_greedy(m, ids, N_NEW)[0]
    outs = {}
    for flag in ("--expert-cache", "--no-expert-cache"):
        assert run_cli(strata_run, [str(plan / "plan.bin"), "--input-ids", str(tmp_path / "ids.npy"), "-n",
                                    str(N_NEW), "--greedy", "--ignore-eos", "--device", "cpu", flag, "--stats",
                                    "--logits-out", str(tmp_path / "l.npy"), "--tokens-out",
                                    str(tmp_path / "t.npy")]
                       + (["--trace", str(tmp_path / "trace.json")] if flag == "--expert-cache" else [])) == 0
        outs[flag] = (np.load(tmp_path / "l.npy"), np.load(tmp_path / "t.npy"), capsys.readouterr().err)
    for flag, (logits, tokens, err) in outs.items():
        assert np.abs(logits - ref).max() / ref.std() <= 1e-4, flag
        np.testing.assert_array_equal(tokens, ref_tokens)
    on = outs["--expert-cache"][2]
    assert "expert cache:" in on and "hit rate" in on
    swapped = int(on.split("experts swapped in")[0].split(";")[-1].strip())
    assert swapped > 0                                   # the cache did change its residents
    # the trace has the hits and misses: an instant per cached layer and step, on its own track,
    # adding up to the stats line's counts
    import json
    import re

    from strata_compiler.trace import TRACKS, validate

    doc = json.loads((tmp_path / "trace.json").read_text())
    validate(doc)
    marks = [e for e in doc["traceEvents"] if e["ph"] == "i" and e["tid"] == TRACKS["cache"]]
    hits, misses = (int(x) for x in re.search(r"\((\d+) hits, (\d+) misses\)", on).groups())
    assert marks and sum(len(e["args"]["hit"]) for e in marks) <= hits
    assert sum(int(e["name"].split(": ")[1].split()[0]) for e in marks) == hits
    assert sum(int(e["name"].split(", ")[1].split()[0]) for e in marks) == misses
    assert "hit rate" not in outs["--no-expert-cache"][2]


@pytest.mark.parametrize("batch", [1, 2])
def test_every_decode_step_matches_with_swaps(model, tmp_path, monkeypatch, batch):
    """Step by step, the cached run's logits equal the static run's while experts move (batched
    decode too)."""
    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.3))
    runs = {}
    prompt = np.concatenate([ids, ids[:, ::-1]])[:batch]
    for on in (True, False):
        s = Session(plan, "auto", device="cpu", expert_cache=on)
        s.reset(batch, 64)
        out = [s.step(prompt)[:, -1]]
        rng = np.random.default_rng(0)
        for _ in range(10):       # random tokens: routing moves around, the cache swaps
            out.append(s.step(rng.integers(0, m.config.vocab_size, (batch, 1)))[:, -1])
        runs[on] = (np.concatenate(out), s)
    b = runs[False][0]
    assert np.abs(runs[True][0] - b).max() / b.std() <= 1e-5
    caches = runs[True][1].executor.swaps.caches
    assert caches and sum(c.swaps for c, *_ in caches) > 0
    assert runs[True][1].executor.swaps.cache_group.steps >= 9      # the whole-array bookkeeping ran


def test_queued_swaps_keep_the_logits(model, tmp_path, monkeypatch):
    """Slot copies queued without waiting from page-locked host weights (with fused decode steps;
    here, without CUDA, nothing is pinned and copies land at once) give the logits of copies that
    each wait (partition by partition)."""
    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.3))

    def decode(s):
        s.reset(1, 64)
        steps = [s.step(ids)[:, -1]]
        rng = np.random.default_rng(2)
        for _ in range(6):
            steps.append(s.step(rng.integers(0, m.config.vocab_size, (1, 1)))[:, -1])
        return np.concatenate(steps)

    out = {}
    for queued in (True, False):
        s = Session(plan, "auto", device="cpu")
        assert s.executor.swaps.async_swaps and s.executor.swaps.pinned_bytes == 0
        s.executor.swaps.async_swaps = queued
        out[queued] = decode(s)
        assert sum(c.swaps for c, *_ in s.executor.swaps.caches) > 0
    np.testing.assert_array_equal(out[True], out[False])
    monkeypatch.setenv("STRATA_CACHE_SWAPS", "many")
    with pytest.raises(UsageError, match="STRATA_CACHE_SWAPS"):
        Session(plan, "auto", device="cpu")


def test_copy_budget_caps_swaps_and_keeps_the_logits(model, tmp_path, monkeypatch):
    """With no copy time allowed per step (copy_share 0), only the steps before a step time is known
    (the prefill and the first decode step) copy experts; the later ones leave their copies out
    (counted per layer), the scores still learn, and the logits stay the static run's."""
    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.3))
    out = {}
    for on in (True, False):
        s = Session(plan, "auto", device="cpu", expert_cache=on)
        if on:
            s.executor.swaps.copy_share = 0.0
        s.reset(1, 64)
        steps = [s.step(ids)[:, -1]]
        rng = np.random.default_rng(1)
        moved = []
        for _ in range(8):
            steps.append(s.step(rng.integers(0, m.config.vocab_size, (1, 1)))[:, -1])
            moved.append(sum(c.swaps for c, *_ in s.executor.swaps.caches))
        out[on] = (np.concatenate(steps), s, moved)
    caches = out[True][1].executor.swaps.caches
    assert caches and sum(c.budget_skips for c, *_ in caches) > 0
    assert len(set(out[True][2][1:])) == 1          # nothing copied after the first decode step
    assert all(c.step > 1 for c, *_ in caches)     # the scores kept counting steps
    b = out[False][0]
    assert np.abs(out[True][0] - b).max() / b.std() <= 1e-5


def test_out_of_gpu_memory_shrinks_the_cache(model, tmp_path, monkeypatch, capsys):
    """Less GPU memory than the plan's partitions need: the expert caches lose slots (the CPU
    computes those experts) instead of the run failing; the results stay the same."""
    from strata_compiler.formats import get_format
    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.5))
    g = plan.graph

    def nbytes(name):
        w = g.weight(name)
        return get_format(w.fmt).nbytes(w.shape, w.group_size or 32)

    on_gpu = {w for n in g.nodes if n.backend == "xla" for _, w in n.weights}
    share = next(n for n in g.nodes if n.attr("cache", "") and n.attr("experts", ()) and n.backend == "xla")
    per_slot = sum(nbytes(w) for _, w in share.weights) // len(share.attr("experts"))
    limit = sum(nbytes(w) for w in on_gpu) - per_slot          # one slot too many
    ref = Session(plan, "auto", device="cpu", expert_cache=False)
    ref.reset(1, 32)
    want = [ref.step(ids)[:, -1]] + [ref.step(np.array([[t]], np.int64))[:, -1] for t in (3, 9, 4)]
    capsys.readouterr()
    monkeypatch.setenv("STRATA_GPU_MEM_LIMIT", str(limit))
    s = Session(plan, "auto", device="cpu")
    assert "slots" in capsys.readouterr().err
    assert s.executor.shrunk and list(s.executor.shrunk.values())[0] < len(share.attr("experts"))
    s.reset(1, 32)
    got = [s.step(ids)[:, -1]] + [s.step(np.array([[t]], np.int64))[:, -1] for t in (3, 9, 4)]
    want, got = np.concatenate(want), np.concatenate(got)
    assert np.abs(got - want).max() / want.std() <= 1e-5
    assert s.executor.fused is not None and s.executor.fused.steps == 2    # the shrunk slots in fused steps too
