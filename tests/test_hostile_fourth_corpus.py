"""Hostile input, fourth corpus (issue 40, round two): new variants of the classes the earlier
corpora fixed. A Python caller's messages that hold themselves, or a prompt of ids that never ends;
a chat template that spends nearly all of the compile-time check's budget on one conversation and
then refuses it; GGUF tensors that share bytes, token types outside llama.cpp's, NaN scores;
request bodies that name a key twice, ask for logprobs=0 or best_of=0, type include_usage wrongly
or stop sending their bytes; a prompt-cache folder reached through another user's symlink. Each is
one clear error (400/408 on the server), never a hang or silently wrong behaviour."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import pytest

from limits import run_python
from strata_compiler import settings
from strata_compiler.errors import ModelError, UsageError
from strata_compiler.runtime import request_schema as schema

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------
# the Python API: values no JSON body can hold


def test_self_holding_messages_do_not_hang():
    code = ("from strata_compiler.runtime import request_schema as s\n"
            "from strata_compiler.runtime.chat import check_messages\n"
            "l = []; l.append(l); d = {}; d['d'] = d\n"
            "for content in (l, d):\n"
            "    msgs = [{'role': 'user', 'content': content}]; msgs.append(msgs)\n"
            "    assert s.find_surrogate(msgs, 'messages') is None\n"
            "    try:\n"
            "        check_messages(msgs)\n"
            "    except Exception as e:\n"
            "        print(type(e).__name__, e)\n")
    r = run_python(code, cwd=ROOT).check()
    assert r.rc == 0, r.stderr
    assert r.stdout.splitlines() == ["UsageError messages[0].content should be a string, got list",
                                     "UsageError messages[0].content should be a string, got dict"]
    assert schema.find_surrogate([{"a": ["x", "\ud800"]}], "m") == "m[0].a[1]"      # still found where it is


def test_prompt_ids_are_capped_before_they_are_listed():
    code = ("import itertools\nfrom strata_compiler.runtime import request_schema as s\n"
            "for p in (range(10 ** 12), itertools.repeat(1)):\n"
            "    try:\n"
            "        s.prompt_ids(p, 4096, 64)\n"
            "    except s.SchemaError as e:\n"
            "        print(e.field, e)\n")
    r = run_python(code, cwd=ROOT).check()
    assert r.rc == 0 and r.stdout.splitlines() == [
        "prompt prompt: more than 64 token ids, more than the context of 64 holds; shorten it"] * 2, r.stderr
    assert schema.prompt_ids([1, 2], 4096, 2) == [1, 2]


@pytest.fixture(scope="module")
def model(tiny_int8_plan):
    import strata

    with strata.load(tiny_int8_plan, backend="llvm", max_batch=2, ctx=64) as m:
        yield m


def test_api_refuses_self_holding_messages_and_endless_prompts(model):
    msgs: list = [{"role": "user", "content": "hi"}]
    msgs.append(msgs)
    with pytest.raises(UsageError, match=r"messages\[1\] should be an object"):
        model.chat(msgs, max_tokens=2)
    with pytest.raises(UsageError, match="more than 64 token ids"):
        model.generate(range(10 ** 12), max_tokens=2)
    with pytest.raises(UsageError, match="the prompt has 4097 characters"):
        model.generate("x" * (64 * 64 + 1), max_tokens=2)
    assert isinstance(model.generate([1, 2, 3], max_tokens=2, temperature=0), str)


# ------------------------------------------------------------------------------------------------
# chat templates: the compile-time check's conversations share one budget

# spends ~80% of the budget on the system + user conversation, then refuses it (which sends the
# check on to the next conversation), then loops for ever on the user-only one
STALLING = ("{% set t0 = strftime_now('%s%f') | int %}{% if messages[0]['role'] == 'system' %}"
            "{% for i in range(100000) %}{% for j in range(100000) %}"
            "{% if strftime_now('%s%f') | int - t0 > LIMIT %}{{ raise_exception('no system role') }}{% endif %}"
            "{% endfor %}{% endfor %}{% endif %}"
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")


def test_check_conversations_share_one_budget():
    from strata_compiler.frontend.chat import check_renders

    budget = 2.0
    with settings.override(template_timeout=budget, template_memory=256):
        t0 = time.monotonic()
        with pytest.raises(ModelError, match=f"took longer than {budget:g} s in all"):
            check_renders(STALLING.replace("LIMIT", str(int(budget * 0.8e6))), "t.jinja")
        assert time.monotonic() - t0 < budget + 1.5      # was ~1.8 budgets: 5 s each, past 10 s in all


# ------------------------------------------------------------------------------------------------
# GGUF


def _offset_field(raw: bytes, name: str) -> int:
    """Where tensor `name`'s u64 offset lies in the file's tensor directory."""
    nb = name.encode()
    p = raw.index(struct.pack("<Q", len(nb)) + nb) + 8 + len(nb)
    return p + 4 + 8 * struct.unpack_from("<I", raw, p)[0] + 4


@pytest.mark.parametrize("shift", [0, 4096 // 2], ids=["same offset", "half way in"])
def test_gguf_tensors_sharing_bytes_are_refused(tmp_path, shift):
    pytest.importorskip("gguf")
    from test_hostile_gguf import tiny_gguf

    from strata_compiler.frontend.gguf_file import read_gguf

    path = tiny_gguf(tmp_path / "m.gguf")
    read_gguf(path)
    raw = bytearray(path.read_bytes())
    q, k = _offset_field(raw, "blk.0.attn_q.weight"), _offset_field(raw, "blk.0.attn_k.weight")
    struct.pack_into("<Q", raw, k, struct.unpack_from("<Q", raw, q)[0] + shift)
    path.write_bytes(raw)
    with pytest.raises(ModelError, match="tensors blk.0.attn_q.weight and blk.0.attn_k.weight share bytes"):
        read_gguf(path)


@pytest.mark.parametrize("meta, why", [
    ({"tokenizer.ggml.token_type": [99] * 10}, "tokenizer.ggml.token_type item 0 is 99, not a token type"),
    ({"tokenizer.ggml.scores": [float("nan")] * 10}, "tokenizer.ggml.scores item 0 is NaN"),
])
def test_gguf_token_types_and_scores_are_checked(tmp_path, meta, why):
    pytest.importorskip("gguf")
    from test_hostile_gguf import tiny_gguf

    from strata_compiler.frontend.gguf_reader import open_gguf

    with pytest.raises(ModelError, match=why):
        open_gguf(tiny_gguf(tmp_path / "m.gguf", meta=meta))
    open_gguf(tiny_gguf(tmp_path / "ok.gguf", meta={"tokenizer.ggml.scores": [-float("inf")] + [0.0] * 9}))


# ------------------------------------------------------------------------------------------------
# HTTP

pytest.importorskip("fastapi")
from test_hostile_server import AUTH, _alive, _engine, _openai_error, _post, app  # noqa: E402,F401


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "hi", "max_tokens": 1, "prompt": [1]}', "prompt"),
    (b'{"messages": [{"role": "user", "content": "a", "content": "b"}]}', "content"),
])
def test_a_key_named_twice_is_a_400(app, raw, param):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = _post(app, path, raw)
    assert r.status_code == 400 and _openai_error(r)["param"] == param
    assert "twice in one object" in _openai_error(r)["message"]
    _alive(app)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "logprobs": 0}, "logprobs"),
    ({"prompt": "hi", "best_of": 0}, None),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": "no"}}, "stream_options.include_usage"),
])
def test_options_that_would_be_silently_ignored_are_a_400(app, body, param):
    r = _post(app, "/v1/completions", {**body, "max_tokens": 1})
    assert r.status_code == 400 and _openai_error(r)["param"] == param
    ok = _post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": False, "best_of": 1,
                                        "stream_options": {"include_usage": False}})
    assert ok.status_code == 200


@contextlib.contextmanager
def _serving(uvicorn, asgi, **config):
    """`asgi` served by uvicorn on a thread of this process; yields its port, stops it after."""
    from test_server import _free_port

    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(asgi, port=port, log_level="error", lifespan="off", **config))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 10
        while not srv.started and time.monotonic() < deadline:
            time.sleep(0.05)
        yield port
    finally:
        srv.should_exit = True
        th.join(10)


def test_a_body_that_stops_arriving_is_a_408(tiny_int8_plan, monkeypatch):
    uvicorn = pytest.importorskip("uvicorn")
    from strata_compiler.runtime import server

    monkeypatch.setattr(server, "BODY_IDLE_S", 1.0)
    engine = _engine(tiny_int8_plan)
    try:
        with _serving(uvicorn, server.make_app(engine, api_key="k")) as port:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
                t0 = time.monotonic()
                answer = s.recv(4096)
                assert time.monotonic() - t0 < 5
                while b"}}" not in answer and time.monotonic() - t0 < 5:
                    answer += s.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"the request body stopped arriving" in answer
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:     # a whole body is served
                body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nConnection: close\r\n"
                          b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
                assert s.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        engine.shutdown()


# ------------------------------------------------------------------------------------------------
# the prompt-cache folder


def test_a_cache_folder_reached_through_another_users_symlink_is_refused(tmp_path, monkeypatch):
    import hashlib
    import os

    import numpy as np

    from strata_compiler.runtime import prompt_cache
    from strata_compiler.runtime.prompt_cache import PromptCache

    plan = hashlib.sha256(b"a plan.bin").hexdigest()
    ours = tmp_path / "ours"            # a folder of ours, mode 700, that the link's owner points at
    PromptCache(1 << 20, plan, ours, shape=(2, 2, 4))
    link = tmp_path / "kv"
    link.symlink_to(ours)
    real_lstat = os.lstat

    def lstat(path, *a, **kw):           # the link as another user's (tests may run as root)
        st = real_lstat(path, *a, **kw)
        if os.fspath(path) == os.fspath(link):
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, os.geteuid() + 1, *st[5:]))
        return st

    monkeypatch.setattr(prompt_cache.os, "lstat", lstat)
    with pytest.raises(UsageError, match="it is a symbolic link owned by uid .*give the folder itself"):
        PromptCache(1 << 20, plan, link, shape=(2, 2, 4))
    monkeypatch.undo()
    pc = PromptCache(1 << 20, plan, link, shape=(2, 2, 4))     # our own link is followed, as before

    class Cache:
        k = [np.ones((1, 2, 16, 4), np.float32)] * 2
        v = [np.ones((1, 2, 16, 4), np.float32)] * 2
        lengths = np.array([16])

    pc.store(np.arange(16), Cache(), 0)
    assert pc.save() == 1
    assert sorted(p.suffix for p in ours.iterdir()) == [".key", ".kv"]     # hmac.key and the entry, no temp left
    assert len(PromptCache(1 << 20, plan, ours, shape=(2, 2, 4)).entries) == 1


def test_a_request_head_that_never_completes_is_closed(tiny_int8_plan, monkeypatch):
    """Slowloris: a connection that sends nothing, or a request line and headers a byte at a time,
    is closed HEAD_S after it started (uvicorn alone kept both for ever); a whole request on a
    kept-alive connection is still served, and so is its next one."""
    uvicorn = pytest.importorskip("uvicorn")
    from strata_compiler.runtime import http_protocol, server

    monkeypatch.setattr(http_protocol, "HEAD_S", 1.0)
    engine = _engine(tiny_int8_plan)
    with _serving(uvicorn, server.make_app(engine, api_key="k"), http=http_protocol.HeadDeadlineProtocol) as port:
        silent = socket.create_connection(("127.0.0.1", port), timeout=10)
        slow = socket.create_connection(("127.0.0.1", port), timeout=10)
        t0 = time.monotonic()
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        for s in (silent, slow):
            assert s.recv(4096) == b""          # closed by the server, nothing answered
        assert time.monotonic() - t0 < 5
        silent.close()
        slow.close()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:     # keep-alive: two requests
            for _ in range(2):
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = s.recv(4096)
                while not answer.endswith(b"}"):     # the head and the body may come in two segments
                    more = s.recv(4096)
                    assert more, answer
                    answer += more
                assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
                time.sleep(1.5)                 # longer than HEAD_S between requests: the idle wait is keep-alive's
