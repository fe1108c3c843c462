"""Serving benchmark: N concurrent streaming clients through the official `openai` client against an
OpenAI-compatible server (strata-server or llama.cpp's llama-server), per concurrency level.

Each level runs a fixed, seeded mix of prompt lengths x output lengths (the same request sequence at
every level) with `temperature 0`, `stream: true` and `stream_options.include_usage`, on
/v1/completions. Per request it records the time to first token (TTFT: request sent -> first chunk
with text) and the inter-token latencies (ITL: gaps between later text chunks; chunks that arrive in
a burst give ITLs near 0, so TPOT -- (latency - TTFT) / (output tokens - 1) per request -- is reported
beside it). Per level it reports requests, errors, TTFT p50/p99, ITL p50/p99, TPOT p50/p99, aggregate output tok/s (output tokens from `usage`, else
the count of text chunks, over the level's wall time), requests/s and wall time. A level with any
error or lost request (a stream that ends without a finish_reason) is flagged `FAIL`, never hidden;
the exit status is 1 when any level failed.

Prompts: `--prompt-mode ids` (default) sends the prompt as a list of random token ids drawn from
[16, --vocab) -- exact prompt lengths; strata-server and llama-server both take token-id prompts.
`--prompt-mode text` sends random words from a built-in word list (one word is about one token;
the real count is in the report's mean prompt tokens, from `usage`).

Usage
  # against a running server (strata-server or llama-server)
  python benchmarks/serve_bench.py --base-url http://127.0.0.1:8080/v1 --concurrency 1,4,16,64 \\
      --prompt-lens 32,128,512 --output-lens 16,64,128 --json out.json
  # start `strata-server PLAN --port FREE` itself (waits for /health 200; SIGTERM at the end and
  # checks the exit status is 0); --server-arg passes flags through
  python benchmarks/serve_bench.py --plan /tmp/plan --server-arg=--max-batch=16 --concurrency 1,4
  # soak: run requests continuously for SECONDS at one concurrency; reports lost/errored requests
  python benchmarks/serve_bench.py --base-url ... --soak 300 --concurrency 64

CPU smoke test (the tiny trained MoE; BENCHMARKS.md has --max-batch 1 against 8 on the VM)
  .venv/bin/stratac compile examples/models/tiny-moe -o /tmp/sb_plan --quant int8
  .venv/bin/python benchmarks/serve_bench.py --plan /tmp/sb_plan --concurrency 1,4 --requests 8 \\
      --prompt-lens 16,32 --output-lens 8,16 --vocab 4096
  .venv/bin/python benchmarks/serve_bench.py --plan /tmp/sb_plan --soak 10 --concurrency 4 \\
      --prompt-lens 16,32 --output-lens 8,16 --vocab 4096

H200 comparison beside llama-server (issue 27, "Benchmarks"): the same model, benchmarks/make_mixtral_model.py
defaults, Strata int4 against Q4_0, llama-server built from ../shared/anchors/llamacpp. Same prompt/output mix,
same seed, for both, --ignore-eos for both (each then makes exactly the asked output lengths). VOCAB below is the
model's vocab_size (config.json); N is the largest concurrency.
  MIX="--concurrency 1,4,16,64 --prompt-lens 32,128,512 --output-lens 16,64,128 --vocab VOCAB --seed 0"
  # everything on the GPU
  llama-server -m Q4_0.gguf -ngl 99 --parallel 64 -c $((64*640)) --port 8081 &
  python benchmarks/serve_bench.py --base-url http://127.0.0.1:8081/v1 $MIX --ignore-eos --json llama_gpu.json
  python benchmarks/serve_bench.py --plan PLAN_INT4 --server-arg=--device=gpu --server-arg=--max-batch=64 \\
      --server-arg=--ctx=640 $MIX --json strata_gpu.json
  # experts of 8 of 16 layers on the CPU
  llama-server -m Q4_0.gguf -ngl 99 --n-cpu-moe 8 --parallel 64 -c $((64*640)) --port 8081 &
  python benchmarks/serve_bench.py --base-url http://127.0.0.1:8081/v1 $MIX --ignore-eos --json llama_cpumoe8.json
  python benchmarks/serve_bench.py --plan PLAN_INT4_CPU8 ... $MIX --json strata_cpumoe8.json   # the matching placement
  # acceptance: tok/s at concurrency 16 >= 1.5x llama-server's; TTFT p50 at concurrency 1 with a 512-token prompt
  # (--concurrency 1 --prompt-lens 512 --output-lens 16) <= llama-server's; and no request lost or errored in
  python benchmarks/serve_bench.py --plan PLAN_INT4 ... --soak 300 --concurrency 64 --json soak.json
(llama-server's -c is the total context shared by its --parallel slots: N x (longest prompt + longest output).)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

WORDS = (
    "the of and to in is was for on that with as by at from his her an be this which or had are not but "
    "were they have one all their there been has when who will more no if out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another know while last "
    "might us great old year off come since against go came right used take three river stone garden light "
    "window market paper engine signal forest number letter music animal winter summer silver orange"
).split()


def parse_ints(s: str) -> list[int]:
    out = [int(x) for x in s.split(",") if x.strip()]
    if not out or any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError(f"{s!r}: a comma-separated list of positive integers")
    return out


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def make_mix(n: int, prompt_lens: list[int], output_lens: list[int], seed: int, vocab: int,
             mode: str) -> list[tuple[object, int, int]]:
    """n requests (prompt, prompt_len, max_tokens): every (prompt length, output length) pair in turn,
    in a seeded order, with seeded random prompts. The same seed gives the same sequence."""
    rng = random.Random(seed)
    pairs = [(p, o) for p in prompt_lens for o in output_lens]
    out = []
    while len(out) < n:
        order = pairs[:]
        rng.shuffle(order)
        for p, o in order:
            if len(out) == n:
                break
            if mode == "ids":
                prompt: object = [rng.randrange(16, vocab) for _ in range(p)]
            else:
                prompt = " ".join(rng.choice(WORDS) for _ in range(p))
            out.append((prompt, p, o))
    return out


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    lost: bool = False              # the stream ended without a finish_reason
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    latency: float = 0.0


async def one_request(client, model: str, prompt, max_tokens: int, timeout: float, ignore_eos: bool) -> Result:
    r = Result()
    t0 = time.perf_counter()
    last = None
    finish = None
    usage = None

    async def go():
        nonlocal last, finish, usage
        extra = {"ignore_eos": True} if ignore_eos else None
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
        async for ch in stream:
            now = time.perf_counter()
            if ch.usage is not None:
                usage = ch.usage
            for c in ch.choices or ():
                if c.text:
                    if r.ttft is None:
                        r.ttft = now - t0
                    else:
                        r.itl.append(now - last)
                    last = now
                    r.chunks += 1
                if c.finish_reason:
                    finish = c.finish_reason

    try:
        await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError:
        r.error = f"timeout after {timeout:g} s"
    except Exception as e:  # noqa: BLE001 -- every failure is counted and reported
        r.error = f"{type(e).__name__}: {str(e)[:200]}"
    r.latency = time.perf_counter() - t0
    if r.error is None:
        if finish is None:
            r.lost, r.error = True, "stream ended without a finish_reason"
        else:
            r.ok = True
    r.output_tokens = usage.completion_tokens if usage is not None and usage.completion_tokens is not None \
        else r.chunks
    r.prompt_tokens = usage.prompt_tokens if usage is not None else None
    return r


async def run_level(client, model: str, conc: int, mix: list, duration: float | None, timeout: float,
                    ignore_eos: bool, soak: float | None = None) -> dict:
    """`conc` workers take requests from the mix in turn (closed loop). A fixed-count level stops
    handing out requests once `duration` has passed; a soak cycles the mix until `soak` seconds have
    passed, then waits for the requests in flight (each bounded by its timeout)."""
    results: list[Result] = []
    nxt = 0
    t0 = time.perf_counter()
    stop_at = t0 + (soak if soak is not None else (duration or float("inf")))

    async def worker():
        nonlocal nxt
        while time.perf_counter() < stop_at:
            if soak is None and nxt >= len(mix):
                return
            prompt, _, max_tokens = mix[nxt % len(mix)]
            nxt += 1
            results.append(await one_request(client, model, prompt, max_tokens, timeout, ignore_eos))

    await asyncio.gather(*(worker() for _ in range(conc)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [g for r in ok for g in r.itl]
    # time per output token after the first, per request: robust to chunks that arrive in bursts
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    out_tok = sum(r.output_tokens for r in results)
    errors = [r.error for r in results if r.error]
    ptoks = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    row = {
        "concurrency": conc, "requests": len(results), "ok": len(ok), "errors": len(errors),
        "lost": sum(r.lost for r in results),
        "skipped_by_duration": (len(mix) - len(results)) if soak is None else 0,
        "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "itl_p50_ms": _ms(percentile(itl, 50)), "itl_p99_ms": _ms(percentile(itl, 99)),
        "tpot_p50_ms": _ms(percentile(tpot, 50)), "tpot_p99_ms": _ms(percentile(tpot, 99)),
        "chunks_per_token": (sum(r.chunks for r in ok) / max(1, sum(r.output_tokens for r in ok))) if ok else None,
        "output_tokens": out_tok, "output_tok_s": out_tok / wall if wall else 0.0,
        "requests_s": len(ok) / wall if wall else 0.0, "wall_s": wall,
        "mean_prompt_tokens": sum(ptoks) / len(ptoks) if ptoks else None,
        "mean_output_tokens": sum(r.output_tokens for r in ok) / len(ok) if ok else None,
        "latency_p50_s": percentile([r.latency for r in ok], 50),
        "error_samples": sorted(set(errors))[:5],
    }
    row["flag"] = "FAIL" if row["errors"] or not results else "ok"
    return row


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000


def print_table(rows: list[dict], title: str) -> None:
    cols = [("conc", "concurrency", "d"), ("reqs", "requests", "d"), ("err", "errors", "d"), ("lost", "lost", "d"),
            ("TTFT p50 ms", "ttft_p50_ms", ".1f"), ("TTFT p99 ms", "ttft_p99_ms", ".1f"),
            ("ITL p50 ms", "itl_p50_ms", ".2f"), ("ITL p99 ms", "itl_p99_ms", ".2f"),
            ("TPOT p50 ms", "tpot_p50_ms", ".2f"),
            ("out tok/s", "output_tok_s", ".1f"), ("req/s", "requests_s", ".2f"), ("wall s", "wall_s", ".1f"),
            ("flag", "flag", "s")]
    cells = [[h for h, _, _ in cols]]
    for r in rows:
        cells.append(["-" if r[k] is None else format(r[k], f) for _, k, f in cols])
    w = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    print(title)
    for i, c in enumerate(cells):
        print("  ".join(s.rjust(w[j]) for j, s in enumerate(c)))
        if i == 0:
            print("  ".join("-" * x for x in w))
    for r in rows:
        if r["skipped_by_duration"]:
            print(f"  concurrency {r['concurrency']}: {r['skipped_by_duration']} requests not started (--duration cap)")
        for e in r["error_samples"]:
            print(f"  concurrency {r['concurrency']}: error: {e}")
    sys.stdout.flush()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(plan: str, port: int, extra: list[str]) -> list[str]:
    exe = shutil.which("strata-server") or str(Path(sys.executable).with_name("strata-server"))
    cmd = [exe] if Path(exe).exists() else [sys.executable, "-m", "strata_compiler.runtime.server_cli"]
    return cmd + [plan, "--port", str(port), "--log-level", "warning", *extra]


@contextlib.contextmanager
def strata_server(plan: str, extra: list[str], startup_timeout: float, info: dict):
    """`strata-server PLAN --port FREE` as a child process; yields its base URL once /health is 200;
    SIGTERM at the end, and the exit status goes into info['server_exit_code']."""
    import httpx

    port = free_port()
    cmd = server_command(plan, port, extra)
    log = tempfile.NamedTemporaryFile("w+", prefix="serve_bench_server_", suffix=".log", delete=False)
    print(f"[serve_bench] starting: {' '.join(cmd)} (log {log.name})", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    info.update(server_cmd=cmd, server_log=log.name)
    t0 = time.perf_counter()
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"strata-server exited {proc.returncode} while starting:\n{_tail(log.name)}")
            if time.perf_counter() - t0 > startup_timeout:
                raise SystemExit(f"strata-server not healthy after {startup_timeout:g} s:\n{_tail(log.name)}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        info["server_startup_s"] = time.perf_counter() - t0
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                info["server_killed"] = True
        info["server_exit_code"] = proc.returncode
        text = _tail(log.name, 4000)
        info["server_traceback"] = "Traceback" in text
        if proc.returncode != 0 or info["server_traceback"]:
            print(f"[serve_bench] strata-server exit {proc.returncode}:\n{text}", file=sys.stderr)


def _tail(path: str, n: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


async def bench(args, base_url: str, info: dict) -> list[dict]:
    import httpx
    from openai import AsyncOpenAI

    top = max(args.concurrency)
    client = AsyncOpenAI(base_url=base_url, api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or "none",
                         max_retries=0, timeout=args.timeout,
                         # idle connections dropped after 2 s, before either server closes them
                         # (llama-server's and uvicorn's default keep-alive: 5 s): with no retries, a
                         # reuse racing the server's close would count as an error the server never saw
                         http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=top + 8,
                                                                           max_keepalive_connections=top + 8,
                                                                           keepalive_expiry=2.0),
                                                       timeout=args.timeout))
    model = args.model
    if model is None:
        models = await client.models.list()
        model = models.data[0].id if models.data else "default"
    info["model"] = model
    for i in range(args.warmup):
        p, _, o = make_mix(1, args.prompt_lens, args.output_lens, args.seed + 1000 + i, args.vocab, args.prompt_mode)[0]
        w = await one_request(client, model, p, o, args.timeout, args.ignore_eos)
        if not w.ok:
            print(f"[serve_bench] warmup request failed: {w.error}", file=sys.stderr)
    rows = []
    if args.soak:
        conc = args.concurrency[0]
        mix = make_mix(max(64, 4 * conc), args.prompt_lens, args.output_lens, args.seed, args.vocab, args.prompt_mode)
        rows.append(await run_level(client, model, conc, mix, None, args.timeout, args.ignore_eos, soak=args.soak))
    else:
        for conc in args.concurrency:
            n = args.requests or 4 * conc
            mix = make_mix(n, args.prompt_lens, args.output_lens, args.seed, args.vocab, args.prompt_mode)
            row = await run_level(client, model, conc, mix, args.duration, args.timeout, args.ignore_eos)
            rows.append(row)
            print(f"[serve_bench] concurrency {conc}: {row['requests']} requests, {row['errors']} errors, "
                  f"{row['output_tok_s']:.1f} out tok/s, {row['wall_s']:.1f} s", file=sys.stderr, flush=True)
    await client.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--base-url", help="an OpenAI-compatible server's API root, e.g. http://127.0.0.1:8080/v1")
    src.add_argument("--plan", help="start `strata-server PLAN --port FREE` for the run")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="a flag passed to strata-server (repeatable), e.g. --server-arg=--max-batch=16")
    ap.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health 200")
    ap.add_argument("--model", default=None, help="model id to send (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--concurrency", type=parse_ints, default=[1, 4, 16, 64],
                    help="comma-separated levels (the first one only with --soak)")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default 4 x concurrency)")
    ap.add_argument("--duration", type=float, default=300.0,
                    help="seconds per level after which no new request is started (the count says how many were skipped)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                    help="run requests continuously for SECONDS at the first concurrency; report lost/errored ones")
    ap.add_argument("--prompt-lens", type=parse_ints, default=[32, 128, 512])
    ap.add_argument("--output-lens", type=parse_ints, default=[16, 64, 128])
    ap.add_argument("--prompt-mode", choices=["ids", "text"], default="ids",
                    help="prompt as a list of token ids (exact lengths) or as words from a word list")
    ap.add_argument("--vocab", type=int, default=4096, help="token ids are drawn from [16, VOCAB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests before the first level")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="send ignore_eos: true (strata-server, llama-server and vLLM take it): outputs of exactly the asked lengths")
    ap.add_argument("--json", dest="json_out", default=None, help="write the rows and run info here")
    args = ap.parse_args(argv)
    if args.vocab <= 16:
        ap.error("--vocab must be > 16")

    info: dict = {"argv": sys.argv[1:] if argv is None else argv,
                  "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t0 = time.perf_counter()
    if args.plan:
        with strata_server(args.plan, args.server_arg, args.startup_timeout, info) as url:
            rows = asyncio.run(bench(args, url, info))
    else:
        rows = asyncio.run(bench(args, args.base_url, info))
    info["total_s"] = time.perf_counter() - t0

    title = (f"serve_bench {'soak ' + format(args.soak, 'g') + ' s' if args.soak else ''} "
             f"model={info.get('model')} prompts={args.prompt_lens} ({args.prompt_mode}) outputs={args.output_lens}")
    print_table(rows, title)
    failed = any(r["flag"] != "ok" for r in rows)
    if args.plan:
        code = info.get("server_exit_code")
        print(f"strata-server: startup {info.get('server_startup_s', float('nan')):.1f} s, exit code {code}"
              f"{', traceback in its log' if info.get('server_traceback') else ''}")
        failed = failed or code != 0 or bool(info.get("server_traceback"))
    if args.soak:
        r = rows[0]
        print(f"soak: {r['requests']} requests in {r['wall_s']:.1f} s at concurrency {r['concurrency']}: "
              f"{r['errors']} errored, {r['lost']} lost")
    print(f"total {info['total_s']:.1f} s{'  -- FAILED' if failed else ''}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"info": info, "rows": rows, "failed": failed}, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
