"""Long prefills of a mixed plan run its CPU-placed experts on the GPU, their weights copied there
partition by partition (runtime/partitions.py MixedExecutor._streamed_parts): the same logits as
the CPU kernels and the reference backend, then decode as before. JAX's CPU platform stands in
for the GPU (the executor's `stream_ok` forced)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata_compiler.runtime.plan import load_plan
from strata_compiler.runtime.session import Session

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("streamed")
    subprocess.run([sys.executable, "-c", "from strata_compiler.cli import main; main()", "compile",
                    str(ROOT / "examples" / "models" / "tiny-moe"), "-o", str(out), "--quant", "f32",
                    "--place", r"re:^L(0|1)\.moe\.(gate|up|down)=cpu,all=gpu"], check=True, capture_output=True,
                   timeout=300)
    return load_plan(out)


def _run(plan, ids, stream: bool, monkeypatch):
    monkeypatch.setenv("STRATA_STREAM_PREFILL_TOKENS", "16" if stream else "0")
    s = Session(plan, "auto", device="cpu")
    s.executor.stream_ok = True
    s.reset(1, 128)
    out = [s.step(ids[None])[0]]
    for t in (5, 9, 11):
        out.append(s.step(np.array([[t]], np.int64))[0])
    return np.concatenate(out), s


def test_streamed_prefill_gives_the_cpu_kernels_logits(plan, monkeypatch):
    ids = np.random.default_rng(0).integers(3, plan.meta["model"]["vocab_size"], 37)
    got, s = _run(plan, ids, True, monkeypatch)
    assert s.executor.streamed_steps == 1 and len(s.executor._streamed) == 2     # the 2 CPU layers' experts
    assert all(not e.params for e in s.executor._streamed.values())    # their device copies dropped
    plain, p = _run(plan, ids, False, monkeypatch)
    assert p.executor.streamed_steps == 0
    ref = Session(plan, "reference")
    ref.reset(1, 128)
    want = np.concatenate([ref.step(ids[None])[0]] + [ref.step(np.array([[t]], np.int64))[0] for t in (5, 9, 11)])
    assert np.abs(got - want).max() <= 1e-4 * want.std()
    assert np.abs(plain - want).max() <= 1e-4 * want.std()


def test_short_prefills_stay_on_the_cpu(plan, monkeypatch):
    ids = np.arange(3, 12)      # 9 tokens: under the 16 asked for
    _, s = _run(plan, ids, True, monkeypatch)
    assert s.executor.streamed_steps == 0


def _executor(plan, stream_from: object, placed_by: str = "cost model"):
    """The plan's executor as if the cost model had placed it with break-even `stream_from`
    (the GPU forced, as above)."""
    from strata_compiler.ir import make_attrs
    from strata_compiler.runtime.partitions import MixedExecutor

    record = json.dumps({"phases": {"prefill": {"stream_from_tokens": stream_from}}})
    g = plan.graph.with_(meta=make_attrs(**dict(plan.graph.meta, placed_by=placed_by, placement=record)))
    mx = MixedExecutor(g, plan.weights, device="cpu")
    mx.stream_ok = True
    return mx


def test_auto_streams_from_the_plans_break_even_and_a_setting_overrides_it(plan, monkeypatch):
    monkeypatch.delenv("STRATA_STREAM_PREFILL_TOKENS", raising=False)
    mx = _executor(plan, 40)
    assert mx._streamed_parts(39) == {} and len(mx._streamed_parts(40)) == 2
    monkeypatch.setenv("STRATA_STREAM_PREFILL_TOKENS", "64")       # a given value beats the plan's
    assert mx._streamed_parts(63) == {} and len(mx._streamed_parts(64)) == 2
    monkeypatch.setenv("STRATA_STREAM_PREFILL_TOKENS", "0")
    assert mx._streamed_parts(4096) == {}
    monkeypatch.delenv("STRATA_STREAM_PREFILL_TOKENS")
    assert _executor(plan, None)._streamed_parts(4096) == {}       # the plan predicts it never pays


@pytest.mark.parametrize("stream_from,placed_by", [("40", "cost model"), (-1, "cost model"), (2**40, "cost model"),
                                                   (40, "rules")])
def test_auto_takes_128_tokens_without_a_valid_break_even(plan, monkeypatch, stream_from, placed_by):
    """A hostile or invalid value in the plan's meta, or a plan placed by --place rules: the fallback."""
    monkeypatch.delenv("STRATA_STREAM_PREFILL_TOKENS", raising=False)
    mx = _executor(plan, stream_from, placed_by)
    assert mx._streamed_parts(127) == {} and len(mx._streamed_parts(128)) == 2


# backends/xla/streaming.py: the streamed partitions share two device buffer sets per layout,
# refilled by raw copies only after their last reader finished (raw copies in host mode stand in
# for a CUDA GPU's)
def _prefill(plan, ids, stream: bool, monkeypatch):
    monkeypatch.setenv("STRATA_STREAM_PREFILL_TOKENS", "16" if stream else "0")
    monkeypatch.setenv("STRATA_RAW_COPY", "host")
    s = Session(plan, "auto", device="cpu")
    s.executor.stream_ok = True
    s.reset(1, 128)
    out = [s.step(ids[None])[0], s.step(ids[None, :20])[0]]     # two streamed steps: both sets reused
    return np.concatenate(out), s


def test_streamed_partitions_share_two_sets_and_match_the_cpu(plan, monkeypatch):
    ids = np.random.default_rng(0).integers(3, plan.meta["model"]["vocab_size"], 37)
    got, s = _prefill(plan, ids, True, monkeypatch)
    exes = list(s.executor._streamed.values())
    pool = exes[0].pool
    assert pool is not None and all(e.pool is pool for e in exes) and len(exes) == 2
    per_step = sum(v.nbytes for e in exes for arrs in e.host_params.values() for v in arrs.values())
    assert pool.bytes == 2 * per_step           # every streamed partition copied once per step
    assert len(pool.sets) == 1 and not pool.guards.keys() - {(next(iter(pool.sets)), 0), (next(iter(pool.sets)), 1)}
    want, p = _prefill(plan, ids, False, monkeypatch)
    assert p.executor.streamed_steps == 0
    assert np.abs(got - want).max() <= 1e-4 * want.std()
