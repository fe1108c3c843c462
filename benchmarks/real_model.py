"""A real trained GGUF through Strata: what each CPU activation mode costs in quality and speed.

    python benchmarks/real_model.py FILE.gguf [--work DIR] [--acts q16,q8,f32] [--text FILE] [--rounds 3]

Compiles FILE with `--quant auto` (its own formats) and `--quant f32` (its values exactly), then per
activation mode (the `cpu_act` setting: q16, q8, f32; one process each, alternating rounds):
KL and top-1 against the f32 plan on --text (stratac eval's conventions, ctx 256, 4 chunks), how
many of 8 prompts' 24 greedy tokens equal the f32 plan's, and strata-run's decode (a 5-token
prompt, 128 tokens) and prefill (the first 2,000 characters of --text) rates, median of --rounds.
Prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "To make a cup of tea, first", "Water boils at a temperature of",
           "The largest planet in our solar system", "In machine learning, overfitting means"]


def sh(cmd: list[str], env: dict | None = None) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=1800)
    if r.returncode:
        sys.exit(f"error: {' '.join(cmd[:3])} ... failed:\n{r.stderr[-2000:]}")
    return r.stdout + r.stderr


def strata(tool: str) -> list[str]:
    entry = {"stratac": "strata_compiler.cli:main", "strata-run": "strata_compiler.runtime.entry:strata_run"}[tool]
    mod, fn = entry.split(":")
    return [sys.executable, "-c", f"import sys; sys.argv[0] = {tool!r}; from {mod} import {fn}; {fn}()"]


GREEDY = """
import json, sys
import strata
out = []
with strata.load(sys.argv[1], max_batch=1) as m:
    for p in json.loads(sys.argv[2]):
        out.append(m.tokenizer.encode(m.generate(p, max_tokens=24, temperature=0, ignore_eos=True)).ids)
print(json.dumps(out))
"""


def greedy(plan: Path, act: str) -> list[list[int]]:
    out = sh([sys.executable, "-c", GREEDY, str(plan), json.dumps(PROMPTS)], {"STRATA_CPU_ACT": act})
    return json.loads(out.strip().splitlines()[-1])


def rates(plan: Path, act: str, prompt: str, n: int) -> tuple[float, float]:
    out = sh(strata("strata-run") + [str(plan), "--prompt", prompt, "-n", str(n), "--temperature", "0", "--ignore-eos"],
             {"STRATA_CPU_ACT": act})
    m = re.search(r"prefill \d+ tokens at ([\d.]+) tok/s, decode \d+ tokens at ([\d.]+) tok/s", out)
    if not m:
        sys.exit(f"error: no rates in strata-run's output:\n{out[-1000:]}")
    return float(m.group(1)), float(m.group(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/real_model"))
    ap.add_argument("--acts", default="q16,q8,f32")
    ap.add_argument("--text", type=Path, default=ROOT / "README.md")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    plans = {"auto": a.work / "auto", "f32": a.work / "f32"}
    for name, flags in (("auto", []), ("f32", ["--quant", "f32"])):
        if not (plans[name] / "plan.bin").is_file():
            sh(strata("stratac") + ["compile", str(a.gguf), "-o", str(plans[name]), *flags])
    acts = a.acts.split(",")
    ref = greedy(plans["f32"], "f32")
    long_prompt = a.text.read_text()[:2000]
    rows = {}
    for act in acts:
        ev = json.loads(sh(strata("stratac") + ["eval", str(plans["auto"]), "--reference", str(plans["f32"]), "--text",
                                                str(a.text), "--ctx", "256", "--chunks", "4", "--json"],
                           {"STRATA_CPU_ACT": act}).strip().splitlines()[-1])
        same = sum(g == r for g, r in zip(greedy(plans["auto"], act), ref))
        rows[act] = {"kl": ev["mean_kl"], "top1": ev["top1"], "same": same, "decode": [], "prefill": []}
    for _ in range(a.rounds):
        for act in acts:
            rows[act]["decode"].append(rates(plans["auto"], act, "The capital of France is", 128)[1])
            rows[act]["prefill"].append(rates(plans["auto"], act, long_prompt, 1)[0])
    print(f"{a.gguf.name}, plan {plans['auto']} (--quant auto), reference {plans['f32']} (--quant f32); "
          f"{os.cpu_count()} CPUs")
    print("| activations | mean KL | top-1 | greedy = f32 plan's (8 prompts x 24) | decode tok/s | prefill tok/s |")
    print("|---|---|---|---|---|---|")
    for act, r in rows.items():
        d, p = r["decode"], r["prefill"]
        print(f"| {act} | {r['kl']:.6f} | {100 * r['top1']:.2f} % | {r['same']}/8 | {statistics.median(d):.1f} "
              f"({min(d):.1f}-{max(d):.1f}) | {statistics.median(p):.1f} ({min(p):.1f}-{max(p):.1f}) |")


if __name__ == "__main__":
    main()
