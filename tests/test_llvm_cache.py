"""The CPU kernel cache: a second run compiles nothing; corrupt entries are rebuilt; paths honoured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_models import build_model

BIN = Path(sys.executable).parent


def run(plan: Path, ids: Path, env: dict) -> tuple[str, str]:
    p = subprocess.run([str(BIN / "strata-run"), str(plan), "--input-ids", str(ids), "-n", "4", "--backend", "llvm",
                        "--greedy"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout, p.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache")
    model = build_model("mixtral", tmp / "model")
    np.save(tmp / "ids.npy", np.array([[1, 2, 3, 4]], np.int64))
    return tmp, model


def env_with(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("STRATA_CACHE_DIR", "XDG_CACHE_HOME")}
    env.update({k: str(v) for k, v in kw.items()})
    return env


def compile_to(model: Path, out: Path, env: dict) -> None:
    p = subprocess.run([str(BIN / "stratac"), "compile", str(model), "-o", str(out), "--quant", "int4"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr


def test_compile_warms_the_cache_and_runs_compile_nothing(plan):
    tmp, model = plan
    env = env_with(STRATA_CACHE_DIR=tmp / "c1")
    compile_to(model, tmp / "p1", env)
    out1, line1 = run(tmp / "p1" / "plan.bin", tmp / "ids.npy", env)
    assert "kernels: 0 compiled" in line1, line1
    out2, line2 = run(tmp / "p1" / "plan.bin", tmp / "ids.npy", env)
    assert "kernels: 0 compiled" in line2 and out1 == out2


def test_cold_cache_compiles_once(plan):
    tmp, model = plan
    compile_to(model, tmp / "p2", env_with(STRATA_CACHE_DIR=tmp / "warm"))
    env = env_with(STRATA_CACHE_DIR=tmp / "cold")
    _, first = run(tmp / "p2" / "plan.bin", tmp / "ids.npy", env)
    assert "kernels: 0 compiled" not in first
    _, second = run(tmp / "p2" / "plan.bin", tmp / "ids.npy", env)
    assert "kernels: 0 compiled" in second


def test_corrupt_entries_are_rebuilt(plan):
    tmp, model = plan
    env = env_with(STRATA_CACHE_DIR=tmp / "c3")
    compile_to(model, tmp / "p3", env)
    good, _ = run(tmp / "p3" / "plan.bin", tmp / "ids.npy", env)
    entries = list((tmp / "c3" / "kernels").glob("*.o"))
    assert entries
    for i, e in enumerate(entries):
        data = bytearray(e.read_bytes())
        if i % 2:
            data[len(data) // 2] ^= 0xFF      # flipped byte
        else:
            data = data[: len(data) // 3]     # truncated
        e.write_bytes(bytes(data))
    out, line = run(tmp / "p3" / "plan.bin", tmp / "ids.npy", env)
    assert out == good and "kernels: 0 compiled" not in line
    _, line = run(tmp / "p3" / "plan.bin", tmp / "ids.npy", env)
    assert "kernels: 0 compiled" in line


def test_xdg_cache_home_is_honoured(plan):
    tmp, model = plan
    env = env_with(XDG_CACHE_HOME=tmp / "xdg")
    compile_to(model, tmp / "p4", env)
    assert list((tmp / "xdg" / "strata" / "kernels").glob("*.o"))
