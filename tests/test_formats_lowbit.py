"""The formats added for layer-adaptive quantization (int4a, int3, int2, fp8) and the
importance-weighted scale search, against the definitions in strata_compiler.formats' docstring,
recomputed here independently of the code."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from strata_compiler.errors import UsageError
from strata_compiler.formats import FORMATS

SHAPES = [((4, 64), 32), ((3, 70), 32), ((2, 5, 72), 8), ((3, 40), 16)]


def _w(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _groups(w, g):
    k = w.shape[-1]
    kp = -(-k // g) * g
    p = np.zeros(w.shape[:-1] + (kp,), np.float32)
    p[..., :k] = w
    return p.reshape(w.shape[:-1] + (kp // g, g))


def _expected(fmt, w, g):
    """Dequantized values straight from the docstring's rules."""
    G = _groups(w, g)
    if fmt == "int3":
        d = np.maximum(G.max(-1) / 3, G.min(-1) / -4).astype(np.float16).astype(np.float32)[..., None]
        inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0)
        out = np.clip(np.rint(G * inv), -4, 3) * d
    elif fmt in ("int2", "int4a"):
        levels = 3 if fmt == "int2" else 15
        lo, hi = G.min(-1), G.max(-1)
        d = ((hi - lo) / levels).astype(np.float16).astype(np.float32)[..., None]
        m = lo.astype(np.float16).astype(np.float32)[..., None]
        inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0)
        out = np.clip(np.rint((G - m) * inv), 0, levels) * d + m
    else:  # fp8
        d = (np.abs(G).max(-1) / 448).astype(np.float16).astype(np.float32)[..., None]
        inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0)
        q = np.clip(G * inv, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        out = q * d
    return out.reshape(w.shape[:-1] + (-1,))[..., :w.shape[-1]]


@pytest.mark.parametrize("fmt", ["int4a", "int3", "int2", "fp8"])
@pytest.mark.parametrize("shape,gs", SHAPES)
def test_matches_docstring_definition(fmt, shape, gs):
    w = _w(shape)
    got = FORMATS[fmt].roundtrip(w, gs)
    np.testing.assert_allclose(got, _expected(fmt, w, gs), rtol=0, atol=1e-6 * max(1.0, float(np.abs(w).max())))


def test_documented_sizes():
    bpw = {n: FORMATS[n].bits_per_weight((4, 64), 32) for n in ("int4a", "int3", "int2", "fp8")}
    assert bpw == pytest.approx({"int4a": 5.0, "int3": 3.5, "int2": 3.0, "fp8": 8.5})
    assert FORMATS["int3"].array_shapes((2, 5, 70), 32) == {
        "qs": (np.dtype(np.uint8), (2, 5, 36)), "scales": (np.dtype(np.float16), (2, 5, 3))}
    assert FORMATS["int2"].array_shapes((2, 5, 70), 32)["scales"] == (np.dtype(np.float16), (2, 5, 6))


def test_int3_bit_planes_by_hand():
    # one group of 8 (G/4 = 2 low bytes, G/8 = 1 high byte); d = 1 exactly (absmax 4)
    w = np.array([[-4, -3, -2, -1, 0, 1, 2, 3]], np.float32)
    a = FORMATS["int3"].quantize(w, 8)
    q = (w[0] + 4).astype(int)              # stored codes 0..7
    low = [sum(((q[i + 2 * j] & 3) << (2 * j)) for j in range(4)) for i in range(2)]
    high = sum(((q[j] >> 2) & 1) << j for j in range(8))
    assert list(a["qs"][0]) == low + [high]
    assert a["scales"][0, 0] == np.float16(1.0)
    np.testing.assert_array_equal(FORMATS["int3"].dequantize(a, 8, 8), w)


def test_int3_keeps_a_positive_maximum():
    """The code range is [-4, 3]: a group led by a positive value takes d = max / 3, so the
    maximum is stored exactly instead of clipped to 3/4 of itself (absmax / 4)."""
    w = np.array([[6.0, -1.0, 0.5, 2.0, -2.0, 4.0, 0.0, 1.0]], np.float32)
    r = FORMATS["int3"].roundtrip(w, 8)
    assert r[0, 0] == 6.0
    assert np.abs(r - w).max() <= 1.0 + 1e-6    # d = 2: half a step at most


def test_int2_plane_by_hand():
    w = np.array([[0, 1, 2, 3, 3, 2, 1, 0]], np.float32)      # min 0, d = 1
    a = FORMATS["int2"].quantize(w, 8)
    q = w[0].astype(int)
    assert list(a["qs"][0]) == [sum(q[i + 2 * j] << (2 * j) for j in range(4)) for i in range(2)]
    np.testing.assert_array_equal(a["scales"][0], np.array([1, 0], np.float16))
    np.testing.assert_array_equal(FORMATS["int2"].dequantize(a, 8, 8), w)


@pytest.mark.parametrize("fmt,mult", [("int3", 8), ("int2", 4)])
def test_group_size_must_fit_the_bit_planes(fmt, mult):
    with pytest.raises(UsageError, match=f"multiple of {mult}"):
        FORMATS[fmt].quantize(_w((2, 12)), 6)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4a", "int3", "int2", "fp8"])
def test_importance_search_never_worse_and_usually_better(fmt):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((64, 256)) * rng.gamma(1.0, 1.0, 256)).astype(np.float32)
    imp = rng.gamma(0.5, 2.0, 256).astype(np.float32)
    plain = FORMATS[fmt].roundtrip(w, 32)
    tuned = FORMATS[fmt].roundtrip(w, 32, imp)
    G = lambda a: _groups(a, 32)  # noqa: E731
    e_plain = (G(imp[None]) * (G(w) - G(plain)) ** 2).sum(-1)
    e_tuned = (G(imp[None]) * (G(w) - G(tuned)) ** 2).sum(-1)
    assert (e_tuned <= e_plain * (1 + 1e-6) + 1e-12).all()      # per group: the plain rule is a candidate
    if fmt != "int8":
        assert e_tuned.sum() < 0.97 * e_plain.sum()


def test_importance_length_mismatch_is_a_usage_error():
    with pytest.raises(UsageError, match="importance vector of 3 values"):
        FORMATS["int4"].quantize(_w((2, 64)), 32, np.ones(3, np.float32))


def test_fp8_saturates_and_keeps_signs():
    w = np.array([[1e6, -1e6, 0.0, 1e-3] + [0.0] * 4], np.float32)
    r = FORMATS["fp8"].roundtrip(w, 8)
    assert np.isfinite(r).all() and r[0, 0] > 0 and r[0, 1] < 0 and r[0, 2] == 0
