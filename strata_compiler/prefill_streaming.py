"""From what prompt length a mixed plan's prefill streams its CPU-placed experts to the GPU.

The `stream_prefill_tokens` setting decides when it is given; left at auto, the plan's own
break-even decides: the prompt length from which the place pass predicted streaming to be faster
(graph meta `placement`, `phases.prefill.stream_from_tokens`, written by passes/place_phases.py;
null: never). Plans without a cost-model placement (`--place` rules, older plans) take
FALLBACK_TOKENS. The compiler writes the record and the runtime reads it, so the reading lives here.
"""

from __future__ import annotations

from .ir import Graph
from .untrusted import load_json

FALLBACK_TOKENS = 128       # plans the cost model did not place
MAX_TOKENS = 1 << 20        # a larger break-even in a plan is not one the place pass wrote


def plan_stream_tokens(g: Graph) -> int:
    """The plan's threshold: its predicted break-even, 0 (never) where it predicts that streaming
    never pays, else FALLBACK_TOKENS. The meta is untrusted: a value that is no whole number in
    1..MAX_TOKENS, or a record that does not parse, counts as none."""
    if g.meta_value("placed_by", "") != "cost model":
        return FALLBACK_TOKENS
    raw = g.meta_value("placement", "")
    if not isinstance(raw, str) or not raw:
        return FALLBACK_TOKENS
    try:
        record = load_json(raw, allow_nonfinite=True)
    except ValueError:
        return FALLBACK_TOKENS
    phases = record.get("phases") if isinstance(record, dict) else None
    prefill = phases.get("prefill") if isinstance(phases, dict) else None
    if not isinstance(prefill, dict) or "stream_from_tokens" not in prefill:
        return FALLBACK_TOKENS
    n = prefill["stream_from_tokens"]
    if n is None:
        return 0
    if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_TOKENS:
        return n
    return FALLBACK_TOKENS
