"""GPU time of the decode kernels per weight format, one MoE layer and the output head of the
Mixtral-shaped model (make_mixtral_model.py: D 2048, I 5632, 8 experts top-2; vocabulary 32000):
what a Q4_K_M plan's formats (its Q4_K / Q6_K as int4a / int8) cost against Q4_0's int4, and the
bandwidth each reaches.

    python3 benchmarks/kquant_kernels.py        (on a GPU; prints a markdown table)

Per row: the GPU's busy time per call (the sum of its kernels' durations from a JAX profiler trace
of 50 calls), the weight bytes a call reads (the two chosen experts, or the whole head) and those
bytes over that time. Values are random codes and scales: kernel speed does not depend on them.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import device_kernels  # noqa: E402
from strata_compiler.backends.xla import pallas_dense, pallas_moe  # noqa: E402
from strata_compiler.backends.xla.pallas_quant import gate  # noqa: E402
from strata_compiler.backends.xla.dequant import matvec  # noqa: E402
from strata_compiler.formats import get_format  # noqa: E402
from strata_compiler.ir import WeightSpec  # noqa: E402

E, D, I, K_TOP, V = 8, 2048, 5632, 2, 32000
GROUP: dict[str, int] = {}     # a format's group where it is not 32
INTERPRET = gate(True, True)[1]        # STRATA_PALLAS=interpret: a check of this script on the CPU


def _arrays(fmt: str, shape: tuple, rng) -> dict:
    """Random stored arrays of `shape` in `fmt` (the format's own array shapes and dtypes)."""
    G = GROUP.get(fmt, 32)
    out = {}
    for name, (dt, s) in get_format(fmt).array_shapes(shape, G).items():
        if dt == np.float16:
            out[name] = jnp.asarray(rng.uniform(1e-4, 1e-3, s).astype(np.float16))
        else:
            info = np.iinfo(dt)
            out[name] = jnp.asarray(rng.integers(info.min, info.max, s, dtype=dt, endpoint=True))
    return out


def _busy_us(f, args, calls: int = 50) -> float:
    jf = jax.jit(f)
    jax.block_until_ready(jf(*args))
    got = device_kernels(lambda: [jax.block_until_ready(jf(*args)) for _ in range(calls)])
    if got is None:
        raise SystemExit("no GPU kernel events: run this on a GPU")
    return got[1] / calls


def moe_row(fmts: tuple[str, str], rng) -> tuple[str, float, int]:
    gs = WeightSpec("gu", (E, 2 * I, D), (), E, fmts[0], GROUP.get(fmts[0], 32))
    ds = WeightSpec("dn", (E, D, I), (), E, fmts[1], GROUP.get(fmts[1], 32))
    ga, da = _arrays(fmts[0], gs.shape, rng), _arrays(fmts[1], ds.shape, rng)
    x = jnp.asarray(rng.standard_normal((1, D)).astype(np.float32))
    topi, topw = jnp.asarray([[1, 5]], jnp.int32), jnp.asarray([[0.6, 0.4]], jnp.float32)
    f = lambda x, ga, da: pallas_moe.moe_decode(x, topi, topw, gs, ga, ds, da, interpret=INTERPRET)   # noqa: E731
    per_expert = sum(a.nbytes for a in ga.values()) // E + sum(a.nbytes for a in da.values()) // E
    return f"MoE layer gate_up {fmts[0]}, down {fmts[1]}", _busy_us(f, (x, ga, da)), K_TOP * per_expert


def head_row(fmt: str, rng) -> tuple[str, float, int]:
    spec = WeightSpec("head", (V, D), (), 0, fmt, GROUP.get(fmt, 32))
    a = _arrays(fmt, spec.shape, rng)
    x = jnp.asarray(rng.standard_normal((1, D)).astype(np.float32))
    if pallas_dense.use_linear(True, spec, 1)[0]:
        f, how = (lambda x, a: pallas_dense.linear_decode(x, spec, a, interpret=INTERPRET)), "Pallas"
    else:
        f, how = (lambda x, a: matvec(jnp, spec, a, x)), "XLA multiply-reduce"
    return f"head {fmt} ({how})", _busy_us(f, (x, a)), sum(v.nbytes for v in a.values())


def main() -> int:
    rng = np.random.default_rng(0)
    rows = [moe_row(f, rng) for f in (("int4", "int4"), ("int4a", "int8"), ("int4a", "int4a"))]
    rows += [head_row(f, rng) for f in ("int4", "int8")]
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; GPU busy us per call, median of none "
          "(the mean over 50 calls)\n")
    print("| kernel | us | MB read | GB/s |\n|---|---:|---:|---:|")
    for name, us, nbytes in rows:
        print(f"| {name} | {us:.1f} | {nbytes / 1e6:.2f} | {nbytes / us / 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
