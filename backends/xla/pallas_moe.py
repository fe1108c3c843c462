"""Decode MoE of one layer as two Pallas (Triton) kernels over the stored packed expert weights.

At decode (a few tokens) the step is bound by kernel launches, not bytes; here a layer's MoE is
two launches instead of XLA's several small ones:

  gate_up  grid (M*k pairs, row blocks of I): each program takes its pair's expert, loads a block
           of gate rows and the same block of up rows straight from the stored arrays, dots them
           with the token's activation (pallas_quant.py) and writes silu(gate) * up
           -> h [M*k, Ip], for dp4a down weights in q8 form (one group per program)
  down     grid (M tokens, row blocks of D): each program loops over the token's k experts,
           dots its block of down rows with h and accumulates the routing-weighted sum
           (no atomics: one program owns its output rows)                       -> out [M, D]

When the route op ran in the same computation, gate_up routes itself: softmax and top-k over the
router logits (ranks from one comparison of all E logits, ties to the lower expert as lax.top_k),
or over the partial router sums the o projection's kernel left (pallas_dense.linear_decode
router=), and hands the chosen experts and weights to down: no routing kernels in between. The
RMS norm before the MoE can be gate_up's prologue and the residual add down's epilogue.

Legend: M tokens, k experts per token, E experts, D hidden, I expert intermediate, G group size,
Kp = K rounded up to a multiple of G, Ip = I so rounded (down's groups).
"""

from __future__ import annotations

import functools

from strata_compiler import settings

from .pallas_quant import (FORMATS, _Proj, _Spec, _is_pow2, _key, _load, _padded, _pow2, _row_block, _rows_apply,
                           _rows_load, _store_q8, _store_rows, _x_parts, gate)


def max_rows() -> int:
    """Tokens per step up to which the MoE runs on these kernels; above it, XLA's path that groups
    tokens by expert."""
    return settings.get("pallas_max_rows")[0]


def tuning() -> tuple[int, int, int, int]:
    """Rows per program and warps of (gate_up, down); gate_up's rows are the down weights' group
    when h passes in q8 form."""
    return settings.get("pallas_tune")


def supported(gu_spec, dn_spec) -> bool:
    """Whether both projections' stored formats have a kernel here: int8 with a power-of-two
    group, int4/int4a with a power-of-two group of at least 8 (dp4a words)."""
    for s in (gu_spec, dn_spec):
        G = s.group_size or 32
        if s.fmt not in FORMATS or len(s.shape) != 3:
            return False
        if s.fmt in ("int4", "int4a") and (G % 8 or not _is_pow2(G)) or s.fmt == "int8" and not _is_pow2(G):
            return False
    return gu_spec.shape[0] == dn_spec.shape[0] and gu_spec.shape[1] % 2 == 0


def use(on_gpu: bool, gu_spec, dn_spec, M: int) -> tuple[bool, bool]:
    """(use the kernels, in interpret mode) for a decode MoE of M tokens."""
    return gate(on_gpu, M <= max_rows() and supported(gu_spec, dn_spec))


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
    d = tuple(jnp.where(hit, a, b) for a, b in zip(da, db)) if p.paired else jnp.where(hit, da, db)
    return jnp.where(hit, qa, qb), d


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
                    interpret: bool = False, eps=None, q8_out: int = 0, cached: bool = False):
    """route (norm, E, partials: P or 0): each program takes its expert from the top-k of the router
    logits of its token (`_ranks`: no routing kernels in between), and the first program of each
    (token, rank) pair also writes the pair's expert and weight for the down kernel (the last two
    outputs). ids_ref holds the logits [M, EP] (E padded to 2^n with -inf), or, with `partials`,
    the o projection's router epilogue [M, P, EP]: partial sums over its row blocks of the router
    applied to the norm weight times x, not yet divided by x's rms (taken here, from the norm
    prologue, which `partials` needs). Without route, ids_ref holds the chosen ids [M*k].
    eps: x arrives un-normalised, with the norm's weight after it (`_x_parts` norm prologue).
    q8_out (BN = the down projection's group): h leaves in its dp4a q8 form (`_store_q8`; 2: q16,
    for int8 down weights), one group per program, so the down kernel reads it as is.
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
        _store_q8(outs, pair, blk, h, BN, q8_out)
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


def q8_between(gu_spec, dn_spec) -> bool:
    """Whether gate_up hands h to down in q8 form: dp4a down weights whose groups tile I exactly
    (one group per gate_up program)."""
    pd = _Proj(_Spec(*_key(dn_spec)))
    return pd.dp4a and pd.K == pd.Kp and _is_pow2(pd.G) and pd.G <= 128


@functools.lru_cache(maxsize=None)
def _calls(gu: tuple, dn: tuple, M: int, k: int, interpret: bool, bn1: int, bn2: int, warps1: int, warps2: int,
           route=None, eps=None, residual: bool = False, cached: bool = False):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    pg, pd = _Proj(_Spec(*gu)), _Proj(_Spec(*dn))
    I = pg.N // 2
    Ip = pd.Kp                               # h columns: down's K (= I) padded to its groups
    q8 = q8_between(_Spec(*gu), _Spec(*dn))
    bn1 = pd.G if q8 else min(bn1, _pow2(I))
    bn2 = min(bn2, _pow2(pd.N))
    if q8:
        h_shape = (jax.ShapeDtypeStruct((M * k, pd.ng, pd.G // 4 * pd.planes), jnp.int32),
                   jax.ShapeDtypeStruct((M * k, pd.ng), jnp.float32), jax.ShapeDtypeStruct((M * k, pd.ng), jnp.int32))
    else:
        h_shape = (jax.ShapeDtypeStruct((M * k, Ip), jnp.float32),)
    if route is not None:       # gate_up routes and hands the choice on: experts, weights [M*k]
        h_shape += (jax.ShapeDtypeStruct((M * k,), jnp.int32), jax.ShapeDtypeStruct((M * k,), jnp.float32))
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps1, num_stages=1))
    gate_up = pl.pallas_call(
        functools.partial(_gate_up_kernel, p=pg, k=k, I=I, Ip=Ip, BN=bn1, route=route, interpret=interpret,
                          eps=eps, q8_out=pd.planes if q8 else 0, cached=cached),
        out_shape=h_shape, grid=(M * k, -(-Ip // bn1)), interpret=interpret, name="strata_moe_gate_up", **params)
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps2, num_stages=1))
    down = pl.pallas_call(
        functools.partial(_down_kernel, p=pd, k=k, BN=bn2, interpret=interpret, q8_in=q8, residual=residual,
                          cached=cached),
        out_shape=jax.ShapeDtypeStruct((M, pd.N), jnp.float32),
        grid=(M, -(-pd.N // bn2)), interpret=interpret, name="strata_moe_down", **params)
    return pg, pd, q8, gate_up, down


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
                                       eps=eps, residual=residual is not None, cached=slots is not None)
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
    gw = [pg.qs_view(gu_arrays["qs"]), pg.sc_view(gu_arrays["scales"])]
    dw = [pd.qs_view(dn_arrays["qs"]), pd.sc_view(dn_arrays["scales"])]
    if slots is not None:
        slot_of = slots[0].astype(jnp.int32)
        gw += [slot_of, pg.qs_view(slots[1]["qs"]), pg.sc_view(slots[1]["scales"])]
        dw += [slot_of, pd.qs_view(slots[2]["qs"]), pd.sc_view(slots[2]["scales"])]
    out = gate_up(ids, *xin, *gw)   # h [M*k, Ip] or its q8 (+ ids, w)
    if route is None:
        h, w = out, topw.reshape(-1).astype(jnp.float32)
    else:
        h, ids, w = out[:-2], out[-2], out[-1]
    hin = list(h) if q8 else [pd.x_view(h[0])]
    res = [residual.astype(jnp.float32)] if residual is not None else []
    y = down(ids, w, *hin, *dw, *res)
    return (y, ids) if with_ids else y

