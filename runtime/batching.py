"""Continuous batching: one decode step runs every active sequence, each at its own position.

The scheduler thread owns the Session and two KV caches: the batch's (`max_batch` rows, a row per
running sequence, rows at ragged positions) and a one-row cache where a new request's prompt is
prefilled, one chunk of at most `chunk` tokens per loop turn, so that a long prompt stalls the
running streams by one chunk at a time. A prompt done, its row moves into a free slot of the
batch (Session.load_row) and joins the next decode step. A request waits in the bounded queue
while every slot is taken; a finished or cancelled sequence frees its slot at once.

Between two decode steps, in this order: new requests are taken from the queue, one prefill
chunk runs, the batch steps (rows without a sequence run a dummy token at position 0 and are
ignored). A sequence samples its tokens with its own Sampler, so a request's tokens do not
depend on what else runs beside it (up to the float differences of batched kernels).

Where the plan runs whole on one xla device (Session.batch_stepper), a step's tokens are chosen
on the device (greedy, or sampled by each row's settings, uniform and window of ids seen:
backends/xla/sampling.py), and the next step is launched before the last one's tokens reach the
host: the host's share of a step (reading the tokens, the text, the events) overlaps the device's
work. A sequence that ends has one step run past its end, dropped. A batch holding a sequence whose
sampling the device does not compute (no top-k, or one above its bound) steps one at a time,
sampling on the host.

Each request's own steps (its text stream, prompt-cache lookup, prefill, the check that its logits
are finite, sampling, detokenizing) are guarded: one that fails ends that request with an error
event and the others go on; only a failed batch step fails every sequence it ran. A device step's
logits are checked on the device: a row whose logits hold NaN or Inf reads token -1 (the tokens
come to the host in one copy), and only then are its logits read.
"""

from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass, field

import numpy as np

from strata_compiler import settings
from strata_compiler.errors import UsageError
from strata_compiler.execution import AheadSampling
from strata_compiler.hwprofile import host_memory
from strata_compiler.kv_cache import KVCache

from .prompt_cache import PromptCache
from .request_schema import MAX_BATCH, MAX_CHUNK, whole
from .scheduler import Request, Scheduler, TextStream, batched_events, caught, check_logits, describe
from .session import NonFiniteLogits, non_finite_error


def kv_capacity(ctx: int) -> int:
    """Positions per KV row for a context of ctx: a multiple of 64, and room for a padded last prefill chunk."""
    return -(-ctx // 64) * 64 + 64


def kv_bytes(plan, ctx: int, max_batch: int) -> int:
    """The f32 KV caches a BatchScheduler holds: max_batch rows and the prefill row."""
    m = plan.meta["model"]
    return 8 * m["n_layers"] * m["n_kv_heads"] * m["head_dim"] * kv_capacity(ctx) * (max_batch + 1)


def check_options(plan, ctx: int, max_batch: int, chunk: int) -> None:
    """One UsageError line for options a scheduler cannot run with: max_batch outside 1..MAX_BATCH,
    a prefill chunk outside 1..MAX_CHUNK, a context below 1, or KV caches larger than the memory
    this host has available (refused before anything is allocated)."""
    whole("max_batch", max_batch, 1, MAX_BATCH)
    whole("prefill_chunk", chunk, 1, MAX_CHUNK)
    whole("ctx", ctx, 1, 1 << 31)
    need, have = kv_bytes(plan, ctx, max_batch), host_memory()[1]
    if need > have:
        raise UsageError(f"max_batch {max_batch} and ctx {ctx}: the KV cache needs {need / 2**30:.1f} GiB and this "
                         f"host has {have / 2**30:.1f} GiB available; give a smaller max_batch or ctx")


@dataclass
class _Seq:
    req: Request
    text: TextStream
    prompt_len: int
    slot: int = -1
    done: int = 0           # prompt tokens prefilled so far
    n: int = 0              # tokens generated
    last: int = -1          # the last sampled token: the next decode step's input
    tokens: list[int] = field(default_factory=list)    # prompt + the generated tokens stepped
    launched: int = -1      # the last device step (its launch count) that stepped this sequence
    ended: bool = False     # its done event sent
    on_device: bool | None = None   # its tokens chosen on the device (BatchScheduler._on_device)


@dataclass
class _Step:
    """A decode step launched on the device (batch_step), its results not yet on the host."""
    seqs: list[tuple[int, _Seq]]        # (slot, sequence) of each row it steps
    tokens: object                      # device int32 [max_batch]: each row's token (the next step's ids)
    checked: object                     # device int32 [max_batch] ([steps, max_batch]): -1 where not finite
    logits: object                      # device f32 [rows, V] (the last step's)
    steps: int = 1                      # decode steps in this one dispatch


class BatchScheduler(Scheduler):
    """Serves up to `max_batch` sequences at once."""

    def __init__(self, session, tokenizer, ctx: int, max_batch: int | None = None, queue_size: int | None = None,
                 chunk: int | None = None, prompt_cache: PromptCache | None = None, decode_steps: int | None = None):
        """The options left None take strata-server's settings of those names (max_batch,
        queue_size, prefill_chunk, decode_steps: strata_compiler/settings.py)."""
        max_batch, queue_size, chunk = (settings.get(k) if v is None else v for k, v in (
            ("max_batch", max_batch), ("queue_size", queue_size), ("prefill_chunk", chunk)))
        check_options(session.plan, ctx, max_batch, chunk)
        super().__init__(session, tokenizer, ctx, queue_size)
        self.max_batch = max_batch
        self.chunk = chunk
        self.prompt_cache = prompt_cache
        m = self.plan.meta["model"]
        self.capacity = kv_capacity(ctx)
        self.kv = KVCache(m["n_layers"], max_batch, m["n_kv_heads"], m["head_dim"], self.capacity)
        self.pre = KVCache(m["n_layers"], 1, m["n_kv_heads"], m["head_dim"], self.capacity)
        self.slots: list[_Seq | None] = [None] * max_batch
        self.stepper = session.batch_stepper()
        # decode steps per device dispatch while nothing waits to be admitted (the host's launch of
        # a step then counts once per that many tokens)
        self.decode_steps = max(1, int(settings.get("decode_steps") if decode_steps is None else decode_steps))
        self.inflight: _Step | None = None     # launched, not yet read (while the batch is all greedy)
        self.prev = None        # the last launched step's device tokens while they are its rows' next ids
        self.launches = 0
        self.waiting: collections.deque[Request] = collections.deque()
        self.filling: _Seq | None = None       # the sequence whose prompt is being prefilled
        self.stats.update({"steps": 0, "rows_stepped": 0, "prefill_chunks": 0, "prompt_cache_tokens": 0})

    # -- the surface -------------------------------------------------------------------------------

    def abort(self, why: str = "the server is shutting down", status: int = 503) -> None:
        super().abort(why, status)
        for r in self._requests():
            r.cancel(why)

    def warm_up(self) -> None:
        """Build every program serving needs before the server says ready: each prefill length up
        to one chunk (the xla backend pads to buckets), the row hand-over, the decode step of each
        row count (_rows)."""
        vocab = self.plan.meta["model"]["vocab_size"]
        s = self.session
        T = 1
        while True:
            # one-token steps twice: a mixed plan's decode steps run as one program from the second
            # on (runtime/fused_step.py), and a one-token prefill is such a step
            for _ in range(2 if T == 1 else 1):
                self.pre.length = 0
                s.cache = self.pre
                s.step((np.arange(T, dtype=np.int64) % vocab)[None], last_only=True)
            if T >= min(self.chunk, self.ctx):
                break
            T = min(T * 2 if T > 1 else 16, self.chunk, self.ctx)
        s.load_row(self.kv, 0, self.pre)
        rows = 1
        while True:             # each batch size a decode step may run (_rows)
            if self.stepper is not None:
                ids = np.zeros(self.max_batch, np.int32)
                default = self._default_sampling()
                for how in [None] + ([default] if default is not None else []):  # greedy, the plan's default
                    for steps in sorted({1, self.decode_steps}):
                        if self.kv.length + steps <= self.capacity:
                            tokens, checked, _ = self.stepper.batch_step(self.kv, rows, ids, np.ones(self.max_batch, bool),
                                                                         sampling=how, steps=steps)
                            self.stepper.fetch(checked)
            else:       # twice: as the one-token prefill above (a mixed plan's one-program step)
                self._decode_step(rows)
                self._decode_step(rows)
            if rows >= self.max_batch or self._exact_rows:
                break
            rows = min(rows * 2, self.max_batch)
        if self.prompt_cache is not None:
            self.prompt_cache.warm(self.pre, self.kv)
        self.kv.length = 0
        self.pre.length = 0

    def _default_sampling(self) -> AheadSampling | None:
        """A batch_step sampling of every row by the plan's default settings (what a request that
        names none gets), where the device computes it (warm_up builds its program)."""
        from .sampler import plan_sampling

        d = plan_sampling(self.plan.meta)
        if d.greedy or not self.stepper.samples(d):
            return None
        B = self.max_batch
        return AheadSampling((d,) * B, np.zeros((self.decode_steps, B)), np.full((B, d.window), -1, np.int64))

    # -- the loop ----------------------------------------------------------------------------------

    def _active(self) -> list[_Seq]:
        return [s for s in self.slots if s is not None]

    def _requests(self) -> list[Request]:
        """Every request this thread holds: waiting, being prefilled, decoding."""
        held = self._active() + ([self.filling] if self.filling is not None else [])
        return [*self.waiting, *(x.req for x in held)]

    @property
    def _exact_rows(self) -> bool:
        """Whether a step may run any number of rows at no compile cost (the CPU backends), or
        only the powers of two built at warm-up (xla: a program per row count)."""
        return self.session.backend in ("llvm", "reference")

    def _take(self, block: bool) -> bool:
        """Move queued requests to `waiting` (blocking while there is nothing else to do); False
        once the shutdown sentinel arrives."""
        while True:
            try:
                r = self.queue.get(block=block)
            except queue.Empty:
                return True
            if r is None:
                return False
            self.waiting.append(r)
            block = False

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:      # an exit: whatever this thread holds or is queued still gets its answer
            self._stopping = True
            why = f"the generation thread stopped ({describe(e)})"
            for r in self._requests():
                r.emit("error", why, 500)
            super().abort(why, 500)
            raise

    def _serve(self) -> None:
        if self._exact_rows:    # the caches the host's kernels read, reserved beside the warm-up and first steps
            threading.Thread(target=lambda: self.kv.populate() and self.pre.populate(), daemon=True,
                             name="strata-kv-reserve").start()
        if self._warm:
            try:
                self.warm_up()
            except Exception as e:      # noqa: BLE001 — reported by /health, not a dead thread
                self.warm_error = f"{e.__class__.__name__}: {e}"
        self.ready.set()
        while True:
            idle = self.filling is None and not self.waiting and not self._active()
            if not self._take(block=idle):      # shutdown: whatever is left gets its error event
                for r in self._requests():
                    r.cancel("the server is shutting down")
                    self._cancelled(r)
                return
            try:
                with batched_events():      # a first token goes out before the next decode step
                    self._admit()
                if self._active():
                    with batched_events():
                        self._decode()
            except BaseException as e:  # a failed batch step: the requests it ran fail, the server goes on
                if not caught(e):
                    raise
                why = describe(e)
                for s in [*self.slots, self.filling]:
                    if s is not None:
                        s.req.emit("error", why, 500)
                self.slots = [None] * self.max_batch
                self.filling = None
                self.inflight = self.prev = None
                self.kv.length = 0

    def _cancelled(self, r: Request) -> bool:
        if r.cancelled.is_set():
            self.stats["cancelled"] += 1
            r.emit("error", r.why, 503)
            return True
        return False

    @staticmethod
    def _failed(req: Request, step, *args) -> bool:
        """step(*args), one of `req`'s own steps; True when it failed, which ends `req` alone (its
        error event)."""
        try:
            step(*args)
            return False
        except BaseException as e:
            if not caught(e):
                raise
            req.emit("error", describe(e), 500)
            return True

    def _admit(self) -> None:
        """One prefill chunk of the sequence being admitted (taking the next waiting request when
        none is and a slot is free)."""
        if self.filling is None:
            if None not in self.slots:
                return
            while self.waiting and self.filling is None:
                r = self.waiting.popleft()
                if not self._cancelled(r):
                    self._failed(r, self._start, r)
            if self.filling is None:
                return
        seq = self.filling
        if self._cancelled(seq.req):
            self.filling = None
            return
        if self._failed(seq.req, self._prefill, seq):
            self.filling = None
            self.pre.length = 0

    def _prefill(self, seq: _Seq) -> None:
        """The next chunk of `seq`'s prompt; after the last one its first token, and its row moved
        into a free slot of the batch."""
        prompt = seq.req.prompt
        end = min(seq.done + self.chunk, len(prompt))
        s = self.session
        s.cache = self.pre
        logits = s.step(np.asarray(prompt[seq.done:end], np.int64)[None], last_only=True)[:, -1]
        self.stats["prefill_chunks"] += 1
        seq.done = end
        if end < len(prompt):
            return
        self.filling = None
        if self.prompt_cache is not None:
            self.prompt_cache.store(prompt, self.pre, 0)
        check_logits(logits, f"the prompt's last token (prefill, position {len(prompt) - 1})")
        tok = int(seq.req.sampler(logits, [prompt])[0])
        if self._emit(seq, tok):
            return
        slot = self.slots.index(None)
        s.load_row(self.kv, slot, self.pre)
        seq.slot, seq.tokens, seq.last = slot, list(prompt), tok
        self.slots[slot] = seq

    def _start(self, r: Request) -> None:
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(r.prompt)
        seq = _Seq(r, TextStream(self.tokenizer, r.prompt, r.stop), len(r.prompt))
        self.pre.length = 0
        if self.prompt_cache is not None:     # the longest cached prefix (at least one token is left to prefill)
            seq.done = self.prompt_cache.load(r.prompt[:-1], self.pre, 0)
            self.stats["prompt_cache_tokens"] += seq.done
        self.filling = seq

    def _emit(self, seq: _Seq, tok: int) -> bool:
        """A sampled token to its stream; True when the sequence has ended (its done event sent)."""
        seq.n += 1
        self.stats["completion_tokens"] += 1
        reason = None
        if tok in seq.req.stop_ids:
            reason = "stop"
        else:
            out = seq.text.push(tok)
            if out:
                seq.req.emit("text", out)
            if seq.text.stopped:
                reason = "stop"
            elif seq.n >= seq.req.max_tokens:
                reason = "length"
        if reason is None:
            return False
        out = seq.text.flush()
        if out:
            seq.req.emit("text", out)
        seq.req.emit("done", reason, seq.prompt_len, seq.n)
        return True

    def _free(self, seq: _Seq) -> None:
        self.slots[seq.slot] = None
        self.kv.lengths[seq.slot] = 0

    def _decode_step(self, rows: int) -> np.ndarray:
        """One step of the batch's first `rows` rows (the dummy token 0 where no sequence runs);
        logits [rows, V]."""
        ids = np.zeros((rows, 1), np.int64)
        for seq in self._active():
            ids[seq.slot, 0] = seq.last
        s = self.session
        s.cache = self.kv if rows == self.max_batch else self.kv.head(rows)
        logits = s.step(ids, last_only=True)[:, -1]
        self.stats["steps"] += 1
        self.stats["rows_stepped"] += rows
        return logits

    def _rows(self) -> int:
        """How many leading rows a step runs: up to the last busy slot (new sequences take the
        lowest free slot, so the busy ones stay near the top), rounded up to a power of two where
        each row count is a compiled program (xla), exact on the CPU backends."""
        busy = [i for i, s in enumerate(self.slots) if s is not None]
        n = busy[-1] + 1 if busy else 1
        if self._exact_rows:
            return n
        return min(1 << (n - 1).bit_length(), self.max_batch)

    def _decode(self) -> None:
        for seq in self._active():         # free the slots of cancelled sequences before stepping
            if self._cancelled(seq.req):
                self._free(seq)
        if self.stepper is not None:
            self._decode_on_device()
            return
        if not self._active():
            return
        self._clear_free_rows()
        logits = self._decode_step(self._rows())
        for seq in self._active():
            self._deliver(seq, lambda seq=seq: self._sample(seq, logits[seq.slot:seq.slot + 1]))

    @staticmethod
    def _where(seq: _Seq) -> str:
        """The step whose logits choose `seq`'s next token (NonFiniteLogits' wording)."""
        return f"decode step {seq.n} (position {len(seq.tokens) - 1})"

    def _sample(self, seq: _Seq, logits: np.ndarray) -> int:
        """`seq`'s next token from its row of a step's logits f32[1, V], checked finite."""
        check_logits(logits, self._where(seq))
        return int(seq.req.sampler(logits, [seq.tokens])[0])

    def _deliver(self, seq: _Seq, pick) -> None:
        """A step's token for `seq` (pick(): it, once the id the step took is in the sequence's
        history), or for a cancelled sequence its slot freed; a failure to pick, detokenize or
        store it ends `seq` alone."""
        seq.tokens.append(seq.last)
        if seq.req.cancelled.is_set():
            self._cancelled(seq.req)
            self._free(seq)
            return
        if self._failed(seq.req, self._take_token, seq, pick) or seq.ended:
            self._free(seq)

    def _take_token(self, seq: _Seq, pick) -> None:
        tok = pick()
        seq.ended = self._emit(seq, tok)
        if not seq.ended:
            seq.last = tok
        elif self.prompt_cache is not None:
            self.prompt_cache.store(seq.tokens, self.kv, seq.slot)

    def _clear_free_rows(self) -> None:
        for i, s in enumerate(self.slots):
            if s is None:
                self.kv.lengths[i] = 0

    # -- decode steps on the device (Session.batch_stepper) ----------------------------------------

    def _decode_on_device(self) -> None:
        """One decode step: launched before the step in flight is read while every sequence is
        greedy, else (a sampled sequence runs) after it, and read at once."""
        if not self._active():
            self._drain()
            return
        if not all(self._on_device(seq) for seq in self._active()):
            self._drain()
            if self._active():
                self._finish(self._launch(), sync=True)
            return
        steps = self._steps()
        if self.inflight is not None and (steps > 1 or self.inflight.steps > 1) and self._windows():
            self._drain()       # a penalty window past a step of several: the host must know every token first
        step = self._launch(steps)
        last, self.inflight = self.inflight, step
        if last is not None:
            self._finish(last, sync=False)
        if not self._active():
            self._drain()

    def _steps(self) -> int:
        """Decode steps for the next dispatch: `decode_steps` while no request waits to be admitted
        and every sequence has that many tokens and the cache that many positions left (counting
        the step in flight), else 1."""
        K = self.decode_steps
        if K == 1 or self.waiting or self.filling is not None or not self.queue.empty():
            return 1
        flight = self.inflight.steps if self.inflight is not None else 0
        for seq in self._active():
            if seq.req.max_tokens - seq.n - flight < K:
                return 1
        rows = self._rows()
        return K if int(self.kv.lengths[:rows].max(initial=0)) + K <= self.capacity else 1

    def _windows(self) -> bool:
        """Whether a running sequence's sampling has a repetition penalty's window (the device adds
        to it only the one id of the step before)."""
        return any(seq.req.sampler.settings.window for seq in self._active())

    def _on_device(self, seq: _Seq) -> bool:
        """Whether `seq`'s tokens are chosen on the device (greedy, or a sampling it computes);
        decided once per sequence (its settings do not change), asked several times a step."""
        if seq.on_device is None:
            smp = seq.req.sampler
            seq.on_device = smp.plain_greedy or self.stepper.samples(smp.settings)
        return seq.on_device

    def _device_sampling(self, seqs: list, use_host: np.ndarray, steps: int = 1) -> AheadSampling:
        """batch_step's sampling of the rows `seqs` ((slot, seq) pairs): each request's settings,
        a uniform per step from its own generator (as the host would draw them, in order) and its
        window of the ids seen so far, one short where the step's id is the device's (it adds that one)."""
        B = len(use_host)
        settings: list = [None] * B
        u = np.zeros((steps, B))
        windows = {slot: seq.req.sampler.settings.window for slot, seq in seqs}
        hist = np.full((B, max(windows.values(), default=0)), -1, np.int64)
        for slot, seq in seqs:
            smp = seq.req.sampler
            settings[slot] = smp.settings
            if not smp.greedy:
                u[:, slot] = smp.rng.random(steps)
            take = windows[slot] - (0 if use_host[slot] else 1)
            if take > 0:
                known = (seq.tokens + [seq.last])[-take:]
                hist[slot, hist.shape[1] - len(known):] = known
        return AheadSampling(tuple(settings), u, hist)

    def _drain(self) -> None:
        """Read the step in flight; afterwards every sequence's next id is on the host."""
        step, self.inflight = self.inflight, None
        if step is not None:
            self._finish(step, sync=False)
        self.prev = None

    def _launch(self, steps: int = 1) -> _Step:
        self._clear_free_rows()
        rows = self._rows()
        host = np.zeros(self.max_batch, np.int32)
        use_host = np.ones(self.max_batch, bool)
        seqs = []
        for seq in self._active():
            if self.prev is not None and seq.launched == self.launches - 1:
                use_host[seq.slot] = False      # its id: the token the step in flight chooses
            else:
                host[seq.slot] = seq.last
            seq.launched = self.launches
            seqs.append((seq.slot, seq))
        how = None      # every row greedy, or some sampled on the host (the step read at once)
        if all(self._on_device(seq) for _, seq in seqs) and not all(seq.req.sampler.plain_greedy for _, seq in seqs):
            how = self._device_sampling(seqs, use_host, steps)
        tokens, checked, logits = self.stepper.batch_step(self.kv, rows, host, use_host, self.prev, sampling=how,
                                                          steps=steps)
        self.prev = tokens
        self.stats["steps"] += steps
        self.stats["rows_stepped"] += rows * steps
        self.launches += 1
        return _Step(seqs, tokens, checked, logits, steps)

    def _finish_steps(self, step: _Step, tokens: np.ndarray) -> None:
        """A dispatch of several steps (every row's tokens chosen on the device, tokens [steps,
        max_batch]): each sequence takes its tokens in order while it runs; a step whose logits
        were not finite ends it there (the step's logits are not kept: only the last step's)."""
        logits = None
        for slot, seq in step.seqs:
            for j in range(step.steps):
                if self.slots[slot] is not seq:
                    break           # ended or cancelled: the rest of its row ran past its end
                if tokens[j, slot] >= 0:
                    self._deliver(seq, lambda t=int(tokens[j, slot]): t)
                elif j == step.steps - 1:
                    if logits is None:
                        logits = self.stepper.fetch(step.logits)
                    self._deliver(seq, lambda slot=slot, seq=seq: self._sample(seq, logits[slot:slot + 1]))
                else:
                    self._deliver(seq, lambda seq=seq: self._non_finite(seq))

    def _non_finite(self, seq: _Seq) -> int:
        raise NonFiniteLogits(non_finite_error("NaN or infinite values", self._where(seq)),
                              np.zeros((1, 0), np.float32), np.zeros((1, 0), np.int64))

    def _finish(self, step: _Step, sync: bool) -> None:
        """A launched step's tokens to its sequences (those still in their slots); sync: sampled
        sequences sample from its logits, and the next step takes every id from the host."""
        tokens = self.stepper.fetch(step.checked)
        if step.steps > 1:
            self._finish_steps(step, tokens.reshape(step.steps, -1))
            return
        finite = tokens >= 0
        logits = None
        if sync:
            self.prev = None
            if not all(self._on_device(seq) for _, seq in step.seqs):
                logits = self.stepper.fetch(step.logits)
        if logits is None and not finite.all():     # a row to look at closely (_sample checks it)
            logits = self.stepper.fetch(step.logits)
        for slot, seq in step.seqs:
            if self.slots[slot] is not seq:
                continue            # ended or cancelled since: this row ran past its end
            if self._on_device(seq) and finite[slot]:
                self._deliver(seq, lambda slot=slot: int(tokens[slot]))
            else:       # sampled on the host, or a row to check closely (the host's choice is the device's)
                self._deliver(seq, lambda slot=slot, seq=seq: self._sample(seq, logits[slot:slot + 1]))
