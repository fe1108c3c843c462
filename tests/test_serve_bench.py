"""benchmarks/serve_bench.py's pure helpers: the seeded request mix and the percentiles."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("serve_bench", ROOT / "benchmarks" / "serve_bench.py")
sb = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("serve_bench", sb)
_spec.loader.exec_module(sb)


def test_mix_is_seeded_and_covers_every_pair():
    a = sb.make_mix(12, [16, 32], [8, 16, 4], seed=3, vocab=100, mode="ids")
    assert a == sb.make_mix(12, [16, 32], [8, 16, 4], seed=3, vocab=100, mode="ids")
    assert a != sb.make_mix(12, [16, 32], [8, 16, 4], seed=4, vocab=100, mode="ids")
    assert sorted((p, o) for _, p, o in a[:6]) == sorted((p, o) for p in (16, 32) for o in (8, 16, 4))
    for prompt, p, _ in a:
        assert len(prompt) == p and all(16 <= t < 100 for t in prompt)
    # a smaller request count is a prefix of a larger one: every concurrency level sees the same requests
    assert sb.make_mix(5, [16, 32], [8, 16, 4], 3, 100, "ids") == a[:5]
    text = sb.make_mix(3, [10], [8], 0, 100, "text")
    assert all(isinstance(t, str) and len(t.split()) == 10 for t, _, _ in text)


def test_percentile():
    assert sb.percentile([], 50) is None
    assert sb.percentile([3.0], 99) == 3.0
    assert sb.percentile([1, 2, 3, 4], 50) == 2.5
    assert abs(sb.percentile(list(range(101)), 99) - 99) < 1e-9
