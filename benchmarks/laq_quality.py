"""Quality of layer-adaptive quantization against uniform formats at equal weight bytes.

    python benchmarks/laq_quality.py MODEL --calib CALIB.txt --text HELDOUT.txt
        [--work-dir /tmp/laq_bench] [--ctx 512] [--chunks 8] [--calib-tokens 4096]
        [--variants int4,laq:4.5,int3,laq:3.5] [--extra NAME=PLAN_OR_GGUF ...] [--json OUT]

Variants: `FMT` (uniform `--quant FMT`; `FMT/embed=FMT2` also stores the embedding table as FMT2),
`laq:B` (`--bits B --calib CALIB`), `laq@NAME` (`--memory-budget` = the tensor bytes of the
--extra GGUF called NAME: LAQ at exactly the size of, e.g., llama.cpp's own Q4_K_M file).

MODEL is a Hugging Face folder or a .gguf file. The f32 compile of MODEL is the reference;
every variant is compiled from MODEL (uniform: `--quant FMT`; `laq:B`: `--bits B --calib CALIB`)
and measured with `stratac eval` on the held-out text (llama.cpp's --kl-divergence conventions:
mean and 99th-percentile KL against the reference, top-1 agreement, perplexity). `--extra`
adds other plans or GGUF files (e.g. llama.cpp's own Q4_K_M mix, compiled at f32 so its
dequantized weights are measured). The table gives the bytes of the weights whose format LAQ
decides (linear layers and the embedding table: what --bits budgets) and of the whole plan.
Calibration and held-out text must not overlap: pass different documents.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.common import log, stratac  # noqa: E402


def gguf_tensor_bytes(path: Path) -> int:
    """The bytes of a GGUF file's tensor data (its size less metadata and tokenizer)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def linear_bytes(plan_dir: Path) -> tuple[int, int]:
    """(bytes, parameters) of the weights whose format LAQ decides (`formats.adaptive`)."""
    import numpy as np

    from strata_compiler.formats import adaptive, get_format
    from strata_compiler.runtime.plan import load_plan

    plan = load_plan(plan_dir, verify_weights="none")
    ws = [w for w in plan.graph.weights if adaptive(w)]
    return (sum(get_format(w.fmt).nbytes(w.shape, w.group_size or 32) for w in ws),
            sum(int(np.prod(w.shape)) for w in ws))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--calib", type=Path, required=True)
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/laq_bench"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--variants", default="int4,laq:4.5,int3,laq:3.5")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--backend", default="llvm")
    ap.add_argument("--sensitivity", type=int, default=0, metavar="N",
                    help="also check the allocator's error proxy against measured KL: N tensors, each alone at "
                         "--sensitivity-format (the rest f32); prints both and their rank correlation")
    ap.add_argument("--sensitivity-format", default="int2")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    a.work_dir.mkdir(parents=True, exist_ok=True)
    ref = a.work_dir / "ref-f32"
    if not (ref / "plan.bin").exists():
        log("compiling the f32 reference")
        stratac("compile", str(a.model), "-o", str(ref), "--quant", "f32")
    plans: dict[str, Path] = {}
    extras = dict(item.partition("=")[::2] for item in a.extra)
    for v in a.variants.split(","):
        out = a.work_dir / v.replace(":", "-").replace("/", "-").replace("=", "-").replace("@", "-at-")
        if not (out / "plan.bin").exists():
            t0 = time.time()
            laq = ["--calib", str(a.calib), "--calib-tokens", str(a.calib_tokens), "--dump-dir", str(out / "dump"),
                   "--dump-after", "quantize"]
            if v.startswith("laq:"):
                stratac("compile", str(a.model), "-o", str(out), "--bits", v[4:], *laq)
            elif v.startswith("laq@"):
                if v[4:] not in extras or not extras[v[4:]].endswith(".gguf"):
                    raise SystemExit(f"variant {v}: pass the GGUF as --extra {v[4:]}=FILE.gguf")
                budget = gguf_tensor_bytes(Path(extras[v[4:]]))
                log(f"{v}: memory budget {budget} B (tensor bytes of {extras[v[4:]]})")
                stratac("compile", str(a.model), "-o", str(out), "--memory-budget", str(budget), *laq)
            else:
                fmt, _, emb = v.partition("/embed=")
                stratac("compile", str(a.model), "-o", str(out), "--quant", fmt,
                        *(["--tensor-format", f"^embed$={emb}"] if emb else []))
            log(f"compiled {v} in {time.time() - t0:.0f} s")
        plans[v] = out
    for item in a.extra:
        name, _, path = item.partition("=")
        p = Path(path)
        if p.suffix == ".gguf":
            out = a.work_dir / f"extra-{name}"
            if not (out / "plan.bin").exists():
                stratac("compile", str(p), "-o", str(out), "--quant", "f32")
            p = out
        plans[name] = p
    rows = []
    for name, p in plans.items():
        t0 = time.time()
        r = json.loads(stratac("eval", str(p), "--reference", str(ref), "--text", str(a.text), "--ctx", str(a.ctx),
                               "--chunks", str(a.chunks), "--backend", a.backend, "--json"))
        lb, params = linear_bytes(p)
        r.update(variant=name, linear_bytes=lb, linear_bpw=8.0 * lb / params)
        if name in extras and extras[name].endswith(".gguf"):
            r["gguf_tensor_bytes"] = gguf_tensor_bytes(Path(extras[name]))
        rows.append(r)
        log(f"{name}: mean KL {r['mean_kl']:.5f} ({time.time() - t0:.0f} s)")
    base = {r["variant"]: r for r in rows}
    print(f"\nmodel {a.model}; reference: its f32 compile; held-out {a.text.name}, ctx {a.ctx}, "
          f"{rows[0]['tokens']} scored tokens; calibration {a.calib.name} ({a.calib_tokens} tokens)")
    print("(decided = the weights LAQ chooses formats for: linear layers + embedding table; for a GGUF extra, "
          "'size MiB' is its own tensor bytes, else the plan's weight bytes)")
    print(f"{'variant':16} {'decided MiB':>11} {'decided bpw':>11} {'size MiB':>9} {'mean KL':>9} {'p99 KL':>8} "
          f"{'top-1':>7} {'ppl':>8} {'ref ppl':>8}")
    for r in rows:
        size = r.get("gguf_tensor_bytes", r["weight_bytes"])
        print(f"{r['variant']:16} {r['linear_bytes'] / 2**20:11.2f} {r['linear_bpw']:11.3f} "
              f"{size / 2**20:9.2f} {r['mean_kl']:9.5f} {r['p99_kl']:8.4f} {r['top1']:7.4f} "
              f"{r['ppl']:8.3f} {r['ref_ppl']:8.3f}")
    for laq, uni in (("laq:4.5", "int4"), ("laq:3.5", "int3"), ("laq:4.5", "int4/embed=int4"),
                     ("laq:3.5", "int3/embed=int3")):
        if laq in base and uni in base:
            x, y = base[laq], base[uni]
            print(f"{laq} / {uni}: mean KL x{x['mean_kl'] / y['mean_kl']:.3f}, p99 KL x{x['p99_kl'] / y['p99_kl']:.3f}, "
                  f"linear bytes x{x['linear_bytes'] / y['linear_bytes']:.4f}")
    for v in base:
        if v.startswith("laq@") and v[4:] in base:
            x, y = base[v], base[v[4:]]
            print(f"{v} / {v[4:]}: mean KL x{x['mean_kl'] / y['mean_kl']:.3f}, p99 KL x{x['p99_kl'] / y['p99_kl']:.3f}, "
                  f"size x{x['weight_bytes'] / y.get('gguf_tensor_bytes', y['weight_bytes']):.4f}")
    sens = sensitivity(a, ref) if a.sensitivity else None
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "sensitivity": sens}, indent=1))
    return 0


def sensitivity(a, ref: Path) -> list[dict]:
    """The proxy (laq.json's predicted error of one tensor at a format) against the KL measured
    with only that tensor quantized: does the proxy rank tensors the way KL does?"""
    import numpy as np

    dumps = sorted(a.work_dir.glob("laq-*/dump/laq.json"))
    if not dumps:
        raise SystemExit("--sensitivity needs a laq:B variant (its dump holds the proxy errors)")
    table = json.loads(dumps[0].read_text())["tensors"]
    names = sorted(table)
    pick = [names[i] for i in np.linspace(0, len(names) - 1, a.sensitivity).round().astype(int)]
    out = []
    for name in dict.fromkeys(pick):
        d = a.work_dir / f"sens-{name}"
        if not (d / "plan.bin").exists():
            stratac("compile", str(a.model), "-o", str(d), "--quant", "f32", "--tensor-format",
                    f"^{name.replace('.', chr(92) + '.')}$={a.sensitivity_format}")
        r = json.loads(stratac("eval", str(d), "--reference", str(ref), "--text", str(a.text), "--ctx", str(a.ctx),
                               "--chunks", str(max(1, a.chunks // 2)), "--backend", a.backend, "--json"))
        proxy = table[name]["proxy"][a.sensitivity_format]
        out.append({"tensor": name, "proxy": proxy, "mean_kl": r["mean_kl"]})
        log(f"sensitivity {name}: proxy {proxy:.4g}, KL {r['mean_kl']:.5f}")
    px = np.argsort(np.argsort([o["proxy"] for o in out]))
    kl = np.argsort(np.argsort([o["mean_kl"] for o in out]))
    rho = float(np.corrcoef(px, kl)[0, 1]) if len(out) > 2 else float("nan")
    print(f"\nproxy vs measured KL, one tensor at {a.sensitivity_format} (the rest f32):")
    print(f"{'tensor':24} {'proxy':>12} {'mean KL':>10}")
    for o in out:
        print(f"{o['tensor']:24} {o['proxy']:12.4g} {o['mean_kl']:10.5f}")
    print(f"Spearman rank correlation: {rho:.3f} over {len(out)} tensors")
    return out


if __name__ == "__main__":
    sys.exit(main())
