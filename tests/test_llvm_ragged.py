"""The llvm CPU backend with batch rows at their own positions (continuous batching's decode).

attn_prep / attn_core read each row's position from `pasts` i64[B]: at ragged positions they
must match the reference's RoPE and causal attention (backends/reference/executor.py), and a
session's ragged decode step must give each row the logits it gets when stepped alone.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llvmlite.binding")

from strata_compiler.backends.llvm_cpu.codegen import attention as at  # noqa: E402
from strata_compiler.backends.llvm_cpu.codegen.common import float_slot  # noqa: E402
from strata_compiler.backends.llvm_cpu.jit import KernelLibrary  # noqa: E402
from strata_compiler.backends.llvm_cpu.target import Target  # noqa: E402
from strata_compiler.backends.reference.executor import rms_norm, rope, sdpa  # noqa: E402
from strata_compiler.errors import UsageError  # noqa: E402
from strata_compiler.kv_cache import KVCache  # noqa: E402
from strata_compiler.rope import rope_inv_freq  # noqa: E402
from strata_compiler.runtime.plan import load_plan  # noqa: E402
from strata_compiler.runtime.session import Session  # noqa: E402

KERNEL = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


@pytest.fixture(scope="module")
def lib() -> KernelLibrary:
    return KernelLibrary(Target.host(), use_disk_cache=False)


def call(lib: KernelLibrary, ks, n: int, cuts=(), **args) -> None:
    """Run kernel `ks` over [0, n), split at `cuts` (as the pool does); args by name."""
    vals = [0 if v is None else v.ctypes.data if isinstance(v, np.ndarray) else
            float_slot(v) if isinstance(v, float) else int(v) for v in (args[p] for p in ks.params)]
    slots = (ctypes.c_int64 * len(vals))(*vals)
    fn = KERNEL(lib.address(ks.ir, ks.name))
    bounds = [0, *cuts, n]
    for a, b in zip(bounds, bounds[1:]):
        fn(ctypes.addressof(slots), a, b)


# ------------------------------------------------------------------------------------- kernels

@pytest.mark.parametrize("mode,clip", [("none", None), ("head", 1.5), ("full", None)])
@pytest.mark.parametrize("lengths", [(0, 5, 17), (17, 0, 33), (4, 4, 4)])
def test_kernels_at_ragged_positions(lib, mode, clip, lengths):
    """One decode token per row (B=3, GQA H=4 KV=2) with rows at lengths: q, the cache writes and
    the output as the reference computes them per row; nothing written past a row's new position."""
    B, T, H, KV, hd, cap = 3, 1, 4, 2, 24, 40
    attrs, eps = {"rope_theta": 10000.0}, 1e-6
    rng = np.random.default_rng(sum(lengths))
    W = (H + 2 * KV) * hd
    nw = {"none": (0, 0), "head": (hd, hd), "full": (H * hd, KV * hd)}[mode]
    qnw = (1 + 0.2 * rng.standard_normal(nw[0])).astype(np.float32) if nw[0] else None
    knw = (1 + 0.2 * rng.standard_normal(nw[1])).astype(np.float32) if nw[1] else None
    ref = KVCache(1, B, KV, hd, cap)
    for b, n in enumerate(lengths):      # earlier keys and values of each row, zeros past them
        ref.k[0][b, :, :n] = rng.standard_normal((KV, n, hd)).astype(np.float32) * 2
        ref.v[0][b, :, :n] = rng.standard_normal((KV, n, hd)).astype(np.float32)
    ref.lengths[:] = lengths
    kc, vc = ref.k[0].copy(), ref.v[0].copy()
    qkv_buf = (rng.standard_normal((B * T, W + 3)) * 2).astype(np.float32)

    # the reference: backends/reference/executor.py `_fused_attention`'s steps
    qkv = qkv_buf[:, :W].reshape(B, T, W)
    q, k, v = qkv[..., :H * hd], qkv[..., H * hd:(H + KV) * hd], qkv[..., (H + KV) * hd:]
    if mode != "none":
        group = hd if mode == "head" else 0
        q, k = rms_norm(q, qnw, eps, group), rms_norm(k, knw, eps, group)
    if clip is not None:
        q, k, v = (np.clip(t, -clip, clip) for t in (q, k, v))
    pos = ref.positions(T)[:, None] + np.arange(T)
    q, k = rope(q, pos, hd, attrs), rope(k, pos, hd, attrs)
    want = sdpa(q, k, v, ref, 0, H, KV, hd)

    pasts = np.array(lengths, np.int64)
    qout = np.zeros((B * T, H * hd), np.float32)
    o = np.full((B * T, H * hd + 2), -7.25, np.float32)
    call(lib, at.attn_prep(H, KV, hd, mode, clip is not None, lib.target), B * T, cuts=(1,), qkv=qkv_buf,
         qnw=qnw, knw=knw, qout=qout, kc=kc, vc=vc, T=T, pasts=pasts, cap=cap, ldq=W + 3, eps=eps,
         clip=float(clip or 0.0), inv_freq=rope_inv_freq(hd, attrs))
    call(lib, at.attn_core(H, KV, hd, lib.target), B * H, cuts=(5, 6), qout=qout, kc=kc, vc=vc, o=o, T=T,
         pasts=pasts, cap=cap, ldo=H * hd + 2)
    np.testing.assert_allclose(qout.reshape(B, T, H * hd), q, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kc, ref.k[0], rtol=1e-5, atol=2e-6)      # each row's new key at its own position
    np.testing.assert_array_equal(vc, ref.v[0])
    np.testing.assert_allclose(o[:, :H * hd].reshape(B, T, H * hd), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.all(o[:, H * hd:] == np.float32(-7.25))
    np.testing.assert_array_equal(pasts, lengths)     # read, never written


def test_rope_at_ragged_positions_is_the_reference_rope(lib):
    """attn_prep's q alone (no norm, no clip: the same f32 ops) is exactly rope at each row's position."""
    B, H, KV, hd, cap = 3, 4, 2, 24, 64
    attrs = {"rope_theta": 1e6}
    pasts = np.array([0, 5, 57], np.int64)
    W = (H + 2 * KV) * hd
    qkv = np.random.default_rng(2).standard_normal((B, W)).astype(np.float32)
    qout = np.zeros((B, H * hd), np.float32)
    kc = np.zeros((B, KV, cap, hd), np.float32)
    vc = np.zeros_like(kc)
    call(lib, at.attn_prep(H, KV, hd, "none", False, lib.target), B, qkv=qkv, qnw=None, knw=None, qout=qout,
         kc=kc, vc=vc, T=1, pasts=pasts, cap=cap, ldq=W, eps=1e-6, clip=0.0, inv_freq=rope_inv_freq(hd, attrs))
    want = rope(qkv[:, :H * hd].reshape(B, 1, H * hd), pasts[:, None], hd, attrs)
    np.testing.assert_allclose(qout.reshape(B, 1, H * hd), want, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------ sessions
# (tiny_f32_plan, tiny_int8_plan: examples/models/tiny-moe compiled once, tests/conftest.py)

def ragged_vs_alone(plan_dir: Path, lens=(5, 9, 3), steps: int = 2) -> tuple[float, float]:
    """Prompts of `lens` tokens prefilled alone (B=1), then `steps` decode steps of the three rows
    together at ragged positions: (max |ragged - alone| over rows and steps, std of the logits)."""
    plan = load_plan(str(plan_dir / "plan.bin"))
    s = Session(plan, backend="llvm")
    m = plan.meta["model"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, m["vocab_size"], n) for n in lens]
    nxt = rng.integers(0, m["vocab_size"], (steps, len(lens)))
    alone, caches = [], []
    for i, p in enumerate(prompts):
        s.reset(1, 64)
        s.step(p[None])
        caches.append(s.cache)
        s.reset(1, 64)
        s.step(p[None])
        alone.append([s.step(nxt[j, i].reshape(1, 1))[0, -1] for j in range(steps)])
    big = KVCache(m["n_layers"], len(lens), m["n_kv_heads"], m["head_dim"], 64)
    for i, c in enumerate(caches):
        s.load_row(big, i, c)
    s.cache = big
    err = 0.0
    for j in range(steps):
        lg = s.step(nxt[j][:, None])[:, -1]
        err = max(err, max(float(np.abs(lg[i] - alone[i][j]).max()) for i in range(len(lens))))
    np.testing.assert_array_equal(big.lengths, np.array(lens) + steps)
    return err, float(np.std(alone[0][0]))


def test_session_ragged_decode_f32(tiny_f32_plan):
    err, std = ragged_vs_alone(tiny_f32_plan)
    assert err <= 1e-4 * std, (err, std)


def test_session_ragged_decode_int8(tiny_int8_plan):
    """q8 activations: each row is quantized on its own (per-row blocks), so batching the rows
    should change nothing (the rows come out bit-identical today); the bound is loose all the same."""
    err, std = ragged_vs_alone(tiny_int8_plan)
    assert err <= 1e-3 * std, (err, std)


def test_ragged_prefill_is_refused(tiny_f32_plan):
    """A step of T > 1 tokens at ragged rows is a usage error, not a wrong answer."""
    plan = load_plan(str(tiny_f32_plan / "plan.bin"))
    s = Session(plan, backend="llvm")
    s.reset(2, 32)
    s.cache.lengths[:] = (3, 5)
    with pytest.raises(UsageError, match="one length"):
        s.step(np.zeros((2, 2), np.int64))
