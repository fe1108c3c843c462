"""xla backend specifics (on JAX's CPU platform in CI): the device-side greedy loop, every MoE
path (expert slices, gathered experts, grouped ragged matmul) against the reference, and the
persistent compilation cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_models import build_model
from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.runtime.plan import load_plan
from strata_compiler.runtime.sampler import Sampler
from strata_compiler.runtime.session import Session


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("xla")
    d = build_model("olmoe", tmp / "model")
    out = {}
    for q in ("f32", "int4"):
        assert run_cli(stratac, ["compile", str(d), "-o", str(tmp / q), "--quant", q]) == 0
        out[q] = tmp / q
    return tmp, out


@pytest.mark.parametrize("quant", ["f32", "int4"])
def test_device_greedy_loop_matches_step_by_step(plans, quant):
    _, p = plans
    plan = load_plan(p[quant])
    ids = np.random.default_rng(0).integers(0, 100, (2, 5))
    _, want = Session(plan, "reference").generate(ids, 9, Sampler())
    s = Session(plan, "xla")
    s.reset(2, 64)
    first = s.step(ids)[:, -1].argmax(-1)
    rest = s.executor.greedy_decode(first, s.cache, 8)
    np.testing.assert_array_equal(np.concatenate([first[:, None], rest], 1), want)


@pytest.mark.parametrize("quant", ["f32", "int4"])
def test_generate_decodes_ahead_as_step_by_step(plans, quant, monkeypatch):
    """Session.generate on a whole xla plan dispatches each greedy step before the last has
    finished (backends/ahead.py): the reference's tokens, and a stop id ends it where step-by-step
    decoding ends."""
    _, p = plans
    plan = load_plan(p[quant])
    ids = np.random.default_rng(0).integers(0, 100, (2, 5))
    _, want = Session(plan, "reference").generate(ids, 9, Sampler())
    s = Session(plan, "xla")
    _, got = s.generate(ids, 9, Sampler())
    np.testing.assert_array_equal(got, want)
    assert s.executor._ahead_fn is not None
    stop = int(want[0, 4])
    _, a = Session(plan, "reference").generate(ids[:1], 9, Sampler(), stop_ids=(stop,))    # step by step
    _, b = s.generate(ids[:1], 9, Sampler(), stop_ids=(stop,))
    np.testing.assert_array_equal(a, b)
    assert b.shape[1] <= 5 and b[0, -1] == stop


@pytest.mark.parametrize("batch,length", [(1, 1), (3, 1), (2, 40)])   # slices, gather, ragged
def test_moe_paths_match_reference(plans, batch, length, monkeypatch):
    _, p = plans
    plan = load_plan(p["int4"])
    ids = np.random.default_rng(batch).integers(0, 100, (batch, length))
    want = Session(plan, "reference")
    want.reset(batch, 64)
    got = Session(plan, "xla")
    got.reset(batch, 64)
    a, b = want.step(ids), got.step(ids)
    assert np.abs(a - b).max() <= 1e-4 * a.std()


def test_second_run_compiles_nothing(plans, tmp_path):
    tmp, p = plans
    env = dict(os.environ, STRATA_CACHE_DIR=str(tmp_path / "cache"))
    np.save(tmp_path / "ids.npy", np.array([[1, 2, 3]], np.int64))
    cmd = [str(Path(sys.executable).parent / "strata-run"), str(p["f32"]), "--input-ids", str(tmp_path / "ids.npy"),
           "-n", "3", "--greedy", "--backend", "xla"]
    for _ in range(2):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
    entries = list((tmp_path / "cache" / "xla").iterdir())
    assert entries, "no persistent compilation cache entries"
    before = {e.name for e in entries}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and {e.name for e in (tmp_path / "cache" / "xla").iterdir()} == before


def test_layer_partitions_of_one_shape_compile_once(tmp_path):
    """A plan that puts every layer's experts on the CPU has one GPU partition per layer, all of
    one structure: they lower to the same module (results as tuples, not dicts keyed by node ids),
    so the persistent cache holds one entry per distinct partition and shape, not one per layer."""
    d = build_model("olmoe", tmp_path / "model", num_hidden_layers=5)
    plan = tmp_path / "plan"
    assert run_cli(stratac, ["compile", str(d), "-o", str(plan), "--place", "experts=cpu,all=gpu"]) == 0
    g = load_plan(plan).graph
    from strata_compiler.runtime.partitions import partitions

    n_xla = sum(b == "xla" for b, _ in partitions(g))
    env = dict(os.environ, STRATA_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    np.save(tmp_path / "ids.npy", np.array([[1, 2, 3]], np.int64))
    r = subprocess.run([str(Path(sys.executable).parent / "strata-run"), str(plan), "--input-ids",
                        str(tmp_path / "ids.npy"), "-n", "3", "--greedy", "--device", "cpu"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    names = [e.name for e in (tmp_path / "cache" / "xla").iterdir()]
    entries = [e for e in names if e.startswith("jit_traced_body")]
    # prefill and decode shapes of: the first partition (embedding), the middle layers' (all
    # alike), the last one (its layer and the head); decode steps after the first run as one
    # program (runtime/fused_step.py), one entry more
    assert n_xla == 6 and len(entries) <= 2 * 3, (n_xla, entries)
    assert sum(e.startswith("jit_fused_step") for e in names) == 1, names


def test_raw_copy_staging_round_trip(monkeypatch):
    """cuda_rt's staging and fetch logic, with memmove on JAX's CPU arrays standing in for
    cudaMemcpy: a staged value reaches the jitted call (0-d arrays stay 0-d), a rewrite waits for
    the previous call, fetch_into copies a result into a caller's buffer and declines a buffer
    of another dtype; without a CUDA runtime a GPU gets no raw copies."""
    import jax

    from strata_compiler.backends.xla import cuda_rt

    monkeypatch.setenv("STRATA_RAW_COPY", "host")
    assert cuda_rt.Transfers.of("cpu") == cuda_rt.Transfers("host") and cuda_rt.Transfers.of("cpu").raw
    dev = jax.devices("cpu")[0]
    st = cuda_rt.Staging(dev)
    f = jax.jit(lambda x, p: x * 2.0 + p)
    for i in range(3):
        x = np.arange(8, dtype=np.float32).reshape(1, 8) + i
        p = st.stage("pos", np.asarray(i, np.int32))
        assert p.shape == ()
        y = f(st.stage(0, x), p)
        st.guard = y
        out = np.empty((1, 8), np.float32)
        assert cuda_rt.fetch_into(y, out)
        np.testing.assert_array_equal(out, x * 2 + i)
    assert not cuda_rt.fetch_into(y, np.empty((1, 8), np.float64))
    np.testing.assert_array_equal(cuda_rt.fetch(y), np.asarray(y))
    # a staged value rewritten without write=True stays; a bulk copy (wait=False) lands by wait_bulk
    assert st.stage("pos", np.asarray(9, np.int32), write=False) is p and int(np.asarray(p)) == 2
    buf = st.stage(1, np.zeros(8, np.float32))
    cuda_rt.to_device(np.full(4, 7, np.float32), buf, offset=16, wait=False)
    cuda_rt.wait_bulk()
    np.testing.assert_array_equal(np.asarray(buf), [0, 0, 0, 0, 7, 7, 7, 7])
    with pytest.raises(ValueError, match="does not fit"):
        cuda_rt.to_device(np.zeros(4, np.float32), buf, offset=20)
    assert cuda_rt.pin([x]) == 0          # page-locking needs CUDA
    monkeypatch.delenv("STRATA_RAW_COPY")
    assert cuda_rt.raw_mode("cpu") is None      # the default on JAX's CPU platform: JAX's own copies
    assert not cuda_rt.fetch_into(y, out)       # decided per array, by its platform
    if not cuda_rt.available():
        assert cuda_rt.raw_mode("gpu") is None and not cuda_rt.Transfers.of("gpu").raw


def test_timings_count_the_compiling(plans, capsys):
    """A fresh session's first generation compiles its programs: the timings hold those seconds
    apart, and strata-run reports the rates without them too."""
    from strata_compiler.runtime.cli import strata_run

    tmp, p = plans
    s = Session(load_plan(p["f32"]), "xla")
    s.generate(np.random.default_rng(0).integers(0, 100, (1, 5)), 6, Sampler())
    t = s.timings
    assert 0 < t.prefill_compile_seconds <= t.prefill_seconds and 0 < t.decode_compile_seconds <= t.decode_seconds
    pre, dec = t.warm_rates()
    assert pre > t.rates()[0] and dec > t.rates()[1]
    np.save(tmp / "ids.npy", np.arange(1, 6))
    assert run_cli(strata_run, [str(p["int4"]), "--input-ids", str(tmp / "ids.npy"), "-n", "4", "--backend", "xla",
                                "--greedy", "--ignore-eos"]) == 0
    assert "s of compiling)" in capsys.readouterr().err
