"""strata-run --chat on the tiny trained MoE (int8, llvm): the answers are those of a plain greedy
Session.generate on the rendered conversation; a later turn prefills only its new tokens; /reset,
EOF, /exit, the context limit and Ctrl-C during an answer behave as the chat promises."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from strata_compiler.runtime.chat import render_chat, stop_ids
from strata_compiler.runtime.chat_cli import Chat, run_chat
from strata_compiler.runtime.cli import strata_run
from strata_compiler.runtime.plan import load_plan
from strata_compiler.runtime.sampler import Sampler
from strata_compiler.runtime.session import Session

pytest.importorskip("jinja2")
ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "models" / "tiny-moe"
N = 24


@pytest.fixture(scope="module")
def plan_dir(tiny_int8_plan) -> Path:
    return tiny_int8_plan


@pytest.fixture(scope="module")
def env(plan_dir):
    from tokenizers import Tokenizer

    plan = load_plan(plan_dir)
    tok = Tokenizer.from_str(plan.tokenizer_json.decode())
    return plan, tok, Session(plan, "llvm")


def _reference(env, messages, n=N) -> str:
    """A fresh full prefill of the whole conversation, greedy, as strata-run does."""
    plan, tok, _ = env
    ids = tok.encode(render_chat(plan, messages)).ids
    _, new = Session(plan, "llvm").generate(np.array([ids], np.int64), n, Sampler(), stop_ids(plan))
    toks = [t for t in new[0].tolist() if t not in stop_ids(plan)]
    return tok.decode(ids + toks)[len(tok.decode(ids)):]


def _chat(env, **kw) -> tuple[Chat, io.StringIO]:
    plan, tok, session = env
    out = io.StringIO()
    kw.setdefault("ctx", 1024)
    return Chat(session, tok, Sampler(), N, out=out, **kw), out


def test_turns_reuse_the_kv_and_match_a_fresh_prefill(env):
    plan, tok, session = env
    chat, out = _chat(env)
    a1 = chat.turn("The keeper climbed the tower")
    assert a1 and a1 == _reference(env, [{"role": "user", "content": "The keeper climbed the tower"}])
    assert out.getvalue() == a1 + "\n"
    fed = len(chat.fed)
    a2 = chat.turn("What did he see?")
    conv = chat.messages
    assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant"]
    full = tok.encode(render_chat(plan, conv[:3])).ids
    assert chat.prefilled == [chat.prefilled[0], len(full) - fed]     # the second turn: only the suffix
    assert 0 < chat.prefilled[1] < len(full) // 2
    assert a2 == _reference(env, conv[:3])
    assert session.cache.length == len(chat.fed)


def test_system_reset_exit_and_context(env):
    chat, out = _chat(env, system="You are terse.")
    run_chat(chat, io.StringIO("hello\n/reset\nhello\n/exit\nnever read\n"), out)
    text = out.getvalue()
    assert "[conversation cleared]" in text and "never read" not in text
    first, second = text.split("[conversation cleared]\n")
    assert first == second                                      # the same answer after /reset
    assert chat.prefilled[1] == chat.prefilled[0]                # /reset: a full prefill again
    assert chat.messages[0] == {"role": "system", "content": "You are terse."}
    ref = _reference(env, [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}])
    assert first == "> " + ref + "\n> "
    # a context that holds one turn but not two: one line, then the conversation starts over
    small, out2 = _chat(env, ctx=len(chat.fed) + N + 4)
    small.turn("hello")
    small.turn("hello")
    assert "no longer fits the context" in out2.getvalue()
    assert len(small.messages) == 2 and small.prefilled[1] == small.prefilled[0]   # all of it again


def test_ctrl_c_stops_the_answer_not_the_chat(env, monkeypatch):
    plan, tok, session = env
    chat, out = _chat(env)
    real, calls = Session.step, []

    def step(self, ids, last_only=False):
        calls.append(ids.shape[1])
        if ids.shape[1] == 1 and calls.count(1) == 3 and len(calls) < 10:   # the 3rd decode step of turn 1
            raise KeyboardInterrupt
        return real(self, ids, last_only)

    monkeypatch.setattr(Session, "step", step)
    run_chat(chat, io.StringIO("The keeper climbed the tower\nWhat did he see?\n"), out)
    text = out.getvalue()
    first, rest = text.split(" [stopped]\n")
    full = _reference(env, [{"role": "user", "content": "The keeper climbed the tower"}])
    assert full.startswith(first.removeprefix("> ")) and len(first) > 2
    assert rest.startswith("> ") and len(rest) > 4 and rest.endswith("\n> ")      # answered, then EOF
    # the interrupted step left the cache untrusted: the second turn prefilled the whole conversation
    conv = chat.messages
    assert chat.prefilled[1] == len(tok.encode(render_chat(plan, conv[:3])).ids)
    assert conv[1]["content"] == first.removeprefix("> ")
    monkeypatch.setattr(Session, "step", real)
    assert conv[3]["content"] == _reference(env, conv[:3])


def test_strata_run_chat_exits_0_at_eof(plan_dir, env):
    r = CliRunner().invoke(strata_run, [str(plan_dir), "--chat", "--backend", "llvm", "-n", str(N), "--greedy",
                                        "--system", "You are terse."], input="hello\n")
    assert r.exit_code == 0, r.output
    ref = _reference(env, [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}])
    assert r.output == "> " + ref + "\n> "
    r = CliRunner().invoke(strata_run, [str(plan_dir), "--chat", "--prompt", "x"])
    assert r.exit_code != 0 and "--chat" in str(r.exception)
    # the real entry point in a process of its own: EOF (Ctrl-D) ends it with status 0, no traceback
    p = subprocess.run([sys.executable, "-c", "from strata_compiler.runtime.cli import main; main()", str(plan_dir),
                        "--chat", "--backend", "llvm", "-n", "4"], input="hello\n", capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stdout.startswith("> ") and p.stdout.endswith("\n> ")


def test_chat_decodes_ahead_where_the_executor_can(plan_dir):
    """On the xla backend (JAX's CPU here) a chat answer goes through the executor's decode_ahead,
    as strata-run's generation does: the same answer as a fresh greedy generate there, and a second
    turn still reuses the cache (which then holds the conversation and all but the answer's last
    token)."""
    pytest.importorskip("jax")
    from tokenizers import Tokenizer

    plan = load_plan(plan_dir)
    tok = Tokenizer.from_str(plan.tokenizer_json.decode())
    session = Session(plan, "xla", device="cpu")
    calls = []
    real = session.executor.decode_ahead
    session.executor.decode_ahead = lambda *a, **kw: calls.append(a[2]) or real(*a, **kw)
    chat = Chat(session, tok, Sampler(), N, ctx=1024, out=io.StringIO())
    msgs = [{"role": "user", "content": "The keeper climbed the tower"}]
    answer = chat.turn(msgs[0]["content"])
    assert calls, "the answer did not decode ahead"
    ids = tok.encode(render_chat(plan, msgs)).ids
    _, new = Session(plan, "xla", device="cpu").generate(np.array([ids], np.int64), N, Sampler(), stop_ids(plan))
    toks = [t for t in new[0].tolist() if t not in stop_ids(plan)]
    assert answer == tok.decode(ids + toks)[len(tok.decode(ids)):]
    chat.turn("What did he see?")
    assert chat.fed is not None and session.cache.length == len(chat.fed) and 0 < chat.prefilled[1] < len(chat.fed)
    # an answer that stops with a step decoded ahead past it: that step is dropped, the cache kept
    conv = tok.encode(render_chat(plan, chat.messages + [{"role": "user", "content": "And then?"}])).ids
    _, ref = Session(plan, "xla", device="cpu").generate(np.array([conv], np.int64), 2 * N, Sampler())
    ref = ref[0].tolist()
    at = next(i for i in range(10, len(ref)) if ref[i] not in ref[:i])     # a token first made at step >= 10
    chat.stop, chat.max_new = (ref[at], *chat.stop), 2 * N
    calls.clear()
    chat.turn("And then?")
    assert calls and chat.fed is not None and session.cache.length == len(chat.fed)
    n = chat.prefilled[2]
    chat.turn("Why?")
    assert chat.prefilled[3] < len(chat.fed) and n > 0             # the fourth turn reused the cache too
