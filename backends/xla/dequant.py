"""Stored weights as JAX values inside the xla backend's traced functions: `dequantize` (any format
of formats.py) and `matvec`, the decode product as one fused multiply-reduce over the packed bytes;
and the SiLU the linear and MoE lowerings share.

Legend: N output rows, K input columns, G group size, ng = ceil(K / G) groups per row.
"""

from __future__ import annotations

from strata_compiler.errors import BackendError

from .device import load_jax


def _jnp():
    load_jax()
    import jax.numpy as jnp

    return jnp


def dequantize(jnp, spec, arrays: dict, dtype):
    """The weight's logical [..., N, K] values from its stored arrays (formats.py layouts)."""
    fmt, G, K = spec.fmt, spec.group_size or 32, spec.shape[-1]
    import jax

    if fmt == "f32":
        return arrays["w"].astype(dtype)
    if fmt == "bf16":
        return jax.lax.bitcast_convert_type(arrays["w"], jnp.bfloat16).astype(dtype)
    qs, d = arrays["qs"], arrays["scales"]
    lead = qs.shape[:-1]
    ng = -(-K // G)
    m = None
    if fmt in ("int4a", "int2"):                      # (scale, min) pairs per group
        d, m = d[..., 0::2], d[..., 1::2]
    if fmt == "int8":
        q = qs.reshape(*lead, ng, G).astype(dtype)
    elif fmt in ("int4", "int4a"):
        p = qs.reshape(*lead, ng, G // 2)
        q = jnp.concatenate([p & 0x0F, p >> 4], axis=-1).astype(dtype) - (8 if fmt == "int4" else 0)
    elif fmt in ("int3", "int2"):
        bits = 3 if fmt == "int3" else 2
        b = qs.reshape(*lead, ng, G * bits // 8)
        low = b[..., :G // 4]
        q = jnp.concatenate([(low >> (2 * j)) & 3 for j in range(4)], axis=-1)
        if bits == 3:
            hb = b[..., G // 4:]
            q = q | (jnp.concatenate([(hb >> j) & 1 for j in range(8)], axis=-1) << 2)
        q = q.astype(dtype) - (4 if bits == 3 else 0)
    elif fmt == "fp8":
        q = jax.lax.bitcast_convert_type(qs.reshape(*lead, ng, G), jnp.float8_e4m3fn).astype(dtype)
    else:
        raise BackendError(f"the xla backend has no lowering for weight format {fmt!r}")
    if m is not None:       # q d + m in f32, one rounding to dtype: m may be far larger than q d's step
        f32 = jnp.float32
        w = (q.astype(f32) * d.astype(f32)[..., None] + m.astype(f32)[..., None]).astype(dtype)
    else:
        w = q * d.astype(dtype)[..., None]
    return w.reshape(*lead, ng * G)[..., :K]


# Up to this many rows, x @ W^T is `matvec`, a fused multiply-reduce; above it, dequantize and a dot.
MATVEC_ROWS = 4


def matvec(jnp, spec, arrays: dict, x):
    """x[..., K] @ W[..., N, K]^T in f32 as one multiply-reduce straight from the stored arrays.

    XLA fuses the dequantization, the product and the sum into a single reduction that reads the
    packed bytes once, where a dot would first write the dequantized matrix out (at decode, a
    matrix-vector product is bound by reading the weights, so that write and read back cost more
    than int4 saves). Leading dims of the weight arrays (e.g. [M, k] chosen experts, gathered
    inside the same fusion) broadcast against x's; returns [..., N]."""
    fmt, G, K = spec.fmt, spec.group_size or 32, spec.shape[-1]
    f32 = jnp.float32
    x = x.astype(f32)
    if fmt not in ("int8", "int4"):
        w = dequantize(jnp, spec, arrays, f32)
        return (w * x[..., None, :]).sum(-1)
    qs, d = arrays["qs"], arrays["scales"].astype(f32)
    ng = d.shape[-1]
    if ng * G != K:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, ng * G - K)])
    d = d[..., None]               # the scale inside the sum: one reduction over (groups, group)
    if fmt == "int8":
        q = qs.reshape(*qs.shape[:-1], ng, G).astype(f32)
        t = q * d * x.reshape(*x.shape[:-1], 1, ng, G)
    else:
        p = qs.reshape(*qs.shape[:-1], ng, G // 2)
        xg = x.reshape(*x.shape[:-1], 1, ng, 2, G // 2)
        lo = (p & 0x0F).astype(f32) - 8
        hi = (p >> 4).astype(f32) - 8
        t = (lo * xg[..., 0, :] + hi * xg[..., 1, :]) * d
    return t.sum((-2, -1))


def silu(jnp, x):
    return x / (1.0 + jnp.exp(-x))
