"""Refit the place pass's two runtime constants to a measured placement run, on the machine it ran on.

    python benchmarks/refit_cost_model.py --json pb.json [--work-dir /tmp/pb] [--hw PROFILE]
        [--switch 0.25,0.5,0.75,1.0] [--eff 0.6,0.75,0.9,1.0,1.2]

The place pass (passes/place.py) prices a split layer's switch at FUSED_SWITCH_FACTOR x the
profile's tiny round trip and CPU work beside the GPU at CPU_MIXED_EFFICIENCY x the probed rates;
both were fitted by hand to one H200 run and go stale when the runtime gets faster. This reads
benchmarks/placement_bench.py's JSON (measured decode tok/s per variant), runs the compiler up to
the place pass once on the work dir's model (the calibration from its `base` plan, the formats of
--quant), and replays the place pass for every grid point and budget of that run. The candidates
that match measured variants are compared:

    first layers on gpu (-ngl)            <-> ngl-B
    dense on gpu, experts on cpu          <-> ktransformers
    dense on gpu, hottest experts on gpu  <-> hot-B
    the label strata-B chose              <-> strata-B

It prints each grid point's log-rms error over those pairs (best first), the pairs of the best,
and what the planner would choose with it. It changes nothing: put the fitted values into
passes/place.py by hand, with the run in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

PAIRS = {"first layers on gpu (-ngl)": "ngl-{b}", "dense on gpu, experts on cpu": "ktransformers",
         "dense on gpu, hottest experts on gpu": "hot-{b}"}


def graph_at_place(model: Path, calib_plan: Path, quant: str):
    """(graph, context) right before the place pass, as `stratac compile` makes them."""
    from strata_compiler.driver import DEFAULT, cpu_backend
    from strata_compiler.frontend.hf import build_graph
    from strata_compiler.frontend.safetensors_reader import TensorStore
    from strata_compiler.pass_manager import CompileOptions, PassContext, run_pipeline
    from strata_compiler.runtime.plan import load_plan

    store = TensorStore.open(model)
    graph, _ = build_graph(model, store)
    opts = CompileOptions(quant=quant, calib=str(calib_plan), imatrix=False, backend=cpu_backend(),
                          cpu_backend=cpu_backend())
    ctx = PassContext(opts, model_dir=model, store=store, calib_plan=load_plan(calib_plan, verify_weights="lazy"))
    before = DEFAULT[:DEFAULT.index("place")]
    return run_pipeline(graph, list(before), ctx, stop_after=before[-1]), ctx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True, help="placement_bench.py --json output")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/pb"), help="placement_bench.py's --work-dir")
    ap.add_argument("--hw", type=Path, help="the profile the run's strata plans were compiled for "
                    "(default: the work dir's hw.json)")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--switch", default="0.25,0.5,0.75,1.0", help="FUSED_SWITCH_FACTOR values")
    ap.add_argument("--eff", default="0.6,0.75,0.9,1.0,1.2", help="CPU_MIXED_EFFICIENCY values")
    a = ap.parse_args()
    from strata_compiler.errors import StrataError
    from strata_compiler.passes import place
    from strata_compiler.runtime.plan import load_plan

    try:
        run = json.loads(a.json.read_text())
    except (OSError, ValueError) as e:
        print(f"error: --json {a.json}: {e}", file=sys.stderr)
        return 2
    measured = {k: v["tok_s"] for k, v in run.get("variants", {}).items()
                if isinstance(v.get("tok_s"), (int, float)) and math.isfinite(v["tok_s"]) and "@" not in k}
    budgets = sorted(int(k.split("-")[1]) for k in measured if k.startswith("strata-") and k.split("-")[1].isdigit())
    if not budgets:
        print(f"error: --json {a.json}: no measured strata-B variant", file=sys.stderr)
        return 2
    hw = a.hw or a.work_dir / "hw.json"
    base = a.work_dir / "base"
    try:
        from benchmarks.placement_bench import layer_bytes, weight_split  # noqa: F401

        bp = load_plan(base, verify_weights="none")
        experts_b, rest_b = weight_split(bp)
        g, ctx = graph_at_place(a.work_dir / "model", base / "plan.bin", a.quant)
    except StrataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dims = run["dims"]
    kv_guess = 2 * dims["layers"] * dims["kv_heads"] * dims["head_dim"] * 4 * 4096
    opts = replace(ctx.options, target=str(hw))
    grid = [(float(s), float(e)) for s in a.switch.split(",") for e in a.eff.split(",")]
    saved = place.FUSED_SWITCH_FACTOR, place.CPU_MIXED_EFFICIENCY
    rows = []
    try:
        for sw, eff in grid:
            place.FUSED_SWITCH_FACTOR, place.CPU_MIXED_EFFICIENCY = sw, eff
            pairs, chosen = [], {}
            for b in budgets:
                mem = int((rest_b + experts_b * b // 100 + kv_guess) / (1 - place.GPU_RESERVE)) + (1 << 20)
                ctx.options = replace(opts, gpu_mem=str(mem))
                place.place_pass(g, ctx)
                summary = ctx.analyses.placement
                cands = summary["candidates"]
                chosen[b] = (summary["choice"], summary["predicted_tok_s"])
                strata_label = run["variants"][f"strata-{b}"].get("choice")
                for label, pred in cands.items():
                    names = ([PAIRS[label].format(b=b)] if label in PAIRS else []) + \
                        ([f"strata-{b}"] if label == strata_label else [])
                    for name in names:
                        if name in measured and name not in {n for n, *_ in pairs}:
                            pairs.append((name, b, pred, measured[name]))
            err = math.sqrt(sum(math.log(p / m) ** 2 for _, _, p, m in pairs) / max(len(pairs), 1))
            rows.append((err, sw, eff, pairs, chosen))
    finally:
        place.FUSED_SWITCH_FACTOR, place.CPU_MIXED_EFFICIENCY = saved
    rows.sort(key=lambda r: r[0])
    print(f"{'switch':>7} {'cpu eff':>7} {'log-rms':>8}  choices (budget: label, predicted tok/s)")
    for err, sw, eff, _pairs, chosen in rows:
        print(f"{sw:7.2f} {eff:7.2f} {err:8.3f}  " + "; ".join(f"{b}%: {c} {p:.0f}" for b, (c, p) in chosen.items()))
    err, sw, eff, pairs, _ = rows[0]
    print(f"\nbest: FUSED_SWITCH_FACTOR = {sw}, CPU_MIXED_EFFICIENCY = {eff} (now {saved[0]}, {saved[1]})")
    for name, b, p, m in pairs:
        print(f"  {name:16} predicted {p:7.1f}  measured {m:7.1f}  {p / m:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
