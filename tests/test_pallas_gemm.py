"""The many-token MoE kernels (backends/xla/pallas_gemm.py) in Pallas interpret mode on the CPU:
against NumPy over the formats' own dequantization (x, weights and h rounded to bf16 as the kernels
feed the tensor cores; f32 products where the plan computes in f32), ragged shapes, int4/int8;
`align`'s blocks; and a tiny model's prefill logits with the kernels forced against XLA's path."""

from __future__ import annotations

import numpy as np
import pytest

from strata_compiler.formats import get_format
from strata_compiler.ir import WeightSpec

jax = pytest.importorskip("jax")
jnp = jax.numpy

from strata_compiler import settings  # noqa: E402
from strata_compiler.backends.xla import pallas_gemm  # noqa: E402

from test_pallas_moe import pow2_blocks  # noqa: E402


@pytest.fixture(autouse=True)
def _pow2(monkeypatch):
    pow2_blocks(monkeypatch)


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


def _weight(shape, fmt, G, seed):
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) / np.sqrt(shape[-1])
    f = get_format(fmt)
    a = f.quantize(w, G)
    return WeightSpec("w", tuple(shape), (), shape[0] if len(shape) == 3 else 0, fmt, G), a, \
        f.dequantize(a, shape[-1], G)


def test_align_blocks():
    ids = jnp.asarray([3, 0, 3, 3, 1, 0, 3], jnp.int32)
    slot, pair_of, e_of = (np.asarray(t) for t in pallas_gemm.align(ids, 4, 2))
    P = 7
    assert sorted(slot.tolist()) == sorted(set(slot.tolist()))          # one slot per pair
    assert all(pair_of[slot[p]] == p for p in range(P))
    for p in range(P):
        assert e_of[slot[p] // 2] == int(ids[p])                         # a pair's block is its expert's
    used = {s // 2 for s in slot}
    assert all(e_of[b] == -1 for b in range(len(e_of)) if b not in used)
    assert all(pair_of[s] == P for s in range(len(pair_of)) if s not in set(slot.tolist()))


@pytest.mark.parametrize("first", [False, True], ids=["in-registers", "dequantized-first"])
@pytest.mark.parametrize("fmt,G,M,k", [("int4", 32, 24, 2), ("int8", 32, 9, 3), ("int4", 64, 33, 2), ("int4a", 32, 17, 2)])
def test_moe_matches_numpy(fmt, G, M, k, first, monkeypatch):
    """Both forms: weight tiles dequantized in registers, and (from DEQUANT_FIRST_TOKENS tokens)
    the experts dequantized to bf16 first, then plain tiles (D, I not multiples of the tiles)."""
    monkeypatch.setattr(pallas_gemm, "DEQUANT_FIRST_TOKENS", 1 if first else 1 << 30)
    E, D, I = 5, 96, 80
    gs, ga, gw = _weight((E, 2 * I, D), fmt, G, 3)
    ds, da, dw = _weight((E, D, I), fmt, G, 4)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((M, D)).astype(np.float32)
    topi = np.stack([rng.choice(E, k, replace=False) for _ in range(M)]).astype(np.int32)
    topw = rng.random((M, k)).astype(np.float32)
    with settings.override(pallas_gemm_tune=(16, 32, 2, 4, 1), pallas_gemm_bf16_tune=(16, 32, 2, 4, 1)):
        y = np.asarray(pallas_gemm.moe(jnp.asarray(x), jnp.asarray(topi), jnp.asarray(topw), gs,
                                       {n: jnp.asarray(v) for n, v in ga.items()}, ds,
                                       {n: jnp.asarray(v) for n, v in da.items()}, interpret=True))
    ref = np.zeros((M, D), np.float32)
    for m in range(M):
        for j in range(k):
            e = topi[m, j]
            hg = _bf16(x[m]) @ gw[e].T
            h = hg[:I] / (1 + np.exp(-hg[:I])) * hg[I:]
            ref[m] += topw[m, j] * (_bf16(h) @ dw[e].T)
    assert np.abs(y - ref).max() <= 5e-2 * np.abs(ref).std()      # x, w and h each rounded to bf16


@pytest.mark.parametrize("first", [False, True], ids=["in-registers", "dequantized-first"])
def test_moe_f32_products_match_numpy(first, monkeypatch):
    """Where the plan computes in f32 (the CPU), the kernels' products are f32: the exact result
    to f32 rounding."""
    monkeypatch.setattr(pallas_gemm, "DEQUANT_FIRST_TOKENS", 1 if first else 1 << 30)
    E, D, I, M, k, G = 4, 64, 96, 20, 2, 32
    gs, ga, gw = _weight((E, 2 * I, D), "int4", G, 6)
    ds, da, dw = _weight((E, D, I), "int4", G, 7)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((M, D)).astype(np.float32)
    topi = np.stack([rng.choice(E, k, replace=False) for _ in range(M)]).astype(np.int32)
    topw = rng.random((M, k)).astype(np.float32)
    y = np.asarray(pallas_gemm.moe(jnp.asarray(x), jnp.asarray(topi), jnp.asarray(topw), gs,
                                   {n: jnp.asarray(v) for n, v in ga.items()}, ds,
                                   {n: jnp.asarray(v) for n, v in da.items()}, dtype="float32", interpret=True))
    ref = np.zeros((M, D))
    for m in range(M):
        for j in range(k):
            hg = x[m].astype(np.float64) @ gw[topi[m, j]].T
            h = hg[:I] / (1 + np.exp(-hg[:I])) * hg[I:]
            ref[m] += topw[m, j] * (h @ dw[topi[m, j]].T)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).std()


def test_model_prefill_with_kernels_matches_xla(tmp_path, monkeypatch):
    """A tiny int4 OLMoE's prefill of 40 tokens x 2 rows (80 > the decode kernels' 16) with the
    kernels forced (interpret) gives the XLA path's logits to f32 rounding and takes the kernels
    (the MoE's and the flash attention's)."""
    from hf_models import build_model
    from strata_compiler.cli import stratac
    from strata_compiler.cli_common import run_cli
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.session import Session

    d = build_model("olmoe", tmp_path / "model")
    assert run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "p"), "--quant", "int4"]) == 0
    plan = load_plan(tmp_path / "p")
    ids = np.random.default_rng(0).integers(0, 100, (2, 40))
    calls = []
    real = pallas_gemm.moe
    monkeypatch.setattr(pallas_gemm, "moe", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    from strata_compiler.backends.xla import pallas_flash

    flash, real_flash = [], pallas_flash.attention
    monkeypatch.setattr(pallas_flash, "attention", lambda *a, **kw: flash.append(a) or real_flash(*a, **kw))
    out = {}
    for mode in ("off", "interpret"):
        monkeypatch.setenv("STRATA_PALLAS", mode)
        s = Session(plan, "xla")
        s.reset(2, 64)
        out[mode] = s.step(ids)
    assert calls and all(kw["interpret"] and kw["dtype"] == "float32" for kw in calls)
    assert flash        # the prefill's attention took the flash kernel too
    assert np.abs(out["interpret"] - out["off"]).max() <= 1e-4 * out["off"].std()


def test_dequantized_first_only_within_its_bytes(monkeypatch):
    """From DEQUANT_FIRST_TOKENS tokens the experts are dequantized first, unless their bf16 copy
    would pass DEQUANT_FIRST_BYTES: then the register form runs."""
    E, D, I, M, k = 4, 64, 96, 20, 2
    gs, ga, _ = _weight((E, 2 * I, D), "int4", 32, 6)
    ds, da, _ = _weight((E, D, I), "int4", 32, 7)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((M, D)).astype(np.float32))
    topi = jnp.asarray(np.tile(np.arange(k, dtype=np.int32), (M, 1)))
    topw = jnp.ones((M, k), jnp.float32)
    monkeypatch.setattr(pallas_gemm, "DEQUANT_FIRST_TOKENS", 1)
    forms = []
    monkeypatch.setattr(pallas_gemm, "tuning", lambda rows, dequantized=False: forms.append(dequantized) or (16, 32, 2, 4, 1))
    args = (x, topi, topw, gs, {n: jnp.asarray(v) for n, v in ga.items()}, ds, {n: jnp.asarray(v) for n, v in da.items()})
    a = pallas_gemm.moe(*args, interpret=True)
    monkeypatch.setattr(pallas_gemm, "DEQUANT_FIRST_BYTES", 2 * (E * 2 * I * D + E * D * I) - 1)
    b = pallas_gemm.moe(*args, interpret=True)
    assert forms == [True, False]
    assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 5e-2 * np.asarray(b).std()
