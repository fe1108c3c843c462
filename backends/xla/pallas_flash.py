"""Prefill attention of one layer as one Pallas (Triton) flash-attention kernel.

XLA's path for a step of T tokens forms every score over the whole cache (f32 [B, H, T, S]),
masks, softmaxes and multiplies it by V: at 4096 tokens that is 1 GB per layer written and read
again, the largest part of a long prefill after the MoE. Here each program holds one block of
queries and walks the cache's key blocks with an online softmax, so no score leaves registers:

  grid (B, H, T / BQ): one program per sequence, query head and block of BQ queries. Query t of
    row b sits at position pos[b] + t and sees the keys [0, pos[b] + t] (the step's own keys are
    already in the cache): the program walks key blocks of BK rows up to its last query's position
    (fewer blocks for earlier queries: causal work, not the whole cache), scores in f32 from
    operands in the plan's compute dtype, masks the keys past each query's position, and keeps a
    running max, sum and weighted V (p rounded to the compute dtype for the product, as XLA's path).
  GQA: query head h reads KV head h // rep.

Triton needs power-of-two blocks: T (a prefill bucket) and hd must be powers of two and the cache
rows S a multiple of BK, else `use` says no and the caller keeps XLA's path. On the CPU the kernel
runs in Pallas interpret mode (tests). Legend: B batch, H/KV query/KV heads, hd head dim,
rep = H/KV, T step tokens, S cache rows, BQ/BK query/key rows per block.
"""

from __future__ import annotations

import functools

from strata_compiler import settings

from .pallas_quant import _is_pow2, gate


def tuning() -> tuple[int, int, int, int]:
    """(BQ, BK, warps, stages) from the `pallas_flash_tune` setting."""
    return settings.get("pallas_flash_tune")


def _heads_fit(H: int, KV: int, hd: int) -> bool:
    return H % KV == 0 and _is_pow2(hd) and hd >= 16


def supported(on_gpu: bool, H: int, KV: int, hd: int) -> bool:
    """Whether an attention of these heads takes the kernel on its power-of-two prefill steps (over
    caches of whole key blocks: Session's capacities are multiples of 64)."""
    return gate(on_gpu, _heads_fit(H, KV, hd))[0]


def use(on_gpu: bool, H: int, KV: int, hd: int, T: int, S: int) -> tuple[bool, bool]:
    """(use the kernel, in interpret mode) for an attention step of T > 1 tokens over S cache rows."""
    BQ, BK, _, _ = tuning()
    return gate(on_gpu, T > 1 and _is_pow2(T) and _heads_fit(H, KV, hd) and S % BK == 0 and T % min(BQ, T) == 0)


def _kernel(pos_ref, q_ref, k_ref, v_ref, o_ref, *, BQ: int, BK: int, rep: int, S: int, scale: float, dt):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g = h // rep
    t0 = i * BQ
    pos = pos_ref[b]
    q = q_ref[b, h, pl.ds(t0, BQ), :].astype(dt)                       # [BQ, hd]
    rows = pos + t0 + jnp.arange(BQ)                                    # each query's position
    blocks = (jnp.minimum(pos + t0 + BQ, S) + BK - 1) // BK
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    hd = q.shape[1]

    def body(j, carry):
        m, l, acc = carry
        k0 = j * BK
        kb = k_ref[b, g, pl.ds(k0, BK), :].astype(dt)                   # [BK, hd]
        vb = v_ref[b, g, pl.ds(k0, BK), :].astype(dt)
        s = jax.lax.dot_general(q, kb, (((1,), (1,)), ((), ())), precision=prec,
                                preferred_element_type=jnp.float32) * scale
        s = jnp.where((k0 + jnp.arange(BK))[None, :] <= rows[:, None], s, -1e30)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        acc = acc * alpha[:, None] + jax.lax.dot_general(
            p.astype(dt), vb, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)
        return m_new, l * alpha + p.sum(axis=1), acc

    init = (jnp.full((BQ,), -1e30, jnp.float32), jnp.zeros((BQ,), jnp.float32), jnp.zeros((BQ, hd), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, blocks, body, init)
    o_ref[b, h, pl.ds(t0, BQ), :] = (acc / l[:, None]).astype(o_ref.dtype)


@functools.lru_cache(maxsize=None)
def _call(B: int, H: int, KV: int, T: int, S: int, hd: int, dtype: str, interpret: bool, tune: tuple):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    BQ, BK, warps, stages = tune
    BQ = min(BQ, T)
    kern = functools.partial(_kernel, BQ=BQ, BK=BK, rep=H // KV, S=S, scale=float(1 / hd ** 0.5),
                             dt=jnp.dtype(dtype))
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages))
    return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((B, H, T, hd), jnp.float32),
                          grid=(B, H, T // BQ), interpret=interpret, name="strata_flash_prefill", **params)


def attention(q, K, V, pos, dtype, interpret: bool = False):
    """softmax(q K^T / sqrt(hd)) V, query t of row b seeing the cache rows [0, pos[b] + t]:
    q [B, T, H, hd] (RoPE applied), K/V the cache [Bc >= B, KV, S, hd] holding the step's keys,
    pos int [B]. Returns f32 [B, T, H, hd]."""
    import jax.numpy as jnp

    B, T, H, hd = q.shape
    KV, S = K.shape[1], K.shape[2]
    fn = _call(B, H, KV, T, S, hd, jnp.dtype(dtype).name, bool(interpret), tuple(tuning()))
    out = fn(pos.astype(jnp.int32), q.transpose(0, 2, 1, 3).astype(dtype), K, V)
    return out.transpose(0, 2, 1, 3)
