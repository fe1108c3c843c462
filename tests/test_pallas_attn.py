"""The Pallas decode-attention kernel (backends/xla/pallas_attn.py) in Pallas interpret mode on the
CPU: against a NumPy reference (norm modes, GQA, a cache not a multiple of the block, positions
in the first, a middle and the last block, clip, batch > 1, the in-place cache write), and tiny
models' decode logits and greedy tokens with the kernel forced (STRATA_PALLAS=interpret)
against the XLA path."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from strata_compiler.backends.xla import pallas_attn  # noqa: E402


@pytest.fixture(autouse=True)
def _pow2(monkeypatch):
    from test_pallas_moe import pow2_blocks

    pow2_blocks(monkeypatch)


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _reference(qkv, pos, K, V, H, KV, hd, norm, qn, kn, eps, clip, inv):
    """out [B, H hd], K, V after writing row pos; float64."""
    B = qkv.shape[0]
    qkv = qkv.astype(np.float64)
    q, k, v = qkv[:, :H * hd], qkv[:, H * hd:(H + KV) * hd], qkv[:, (H + KV) * hd:]
    if norm == "full":
        q, k = _rms(q, qn, eps), _rms(k, kn, eps)
    elif norm == "head":
        q = _rms(q.reshape(B, H, hd), qn, eps).reshape(B, -1)
        k = _rms(k.reshape(B, KV, hd), kn, eps).reshape(B, -1)
    if clip is not None:
        q, k, v = (np.clip(t, -clip, clip) for t in (q, k, v))
    ang = pos * inv.astype(np.float64)
    cos, sin = np.concatenate([np.cos(ang)] * 2), np.concatenate([np.sin(ang)] * 2)

    def rope(x):
        half = hd // 2
        return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin

    q, k = rope(q.reshape(B, H, hd)), rope(k.reshape(B, KV, hd))
    K, V = K.astype(np.float64).copy(), V.astype(np.float64).copy()
    K[:, :, pos], V[:, :, pos] = k, v.reshape(B, KV, hd)
    rep = H // KV
    out = np.zeros((B, H, hd))
    for b in range(B):
        for h in range(H):
            s = K[b, h // rep, :pos + 1] @ q[b, h] / np.sqrt(hd)
            p = np.exp(s - s.max())
            out[b, h] = p @ V[b, h // rep, :pos + 1] / p.sum()
    return out.reshape(B, -1), K, V


@pytest.mark.parametrize("norm,H,KV,S,pos,B,clip,tune", [
    ("none", 4, 4, 64, 0, 1, None, None),
    ("full", 4, 2, 150, 70, 2, None, None),       # GQA, S not a multiple of the block, pos in block 2
    ("head", 8, 2, 150, 149, 1, None, None),      # the last row of a ragged last block
    ("full", 3, 3, 96, 63, 1, 0.7, None),         # H not a power of two (masked norm loads), clip
    ("head", 2, 1, 200, 130, 3, None, None),
    ("full", 4, 2, 150, 70, 2, None, "32,2,256"),  # STRATA_PALLAS_ATTN_TUNE: 32-row blocks, pos in block 3
    ("head", 4, 2, 150, 70, 2, None, "16,2,4"),    # one chunk of 160 rows per head: a loop of 5 blocks
    ("full", 4, 2, 150, 70, 2, 0.5, "32,2,8"),     # chunks of 96 rows: pos in the first, the second empty
    ("none", 2, 2, 300, 299, 1, None, "32,2,4"),   # chunks of 160: pos the last row of the second
])
def test_kernel_matches_reference(norm, H, KV, S, pos, B, clip, tune, monkeypatch):
    if tune:
        monkeypatch.setenv("STRATA_PALLAS_ATTN_TUNE", tune)
    hd, eps = 16, 1e-5
    rng = np.random.default_rng(pos + S)
    qkv = rng.standard_normal((B, (H + 2 * KV) * hd)).astype(np.float32)
    K = rng.standard_normal((B, KV, S, hd)).astype(np.float32)
    V = rng.standard_normal((B, KV, S, hd)).astype(np.float32)
    n = {"head": (hd, hd), "full": (H * hd, KV * hd)}.get(norm)
    qn = kn = None
    if n:
        qn = (1 + 0.3 * rng.standard_normal(n[0])).astype(np.float32)
        kn = (1 + 0.3 * rng.standard_normal(n[1])).astype(np.float32)
    inv = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    want, wK, wV = _reference(qkv, pos, K, V, H, KV, hd, norm, qn, kn, eps, clip, inv)
    out, K2, V2 = pallas_attn.attention_decode(
        jnp.asarray(qkv), jnp.int32(pos), jnp.asarray(K), jnp.asarray(V), H=H, KV=KV, hd=hd, norm=norm,
        q_norm=None if qn is None else jnp.asarray(qn), k_norm=None if kn is None else jnp.asarray(kn),
        eps=eps, clip=clip, inv_freq=inv, interpret=True)
    assert np.abs(np.asarray(out) - want).max() <= 1e-5 * max(1.0, np.abs(want).max())
    np.testing.assert_allclose(np.asarray(K2), wK, atol=1e-5)
    np.testing.assert_allclose(np.asarray(V2), wV, atol=1e-6)


def test_kernel_on_the_first_rows_of_a_larger_cache():
    """A server's step runs rows [0, B) of a batch cache of Bc > B rows: the same results for those
    rows, the other rows untouched."""
    H, KV, hd, S, B, Bc = 4, 2, 16, 96, 2, 4
    rng = np.random.default_rng(7)
    qkv = rng.standard_normal((B, (H + 2 * KV) * hd)).astype(np.float32)
    K = rng.standard_normal((Bc, KV, S, hd)).astype(np.float32)
    V = rng.standard_normal((Bc, KV, S, hd)).astype(np.float32)
    pos = np.array([40, 3], np.int32)
    inv = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    kw = dict(H=H, KV=KV, hd=hd, norm="none", inv_freq=inv, interpret=True)
    small = pallas_attn.attention_decode(jnp.asarray(qkv), jnp.asarray(pos), jnp.asarray(K[:B]), jnp.asarray(V[:B]), **kw)
    big = pallas_attn.attention_decode(jnp.asarray(qkv), jnp.asarray(pos), jnp.asarray(K), jnp.asarray(V), **kw)
    assert np.array_equal(np.asarray(big[0]), np.asarray(small[0]))
    assert np.array_equal(np.asarray(big[1])[:B], np.asarray(small[1])) and np.array_equal(np.asarray(big[1])[B:], K[B:])
    assert np.array_equal(np.asarray(big[2])[B:], V[B:])


def test_use_rules(monkeypatch):
    monkeypatch.delenv("STRATA_PALLAS", raising=False)
    monkeypatch.delenv("STRATA_PALLAS_ATTN", raising=False)
    S = pallas_attn.MAX_S
    assert pallas_attn.use(True, 16, 16, 128, 1, S) == (True, False)       # default: short caches only
    assert pallas_attn.use(True, 16, 16, 128, 1, S + 64) == (False, False)
    assert pallas_attn.use(False, 16, 16, 128, 1, S) == (False, False)     # CPU: the XLA path
    monkeypatch.setenv("STRATA_PALLAS_ATTN", "on")
    assert pallas_attn.use(True, 16, 16, 128, 1, 4 * S) == (True, False)   # forced on
    assert pallas_attn.use(True, 16, 16, 128, 2, S)[0] is False            # prefill: XLA
    assert pallas_attn.use(True, 12, 4, 128, 1, S)[0] is False             # rep 3: not 2^n
    assert pallas_attn.use(True, 16, 16, 96, 1, S)[0] is False             # hd/2 = 48: not 2^n
    monkeypatch.setenv("STRATA_PALLAS_ATTN", "off")
    assert pallas_attn.use(True, 16, 16, 128, 1, 64) == (False, False)
    monkeypatch.setenv("STRATA_PALLAS", "off")
    monkeypatch.setenv("STRATA_PALLAS_ATTN", "on")
    assert pallas_attn.use(True, 16, 16, 128, 1, S) == (False, False)      # no Pallas kernels at all
    monkeypatch.setenv("STRATA_PALLAS", "interpret")
    assert pallas_attn.use(False, 16, 16, 128, 1, S) == (True, True)


@pytest.fixture(scope="module")
def f32_plans(tmp_path_factory):
    from hf_models import build_model
    from strata_compiler.cli import stratac
    from strata_compiler.cli_common import run_cli

    tmp = tmp_path_factory.mktemp("pattn")
    out = {}
    for arch in ("olmoe", "qwen3_moe", "mixtral"):      # full / head / no q-k norm (GQA)
        # the tiny qwen3's head_dim 24 has no kernel (hd/2 = 12): 32 here
        d = build_model(arch, tmp / arch, **({"head_dim": 32} if arch == "qwen3_moe" else {}))
        assert run_cli(stratac, ["compile", str(d), "-o", str(tmp / f"{arch}-plan")]) == 0
        out[arch] = tmp / f"{arch}-plan"
    return out


@pytest.mark.parametrize("arch,batch", [("olmoe", 1), ("qwen3_moe", 2), ("mixtral", 1)])
def test_model_decode_unchanged_with_kernel(f32_plans, monkeypatch, arch, batch):
    from strata_compiler.runtime.plan import load_plan
    from test_pallas_moe import _decode, _spy

    plan = load_plan(f32_plans[arch])
    ids = np.random.default_rng(batch).integers(0, 100, (batch, 5))
    calls = _spy(monkeypatch, pallas_attn, "attention_decode")

    monkeypatch.setenv("STRATA_PALLAS_ATTN", "on")
    # 80 cache rows: two blocks; 66 greedy tokens cross into the second
    want, want_toks = _decode(plan, ids, monkeypatch, "off", capacity=80, n=66)
    assert not calls
    got, got_toks = _decode(plan, ids, monkeypatch, "interpret", capacity=80, n=66)
    assert calls and all(kw["interpret"] for kw in calls)
    assert np.abs(got - want).max() <= 1e-5 * want.std()
    np.testing.assert_array_equal(got_toks, want_toks)


def test_chunk_rows():
    """One 64-row block per program while the blocks are few, whole blocks per chunk after, about
    `programs` programs over B x KV."""
    assert [pallas_attn.chunk_rows(1, 16, S, 64, 256) for S in (64, 192, 1024, 1216, 4096)] == [64, 64, 64, 128, 256]
    assert pallas_attn.chunk_rows(4, 16, 4096, 64, 256) == 1024            # 4 chunks per head
    assert pallas_attn.chunk_rows(1, 1, 100, 64, 256) == 64                # never fewer rows than a block
