"""The GGUF K-quant formats `q4k` and `q6k`: llama.cpp's Q4_K and Q6_K kept at their own size, in a
layout a dp4a kernel reads (formats.py's module docstring defines both; formats.py registers them).

pack_q4k / pack_q6k are the one place the layouts are written: quantize here and the GGUF reader's
conversion of a file's Q4_K / Q6_K blocks (frontend/gguf_reader.py) both call them, so a file's
tensor and one quantized from f32 are the same kind of arrays, and dequantize gives a file's values
bit for bit (the same f32 operations in the same order as ggml's dequantize_row_q4_K / _q6_K).

Legend: K = input columns, a multiple of QK = 256; S = K / 256 super-blocks per row; leading axes
[..., N] (and E = experts ahead of them) pass through. Codes are unsigned: q4k [0, 15], q6k [0, 63].
"""

from __future__ import annotations

import numpy as np

from .errors import UsageError

QK = 256                                # values per super-block (ggml's QK_K)
GROUP = {"q4k": 32, "q6k": 16}          # the one group size (sub-block) each format takes
GPU_ONLY = tuple(GROUP)                 # kernels on the xla backend only (the llvm backend has none)
_GGUF = {"q4k": "Q4_K", "q6k": "Q6_K"}


def check_group(name: str, group_size: int) -> None:
    """UsageError unless `group_size` is the sub-block of K-quant format `name`."""
    if group_size != GROUP[name]:
        raise UsageError(f"--group-size {group_size}: {name} takes --group-size {GROUP[name]} "
                         f"(the sub-blocks of GGUF's {_GGUF[name]})")


def check_shape(name: str, k: int, group_size: int) -> None:
    """UsageError unless rows of `k` values in groups of `group_size` suit K-quant format `name`."""
    check_group(name, group_size)
    if k % QK:
        raise UsageError(f"{name} stores rows in super-blocks of {QK} values; a row of {k} is not a whole "
                         f"number of them: store this weight in another format (--quant / --tensor-format)")


def array_shapes(name: str, shape: tuple[int, ...], group_size: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """dtype and shape of each array of K-quant format `name` for a logical f32 `shape` [..., N, K]."""
    *lead, k = shape
    check_shape(name, k, group_size)
    lead = tuple(lead)
    u8, f16 = np.dtype(np.uint8), np.dtype(np.float16)
    if name == "q4k":
        return {"qs": (u8, lead + (k // 2,)), "sub": (u8, lead + (2 * k // 32,)), "scales": (f16, lead + (2 * k // QK,))}
    return {"qs": (u8, lead + (3 * k // 4,)), "sub": (np.dtype(np.int8), lead + (k // 16,)),
            "scales": (f16, lead + (k // QK,))}


def _interleave(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.stack([a, b], axis=-1).reshape(*a.shape[:-1], -1)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b in f32, 0 where b == 0."""
    out = np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32)
    return np.divide(a, b, out=out, where=b != 0)


def _f16_up(x: np.ndarray) -> np.ndarray:
    """f32 >= 0 -> the smallest f16 not below it (at most 65504): a scale at which no code overflows."""
    x = np.minimum(x, np.float32(65504.0))
    h = x.astype(np.float16)
    return np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)


def _levels(x: np.ndarray, d: np.ndarray, rnd, top: int) -> np.ndarray:
    """Per group: x [..., S, n] in units of its super-block's f16 scale d [..., S], rounded by `rnd`,
    clipped to [0, top]."""
    return np.clip(rnd(_div(x, d.astype(np.float32)[..., None])), 0, top)


# -- q4k -------------------------------------------------------------------------------------------


def pack_q4k(codes: np.ndarray, sc: np.ndarray, m: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> dict[str, np.ndarray]:
    """q4k's arrays from codes [..., K] in [0, 15], per group of 32 sc and m [..., K/32] in [0, 63],
    per super-block d and dmin f16 [..., K/256]."""
    q = codes.astype(np.uint8).reshape(*codes.shape[:-1], -1, 32)
    qs = q[..., :16] | (q[..., 16:] << 4)
    return {"qs": qs.reshape(*codes.shape[:-1], -1),
            "sub": _interleave(sc.astype(np.uint8), m.astype(np.uint8)),
            "scales": _interleave(d.astype(np.float16), dmin.astype(np.float16))}


def q4k_quantize(w: np.ndarray, group_size: int, importance: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """f32 [..., K] -> q4k (the module docstring of formats.py gives the rule; importance is not used)."""
    w = np.asarray(w, dtype=np.float32)
    check_shape("q4k", w.shape[-1], group_size)
    lead = w.shape[:-1]
    g = w.reshape(*lead, -1, 8, 32)                             # [..., S, 8, 32]
    lo = np.minimum(g.min(axis=-1), np.float32(0))              # [..., S, 8]: stored as -dmin * m <= 0
    step = (g.max(axis=-1) - lo) / np.float32(15)
    d, dmin = _f16_up(step.max(axis=-1) / np.float32(63)), _f16_up(-lo.min(axis=-1) / np.float32(63))   # [..., S]
    sc = _levels(step, d, np.ceil, 63)                          # d * sc >= step: the top fits
    m = _levels(-lo, dmin, np.rint, 63)
    ds = (d.astype(np.float32)[..., None] * sc)[..., None]      # [..., S, 8, 1]
    ms = (dmin.astype(np.float32)[..., None] * m)[..., None]
    q = np.clip(np.rint(_div(g + ms, ds)), 0, 15)
    return pack_q4k(q.reshape(w.shape), sc.reshape(*lead, -1), m.reshape(*lead, -1), d, dmin)


def q4k_dequantize(a: dict[str, np.ndarray], k: int, group_size: int) -> np.ndarray:
    """q4k -> f32 [..., K]: (f32(d) * sc) * q - f32(dmin) * m, ggml's order."""
    check_shape("q4k", k, group_size)
    p = a["qs"].reshape(*a["qs"].shape[:-1], -1, 16)
    q = np.concatenate([p & 0x0F, p >> 4], axis=-1).astype(np.float32)         # [..., K/32, 32]
    sub = a["sub"].astype(np.float32)
    lead = sub.shape[:-1]
    sc, m = sub[..., 0::2].reshape(*lead, -1, 8), sub[..., 1::2].reshape(*lead, -1, 8)   # [..., S, 8]
    s = a["scales"].astype(np.float32)
    d, dmin = s[..., 0::2, None], s[..., 1::2, None]                           # [..., S, 1]
    d1 = (d * sc).reshape(*lead, -1, 1)
    m1 = (dmin * m).reshape(*lead, -1, 1)
    return (d1 * q - m1).reshape(*lead, -1)


# -- q6k -------------------------------------------------------------------------------------------


def pack_q6k(codes: np.ndarray, sc: np.ndarray, d: np.ndarray) -> dict[str, np.ndarray]:
    """q6k's arrays from codes [..., K] in [0, 63], per group of 16 sc i8 [..., K/16], per
    super-block d f16 [..., K/256]."""
    q = codes.astype(np.uint8).reshape(*codes.shape[:-1], -1, 16)
    low = (q[..., :8] & 0x0F) | ((q[..., 8:] & 0x0F) << 4)                     # [..., K/16, 8]
    hi = (q >> 4).reshape(*q.shape[:-1], 4, 4)                                 # [..., K/16, j, i]: code i + 4j
    high = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)
    qs = np.concatenate([low, high], axis=-1)                                  # [..., K/16, 12]
    return {"qs": qs.reshape(*codes.shape[:-1], -1), "sub": sc.astype(np.int8), "scales": d.astype(np.float16)}


def _unpack_q6k(qs: np.ndarray) -> np.ndarray:
    """q6k's qs [..., 3K/4] -> codes u8 [..., K/16, 16]."""
    b = qs.reshape(*qs.shape[:-1], -1, 12)
    low, high = b[..., :8], b[..., 8:]
    q = np.concatenate([low & 0x0F, low >> 4], axis=-1)
    return q | (np.concatenate([(high >> (2 * j)) & 3 for j in range(4)], axis=-1) << 4)


def q6k_quantize(w: np.ndarray, group_size: int, importance: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """f32 [..., K] -> q6k (the module docstring of formats.py gives the rule; importance is not used)."""
    w = np.asarray(w, dtype=np.float32)
    check_shape("q6k", w.shape[-1], group_size)
    lead = w.shape[:-1]
    g = w.reshape(*lead, -1, 16, 16)                            # [..., S, 16, 16]
    s = np.abs(g).max(axis=-1) / np.float32(31)                 # [..., S, 16]: the group's step
    d = _f16_up(s.max(axis=-1) / np.float32(127))               # [..., S]
    sc = _levels(s, d, np.ceil, 127)                            # d * sc >= s: no code past +-31
    ds = (d.astype(np.float32)[..., None] * sc)[..., None]
    q = np.clip(np.rint(_div(g, ds)), -32, 31) + 32
    return pack_q6k(q.reshape(w.shape), sc.reshape(*lead, -1), d)


def q6k_dequantize(a: dict[str, np.ndarray], k: int, group_size: int) -> np.ndarray:
    """q6k -> f32 [..., K]: (f32(d) * sc) * (q - 32), ggml's order."""
    check_shape("q6k", k, group_size)
    sc = a["sub"].astype(np.float32)
    lead = sc.shape[:-1]
    d = a["scales"].astype(np.float32)[..., None]                              # [..., S, 1]
    ds = (d * sc.reshape(*lead, -1, 16)).reshape(*lead, -1, 1)                 # [..., K/16, 1]
    q = (_unpack_q6k(a["qs"]).astype(np.int8) - np.int8(32)).astype(np.float32)
    return (ds * q).reshape(*lead, -1)
