"""The server's scheduler surface: requests, their events, incremental text, the bounded queue.

One thread owns the Session and turns queued requests into tokens (runtime/batching.py); the
HTTP layer sees `submit`, `start`, `shutdown`, `ready` and `Request` with its async queue of
events and its cancel flag.

Events a request's queue receives (put from the scheduler thread with `call_soon_threadsafe`):
("text", str) — newly decoded text, never an incomplete UTF-8 character nor a possible start of
a stop string; ("done", finish_reason, prompt_tokens, completion_tokens); ("error", message, http_status).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from strata_compiler.errors import PlanError, StrataError

from .sampler import Sampler
from .session import NonFiniteLogits, non_finite, non_finite_error


class QueueFull(Exception):
    """The scheduler's queue of waiting requests is full (the server answers 429)."""
    status = 429


class ShuttingDown(QueueFull):
    """The server is shutting down and admits nothing new (503)."""
    status = 503


def caught(e: BaseException) -> bool:
    """Whether `e` is a failure to report: an Exception, or a Rust panic raised through pyo3 (the
    tokenizers library's PanicException derives from BaseException); not an exit or an interrupt."""
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"


def describe(e: BaseException) -> str:
    """One line for a failure: a StrataError's own message, else its class and message."""
    if isinstance(e, StrataError):
        return str(e)
    text = str(e).strip().splitlines()
    return f"{e.__class__.__name__}: {text[0][:300] if text else ''}".rstrip(": ")


class TokenizerError(PlanError):
    """The plan's tokenizer cannot be read, or failed on a text or on token ids."""


class PlanTokenizer:
    """The plan's tokenizer (a `tokenizers.Tokenizer`) with every failure one TokenizerError line."""

    __slots__ = ("inner",)

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name: str):       # the rest of the library's Tokenizer, as it is
        return getattr(self.inner, name)

    def encode(self, text: str):
        try:
            return self.inner.encode(text)
        except BaseException as e:
            if not caught(e):
                raise
            raise TokenizerError(f"the plan's tokenizer failed on this text ({describe(e)})") from None

    def decode(self, ids: list[int]) -> str:
        try:
            return self.inner.decode(ids)
        except BaseException as e:
            if not caught(e):
                raise
            raise TokenizerError(f"the plan's tokenizer failed to decode token ids ({describe(e)})") from None


def load_tokenizer(plan) -> tuple[PlanTokenizer | None, str | None]:
    """(the plan's tokenizer, None), (None, None) for a plan without one, or (None, why it cannot
    be read: "not UTF-8", "not a tokenizer.json: ...") for a broken tokenizer section."""
    if plan.tokenizer_json is None:
        return None, None
    try:
        from tokenizers import Tokenizer

        return PlanTokenizer(Tokenizer.from_str(plan.tokenizer_json.decode())), None
    except BaseException as e:
        if not caught(e):
            raise
        return None, "not UTF-8" if isinstance(e, UnicodeDecodeError) else f"not a tokenizer.json: {describe(e)[:120]}"


def check_logits(logits: np.ndarray, where: str) -> None:
    """NonFiniteLogits naming `where` when logits f32[B, V] (a sequence's: B = 1) hold NaN or Inf.
    The sums are checked first (one pass, no temporary); only a row whose sum is not finite (NaN,
    Inf, or finite values that overflow it) is looked at closely."""
    sums = logits.sum(axis=-1)
    if np.isfinite(sums).all():
        return
    for b in np.flatnonzero(~np.isfinite(sums)):
        what = non_finite(logits[b])
        if what is not None:
            raise NonFiniteLogits(non_finite_error(what, where), logits, np.zeros((len(logits), 0), np.int64))


class TextStream:
    """Token ids in, text out: incremental detokenization (a text is released only once the bytes
    of its last character are complete) and stop strings (text that might begin one is held back;
    a stop string ends the stream, itself not included). Without a tokenizer (a plan whose section
    is broken: token-id prompts only) the text is the ids, space-separated, as strata-run prints them."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = ()):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-4:])        # a few prompt tokens give the first new ones their context
        self.prefix = self.read = len(self.ids)
        self.stop = tuple(s for s in stop if s)
        self.pending = ""       # decoded, not yet released
        self.stopped = False

    def _hold(self, text: str) -> int:
        """How many trailing characters of text could begin a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def push(self, tok: int) -> str:
        """Add one token; the text it releases (maybe empty). After a stop string, `stopped` is set."""
        self.ids.append(int(tok))
        if self.tok is None:
            return f" {int(tok)}" if len(self.ids) > self.read + 1 else str(int(tok))
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""           # an incomplete character: wait for its other bytes
        self.pending += now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        return self._release()

    def _release(self) -> str:
        cut = min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending, self.stopped = self.pending[:cut], "", True
            return out
        keep = self._hold(self.pending)
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out

    def flush(self) -> str:
        """At the end of a stream: whatever is held back (an incomplete character as U+FFFD)."""
        if self.stopped or self.tok is None:
            return ""
        tail = self.tok.decode(self.ids[self.prefix:])
        before = self.tok.decode(self.ids[self.prefix:self.read])
        out = self.pending + tail[len(before):]
        self.pending = ""
        return out


_outbox = threading.local()


def _post(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """Events into their requests' queues, on the loop's thread: one wake-up for all of them."""
    if loop.is_closed():
        return
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:        # the loop closed meanwhile (shutdown)
        pass


def _put_all(items: list) -> None:
    for req, event in items:
        req.events.put_nowait(event)


@contextlib.contextmanager
def batched_events():
    """Requests' events emitted by this thread inside the block reach their event loops at its
    end, one wake-up per loop (a decode step's tokens for all its streams at once), in order."""
    if getattr(_outbox, "items", None) is not None:
        yield
        return
    _outbox.items = items = []
    try:
        yield
    finally:
        _outbox.items = None
        by_loop: dict = {}
        for req, event in items:
            by_loop.setdefault(req.loop, []).append((req, event))
        for loop, batch in by_loop.items():
            _post(loop, batch)


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    why: str = "the request was cancelled"
    sink: Callable[[tuple], None] | None = None     # events to this instead (the Python API's queue)
    ended: bool = False     # its "done" or "error" was sent: nothing follows it

    def emit(self, *event) -> None:
        if self.ended:
            return
        self.ended = event[0] in ("done", "error")
        if self.sink is not None:
            self.sink(event)
        elif self.loop is not None:
            box = getattr(_outbox, "items", None)
            if box is not None:
                box.append((self, event))
            else:
                _post(self.loop, [(self, event)])

    def cancel(self, why: str | None = None) -> None:
        if why:
            self.why = why
        self.cancelled.set()


class Scheduler:
    """The surface a server drives: a thread that owns `session`, fed from a bounded queue (the
    loop itself: runtime/batching.py's BatchScheduler)."""

    max_batch = 1

    def __init__(self, session, tokenizer, ctx: int, queue_size: int = 64):
        self.session = session
        self.tokenizer = tokenizer
        self.ctx = ctx
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.ready = threading.Event()
        self.warm_error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="strata-scheduler", daemon=True)
        self._stopping = False
        # served / cancelled requests and the tokens generated for them (GET /stats)
        self.stats = {"requests": 0, "cancelled": 0, "prompt_tokens": 0, "completion_tokens": 0}

    @property
    def plan(self):
        return self.session.plan

    @property
    def stopped(self) -> bool:
        """Whether the thread was started and has ended (shutdown, or a failure it could not survive)."""
        return self._thread.ident is not None and not self._thread.is_alive()

    def start(self, warm: bool = True) -> None:
        self._warm = warm
        self._thread.start()

    def submit(self, req: Request) -> None:
        if self._stopping:
            raise ShuttingDown("the server is shutting down")
        if self.stopped:
            raise ShuttingDown("the generation thread has stopped; restart the server")
        try:
            self.queue.put_nowait(req)
        except queue.Full:
            raise QueueFull(f"{self.queue.maxsize} requests are already waiting; try again later") from None

    def stop_admitting(self) -> None:
        self._stopping = True

    def abort(self, why: str = "the server is shutting down", status: int = 503) -> None:
        """Cancel every waiting request (their clients get a 503 / an error event); a subclass
        cancels the running ones too."""
        self._stopping = True
        while True:
            try:
                r = self.queue.get_nowait()
            except queue.Empty:
                break
            if r is not None:
                self.stats["cancelled"] += 1
                r.emit("error", why, status)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Abort what runs and waits, stop the thread."""
        self.abort()
        self.queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        raise NotImplementedError
