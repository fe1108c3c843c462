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

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import device_kernels  # noqa: E402
from strata_compiler import settings  # noqa: E402
from strata_compiler.backends.xla import pallas_dense, pallas_moe  # noqa: E402
from strata_compiler.backends.xla.pallas_quant import gate  # noqa: E402
from strata_compiler.backends.xla.dequant import matvec  # noqa: E402
from strata_compiler.formats import get_format  # noqa: E402
from strata_compiler.ir import WeightSpec  # noqa: E402

E, D, I, K_TOP, V = 8, 2048, 5632, 2, 32000
GROUP: dict[str, int] = {}     # a format's group where it is not 32
CHECK = False
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


def _checked(name: str, f, args) -> str:
    """name, with --check: the kernels' result against the same kernels in Pallas interpret mode
    (max |difference| / max |value|), a test of the code Triton compiled."""
    if not CHECK or INTERPRET:
        return name
    got, want = (np.asarray(jax.jit(functools.partial(f, interpret=i))(*args)) for i in (False, True))
    return f"{name} (vs interpret: {np.abs(got - want).max() / np.abs(want).max():.1e})"


def moe_row(fmts: tuple[str, str], rng) -> tuple[str, float, int]:
    gs = WeightSpec("gu", (E, 2 * I, D), (), E, fmts[0], GROUP.get(fmts[0], 32))
    ds = WeightSpec("dn", (E, D, I), (), E, fmts[1], GROUP.get(fmts[1], 32))
    ga, da = _arrays(fmts[0], gs.shape, rng), _arrays(fmts[1], ds.shape, rng)
    x = jnp.asarray(rng.standard_normal((1, D)).astype(np.float32))
    topi, topw = jnp.asarray([[1, 5]], jnp.int32), jnp.asarray([[0.6, 0.4]], jnp.float32)
    f = lambda x, ga, da, interpret=INTERPRET: pallas_moe.moe_decode(   # noqa: E731
        x, topi, topw, gs, ga, ds, da, interpret=interpret)
    per_expert = sum(a.nbytes for a in ga.values()) // E + sum(a.nbytes for a in da.values()) // E
    name = _checked(f"MoE layer gate_up {fmts[0]}, down {fmts[1]}", f, (x, ga, da))
    return name, _busy_us(f, (x, ga, da)), K_TOP * per_expert


def head_row(fmt: str, rng) -> tuple[str, float, int]:
    spec = WeightSpec("head", (V, D), (), 0, fmt, GROUP.get(fmt, 32))
    a = _arrays(fmt, spec.shape, rng)
    x = jnp.asarray(rng.standard_normal((1, D)).astype(np.float32))
    if pallas_dense.use_linear(True, spec, 1)[0]:
        f = lambda x, a, interpret=INTERPRET: pallas_dense.linear_decode(x, spec, a, interpret=interpret)  # noqa: E731
        name = _checked(f"head {fmt} (Pallas)", f, (x, a))
    else:
        f, name = (lambda x, a: matvec(jnp, spec, a, x)), f"head {fmt} (XLA multiply-reduce)"
    return name, _busy_us(f, (x, a)), sum(v.nbytes for v in a.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tunes", default="", help="MoE rows again under each pallas_tune, `BN1,BN2,W1,W2;...`")
    ap.add_argument("--check", action="store_true", help="each Pallas row's result against interpret mode")
    ap.add_argument("--linear-tunes", default="", help="head rows again under each pallas_linear_tune, `BN,W;...`")
    a = ap.parse_args()
    global CHECK
    CHECK = a.check
    rng = np.random.default_rng(0)
    moe = (("int4", "int4"), ("int4a", "int8"), ("int4a", "int4a"))
    rows = [moe_row(f, rng) for f in moe]
    rows += [head_row(f, rng) for f in ("int4", "int8")]
    for t in filter(None, a.tunes.split(";")):
        with settings.override(pallas_tune=tuple(int(v) for v in t.split(","))):
            rows += [(f"{name} [pallas_tune {t}]", us, nb) for name, us, nb in (moe_row(f, rng) for f in moe[1:])]
    for t in filter(None, a.linear_tunes.split(";")):
        with settings.override(pallas_linear_tune=tuple(int(v) for v in t.split(","))):
            name, us, nb = head_row("int8", rng)
            rows.append((f"{name} [pallas_linear_tune {t}]", us, nb))
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; GPU busy us per call, median of none "
          "(the mean over 50 calls)\n")
    print("| kernel | us | MB read | GB/s |\n|---|---:|---:|---:|")
    for name, us, nbytes in rows:
        print(f"| {name} | {us:.1f} | {nbytes / 1e6:.2f} | {nbytes / us / 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
