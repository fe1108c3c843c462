"""The execution contract (strata_compiler/execution.py): every whole-plan executor derives from
Executor, and the session asks its abilities through it, never by probing attributes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from strata_compiler.execution import Caps, Executor

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("module, name", [
    ("strata_compiler.backends.reference.executor", "ReferenceExecutor"),
    ("strata_compiler.backends.llvm_cpu.executor", "LLVMExecutor"),
    ("strata_compiler.backends.xla.executor", "XLAExecutor"),
    ("strata_compiler.backends.xla.mesh", "MeshXLAExecutor"),
    ("strata_compiler.runtime.partitions", "MixedExecutor"),
])
def test_every_executor_keeps_the_contract(module, name):
    import importlib

    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, Executor)
    assert cls.run is not Executor.run                     # the one required method
    for attr in ("fetches_last", "prefills_on_gpu", "flash_prefill"):
        assert not hasattr(cls, attr), f"{name}.{attr}: a capability belongs in caps()"


def test_the_session_does_not_probe_its_executor():
    """No getattr/hasattr on the executor in runtime/session.py: what it may ask is the contract."""
    tree = ast.parse((ROOT / "runtime" / "session.py").read_text())
    probes = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in ("getattr", "hasattr") and n.args and "executor" in ast.unparse(n.args[0])]
    assert probes == []


def test_defaults_say_no():
    class Minimal(Executor):
        def run(self, input_ids, cache, last_only=False):
            return {}

    e = Minimal()
    assert e.caps() == Caps() and not e.can_decode_ahead(1, None) and not e.can_batch_step()
    with pytest.raises(NotImplementedError, match="does not decode ahead"):
        e.decode_ahead(None, None, 1)


@pytest.mark.parametrize("module, name", [
    ("strata_compiler.backends.reference.executor", "ReferenceExecutor"),
    ("strata_compiler.backends.llvm_cpu.executor", "LLVMExecutor"),
    ("strata_compiler.backends.xla.executor", "XLAExecutor"),
    ("strata_compiler.backends.xla.mesh", "MeshXLAExecutor"),
])
def test_every_partition_runs_a_segment_by_one_signature(module, name):
    """A mixed plan's partitions (execution.Partition): run_segment(env, input_ids, cache, seg)
    whatever the backend, so the mixed executor drives them alike."""
    import importlib
    import inspect

    from strata_compiler.execution import WHOLE

    cls = getattr(importlib.import_module(module), name)
    params = list(inspect.signature(cls.run_segment).parameters.values())
    assert [p.name for p in params] == ["self", "env", "input_ids", "cache", "seg"]
    assert params[-1].default is WHOLE
