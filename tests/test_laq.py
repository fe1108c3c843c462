"""passes/laq.py: the layer-adaptive format allocator, and --bits / --memory-budget end to end."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.errors import UsageError
from strata_compiler.formats import get_format
from strata_compiler.hwprofile import parse_size
from strata_compiler.passes.laq import Option, allocate
from strata_compiler.runtime.plan import load_plan
from test_calibrate import demo  # noqa: F401  (fixture)


def _random_options(rng, n_tensors):
    out = {}
    for t in range(n_tensors):
        size = int(rng.integers(100, 1000))
        opts = []
        for bits, base in ((2, 8.0), (3, 3.0), (4, 1.0), (8, 0.05)):
            opts.append(Option(f"b{bits}", size * bits, float(base * rng.uniform(0.2, 5.0))))
        out[f"t{t}"] = opts
    return out


@pytest.mark.parametrize("seed", range(8))
def test_allocation_fits_and_is_near_the_exact_optimum(seed):
    rng = np.random.default_rng(seed)
    options = _random_options(rng, 5)
    lo = sum(min(o.nbytes for o in v) for v in options.values())
    hi = sum(max(o.nbytes for o in v) for v in options.values())
    budget = int(rng.uniform(lo, hi))
    choice = allocate(options, budget)
    assert sum(o.nbytes for o in choice.values()) <= budget
    names = sorted(options)
    best = min((sum(c.error for c in combo) for combo in itertools.product(*(options[n] for n in names))
                if sum(c.nbytes for c in combo) <= budget))
    got = sum(o.error for o in choice.values())
    assert got <= 1.02 * best + 1e-12
    # never worse than any uniform choice that fits
    for i in range(4):
        uni = [options[n][i] for n in names]
        if sum(o.nbytes for o in uni) <= budget:
            assert got <= sum(o.error for o in uni) + 1e-12


def test_allocation_extremes():
    options = _random_options(np.random.default_rng(0), 3)
    everything = allocate(options, 10**9)
    assert all(o.fmt == min(v, key=lambda o: o.error).fmt for o, v in zip(everything.values(), options.values()))
    with pytest.raises(UsageError, match="below the smallest possible"):
        allocate(options, 10)


@pytest.mark.parametrize("text,value", [("123", 123), ("1KiB", 1024), ("1.5GiB", int(1.5 * 2**30)),
                                        ("800MB", 800 * 10**6), ("16g", 16 * 2**30)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-5MB", "12XB", "0"])
def test_parse_size_rejects(text):
    with pytest.raises(UsageError, match="--memory-budget"):
        parse_size(text)


def _quantized_bytes(plan):
    from strata_compiler.formats import adaptive

    ws = [w for w in plan.graph.weights if adaptive(w)]
    nbytes = sum(get_format(w.fmt).nbytes(w.shape, w.group_size or 32) for w in ws)
    return nbytes, sum(int(np.prod(w.shape)) for w in ws), ws


def test_bits_budget_end_to_end(demo, tmp_path, monkeypatch):  # noqa: F811
    d, calib = demo
    out = tmp_path / "p"
    assert run_cli(stratac, ["compile", str(d), "-o", str(out), "--bits", "4.0", "--calib", str(calib),
                             "--calib-tokens", "256", "--dump-dir", str(tmp_path / "dump")]) == 0
    plan = load_plan(out)
    nbytes, params, ws = _quantized_bytes(plan)
    assert nbytes <= 4.0 / 8 * params
    assert nbytes >= 0.97 * 4.0 / 8 * params          # the budget is spent
    assert len({w.fmt for w in ws}) >= 2              # adaptive: not one format everywhere
    assert "embed" in {w.name for w in ws}            # the embedding table is decided too
    laq = json.loads((tmp_path / "dump" / "laq.json").read_text())
    # one format per tensor, expert stacks included: the plan stores each tensor whole, as chosen
    assert {w.name: w.fmt for w in ws} == {n: t["fmt"] for n, t in laq["tensors"].items()}
    assert any(w.experts > 1 for w in ws) and not any(w.expert_ids for w in plan.graph.weights)
    assert sum(t["bytes"] for t in laq["tensors"].values()) == nbytes <= laq["budget"]
    # with --calib, each tensor's error is its measured KL at the probe format, scaled per format
    assert laq["sensitivity"] and set(laq["sensitivity"]) == set(laq["tensors"])
    for name, t in laq["tensors"].items():
        assert t["options"]["int3"][1] == pytest.approx(laq["sensitivity"][name], rel=1e-9, abs=1e-15)
        assert all(v >= 0 for v in t["proxy"].values())
    # the mixed plan runs, and the llvm kernels agree with the reference backend (exact f32
    # activations: the default q8 activations of int8/int4 round x)
    from strata_compiler.runtime.session import Session

    monkeypatch.setenv("STRATA_CPU_ACT", "f32")
    ids = np.arange(3, 15, dtype=np.int64)[None]
    outs = []
    for backend in ("reference", "llvm"):
        s = Session(plan, backend=backend)
        s.reset(1, 32)
        outs.append(s.step(ids))
    assert np.abs(outs[0] - outs[1]).max() / outs[0].std() <= 1e-4


def test_memory_budget_end_to_end(demo, tmp_path):  # noqa: F811
    d, _ = demo
    ref = tmp_path / "int4"
    assert run_cli(stratac, ["compile", str(d), "-o", str(ref), "--quant", "int4"]) == 0
    size = (ref / "weights.bin").stat().st_size
    out = tmp_path / "p"
    assert run_cli(stratac, ["compile", str(d), "-o", str(out), "--memory-budget", str(size)]) == 0
    total = sum(get_format(w.fmt).nbytes(w.shape, w.group_size or 32) for w in load_plan(out).graph.weights)
    assert total <= size


@pytest.mark.parametrize("args,msg", [
    (["--quant", "int4", "--bits", "4"], "--quant int4 and --bits both choose formats"),
    (["--bits", "4", "--memory-budget", "1GiB"], "--bits and --memory-budget both set the size"),
    (["--memory-budget", "12XB"], "--memory-budget '12XB'"),
    (["--memory-budget", "1KiB"], "raise the budget"),
])
def test_bad_budget_flags(demo, tmp_path, capsys, args, msg):  # noqa: F811
    d, _ = demo
    rc = run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "p"), *args])
    err = capsys.readouterr().err
    assert rc != 0 and msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_tensor_format_overrides(demo, tmp_path):  # noqa: F811
    d, _ = demo
    out = tmp_path / "p"
    assert run_cli(stratac, ["compile", str(d), "-o", str(out), "--quant", "int4",
                             "--tensor-format", r"L0\.attn=int8,moe\.down=int3"]) == 0
    ws = {w.name: w for w in load_plan(out).graph.weights}
    assert ws["L0.attn.q_k_v"].fmt == "int8" and ws["L1.attn.q_k_v"].fmt == "int4"
    assert all(w.fmt == "int3" for n, w in ws.items() if n.endswith("moe.down"))
    assert ws["embed"].fmt == "f32"      # only linear-layer matrices take formats


@pytest.mark.parametrize("rule,msg", [("L0=int9", "unknown weight format 'int9'"), ("nofmt", "use REGEX=FORMAT"),
                                      ("(=int4", "bad regular expression")])
def test_bad_tensor_format_rules(demo, tmp_path, capsys, rule, msg):  # noqa: F811
    d, _ = demo
    rc = run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "p"), "--tensor-format", rule])
    err = capsys.readouterr().err
    assert rc != 0 and msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1

