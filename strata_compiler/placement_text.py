"""The prefill half of a placement record as `stratac inspect` prints it (the decode half and the
per-layer table are in cli.py): the prediction at the planned prompt length, and from what prompt
length the runtime streams the CPU-placed experts to the GPU (passes/place_phases.py). The record
comes from a plan, so a field that is missing or of the wrong type leaves its line out."""

from __future__ import annotations


def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def prefill_lines(pl: dict) -> list[str]:
    """Lines (without indent) for placement record `pl`: none where it has no prefill figures."""
    out = []
    if _num(pl.get("predicted_prefill_tok_s")) and _num(pl.get("prefill_tokens")):
        out.append(f"predicted prefill: {pl['predicted_prefill_tok_s']:.0f} tok/s for a "
                   f"{pl['prefill_tokens']}-token prompt")
    phases = pl.get("phases")
    pre = phases.get("prefill") if isinstance(phases, dict) else None
    if not isinstance(pre, dict) or not _num(pre.get("streamed_bytes")) or not isinstance(pre.get("predicted"), dict):
        return out
    n, mib = pre.get("stream_from_tokens"), pre["streamed_bytes"] / 2**20
    if _num(n):
        head = f"prefill: streams {mib:.1f} MiB of CPU-placed experts to the GPU from {n} tokens"
    elif mib:
        head = f"prefill: as placed (streaming its {mib:.1f} MiB of CPU-placed experts to the GPU never pays)"
    else:
        head = "prefill: as placed (nothing to stream: no CPU-placed experts beside GPU work)"
    figures = []
    for T, p in sorted(pre["predicted"].items(), key=lambda kv: (len(kv[0]), kv[0])):     # numeric order
        if isinstance(p, dict) and _num(p.get("as_placed_tok_s")):
            streamed = f", {p['streamed_tok_s']:,.0f} streamed" if _num(p.get("streamed_tok_s")) else ""
            figures.append(f"{T} tokens: {p['as_placed_tok_s']:,.0f} tok/s as placed{streamed}")
    return out + [head + ("; predicted " + "; ".join(figures) if figures else "")]
