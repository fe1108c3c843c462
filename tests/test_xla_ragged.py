"""The xla backend with rows at their own positions (continuous batching, on JAX's CPU platform):
a decode step of rows at ragged positions gives each row's logits as when stepped alone (rows
assembled on the host, or on the device by XLAExecutor.load_row, with the XLA attention and the
Pallas kernel in interpret mode); the Pallas decode attention at ragged positions against NumPy;
the device's greedy loops from a ragged cache; and a mixed plan (layers on llvm and on xla)
decoding ragged rows partition by partition, then as one fused program."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from strata_compiler.backends.xla import pallas_attn  # noqa: E402
from strata_compiler.cli import stratac  # noqa: E402
from strata_compiler.cli_common import run_cli  # noqa: E402
from strata_compiler.errors import UsageError  # noqa: E402
from strata_compiler.kv_cache import KVCache  # noqa: E402
from strata_compiler.runtime.plan import load_plan  # noqa: E402
from strata_compiler.runtime.session import Session  # noqa: E402
from test_pallas_attn import _reference  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "examples" / "models" / "tiny-moe"
LENGTHS = (5, 9, 3)        # the prompts' lengths: rows at positions 5, 9, 3 after their prefills
CAP = 64


@pytest.fixture(scope="module")
def f32_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("ragged") / "f32"
    assert run_cli(stratac, ["compile", str(TINY), "-o", str(out), "--quant", "f32"]) == 0
    return load_plan(out)


def _prompts(plan):
    rng = np.random.default_rng(0)
    return [rng.integers(0, plan.meta["model"]["vocab_size"], n) for n in LENGTHS]


def _alone(s: Session, prompts, tokens, capacity: int = CAP):
    """Each prompt on its own (B = 1): the logits of decode steps of `tokens` after its prefill
    [len(tokens), V], and its cache right after the prefill (a fresh one, never stepped further)."""
    logits, caches = [], []
    for pr in prompts:
        s.reset(1, capacity)
        s.step(pr[None])
        logits.append(np.stack([s.step(np.array([[t]]))[0, -1] for t in tokens]))
        s.reset(1, capacity)
        s.step(pr[None])
        caches.append(s.cache)
    return logits, caches


def _batch(plan, B: int = len(LENGTHS)) -> KVCache:
    m = plan.meta["model"]
    return KVCache(m["n_layers"], B, m["n_kv_heads"], m["head_dim"], CAP)


def _close(got, want) -> None:
    assert np.abs(got - want).max() <= 1e-4 * want.std()


@pytest.mark.parametrize("pallas", ["off", "interpret"])
@pytest.mark.parametrize("assemble", ["host", "device"])
def test_ragged_decode_gives_each_rows_logits_alone(f32_plan, monkeypatch, pallas, assemble):
    """Three prompts prefilled alone, then B = 3 decode steps at ragged positions [5, 9, 3] + t:
    each row's logits as stepped alone. The batch cache is assembled on the host (KVCache.load_row:
    the executor puts the rows on the device at the first step) or on the device (load_row: rows
    from a device cache, a host cache and a cache of another capacity). Then slot 2 takes a new
    sequence (load_row into the live batch) and the other rows go on undisturbed."""
    monkeypatch.setenv("STRATA_PALLAS", pallas)
    monkeypatch.setenv("STRATA_PALLAS_ATTN", "on")
    calls = []
    real = pallas_attn.attention_decode
    monkeypatch.setattr(pallas_attn, "attention_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    s = Session(f32_plan, "xla")
    prompts = _prompts(f32_plan)
    want, caches = _alone(s, prompts, (7, 9, 11))
    big = _batch(f32_plan)
    exe = s.executor
    if assemble == "host":
        for i, c in enumerate(caches):
            big.load_row(i, c)
    else:
        m = f32_plan.meta["model"]
        host = KVCache(m["n_layers"], 1, m["n_kv_heads"], m["head_dim"], CAP)
        host.load_row(0, caches[1])                     # NumPy arrays
        s.reset(1, 16)
        s.step(prompts[2][None])                        # a device cache of capacity 16
        short = s.cache
        exe.load_row(big, 0, caches[0])
        exe.load_row(big, 1, host)
        exe.load_row(big, 2, short)
        assert all(isinstance(big.k[l], jax.Array) for l in exe.layers)
        with pytest.raises(UsageError, match="rows"):
            exe.load_row(big, 3, caches[0])
    assert big.lengths.tolist() == list(LENGTHS)
    s.cache = big
    for t, tok in enumerate((7, 9)):
        got = s.step(np.full((3, 1), tok))[:, -1]
        for i in range(3):
            _close(got[i], want[i][t])
    assert big.lengths.tolist() == [n + 2 for n in LENGTHS]
    assert bool(calls) == (pallas == "interpret")
    # continuous batching: slot 2 restarts with prompt 0; rows 0 and 1 take their third step
    exe.load_row(big, 2, caches[0])
    assert big.lengths.tolist() == [LENGTHS[0] + 2, LENGTHS[1] + 2, LENGTHS[0]]
    got = s.step(np.array([[11], [11], [7]]))[:, -1]
    _close(got[0], want[0][2])
    _close(got[1], want[1][2])
    _close(got[2], want[0][0])


@pytest.mark.parametrize("norm,H,KV,S,pos,tune", [
    ("none", 4, 4, 64, (0, 63, 17), None),
    ("full", 4, 2, 150, (70, 0, 149), None),          # S not a multiple of the block; first, middle, last block
    ("head", 8, 2, 150, (149, 3, 64), None),
    ("head", 4, 2, 150, (70, 5, 140), "16,2,4"),       # one chunk of 160 rows per head: loops of 5, 1, 9 blocks
    ("full", 4, 2, 150, (10, 100, 149), "32,2,8"),     # chunks of 96 rows: a row's chunk wholly past its pos
    ("none", 2, 2, 300, (299, 0, 160), "32,2,4"),      # chunks of 160
])
def test_kernel_at_ragged_positions_matches_reference(norm, H, KV, S, pos, tune, monkeypatch):
    """attention_decode (interpret mode) with each row at its own position: the NumPy reference of
    each row alone (its cache row written at its position, attention up to it)."""
    from test_pallas_moe import pow2_blocks

    pow2_blocks(monkeypatch)
    if tune:
        monkeypatch.setenv("STRATA_PALLAS_ATTN_TUNE", tune)
    hd, eps, B = 16, 1e-5, len(pos)
    rng = np.random.default_rng(S + pos[0])
    qkv = rng.standard_normal((B, (H + 2 * KV) * hd)).astype(np.float32)
    K = rng.standard_normal((B, KV, S, hd)).astype(np.float32)
    V = rng.standard_normal((B, KV, S, hd)).astype(np.float32)
    n = {"head": (hd, hd), "full": (H * hd, KV * hd)}.get(norm)
    qn = kn = None
    if n:
        qn = (1 + 0.3 * rng.standard_normal(n[0])).astype(np.float32)
        kn = (1 + 0.3 * rng.standard_normal(n[1])).astype(np.float32)
    inv = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    rows = [_reference(qkv[b:b + 1], pos[b], K[b:b + 1], V[b:b + 1], H, KV, hd, norm, qn, kn, eps, None, inv)
            for b in range(B)]
    want, wK, wV = (np.concatenate([r[i] for r in rows]) for i in range(3))
    out, K2, V2 = pallas_attn.attention_decode(
        jnp.asarray(qkv), jnp.asarray(pos, jnp.int32), jnp.asarray(K), jnp.asarray(V), H=H, KV=KV, hd=hd,
        norm=norm, q_norm=None if qn is None else jnp.asarray(qn), k_norm=None if kn is None else jnp.asarray(kn),
        eps=eps, inv_freq=inv, interpret=True)
    assert np.abs(np.asarray(out) - want).max() <= 1e-5 * max(1.0, np.abs(want).max())
    np.testing.assert_allclose(np.asarray(K2), wK, atol=1e-5)
    np.testing.assert_allclose(np.asarray(V2), wV, atol=1e-6)


@pytest.mark.parametrize("loop", ["greedy_decode", "decode_ahead"])
def test_greedy_loops_from_a_ragged_cache_give_each_rows_tokens(f32_plan, loop):
    """The device's greedy loops (one program of n steps; steps dispatched ahead) from a batch
    cache at ragged positions: each row's tokens as decoded alone, each row n positions on."""
    n = 6
    s = Session(f32_plan, "xla")
    prompts = _prompts(f32_plan)
    firsts, want, caches = [], [], []
    for pr in prompts:
        s.reset(1, CAP)
        first = s.step(pr[None])[:, -1].argmax(-1)
        firsts.append(int(first[0]))
        want.append(s.executor.greedy_decode(first, s.cache, n)[0])
        s.reset(1, CAP)
        s.step(pr[None])
        caches.append(s.cache)
    big = _batch(f32_plan)
    for i, c in enumerate(caches):
        s.executor.load_row(big, i, c)
    got = getattr(s.executor, loop)(np.array(firsts), big, n)
    np.testing.assert_array_equal(got, np.stack(want))
    assert big.lengths.tolist() == [k + n for k in LENGTHS]


def _llvm_takes_row_positions() -> bool:
    """Whether the llvm backend's attention kernels take each row's position (a `pasts` array)."""
    from strata_compiler.backends.llvm_cpu.codegen import attention

    return "pasts" in attention.PREP_PARAMS


@pytest.fixture(scope="module")
def mixed_plan(tmp_path_factory):
    """The tiny model's first layers on the GPU (xla), the others on the CPU (llvm): -ngl."""
    from test_place import _compile, fake_profile, gpu_mem_for, probe_placement

    tmp = tmp_path_factory.mktemp("ragged_mixed")
    hw = fake_profile(tmp / "hw.json")
    probe = probe_placement(TINY, tmp, hw, "--quant", "f32")
    _compile(TINY, tmp / "ngl", hw, gpu_mem_for(probe, probe["gpu_bytes"] * 0.5), "--place-strategy", "ngl",
             "--quant", "f32")
    return load_plan(tmp / "ngl")


@pytest.mark.skipif(not _llvm_takes_row_positions(),
                    reason="the llvm backend's attention still takes one position for all rows (scalar `past`)")
@pytest.mark.parametrize("assemble", ["host", "device"])
def test_mixed_plan_ragged_rows_partition_by_partition_and_fused(mixed_plan, assemble):
    """Layers on llvm and on xla: the batch's first ragged step runs partition by partition, the
    next ones as one fused program (positions packed per row); each row's logits as alone. The
    batch cache assembled on the host, or by MixedExecutor.load_row (xla layers on the device,
    llvm layers by NumPy copies)."""
    kinds = {(n.backend, n.attr("layer")) for n in mixed_plan.graph.nodes if n.op.value == "fused_attention"}
    assert {b for b, _ in kinds} == {"llvm", "xla"}
    s = Session(mixed_plan, "auto", device="cpu")
    exe = s.executor
    assert exe.fused is not None
    prompts = _prompts(mixed_plan)
    want, caches = _alone(s, prompts, (7, 9, 11))
    big = _batch(mixed_plan)
    for i, c in enumerate(caches):
        if assemble == "host":
            big.load_row(i, c)
        else:
            exe.load_row(big, i, c)
    if assemble == "device":
        xla_layers = {l for k, e, _ in exe.parts if k == "xla" for l in e.layers}
        assert xla_layers and all(isinstance(big.k[l], jax.Array) == (l in xla_layers) for l in range(len(big.k)))
    assert big.lengths.tolist() == list(LENGTHS)
    s.cache = big
    steps = exe.fused.steps
    for t, tok in enumerate((7, 9, 11)):
        got = s.step(np.full((3, 1), tok))[:, -1]
        for i in range(3):
            _close(got[i], want[i][t])
    assert exe.fused.steps == steps + 2         # the first B = 3 step sets up the frames
