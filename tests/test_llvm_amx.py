"""The AMX prefill kernels (codegen/amx.py: MoE and linear): their assembly for an AMX CPU anywhere, their
products against the q8 definition and, bit for bit, the row-by-row kernels where this CPU has AMX
(canon.py: one order of arithmetic, so a token's result does not depend on the kernel that took it)."""

from __future__ import annotations

import numpy as np
import pytest

from strata_compiler.backends.llvm_cpu.codegen import amx
from strata_compiler.backends.llvm_cpu.codegen import moe as moe_gen
from strata_compiler.backends.llvm_cpu.codegen.linear import LinearSpec, generate
from strata_compiler.backends.llvm_cpu.codegen.moe import MoESpec
from strata_compiler.backends.llvm_cpu.jit import KernelLibrary, emit_artifacts
from strata_compiler.backends.llvm_cpu.target import Target
from strata_compiler.backends.reference.executor import silu
from test_llvm_linear_moe import activations, call, linear_reference, ptr, quantized, routes

HOST = Target.host()
needs_amx = pytest.mark.skipif(not HOST.amx, reason="this CPU has no AMX-INT8 (or the OS did not grant it)")


@pytest.mark.parametrize("fmt", amx.FORMATS)
def test_kernels_use_tiles_on_an_amx_cpu(fmt):
    t = Target.named("sapphirerapids")
    assert t.amx and not Target.named("icelake-server").amx
    spec = amx.AmxMoESpec(fmt, fmt, 256, 384, residual=True)
    lin = amx.AmxLinearSpec(fmt, 64, 256, bias=True, silu_mul=True, residual=True)
    for src in (amx.gate_up(spec, t), amx.down(spec, t), amx.linear(lin, t)):
        asm = emit_artifacts(src.ir, t)["s"]
        assert "tdpbssd" in asm and "ldtilecfg" in asm and "tilerelease" in asm, src.name


def test_supported_shapes():
    t = Target.named("sapphirerapids")
    assert amx.supported(t, "int4", 32, "int8", 32, 2048, 5632)
    assert not amx.supported(t, "int4", 64, "int4", 32, 2048, 5632)          # group size
    assert not amx.supported(t, "int3", 32, "int4", 32, 2048, 5632)          # format
    assert not amx.supported(t, "int4", 32, "int4", 32, 2048, 5630)          # I not whole groups
    assert not amx.supported(Target.host(force="avx2"), "int4", 32, "int4", 32, 2048, 5632)


def _layout(first: np.ndarray, nA: int):
    """Each active expert's pairs padded to whole tiles, as binders._amx_tiles lays them out."""
    counts = np.diff(first[:nA + 1])
    nt = (counts + amx.T - 1) // amx.T
    st = amx.T * (np.cumsum(nt) - nt)
    prow = np.repeat(st - first[:nA], counts) + np.arange(int(first[nA]))
    return nt, st, int(amx.T * nt.sum()), prow


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@needs_amx
@pytest.mark.parametrize("fmt,dfmt,D,I,planes", [("int4", "int4", 64, 96, 1), ("int8", "int8", 64, 96, 1),
                                                 ("int4", "int8", 64, 96, 1), ("int4a", "int4a", 64, 96, 1),
                                                 ("int4a", "int4", 320, 2112, 1), ("int4", "int8", 64, 96, 2),
                                                 ("int4a", "int4a", 320, 2112, 2)])
def test_moe_tiles_match_the_q8_definition(fmt, dfmt, D, I, planes):
    """The AMX MoE kernels against the q8 definition, and bit for bit against the row kernels (I =
    2112: 66 groups, more than a pass of tile_gemm keeps)."""
    lib = KernelLibrary(HOST, use_disk_cache=False)
    rng = np.random.default_rng(3)
    E, M, k = 5, 37, 2
    wu, su, gud = quantized(fmt, rng.standard_normal((E, 2 * I, D), dtype=np.float32), 32)
    wd, sd, dnd = quantized(dfmt, rng.standard_normal((E, D, I), dtype=np.float32), 32)
    x = rng.standard_normal((M, D), dtype=np.float32)
    r = rng.standard_normal((M, D), dtype=np.float32)
    _, tok, exp, pw, first, active = routes(rng, M, E, k, choices=E - 1)      # expert 4 never chosen
    nA = len(active)
    nt, st, Pp, prow = _layout(first, nA)
    xq, xd, xs, xdeq = activations(x, True, 32, planes=planes)
    xg = np.full((Pp, D * planes), 77, np.int8)     # pad rows hold bytes; their scale is 0
    xgd = np.zeros((Pp, D // 32), np.float32)
    xgs = np.full((Pp, D // 32), 5, np.int32)
    xg[prow], xgd[prow], xgs[prow] = xq[tok], xd[tok], xs[tok]
    h = np.full((Pp, I), np.nan, np.float32)
    spec = amx.AmxMoESpec(fmt, dfmt, D, I, residual=True, planes=planes)
    act = active
    call(lib, amx.gate_up(spec, HOST), dict(h=ptr(h), x=ptr(xg), xd=ptr(xgd), xs=ptr(xgs), w=ptr(wu), s=ptr(su),
                                           act=ptr(act), pstart=ptr(st), ptiles=ptr(nt), ldh=I), nA * I // amx.T,
         split=7)
    href = np.stack([silu(xdeq[m] @ gud[e, :I].T) * (xdeq[m] @ gud[e, I:].T) for m, e in zip(tok, exp)])
    np.testing.assert_allclose(h[prow], href, atol=2e-5 * np.abs(href).max())
    rspec = MoESpec(fmt, D, I, 32, True, residual=True, down_fmt=dfmt, down_q8=True, down_group_size=32,
                    planes=planes)
    hrow = np.zeros((len(tok), I), np.float32)
    call(lib, moe_gen.gate_up(rspec, HOST), dict(h=ptr(hrow), x=ptr(xq), xd=ptr(xd), xs=ptr(xs), w=ptr(wu), s=ptr(su),
                                                pair_tok=ptr(tok), first=ptr(first), active=ptr(active), ldx=D),
         nA * I, split=I + 3)
    np.testing.assert_array_equal(_bits(h[prow]), _bits(hrow))
    hq, hd, hs, hdeq = activations(np.ascontiguousarray(h[prow]), True, 32, planes=planes)
    hgq = np.zeros((Pp, I * planes), np.int8)
    hgd = np.zeros((Pp, I // 32), np.float32)
    hgs = np.zeros((Pp, I // 32), np.int32)
    hgq[prow], hgd[prow], hgs[prow] = hq, hd, hs
    ptok = np.full(Pp, -1, np.int64)
    ptok[prow] = tok
    pwp = np.zeros(Pp, np.float32)
    pwp[prow] = pw
    y = np.full((M, D), np.nan, np.float32)
    call(lib, amx.down(spec, HOST), dict(y=ptr(y), r=ptr(r), h=ptr(hgq), hd=ptr(hgd), hs=ptr(hgs), w=ptr(wd),
                                        s=ptr(sd), act=ptr(act), pstart=ptr(st), ptiles=ptr(nt), ptok=ptr(ptok),
                                        pw=ptr(pwp), nA=nA, M=M, ldy=D, ldr=D), D // amx.T, split=1)
    ref = r.copy()
    for p, (m, e) in enumerate(zip(tok, exp)):
        ref[m] += pw[p] * (hdeq[p] @ dnd[e].T)
    np.testing.assert_allclose(y, ref, atol=2e-5 * np.abs(ref).max())
    yrow = np.zeros((M, D), np.float32)
    call(lib, moe_gen.down(rspec, HOST), dict(y=ptr(yrow), r=ptr(r), h=ptr(hq), hd=ptr(hd), hs=ptr(hs), w=ptr(wd),
                                             s=ptr(sd), pair_tok=ptr(tok), pair_exp=ptr(exp), pair_w=ptr(pw),
                                             P=len(tok), M=M, ldy=D, ldr=D), D, split=17)
    np.testing.assert_array_equal(_bits(y), _bits(yrow))


@needs_amx
def test_a_prefill_on_tiles_matches_the_row_kernels(tiny_int8_plan, monkeypatch):
    """The executor's MoE and linear ops on AMX tiles (a prompt of AMX_MIN_TOKENS or more) give the
    logits of the row-by-row kernels (q8 rounding apart), and the same greedy tokens."""
    from strata_compiler.backends.llvm_cpu import binders
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.runtime.session import Session

    plan = load_plan(tiny_int8_plan)
    ids = np.random.default_rng(5).integers(3, 3000, (1, 64))
    out = {}
    for name, least in (("tiles", 16), ("rows", 10 ** 9)):
        monkeypatch.setattr(binders, "AMX_MIN_TOKENS", least)
        logits, new = Session(plan, "llvm").generate(ids, 2, Sampler(0.0, 1.0, 0), keep_logits=True)
        out[name] = (logits, new)
    sd = out["rows"][0].std()
    assert np.abs(out["tiles"][0] - out["rows"][0]).max() < 2e-2 * sd
    np.testing.assert_array_equal(out["tiles"][1], out["rows"][1])


@needs_amx
@pytest.mark.parametrize("fmt", amx.FORMATS)
@pytest.mark.parametrize("N,K,M,epi", [(32, 64, 37, "bsr"), (48, 96, 16, ""), (16, 32, 5, "s"), (64, 128, 33, "br"),
                                        (16, 2336, 17, "s")])
@pytest.mark.parametrize("planes", [1, 2])
def test_linear_tiles_match_the_q8_definition(fmt, N, K, M, epi, planes):
    """Against the q8 (q16) definition, and bit for bit against the row kernels (K = 2336: 73 groups)."""
    lib = KernelLibrary(HOST, use_disk_cache=False)
    rng = np.random.default_rng(N + K + M)
    silu_mul = "s" in epi
    rows = 2 * N if silu_mul else N
    w, s, wd = quantized(fmt, rng.standard_normal((rows, K), dtype=np.float32), 32)
    x = rng.standard_normal((M, K), dtype=np.float32)
    xq, xd, xs, xdeq = activations(x, True, 32, planes=planes)
    Mp = -(-M // amx.T) * amx.T
    xt = np.full((Mp, K * planes), 99, np.int8)
    xtd = np.zeros((Mp, K // 32), np.float32)
    xts = np.full((Mp, K // 32), 3, np.int32)
    xt[:M], xtd[:M], xts[:M] = xq, xd, xs
    b = rng.standard_normal(rows, dtype=np.float32)
    r = rng.standard_normal((M, N), dtype=np.float32)
    y = np.full((M + 1, N), np.nan, np.float32)          # the row past M stays untouched
    spec = amx.AmxLinearSpec(fmt, N, K, bias="b" in epi, silu_mul=silu_mul, residual="r" in epi, planes=planes)
    call(lib, amx.linear(spec, HOST), dict(y=ptr(y), x=ptr(xt), xd=ptr(xtd), xs=ptr(xts), w=ptr(w), s=ptr(s),
                                           b=ptr(b), r=ptr(r), M=M, ldy=N, ldr=N), N // amx.T, split=1)
    h = linear_reference(xdeq, wd, b, r, N, epi)
    np.testing.assert_allclose(y[:M], h, rtol=0, atol=2e-5 * np.abs(h).max())
    assert np.isnan(y[M]).all()
    yrow = np.zeros((M, N), np.float32)
    call(lib, generate(LinearSpec(fmt, N, K, 32, True, bias="b" in epi, silu_mul=silu_mul, residual="r" in epi,
                                  planes=planes), HOST),
         dict(y=ptr(yrow), x=ptr(xq), xd=ptr(xd), xs=ptr(xs), w=ptr(w), s=ptr(s), b=ptr(b), r=ptr(r), M=M, ldx=K,
              ldy=N, ldr=N), N, split=N // 3)
    np.testing.assert_array_equal(_bits(y[:M]), _bits(yrow))
