"""The Pallas decode kernels on GGUF's K-quants kept as stored (q4k, q6k: formats.py), in interpret
mode on the CPU: the dense and MoE kernels against the q8-rounded product with the formats' own
values, the xla backend's dequantization against the format definition, and the expert cache's
slots. Arrays are random codes and scales of each layout (every code and factor is valid)."""

from __future__ import annotations

import numpy as np
import pytest

from strata_compiler.formats import get_format
from strata_compiler.ir import WeightSpec

jax = pytest.importorskip("jax")
jnp = jax.numpy

from strata_compiler.backends.xla import pallas_dense, pallas_moe  # noqa: E402
from strata_compiler.backends.xla.dequant import dequantize  # noqa: E402
from test_pallas_moe import _q8, _route, pow2_blocks  # noqa: E402

GROUP = {"q4k": 32, "q6k": 16}


@pytest.fixture(autouse=True)
def _blocks(monkeypatch):
    monkeypatch.setenv("STRATA_PALLAS_ATTN", "off")
    pow2_blocks(monkeypatch)


def _random(fmt: str, lead: tuple, K: int, rng, scale: float = 1.0) -> dict:
    """Random stored arrays of a [*lead, K] weight in `fmt`, values of about `scale`."""
    if fmt == "q4k":
        ng, nsb = K // 32, K // 256
        sup = np.stack([rng.uniform(0.5, 1.0, lead + (nsb,)) * scale / 63 / 8,
                        rng.uniform(0.0, 1.0, lead + (nsb,)) * scale / 63], -1)
        return {"qs": rng.integers(0, 256, lead + (K // 2,), dtype=np.uint8),
                "sub": rng.integers(0, 64, lead + (2 * ng,), dtype=np.uint8),
                "scales": sup.reshape(lead + (2 * nsb,)).astype(np.float16)}
    return {"qs": rng.integers(0, 256, lead + (3 * K // 4,), dtype=np.uint8),
            "sub": rng.integers(-128, 128, lead + (K // 16,), dtype=np.int8),
            "scales": (rng.uniform(0.5, 1.0, lead + (K // 256,)) * scale / 128 / 32).astype(np.float16)}


def _values(fmt: str, a: dict, K: int) -> np.ndarray:
    """The format's values by its definition (formats.py), written out here independently."""
    qs, sub, sup = a["qs"], a["sub"].astype(np.float32), a["scales"].astype(np.float32)
    lead = qs.shape[:-1]
    if fmt == "q4k":
        b = qs.reshape(*lead, K // 32, 16)
        q = np.concatenate([b & 15, b >> 4], -1).astype(np.float32)
        d = np.repeat(sup[..., 0::2], 8, -1) * sub[..., 0::2]
        m = np.repeat(sup[..., 1::2], 8, -1) * sub[..., 1::2]
        return (d[..., None] * q - m[..., None]).reshape(*lead, K)
    b = qs.reshape(*lead, K // 16, 12)
    nib, hp = b[..., :8], b[..., 8:]
    codes = np.concatenate([nib & 15, nib >> 4], -1) | (np.concatenate([(hp >> 2 * j) & 3 for j in range(4)], -1) << 4)
    d = np.repeat(sup, 16, -1) * sub
    return (d[..., None] * (codes.astype(np.float32) - 32)).reshape(*lead, K)


def _dev(a: dict) -> dict:
    return {k: jnp.asarray(v) for k, v in a.items()}


@pytest.mark.parametrize("fmt", ["q4k", "q6k"])
def test_xla_dequantize_is_the_format(fmt):
    rng = np.random.default_rng(1)
    a = _random(fmt, (3, 40), 512, rng)
    spec = WeightSpec("w", (3, 40, 512), (), 3, fmt, GROUP[fmt])
    got = np.asarray(dequantize(jnp, spec, _dev(a), jnp.float32))
    np.testing.assert_array_equal(got, _values(fmt, a, 512))
    if fmt in _formats_registered():
        np.testing.assert_array_equal(get_format(fmt).dequantize(a, 512, GROUP[fmt]), _values(fmt, a, 512))


def _formats_registered() -> tuple:
    from strata_compiler.formats import FORMATS

    return tuple(FORMATS)


@pytest.mark.parametrize("fmt", ["q4k", "q6k"])
@pytest.mark.parametrize("N,K,M", [(64, 256, 1), (50, 768, 3), (300, 512, 2)])
def test_linear_kernel_matches_q8_reference(fmt, N, K, M):
    """linear_decode on q4k / q6k rows (ragged row blocks; 768 columns: a group axis padded to a
    power of two, super-blocks masked) against q8(x) @ W^T; use_linear takes them."""
    G = GROUP[fmt]
    rng = np.random.default_rng(N + K)
    a = _random(fmt, (N,), K, rng, scale=1 / np.sqrt(K))
    spec = WeightSpec("w", (N, K), (), 0, fmt, G)
    x = rng.standard_normal((M, K)).astype(np.float32)
    want = _q8(x, G).astype(np.float64) @ _values(fmt, a, K).astype(np.float64).T
    got = np.asarray(pallas_dense.linear_decode(jnp.asarray(x), spec, _dev(a), interpret=True))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert pallas_dense.use_linear(True, spec, M) == (True, False)
    assert pallas_dense.use_linear(True, WeightSpec("w", (N, K), (), 0, fmt, 64), M)[0] is False
    assert pallas_dense.use_linear(True, WeightSpec("w", (N, 200), (), 0, fmt, G), M)[0] is False


def test_linear_kernel_takes_the_norm_and_the_residual():
    K, N, M, eps = 512, 96, 2, 1e-5
    rng = np.random.default_rng(7)
    a = _random("q6k", (N,), K, rng, scale=1 / np.sqrt(K))
    spec = WeightSpec("w", (N, K), (), 0, "q6k", 16)
    x = 3 * rng.standard_normal((M, K)).astype(np.float32)
    nw = (1 + 0.3 * rng.standard_normal(K)).astype(np.float32)
    r = rng.standard_normal((M, N)).astype(np.float32)
    xn = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * nw
    want = _q8(xn.astype(np.float32), 16).astype(np.float64) @ _values("q6k", a, K).astype(np.float64).T + r
    got = np.asarray(pallas_dense.linear_decode(jnp.asarray(x), spec, _dev(a), interpret=True,
                                                rms=(jnp.asarray(nw), eps), residual=jnp.asarray(r)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def _experts(E, D, I, fmts, seed):
    rng = np.random.default_rng(seed)
    ga = _random(fmts[0], (E, 2 * I), D, rng, scale=1 / np.sqrt(D))
    da = _random(fmts[1], (E, D), I, rng, scale=1 / np.sqrt(I))
    gs = WeightSpec("gu", (E, 2 * I, D), (), E, fmts[0], GROUP[fmts[0]])
    ds = WeightSpec("dn", (E, D, I), (), E, fmts[1], GROUP[fmts[1]])
    return gs, ga, ds, da


def _moe_reference(x, topi, topw, gs, ga, ds, da):
    E, I2, D = gs.shape
    I = I2 // 2
    gw = _values(gs.fmt, ga, D).astype(np.float64)
    dw = _values(ds.fmt, da, I).astype(np.float64)
    xr = _q8(x, gs.group_size).astype(np.float64)
    out = np.zeros((x.shape[0], D))
    for m in range(x.shape[0]):
        for j in range(topi.shape[1]):
            h = gw[topi[m, j]] @ xr[m]
            h = (h[:I] / (1 + np.exp(-h[:I])) * h[I:]).astype(np.float32)[None]
            out[m] += topw[m, j] * (dw[topi[m, j]] @ _q8(h, ds.group_size)[0].astype(np.float64))
    return out


@pytest.mark.parametrize("fmts,D,I,M", [(("q4k", "q6k"), 256, 256, 1), (("q6k", "q4k"), 512, 256, 2),
                                        (("q4k", "q4k"), 256, 512, 3)])
def test_moe_kernels_match_reference(fmts, D, I, M):
    E, k = 6, 2
    gs, ga, ds, da = _experts(E, D, I, fmts, seed=D + I)
    assert pallas_moe.supported(gs, ds)
    rng = np.random.default_rng(M)
    x = rng.standard_normal((M, D)).astype(np.float32)
    topi, topw = _route(rng, M, E, k)
    want = _moe_reference(x, topi, topw, gs, ga, ds, da)
    got = np.asarray(pallas_moe.moe_decode(jnp.asarray(x), jnp.asarray(topi), jnp.asarray(topw), gs, _dev(ga), ds,
                                           _dev(da), interpret=True))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_cached_experts_read_their_slots():
    """An expert cache's slots in the two-level formats: experts in slots read there, the rest from
    the whole arrays, the same result as the whole arrays alone."""
    E, D, I, M, k = 6, 256, 256, 2, 2
    gs, ga, ds, da = _experts(E, D, I, ("q4k", "q6k"), seed=3)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((M, D)).astype(np.float32)
    topi, topw = _route(rng, M, E, k)
    slot_of = np.full(E, -1, np.int32)
    held = [int(topi[0, 0]), int(topi[1, 1])]
    slot_of[held] = [1, 0]
    order = [held[1], held[0]]
    slots = (jnp.asarray(slot_of), _dev({n: v[order] for n, v in ga.items()}), _dev({n: v[order] for n, v in da.items()}))
    whole = np.asarray(pallas_moe.moe_decode(jnp.asarray(x), jnp.asarray(topi), jnp.asarray(topw), gs, _dev(ga), ds,
                                             _dev(da), interpret=True))
    bad = {n: np.zeros_like(v) for n, v in ga.items()}, {n: np.zeros_like(v) for n, v in da.items()}
    for e in range(E):      # the whole arrays lose the held experts: only their slots have them
        if e not in held:
            for b, src in zip(bad, (ga, da)):
                for n in b:
                    b[n][e] = src[n][e]
    got = np.asarray(pallas_moe.moe_decode(jnp.asarray(x), jnp.asarray(topi), jnp.asarray(topw), gs, _dev(bad[0]),
                                           ds, _dev(bad[1]), interpret=True, slots=slots))
    np.testing.assert_allclose(got, whole, rtol=0, atol=1e-6 * np.abs(whole).max())


def _cuda() -> int:
    from strata_compiler.backends.xla.device import cuda_device_count

    return cuda_device_count()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="no CUDA GPU")
@pytest.mark.parametrize("fmt", ["q4k", "q6k"])
def test_triton_kernels_on_the_gpu(fmt):
    """The same kernels compiled by Triton (interpret mode lowers what Triton may not): the dense
    kernel with a padded group axis, and a MoE mixing both formats, against the references."""
    N, K, M = 300, 768, 2
    rng = np.random.default_rng(11)
    a = _random(fmt, (N,), K, rng, scale=1 / np.sqrt(K))
    spec = WeightSpec("w", (N, K), (), 0, fmt, GROUP[fmt])
    x = rng.standard_normal((M, K)).astype(np.float32)
    want = _q8(x, GROUP[fmt]).astype(np.float64) @ _values(fmt, a, K).astype(np.float64).T
    got = np.asarray(pallas_dense.linear_decode(jnp.asarray(x), spec, _dev(a)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    other = "q6k" if fmt == "q4k" else "q4k"
    gs, ga, ds, da = _experts(6, 512, 768, (fmt, other), seed=9)
    x = rng.standard_normal((M, 512)).astype(np.float32)
    topi, topw = _route(rng, M, 6, 2)
    want = _moe_reference(x, topi, topw, gs, ga, ds, da)
    got = np.asarray(pallas_moe.moe_decode(jnp.asarray(x), jnp.asarray(topi), jnp.asarray(topw), gs, _dev(ga), ds,
                                           _dev(da)))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_prefill_kernels_take_them_dequantized_first(monkeypatch):
    """Many tokens: pallas_gemm runs q4k / q6k experts dequantized first (it has no register tiles
    for them), from DEQUANT_FIRST_TOKENS tokens only; f32 products against the formats' values."""
    from strata_compiler.backends.xla import pallas_gemm

    E, D, I, M, k = 4, 256, 256, 20, 2
    gs, ga, ds, da = _experts(E, D, I, ("q4k", "q6k"), seed=8)
    assert not pallas_gemm.supported(gs, M) and pallas_gemm.supported(gs, pallas_gemm.DEQUANT_FIRST_TOKENS)
    monkeypatch.setattr(pallas_gemm, "DEQUANT_FIRST_TOKENS", 1)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((M, D)).astype(np.float32)
    topi, topw = _route(rng, M, E, k)
    y = np.asarray(pallas_gemm.moe(jnp.asarray(x), jnp.asarray(topi), jnp.asarray(topw), gs, _dev(ga), ds, _dev(da),
                                   dtype="float32", interpret=True))
    gw, dw = _values("q4k", ga, D).astype(np.float64), _values("q6k", da, I).astype(np.float64)
    ref = np.zeros((M, D))
    for m in range(M):
        for j in range(k):
            hg = gw[topi[m, j]] @ x[m]
            ref[m] += topw[m, j] * (dw[topi[m, j]] @ (hg[:I] / (1 + np.exp(-hg[:I])) * hg[I:]))
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
