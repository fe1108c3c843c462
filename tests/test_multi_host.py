"""Several hosts (runtime/distributed.py): two processes joined by jax.distributed run a plan
striped over the four devices they hold together (two each: JAX's CPU platform stands in for
GPUs, gloo for NCCL) and give the tokens one process with all four devices gives."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_models import build_model, clear_prompts, load_model
from test_place import fake_profile

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run(plan, ids, out, devices: int, extra=()):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "strata_compiler.runtime.cli", str(plan / "plan.bin"), "--input-ids", str(ids),
           "-n", "6", "--ignore-eos", "--device", "cpu", "--tokens-out", str(out), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_run_a_striped_plan_as_one_mesh(tmp_path, monkeypatch):
    from strata_compiler.cli import stratac
    from strata_compiler.cli_common import run_cli
    from strata_compiler.passes import place

    monkeypatch.setattr(place, "PARTITION_S", 0.0)      # everything fits and goes to the GPUs
    monkeypatch.setattr(place, "GPU_KERNEL_S", 0.0)
    d = build_model("qwen3_moe", tmp_path / "model")
    m = load_model(d)
    ids = clear_prompts(m, m.config.vocab_size, n_prompts=1, length=6, n_new=6, seed=3)[0]
    np.save(tmp_path / "ids.npy", ids)
    hw = fake_profile(tmp_path / "hw.json")
    assert run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "p"), "--target", str(hw), "--gpu-mem", "1GiB",
                             "--gpus", "4", "--gpu-mode", "stripe"]) == 0
    one = _run(tmp_path / "p", tmp_path / "ids.npy", tmp_path / "one.npy", 4)
    assert one.wait(300) == 0, one.stderr.read()[-3000:]
    port = _free_port()
    procs = [_run(tmp_path / "p", tmp_path / "ids.npy", tmp_path / "two.npy", 2,
                  ("--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)))
             for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (so, se) in zip(procs, outs):
        assert p.returncode == 0, se[-3000:]
    # process 0 prints the tokens, process 1 nothing; gloo's connection lines, which two ranks per
    # process may interleave into fragments ("3" on a line of its own), are not token lines
    said = [[ln for ln in so.splitlines() if re.fullmatch(r"\d+( \d+)+", ln.strip())] for so, _ in outs]
    assert len(said[0]) == 1 and said[1] == []
    np.testing.assert_array_equal(np.load(tmp_path / "two.npy"), np.load(tmp_path / "one.npy"))


def test_multi_host_flags_go_together(tmp_path, capsys):
    from strata_compiler.cli_common import run_cli
    from strata_compiler.runtime.cli import strata_run

    assert run_cli(strata_run, [str(tmp_path / "missing.bin"), "--prompt", "x", "--coordinator", "h:1"]) != 0
    err = capsys.readouterr().err
    assert "--coordinator, --num-processes and --process-id go together" in err and "Traceback" not in err
