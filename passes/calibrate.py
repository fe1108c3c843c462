"""`calibrate`: run the f32 model over calibration text and record what quantization needs.

With `stratac compile --calib FILE` (plain UTF-8 text, or JSONL whose lines carry a "text"
field), the pass tokenizes the text with the model's tokenizer, runs it through the reference
backend in chunks of `calib_ctx` tokens (at most `calib_tokens` tokens in all) and records:

  * per weight, the mean square of each input column over every row it multiplied (llama.cpp's
    imatrix): f32[K], or f32[E, K] for stacked expert weights, each expert over its own tokens;
  * per MoE layer, each expert's routing frequency (the share of tokens that chose it) and its
    mean routing weight when chosen;
  * per MoE layer, the routing trace: the experts each token chose, i16[tokens, k] (what the
    cluster-experts pass groups experts by).

The result is a `Calibration` in ctx.analyses.calibration: the quantize and emit passes read
it (importance-weighted scales), and emit stores it in the plan (a summary in the metadata,
the vectors in plan.bin's "imatrix" section). With --dump-dir the summary is also written to
calibration.json there, with counts from the routing trace (the trace itself stays in memory).
Without --calib the pass does nothing. `--calib PLAN.bin` reuses a plan's calibration instead.

`sensitivity` is the other half of the calibration probe: layer-adaptive quantization's measured
KL per tensor. These two are the only compiler code that executes the model (on the reference
backend, the one import across the layers that tests/test_layering.py allows).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from strata_compiler.errors import PassError, UsageError
from strata_compiler.formats import get_format
from strata_compiler.ir import Graph, Level, Op
from strata_compiler.kv_cache import KVCache
from strata_compiler.pass_manager import PassContext, register
from strata_compiler.passes.laq import PROBE_FORMAT
from strata_compiler.plan_format import is_plan_file


@dataclass
class Calibration:
    tokens: int = 0
    sumsq: dict[str, np.ndarray] = field(default_factory=dict)   # weight -> f64 [K] or [E, K]
    rows: dict[str, np.ndarray] = field(default_factory=dict)    # weight -> rows seen: [] or [E]
    freq: dict[int, np.ndarray] = field(default_factory=dict)    # moe layer -> tokens per expert
    wsum: dict[int, np.ndarray] = field(default_factory=dict)    # moe layer -> routing weight sums
    layer_of: dict[str, int] = field(default_factory=dict)       # expert weight -> its moe layer
    probe_ids: np.ndarray | None = None                          # i64[1, T]: tokens for sensitivity probes
    routes: dict[int, list[np.ndarray]] = field(default_factory=dict)  # moe layer -> i16[T, k] chunks

    def trace(self, layer: int) -> np.ndarray:
        """i16[tokens, k]: the experts each calibration token chose at MoE layer `layer`, by
        decreasing routing weight (-1 where a token got fewer than k nonzero weights)."""
        parts = self.routes.get(layer)
        if not parts:
            return np.zeros((0, 0), np.int16)
        if len(parts) > 1:
            parts[:] = [np.concatenate(parts)]
        return parts[0]

    def route_summary(self, top: int = 8) -> dict[str, dict]:
        """Per MoE layer, counts from the routing trace: tokens, k, how many distinct expert sets
        tokens chose, and the most frequent sets with their token counts."""
        out = {}
        for layer in sorted(self.routes):
            t = self.trace(layer)
            sets, counts = np.unique(np.sort(t, axis=1), axis=0, return_counts=True)
            order = np.argsort(-counts, kind="stable")[:top]
            out[str(layer)] = {"tokens": int(t.shape[0]), "k": int(t.shape[1]), "distinct_sets": int(len(sets)),
                               "top_sets": [[[int(e) for e in sets[i] if e >= 0], int(counts[i])] for i in order]}
        return out

    def importance(self, weight: str) -> np.ndarray | None:
        """Mean square input per column: f32[K] or f32[E, K] (experts never routed get the
        mean over the others); None if the weight was never seen."""
        if weight not in self.sumsq:
            return None
        s, r = self.sumsq[weight], self.rows[weight]
        if s.ndim == 1:
            return (s / max(int(r), 1)).astype(np.float32)
        seen = r > 0
        out = np.zeros_like(s)
        out[seen] = s[seen] / r[seen, None]
        fill = out[seen].mean(axis=0) if seen.any() else np.ones(s.shape[1])
        out[~seen] = fill
        return out.astype(np.float32)

    def expert_weight(self, weight: str) -> np.ndarray | None:
        """How much each expert of a stacked weight matters to the output: routing frequency x
        mean squared routing weight (an expert's error reaches the residual scaled by its
        weight, for the share of tokens that choose it); None for non-expert weights."""
        layer = self.layer_of.get(weight)
        if layer is None or layer not in self.freq:
            return None
        f, w = self.freq[layer].astype(np.float64), self.wsum[layer]
        mean_w = np.divide(w, f, out=np.zeros_like(w), where=f > 0)
        return f / max(self.tokens, 1) * mean_w ** 2

    def expert_stats(self) -> dict[int, dict[str, list[float]]]:
        """Per MoE layer: routing frequency (share of tokens) and mean routing weight per expert."""
        out = {}
        for layer, f in sorted(self.freq.items()):
            w = self.wsum[layer]
            out[layer] = {"freq": [float(v) for v in f / max(self.tokens, 1)],
                          "mean_weight": [float(a / b) if b else 0.0 for a, b in zip(w, f)]}
        return out

    def summary(self) -> dict:
        return {"tokens": self.tokens, "weights": sorted(self.sumsq),
                "experts": {str(k): v for k, v in self.expert_stats().items()}}


class Recorder:
    """The reference executor's observer: accumulates a Calibration."""

    def __init__(self, graph: Graph, calib: Calibration) -> None:
        self.c = calib
        self.layer_of = {}
        for n in graph.nodes:
            if n.op is Op.MOE_FFN:
                self.layer_of[n.id] = len(self.layer_of)
        self.experts = {n.id: graph.weight(n.weight("down")).shape[0] for n in graph.nodes if n.op is Op.MOE_FFN}
        self.k = {nid: _top_k(graph, graph.node(nid)) for nid in self.layer_of}

    def _add(self, name: str, x: np.ndarray, e: int | None = None, E: int = 0) -> None:
        x = x.reshape(-1, x.shape[-1]).astype(np.float64)
        s = (x * x).sum(axis=0)
        c = self.c
        if e is None:
            c.sumsq[name] = c.sumsq.get(name, 0) + s
            c.rows[name] = c.rows.get(name, np.zeros((), np.int64)) + x.shape[0]
        else:
            if name not in c.sumsq:
                c.sumsq[name] = np.zeros((E, x.shape[1]))
                c.rows[name] = np.zeros(E, np.int64)
            c.sumsq[name][e] += s
            c.rows[name][e] += x.shape[0]

    def matmul(self, n, x: np.ndarray) -> None:
        self._add(n.weight("w"), x)

    def expert(self, n, e: int, x: np.ndarray, h: np.ndarray, w: np.ndarray) -> None:
        E = self.experts[n.id]
        layer = self.layer_of[n.id]
        c = self.c
        for role in ("gate_up", "gate", "up", "down"):
            if n.weight(role) is not None:
                self._add(n.weight(role), h if role == "down" else x, e, E)
                c.layer_of[n.weight(role)] = layer
        if layer not in c.freq:
            c.freq[layer] = np.zeros(E, np.int64)
            c.wsum[layer] = np.zeros(E)
        c.freq[layer][e] += x.shape[0]
        c.wsum[layer][e] += float(np.sum(w))

    def route(self, n, combine: np.ndarray) -> None:
        """Append the experts each token chose (the nonzero routing weights, largest first)."""
        cf = combine.reshape(-1, combine.shape[-1])
        k = self.k[n.id] or int((cf != 0).sum(axis=-1).max(initial=1))
        idx = np.argsort(-cf, axis=-1, kind="stable")[:, :k]
        chosen = np.take_along_axis(cf, idx, axis=-1) != 0
        self.c.routes.setdefault(self.layer_of[n.id], []).append(np.where(chosen, idx, -1).astype(np.int16))


def _top_k(graph: Graph, moe) -> int | None:
    """The k of the top-k routing that feeds a moe_ffn (through route, or topk_mask [-> renorm])."""
    n = graph.node(moe.args[1])
    if n.op is Op.RENORM:
        n = graph.node(n.args[0])
    return int(n.attr("k")) if n.op in (Op.ROUTE, Op.TOPK_MASK) else None


def read_calibration_text(path: Path) -> str:
    """Plain text, or JSONL with a "text" field per line."""
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"--calib {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--calib {path}: cannot read it as UTF-8 text ({e})") from None
    if path.suffix == ".jsonl":
        parts = []
        for i, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"--calib {path}:{i}: not a JSON object ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise UsageError(f"--calib {path}:{i}: each line needs a string \"text\" field")
            parts.append(obj["text"])
        raw = "\n\n".join(parts)
    if not raw.strip():
        raise UsageError(f"--calib {path}: the file holds no text")
    return raw


class _F32Weights:
    """Weights straight from the checkpoint as f32, materialised on use; the most recently used
    stay cached up to `budget` bytes, so calibrating a model larger than RAM re-reads instead of
    running out of memory."""

    def __init__(self, graph: Graph, store, budget: int = 4 << 30) -> None:
        from collections import OrderedDict

        self.g, self.store, self.budget = graph, store, budget
        self.cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self.bytes = 0

    def get(self, name: str) -> np.ndarray:
        from strata_compiler.weights import materialize_f32

        if name in self.cache:
            self.cache.move_to_end(name)
            return self.cache[name]
        w = materialize_f32(self.g.weight(name), self.store)
        self.cache[name] = w
        self.bytes += w.nbytes
        while self.bytes > self.budget and len(self.cache) > 1:
            _, old = self.cache.popitem(last=False)
            self.bytes -= old.nbytes
        return w


@register("calibrate", Level.TENSOR)
def calibrate(g: Graph, ctx: PassContext) -> Graph:
    """Run calibration text through the f32 model (--calib): input statistics per weight, routing per expert."""
    opts = ctx.options
    if not opts.calib:
        return g
    if is_plan_file(opts.calib):
        plan = ctx.calib_plan
        if plan is None:
            raise PassError(f"--calib {opts.calib}: a plan is loaded by the compile driver "
                            f"(driver.compile_model) into the pass context's calib_plan")
        calib = calibration_from_plan(plan, g)
        ctx.analyses.calibration = calib
        if _donor(plan, g, ctx.store):
            ctx.analyses.donor_plan = plan        # emit checks the tensors, copies weights where formats match
        if ctx.dump_dir is not None:
            ctx.dump_dir.mkdir(parents=True, exist_ok=True)
            (ctx.dump_dir / "calibration.json").write_text(json.dumps(calib.summary(), indent=1, sort_keys=True))
        return g
    if ctx.tokenizer_json is None:
        raise UsageError("--calib needs the model's tokenizer.json next to config.json; the folder has none")
    if ctx.store is None:
        raise UsageError("--calib needs the model's weights")
    from tokenizers import Tokenizer

    from strata_compiler.backends.reference.executor import ReferenceExecutor

    text = read_calibration_text(Path(opts.calib))
    ids = np.asarray(Tokenizer.from_str(ctx.tokenizer_json.decode()).encode(text).ids, np.int64)
    ids = ids[:opts.calib_tokens]
    if ids.size < 2:
        raise UsageError(f"--calib {opts.calib}: the text gives fewer than 2 tokens")
    meta = dict(g.meta)
    calib = Calibration()
    exe = ReferenceExecutor(g, _F32Weights(g, ctx.store), observer=Recorder(g, calib))
    ctxlen = max(2, min(opts.calib_ctx, int(meta.get("max_position") or opts.calib_ctx)))
    for start in range(0, ids.size, ctxlen):
        chunk = ids[start:start + ctxlen][None]
        cache = KVCache(meta["n_layers"], 1, meta["n_kv_heads"], meta["head_dim"], chunk.shape[1])
        exe.run(chunk, cache)
        calib.tokens += chunk.shape[1]
    calib.probe_ids = ids[:min(ids.size, opts.calib_probe_tokens)][None]
    ctx.analyses.calibration = calib
    ctx.analyses.calibration_weights = exe.w      # the f32 weights, reused by the sensitivity probe
    if ctx.dump_dir is not None:
        ctx.dump_dir.mkdir(parents=True, exist_ok=True)
        summary = dict(calib.summary(), routes=calib.route_summary())
        (ctx.dump_dir / "calibration.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    return g


def calibration_from_plan(plan, g: Graph) -> Calibration:
    """A plan compiled with --calib, reused: its imatrix (per-column importance) and per-expert
    routing statistics, without running the model again (no routing trace, no sensitivity probe
    tokens: the allocator then uses its error proxy alone)."""
    summary = plan.meta.get("calibration")
    if not summary:
        raise UsageError(f"--calib {plan.path}: this plan was compiled without --calib; it holds no calibration to reuse")
    c = Calibration(tokens=int(summary["tokens"]))
    for name, imp in plan.imatrix.items():
        if not g.has_weight(name):
            continue
        c.sumsq[name] = np.asarray(imp, np.float64)
        c.rows[name] = np.ones(imp.shape[0], np.int64) if imp.ndim == 2 else np.int64(1)
    layer = 0
    for n in g.nodes:
        if n.op is not Op.MOE_FFN:
            continue
        for _, w in n.weights:
            c.layer_of[w] = layer
        st = summary.get("experts", {}).get(str(layer))
        if st:
            f = np.rint(np.asarray(st["freq"]) * c.tokens).astype(np.int64)
            c.freq[layer] = f
            c.wsum[layer] = np.asarray(st["mean_weight"]) * f
        layer += 1
    return c


def _donor(plan, g: Graph, store) -> bool:
    """Whether the plan behind --calib PLAN.bin donates its quantized weights: it records a hash
    of every source tensor (older plans do not: their calibration is reused, the weights are
    quantized afresh). The tensor names must be this checkpoint's, checked here before any work;
    emit compares every tensor's hash as the weights stream and refuses a changed one."""
    theirs = plan.meta.get("source_hashes")
    if not isinstance(theirs, dict) or store is None:
        return False
    ours = {k for w in g.weights for k in w.all_source_keys()}
    if set(theirs) != ours:
        odd = sorted(ours.symmetric_difference(theirs))[0]
        raise UsageError(f"--calib {plan.path}: that plan was compiled from other weights than this model's "
                         f"(tensor {odd[:200]!r} is in only one of them); calibrate this model (--calib TEXT) or pass "
                         f"a plan of the same checkpoint")
    return True


def sensitivity(graph, weights, calib, group_size: int, names: list[str], probe: str = PROBE_FORMAT,
                progress=None) -> dict[str, float]:
    """Measured sensitivity (for passes/laq.py): the mean KL(f32 || perturbed) of the next-token
    distributions over the calibration probe tokens when only tensor t is stored at `probe` (the
    rest f32)."""
    from strata_compiler.backends.reference.executor import ReferenceExecutor

    meta = dict(graph.meta)
    ids = calib.probe_ids
    f = get_format(probe)

    class Perturbed:
        target: str | None = None
        value: np.ndarray | None = None

        def get(self, name: str) -> np.ndarray:
            return self.value if name == self.target else weights.get(name)

    src = Perturbed()
    exe = ReferenceExecutor(graph, src)

    def log_probs() -> np.ndarray:
        cache = KVCache(meta["n_layers"], 1, meta["n_kv_heads"], meta["head_dim"], ids.shape[1])
        z = exe.run(ids, cache)[graph.outputs[0]].reshape(-1, meta["vocab_size"]).astype(np.float64)
        z -= z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    ref = log_probs()
    p_ref = np.exp(ref)
    out = {}
    for i, name in enumerate(names):
        w = weights.get(name)
        imp = calib.importance(name)
        if imp is not None and imp.ndim == 2:
            r = np.stack([f.roundtrip(w[e], group_size, imp[e]) for e in range(w.shape[0])])
        else:
            r = f.roundtrip(w, group_size, imp)
        src.target, src.value = name, r
        out[name] = float((p_ref * (ref - log_probs())).sum(-1).mean())
        if progress:
            progress(f"quantize: probed {i + 1}/{len(names)} tensors")
    src.target = src.value = None
    return out
