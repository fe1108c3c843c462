"""`quantize`: choose each weight's storage format from `--quant` and `--group-size` (`auto`: a
GGUF file's own formats), or per tensor under a size budget (`--bits`, `--memory-budget`:
layer-adaptive, passes/laq.py).

The format applies to the matrices of linear layers (formats.quantizes); a weight fused from
several tensors takes it only if all its parts would, so one kernel reads one format.
"""

from __future__ import annotations

from dataclasses import replace

from strata_compiler.formats import adaptive, get_format, quantizes
from strata_compiler.ir import Graph, Level
from strata_compiler.pass_manager import PassContext, register


@register("quantize", Level.TENSOR)
def quantize(g: Graph, ctx: PassContext) -> Graph:
    """Assign the --quant format (group-wise scales of --group-size) to linear-layer weights."""
    opts = ctx.options
    if opts.bits or opts.memory_budget:
        g = _adaptive(g, ctx)
    elif opts.quant == "auto":
        g = _as_stored(g, ctx)
    else:
        fmt = get_format(opts.quant)
        if fmt.name != "f32":
            gs = ctx.options.group_size if fmt.grouped else 0
            g = g.with_(weights=tuple(
                replace(w, fmt=fmt.name, group_size=gs)
                if len(w.shape) >= 2 and all(quantizes(k) for k in w.sources) else w
                for w in g.weights))
    return _overrides(g, opts.tensor_format, opts.group_size)


def parse_tensor_formats(rules: str) -> list[tuple[object, str]]:
    """'REGEX=FMT,...' -> [(compiled regex, format)]; one clear error per bad rule."""
    import re

    from strata_compiler.errors import UsageError

    out = []
    for rule in filter(None, (r.strip() for r in rules.split(","))):
        pat, sep, fmt = rule.rpartition("=")
        if not sep or not pat:
            raise UsageError(f"--tensor-format {rule!r}: use REGEX=FORMAT, e.g. 'L0\\..*=int8'")
        get_format(fmt)
        try:
            out.append((re.compile(pat), fmt))
        except re.error as e:
            raise UsageError(f"--tensor-format {rule!r}: bad regular expression ({e})") from None
    return out


def _overrides(g: Graph, rules: str, group_size: int) -> Graph:
    """--tensor-format: the first rule whose regex matches (re.search) a weight's name sets its
    format (matrices of linear layers and the embedding table: formats.adaptive)."""
    if not rules:
        return g
    parsed = parse_tensor_formats(rules)
    out = []
    for w in g.weights:
        for pat, fmt in parsed:
            if pat.search(w.name) and adaptive(w):
                w = replace(w, fmt=fmt, group_size=group_size if get_format(fmt).grouped else 0)
                break
        out.append(w)
    return g.with_(weights=tuple(out))


# --quant auto on a GGUF file: a tensor type -> the Strata format its weights take. Q4_0, Q4_1 and
# Q8_0 are Strata's int4, int4a and int8 bit for bit (stored as they are); the other types become
# a format whose error against the file is below the file's own (dequantized, then quantized
# again; tests/test_gguf_types.py measures each): Q3_K int4, the asymmetric Q2_K and Q4_K int4a,
# the 5- and 6-bit types and the non-uniform grids (IQ) int8; BF16 stays bf16, F16 becomes f32
# (exact; bf16 would round it).
FROM_GGUF = {
    "F32": "f32", "F64": "f32", "F16": "f32", "BF16": "bf16",
    "Q8_0": "int8", "Q8_1": "int8", "Q8_K": "int8", "Q6_K": "int8", "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8",
    "Q4_0": "int4", "Q4_1": "int4a", "Q4_K": "int4a", "Q3_K": "int4", "Q2_K": "int4a",
    "IQ4_NL": "int8", "IQ4_XS": "int8", "IQ3_XXS": "int8", "IQ3_S": "int8",
    "IQ2_XXS": "int8", "IQ2_XS": "int8", "IQ2_S": "int8", "IQ1_S": "int8", "IQ1_M": "int8",
}
_PRECISION = ("int3", "int4", "int4a", "int8", "bf16", "f32")     # narrowest first


def source_type(store, key: str) -> str | None:
    """A source tensor's GGUF type ("Q4_K", ...), None in a store without types (an HF folder)."""
    key = key.replace("{e}", "0")       # an experts' template key: their types are one stack's
    if not getattr(store, "typed", False) or key not in store:
        return None
    return str(store.info(key).dtype)


def stored_format(store, key: str) -> str:
    """The format --quant auto gives a source tensor: its GGUF type's (FROM_GGUF; f32 for a type
    not listed), f32 for a store without types (a Hugging Face folder)."""
    return FROM_GGUF.get(source_type(store, key), "f32")


def _as_stored(g: Graph, ctx: PassContext) -> Graph:
    """--quant auto: each quantizable weight (formats.adaptive) in the format of the tensors it is
    stored in (stored_format; the most precise of several fused into one)."""
    gs = ctx.options.group_size
    out = []
    for w in g.weights:
        if ctx.store is not None and adaptive(w):
            fmt = max((stored_format(ctx.store, k) for k in w.sources), key=_PRECISION.index, default="f32")
            if fmt != "f32":
                w = replace(w, fmt=fmt, group_size=gs if get_format(fmt).grouped else 0)
        out.append(w)
    return g.with_(weights=tuple(out))


def _quantizable(g: Graph) -> list:
    return [w for w in g.weights if adaptive(w)]


def _adaptive(g: Graph, ctx: PassContext) -> Graph:
    """Layer-adaptive formats (passes/laq.py): measured error per tensor and format, a knapsack."""
    import json

    import numpy as np

    from strata_compiler.errors import UsageError
    from strata_compiler.hwprofile import parse_size
    from strata_compiler.passes.calibrate import sensitivity
    from strata_compiler.passes.laq import PROBE_FORMAT, allocate, calibrate_errors, candidates, measure

    opts = ctx.options
    if ctx.store is None:
        raise UsageError("--bits / --memory-budget need the model's weights")
    gs = opts.group_size
    todo = _quantizable(g)
    calib = ctx.analyses.calibration
    options = {}
    for i, w in enumerate(todo):
        options[w.name] = measure(w, ctx.store, calib, gs, candidates=candidates(w))
        if ctx.progress:
            ctx.progress(f"quantize: measured {i + 1}/{len(todo)} tensors")
    raw = options
    sens = None
    if calib is not None and calib.probe_ids is not None and opts.calib_probe_tokens > 0:
        sens = sensitivity(g, ctx.analyses.calibration_weights, calib, gs, [w.name for w in todo],
                           progress=ctx.progress)
        options = calibrate_errors(options, sens)
    params = sum(int(np.prod(w.shape)) for w in todo)
    if opts.bits:
        budget = int(opts.bits / 8.0 * params)
    else:
        fixed = sum(get_format(w.fmt).nbytes(w.shape, w.group_size or 32) for w in g.weights if w not in todo)
        budget = parse_size(opts.memory_budget) - fixed
        if budget <= 0:
            raise UsageError(f"--memory-budget {opts.memory_budget}: the weights that stay f32 (norms, "
                             f"routers) alone take {fixed} bytes; raise the budget")
    choice = allocate(options, budget)
    table = {n: {"fmt": choice[n].fmt, "bytes": choice[n].nbytes, "error": choice[n].error,
                 "options": {x.fmt: [x.nbytes, x.error] for x in options[n]},
                 "proxy": {x.fmt: x.error for x in raw[n]}}
             for n in options}
    ctx.analyses.laq = {"budget": budget, "params": params, "tensors": table,
                        "error_units": f"KL at {PROBE_FORMAT} (measured)" if sens else "activation-weighted MSE",
                        "sensitivity": sens}
    if ctx.dump_dir is not None:
        ctx.dump_dir.mkdir(parents=True, exist_ok=True)
        (ctx.dump_dir / "laq.json").write_text(json.dumps(ctx.analyses.laq, indent=1, sort_keys=True))

    def with_fmt(w, fmt):
        return replace(w, fmt=fmt, group_size=gs if get_format(fmt).grouped else 0)

    return g.with_(weights=tuple(with_fmt(w, choice[w.name].fmt) if w.name in choice else w for w in g.weights))

