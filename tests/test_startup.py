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
