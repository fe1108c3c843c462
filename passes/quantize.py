"""`quantize`: choose each weight's storage format from `--quant` and `--group-size`.

The format applies to the matrices of linear layers (formats.quantizes); a weight fused from
several tensors takes it only if all its parts would, so one kernel reads one format.
"""

from __future__ import annotations

from dataclasses import replace

from strata_compiler.formats import get_format, quantizes
from strata_compiler.ir import Graph, Level
from strata_compiler.pass_manager import PassContext, register


@register("quantize", Level.TENSOR)
def quantize(g: Graph, ctx: PassContext) -> Graph:
    """Assign the --quant format (group-wise scales of --group-size) to linear-layer weights."""
    fmt = get_format(ctx.options.quant)
    if fmt.name == "f32":
        return g
    gs = ctx.options.group_size if fmt.grouped else 0
    weights = tuple(
        replace(w, fmt=fmt.name, group_size=gs)
        if len(w.shape) >= 2 and all(quantizes(k) for k in w.sources) else w
        for w in g.weights)
    return g.with_(weights=weights)
