"""Weight format registry: the NumPy quantize/dequantize here is the definition of each format.

Every backend implements exactly these semantics; tests check them against `dequantize`.

Legend: N = output rows, K = input columns (the reduced axis), G = group size,
Kp = K rounded up to a multiple of G (groups never straddle rows; the tail is zero-padded).
Leading axes (e.g. E = experts) pass through unchanged.

Layouts (all little-endian, C order):
  f32   w      f32[..., N, K]
  bf16  w      u16[..., N, K]      bf16 bits, round-to-nearest-even from f32
  int8  qs     i8 [..., N, Kp]     q = roundf(w / d) (half away from zero), d = absmax(group) / 127
        scales f16[..., N, Kp/G]   in f32, stored f16: llama.cpp's Q8_0 bit for bit at G = 32
  int4  qs     u8 [..., N, Kp/2]   group-major; in each group of G values, byte i holds value i in
                                   its low nibble and value i + G/2 in its high nibble (llama.cpp
                                   Q4_0 order: one AND and one shift give two contiguous halves)
        scales f16[..., N, Kp/G]   d = m / -8 (m: the group's value of largest magnitude, sign
                                   kept; f32, stored f16), q = min(15, trunc(w / d + 8.5)): the
                                   extreme takes level 0 exactly, the other end may clip by one
                                   step; llama.cpp's Q4_0 bit for bit at G = 32
  int4a qs     u8 [..., N, Kp/2]   int4's nibble order, q in [0, 15], w = q * d + m (asymmetric)
        scales f16[..., N, 2Kp/G]  (d, m) per group, interleaved; d = (max - min) / 15, m = min
  int3  qs     u8 [..., N, 3Kp/8]  per group: G/4 bytes of low bits — byte i holds value
                                   i + j*G/4 in bits 2j..2j+1 — then G/8 bytes of high bits —
                                   byte i holds the third bit of value i + j*G/8 in bit j;
                                   q = clip(round(w / d), -4, 3) + 4,
                                   d = max(max(group) / 3, min(group) / -4): no value clips
        scales f16[..., N, Kp/G]
  int2  qs     u8 [..., N, Kp/4]   int3's low-bit plane alone, q in [0, 3], w = q * d + m
        scales f16[..., N, 2Kp/G]  (d, m) per group; d = (max - min) / 3, m = min
  fp8   qs     u8 [..., N, Kp]     float8 e4m3fn bits of w / d (round to nearest even)
        scales f16[..., N, Kp/G]   d = absmax(group) / 448

Grouped formats take an optional importance vector (per input column, e.g. the mean square of
the activations it multiplies, as llama.cpp's imatrix): scales (and minima) are then chosen
from a small grid of candidates to minimise the importance-weighted squared error of the
group, instead of from its extremes. Without one, the extremes decide (deterministic, fast).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .errors import UsageError

Arrays = dict[str, np.ndarray]


def _pad_groups(w: np.ndarray, group_size: int) -> np.ndarray:
    """[..., K] -> [..., Kp/G, G], zero-padded."""
    k = w.shape[-1]
    kp = -(-k // group_size) * group_size
    if kp != k:
        pad = [(0, 0)] * (w.ndim - 1) + [(0, kp - k)]
        w = np.pad(w, pad)
    return w.reshape(*w.shape[:-1], kp // group_size, group_size)


def _f32_quantize(w: np.ndarray, group_size: int, importance=None) -> Arrays:
    return {"w": np.ascontiguousarray(w, dtype=np.float32)}


def _f32_dequantize(a: Arrays, k: int, group_size: int) -> np.ndarray:
    return a["w"].astype(np.float32, copy=False)


def f32_to_bf16_bits(w: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even f32 -> bf16, returned as raw u16 bits (NaN stays NaN)."""
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    rounded = u + (np.uint32(0x7FFF) + ((u >> 16) & 1))
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(w)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def _bf16_quantize(w: np.ndarray, group_size: int, importance=None) -> Arrays:
    return {"w": f32_to_bf16_bits(w)}


def _bf16_dequantize(a: Arrays, k: int, group_size: int) -> np.ndarray:
    return bf16_bits_to_f32(a["w"])


def _q8_0(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's quantize_row_q8_0_ref on groups g [..., G]: (f16 scales, int codes)."""
    d32 = (np.abs(g).max(axis=-1) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d32, out=np.zeros_like(d32), where=d32 != 0)[..., None]
    x = g * inv
    a = np.abs(x)
    q = np.clip(np.sign(x) * (np.floor(a) + np.floor(2 * (a - np.floor(a)))), -127, 127)
    return _f16_scale(d32), q


def _q4_0(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's quantize_row_q4_0_ref on groups g [..., G]: (f16 scales, codes - 8 in [-8, 7])."""
    m = np.take_along_axis(g, np.abs(g).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    d32 = (m / np.float32(-8)).astype(np.float32)
    inv = np.divide(np.float32(1), d32, out=np.zeros_like(d32), where=d32 != 0)[..., None]
    q = np.clip(np.trunc(g * inv + np.float32(8.5)), 0, 15) - 8
    return np.clip(d32, np.float32(-65504.0), np.float32(65504.0)).astype(np.float16), q


def _with_plain(g: np.ndarray, imp: np.ndarray | None, plain, qmax_abs: int, qmin: int, qmax: int):
    """(scales, codes) of the plain rule `plain(g)`; with importance, per group the better of it
    and the importance search's (so the search is never worse than the plain rule)."""
    d0, q0 = plain(g)
    if imp is None:
        return d0, q0
    d1, q1 = _sym(g, imp, qmax_abs, qmin, qmax)
    err = [(imp * (g - q * d.astype(np.float32)[..., None]) ** 2).sum(-1) for d, q in ((d0, q0), (d1, q1))]
    take = err[1] < err[0]
    return np.where(take, d1, d0), np.where(take[..., None], q1, q0)


def int4_codes(g: np.ndarray, imp: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """int4's (f16 scales, codes in [-8, 7]) of groups g [..., G], importance per value or None."""
    return _with_plain(g, imp, _q4_0, 7, -8, 7)


def _int8_quantize(w: np.ndarray, group_size: int, importance=None) -> Arrays:
    g = _pad_groups(np.asarray(w, dtype=np.float32), group_size)
    d, q = _with_plain(g, _imp_groups(importance, w.shape[-1], group_size), _q8_0, 127, -127, 127)
    q = q.astype(np.int8)
    return {"qs": q.reshape(*q.shape[:-2], -1), "scales": d}


def _int8_dequantize(a: Arrays, k: int, group_size: int) -> np.ndarray:
    qs, d = a["qs"], a["scales"]
    g = qs.reshape(*qs.shape[:-1], -1, group_size).astype(np.float32)
    w = g * d.astype(np.float32)[..., None]
    return w.reshape(*w.shape[:-2], -1)[..., :k]


def _int4_quantize(w: np.ndarray, group_size: int, importance=None) -> Arrays:
    if group_size % 2:
        raise UsageError(f"--group-size {group_size}: int4 needs an even group size")
    g = _pad_groups(np.asarray(w, dtype=np.float32), group_size)
    d, q = int4_codes(g, _imp_groups(importance, w.shape[-1], group_size))
    return {"qs": _pack_nibbles((q + 8).astype(np.uint8), group_size), "scales": d}


def _int4_dequantize(a: Arrays, k: int, group_size: int) -> np.ndarray:
    qs, d = a["qs"], a["scales"]
    half = group_size // 2
    p = qs.reshape(*qs.shape[:-1], -1, half)
    q = np.concatenate([p & 0x0F, p >> 4], axis=-1).astype(np.float32) - 8.0
    w = q * d.astype(np.float32)[..., None]
    return w.reshape(*w.shape[:-2], -1)[..., :k]


# scale multipliers tried by the importance search: the plain rule (1.0) first, then a grid
_CANDIDATES = np.concatenate([[1.0], np.linspace(0.7, 1.1, 17)]).astype(np.float32)


def _f16_scale(x: np.ndarray) -> np.ndarray:
    return np.minimum(x, np.float32(65504.0)).astype(np.float16)


def _inverse(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d as f32 [..., 1], 1/d with 0 where d == 0)."""
    d32 = d.astype(np.float32)[..., None]
    return d32, np.divide(1.0, d32, out=np.zeros_like(d32), where=d32 != 0)


def _search(g: np.ndarray, imp: np.ndarray | None, base: np.ndarray, roundtrip) -> np.ndarray:
    """Per-group f16 scale minimising sum imp * (w - roundtrip(d))^2 over candidates base * f,
    f in _CANDIDATES (`roundtrip(d)` gives the group's values as stored with scales d). The
    first candidate (the plain rule) wins ties, so the search is never worse than it."""
    if imp is None:
        return _f16_scale(base)
    best_err = best_d = None
    for f in _CANDIDATES:
        d = _f16_scale(base * f)
        err = (imp * (g - roundtrip(d)) ** 2).sum(-1)
        if best_err is None:
            best_err, best_d = err, d
        else:
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_d = np.where(better, d, best_d)
    return best_d


def _imp_groups(importance: np.ndarray | None, k: int, group_size: int) -> np.ndarray | None:
    if importance is None:
        return None
    imp = np.asarray(importance, np.float32).reshape(-1)
    if imp.shape[0] != k:
        raise UsageError(f"importance vector of {imp.shape[0]} values for rows of {k}")
    return _pad_groups(np.maximum(imp, 1e-12)[None], group_size)[0]


def _codes(g: np.ndarray, d: np.ndarray, m: np.ndarray | None, qmin: int, qmax: int) -> np.ndarray:
    _, inv = _inverse(d)
    m32 = 0.0 if m is None else m.astype(np.float32)[..., None]
    return np.clip(np.rint((g - m32) * inv), qmin, qmax)


def _int_roundtrip(g: np.ndarray, m: np.ndarray | None, qmin: int, qmax: int):
    """d -> the group's values stored as integer codes with scales d (and minima m)."""
    m32 = 0.0 if m is None else m.astype(np.float32)[..., None]
    return lambda d: _codes(g, d, m, qmin, qmax) * _inverse(d)[0] + m32


def _sym(g, imp, qmax_abs: int, qmin: int, qmax: int, signed_range: bool = False):
    """Symmetric: d from absmax / qmax_abs (or the importance search), codes in [qmin, qmax].
    signed_range: d = max(max / qmax, min / qmin), the smallest scale at which both extremes
    fit the uneven code range (for int3's [-4, 3], absmax / 4 would clip a positive maximum
    to 3/4 of itself)."""
    if signed_range:
        base = np.maximum(g.max(axis=-1) / qmax, g.min(axis=-1) / qmin).astype(np.float32)
    else:
        base = np.abs(g).max(axis=-1) / qmax_abs
    d = _search(g, imp, base, _int_roundtrip(g, None, qmin, qmax))
    return d, _codes(g, d, None, qmin, qmax)


def _asym(g, imp, levels: int):
    """Asymmetric: m = min, d = (max - min) / levels (or the search), codes in [0, levels]."""
    lo = g.min(axis=-1).astype(np.float32)
    hi = g.max(axis=-1).astype(np.float32)
    m = lo.astype(np.float16)
    d = _search(g, imp, (hi - lo) / levels, _int_roundtrip(g, m, 0, levels))
    return d, m, _codes(g, d, m, 0, levels)


def _interleave(d: np.ndarray, m: np.ndarray) -> np.ndarray:
    return np.stack([d, m], axis=-1).reshape(*d.shape[:-1], -1)


def _pack_nibbles(q: np.ndarray, group_size: int) -> np.ndarray:
    half = group_size // 2
    q = q.astype(np.uint8)
    packed = q[..., :half] | (q[..., half:] << 4)
    return packed.reshape(*packed.shape[:-2], -1)


def _unpack_nibbles(qs: np.ndarray, group_size: int) -> np.ndarray:
    p = qs.reshape(*qs.shape[:-1], -1, group_size // 2)
    return np.concatenate([p & 0x0F, p >> 4], axis=-1).astype(np.float32)


def _pack_planes(q: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """[..., NG, G] codes of `bits` (2 or 3) bits -> [..., NG * G*bits/8] (module docstring)."""
    q = q.astype(np.uint8)
    q4 = group_size // 4
    low = (q & 3).reshape(*q.shape[:-1], 4, q4)
    plane = (low[..., 0, :] | (low[..., 1, :] << 2) | (low[..., 2, :] << 4) | (low[..., 3, :] << 6))
    if bits == 3:
        q8 = group_size // 8
        high = (q >> 2).reshape(*q.shape[:-1], 8, q8)
        hb = np.zeros(q.shape[:-1] + (q8,), np.uint8)
        for j in range(8):
            hb |= high[..., j, :] << j
        plane = np.concatenate([plane, hb], axis=-1)
    return plane.reshape(*plane.shape[:-2], -1)


def _unpack_planes(qs: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    q4 = group_size // 4
    per = group_size * bits // 8
    b = qs.reshape(*qs.shape[:-1], -1, per)
    low = b[..., :q4]
    q = np.concatenate([(low >> (2 * j)) & 3 for j in range(4)], axis=-1)
    if bits == 3:
        hb = b[..., q4:]
        q = q | (np.concatenate([(hb >> j) & 1 for j in range(8)], axis=-1) << 2)
    return q.astype(np.float32)


# The multiple of which each grouped format's group size must be: int3 and int2 pack bit planes
# of G/8 and G/4 bytes; fp8 takes multiples of 8 as `stratac compile --help` documents; the
# others hold pairs of values (nibbles). Checked before a compile starts (driver.check_options).
GROUP_MULTIPLE = {"int8": 2, "int4": 2, "int4a": 2, "int3": 8, "int2": 4, "fp8": 8}


def check_group_size(name: str, group_size: int) -> None:
    """UsageError unless `group_size` suits grouped format `name`."""
    mult = GROUP_MULTIPLE.get(name, 1)
    if group_size % mult:
        raise UsageError(f"--group-size {group_size}: {name} needs a group size that is a multiple of {mult}")


def _grid(w: np.ndarray, group_size: int, name: str) -> np.ndarray:
    check_group_size(name, group_size)
    return _pad_groups(np.asarray(w, dtype=np.float32), group_size)


def _finish(w: np.ndarray, k: int) -> np.ndarray:
    return w.reshape(*w.shape[:-2], -1)[..., :k]


def _int4a_quantize(w, group_size, importance=None):
    g = _grid(w, group_size, "int4a")
    d, m, q = _asym(g, _imp_groups(importance, w.shape[-1], group_size), 15)
    return {"qs": _pack_nibbles(q, group_size), "scales": _interleave(d, m)}


def _int4a_dequantize(a, k, group_size):
    sc = a["scales"].astype(np.float32)
    q = _unpack_nibbles(a["qs"], group_size)
    return _finish(q * sc[..., 0::2, None] + sc[..., 1::2, None], k)


def _int3_quantize(w, group_size, importance=None):
    g = _grid(w, group_size, "int3")
    d, q = _sym(g, _imp_groups(importance, w.shape[-1], group_size), 4, -4, 3, signed_range=True)
    return {"qs": _pack_planes(q + 4, 3, group_size), "scales": d}


def _int3_dequantize(a, k, group_size):
    q = _unpack_planes(a["qs"], 3, group_size) - 4.0
    return _finish(q * a["scales"].astype(np.float32)[..., None], k)


def _int2_quantize(w, group_size, importance=None):
    g = _grid(w, group_size, "int2")
    d, m, q = _asym(g, _imp_groups(importance, w.shape[-1], group_size), 3)
    return {"qs": _pack_planes(q, 2, group_size), "scales": _interleave(d, m)}


def _int2_dequantize(a, k, group_size):
    sc = a["scales"].astype(np.float32)
    q = _unpack_planes(a["qs"], 2, group_size)
    return _finish(q * sc[..., 0::2, None] + sc[..., 1::2, None], k)


FP8_MAX = 448.0


def _fp8_codes(x: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return np.clip(x, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _fp8_values(b: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _fp8_quantize(w, group_size, importance=None):
    g = _grid(w, group_size, "fp8")

    def roundtrip(d):
        d32, inv = _inverse(d)
        return _fp8_values(_fp8_codes(g * inv)) * d32

    d = _search(g, _imp_groups(importance, w.shape[-1], group_size),
                np.abs(g).max(axis=-1) / np.float32(FP8_MAX), roundtrip)
    q = _fp8_codes(g * _inverse(d)[1])
    return {"qs": q.reshape(*q.shape[:-2], -1), "scales": d}


def _fp8_dequantize(a, k, group_size):
    qs = a["qs"]
    v = _fp8_values(qs.reshape(*qs.shape[:-1], -1, group_size))
    return _finish(v * a["scales"].astype(np.float32)[..., None], k)


@dataclass(frozen=True)
class WeightFormat:
    """One storage format for a weight matrix. `grouped` formats carry per-group scales."""

    name: str
    grouped: bool
    _quantize: Callable[[np.ndarray, int], Arrays]
    _dequantize: Callable[[Arrays, int, int], np.ndarray]

    def quantize(self, w: np.ndarray, group_size: int, importance: np.ndarray | None = None) -> Arrays:
        """f32[..., K] -> the format's named arrays (see the module docstring); `importance`
        (f32[K], optional) weights each column's error when scales are chosen."""
        return self._quantize(w, group_size, importance)

    def dequantize(self, arrays: Arrays, k: int, group_size: int) -> np.ndarray:
        """The format's arrays -> f32[..., K]."""
        return self._dequantize(arrays, k, group_size)

    def roundtrip(self, w: np.ndarray, group_size: int, importance: np.ndarray | None = None) -> np.ndarray:
        return self.dequantize(self.quantize(w, group_size, importance), w.shape[-1], group_size)

    def array_shapes(self, shape: tuple[int, ...], group_size: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """dtype and shape of each stored array for a logical f32 `shape` [..., N, K]."""
        *lead, k = shape
        lead = tuple(lead)
        ngroups = -(-k // group_size)
        kp = ngroups * group_size
        if self.name == "f32":
            return {"w": (np.dtype(np.float32), shape)}
        if self.name == "bf16":
            return {"w": (np.dtype(np.uint16), shape)}
        qbytes, scales = _LAYOUT[self.name]
        return {"qs": (np.dtype(np.int8 if self.name == "int8" else np.uint8), lead + (kp * qbytes[0] // qbytes[1],)),
                "scales": (np.dtype(np.float16), lead + (scales * ngroups,))}

    def nbytes(self, shape: tuple[int, ...], group_size: int) -> int:
        return sum(dt.itemsize * int(np.prod(s)) for dt, s in self.array_shapes(shape, group_size).values())

    def row_bytes(self, k: int, group_size: int) -> tuple[int, int]:
        """Bytes of one stored row [K]: its data (w or qs) and its scales (0 if none)."""
        shapes = self.array_shapes((1, k), group_size)
        data = shapes["w"] if "w" in shapes else shapes["qs"]
        sc = shapes.get("scales")
        return (data[0].itemsize * data[1][-1], 0 if sc is None else sc[0].itemsize * sc[1][-1])

    def bits_per_weight(self, shape: tuple[int, ...], group_size: int) -> float:
        return 8.0 * self.nbytes(shape, group_size) / float(np.prod(shape))


# grouped formats: (numerator, denominator) of qs bytes per weight, f16 scale values per group
_LAYOUT = {"int8": ((1, 1), 1), "int4": ((1, 2), 1), "int4a": ((1, 2), 2), "int3": ((3, 8), 1),
           "int2": ((1, 4), 2), "fp8": ((1, 1), 1)}

FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("f32", False, _f32_quantize, _f32_dequantize),
        WeightFormat("bf16", False, _bf16_quantize, _bf16_dequantize),
        WeightFormat("int8", True, _int8_quantize, _int8_dequantize),
        WeightFormat("int4", True, _int4_quantize, _int4_dequantize),
        WeightFormat("int4a", True, _int4a_quantize, _int4a_dequantize),
        WeightFormat("int3", True, _int3_quantize, _int3_dequantize),
        WeightFormat("int2", True, _int2_quantize, _int2_dequantize),
        WeightFormat("fp8", True, _fp8_quantize, _fp8_dequantize),
    )
}


def get_format(name: str) -> WeightFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise UsageError(f"unknown weight format {name!r}; known formats: {', '.join(FORMATS)}") from None


# Which Hugging Face tensors a `--quant` format applies to: the matrices of linear layers.
# Embeddings (a gather, and the tied lm_head that shares them), norms, biases and routers
# (tiny, and a flipped expert choice costs more than the bytes saved) stay f32.
_QUANTIZED_SUFFIXES = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
    "gate_proj.weight", "up_proj.weight", "down_proj.weight",
    "w1.weight", "w2.weight", "w3.weight",
)


def quantizes(hf_key: str) -> bool:
    """True when `--quant` applies to this Hugging Face weight (lm_head only when untied)."""
    return hf_key == "lm_head.weight" or hf_key.endswith(_QUANTIZED_SUFFIXES)


def adaptive(spec) -> bool:
    """True when layer-adaptive quantization (`--bits`, `--memory-budget`) and `--tensor-format`
    choose this weight's format: the linear layers' matrices `quantizes` selects, and the token
    embedding table (a row gather, and the lm_head as well when the model ties them)."""
    return len(spec.shape) >= 2 and (spec.name == "embed" or all(quantizes(k) for k in spec.sources))
