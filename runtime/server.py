"""strata-server's HTTP layer: OpenAI-compatible endpoints (FastAPI) over a scheduler.

`make_app(engine)` takes a scheduler (runtime/scheduler.py: `submit`, `ready`, `plan`, `tokenizer`,
`ctx`) and serves GET /health, GET /v1/models, POST /v1/completions and POST /v1/chat/completions,
with `stream: true` as server-sent events. Errors come in OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, so the official client reads them unchanged.

Every request field goes through runtime/request_schema.py (the Python API's schema too): a value
that does not fit is a 400 naming the field. A request that fails once admitted (non-finite
logits, the plan's tokenizer failing) gets a 500 error object, or an error event in its stream.
The event loop never runs anything that may take long: tokenizing and the chat template (model-
supplied input) run in daemon worker threads (_Workers), which the server's shutdown does not
wait for.
"""

from __future__ import annotations

import asyncio
import json
import queue
import secrets
import threading
import time
import uuid
from typing import Any, Optional, Union

from fastapi import Depends, FastAPI, HTTPException, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from strata_compiler.errors import StrataError

from . import chat as chat_mod    # the plan's chat template (jinja2, sandboxed) and stop ids
from . import request_schema as schema
from .sampler import Sampler, plan_sampling
from .scheduler import PlanTokenizer, QueueFull, Request, caught, describe

MAX_CHARS_PER_TOKEN = schema.MAX_CHARS_PER_TOKEN    # a longer text prompt is refused unread
MAX_BODY = 16 << 20         # request bodies larger than this are refused (413), counted as they are read
WORKER_THREADS = 4          # blocking calls (tokenizing; the chat template) running at once, of each kind
WORKER_BACKLOG = 64         # ... waiting or running; beyond it a request is answered 503
BODY_IDLE_S = 30.0          # a request body that sends no bytes for this long is answered 408 (slowloris)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _printable(text):
    """A str that UTF-8 can carry (a lone surrogate echoed from a request becomes U+FFFD's "?")."""
    return text.encode("utf-8", "replace").decode("utf-8") if isinstance(text, str) else text


def _error(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse({"error": {"message": _printable(message), "type": type_, "param": _printable(param),
                                   "code": code}}, status)


def _invalid_field(e: schema.SchemaError) -> PydanticCustomError:
    """A schema error as pydantic's: the 400 handler gives its message as it is, and its field as `param`."""
    return PydanticCustomError("request_schema", "{message}", {"message": str(e), "param": e.field})


class _Common(BaseModel):
    """Fields both endpoints take. Unknown fields are refused (400), not silently ignored. The
    generation fields (request_schema.FIELDS) are any JSON value here, checked by the schema."""
    model_config = ConfigDict(extra="forbid", strict=True)     # JSON types as written: no "yes" for true, no true for 1
    model: Optional[str] = None
    # max_tokens; sampling (a field left out, or null, takes the plan's default: docs/sampling.md):
    # temperature, top_p, and vLLM's (llama-server's too) top_k (<= 0 off), min_p, repetition_penalty,
    # repeat_last_n (llama-server's: the penalty's window, -1 every token seen); seed; stop; ignore_eos
    # (vLLM's and llama-server's: run to max_tokens past an EOS)
    max_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    repeat_last_n: Any = None
    seed: Any = None
    stop: Any = None
    ignore_eos: Any = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    # accepted at their neutral values only
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    logprobs: Optional[Union[bool, int]] = None

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data):
        """Text anywhere in the body (values and keys) is valid Unicode: no lone surrogate."""
        where = schema.find_surrogate(data)
        if where is not None:
            raise _invalid_field(schema.SchemaError(where, f"{where}: a lone UTF-16 surrogate is not valid "
                                                           f"Unicode text"))
        return data

    @field_validator(*schema.FIELDS)
    @classmethod
    def _generation(cls, v, info):
        try:
            return schema.check(info.field_name, v)
        except schema.SchemaError as e:
            raise _invalid_field(e) from None

    @field_validator("model", "user")
    @classmethod
    def _name(cls, v, info):
        try:
            return None if v is None else schema.text(info.field_name, v, schema.MAX_NAME)
        except schema.SchemaError as e:
            raise _invalid_field(e) from None

    def generation(self) -> schema.Generation:
        return schema.generation(**{name: getattr(self, name) for name in schema.FIELDS})

    def check(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n}: this server makes one choice per request (n must be 1)", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported (only 0)", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        # completions' logprobs=0 asks for the chosen tokens' log probabilities: refused too, not ignored
        if self.logprobs is not None and self.logprobs is not False:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        usage = (self.stream_options or {}).get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise APIError(400, f"stream_options.include_usage: expected true or false, got {type(usage).__name__}",
                           param="stream_options.include_usage")


class CompletionBody(_Common):
    prompt: Union[str, list[int], list[str]]
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ChatBody(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: Any = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion(cls, v):
        try:
            return None if v is None else schema.whole("max_completion_tokens", v, 1, schema.MAX_TOKENS)
        except schema.SchemaError as e:
            raise _invalid_field(e) from None


class _BodyLimit:
    """Refuses (413) a request body over MAX_BODY: at once where its Content-Length says so, else
    (chunked transfer encoding) as soon as the bytes read pass it, counted in `receive`; and (408)
    one whose bytes stop arriving for BODY_IDLE_S before it is whole. Plain
    ASGI, not Starlette's BaseHTTPMiddleware, which would put every streamed chunk through a task."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1")
        if size.isdigit() and int(size) > MAX_BODY:
            resp = _error(413, f"the request body has {size} bytes; at most {MAX_BODY} are read")
            await resp(scope, receive, send)
            return
        read, whole = 0, False

        async def counted():
            nonlocal read, whole
            if whole:       # the body is in: what follows is the wait for a disconnect, however long
                return await receive()
            try:            # a client that stops sending its body holds a connection: not for ever
                message = await asyncio.wait_for(receive(), BODY_IDLE_S)
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body stopped arriving ({read} bytes in, none for "
                                         f"{BODY_IDLE_S:g} s); send it whole") from None
            if message["type"] == "http.request":
                whole = not message.get("more_body", False)
                read += len(message.get("body", b""))
                if read > MAX_BODY:     # FastAPI passes its own HTTPException through the body's parsing
                    raise HTTPException(413, f"the request body is over {MAX_BODY} bytes; at most {MAX_BODY} "
                                             f"are read")
            return message

        await self.app(scope, counted, send)


class _Workers:
    """Blocking calls run off the event loop: at most `threads` at once, in daemon threads, and at
    most `backlog` waiting or running (more: 503). A call that never ends (a hostile chat template)
    holds one thread, never the loop; `stop` (the server's shutdown) answers every request still
    waiting on a call at once, and nothing waits for the threads at exit."""

    def __init__(self, name: str, threads: int = WORKER_THREADS, backlog: int = WORKER_BACKLOG):
        self.name, self.max_threads, self.backlog = name, threads, backlog
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.threads = self.pending = 0         # started; submitted and not finished
        self.waiting: set[asyncio.Future] = set()
        self.stopped = False

    async def run(self, fn, *args):
        if self.stopped:
            raise APIError(503, "the server is shutting down", "server_error")
        with self.lock:
            if self.pending >= self.backlog:
                raise APIError(503, f"{self.pending} requests are waiting for {self.name}; try again later",
                               "server_error", code="busy")
            self.pending += 1
            spawn = self.threads < min(self.pending, self.max_threads)
            self.threads += spawn
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.waiting.add(fut)
        self.jobs.put((fn, args, loop, fut))
        if spawn:
            threading.Thread(target=self._work, name=f"strata-{self.name.split()[-1]}", daemon=True).start()
        try:
            return await fut
        finally:
            self.waiting.discard(fut)

    def _work(self) -> None:
        while True:
            fn, args, loop, fut = self.jobs.get()
            result = error = None
            try:
                result = fn(*args)
            except BaseException as e:
                if not caught(e):
                    raise
                error = e if isinstance(e, Exception) else RuntimeError(describe(e))
            with self.lock:
                self.pending -= 1
            try:
                loop.call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:        # that request's event loop has closed
                pass

    def stop(self) -> None:
        self.stopped = True
        for fut in list(self.waiting):
            _settle(fut, None, APIError(503, "the server is shutting down", "server_error"))


def _settle(fut: asyncio.Future, result, error) -> None:
    if fut.done():          # the request stopped waiting (shutdown, or its client went away)
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = _printable(key[:64])
        self.where = f"key {self.key!r}" if key.isprintable() else "a key"


def _unique_pairs(pairs: list) -> dict:
    """json.loads' object_pairs_hook: the object, unless a key appears twice (_DuplicateKey)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return out


def _usage(p: int, c: int) -> dict:
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _no_tokenizer(param: str) -> APIError:
    return APIError(400, "the plan has no usable tokenizer: give the prompt as token ids", param=param)


async def _unique_keys(request: HTTPRequest):
    """A body that names a key twice in one object is refused: json.loads keeps the last, so a
    proxy or log that reads the first would see another request than the one served."""
    try:
        json.loads(await request.body(), object_pairs_hook=_unique_pairs)
    except _DuplicateKey as e:
        raise APIError(400, f"the request body names {e.where} twice in one object; send each field once",
                       param=e.key) from None
    except (ValueError, RecursionError):     # FastAPI's own parsing has answered for these
        pass


def _auth(api_key: str | None):
    """The dependency that checks a request's API key (none with no key set)."""
    # bytes, not str: compare_digest refuses a non-ASCII str (a header is any bytes, read as latin-1)
    wanted = None if api_key is None else f"Bearer {api_key}".encode("utf-8", "surrogateescape")

    async def auth(request: HTTPRequest):
        if wanted is not None and not secrets.compare_digest(
                request.headers.get("authorization", "").encode("latin-1"), wanted):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                           "authentication_error", code="invalid_api_key")

    return auth


async def _events(req: Request):
    """The request's events until done, in lists of those that have arrived (a stream behind
    the scheduler sends them in one write); cancels the sequence if the client goes away."""
    try:
        while True:
            evs = [await req.events.get()]
            while not req.events.empty() and evs[-1][0] == "text":
                evs.append(req.events.get_nowait())
            for ev in evs:
                if ev[0] == "error":
                    raise APIError(ev[2], ev[1], "server_error" if ev[2] >= 500 else "invalid_request_error")
            yield evs
            if evs[-1][0] == "done":
                return
    finally:
        req.cancel()


async def _hang_up(http: HTTPRequest, req: Request) -> None:
    """A client that goes away while its whole answer is made: cancel the sequence."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    req.cancel()


async def _collect(req: Request, http: HTTPRequest) -> tuple[str, str, dict | None]:
    """A request's whole answer: its text, finish reason and usage (cancelled if the client goes)."""
    parts, reason, usage = [], "length", None
    watch = asyncio.create_task(_hang_up(http, req))
    try:
        async for evs in _events(req):
            for ev in evs:
                if ev[0] == "text":
                    parts.append(ev[1])
                else:
                    reason, usage = ev[1], _usage(ev[2], ev[3])
    finally:
        watch.cancel()
    return "".join(parts), reason, usage


def _completion(head: dict, kind: str, text: str, reason: str, usage: dict | None) -> dict:
    """The non-streamed response body of a chat or text completion."""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason}
        return {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    return {**head, "object": "text_completion", "choices": [choice], "usage": usage}


def _chunk_object(kind: str) -> str:
    return "chat.completion.chunk" if kind == "chat" else "text_completion"


def _chunk(head: dict, kind: str, text: str | None, reason: str | None, first: bool = False) -> str:
    """One server-sent event of a stream: a piece of text, or the finish reason."""
    if kind == "chat":
        delta = {"role": "assistant", "content": text or ""} if first else \
            ({"content": text} if text is not None else {})
        c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    else:
        c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    return f"data: {json.dumps({**head, 'object': _chunk_object(kind), 'choices': [c]})}\n\n"


async def _sse(req: Request, kind: str, head: dict, include_usage: bool):
    """A request's answer as server-sent events: its chunks, an error event if it fails, then [DONE]."""
    if kind == "chat":
        yield _chunk(head, kind, "", None, first=True)
    try:
        async for evs in _events(req):
            out = []
            for ev in evs:
                if ev[0] == "text":
                    out.append(_chunk(head, kind, ev[1], None))
                else:
                    out.append(_chunk(head, kind, None, ev[1]))
                    if include_usage:
                        usage = {**head, "object": _chunk_object(kind), "choices": [], "usage": _usage(ev[2], ev[3])}
                        out.append(f"data: {json.dumps(usage)}\n\n")
            yield "".join(out)
    except APIError as e:
        err = {"error": {"message": e.message, "type": e.type, "param": None, "code": e.code}}
        yield f"data: {json.dumps(err)}\n\n"
    yield "data: [DONE]\n\n"


class _Service:
    """What the generation endpoints share: the scheduler, the plan's tokenizer and stop ids, and
    the worker threads that tokenize and render chat templates off the event loop."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.plan = engine.plan
        tok = engine.tokenizer
        if tok is not None and not isinstance(tok, PlanTokenizer):
            tok = PlanTokenizer(tok)        # its failures: one TokenizerError
        self.tok = tok
        self.encoder, self.renderer = _Workers("the tokenizer"), _Workers("the chat template")
        self.eos = tuple(chat_mod.stop_ids(self.plan))
        self.vocab = self.plan.meta["model"]["vocab_size"]

    def stop_waiting(self) -> None:
        """At shutdown (on the event loop): requests waiting for a worker thread get a 503 now."""
        self.encoder.stop()
        self.renderer.stop()

    async def encode(self, text: str, param: str = "prompt") -> list[int]:
        """Token ids of a text, tokenized off the event loop (other clients keep being served); a
        text longer than MAX_CHARS_PER_TOKEN per position of the context is refused unread."""
        if self.tok is None:
            raise _no_tokenizer(param)
        ctx = self.engine.ctx
        if len(text) > MAX_CHARS_PER_TOKEN * ctx:
            raise APIError(400, f"the prompt has {len(text)} characters: more than this model's context of "
                                f"{ctx} tokens can hold", param=param, code="context_length_exceeded")
        try:
            return (await self.encoder.run(self.tok.encode, text)).ids
        except StrataError as e:        # the plan's tokenizer failed on it (a regex that panics, say)
            raise APIError(400, str(e), param=param) from None

    async def render(self, messages: list) -> str:
        """The chat template applied to a conversation, in a worker thread."""
        if self.tok is None:
            raise _no_tokenizer("messages")
        try:        # the template is model-supplied: it may take long, never on the event loop
            return await self.renderer.run(chat_mod.render_chat, self.plan, messages, True)
        except StrataError as e:
            raise APIError(400, str(e), param="messages") from None

    def _max_tokens(self, body: _Common, ids: list[int], max_tokens: int | None) -> int:
        """The checked prompt's token budget: `max_tokens`, or all the context leaves when None."""
        ctx, vocab = self.engine.ctx, self.vocab
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if any(not 0 <= i < vocab for i in ids):
            raise APIError(400, f"a prompt token id is outside the vocabulary [0, {vocab})", param="prompt")
        room = ctx - len(ids)
        if room <= 0:
            raise APIError(400, f"the prompt has {len(ids)} tokens: this model's context of {ctx} tokens "
                                f"leaves no room for an answer; shorten it", param="messages" if
                           isinstance(body, ChatBody) else "prompt", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = room
        if max_tokens > room:
            raise APIError(400, f"this model's context is {ctx} tokens; the prompt has {len(ids)} and "
                                f"max_tokens is {max_tokens}: give {room} or less", param="max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    def submit(self, body: _Common, ids: list[int], max_tokens: int | None) -> Request:
        """A checked request for the prompt `ids`, with the body's sampling, queued on the scheduler."""
        gen = body.generation()
        max_tokens = self._max_tokens(body, ids, max_tokens)
        if gen.stop and self.tok is None:
            raise APIError(400, "stop strings need the plan's tokenizer", param="stop")
        seed = gen.seed if gen.seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "little")
        sampling = plan_sampling(self.plan.meta, **gen.sampling())
        req = Request(ids, max_tokens, Sampler.of(sampling, seed), () if gen.ignore_eos else self.eos, gen.stop)
        req.loop = asyncio.get_running_loop()
        try:
            self.engine.submit(req)
        except QueueFull as e:
            if e.status != 429:
                raise APIError(e.status, str(e), "server_error") from None
            raise APIError(429, str(e), "rate_limit_error", code="queue_full") from None
        return req

    async def respond(self, body: _Common, req: Request, kind: str, http: HTTPRequest):
        """The answer to a submitted request: one JSON object, or server-sent events with `stream`."""
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "created": int(time.time()), "model": body.model or self.model_name}
        if not body.stream:
            return _completion(head, kind, *await _collect(req, http))
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(_sse(req, kind, head, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error object."""

    @app.exception_handler(APIError)
    async def _api_error(_req, e: APIError):
        return _error(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return _error(400, f"the request body is not valid JSON ({msg})")
        if first.get("type") == "request_schema":      # its message names the field
            return _error(400, msg, param=first.get("ctx", {}).get("param"))
        where = ".".join(loc)
        return _error(400, f"{where}: {msg}" if where else msg, param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error")

    @app.exception_handler(Exception)
    async def _bug(_req, e: Exception):
        return _error(500, f"{e.__class__.__name__}: {e}", "server_error")


def _add_info_routes(app: FastAPI, engine, model_name: str, guarded: list) -> None:
    """GET /health, /v1/models and /stats."""

    @app.get("/health")
    async def health():
        if engine.warm_error:
            return JSONResponse({"status": "error", "message": engine.warm_error}, 500)
        if getattr(engine, "stopped", False):
            return JSONResponse({"status": "error", "message": "the generation thread has stopped"}, 500)
        if not engine.ready.is_set():
            return JSONResponse({"status": "loading"}, 503)
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "strata", "max_model_len": engine.ctx}]}

    @app.get("/stats", dependencies=guarded)
    async def stats():
        """The scheduler's counters and how many requests wait (not part of OpenAI's API)."""
        return {**engine.stats, "waiting": engine.queue.qsize(), "max_batch": engine.max_batch}


def _add_generation_routes(app: FastAPI, svc: _Service, posted: list) -> None:
    """POST /v1/completions and /v1/chat/completions."""

    @app.post("/v1/completions", dependencies=posted)
    async def completions(body: CompletionBody, http: HTTPRequest):
        if body.echo or body.suffix or body.best_of not in (None, 1):
            raise APIError(400, "echo, suffix and best_of are not supported")
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise APIError(400, "one prompt per request (a list of one string at most)", param="prompt")
            p = p[0]
        body.check()
        ids = await svc.encode(p) if isinstance(p, str) else list(p)
        req = svc.submit(body, ids, body.max_tokens or 16)      # 16: OpenAI's default
        return await svc.respond(body, req, "completion", http)

    @app.post("/v1/chat/completions", dependencies=posted)
    async def chat(body: ChatBody, http: HTTPRequest):
        body.check()
        text = await svc.render(body.messages)
        ids = await svc.encode(text, "messages")
        req = svc.submit(body, ids, body.max_completion_tokens or body.max_tokens)
        return await svc.respond(body, req, "chat", http)


def make_app(engine, api_key: str | None = None, model_name: str = "strata") -> FastAPI:
    """The FastAPI app serving `engine` (a scheduler); `app.state.stop_waiting` is for shutdown."""
    app = FastAPI(title="strata-server", docs_url=None, redoc_url=None, openapi_url=None)
    svc = _Service(engine, model_name)
    app.state.stop_waiting = svc.stop_waiting
    _add_error_handlers(app)
    auth = _auth(api_key)
    app.add_middleware(_BodyLimit)
    _add_info_routes(app, engine, model_name, [Depends(auth)])
    _add_generation_routes(app, svc, [Depends(auth), Depends(_unique_keys)])
    return app
