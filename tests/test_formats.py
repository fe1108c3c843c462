"""The weight format registry (strata_compiler.formats) against its documented definition.

The module docstring is the specification: layouts, the int8/int4 scale rule
(d = f16(absmax(group) / qmax), q = clip(round(w / d), ...)), the int4 nibble order and the
bf16 rounding. These tests recompute everything from that text, independently of the code.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from strata_compiler.errors import UsageError
from strata_compiler.formats import (
    FORMATS,
    bf16_bits_to_f32,
    f32_to_bf16_bits,
    get_format,
    quantizes,
)

QMAX = {"int8": 127, "int4": 7}
F16_MIN_NORMAL = 2.0 ** -14
F16_SUBNORMAL_STEP = 2.0 ** -24

# (shape [..., N, K], group size): aligned, K not a multiple of G, stacked experts, tiny K.
SHAPES = [
    ((4, 64), 32),
    ((3, 70), 32),
    ((2, 5, 70), 32),   # [E, N, K]
    ((2, 3, 4, 40), 16),  # two leading axes
    ((3, 5), 8),        # K < G: one padded group
]


def _weights(shape, seed=0, scale=1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _groups(w: np.ndarray, g: int) -> np.ndarray:
    """[..., K] -> [..., Kp/G, G], zero-padded (written independently of the module)."""
    k = w.shape[-1]
    kp = -(-k // g) * g
    p = np.zeros(w.shape[:-1] + (kp,), np.float32)
    p[..., :k] = w
    return p.reshape(w.shape[:-1] + (kp // g, g))


# -- shapes, dtypes, sizes -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("shape,gs", SHAPES)
def test_roundtrip_shape_dtype_and_array_shapes(fmt, shape, gs):
    f = FORMATS[fmt]
    w = _weights(shape)
    arrays = f.quantize(w, gs)
    spec = f.array_shapes(shape, gs)
    assert set(arrays) == set(spec)
    for name, a in arrays.items():
        dt, s = spec[name]
        assert a.dtype == dt, (fmt, name)
        assert a.shape == tuple(s), (fmt, name)
    assert f.nbytes(shape, gs) == sum(a.nbytes for a in arrays.values())
    assert f.bits_per_weight(shape, gs) == pytest.approx(8.0 * f.nbytes(shape, gs) / np.prod(shape))
    back = f.dequantize(arrays, shape[-1], gs)
    assert back.shape == shape and back.dtype == np.float32
    r = f.roundtrip(w, gs)
    assert r.shape == shape and r.dtype == np.float32
    np.testing.assert_array_equal(r, back)
    assert np.isfinite(r).all()


def test_array_shapes_documented_layouts():
    # K = 70, G = 32: Kp = 96, 3 groups; E = 2 leading axis passes through.
    shape = (2, 5, 70)
    assert FORMATS["f32"].array_shapes(shape, 32) == {"w": (np.dtype(np.float32), shape)}
    assert FORMATS["bf16"].array_shapes(shape, 32) == {"w": (np.dtype(np.uint16), shape)}
    assert FORMATS["int8"].array_shapes(shape, 32) == {
        "qs": (np.dtype(np.int8), (2, 5, 96)), "scales": (np.dtype(np.float16), (2, 5, 3))}
    assert FORMATS["int4"].array_shapes(shape, 32) == {
        "qs": (np.dtype(np.uint8), (2, 5, 48)), "scales": (np.dtype(np.float16), (2, 5, 3))}
    assert FORMATS["f32"].nbytes(shape, 32) == 2 * 5 * 70 * 4
    assert FORMATS["bf16"].nbytes(shape, 32) == 2 * 5 * 70 * 2
    assert FORMATS["int8"].nbytes(shape, 32) == 2 * 5 * (96 + 3 * 2)
    assert FORMATS["int4"].nbytes(shape, 32) == 2 * 5 * (48 + 3 * 2)
    assert FORMATS["int4"].bits_per_weight((4, 64), 32) == pytest.approx(4.5)
    assert FORMATS["int8"].bits_per_weight((4, 64), 32) == pytest.approx(8.5)


def test_grouped_flags():
    assert {n for n, f in FORMATS.items() if f.grouped} == {"int8", "int4", "int4a", "int3", "int2", "fp8"}
    assert {n for n, f in FORMATS.items() if not f.grouped} == {"f32", "bf16"}


def test_f32_is_exact():
    w = _weights((3, 70))
    np.testing.assert_array_equal(FORMATS["f32"].roundtrip(w, 32), w)


# -- int8 / int4 semantics -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("shape,gs", SHAPES)
def test_grouped_matches_definition(fmt, shape, gs):
    """qs/scales recomputed from the docstring's formulas (ggml's Q8_0 / Q4_0 reference rules);
    padding is zero."""
    w = _weights(shape, seed=1)
    a = FORMATS[fmt].quantize(w, gs)
    g = _groups(w, gs)
    if fmt == "int8":
        d32 = (np.abs(g).max(-1) / np.float32(127)).astype(np.float32)
    else:
        d32 = (np.take_along_axis(g, np.abs(g).argmax(-1)[..., None], -1)[..., 0] / np.float32(-8)).astype(np.float32)
    np.testing.assert_array_equal(a["scales"], d32.astype(np.float16))
    inv = np.divide(np.float32(1), d32, out=np.zeros_like(d32), where=d32 != 0)[..., None]
    if fmt == "int8":
        x = g * inv
        q = np.clip(np.sign(x) * np.floor(np.abs(x) + 0.5), -127, 127)      # roundf: half away from zero
        np.testing.assert_array_equal(a["qs"].reshape(q.shape), q.astype(np.int8))
        assert (a["qs"].reshape(q.shape).reshape(*shape[:-1], -1)[..., shape[-1]:] == 0).all()
    else:
        u = np.minimum(15, np.trunc(g * inv + np.float32(8.5))).astype(np.uint8)
        q = u.astype(np.float32) - 8
        half = gs // 2
        packed = a["qs"].reshape(*q.shape[:-1], half)
        np.testing.assert_array_equal(packed & 0x0F, u[..., :half])
        np.testing.assert_array_equal(packed >> 4, u[..., half:])
    k = shape[-1]
    expect = (q * a["scales"].astype(np.float32)[..., None]).reshape(*shape[:-1], -1)[..., :k]
    np.testing.assert_array_equal(FORMATS[fmt].dequantize(a, k, gs), expect)


def _error_bound(w: np.ndarray, gs: int, fmt: str) -> np.ndarray:
    """Per-element bound: half a step of the scale (int4: a whole step, at the end that clips),
    plus what rounding the f32 scale to f16 moves the largest code (qmax * |d32 - d16|), plus
    f32 slack for w * (1/d)."""
    g = _groups(w, gs)
    absmax = np.abs(g).max(-1)
    qmax, steps = (127, 0.5) if fmt == "int8" else (8, 1.0)
    exact = absmax.astype(np.float64) / (127 if fmt == "int8" else 8)
    d = exact.astype(np.float32).astype(np.float16).astype(np.float64)
    bound = steps * np.maximum(exact, d) + qmax * np.abs(exact - d) + 1e-6 * absmax
    b = np.broadcast_to(bound[..., None], g.shape).reshape(*w.shape[:-1], -1)
    return b[..., : w.shape[-1]]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("scale", [1e3, 1.0, 1e-2, 1e-4, 1e-6])
@pytest.mark.parametrize("shape,gs", SHAPES[:3])
def test_grouped_error_bound(fmt, scale, shape, gs):
    w = _weights(shape, seed=2, scale=scale)
    r = FORMATS[fmt].roundtrip(w, gs)
    err = np.abs(r.astype(np.float64) - w)
    bound = _error_bound(w, gs, fmt)
    assert (err <= bound).all(), float((err - bound).max())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_error_at_most_half_a_scale_step_in_f16_normal_range(fmt):
    """With scales in f16's normal range: |err| <= d/2 for int8 (plus what the f16 rounding of the
    scale moves code 127: the codes come from the f32 scale, as ggml's), <= |d| for int4 (whose
    one end may clip by a step); the group's extreme is stored at code +-127 / -8 exactly."""
    w = _weights((8, 70), seed=3)
    a = FORMATS[fmt].quantize(w, 32)
    d = np.abs(a["scales"].astype(np.float64))
    assert (d >= F16_MIN_NORMAL).all()
    r = FORMATS[fmt].dequantize(a, 70, 32)
    err = np.abs(_groups(r - w, 32)).max(-1)
    assert (err <= (d / 2 + 127 * d * 2.0 ** -11 if fmt == "int8" else d) * (1 + 1e-6)).all()
    qmax = 127 if fmt == "int8" else 8
    assert np.abs(_groups(r, 32)).max(-1) == pytest.approx(qmax * d, rel=0)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_all_zero_groups_give_zeros(fmt):
    w = _weights((3, 96), seed=4)
    w[0] = 0.0              # a whole row
    w[1, 32:64] = 0.0       # one group of a row
    w[2, 64:] = -0.0
    a = FORMATS[fmt].quantize(w, 32)
    assert np.isfinite(a["scales"].astype(np.float32)).all()
    assert (a["scales"][0] == 0).all() and a["scales"][1, 1] == 0 and a["scales"][2, 2] == 0
    r = FORMATS[fmt].dequantize(a, 96, 32)
    assert not np.isnan(r).any()
    assert (r[0] == 0).all() and (r[1, 32:64] == 0).all() and (r[2, 64:] == 0).all()
    assert not np.isnan(FORMATS[fmt].roundtrip(np.zeros((2, 70), np.float32), 32)).any()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_finite_weights_never_dequantize_to_nan(fmt):
    w = np.full((1, 32), 1.0e7, np.float32)
    w[0, 1] = -3.0
    r = FORMATS[fmt].roundtrip(w, 32)
    assert not np.isnan(r).any()


# -- int4 nibble layout ----------------------------------------------------------------------------


def test_int4_nibble_layout_by_hand():
    # G = 8, two groups per row. Group 0's extreme is -8 -> d = -8 / -8 = 1; group 1's -16 -> d = 2.
    g0 = [-8, 7, 1, 2, -3, 0, 5, -1]
    g1 = [2, 4, -16, 0, 6, -2, 14, -8]
    w = np.array([g0 + g1], np.float32)
    a = FORMATS["int4"].quantize(w, 8)
    np.testing.assert_array_equal(a["scales"], np.array([[1.0, 2.0]], np.float16))
    # q = trunc(w / d + 8.5): group 0 -> [0,15,9,10,5,8,13,7]; group 1 -> [9,10,0,8,11,7,15,4]
    # byte i = q[i] | q[i + 4] << 4, group-major.
    expect = [0 | 5 << 4, 15 | 8 << 4, 9 | 13 << 4, 10 | 7 << 4,
              9 | 11 << 4, 10 | 7 << 4, 0 | 15 << 4, 8 | 4 << 4]
    assert a["qs"].dtype == np.uint8
    assert a["qs"].tolist() == [expect]
    np.testing.assert_array_equal(FORMATS["int4"].dequantize(a, 16, 8), w)


def test_int4_dequantize_reads_low_then_high_nibble():
    # One group of G = 4 (2 bytes): nibbles 0x0 .. 0xF decode to -8 .. 7 times the scale.
    qs = np.array([[0x0F, 0x3C]], np.uint8)   # byte0: lo 15, hi 0; byte1: lo 12, hi 3
    scales = np.array([[0.5]], np.float16)
    r = FORMATS["int4"].dequantize({"qs": qs, "scales": scales}, 4, 4)
    # values 0,1 from the low nibbles, values 2,3 (= i + G/2) from the high nibbles
    np.testing.assert_array_equal(r, np.array([[(15 - 8) * 0.5, (12 - 8) * 0.5, (0 - 8) * 0.5, (3 - 8) * 0.5]], np.float32))


def test_int4_odd_group_size_is_a_usage_error():
    with pytest.raises(UsageError, match="even"):
        FORMATS["int4"].quantize(np.ones((2, 6), np.float32), 3)


# -- bf16 ------------------------------------------------------------------------------------------


def _ml_bf16_bits(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).view(np.uint16)


def test_bf16_matches_ml_dtypes_on_random_bit_patterns():
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 2 ** 32, size=200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[~np.isnan(x)]
    np.testing.assert_array_equal(f32_to_bf16_bits(x), _ml_bf16_bits(x))


def test_bf16_ties_round_to_even_and_specials():
    # Low 16 bits exactly 0x8000: a tie. Even upper half stays, odd upper half rounds up.
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x00008000, 0x00018000,
                     0x7F7F8000, 0x7F7E8000], np.uint32)
    near = np.array([0x3F807FFF, 0x3F808001, 0x7F7FFFFF, 0x00000001, 0x80000001], np.uint32)
    special = np.array([0x7F800000, 0xFF800000, 0x00000000, 0x80000000], np.uint32)  # +-inf, +-0
    x = np.concatenate([ties, near, special]).view(np.float32)
    got = f32_to_bf16_bits(x)
    np.testing.assert_array_equal(got, _ml_bf16_bits(x))
    assert got[:4].tolist() == [0x3F80, 0x3F82, 0xBF80, 0xBF82]
    assert got[6] == 0x7F80 and got[7] == 0x7F7E     # the largest tie overflows to inf (odd -> even)
    back = bf16_bits_to_f32(got[-4:])
    assert back[0] == np.inf and back[1] == -np.inf and back[2] == 0 and np.signbit(back[3])


def test_bf16_nan_stays_nan_and_format_roundtrip():
    x = np.array([np.nan, -np.nan, 1.0, -2.5], np.float32)
    b = f32_to_bf16_bits(x)
    assert np.isnan(bf16_bits_to_f32(b)[:2]).all()
    w = _weights((3, 70), seed=6)
    r = FORMATS["bf16"].roundtrip(w, 32)
    np.testing.assert_array_equal(r, w.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(FORMATS["bf16"].roundtrip(r, 32), r)


# -- policy and registry ---------------------------------------------------------------------------


@pytest.mark.parametrize("key", [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.11.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.mlp.experts.3.gate_proj.weight",
    "model.layers.0.mlp.experts.3.down_proj.weight",
    "model.layers.0.mlp.shared_expert.up_proj.weight",
    "model.layers.0.block_sparse_moe.experts.0.w1.weight",
    "model.layers.0.block_sparse_moe.experts.7.w2.weight",
    "model.layers.0.block_sparse_moe.experts.7.w3.weight",
    "lm_head.weight",
])
def test_quantizes_linear_matrices(key):
    assert quantizes(key) is True


@pytest.mark.parametrize("key", [
    "model.embed_tokens.weight",
    "model.norm.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.0.self_attn.q_norm.weight",
    "model.layers.0.self_attn.k_norm.weight",
    "model.layers.0.self_attn.q_proj.bias",
    "model.layers.0.self_attn.o_proj.bias",
    "model.layers.0.mlp.gate.weight",                 # router
    "model.layers.0.block_sparse_moe.gate.weight",    # Mixtral router
    "model.layers.0.mlp.shared_expert_gate.weight",
])
def test_does_not_quantize_embeddings_norms_biases_routers(key):
    assert quantizes(key) is False


def test_get_format_known_and_unknown():
    for name in FORMATS:
        assert get_format(name) is FORMATS[name]
    with pytest.raises(UsageError) as ei:
        get_format("int5")
    msg = str(ei.value)
    assert "int5" in msg
    for name in ("f32", "bf16", "int8", "int4"):
        assert name in msg


# -- idempotence (property) ------------------------------------------------------------------------


_rows = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=2, max_dims=3, min_side=1, max_side=40),
    elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=_rows, gs=st.sampled_from([2, 8, 32]), scale=st.sampled_from([1.0, 1e-3, 1e-5]))
def test_int8_roundtrip_is_idempotent(w, gs, scale):
    """Exactly idempotent when each group's scale is an f16 normal (or 0): q*d has at most 18
    significant bits, so absmax(q*d)/127 == d and q comes back unchanged. Scales in f16's
    subnormal range lose precision, and the second pass may differ by its own error bound."""
    w = (w * np.float32(scale)).astype(np.float32)
    f = FORMATS["int8"]
    r = f.roundtrip(w, gs)
    rr = f.roundtrip(r, gs)
    d = f.quantize(r, gs)["scales"].astype(np.float64)
    normal = (d == 0) | (d >= F16_MIN_NORMAL)
    rg, rrg = _groups(r, gs), _groups(rr, gs)
    np.testing.assert_array_equal(rrg[normal], rg[normal])
    bound = _error_bound(r, gs, "int8")
    assert (np.abs(rr.astype(np.float64) - r) <= bound).all()


def test_roundtrips_are_idempotent_at_every_scale():
    """The codes come from the f32 scale and the group's extreme is stored exactly (code +-127,
    or -8), so quantizing a roundtrip gives it back, tiny (f16-subnormal) scales included."""
    for scale in (1e-6, 1e-4, 1.0, 1e3):
        w = _weights((64, 70), seed=7, scale=scale)
        for fmt in ("int8", "int4"):
            r = FORMATS[fmt].roundtrip(w, 32)
            np.testing.assert_array_equal(FORMATS[fmt].roundtrip(r, 32), r)
