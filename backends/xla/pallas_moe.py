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

Routing inside (default when the route op ran in the same computation): gate_up takes the router
logits and computes softmax and top-k itself (ranks from one comparison of all E logits, ties to
the lower expert as lax.top_k) and hands the chosen experts and weights to down, which removes the
route's four small kernels (softmax, sort, two
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
Now (2026-11-30, dp4a, routing once in gate_up, the router in o's epilogue): gate_up 11.0 and down
5.6 us per layer, a layer about 6 launches, int4 batch-1 decode 1635 tok/s = 1.84x bf16
(BENCHMARKS.md).

Legend as in executor.py: M tokens, k experts per token, E experts, D hidden, I expert
intermediate, G group size, Kp = K rounded up to a multiple of G.
"""

from __future__ import annotations

import functools
import os

from strata_compiler.errors import UsageError

FORMATS = ("int4", "int8")
# Tokens per step up to which the MoE kernels are used (STRATA_PALLAS_MAX_ROWS, a power of two,
# overrides): above it, the XLA path that groups tokens by expert (it dequantizes every expert).
# H200, int4, batch-16 decode, one process (BENCHMARKS.md): 4434 tok/s with 16 against 1181 with
# 4. The dense projections' kernels stop at executor.MATVEC_ROWS rows before this.
MAX_ROWS = 16


def max_rows() -> int:
    return tune("STRATA_PALLAS_MAX_ROWS", (MAX_ROWS,))[0]


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


OFF = ("0", "off", "false", "no")


def mode() -> str:
    """STRATA_XLA_PALLAS: '0' never, 'interpret' always (Pallas interpret mode, any platform:
    tests), anything else (default '1'): on a GPU."""
    return os.environ.get("STRATA_XLA_PALLAS", "1").strip().lower()


def gate(on_gpu: bool, applies: bool) -> tuple[bool, bool]:
    """(use a decode kernel, in interpret mode) under STRATA_XLA_PALLAS, for a kernel that
    `applies` to the step at hand."""
    m = mode()
    if m in OFF or not applies:
        return False, False
    if m == "interpret":
        return True, True
    return on_gpu, False


def choice(env: str, values: tuple, default: str, aliases: dict | None = None) -> str:
    """env's value, one of `values` (case-insensitive; `aliases` map other spellings), else default
    when unset; anything else is one clear error."""
    m = os.environ.get(env, "").strip().lower() or default
    m = (aliases or {}).get(m, m)
    if m not in values:
        raise UsageError(f"{env}={os.environ.get(env)!r}: give one of {', '.join(values)} (default {default})")
    return m


def tune(env: str, default: tuple) -> tuple:
    """A kernel tuning: env's comma-separated powers of two (as many as `default`), else default."""
    t = os.environ.get(env)
    if not t:
        return tuple(default)
    try:
        vals = tuple(int(v) for v in t.split(","))
    except ValueError:
        vals = ()
    if len(vals) != len(default) or not all(_is_pow2(v) for v in vals):
        what = "a power of two" if len(default) == 1 else f"{len(default)} comma-separated powers of two"
        raise UsageError(f"{env}={t!r}: give {what} (default {','.join(map(str, default))})")
    return vals


def route_mode() -> str:
    """STRATA_XLA_PALLAS_ROUTE: where decode routing happens with the Pallas kernels (A/Bs).
    'fused' (default): gate_up takes softmax and top-k itself, and the router is the o
    projection's epilogue (`linear_decode(router=)`) where the layer allows;
    'kernel': as fused, but the router keeps its own kernel (`dense_decode`);
    '0': the route's own top-k (XLA) feeds the kernels."""
    return choice("STRATA_XLA_PALLAS_ROUTE", ("fused", "kernel", "0"), "fused", {v: "0" for v in OFF})


def route_inside() -> bool:
    return route_mode() != "0"


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
    return gate(on_gpu, M <= max_rows() and supported(gu_spec, dn_spec))


# Rows per program and warps of (gate_up, down): the fastest of sweeps on an H200 at the OLMoE
# shape (D 2048, I 1024, k 8, int4). f32 activations ('bytes', 'words'): gate_up took 23.0-24.6 us
# and down 21-29 us per layer (with a 10 us harness) over rows {4..32} x warps {2..8}. dp4a (h handed
# over in q8, so gate_up's rows are the down weights' group): whole decode steps, in one process,
# 32,4,4,4 1361 tok/s against 1346 for 32,8,4,8 and 1307-1350 for other warps (BENCHMARKS.md).
# STRATA_PALLAS_TUNE="bn1,bn2,w1,w2" overrides (powers of two).
TUNING = {"bytes": (4, 8, 4, 8), "words": (4, 8, 4, 8), "dp4a": (32, 4, 4, 4)}


def tuning() -> tuple[int, int, int, int]:
    return tune("STRATA_PALLAS_TUNE", TUNING[int4_mode()])


def int4_mode() -> str:
    """STRATA_PALLAS_INT4: how the kernels read int4 weights.
    'dp4a' (default): u32 loads, nibbles masked into bytes, integer dot products (PTX dp4a, 4
    products per instruction) against activations quantized to int8 per group of G (q8, as
    llama.cpp's mmvq and the llvm CPU kernels); the kernels quantize their input themselves, take
    the RMS norm before them and the residual add after them, and also cover the dense int4
    projections and the router (BENCHMARKS.md: 1.3x the decode rate of 'bytes' on an H200; logits
    within a few hundredths of their std of the f32-activation path, the same greedy tokens);
    'bytes': u8 loads, int->float conversions, f32 products with f32 activations (the MoE kernels
    only; the rest stays XLA's);
    'words': as bytes, with u32 loads (8 nibbles each) and floats built by the exponent trick."""
    return choice("STRATA_PALLAS_INT4", ("dp4a", "bytes", "words"), "dp4a")


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
        self.QW = self.W // 4 if self.words else self.W          # stored elements per group as loaded

    def qs_view(self, qs):
        """(Stacked experts: the leading axis is the array's own, E experts or an expert cache's S
        slots.)"""
        E = qs.shape[0] if qs.ndim == 3 else self.E
        if self.words:      # [E, N, ng, W/4] u32: byte j of word w is byte 4w + j of the group
            import jax
            import jax.numpy as jnp

            return jax.lax.bitcast_convert_type(qs.reshape(E, self.N, self.ng, self.QW, 4), jnp.uint32)
        return qs.reshape(E, self.N, self.ng, self.W)

    def norm_view(self, w):
        """A norm's weight [K] in the words view of one activation row: f32 [ng, 2, G/8, 4]."""
        import jax.numpy as jnp

        w = jnp.pad(w.astype(jnp.float32), [(0, self.Kp - self.K)]) if self.Kp != self.K else w.astype(jnp.float32)
        return w.reshape(self.ng, 2, self.QW, 4)

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


def _x_parts(p: _Proj, x_ref, r, norm=None, with_inv: bool = False):
    """Row r of the activation as [NGP, W] block(s): (low half, high half) for int4; words: the
    8 [NGP, W/4] blocks (half, byte j) that line up with the nibbles of the words; dp4a: their q8
    form (`_q8_parts`), quantized here by every program that reads the row (a few thousand values,
    against the weight block it reads), or read as such when x_ref is a (words, scales, sums)
    triple that an earlier kernel wrote (`_store_q8`).
    norm (w_ref, eps), words layouts only: the row is RMS-normalised first (x / rms(x) * w, w
    viewed as the row is), so no separate norm kernel runs; with_inv: (parts, its 1/rms)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    gs = pl.ds(0, p.NGP)
    mask = gmask = None
    if p.NGP != p.ng:
        mask = jnp.broadcast_to((jnp.arange(p.NGP) < p.ng)[:, None], (p.NGP, p.QW))
        gmask = jnp.arange(p.NGP) < p.ng
    if isinstance(x_ref, tuple):
        wq, sq, tq = x_ref
        return (_load(wq.at[r, gs, pl.ds(0, p.QW)], mask), _load(wq.at[r, gs, pl.ds(p.QW, p.QW)], mask),
                _load(sq.at[r, gs], gmask), _load(tq.at[r, gs], gmask))
    if p.words:
        hj = [(jnp.int32(h), jnp.int32(j)) for h in (0, 1) for j in range(4)]   # traced: see below
        blocks = [_load(x_ref.at[r, gs, h, :, j], mask).astype(jnp.float32) for h, j in hj]
        if norm is not None:
            w_ref, eps = norm
            ss = None
            for b in blocks:
                t = (b * b).sum()
                ss = t if ss is None else ss + t
            inv = 1.0 / jnp.sqrt(ss / p.K + eps)
            blocks = [b * inv * _load(w_ref.at[gs, h, :, j], mask) for b, (h, j) in zip(blocks, hj)]
        parts = _q8_parts(blocks) if p.dp4a else tuple(blocks)
        return (parts, inv) if with_inv else parts
    assert norm is None, "the norm prologue needs the words layout"
    if p.fmt == "int4":
        half0, half1 = jnp.int32(0), jnp.int32(1)   # traced: interpret mode masks no python ints
        return (_load(x_ref.at[r, gs, half0, :], mask).astype(jnp.float32),
                _load(x_ref.at[r, gs, half1, :], mask).astype(jnp.float32))
    return (_load(x_ref.at[r, gs, :], mask).astype(jnp.float32),)


def _q8_inv(amax):
    """127 / max|x| (0 for an all-zero group): the q8 scale's reciprocal."""
    import jax.numpy as jnp

    return jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)


def _q8_values(x, inv):
    """floor(x inv + 1/2) as i32: the q8 rounding of every dp4a activation (|q| <= 127)."""
    import jax.numpy as jnp

    return jnp.floor(x * inv + 0.5).astype(jnp.int32)


def _pack4(q):
    """i32 [..., 4] of q8 values -> u32 [...] with byte j the low byte of q[..., j]."""
    import jax
    import jax.numpy as jnp

    u = jax.lax.bitcast_convert_type(q, jnp.uint32) & jnp.uint32(0xFF)
    return (u << (jnp.arange(4, dtype=jnp.uint32) * jnp.uint32(8))).sum(axis=-1)


def _store_q8(out_refs, r, blk, h, G: int) -> None:
    """The G values h (one group of the next projection's input) as its dp4a q8 form, at group
    blk of row r of (words i32 [R, ng, G/4], scales f32 [R, ng], sums i32 [R, ng])."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    wq, sq, tq = out_refs
    amax = jnp.abs(h).max()
    q = _q8_values(h.reshape(G // 4, 4), _q8_inv(amax))
    one = pl.ds(blk, 1)
    wq.at[r, one, :][...] = jax.lax.bitcast_convert_type(_pack4(q), jnp.int32)[None, :]
    sq.at[r, one][...] = jnp.full((1,), amax / 127.0, jnp.float32)
    tq.at[r, one][...] = jnp.full((1,), q.sum(), jnp.int32)


def _q8_parts(blocks: list):
    """q8 of one activation row, from its 8 f32 blocks [NGP, W/4] (half h, byte j: element
    g G + h G/2 + 4w + j at [g, w]): (low-half words, high-half words i32 [NGP, W/4], with byte j
    of word w the q8 value of block (h, j) at w; scales f32 [NGP]; sums i32 [NGP] of each group's
    q8 values, for the -8 of the int4 weights). q = floor(x 127 / max|x| + 1/2) per group."""
    import jax
    import jax.numpy as jnp

    amax = None
    for b in blocks:
        m = jnp.abs(b).max(axis=-1)
        amax = m if amax is None else jnp.maximum(amax, m)
    inv = _q8_inv(amax)[:, None]
    qs = [_q8_values(b, inv) for b in blocks]
    total = None
    for q in qs:
        t = q.sum(axis=-1)
        total = t if total is None else total + t
    words = []
    for h in (0, 1):        # byte j of word w <- block (h, j) at w (no stacking: Triton has no such op)
        w = None
        for j in range(4):
            u = (jax.lax.bitcast_convert_type(qs[4 * h + j], jnp.uint32) & jnp.uint32(0xFF)) << jnp.uint32(8 * j)
            w = u if w is None else w | u
        words.append(jax.lax.bitcast_convert_type(w, jnp.int32))
    return words[0], words[1], amax / 127.0, total


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


def _rows_load(p: _Proj, qs_ref, sc_ref, e, start, row0, BN: int, limit: int, span: int, on=None):
    """(q [BN, NGP, QW], scales f32 [BN, NGP]) of rows start + row0 + [0, BN) of expert e; rows at
    or past `limit` (counted from `start`) read nothing and get scale 0 (the grid spans `span` rows).
    `on` (a traced bool): where false, nothing is read at all (zeros; the masked loads move no
    bytes). The kernels issue these loads before they prepare their activations, so the weights'
    memory latency overlaps that work (Triton keeps the program order of loads)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    rows = row0 + jnp.arange(BN)
    qmask = smask = None
    if span > limit or p.NGP != p.ng or on is not None:
        ok = (rows < limit)[:, None] & (jnp.arange(p.NGP) < p.ng)[None, :]     # [BN, NGP]
        if on is not None:
            ok = ok & on
        smask = ok
        qmask = jnp.broadcast_to(ok[:, :, None], (BN, p.NGP, p.QW))
    rs, gs = pl.ds(start + row0, BN), pl.ds(0, p.NGP)
    return _load(qs_ref.at[e, rs, gs, :], qmask), _load(sc_ref.at[e, rs, gs], smask).astype(jnp.float32)


def _expert_rows(p: _Proj, w_refs, e, start, row0, BN: int, limit: int, span: int):
    """_rows_load of expert e from w_refs: (qs, scales) of the stacked experts, or with an expert
    cache's slots (qs, scales, slot_of, slot qs, slot scales): from its slot where slot_of[e] >= 0
    (device memory), else from the whole stacked arrays (host memory mapped into the GPU's address
    space, runtime/mapped.py: read over PCIe). Each load is masked by the other's condition, so
    only one of them moves bytes."""
    import jax.numpy as jnp

    if len(w_refs) == 2:
        return _rows_load(p, *w_refs, e, start, row0, BN, limit, span)
    qs_ref, sc_ref, slot_ref, qs_slot, sc_slot = w_refs
    s = slot_ref[e]
    hit = s >= 0
    qa, da = _rows_load(p, qs_slot, sc_slot, jnp.maximum(s, 0), start, row0, BN, limit, span, on=hit)
    qb, db = _rows_load(p, qs_ref, sc_ref, e, start, row0, BN, limit, span, on=~hit)
    return jnp.where(hit, qa, qb), jnp.where(hit, da, db)


def _rows_apply(p: _Proj, w, xs, interpret: bool = False):
    """f32[BN]: the rows `w` (from `_rows_load`) dequantized, times the activation parts xs."""
    q, d = w
    s = _dequant_dot(p, q, tuple(x[None] for x in xs), interpret)
    return (s * d).sum(axis=-1)                                                  # masked: d == 0


def _ranks(x):
    """Rank of every logit of x [EP] (0 = the largest; ties: the lower index first, as lax.top_k),
    from one [EP, EP] comparison (rank i = how many logits beat logit i): a few reductions, not k
    rounds of argmax."""
    import jax.numpy as jnp

    ids = jnp.arange(x.shape[0])
    beats = (x[None, :] > x[:, None]) | ((x[None, :] == x[:, None]) & (ids[None, :] < ids[:, None]))
    return beats.astype(jnp.int32).sum(axis=1)


def _route_weight(x, rank, mine, k: int, norm: bool):
    """Routing weight of the expert `mine` marks: softmax of the logits x [EP] at it, renormalised
    over the top k (rank < k) when `norm`."""
    import jax.numpy as jnp

    ex = jnp.exp(x - x.max())
    total = jnp.where(rank < k, ex, 0.0).sum() if norm else ex.sum()
    return jnp.where(mine, ex, 0.0).sum() / total


def _gate_up_kernel(ids_ref, *refs, p: _Proj, k: int, I: int, Ip: int, BN: int, route=None,
                    interpret: bool = False, eps=None, q8_out: bool = False, cached: bool = False):
    """route (norm, E, partials: P or 0): each program takes its expert from the top-k of the router
    logits of its token (`_ranks`: no routing kernels in between), and the first program of each
    (token, rank) pair also writes the pair's expert and weight for the down kernel (the last two
    outputs). ids_ref holds the logits [M, EP] (E padded to 2^n with -inf), or, with `partials`,
    the o projection's router epilogue [M, P, EP]: partial sums over its row blocks of the router
    applied to the norm weight times x, not yet divided by x's rms (taken here, from the norm
    prologue, which `partials` needs). Without route, ids_ref holds the chosen ids [M*k].
    eps: x arrives un-normalised, with the norm's weight after it (`_x_parts` norm prologue).
    q8_out (BN = the down projection's group): h leaves in its dp4a q8 form (`_store_q8`), one
    group per program, so the down kernel reads it as is.
    cached: the weights come with an expert cache's slot map and slots after them
    (`_expert_rows`)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    pair, blk = pl.program_id(0), pl.program_id(1)
    m = pair // k
    if route is None:
        e = ids_ref[pair]
    else:
        renorm, E, partials = route
        if partials:        # P row blocks' sums, loaded as 2^n rows (Triton's blocks), the rest masked
            PP, EP = _pow2(partials), ids_ref.shape[2]
            mask = jnp.broadcast_to((jnp.arange(PP) < partials)[:, None], (PP, EP)) if PP != partials else None
            z = _load(ids_ref.at[m, pl.ds(0, PP), :], mask).sum(axis=0)
            z = jnp.where(jnp.arange(EP) < E, z, -jnp.inf)
        else:
            z = ids_ref[m, :].astype(jnp.float32)
        rank = _ranks(z)
        mine = rank == pair % k
        e = jnp.where(mine, jnp.arange(z.shape[0]), 0).sum()
        refs, (e_out, w_out) = refs[:-2], refs[-2:]
    x_ref, refs = refs[0], refs[1:]
    norm = None
    if eps is not None:
        norm, refs = (refs[0], eps), refs[1:]
    nw = 5 if cached else 2
    w_refs, outs = refs[:nw], refs[nw:]
    row0 = blk * BN
    span = -(-Ip // BN) * BN
    wg = _expert_rows(p, w_refs, e, 0, row0, BN, I, span)
    wu = _expert_rows(p, w_refs, e, I, row0, BN, I, span)
    if route is not None and partials:
        xs, inv = _x_parts(p, x_ref, m, norm, with_inv=True)
        z = z * inv
    else:
        xs = _x_parts(p, x_ref, m, norm)
    g, u = _rows_apply(p, wg, xs, interpret), _rows_apply(p, wu, xs, interpret)
    h = g / (1.0 + jnp.exp(-g)) * u                                             # rows >= I: 0
    if q8_out:
        _store_q8(outs, pair, blk, h, BN)
    else:
        _store_rows(outs[0], pair, row0, BN, Ip, h)
    if route is not None:
        w = _route_weight(z, rank, mine, k, renorm)

        @pl.when(blk == 0)
        def _():
            one = pl.ds(pair, 1)
            e_out.at[one][...] = jnp.full((1,), e, jnp.int32)
            w_out.at[one][...] = jnp.full((1,), w, jnp.float32)


def _down_kernel(ids_ref, w_ref, *refs, p: _Proj, k: int, BN: int, interpret: bool = False,
                 q8_in: bool = False, residual: bool = False, cached: bool = False):
    """ids_ref, w_ref [M*k]: the chosen experts and their weights (the route's, or gate_up's when
    it routed). q8_in: h comes as gate_up's q8 triple; residual: a [M, D] array added to the
    output; cached: the weights come with an expert cache's slot map and slots (`_expert_rows`)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    if q8_in:
        h_ref, refs = tuple(refs[:3]), refs[3:]
    else:
        h_ref, refs = refs[0], refs[1:]
    nw = 5 if cached else 2
    w_refs, o_ref = refs[:nw], refs[-1]
    m, blk = pl.program_id(0), pl.program_id(1)
    row0 = blk * BN
    span = -(-p.N // BN) * BN
    ws = [w_ref[m * k + j] for j in range(k)]
    # unrolled, every expert's weights requested before any arithmetic: the loads overlap
    rows = [_expert_rows(p, w_refs, ids_ref[m * k + j], 0, row0, BN, p.N, span) for j in range(k)]
    acc = _row_block(refs[nw], m, row0, BN, p.N) if residual else jnp.zeros((BN,), jnp.float32)
    for j in range(k):
        acc = acc + ws[j] * _rows_apply(p, rows[j], _x_parts(p, h_ref, m * k + j), interpret)
    _store_rows(o_ref, m, row0, BN, p.N, acc)


def _row_block(ref, r, row0, BN: int, n: int):
    """ref[r, row0:row0 + BN] as f32 [BN], positions at or past n read as 0."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    mask = (row0 + jnp.arange(BN) < n) if n % BN else None
    return _load(ref.at[r, pl.ds(row0, BN)], mask).astype(jnp.float32)


def q8_between(gu_spec, dn_spec, int4: str) -> bool:
    """Whether gate_up hands h to down in q8 form: dp4a down weights whose groups tile I exactly
    (one group per gate_up program)."""
    pd = _Proj(_Spec(*_key(dn_spec)), int4)
    return pd.dp4a and pd.K == pd.Kp and _is_pow2(pd.G) and pd.G <= 128


@functools.lru_cache(maxsize=None)
def _calls(gu: tuple, dn: tuple, M: int, k: int, interpret: bool, bn1: int, bn2: int, warps1: int, warps2: int,
           route=None, int4: str = "bytes", eps=None, residual: bool = False, cached: bool = False):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    pg, pd = _Proj(_Spec(*gu), int4), _Proj(_Spec(*dn), int4)
    I = pg.N // 2
    Ip = pd.Kp                               # h columns: down's K (= I) padded to its groups
    q8 = q8_between(_Spec(*gu), _Spec(*dn), int4)
    bn1 = pd.G if q8 else min(bn1, _pow2(I))
    bn2 = min(bn2, _pow2(pd.N))
    if q8:
        h_shape = (jax.ShapeDtypeStruct((M * k, pd.ng, pd.G // 4), jnp.int32),
                   jax.ShapeDtypeStruct((M * k, pd.ng), jnp.float32), jax.ShapeDtypeStruct((M * k, pd.ng), jnp.int32))
    else:
        h_shape = (jax.ShapeDtypeStruct((M * k, Ip), jnp.float32),)
    if route is not None:       # gate_up routes and hands the choice on: experts, weights [M*k]
        h_shape += (jax.ShapeDtypeStruct((M * k,), jnp.int32), jax.ShapeDtypeStruct((M * k,), jnp.float32))
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps1, num_stages=1))
    gate_up = pl.pallas_call(
        functools.partial(_gate_up_kernel, p=pg, k=k, I=I, Ip=Ip, BN=bn1, route=route, interpret=interpret,
                          eps=eps, q8_out=q8, cached=cached),
        out_shape=h_shape, grid=(M * k, -(-Ip // bn1)), interpret=interpret, name="strata_moe_gate_up", **params)
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps2, num_stages=1))
    down = pl.pallas_call(
        functools.partial(_down_kernel, p=pd, k=k, BN=bn2, interpret=interpret, q8_in=q8, residual=residual,
                          cached=cached),
        out_shape=jax.ShapeDtypeStruct((M, pd.N), jnp.float32),
        grid=(M, -(-pd.N // bn2)), interpret=interpret, name="strata_moe_down", **params)
    return pg, pd, q8, gate_up, down


class _Spec:
    """The parts of a WeightSpec the kernels depend on (hashable, for the cache)."""

    def __init__(self, fmt, group_size, shape):
        self.fmt, self.group_size, self.shape = fmt, group_size, tuple(shape)


def _key(spec) -> tuple:
    return spec.fmt, spec.group_size or 32, tuple(spec.shape)


def moe_decode(x, topi, topw, gu_spec, gu_arrays: dict, dn_spec, dn_arrays: dict, *, interpret: bool = False,
               logits=None, k: int = 0, norm: bool = False, rms=None, residual=None, partials=None,
               n_experts: int = 0, slots=None, with_ids: bool = False):
    """sum_j topw[m, j] * down_e(silu(gate_e(x[m])) * up_e(x[m])), e = topi[m, j]: f32[M, D].

    x [M, D] (any float), topi int[M, k], topw [M, k]; *_arrays the stored arrays ({'qs',
    'scales'}) of the stacked expert weights gate_up [E, 2I, D] and down [E, D, I].
    Or, with `logits` [M, E] (topi/topw None): the routing itself — softmax, top-k (k), renormalised
    when `norm` — computed inside gate_up (no routing kernels of their own). Or, with `partials`
    [M, P, EP] (and n_experts, rms): the logits as `linear_decode(router=)` leaves them, summed
    and divided by x's rms in gate_up (the router has no kernel of its own either).
    rms (w [D], eps): x is un-normalised, gate_up normalises it (`fusable_norm` says when);
    residual [M, D]: added to the result by the down kernel.
    slots (slot_of int32 [E], gate_up's slot arrays, down's slot arrays): an expert cache's GPU
    slots; expert e reads its weights from slot slot_of[e] where that is >= 0, else from *_arrays
    (then the whole layer in host memory the GPU reads in place: runtime/mapped.py).
    with_ids: also return the chosen experts, int32 [M*k] (the route's or gate_up's)."""
    import jax.numpy as jnp

    if partials is not None:
        M, E = partials.shape[0], int(n_experts)
        route = (bool(norm), E, partials.shape[1])
        assert rms is not None, "router partials need the norm prologue (its 1/rms divides them)"
    elif logits is not None:
        M, E = logits.shape
        route = (bool(norm), E, 0)
    else:
        (M, k), route = topi.shape, None
    eps = float(rms[1]) if rms is not None else None
    pg, pd, q8, gate_up, down = _calls(_key(gu_spec), _key(dn_spec), M, k, bool(interpret), *tuning(), route=route,
                                       int4=int4_mode(), eps=eps, residual=residual is not None,
                                       cached=slots is not None)
    if route is None:
        ids = topi.reshape(-1).astype(jnp.int32)
    elif partials is not None:
        ids = partials
    else:
        EP = _pow2(E)
        ids = logits.astype(jnp.float32)
        if EP != E:
            ids = jnp.pad(ids, [(0, 0), (0, EP - E)], constant_values=-jnp.inf)
    xin = [pg.x_view(_padded(x, pg))] + ([pg.norm_view(rms[0])] if rms is not None else [])
    gw = [pg.qs_view(gu_arrays["qs"]), gu_arrays["scales"]]
    dw = [pd.qs_view(dn_arrays["qs"]), dn_arrays["scales"]]
    if slots is not None:
        slot_of = slots[0].astype(jnp.int32)
        gw += [slot_of, pg.qs_view(slots[1]["qs"]), slots[1]["scales"]]
        dw += [slot_of, pd.qs_view(slots[2]["qs"]), slots[2]["scales"]]
    out = gate_up(ids, *xin, *gw)   # h [M*k, Ip] or its q8 (+ ids, w)
    if route is None:
        h, w = out, topw.reshape(-1).astype(jnp.float32)
    else:
        h, ids, w = out[:-2], out[-2], out[-1]
    hin = list(h) if q8 else [pd.x_view(h[0])]
    res = [residual.astype(jnp.float32)] if residual is not None else []
    y = down(ids, w, *hin, *dw, *res)
    return (y, ids) if with_ids else y


def _padded(x, p: _Proj):
    """x [R, K] as f32 [R, Kp]."""
    import jax.numpy as jnp

    x = x.astype(jnp.float32)
    return jnp.pad(x, [(0, 0), (0, p.Kp - p.K)]) if p.Kp != p.K else x


def fusable_norm(spec) -> bool:
    """Whether kernels reading a weight stored as `spec` can take an RMS norm as their prologue
    (the words layout of dp4a)."""
    fmt, G, shape = _key(spec)
    return _Proj(_Spec(fmt, G, shape if len(shape) == 3 else (1, *shape)), int4_mode()).words


# Dense int4 matrix-vector products at decode (lm_head, q/k/v, o, router when int4) as one Pallas
# kernel, with STRATA_PALLAS_INT4=dp4a only: with f32 activations XLA's fused multiply-reduce is
# as fast as these kernels (BENCHMARKS.md), so the Pallas path is worth it only for the integer
# dot products.
# rows per program, warps; STRATA_PALLAS_LINEAR_TUNE="bn,warps". Decode steps on an H200 (one
# process, BENCHMARKS.md): 32,8 1359 tok/s; 64,8 1347; 64,4 1329; 128,8 1255; 8,4 1229 (every
# program normalises and quantizes the whole row: few rows per program repeat that too often).
LINEAR_TUNING = (32, 8)


# Rows up to which dense int4 projections use linear_decode (STRATA_PALLAS_LINEAR_ROWS, a power of
# two; default 4, where XLA's multiply-reduce stops too: executor.MATVEC_ROWS); above it, XLA's
# dequantize + dot. Each row is a program row of its own that reads the weight block again (from
# the L2 when the rows' programs run together); not yet measured above 4 rows.
LINEAR_ROWS = 4


def use_linear(on_gpu: bool, spec, M: int) -> tuple[bool, bool]:
    """(use linear_decode, in interpret mode) for x[M, K] @ W^T with W stored as `spec`."""
    return gate(on_gpu, M <= tune("STRATA_PALLAS_LINEAR_ROWS", (LINEAR_ROWS,))[0] and int4_mode() == "dp4a" and spec.fmt == "int4" and len(spec.shape) == 2
                and (spec.group_size or 32) % 8 == 0)


def _linear_kernel(*refs, p: _Proj, BN: int, interpret: bool = False, eps=None, residual: bool = False,
                   router=None):
    """eps: an RMS norm prologue (its weight follows x); residual: [M, N] added to the output.
    router (E, bf16): an epilogue for the projection before a router (o, whose output y is the
    residual stream the MoE's norm and router read): the router's columns of this program's rows
    times the norm's weight times y, summed over the rows -> partials [M, programs, EP] (the norm's
    1/rms, which needs the whole row, is left to the consumer: `_gate_up_kernel`)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    x_ref, refs = refs[0], refs[1:]
    norm = None
    if eps is not None:
        norm, refs = (refs[0], eps), refs[1:]
    qs_ref, sc_ref, refs = refs[0], refs[1], refs[2:]
    m, blk = pl.program_id(0), pl.program_id(1)
    row0 = blk * BN
    span = -(-p.N // BN) * BN
    zero = jnp.int32(0)     # traced: interpret mode masks no python ints
    w = _rows_load(p, qs_ref, sc_ref, zero, 0, row0, BN, p.N, span)
    y = _rows_apply(p, w, _x_parts(p, x_ref, m, norm), interpret)
    if residual:
        y = y + _row_block(refs[0], m, row0, BN, p.N)
        refs = refs[1:]
    _store_rows(refs[-1] if router is None else refs[-2], m, row0, BN, p.N, y)
    if router is None:
        return
    E, bf16 = router
    wr_ref, nw_ref, _, z_ref = refs
    EP = _pow2(E)
    rows = row0 + jnp.arange(BN)
    mask = None
    if EP != E or p.N % BN:
        mask = (jnp.arange(EP) < E)[:, None] & (rows < p.N)[None, :]
    wr = _widen(_load(wr_ref.at[pl.ds(0, EP), pl.ds(row0, BN)], mask), bf16)            # [EP, BN]
    yw = y * _row_block(nw_ref, zero, row0, BN, p.N)
    z_ref.at[m, pl.ds(blk, 1), :][...] = (wr * yw[None, :]).sum(axis=1)[None, :]


def _widen(w, bf16: bool):
    """Router weights as loaded -> f32 (bf16 is stored as u16 bit patterns: an f32's high half)."""
    import jax
    import jax.numpy as jnp

    if bf16:
        return jax.lax.bitcast_convert_type(w.astype(jnp.uint32) << jnp.uint32(16), jnp.float32)
    return w.astype(jnp.float32)


@functools.lru_cache(maxsize=None)
def _linear_call(key: tuple, M: int, interpret: bool, bn: int, warps: int, int4: str, eps=None,
                 residual: bool = False, router=None):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    fmt, G, (N, K) = key
    p = _Proj(_Spec(fmt, G, (1, N, K)), int4)
    bn = min(bn, _pow2(N))
    out = jax.ShapeDtypeStruct((M, N), jnp.float32)
    if router is not None:
        out = (out, jax.ShapeDtypeStruct((M, -(-N // bn), _pow2(router[0])), jnp.float32))
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1))
    call = pl.pallas_call(functools.partial(_linear_kernel, p=p, BN=bn, interpret=interpret, eps=eps,
                                            residual=residual, router=router),
                          out_shape=out, grid=(M, -(-N // bn)), interpret=interpret, name="strata_linear_int4",
                          **params)
    return p, call


def linear_decode(x, spec, arrays: dict, *, interpret: bool = False, rms=None, residual=None, router=None):
    """x[M, K] @ W[N, K]^T, f32[M, N], W an int4 weight by its stored arrays ({'qs', 'scales'}).
    rms (w [K], eps): x is un-normalised and the kernel normalises it; residual [M, N]: added.
    router (spec, arrays, norm weight [N]) of an f32/bf16 router [E, N] that reads rms_norm of the
    output: returns (output, partials [M, P, EP]) for `moe_decode(partials=)`, so the router
    needs no kernel of its own."""
    import jax.numpy as jnp

    bn, warps = tune("STRATA_PALLAS_LINEAR_TUNE", LINEAR_TUNING)
    eps = float(rms[1]) if rms is not None else None
    rkey = (router[0].shape[0], router[0].fmt == "bf16") if router is not None else None
    p, call = _linear_call(_key(spec), x.shape[0], bool(interpret), bn, warps, int4_mode(), eps,
                           residual is not None, rkey)
    args = [p.x_view(_padded(x, p))] + ([p.norm_view(rms[0])] if rms is not None else [])
    args += [p.qs_view(arrays["qs"]), arrays["scales"].reshape(1, p.N, p.ng)]
    args += [residual.astype(jnp.float32)] if residual is not None else []
    if router is not None:
        args += [_dense_bits(router[0], router[1]), router[2].astype(jnp.float32).reshape(1, p.N)]
    return call(*args)


def router_fusable(spec, router_spec) -> bool:
    """Whether linear_decode of a weight stored as `spec` can take the router `router_spec`
    (f32/bf16 [E, N]) as its epilogue."""
    return (router_spec.fmt in ("f32", "bf16") and len(router_spec.shape) == 2
            and router_spec.shape[1] == spec.shape[0])


# The router at decode (f32 or bf16 [E, D], a few rows): one small kernel that also applies the RMS
# norm before it, so the norm's own kernels go (the MoE kernels normalise x themselves).
# rows per program, warps; STRATA_PALLAS_DENSE_TUNE="bn,warps". H200 decode steps: 2,4 1377
# tok/s; 1,2 1366; 4,4 1350; 8,8 1332.
DENSE_TUNING = (2, 4)


def use_dense(on_gpu: bool, spec, M: int) -> tuple[bool, bool]:
    """(use dense_decode, in interpret mode) for x[M, K] @ W^T with W stored as `spec`: f32/bf16,
    with the dp4a kernels on (whose MoE and linear kernels take the norm as a prologue)."""
    return gate(on_gpu, M <= max_rows() and int4_mode() == "dp4a" and spec.fmt in ("f32", "bf16")
                and len(spec.shape) == 2)


def _dense_kernel(x_ref, nw_ref, w_ref, o_ref, *, N: int, K: int, BN: int, eps: float, bf16: bool):
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    m, blk = pl.program_id(0), pl.program_id(1)
    KP = _pow2(K)
    kmask = (jnp.arange(KP) < K) if KP != K else None
    x = _load(x_ref.at[m, pl.ds(0, KP)], kmask).astype(jnp.float32)
    x = x * (1.0 / jnp.sqrt((x * x).sum() / K + eps)) * _load(nw_ref.at[pl.ds(0, KP)], kmask).astype(jnp.float32)
    row0 = blk * BN
    rows = row0 + jnp.arange(BN)
    wmask = None
    if N % BN or KP != K:
        wmask = (rows < N)[:, None] & (jnp.arange(KP) < K)[None, :]
    w = _widen(_load(w_ref.at[pl.ds(row0, BN), pl.ds(0, KP)], wmask), bf16)
    _store_rows(o_ref, m, row0, BN, N, (w * x[None, :]).sum(axis=-1))


@functools.lru_cache(maxsize=None)
def _dense_call(N: int, K: int, M: int, bf16: bool, eps: float, interpret: bool, bn: int, warps: int):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    bn = min(bn, _pow2(N))
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1))
    return pl.pallas_call(functools.partial(_dense_kernel, N=N, K=K, BN=bn, eps=eps, bf16=bf16),
                          out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32), grid=(M, -(-N // bn)),
                          interpret=interpret, name="strata_norm_dense", **params)


def dense_decode(x, spec, arrays: dict, rms, *, interpret: bool = False):
    """rms_norm(x) @ W[N, K]^T, f32[M, N], W stored f32 or bf16 ({'w'}), rms = (norm weight [K], eps)."""
    import jax.numpy as jnp

    N, K = spec.shape
    call = _dense_call(N, K, x.shape[0], spec.fmt == "bf16", float(rms[1]), bool(interpret),
                       *tune("STRATA_PALLAS_DENSE_TUNE", DENSE_TUNING))
    return call(x.astype(jnp.float32), rms[0].astype(jnp.float32), _dense_bits(spec, arrays))


def _dense_bits(spec, arrays: dict):
    """An f32/bf16 weight's array as the kernels load it (bf16 as its u16 bit patterns)."""
    import jax
    import jax.numpy as jnp

    w = arrays["w"]
    if spec.fmt == "bf16" and w.dtype != jnp.uint16:
        w = jax.lax.bitcast_convert_type(w, jnp.uint16)
    return w
