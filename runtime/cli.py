"""`strata-run`: execute a plan — prompt or token ids in, text / ids / logits out."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import click
import numpy as np

from strata_compiler import settings
from strata_compiler.cli_common import debug_option, run_cli
from strata_compiler.errors import PlanError, StrataError, UsageError


class RunInterrupted(StrataError):
    """Ctrl-C: the run stopped (what it had made is printed and saved first)."""

    exit_code = 130


class OutputError(StrataError):
    """An output file (--tokens-out, --logits-out, --trace) could not be written."""


class _CtrlC:
    """Ctrl-C (SIGINT) while strata-run works.

    Before the first token nothing would be lost, so it ends the run at once: KeyboardInterrupt in
    the main thread, and where that is swallowed (Python ignores exceptions raised in finalizers,
    e.g. llvmlite's while kernels compile) or the main thread sits in a long native call, a thread
    woken by the signal's wakeup fd prints the line and exits 130 after GRACE seconds. From the
    first token on (`decoding`), Session.generate keeps what was made: the KeyboardInterrupt, and
    `on_token`, which stops at the next step should that one have been swallowed."""

    GRACE = 0.5

    def __init__(self) -> None:
        self.hits = 0
        self.decoding = False
        self._lock = threading.Lock()
        self._claimed = False
        self._saved: tuple | None = None

    def __enter__(self) -> "_CtrlC":
        if threading.current_thread() is threading.main_thread():
            r, w = os.pipe()
            os.set_blocking(w, False)
            self._saved = (signal.signal(signal.SIGINT, self._on_signal),
                           signal.set_wakeup_fd(w, warn_on_full_buffer=False), sys.unraisablehook, w)
            sys.unraisablehook = self._unraisable
            threading.Thread(target=self._watch, args=(r,), name="strata-run ctrl-c", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            handler, fd, hook, w = self._saved
            signal.signal(signal.SIGINT, handler)
            signal.set_wakeup_fd(fd)
            sys.unraisablehook = hook
            os.close(w)         # the watcher's read ends: it closes its end and returns
            self._saved = None

    def claim(self) -> bool:
        """The main thread reports the interrupt (False: the watcher already has, and exits)."""
        with self._lock:
            first, self._claimed = not self._claimed, True
            return first

    def on_token(self, i: int, tokens=None) -> bool:
        """Session.generate's hook: decoding has begun; True stops it (a Ctrl-C was swallowed)."""
        self.decoding = True
        return self.hits > 0

    def _on_signal(self, signum, frame) -> None:
        self.hits += 1
        raise KeyboardInterrupt

    def _unraisable(self, u) -> None:
        if not isinstance(u.exc_value, KeyboardInterrupt):     # counted in `hits`; acted on above
            self._saved[2](u)

    def _watch(self, r: int) -> None:
        while data := os.read(r, 64):
            if signal.SIGINT not in data:
                continue
            time.sleep(self.GRACE)
            if self.decoding or self._saved is None:
                continue
            with self._lock:
                if not self._claimed:
                    self._claimed = True
                    os.write(2, b"error: interrupted (Ctrl-C) before the first token; nothing was written\n")
                    os._exit(130)
        os.close(r)


def _finite(ctx, param, value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number", ctx, param)
    return value


def _on_command_line(name: str) -> bool:
    """Whether option `name` was given on the command line (not by its STRATA_<NAME> or its default)."""
    from click.core import ParameterSource

    ctx = click.get_current_context(silent=True)
    return ctx is None or ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE


def _load_ids(path: Path) -> np.ndarray:
    from strata_compiler.untrusted import open_regular

    try:
        with open_regular(path) as f:       # a regular file only: a FIFO would block np.load
            ids = np.load(f, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise UsageError(f"--input-ids {path}: cannot read a .npy array ({str(e) or e.__class__.__name__})") from None
    if not isinstance(ids, np.ndarray):
        raise UsageError(f"--input-ids {path}: expected one .npy array, not an .npz archive")
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.dtype.kind not in "iu" or 0 in ids.shape:
        raise UsageError(f"--input-ids {path}: expected integer token ids of shape [B, T] (B, T >= 1), "
                         f"got {ids.dtype}{list(ids.shape)}")
    return ids.astype(np.int64)


def _check_out(flag: str, path: Path | None) -> None:
    """An output file's folder must exist and the file, if there, be a regular one (a device such
    as /dev/full would be replaced by the rename) before the run, not after it."""
    if path is None:
        return
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {path.parent} does not exist; create it or give another path")
    if os.path.lexists(path) and not path.is_file():
        raise UsageError(f"{flag} {path}: exists and is not a regular file; give a file path")
    if not os.access(path.parent, os.W_OK):
        raise UsageError(f"{flag} {path}: the folder {path.parent} is not writable; give another path")


def _write(flag: str, path: Path, write) -> None:
    """write(file) into a temp file beside `path`, then a rename: `path` is whole or as it was.
    A failure (a full disk) is one OutputError naming the flag."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"{flag} {path}: cannot write it ({e.strerror or e}); {path.name} was left as it was") \
            from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _tokenizer(plan, needed: str | None):
    """The plan's tokenizer, or None. `needed` (the flag that needs it): a broken tokenizer section
    is an error; else (--input-ids) it is skipped with one warning and ids are printed."""
    from .scheduler import load_tokenizer

    tokenizer, why = load_tokenizer(plan)       # its encode and decode fail as one TokenizerError line
    if why is not None:
        if needed:
            raise PlanError(f"{plan.path}: the tokenizer section is {why}; {needed} needs it (recompile the plan "
                            f"from a model folder with a valid tokenizer.json, or use --input-ids)")
        click.echo(f"strata-run: warning: {plan.path}: the tokenizer section is {why}; printing token ids", err=True)
    return tokenizer


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("plan_path", type=click.Path(path_type=Path))
@click.option("--prompt", help="Text prompt (needs the tokenizer that travels with the plan).")
@click.option("--input-ids", type=click.Path(path_type=Path), help="Token ids as .npy, int64 [B, T] (or [T]).")
@settings.option("max_new_tokens", "-n")
@click.option("--greedy", is_flag=True, help="Pick the most likely token: the same as --temperature 0.")
@settings.option("temperature", callback=_finite)
@settings.option("top_p", callback=_finite)
@settings.option("top_k")
@settings.option("min_p", callback=_finite)
@settings.option("repeat_penalty", callback=_finite)
@settings.option("repeat_last_n")
@settings.option("seed")
@settings.option("ignore_eos")
@click.option("--stop", "stop_strings", multiple=True, metavar="TEXT",
              help="End the output where this text appears (not printed); repeatable. Needs the tokenizer.")
@settings.option("echo")
@click.option("--logits-out", type=click.Path(path_type=Path), help="Save the prompt logits, float32 [B, T, V], as .npy.")
@click.option("--tokens-out", type=click.Path(path_type=Path), help="Save the generated ids, int64 [B, N], as .npy "
              "(after Ctrl-C: those made before it).")
@settings.option("prefill_chunk", default=None, maximum=None,
                 help="Prompt tokens per prefill step: a long prompt's activation memory is bounded by this "
                      "(default: 512; where the prefill runs on a GPU 4096, fewer without its flash-attention "
                      "kernel while a step's attention scores would pass 2 GiB).")
@settings.option("backend")
@settings.option("device")
@click.option("--trace", "trace_out", type=click.Path(path_type=Path),
              help="Write a Chrome/Perfetto trace (JSON trace events) of every kernel, partition and copy: one "
                   "track per device and per copy direction. Open it at ui.perfetto.dev.")
@settings.option("stats")
@settings.option("expert_cache")
@settings.option("miss_path")
@settings.option("cache_policy")
@settings.option("multi_gpu")
@settings.option("coordinator", metavar="HOST:PORT")
@settings.option("num_processes")
@settings.option("process_id")
@click.option("--chat", is_flag=True, help="An interactive chat in the terminal under the plan's chat template: "
              "answers stream as they are made, the KV cache is kept across turns, -n caps each answer; Ctrl-C "
              "stops an answer, /reset starts over, /exit or Ctrl-D quits.")
@click.option("--system", "system_prompt", metavar="TEXT", help="With --chat: the system message.")
@click.version_option(package_name="strata", prog_name="strata-run")
@debug_option
def strata_run(plan_path: Path, prompt: str | None, input_ids: Path | None, max_new_tokens: int, greedy: bool,
               temperature: float | None, top_p: float | None, top_k: int | None, min_p: float | None,
               repeat_penalty: float | None, repeat_last_n: int | None, seed: int,
               ignore_eos: bool, stop_strings: tuple[str, ...], echo: bool, logits_out: Path | None,
               tokens_out: Path | None, prefill_chunk: int | None, backend: str, device: str, trace_out: Path | None, stats: bool,
               expert_cache: bool, miss_path: str, cache_policy: str, multi_gpu: str,
               coordinator: str | None,
               num_processes: int | None, process_id: int | None, chat: bool, system_prompt: str | None,
               debug: bool) -> None:
    """Run PLAN_PATH (a plan.bin, or the directory holding it): prefill the prompt, then decode."""
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
    if greedy and temperature and _on_command_line("temperature"):     # not STRATA_TEMPERATURE: the flag wins
        raise UsageError("--greedy and --temperature > 0 contradict each other; pick one")
    if greedy:
        temperature = 0.0
    for flag, path in (("--trace", trace_out), ("--logits-out", logits_out), ("--tokens-out", tokens_out)):
        _check_out(flag, path)
    if (coordinator, num_processes, process_id) != (None, None, None):
        if None in (coordinator, num_processes, process_id):
            raise UsageError("--coordinator, --num-processes and --process-id go together; give all three")
        if multi_gpu != "mesh":
            raise UsageError("--coordinator and --multi-gpu host conflict: several hosts run as one mesh")
    ctrl = _CtrlC()
    try:
        with ctrl:
            _run(**locals())        # every flag, and ctrl
    except KeyboardInterrupt:
        if ctrl.claim():
            raise RunInterrupted("interrupted (Ctrl-C)" if ctrl.decoding else
                                 "interrupted (Ctrl-C) before the first token; nothing was written") from None
        threading.Event().wait()        # the watcher is printing its line and ending the process


def _run(ctrl: _CtrlC, plan_path: Path, prompt: str | None, input_ids: Path | None, max_new_tokens: int,
         temperature: float | None, top_p: float | None, top_k: int | None, min_p: float | None,
         repeat_penalty: float | None, repeat_last_n: int | None, seed: int,
         ignore_eos: bool, stop_strings: tuple[str, ...], echo: bool, logits_out: Path | None,
         tokens_out: Path | None, prefill_chunk: int | None, backend: str, device: str, trace_out: Path | None,
         stats: bool, expert_cache: bool, miss_path: str, cache_policy: str, multi_gpu: str,
         coordinator: str | None, num_processes: int | None, process_id: int | None, chat: bool,
         system_prompt: str | None, **_flags) -> None:
    """strata-run after its flags were checked: start up, generate, report (Ctrl-C: `ctrl`)."""
    from .plan import load_plan
    from .sampler import Sampler, plan_sampling
    from .session import Session, check_room
    from .sigbus import guard

    lead = True
    if coordinator is not None:
        from .distributed import initialize

        lead = initialize(coordinator, num_processes, process_id) == 0
    xla = backend in ("auto", "xla") and device != "cpu"
    if xla:     # JAX's import and GPU start-up (seconds) beside the plan's reading
        from strata_compiler.backends.xla.device import start_in_background

        start_in_background()
    plan = load_plan(plan_path)
    guard(plan.weights_path)        # a weights file truncated under this process: one error line
    tokenizer = _tokenizer(plan, "--chat" if chat else "--prompt" if prompt is not None else None)

    sampling = plan_sampling(plan.meta, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                             repetition_penalty=repeat_penalty, repeat_last_n=repeat_last_n)
    sampler = Sampler.of(sampling, seed)

    def start() -> Session:
        return Session(plan, backend, device=device, expert_cache=expert_cache, cache_policy=cache_policy,
                       multi_gpu=multi_gpu, miss_path=miss_path)

    if chat:
        from .chat_cli import start_chat

        session = start()
        ctrl.__exit__()         # from here on the chat's own Ctrl-C: it stops an answer, not the chat
        start_chat(plan, session, tokenizer, sampler, max_new_tokens, system_prompt,
                   ignore_eos)
        return
    ids = _prompt_ids(plan, tokenizer, prompt, input_ids)
    check_room(plan, *ids.shape, max_new_tokens, keep_logits=bool(logits_out))
    session = start()
    from .chat import stop_ids

    stop = () if ignore_eos else stop_ids(plan)   # config.json's and generation_config.json's EOS ids
    from strata_compiler import trace

    tracer = trace.Tracer(full=bool(trace_out)) if (trace_out or stats) else None
    trace.ACTIVE = tracer
    if stop_strings and (tokenizer is None or ids.shape[0] != 1):
        raise UsageError("--stop needs the plan's tokenizer and one sequence (a --prompt, or --input-ids of one row)")
    # one sequence with a tokenizer: its text streams to stdout as the tokens are made
    out = _Streamer(tokenizer, ids, stop_strings, echo) if tokenizer is not None and ids.shape[0] == 1 and lead \
        else None
    t_run = time.perf_counter()
    logits, new, stopped = _generate(ctrl, session, ids, max_new_tokens, sampler, stop, prefill_chunk,
                                     bool(logits_out), out)
    t_run = time.perf_counter() - t_run
    # another host of a multi-host run reports nothing (process 0 does); a stop before the first
    # token leaves nothing to keep
    kept = lead and (stopped is None or new.shape[1] > 0)
    if kept:
        _keep(tokenizer, ids, new, logits, tokens_out, logits_out, trace_out, tracer,
              None if stopped is not None else lambda: _report(session, ids, stats, tracer, t_run, sampling),
              out, echo)
    if isinstance(stopped, KeyboardInterrupt):
        saved = [f for f, v in (("--tokens-out", tokens_out), ("--logits-out", logits_out)) if v and kept]
        raise RunInterrupted(f"interrupted (Ctrl-C) after {new.shape[1]} new tokens"
                             + (f"; {' and '.join(saved)} saved with them" if saved else ""))
    if stopped is not None:
        raise stopped


def _prompt_ids(plan, tokenizer, prompt: str | None, input_ids: Path | None) -> np.ndarray:
    """The prompt's ids, int64 [B, T], from --prompt or --input-ids: a user's mistake is one error line."""
    if prompt is not None:
        if tokenizer is None:
            raise UsageError(f"{plan.path}: the plan has no tokenizer (the model folder had no tokenizer.json); use --input-ids")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError("--prompt: not valid UTF-8 text") from None
        ids = np.array([tokenizer.encode(prompt).ids], np.int64)
        if ids.shape[1] == 0:
            raise UsageError("--prompt: the prompt encodes to no tokens")
    else:
        ids = _load_ids(input_ids)
        vocab = plan.meta["model"]["vocab_size"]
        if ids.min() < 0 or ids.max() >= vocab:
            bad = int(ids.min() if ids.min() < 0 else ids.max())
            raise UsageError(f"--input-ids {input_ids}: token id {bad} is outside the vocabulary [0, {vocab})")
    return ids


def _generate(ctrl: _CtrlC, session, ids: np.ndarray, max_new_tokens: int, sampler, stop, prefill_chunk: int | None,
              keep_logits: bool, out: "_Streamer | None") -> tuple[np.ndarray | None, np.ndarray, BaseException | None]:
    """Session.generate -> (logits, new, stopped): an early stop is returned, not raised, so its output is kept."""
    from strata_compiler import trace

    from .session import Interrupted, NonFiniteLogits

    stopped: BaseException | None = None
    try:
        logits, new = session.generate(ids, max_new_tokens, sampler, stop,
                                       prefill_chunk=prefill_chunk, keep_logits=keep_logits,
                                       on_token=lambda i, t: ctrl.on_token(i) or (out is not None and out.push(i, t)))
    except (Interrupted, NonFiniteLogits) as e:     # what was made before it is printed and saved
        if e.logits is None:
            raise
        stopped, logits, new = e, e.logits, e.new
        if out is not None and out.stream.stopped and isinstance(e, Interrupted) and not ctrl.hits:
            stopped = None          # a --stop string ended it: a normal end
    finally:
        trace.ACTIVE = None
        ctrl.decoding = True        # the outputs: a Ctrl-C now stops their writing cleanly, no forced exit
    return logits, new, stopped


class _Streamer:
    """One sequence's text on stdout as its tokens are made (the prompt first with --echo), ended
    by a --stop string (`stream.stopped`); `finish` prints what the generation made past the last
    token it was shown (the last one, those decoded ahead)."""

    def __init__(self, tokenizer, ids: np.ndarray, stops: tuple[str, ...], echo: bool):
        from .scheduler import TextStream

        self.stream = TextStream(tokenizer, ids[0].tolist(), tuple(stops))
        self.shown = 0
        if echo:
            click.echo(tokenizer.decode(ids[0].tolist()), nl=False)
            sys.stdout.flush()

    def push(self, i: int, tokens) -> bool:
        """Token i (Session.generate's hook); True: a stop string was reached."""
        self._write(self.stream.push(int(tokens[0])))
        self.shown = i + 1
        return self.stream.stopped

    def finish(self, new: np.ndarray) -> None:
        for t in new[0, self.shown:].tolist():
            if self.stream.stopped:
                break
            self._write(self.stream.push(t))
        self._write(self.stream.flush())
        click.echo("")

    @staticmethod
    def _write(text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()


def _keep(tokenizer, ids: np.ndarray, new: np.ndarray, logits: np.ndarray, tokens_out: Path | None,
          logits_out: Path | None, trace_out: Path | None, tracer, report, streamed: _Streamer | None = None,
          echo: bool = False) -> None:
    """The text on stdout first (the rest of a streamed one), then the rates line (`report`), then
    the output files, each whole or not at all: one that cannot be written (a full disk) is one
    error line, after the text."""
    if streamed is not None:
        streamed.finish(new)
    elif tokenizer is not None:
        for b in range(new.shape[0]):
            text = tokenizer.decode(ids[b].tolist() + new[b].tolist())
            click.echo(text if echo else text[len(tokenizer.decode(ids[b].tolist())):])
    else:
        for row in new:
            click.echo(" ".join(map(str, row.tolist())))
    sys.stdout.flush()
    if report is not None:
        report()
    failed = []
    for flag, path, write in (
            ("--trace", trace_out, lambda f: f.write(json.dumps(tracer.document()).encode())),
            ("--tokens-out", tokens_out, lambda f: np.save(f, new)),
            ("--logits-out", logits_out, lambda f: np.save(f, logits.astype(np.float32, copy=False)))):
        if path:
            try:
                _write(flag, path, write)
            except OutputError as e:    # the others are still tried; the first failure is the line
                failed.append(e)
    if failed:
        raise failed[0]


def _report(session, ids: np.ndarray, stats: bool, tracer, t_run: float, sampling) -> None:
    """The rates line, ending with the sampling in effect (and --stats' lines) on stderr."""
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
               f"{dec:.1f} tok/s{warm(warm_dec, t.decode_compile_seconds)}{extra}"
               + (f"; first token {t.first_token_at:.2f} s after the process started" if t.first_token_at else "")
               + f"; {sampling.describe()}", err=True)
    if stats:
        from . import expert_cache as ec

        for line in tracer.stats_lines(t_run) + ec.stats_lines(session.executor.residency):
            click.echo(line, err=True)


def main() -> None:
    sys.exit(run_cli(strata_run))


if __name__ == "__main__":
    main()
