"""The llvm_cpu row kernels (codegen/elementwise.py) and attention kernels (codegen/attention.py)
against the NumPy reference semantics (backends/reference/executor.py).

Kernels are JIT-compiled for the host and called through ctypes with the uniform signature
`void k(const int64_t *args, int64_t begin, int64_t end)`. Activations are views into wider
buffers (row strides larger than the row width), outputs start as a sentinel so writes outside
the rows and columns a kernel owns are caught, and several tests call a kernel over [0, n) in
pieces (as the thread pool does) and require the same bits as one call.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytest.importorskip("llvmlite.binding")

from strata_compiler.backends.llvm_cpu.codegen import attention as at  # noqa: E402
from strata_compiler.backends.llvm_cpu.codegen import elementwise as ew  # noqa: E402
from strata_compiler.backends.llvm_cpu.codegen.common import float_slot  # noqa: E402
from strata_compiler.backends.llvm_cpu.jit import KernelLibrary, emit_artifacts  # noqa: E402
from strata_compiler.backends.llvm_cpu.target import Target  # noqa: E402
from strata_compiler.backends.reference.executor import (  # noqa: E402
    rms_norm,
    rope,
    sdpa,
    sigmoid,
    silu,
    softmax,
    topk_mask,
)
from strata_compiler.rope import rope_inv_freq  # noqa: E402
from strata_compiler.kv_cache import KVCache  # noqa: E402

KERNEL = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
SENTINEL = np.float32(-7.25)
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def lib() -> KernelLibrary:
    return KernelLibrary(Target.host(), use_disk_cache=False)


@pytest.fixture(scope="module")
def lib_avx2() -> KernelLibrary:
    return KernelLibrary(Target.host(force="avx2"), use_disk_cache=False)


def call(lib: KernelLibrary, ks, n: int, cuts=(), **args) -> None:
    """Run kernel `ks` over [0, n), split at `cuts`; args by name (arrays, ints, floats, None)."""
    vals = []
    for p in ks.params:
        v = args[p]
        if v is None:
            vals.append(0)
        elif isinstance(v, np.ndarray):
            vals.append(v.ctypes.data)
        elif isinstance(v, float):
            vals.append(float_slot(v))
        else:
            vals.append(int(v))
    slots = (ctypes.c_int64 * len(vals))(*vals)
    fn = KERNEL(lib.address(ks.ir, ks.name))
    bounds = [0, *cuts, n]
    for a, b in zip(bounds, bounds[1:]):
        fn(ctypes.addressof(slots), a, b)


def wide(rng, M: int, C: int, pad: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """A random [M, C + pad] buffer and its [M, C] view (row stride C + pad)."""
    buf = (rng.standard_normal((M, C + pad)) * scale).astype(np.float32)
    return buf, buf[:, :C]


def out_buf(M: int, C: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    buf = np.full((M, C + pad), SENTINEL, np.float32)
    return buf, buf[:, :C]


def check_pad(buf: np.ndarray, C: int) -> None:
    assert np.all(buf[:, C:] == SENTINEL), "kernel wrote outside its columns"


# ------------------------------------------------------------------------------------ rms_norm

@pytest.mark.parametrize("C,group", [(70, 0), (64, 16), (24, 24), (128, 0), (70, 10)])
@pytest.mark.parametrize("M", [1, 5])
def test_rms_norm(lib, C, group, M):
    rng = np.random.default_rng(C * 10 + group + M)
    xb, x = wide(rng, M, C, 3, scale=3.0)
    w = (1.0 + 0.3 * rng.standard_normal(group or C)).astype(np.float32)
    yb, y = out_buf(M, C, 5)
    ks = ew.rms_norm(C, group, lib.target)
    call(lib, ks, M, cuts=(2,) if M > 2 else (), x=xb, w=w, y=yb, ldx=C + 3, ldy=C + 5, eps=1e-6)
    np.testing.assert_allclose(y, rms_norm(x, w, 1e-6, group), rtol=RTOL, atol=ATOL)
    check_pad(yb, C)


# --------------------------------------------------------------------------------------- route

def ref_route(x: np.ndarray, k: int, norm: bool) -> np.ndarray:
    m = topk_mask(softmax(x), k)
    return m / m.sum(axis=-1, keepdims=True) if norm else m


@pytest.mark.parametrize("E,k,norm", [(6, 2, True), (6, 2, False), (8, 1, False), (6, 6, True),
                                      (60, 4, True), (64, 8, False)])
def test_route(lib, E, k, norm):
    rng = np.random.default_rng(E * 100 + k)
    M = 7
    xb, x = wide(rng, M, E, 2, scale=2.0)
    x[1] = 0.5                                   # all tied: the first k win
    x[2, :] = -1.0
    x[2, [1, 2, E - 1]] = 3.0                    # a three-way tie at the top
    x[3, ::2] = 1.25                             # ties at the cut
    x[4] *= 40.0                                 # saturated softmax
    yb, y = out_buf(M, E, 3)
    ks = ew.route(E, k, norm, lib.target)
    call(lib, ks, M, cuts=(3,), x=xb, y=yb, ldx=E + 2, ldy=E + 3)
    ref = ref_route(x, k, norm).astype(np.float32)
    assert np.array_equal(y != 0, ref != 0), "different experts kept"
    np.testing.assert_allclose(y, ref, rtol=RTOL, atol=1e-7)
    check_pad(yb, E)


# --------------------------------------------------------------------------------------- embed

@pytest.mark.parametrize("D", [70, 64])
@pytest.mark.parametrize("M", [1, 5])
def test_embed(lib, D, M):
    rng = np.random.default_rng(D + M)
    table = rng.standard_normal((11, D)).astype(np.float32)
    ids = rng.integers(0, 11, size=M).astype(np.int64)
    ids[-1] = 10
    yb, y = out_buf(M, D, 2)
    call(lib, ew.embed(D, lib.target), M, ids=ids, table=table, y=yb, ldy=D + 2)
    assert np.array_equal(y, table[ids])
    check_pad(yb, D)


# ------------------------------------------------------------------------------ binary / unary

@pytest.mark.parametrize("op", ["add", "mul"])
@pytest.mark.parametrize("C,b_cols", [(70, 70), (70, 1), (64, 64), (33, 1)])
def test_binary(lib, op, C, b_cols):
    rng = np.random.default_rng(C + b_cols)
    M = 5
    ab, a = wide(rng, M, C, 1)
    bb, b = wide(rng, M, b_cols, 4)
    yb, y = out_buf(M, C, 3)
    call(lib, ew.binary(op, C, b_cols, lib.target), M, cuts=(1, 4),
         a=ab, b=bb, y=yb, lda=C + 1, ldb=b_cols + 4, ldy=C + 3)
    ref = a + b if op == "add" else a * b
    assert np.array_equal(y, ref.astype(np.float32))
    check_pad(yb, C)


@pytest.mark.parametrize("op", ["silu", "sigmoid", "clamp"])
@pytest.mark.parametrize("C", [70, 33])
@pytest.mark.parametrize("M", [1, 5])
def test_unary(lib, op, C, M):
    rng = np.random.default_rng(C + M)
    xb, x = wide(rng, M, C, 2, scale=4.0)
    x[0, :4] = [95.0, -95.0, 0.0, -0.0]
    yb, y = out_buf(M, C, 1)
    call(lib, ew.unary(op, C, lib.target), M, x=xb, y=yb, ldx=C + 2, ldy=C + 1, limit=1.5)
    with np.errstate(over="ignore"):   # exp(95) overflows to inf in f32, as in the kernel
        ref = {"silu": silu, "sigmoid": sigmoid, "clamp": lambda t: np.clip(t, -1.5, 1.5)}[op](x)
    np.testing.assert_allclose(y, ref, rtol=RTOL, atol=1e-30)
    check_pad(yb, C)


@pytest.mark.parametrize("start,stop", [(3, 40), (0, 70), (64, 70), (69, 70)])
def test_slice_copy(lib, start, stop):
    rng = np.random.default_rng(start)
    M, C = 5, 70
    xb, x = wide(rng, M, C, 6)
    W = stop - start
    yb, y = out_buf(M, W, 2)
    call(lib, ew.slice_copy(start, stop, lib.target), M, cuts=(2,), x=xb, y=yb, ldx=C + 6, ldy=W + 2)
    assert np.array_equal(y, x[:, start:stop])
    check_pad(yb, W)


# ---------------------------------------------------------------------------------- quantize_q8

def ref_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The q8 definition: blocks of 32 (zero-padded), d = max|x|/127, q = clip(rint(x * (1/d)))."""
    M, K = x.shape
    NG = -(-K // 32)
    xpad = np.zeros((M, NG * 32), np.float32)
    xpad[:, :K] = x
    g = xpad.reshape(M, NG, 32)
    d = np.abs(g).max(-1) / 127
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, 1 / d, 0)
    q = np.clip(np.rint(g * inv[..., None]), -127, 127)
    assert d.dtype == inv.dtype == q.dtype == np.float32
    return q.astype(np.int8).reshape(M, NG * 32), d, q.sum(-1).astype(np.int32)


def q8_input(rng, M: int, K: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    xb, x = wide(rng, M, K, pad, scale=2.0)
    x[0, :32] = 0.0                                           # d = 0 block
    if M > 1:   # exact halves: max 127 -> d = 1, x / d = k + 0.5 rounds to even
        x[1, : min(K, 32)] = (np.arange(min(K, 32)) % 9 - 4 + 0.5).astype(np.float32)
        x[1, 0] = 127.0
    if M > 2:
        x[2] *= 1e4
        x[2, K - 1] = -3e-3
    if M > 3:
        x[3] *= 1e-30                                           # tiny (subnormal d)
    return xb, x


@pytest.mark.parametrize("K", [70, 64, 20, 33, 96])
@pytest.mark.parametrize("M", [1, 5])
def test_quantize_q8(lib, K, M):
    rng = np.random.default_rng(K + M)
    xb, x = q8_input(rng, M, K, 5)
    NG = -(-K // 32)
    xq = np.full((M, NG * 32), 99, np.int8)
    xd = np.full((M, NG), SENTINEL, np.float32)
    xs = np.full((M, NG), 12345, np.int32)
    call(lib, ew.quantize_q8(K, lib.target), M, cuts=(1,) if M > 1 else (), x=xb, xq=xq, xd=xd, xs=xs, ldx=K + 5)
    rq, rd, rs = ref_q8(x)
    assert np.array_equal(xq, rq)
    assert np.array_equal(xd.view(np.int32), rd.view(np.int32))
    assert np.array_equal(xs, rs)


# ------------------------------------------------------------------------------------ attention

def ref_fused_attention(qkv, cache: KVCache, H, KV, hd, mode, qnw, knw, eps, clip, attrs):
    """backends/reference/executor.py `_fused_attention` on one step, then the cache advances."""
    q, k, v = qkv[..., :H * hd], qkv[..., H * hd:(H + KV) * hd], qkv[..., (H + KV) * hd:]
    if mode != "none":
        group = hd if mode == "head" else 0
        q, k = rms_norm(q, qnw, eps, group), rms_norm(k, knw, eps, group)
    if clip is not None:
        q, k, v = (np.clip(t, -clip, clip) for t in (q, k, v))
    T = qkv.shape[1]
    pos = cache.positions(T)[:, None] + np.arange(T)      # [B, T]
    q, k = rope(q, pos, hd, attrs), rope(k, pos, hd, attrs)
    out = sdpa(q, k, v, cache, 0, H, KV, hd)
    cache.advance(T)
    return out


class Attention:
    """The two llvm kernels over one layer's cache, stepping like the reference."""

    def __init__(self, lib, B, H, KV, hd, mode, clip, cap, attrs):
        self.lib, self.B, self.H, self.KV, self.hd, self.clip = lib, B, H, KV, hd, clip
        self.prep = at.attn_prep(H, KV, hd, mode, clip is not None, lib.target)
        self.core = at.attn_core(H, KV, hd, lib.target)
        self.kc = np.zeros((B, KV, cap, hd), np.float32)
        self.vc = np.zeros((B, KV, cap, hd), np.float32)
        self.inv_freq = rope_inv_freq(hd, attrs)
        self.cap, self.past = cap, 0

    def step(self, qkv_buf, ldq, T, qnw, knw, eps, prep_cuts=(), core_cuts=(), ld_pad=3):
        B, H, hd = self.B, self.H, self.hd
        qout = np.full((B * T, H * hd), SENTINEL, np.float32)
        ldo = H * hd + ld_pad
        ob = np.full((B * T, ldo), SENTINEL, np.float32)
        call(self.lib, self.prep, B * T, cuts=prep_cuts, qkv=qkv_buf, qnw=qnw, knw=knw, qout=qout,
             kc=self.kc, vc=self.vc, T=T, pasts=np.full(B, self.past, np.int64), cap=self.cap, ldq=ldq, eps=eps,
             clip=float(self.clip or 0.0), inv_freq=self.inv_freq)
        call(self.lib, self.core, B * H, cuts=core_cuts, qout=qout, kc=self.kc, vc=self.vc, o=ob,
             T=T, pasts=np.full(B, self.past, np.int64), cap=self.cap, ldo=ldo)
        check_pad(ob, H * hd)
        self.past += T
        return ob[:, :H * hd].reshape(B, T, H * hd)


ATTN_CASES = [
    # B, H, KV, hd, qk_norm, clip, chunks (prefill, prefill, decode...), rope attrs
    (2, 4, 2, 24, "none", None, (5, 3, 1), {"rope_theta": 10000.0}),
    (2, 4, 2, 24, "head", None, (4, 4, 1, 1), {"rope_theta": 1e6}),
    (1, 4, 4, 16, "full", None, (6, 2, 1), {"rope_theta": 10000.0}),
    (2, 6, 2, 32, "head", 1.0, (3, 5, 1), {"rope_theta": 10000.0}),
    (2, 4, 1, 64, "full", 0.9, (2, 7, 1), {"rope_theta": 500000.0, "rope_type": "llama3", "rope_factor": 8.0,
                                            "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                                            "rope_original_max": 64}),
    (1, 2, 1, 128, "none", 2.0, (9, 1), {"rope_theta": 10000.0}),
    # more keys than attn_core's block of 16: full and partial blocks, the running max moving on
    (2, 4, 2, 24, "head", None, (20, 13, 1, 1), {"rope_theta": 10000.0}),
    (1, 4, 1, 40, "none", None, (1, 16, 17, 1), {"rope_theta": 10000.0}),
]


def run_attention(lib, B, H, KV, hd, mode, clip, chunks, attrs, seed=0):
    rng = np.random.default_rng(seed + hd + H)
    cap = sum(chunks) + 3
    W = (H + 2 * KV) * hd
    eps = 1e-6
    nw = {"none": (0, 0), "head": (hd, hd), "full": (H * hd, KV * hd)}[mode]
    qnw = (1 + 0.2 * rng.standard_normal(nw[0])).astype(np.float32) if nw[0] else None
    knw = (1 + 0.2 * rng.standard_normal(nw[1])).astype(np.float32) if nw[1] else None
    ref_cache = KVCache(1, B, KV, hd, cap)
    ours = Attention(lib, B, H, KV, hd, mode, clip, cap, attrs)
    for i, T in enumerate(chunks):
        qkv_buf = (rng.standard_normal((B * T, W + 5)) * (1.5 + i)).astype(np.float32)   # later keys score higher
        qkv = qkv_buf[:, :W].reshape(B, T, W)
        ref = ref_fused_attention(qkv, ref_cache, H, KV, hd, mode, qnw, knw, eps, clip, attrs)
        cuts = ((1,) if B * T > 1 else (), (1, B * H - 1) if i % 2 else ())
        got = ours.step(qkv_buf, W + 5, T, qnw, knw, eps, prep_cuts=cuts[0], core_cuts=cuts[1])
        # softmax amplifies the scores' rounding (|score| ~ 10 here): absolute error relative to the output scale
        np.testing.assert_allclose(got, ref, rtol=RTOL, atol=1e-5 * np.abs(ref).max(), err_msg=f"step {i} (T={T})")
    n = sum(chunks)
    np.testing.assert_allclose(ours.kc[:, :, :n], ref_cache.k[0][:, :, :n], rtol=RTOL, atol=2e-6)
    np.testing.assert_array_equal(ours.vc[:, :, :n], ref_cache.v[0][:, :, :n])
    assert not ours.kc[:, :, n:].any() and not ours.vc[:, :, n:].any(), "wrote past the new positions"


@pytest.mark.parametrize("B,H,KV,hd,mode,clip,chunks,attrs", ATTN_CASES)
def test_attention(lib, B, H, KV, hd, mode, clip, chunks, attrs):
    run_attention(lib, B, H, KV, hd, mode, clip, chunks, attrs)


def test_attention_rope_matches_reference_rope(lib):
    """attn_prep's q output alone is exactly the reference rope (no norm, no clip: same f32 ops)."""
    B, H, KV, hd, T, past = 2, 3, 1, 24, 4, 6
    attrs = {"rope_theta": 10000.0}
    rng = np.random.default_rng(7)
    W = (H + 2 * KV) * hd
    qkv = rng.standard_normal((B * T, W)).astype(np.float32)
    qout = np.zeros((B * T, H * hd), np.float32)
    kc = np.zeros((B, KV, 16, hd), np.float32)
    vc = np.zeros_like(kc)
    call(lib, at.attn_prep(H, KV, hd, "none", False, lib.target), B * T, qkv=qkv, qnw=None, knw=None,
         qout=qout, kc=kc, vc=vc, T=T, pasts=np.full(B, past, np.int64), cap=16, ldq=W, eps=1e-6, clip=0.0,
         inv_freq=rope_inv_freq(hd, attrs))
    ref = rope(qkv[:, :H * hd].reshape(B, T, H * hd), np.tile(np.arange(past, past + T), (B, 1)), hd, attrs)
    np.testing.assert_allclose(qout.reshape(B, T, H * hd), ref, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------- splits, empty ranges

def test_thread_split_bitwise(lib):
    """Any split of [0, n) gives the same bits as one call."""
    rng = np.random.default_rng(3)
    M, C = 9, 70
    xb, _ = wide(rng, M, C, 3, scale=2.0)
    for ks in [ew.rms_norm(C, 0, lib.target), ew.route(C, 5, True, lib.target), ew.unary("silu", C, lib.target)]:
        res = []
        for cuts in [(), (1,), (4, 5), tuple(range(1, M))]:
            y = np.full((M, C), SENTINEL, np.float32)
            call(lib, ks, M, cuts=cuts, x=xb, w=np.ones(C, np.float32), y=y, ldx=C + 3, ldy=C, eps=1e-5, limit=0.0)
            res.append(y)
        assert all(np.array_equal(r.view(np.int32), res[0].view(np.int32)) for r in res), ks.name
    res = []
    for cuts in [(), (2,), (1, 2, 3, 4, 5, 6, 7)]:
        xq = np.zeros((M, 96), np.int8)
        xd = np.zeros((M, 3), np.float32)
        xs = np.zeros((M, 3), np.int32)
        call(lib, ew.quantize_q8(C, lib.target), M, cuts=cuts, x=xb, xq=xq, xd=xd, xs=xs, ldx=C + 3)
        res.append((xq, xd, xs))
    assert all(all(np.array_equal(a, b) for a, b in zip(r, res[0])) for r in res)
    # attention: one call each vs every row / head on its own
    outs = []
    for prep_cuts, core_cuts in [((), ()), (tuple(range(1, 6)), tuple(range(1, 8)))]:
        att = Attention(lib, 2, 4, 2, 24, "head", 1.2, 10, {"rope_theta": 10000.0})
        rng = np.random.default_rng(11)
        ys = []
        for T in (3, 1):
            qkv = rng.standard_normal((2 * T, 8 * 24)).astype(np.float32)
            w = (1 + 0.1 * rng.standard_normal(24)).astype(np.float32)
            ys.append(att.step(qkv, 8 * 24, T, w, w, 1e-6, prep_cuts=prep_cuts[:2 * T - 1],
                               core_cuts=core_cuts))
        outs.append((ys, att.kc.copy(), att.vc.copy()))
    (y0, k0, v0), (y1, k1, v1) = outs
    assert all(np.array_equal(a, b) for a, b in zip(y0, y1))
    assert np.array_equal(k0, k1) and np.array_equal(v0, v1)


def test_empty_range_is_noop(lib):
    """begin >= end touches nothing, even with null pointers and zero sizes in args."""
    t = lib.target
    kernels = [ew.rms_norm(70, 0, t), ew.route(6, 2, True, t), ew.embed(70, t), ew.binary("add", 70, 1, t),
               ew.unary("clamp", 70, t), ew.slice_copy(3, 40, t), ew.quantize_q8(70, t),
               at.attn_prep(4, 2, 24, "full", True, t), at.attn_core(4, 2, 24, t)]
    for ks in kernels:
        slots = (ctypes.c_int64 * len(ks.params))()
        fn = KERNEL(lib.address(ks.ir, ks.name))
        fn(ctypes.addressof(slots), 0, 0)
        fn(ctypes.addressof(slots), 5, 5)
        fn(ctypes.addressof(slots), 7, 3)


def test_core_with_no_tokens_is_noop(lib):
    """attn_core over (b, h) pairs with T = 0 writes nothing."""
    ks = at.attn_core(4, 2, 24, lib.target)
    o = np.full((1, 96), SENTINEL, np.float32)
    kc = np.zeros((1, 2, 4, 24), np.float32)
    call(lib, ks, 4, qout=o, kc=kc, vc=kc, o=o, T=0, pasts=np.full(1, 2, np.int64), cap=4, ldo=96)
    assert np.all(o == SENTINEL)


def test_names_encode_shapes():
    t = Target.host()
    names = [ew.rms_norm(70, 0, t).name, ew.rms_norm(70, 10, t).name, ew.rms_norm(64, 0, t).name,
             ew.route(6, 2, True, t).name, ew.route(6, 2, False, t).name, ew.route(6, 3, True, t).name,
             ew.route(8, 2, True, t).name, ew.embed(70, t).name, ew.embed(64, t).name,
             ew.binary("add", 70, 1, t).name, ew.binary("add", 70, 70, t).name, ew.binary("mul", 70, 1, t).name,
             ew.unary("silu", 70, t).name, ew.unary("sigmoid", 70, t).name, ew.unary("silu", 64, t).name,
             ew.slice_copy(3, 40, t).name, ew.slice_copy(4, 40, t).name, ew.quantize_q8(70, t).name,
             ew.quantize_q8(64, t).name,
             at.attn_prep(4, 2, 24, "none", False, t).name, at.attn_prep(4, 2, 24, "none", True, t).name,
             at.attn_prep(4, 2, 24, "head", False, t).name, at.attn_prep(4, 1, 24, "none", False, t).name,
             at.attn_prep(4, 2, 32, "none", False, t).name, at.attn_core(4, 2, 24, t).name,
             at.attn_core(8, 2, 24, t).name, at.attn_core(4, 2, 32, t).name, at.attn_core(4, 1, 24, t).name]
    assert len(set(names)) == len(names)
    assert at.attn_prep(4, 2, 24, "head", True, t).params == at.PREP_PARAMS
    assert at.attn_core(4, 2, 24, t).params == at.CORE_PARAMS


# ------------------------------------------------------------------------------------ AVX2 path

def test_avx2_target(lib_avx2):
    """A few kernels again for an AVX2-only target (on AVX-512 hosts: the other code path)."""
    assert not lib_avx2.target.avx512
    test_rms_norm(lib_avx2, 70, 0, 5)
    test_route(lib_avx2, 60, 4, True)
    test_unary(lib_avx2, "silu", 70, 5)
    test_quantize_q8(lib_avx2, 70, 5)
    run_attention(lib_avx2, *ATTN_CASES[1])
    run_attention(lib_avx2, *ATTN_CASES[4])


def test_avx512_codegen():
    """Compile-only (the host may lack AVX-512): a 512-bit target gets zmm code for every generator."""
    t = Target("sapphirerapids", "+avx2,+fma,+f16c,+avx512f,+avx512bw,+avx512vl,+avx512dq,+avx512vnni,-prefer-256-bit")
    assert t.avx512 and t.vector_bits == 512
    for ks in [ew.rms_norm(70, 0, t), ew.route(64, 8, True, t), ew.binary("mul", 70, 1, t),
               ew.unary("silu", 70, t), ew.quantize_q8(70, t),
               at.attn_prep(4, 2, 24, "full", True, t), at.attn_core(8, 2, 128, t)]:
        assert "zmm" in emit_artifacts(ks.ir, t)["s"], ks.name
    for ks in [ew.embed(64, t), ew.slice_copy(0, 64, t)]:   # copies may become memcpy: compile only
        assert emit_artifacts(ks.ir, t)["s"]


@pytest.fixture(scope="module")
def moe_plan(tmp_path_factory):
    """A compiled int4 qwen3_moe plan and the token ids of a prompt."""
    from hf_models import build_model
    from strata_compiler.cli import stratac
    from strata_compiler.cli_common import run_cli

    tmp = tmp_path_factory.mktemp("moe_plan")
    d = build_model("qwen3_moe", tmp / "model")
    assert run_cli(stratac, ["compile", str(d), "-o", str(tmp / "plan"), "--quant", "int4"]) == 0
    return tmp / "plan", np.array([[3, 17, 42, 8, 99]], np.int64)


def _logits(plan_dir, ids, steps: int = 1):
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.session import Session

    plan = load_plan(plan_dir)
    s = Session(plan, "llvm")
    s.reset(1, 16)
    out = [s.step(ids)[:, -1]] + [s.step(ids[:, i:i + 1])[:, -1] for i in range(steps)]
    return plan, s, np.concatenate(out)


def test_hugepage_resident_weights_keep_the_logits(moe_plan, monkeypatch):
    """Where the OS offers transparent huge pages, the llvm kernels' weights are copied out of the
    plan's mmap into anonymous memory (2 MiB pages): same logits as the mapped weights, the copies
    read-only and apart from the file's mapping."""
    from strata_compiler.backends.llvm_cpu import executor as lx

    out = {}
    for thp in (False, True):
        monkeypatch.setattr(lx, "hugepages_available", lambda: thp)
        plan, s, out[thp] = _logits(*moe_plan)
        assert s.executor.hugepages == thp
        if thp:
            name = next(w.name for w in plan.graph.weights if w.fmt == "int4")
            res, mapped = plan.weights.resident_arrays(name), plan.weights.arrays(name)
            for k in mapped:
                np.testing.assert_array_equal(res[k], mapped[k])
                assert not res[k].flags.writeable and not np.shares_memory(res[k], mapped[k])
            assert plan.weights.resident_arrays(name) is res           # copied once
    np.testing.assert_array_equal(out[False], out[True])


def test_segment_program_matches_the_op_by_op_path(moe_plan, monkeypatch):
    """An all-CPU step runs as one native segment program (pool.ll strata_run_program); timing the
    MoE phases (LLVMExecutor.phase_ns) or tracing runs it op by op from Python instead: the same logits, bit
    for bit, and the phase timer gets the MoE op's phases."""
    from strata_compiler.backends.llvm_cpu import executor as lx
    from strata_compiler.backends.llvm_cpu import pool as poolmod
    from strata_compiler import trace

    calls = []
    real = poolmod.ThreadPool.run_program
    monkeypatch.setattr(poolmod.ThreadPool, "run_program", lambda self, a, n, *r: (calls.append(n), real(self, a, n, *r)))
    out, ran = {}, {}
    for name in ("program", "phases", "traced"):
        calls.clear()
        monkeypatch.setattr(lx.LLVMExecutor, "phase_ns", {} if name == "phases" else None)
        trace.ACTIVE = trace.Tracer() if name == "traced" else None
        try:
            _, _, out[name] = _logits(*moe_plan, steps=4)
        finally:
            trace.ACTIVE = None
        ran[name] = len(calls)
        if name == "phases":
            ph = lx.LLVMExecutor.phase_ns
            assert ph["moe.gate_up"] and len(ph["moe.down"]) == len(ph["moe.pairs"])
    assert ran == {"program": 5, "phases": 0, "traced": 0}
    np.testing.assert_array_equal(out["program"], out["phases"])
    np.testing.assert_array_equal(out["program"], out["traced"])
