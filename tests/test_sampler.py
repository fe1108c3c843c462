"""runtime/sampler.py: top-k, min-p and top-p keep the tokens they should (no other token is ever
drawn), the same set with the same renormalised probabilities as a brute-force reference (softmax,
full sort) for every combination, over peaked, flat and tied logits; the repetition penalty divides
seen positive logits and multiplies seen negative ones within its window, and changes greedy
choices; rows of a batch are independent; a seed repeats its draws; strata-run's flags and the
server's fields reach the sampler."""

from __future__ import annotations

import numpy as np
import pytest

from strata_compiler.runtime.sampler import Sampler

LOGITS = np.log(np.array([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04]], np.float64)).astype(np.float32)


def _drawn(sampler: Sampler, n: int = 400) -> set[int]:
    return {int(sampler(LOGITS)[0]) for _ in range(n)}


@pytest.mark.parametrize("kw,allowed", [
    (dict(top_k=2), {0, 1}),
    (dict(top_k=1), {0}),
    (dict(min_p=0.3), {0, 1, 2}),            # p >= 0.3 x 0.40 = 0.12
    (dict(min_p=0.9), {0}),
    (dict(top_p=0.6), {0, 1}),               # 0.40 + 0.25 reaches 0.6
    (dict(top_k=5, min_p=0.2, top_p=0.99), {0, 1, 2, 3}),
    (dict(), {0, 1, 2, 3, 4, 5}),
])
def test_filters_keep_exactly_their_tokens(kw, allowed):
    assert _drawn(Sampler(temperature=1.0, seed=3, **kw)) == allowed


def test_repetition_penalty():
    logits = np.array([[2.0, 1.9, -1.0, -1.2]], np.float32)
    s = Sampler(repetition_penalty=2.0)
    assert not s.plain_greedy and s.needs_history
    assert s(logits, [[0]])[0] == 1                 # 2.0 / 2 = 1.0 < 1.9
    assert s(logits, [[0, 1, 2]])[0] == 0           # 1.0 vs 0.95 vs -2.0
    assert s(logits, None)[0] == 0                  # no history: no penalty
    assert Sampler()(logits, [[0]])[0] == 0 and Sampler().plain_greedy
    # a seen negative logit is pushed further down: -1.0 * 2 = -2.0 falls below -1.2
    low = np.array([[-3.0, -3.0, -1.0, -1.2]], np.float32)
    assert s(low, [[2]])[0] == 3


def _reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float):
    """The filters as specified, by brute force: float64 softmax, a stable sort of the whole row, the
    shortest prefix reaching top_p, at most top_k, none below min_p x the top probability."""
    z = (logits.astype(np.float64) - logits.max()) / temperature
    p = np.exp(z) / np.exp(z).sum()
    order = np.argsort(-p, kind="stable")
    n = int(np.searchsorted(np.cumsum(p[order]), top_p) + 1) if top_p < 1 else len(p)    # 1: off
    if top_k > 0:
        n = min(n, top_k)
    n = min(n, max(1, int((p[order] >= min_p * p[order[0]]).sum())))
    keep = order[:n]
    return {int(i): float(q) for i, q in zip(keep, p[keep] / p[keep].sum())}


def _rows(V: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(V)
    peaked = rng.standard_normal(V).astype(np.float32) * 3
    H = min(V, 200)
    peaked[rng.choice(V, H, replace=False)] = 16 - 2.0 * np.log(np.arange(1, H + 1))   # a Zipf-like head, as a model's
    return {
        "peaked": peaked,
        "flat": rng.standard_normal(V).astype(np.float32) * 3,   # the 1e-4 guess holds too little mass
        "tied": np.round(rng.standard_normal(V) * 2).astype(np.float32),   # many equal logits at every cut
        "uniform": np.zeros(V, np.float32),
    }


@pytest.mark.parametrize("V", [51, 4999])   # no top_p x V is a whole number: no exact tie at the cut
@pytest.mark.parametrize("kind", ["peaked", "flat", "tied", "uniform"])
def test_allowed_set_matches_brute_force(V, kind):
    row = _rows(V)[kind]
    for temperature in (0.3, 0.8, 1.5):
        for top_k in (0, 1, 7, 40, V - 1, V + 3):
            for top_p in (1.0, 0.95, 0.5, 0.05):
                for min_p in (0.0, 0.05, 0.5):
                    s = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
                    ids, probs = s.distribution(row[None])[0]
                    want = _reference(row, temperature, top_k, top_p, min_p)
                    case = f"T={temperature} k={top_k} p={top_p} min_p={min_p}"
                    assert sorted(ids.tolist()) == sorted(want), case
                    np.testing.assert_allclose(probs, [want[int(i)] for i in ids], rtol=1e-5, atol=1e-9,
                                               err_msg=case)
                    assert int(s(row[None])[0]) in want, case


def test_draws_follow_the_distribution():
    s = Sampler(temperature=0.8, top_k=5, top_p=0.99, min_p=0.01, seed=11)
    ids, probs = s.distribution(LOGITS)[0]
    n = 20000
    drawn = s(np.repeat(LOGITS, n, axis=0))
    freq = np.bincount(drawn, minlength=LOGITS.shape[1]) / n
    np.testing.assert_allclose(freq[ids], probs, atol=0.015)
    assert freq[np.setdiff1d(np.arange(LOGITS.shape[1]), ids)].sum() == 0


def test_batch_rows_are_independent():
    rows = _rows(5000)
    batch = np.stack([rows["peaked"], rows["flat"], rows["tied"], rows["uniform"]])
    history = [[1, 2, 3], [], list(range(200)), [4999]]
    s = Sampler(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3, repeat_last_n=16)
    together = s.distribution(batch, history)
    for b in range(len(batch)):
        ids, probs = s.distribution(batch[b:b + 1], [history[b]])[0]
        np.testing.assert_array_equal(together[b][0], ids)
        np.testing.assert_allclose(together[b][1], probs, rtol=1e-6)
    assert Sampler()(batch).tolist() == [int(r.argmax()) for r in batch]


def test_seed_repeats_draws():
    row = _rows(5000)["flat"][None]
    a, b, c = (Sampler(temperature=1.0, top_p=0.9, seed=seed) for seed in (5, 5, 6))
    seq_a = [int(a(row)[0]) for _ in range(30)]
    assert seq_a == [int(b(row)[0]) for _ in range(30)]
    assert seq_a != [int(c(row)[0]) for _ in range(30)]


def test_penalty_window():
    logits = np.array([[3.0, 2.9, 2.8, -1.0]], np.float32)
    s = Sampler(repetition_penalty=2.0, repeat_last_n=2)
    assert s(logits, [[0, 1, 2]])[0] == 0           # only 1 and 2 are in the last two: 0 keeps its 3.0
    assert s(logits, [[2, 2, 0]])[0] == 1           # 0 and 2 halved (2 twice counts once)
    whole = Sampler(repetition_penalty=2.0, repeat_last_n=-1)
    assert whole(logits, [[0, 1, 2]])[0] == 0 and whole(logits, [[0, 1, 2]]).dtype == np.int64
    before = logits.copy()
    with whole.penalised(logits, [[0, 1, 2, 3, 3]]) as v:
        np.testing.assert_allclose(v, [[1.5, 1.45, 1.4, -2.0]])
    np.testing.assert_array_equal(logits, before)   # the caller's array is as it was
    frozen = before.copy()
    frozen.flags.writeable = False                  # a read-only array: penalised in a copy
    with whole.penalised(frozen, [[0, 1, 2, 3]]) as v:
        np.testing.assert_allclose(v, [[1.5, 1.45, 1.4, -2.0]])
    whole(logits, [[0, 1]])
    np.testing.assert_array_equal(logits, before)
    off = Sampler(repetition_penalty=2.0, repeat_last_n=0)
    assert off.plain_greedy and not off.needs_history
    with off.penalised(logits, [[0]]) as v:
        np.testing.assert_array_equal(v, before)


def test_strata_run_sampling_flags(tiny_int8_plan):
    from strata_compiler.cli_common import run_cli
    from strata_compiler.runtime.cli import strata_run

    args = [str(tiny_int8_plan), "--prompt", "Once upon a time", "-n", "8", "--backend", "llvm"]
    assert run_cli(strata_run, args + ["--temperature", "0.8", "--top-k", "5", "--min-p", "0.05",
                                       "--repeat-penalty", "1.3", "--seed", "2"]) == 0
    assert run_cli(strata_run, args + ["--repeat-penalty", "0"]) != 0       # out of range: a usage error
    assert run_cli(strata_run, ["--version"]) == 0
