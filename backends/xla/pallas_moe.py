"""Decode MoE of one layer as two Pallas (Triton) kernels over the stored packed expert weights.

At decode (a few tokens), the XLA path runs the MoE as several small kernels (gate/up
multiply-reduce, silu*mul, down multiply-reduce, the weighted combine), each a launch and a
tail; at batch 1 that count, not the bytes, bounds a step. Here, two launches:

  gate_up  grid (M*k pairs, row blocks of I): each program reads its pair's expert id, loads a
           block of gate rows and the same block of up rows straight from the stored arrays
           (int4 nibbles or int8 bytes + per-group f16 scales), dequantizes in registers, dots
           with the token's activation and writes silu(gate) * up              -> h [M*k, Ip]
  down     grid (M tokens, row blocks of D): each program loops over the token's k experts,
           dots its block of down rows with h and accumulates the routing-weighted sum
           (no atomics: one program owns its output rows)                       -> out [M, D]

The weights stay exactly as formats.py stores them (no repacking): int4 qs u8[E, N, Kp/2] is
viewed (a free reshape) as [E, N, Kp/G, G/2], where byte i of a group holds value i (low nibble)
and value i + G/2 (high nibble); the activation [Kp] is viewed as [Kp/G, 2, G/2], so its two
halves of every group line up with the two nibbles of the group's bytes. int8 qs i8[E, N, Kp] is
viewed as [E, N, Kp/G, G]. Sums are f32 (as the XLA multiply-reduce), so results agree with it to
rounding.

Triton needs power-of-two tensor sizes: the group axis is padded to the next power of two and
ragged row blocks are masked (masked lanes read scale 0, so they add nothing); the group size
itself (G/2 for int4, G for int8) must be a power of two, else `supported` says no and the
caller keeps its XLA path. On the CPU the same kernels run in Pallas interpret mode (tests).

Measured on an H200 (jax 0.11.2, OLMoE shape: D 2048, I 1024, 64 experts top-8, int4, batch 1):
the MoE of a layer takes about 22 us here against 27 us for the XLA multiply-reduce (a device loop
over 16 layers of distinct weights, routing excluded; the bytes alone need ~9 us); a whole decode
step gains little (1026 against 1010 tok/s, same run): the step is bound by ~17 launches per
layer, of which this saves under one. Kernel-level sweeps found gate_up insensitive to rows per
program (4..32), warps (2..8) and to building floats with integer tricks instead of int->float
conversions (not compute-bound); a down kernel loading all k experts' rows as one gathered block
was slower (25 against 21 us) than the unrolled loop kept here.

Legend as in executor.py: M tokens, k experts per token, E experts, D hidden, I expert
intermediate, G group size, Kp = K rounded up to a multiple of G.
"""

from __future__ import annotations

import functools
import os

FORMATS = ("int4", "int8")
MAX_ROWS = 4            # tokens per step up to which the decode kernels are used


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def mode() -> str:
    """STRATA_XLA_PALLAS: '0' never, 'interpret' always (Pallas interpret mode, any platform:
    tests), anything else (default '1'): on a GPU."""
    return os.environ.get("STRATA_XLA_PALLAS", "1").strip().lower()


def supported(gu_spec, dn_spec) -> bool:
    """Whether both projections' stored formats have a kernel here."""
    for s in (gu_spec, dn_spec):
        G = s.group_size or 32
        if s.fmt not in FORMATS or len(s.shape) != 3:
            return False
        if not _is_pow2(G // 2 if s.fmt == "int4" else G) or (s.fmt == "int4" and G % 2):
            return False
    return gu_spec.shape[0] == dn_spec.shape[0] and gu_spec.shape[1] % 2 == 0


def use(on_gpu: bool, gu_spec, dn_spec, M: int) -> tuple[bool, bool]:
    """(use the kernels, in interpret mode) for a decode MoE of M tokens."""
    m = mode()
    if m in ("0", "off", "false", "no") or M > MAX_ROWS or not supported(gu_spec, dn_spec):
        return False, False
    if m == "interpret":
        return True, True
    return on_gpu, False


# Rows per program and warps of (gate_up, down): the fastest of a sweep on an H200 at the OLMoE
# shape (D 2048, I 1024, k 8, int4), where gate_up took 23.0-24.6 us and down 21-29 us per layer
# (with a 10 us harness) over rows {4..32} x warps {2..8}; STRATA_PALLAS_TUNE="bn1,bn2,w1,w2"
# overrides (powers of two).
TUNING = (4, 8, 4, 8)


def tuning() -> tuple[int, int, int, int]:
    t = os.environ.get("STRATA_PALLAS_TUNE")
    return tuple(int(v) for v in t.split(",")) if t else TUNING


class _Proj:
    """Static geometry of one stored projection [E, N, K] and its kernel-side views."""

    def __init__(self, spec):
        self.fmt, self.G = spec.fmt, spec.group_size or 32
        self.E, self.N, self.K = spec.shape
        self.ng = -(-self.K // self.G)               # groups per row
        self.Kp = self.ng * self.G
        self.NGP = _pow2(self.ng)                    # group axis as loaded (power of two)
        self.W = self.G // 2 if self.fmt == "int4" else self.G   # bytes per group

    def qs_view(self, qs):
        return qs.reshape(self.E, self.N, self.ng, self.W)

    def x_view(self, x):
        """x [R, Kp] -> the layout the kernel loads: [R, ng, 2, G/2] (int4) or [R, ng, G]."""
        if self.fmt == "int4":
            return x.reshape(x.shape[0], self.ng, 2, self.W)
        return x.reshape(x.shape[0], self.ng, self.W)


def _load(ref, mask):
    from jax.experimental.pallas import triton as plgpu

    if mask is None:
        return ref[...]
    return plgpu.load(ref, mask=mask, other=0)


def _x_parts(p: _Proj, x_ref, r):
    """Row r of the activation as [NGP, W] block(s): (low half, high half) for int4."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    gs = pl.ds(0, p.NGP)
    mask = None
    if p.NGP != p.ng:
        mask = jnp.broadcast_to((jnp.arange(p.NGP) < p.ng)[:, None], (p.NGP, p.W))
    if p.fmt == "int4":
        half0, half1 = jnp.int32(0), jnp.int32(1)   # traced: interpret mode masks no python ints
        return (_load(x_ref.at[r, gs, half0, :], mask).astype(jnp.float32),
                _load(x_ref.at[r, gs, half1, :], mask).astype(jnp.float32))
    return (_load(x_ref.at[r, gs, :], mask).astype(jnp.float32),)


def _dequant_dot(p: _Proj, q, xs):
    """sum over the last axis of q [..., NGP, W] (integers, scale not applied) times x: [..., NGP]."""
    import jax.numpy as jnp

    if p.fmt == "int4":
        qi = q.astype(jnp.int32)
        lo = (qi & 15).astype(jnp.float32) - 8.0
        hi = (qi >> 4).astype(jnp.float32) - 8.0
        return (lo * xs[0] + hi * xs[1]).sum(axis=-1)
    return (q.astype(jnp.float32) * xs[0]).sum(axis=-1)


def _rows_dot(p: _Proj, qs_ref, sc_ref, e, start, row0, BN: int, limit: int, span: int, xs):
    """f32[BN]: rows start + row0 + [0, BN) of expert e's dequantized weight times x; rows at or
    past `limit` (counted from `start`) read nothing and give 0 (the grid spans `span` rows)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    rows = row0 + jnp.arange(BN)
    ragged = span > limit
    qmask = smask = None
    if ragged or p.NGP != p.ng:
        ok = (rows < limit)[:, None] & (jnp.arange(p.NGP) < p.ng)[None, :]     # [BN, NGP]
        smask = ok
        qmask = jnp.broadcast_to(ok[:, :, None], (BN, p.NGP, p.W))
    rs, gs = pl.ds(start + row0, BN), pl.ds(0, p.NGP)
    q = _load(qs_ref.at[e, rs, gs, :], qmask)                                   # [BN, NGP, W]
    d = _load(sc_ref.at[e, rs, gs], smask).astype(jnp.float32)                  # [BN, NGP]
    s = _dequant_dot(p, q, tuple(x[None] for x in xs))
    return (s * d).sum(axis=-1)                                                  # masked: d == 0


def _gate_up_kernel(ids_ref, x_ref, qs_ref, sc_ref, h_ref, *, p: _Proj, k: int, I: int, Ip: int, BN: int):
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    pair, blk = pl.program_id(0), pl.program_id(1)
    e = ids_ref[pair]
    xs = _x_parts(p, x_ref, pair // k)
    row0 = blk * BN
    span = -(-Ip // BN) * BN
    g = _rows_dot(p, qs_ref, sc_ref, e, 0, row0, BN, I, span, xs)
    u = _rows_dot(p, qs_ref, sc_ref, e, I, row0, BN, I, span, xs)
    h = g / (1.0 + jnp.exp(-g)) * u                                             # rows >= I: 0
    out = h_ref.at[pair, pl.ds(row0, BN)]
    if Ip % BN:
        plgpu.store(out, h, mask=row0 + jnp.arange(BN) < Ip)
    else:
        out[...] = h


def _down_kernel(ids_ref, w_ref, h_ref, qs_ref, sc_ref, o_ref, *, p: _Proj, k: int, BN: int):
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    m, blk = pl.program_id(0), pl.program_id(1)
    row0 = blk * BN
    span = -(-p.N // BN) * BN
    acc = jnp.zeros((BN,), jnp.float32)
    for j in range(k):                      # unrolled: the k experts' loads can overlap
        pair = m * k + j
        xs = _x_parts(p, h_ref, pair)
        acc = acc + w_ref[pair] * _rows_dot(p, qs_ref, sc_ref, ids_ref[pair], 0, row0, BN, p.N, span, xs)
    out = o_ref.at[m, pl.ds(row0, BN)]
    if p.N % BN:
        plgpu.store(out, acc, mask=row0 + jnp.arange(BN) < p.N)
    else:
        out[...] = acc


@functools.lru_cache(maxsize=None)
def _calls(gu: tuple, dn: tuple, M: int, k: int, interpret: bool, bn1: int, bn2: int, warps1: int, warps2: int):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    pg, pd = _Proj(_Spec(*gu)), _Proj(_Spec(*dn))
    I = pg.N // 2
    Ip = pd.Kp                               # h columns: down's K (= I) padded to its groups
    bn1 = min(bn1, _pow2(I))
    bn2 = min(bn2, _pow2(pd.N))
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps1, num_stages=1))
    gate_up = pl.pallas_call(
        functools.partial(_gate_up_kernel, p=pg, k=k, I=I, Ip=Ip, BN=bn1),
        out_shape=jax.ShapeDtypeStruct((M * k, Ip), jnp.float32),
        grid=(M * k, -(-Ip // bn1)), interpret=interpret, name="strata_moe_gate_up", **params)
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps2, num_stages=1))
    down = pl.pallas_call(
        functools.partial(_down_kernel, p=pd, k=k, BN=bn2),
        out_shape=jax.ShapeDtypeStruct((M, pd.N), jnp.float32),
        grid=(M, -(-pd.N // bn2)), interpret=interpret, name="strata_moe_down", **params)
    return pg, pd, gate_up, down


class _Spec:
    """The parts of a WeightSpec the kernels depend on (hashable, for the cache)."""

    def __init__(self, fmt, group_size, shape):
        self.fmt, self.group_size, self.shape = fmt, group_size, tuple(shape)


def _key(spec) -> tuple:
    return spec.fmt, spec.group_size or 32, tuple(spec.shape)


def moe_decode(x, topi, topw, gu_spec, gu_arrays: dict, dn_spec, dn_arrays: dict, *, interpret: bool = False):
    """sum_j topw[m, j] * down_e(silu(gate_e(x[m])) * up_e(x[m])), e = topi[m, j]: f32[M, D].

    x [M, D] (any float), topi int[M, k], topw [M, k]; *_arrays the stored arrays ({'qs',
    'scales'}) of the stacked expert weights gate_up [E, 2I, D] and down [E, D, I]."""
    import jax.numpy as jnp

    M, k = topi.shape
    pg, pd, gate_up, down = _calls(_key(gu_spec), _key(dn_spec), M, k, bool(interpret), *tuning())
    x = x.astype(jnp.float32)
    if pg.Kp != pg.K:
        x = jnp.pad(x, [(0, 0), (0, pg.Kp - pg.K)])
    ids = topi.reshape(-1).astype(jnp.int32)
    h = gate_up(ids, pg.x_view(x), pg.qs_view(gu_arrays["qs"]), gu_arrays["scales"])          # [M*k, Ip]
    return down(ids, topw.reshape(-1).astype(jnp.float32), pd.x_view(h),
                pd.qs_view(dn_arrays["qs"]), dn_arrays["scales"])
