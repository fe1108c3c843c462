"""Shared pytest setup: import paths and an offline Hugging Face environment.

Tests import the oracle helpers as `from hf_models import ...` and the product as
`import strata_compiler` without installing either, so both the tests directory and the
repository root go on sys.path. Nothing here imports torch: the torch thread count is set
by `hf_models` when it is first imported (2 threads unless STRATA_TEST_TORCH_THREADS says
otherwise), so tests that never touch the oracle do not pay for torch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Never reach the network: the oracle models are built locally from random weights.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_TESTS_DIR = Path(__file__).resolve().parent
_REPO_ROOT = _TESTS_DIR.parent
for _p in (str(_REPO_ROOT), str(_TESTS_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)


import subprocess  # noqa: E402

import pytest  # noqa: E402


def _compile_tiny(tmp_path_factory, quant: str) -> Path:
    out = tmp_path_factory.mktemp(f"tiny_{quant}")
    subprocess.run([sys.executable, "-c", "from strata_compiler.cli import main; main()", "compile",
                    str(_REPO_ROOT / "examples" / "models" / "tiny-moe"), "-o", str(out), "--quant", quant],
                   check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="session")
def tiny_int8_plan(tmp_path_factory) -> Path:
    """examples/models/tiny-moe compiled once with --quant int8 (the server and chat tests' plan)."""
    return _compile_tiny(tmp_path_factory, "int8")


@pytest.fixture(scope="session")
def tiny_f32_plan(tmp_path_factory) -> Path:
    """examples/models/tiny-moe compiled once with --quant f32 (the batching and prompt-cache tests' plan)."""
    return _compile_tiny(tmp_path_factory, "f32")
