"""Decode attention of one layer as one Pallas (Triton) kernel: q/k norms, RoPE, the KV-cache
write and softmax(q K^T / sqrt(hd)) V in a single launch.

At batch-1 decode the XLA lowering of a layer's attention is about seven small kernels (the RoPE
concatenations, two cache updates, the scores, softmax times V) whose launches and tails, not
their bytes, bound the step. Here, one kernel and one small combine per layer:

  grid (B, KV, S / C): one program per sequence, KV head (its `rep` = H / KV query heads) and
    chunk of C cache rows (flash-decoding: the cache is split over programs, not walked by one):
    load the head's q rows, k and v from the fused qkv projection; apply the q/k RMS norm
    ('head': over each head; 'full': over the whole projection, read by every program) and the
    clip; rotate-half RoPE at its sequence's position `pos` (pos[b]: each row decodes at a
    position of its own); the program whose chunk holds `pos` writes k and v into that cache row
    (the cache arrays are aliased to the outputs: updated in place); each program then takes
    scores, an online softmax and the weighted sum of V over its chunk's rows up to `pos`, BS
    rows at a time (rows past it masked, not loaded; the row at `pos` from registers, not read
    back), and writes its partial (max, sum, weighted V); a small XLA fusion combines the chunks.
    C is one block for short caches and several for long ones, so that about `programs`
    programs run (`chunk_rows`).

The head dim is handled as its two rotate-half halves [2, hd/2] (a free reshape), so RoPE needs
no shuffle. Sums are f32, as the XLA path. Triton needs power-of-two blocks: hd/2 and rep must be
powers of two (else `supported` says no and the caller keeps its XLA path); the head counts read
for a 'full' norm are padded and masked. On the CPU the kernel runs in Pallas interpret mode
(tests).

Legend: B batch, H/KV query/KV heads, hd head dim, rep = H/KV, S cache capacity, C cache rows
per program, BS rows per loop step.
"""

from __future__ import annotations

import functools

from strata_compiler import settings

from .pallas_quant import _is_pow2, _load, _pow2, gate

# Cache capacities up to which the kernel is the default: above it, its 4-warp programs stream long
# caches less well than XLA's reductions.
MAX_S = 512


def tuning() -> tuple[int, int, int]:
    """Rows per block, warps, programs aimed at (B x KV x chunks)."""
    return settings.get("pallas_attn_tune")


def enabled(S: int) -> bool:
    """The `pallas_attn` setting: auto, the kernel for caches of at most MAX_S rows; on; off."""
    v = settings.get("pallas_attn")
    return v == "on" or (v == "auto" and S <= MAX_S)


def supported(H: int, KV: int, hd: int) -> bool:
    return H % KV == 0 and _is_pow2(H // KV) and hd % 2 == 0 and _is_pow2(hd // 2)


def use(on_gpu: bool, H: int, KV: int, hd: int, T: int, S: int) -> tuple[bool, bool]:
    """(use the kernel, in interpret mode) for an attention step of T tokens per sequence over a
    cache of S rows."""
    return gate(on_gpu, T == 1 and supported(H, KV, hd) and enabled(S))


def _rms_scale(x2, n: int, eps: float):
    """1 / sqrt(mean(x^2) + eps) over everything in the (masked: zeros) block x2 = x*x of n values."""
    import jax.numpy as jnp

    return 1.0 / jnp.sqrt(x2.sum() / n + eps)


def _attn_kernel(pos_ref, qkv_ref, qn_ref, kn_ref, inv_ref, kc_ref, vc_ref, m_ref, l_ref, a_ref, ko_ref, vo_ref, *,
                 H: int, KV: int, hd: int, S: int, norm: str, eps: float, clip, scale: float, BS: int, C: int):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    f32 = jnp.float32
    b, g = pl.program_id(0), pl.program_id(1)
    rep, half = H // KV, hd // 2
    pos = pos_ref[b]                        # this sequence's position (rows are ragged)
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
    j = pl.program_id(2)

    @pl.when(j == pos // C)
    def _():                              # the cache row `pos`, in place (aliased): its chunk's program
        for i, ii in ((0, lo), (1, hi)):
            ko_ref[b, g, pos, ii, :] = k[i].astype(ko_ref.dtype)
            vo_ref[b, g, pos, ii, :] = v[i].astype(vo_ref.dtype)

    def scores(r0):
        """Rows r0 + [0, BS): (valid [BS], scores [rep, BS] (-inf where not valid), V halves)."""
        rows = r0 + jnp.arange(BS)
        rs = pl.ds(r0, BS)
        valid = rows <= pos               # rows past `pos` are masked, not even loaded
        ok = valid & (rows < S) if S % BS else valid
        mask = jnp.broadcast_to(ok[:, None], (BS, half))
        new = (rows == pos)[:, None]
        kb = [jnp.where(new, k[i][None, :], _load(kc_ref.at[b, g, rs, ii, :], mask).astype(f32))
              for i, ii in ((0, lo), (1, hi))]                                            # [BS, half]
        s = ((q[0][:, None, :] * kb[0][None]).sum(-1) + (q[1][:, None, :] * kb[1][None]).sum(-1)) * scale
        vb = [jnp.where(new, v[i][None, :], _load(vc_ref.at[b, g, rs, ii, :], mask).astype(f32))
              for i, ii in ((0, lo), (1, hi))]
        return valid, jnp.where(valid[None, :], s, -jnp.inf), vb

    def weighted(p, vb):
        return [(p[:, :, None] * vb[i][None]).sum(1) for i in (0, 1)]                     # [rep, half] x 2

    if C == BS:       # one block per program (short caches): straight-line code
        valid, sc, vb = scores(j * C)
        m = sc.max(-1)                    # -inf for a block wholly past pos: then p, l, acc are 0
        p = jnp.where(valid[None, :], jnp.exp(sc - m[:, None]), 0.0)
        l = p.sum(-1)
        acc0, acc1 = weighted(p, vb)
    else:             # several blocks: a loop over those holding rows <= pos, online softmax

        def block(t, carry):
            m, l, acc0, acc1 = carry
            valid, sc, vb = scores(j * C + t * BS)
            m2 = jnp.maximum(m, sc.max(-1))   # finite: every visited block has a row <= pos
            alpha = jnp.exp(m - m2)
            p = jnp.where(valid[None, :], jnp.exp(sc - m2[:, None]), 0.0)
            w0, w1 = weighted(p, vb)
            return m2, l * alpha + p.sum(-1), acc0 * alpha[:, None] + w0, acc1 * alpha[:, None] + w1

        init = (jnp.full((rep,), -jnp.inf, f32), jnp.zeros((rep,), f32),
                jnp.zeros((rep, half), f32), jnp.zeros((rep, half), f32))
        nblk = jnp.clip((pos - j * C) // BS + 1, 0, C // BS)     # 0 for a chunk wholly past pos
        m, l, acc0, acc1 = jax.lax.fori_loop(0, nblk, block, init)
    m_ref[b, j, qr] = m                   # -inf, 0, 0 for an empty chunk: weight 0 in the combine
    l_ref[b, j, qr] = l
    a_ref[b, j, qr, lo, :] = acc0
    a_ref[b, j, qr, hi, :] = acc1


def chunk_rows(B: int, KV: int, S: int, BS: int, programs: int) -> int:
    """Cache rows per program: whole BS-row blocks, as few per program as keep about `programs`
    programs over B x KV heads (short caches: one block each; long ones: a loop over several)."""
    blocks = -(-S // BS)
    ns = max(1, min(blocks, -(-programs // (B * KV))))
    return -(-blocks // ns) * BS


@functools.lru_cache(maxsize=None)
def _call(B: int, H: int, KV: int, hd: int, S: int, norm: str, eps: float, clip, kv_dtype, interpret: bool,
          BS: int, warps: int, programs: int, Bc: int | None = None):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    half = hd // 2
    C = chunk_rows(B, KV, S, BS, programs)
    kernel = functools.partial(_attn_kernel, H=H, KV=KV, hd=hd, S=S, norm=norm, eps=eps, clip=clip,
                               scale=float(1.0 / np.sqrt(hd)), BS=BS, C=C)
    cache = jax.ShapeDtypeStruct((Bc or B, KV, S, 2, half), kv_dtype)
    NS = -(-S // C)
    part = jax.ShapeDtypeStruct((B, NS, H), jnp.float32)
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1))
    return pl.pallas_call(
        kernel, out_shape=(part, part, jax.ShapeDtypeStruct((B, NS, H, 2, half), jnp.float32), cache, cache),
        grid=(B, KV, NS), input_output_aliases={5: 3, 6: 4}, interpret=interpret, name="strata_decode_attention",
        **params)


def attention_decode(qkv, pos, K, V, *, H: int, KV: int, hd: int, norm: str = "none", q_norm=None, k_norm=None,
                     eps: float = 1e-6, clip=None, inv_freq, interpret: bool = False):
    """One decode step (one token per sequence) of attention over the cache, with its write.

    qkv f32[B, (H + 2 KV) hd] (q heads, then k, then v); pos int32[B] (each sequence's new
    token's position; a scalar: the same for all); K, V [B, KV, S, hd] (the cache: row b's new
    entry is written at pos[b]); q_norm/k_norm the norm weights ([hd] for 'head', [H hd]/[KV hd] for
    'full'); inv_freq f32[hd/2] (RoPE). The cache may hold more rows than the step (Bc >= B: a
    server's batch cache, of which rows [0, B) decode). Returns (out f32[B, H hd], K, V)."""
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
    Bc = K.shape[0]
    call = _call(B, H, KV, hd, S, norm, float(eps), None if clip is None else float(clip), jnp.dtype(K.dtype),
                 bool(interpret), *tuning(), Bc=Bc)
    p = jnp.broadcast_to(jnp.reshape(pos, (-1,)).astype(jnp.int32), (B,))
    m, l, acc, K2, V2 = call(p, qkv, qn, kn, jnp.asarray(inv_freq, f32), K.reshape(Bc, KV, S, 2, half),
                             V.reshape(Bc, KV, S, 2, half))
    # the blocks' partial softmaxes combined (flash-decoding): weights exp(m_j - max m), 0 for
    # blocks wholly past pos (m_j = -inf); block 0 always holds row 0, so the max is finite
    w = jnp.exp(m - m.max(axis=1, keepdims=True))                                        # [B, NS, H]
    out = (w[..., None, None] * acc).sum(1) / (w * l).sum(1)[..., None, None]             # [B, H, 2, half]
    return out.reshape(B, H * hd), K2.reshape(K.shape), V2.reshape(V.shape)
