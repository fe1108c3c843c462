"""Rotary position embedding frequencies, shared by every backend (default, linear, llama3)."""

from __future__ import annotations

import math

import numpy as np


def rope_inv_freq(head_dim: int, attrs: dict) -> np.ndarray:
    """inv_freq f32[hd/2] as transformers computes it for the rope_type in `attrs`."""
    theta = float(attrs["rope_theta"])
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    rtype = attrs.get("rope_type", "default")
    if rtype == "linear":
        inv = inv / float(attrs["rope_factor"])
    elif rtype == "llama3":
        factor, lo, hi = float(attrs["rope_factor"]), float(attrs["rope_low_freq_factor"]), float(attrs["rope_high_freq_factor"])
        old = float(attrs["rope_original_max"])
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rope_cos_sin(positions: np.ndarray, head_dim: int, attrs: dict) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin f32[..., hd] for positions [...] (rotate-half RoPE: the halves repeat the frequencies)."""
    freqs = positions.astype(np.float32)[..., None] * rope_inv_freq(head_dim, attrs)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
