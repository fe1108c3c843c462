"""Long prefills of a mixed plan run its CPU-placed experts on the GPU, their weights copied there
partition by partition (runtime/partitions.py MixedExecutor._streamed_parts): the same logits as
the CPU kernels and the reference backend, then decode as before. JAX's CPU platform stands in
for the GPU (the executor's `stream_ok` forced)."""

from __future__ import annotations

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
