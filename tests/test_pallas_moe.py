"""The Pallas decode-MoE kernels (backends/xla/pallas_moe.py) in Pallas interpret mode on the CPU:
against a NumPy reference over the formats' own dequantization (ragged shapes, int4/int8, mixed),
against the executor's XLA multiply-reduce, and a tiny model's decode logits and greedy tokens
with the kernels forced (STRATA_XLA_PALLAS=interpret) against the XLA path."""

from __future__ import annotations

import numpy as np
import pytest

from strata_compiler.formats import get_format
from strata_compiler.ir import WeightSpec

jax = pytest.importorskip("jax")
jnp = jax.numpy

from strata_compiler.backends.xla import pallas_moe  # noqa: E402
from strata_compiler.backends.xla.executor import _silu, matvec  # noqa: E402


@pytest.fixture(autouse=True)
def _f32_activations(monkeypatch):
    """The kernels' f32-activation mode unless a test asks for dp4a (the default on a GPU), whose
    q8 activations only come near the references; XLA's attention."""
    monkeypatch.setenv("STRATA_PALLAS_INT4", "bytes")
    monkeypatch.setenv("STRATA_XLA_PALLAS_ATTN", "0")     # its own tests: test_pallas_attn.py
    pow2_blocks(monkeypatch)


def pow2_blocks(monkeypatch) -> None:
    """Every block the kernels load (`_load`) must have power-of-two sizes, as Triton needs on a
    GPU; interpret mode (these tests) would take any shape."""
    from strata_compiler.backends.xla import pallas_attn

    real = pallas_moe._load

    def load(ref, mask):
        out = real(ref, mask)
        assert all(d > 0 and d & (d - 1) == 0 for d in out.shape), f"a block of shape {out.shape} (Triton: 2^n only)"
        return out

    monkeypatch.setattr(pallas_moe, "_load", load)
    monkeypatch.setattr(pallas_attn, "_load", load)


def _experts(E, D, I, fmt_gu, fmt_dn, G, seed):
    rng = np.random.default_rng(seed)
    gu = rng.standard_normal((E, 2 * I, D)).astype(np.float32) / np.sqrt(D)
    dn = rng.standard_normal((E, D, I)).astype(np.float32) / np.sqrt(I)
    ga, da = get_format(fmt_gu).quantize(gu, G), get_format(fmt_dn).quantize(dn, G)
    gs = WeightSpec("gu", (E, 2 * I, D), (), E, fmt_gu, G)
    ds = WeightSpec("dn", (E, D, I), (), E, fmt_dn, G)
    return gs, ga, ds, da


def _route(rng, M, E, k):
    topi = np.stack([rng.choice(E, k, replace=False) for _ in range(M)]).astype(np.int32)
    topw = rng.random((M, k)).astype(np.float32)
    return topi, topw


def _reference(x, topi, topw, gs, ga, ds, da):
    E, I2, D = gs.shape
    I = I2 // 2
    gw = get_format(gs.fmt).dequantize(ga, D, gs.group_size).astype(np.float64)
    dw = get_format(ds.fmt).dequantize(da, I, ds.group_size).astype(np.float64)
    out = np.zeros((x.shape[0], D))
    for m in range(x.shape[0]):
        for j in range(topi.shape[1]):
            h = gw[topi[m, j]] @ x[m]
            out[m] += topw[m, j] * (dw[topi[m, j]] @ (h[:I] / (1 + np.exp(-h[:I])) * h[I:]))
    return out


def _run(x, topi, topw, gs, ga, ds, da):
    dev = lambda a: {r: jnp.asarray(v) for r, v in a.items()}   # noqa: E731
    return np.asarray(pallas_moe.moe_decode(jnp.asarray(x), jnp.asarray(topi), jnp.asarray(topw),
                                            gs, dev(ga), ds, dev(da), interpret=True))


@pytest.mark.parametrize("E,D,I,k,M,fmts,G", [
    (8, 64, 32, 2, 1, ("int4", "int4"), 32),      # exact blocks, no masks
    (8, 200, 72, 3, 2, ("int4", "int4"), 32),     # D and I not multiples of G, groups not 2^n
    (5, 96, 40, 2, 3, ("int8", "int4"), 32),      # mixed formats, ragged row blocks
    (6, 128, 96, 2, 1, ("int4", "int8"), 64),     # G=64; I a multiple of G but not of the block
    (4, 48, 24, 4, 4, ("int8", "int8"), 8),       # every expert chosen, small groups
])
def test_kernels_match_reference(E, D, I, k, M, fmts, G):
    gs, ga, ds, da = _experts(E, D, I, *fmts, G, seed=E + D)
    rng = np.random.default_rng(I)
    x = rng.standard_normal((M, D)).astype(np.float32)
    topi, topw = _route(rng, M, E, k)
    want = _reference(x, topi, topw, gs, ga, ds, da)
    got = _run(x, topi, topw, gs, ga, ds, da)
    assert got.shape == (M, D) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("E,k,M,norm", [(8, 2, 1, False), (6, 3, 2, True), (64, 8, 1, False), (8, 2, 16, True)])
def test_routing_inside_kernels(E, k, M, norm):
    """The kernels' own softmax + top-k over the router logits (E not 2^n: padded) pick the experts
    and weights lax.top_k does, ties included (the lower expert first)."""
    gs, ga, ds, da = _experts(E, 64, 32, "int4", "int4", 32, seed=E)
    rng = np.random.default_rng(k)
    x = rng.standard_normal((M, 64)).astype(np.float32)
    logits = rng.standard_normal((M, E)).astype(np.float32)
    logits[0, 1] = logits[0, 4] = logits[0].max() + 0.5         # a tie at the top
    p = jax.nn.softmax(jnp.asarray(logits), axis=-1)
    topw, topi = jax.lax.top_k(p, k)
    if norm:
        topw = topw / topw.sum(-1, keepdims=True)
    assert int(topi[0, 0]) == 1 and int(topi[0, 1]) == 4
    want = _reference(x, np.asarray(topi), np.asarray(topw), gs, ga, ds, da)
    dev = lambda a: {r: jnp.asarray(v) for r, v in a.items()}   # noqa: E731
    got = np.asarray(pallas_moe.moe_decode(jnp.asarray(x), None, None, gs, dev(ga), ds, dev(da), interpret=True,
                                           logits=jnp.asarray(logits), k=k, norm=norm))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def _cache_split(ga, da, resident, S, seed):
    """An expert cache's two sources for `resident` experts in S slots (the rest of the slots
    unused): slot arrays holding their rows, whole arrays whose rows of those experts are garbage,
    and garbage in the unused slots, so that a read from the wrong source shows."""
    rng = np.random.default_rng(seed)
    E = next(iter(ga.values())).shape[0]
    slot_of = np.full(E, -1, np.int32)
    slot_of[resident] = rng.permutation(S)[:len(resident)]

    def split(a):
        whole, slots = {}, {}
        for r, v in a.items():
            junk = lambda shape: (rng.integers(0, 255, shape) if v.dtype.kind in "ui"      # noqa: E731
                                  else rng.standard_normal(shape) * 50).astype(v.dtype)
            slots[r] = junk((S,) + v.shape[1:])
            slots[r][slot_of[resident]] = v[resident]
            whole[r] = v.copy()
            whole[r][resident] = junk((len(resident),) + v.shape[1:])
        return whole, slots

    return slot_of, split(ga), split(da)


@pytest.mark.parametrize("dp4a", [False, True])
@pytest.mark.parametrize("route", [False, True])
def test_cached_experts_read_from_their_slots_the_rest_from_the_whole_arrays(dp4a, route, monkeypatch):
    """moe_decode(slots=): a resident expert's rows come from its slot, a missing one's from the
    whole (host-mapped) arrays, in both kernels, with the routing outside or inside them; each
    source's wrong rows are garbage, so a read from the wrong one changes the result."""
    if dp4a:
        monkeypatch.setenv("STRATA_PALLAS_INT4", "dp4a")
    E, D, I, k, M = 16, 64, 64, 4, 2
    gs, ga, ds, da = _experts(E, D, I, "int4", "int4", 32, seed=3)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((M, D)).astype(np.float32)
    logits = rng.standard_normal((M, E)).astype(np.float32)
    p = jax.nn.softmax(jnp.asarray(logits), axis=-1)
    topw, topi = jax.lax.top_k(p, k)
    chosen = np.unique(np.asarray(topi))
    resident = np.concatenate([chosen[::2], [e for e in range(E) if e not in chosen][:2]])     # hits and misses
    slot_of, (gw, gsl), (dw, dsl) = _cache_split(ga, da, resident, 8, seed=2)
    dev = lambda a: {r: jnp.asarray(v) for r, v in a.items()}   # noqa: E731
    kw = dict(logits=jnp.asarray(logits), k=k) if route else {}
    ti, tw = (None, None) if route else (jnp.asarray(topi), jnp.asarray(topw))
    want = np.asarray(pallas_moe.moe_decode(jnp.asarray(x), ti, tw, gs, dev(ga), ds, dev(da), interpret=True, **kw))
    got, ids = pallas_moe.moe_decode(jnp.asarray(x), ti, tw, gs, dev(gw), ds, dev(dw), interpret=True,
                                     slots=(jnp.asarray(slot_of), dev(gsl), dev(dsl)), with_ids=True, **kw)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-6 * np.abs(want).max())
    np.testing.assert_array_equal(np.sort(np.asarray(ids).reshape(M, k), 1), np.sort(np.asarray(topi), 1))
    bad = np.asarray(pallas_moe.moe_decode(jnp.asarray(x), ti, tw, gs, dev(gw), ds, dev(dw), interpret=True, **kw))
    assert np.abs(bad - want).max() > 1e-2 * np.abs(want).max()     # the garbage does show


def _spy(monkeypatch, module, name: str, calls=None, record=lambda kw: kw) -> list:
    """Wrap module.name so each call appends record(its keyword arguments) to calls (returned)."""
    calls = [] if calls is None else calls
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(record(kw)) or real(*a, **kw))
    return calls


def _q8(x, G):
    """x rounded as the dp4a kernels' activations: int8 per group of G, scale max|x| / 127."""
    xg = x.reshape(x.shape[0], -1, G).astype(np.float32)
    amax = np.abs(xg).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.floor(xg * inv + np.float32(0.5)), -127, 127)
    return (q * (amax / np.float32(127))).reshape(x.shape)


@pytest.mark.parametrize("E,D,I,k,M", [(8, 64, 32, 2, 1), (8, 200, 72, 3, 2), (6, 128, 96, 2, 3)])
def test_dp4a_kernels_match_q8_reference(E, D, I, k, M, monkeypatch):
    """STRATA_PALLAS_INT4=dp4a (interpret mode: the integer dot products in plain arithmetic): the
    int4 experts times q8-rounded activations (x for gate/up, h for down), ragged shapes included."""
    monkeypatch.setenv("STRATA_PALLAS_INT4", "dp4a")
    G = 32
    gs, ga, ds, da = _experts(E, D, I, "int4", "int4", G, seed=E + D + 1)
    rng = np.random.default_rng(M)
    x = rng.standard_normal((M, D)).astype(np.float32)
    topi, topw = _route(rng, M, E, k)
    gw = get_format("int4").dequantize(ga, D, G).astype(np.float64)
    dw = get_format("int4").dequantize(da, I, G).astype(np.float64)
    Dp, Ip = -(-D // G) * G, -(-I // G) * G
    xq = _q8(np.pad(x, [(0, 0), (0, Dp - D)]), G)[:, :D].astype(np.float64)
    want = np.zeros((M, D))
    for m in range(M):
        for j in range(k):
            h = gw[topi[m, j]] @ xq[m]
            h = (h[:I] / (1 + np.exp(-h[:I])) * h[I:]).astype(np.float32)
            hq = _q8(np.pad(h[None], [(0, 0), (0, Ip - I)]), G)[0, :I].astype(np.float64)
            want[m] += topw[m, j] * (dw[topi[m, j]] @ hq)
    got = _run(x, topi, topw, gs, ga, ds, da)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    exact = _reference(x, topi, topw, gs, ga, ds, da)           # and near the f32-activation result
    assert np.abs(got - exact).max() <= 0.03 * np.abs(exact).max()


@pytest.mark.parametrize("N,K,M", [(64, 64, 1), (50, 200, 3), (300, 96, 2)])
def test_dp4a_linear_matches_q8_reference(N, K, M, monkeypatch):
    """The dense int4 decode kernel (linear_decode, dp4a mode, interpret): W x_q8 for ragged rows
    and groups; and use_linear picks it only for int4 2-D weights in dp4a mode."""
    monkeypatch.setenv("STRATA_PALLAS_INT4", "dp4a")
    G = 32
    rng = np.random.default_rng(N + K)
    w = rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K)
    arrays = get_format("int4").quantize(w, G)
    spec = WeightSpec("w", (N, K), (), 0, "int4", G)
    x = rng.standard_normal((M, K)).astype(np.float32)
    Kp = -(-K // G) * G
    xq = _q8(np.pad(x, [(0, 0), (0, Kp - K)]), G)[:, :K].astype(np.float64)
    want = xq @ get_format("int4").dequantize(arrays, K, G).astype(np.float64).T
    got = np.asarray(pallas_moe.linear_decode(jnp.asarray(x), spec, {r: jnp.asarray(v) for r, v in arrays.items()},
                                              interpret=True))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert pallas_moe.use_linear(True, spec, M) == (True, False)
    assert pallas_moe.use_linear(True, WeightSpec("w", (N, K), (), 0, "int8", G), M)[0] is False
    monkeypatch.setenv("STRATA_PALLAS_INT4", "bytes")
    assert pallas_moe.use_linear(True, spec, M)[0] is False       # XLA's multiply-reduce is as fast


def _rms_np(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("N,K,M", [(64, 64, 1), (50, 200, 3)])
def test_dp4a_linear_takes_the_norm_and_the_residual(N, K, M, monkeypatch):
    """linear_decode(rms=, residual=): W q8(rms_norm(x)) + r in one kernel."""
    monkeypatch.setenv("STRATA_PALLAS_INT4", "dp4a")
    G, eps = 32, 1e-5
    rng = np.random.default_rng(N * K)
    w = rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K)
    arrays = get_format("int4").quantize(w, G)
    spec = WeightSpec("w", (N, K), (), 0, "int4", G)
    x = 3 * rng.standard_normal((M, K)).astype(np.float32)
    nw = (1 + 0.3 * rng.standard_normal(K)).astype(np.float32)
    r = rng.standard_normal((M, N)).astype(np.float32)
    Kp = -(-K // G) * G
    xn = _rms_np(x, nw, eps).astype(np.float32)
    xq = _q8(np.pad(xn, [(0, 0), (0, Kp - K)]), G)[:, :K].astype(np.float64)
    want = xq @ get_format("int4").dequantize(arrays, K, G).astype(np.float64).T + r
    got = np.asarray(pallas_moe.linear_decode(jnp.asarray(x), spec, {k: jnp.asarray(v) for k, v in arrays.items()},
                                              interpret=True, rms=(jnp.asarray(nw), eps), residual=jnp.asarray(r)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("fmt,N,K,M", [("f32", 64, 256, 1), ("bf16", 6, 200, 2)])
def test_dense_router_kernel_takes_the_norm(fmt, N, K, M, monkeypatch):
    """dense_decode: rms_norm(x) @ W^T for f32 / bf16 routers (ragged rows and K)."""
    monkeypatch.setenv("STRATA_PALLAS_INT4", "dp4a")
    rng = np.random.default_rng(N)
    w = rng.standard_normal((N, K)).astype(np.float32)
    arrays = get_format(fmt).quantize(w, 0)
    wd = get_format(fmt).dequantize(arrays, K, 0).astype(np.float64)
    x = rng.standard_normal((M, K)).astype(np.float32)
    nw = (1 + 0.3 * rng.standard_normal(K)).astype(np.float32)
    spec = WeightSpec("r", (N, K), (), 0, fmt, 0)
    want = _rms_np(x, nw, 1e-6) @ wd.T
    got = np.asarray(pallas_moe.dense_decode(jnp.asarray(x), spec, {k: jnp.asarray(v) for k, v in arrays.items()},
                                             (jnp.asarray(nw), 1e-6), interpret=True))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert pallas_moe.use_dense(True, spec, M) == (True, False)
    monkeypatch.setenv("STRATA_PALLAS_INT4", "bytes")
    assert pallas_moe.use_dense(True, spec, M)[0] is False


@pytest.mark.parametrize("I", [64, 40])
def test_dp4a_moe_takes_the_norm_and_the_residual(I, monkeypatch):
    """moe_decode(rms=, residual=): gate_up normalises x, down adds the residual; I = 64 hands h
    over in q8 form (q8_between), I = 40 (not a multiple of G) as f32."""
    monkeypatch.setenv("STRATA_PALLAS_INT4", "dp4a")
    E, D, k, M, G, eps = 6, 128, 2, 2, 32, 1e-5
    gs, ga, ds, da = _experts(E, D, I, "int4", "int4", G, seed=I)
    assert pallas_moe.q8_between(gs, ds, "dp4a") == (I % G == 0)
    rng = np.random.default_rng(I)
    x = 2 * rng.standard_normal((M, D)).astype(np.float32)
    nw = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    r = rng.standard_normal((M, D)).astype(np.float32)
    topi, topw = _route(rng, M, E, k)
    xn = _rms_np(x, nw, eps).astype(np.float32)
    dev = lambda a: {n: jnp.asarray(v) for n, v in a.items()}   # noqa: E731
    want = np.asarray(pallas_moe.moe_decode(jnp.asarray(xn), jnp.asarray(topi), jnp.asarray(topw), gs, dev(ga), ds,
                                            dev(da), interpret=True)) + r
    got = np.asarray(pallas_moe.moe_decode(jnp.asarray(x), jnp.asarray(topi), jnp.asarray(topw), gs, dev(ga), ds,
                                           dev(da), interpret=True, rms=(jnp.asarray(nw), eps),
                                           residual=jnp.asarray(r)))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())   # q8 of a rounded-apart x


def test_dp4a_model_logits_near_the_xla_path(int_plans, monkeypatch):
    """A tiny int4 model's decode logits with every int4 matrix product on the dp4a kernels
    (interpret mode), norms and residual adds folded into them, stay within q8 rounding of the
    XLA path's."""
    from strata_compiler.runtime.plan import load_plan

    plan = load_plan(int_plans["int4"])
    ids = np.random.default_rng(7).integers(0, 100, (1, 5))
    calls = []
    for name in ("linear_decode", "dense_decode", "moe_decode"):
        _spy(monkeypatch, pallas_moe, name, calls,
             lambda kw, name=name: (name, kw.get("rms") is not None, kw.get("residual") is not None,
                                    kw.get("router") is not None or kw.get("partials") is not None))
    want, _ = _decode(plan, ids, monkeypatch, "0")
    monkeypatch.setenv("STRATA_PALLAS_INT4", "dp4a")
    got, _ = _decode(plan, ids, monkeypatch, "interpret")
    # q/k/v and lm_head with their norm, o with its residual and the router after the MoE's norm,
    # the MoE with that norm, the residual and the router's partials: no norm, residual or router
    # kernel of its own is left in a layer
    assert {("linear_decode", True, False, False), ("linear_decode", False, True, True),
            ("moe_decode", True, True, True)} <= set(calls)
    assert not [c for c in calls if c[0] == "dense_decode"]
    assert np.abs(got - want).max() <= 0.05 * want.std()


def test_kernels_match_xla_multiply_reduce():
    """The executor's decode path (matvec over the gathered experts) gives the same numbers."""
    gs, ga, ds, da = _experts(16, 256, 64, "int4", "int4", 32, seed=1)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    topi, topw = _route(rng, 2, 16, 4)
    ti = jnp.asarray(topi)
    gu = matvec(jnp, gs, {r: jnp.asarray(v)[ti] for r, v in ga.items()}, jnp.asarray(x)[:, None, :])
    h = _silu(jnp, gu[..., :64]) * gu[..., 64:]
    y = matvec(jnp, ds, {r: jnp.asarray(v)[ti] for r, v in da.items()}, h)
    want = np.asarray((y * jnp.asarray(topw)[..., None]).sum(axis=1))
    got = _run(x, topi, topw, gs, ga, ds, da)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_use_switch(monkeypatch):
    gs, _, ds, _ = _experts(2, 32, 16, "int4", "int4", 32, seed=0)
    monkeypatch.delenv("STRATA_XLA_PALLAS", raising=False)
    assert pallas_moe.use(False, gs, ds, 1) == (False, False)      # CPU: the XLA path
    assert pallas_moe.use(True, gs, ds, 1) == (True, False)
    assert pallas_moe.use(True, gs, ds, pallas_moe.MAX_ROWS + 1)[0] is False
    monkeypatch.setenv("STRATA_PALLAS_MAX_ROWS", "4")
    assert pallas_moe.use(True, gs, ds, 4) == (True, False) and pallas_moe.use(True, gs, ds, 5)[0] is False
    monkeypatch.delenv("STRATA_PALLAS_MAX_ROWS")
    monkeypatch.setenv("STRATA_XLA_PALLAS", "0")
    assert pallas_moe.use(True, gs, ds, 1) == (False, False)
    monkeypatch.setenv("STRATA_XLA_PALLAS", "interpret")
    assert pallas_moe.use(False, gs, ds, 1) == (True, True)
    bf = WeightSpec("gu", gs.shape, (), 2, "bf16", 0)
    odd = WeightSpec("gu", gs.shape, (), 2, "int4", 12)                  # G/2 = 6: not 2^n
    assert not pallas_moe.supported(bf, ds) and not pallas_moe.supported(odd, ds)


@pytest.fixture(scope="module")
def int_plans(tmp_path_factory):
    from hf_models import build_model
    from strata_compiler.cli import stratac
    from strata_compiler.cli_common import run_cli

    tmp = tmp_path_factory.mktemp("pallas")
    d = build_model("olmoe", tmp / "model")
    out = {}
    for q in ("int4", "int8"):
        assert run_cli(stratac, ["compile", str(d), "-o", str(tmp / q), "--quant", q]) == 0
        out[q] = tmp / q
    return out


def _decode(plan, ids, monkeypatch, mode, capacity: int = 64, n: int = 6):
    """Logits of one decode step after a prefill, then n greedy tokens in the device loop."""
    from strata_compiler.runtime.session import Session

    monkeypatch.setenv("STRATA_XLA_PALLAS", mode)
    s = Session(plan, "xla")
    s.reset(ids.shape[0], capacity)
    first = s.step(ids)[:, -1].argmax(-1)
    logits = s.step(first[:, None])[:, -1]
    toks = s.executor.greedy_decode(logits.argmax(-1), s.cache, n)
    return logits, toks


@pytest.mark.parametrize("quant,batch", [("int4", 1), ("int4", 3), ("int8", 2)])
def test_model_logits_unchanged_with_kernels(int_plans, monkeypatch, quant, batch):
    from strata_compiler.runtime.plan import load_plan

    plan = load_plan(int_plans[quant])
    ids = np.random.default_rng(batch).integers(0, 100, (batch, 5))
    calls = _spy(monkeypatch, pallas_moe, "moe_decode")
    want, want_toks = _decode(plan, ids, monkeypatch, "0")
    assert not calls
    got, got_toks = _decode(plan, ids, monkeypatch, "interpret")
    assert calls and all(kw["interpret"] for kw in calls)      # traced once per MoE layer and shape
    assert np.abs(got - want).max() <= 1e-5 * want.std()
    np.testing.assert_array_equal(got_toks, want_toks)


def test_bad_tuning_is_one_clear_error(monkeypatch):
    from strata_compiler.errors import UsageError

    for bad in ("abc", "32,4", "32,3,4,4"):
        monkeypatch.setenv("STRATA_PALLAS_TUNE", bad)
        with pytest.raises(UsageError, match="STRATA_PALLAS_TUNE=.*powers of two"):
            pallas_moe.tuning()
    monkeypatch.setenv("STRATA_PALLAS_TUNE", "32,4,4,4")
    assert pallas_moe.tuning() == (32, 4, 4, 4)
    for env, bad in (("STRATA_PALLAS_INT4", "dp4"), ("STRATA_XLA_PALLAS_ROUTE", "inside"),
                     ("STRATA_PALLAS_MAX_ROWS", "12")):
        monkeypatch.setenv(env, bad)
        with pytest.raises(UsageError, match=f"{env}="):
            (pallas_moe.int4_mode(), pallas_moe.route_mode(), pallas_moe.max_rows())
        monkeypatch.delenv(env)
    monkeypatch.setenv("STRATA_XLA_PALLAS_ROUTE", "off")
    assert pallas_moe.route_mode() == "0" and not pallas_moe.route_inside()


@pytest.mark.parametrize("fmt,E,N,M", [("f32", 8, 64, 1), ("bf16", 6, 200, 2)])
def test_dp4a_linear_computes_the_router_after_it(fmt, E, N, M, monkeypatch):
    """linear_decode(router=): the projection's output (with its residual) and, from the same
    kernel, partial router sums whose total over the row blocks divided by the output's rms is
    the router's logits on rms_norm(output); moe_decode(partials=) routes from them as from those
    logits (E = 6 pads the experts, N = 200 ragged row blocks)."""
    monkeypatch.setenv("STRATA_PALLAS_INT4", "dp4a")
    rng = np.random.default_rng(E)
    K, eps = 64, 1e-5
    wo = rng.standard_normal((N, K)).astype(np.float32)
    ospec = WeightSpec("o", (N, K), (), 0, "int4", 32)
    oarr = {n: jnp.asarray(v) for n, v in get_format("int4").quantize(wo, 32).items()}
    wr = rng.standard_normal((E, N)).astype(np.float32)
    rarr = get_format(fmt).quantize(wr, 0)
    wrd = get_format(fmt).dequantize(rarr, N, 0).astype(np.float64)
    rspec = WeightSpec("r", (E, N), (), 0, fmt, 0)
    assert pallas_moe.router_fusable(ospec, rspec)
    x = rng.standard_normal((M, K)).astype(np.float32)
    res = rng.standard_normal((M, N)).astype(np.float32)
    nw = (1 + 0.3 * rng.standard_normal(N)).astype(np.float32)
    want_y = np.asarray(pallas_moe.linear_decode(jnp.asarray(x), ospec, oarr, interpret=True,
                                                 residual=jnp.asarray(res)))
    y, part = pallas_moe.linear_decode(jnp.asarray(x), ospec, oarr, interpret=True, residual=jnp.asarray(res),
                                       router=(rspec, {n: jnp.asarray(v) for n, v in rarr.items()}, jnp.asarray(nw)))
    np.testing.assert_array_equal(np.asarray(y), want_y)
    part = np.asarray(part)
    assert part.shape[0] == M and part.shape[2] == pallas_moe._pow2(E)
    yd = want_y.astype(np.float64)
    logits = _rms_np(yd, nw, eps) @ wrd.T
    rms = np.sqrt((yd * yd).mean(-1, keepdims=True) + eps)
    np.testing.assert_allclose(part.sum(1)[:, :E] / rms, logits, rtol=0, atol=1e-5 * np.abs(logits).max())

    # the MoE after it: routing from the partials = routing from the logits
    D, I, k = N, 64, 2
    gs, ga, ds, da = _experts(E, D, I, "int4", "int4", 32, seed=E)
    dev = lambda a: {n: jnp.asarray(v) for n, v in a.items()}   # noqa: E731
    kw = dict(interpret=True, k=k, norm=True, rms=(jnp.asarray(nw), eps), residual=jnp.asarray(res))
    want = pallas_moe.moe_decode(y, None, None, gs, dev(ga), ds, dev(da), logits=jnp.asarray(logits, jnp.float32),
                                 **kw)
    got = pallas_moe.moe_decode(y, None, None, gs, dev(ga), ds, dev(da), partials=jnp.asarray(part), n_experts=E,
                                **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * np.abs(np.asarray(want)).max())


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_dp4a_router_in_o_other_architectures(arch, tmp_path, monkeypatch):
    """The router as the o projection's epilogue on the other MoE families: renormalised top-k
    (mixtral, qwen3), a shared expert beside the routed ones whose gate is the router's last
    column (qwen2: the route reads a slice), GQA. The MoE kernels route from the o projection's
    partial sums; logits within q8 rounding of the XLA path."""
    from hf_models import build_model
    from strata_compiler.cli import stratac
    from strata_compiler.cli_common import run_cli
    from strata_compiler.runtime.plan import load_plan

    d = build_model(arch, tmp_path / "model")
    assert run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "plan"), "--quant", "int4"]) == 0
    plan = load_plan(tmp_path / "plan")
    ids = np.random.default_rng(5).integers(0, 100, (2, 5))
    routed = _spy(monkeypatch, pallas_moe, "moe_decode", record=lambda kw: kw.get("partials") is not None)
    want, _ = _decode(plan, ids, monkeypatch, "0")
    monkeypatch.setenv("STRATA_PALLAS_INT4", "dp4a")
    got, _ = _decode(plan, ids, monkeypatch, "interpret")
    assert True in routed
    assert np.abs(got - want).max() <= 0.05 * want.std()


def test_dp4a_linear_kernel_for_more_rows(int_plans, monkeypatch):
    """STRATA_PALLAS_LINEAR_ROWS=16: the dense int4 projections of a 5-token prefill (padded to the
    16-row bucket) also run on the linear kernel (with the router in o); logits within q8 rounding
    of the XLA path."""
    from strata_compiler.runtime.plan import load_plan

    plan = load_plan(int_plans["int4"])
    ids = np.random.default_rng(11).integers(0, 100, (1, 5))
    want, _ = _decode(plan, ids, monkeypatch, "0")
    rows = _spy(monkeypatch, pallas_moe, "linear_decode", record=lambda kw: kw.get("router") is not None)
    monkeypatch.setenv("STRATA_PALLAS_INT4", "dp4a")
    monkeypatch.setenv("STRATA_PALLAS_LINEAR_ROWS", "16")
    real = pallas_moe.linear_decode
    shapes = []
    monkeypatch.setattr(pallas_moe, "linear_decode", lambda x, *a, **kw: shapes.append(x.shape[0]) or real(x, *a, **kw))
    got, _ = _decode(plan, ids, monkeypatch, "interpret")
    assert 16 in shapes and True in rows
    assert np.abs(got - want).max() <= 0.05 * want.std()
