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

Routing inside (default when the route op ran in the same computation): both kernels take the
router logits and compute softmax and top-k themselves (k passes of argmax over E values, ties to
the lower expert as lax.top_k), which removes the route's four small kernels (softmax, sort, two
slices) per layer. STRATA_PALLAS_INT4=words loads int4 as u32 words and builds floats with the
exponent trick instead of int->float conversions (measured no faster: BENCHMARKS.md).

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


def route_inside() -> bool:
    """STRATA_XLA_PALLAS_ROUTE=0: the route's own top-k feeds the kernels (A/B), instead of each
    kernel taking softmax and top-k of the router logits itself."""
    return os.environ.get("STRATA_XLA_PALLAS_ROUTE", "1").strip().lower() not in ("0", "off", "false", "no")


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


def int4_mode() -> str:
    """STRATA_PALLAS_INT4: how the kernels read int4 weights.
    'bytes' (default): u8 loads, int->float conversions, f32 products with f32 activations;
    'words': u32 loads (8 nibbles each), floats built with the exponent trick;
    'dp4a': u32 loads, nibbles masked into bytes, integer dot products (dp4a, 4 products per
    instruction) against activations quantized to int8 per group of G (q8, as llama.cpp's mmvq
    and the llvm CPU kernels): far fewer instructions per weight. Not yet measured on a GPU."""
    m = os.environ.get("STRATA_PALLAS_INT4", "bytes").strip().lower()
    return m if m in ("bytes", "words", "dp4a") else "bytes"


class _Proj:
    """Static geometry of one stored projection [E, N, K] and its kernel-side views."""

    def __init__(self, spec, int4: str = "bytes"):
        self.fmt, self.G = spec.fmt, spec.group_size or 32
        self.E, self.N, self.K = spec.shape
        self.ng = -(-self.K // self.G)               # groups per row
        self.Kp = self.ng * self.G
        self.NGP = _pow2(self.ng)                    # group axis as loaded (power of two)
        self.W = self.G // 2 if self.fmt == "int4" else self.G   # bytes per group
        self.dp4a = int4 == "dp4a" and self.fmt == "int4" and self.W % 4 == 0
        self.words = (int4 == "words" or self.dp4a) and self.fmt == "int4" and self.W % 4 == 0
        self.nx = 4 if self.dp4a else 1               # activation arrays the kernels read
        self.QW = self.W // 4 if self.words else self.W          # stored elements per group as loaded

    def qs_view(self, qs):
        if self.words:      # [E, N, ng, W/4] u32: byte j of word w is byte 4w + j of the group
            import jax
            import jax.numpy as jnp

            return jax.lax.bitcast_convert_type(qs.reshape(self.E, self.N, self.ng, self.QW, 4), jnp.uint32)
        return qs.reshape(self.E, self.N, self.ng, self.W)

    def x_in(self, x) -> tuple:
        """The activation arrays the kernels read, from x f32[R, Kp]: (x_view(x),), or for dp4a
        its q8 form (words i32[R, ng, G/8] of the low and of the high half: byte j of word w of
        half h is q8(x[g G + h G/2 + 4w + j]); scales f32[R, ng]; sums i32[R, ng] of each group's
        q8 values, for the -8 of the int4 weights)."""
        if not self.dp4a:
            return (self.x_view(x),)
        import jax
        import jax.numpy as jnp

        R = x.shape[0]
        xg = x.reshape(R, self.ng, self.G)
        amax = jnp.abs(xg).max(-1)
        inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
        q = jnp.clip(jnp.round(xg * inv[..., None]), -127, 127).astype(jnp.int32)
        b = (q & 0xFF).astype(jnp.uint32).reshape(R, self.ng, 2, self.QW, 4)
        w = (b << jnp.arange(0, 32, 8, dtype=jnp.uint32)).sum(-1, dtype=jnp.uint32)   # bytes apart: sum = or
        words = jax.lax.bitcast_convert_type(w, jnp.int32)
        return words[:, :, 0], words[:, :, 1], amax / 127.0, q.sum(-1)

    def x_view(self, x):
        """x [R, Kp] -> the layout the kernel loads: [R, ng, 2, G/2] (int4; words: [R, ng, 2, G/8,
        4]) or [R, ng, G]."""
        if self.words:
            return x.reshape(x.shape[0], self.ng, 2, self.QW, 4)
        if self.fmt == "int4":
            return x.reshape(x.shape[0], self.ng, 2, self.W)
        return x.reshape(x.shape[0], self.ng, self.W)


def _load(ref, mask):
    from jax.experimental.pallas import triton as plgpu

    if mask is None:
        return ref[...]
    return plgpu.load(ref, mask=mask, other=0)


def _store_rows(o_ref, r, row0, BN: int, n: int, values) -> None:
    """values [BN] into o_ref[r, row0:row0 + BN], the positions at or past n masked off."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    out = o_ref.at[r, pl.ds(row0, BN)]
    if n % BN:
        plgpu.store(out, values, mask=row0 + jnp.arange(BN) < n)
    else:
        out[...] = values


def _x_parts(p: _Proj, x_refs: tuple, r):
    """Row r of the activation as [NGP, W] block(s): (low half, high half) for int4; words: the
    8 [NGP, W/4] blocks (half, byte j) that line up with the nibbles of the words; dp4a: (low
    words, high words [NGP, W/4], scales [NGP], sums [NGP])."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    gs = pl.ds(0, p.NGP)
    mask = gmask = None
    if p.NGP != p.ng:
        mask = jnp.broadcast_to((jnp.arange(p.NGP) < p.ng)[:, None], (p.NGP, p.QW))
        gmask = jnp.arange(p.NGP) < p.ng
    if p.dp4a:
        lo, hi, d, sm = x_refs
        return (_load(lo.at[r, gs, :], mask), _load(hi.at[r, gs, :], mask),
                _load(d.at[r, gs], gmask).astype(jnp.float32), _load(sm.at[r, gs], gmask))
    x_ref = x_refs[0]
    if p.words:
        return tuple(_load(x_ref.at[r, gs, jnp.int32(h), :, jnp.int32(j)], mask).astype(jnp.float32)
                     for h in (0, 1) for j in range(4))
    if p.fmt == "int4":
        half0, half1 = jnp.int32(0), jnp.int32(1)   # traced: interpret mode masks no python ints
        return (_load(x_ref.at[r, gs, half0, :], mask).astype(jnp.float32),
                _load(x_ref.at[r, gs, half1, :], mask).astype(jnp.float32))
    return (_load(x_ref.at[r, gs, :], mask).astype(jnp.float32),)


def _dp4a(a, b, c, interpret: bool):
    """c + sum over the 4 bytes of a (unsigned) times b (signed), per 32-bit lane (PTX dp4a);
    in interpret mode (the CPU: tests) the same in plain integer arithmetic."""
    import jax
    import jax.numpy as jnp

    if interpret:
        acc = c
        for j in range(4):
            aj = ((a >> jnp.uint32(8 * j)) & jnp.uint32(0xFF)).astype(jnp.int32)
            bj = (b >> (8 * j)) & 0xFF
            acc = acc + aj * jnp.where(bj >= 128, bj - 256, bj)
        return acc
    from jax.experimental.pallas import triton as plgpu

    return plgpu.elementwise_inline_asm("dp4a.u32.s32 $0, $1, $2, $3;", args=[a, b, c], constraints="=r,r,r,r",
                                        pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])[0]


def _dequant_dot(p: _Proj, q, xs, interpret: bool = False):
    """sum over the last axis of q [..., NGP, W] (integers, scale not applied) times x: [..., NGP].
    dp4a: the same from the q8 activations, their scale applied (the weights' scale is not)."""
    import jax
    import jax.numpy as jnp

    if p.dp4a:
        xlo, xhi, dx, sm = xs
        lo = q & jnp.uint32(0x0F0F0F0F)
        hi = (q >> jnp.uint32(4)) & jnp.uint32(0x0F0F0F0F)
        xlo, xhi = jnp.broadcast_to(xlo, q.shape), jnp.broadcast_to(xhi, q.shape)
        acc = _dp4a(hi, xhi, _dp4a(lo, xlo, jnp.zeros(q.shape, jnp.int32), interpret), interpret)
        return (acc.sum(axis=-1) - 8 * sm).astype(jnp.float32) * dx      # nibbles are value + 8
    if p.words:
        # nibble n of a word | 0x4B000000 is the float 2^23 + n: minus 2^23 + 8 gives n - 8
        acc = None
        for h in (0, 1):
            for j in range(4):
                nib = (q >> jnp.uint32(8 * j + 4 * h)) & jnp.uint32(15)
                f = jax.lax.bitcast_convert_type(nib | jnp.uint32(0x4B000000), jnp.float32) - 8388616.0
                t = f * xs[4 * h + j]
                acc = t if acc is None else acc + t
        return acc.sum(axis=-1)
    if p.fmt == "int4":
        qi = q.astype(jnp.int32)
        lo = (qi & 15).astype(jnp.float32) - 8.0
        hi = (qi >> 4).astype(jnp.float32) - 8.0
        return (lo * xs[0] + hi * xs[1]).sum(axis=-1)
    return (q.astype(jnp.float32) * xs[0]).sum(axis=-1)


def _rows_dot(p: _Proj, qs_ref, sc_ref, e, start, row0, BN: int, limit: int, span: int, xs,
              interpret: bool = False):
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
        qmask = jnp.broadcast_to(ok[:, :, None], (BN, p.NGP, p.QW))
    rs, gs = pl.ds(start + row0, BN), pl.ds(0, p.NGP)
    q = _load(qs_ref.at[e, rs, gs, :], qmask)                                   # [BN, NGP, QW]
    d = _load(sc_ref.at[e, rs, gs], smask).astype(jnp.float32)                  # [BN, NGP]
    s = _dequant_dot(p, q, tuple(x[None] for x in xs), interpret)
    return (s * d).sum(axis=-1)                                                  # masked: d == 0


def _top_k(l_ref, m, k: int, E: int, norm: bool):
    """Row m of the router logits l_ref [M, EP] (EP = E padded to 2^n with -inf): softmax, then the
    k largest probabilities (ties: the lower expert first, as lax.top_k) and their experts, in
    order; renormalised to sum 1 when `norm`. Returns two lists of k traced scalars."""
    import jax.numpy as jnp

    x = l_ref[m, :].astype(jnp.float32)
    p = jnp.exp(x - x.max())
    p = p / p.sum()
    ids = jnp.arange(x.shape[0])
    ws, es = [], []
    for _ in range(k):
        best = p.max()
        e = jnp.where(p == best, ids, E).min()
        ws.append(best)
        es.append(e)
        p = jnp.where(ids == e, -1.0, p)        # probabilities are >= 0: -1 takes e out
    if norm:
        total = ws[0]
        for w in ws[1:]:
            total = total + w
        ws = [w / total for w in ws]
    return ws, es


def _pick(vals: list, j):
    """vals[j] for a traced j."""
    import jax.numpy as jnp

    out = vals[0]
    for i in range(1, len(vals)):
        out = jnp.where(j == i, vals[i], out)
    return out


def _gate_up_kernel(ids_ref, *refs, p: _Proj, k: int, I: int, Ip: int, BN: int, route=None,
                    interpret: bool = False):
    """route (E, norm): ids_ref holds the router's logits [M, EP] and each program takes its
    expert from their top-k (no routing kernels in between); else the chosen ids [M*k]."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    pair, blk = pl.program_id(0), pl.program_id(1)
    if route is None:
        e = ids_ref[pair]
    else:
        e = _pick(_top_k(ids_ref, pair // k, k, *route)[1], pair % k)
    x_refs, (qs_ref, sc_ref, h_ref) = refs[:p.nx], refs[p.nx:]
    xs = _x_parts(p, x_refs, pair // k)
    row0 = blk * BN
    span = -(-Ip // BN) * BN
    g = _rows_dot(p, qs_ref, sc_ref, e, 0, row0, BN, I, span, xs, interpret)
    u = _rows_dot(p, qs_ref, sc_ref, e, I, row0, BN, I, span, xs, interpret)
    h = g / (1.0 + jnp.exp(-g)) * u                                             # rows >= I: 0
    _store_rows(h_ref, pair, row0, BN, Ip, h)


def _down_kernel(ids_ref, w_ref, *refs, p: _Proj, k: int, BN: int, route=None, interpret: bool = False):
    """route (E, norm): ids_ref holds the router's logits [M, EP] (w_ref unused), as in gate_up."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    h_refs, (qs_ref, sc_ref, o_ref) = refs[:p.nx], refs[p.nx:]
    m, blk = pl.program_id(0), pl.program_id(1)
    row0 = blk * BN
    span = -(-p.N // BN) * BN
    if route is None:
        ws = [w_ref[m * k + j] for j in range(k)]
        es = [ids_ref[m * k + j] for j in range(k)]
    else:
        ws, es = _top_k(ids_ref, m, k, *route)
    acc = jnp.zeros((BN,), jnp.float32)
    for j in range(k):                      # unrolled: the k experts' loads can overlap
        xs = _x_parts(p, h_refs, m * k + j)
        acc = acc + ws[j] * _rows_dot(p, qs_ref, sc_ref, es[j], 0, row0, BN, p.N, span, xs, interpret)
    _store_rows(o_ref, m, row0, BN, p.N, acc)


@functools.lru_cache(maxsize=None)
def _calls(gu: tuple, dn: tuple, M: int, k: int, interpret: bool, bn1: int, bn2: int, warps1: int, warps2: int,
           route=None, int4: str = "bytes"):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    pg, pd = _Proj(_Spec(*gu), int4), _Proj(_Spec(*dn), int4)
    I = pg.N // 2
    Ip = pd.Kp                               # h columns: down's K (= I) padded to its groups
    bn1 = min(bn1, _pow2(I))
    bn2 = min(bn2, _pow2(pd.N))
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps1, num_stages=1))
    gate_up = pl.pallas_call(
        functools.partial(_gate_up_kernel, p=pg, k=k, I=I, Ip=Ip, BN=bn1, route=route, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((M * k, Ip), jnp.float32),
        grid=(M * k, -(-Ip // bn1)), interpret=interpret, name="strata_moe_gate_up", **params)
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps2, num_stages=1))
    down = pl.pallas_call(
        functools.partial(_down_kernel, p=pd, k=k, BN=bn2, route=route, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((M, pd.N), jnp.float32),
        grid=(M, -(-pd.N // bn2)), interpret=interpret, name="strata_moe_down", **params)
    return pg, pd, gate_up, down


class _Spec:
    """The parts of a WeightSpec the kernels depend on (hashable, for the cache)."""

    def __init__(self, fmt, group_size, shape):
        self.fmt, self.group_size, self.shape = fmt, group_size, tuple(shape)


def _key(spec) -> tuple:
    return spec.fmt, spec.group_size or 32, tuple(spec.shape)


def moe_decode(x, topi, topw, gu_spec, gu_arrays: dict, dn_spec, dn_arrays: dict, *, interpret: bool = False,
               logits=None, k: int = 0, norm: bool = False):
    """sum_j topw[m, j] * down_e(silu(gate_e(x[m])) * up_e(x[m])), e = topi[m, j]: f32[M, D].

    x [M, D] (any float), topi int[M, k], topw [M, k]; *_arrays the stored arrays ({'qs',
    'scales'}) of the stacked expert weights gate_up [E, 2I, D] and down [E, D, I].
    Or, with `logits` [M, E] (topi/topw None): the routing itself — softmax, top-k (k), renormalised
    when `norm` — computed inside both kernels (no routing kernels of their own)."""
    import jax.numpy as jnp

    if logits is not None:
        M, E = logits.shape
        route = (E, bool(norm))
    else:
        (M, k), route = topi.shape, None
    pg, pd, gate_up, down = _calls(_key(gu_spec), _key(dn_spec), M, k, bool(interpret), *tuning(), route=route,
                                   int4=int4_mode())
    x = x.astype(jnp.float32)
    if pg.Kp != pg.K:
        x = jnp.pad(x, [(0, 0), (0, pg.Kp - pg.K)])
    if route is None:
        ids, w = topi.reshape(-1).astype(jnp.int32), topw.reshape(-1).astype(jnp.float32)
    else:
        EP = _pow2(E)
        ids = logits.astype(jnp.float32)
        if EP != E:
            ids = jnp.pad(ids, [(0, 0), (0, EP - E)], constant_values=-jnp.inf)
        w = jnp.zeros((1,), jnp.float32)
    h = gate_up(ids, *pg.x_in(x), pg.qs_view(gu_arrays["qs"]), gu_arrays["scales"])          # [M*k, Ip]
    return down(ids, w, *pd.x_in(h), pd.qs_view(dn_arrays["qs"]), dn_arrays["scales"])


# Dense int4 matrix-vector products at decode (lm_head, q/k/v, o, router when int4) as one Pallas
# kernel, with STRATA_PALLAS_INT4=dp4a only: with f32 activations XLA's fused multiply-reduce is
# as fast as these kernels (BENCHMARKS.md), so the Pallas path is worth it only for the integer
# dot products.
LINEAR_TUNING = (8, 4)       # rows per program, warps; STRATA_PALLAS_LINEAR_TUNE="bn,warps"


def use_linear(on_gpu: bool, spec, M: int) -> tuple[bool, bool]:
    """(use linear_decode, in interpret mode) for x[M, K] @ W^T with W stored as `spec`."""
    m = mode()
    if m in ("0", "off", "false", "no") or M > MAX_ROWS or int4_mode() != "dp4a":
        return False, False
    if spec.fmt != "int4" or len(spec.shape) != 2 or (spec.group_size or 32) % 8:
        return False, False
    if m == "interpret":
        return True, True
    return on_gpu, False


def _linear_kernel(*refs, p: _Proj, BN: int, interpret: bool = False):
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    x_refs, (qs_ref, sc_ref, o_ref) = refs[:p.nx], refs[p.nx:]
    m, blk = pl.program_id(0), pl.program_id(1)
    row0 = blk * BN
    span = -(-p.N // BN) * BN
    zero = jnp.int32(0)     # traced: interpret mode masks no python ints
    y = _rows_dot(p, qs_ref, sc_ref, zero, 0, row0, BN, p.N, span, _x_parts(p, x_refs, m), interpret)
    _store_rows(o_ref, m, row0, BN, p.N, y)


@functools.lru_cache(maxsize=None)
def _linear_call(key: tuple, M: int, interpret: bool, bn: int, warps: int, int4: str):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    fmt, G, (N, K) = key
    p = _Proj(_Spec(fmt, G, (1, N, K)), int4)
    bn = min(bn, _pow2(N))
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1))
    call = pl.pallas_call(functools.partial(_linear_kernel, p=p, BN=bn, interpret=interpret),
                          out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32), grid=(M, -(-N // bn)),
                          interpret=interpret, name="strata_linear_int4", **params)
    return p, call


def linear_decode(x, spec, arrays: dict, *, interpret: bool = False):
    """x[M, K] @ W[N, K]^T, f32[M, N], W an int4 weight by its stored arrays ({'qs', 'scales'})."""
    import jax.numpy as jnp

    t = os.environ.get("STRATA_PALLAS_LINEAR_TUNE")
    bn, warps = (int(v) for v in t.split(",")) if t else LINEAR_TUNING
    p, call = _linear_call(_key(spec), x.shape[0], bool(interpret), bn, warps, int4_mode())
    x = x.astype(jnp.float32)
    if p.Kp != p.K:
        x = jnp.pad(x, [(0, 0), (0, p.Kp - p.K)])
    return call(*p.x_in(x), p.qs_view(arrays["qs"]), arrays["scales"].reshape(1, p.N, p.ng))
