"""The K-quant formats q4k and q6k (strata_compiler/kquant.py, defined in formats.py's docstring):
a GGUF file's Q4_K / Q6_K blocks converted by the reader give gguf-py's own values bit for bit;
quantizing from f32 stays within the documented error bound; array shapes, sizes and the
UsageErrors for rows and group sizes the formats cannot hold.

gguf-py does not quantize K-quants, so the blocks are random bytes (every bit pattern is a valid
block) with the f16 fields set to a weight-like magnitude, as tests/test_gguf_types.py makes them.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from strata_compiler.errors import UsageError
from strata_compiler.formats import FORMATS, check_group_size
from strata_compiler.frontend.gguf_reader import GGUFTensorInfo, GGUFTensorStore, q4k_arrays, q6k_arrays

# format -> (GGUF type, group size, byte offsets of the block's f16 fields, the reader's conversion)
KQUANTS = {"q4k": (QT.Q4_K, 32, (0, 2), q4k_arrays), "q6k": (QT.Q6_K, 16, (208,), q6k_arrays)}


def _blocks(fmt: str, lead: tuple[int, ...], k: int, rng) -> np.ndarray:
    """Random blocks of fmt's GGUF type for a [*lead, K] tensor: u8 [*lead, K/256, block bytes]."""
    qt, _, offsets, _ = KQUANTS[fmt]
    _, nbytes = gguf.GGML_QUANT_SIZES[qt]
    b = rng.integers(0, 256, (*lead, k // 256, nbytes), dtype=np.uint8)
    for off in offsets:
        f = rng.uniform(-0.02, 0.02, (*lead, k // 256, 1)).astype(np.float16)
        b[..., off:off + 2] = f.view(np.uint8)
    return b


def _gguf_values(b: np.ndarray, qt: QT) -> np.ndarray:
    return dequantize(b.reshape(-1, b.shape[-1]), qt).reshape(*b.shape[:-2], -1)


@pytest.mark.parametrize("fmt", sorted(KQUANTS))
@pytest.mark.parametrize("lead", [(3,), (2, 5)], ids=["N", "E,N"])
def test_file_blocks_convert_bit_for_bit(fmt, lead):
    qt, gs, _, convert = KQUANTS[fmt]
    rng = np.random.default_rng(len(lead))
    k = 768
    b = _blocks(fmt, lead, k, rng)
    arrays = convert(b)
    spec = FORMATS[fmt].array_shapes((*lead, k), gs)
    assert {n: (a.dtype, a.shape) for n, a in arrays.items()} == spec
    got = FORMATS[fmt].dequantize(arrays, k, gs)
    assert got.dtype == np.float32
    assert np.array_equal(got, _gguf_values(b, qt))


@pytest.mark.parametrize("fmt", sorted(KQUANTS))
def test_every_code_and_scale_survives(fmt):
    """Extreme bytes (all 0x00, all 0xFF, alternating) and NaN-free extreme f16 fields, bit for bit."""
    qt, gs, offs, convert = KQUANTS[fmt]
    _, nbytes = gguf.GGML_QUANT_SIZES[qt]
    b = np.stack([np.full(nbytes, v, np.uint8) for v in (0x00, 0xFF, 0x55, 0xAA)])[None]     # [1, 4, bytes]
    for i, f in enumerate((0.0, 65504.0, -2.0 ** -24, 1.0)):
        for off in offs:
            b[0, i, off:off + 2] = np.array([f], np.float16).view(np.uint8)
    with np.errstate(over="ignore"):
        want, got = _gguf_values(b, qt), FORMATS[fmt].dequantize(convert(b), 1024, gs)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("fmt", sorted(KQUANTS))
def test_reader_native_rows_unpermute_every_array(fmt):
    """iter_row_blocks(native=...) on a permuted q tensor: the arrays' values equal the reader's own f32
    rows (gguf-py's dequantization, unpermuted) bit for bit, block after block."""
    qt, gs, _, _ = KQUANTS[fmt]
    n, k, heads = 16, 512, 2
    data = _blocks(fmt, (n,), k, np.random.default_rng(7)).reshape(-1)
    file = SimpleNamespace(metadata={}, view=lambda off, nb: data[off:off + nb])
    info = GGUFTensorInfo("model.layers.0.self_attn.q_proj.weight", Path("x.gguf"), qt.name, (n, k), 0,
                          data.size, "blk.0.attn_q.weight", heads)
    store = GGUFTensorStore(Path("x.gguf"), file, {info.key: info})
    blocks = list(store.iter_row_blocks(info.key, block_bytes=8 * 4 * k, native=(fmt, gs)))
    assert len(blocks) == 2
    for rows, arrays in blocks:
        assert arrays is not None
        assert np.array_equal(FORMATS[fmt].dequantize(arrays, k, gs), rows)
    assert list(store.iter_row_blocks(info.key, native=("int4", 32)))[0][1] is None     # not the file's format


def _step_bound(fmt: str, a: dict[str, np.ndarray], lead: tuple[int, ...], gs: int) -> np.ndarray:
    """The docstring's bound per group [*lead, K/G]: (d*sc + dmin*[q4k]) / 2."""
    s = a["scales"].astype(np.float32)
    sub = a["sub"].astype(np.float32)
    if fmt == "q4k":
        d, dmin, sc = s[..., 0::2], s[..., 1::2], sub[..., 0::2]
        per = 256 // gs
        return (np.repeat(d, per, -1) * sc + np.repeat(dmin, per, -1)) / 2
    return np.repeat(s, 256 // gs, -1) * sub / 2


@pytest.mark.parametrize("fmt,rms", [("q4k", 0.1), ("q6k", 0.025)])
@pytest.mark.parametrize("shape", [(8, 1024), (3, 4, 512)], ids=["N,K", "E,N,K"])
def test_quantize_roundtrip_error_bounded(fmt, rms, shape):
    gs = KQUANTS[fmt][1]
    w = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    f = FORMATS[fmt]
    a = f.quantize(w, gs)
    spec = f.array_shapes(shape, gs)
    assert {n: (x.dtype, x.shape) for n, x in a.items()} == spec
    assert f.nbytes(shape, gs) == sum(x.nbytes for x in a.values())
    r = f.dequantize(a, shape[-1], gs)
    assert r.shape == shape and r.dtype == np.float32
    assert np.sqrt(((r - w) ** 2).mean() / (w ** 2).mean()) < rms
    bound = np.repeat(_step_bound(fmt, a, shape[:-1], gs), gs, -1)
    assert (np.abs(r - w) <= bound * (1 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("fmt", sorted(KQUANTS))
def test_quantize_edge_values(fmt):
    """Zeros, constant rows of either sign, one spike and all-negative rows: finite, bounded, no NaN."""
    gs = KQUANTS[fmt][1]
    w = np.zeros((6, 256), np.float32)
    w[1] = 3.0
    w[2] = -0.5
    w[3, 17] = 100.0
    w[4] = -np.linspace(1, 2, 256, dtype=np.float32)
    w[5] = np.linspace(-1e-6, 1e-6, 256, dtype=np.float32)
    a = FORMATS[fmt].quantize(w, gs)
    r = FORMATS[fmt].dequantize(a, 256, gs)
    assert np.isfinite(r).all()
    assert (r[0] == 0).all()
    bound = np.repeat(_step_bound(fmt, a, (6,), gs), gs, -1)
    assert (np.abs(r - w) <= bound * (1 + 1e-5) + 1e-7).all()


def test_sizes():
    assert FORMATS["q4k"].bits_per_weight((4, 512), 32) == pytest.approx(4.625)
    assert FORMATS["q6k"].bits_per_weight((4, 512), 16) == pytest.approx(6.5625)
    assert FORMATS["q4k"].row_bytes(512, 32) == (256, 32 + 8)
    assert FORMATS["q6k"].row_bytes(512, 16) == (384, 32 + 4)
    assert FORMATS["q4k"].array_shapes((2, 5, 256), 32) == {
        "qs": (np.dtype(np.uint8), (2, 5, 128)), "sub": (np.dtype(np.uint8), (2, 5, 16)),
        "scales": (np.dtype(np.float16), (2, 5, 2))}
    assert FORMATS["q6k"].array_shapes((2, 5, 256), 16) == {
        "qs": (np.dtype(np.uint8), (2, 5, 192)), "sub": (np.dtype(np.int8), (2, 5, 16)),
        "scales": (np.dtype(np.float16), (2, 5, 1))}
    assert FORMATS["q4k"].grouped and FORMATS["q6k"].grouped


@pytest.mark.parametrize("fmt", sorted(KQUANTS))
def test_usage_errors(fmt):
    gs = KQUANTS[fmt][1]
    w = np.zeros((2, 320), np.float32)
    with pytest.raises(UsageError, match=f"{fmt} stores rows in super-blocks of 256"):
        FORMATS[fmt].quantize(w, gs)
    with pytest.raises(UsageError, match=fmt):
        FORMATS[fmt].array_shapes((2, 320), gs)
    with pytest.raises(UsageError, match=f"{fmt} takes --group-size {gs}"):
        FORMATS[fmt].quantize(np.zeros((2, 256), np.float32), 64)
    with pytest.raises(UsageError, match=f"{fmt} takes --group-size {gs}"):
        check_group_size(fmt, 64)
    check_group_size(fmt, gs)
