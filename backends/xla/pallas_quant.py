"""What the Pallas (Triton) decode kernels share: when they run, how they load blocks, and how
they read stored int4/int4a/int8 weights against an activation row.

Weights are read as u32 words (int4: nibbles masked into bytes) and multiplied by activations
quantized to int8 per group of G (q8, as llama.cpp's mmvq and the llvm CPU kernels) with integer
dot products (PTX dp4a, 4 products per instruction). int8 weights (signed bytes) take the
activations in two planes of int8 codes (q16: x ~ d (hi + lo / 254), about 15 bits, as the llvm
CPU kernels' default): twice the integer products, where one plane would round away more than the
weights' own 8 bits keep. Sums are f32.

The weights stay exactly as formats.py stores them (no repacking): int4 qs u8[E, N, Kp/2] is
viewed (a free reshape and bitcast) as u32 [E, N, Kp/G, G/8], where byte i of a group holds
value i (low nibble) and value i + G/2 (high nibble); the activation [Kp] is viewed as [Kp/G, 2,
G/8, 4], so its two halves of every group line up with the two nibbles of the group's bytes.
int8 qs i8[E, N, Kp] is viewed as u32 [E, N, Kp/G, G/4] (byte j of word w is value 4w + j), the
activation as [Kp/G, 1, G/4, 4]: one "half" where int4 has two. int4a (Q4_1's layout) is int4's nibbles with
a (scale, min) pair per group, its scales [E, N, 2 Kp/G] viewed as [E, N, Kp/G, 2]: a group's sum is
d dot(q, x) + m sum(x), the second term from the q8 block sums.

Triton needs power-of-two tensor sizes: the group axis is padded to the next power of two and
ragged row blocks are masked (masked lanes read scale 0, so they add nothing). On the CPU the
kernels run in Pallas interpret mode (tests).

Legend: R rows of the activation, E experts (or an expert cache's slots), N output rows, K input
columns, G group size, Kp = K rounded up to a multiple of G, ng = Kp / G groups, NGP = ng rounded
up to a power of two, W bytes per group, QW elements per group as loaded.
"""

from __future__ import annotations

from strata_compiler import settings

FORMATS = ("int4", "int8", "int4a")


def gate(on_gpu: bool, applies: bool) -> tuple[bool, bool]:
    """(use a decode kernel, in interpret mode) for a kernel that `applies` to the step at hand,
    under the `pallas` setting: auto (on a GPU), off, interpret (any platform: tests)."""
    m = settings.get("pallas")
    if m == "off" or not applies:
        return False, False
    if m == "interpret":
        return True, True
    return on_gpu, False


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class _Spec:
    """The parts of a WeightSpec the kernels depend on (hashable, for the kernel caches)."""

    def __init__(self, fmt, group_size, shape):
        self.fmt, self.group_size, self.shape = fmt, group_size, tuple(shape)


def _key(spec) -> tuple:
    return spec.fmt, spec.group_size or 32, tuple(spec.shape)


class _Proj:
    """Static geometry of one stored projection [E, N, K] and its kernel-side views."""

    def __init__(self, spec):
        self.fmt, self.G = spec.fmt, spec.group_size or 32
        self.E, self.N, self.K = spec.shape
        self.ng = -(-self.K // self.G)               # groups per row
        self.Kp = self.ng * self.G
        self.NGP = _pow2(self.ng)                    # group axis as loaded (power of two)
        self.paired = self.fmt == "int4a"            # a (scale, min) pair per group
        nib = self.fmt in ("int4", "int4a")
        self.W = self.G // 2 if nib else self.G                  # bytes per group
        self.dp4a = self.W % 4 == 0
        self.signed = not nib                                    # int8: signed bytes on both sides of dp4a
        self.halves = 2 if nib else 1                            # q8 word blocks per group (int4: a nibble each)
        self.planes = 2 if self.signed and self.dp4a else 1      # activation code planes: q16 for int8, q8 else
        self.QW = self.W // 4 if self.dp4a else self.W          # stored elements per group as loaded

    def qs_view(self, qs):
        """(Stacked experts: the leading axis is the array's own, E experts or an expert cache's S
        slots.)"""
        E = qs.shape[0] if qs.ndim == 3 else self.E
        if self.dp4a:       # [E, N, ng, W/4] u32: byte j of word w is byte 4w + j of the group
            import jax
            import jax.numpy as jnp

            return jax.lax.bitcast_convert_type(qs.reshape(E, self.N, self.ng, self.QW, 4), jnp.uint32)
        return qs.reshape(E, self.N, self.ng, self.W)

    def sc_view(self, sc):
        """The scales as the kernels load them: [E, N, ng], int4a's pairs [E, N, ng, 2]."""
        E = sc.shape[0] if sc.ndim == 3 else self.E
        return sc.reshape(E, self.N, self.ng, 2) if self.paired else sc.reshape(E, self.N, self.ng)

    def norm_view(self, w):
        """A norm's weight [K] in the dp4a view of one activation row: f32 [ng, halves, QW, 4]."""
        import jax.numpy as jnp

        w = jnp.pad(w.astype(jnp.float32), [(0, self.Kp - self.K)]) if self.Kp != self.K else w.astype(jnp.float32)
        return w.reshape(self.ng, self.halves, self.QW, 4)

    def x_view(self, x):
        """x [R, Kp] -> the layout the kernel loads: [R, ng, halves, QW, 4] (dp4a) or [R, ng, G]."""
        if self.dp4a:
            return x.reshape(x.shape[0], self.ng, self.halves, self.QW, 4)
        return x.reshape(x.shape[0], self.ng, self.W)


def _padded(x, p: _Proj):
    """x [R, K] as f32 [R, Kp]."""
    import jax.numpy as jnp

    x = x.astype(jnp.float32)
    return jnp.pad(x, [(0, 0), (0, p.Kp - p.K)]) if p.Kp != p.K else x


def fusable_norm(spec) -> bool:
    """Whether kernels reading a weight stored as `spec` can take an RMS norm as their prologue
    (the dp4a layout)."""
    fmt, G, shape = _key(spec)
    return _Proj(_Spec(fmt, G, shape if len(shape) == 3 else (1, *shape))).dp4a


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


def _row_block(ref, r, row0, BN: int, n: int):
    """ref[r, row0:row0 + BN] as f32 [BN], positions at or past n read as 0."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    mask = (row0 + jnp.arange(BN) < n) if n % BN else None
    return _load(ref.at[r, pl.ds(row0, BN)], mask).astype(jnp.float32)


def _x_parts(p: _Proj, x_ref, r, norm=None, with_inv: bool = False):
    """Row r of the activation as the kernels multiply it: without dp4a, one f32 [NGP, W] block;
    dp4a, its q8 (int8: q16) form (`_q8_parts`) of the 4 halves [NGP, QW] blocks (half, byte j) that line up
    with the bytes (int4: the nibbles) of the weight words, quantized here by every program that reads the row (a few
    thousand values, against the weight block it reads), or read as such when x_ref is a (words,
    scales, sums) triple that an earlier kernel wrote (`_store_q8`).
    norm (w_ref, eps), dp4a only: the row is RMS-normalised first (x / rms(x) * w, w viewed as the
    row is), so no separate norm kernel runs; with_inv: (parts, its 1/rms)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    gs = pl.ds(0, p.NGP)
    mask = gmask = None
    if p.NGP != p.ng:
        mask = jnp.broadcast_to((jnp.arange(p.NGP) < p.ng)[:, None], (p.NGP, p.QW))
        gmask = jnp.arange(p.NGP) < p.ng
    if isinstance(x_ref, tuple):
        wq, sq, tq = x_ref
        words = tuple(_load(wq.at[r, gs, pl.ds(h * p.QW, p.QW)], mask) for h in range(p.halves * p.planes))
        return (*words, _load(sq.at[r, gs], gmask), _load(tq.at[r, gs], gmask))
    if p.dp4a:
        # (half, byte) indices traced: interpret mode masks no python ints
        hj = [(jnp.int32(h), jnp.int32(j)) for h in range(p.halves) for j in range(4)]
        blocks = [_load(x_ref.at[r, gs, h, :, j], mask).astype(jnp.float32) for h, j in hj]
        inv = None
        if norm is not None:
            w_ref, eps = norm
            ss = None
            for b in blocks:
                t = (b * b).sum()
                ss = t if ss is None else ss + t
            inv = 1.0 / jnp.sqrt(ss / p.K + eps)
            blocks = [b * inv * _load(w_ref.at[gs, h, :, j], mask) for b, (h, j) in zip(blocks, hj)]
        parts = _q8_parts(blocks, p.planes)
        return (parts, inv) if with_inv else parts
    assert norm is None, "the norm prologue needs the dp4a layout"
    return (_load(x_ref.at[r, gs, :], mask).astype(jnp.float32),)


def _q8_inv(amax):
    """127 / max|x| (0 for an all-zero group): the q8 scale's reciprocal."""
    import jax.numpy as jnp

    return jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)


def _q8_values(x, inv):
    """floor(x inv + 1/2) as i32: the q8 rounding of every dp4a activation (|q| <= 127)."""
    import jax.numpy as jnp

    return jnp.floor(x * inv + 0.5).astype(jnp.int32)


def _q16_low(x, inv, hi):
    """The second plane of q16: floor((x inv - hi) 254 + 1/2) as i32 (|lo| <= 127), so that
    x ~ (hi + lo / 254) / inv."""
    import jax.numpy as jnp

    return jnp.floor((x * inv - hi.astype(jnp.float32)) * 254.0 + 0.5).astype(jnp.int32)


def _pack4(q):
    """i32 [..., 4] of q8 values -> u32 [...] with byte j the low byte of q[..., j]."""
    import jax
    import jax.numpy as jnp

    u = jax.lax.bitcast_convert_type(q, jnp.uint32) & jnp.uint32(0xFF)
    return (u << (jnp.arange(4, dtype=jnp.uint32) * jnp.uint32(8))).sum(axis=-1)


def _store_q8(out_refs, r, blk, h, G: int, planes: int = 1) -> None:
    """The G values h (one group of the next projection's input) as its dp4a q8 form (planes 2:
    q16, the second plane's words after the first's), at group blk of row r of (words i32 [R, ng,
    planes G/4], scales f32 [R, ng], sums i32 [R, ng])."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    wq, sq, tq = out_refs
    amax = jnp.abs(h).max()
    inv = _q8_inv(amax)
    x = h.reshape(G // 4, 4)
    q = _q8_values(x, inv)
    one = pl.ds(blk, 1)
    wq.at[r, one, pl.ds(0, G // 4)][...] = jax.lax.bitcast_convert_type(_pack4(q), jnp.int32)[None, :]
    if planes == 2:
        lo = _pack4(_q16_low(x, inv, q))
        wq.at[r, one, pl.ds(G // 4, G // 4)][...] = jax.lax.bitcast_convert_type(lo, jnp.int32)[None, :]
    sq.at[r, one][...] = jnp.full((1,), amax / 127.0, jnp.float32)
    tq.at[r, one][...] = jnp.full((1,), q.sum(), jnp.int32)


def _q8_parts(blocks: list, planes: int = 1):
    """q8 of one activation row, from its 4 halves f32 blocks [NGP, QW] (half h, byte j: element
    g G + h G/halves + 4w + j at [g, w]): (each half's words i32 [NGP, QW], with byte j of word w
    the q8 value of block (h, j) at w; with planes 2 then the second plane's words (`_q16_low`);
    scales f32 [NGP]; sums i32 [NGP] of each group's q8 values, for the -8 of the int4 weights).
    q = floor(x 127 / max|x| + 1/2) per group."""
    import jax
    import jax.numpy as jnp

    amax = None
    for b in blocks:
        m = jnp.abs(b).max(axis=-1)
        amax = m if amax is None else jnp.maximum(amax, m)
    inv = _q8_inv(amax)[:, None]
    qs = [_q8_values(b, inv) for b in blocks]
    if planes == 2:
        qs += [_q16_low(b, inv, q) for b, q in zip(blocks, qs)]
    total = None
    for q in qs[:len(blocks)]:
        t = q.sum(axis=-1)
        total = t if total is None else total + t
    words = []
    for h in range(len(qs) // 4):   # byte j of word w <- block (h, j) at w (no stacking: Triton has no such op)
        w = None
        for j in range(4):
            u = (jax.lax.bitcast_convert_type(qs[4 * h + j], jnp.uint32) & jnp.uint32(0xFF)) << jnp.uint32(8 * j)
            w = u if w is None else w | u
        words.append(jax.lax.bitcast_convert_type(w, jnp.int32))
    return (*words, amax / 127.0, total)


def _dp4a(a, b, c, interpret: bool, signed: bool = False):
    """c + sum over the 4 bytes of a (unsigned, or signed) times b (signed), per 32-bit lane
    (PTX dp4a); in interpret mode (the CPU: tests) the same in plain integer arithmetic."""
    import jax
    import jax.numpy as jnp

    if interpret:
        acc = c
        for j in range(4):
            aj = ((a >> jnp.uint32(8 * j)) & jnp.uint32(0xFF)).astype(jnp.int32)
            bj = (b >> (8 * j)) & 0xFF
            aj = jnp.where(aj >= 128, aj - 256, aj) if signed else aj
            acc = acc + aj * jnp.where(bj >= 128, bj - 256, bj)
        return acc
    from jax.experimental.pallas import triton as plgpu

    op = "dp4a.s32.s32" if signed else "dp4a.u32.s32"
    return plgpu.elementwise_inline_asm(op + " $0, $1, $2, $3;", args=[a, b, c], constraints="=r,r,r,r",
                                        pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])[0]


def _dequant_dot(p: _Proj, q, xs, interpret: bool = False):
    """sum over the last axis of q [..., NGP, QW] (stored integers, the weights' scale not applied)
    times the activation parts xs: [..., NGP]. dp4a: from the q8 activations, their scale applied;
    int4a: (that, the group's sum of x) [..., NGP] each, for its scale and its min."""
    import jax.numpy as jnp

    if p.signed and p.dp4a:                 # int8: signed weight bytes times the q16 planes, no offset
        hi, lo, dx, _ = xs
        zero = jnp.zeros(q.shape, jnp.int32)
        a = _dp4a(q, jnp.broadcast_to(hi, q.shape), zero, interpret, signed=True).sum(axis=-1)
        b = _dp4a(q, jnp.broadcast_to(lo, q.shape), zero, interpret, signed=True).sum(axis=-1)
        return (a.astype(jnp.float32) + b.astype(jnp.float32) * (1.0 / 254.0)) * dx
    if p.dp4a:
        xlo, xhi, dx, sm = xs
        lo = q & jnp.uint32(0x0F0F0F0F)
        hi = (q >> jnp.uint32(4)) & jnp.uint32(0x0F0F0F0F)
        xlo, xhi = jnp.broadcast_to(xlo, q.shape), jnp.broadcast_to(xhi, q.shape)
        acc = _dp4a(hi, xhi, _dp4a(lo, xlo, jnp.zeros(q.shape, jnp.int32), interpret), interpret)
        if p.paired:
            return acc.sum(axis=-1).astype(jnp.float32) * dx, sm.astype(jnp.float32) * dx
        return (acc.sum(axis=-1) - 8 * sm).astype(jnp.float32) * dx      # nibbles are value + 8
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
    q = _load(qs_ref.at[e, rs, gs, :], qmask)
    if p.paired:    # scale and min as two strided loads: Triton cannot slice a loaded [.., 2] block
        return q, tuple(_load(sc_ref.at[e, rs, gs, jnp.int32(i)], smask).astype(jnp.float32) for i in (0, 1))
    return q, _load(sc_ref.at[e, rs, gs], smask).astype(jnp.float32)


def _rows_apply(p: _Proj, w, xs, interpret: bool = False):
    """f32[BN]: the rows `w` (from `_rows_load`) dequantized, times the activation parts xs."""
    q, d = w
    s = _dequant_dot(p, q, tuple(x[None] for x in xs), interpret)
    if p.paired:                                                                 # d: (scale, min) [BN, NGP] each
        return (s[0] * d[0] + s[1] * d[1]).sum(axis=-1)
    return (s * d).sum(axis=-1)                                                  # masked: d == 0
