"""strata_compiler/prefill_streaming.py: the prompt length from which a plan streams its CPU-placed
experts, read from the plan's placement record, which is untrusted input."""

from __future__ import annotations

import json

import pytest

from strata_compiler.ir import Graph, Level, make_attrs
from strata_compiler.prefill_streaming import FALLBACK_TOKENS, MAX_TOKENS, plan_stream_tokens


def graph(placement: object, placed_by: object = "cost model") -> Graph:
    """An empty graph whose meta holds `placement` (a record, JSON-encoded, or a raw meta value)."""
    raw = placement if isinstance(placement, (str, int)) else json.dumps(placement)
    return Graph(Level.KERNEL, (), (), (), make_attrs(placed_by=placed_by, placement=raw))


def record(n: object) -> dict:
    return {"choice": "dense on gpu, experts on cpu", "phases": {"prefill": {"stream_from_tokens": n}}}


def test_the_plans_break_even_or_never():
    assert plan_stream_tokens(graph(record(256))) == 256
    assert plan_stream_tokens(graph(record(MAX_TOKENS))) == MAX_TOKENS
    assert plan_stream_tokens(graph(record(None))) == 0        # the plan predicts streaming never pays


@pytest.mark.parametrize("g", [
    Graph(Level.KERNEL, (), (), ()),                            # not placed
    graph(record(256), placed_by="rules"),                      # --place rules: no cost-model placement
    graph({"choice": "all on cpu"}),                            # placed before phases were recorded
    graph({"phases": {"decode": {}}}),
], ids=["unplaced", "rules", "no phases", "no prefill"])
def test_plans_without_a_break_even_take_the_fallback(g):
    assert plan_stream_tokens(g) == FALLBACK_TOKENS


@pytest.mark.parametrize("value", ["256", 256.0, True, 0, -16, MAX_TOKENS + 1, 10**30, [256], {"n": 256}])
def test_an_invalid_break_even_falls_back(value):
    assert plan_stream_tokens(graph(record(value))) == FALLBACK_TOKENS


@pytest.mark.parametrize("placement", ["{", "[256]", "null", 7, "[" * 100000 + "]" * 100000, '{"phases": [1]}',
                                       '{"phases": {"prefill": "256"}}', '{"phases": {"prefill": {"stream_from_tokens": 1e999}}}'],
                         ids=["truncated", "a list", "null", "not text", "deep", "phases a list", "prefill text", "inf"])
def test_a_malformed_record_falls_back(placement):
    assert plan_stream_tokens(graph(placement)) == FALLBACK_TOKENS
