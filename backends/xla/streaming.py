"""Device buffers a long prefill streams CPU-placed weights through (MixedExecutor's streamed
partitions): two sets per array layout, filled by raw copies from page-locked host memory on a
copy stream of their own, so the copy of partition i+1 runs while the GPU computes partition i.

Ordering, all explicit: a set is refilled only after the last call that read it has finished
(`guard`: one of that call's results, waited for), and a partition's call is launched only after
its copies have landed (`wait`, a host-side wait on the copy stream, which by then has had a
partition's compute time to finish). Partitions of one layout (a layer's experts) share the two
sets: the device holds two partitions' weights, not all of them.
"""

from __future__ import annotations

import numpy as np

from . import cuda_rt
from .device import load_jax, zeros_all


class WeightPool:
    def __init__(self, device, transfers) -> None:
        self.device, self.transfers = device, transfers       # cuda_rt.Transfers of the device's partitions
        self.sets: dict[tuple, list[list]] = {}       # layout -> two lists of device arrays
        self.turn: dict[tuple, int] = {}
        self.guards: dict[tuple, object] = {}          # (layout, set) -> a result of its last reader
        self.stream = None
        self.bytes = 0                                 # bytes copied (all fills)

    def fill(self, host: dict[str, dict[str, np.ndarray]]) -> tuple[dict, tuple]:
        """Queue copies of `host` (by weight, then array; C-contiguous) into the next set of its
        layout. Returns (the params dict over that set, the set's key for `guard`)."""
        jax = load_jax()
        items = [(name, a, np.ascontiguousarray(v)) for name in sorted(host) for a, v in sorted(host[name].items())]
        layout = tuple((v.shape, v.dtype.str) for _, _, v in items)
        sets = self.sets.get(layout)
        if sets is None:
            sets = self.sets[layout] = [zeros_all([(v.shape, v.dtype) for _, _, v in items], self.device)
                                        for _ in range(2)]
            jax.block_until_ready(sets)
        k = self.turn.get(layout, 0)
        self.turn[layout] = 1 - k
        guard = self.guards.pop((layout, k), None)
        if guard is not None:
            jax.block_until_ready(guard)
        if self.transfers.cuda and self.stream is None:
            self.stream = cuda_rt.copy_stream(self.device)
        for (_, _, v), d in zip(items, sets[k]):
            if self.stream is not None:
                cuda_rt.copy_async(d.unsafe_buffer_pointer(), v.ctypes.data, v.nbytes, self.stream.value)
            else:       # raw copies on JAX's CPU platform (the raw_copy setting's "host": tests)
                cuda_rt.to_device(v, d)
            self.bytes += v.nbytes
        params: dict = {name: {} for name in host}
        for (name, a, _), d in zip(items, sets[k]):
            params[name][a] = d
        return params, (layout, k)

    def wait(self) -> None:
        """Until every queued copy has landed."""
        if self.stream is not None:
            cuda_rt.stream_sync(self.stream)

    def guard(self, key: tuple, result) -> None:
        """`result` (of the call that read set `key`) must be ready before the set is refilled."""
        self.guards[key] = result
