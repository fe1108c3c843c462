"""`strata-server`: serve a plan over an OpenAI-compatible HTTP API (runtime/server.py)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click

from strata_compiler import settings
from strata_compiler.cli_common import debug_option, run_cli
from strata_compiler.errors import UsageError

KEEP_ALIVE_S = 30       # seconds an idle HTTP connection is kept (see main)
_KEYS = {"host", "port", "ctx", "max_batch", "api_key", "backend", "device", "queue_size", "model_name",
         "prefill_chunk", "prompt_cache", "kv_cache_dir"}


def _read_config(ctx: click.Context, _param, path: Path | None):
    """--config FILE.toml: the same keys as the flags (dashes or underscores); flags override it."""
    if path is None:
        return None
    try:
        import tomllib
    except ImportError:         # Python 3.10
        raise UsageError("--config needs Python 3.11 or later (tomllib)") from None
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise UsageError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"--config {path}: not valid TOML ({e})") from None
    data = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise UsageError(f"--config {path}: unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(_KEYS))}")
    ctx.default_map = {**(ctx.default_map or {}), **data}
    return path


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("plan_path", type=click.Path(path_type=Path))
@click.option("--config", type=click.Path(path_type=Path, dir_okay=False), is_eager=True, expose_value=False,
              callback=_read_config, help="A TOML file holding any of these options (host, port, ctx, max-batch, "
                                          "prefill-chunk, prompt-cache, kv-cache-dir, api-key, backend, device, "
                                          "queue-size, model-name); flags override it.")
@settings.option("host")
@settings.option("port")
@settings.option("ctx")
@settings.option("max_batch")
@settings.option("prefill_chunk")
@settings.option("prompt_cache", metavar="MIB")
@settings.option("kv_cache_dir", type=click.Path(path_type=Path, file_okay=False))
@settings.option("queue_size")
@settings.option("api_key")
@settings.option("model_name")
@settings.option("backend")
@settings.option("device")
@settings.option("log_level")
@click.version_option(package_name="strata", prog_name="strata-server")
@debug_option
def strata_server(plan_path: Path, host: str, port: int, ctx: int | None, max_batch: int, prefill_chunk: int,
                  prompt_cache: int, kv_cache_dir: Path | None, queue_size: int, api_key: str | None,
                  model_name: str | None, backend: str, device: str, log_level: str, debug: bool) -> None:
    """Serve PLAN_PATH (a plan.bin, or its directory) over an OpenAI-compatible API: /v1/completions,
    /v1/chat/completions, /v1/models, /health. A request that leaves out a sampling field gets the
    plan's default (the model's recommendation, else temperature 0.8, top-k 40, top-p 0.95, min-p 0.05,
    repetition penalty 1.1 over the last 64 tokens; docs/sampling.md)."""
    if backend in ("auto", "xla") and device != "cpu":     # JAX's start-up beside the imports and the plan's reading
        from strata_compiler.backends.xla.device import start_in_background

        start_in_background()
    import uvicorn

    from .http_protocol import HeadDeadlineProtocol

    _Server = _server_class()

    from .plan import load_plan
    from .batching import BatchScheduler, kv_bytes
    from .prompt_cache import PromptCache
    from .server import make_app
    from .sampler import plan_sampling
    from .scheduler import load_tokenizer
    from .session import Session, default_ctx
    from .sigbus import guard

    plan = load_plan(plan_path)
    guard(plan.weights_path)        # a weights file truncated under the server: one error line
    tokenizer, problem = load_tokenizer(plan)
    if problem:         # as strata-run: token-id prompts are still served
        click.echo(f"strata-server: warning: {plan.path}: the tokenizer section is {problem}; serving prompts "
                   f"given as token ids only", err=True)
    limit = int(plan.meta["model"].get("max_position") or 0)
    if ctx is not None and limit and ctx > limit:
        raise UsageError(f"--ctx {ctx}: the model's positions end at {limit}; give --ctx {limit} or less")
    session = Session(plan, backend, device=device)
    if ctx is None:     # the batch's rows and the prefill row, in the memory left where the cache lives
        ctx = default_ctx(plan, max_batch + 1, session.executor.kv_room())
    cache = None
    if prompt_cache:
        m = plan.meta["model"]
        cache = PromptCache(prompt_cache << 20, plan.digest(), kv_cache_dir,
                            shape=(m["n_layers"], m["n_kv_heads"], m["head_dim"]))
    engine = BatchScheduler(session, tokenizer, ctx, max_batch=max_batch, queue_size=queue_size,
                            chunk=prefill_chunk, prompt_cache=cache)
    kv_mib = kv_bytes(plan, ctx, max_batch) / 2**20
    click.echo(f"strata-server: {max_batch} sequences of up to {ctx} tokens; KV cache {kv_mib:.0f} MiB; "
               f"requests that name none sample with {plan_sampling(plan.meta).describe()}", err=True)
    name = model_name or (plan.path.parent.name if plan.path.name == "plan.bin" else plan.path.stem)
    app = make_app(engine, api_key=api_key, model_name=name)
    # keep-alive longer than clients keep idle connections (httpx, so the openai client: 5 s): a
    # client then closes an idle connection before the server does, never reusing one the server is
    # closing at that moment (a request that fails before the server sees it)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            timeout_keep_alive=KEEP_ALIVE_S, lifespan="off", http=HeadDeadlineProtocol)
    server = _Server(config)
    server.engine, server.grace = engine, config.timeout_graceful_shutdown
    server.stop_waiting = app.state.stop_waiting
    engine.start(warm=True)     # builds the programs; /health says "loading" until it is done
    # uvicorn handles SIGINT/SIGTERM (a graceful shutdown), then re-raises the signal to the handler
    # that was there before it: a quiet one here, so that the process exits 0 without a traceback
    quiet = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        engine.shutdown()
        if cache is not None:
            cache.save()
        for sig, h in quiet.items():
            signal.signal(sig, h)
    if not server.started:      # the port was taken, say (uvicorn logged why)
        raise UsageError(f"could not serve on {host}:{port}")


def _server_class():
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's graceful shutdown, and the scheduler's: no new sequences; the running ones get
        most of the grace period to finish, then are aborted (their clients see an error, not a
        cut connection)."""

        async def shutdown(self, sockets=None):
            self.engine.stop_admitting()
            self.stop_waiting()     # requests waiting for a worker thread (the chat template): 503 now
            asyncio.get_running_loop().call_later(max(self.grace - 1, 0.1), self.engine.abort)
            await super().shutdown(sockets)

    return Server


def main() -> None:
    sys.exit(run_cli(strata_server))


if __name__ == "__main__":
    main()
