"""Start-up: `--backend auto` on a host without a CUDA GPU never imports JAX (issue 28), so a CPU
run of the tiny MoE starts as fast as `--backend llvm`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from strata_compiler.backends.xla.device import cuda_device_count


@pytest.mark.skipif(cuda_device_count() > 0, reason="this host has a CUDA GPU: auto picks xla")
def test_auto_on_a_cpu_host_does_not_import_jax(tiny_int8_plan):
    code = ("import sys\n"
            "from strata_compiler.cli_common import run_cli\n"
            "from strata_compiler.runtime.cli import strata_run\n"
            f"rc = run_cli(strata_run, [{str(tiny_int8_plan)!r}, '-n', '1', '--prompt', 'Hello'])\n"
            "print('rc', rc, 'jax imported' if 'jax' in sys.modules else 'no jax')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("rc 0 no jax"), r.stdout


def test_jax_starts_in_the_background_once(monkeypatch):
    """strata-run and strata-server bound for the xla backend start JAX's import and GPU backend on
    a thread while they read the plan (where the driver sees a GPU), and only once."""
    from strata_compiler.backends.xla import device

    calls = []
    monkeypatch.setattr(device, "_started", [])
    monkeypatch.setattr(device, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(device, "gpus", lambda: calls.append(1) or [])
    device.start_in_background()
    device.start_in_background()
    assert len(device._started) == 1
    device._started[0].join(10)
    assert calls == [1]


def test_zeros_all_makes_every_buffer_on_the_device():
    """A plan's weight buffers come from one program (device.zeros_all): each of the shape and
    dtype asked, zero, on the device asked."""
    import jax
    import numpy as np

    from strata_compiler.backends.xla.device import _zeros_all_fn, zeros_all

    dev = jax.devices("cpu")[0]
    specs = [((3, 5), np.float32), ((7,), np.uint8), ((2, 2, 4), np.float16), ((3, 5), np.float32)]
    out = zeros_all(specs, dev)
    assert [(a.shape, a.dtype) for a in out] == [(s, np.dtype(d)) for s, d in specs]
    assert all(not np.asarray(a).any() and a.devices() == {dev} for a in out)
    assert out[0] is not out[3]                   # separate buffers, even of one shape
    zeros_all(specs, dev)
    assert _zeros_all_fn.cache_info().hits >= 1   # one program per set of shapes
    assert zeros_all([], dev) == []


def test_jax_client_env_skips_the_memory_reservation(monkeypatch):
    """JAX's GPU client is told not to reserve 75 % of the device's memory at its start (seconds on
    a large GPU), unless the gpu_preallocate setting asks for it; a user's own value stays."""
    from strata_compiler import settings

    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    settings.jax_client_env()
    import os

    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    settings.jax_client_env()
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE")
    with settings.override(gpu_preallocate=True):
        settings.jax_client_env()
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ


def test_prefill_steps_are_larger_on_a_gpu(tiny_int8_plan):
    """Session's default prefill step: 512 tokens, 4096 where the executor prefills on a GPU with
    the flash kernel, else up to 4096, halved while one step's attention scores would pass
    GPU_SCORES_BYTES."""
    from strata_compiler.runtime import session as sm
    from strata_compiler.runtime.plan import load_plan

    s = sm.Session(load_plan(tiny_int8_plan), "llvm")
    assert s.default_chunk(1, 8192, 16) == sm.PREFILL_CHUNK

    from strata_compiler.execution import Caps, Executor

    class OnGpu(Executor):
        flash = True

        def caps(self):
            return Caps(prefills_on_gpu=True, flash_prefill=self.flash)

    s.executor = OnGpu()
    assert s.default_chunk(2, 1 << 15, 16) == sm.GPU_PREFILL_CHUNK      # flash: no scores to bound
    OnGpu.flash = False
    assert s.default_chunk(1, 8192, 16) == sm.GPU_PREFILL_CHUNK
    heads = max(int(n.attr("n_heads")) for n in s.plan.graph.nodes if n.has_attr("n_heads"))
    cap = s.capacity_for(8192, 16, 2048)
    with pytest.MonkeyPatch.context() as mp:       # a scores budget that 2048-token steps just fit
        mp.setattr(sm, "GPU_SCORES_BYTES", 4 * 2 * heads * 2048 * cap)
        assert s.default_chunk(2, 8192, 16) == 2048
        mp.setattr(sm, "GPU_SCORES_BYTES", 1)
        assert s.default_chunk(2, 8192, 16) == sm.PREFILL_CHUNK
