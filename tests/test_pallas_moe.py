"""The Pallas decode kernels (backends/xla/pallas_moe.py, pallas_dense.py) in Pallas interpret mode
on the CPU: against a NumPy reference over the formats' own dequantization (ragged shapes,
int4/int8, mixed; int4 against q8-rounded activations, as dp4a computes), against the executor's
XLA multiply-reduce, and tiny models' decode logits and greedy tokens with the kernels forced
(STRATA_PALLAS=interpret) against the XLA path."""

from __future__ import annotations

import numpy as np
import pytest

from strata_compiler.formats import get_format
from strata_compiler.ir import WeightSpec

jax = pytest.importorskip("jax")
jnp = jax.numpy

from strata_compiler.backends.xla import pallas_dense, pallas_moe, pallas_quant  # noqa: E402
from strata_compiler.backends.xla.dequant import matvec, silu  # noqa: E402


@pytest.fixture(autouse=True)
def _xla_attention(monkeypatch):
    """XLA's attention (the kernel's own tests: test_pallas_attn.py); Triton's block shapes."""
    monkeypatch.setenv("STRATA_PALLAS_ATTN", "off")
    pow2_blocks(monkeypatch)


def pow2_blocks(monkeypatch) -> None:
    """Every block the kernels load (`_load`) must have power-of-two sizes, as Triton needs on a
    GPU; interpret mode (these tests) would take any shape."""
    from strata_compiler.backends.xla import pallas_attn

    real = pallas_quant._load

    def load(ref, mask):
        out = real(ref, mask)
        assert all(d > 0 and d & (d - 1) == 0 for d in out.shape), f"a block of shape {out.shape} (Triton: 2^n only)"
        return out

    for module in (pallas_quant, pallas_moe, pallas_dense, pallas_attn):
        monkeypatch.setattr(module, "_load", load)


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


def _q8(x, G, planes: int = 1):
    """x rounded as the dp4a kernels' activations: int8 per group of G, scale max|x| / 127; planes
    2 (int8 weights' q16): plus a second int8 code for what the first left, x ~ d (hi + lo / 254)."""
    xg = x.reshape(x.shape[0], -1, G).astype(np.float32)
    amax = np.abs(xg).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.floor(xg * inv + np.float32(0.5)), -127, 127)
    if planes == 2:
        q = q + np.floor((xg * inv - q) * np.float32(254) + np.float32(0.5)) / np.float32(254)
    return (q * (amax / np.float32(127))).reshape(x.shape)


def _planes(spec) -> int:
    return pallas_quant._Proj(pallas_quant._Spec(spec.fmt, spec.group_size, (1, *spec.shape[-2:]))).planes


def _as_read(x, spec):
    """The activation rows x [R, K] as a kernel reading weights stored as `spec` multiplies them:
    q8-rounded where it takes dp4a words (int4, int4a; int8 with a group of a multiple of 4)."""
    if not pallas_quant._Proj(pallas_quant._Spec(spec.fmt, spec.group_size, (1, *spec.shape[-2:]))).dp4a:
        return x.astype(np.float64)
    G, K = spec.group_size, x.shape[1]
    Kp = -(-K // G) * G
    return _q8(np.pad(x, [(0, 0), (0, Kp - K)]).astype(np.float32), G, _planes(spec))[:, :K].astype(np.float64)


def _reference(x, topi, topw, gs, ga, ds, da, q8: bool = True):
    """The MoE in float64 over the formats' dequantization; q8: each int4 projection's input
    q8-rounded first (x for gate_up, h for down), as the kernels compute."""
    E, I2, D = gs.shape
    I = I2 // 2
    gw = get_format(gs.fmt).dequantize(ga, D, gs.group_size).astype(np.float64)
    dw = get_format(ds.fmt).dequantize(da, I, ds.group_size).astype(np.float64)
    xr = _as_read(x, gs) if q8 else x.astype(np.float64)
    out = np.zeros((x.shape[0], D))
    for m in range(x.shape[0]):
        for j in range(topi.shape[1]):
            h = gw[topi[m, j]] @ xr[m]
            h = (h[:I] / (1 + np.exp(-h[:I])) * h[I:]).astype(np.float32)[None]
            h = _as_read(h, ds)[0] if q8 else h[0].astype(np.float64)
            out[m] += topw[m, j] * (dw[topi[m, j]] @ h)
    return out


def _tolerance(gs, ds) -> float:
    """Relative tolerance against `_reference`: a q8 rounding that may land on the other side of a
    step (f32 against float64 activations)."""
    return 1e-4


def _run(x, topi, topw, gs, ga, ds, da):
    dev = lambda a: {r: jnp.asarray(v) for r, v in a.items()}   # noqa: E731
    return np.asarray(pallas_moe.moe_decode(jnp.asarray(x), jnp.asarray(topi), jnp.asarray(topw),
                                            gs, dev(ga), ds, dev(da), interpret=True))


@pytest.mark.parametrize("E,D,I,k,M,fmts,G", [
    (8, 64, 32, 2, 1, ("int4", "int4"), 32),      # exact blocks, no masks; h handed over in q8
    (8, 200, 72, 3, 2, ("int4", "int4"), 32),     # D and I not multiples of G, groups not 2^n
    (6, 128, 96, 2, 3, ("int4", "int4"), 32),
    (8, 64, 32, 2, 2, ("int4", "int4"), 8),       # the smallest int4 group: one u32 word
    (5, 96, 40, 2, 3, ("int8", "int4"), 32),      # mixed formats, ragged row blocks
    (6, 128, 96, 2, 1, ("int4", "int8"), 64),     # G=64; I a multiple of G but not of the block
    (4, 48, 24, 4, 4, ("int8", "int8"), 8),       # every expert chosen, small groups
    (4, 64, 64, 2, 1, ("int4a", "int8"), 32),     # Q4_K_M's Q6_K layers: h handed to int8 down in q8
    (4, 64, 24, 2, 2, ("int8", "int8"), 2),       # int8 groups of 2: no dp4a word, f32 activations
    (8, 200, 72, 3, 2, ("int4a", "int4a"), 32),   # Q4_1's layout: (scale, min) pairs
    (6, 128, 96, 2, 1, ("int4a", "int4"), 32),
])
def test_kernels_match_reference(E, D, I, k, M, fmts, G):
    gs, ga, ds, da = _experts(E, D, I, *fmts, G, seed=E + D)
    rng = np.random.default_rng(I)
    x = rng.standard_normal((M, D)).astype(np.float32)
    topi, topw = _route(rng, M, E, k)
    want = _reference(x, topi, topw, gs, ga, ds, da)
    got = _run(x, topi, topw, gs, ga, ds, da)
    assert got.shape == (M, D) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(gs, ds) * np.abs(want).max())
    exact = _reference(x, topi, topw, gs, ga, ds, da, q8=False)      # and near the f32-activation result
    assert np.abs(got - exact).max() <= 0.03 * np.abs(exact).max()


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
    np.testing.assert_allclose(got, want, rtol=0, atol=_tolerance(gs, ds) * np.abs(want).max())


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


@pytest.mark.parametrize("route", [False, True])
def test_cached_experts_read_from_their_slots_the_rest_from_the_whole_arrays(route):
    """moe_decode(slots=): a resident expert's rows come from its slot, a missing one's from the
    whole (host-mapped) arrays, in both kernels, with the routing outside or inside them; each
    source's wrong rows are garbage, so a read from the wrong one changes the result."""
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


@pytest.mark.parametrize("fmt", ["int4", "int4a", "int8"])
@pytest.mark.parametrize("N,K,M", [(64, 64, 1), (50, 200, 3), (300, 96, 2)])
def test_dp4a_linear_matches_q8_reference(N, K, M, fmt):
    """The dense int4/int4a/int8 decode kernel (linear_decode, interpret): W x_q8 for ragged rows
    and groups; and use_linear picks it only for 2-D weights whose groups fill u32 words."""
    G = 32
    rng = np.random.default_rng(N + K)
    w = rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K) + (0.05 if fmt == "int4a" else 0.0)
    arrays = get_format(fmt).quantize(w, G)
    spec = WeightSpec("w", (N, K), (), 0, fmt, G)
    x = rng.standard_normal((M, K)).astype(np.float32)
    Kp = -(-K // G) * G
    xq = _q8(np.pad(x, [(0, 0), (0, Kp - K)]), G, _planes(spec))[:, :K].astype(np.float64)
    want = xq @ get_format(fmt).dequantize(arrays, K, G).astype(np.float64).T
    got = np.asarray(pallas_dense.linear_decode(jnp.asarray(x), spec, {r: jnp.asarray(v) for r, v in arrays.items()},
                                                interpret=True))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert pallas_dense.use_linear(True, spec, M) == (True, False)
    assert pallas_dense.use_linear(False, spec, M) == (False, False)      # CPU: XLA's multiply-reduce
    assert pallas_dense.use_linear(True, WeightSpec("w", (N, K), (), 0, "int8", 2), M)[0] is False
    assert pallas_dense.use_linear(True, WeightSpec("w", (N, K), (), 0, "int4", 4), M)[0] is False


def _rms_np(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("N,K,M", [(64, 64, 1), (50, 200, 3)])
def test_dp4a_linear_takes_the_norm_and_the_residual(N, K, M):
    """linear_decode(rms=, residual=): W q8(rms_norm(x)) + r in one kernel."""
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
    got = np.asarray(pallas_dense.linear_decode(jnp.asarray(x), spec, {k: jnp.asarray(v) for k, v in arrays.items()},
                                                interpret=True, rms=(jnp.asarray(nw), eps), residual=jnp.asarray(r)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("fmt,N,K,M", [("f32", 64, 256, 1), ("bf16", 6, 200, 2)])
def test_dense_router_kernel_takes_the_norm(fmt, N, K, M, monkeypatch):
    """dense_decode: rms_norm(x) @ W^T for f32 / bf16 routers (ragged rows and K)."""
    rng = np.random.default_rng(N)
    w = rng.standard_normal((N, K)).astype(np.float32)
    arrays = get_format(fmt).quantize(w, 0)
    wd = get_format(fmt).dequantize(arrays, K, 0).astype(np.float64)
    x = rng.standard_normal((M, K)).astype(np.float32)
    nw = (1 + 0.3 * rng.standard_normal(K)).astype(np.float32)
    spec = WeightSpec("r", (N, K), (), 0, fmt, 0)
    want = _rms_np(x, nw, 1e-6) @ wd.T
    got = np.asarray(pallas_dense.dense_decode(jnp.asarray(x), spec, {k: jnp.asarray(v) for k, v in arrays.items()},
                                               (jnp.asarray(nw), 1e-6), interpret=True))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert pallas_dense.use_dense(True, spec, M) == (True, False)
    monkeypatch.setenv("STRATA_PALLAS", "off")
    assert pallas_dense.use_dense(True, spec, M)[0] is False


@pytest.mark.parametrize("I", [64, 40])
def test_dp4a_moe_takes_the_norm_and_the_residual(I):
    """moe_decode(rms=, residual=): gate_up normalises x, down adds the residual; I = 64 hands h
    over in q8 form (q8_between), I = 40 (not a multiple of G) as f32."""
    E, D, k, M, G, eps = 6, 128, 2, 2, 32, 1e-5
    gs, ga, ds, da = _experts(E, D, I, "int4", "int4", G, seed=I)
    assert pallas_moe.q8_between(gs, ds) == (I % G == 0)
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


@pytest.mark.parametrize("batch", [1, 3])
def test_dp4a_model_logits_near_the_xla_path(int_plans, monkeypatch, batch):
    """A tiny int4 model's decode logits with every int4 matrix product on the dp4a kernels
    (interpret mode), norms and residual adds folded into them, stay within q8 rounding of the
    XLA path's."""
    from strata_compiler.runtime.plan import load_plan

    plan = load_plan(int_plans["int4"])
    ids = np.random.default_rng(7 + batch).integers(0, 100, (batch, 5))
    calls = []
    for module, name in ((pallas_dense, "linear_decode"), (pallas_dense, "dense_decode"), (pallas_moe, "moe_decode")):
        _spy(monkeypatch, module, name, calls,
             lambda kw, name=name: (name, kw.get("rms") is not None, kw.get("residual") is not None,
                                    kw.get("router") is not None or kw.get("partials") is not None))
    want, _ = _decode(plan, ids, monkeypatch, "off")
    assert not calls
    got, _ = _decode(plan, ids, monkeypatch, "interpret")
    # q/k/v and lm_head with their norm, o with its residual and the router after the MoE's norm,
    # the MoE with that norm, the residual and the router's partials: no norm, residual or router
    # kernel of its own is left in a layer
    assert {("linear_decode", True, False, False), ("linear_decode", False, True, True),
            ("moe_decode", True, True, True)} <= set(calls)
    assert not [c for c in calls if c[0] == "dense_decode"]
    assert np.abs(got - want).max() <= 0.05 * want.std()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_kernels_match_xla_multiply_reduce(fmt):
    """The executor's decode path (matvec over the gathered experts) gives the same numbers, over
    the activations the kernels read (int4: q8-rounded)."""
    gs, ga, ds, da = _experts(16, 256, 64, fmt, fmt, 32, seed=1)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    topi, topw = _route(rng, 2, 16, 4)
    ti = jnp.asarray(topi)
    xr = jnp.asarray(_as_read(x, gs), jnp.float32)
    gu = matvec(jnp, gs, {r: jnp.asarray(v)[ti] for r, v in ga.items()}, xr[:, None, :])
    h = np.asarray(silu(jnp, gu[..., :64]) * gu[..., 64:]).reshape(-1, 64)
    h = jnp.asarray(_as_read(h, ds), jnp.float32).reshape(2, 4, 64)
    y = matvec(jnp, ds, {r: jnp.asarray(v)[ti] for r, v in da.items()}, h)
    want = np.asarray((y * jnp.asarray(topw)[..., None]).sum(axis=1))
    got = _run(x, topi, topw, gs, ga, ds, da)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_use_switch(monkeypatch):
    from strata_compiler import settings

    gs, _, ds, _ = _experts(2, 32, 16, "int4", "int4", 32, seed=0)
    monkeypatch.delenv("STRATA_PALLAS", raising=False)
    monkeypatch.delenv("STRATA_PALLAS_MAX_ROWS", raising=False)
    assert pallas_moe.use(False, gs, ds, 1) == (False, False)      # CPU: the XLA path
    assert pallas_moe.use(True, gs, ds, 1) == (True, False)
    assert pallas_moe.use(True, gs, ds, settings.declared("pallas_max_rows").default[0] + 1)[0] is False
    monkeypatch.setenv("STRATA_PALLAS_MAX_ROWS", "4")
    assert pallas_moe.use(True, gs, ds, 4) == (True, False) and pallas_moe.use(True, gs, ds, 5)[0] is False
    monkeypatch.delenv("STRATA_PALLAS_MAX_ROWS")
    monkeypatch.setenv("STRATA_PALLAS", "off")
    assert pallas_moe.use(True, gs, ds, 1) == (False, False)
    monkeypatch.setenv("STRATA_PALLAS", "interpret")
    assert pallas_moe.use(False, gs, ds, 1) == (True, True)
    bf = WeightSpec("gu", gs.shape, (), 2, "bf16", 0)
    odd = WeightSpec("gu", gs.shape, (), 2, "int4", 12)                  # G/2 = 6: not 2^n
    small = WeightSpec("gu", gs.shape, (), 2, "int4", 4)                 # G/2 = 2 bytes: no u32 word
    assert not any(pallas_moe.supported(s, ds) for s in (bf, odd, small))


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

    monkeypatch.setenv("STRATA_PALLAS", mode)
    s = Session(plan, "xla")
    s.reset(ids.shape[0], capacity)
    first = s.step(ids)[:, -1].argmax(-1)
    logits = s.step(first[:, None])[:, -1]
    toks = s.executor.greedy_decode(logits.argmax(-1), s.cache, n)
    return logits, toks


@pytest.mark.parametrize("batch", [1, 2])
def test_int8_model_logits_near_the_xla_path(int_plans, monkeypatch, batch):
    """An int8 model on the dp4a kernels (signed weight bytes, q16 activations): its experts and
    dense projections take the kernels with their norms and residual adds folded in, and the
    logits stay within q16 rounding of the XLA path's (f32 activations), its greedy tokens too."""
    from strata_compiler.runtime.plan import load_plan

    plan = load_plan(int_plans["int8"])
    ids = np.random.default_rng(batch).integers(0, 100, (batch, 5))
    calls = []
    for module, name in ((pallas_dense, "linear_decode"), (pallas_moe, "moe_decode")):
        _spy(monkeypatch, module, name, calls, lambda kw, name=name: (name, kw.get("rms") is not None))
    want, want_toks = _decode(plan, ids, monkeypatch, "off")
    assert not calls
    got, got_toks = _decode(plan, ids, monkeypatch, "interpret")
    assert {("linear_decode", True), ("moe_decode", True)} <= set(calls)
    assert np.abs(got - want).max() <= 1e-3 * want.std()
    np.testing.assert_array_equal(got_toks, want_toks)


def test_bad_tuning_is_one_clear_error(monkeypatch):
    from strata_compiler.errors import UsageError

    for bad in ("abc", "32,4", "32,3,4,4"):
        monkeypatch.setenv("STRATA_PALLAS_TUNE", bad)
        with pytest.raises(UsageError, match="STRATA_PALLAS_TUNE=.*powers of two"):
            pallas_moe.tuning()
    monkeypatch.setenv("STRATA_PALLAS_TUNE", "64,4,8,4")
    assert pallas_moe.tuning() == (64, 4, 8, 4)
    for env, bad in (("STRATA_PALLAS_MAX_ROWS", "12"), ("STRATA_PALLAS", "sometimes")):
        monkeypatch.setenv(env, bad)
        with pytest.raises(UsageError, match=f"{env}="):
            pallas_moe.use(True, *_experts(2, 32, 16, "int4", "int4", 32, seed=0)[::2], 1)
        monkeypatch.delenv(env)


@pytest.mark.parametrize("fmt,E,N,M", [("f32", 8, 64, 1), ("bf16", 6, 200, 2)])
def test_dp4a_linear_computes_the_router_after_it(fmt, E, N, M, monkeypatch):
    """linear_decode(router=): the projection's output (with its residual) and, from the same
    kernel, partial router sums whose total over the row blocks divided by the output's rms is
    the router's logits on rms_norm(output); moe_decode(partials=) routes from them as from those
    logits (E = 6 pads the experts, N = 200 ragged row blocks)."""
    rng = np.random.default_rng(E)
    K, eps = 64, 1e-5
    wo = rng.standard_normal((N, K)).astype(np.float32)
    ospec = WeightSpec("o", (N, K), (), 0, "int4", 32)
    oarr = {n: jnp.asarray(v) for n, v in get_format("int4").quantize(wo, 32).items()}
    wr = rng.standard_normal((E, N)).astype(np.float32)
    rarr = get_format(fmt).quantize(wr, 0)
    wrd = get_format(fmt).dequantize(rarr, N, 0).astype(np.float64)
    rspec = WeightSpec("r", (E, N), (), 0, fmt, 0)
    assert pallas_dense.router_fusable(ospec, rspec)
    x = rng.standard_normal((M, K)).astype(np.float32)
    res = rng.standard_normal((M, N)).astype(np.float32)
    nw = (1 + 0.3 * rng.standard_normal(N)).astype(np.float32)
    want_y = np.asarray(pallas_dense.linear_decode(jnp.asarray(x), ospec, oarr, interpret=True,
                                                   residual=jnp.asarray(res)))
    y, part = pallas_dense.linear_decode(jnp.asarray(x), ospec, oarr, interpret=True, residual=jnp.asarray(res),
                                         router=(rspec, {n: jnp.asarray(v) for n, v in rarr.items()}, jnp.asarray(nw)))
    np.testing.assert_array_equal(np.asarray(y), want_y)
    part = np.asarray(part)
    assert part.shape[0] == M and part.shape[2] == pallas_quant._pow2(E)
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
    # ids whose routing has no near-tie: a top-k flip under q8 rounding moves the logits by far more
    ids = np.random.default_rng(6).integers(0, 100, (2, 5))
    routed = _spy(monkeypatch, pallas_moe, "moe_decode", record=lambda kw: kw.get("partials") is not None)
    want, _ = _decode(plan, ids, monkeypatch, "off")
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
    want, _ = _decode(plan, ids, monkeypatch, "off")
    rows = _spy(monkeypatch, pallas_dense, "linear_decode", record=lambda kw: kw.get("router") is not None)
    monkeypatch.setenv("STRATA_PALLAS_LINEAR_ROWS", "16")
    real = pallas_dense.linear_decode
    shapes = []
    monkeypatch.setattr(pallas_dense, "linear_decode",
                        lambda x, *a, **kw: shapes.append(x.shape[0]) or real(x, *a, **kw))
    got, _ = _decode(plan, ids, monkeypatch, "interpret")
    assert 16 in shapes and True in rows
    assert np.abs(got - want).max() <= 0.05 * want.std()
