"""The XLA executor: a kernel-level graph (or a partition of one) as one jitted JAX function.

Each step shape (B, T, cache capacity) compiles once into a single XLA computation — not one
dispatch per op — which XLA fuses. Weights are placed on the device once in their stored
(packed) form and dequantized inside the computation, so device memory traffic is the packed
bytes. The KV cache lives on the device and is updated in place (donated buffers). Prefill
lengths are padded to a few buckets to bound recompiles. MoE gathers only the chosen experts'
packed weights when few tokens route (decode); with many tokens (prefill) it groups tokens by
expert and runs a ragged (grouped) matmul.

Legend: B batch, T tokens per sequence, M = B*T, D hidden, H/KV heads, hd head dim, E experts,
k experts per token, I expert intermediate, S = cache capacity.
"""

from __future__ import annotations

import math
import os
from typing import Callable

import numpy as np

from strata_compiler.errors import BackendError, UsageError
from strata_compiler.ir import Graph, Node, Op
from strata_compiler.rope import rope_inv_freq

from strata_compiler.runtime import expert_cache, trace

from . import cuda_rt
from .device import _jax, device as pick_device

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
RAW_MAX_TOKENS = 16   # steps of at most this many tokens stage their host inputs by raw copies (cuda_rt)
PACKED = -(1 << 40)   # the key of a partition's packed host-bound results in its outputs
COUNTS = -(1 << 41)   # ... and of its expert caches' routings per expert (--miss-path gpu), int32 [layers, E]


class HostSlice:
    """One result inside a partition's packed device->host buffer: becomes a NumPy array when a
    CPU kernel reads it. The buffer comes to the host once, for all its slices: by a raw copy
    when those are on (cuda_rt), else through the host copy JAX started at dispatch."""

    __slots__ = ("packed", "off", "n", "shape")

    def __init__(self, packed: dict, off: int, shape) -> None:
        self.packed, self.off, self.shape = packed, off, tuple(shape)
        self.n = math.prod(self.shape)

    def __array__(self, dtype=None, copy=None):
        host = self.packed.get("host")
        if host is None:
            host = self.packed["host"] = cuda_rt.fetch(self.packed["buf"])
        a = host[self.off:self.off + self.n].reshape(self.shape)
        return a if dtype is None else a.astype(dtype)


SLICE_PAIRS = 16   # up to this many (token, expert) pairs, MoE slices experts one by one


def _jnp():
    _jax()
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
    w = q * d.astype(dtype)[..., None]
    if m is not None:
        w = w + m.astype(dtype)[..., None]
    return w.reshape(*lead, ng * G)[..., :K]


MATVEC_ROWS = 4   # up to this many rows, x @ W^T is a fused multiply-reduce (STRATA_XLA_MATVEC=dot: never)


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


def _use_matvec(rows: int) -> bool:
    return rows <= MATVEC_ROWS and os.environ.get("STRATA_XLA_MATVEC", "reduce") != "dot"


class _Ctx:
    """What the traced ops see: parameters, positions, cache, compute dtype."""

    def __init__(self, exe: "XLAExecutor", params, ks, vs, ids, pos, B, T):
        self.exe, self.params, self.ks, self.vs = exe, params, ks, vs
        self.ids, self.pos, self.B, self.T = ids, pos, B, T
        self.topk: dict[int, tuple] = {}      # route node id -> (weights, expert ids), [M, k] each
        self.logits: dict[int, tuple] = {}    # route node id -> (router logits [M, E], k, renormalise, partials)
        self.norms: dict[int, tuple] = {}     # rms_norm node id -> (weight, eps, its input): for fusing
        self.partials: dict[int, object] = {}  # router node id -> its logits as an o projection's epilogue left them
        self.counts: dict[int, object] = {}    # cached GPU share id -> routings per expert this step (int32 [E])
        self.jnp = _jnp()
        import jax

        self.jax = jax

    def w(self, n: Node, role: str, dtype=None):
        name = n.weight(role)
        if name is None:
            return None
        spec = self.exe.g.weight(name)
        return dequantize(self.jnp, spec, self.params[name], dtype or self.exe.compute_dtype(spec))

    def matmul(self, x, w):
        """x [..., K] @ w[N, K]^T with f32 accumulation."""
        jnp = self.jnp
        prec = self.jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
        return jnp.einsum("...k,nk->...n", x.astype(w.dtype), w, precision=prec, preferred_element_type=jnp.float32)


def _embed(c, n: Node, a):
    """Gather the stored rows first, then decode only those (the table may be quantized)."""
    spec = c.exe.g.weight(n.weight("table"))
    rows = {k: v[a[0]] for k, v in c.params[spec.name].items()}
    return dequantize(c.jnp, spec, rows, c.jnp.float32)


def _rms(jnp, x, w, eps, group=0):
    shape = x.shape
    if group:
        x = x.reshape(*shape[:-1], shape[-1] // group, group)
    y = x * (1.0 / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))
    return (y * w).reshape(shape)


def _rms_node(c, n: Node, a: list):
    w, eps = c.w(n, "w", c.jnp.float32), n.attr("eps")
    if not n.attr("group", 0):      # consumers with a norm prologue read the input instead (norms)
        c.norms[n.id] = (w, eps, a[0])
    return _rms(c.jnp, a[0], w, eps, n.attr("group", 0))


def _silu(jnp, x):
    return x / (1.0 + jnp.exp(-x))


def _linear(c: _Ctx, n: Node, a: list):
    jnp = c.jnp
    x = a[0]
    rms = n.attr("prologue", "none") == "rms_norm"
    rows = x.shape[0]
    from . import pallas_moe

    name = n.weight("w")
    spec = c.exe.g.weight(name)
    # the norm a kernel can take as its prologue: the linear's own, or a standalone norm's (then
    # the kernel reads the norm's input: the norm itself is left unused)
    norm = (c.w(n, "norm", jnp.float32), n.attr("eps"), x) if rms else c.norms.get(n.args[0])
    y = _linear_kernel(c, n, a, spec, norm)
    if y is not None:
        return y
    if n.id in c.partials and norm is not None:
        # computed as the o projection's epilogue; these logits are for the XLA routing path only
        # (XLA drops them when the MoE kernels read the partials themselves)
        z = c.partials[n.id].sum(axis=1)[:, :spec.shape[0]]
        return z * (1.0 / jnp.sqrt(jnp.mean(norm[2] * norm[2], axis=-1, keepdims=True) + norm[1]))
    if _use_matvec(rows):
        dense, interpret = pallas_moe.use_dense(c.exe.on_gpu, spec, rows)
        if dense and norm is not None:     # the router after a norm: one kernel for both
            y = pallas_moe.dense_decode(norm[2], spec, c.params[name], norm[:2], interpret=interpret)
            return _linear_tail(c, n, a, y, False)
        # the norm's 1/rms scales the product instead of x: x * w fuses into the reduction
        if rms:
            x = x * c.w(n, "norm", jnp.float32)
        y = matvec(jnp, spec, c.params[name], x)
        if rms:
            y = y * (1.0 / jnp.sqrt(jnp.mean(a[0] * a[0], axis=-1, keepdims=True) + n.attr("eps")))
    else:
        if rms:
            x = _rms(jnp, x, c.w(n, "norm", jnp.float32), n.attr("eps"))
        y = c.matmul(x, c.w(n, "w"))
    return _linear_tail(c, n, a, y, False)


def _linear_kernel(c: _Ctx, n: Node, a: list, spec, norm):
    """The linear through `pallas_moe.linear_decode` when it applies (int4, dp4a, few rows: the
    kernel takes the norm as its prologue and, with no bias or epilogue in between, the residual
    add as its epilogue, and for the projection before a MoE the router too), else None."""
    from . import pallas_moe

    jnp, x = c.jnp, a[0]
    kernel, interpret = pallas_moe.use_linear(c.exe.on_gpu, spec, x.shape[0])
    if not kernel or not (norm is None or pallas_moe.fusable_norm(spec)):
        return None
    plain = n.weight("b") is None and n.attr("epilogue", "none") == "none"
    res = a[1] if len(a) == 2 and plain else None
    args = dict(interpret=interpret, rms=norm[:2] if norm is not None else None, residual=res)
    xin = x if norm is None else norm[2]
    router = c.exe.router_after.get(n.id) if res is not None and pallas_moe.route_mode() == "fused" else None
    if router is not None:
        rn, nn = (c.exe.g.node(i) for i in router)
        rspec = c.exe.g.weight(rn.weight("w"))
        if pallas_moe.router_fusable(spec, rspec) and pallas_moe.use_dense(c.exe.on_gpu, rspec, x.shape[0])[0]:
            # the o projection with the MoE's router as its epilogue: no router kernel
            y, c.partials[rn.id] = pallas_moe.linear_decode(
                xin, spec, c.params[spec.name], router=(rspec, c.params[rspec.name], c.w(nn, "w", jnp.float32)),
                **args)
            return _linear_tail(c, n, a, y, True)
    y = pallas_moe.linear_decode(xin, spec, c.params[spec.name], **args)
    return _linear_tail(c, n, a, y, res is not None)


def _linear_tail(c: _Ctx, n: Node, a: list, y, added: bool):
    """Bias, epilogue and residual of a linear after its product y (added: the residual is in y)."""
    jnp = c.jnp
    b = c.w(n, "b", jnp.float32)
    if b is not None:
        y = y + b
    if n.attr("epilogue", "none") == "silu_mul":
        half = y.shape[-1] // 2
        y = _silu(jnp, y[..., :half]) * y[..., half:]
    if len(a) == 2 and not added:
        y = y + a[1]
    return y


def _rope(jnp, x, pos, hd, inv):
    """x [B, T, n, hd], rotate-half RoPE at positions pos + t."""
    T = x.shape[1]
    freqs = (pos + jnp.arange(T, dtype=jnp.float32))[:, None] * inv[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb)[None, :, None, :], jnp.sin(emb)[None, :, None, :]
    half = hd // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def _attention(c: _Ctx, n: Node, a: list):
    jnp, lax = c.jnp, c.jax.lax
    H, KV, hd = n.attr("n_heads"), n.attr("n_kv_heads"), n.attr("head_dim")
    B, T = c.B, c.T
    qkv = a[0].reshape(B, T, -1)
    q, k, v = qkv[..., :H * hd], qkv[..., H * hd:(H + KV) * hd], qkv[..., (H + KV) * hd:]
    mode = n.attr("qk_norm")
    layer = n.attr("layer")
    from . import pallas_attn

    kernel, interpret = pallas_attn.use(c.exe.on_gpu, H, KV, hd, T, c.ks[layer].shape[2])
    if kernel:
        # decode on a GPU: norms, RoPE, the cache write and the attention in one Pallas kernel
        out, c.ks[layer], c.vs[layer] = pallas_attn.attention_decode(
            a[0].reshape(B, -1), c.pos, c.ks[layer], c.vs[layer], H=H, KV=KV, hd=hd, norm=mode,
            q_norm=c.w(n, "q_norm", jnp.float32) if mode != "none" else None,
            k_norm=c.w(n, "k_norm", jnp.float32) if mode != "none" else None, eps=n.attr("eps", 1e-6),
            clip=n.attr("clip_qkv") if n.has_attr("clip_qkv") else None,
            inv_freq=rope_inv_freq(hd, dict(n.attrs)), interpret=interpret)
        return out
    if mode != "none":
        g = hd if mode == "head" else 0
        q = _rms(jnp, q, c.w(n, "q_norm", jnp.float32), n.attr("eps"), g)
        k = _rms(jnp, k, c.w(n, "k_norm", jnp.float32), n.attr("eps"), g)
    if n.has_attr("clip_qkv"):
        lim = n.attr("clip_qkv")
        q, k, v = (jnp.clip(t, -lim, lim) for t in (q, k, v))
    inv = jnp.asarray(rope_inv_freq(hd, dict(n.attrs)))
    posf = c.pos.astype(jnp.float32)
    q = _rope(jnp, q.reshape(B, T, H, hd), posf, hd, inv)
    k = _rope(jnp, k.reshape(B, T, KV, hd), posf, hd, inv)
    v = v.reshape(B, T, KV, hd)
    K = lax.dynamic_update_slice(c.ks[layer], k.transpose(0, 2, 1, 3).astype(c.ks[layer].dtype), (0, 0, c.pos, 0))
    V = lax.dynamic_update_slice(c.vs[layer], v.transpose(0, 2, 1, 3).astype(c.vs[layer].dtype), (0, 0, c.pos, 0))
    c.ks[layer], c.vs[layer] = K, V
    S = K.shape[2]
    rep = H // KV
    qg = q.reshape(B, T, KV, rep, hd).transpose(0, 2, 3, 1, 4)               # [B, KV, rep, T, hd]
    prec = lax.Precision.HIGHEST
    scores = jnp.einsum("bgrtd,bgsd->bgrts", qg, K.astype(jnp.float32), precision=prec) / np.float32(np.sqrt(hd))
    allowed = jnp.arange(S)[None, :] <= (c.pos + jnp.arange(T))[:, None]    # causal over the cache
    scores = jnp.where(allowed[None, None, None], scores, -jnp.inf)
    p = c.jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bgrts,bgsd->bgrtd", p, V.astype(jnp.float32), precision=prec)
    return out.transpose(0, 3, 1, 2, 4).reshape(B * T, H * hd)


def _route(c: _Ctx, n: Node, a: list):
    p = c.jax.nn.softmax(a[0], axis=-1)
    vals, idx = c.jax.lax.top_k(p, n.attr("k"))          # ties: the lower index first, as the reference
    if n.attr("norm"):
        vals = vals / vals.sum(axis=-1, keepdims=True)
    c.topk[n.id] = vals, idx                             # for the moe_ffn it feeds: no second top_k
    # for decode kernels that route themselves (from the o projection's partials when it made them)
    c.logits[n.id] = a[0], n.attr("k"), bool(n.attr("norm")), c.partials.get(_router_of(c.exe.g, n))
    E = p.shape[-1]
    return (c.jax.nn.one_hot(idx, E, dtype=p.dtype) * vals[..., None]).sum(axis=-2)


def _moe(c: _Ctx, n: Node, a: list):
    jnp, jax = c.jnp, c.jax
    x, comb = a[0], a[1]
    k = c.exe.route_k[n.id]
    whole = c.exe.miss_source.get(n.id)
    if whole is not None:
        return _moe_cached(c, n, a, whole)
    if n.id in c.exe.silent:    # a cache's host share whose misses the GPU share reads in place
        out = jnp.zeros((x.shape[0], c.exe.g.weight(n.weight("down")).shape[1]), jnp.float32)
        return out if len(a) < 3 else out + a[2]
    gu_spec = c.exe.g.weight(n.weight("gate_up"))
    dn_spec = c.exe.g.weight(n.weight("down"))
    dt = c.exe.compute_dtype(gu_spec)
    ids = n.attr("experts", ())
    live = c.ext.get(-(n.id + 1)) if n.attr("cache", "") else None
    if ids:   # a share of the layer's experts: their routing columns (a cache's: its slots'), own top-k
        comb = comb[:, live if live is not None else jnp.asarray(ids)]
        k = min(k, comb.shape[1])
        topw, topi = jax.lax.top_k(comb, k)
    elif n.attr("cache", ""):   # an expert cache's host side, run here: the plan's non-resident experts
        from strata_compiler.passes.expert_split import nonresident_mask

        comb = comb * jnp.asarray(nonresident_mask(c.exe.g, n))
        topw, topi = jax.lax.top_k(comb, k)
    else:     # [M, k], in top_k(comb)'s order: the route's own, when it ran in this computation
        topw, topi = c.topk.get(n.args[1]) or jax.lax.top_k(comb, k)
    gu_p, dn_p = c.params[n.weight("gate_up")], c.params[n.weight("down")]
    route = None if ids or n.attr("cache", "") else c.logits.get(n.args[1])
    return moe_core(c, x, topw, topi, gu_spec, gu_p, dn_spec, dn_p, dt, route=route, norm=c.norms.get(n.args[0]),
                    residual=a[2] if len(a) == 3 else None)


def _moe_cached(c: _Ctx, n: Node, a: list, whole: Node):
    """An expert cache's GPU share that computes the whole layer (`--miss-path gpu`,
    runtime/mapped.py): each chosen expert's weights from its slot when resident, else from the
    host share's whole arrays, which on a GPU are host memory read in place over PCIe. Records
    the step's routings per expert (c.counts) for the cache's bookkeeping."""
    jnp, jax = c.jnp, c.jax
    x, comb = a[0], a[1]
    g = c.exe.g
    gu_spec, dn_spec = g.weight(whole.weight("gate_up")), g.weight(whole.weight("down"))
    live = c.ext.get(-(n.id + 1))                    # slot -> expert, int32 [S]
    if live is None:                                 # no live cache: the plan's slots
        live = jnp.asarray(n.attr("experts")[:c.exe.slots_of[n.id]], jnp.int32)
    E = comb.shape[1]
    # a slot whose expert is being swapped holds -1 (FusedStep.launch): no expert reads it
    slot_of = jnp.full((E,), -1, jnp.int32).at[jnp.where(live >= 0, live, E)].set(
        jnp.arange(live.shape[0], dtype=jnp.int32), mode="drop")
    topw, topi = c.topk.get(n.args[1]) or jax.lax.top_k(comb, c.exe.route_k[n.id])
    out, ids = moe_core(c, x, topw, topi, gu_spec, c.params[whole.weight("gate_up")], dn_spec,
                        c.params[whole.weight("down")], c.exe.compute_dtype(gu_spec), route=c.logits.get(n.args[1]),
                        norm=c.norms.get(n.args[0]), residual=a[2] if len(a) == 3 else None,
                        slots=(slot_of, c.params[n.weight("gate_up")], c.params[n.weight("down")]))
    c.counts[n.id] = jnp.zeros((E,), jnp.int32).at[ids.reshape(-1)].add(1)
    return out


def moe_core(c: _Ctx, x, topw, topi, gu_spec, gu_p, dn_spec, dn_p, dt, pallas_ok: bool = True, route=None,
             norm=None, residual=None, slots=None):
    """sum_j topw[m, j] * expert_{topi[m, j]}(x[m]) over the stacked experts gu_p / dn_p (their
    arrays by name, specs' formats), f32 [M, D], plus `residual` when given. route: (logits, k,
    renormalise, partials or None) of the route op that gave topw/topi, when it ran in this
    computation (the decode kernels then route inside; partials: its router's logits as the o
    projection's epilogue left them, `pallas_moe.linear_decode(router=)`). norm: (weight, eps,
    input) of the RMS norm that gave x, which the decode kernels can take over with the residual
    add (dp4a: the norm in gate_up, the add in down). slots (slot_of int32 [E], gate_up's and
    down's slot arrays): an expert cache's GPU slots, where the decode paths read a resident
    expert instead of gu_p / dn_p (then the whole layer in host memory, read in place); the
    others read gu_p / dn_p, which hold every expert. With slots: (result, the chosen experts
    int32 [M*k])."""
    jnp, jax = c.jnp, c.jax
    M, D = x.shape
    k = topi.shape[1]
    ids = topi.reshape(-1)

    def done(out):
        out = out if residual is None else out + residual
        return out if slots is None else (out, ids)

    E, I2, _ = gu_spec.shape
    I = I2 // 2
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    from . import pallas_moe

    pallas, interpret = pallas_moe.use(c.exe.on_gpu, gu_spec, dn_spec, M) if pallas_ok else (False, False)
    if pallas:
        # decode, int4/int8 experts on a GPU: two Pallas kernels (gate/up + silu*mul; down +
        # weighted combine) over the stored packed weights (STRATA_XLA_PALLAS=0: the XLA path)
        kw = {}
        if norm is not None and pallas_moe.fusable_norm(gu_spec):
            # the norm as gate_up's prologue, the residual add (when it is the MoE's) as down's
            # epilogue (dp4a)
            x, kw = norm[2], dict(rms=norm[:2], residual=residual)
        cached = dict(slots=slots, with_ids=True) if slots is not None else {}
        if route is not None and pallas_moe.route_inside():
            # softmax and top-k in gate_up: four small routing kernels fewer per layer; from the
            # router's partial sums when the o projection left them (and gate_up takes the norm)
            src = dict(partials=route[3], n_experts=E) if route[3] is not None and kw else dict(logits=route[0])
            out = pallas_moe.moe_decode(x, None, None, gu_spec, gu_p, dn_spec, dn_p, interpret=interpret,
                                        k=route[1], norm=route[2], **src, **kw, **cached)
        else:
            out = pallas_moe.moe_decode(x, topi, topw, gu_spec, gu_p, dn_spec, dn_p, interpret=interpret, **kw,
                                        **cached)
        if slots is not None:
            out, ids = out
        if residual is not None and kw:     # (down added it)
            return out if slots is None else (out, ids)
    elif _use_matvec(M):
        # decode: one fused multiply-reduce per projection over all chosen experts (the gather of
        # their packed weights happens inside the reduction, so nothing is copied); an expert
        # cache's resident experts from their slots
        if slots is None:
            def sel(p, _s):
                return {r: v[topi] for r, v in p.items()}
            gu_s = dn_s = None
        else:
            hit, si = slots[0][topi] >= 0, jnp.maximum(slots[0][topi], 0)
            gu_s, dn_s = slots[1], slots[2]

            def sel(p, s):
                return {r: jnp.where(hit.reshape(hit.shape + (1,) * (v.ndim - 1)), s[r][si], v[topi])
                        for r, v in p.items()}
        gu = matvec(jnp, gu_spec, sel(gu_p, gu_s), x[:, None, :])                               # [M, k, 2I]
        h = _silu(jnp, gu[..., :I]) * gu[..., I:]
        y = matvec(jnp, dn_spec, sel(dn_p, dn_s), h)                                            # [M, k, D]
        out = (y * topw[..., None]).sum(axis=1)
    elif M * k <= SLICE_PAIRS:
        # decode: each chosen expert's weights as a dynamic slice of the stacked array, read in
        # place (a gather first copies k experts' weights: measured 1.4x slower on an H200)
        out = jnp.zeros((M, D), jnp.float32)
        for m in range(M):
            for j in range(k):
                e = topi[m, j]
                gu = dequantize(jnp, gu_spec, {r: jax.lax.dynamic_index_in_dim(v, e, 0, keepdims=False)
                                               for r, v in gu_p.items()}, dt)             # [2I, D]
                h = jnp.dot(gu, x[m].astype(dt), precision=prec, preferred_element_type=jnp.float32)
                h = _silu(jnp, h[:I]) * h[I:]
                dn = dequantize(jnp, dn_spec, {r: jax.lax.dynamic_index_in_dim(v, e, 0, keepdims=False)
                                               for r, v in dn_p.items()}, dt)             # [D, I]
                y = jnp.dot(dn, h.astype(dt), precision=prec, preferred_element_type=jnp.float32)
                out = out.at[m].add(topw[m, j] * y)
    elif M * k <= E:
        # few tokens: gather just the chosen experts' packed weights, then dequantize those
        gu = dequantize(jnp, gu_spec, {r: v[topi] for r, v in gu_p.items()}, dt)       # [M, k, 2I, D]
        h = jnp.einsum("md,mkid->mki", x.astype(dt), gu, precision=prec, preferred_element_type=jnp.float32)
        h = _silu(jnp, h[..., :I]) * h[..., I:]
        dn = dequantize(jnp, dn_spec, {r: v[topi] for r, v in dn_p.items()}, dt)        # [M, k, D, I]
        y = jnp.einsum("mki,mkdi->mkd", h.astype(dt), dn, precision=prec, preferred_element_type=jnp.float32)
        out = (y * topw[..., None]).sum(axis=1)
    else:
        # many tokens: group the (token, expert) pairs by expert, one ragged matmul per projection
        flat = topi.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        tok = order // k
        sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        xs = x[tok].astype(dt)
        gu = dequantize(jnp, gu_spec, gu_p, dt).transpose(0, 2, 1)                   # [E, D, 2I]
        h = jax.lax.ragged_dot(xs, gu, sizes, precision=prec, preferred_element_type=jnp.float32)
        h = _silu(jnp, h[:, :I]) * h[:, I:]
        dn = dequantize(jnp, dn_spec, dn_p, dt).transpose(0, 2, 1)                   # [E, I, D]
        ys = jax.lax.ragged_dot(h.astype(dt), dn, sizes, precision=prec, preferred_element_type=jnp.float32)
        # back to (token, choice) order, then a weighted sum over the k choices: a scatter-add
        # into the tokens' rows accumulates in whatever order the GPU's atomics land, not the same
        # from run to run. (On an H200, 2026-11-30, two sessions of one mixed plan in one process
        # gave decode logits up to 4.5e-3 apart after the same prompt; this scatter is the likely
        # cause, not yet re-measured on the GPU without it.)
        back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        out = (ys[back].reshape(M, k, D) * topw[..., None]).sum(axis=1)
    return done(out)


_OPS: dict[Op, Callable[[_Ctx, Node, list], object]] = {
    Op.EMBED: _embed,
    Op.RMS_NORM: _rms_node,
    Op.LINEAR: _linear,
    Op.FUSED_ATTENTION: _attention,
    Op.ROUTE: _route,
    Op.MOE_FFN: _moe,
    Op.ADD: lambda c, n, a: a[0] + a[1],
    Op.MUL: lambda c, n, a: a[0] * a[1],
    Op.SILU: lambda c, n, a: _silu(c.jnp, a[0]),
    Op.SIGMOID: lambda c, n, a: c.jax.nn.sigmoid(a[0]),
    Op.CLAMP: lambda c, n, a: c.jnp.clip(a[0], -n.attr("limit"), n.attr("limit")),
    Op.SLICE: lambda c, n, a: a[0][..., n.attr("start"):n.attr("stop")],
    Op.TRANSFER: lambda c, n, a: c.jnp.asarray(a[0], c.jnp.float32).reshape(-1, a[0].shape[-1]),
}


def _routers_after(graph: Graph, users: dict, ids: set) -> dict[int, tuple[int, int]]:
    """linear node id -> (router linear, rms_norm) for each projection whose output (with its
    residual add) feeds, through an RMS norm, a dense router linear whose logits a route ranks
    (`_router_of`), all in this computation: the decode kernels can then compute the router as
    that projection's epilogue (`linear_decode(router=)`)."""
    def plain(n: Node) -> bool:
        return (n.op is Op.LINEAR and n.weight("b") is None and n.attr("epilogue", "none") == "none"
                and n.attr("prologue", "none") == "none")

    routers = {_router_of(graph, n) for n in graph.nodes if n.id in ids and n.op is Op.ROUTE}
    out = {}
    for n in graph.nodes:
        if n.id not in ids or not plain(n) or len(n.args) != 2:
            continue
        for r in (graph.node(u) for u in users[n.id] if u in ids):
            if r.op is not Op.RMS_NORM or r.attr("group", 0):
                continue
            for lin in (graph.node(u) for u in users[r.id] if u in ids):
                if plain(lin) and len(lin.args) == 1 and lin.id in routers:
                    out[n.id] = (lin.id, r.id)
    return out


def _router_of(graph: Graph, route: Node) -> int:
    """The node whose logits a route op ranks: its argument, or the argument of a slice from column
    0 before it (a router fused with a shared expert's gate, as Qwen2-MoE's: [E + 1] columns)."""
    src = graph.node(route.args[0])
    if src.op is Op.SLICE and src.attr("start") == 0:
        return src.args[0]
    return src.id


class GPUOutOfMemory(BackendError):
    """The device could not hold a partition's weights."""


class XLAExecutor:
    """Runs the nodes of `graph` (all, or the ids in `nodes`) as one jitted JAX function."""

    def __init__(self, graph: Graph, weights, nodes: list[int] | None = None, device_kind: str = "auto",
                 slot_limit: dict[int, int] | None = None, device_index: int = 0,
                 mapped: dict[int, int] | None = None) -> None:
        """slot_limit: expert-cache GPU shares (node id) loaded with only their first N slots (a
        device out of memory raises GPUOutOfMemory). mapped: {GPU share: host share} of expert
        caches whose misses the GPU reads from host memory (runtime/mapped.py `rebind_misses`):
        the host share's weights stay in host memory, mapped, and its value is zero; so do the
        other weights the graph's meta names in place (an embedding table)."""
        jax = _jax()
        jnp = _jnp()
        self.g = graph
        self.device = pick_device(device_kind, device_index)
        self.on_gpu = self.device.platform != "cpu"
        cuda_rt.enable("gpu" if self.on_gpu else "cpu")     # raw hand-off copies where they apply
        ids = set(nodes) if nodes is not None else {n.id for n in graph.nodes}
        self.nodes = [n for n in graph.nodes if n.id in ids]
        for n in self.nodes:
            if n.op not in _OPS and n.op is not Op.INPUT_IDS:
                raise BackendError(f"the xla backend has no lowering for op {n.op.value} (%{n.id}); "
                                   f"recompile the plan (the fuse pass removes it) or use --backend reference")
        users = graph.users()
        self.inputs = sorted({a for n in self.nodes for a in n.args if a not in ids})
        self.outputs = [n.id for n in self.nodes if any(u == -1 or u not in ids for u in users[n.id])]
        self.layers = sorted({n.attr("layer") for n in self.nodes if n.op is Op.FUSED_ATTENTION})
        self._reads_ids = any(n.op is Op.INPUT_IDS for n in self.nodes)   # else the ids argument is unused
        self._bulk_pending = False      # set_slot(wait=False) copies not yet waited for
        self.step_counts = None         # the last call's COUNTS result (run_partition)
        self.params_version = 0         # bumped where an array of `params` is replaced (the fused step's flat copy)
        self.route_k = {}
        for n in self.nodes:
            if n.op is Op.MOE_FFN:
                r = graph.node(n.args[1])
                while r.op is Op.TRANSFER:      # routing computed on the other device
                    r = graph.node(r.args[0])
                if r.op is not Op.ROUTE:
                    raise BackendError(f"moe_ffn %{n.id}: the xla backend needs its routing from a route op")
                self.route_k[n.id] = r.attr("k")
        self.router_after = _routers_after(graph, users, ids)
        self.packed: list[int] = []       # pack_for_host: results that leave as one buffer
        self._packed_T = 0
        self.cached = [n for n in self.nodes if n.op is Op.MOE_FFN and n.attr("cache", "") and n.attr("experts", ())]
        self.slots_of = {n.id: (slot_limit or {}).get(n.id, len(n.attr("experts"))) for n in self.cached}
        # --miss-path gpu: cached GPU share -> the host share whose whole arrays its misses read
        self.miss_source = {gid: graph.node(hid) for gid, hid in (mapped or {}).items() if gid in ids and hid in ids}
        self.silent = {h.id for h in self.miss_source.values()}
        self.count_order = [n.id for n in self.nodes if n.id in self.miss_source]   # rows of the COUNTS result
        from strata_compiler.runtime.mapped import in_place_weights

        in_place = {w for h in self.miss_source.values() for _, w in h.weights}
        in_place |= in_place_weights(graph) & {w for n in self.nodes for _, w in n.weights}
        # host arrays the GPU reads in place (by weight, then array name)
        self.mapped_host = {name: {a: np.asarray(v) for a, v in weights.arrays(name).items()} for name in sorted(in_place)}
        cut = {w: self.slots_of[n.id] for n in self.cached for _, w in n.weights}
        names = sorted({w for n in self.nodes for _, w in n.weights} - in_place)
        host = {name: {a: np.asarray(v)[:cut[name]] if name in cut else np.asarray(v)
                       for a, v in weights.arrays(name).items()} for name in names}
        self.param_bytes = sum(v.nbytes for arrs in host.values() for v in arrs.values())
        try:
            self.params = self._place_params(host)
            if self.mapped_host:
                from strata_compiler.runtime import mapped as mp

                self.params.update({name: {a: mp.device_view(v, self.device) for a, v in arrs.items()}
                                    for name, arrs in self.mapped_host.items()})
        except Exception as e:    # XLA reports an out-of-memory as RESOURCE_EXHAUSTED
            if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
                raise GPUOutOfMemory(str(e).splitlines()[0][:200]) from None
            raise
        self.kv_dtype = jnp.float32
        self._out_keys: dict[tuple[int, int], tuple] = {}     # (B, T) -> the result keys of _flat's first tuple
        self._fn = jax.jit(self._flat, static_argnums=(5, 6), donate_argnums=(1, 2))

    def _home(self):
        """Where this partition's own arrays go (device_put target): its device."""
        return self.device

    def _place_params(self, host: dict[str, dict[str, np.ndarray]]) -> dict:
        """The weights' stored arrays (by weight, then array name) on the device."""
        jax = _jax()
        return {name: {a: jax.device_put(v, self._home()) for a, v in arrs.items()} for name, arrs in host.items()}

    def _value(self, c: "_Ctx", n: Node, args: list):
        """Node n's value inside the traced forward function."""
        return _OPS[n.op](c, n, args)

    def compute_dtype(self, spec):
        """f32 for f32 weights; on a GPU the others compute in bf16 (f32 accumulation)."""
        jnp = _jnp()
        if spec.fmt == "f32" or not self.on_gpu or os.environ.get("STRATA_XLA_COMPUTE") == "f32":
            return jnp.float32
        return jnp.bfloat16

    def _forward(self, params, ks, vs, ext, ids, B, T, pos, hooks: dict | None = None):
        """hooks: node id -> f(env, args) -> args, called while tracing, before that node (the fused
        step puts a host call there and ties the node's operands to it)."""
        ks, vs = dict(ks), dict(vs)
        c = _Ctx(self, params, ks, vs, ids, pos, B, T)
        c.ext = ext
        env = {k: v for k, v in ext.items() if k >= 0}
        for n in self.nodes:
            if n.op is Op.INPUT_IDS:
                env[n.id] = ids.reshape(-1)
            else:
                args = [env[a] for a in n.args]
                if hooks and n.id in hooks:
                    args = hooks[n.id](env, args)
                env[n.id] = self._value(c, n, args)
        outs = {o: env[o] for o in self.outputs}
        if c.counts:        # the expert caches' routings per expert, for their bookkeeping on the host
            outs[COUNTS] = c.jnp.stack([c.counts[i] for i in self.count_order])
        if self.packed and T == self._packed_T:    # the host-bound results as one f32 buffer: one copy
            outs[PACKED] = c.jnp.concatenate([outs[o].reshape(-1).astype(c.jnp.float32) for o in self.packed])
        return outs, ks, vs

    def _flat(self, params, ks, vs, ext, ids, B, T, pos, hooks: dict | None = None):
        """_forward with its results as tuples (in _out_keys[B, T] and self.layers order), not dicts
        keyed by node ids and layers: result keys are written into the lowered module, so
        structurally equal partitions (one per layer in a split plan) lower to the same module and
        compile once, through the persistent cache."""
        outs, ks, vs = self._forward(params, ks, vs, ext, ids, B, T, pos, hooks)
        self._out_keys[B, T] = tuple(outs)
        return tuple(outs.values()), tuple(ks[l] for l in self.layers), tuple(vs[l] for l in self.layers)

    def pack_for_host(self, node_ids, tokens: int = 1) -> None:
        """Results `node_ids` (f32, read only by the CPU) leave the device as one buffer, at steps
        of `tokens` tokens (decode): one device->host copy per partition instead of one each."""
        from strata_compiler.ir import DType

        ids = [i for i in node_ids if self.g.node(i).type.dtype is DType.F32]
        self.packed, self._packed_T = (ids, tokens) if len(ids) > 1 else ([], 0)

    def set_slot(self, node_id: int, slot: int, rows: dict[str, dict[str, np.ndarray]], wait: bool = True) -> int:
        """An expert cache swap: the stored arrays of one expert (by role, then array) into slot
        `slot` of node `node_id`'s weights, in place on the device. Returns the bytes copied.
        wait=False: raw copies return once queued (cuda_rt bulk stream); this partition's next
        call waits for them. (A running fused step's copies: MixedExecutor._copy_rows.)"""
        jax = _jax()
        if not hasattr(self, "_put_row"):
            self._put_row = jax.jit(lambda a, r, i: a.at[i].set(r), donate_argnums=0)
        n = self.g.node(node_id)
        moved = 0
        # on a CUDA GPU, a raw copy straight into the slot's rows (no jitted update, no donation)
        # once this partition's last call has finished reading the weights
        raw = cuda_rt.mode == "cuda" and self.on_gpu
        if raw and getattr(self, "_last_outs", None) is not None:
            jax.block_until_ready(self._last_outs)
            self._last_outs = None
        for role, name in n.weights:
            for arr, host in rows[role].items():
                cur = self.params[name][arr]
                host = np.ascontiguousarray(host, dtype=cur.dtype)
                if raw and host.nbytes * cur.shape[0] == cur.nbytes:
                    cuda_rt.to_device(host, cur, offset=slot * host.nbytes, wait=wait)
                    self._bulk_pending |= not wait
                else:
                    dev = jax.device_put(host, self.device)
                    self.params[name][arr] = self._put_row(cur, dev, np.int32(slot))
                    self.params_version += 1
                moved += host.nbytes
        return moved

    def land_slot_copies(self) -> None:
        """Wait for the expert-slot copies set_slot(wait=False) queued: before anything reads the
        weights (this partition's next call, or a fused step's program)."""
        if self._bulk_pending:
            cuda_rt.wait_bulk()
            self._bulk_pending = False

    def new_cache(self, cache) -> None:
        """Put this partition's layers of the cache on the device (zeros)."""
        jax, jnp = _jax(), _jnp()
        for layer in self.layers:
            shape = cache.k[layer].shape
            cache.k[layer] = jax.device_put(jnp.zeros(shape, self.kv_dtype), self._home())
            cache.v[layer] = jax.device_put(jnp.zeros(shape, self.kv_dtype), self._home())

    def bucket(self, T: int, room: int) -> int:
        """The padded prefill length: the smallest bucket >= T that fits the cache (else T)."""
        if T == 1:
            return 1
        for b in PREFILL_BUCKETS:
            if b >= T:
                return b if b <= room else T
        return T

    def step_inputs(self, input_ids: np.ndarray, cache) -> tuple:
        """The token ids (int32) and cache position of this step on this partition's device, put
        there once per step and shared by the step's partitions on the device: NumPy arguments
        would be copied to the device at every jitted call (a synchronous host->device copy each)."""
        jax = _jax()
        return tuple(jax.device_put((np.asarray(input_ids, np.int32), np.int32(cache.length)), self._home()))

    def run_partition(self, ext: dict, input_ids: np.ndarray, cache, T_pad: int, step_in: tuple | None = None) -> dict:
        B, T = input_ids.shape
        if cache.length + T_pad > cache.capacity:
            raise UsageError(f"sequence of {cache.length + T} tokens exceeds the KV cache capacity {cache.capacity}")
        ids = input_ids
        if T_pad != T:
            ids = np.zeros((B, T_pad), np.int64)
            ids[:, :T] = input_ids
        ks = {l: cache.k[l] for l in self.layers}
        vs = {l: cache.v[l] for l in self.layers}
        self.land_slot_copies()
        # NumPy arguments go to the device inside jit's C++ dispatch; jnp.asarray here would take
        # JAX's Python path (two primitive dispatches per call: ~0.3 ms each, measured)
        staging = self._staging() if B * T_pad <= RAW_MAX_TOKENS else None
        if step_in is not None and T_pad == T:
            ids_arg, pos_arg = step_in
        elif staging is not None:    # raw copies into this partition's device arrays (cuda_rt)
            # only what the partition reads is rewritten (ids: the embedding; pos: the attention),
            # the other is any array of the right shape: a copy less per call
            ids_arg = staging.stage("ids", np.asarray(ids, np.int32), self._reads_ids)
            pos_arg = staging.stage("pos", np.asarray(cache.length, np.int32), bool(self.layers))
        else:
            ids_arg, pos_arg = np.asarray(ids, np.int32), np.int32(cache.length)
        if staging is not None:
            ext = {i: staging.stage(i, v) if isinstance(v, np.ndarray) else v for i, v in ext.items()}
        flat, kt, vt = self._fn(self.params, ks, vs, ext, ids_arg, B, T_pad, pos_arg)
        outs = dict(zip(self._out_keys[B, T_pad], flat))
        # the expert caches' routings of this call (--miss-path gpu), for MixedExecutor to fold
        self.step_counts = outs.pop(COUNTS, None)
        if staging is not None and outs:
            staging.guard = next(iter(outs.values()))   # the next rewrite waits for this call
        if self.cached:
            self._last_outs = outs      # an expert-slot rewrite (set_slot) waits for this call
        for l, k, v in zip(self.layers, kt, vt):
            cache.k[l], cache.v[l] = k, v
        return outs

    def _staging(self):
        """This partition's staging arrays when raw copies are on for its platform (cuda_rt), else None."""
        if cuda_rt.mode is None or (cuda_rt.mode == "cuda") != self.on_gpu:
            return None
        if not hasattr(self, "_stage"):
            self._stage = cuda_rt.Staging(self._home())
        return self._stage

    def _decode_loop(self, params, ks, vs, tok, pos, n):
        """n greedy decode steps in one XLA computation: the token never leaves the device."""
        jax, jnp = _jax(), _jnp()
        B = tok.shape[0]

        def body(i, carry):
            ks, vs, tok, pos, out = carry
            nxt, pos, ks, vs = self._ahead_step(params, ks, vs, tok, pos)
            return ks, vs, nxt, pos, out.at[:, i].set(nxt)

        out = jnp.zeros((B, n), jnp.int32)
        ks, vs, _, _, out = jax.lax.fori_loop(0, n, body, (ks, vs, tok, pos, out))
        return out, ks, vs

    def greedy_decode(self, first: np.ndarray, cache, n: int) -> np.ndarray:
        """n greedy tokens after `first` (i64[B], the token the prefill chose), all on the device.

        Returns i64[B, n]. Whole-plan executors only."""
        jax, jnp = _jax(), _jnp()
        if len(self.nodes) != len(self.g.nodes):
            raise BackendError("greedy_decode runs whole plans on one device")
        if cache.length + n > cache.capacity:
            raise UsageError(f"sequence of {cache.length + n} tokens exceeds the KV cache capacity {cache.capacity}")
        if not hasattr(self, "_loop"):
            self._loop = jax.jit(self._decode_loop, static_argnums=(5,), donate_argnums=(1, 2))
        ks = {l: cache.k[l] for l in self.layers}
        vs = {l: cache.v[l] for l in self.layers}
        out, ks, vs = self._loop(self.params, ks, vs, jnp.asarray(first, jnp.int32),
                                 jnp.asarray(cache.length, jnp.int32), n)
        for l in self.layers:
            cache.k[l], cache.v[l] = ks[l], vs[l]
        cache.advance(n)
        return np.asarray(out).astype(np.int64)

    def can_decode_ahead(self, B: int, cache) -> bool:
        """Whether a whole plan's next decode steps can run ahead (runtime/ahead.py): on this
        executor alone, its cache on the device, no trace file (STRATA_DECODE_AHEAD=0: never)."""
        from strata_compiler.runtime import ahead

        return (len(self.nodes) == len(self.g.nodes) and not self.cached and ahead.wanted()
                and not ahead.traced_fully() and (not self.layers or hasattr(cache.k[self.layers[0]], "device")))

    def _ahead_step(self, params, ks, vs, tok, pos):
        """A decode step that also chooses its greedy token and the next position on the device."""
        jnp = _jnp()
        B = tok.shape[0]
        res, ks, vs = self._forward(params, ks, vs, {}, tok[:, None], B, 1, pos)
        nxt = jnp.argmax(res[self.g.outputs[0]].reshape(B, -1), axis=-1).astype(jnp.int32)
        return nxt, pos + 1, ks, vs

    def decode_ahead(self, tok: np.ndarray, cache, n: int, stop_ids=(), done: np.ndarray | None = None) -> np.ndarray:
        """Greedy decode of n steps from the tokens `tok` (int64 [B]) of a whole plan, each step
        dispatched before the one before has finished, its ids and position that step's results on
        the device (runtime/ahead.py). The tokens, int64 [B, <= n]."""
        from strata_compiler.runtime import ahead

        jax = _jax()
        if cache.length + n > cache.capacity:
            raise UsageError(f"sequence of {cache.length + n} tokens exceeds the KV cache capacity {cache.capacity}")
        fn = getattr(self, "_ahead_fn", None)
        if fn is None:
            fn = self._ahead_fn = jax.jit(self._ahead_step, donate_argnums=(1, 2))
        first = (np.asarray(tok, np.int32).reshape(-1), np.int32(cache.length))

        def launch(prev):
            ks = {l: cache.k[l] for l in self.layers}
            vs = {l: cache.v[l] for l in self.layers}
            t, pos, ks, vs = fn(self.params, ks, vs, *(first if prev is None else prev))
            for l in self.layers:
                cache.k[l], cache.v[l] = ks[l], vs[l]
            cache.advance(1)
            return t, pos

        def finish(step, use: bool) -> np.ndarray:
            return np.asarray(cuda_rt.fetch(jax.block_until_ready(step[0]))).astype(np.int64)

        return ahead.run(launch, finish, n, int(first[0].shape[0]), stop_ids, done)

    def run_segment(self, env: dict, input_ids: np.ndarray, cache, step_in: tuple | None = None) -> None:
        """Run this partition at the exact length (no padding: other devices share the step);
        `step_in`: step_inputs() of this device for this step, if the caller made them."""
        if self.layers and not hasattr(cache.k[self.layers[0]], "device"):
            self.new_cache(cache)
        ext = {i: env[i] for i in self.inputs if self.g.node(i).op is not Op.INPUT_IDS}
        jax = _jax()
        for i, v in ext.items():     # results of another GPU's partition: a device-to-device copy
            if not isinstance(v, np.ndarray) and self.device not in v.devices():
                ext[i] = jax.device_put(v, self.device)

        for n in self.cached:   # the live slot -> expert maps of the expert caches here
            live = expert_cache.lookup(self.g, n.attr("cache"))
            if live is not None:
                ext[-(n.id + 1)] = live.slots.copy()

        tr = trace.ACTIVE
        if tr is None:
            # results stay on the device: a consumer on the CPU waits for them when it reads them,
            # so CPU work in between (another share of the same layer) overlaps the GPU's
            outs = self.run_partition(ext, input_ids, cache, input_ids.shape[1], step_in)
            packed = outs.pop(PACKED, None)
            if packed is not None:
                if cuda_rt.mode is None:
                    packed.copy_to_host_async()
                off, holder = 0, {"buf": packed}
                for o in self.packed:
                    outs[o] = HostSlice(holder, off, outs[o].shape)
                    off += outs[o].n
            env.update(outs)
            return
        import threading
        import time

        # with raw copies on, host values go in by those inside the call, as untraced (their time is
        # the h2d span); else they are put on the device first and timed
        staging = self._staging() if input_ids.size <= RAW_MAX_TOKENS else None
        if staging is None:
            t0 = time.perf_counter()
            host_in = {i: v for i, v in ext.items() if isinstance(v, np.ndarray)}
            ext = {i: jax.device_put(v, self.device) if i in host_in else v for i, v in ext.items()}
            jax.block_until_ready(ext)
            tr.transfer("h2d", sum(int(v.nbytes) for v in host_in.values()), time.perf_counter() - t0)
        else:
            b0, s0 = staging.bytes, staging.seconds
        start = time.perf_counter_ns()
        outs = self.run_partition(ext, input_ids, cache, input_ids.shape[1], step_in)
        if staging is not None and staging.bytes > b0:
            tr.transfer("h2d", staging.bytes - b0, staging.seconds - s0, end_ns=staging.last_end_ns)

        def watch(outs=outs, start=start, n=len(self.nodes), tokens=int(input_ids.size)):
            jax.block_until_ready(outs)
            tr.add_span(f"xla partition ({n} ops)", "gpu", start, time.perf_counter_ns(), tokens=tokens)

        w = threading.Thread(target=watch, daemon=True)
        w.start()
        tr.watchers.append(w)
        env.update(outs)

    def run(self, input_ids: np.ndarray, cache) -> dict[int, np.ndarray]:
        """Whole-plan execution (every node on this executor)."""
        B, T = input_ids.shape
        if self.layers and not hasattr(cache.k[self.layers[0]], "device"):
            self.new_cache(cache)
        T_pad = self.bucket(T, cache.capacity - cache.length)
        outs = self.run_partition({}, input_ids, cache, T_pad)
        cache.advance(T)
        # the logits to the host by a raw copy when on (cuda_rt: ~12 us against JAX's ~0.35 ms on an H200 host)
        return {o: cuda_rt.fetch(outs[o]).reshape(B, T_pad, -1)[:, :T] for o in self.g.outputs}
