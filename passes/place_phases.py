"""The placement's two phases: decode as placed, and a prefill of T tokens as placed or streamed.

A long prompt multiplies each expert's work by its tokens while its weights are read once, so from
some length on it pays to copy the CPU-placed experts' weights to the GPU layer by layer and
compute them there, as the runtime does (runtime/partitions.py MixedExecutor._streamed_parts): the
next streamed layer's upload runs while the GPU computes, and the GPU waits only where the upload
takes longer than the work between two streamed layers:

    streamed(T) = timeline(T, the placed GPU units + the streamed experts)
                  + max(0, up(l_1) - t(before l_1)) + sum_i max(0, up(l_i+1) - t(l_i .. l_i+1))

up(l): layer l's streamed weight bytes at the pinned host->device rate (the runtime's raw
copies from page-locked memory, backends/xla/streaming.py); t: the streamed timeline's per-layer
times. The CPU cores stay as placed. The
break-even is the smallest prompt from which streamed(T) beats the placement as it is; it goes
into the placement record (`phases.prefill.stream_from_tokens`), which the runtime reads through
strata_compiler/prefill_streaming.py.
"""

from __future__ import annotations

from itertools import groupby
from typing import Callable

from strata_compiler.experts import mesh_devices
from strata_compiler.ir import Graph, Op

SEARCH = (16, 16384)        # prompt lengths the break-even is searched over: powers of two, then bisection
PRECISION = 32              # ... to within 1/PRECISION of itself (each step prices the whole model again)
REPORTED = (512, 4096)      # prompt lengths whose two predictions the record shows


def streamed_layers(placed: Graph) -> set[int]:
    """Layers whose CPU-placed experts the runtime streams: their moe_ffn (or CPU share) lies in
    a run of consecutive CPU ops (one CPU partition) without attention, the step's input or an
    expert cache. None in a plan without GPU ops, or one that runs as a mesh."""
    if mesh_devices(placed) or not any(n.device.startswith("gpu") for n in placed.nodes):
        return set()
    out, layer = set(), -1
    for on_cpu, run in groupby(placed.nodes, key=lambda n: n.device == "cpu"):
        run = list(run)
        moe = set()
        for n in run:
            if n.op is Op.FUSED_ATTENTION:
                layer = int(n.attr("layer"))
            elif n.op is Op.MOE_FFN:
                moe.add(layer)
        if on_cpu and not any(n.op in (Op.FUSED_ATTENTION, Op.INPUT_IDS) or n.attr("cache", "") for n in run):
            out |= moe
    return out


def prefill_seconds(tl, gpu: set[str], streamed: set[str], upload: dict[int, float]) -> tuple[float, float | None]:
    """(as placed, streamed) seconds of the prefill `tl` prices (a place._Timeline at T tokens);
    `upload`: seconds to copy each streamed layer's experts. Streamed is None with nothing to stream."""
    placed = tl.predict(gpu)["seconds"]
    if not streamed:
        return placed, None
    on = tl.predict(gpu | streamed)
    per = on["per_layer"]
    layers = sorted(upload)

    def span(a: float, b: float) -> float:
        return sum(t for k, t in per.items() if a <= k < b)

    wait = max(0.0, upload[layers[0]] - span(float("-inf"), layers[0]))
    for a, b in zip(layers, layers[1:]):
        wait += max(0.0, upload[b] - span(a, b))
    return placed, on["seconds"] + wait


def break_even(price: Callable[[int], tuple[float, float | None]]) -> int | None:
    """The smallest prompt length in SEARCH from which price(T)'s streamed time is below its time
    as placed (powers of two, then bisection between the last two, to within 1/PRECISION); None if
    none is."""
    lo, T = None, SEARCH[0]
    while T <= SEARCH[1]:
        placed, streamed = price(T)
        if streamed is not None and streamed < placed:
            break
        lo, T = T, T * 2
    else:
        return None
    hi = T
    while lo is not None and hi - lo > max(1, lo // PRECISION):
        mid = (lo + hi) // 2
        placed, streamed = price(mid)
        lo, hi = (lo, mid) if streamed is not None and streamed < placed else (mid, hi)
    return hi


def phases(summary: dict, placed: Graph, units: list, timeline_at: Callable[[int], object], gpu: set[str],
           hw) -> dict:
    """The record's `phases`: decode as the summary predicts it, and the prefill's break-even with
    both predictions at REPORTED lengths. `units`: place.Unit (their bytes); `timeline_at(T)`: the
    place._Timeline of a T-token prefill."""
    layers = streamed_layers(placed)
    streamed = {u.name for u in units if u.expert and u.name not in gpu and u.layer in layers}
    nbytes: dict[int, int] = {}
    for u in units:
        if u.name in streamed:
            nbytes[u.layer] = nbytes.get(u.layer, 0) + u.gpu_bytes
    upload = {k: hw.h2d_seconds(b) for k, b in nbytes.items()}
    memo: dict[int, tuple[float, float | None]] = {}

    def price(T: int) -> tuple[float, float | None]:
        if T not in memo:
            memo[T] = prefill_seconds(timeline_at(T), gpu, streamed, upload)
        return memo[T]

    predicted = {}
    for T in REPORTED:
        placed_s, streamed_s = price(T)
        predicted[str(T)] = {"as_placed_tok_s": round(T / placed_s, 1),
                             "streamed_tok_s": round(T / streamed_s, 1) if streamed_s else None}
    return {
        "decode": {k: summary[k] for k in ("predicted_tok_s", "gpu_bytes", "host_bytes", "disk_bytes")},
        "prefill": {"stream_from_tokens": break_even(price) if streamed else None,
                    "streamed_bytes": sum(nbytes.values()), "streamed_experts": len(streamed),
                    "predicted": predicted},
    }
