"""The execution contract: what the runtime may ask of an executor, whatever the backend.

Every executor of a whole plan (the reference, llvm and xla backends' and the runtime's mixed one)
derives from `Executor`: one `run` signature, and the optional abilities as methods whose
defaults say "not here", so the runtime asks `executor.caps()` and calls methods instead of
probing attributes. `Caps` is fixed once the executor is built (its device and partitions are).
The core defines the contract; backends implement it; the runtime drives it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from .kv_cache import KVCache
    from .sampling import Sampling


@dataclass(frozen=True, slots=True)
class Caps:
    """What an executor does beyond running a step on the host's arrays."""
    # run(last_only=True) brings only the last token's outputs to the host
    fetches_last: bool = False
    # a prefill step runs on a GPU: the session gives it longer steps
    prefills_on_gpu: bool = False
    # ... and its attention is the flash kernel (no [step, cache] scores in memory)
    flash_prefill: bool = False


@dataclass(frozen=True, slots=True)
class Segment:
    """Which part of a shared step a partition runs (Partition.run_segment): every node at the
    step's length, or at T_pad (a prefill's bucket: the xla backend compiles a program per bucket,
    not per prompt length; a CPU backend runs at the step's own length), or only its nodes
    [lo, hi) (a segment run in two parts around a GPU's work: the llvm backend's host calls)."""
    T_pad: int | None = None
    lo: int = 0
    hi: int | None = None


WHOLE = Segment()


class Partition(Protocol):
    """A backend's executor of some of a plan's nodes (a mixed plan's partition): it runs them in a
    step that other partitions share, reading their operands from `env` (node id -> value, on the
    host or its device) and writing its results there."""

    def run_segment(self, env: dict, input_ids: np.ndarray, cache: KVCache, seg: Segment = WHOLE) -> None: ...


@dataclass(frozen=True)
class AheadSampling:
    """How decode_ahead / batch_step choose tokens when not plain greedy: the settings
    (runtime/sampler.py's rules; batch_step: one per row, None for greedy), one uniform draw per
    step and row from the host's generator (f64 [n, B], so a seed gives the same stream as
    sampling on the host) and each row's last tokens seen, oldest first (i64 [B, W], -1 where
    fewer; W = the repetition penalty's window, 0 without one)."""
    settings: Sampling | tuple[Sampling | None, ...]
    uniforms: np.ndarray
    history: np.ndarray


class Executor:
    """Base of every whole-plan executor. `run` is the one required method; the rest are the
    optional abilities, answered "no" (or done on the host) here."""

    def caps(self) -> Caps:
        return Caps()

    def run(self, input_ids: np.ndarray, cache: KVCache, last_only: bool = False) -> dict[int, np.ndarray]:
        """One step of ids i64[B, T] at the cache's position: every output [B, T, ...], or with
        `last_only` and `caps().fetches_last` the last token's [B, 1, ...] (without it the caller
        slices)."""
        raise NotImplementedError

    def load_row(self, cache: KVCache, slot: int, src: KVCache, row: int = 0) -> None:
        """Row `row` of `src` (a sequence prefilled in a cache of its own) into row `slot` of
        `cache`, wherever the executor keeps their layers; here, host arrays."""
        cache.load_row(slot, src, row)

    def can_decode_ahead(self, B: int, cache: KVCache, sampling: Sampling | None = None) -> bool:
        """Whether `decode_ahead` may run the next decode steps of batch B: greedy (sampling None),
        else choosing tokens by `sampling` where it computes them."""
        return False

    def decode_ahead(self, tok: np.ndarray, cache: KVCache, n: int, stop_ids=(), done=None,
                     sampling: AheadSampling | None = None, on_token=None) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} does not decode ahead (check can_decode_ahead)")

    def samples(self, settings: Sampling) -> bool:
        """Whether this executor chooses tokens sampled by `settings` where it computes the logits
        (decode_ahead and batch_step take an AheadSampling then)."""
        return False

    def kv_room(self) -> int | None:
        """Bytes free on the accelerator that holds the KV cache (what a default context may take
        a share of), None where the cache lives in host memory."""
        return None

    def can_batch_step(self) -> bool:
        """Whether `batch_step` may run the server's continuous-batching decode steps."""
        return False
