"""The Python API: a plan loaded once, text in, text out, on the server's own machinery.

    import strata
    m = strata.load("plan/")                       # or strata.load("plan/", backend="llvm")
    print(m.generate("Explain MoE", max_tokens=64))
    for piece in m.stream("Explain MoE", max_tokens=64):
        print(piece, end="", flush=True)
    print(m.chat([{"role": "user", "content": "Hi!"}], max_tokens=32))
    m.close()                                      # or: with strata.load(...) as m: ...

A `Model` owns a Session and the BatchScheduler that strata-server runs (one generation loop for the
server, the chat and this API): calls from several threads are batched together like concurrent
requests. `m.session` and `m.engine` are those objects. Errors are StrataError subclasses
(UsageError for a bad argument), raised in the caller's thread: the keyword arguments go through
the server's request schema (runtime/request_schema.py), and a failure while a call's tokens are
made (non-finite logits, the plan's tokenizer failing) ends that call with a StrataError.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Iterator

from strata_compiler import settings
from strata_compiler.errors import StrataError, UsageError

from . import request_schema as schema
from .sampler import Sampler, plan_sampling


class Model:
    def __init__(self, plan_path: str | Path, *, backend: str | None = None, device: str | None = None,
                 ctx: int | None = None, max_batch: int | None = None, prefill_chunk: int | None = None,
                 queue_size: int | None = None):
        """An option left None is strata-server's flag of the same name left out: STRATA_<NAME>, else
        the default declared in strata_compiler/settings.py (ctx: the model's, as far as it fits)."""
        from .batching import BatchScheduler, check_options
        from .plan import load_plan
        from .scheduler import load_tokenizer
        from .session import Session, default_ctx

        backend, device, ctx, max_batch, prefill_chunk, queue_size = (
            settings.get(k) if v is None else v for k, v in (
                ("backend", backend), ("device", device), ("ctx", ctx), ("max_batch", max_batch),
                ("prefill_chunk", prefill_chunk), ("queue_size", queue_size)))
        schema.whole("queue_size", queue_size, 1, 1 << 31)
        self.plan = load_plan(plan_path)
        # a broken tokenizer section: token-id prompts still run; text says why it cannot
        self.tokenizer, self._tokenizer_problem = load_tokenizer(self.plan)
        limit = int(self.plan.meta["model"].get("max_position") or 0)
        rows = schema.whole("max_batch", max_batch, 1, schema.MAX_BATCH) + 1    # the batch's and the prefill row
        if ctx is not None:
            schema.whole("ctx", ctx, 1, limit or 1 << 31)
        check_options(self.plan, ctx or 1, max_batch, prefill_chunk)    # before anything is loaded
        self.session = Session(self.plan, backend, device=device)
        if ctx is None:     # in the memory left where the cache lives (default_ctx: it fits)
            ctx = default_ctx(self.plan, rows, self.session.executor.kv_room())
        self.engine = BatchScheduler(self.session, self.tokenizer, ctx, max_batch=max_batch, queue_size=queue_size,
                                     chunk=prefill_chunk)
        self.engine.start(warm=False)
        self.engine.ready.wait()
        if self.engine.warm_error:
            self.close()
            raise StrataError(self.engine.warm_error)

    # -- text in, text out -----------------------------------------------------------------------

    def stream(self, prompt: str | list[int], max_tokens: int = 64, *, temperature: float | None = None,
               top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
               repetition_penalty: float | None = None, repeat_last_n: int | None = None, seed: int = 0,
               stop: tuple[str, ...] | list[str] = (), ignore_eos: bool = False) -> Iterator[str]:
        """The continuation of `prompt` (text, or token ids) piece by piece as it is made; stops at
        an EOS token (unless `ignore_eos`), a `stop` string (not included) or `max_tokens`. A
        sampling argument left None takes the plan's default (`self.sampling`, docs/sampling.md);
        temperature=0 is greedy."""
        from .chat import stop_ids
        from .scheduler import QueueFull, Request

        g = schema.generation(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                              repetition_penalty=repetition_penalty, repeat_last_n=repeat_last_n, seed=seed,
                              stop=stop, ignore_eos=ignore_eos)
        if g.max_tokens is None:        # None is "not given" to the schema; here it has a default
            schema.whole("max_tokens", None, 1, schema.MAX_TOKENS)
        ids = self._ids(prompt)
        room = self.engine.ctx - len(ids)
        if g.max_tokens > room:
            raise UsageError(f"max_tokens {g.max_tokens}: the prompt has {len(ids)} tokens and the context is "
                             f"{self.engine.ctx}; " + (f"give max_tokens {room} or less" if room > 0 else
                                                        "shorten the prompt (or load the plan with a larger ctx)"))
        if g.stop and self.tokenizer is None:
            raise UsageError(f"stop strings need the plan's tokenizer{self._why_no_tokenizer()}")
        sampler = Sampler.of(plan_sampling(self.plan.meta, **g.sampling()), 0 if g.seed is None else g.seed)
        events: queue.Queue = queue.Queue()
        req = Request(ids, g.max_tokens, sampler, () if g.ignore_eos else stop_ids(self.plan), g.stop,
                      sink=events.put)
        try:
            self.engine.submit(req)
        except QueueFull as e:      # a full queue, or a model closed or whose generation thread stopped
            raise StrataError(str(e)) from None
        try:
            while True:
                kind, *rest = events.get()
                if kind == "text":
                    yield rest[0]
                elif kind == "done":
                    return
                elif kind == "error":
                    raise StrataError(rest[0])
        finally:
            req.cancel("the caller stopped reading")     # a no-op once done; frees the slot otherwise

    def generate(self, prompt: str | list[int], max_tokens: int = 64, **sampling) -> str:
        """The whole continuation of `prompt` (see `stream` for the arguments)."""
        return "".join(self.stream(prompt, max_tokens, **sampling))

    def chat(self, messages: list[dict], max_tokens: int = 256, **sampling) -> str:
        """The assistant's answer to `messages` ([{"role": ..., "content": ...}]) under the plan's
        chat template."""
        return "".join(self.chat_stream(messages, max_tokens, **sampling))

    def chat_stream(self, messages: list[dict], max_tokens: int = 256, **sampling) -> Iterator[str]:
        from .chat import render_chat

        bad = schema.find_surrogate(messages, "messages")
        if bad is not None:
            raise UsageError(f"{bad}: a lone UTF-16 surrogate is not valid Unicode text")
        return self.stream(render_chat(self.plan, messages, add_generation_prompt=True), max_tokens, **sampling)

    # -- the rest ----------------------------------------------------------------------------------

    @property
    def sampling(self):
        """The sampling a call gets for the arguments it leaves out (strata_compiler.sampling.Sampling)."""
        return plan_sampling(self.plan.meta)

    def _why_no_tokenizer(self) -> str:
        return f" ({self.plan.path}: the tokenizer section is {self._tokenizer_problem})" \
            if self._tokenizer_problem else ""

    def _ids(self, prompt: str | list[int]) -> list[int]:
        vocab = int(self.plan.meta["model"]["vocab_size"])
        if not isinstance(prompt, str):
            return schema.prompt_ids(prompt, vocab, self.engine.ctx)
        schema.text("prompt", prompt)
        if len(prompt) > schema.MAX_CHARS_PER_TOKEN * self.engine.ctx:     # as the server: refused unread
            raise UsageError(f"the prompt has {len(prompt)} characters: more than this model's context of "
                             f"{self.engine.ctx} tokens can hold; shorten it")
        if self.tokenizer is None:
            raise UsageError(f"{self.plan.path}: the plan has no usable tokenizer{self._why_no_tokenizer()}; "
                             f"pass token ids")
        ids = self.tokenizer.encode(prompt).ids
        if not ids:
            raise UsageError("the prompt is empty")
        return schema.prompt_ids(ids, vocab)

    def close(self) -> None:
        """Stop the generation thread (what still runs is cancelled)."""
        self.engine.shutdown()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(plan_path: str | Path, **options) -> Model:
    """A plan (its folder or plan.bin) ready to generate; options: backend, device, ctx, max_batch,
    prefill_chunk, queue_size (as strata-server's flags, with the same defaults)."""
    return Model(plan_path, **options)
