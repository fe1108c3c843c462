"""`strata-run`: execute a plan — prompt or token ids in, text / ids / logits out."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
import numpy as np

from strata_compiler.cli_common import debug_option, run_cli
from strata_compiler.errors import UsageError


def _load_ids(path: Path) -> np.ndarray:
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise UsageError(f"--input-ids {path}: cannot read a .npy array ({str(e) or e.__class__.__name__})") from None
    if not isinstance(ids, np.ndarray):
        raise UsageError(f"--input-ids {path}: expected one .npy array, not an .npz archive")
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.dtype.kind not in "iu" or ids.shape[1] == 0:
        raise UsageError(f"--input-ids {path}: expected integer token ids of shape [B, T], got {ids.dtype}{list(ids.shape)}")
    return ids.astype(np.int64)


def _check_out(flag: str, path: Path | None) -> None:
    """An output file's folder must exist before the run, not after it (no traceback, no lost run)."""
    if path is not None and not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {path.parent} does not exist; create it or give another path")


def _save(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, arr)
    tmp.replace(path)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("plan_path", type=click.Path(path_type=Path))
@click.option("--prompt", help="Text prompt (needs the tokenizer that travels with the plan).")
@click.option("--input-ids", type=click.Path(path_type=Path), help="Token ids as .npy, int64 [B, T] (or [T]).")
@click.option("-n", "--max-new-tokens", type=click.IntRange(0), default=32, show_default=True,
              help="Tokens to generate after the prompt (fewer if every sequence reaches EOS).")
@click.option("--greedy", is_flag=True, help="Pick the most likely token (the default unless --temperature > 0).")
@click.option("--temperature", type=click.FloatRange(0), default=0.0, show_default=True,
              help="Sampling temperature; 0 is greedy.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
              help="Nucleus sampling: keep the most likely tokens whose probabilities sum to this.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampler.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence tokens.")
@click.option("--logits-out", type=click.Path(path_type=Path), help="Save the prompt logits, float32 [B, T, V], as .npy.")
@click.option("--tokens-out", type=click.Path(path_type=Path), help="Save the generated ids, int64 [B, N], as .npy.")
@click.option("--backend", type=click.Choice(["auto", "reference", "llvm", "xla"]), default="auto", show_default=True,
              help="Where kernels run: auto runs a placed plan (--target, --place) as placed and any other on the "
                   "best available backend (xla on a GPU, else llvm); a name runs every op there.")
@click.option("--device", type=click.Choice(["auto", "gpu", "cpu"]), default="auto", show_default=True,
              help="Where xla partitions run: auto = a CUDA GPU when JAX sees one, else JAX's CPU platform.")
@click.option("--trace", "trace_out", type=click.Path(path_type=Path),
              help="Write a Chrome/Perfetto trace (JSON trace events) of every kernel, partition and copy: one "
                   "track per device and per copy direction. Open it at ui.perfetto.dev.")
@click.option("--stats", is_flag=True, help="Print busy time per device, bytes moved per link and the expert caches' "
              "hit rate after the run.")
@click.option("--expert-cache/--no-expert-cache", default=True, show_default=True,
              help="Swap experts into the GPU slots of layers compiled with --expert-cache as routing shifts "
                   "(off: the plan's split stays static).")
@click.option("--prefetch/--no-prefetch", default=False, show_default=True,
              help="With an expert cache: predict each cached layer's experts by applying its router to the "
                   "hidden state entering the layer, and start their copies before the layer runs. Off by "
                   "default: it has cost more than it saved in every measured run. "
                   "With --miss-path gpu only a cached layer that follows a CPU partition predicts (the others "
                   "have no host call to start copies from).")
@click.option("--miss-path", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True,
              help="With an expert cache: where a missed expert computes. gpu: the GPU reads its weights from "
                   "host memory in place (page-locked, over PCIe) and the whole layer runs on the GPU, no host "
                   "call; cpu: the plan's CPU share computes it (two host calls per cached layer and token); "
                   "auto: gpu on a CUDA GPU unless experts stream from disk (--host-mem plans), else cpu.")
@click.option("--cache-policy", type=click.Choice(["hybrid", "lru"]), default="hybrid", show_default=True,
              help="Expert cache replacement: decayed use counts plus recency (hybrid), or least recently used.")
@click.option("--multi-gpu", type=click.Choice(["mesh", "host"]), default="mesh", show_default=True,
              help="A plan striped over several GPUs (--gpus N --gpu-mode stripe): one sharded computation over "
                   "a device mesh, the shares joined by an all-reduce (mesh), or one partition per GPU driven "
                   "from the host (host).")
@click.option("--coordinator", metavar="HOST:PORT",
              help="Several hosts: the address of process 0's coordinator; start the same command on every host "
                   "with --num-processes and its own --process-id (runtime/distributed.py). The plan must be "
                   "striped over the GPUs of all hosts (stratac compile --gpus N --gpu-mode stripe).")
@click.option("--num-processes", type=click.IntRange(min=1), default=None, help="With --coordinator: how many hosts.")
@click.option("--process-id", type=click.IntRange(min=0), default=None,
              help="With --coordinator: this host's index (0 prints the output).")
@click.option("--chat", is_flag=True, help="An interactive chat in the terminal under the plan's chat template: "
              "answers stream as they are made, the KV cache is kept across turns, -n caps each answer; Ctrl-C "
              "stops an answer, /reset starts over, /exit or Ctrl-D quits.")
@click.option("--system", "system_prompt", metavar="TEXT", help="With --chat: the system message.")
@debug_option
def strata_run(plan_path: Path, prompt: str | None, input_ids: Path | None, max_new_tokens: int, greedy: bool,
               temperature: float, top_p: float, seed: int, ignore_eos: bool, logits_out: Path | None,
               tokens_out: Path | None, backend: str, device: str, trace_out: Path | None, stats: bool,
               expert_cache: bool, prefetch: bool, miss_path: str, cache_policy: str, multi_gpu: str,
               coordinator: str | None,
               num_processes: int | None, process_id: int | None, chat: bool, system_prompt: str | None,
               debug: bool) -> None:
    """Run PLAN_PATH (a plan.bin, or the directory holding it): prefill the prompt, then decode."""
    from .plan import load_plan
    from .sampler import Sampler
    from .session import Session

    if chat:
        if prompt is not None or input_ids is not None:
            raise UsageError("--chat reads the conversation from the terminal; drop --prompt / --input-ids")
        bad = [f for f, v in (("--logits-out", logits_out), ("--tokens-out", tokens_out), ("--trace", trace_out),
                              ("--stats", stats), ("--coordinator", coordinator)) if v]
        if bad:
            raise UsageError(f"--chat does not combine with {', '.join(bad)}")
    elif system_prompt is not None:
        raise UsageError("--system goes with --chat")
    elif (prompt is None) == (input_ids is None):
        raise UsageError("give exactly one of --prompt TEXT or --input-ids FILE.npy")
    if greedy and temperature > 0:
        raise UsageError("--greedy and --temperature > 0 contradict each other; pick one")
    for flag, path in (("--trace", trace_out), ("--logits-out", logits_out), ("--tokens-out", tokens_out)):
        _check_out(flag, path)
    lead = True
    if (coordinator, num_processes, process_id) != (None, None, None):
        if None in (coordinator, num_processes, process_id):
            raise UsageError("--coordinator, --num-processes and --process-id go together; give all three")
        if multi_gpu != "mesh":
            raise UsageError("--coordinator and --multi-gpu host conflict: several hosts run as one mesh")
        from .distributed import initialize

        lead = initialize(coordinator, num_processes, process_id) == 0
    plan = load_plan(plan_path)
    tokenizer = None
    if plan.tokenizer_json is not None:
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_str(plan.tokenizer_json.decode())
    if chat:
        from .chat_cli import start_chat

        session = Session(plan, backend, device=device, expert_cache=expert_cache, cache_policy=cache_policy,
                          prefetch=prefetch, multi_gpu=multi_gpu, miss_path=miss_path)
        start_chat(plan, session, tokenizer, Sampler(temperature, top_p, seed), max_new_tokens, system_prompt,
                   ignore_eos)
        return
    if prompt is not None:
        if tokenizer is None:
            raise UsageError(f"{plan.path}: the plan has no tokenizer (the model folder had no tokenizer.json); use --input-ids")
        ids = np.array([tokenizer.encode(prompt).ids], np.int64)
        if ids.shape[1] == 0:
            raise UsageError("--prompt: the prompt encodes to no tokens")
    else:
        ids = _load_ids(input_ids)
    session = Session(plan, backend, device=device, expert_cache=expert_cache, cache_policy=cache_policy,
                      prefetch=prefetch, multi_gpu=multi_gpu, miss_path=miss_path)
    from .chat import stop_ids

    stop = () if ignore_eos else stop_ids(plan)   # config.json's and generation_config.json's EOS ids
    from strata_compiler import trace

    tracer = trace.Tracer(full=bool(trace_out)) if (trace_out or stats) else None
    trace.ACTIVE = tracer
    t_run = time.perf_counter()
    try:
        logits, new = session.generate(ids, max_new_tokens, Sampler(temperature, top_p, seed), stop)
    finally:
        trace.ACTIVE = None
    t_run = time.perf_counter() - t_run
    if not lead:        # another host of a multi-host run: process 0 reports
        return
    if trace_out:
        tracer.write(trace_out)
    if logits_out:
        _save(logits_out, logits.astype(np.float32))
    if tokens_out:
        _save(tokens_out, new)
    if tokenizer is not None:
        for b in range(new.shape[0]):
            text = tokenizer.decode(ids[b].tolist() + new[b].tolist())
            click.echo(text)
    else:
        for row in new:
            click.echo(" ".join(map(str, row.tolist())))
    pre, dec = session.timings.rates()
    extra = ""
    if session.backend == "llvm":
        from strata_compiler.backends.llvm_cpu.jit import library

        st = library().stats
        extra = f"; kernels: {st.compiled} compiled, {st.cached} from cache"
    t = session.timings
    warm_pre, warm_dec = t.warm_rates()
    # the programs' compilation (a plan's first run; later runs load them from the persistent
    # cache) would otherwise hide the rates a warm process decodes at

    def warm(rate: float, sec: float) -> str:
        return f" ({rate:.1f} tok/s without {sec:.1f} s of compiling)" if sec >= 0.05 and rate > 0 else ""

    click.echo(f"[{session.backend}] prefill {ids.size} tokens at {pre:.1f} tok/s"
               f"{warm(warm_pre, t.prefill_compile_seconds)}, decode {t.decode_tokens} tokens at "
               f"{dec:.1f} tok/s{warm(warm_dec, t.decode_compile_seconds)}{extra}", err=True)
    if stats:
        from . import expert_cache as ec

        for line in tracer.stats_lines(t_run) + ec.stats_lines(session.executor.residency):
            click.echo(line, err=True)


def main() -> None:
    sys.exit(run_cli(strata_run))


if __name__ == "__main__":
    main()
