"""Step results between the device and the host, by rows: one partition's packed host-bound
results (HostSlice), a prefill's results at its padded length (PaddedRows), the last token's rows
sliced on the device (fetch_last)."""

from __future__ import annotations

import math

import numpy as np

from strata_compiler.errors import BackendError

from . import cuda_rt
from .device import load_jax


class HostSlice:
    """One result inside a partition's packed device->host buffer: becomes a NumPy array when a
    CPU kernel reads it. The buffer comes to the host once, for all its slices: by a raw copy
    when those are on (cuda_rt), else through the host copy JAX started at dispatch."""

    __slots__ = ("packed", "off", "n", "shape")

    def __init__(self, packed: dict, off: int, shape) -> None:
        self.packed, self.off, self.shape = packed, off, tuple(shape)
        self.n = math.prod(self.shape)

    def __array__(self, dtype=None, copy=None):
        host = self.packed.get("host")
        if host is None:
            host = self.packed["host"] = cuda_rt.fetch(self.packed["buf"])
        a = host[self.off:self.off + self.n].reshape(self.shape)
        return a if dtype is None else a.astype(dtype)


class PaddedRows:
    """A result of a prefill run at its padded length, [B*T_pad, ...], standing for its B*T real
    rows: another xla partition of the same step takes the padded device array (`v`), a CPU kernel
    the real rows on the host (np.asarray)."""

    __slots__ = ("v", "B", "T", "T_pad")

    def __init__(self, v, B: int, T: int, T_pad: int) -> None:
        self.v, self.B, self.T, self.T_pad = v, B, T, T_pad

    def copy_to_host_async(self) -> None:
        self.v.copy_to_host_async()

    def __array__(self, dtype=None, copy=None):
        tail = tuple(self.v.shape[1:])
        a = cuda_rt.fetch(self.v).reshape(self.B, self.T_pad, *tail)[:, :self.T].reshape(self.B * self.T, *tail)
        return a if dtype is None else a.astype(dtype)


def _pad_rows(v, B: int, T: int, T_pad: int):
    """A partition's input of B*T rows at a prefill's padded length: a PaddedRows' device array as
    it is, a host value zero-padded on the host (row b's tokens first, then T_pad - T zeros)."""
    if isinstance(v, PaddedRows):
        return v.v
    a = np.asarray(v)
    if a.shape[0] != B * T:
        raise BackendError(f"a partition input of {a.shape[0]} rows in a step of {B} x {T} tokens")
    out = np.zeros((B, T_pad, *a.shape[1:]), a.dtype)
    out[:, :T] = a.reshape(B, T, *a.shape[1:])
    return out.reshape(B * T_pad, *a.shape[1:])


_LAST = {}


def fetch_last(v, B: int, T_pad: int, T: int) -> np.ndarray:
    """Token T - 1's rows of a device result [B*T_pad, ...] on the host, [B, 1, ...]: sliced on the
    device by one program per padded shape (a slice at T - 1 would compile one per prompt length)."""
    fn = _LAST.get("fn")
    if fn is None:
        jax = load_jax()
        fn = _LAST["fn"] = jax.jit(
            lambda x, i, B: jax.lax.dynamic_slice_in_dim(x.reshape(B, -1, *x.shape[1:]), i, 1, axis=1),
            static_argnums=2)
    out = cuda_rt.fetch(fn(v, np.int32(T - 1), B))
    return out.reshape(B, 1, -1) if out.ndim != 3 else out
