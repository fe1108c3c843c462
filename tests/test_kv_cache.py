"""strata_compiler/kv_cache.py: reserving a cache's memory up front leaves what it holds as it was."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from strata_compiler.kv_cache import KVCache


def test_populate_keeps_the_contents():
    c = KVCache(2, 3, 2, 8, 1000)
    rng = np.random.default_rng(0)
    for a in (*c.k, *c.v):
        a[1, :, :5] = rng.standard_normal(a[1, :, :5].shape)
    before = [a.copy() for a in (*c.k, *c.v)]
    ok = c.populate()
    if sys.platform == "linux":
        assert ok in (True, False)          # False on kernels older than 5.14 (no MADV_POPULATE_WRITE)
    for a, b in zip((*c.k, *c.v), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_POPULATE_WRITE) is Linux's")
def test_populate_faults_the_pages_in():
    import resource

    c = KVCache(1, 1, 1, 1024, 4096)            # 16 MiB per array, untouched
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    if not c.populate():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c.k[0][0, 0, :] = 1.0                       # now no fault is left to take
    again = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert after - before >= 0 and again - after < 64
