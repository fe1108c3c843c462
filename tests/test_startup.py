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
