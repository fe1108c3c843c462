"""The prefill flash-attention kernel (backends/xla/pallas_flash.py) in Pallas interpret mode on
the CPU: against NumPy's causal softmax over the cache (rows at positions of their own, GQA, a
cache with more rows than the step, several query and key blocks), and when it applies."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from strata_compiler import settings  # noqa: E402
from strata_compiler.backends.xla import pallas_flash  # noqa: E402


def _reference(q, K, V, pos):
    B, T, H, hd = q.shape
    rep = H // K.shape[1]
    out = np.zeros((B, T, H, hd))
    for b in range(B):
        for h in range(H):
            k, v = K[b, h // rep].astype(np.float64), V[b, h // rep].astype(np.float64)
            for t in range(T):
                s = k[:pos[b] + t + 1] @ q[b, t, h] / np.sqrt(hd)
                p = np.exp(s - s.max())
                out[b, t, h] = p @ v[:pos[b] + t + 1] / p.sum()
    return out


@pytest.mark.parametrize("H,KV,T,pos", [(4, 2, 32, (0, 0)), (4, 4, 16, (5, 40)), (8, 2, 64, (3, 0))])
def test_flash_matches_numpy(H, KV, T, pos):
    rng = np.random.default_rng(0)
    B, Bc, S, hd = len(pos), len(pos) + 1, 128, 16
    q = rng.standard_normal((B, T, H, hd)).astype(np.float32)
    K = rng.standard_normal((Bc, KV, S, hd)).astype(np.float32)
    V = rng.standard_normal((Bc, KV, S, hd)).astype(np.float32)
    with settings.override(pallas_flash_tune=(16, 32, 4, 1)):
        assert pallas_flash.use(False, H, KV, hd, T, S) == (False, False)
        with settings.override(pallas="interpret"):
            assert pallas_flash.use(False, H, KV, hd, T, S) == (True, True)
        got = np.asarray(pallas_flash.attention(jnp.asarray(q), jnp.asarray(K), jnp.asarray(V),
                                                jnp.asarray(np.array(pos, np.int32)), jnp.float32, interpret=True))
    want = _reference(q, K, V, pos)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).std()


def test_flash_applies_only_to_power_of_two_steps():
    with settings.override(pallas="interpret", pallas_flash_tune=(16, 32, 4, 1)):
        assert pallas_flash.use(True, 4, 2, 64, 64, 128)[0]
        assert not pallas_flash.use(True, 4, 2, 64, 1, 128)[0]        # decode: its own kernel
        assert not pallas_flash.use(True, 4, 2, 64, 48, 128)[0]       # not a power-of-two step
        assert not pallas_flash.use(True, 4, 2, 64, 64, 100)[0]       # cache rows not whole key blocks
        assert not pallas_flash.use(True, 6, 4, 64, 64, 128)[0]       # heads not grouped evenly
