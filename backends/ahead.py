"""Decoding ahead: greedy decode steps dispatched before the step before them has finished.

A decode step's ids are the token the step before chose. Where that choice (the argmax) is made
on the device, the next step can be dispatched as soon as the last one is: its ids are a device
value that is not ready yet, and the device runs the two in order. The host's part of a step —
the launch of a program with a few hundred arguments, the expert caches' bookkeeping and copies —
then runs while the device computes the step before, instead of between steps. `run` drives it
for an executor's `launch` / `finish` (runtime/partitions.py MixedExecutor.decode_ahead,
backends/xla/executor.py XLAExecutor.decode_ahead). One step runs past a stop id (its result is
dropped). Under `--stats` alone each step is one span on the steps' and the GPU's tracks: from
its launch, or the step before's result if later, to its result on the host.

It sits at the backends' package level: a whole-plan xla executor drives itself with it, and the
runtime's MixedExecutor drives a fused step with it.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from strata_compiler import trace


def traced_fully() -> bool:
    """Whether a trace file is being written (a step's spans and instants): no decoding ahead then."""
    return trace.ACTIVE is not None and trace.ACTIVE.full


def run(launch: Callable[[Any], Any], finish: Callable[[Any, bool], np.ndarray], n: int, B: int,
        stop_ids=(), done: np.ndarray | None = None, after: Callable[[Any], None] | None = None,
        close: Callable[[], None] | None = None,
        on_token: Callable[[int, np.ndarray], bool] | None = None) -> np.ndarray:
    """n greedy decode steps; their tokens, int64 [B, <= n] (fewer when every sequence has reached
    a stop id, `done` marking those that had before).

    launch(prev): dispatch a step and return it in flight (prev: the step whose token it decodes,
    None for the first, whose ids the executor holds). finish(step, use): wait for it and return
    its tokens, int64 [B] (use=False: a step past the stop, or left by an error: nothing of it is
    kept). after(step): the host's work once a step has finished, while the next is in flight.
    close(): the host's work once nothing is in flight (also after an error). on_token(i, tokens):
    step i's tokens, once read, while more may follow (a streaming caller prints them); True stops
    there as a Ctrl-C does."""
    out = np.zeros((B, n), np.int64)
    done = np.zeros(B, bool) if done is None else done.copy()
    tr = trace.ACTIVE
    t_fin = time.perf_counter_ns()
    cur = launch(None)
    t_launch = [time.perf_counter_ns()]
    made = 0
    try:
        for i in range(n):
            nxt = None
            if i + 1 < n:
                nxt = launch(cur)
                t_launch.append(time.perf_counter_ns())
            out[:, i] = finish(cur, True)
            made = i + 1
            if after is not None:
                after(cur)
            cur = None
            if tr is not None:
                end = time.perf_counter_ns()
                tr.add_span("decode step (ahead)", "step", t_fin, end, cat="step", batch=B, tokens=1)
                tr.add_span("decode step (ahead)", "gpu", max(t_launch[i], t_fin), end, batch=B)
                t_fin = end
            done |= np.isin(out[:, i], stop_ids)
            cur = nxt
            if done.all():
                return out[:, :i + 1]
            if on_token is not None and i + 1 < n and on_token(i, out[:, i]):
                raise KeyboardInterrupt
        return out
    except KeyboardInterrupt as e:      # Ctrl-C: the steps that finished go with it (Session.generate keeps them)
        e.tokens = out[:, :made]
        raise
    finally:
        if cur is not None:
            finish(cur, False)
        if close is not None:
            close()
