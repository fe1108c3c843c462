"""`strata-run PLAN --chat`: an interactive chat in the terminal on the server's machinery.

The plan's chat template renders the whole conversation each turn (runtime/chat.py); the KV cache
is kept across turns: when the ids already in the cache are a prefix of the new rendering's ids,
only the suffix is prefilled, else the cache is reset and everything is prefilled. The answer comes
from Session.extend (strata-run's decode loop, decoding ahead where the executor can), each token
printed as `TextStream` releases it (never half a UTF-8 character). Ctrl-C stops the current answer; at the prompt a second Ctrl-C,
EOF (Ctrl-D) or /exit ends the chat; /reset starts the conversation over. When the conversation
and an answer of -n tokens no longer fit the context, one line says so and the conversation
starts over from the system prompt and the new message.
"""

from __future__ import annotations

import sys
from typing import TextIO

import numpy as np

from strata_compiler.errors import UsageError

from .chat import render_chat, stop_ids
from .sampler import Sampler
from .scheduler import TextStream
from .session import default_ctx

HELP = "/reset starts over, /exit (or Ctrl-D) quits; Ctrl-C stops an answer"


class Chat:
    """A conversation bound to a Session: `turn(text)` prints the answer as it is made and returns it."""

    def __init__(self, session, tokenizer, sampler: Sampler, max_new_tokens: int, ctx: int,
                 system: str | None = None, out: TextIO | None = None, ignore_eos: bool = False):
        self.session, self.tok, self.sampler = session, tokenizer, sampler
        self.max_new, self.ctx, self.system = max_new_tokens, ctx, system
        self.out = out if out is not None else sys.stdout
        self.stop = () if ignore_eos else stop_ids(session.plan)
        self.prefilled: list[int] = []      # tokens prefilled per turn (the suffix when the KV is reused)
        self.fed: list[int] | None = None   # the ids in the session's cache; None: untrusted, reset
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the cache is reset at the next turn's prefill)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _ids(self, messages: list[dict]) -> list[int]:
        return self.tok.encode(render_chat(self.session.plan, messages, add_generation_prompt=True)).ids

    def _suffix(self, ids: list[int]) -> list[int]:
        """The ids the cache lacks: after what it holds when that is a prefix of them, else all of
        them in a cache started over."""
        s, fed = self.session, self.fed
        if fed is not None and 0 < len(fed) < len(ids) and ids[: len(fed)] == fed \
                and s.cache is not None and s.cache.length == len(fed):
            suffix = ids[len(fed):]
        else:                               # not a prefix (or nothing kept): start the cache over
            s.reset(1, -(-self.ctx // 64) * 64)
            suffix = ids
        self.prefilled.append(len(suffix))
        self.fed = None                     # untrusted until the answer is complete
        return suffix

    def _answer(self, ids: list[int], emit) -> None:
        """Decode the answer to the rendered conversation `ids`, each token to emit(token) -> bool
        (True: a stop token, the end); the cache then holds ids and every token but the last."""
        shown, ended = [], [False]

        def show(tok: int) -> None:
            shown.append(tok)
            ended[0] = ended[0] or emit(tok)

        def on_token(_i: int, tok: np.ndarray) -> bool:
            if not ended[0]:
                show(int(tok[0]))
            return False
        new = self.session.extend(np.asarray(self._suffix(ids), np.int64)[None], self.max_new, self.sampler,
                                  self.stop, history=np.asarray(ids, np.int64)[None], on_token=on_token)
        toks = new[0].tolist()
        for tok in toks[len(shown):]:
            if ended[0]:
                break
            show(tok)
        fed, cache = ids + toks[:-1], self.session.cache
        if cache.length >= len(fed):    # steps decoded ahead past the end (a stop inside a chunk): not kept
            cache.length = len(fed)
            self.fed = fed
        else:
            self.fed = None

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()

    def turn(self, text: str) -> str:
        """One user message: the answer (streamed to `out`, then a newline); '' when it cannot run."""
        msgs = self.messages + [{"role": "user", "content": text}]
        ids = self._ids(msgs)
        if len(ids) + self.max_new > self.ctx:
            fresh = self.messages[:1] if self.system else []
            ids2 = self._ids(fresh + msgs[-1:])
            if len(ids2) + self.max_new > self.ctx:
                self._write(f"[this message is {len(ids2)} tokens with the template; with -n {self.max_new} it "
                            f"does not fit the context of {self.ctx}; not sent]\n")
                return ""
            self._write(f"[the conversation no longer fits the context of {self.ctx} tokens; starting over]\n")
            msgs, ids = fresh + msgs[-1:], ids2
        self.messages = msgs
        stream = TextStream(self.tok, ids)
        answer = ""

        def emit(tok: int) -> bool:
            nonlocal answer
            if tok in self.stop:
                return True
            piece = stream.push(tok)
            answer += piece
            self._write(piece)
            return False
        try:
            self._answer(ids, emit)
            piece = stream.flush()
        except KeyboardInterrupt:
            piece = stream.flush() if not stream.stopped else ""
            piece += " [stopped]"
        answer += piece.removesuffix(" [stopped]")
        self._write(piece + "\n")
        self.messages = msgs + [{"role": "assistant", "content": answer}]
        return answer


def _read(inp: TextIO, out: TextIO, prompt: str) -> str | None:
    """One line of input (None at EOF); a terminal gets readline editing through input()."""
    if inp is sys.stdin and inp.isatty() and out is sys.stdout:
        try:
            return input(prompt)
        except EOFError:
            return None
    out.write(prompt)
    out.flush()
    line = inp.readline()
    return None if line == "" else line.rstrip("\n")


def run_chat(chat: Chat, inp: TextIO | None = None, out: TextIO | None = None) -> None:
    """The loop: read a line, answer it, until EOF, /exit or a second Ctrl-C at the prompt."""
    inp = inp if inp is not None else sys.stdin
    out = out if out is not None else chat.out
    if inp.isatty():
        out.write(f"[chat: {HELP}; sampling: {chat.sampler.settings.describe()}]\n")
    interrupted = False
    while True:
        try:
            line = _read(inp, out, "> ")
        except KeyboardInterrupt:
            if interrupted:
                out.write("\n")
                return
            interrupted = True
            out.write("\n[Ctrl-C again, /exit or Ctrl-D to quit]\n")
            continue
        interrupted = False
        if line is None:
            out.write("\n" if inp.isatty() else "")
            return
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            return
        if cmd == "/reset":
            chat.reset()
            out.write("[conversation cleared]\n")
            continue
        if cmd in ("/help", "/?"):
            out.write(f"[{HELP}]\n")
            continue
        if not cmd:
            continue
        try:
            chat.turn(line)
        except UsageError as e:     # e.g. a template that fails on this conversation: one line, go on
            out.write(f"[error: {e}]\n")


def start_chat(plan, session, tokenizer, sampler: Sampler, max_new_tokens: int, system: str | None,
               ignore_eos: bool, ctx: int | None = None) -> None:
    """strata-run --chat: check what a chat needs, then run the loop on stdin/stdout."""
    from .chat import NO_TEMPLATE, has_template

    if tokenizer is None:
        raise UsageError(f"{plan.path}: --chat needs the plan's tokenizer (the model folder had no tokenizer.json)")
    if not has_template(plan):
        raise UsageError(NO_TEMPLATE.split(", or send")[0])
    if ctx is None:
        ctx = default_ctx(plan, 1, session.executor.kv_room())
    if max_new_tokens < 1 or max_new_tokens >= ctx:
        raise UsageError(f"-n {max_new_tokens}: a chat answer needs between 1 and {ctx - 1} tokens "
                         f"(the context is {ctx})")
    run_chat(Chat(session, tokenizer, sampler, max_new_tokens, ctx, system, ignore_eos=ignore_eos))
