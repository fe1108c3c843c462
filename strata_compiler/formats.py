"""Weight format registry: the NumPy quantize/dequantize here is the definition of each format.

Every backend implements exactly these semantics; tests check them against `dequantize`.

Legend: N = output rows, K = input columns (the reduced axis), G = group size,
Kp = K rounded up to a multiple of G (groups never straddle rows; the tail is zero-padded).
Leading axes (e.g. E = experts) pass through unchanged.

Layouts (all little-endian, C order):
  f32   w      f32[..., N, K]
  bf16  w      u16[..., N, K]      bf16 bits, round-to-nearest-even from f32
  int8  qs     i8 [..., N, Kp]     q = clip(round(w / d), -127, 127)
        scales f16[..., N, Kp/G]   d = absmax(group) / 127
  int4  qs     u8 [..., N, Kp/2]   group-major; in each group of G values, byte i holds value i in
                                   its low nibble and value i + G/2 in its high nibble (llama.cpp
                                   Q4_0 order: one AND and one shift give two contiguous halves)
        scales f16[..., N, Kp/G]   q = clip(round(w / d), -8, 7) + 8, d = absmax(group) / 7
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


def _group_scales(groups: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-group scale d (as stored, f16) and its reciprocal in f32 (0 where d == 0)."""
    # Scales saturate at f16's largest finite value (65504); weights beyond qmax * 65504 clip.
    d = np.minimum(np.abs(groups).max(axis=-1) / qmax, np.float32(65504.0)).astype(np.float16)
    d32 = d.astype(np.float32)[..., None]
    inv = np.divide(1.0, d32, out=np.zeros_like(d32), where=d32 != 0)
    return d, inv


def _f32_quantize(w: np.ndarray, group_size: int) -> Arrays:
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


def _bf16_quantize(w: np.ndarray, group_size: int) -> Arrays:
    return {"w": f32_to_bf16_bits(w)}


def _bf16_dequantize(a: Arrays, k: int, group_size: int) -> np.ndarray:
    return bf16_bits_to_f32(a["w"])


def _int8_quantize(w: np.ndarray, group_size: int) -> Arrays:
    g = _pad_groups(np.asarray(w, dtype=np.float32), group_size)
    d, inv = _group_scales(g, 127)
    q = np.clip(np.rint(g * inv), -127, 127).astype(np.int8)
    return {"qs": q.reshape(*q.shape[:-2], -1), "scales": d}


def _int8_dequantize(a: Arrays, k: int, group_size: int) -> np.ndarray:
    qs, d = a["qs"], a["scales"]
    g = qs.reshape(*qs.shape[:-1], -1, group_size).astype(np.float32)
    w = g * d.astype(np.float32)[..., None]
    return w.reshape(*w.shape[:-2], -1)[..., :k]


def _int4_quantize(w: np.ndarray, group_size: int) -> Arrays:
    if group_size % 2:
        raise UsageError(f"--group-size {group_size}: int4 needs an even group size")
    g = _pad_groups(np.asarray(w, dtype=np.float32), group_size)
    d, inv = _group_scales(g, 7)
    q = (np.clip(np.rint(g * inv), -8, 7) + 8).astype(np.uint8)
    half = group_size // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    return {"qs": packed.reshape(*packed.shape[:-2], -1), "scales": d}


def _int4_dequantize(a: Arrays, k: int, group_size: int) -> np.ndarray:
    qs, d = a["qs"], a["scales"]
    half = group_size // 2
    p = qs.reshape(*qs.shape[:-1], -1, half)
    q = np.concatenate([p & 0x0F, p >> 4], axis=-1).astype(np.float32) - 8.0
    w = q * d.astype(np.float32)[..., None]
    return w.reshape(*w.shape[:-2], -1)[..., :k]


@dataclass(frozen=True)
class WeightFormat:
    """One storage format for a weight matrix. `grouped` formats carry per-group scales."""

    name: str
    grouped: bool
    _quantize: Callable[[np.ndarray, int], Arrays]
    _dequantize: Callable[[Arrays, int, int], np.ndarray]

    def quantize(self, w: np.ndarray, group_size: int) -> Arrays:
        """f32[..., K] -> the format's named arrays (see the module docstring)."""
        return self._quantize(w, group_size)

    def dequantize(self, arrays: Arrays, k: int, group_size: int) -> np.ndarray:
        """The format's arrays -> f32[..., K]."""
        return self._dequantize(arrays, k, group_size)

    def roundtrip(self, w: np.ndarray, group_size: int) -> np.ndarray:
        return self.dequantize(self.quantize(w, group_size), w.shape[-1], group_size)

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
        if self.name == "int8":
            return {"qs": (np.dtype(np.int8), lead + (kp,)), "scales": (np.dtype(np.float16), lead + (ngroups,))}
        return {"qs": (np.dtype(np.uint8), lead + (kp // 2,)), "scales": (np.dtype(np.float16), lead + (ngroups,))}

    def nbytes(self, shape: tuple[int, ...], group_size: int) -> int:
        return sum(dt.itemsize * int(np.prod(s)) for dt, s in self.array_shapes(shape, group_size).values())

    def bits_per_weight(self, shape: tuple[int, ...], group_size: int) -> float:
        return 8.0 * self.nbytes(shape, group_size) / float(np.prod(shape))


FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("f32", False, _f32_quantize, _f32_dequantize),
        WeightFormat("bf16", False, _bf16_quantize, _bf16_dequantize),
        WeightFormat("int8", True, _int8_quantize, _int8_dequantize),
        WeightFormat("int4", True, _int4_quantize, _int4_dequantize),
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
