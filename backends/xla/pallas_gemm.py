"""The MoE of many tokens (prefill, batched decode) over stored int4/int8 expert weights as Pallas
(Triton) kernels on the tensor cores, the (token, expert) pairs grouped by expert (vLLM's fused_moe
layout).

Above the decode kernels' rows (pallas_moe: one program per pair, each reading its expert's
weights again), XLA's path dequantizes every expert to bf16 in memory, reads it back and runs a
ragged dot. Here the weights stay packed in memory:

  tiles   grid (row blocks of BM, column blocks of BN); a program walks K GB groups at a time,
          dequantizes its [BN, GB*G] weight tile in registers ((q - 8) * scale, bf16) and feeds
          it and the activation tile to one tensor-core dot (f32 accumulation).
  int4    a group's byte i holds values i (low nibble) and i + G/2 (high): the activation [R, Kp]
          viewed as [R, ng, 2, G/2] lines its two halves up with the nibbles, so a step is two
          dots (low, high) over GB*G/2 columns each, with no shuffle.
  moe     the pairs are sorted by expert and each expert's run padded to a multiple of BM
          (`align`), so every row block belongs to one expert (its id per block; -1 for blocks
          past the end, which do nothing). gate_up applies silu(gate) * up in its epilogue
          (a program owns the same columns of both halves); down writes each pair's row; the
          weighted sum over a token's k pairs is an XLA gather-and-sum in a fixed order
          (deterministic, no atomics).

  bf16    from DEQUANT_FIRST_TOKENS tokens, the experts are dequantized to bf16 in memory first (one
          XLA pass over the layer's experts: a temporary as large as them in bf16, at most
          DEQUANT_FIRST_BYTES) and _wkernel's tiles read them: the pass costs about what one row
          block's register dequantization does.

Dense projections stay XLA's: its dot fuses the int4 dequantization itself and beat a kernel of
this shape on q/k/v (BENCHMARKS.md). On the CPU the kernels run in Pallas interpret mode (tests).
Block sizes: the `pallas_gemm_tune` setting. Legend: R rows, N output columns, K input columns,
E experts, G group size, ng = Kp / G groups, H = G/2 bytes per int4 group, GB groups per step,
BM/BN rows/columns per program.
"""

from __future__ import annotations

import functools
import math

from strata_compiler import settings

from .pallas_quant import _is_pow2, _key, _pow2, gate


# From this many tokens a MoE call dequantizes its experts to bf16 in memory once (one XLA fusion)
# and runs plain tensor-core tiles over them (_wkernel): below it, every row block dequantizing its
# weight tiles in registers costs less than that pass (BENCHMARKS.md, the measured crossover).
DEQUANT_FIRST_TOKENS = 256
# ... while that bf16 copy of a layer's experts (a temporary of the step) stays within this many
# bytes: a model whose layers are larger keeps the register form rather than risk a GPU's memory.
DEQUANT_FIRST_BYTES = 2 << 30


def supported(spec) -> bool:
    """Whether a weight stored as `spec` ([N, K] or stacked [E, N, K]) has these kernels: int4 or
    int4a with a power-of-two group of at least 32 (16-column dots per nibble half), int8 with one
    of at least 16."""
    G = spec.group_size or 32
    return (len(spec.shape) in (2, 3) and _is_pow2(G)
            and (spec.fmt in ("int4", "int4a") and G >= 32 or spec.fmt == "int8" and G >= 16))


def use(on_gpu: bool, spec, M: int, above: int) -> tuple[bool, bool]:
    """(use the kernels, in interpret mode) for M tokens against an expert weight stored as `spec`,
    where the decode kernels take up to `above` tokens (their setting) and these the rest."""
    return gate(on_gpu, M > above and supported(spec))


def tuning(rows_per_block: int, dequantized: bool = False) -> tuple[int, int, int, int, int]:
    """(BM, BN, GB, warps, stages) from the `pallas_gemm_tune` setting (`pallas_gemm_bf16_tune` for
    weights dequantized first), BM cut down to the rows a block will have (about `rows_per_block`,
    at least 16: the tensor cores' tile)."""
    BM, BN, GB, warps, stages = settings.get("pallas_gemm_bf16_tune" if dequantized else "pallas_gemm_tune")
    return min(BM, max(16, _pow2(rows_per_block))), BN, GB, warps, stages


class _Geo:
    """Static geometry of a stored [E, N, K] weight and its views for these kernels."""

    def __init__(self, key: tuple):
        self.fmt, self.G, shape = key
        self.E, self.N, self.K = shape if len(shape) == 3 else (1, *shape)
        self.ng = -(-self.K // self.G)
        self.Kp = self.ng * self.G
        self.int4 = self.fmt in ("int4", "int4a")              # nibbles
        self.paired = self.fmt == "int4a"                      # a (scale, min) pair per group
        self.H = self.G // 2 if self.int4 else self.G          # stored bytes per group

    def qs(self, qs):
        """qs [E?, N, Kp/2 | Kp] -> [E, N, ng, H] (a free reshape)."""
        return qs.reshape(self.E, self.N, self.ng, self.H)

    def scales(self, d):
        return d.reshape(self.E, self.N, self.ng, 2) if self.paired else d.reshape(self.E, self.N, self.ng)

    def x(self, x, rows: int, dt):
        """x [R, K] -> dt [rows, ng, 2, H] (int4) or [rows, ng, G] (int8), zero-padded."""
        import jax.numpy as jnp

        x = x.astype(dt)
        x = jnp.pad(x, [(0, rows - x.shape[0]), (0, self.Kp - self.K)])
        return x.reshape(rows, self.ng, 2, self.H) if self.int4 else x.reshape(rows, self.ng, self.G)


def _tile_dot(g: _Geo, x_ref, q_ref, s_ref, e, r0, n0, g0, BM: int, BN: int, GB: int, nmask, dt):
    """[BM, BN] f32: rows r0.. of x times columns n0.. of expert e's weight over groups g0..g0+GB."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from .pallas_quant import _load

    gs, ns = pl.ds(g0, GB), pl.ds(n0, BN)
    gmask = None
    if g.ng % GB:
        gmask = (g0 + jnp.arange(GB)) < g.ng
    smask = None if nmask is None and gmask is None else (
        (nmask[:, None] if nmask is not None else True) & (gmask[None, :] if gmask is not None else True))
    if smask is not None:
        smask = jnp.broadcast_to(smask, (BN, GB))
    qmask = None if smask is None else jnp.broadcast_to(smask[:, :, None], (BN, GB, g.H))
    q = _load(q_ref.at[e, ns, gs, :], qmask)                                  # [BN, GB, H]
    if g.paired:    # [BN, GB, 1] each, two strided loads: Triton cannot slice a loaded [.., 2] block
        s, mn = (_load(s_ref.at[e, ns, gs, jnp.int32(i)], smask).astype(jnp.float32)[:, :, None] for i in (0, 1))
    else:
        s = _load(s_ref.at[e, ns, gs], smask).astype(jnp.float32)[:, :, None]
    dims = (((1,), (1,)), ((), ()))
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    K = GB * g.H
    xmask = None if gmask is None else jnp.broadcast_to(gmask[None, :, None], (BM, GB, g.H))
    if g.int4:
        parts = []
        for half in (0, 1):
            v = (q & jnp.uint8(0x0F)) if half == 0 else (q >> jnp.uint8(4))
            if g.paired:
                w = (v.astype(jnp.float32) * s + mn).astype(dt).reshape(BN, K)
            else:
                w = ((v.astype(jnp.int32) - 8).astype(jnp.float32) * s).astype(dt).reshape(BN, K)
            xv = _load(x_ref.at[pl.ds(r0, BM), gs, jnp.int32(half), :], xmask).reshape(BM, K)
            parts.append(jax.lax.dot_general(xv, w, dims, precision=prec, preferred_element_type=jnp.float32))
        return parts[0] + parts[1]
    w = (q.astype(jnp.float32) * s).astype(dt).reshape(BN, K)
    xv = _load(x_ref.at[pl.ds(r0, BM), gs, :], xmask).reshape(BM, K)
    return jax.lax.dot_general(xv, w, dims, precision=prec, preferred_element_type=jnp.float32)


def _finish(o_ref, body, steps: int, r0, n0, BM: int, BN: int, nmask, glu: bool) -> None:
    """Run the K loop `body` (f32 accumulators: one, or gate and up) and store the [BM, BN] tile
    (silu(gate) * up for glu), the columns past N masked off."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    zero = jnp.zeros((BM, BN), jnp.float32)
    acc = jax.lax.fori_loop(0, steps, body, (zero, zero) if glu else (zero,))
    y = acc[0] / (1.0 + jnp.exp(-acc[0])) * acc[1] if glu else acc[0]
    out = o_ref.at[pl.ds(r0, BM), pl.ds(n0, BN)]
    y = y.astype(o_ref.dtype)
    if nmask is None:
        out[...] = y
    else:
        plgpu.store(out, y, mask=jnp.broadcast_to(nmask[None, :], (BM, BN)))


def _kernel(be_ref, x_ref, q_ref, s_ref, o_ref, *, g: _Geo, BM: int, BN: int, GB: int, N: int, glu: bool, dt):
    """One [BM, BN] output tile. be_ref: the expert of each row block (-1: nothing to do), or None
    (a dense weight). glu: the weight holds gate rows [0, N) and up rows [N, 2N); the tile is
    silu(gate) * up."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    b, j = pl.program_id(0), pl.program_id(1)
    r0, n0 = b * BM, j * BN
    nmask = ((n0 + jnp.arange(BN)) < N) if N % BN else None
    steps = -(-g.ng // GB)

    def run(e):
        dot = functools.partial(_tile_dot, g, x_ref, q_ref, s_ref)

        def body(i, acc):
            a = dot(e, r0, n0, i * GB, BM, BN, GB, nmask, dt)
            if glu:
                u = dot(e, r0, n0 + N, i * GB, BM, BN, GB, nmask, dt)
                return acc[0] + a, acc[1] + u
            return (acc[0] + a,)

        _finish(o_ref, body, steps, r0, n0, BM, BN, nmask, glu)

    if be_ref is None:
        run(jnp.int32(0))
    else:
        e = be_ref[b]

        @pl.when(e >= 0)
        def _():
            run(e)


def _wkernel(be_ref, x_ref, w_ref, o_ref, *, BM: int, BN: int, BK: int, K: int, N: int, glu: bool):
    """As _kernel over weights already dequantized ([E, N(+N), K] in the products' dtype)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from .pallas_quant import _load

    b, j = pl.program_id(0), pl.program_id(1)
    r0, n0 = b * BM, j * BN
    nmask = ((n0 + jnp.arange(BN)) < N) if N % BN else None
    dims = (((1,), (1,)), ((), ()))
    prec = jax.lax.Precision.HIGHEST if w_ref.dtype == jnp.float32 else None

    def run(e):
        def tile(i, c0):
            kmask = ((i * BK + jnp.arange(BK)) < K) if K % BK else None
            wm = None if nmask is None and kmask is None else jnp.broadcast_to(
                (nmask[:, None] if nmask is not None else True) & (kmask[None, :] if kmask is not None else True),
                (BN, BK))
            xm = None if kmask is None else jnp.broadcast_to(kmask[None, :], (BM, BK))
            w = _load(w_ref.at[e, pl.ds(c0, BN), pl.ds(i * BK, BK)], wm)
            xv = _load(x_ref.at[pl.ds(r0, BM), pl.ds(i * BK, BK)], xm)
            return jax.lax.dot_general(xv, w, dims, precision=prec, preferred_element_type=jnp.float32)

        def body(i, acc):
            if glu:
                return acc[0] + tile(i, n0), acc[1] + tile(i, n0 + N)
            return (acc[0] + tile(i, n0),)

        _finish(o_ref, body, -(-K // BK), r0, n0, BM, BN, nmask, glu)

    e = be_ref[b]

    @pl.when(e >= 0)
    def _():
        run(e)


@functools.lru_cache(maxsize=None)
def _wcall(E: int, N: int, K: int, rows: int, glu: bool, out_dtype: str, interpret: bool, tune: tuple):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    BM, BN, GB, warps, stages = tune
    N = N // 2 if glu else N
    BN, BK = min(BN, _pow2(N)), min(GB * 32, _pow2(K))
    kern = functools.partial(_wkernel, BM=BM, BN=BN, BK=BK, K=K, N=N, glu=glu)
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages))
    return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((rows, N), jnp.dtype(out_dtype)),
                          grid=(rows // BM, -(-N // BN)), interpret=interpret, name="strata_gemm_moe_w", **params)


@functools.lru_cache(maxsize=None)
def _call(key: tuple, rows: int, moe: bool, glu: bool, dtype: str, out_dtype: str, interpret: bool, tune: tuple):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    BM, BN, GB, warps, stages = tune
    g = _Geo(key)
    N = g.N // 2 if glu else g.N
    BN = min(BN, _pow2(N))
    GB = min(GB, _pow2(g.ng))
    kern = functools.partial(_kernel, g=g, BM=BM, BN=BN, GB=GB, N=N, glu=glu, dt=jnp.dtype(dtype))
    if not moe:
        kern = functools.partial(kern, None)
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages))
    return g, pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((rows, N), jnp.dtype(out_dtype)),
                             grid=(rows // BM, -(-N // BN)), interpret=interpret,
                             name="strata_gemm_moe" if moe else "strata_gemm", **params)


def align(ids, E: int, BM: int):
    """Pairs (flattened top-k choices, ids int [P]) grouped by expert into blocks of BM rows:
    (slot of each pair int32 [P], the pair in each slot int32 [NB*BM] (P: none), the expert of
    each block int32 [NB] (-1: an empty block)), NB = the most blocks P pairs can need."""
    import jax.numpy as jnp

    P = ids.shape[0]
    NB = -(-(P + E * (BM - 1)) // BM)
    ids = ids.astype(jnp.int32)
    sizes = jnp.bincount(ids, length=E).astype(jnp.int32)
    padded = -(-sizes // BM) * BM
    ends = jnp.cumsum(padded)
    starts = ends - padded
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)             # pairs by expert
    first = jnp.cumsum(sizes) - sizes                                   # each expert's first in `order`
    e_sorted = ids[order]
    slot_sorted = starts[e_sorted] + jnp.arange(P, dtype=jnp.int32) - first[e_sorted]
    slot = jnp.zeros((P,), jnp.int32).at[order].set(slot_sorted)
    pair_of = jnp.full((NB * BM,), P, jnp.int32).at[slot].set(jnp.arange(P, dtype=jnp.int32))
    block_start = jnp.arange(NB, dtype=jnp.int32) * BM
    e_of = jnp.searchsorted(ends, block_start, side="right").astype(jnp.int32)
    e_of = jnp.where(block_start < ends[-1], e_of, -1)
    return slot, pair_of, e_of


def moe(x, topi, topw, gu_spec, gu_arrays: dict, dn_spec, dn_arrays: dict, *, dtype="bfloat16",
        interpret: bool = False):
    """sum_j topw[m, j] * down_e(silu(gate_e(x[m])) * up_e(x[m])), e = topi[m, j]: f32 [M, D].
    gate_up [E, 2I, D] and down [E, D, I] stored int4/int8 ({'qs', 'scales'}); products (and h
    between the kernels) in `dtype`."""
    import jax.numpy as jnp

    M, k = topi.shape
    E = gu_spec.shape[0]
    dt = jnp.dtype(dtype)
    first = (M >= DEQUANT_FIRST_TOKENS
             and dt.itemsize * (math.prod(gu_spec.shape) + math.prod(dn_spec.shape)) <= DEQUANT_FIRST_BYTES)
    tune = tuning(-(-M * k // E), dequantized=first)
    BM = tune[0]
    slot, pair_of, e_of = align(topi.reshape(-1), E, BM)
    rows = pair_of.shape[0]
    tok = jnp.minimum(pair_of // k, M)                                  # M: the zero row
    xz = jnp.concatenate([x.astype(dt), jnp.zeros((1, x.shape[1]), dt)])[tok]
    if first:
        from .dequant import dequantize

        wg, wd = dequantize(jnp, gu_spec, gu_arrays, dt), dequantize(jnp, dn_spec, dn_arrays, dt)
        _, N2, D = wg.shape
        h = _wcall(E, N2, D, rows, True, dt.name, bool(interpret), tune)(e_of, xz, wg)
        ys = _wcall(E, D, N2 // 2, rows, False, "float32", bool(interpret), tune)(e_of, h, wd)
        return (ys[slot].reshape(M, k, -1) * topw[..., None].astype(jnp.float32)).sum(axis=1)
    g1, gate_up = _call(_key(gu_spec), rows, True, True, dt.name, dt.name, bool(interpret), tune)
    h = gate_up(e_of, g1.x(xz, rows, dt), g1.qs(gu_arrays["qs"]), g1.scales(gu_arrays["scales"]))
    g2, down = _call(_key(dn_spec), rows, True, False, dt.name, "float32", bool(interpret), tune)
    ys = down(e_of, g2.x(h, rows, dt), g2.qs(dn_arrays["qs"]), g2.scales(dn_arrays["scales"]))
    return (ys[slot].reshape(M, k, -1) * topw[..., None].astype(jnp.float32)).sum(axis=1)
