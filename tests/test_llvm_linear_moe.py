"""llvm_cpu linear and MoE kernels against the reference semantics, every format and path.

Shapes include sizes that are not multiples of the vector width or of the group size. The q8
path is compared with the reference run on the same q8-rounded activations (its definition);
f32 activations must match the dequantized-weight product to f32 rounding.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from strata_compiler.backends.llvm_cpu.codegen.dot import pair_layout
from strata_compiler.backends.llvm_cpu.codegen.elementwise import quantize_q8
from strata_compiler.backends.llvm_cpu.codegen.linear import PARAMS, LinearSpec, generate
from strata_compiler.backends.llvm_cpu.codegen.moe import MoESpec, down, gate_up, h_stride, pairs
from strata_compiler.backends.llvm_cpu.jit import KernelLibrary, emit_artifacts
from strata_compiler.backends.llvm_cpu.target import Target
from strata_compiler.backends.reference.executor import moe_ffn, silu
from strata_compiler.formats import get_format

KFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
TARGETS = {"native": Target.host(), "avx2": Target.host(force="avx2")}
LIBS = {k: KernelLibrary(t, use_disk_cache=False) for k, t in TARGETS.items()}
CASES = [("f32", False), ("bf16", False), ("int8", False), ("int8", True), ("int4", False), ("int4", True),
         ("int4a", False), ("int4a", True), ("int3", False), ("int2", False), ("fp8", False)]


def call(lib, src, vals, total, split=None):
    f = KFN(lib.address(src.ir, src.name))
    args = (ctypes.c_int64 * len(src.params))(*[int(vals.get(p, 0)) for p in src.params])
    cuts = [0, total] if split is None else [0, split, total]
    for a, b in zip(cuts, cuts[1:]):
        f(ctypes.addressof(args), a, b)


def q8_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """q8 blocks as quantize_q8 defines them, plus the f32 values they stand for."""
    M, K = x.shape
    ng = -(-K // 32)
    xp = np.zeros((M, ng * 32), np.float32)
    xp[:, :K] = x
    g = xp.reshape(M, ng, 32)
    d = np.abs(g).max(-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.rint(g * inv[..., None]), -127, 127)
    return (q.astype(np.int8).reshape(M, -1), d.astype(np.float32), q.sum(-1).astype(np.int32),
            (q * d[..., None]).reshape(M, -1)[:, :K].astype(np.float32))


def q16_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """q16 blocks as quantize_q8(planes=2) defines them: rows [q | q2], d / 256, 256 sum q + sum q2,
    and the f32 values they stand for ((256 q + q2) d / 256)."""
    M, K = x.shape
    ng = -(-K // 32)
    xp = np.zeros((M, ng * 32), np.float32)
    xp[:, :K] = x
    g = xp.reshape(M, ng, 32)
    d = (np.abs(g).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.rint(g * inv[..., None]), -127, 127).astype(np.float32)
    r = (g.astype(np.float64) - q.astype(np.float64) * d[..., None]).astype(np.float32)   # one rounding: an fma
    q2 = np.clip(np.rint(r * (inv * np.float32(256))[..., None]), -127, 127).astype(np.float32)
    d2 = d / np.float32(256)
    codes = np.concatenate([q.astype(np.int8).reshape(M, -1), q2.astype(np.int8).reshape(M, -1)], axis=1)
    sums = (256 * q.sum(-1) + q2.sum(-1)).astype(np.int32)
    return codes, d2, sums, ((256 * q + q2) * d2[..., None]).reshape(M, -1)[:, :K].astype(np.float32)


def quantized(fmt, w, G):
    F = get_format(fmt)
    a = F.quantize(w, G or 32)
    return a.get("qs", a.get("w")), a.get("scales"), F.dequantize(a, w.shape[-1], G or 32)


def pair_permute(xq: np.ndarray) -> np.ndarray:
    """q8 data in the pair layout (codegen/dot.py: pair_layout): per two blocks
    [first[0:16], second[0:16], first[16:32], second[16:32]]; an odd last block unchanged."""
    M, Kp = xq.shape
    out = xq.copy()
    npair = Kp // 64
    if npair:
        b = xq[:, :npair * 64].reshape(M, npair, 2, 2, 16)          # pair, block, half, byte
        out[:, :npair * 64] = b.transpose(0, 1, 3, 2, 4).reshape(M, npair * 64)
    return out


def activations(x, q8, G, pairs: bool = False, planes: int = 1):
    if q8 and planes == 2:
        xq, xd, xs, xdeq = q16_reference(x)
        if pairs:
            h = xq.shape[1] // 2
            xq = np.concatenate([pair_permute(xq[:, :h]), pair_permute(xq[:, h:])], axis=1)
        return xq, xd, xs, xdeq
    if q8:
        xq, xd, xs, xdeq = q8_reference(x)
        return (pair_permute(xq) if pairs else xq), xd, xs, xdeq
    K = x.shape[1]
    kp = -(-K // G) * G if G else K
    xp = np.zeros((x.shape[0], kp), np.float32)
    xp[:, :K] = x
    return xp, None, None, x


def routes(rng, M: int, E: int, k: int, choices: int | None = None):
    """Random top-k routing of M tokens over E experts (picked among the first `choices`) as the
    pairs kernel lays it out: comb [M, E], then (token, expert, weight) pairs sorted by expert,
    each active expert's first pair (and the end), the active experts."""
    comb = np.zeros((M, E), np.float32)
    for m in range(M):
        comb[m, rng.choice(choices or E, k, replace=False)] = rng.random(k, dtype=np.float32)
    return (comb, *pairs_of(comb))


def pairs_of(comb: np.ndarray):
    """The routing comb [M, E] as the pairs kernel lays it out: (token, expert, weight) pairs
    sorted by expert, each active expert's first pair (and the end), the active experts."""
    tok, exp = np.nonzero(comb)
    order = np.argsort(exp, kind="stable")
    tok, exp = tok[order].astype(np.int64), exp[order].astype(np.int64)
    pw = comb[tok, exp].astype(np.float32)
    active, counts = np.unique(exp, return_counts=True)
    first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return tok, exp, pw, first, active.astype(np.int64)


def linear_reference(xdeq, wd, b, r, N: int, epi: str) -> np.ndarray:
    """linear's definition on the activations' values: bias, silu_mul (rows N.. the up half),
    residual as the epilogue letters b, s, r say."""
    h = xdeq @ wd.T + (b if "b" in epi else 0)
    if "s" in epi:
        h = silu(h[:, :N]) * h[:, N:]
    return h + r if "r" in epi else h


def ptr(a):
    return 0 if a is None else a.ctypes.data


@pytest.mark.parametrize("tname", list(TARGETS))
@pytest.mark.parametrize("fmt,q8", CASES)
@pytest.mark.parametrize("N,K,M,epi", [(37, 70, 3, "bsr"), (64, 96, 1, ""), (16, 32, 2, "s"), (130, 288, 5, "br"),
                                        (9, 330, 2, ""), (5, 512, 1, ""), (45, 608, 11, "bsr"), (50, 256, 9, "")])
def test_linear_matches_reference(tname, fmt, q8, N, K, M, epi):
    rng = np.random.default_rng(N * K + M)
    G = 32 if get_format(fmt).grouped else 0
    silu_mul = "s" in epi
    rows = 2 * N if silu_mul else N
    w, s, wd = quantized(fmt, rng.standard_normal((rows, K), dtype=np.float32), G)
    x = rng.standard_normal((M, K), dtype=np.float32)
    xin, xd, xs, xdeq = activations(x, q8, G, pair_layout(TARGETS[tname], fmt, G))
    b = rng.standard_normal(rows, dtype=np.float32)
    r = rng.standard_normal((M, N), dtype=np.float32)
    y = np.full((M, N), np.nan, np.float32)
    spec = LinearSpec(fmt, N, K, G, q8, bias="b" in epi, silu_mul=silu_mul, residual="r" in epi)
    call(LIBS[tname], generate(spec, TARGETS[tname]),
         dict(y=ptr(y), x=ptr(xin), xd=ptr(xd), xs=ptr(xs), w=ptr(w), s=ptr(s), b=ptr(b), r=ptr(r), M=M,
              ldx=xin.shape[1], ldy=N, ldr=N), N, split=N // 3)
    h = linear_reference(xdeq, wd, b, r, N, epi)
    np.testing.assert_allclose(y, h, rtol=0, atol=2e-5 * np.abs(h).max())


@pytest.mark.parametrize("tname", list(TARGETS))
@pytest.mark.parametrize("fmt", ["int4", "int8", "int4a"])
@pytest.mark.parametrize("N,K,M,epi", [(37, 70, 3, "bsr"), (16, 32, 2, "s"), (45, 608, 11, "bsr"), (50, 256, 9, "")])
def test_linear_q16_activations_match_reference(tname, fmt, N, K, M, epi):
    """q16 activations (two planes of int8 codes) against the product with the values they stand
    for: within f32 rounding of the exact one."""
    t = TARGETS[tname]
    rng = np.random.default_rng(N * K + M + 1)
    silu_mul = "s" in epi
    rows = 2 * N if silu_mul else N
    w, s, wd = quantized(fmt, rng.standard_normal((rows, K), dtype=np.float32), 32)
    x = rng.standard_normal((M, K), dtype=np.float32)
    xin, xd, xs, xdeq = activations(x, True, 32, pair_layout(t, fmt, 32), planes=2)
    assert np.abs(xdeq - x).max() <= np.abs(x).max() / 127 / 256
    b = rng.standard_normal(rows, dtype=np.float32)
    r = rng.standard_normal((M, N), dtype=np.float32)
    y = np.full((M, N), np.nan, np.float32)
    spec = LinearSpec(fmt, N, K, 32, True, bias="b" in epi, silu_mul=silu_mul, residual="r" in epi, planes=2)
    call(LIBS[tname], generate(spec, t), dict(y=ptr(y), x=ptr(xin), xd=ptr(xd), xs=ptr(xs), w=ptr(w), s=ptr(s),
                                              b=ptr(b), r=ptr(r), M=M, ldx=xin.shape[1], ldy=N, ldr=N), N, split=N // 3)
    h = linear_reference(xdeq, wd, b, r, N, epi)
    np.testing.assert_allclose(y, h, rtol=0, atol=2e-5 * np.abs(h).max())


@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("K", [32, 70, 330])
def test_quantize_q16_kernel_matches_definition(K, pairs):
    tname = "avx2" if pairs else "native"
    lib, t = LIBS[tname], TARGETS[tname]
    x = np.random.default_rng(K).standard_normal((3, K), dtype=np.float32) * 3
    ng = -(-K // 32)
    xq, xd, xs = np.zeros((3, 2 * ng * 32), np.int8), np.zeros((3, ng), np.float32), np.zeros((3, ng), np.int32)
    call(lib, quantize_q8(K, t, pairs, planes=2), dict(x=ptr(x), xq=ptr(xq), xd=ptr(xd), xs=ptr(xs), ldx=K), 3)
    rq, rd, rs, _ = activations(x, True, 32, pairs, planes=2)
    np.testing.assert_array_equal(xq, rq)
    np.testing.assert_array_equal(xd, rd)
    np.testing.assert_array_equal(xs, rs)


@pytest.mark.parametrize("K", [32, 64, 70, 200, 330])
def test_quantize_q8_pair_layout(K):
    """quantize_q8(pairs=True) writes the blocks of quantize_q8 in the pair layout (scales and
    block sums unchanged)."""
    lib, t = LIBS["avx2"], TARGETS["avx2"]
    x = np.random.default_rng(K).standard_normal((3, K), dtype=np.float32)
    ng = -(-K // 32)
    xq, xd, xs = np.zeros((3, ng * 32), np.int8), np.zeros((3, ng), np.float32), np.zeros((3, ng), np.int32)
    call(lib, quantize_q8(K, t, pairs=True), dict(x=ptr(x), xq=ptr(xq), xd=ptr(xd), xs=ptr(xs), ldx=K), 3)
    rq, rd, rs, _ = q8_reference(x)
    np.testing.assert_array_equal(xq, pair_permute(rq))
    np.testing.assert_array_equal(xs, rs)
    np.testing.assert_allclose(xd, rd, rtol=1e-6)
    assert pair_layout(t, "int4", 32) and not pair_layout(t, "int8", 32)


def test_quantize_q8_kernel_matches_definition():
    lib, t = LIBS["native"], TARGETS["native"]
    x = np.random.default_rng(1).standard_normal((3, 70), dtype=np.float32)
    xq, xd, xs = np.zeros((3, 96), np.int8), np.zeros((3, 3), np.float32), np.zeros((3, 3), np.int32)
    call(lib, quantize_q8(70, t), dict(x=ptr(x), xq=ptr(xq), xd=ptr(xd), xs=ptr(xs), ldx=70), 3)
    rq, rd, rs, _ = q8_reference(x)
    np.testing.assert_array_equal(xq, rq)
    np.testing.assert_array_equal(xd, rd)
    np.testing.assert_array_equal(xs, rs)


@pytest.mark.parametrize("tname", list(TARGETS))
@pytest.mark.parametrize("fmt,q8", CASES)
@pytest.mark.parametrize("E,D,I,M,k", [(6, 64, 40, 5, 2), (3, 96, 45, 23, 2)])
def test_moe_kernels_match_reference(tname, fmt, q8, E, D, I, M, k):
    """The second shape is prefill: enough pairs per expert for whole R x T tiles and leftovers."""
    lib, t = LIBS[tname], TARGETS[tname]
    rng = np.random.default_rng(7)
    G = 32 if get_format(fmt).grouped else 0
    wu, su, gud = quantized(fmt, rng.standard_normal((E, 2 * I, D), dtype=np.float32), G)
    wdn, sdn, dnd = quantized(fmt, rng.standard_normal((E, D, I), dtype=np.float32), G)
    x = rng.standard_normal((M, D), dtype=np.float32)
    r = rng.standard_normal((M, D), dtype=np.float32)
    comb, tok, exp, pw, first, active = routes(rng, M, E, k)
    spec = MoESpec(fmt, D, I, G, q8, residual=True)
    xin, xd, xs, xdeq = activations(x, q8, G, pair_layout(t, fmt, G))
    hfull = np.zeros((len(tok), h_stride(spec)), np.float32)   # f32 rows padded to whole groups
    h = hfull[:, :I]
    call(lib, gate_up(spec, t), dict(h=ptr(hfull), x=ptr(xin), xd=ptr(xd), xs=ptr(xs), w=ptr(wu), s=ptr(su),
                                      pair_tok=ptr(tok), first=ptr(first), active=ptr(active), ldx=xin.shape[1]),
         len(active) * I, split=I + 3)
    href = np.stack([silu(xdeq[m] @ gud[e, :I].T) * (xdeq[m] @ gud[e, I:].T) for m, e in zip(tok, exp)])
    np.testing.assert_allclose(h, href, atol=2e-5 * np.abs(href).max())
    assert not hfull[:, I:].any()
    hin, hd, hs, hdeq = activations(np.ascontiguousarray(h), q8, G, pair_layout(t, fmt, G))
    y = np.zeros((M, D), np.float32)
    call(lib, down(spec, t), dict(y=ptr(y), r=ptr(r), h=ptr(hin), hd=ptr(hd), hs=ptr(hs), w=ptr(wdn), s=ptr(sdn),
                                   pair_tok=ptr(tok), pair_exp=ptr(exp), pair_w=ptr(pw), P=len(tok), M=M, ldy=D, ldr=D),
         D, split=17)
    if q8:
        ref = r.copy()
        for p, (m, e) in enumerate(zip(tok, exp)):
            ref[m] += pw[p] * (hdeq[p] @ dnd[e].T)
    else:
        ref = moe_ffn(x[None], comb[None], lambda e: (gud[e, :I], gud[e, I:]), lambda e: dnd[e])[0] + r
    np.testing.assert_allclose(y, ref, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("M,E,k,ldc", [(1, 8, 2, 8), (7, 6, 2, 9), (40, 64, 8, 64), (3, 4, 4, 4), (0, 8, 2, 8)])
def test_moe_pairs_kernel_groups_pairs_by_expert(M, E, k, ldc):
    rng = np.random.default_rng(M + E)
    comb = np.zeros((max(M, 1), ldc), np.float32)
    for m in range(M):
        comb[m, rng.choice(E, k, replace=False)] = rng.random(k, dtype=np.float32) + 0.01
    comb[:, E:] = 5.0                                           # beyond E: must not be read
    tok, exp = np.zeros(M * E, np.int64), np.zeros(M * E, np.int64)
    pw, first = np.zeros(M * E, np.float32), np.full(E + 1, -1, np.int64)
    active, count = np.full(E, -1, np.int64), np.full(2, -1, np.int64)
    call(LIBS["native"], pairs(E, TARGETS["native"]),
         dict(comb=ptr(comb), ldc=ldc, M=M, tok=ptr(tok), exp=ptr(exp), pw=ptr(pw), first=ptr(first),
              active=ptr(active), count=ptr(count)), 1)
    t, e = np.nonzero(comb[:M, :E])
    order = np.argsort(e, kind="stable")
    acts, counts = np.unique(e, return_counts=True)
    P, nA = len(t), len(acts)
    assert list(count) == [P, nA]
    np.testing.assert_array_equal(tok[:P], t[order])
    np.testing.assert_array_equal(exp[:P], e[order])
    np.testing.assert_array_equal(pw[:P], comb[t[order], e[order]])
    np.testing.assert_array_equal(active[:nA], acts)
    np.testing.assert_array_equal(first[:nA + 1], np.concatenate([[0], np.cumsum(counts)]))


@pytest.mark.parametrize("cpu", ["sapphirerapids", "skylake-avx512"])
def test_int4_gemv_uses_zmm_on_avx512_hosts(cpu):
    """Compiled for an AVX-512 CPU (emitted, not run), the int4 GEMV works in zmm registers."""
    t = Target.named(cpu)
    assert t.avx512
    for q8 in (True, False):
        asm = emit_artifacts(generate(LinearSpec("int4", 4096, 4096, 32, q8), t).ir, t)["s"]
        assert "zmm" in asm, f"no zmm in the int4 GEMV for {cpu} (q8={q8})"
        if q8 and t.vnni:
            assert "vpdpbusd" in asm


@pytest.mark.parametrize("cpu", ["sapphirerapids", "skylake-avx512", "haswell"])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_prefill_tile_kernel_assembly(cpu, fmt):
    """The prefill linear with its R x T tile kernel (emitted, not run) works on zmm registers
    with vpdpbusd where the CPU has VNNI, zmm pmaddubsw on other AVX-512 CPUs, ymm on AVX2."""
    import re

    t = Target.named(cpu)
    tiles = emit_artifacts(generate(LinearSpec(fmt, 4096, 4096, 32, True), t).ir, t)["s"]
    if t.vnni:
        assert re.search(r"vpdpbusd\s+.*zmm", tiles), f"no zmm vpdpbusd in the {fmt} tile kernel for {cpu}"
    elif t.avx512:
        assert re.search(r"vpmaddubsw\s+.*zmm", tiles)
    else:
        assert re.search(r"vpmaddubsw\s+.*ymm", tiles) and "zmm" not in tiles


def test_avx2_target_has_no_avx512():
    t = TARGETS["avx2"]
    assert not t.avx512 and t.vector_bits == 256
    asm = emit_artifacts(generate(LinearSpec("int4", 256, 256, 32, True), t).ir, t)["s"]
    assert "zmm" not in asm and "ymm" in asm
