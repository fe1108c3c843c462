"""backends/xla/sampling.py: the device's choice of a token is the host sampler's (runtime/sampler.py)
for the same seed, and a sampled generation on the xla backend decodes ahead with it."""

from __future__ import annotations

import numpy as np
import pytest

from strata_compiler.backends.xla import sampling as ds
from strata_compiler.runtime.plan import load_plan
from strata_compiler.runtime.sampler import Sampler
from strata_compiler.runtime.session import Session
from strata_compiler.sampling import Sampling

SETTINGS = [
    Sampling(),                                                     # the chat defaults
    Sampling(repetition_penalty=1.3, repeat_last_n=16),
    Sampling(top_p=1.0), Sampling(min_p=0.0), Sampling(top_k=5, temperature=1.5),
    Sampling(temperature=0.0, repetition_penalty=1.2, repeat_last_n=8),     # greedy with a penalty
]


@pytest.mark.parametrize("st", SETTINGS, ids=lambda s: s.describe())
def test_device_choice_is_the_host_samplers(st):
    """Random logits with ties and a penalty window: the same token for every row and seed."""
    import jax
    import jax.numpy as jnp

    B, V = 4, 2000
    fn = jax.jit(ds.choose, static_argnums=(4, 5))
    k, greedy = ds.static(st)
    W = st.window
    for seed in range(40):
        r = np.random.default_rng(seed)
        x = np.round(r.standard_normal((B, V)) * 3, 1).astype(np.float32)     # rounded: many equal logits
        hist = r.integers(-1, V, (B, W))
        host = Sampler.of(st, seed=seed)
        want = host(x.copy(), [row[row >= 0] for row in hist] if W else None)
        u = np.zeros(B) if host.greedy else np.random.default_rng(seed).random(B)
        got = fn(jnp.asarray(x), jnp.asarray(hist, jnp.int32), jnp.asarray(u, jnp.float32),
                 jnp.asarray(np.tile(ds.knobs(st), (B, 1))), k, greedy)
        assert np.asarray(got).tolist() == want.tolist(), (seed, st)


def test_supported_bounds_the_sort_and_the_window():
    assert ds.supported(Sampling(), 32000)
    assert ds.supported(Sampling(temperature=0.0, top_k=0), 32000)        # greedy needs no sort
    assert not ds.supported(Sampling(top_k=0), 32000)                     # the whole vocabulary
    assert not ds.supported(Sampling(top_k=ds.MAX_K + 1), 32000)
    assert not ds.supported(Sampling(top_k=40), 40)                       # top-k >= V is off
    assert not ds.supported(Sampling(repeat_last_n=-1), 32000)           # every token seen
    assert ds.supported(Sampling(repeat_last_n=-1, repetition_penalty=1.0), 32000)


@pytest.mark.parametrize("st", [Sampling(), Sampling(temperature=0.0, repetition_penalty=1.3, repeat_last_n=4)],
                         ids=["chat defaults", "greedy with a penalty"])
def test_sampled_generation_decodes_ahead_with_the_host_samplers_tokens(tiny_f32_plan, monkeypatch, st):
    """The xla executor decodes a sampled generation ahead, and its tokens are those of the same
    seed sampled on the host step by step."""
    plan = load_plan(tiny_f32_plan)
    ids = np.array([[5, 17, 300, 42, 7, 99]], np.int64)
    s = Session(plan, "xla")
    calls = []
    real = type(s.executor).decode_ahead
    monkeypatch.setattr(type(s.executor), "decode_ahead",
                        lambda self, *a, **k: calls.append(k.get("sampling")) or real(self, *a, **k))
    _, ahead = s.generate(ids, 12, Sampler.of(st, seed=3), keep_logits=False)
    assert len(calls) == 1 and calls[0] is not None
    monkeypatch.setattr(type(s.executor), "can_decode_ahead", lambda self, *a, **k: False)
    _, host = Session(plan, "xla").generate(ids, 12, Sampler.of(st, seed=3), keep_logits=False)
    assert ahead.tolist() == host.tolist()


def test_batch_step_marks_a_row_of_non_finite_logits(tiny_f32_plan):
    """batch_step's checked tokens: -1 for a row whose logits hold NaN (its token's embedding
    poisoned), the row's token elsewhere; the host reads only these."""
    s = Session(load_plan(tiny_f32_plan), "xla")
    e = s.executor
    s.reset(2, 64)
    e.params["embed"] = {"w": e.params["embed"]["w"].at[7].set(np.nan)}
    tok, checked, logits = e.batch_step(s.cache, 2, np.array([7, 5], np.int32), np.ones(2, bool))
    checked, logits = np.asarray(checked), np.asarray(logits)
    assert checked[0] == -1 and checked[1] == int(np.asarray(tok)[1]) >= 0
    assert not np.isfinite(logits[0]).all() and np.isfinite(logits[1]).all()


def test_decoding_ahead_streams_each_token_and_stops_when_asked(tiny_f32_plan):
    """Session.generate's on_token sees every token but the last as it is read, decoded ahead or
    not; True from it stops the generation there, the tokens made so far kept."""
    from strata_compiler.runtime.session import Interrupted

    plan = load_plan(tiny_f32_plan)
    ids = np.array([[5, 17, 300, 42, 7, 99]], np.int64)
    s = Session(plan, "xla")
    seen = []
    _, new = s.generate(ids, 10, Sampler.of(Sampling(), seed=2), keep_logits=False,
                        on_token=lambda i, t: seen.append((i, int(t[0]))) and False)
    assert seen == [(i, int(t)) for i, t in enumerate(new[0, :-1])]
    with pytest.raises(Interrupted) as e:
        s.generate(ids, 10, Sampler.of(Sampling(), seed=2), keep_logits=False, on_token=lambda i, t: i == 4)
    assert e.value.new.tolist() == new[:, :5].tolist()


def test_batch_step_attends_only_the_span_its_rows_reach(tiny_f32_plan):
    """A batch step over a long cache (a server's whole context) reads the first power-of-two rows
    past every row's position (attention_span): the logits of the whole cache's."""
    import jax

    from strata_compiler.backends.xla.decoding import MIN_SPAN, attention_span

    assert attention_span(1, 4096) == MIN_SPAN and attention_span(600, 4096) == 1024
    assert attention_span(600, 1024) is None and attention_span(3000, 4096) is None
    s = Session(load_plan(tiny_f32_plan), "xla")
    e = s.executor
    s.reset(2, 4096)
    prompt = np.array([[5, 17, 300, 42, 7, 99, 3, 12]], np.int64)
    for row in range(2):        # two rows at different positions
        one = Session(s.plan, "xla")
        one.generate(prompt[:, :6 + 2 * row], 1, Sampler(), keep_logits=False)
        e.load_row(s.cache, row, one.cache)
        s.cache.lengths[row] = 6 + 2 * row
    ids, use = np.array([9, 11], np.int32), np.ones(2, bool)
    args = lambda: ({l: s.cache.k[l] for l in e.layers}, {l: s.cache.v[l] for l in e.layers})    # noqa: E731
    pos = np.asarray(s.cache.lengths[:2], np.int32)
    samp, static = e._batch_sampling(2, None)
    outs = [jax.jit(e._batch_step, static_argnums=(10, 11, 12))(e.params, *args(), ids, ids, use, pos, *samp, *static, span)
            for span in (512, None)]
    np.testing.assert_allclose(np.asarray(outs[0][2]), np.asarray(outs[1][2]), rtol=1e-5, atol=1e-5)
    assert np.asarray(outs[0][0]).tolist() == np.asarray(outs[1][0]).tolist()


def test_a_decode_step_over_a_long_cache_reads_only_its_span(tiny_f32_plan, monkeypatch):
    """Session.step on a cache of the whole context (strata-run --chat's): each decode step's
    attention reads the span its position reaches, with the logits of a short cache's step."""
    from strata_compiler.backends.xla import executor as xe

    plan = load_plan(tiny_f32_plan)
    ids = np.array([[5, 17, 300, 42, 7, 99]], np.int64)
    spans = []
    real = xe.attention_span
    monkeypatch.setattr(xe, "attention_span", lambda need, cap: spans.append(real(need, cap)) or spans[-1])
    out = []
    for capacity in (64, 4096):
        s = Session(plan, "xla")
        s.reset(1, capacity)
        s.step(ids)
        out.append([s.step(np.array([[t]], np.int64))[0, -1] for t in (9, 11, 13)])
    assert spans[-3:] == [512, 512, 512] and None in spans[:3]
    np.testing.assert_allclose(np.array(out[0]), np.array(out[1]), rtol=1e-5, atol=1e-5)
