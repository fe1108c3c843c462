"""strata-server: a real server in a subprocess on the tiny trained MoE (int8, llvm backend).

One server process serves every test (started once per module, with --api-key); the last test
sends it SIGTERM. Greedy completions must give the text of a plain greedy Session.generate run, and
a request that names no sampling field the text of a run sampled with the plan's defaults.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "models" / "tiny-moe"
KEY = "sk-test-strata"
PROMPT = "The Python"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def plan_dir(tiny_int8_plan) -> Path:
    return tiny_int8_plan


def _wait_ready(proc, base: str, log: Path) -> None:
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "the server never became ready"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(plan_dir, tmp_path_factory):
    port = _free_port()
    cfg = tmp_path_factory.mktemp("cfg") / "server.toml"
    cfg.write_text(f'port = {port}\nbackend = "llvm"\nctx = 1024\n"api-key" = "wrong"\n')
    log = tmp_path_factory.mktemp("log") / "stderr.txt"
    err = open(log, "w")
    # the config file sets the port, backend and context; the flag overrides its api-key
    proc = subprocess.Popen([sys.executable, "-c", "from strata_compiler.runtime.server_cli import main; main()",
                             str(plan_dir), "--config", str(cfg), "--api-key", KEY, "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=err)
    base = f"http://127.0.0.1:{port}"
    _wait_ready(proc, base, log)
    yield proc, base, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    err.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(plan_dir):
    """The greedy text a plain run gives: Session.generate, as strata-run does."""
    from tokenizers import Tokenizer

    from strata_compiler.runtime.chat import stop_ids
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.runtime.session import Session

    plan = load_plan(plan_dir)
    tok = Tokenizer.from_str(plan.tokenizer_json.decode())

    def run(ids: list[int], n: int, stop=None, sampler=None) -> str:
        s = Session(plan, "llvm")
        eos = tuple(stop_ids(plan)) if stop is None else stop
        _, new = s.generate(np.array([ids], np.int64), n, sampler or Sampler(0.0), eos)
        return tok.decode(ids + new[0].tolist())[len(tok.decode(ids)):]

    return plan, tok, run


def _assert_alive(base: str) -> None:
    assert httpx.get(base + "/health", timeout=5).json() == {"status": "ok"}


def test_completion_matches_plain_run(client, reference):
    plan, tok, run = reference
    want = run(tok.encode(PROMPT).ids, 8)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text == want and want
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(tok.encode(PROMPT).ids) and 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    models = client.models.list()
    assert len(models.data) == 1 and models.data[0].id


def test_streaming_matches_and_ends_with_done(server, client, reference):
    plan, tok, run = reference
    want = run(tok.encode(PROMPT).ids, 8)
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
    parts = [c.choices[0].text for c in stream]
    assert "".join(parts) == want and len(parts) > 1
    with httpx.stream("POST", server[1] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert last["usage"]["completion_tokens"] <= 4 and last["choices"] == []


def test_stop_string(client, reference):
    plan, tok, run = reference
    full = run(tok.encode(PROMPT).ids, 8)
    stop = full.split()[1]          # a word in the middle of the greedy text
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    parts = [c.choices[0].text for c in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                                                  temperature=0, stop=stop, stream=True)]
    assert "".join(parts) == r.choices[0].text


def test_sampling_extensions(client, reference):
    """vLLM's top_k / min_p / repetition_penalty: a penalty of 1 is plain greedy; a strong one changes it."""
    plan, tok, run = reference
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    plain = client.completions.create(**kw, extra_body={"top_k": 3, "min_p": 0.1, "repetition_penalty": 1.0})
    assert plain.choices[0].text == run(tok.encode(PROMPT).ids, 8)
    sampled = client.completions.create(**{**kw, "temperature": 0.7, "seed": 1},
                                        extra_body={"top_k": 3, "min_p": 0.1, "repetition_penalty": 1.2})
    assert sampled.usage.completion_tokens == 8 or sampled.choices[0].finish_reason == "stop"


def test_omitted_fields_sample_with_the_plans_defaults(client, reference):
    from strata_compiler.runtime.sampler import Sampler, plan_sampling
    from strata_compiler.sampling import DEFAULTS

    plan, tok, run = reference
    assert plan_sampling(plan.meta) == DEFAULTS
    want = run(tok.encode(PROMPT).ids, 12, sampler=Sampler.of(DEFAULTS, seed=5))
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, seed=5)
    assert r.choices[0].text == want and want != run(tok.encode(PROMPT).ids, 12)
    # a field given replaces its default only: top_k 1 leaves one token, whatever the rest
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, seed=5, extra_body={"top_k": 1,
                                                                                                  "repetition_penalty": 1})
    assert r.choices[0].text == run(tok.encode(PROMPT).ids, 12)


@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "n": 2}, "n"),
    ({"prompt": PROMPT, "max_tokens": -5}, "max_tokens"),
    ({"prompt": PROMPT, "seed": -1}, "seed"),
    ({"prompt": PROMPT, "repeat_last_n": -2}, "repeat_last_n"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "max_tokens": 10_000}, "max_tokens"),
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "bogus_field": 1}, "bogus_field"),
    ({"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": PROMPT, "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": PROMPT, "min_p": 1.5}, "min_p"),
    ({"prompt": [1, 2, 10**9]}, "prompt"),
    ({"max_tokens": 4}, "prompt"),
    ("{not json", None),
])
def test_bad_requests_are_one_400(server, body, param):
    base = server[1]
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}",
                                                      "Content-Type": "application/json"}, timeout=30, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and "needs -" not in err["message"]
    if param:
        assert err["param"] and err["param"].startswith(param)
    _assert_alive(base)


def test_openai_client_sees_400(client, server):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=2)
    _assert_alive(server[1])


def test_api_key_required(server):
    base = server[1]
    for headers in ({}, {"Authorization": "Bearer nope"}):
        r = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(base + "/v1/models", headers=headers).status_code == 401
    _assert_alive(base)


def test_disconnect_cancels_the_sequence(server, client, reference):
    base, auth = server[1], {"Authorization": f"Bearer {KEY}"}
    before = httpx.get(base + "/stats", headers=auth).json()
    with httpx.stream("POST", base + "/v1/completions", headers=auth, timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line:
                break           # one chunk, then hang up
    deadline = time.time() + 10
    while (now := httpx.get(base + "/stats", headers=auth).json())["cancelled"] == before["cancelled"]:
        assert time.time() < deadline, "the sequence was not cancelled"
        time.sleep(0.05)
    assert now["completion_tokens"] - before["completion_tokens"] < 1000
    # a whole answer (1000 tokens, past any EOS: ~0.25 s on a fast, idle host, ~1 s here), and a client that
    # stops waiting for it once the server has surely taken the request (a client gone before that leaves
    # no sequence to cancel)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/completions", headers=auth, timeout=httpx.Timeout(5.0, read=0.15),
                   json={"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True})
    while httpx.get(base + "/stats", headers=auth).json()["cancelled"] == now["cancelled"]:
        assert time.time() < deadline + 10, "the sequence was not cancelled"
        time.sleep(0.05)
    # the next request is served at once, and gets its full answer
    plan, tok, run = reference
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text == run(tok.encode(PROMPT).ids, 8)


PROMPTS = ["The Python", "Once upon a time", "def main():", "import numpy as np", "Hello world",
           "In the beginning", "A list is", "class Foo:"]


def test_concurrent_requests_get_their_tokens_alone(server, client, reference):
    """8 greedy requests at once (the server's 8 slots) each get the text they get alone."""
    import concurrent.futures as cf

    plan, tok, run = reference
    want = [run(tok.encode(p).ids, 16) for p in PROMPTS]
    base, auth = server[1], {"Authorization": f"Bearer {KEY}"}
    before = httpx.get(base + "/stats", headers=auth).json()

    def one(p: str) -> str:
        return client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text

    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, PROMPTS))
    assert got == want and all(want)
    now = httpx.get(base + "/stats", headers=auth).json()
    assert now["rows_stepped"] - before["rows_stepped"] > now["steps"] - before["steps"]   # steps of several rows


def test_prompt_cache_serves_a_shared_system_prompt(server, client):
    base, auth = server[1], {"Authorization": f"Bearer {KEY}"}
    system = {"role": "system", "content": "You are a careful assistant who answers questions about Python code."}
    client.chat.completions.create(model="tiny", messages=[system, {"role": "user", "content": "What is a list?"}],
                                   max_tokens=4, temperature=0)
    before = httpx.get(base + "/stats", headers=auth).json()["prompt_cache_tokens"]
    client.chat.completions.create(model="tiny", messages=[system, {"role": "user", "content": "What is a dict?"}],
                                   max_tokens=4, temperature=0)
    assert httpx.get(base + "/stats", headers=auth).json()["prompt_cache_tokens"] - before >= 16


def test_seeded_sampling_repeats(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.95)
    a, b = (client.completions.create(seed=7, **kw).choices[0].text for _ in range(2))
    assert a == b and a


def test_text_stream_holds_back_partial_text(reference):
    from strata_compiler.runtime.scheduler import TextStream

    plan, tok, run = reference
    ids = tok.encode("naïve 東京").ids
    ts = TextStream(tok, [], ("東京x",))       # "東京" may begin the stop string: held back
    parts = [ts.push(i) for i in ids]
    assert all("\ufffd" not in p for p in parts)
    assert "".join(parts) == "naïve " and ts.flush() == "東京"
    ids = tok.encode("naïve 東京 café").ids
    ts = TextStream(tok, [], ("café",))
    assert "".join(ts.push(i) for i in ids) == "naïve 東京 " and ts.stopped and ts.flush() == ""
    ts = TextStream(tok, [], ())
    assert "".join(ts.push(i) for i in ids) + ts.flush() == tok.decode(ids)


def test_queue_full_is_429(reference):
    from fastapi.testclient import TestClient

    from strata_compiler.runtime.scheduler import QueueFull
    from strata_compiler.runtime.server import make_app

    plan, tok, run = reference

    class Full:
        ctx, tokenizer, warm_error, stats, max_batch = 64, tok, None, {}, 1
        ready = __import__("threading").Event()

        def __init__(self):
            self.plan = plan

        def submit(self, req):
            raise QueueFull("64 requests are already waiting")

    c = TestClient(make_app(Full()))
    assert c.get("/health").status_code == 503
    r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"


def test_a_prompt_that_fills_the_context_names_no_negative_count(reference):
    """Before: `the prompt has 9 and max_tokens is -5` for a chat without max_tokens."""
    from fastapi.testclient import TestClient

    from strata_compiler.runtime.server import make_app

    plan, tok, run = reference
    prompt = "one two three four five six seven eight nine ten"

    class Small:
        ctx, tokenizer, warm_error, stats, max_batch = 4, tok, None, {}, 1
        ready = __import__("threading").Event()

        def __init__(self):
            self.plan = plan

    c = TestClient(make_app(Small()))
    r = c.post("/v1/completions", json={"prompt": prompt})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    n = len(tok.encode(prompt).ids)
    assert err["message"] == (f"the prompt has {n} tokens: this model's context of 4 tokens leaves no room for an "
                              f"answer; shorten it")
    r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
    assert "give 2 or less" in r.json()["error"]["message"] and "-" not in r.json()["error"]["message"]


def test_chat(client, reference):
    plan, tok, run = reference
    chat = pytest.importorskip("strata_compiler.runtime.chat")
    if not chat.has_template(plan):
        pytest.skip("the tiny model's plan has no chat template")
    msgs = [{"role": "user", "content": "What is a list?"}]
    ids = tok.encode(chat.render_chat(plan, msgs)).ids
    want = run(ids, 8, tuple(chat.stop_ids(plan)))
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    parts = [c.choices[0].delta.content or "" for c in
             client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True)]
    assert "".join(parts) == want
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": 3}], max_tokens=4)


def test_sigterm_exits_cleanly(server):
    proc, base, log = server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert "Traceback" not in log.read_text()


def _spawn(plan_dir, args: list[str], log: Path):
    """A server on a free port with `args`; (process, base url) once /health says ok."""
    port = _free_port()
    err = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-c", "from strata_compiler.runtime.server_cli import main; main()",
                             str(plan_dir), "--port", str(port), "--backend", "llvm", "--ctx", "1024",
                             "--log-level", "warning", *args], stdout=subprocess.DEVNULL, stderr=err)
    err.close()
    base = f"http://127.0.0.1:{port}"
    _wait_ready(proc, base, log)
    return proc, base


def test_one_slot_freed_by_a_cancel_and_the_prompt_cache_kept(plan_dir, tmp_path):
    """--max-batch 1: a stream that hangs up frees the only slot and the waiting request runs at
    once; --kv-cache-dir: the prompt cache is written at shutdown and read by the next server."""
    import threading

    kv = tmp_path / "kv"
    # the reference backend: 1000 tokens take seconds there, so the stream is still running when its
    # client hangs up (llvm makes them in a fraction of the wait below)
    proc, base = _spawn(plan_dir, ["--max-batch", "1", "--kv-cache-dir", str(kv), "--backend", "reference"],
                        tmp_path / "a.txt")
    try:
        body = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True, "ignore_eos": True}
        started, hang_up, done = threading.Event(), threading.Event(), {}

        def long_stream():          # reads until told to hang up (leaving the loop closes the connection)
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    started.set()
                    if hang_up.is_set():
                        break

        a = threading.Thread(target=long_stream)
        a.start()
        assert started.wait(30)
        b = threading.Thread(target=lambda: done.setdefault("r", httpx.post(
            base + "/v1/completions", json={"prompt": "Hello world", "max_tokens": 4, "temperature": 0}, timeout=60)))
        b.start()
        time.sleep(0.2)
        assert "r" not in done and a.is_alive()      # the only slot is the long stream's: the request waits
        hang_up.set()
        t0 = time.time()
        b.join(30)
        assert done["r"].status_code == 200 and time.time() - t0 < 10
        a.join(30)
        stats = httpx.get(base + "/stats").json()
        assert stats["cancelled"] == 1 and stats["completion_tokens"] < 1000
        httpx.post(base + "/v1/completions", timeout=60,
                   json={"prompt": "The Python language is a language that people use for", "max_tokens": 4})
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert list(kv.glob("*.kv"))
    proc, base = _spawn(plan_dir, ["--kv-cache-dir", str(kv)], tmp_path / "b.txt")
    try:
        httpx.post(base + "/v1/completions", timeout=60,
                   json={"prompt": "The Python language is a language that people use for", "max_tokens": 4})
        assert httpx.get(base + "/stats").json()["prompt_cache_tokens"] >= 8
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert "Traceback" not in (tmp_path / "a.txt").read_text() + (tmp_path / "b.txt").read_text()


def test_cli_errors_are_one_line(plan_dir, tmp_path, capsys):
    from strata_compiler.cli_common import run_cli
    from strata_compiler.runtime.server_cli import strata_server

    bad = tmp_path / "bad.toml"
    bad.write_text("bogus = 1\n")
    broken = tmp_path / "broken.toml"
    broken.write_text("port = \n")
    for argv, needle in (([str(tmp_path / "nope")], "no such file"),
                         ([str(plan_dir), "--config", str(bad)], "unknown key(s) bogus"),
                         ([str(plan_dir), "--config", str(broken)], "not valid TOML"),
                         ([str(plan_dir), "--ctx", "5000"], "--ctx 5000")):
        assert run_cli(strata_server, argv) != 0
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err
