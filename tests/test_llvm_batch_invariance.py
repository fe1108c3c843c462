"""Batch invariance of the llvm q8 kernels: a token's outputs are the same bits whether it runs
alone (row dot products) or among many (register tiles), on every target (codegen/canon.py).
The AMX kernels' agreement with the row kernels is in test_llvm_amx.py."""

from __future__ import annotations

import numpy as np
import pytest

from strata_compiler.backends.llvm_cpu.codegen.dot import pair_layout
from strata_compiler.backends.llvm_cpu.codegen.linear import LinearSpec, generate
from strata_compiler.backends.llvm_cpu.codegen.moe import MoESpec, down, gate_up, h_stride
from test_llvm_linear_moe import LIBS, TARGETS, activations, call, pairs_of, ptr, quantized, routes


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("tname", list(TARGETS))
@pytest.mark.parametrize("fmt", ["int4", "int8", "int4a"])
@pytest.mark.parametrize("N,K,M,epi", [(37, 330, 11, "bsr"), (20, 256, 8, "s"), (9, 608, 13, "")])
def test_linear_token_alone_equals_token_in_a_batch(tname, fmt, N, K, M, epi, planes):
    t, lib = TARGETS[tname], LIBS[tname]
    rng = np.random.default_rng(K + M)
    silu_mul = "s" in epi
    rows = 2 * N if silu_mul else N
    w, s, _ = quantized(fmt, rng.standard_normal((rows, K), dtype=np.float32), 32)
    x = (rng.standard_normal((M, K), dtype=np.float32) * rng.random((M, 1), dtype=np.float32) * 4)
    xin, xd, xs, _ = activations(x, True, 32, pair_layout(t, fmt, 32), planes)
    b = rng.standard_normal(rows, dtype=np.float32)
    r = rng.standard_normal((M, N), dtype=np.float32)
    src = generate(LinearSpec(fmt, N, K, 32, True, bias="b" in epi, silu_mul=silu_mul, residual="r" in epi,
                              planes=planes), t)

    def run(m0: int, m1: int) -> np.ndarray:
        y = np.full((m1 - m0, N), np.nan, np.float32)
        call(lib, src, dict(y=ptr(y), x=ptr(xin[m0:m1]), xd=ptr(xd[m0:m1]), xs=ptr(xs[m0:m1]), w=ptr(w), s=ptr(s),
                            b=ptr(b), r=ptr(r[m0:m1]), M=m1 - m0, ldx=xin.shape[1], ldy=N, ldr=N), N, split=N // 3)
        return y

    together = run(0, M)
    alone = np.concatenate([run(m, m + 1) for m in range(M)])
    in_pairs = np.concatenate([run(m, min(m + 3, M)) for m in range(0, M, 3)])
    np.testing.assert_array_equal(_bits(together), _bits(alone))
    np.testing.assert_array_equal(_bits(in_pairs), _bits(alone))


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("tname", list(TARGETS))
@pytest.mark.parametrize("fmt", ["int4", "int8", "int4a"])
def test_moe_token_alone_equals_token_in_a_batch(tname, fmt, planes):
    """Gate/up and down of 23 tokens (experts with whole R x T tiles and leftovers) against each
    token run alone: the same h rows and the same outputs, bit for bit."""
    t, lib = TARGETS[tname], LIBS[tname]
    rng = np.random.default_rng(11)
    E, D, I, M, k = 3, 96, 80, 23, 2
    wu, su, _ = quantized(fmt, rng.standard_normal((E, 2 * I, D), dtype=np.float32), 32)
    wdn, sdn, _ = quantized(fmt, rng.standard_normal((E, D, I), dtype=np.float32), 32)
    x = rng.standard_normal((M, D), dtype=np.float32)
    r = rng.standard_normal((M, D), dtype=np.float32)
    comb = routes(rng, M, E, k)[0]
    spec = MoESpec(fmt, D, I, 32, True, residual=True, planes=planes)
    pairs = pair_layout(t, fmt, 32)

    def run(m0: int, m1: int) -> tuple[np.ndarray, np.ndarray]:
        tok, exp, pw, first, active = pairs_of(comb[m0:m1])
        xin, xd, xs, _ = activations(x[m0:m1], True, 32, pairs, planes)
        hfull = np.zeros((len(tok), h_stride(spec)), np.float32)
        h = hfull[:, :I]
        call(lib, gate_up(spec, t), dict(h=ptr(hfull), x=ptr(xin), xd=ptr(xd), xs=ptr(xs), w=ptr(wu), s=ptr(su),
                                          pair_tok=ptr(tok), first=ptr(first), active=ptr(active),
                                          ldx=xin.shape[1]), len(active) * I, split=I + 3)
        hin, hd, hs, _ = activations(np.ascontiguousarray(h), True, 32, pairs, planes)
        y = np.zeros((m1 - m0, D), np.float32)
        call(lib, down(spec, t), dict(y=ptr(y), r=ptr(r[m0:m1]), h=ptr(hin), hd=ptr(hd), hs=ptr(hs), w=ptr(wdn),
                                       s=ptr(sdn), pair_tok=ptr(tok), pair_exp=ptr(exp), pair_w=ptr(pw), P=len(tok),
                                       M=m1 - m0, ldy=D, ldr=D), D, split=17)
        hrows = {(int(m0 + tk), int(e)): h[p] for p, (tk, e) in enumerate(zip(tok, exp))}
        return y, hrows

    y_all, h_all = run(0, M)
    for m in range(M):
        y_one, h_one = run(m, m + 1)
        np.testing.assert_array_equal(_bits(y_one[0]), _bits(y_all[m]))
        for key, row in h_one.items():
            np.testing.assert_array_equal(_bits(row), _bits(h_all[key]))
