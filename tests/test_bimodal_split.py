"""benchmarks/bimodal_split.py: its split quantizers decode what they encode, and the bytes it
reports are the bytes of that encoding (random data; no model needed)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from strata_compiler.formats import get_format

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


B = _load("bimodal_split")
G = B.G


def _data(n=24, k=192, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(4, size=(n, k)) * 0.02).astype(np.float32)
    imp = rng.gamma(1.0, 1.0, k).astype(np.float32)
    return w, imp


@pytest.mark.parametrize("width", [1, 2, 5, 6, 16])
def test_bits_roundtrip(width):
    v = np.random.default_rng(width).integers(0, 1 << width, 1001)
    buf = B.pack_bits(v, width)
    assert buf.nbytes == math.ceil(1001 * width / 8)
    np.testing.assert_array_equal(B.unpack_bits(buf, width, 1001), v)


@pytest.mark.parametrize("base", ["int4", "int3", "int2"])
@pytest.mark.parametrize("weighted", [False, True])
def test_masked_grouped_without_mask_is_the_format(base, weighted):
    w, imp = _data()
    imp = imp if weighted else None
    a = B.masked_grouped(w, imp, np.ones(w.shape, bool), base)
    b = get_format(base).quantize(w, G, imp)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("density,kind", [(0.6, 0), (0.15, 1), (0.004, 2)])
def test_tags_each_encoding_roundtrips_and_is_the_cheapest(density, kind):
    rng = np.random.default_rng(1)
    n, k = 16, 256
    cls = np.where(rng.random((n, k)) < density, rng.integers(1, 3, (n, k)), 0).astype(np.uint8)
    s = B._tags(cls)
    assert int(s["tag_kind"][0]) == kind
    np.testing.assert_array_equal(B._untag(s, n, k), cls)
    nnz = int((cls != 0).sum())
    costs = [math.ceil(2 * n * k / 8),
             math.ceil(6 * n * k // G / 8) + math.ceil(6 * nnz / 8),
             2 * n + 2 * nnz]
    assert B.nbytes(s) == 1 + costs[kind] == 1 + min(costs)


@pytest.mark.parametrize("centre", ["int4", "int3"])
def test_bimodal_roundtrip_per_class_and_bytes(centre):
    w, _ = _data()
    n, k = w.shape
    cls = B.classes_quantile(w, 0.05, 0.05)
    s = B.bimodal_encode(w, None, cls, centre)
    out = B.bimodal_decode(s, w.shape, centre)
    c, b, t = cls == 0, cls == 1, cls == 2
    # centre: the plain rule of formats.py on the centre values of each group alone
    lo, hi = -4, 3      # int3's code range
    g = np.where(c, w, 0).reshape(n, k // G, G)
    if centre == "int4":    # ggml's Q4_0 rule (formats.int4_codes)
        m = np.take_along_axis(g, np.abs(g).argmax(-1)[..., None], -1)
        d32 = (m / np.float32(-8)).astype(np.float32)
        inv = np.divide(np.float32(1), d32, out=np.zeros_like(d32), where=d32 != 0)
        q = np.minimum(15, np.trunc(g * inv + np.float32(8.5))) - 8
        want = (q * d32.astype(np.float16).astype(np.float32)).reshape(n, k)
    else:   # int3's range is uneven: d = max(max / 3, min / -4), so neither extreme clips
        d = np.maximum(g.max(-1) / hi, g.min(-1) / lo).astype(np.float16).astype(np.float32)[..., None]
        inv = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
        want = (np.clip(np.rint(g * inv), lo, hi) * d).reshape(n, k)
    np.testing.assert_array_equal(out[c], want[c])
    # band: e4m3 of w / (row absmax of the band / 448), f16 scale
    db = (np.where(b, np.abs(w), 0).max(1) / 448).astype(np.float16).astype(np.float32)[:, None]
    fb = (w / db).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * db
    np.testing.assert_array_equal(out[b], fb[b])
    # tails: the sign kept, the magnitude one of the row's two stored levels, the nearer one
    lv = s["tail_lv"].astype(np.float32)
    rows = np.nonzero(t)[0]
    assert np.all(np.sign(out[t]) == np.sign(w[t]))
    dist = np.abs(np.abs(w[t])[:, None] - lv[rows])
    np.testing.assert_array_equal(np.abs(out[t]), lv[rows, dist.argmin(1)])
    assert np.abs(w - out)[t].max() < np.abs(w[t]).max()
    # bytes: every stream, nothing else
    bits = 4 if centre == "int4" else 3
    nc, nb, nt = int(c.sum()), int(b.sum()), int(t.sum())
    tags = B.nbytes(B._tags(cls))
    expect = (tags + math.ceil(bits * nc / 8) + 2 * n * (k // G) + nb + 2 * n + math.ceil(2 * nt / 8) + 4 * n)
    assert B.nbytes(s) == expect
    # and the benchmark's method wrapper reports exactly that
    q, nbytes, frac = B._bimodal(lambda x: B.classes_quantile(x, 0.05, 0.05), centre)(w, None)
    np.testing.assert_array_equal(q, out)
    assert nbytes == expect and frac.tolist() == [nc, nb, nt]


def test_gmm_split_with_importance_decodes_close():
    w, imp = _data(seed=3)
    cls = B.classes_gmm(w)
    s = B.bimodal_encode(w, imp, cls)
    out = B.bimodal_decode(s, w.shape)
    err = float((imp * (w - out) ** 2).sum())
    assert 0 < err < float((imp * w ** 2).sum()) * 0.05


@pytest.mark.parametrize("base", ["int4", "int3", "int2"])
def test_outlier_roundtrip_and_bytes(base):
    w, imp = _data(seed=2)
    n, k = w.shape
    s = B.outlier_encode(w, imp, 0.01, base)
    out = B.outlier_decode(s, w.shape, base)
    m = B.outlier_mask(w, imp, 0.01)
    cnt = round(0.01 * w.size)
    assert m.sum() == cnt
    score = np.abs(w) * np.sqrt(imp)
    assert score[m].min() >= score[~m].max()
    np.testing.assert_array_equal(out[m], w[m].astype(np.float16).astype(np.float32))
    # the rest: the base format's own roundtrip of the matrix with the outliers zeroed
    ref = B.masked_grouped(w, imp, ~m, base)
    dense = get_format(base).dequantize(ref, k, G)
    np.testing.assert_array_equal(out[~m], dense[~m])
    assert B.nbytes(s) == get_format(base).nbytes(w.shape, G) + 2 * n + 4 * cnt
    # removing the largest values from the scales only helps the rest
    full = get_format(base).roundtrip(w, G, imp)
    assert (imp * (w - out) ** 2).sum() < (imp * (w - full) ** 2).sum()


def test_uniform_methods_report_format_bytes():
    w, imp = _data()
    for f in B.UNIFORM:
        q, nb, _ = B._uniform(f)(w, imp)
        assert nb == get_format(f).nbytes(w.shape, G)
        np.testing.assert_array_equal(q, get_format(f).roundtrip(w, G, imp))
    q5, nb5, _ = B._uniform_ext(5)(w, imp)
    assert nb5 * 8 / w.size == 5.5
    q4, _, _ = B._uniform("int4")(w, imp)
    assert (imp * (w - q5) ** 2).sum() < (imp * (w - q4) ** 2).sum()


def test_gmm_recovers_a_real_mixture():
    rng = np.random.default_rng(4)
    wide = rng.random((8, 4096)) < 0.2
    x = np.where(wide, rng.normal(0, 5, wide.shape), rng.normal(0, 1, wide.shape))
    _, pi, s1, s2 = B.fit_gmm(x)
    assert np.allclose(pi, 0.2, atol=0.05) and np.allclose(s2 / s1, 5, rtol=0.15)


def test_hull_error():
    pts = [(3.0, 8.0), (4.0, 2.0), (5.0, 1.9), (6.0, 0.5), (6.0, 0.4)]
    assert B.hull_error(pts, 4.0) == pytest.approx(2.0)
    # (5, 1.9) lies above the chord from (4, 2) to (6, 0.4): the hull skips it
    assert B.hull_error(pts, 5.0) == pytest.approx(1.2)
    assert math.isnan(B.hull_error(pts, 2.5))
    assert B.hull_error(pts, 9.0) == pytest.approx(0.4)
