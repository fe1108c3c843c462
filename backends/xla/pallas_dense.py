"""Dense projections at decode as Pallas (Triton) kernels: int4/int4a/int8 matrices (q/k/v, o, lm_head) with
dp4a integer dot products, and the f32/bf16 MoE router with the RMS norm before it.

  linear  grid (M rows, row blocks of N): each program quantizes its activation row to q8 (after
          the RMS norm when it is the kernel's prologue), dots a block of weight rows with it and
          adds the residual when that is the epilogue. Before a MoE (the o projection), it can also
          multiply its output rows by the router's matching columns and the MoE norm's weight, so
          the router needs no kernel of its own (`router=`, read by pallas_moe's gate_up).
  dense   grid (M rows, row blocks of E): rms_norm(x) @ W^T for a router stored f32 or bf16.

With f32 activations XLA's fused multiply-reduce is as fast as such kernels; the integer dot
products are what makes them pay.

Legend: M rows, N output rows, K input columns, E experts (router rows), EP = E rounded up to a
power of two, P row blocks of the linear kernel.
"""

from __future__ import annotations

import functools

from strata_compiler import settings

from .pallas_quant import (_Proj, _Spec, _key, _load, _padded, _pow2, _row_block, _rows_apply, _rows_load, _store_rows,
                           _x_parts, gate)


def use_linear(on_gpu: bool, spec, M: int) -> tuple[bool, bool]:
    """(use linear_decode, in interpret mode) for x[M, K] @ W^T with W stored as `spec`: int4 or
    int4a with a group of a multiple of 8, int8 of a multiple of 4 (dp4a words), up to the
    `pallas_linear_rows` rows (above them, XLA's dequantize and dot)."""
    word = {"int4": 8, "int4a": 8, "int8": 4}.get(spec.fmt)
    return gate(on_gpu, M <= settings.get("pallas_linear_rows")[0] and word is not None
                and len(spec.shape) == 2 and (spec.group_size or 32) % word == 0)


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
def _linear_call(key: tuple, M: int, interpret: bool, bn: int, warps: int, eps=None, residual: bool = False,
                 router=None):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    fmt, G, (N, K) = key
    p = _Proj(_Spec(fmt, G, (1, N, K)))
    bn = min(bn, _pow2(N))
    out = jax.ShapeDtypeStruct((M, N), jnp.float32)
    if router is not None:
        out = (out, jax.ShapeDtypeStruct((M, -(-N // bn), _pow2(router[0])), jnp.float32))
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1))
    call = pl.pallas_call(functools.partial(_linear_kernel, p=p, BN=bn, interpret=interpret, eps=eps,
                                            residual=residual, router=router),
                          out_shape=out, grid=(M, -(-N // bn)), interpret=interpret, name="strata_linear_q",
                          **params)
    return p, call


def linear_decode(x, spec, arrays: dict, *, interpret: bool = False, rms=None, residual=None, router=None):
    """x[M, K] @ W[N, K]^T, f32[M, N], W an int4/int4a/int8 weight by its stored arrays ({'qs', 'scales'}).
    rms (w [K], eps): x is un-normalised and the kernel normalises it; residual [M, N]: added.
    router (spec, arrays, norm weight [N]) of an f32/bf16 router [E, N] that reads rms_norm of the
    output: returns (output, partials [M, P, EP]) for `moe_decode(partials=)`, so the router
    needs no kernel of its own."""
    import jax.numpy as jnp

    bn, warps = settings.get("pallas_linear_tune")
    eps = float(rms[1]) if rms is not None else None
    rkey = (router[0].shape[0], router[0].fmt == "bf16") if router is not None else None
    p, call = _linear_call(_key(spec), x.shape[0], bool(interpret), bn, warps, eps, residual is not None, rkey)
    args = [p.x_view(_padded(x, p))] + ([p.norm_view(rms[0])] if rms is not None else [])
    args += [p.qs_view(arrays["qs"]), p.sc_view(arrays["scales"])]
    args += [residual.astype(jnp.float32)] if residual is not None else []
    if router is not None:
        args += [_dense_bits(router[0], router[1]), router[2].astype(jnp.float32).reshape(1, p.N)]
    return call(*args)


def router_fusable(spec, router_spec) -> bool:
    """Whether linear_decode of a weight stored as `spec` can take the router `router_spec`
    (f32/bf16 [E, N]) as its epilogue."""
    return (router_spec.fmt in ("f32", "bf16") and len(router_spec.shape) == 2
            and router_spec.shape[1] == spec.shape[0])


def use_dense(on_gpu: bool, spec, M: int) -> tuple[bool, bool]:
    """(use dense_decode, in interpret mode) for x[M, K] @ W^T with W stored as `spec`: f32/bf16,
    up to the MoE kernels' rows (`pallas_max_rows`)."""
    return gate(on_gpu, M <= settings.get("pallas_max_rows")[0] and spec.fmt in ("f32", "bf16")
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
                       *settings.get("pallas_dense_tune"))
    return call(x.astype(jnp.float32), rms[0].astype(jnp.float32), _dense_bits(spec, arrays))


def _dense_bits(spec, arrays: dict):
    """An f32/bf16 weight's array as the kernels load it (bf16 as its u16 bit patterns)."""
    import jax
    import jax.numpy as jnp

    w = arrays["w"]
    if spec.fmt == "bf16" and w.dtype != jnp.uint16:
        w = jax.lax.bitcast_convert_type(w, jnp.uint16)
    return w
