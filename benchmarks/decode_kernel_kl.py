"""What the GPU's decode kernels cost in quality on a real model: decode-step logits (one token a
step, so the Pallas decode kernels run, in interpret mode on the CPU) against XLA's path in f32,
teacher-forced on that path's greedy continuations of a few prompts; the llvm CPU backend's
activation modes beside them.

    python benchmarks/decode_kernel_kl.py PLAN [--tokens 24]

Prints mean KL(f32 || variant) per decode step and top-1 agreement. A plan with a tokenizer
(e.g. the real-model test's SmolLM2-135M-Instruct GGUF compiled `--quant int8`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout

import numpy as np  # noqa: E402

PROMPTS = ("The capital of France is", "Photosynthesis is the process by which", "def fibonacci(n):",
           "Once upon a time, in a small village,", "The three laws of motion are", "To make bread, you need")
VARIANTS = (("xla, the Pallas decode kernels (interpret mode)", "xla", dict(pallas="interpret")),
            ("llvm, q16 activations (the CPU default)", "llvm", dict(cpu_act="q16")),
            ("llvm, q8 activations", "llvm", dict(cpu_act="q8")))


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main() -> int:
    from strata_compiler import settings
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.runtime.scheduler import load_tokenizer
    from strata_compiler.runtime.session import Session

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan", type=Path)
    ap.add_argument("--tokens", type=int, default=24)
    a = ap.parse_args()
    plan = load_plan(a.plan)
    tok, why = load_tokenizer(plan)
    if tok is None:
        raise SystemExit(f"error: {a.plan}: {why}")
    prompts = [tok.encode(p).ids for p in PROMPTS]
    reference = dict(pallas="off", xla_compute="f32")
    with settings.override(**reference):
        s = Session(plan, "xla", device="cpu")
        conts = [s.generate(np.array([ids], np.int64), a.tokens, Sampler())[1][0] for ids in prompts]

    def step_logits(backend: str, over: dict) -> list:
        out = []
        with settings.override(**over):
            s = Session(plan, backend, device="cpu")
            for ids, cont in zip(prompts, conts):
                s.reset(1, len(ids) + a.tokens + 8)
                s.step(np.array([ids], np.int64))
                out.append(np.stack([s.step(np.array([[t]], np.int64))[0, -1] for t in cont]))
        return out

    ref = [_log_softmax(x) for x in step_logits("xla", reference)]
    print(f"plan {a.plan}, {len(prompts)} prompts x {a.tokens} decode steps against xla in f32\n")
    print("| variant | mean KL per step | top-1 agreement |\n|---|---:|---:|")
    for name, backend, over in VARIANTS:
        got = [_log_softmax(x) for x in step_logits(backend, over)]
        kl = np.mean([(np.exp(r) * (r - g)).sum(-1).mean() for r, g in zip(ref, got)])
        top1 = np.mean([(r.argmax(-1) == g.argmax(-1)).mean() for r, g in zip(ref, got)])
        print(f"| {name} | {kl:.2e} | {100 * top1:.1f} % |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
