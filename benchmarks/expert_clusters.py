"""Expert clusters on real routing: do co-activation clusters hold the pairs tokens choose, and
does fetching whole clusters into an expert cache move fewer bytes than fetching single experts?

    python benchmarks/expert_clusters.py [--model-dir examples/models/tiny-moe] [--calib FILE]
        [--calib-tokens 16384] [--calib-ctx 512] [--cluster-size N] [--bytes-format bf16]
        [--capacities 0.25,0.5] [--tokenizer tokenizer.json] [--no-variants] [--json OUT]

Runs the compiler's own passes (lower, fuse, calibrate, cluster-experts) on the model folder
over the calibration text (default: the folder's calib.txt), then prints per MoE layer

  * the in-cluster share: of the expert pairs chosen together by one token, the share inside one
    cluster, beside the mean over 100 random partitions with the same cluster sizes;
  * an LRU expert cache per layer holding a share of the layer's experts (--capacities): bytes
    moved per token (experts at --bytes-format) and transfers per token, when a miss fetches the
    one expert (expert) or the whole cluster holding it (cluster), and which moves fewer bytes.

Unless --no-variants, a second table compares clustering variants (edge weights: co-activation
counts or lift; networkx Louvain or greedy modularity; with or without the balancing swap
refinement), averaged over layers. Works on any Hugging Face MoE folder the compiler reads, e.g.
a synthetic OLMoE-shaped model from benchmarks/make_synthetic_model.py (which has no tokenizer:
pass one with --tokenizer whose vocabulary fits the model's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.common import log  # noqa: E402


def calibrate(model_dir: Path, calib: Path, tokens: int, ctx_len: int, tokenizer: Path | None):
    """(tensor graph, PassContext) after lower, fuse, calibrate and cluster-experts."""
    from strata_compiler.driver import DEFAULT
    from strata_compiler.frontend.hf import build_graph
    from strata_compiler.frontend.safetensors_reader import TensorStore
    from strata_compiler.pass_manager import CompileOptions, PassContext, run_pipeline

    tok = tokenizer or model_dir / "tokenizer.json"
    if not tok.exists():
        raise SystemExit(f"{model_dir} has no tokenizer.json; pass one with --tokenizer")
    store = TensorStore.open(model_dir)
    graph, _ = build_graph(model_dir, store)
    from tokenizers import Tokenizer

    vocab = dict(graph.meta)["vocab_size"]
    if Tokenizer.from_file(str(tok)).get_vocab_size() > vocab:
        raise SystemExit(f"{tok}: its vocabulary is larger than the model's ({vocab}); pick a smaller tokenizer")
    ctx = PassContext(CompileOptions(calib=str(calib), calib_tokens=tokens, calib_ctx=ctx_len),
                      model_dir=model_dir, store=store, tokenizer_json=tok.read_bytes())
    passes = DEFAULT[:DEFAULT.index("cluster-experts") + 1]
    return run_pipeline(graph, passes, ctx), ctx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=HERE.parent / "examples" / "models" / "tiny-moe")
    ap.add_argument("--calib", type=Path, help="calibration text (default: MODEL_DIR/calib.txt)")
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--calib-ctx", type=int, default=512)
    ap.add_argument("--cluster-size", type=int, default=0, help="experts per cluster (default E/8, at least 2)")
    ap.add_argument("--bytes-format", default="bf16", help="format the experts are moved in (for bytes)")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--capacities", default="0.25,0.5", help="cache sizes, as shares of a layer's experts")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer.json for a folder without one")
    ap.add_argument("--no-variants", action="store_true", help="skip the clustering-variant comparison")
    ap.add_argument("--json", type=Path, help="write every number here")
    a = ap.parse_args()

    import numpy as np

    from strata_compiler.passes import cluster_experts as ce

    calib_file = a.calib or a.model_dir / "calib.txt"
    caps = tuple(float(c) for c in a.capacities.split(","))
    t0 = time.time()
    g, ctx = calibrate(a.model_dir, calib_file, a.calib_tokens, a.calib_ctx, a.tokenizer)
    cal = ctx.analyses.calibration
    moes = ce.moe_layers(g)
    if cal is None or not moes:
        raise SystemExit(f"{a.model_dir}: no MoE layers to cluster")
    log(f"calibrated on {cal.tokens} tokens of {calib_file.name} in {time.time() - t0:.1f} s")

    size = a.cluster_size or None
    report = {"model": str(a.model_dir), "calib": str(calib_file), "tokens": cal.tokens,
              "bytes_format": a.bytes_format, "capacities": list(caps), "layers": {}, "variants": {}}
    traces, mats, Es = [], [], []
    for layer, n in enumerate(moes):
        E = g.weight(n.weight("down")).shape[0]
        t = cal.trace(layer)
        traces.append(t)
        mats.append(ce.coactivation(t, E))
        Es.append(E)

    clusters = ctx.analyses.expert_clusters if not size else {
        i: ce.cluster_layer(mats[i], cal.tokens, size) for i in range(len(moes))}
    print(f"\n{a.model_dir.name}: {len(moes)} MoE layers, {cal.tokens} calibration tokens of {calib_file.name}; "
          f"experts moved as {a.bytes_format}; LRU cache per layer\n")
    hdr = (f"{'layer':>5} {'E':>3} {'k':>2} {'size':>4} {'in-cluster':>10} {'random':>7} {'cache':>9} "
           f"{'expert KB/tok':>13} {'cluster KB/tok':>14} {'xfers/tok e/c':>13} {'cheaper':>8}")
    print(hdr)
    print("-" * len(hdr))
    sums = {"share": [], "random": [], "cap": {c: [0.0, 0.0] for c in caps}}
    for layer, n in enumerate(moes):
        E, t, C = Es[layer], traces[layer], mats[layer]
        eb = ce.expert_bytes(g, n, a.bytes_format, a.group_size)
        m = ce.layer_metrics(t, clusters[layer], E, eb, C, capacities=caps)
        report["layers"][str(layer)] = dict(m, block=ce._block(n), experts=E, expert_bytes=eb,
                                            clusters=clusters[layer])
        sums["share"].append(m["in_cluster_share"])
        sums["random"].append(m["random_share"])
        sizes = sorted({len(c) for c in clusters[layer]})
        for j, p in enumerate(m["prefetch"]):
            ex, cl = p["expert_fetch"], p["cluster_fetch"]
            sums["cap"][p["capacity"]][0] += ex["bytes"]
            sums["cap"][p["capacity"]][1] += cl["bytes"]
            head = (f"{layer:>5} {E:>3} {t.shape[1]:>2} {'/'.join(map(str, sizes)):>4} "
                    f"{m['in_cluster_share']:>10.3f} {m['random_share']:>7.3f}") if j == 0 else " " * 36
            cap = f"{p['capacity']:.0%}={p['capacity_experts']}"
            print(f"{head} {cap:>9} {ex['bytes_per_token'] / 1024:>13.1f} {cl['bytes_per_token'] / 1024:>14.1f} "
                  f"{ex['transfers'] / cal.tokens:>6.2f}/{cl['transfers'] / cal.tokens:<6.2f} {p['cheaper']:>8}")
    print("-" * len(hdr))
    for j, c in enumerate(caps):
        ex, cl = sums["cap"][c]
        head = (f"{'mean':>5} {'':>3} {'':>2} {'':>4} {np.mean(sums['share']):>10.3f} "
                f"{np.mean(sums['random']):>7.3f}") if j == 0 else " " * 36
        per = cal.tokens * len(moes) * 1024
        print(f"{head} {c:>9.0%} {ex / per:>13.1f} {cl / per:>14.1f} "
              f"{'':>13} {'cluster' if cl < ex else 'expert' if ex < cl else 'equal':>8}")

    if not a.no_variants:
        print("\nclustering variants (mean over layers; bytes relative to per-expert fetch at the same capacity)\n")
        vh = f"{'weights':>7} {'communities':>11} {'refine':>6} {'in-cluster':>10} " + " ".join(
            f"{'cluster/expert @' + format(c, '.0%'):>20}" for c in caps)
        print(vh)
        print("-" * len(vh))
        for weighting in ce.WEIGHTINGS:
            for method in ("louvain", "greedy"):
                for refine in (False, True):
                    shares, ratio = [], {c: [0, 0] for c in caps}
                    for layer in range(len(moes)):
                        cl = ce.cluster_layer(mats[layer], cal.tokens, size, weighting=weighting,
                                              method=method, refine=refine)
                        shares.append(ce.in_cluster_share(mats[layer], cl))
                        for p in ce.prefetch_bytes(traces[layer], cl, Es[layer], 1, caps):
                            ratio[p["capacity"]][0] += p["cluster_fetch"]["bytes"]
                            ratio[p["capacity"]][1] += p["expert_fetch"]["bytes"]
                    key = f"{weighting}/{method}/{'refine' if refine else 'packed'}"
                    report["variants"][key] = {
                        "in_cluster_share": float(np.mean(shares)),
                        "cluster_over_expert_bytes": {str(c): r[0] / r[1] for c, r in ratio.items()}}
                    print(f"{weighting:>7} {method:>11} {'yes' if refine else 'no':>6} {np.mean(shares):>10.3f} "
                          + " ".join(f"{r[0] / r[1]:>20.3f}" for r in ratio.values()))
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
