"""Decode attention of one layer as one Pallas (Triton) kernel: q/k norms, RoPE, the KV-cache
write and softmax(q K^T / sqrt(hd)) V in a single launch.

At batch-1 decode the XLA lowering of a layer's attention is about six small kernels (the RoPE
concatenations, two cache updates, the scores, softmax times V) whose launches and tails, not
their bytes, bound the step. Here, one kernel per layer:

  grid (B, KV): one program per sequence and KV head (its `rep` = H / KV query heads):
    load the head's q rows, k and v from the fused qkv projection; apply the q/k RMS norm
    ('head': over each head; 'full': over the whole projection, read by every program) and the
    clip; rotate-half RoPE at position `pos`; write k and v into the cache row `pos` (the cache
    arrays are aliased to the outputs: updated in place); then, over cache blocks of BS rows up
    to `pos` (a loop whose trip count depends on `pos`), scores, an online softmax and the
    weighted sum of V — the row at `pos` taken from registers, not read back.

The head dim is handled as its two rotate-half halves [2, hd/2] (a free reshape), so RoPE needs
no shuffle. Sums are f32, as the XLA path. Triton needs power-of-two blocks: hd/2 and rep must be
powers of two (else `supported` says no and the caller keeps its XLA path); the head counts read
for a 'full' norm are padded and masked. On the CPU the kernel runs in Pallas interpret mode
(tests).

Legend: B batch, H/KV query/KV heads, hd head dim, rep = H/KV, S cache capacity, BS cache rows
per loop step.
"""

from __future__ import annotations

import functools
import os

from .pallas_moe import _is_pow2, _load, _pow2, mode

BS = 64            # cache rows per loop step
NUM_WARPS = 4


def enabled() -> bool:
    """STRATA_XLA_PALLAS_ATTN=1 turns the kernel on. Off by default: measured slower than XLA's
    six small kernels on an H200 (OLMoE shape, int4, batch 1, one process, alternated twice:
    950.6 against 1031.8 tok/s), though it runs 8.3 us of device time per layer against their
    ~10: its 16 programs (one per KV head) each run the whole chain serially."""
    return os.environ.get("STRATA_XLA_PALLAS_ATTN", "0").strip().lower() in ("1", "on", "true", "yes")


def supported(H: int, KV: int, hd: int) -> bool:
    return H % KV == 0 and _is_pow2(H // KV) and hd % 2 == 0 and _is_pow2(hd // 2)


def use(on_gpu: bool, H: int, KV: int, hd: int, T: int) -> tuple[bool, bool]:
    """(use the kernel, in interpret mode) for an attention step of T tokens per sequence."""
    m = mode()
    if m in ("0", "off", "false", "no") or not enabled() or T != 1 or not supported(H, KV, hd):
        return False, False
    if m == "interpret":
        return True, True
    return on_gpu, False


def _rms_scale(x2, n: int, eps: float):
    """1 / sqrt(mean(x^2) + eps) over everything in the (masked: zeros) block x2 = x*x of n values."""
    import jax.numpy as jnp

    return 1.0 / jnp.sqrt(x2.sum() / n + eps)


def _attn_kernel(pos_ref, qkv_ref, qn_ref, kn_ref, inv_ref, kc_ref, vc_ref, o_ref, ko_ref, vo_ref, *,
                 H: int, KV: int, hd: int, S: int, norm: str, eps: float, clip, scale: float):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    f32 = jnp.float32
    b, g = pl.program_id(0), pl.program_id(1)
    rep, half = H // KV, hd // 2
    pos = pos_ref[0]
    lo, hi = jnp.int32(0), jnp.int32(1)      # traced: interpret mode masks no python ints
    qr = pl.ds(g * rep, rep)
    q = [qkv_ref[b, qr, lo, :].astype(f32), qkv_ref[b, qr, hi, :].astype(f32)]       # [rep, half] x 2
    k = [qkv_ref[b, H + g, lo, :].astype(f32), qkv_ref[b, H + g, hi, :].astype(f32)]  # [half] x 2
    v = [qkv_ref[b, H + KV + g, lo, :].astype(f32), qkv_ref[b, H + KV + g, hi, :].astype(f32)]
    if norm == "head":
        rq = 1.0 / jnp.sqrt(((q[0] * q[0]).sum(-1) + (q[1] * q[1]).sum(-1)) / hd + eps)     # [rep]
        rk = 1.0 / jnp.sqrt(((k[0] * k[0]).sum() + (k[1] * k[1]).sum()) / hd + eps)
        q = [q[i] * rq[:, None] * qn_ref[ii, :][None, :] for i, ii in ((0, lo), (1, hi))]
        k = [k[i] * rk * kn_ref[ii, :] for i, ii in ((0, lo), (1, hi))]
    elif norm == "full":
        # the whole projection's rms: every program reads all H (KV) heads' values
        HP, KP = _pow2(H), _pow2(KV)
        mq = mk = None
        if HP != H:
            mq = jnp.broadcast_to((jnp.arange(HP) < H)[:, None, None], (HP, 2, half))
        if KP != KV:
            mk = jnp.broadcast_to((jnp.arange(KP) < KV)[:, None, None], (KP, 2, half))
        aq = _load(qkv_ref.at[b, pl.ds(0, HP), :, :], mq).astype(f32)
        ak = _load(qkv_ref.at[b, pl.ds(H, KP), :, :], mk).astype(f32)
        rq, rk = _rms_scale(aq * aq, H * hd, eps), _rms_scale(ak * ak, KV * hd, eps)
        q = [q[i] * rq * qn_ref[qr, ii, :] for i, ii in ((0, lo), (1, hi))]
        k = [k[i] * rk * kn_ref[g, ii, :] for i, ii in ((0, lo), (1, hi))]
    if clip is not None:
        q, k, v = ([jnp.clip(t, -clip, clip) for t in ts] for ts in (q, k, v))
    ang = pos.astype(f32) * inv_ref[...]                                                 # [half]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    q = [q[0] * cos - q[1] * sin, q[1] * cos + q[0] * sin]
    k = [k[0] * cos - k[1] * sin, k[1] * cos + k[0] * sin]
    for i, ii in ((0, lo), (1, hi)):      # the cache row `pos`, in place (aliased)
        ko_ref[b, g, pos, ii, :] = k[i].astype(ko_ref.dtype)
        vo_ref[b, g, pos, ii, :] = v[i].astype(vo_ref.dtype)

    def block(j, carry):
        m, l, acc0, acc1 = carry
        rows = j * BS + jnp.arange(BS)
        rs = pl.ds(j * BS, BS)
        mask = None
        if S % BS:
            mask = jnp.broadcast_to((rows < S)[:, None], (BS, half))
        new = (rows == pos)[:, None]
        kb = [jnp.where(new, k[i][None, :], _load(kc_ref.at[b, g, rs, ii, :], mask).astype(f32))
              for i, ii in ((0, lo), (1, hi))]                                            # [BS, half]
        s = ((q[0][:, None, :] * kb[0][None]).sum(-1) + (q[1][:, None, :] * kb[1][None]).sum(-1)) * scale
        s = jnp.where((rows <= pos)[None, :], s, -jnp.inf)                                # [rep, BS]
        m2 = jnp.maximum(m, s.max(-1))
        alpha = jnp.exp(m - m2)
        p = jnp.exp(s - m2[:, None])
        vb = [jnp.where(new, v[i][None, :], _load(vc_ref.at[b, g, rs, ii, :], mask).astype(f32))
              for i, ii in ((0, lo), (1, hi))]
        acc0 = acc0 * alpha[:, None] + (p[:, :, None] * vb[0][None]).sum(1)
        acc1 = acc1 * alpha[:, None] + (p[:, :, None] * vb[1][None]).sum(1)
        return m2, l * alpha + p.sum(-1), acc0, acc1

    init = (jnp.full((rep,), -jnp.inf, f32), jnp.zeros((rep,), f32),
            jnp.zeros((rep, half), f32), jnp.zeros((rep, half), f32))
    _, l, acc0, acc1 = jax.lax.fori_loop(0, pos // BS + 1, block, init)
    o_ref[b, qr, lo, :] = acc0 / l[:, None]
    o_ref[b, qr, hi, :] = acc1 / l[:, None]


@functools.lru_cache(maxsize=None)
def _call(B: int, H: int, KV: int, hd: int, S: int, norm: str, eps: float, clip, kv_dtype, interpret: bool):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    half = hd // 2
    kernel = functools.partial(_attn_kernel, H=H, KV=KV, hd=hd, S=S, norm=norm, eps=eps, clip=clip,
                               scale=float(1.0 / np.sqrt(hd)))
    cache = jax.ShapeDtypeStruct((B, KV, S, 2, half), kv_dtype)
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1))
    return pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((B, H, 2, half), jnp.float32), cache, cache),
        grid=(B, KV), input_output_aliases={5: 1, 6: 2}, interpret=interpret, name="strata_decode_attention",
        **params)


def attention_decode(qkv, pos, K, V, *, H: int, KV: int, hd: int, norm: str = "none", q_norm=None, k_norm=None,
                     eps: float = 1e-6, clip=None, inv_freq, interpret: bool = False):
    """One decode step (one token per sequence) of attention over the cache, with its write.

    qkv f32[B, (H + 2 KV) hd] (q heads, then k, then v); pos int32 scalar (the new token's
    position, the same for every sequence); K, V [B, KV, S, hd] (the cache: the new row is
    written at pos); q_norm/k_norm the norm weights ([hd] for 'head', [H hd]/[KV hd] for
    'full'); inv_freq f32[hd/2] (RoPE). Returns (out f32[B, H hd], K, V)."""
    import jax.numpy as jnp

    B = qkv.shape[0]
    S = K.shape[2]
    half = hd // 2
    f32 = jnp.float32
    qkv = qkv.astype(f32).reshape(B, H + 2 * KV, 2, half)
    one = jnp.ones((2, half), f32)
    if norm == "head":
        qn, kn = q_norm.astype(f32).reshape(2, half), k_norm.astype(f32).reshape(2, half)
    elif norm == "full":
        qn, kn = q_norm.astype(f32).reshape(H, 2, half), k_norm.astype(f32).reshape(KV, 2, half)
    else:
        qn = kn = one
    call = _call(B, H, KV, hd, S, norm, float(eps), None if clip is None else float(clip), jnp.dtype(K.dtype),
                 bool(interpret))
    p = jnp.reshape(pos, (1,)).astype(jnp.int32)
    out, K2, V2 = call(p, qkv, qn, kn, jnp.asarray(inv_freq, f32), K.reshape(B, KV, S, 2, half),
                       V.reshape(B, KV, S, 2, half))
    return out.reshape(B, H * hd), K2.reshape(K.shape), V2.reshape(V.shape)
