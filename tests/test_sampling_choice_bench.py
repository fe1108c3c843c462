"""benchmarks/sampling_choice.py: its choose_fast (a penalty without a [B, V] scatter, a staged
top-k over chunks, the max and argmax from the top-k) chooses backends/xla/sampling.py's tokens,
checked on the CPU."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("sampling_choice", ROOT / "benchmarks" / "sampling_choice.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sampling_choice", mod)
    spec.loader.exec_module(mod)
    return mod


sc = _load()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_choose_fast_chooses_the_tokens_of_choose(seed):
    """Random rows (ties, -inf, signed zeros, windows with repeats and -1, greedy rows among
    sampled ones; k 1, 40, 64, 1024; chunks with and without further stages): not one token differs."""
    import jax

    out = io.StringIO()
    bad = sc.check([seed], sc.CASES, device=jax.devices("cpu")[0], out=out)
    assert bad == 0, out.getvalue()


def test_the_staged_top_k_is_lax_top_k():
    """Values and ids of top_k_chunked equal lax.top_k's, equal values by id, -inf rows too."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    r = np.random.default_rng(0)
    x = np.round(r.standard_normal((3, 1999)), 0).astype(np.float32)      # few distinct values
    x[2, r.random(1999) < 0.99] = -np.inf
    with jax.default_device(jax.devices("cpu")[0]):
        for k, chunk, fan in ((40, 256, 0), (40, 128, 2), (64, 100, 3), (1, 64, 0), (1024, 512, 0)):
            want = jax.lax.top_k(jnp.asarray(x), k)
            got = sc.top_k_chunked(jnp.asarray(x), k, chunk, fan)
            for a, b in zip(want, got):
                assert np.array_equal(np.asarray(a), np.asarray(b)), (k, chunk, fan)
