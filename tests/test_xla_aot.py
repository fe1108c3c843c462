"""backends/xla/aot.py: a plan's programs stored as serialized executables and run by a later
session without tracing (on a GPU); damaged entries skipped; the pickle scan; the directory's
ownership check (on JAX's CPU platform with the executor's GPU-only switch turned on)."""

from __future__ import annotations

import json
import os
import pickle

import jax
import numpy as np
import pytest

from strata_compiler import settings
from strata_compiler.backends.xla import aot
from strata_compiler.backends.xla.device import cuda_device_count
from strata_compiler.backends.xla.executor import XLAExecutor
from strata_compiler.runtime.plan import load_plan
from strata_compiler.runtime.sampler import Sampler
from strata_compiler.runtime.session import Session


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(XLAExecutor, "executables_on_cpu", True)
    with settings.override(cache_dir=str(tmp_path / "cache")):
        yield tmp_path / "cache" / "xla-executables"


def _run(plan, ids):
    logits, new = Session(plan, "xla").generate(ids, 6, Sampler())
    return logits, new


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_device_count(), reason="no CUDA GPU")
def test_a_second_session_runs_the_stored_programs_untraced(tiny_int8_plan, cache, monkeypatch):
    """On a GPU only, as in the product: XLA's CPU client has loaded entries that then failed to
    run ("Function wrapped_iota not found"), which is why the executor keeps them to GPUs."""
    plan = load_plan(tiny_int8_plan)
    ids = np.random.default_rng(0).integers(3, 200, (1, 7))
    want_logits, want = _run(plan, ids)
    entries = sorted(cache.glob("*.bin"))
    assert len(entries) >= 2          # the forward program (prefill) and the decode-ahead one

    def no_compile(self, args):
        raise AssertionError(f"{self.name} compiled again")

    monkeypatch.setattr(aot.Program, "_compile", no_compile)
    logits, got = _run(plan, ids)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(logits, want_logits)


def test_a_damaged_entry_is_skipped_with_a_warning(tiny_int8_plan, cache):
    plan = load_plan(tiny_int8_plan)
    ids = np.random.default_rng(1).integers(3, 200, (1, 5))
    _, want = _run(plan, ids)
    for p in cache.glob("*.bin"):
        data = bytearray(p.read_bytes())
        data[-100] ^= 0xFF                  # inside the payload: its checksum no longer holds
        p.write_bytes(bytes(data))
    aot._warned.clear()
    with pytest.warns(UserWarning, match="skipped"):
        _, got = _run(plan, ids)
    np.testing.assert_array_equal(got, want)


def test_the_scan_admits_jax_types_only():
    assert not aot._scan_globals(pickle.dumps(os.getcwd))
    assert not aot._scan_globals(pickle.dumps(os.getcwd, protocol=2))
    assert not aot._scan_globals(b"not a pickle")
    assert aot._scan_globals(pickle.dumps(np.dtype("float32")))


def test_a_directory_others_may_write_is_not_used(tmp_path):
    d = tmp_path / "c" / "xla-executables"
    d.mkdir(parents=True)
    d.chmod(0o777)
    with settings.override(cache_dir=str(tmp_path / "c")):
        aot._warned.clear()
        with pytest.warns(UserWarning, match="not this user's alone"):
            assert aot.directory() is None
        d.chmod(0o700)
        assert aot.directory() == d


def test_the_output_tree_round_trips():
    tree = ((1, 2), {3: (4,), 1: 5}, [6], None)
    spec = aot._tree_spec(tree)
    back = aot._from_spec(json.loads(json.dumps(spec)))

    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(((0, 0), {3: (0,), 1: 0}, (0,), None))
    with pytest.raises(ValueError):
        aot._from_spec({"x": 1})


def test_a_new_session_prefetches_its_stored_programs(tiny_int8_plan, cache, monkeypatch):
    """A whole plan's executor starts loading its stored programs (both) before its weights go
    up, and its first calls ask for exactly those signatures. (Running them is the GPU test's:
    on XLA's CPU client loaded executables may fail to run.)"""
    plan = load_plan(tiny_int8_plan)
    ids = np.random.default_rng(2).integers(3, 200, (1, 6))
    _, want = _run(plan, ids)
    taken = []

    def prefetched(self, sig, dyn, static):
        taken.append((self.name, sig in self._pending))
        self._pending.pop(sig, None)
        return None                     # compiled again: the CPU client's loads may not run

    monkeypatch.setattr(aot.Program, "_prefetched", prefetched)
    monkeypatch.setattr(aot.Program, "_load", lambda self, sig, dyn, static: None)
    s = Session(plan, "xla")
    assert {p.name: len(p._pending) for p in (s.executor._fn, s.executor._ahead_fn)} == {"forward": 1, "ahead": 1}
    _, got = s.generate(ids, 6, Sampler())
    np.testing.assert_array_equal(got, want)
    assert ("forward", True) in taken and ("ahead", True) in taken


def test_a_traced_setting_is_part_of_the_programs_key(tiny_int8_plan, cache):
    """A stored program is looked up under the xla settings it was traced with (a kernel's
    tuning, a kernel turned off): another value is another program, not the stored one run."""
    plan = load_plan(tiny_int8_plan)
    scope = Session(plan, "xla").executor._scope()
    with settings.override(pallas_tune=(64, 8, 4, 4)):
        assert Session(plan, "xla").executor._scope() != scope
    with settings.override(pallas="off"):
        assert Session(plan, "xla").executor._scope() != scope
    exe = Session(plan, "xla").executor
    key = exe._ahead_fn._key("sig")
    with settings.override(gpu_preallocate=True, temperature=0.5):     # nothing traced: the same programs
        assert Session(plan, "xla").executor._scope() == scope
        assert exe._ahead_fn._key("sig") == key
