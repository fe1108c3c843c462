"""Continuous batching (runtime/batching.py), in process on the tiny MoE (f32): sequences decoded
together get the tokens they get alone, prompts prefilled in chunks give the same text, a
cancelled sequence frees its slot for the next request, the prompt cache is used."""

from __future__ import annotations

import threading
import time

import pytest

from strata_compiler.runtime.batching import BatchScheduler
from strata_compiler.runtime.plan import load_plan
from strata_compiler.runtime.prompt_cache import PromptCache
from strata_compiler.runtime.sampler import Sampler
from strata_compiler.runtime.scheduler import Request
from strata_compiler.runtime.session import Session

tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["The Python language", "Once upon a time there was", "def main():", "import numpy as np\n",
         "Hello", "In the beginning of the", "A list is", "class Foo:"]


class _Req(Request):
    """A request whose events land in a list (no event loop)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.got, self.fin = [], threading.Event()

    def emit(self, *event):
        self.got.append(event)
        if event[0] in ("done", "error"):
            self.fin.set()

    def text(self) -> str:
        assert self.fin.wait(60), "no answer within 60 s"
        return "".join(e[1] for e in self.got if e[0] == "text")


@pytest.fixture(scope="module")
def plan(tiny_f32_plan):
    return load_plan(tiny_f32_plan)


@pytest.fixture(scope="module")
def tok(plan):
    return tokenizers.Tokenizer.from_str(plan.tokenizer_json.decode())


@pytest.fixture(scope="module")
def mixed_plan(tmp_path_factory):
    """The tiny MoE with its experts on the CPU (llvm) and the rest on "the GPU" (xla on JAX's CPU)."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path_factory.mktemp("tiny_mixed")
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", "from strata_compiler.cli import main; main()", "compile",
                    str(root / "examples" / "models" / "tiny-moe"), "-o", str(out), "--quant", "f32",
                    "--place", "experts=cpu,all=gpu"], check=True, capture_output=True, timeout=300)
    return load_plan(out)


def _scheduler(plan, tok, backend, **kw) -> BatchScheduler:
    session = Session(plan, "auto", device="cpu") if backend.startswith("mixed") else Session(plan, backend)
    if backend == "mixed-streamed":     # long prefills run the CPU experts on "the GPU" (JAX's CPU here)
        session.executor.stream_ok = True
    s = BatchScheduler(session, tok, 256, **kw)
    s.start(warm=True)
    assert s.ready.wait(120) and s.warm_error is None
    return s


def _req(tok, text, n=12, **kw) -> _Req:
    return _Req(prompt=tok.encode(text).ids, max_tokens=n, sampler=Sampler(**kw))


@pytest.mark.parametrize("backend", ["reference", "llvm", "xla"])
def test_batched_sequences_get_their_tokens_alone(plan, tok, backend):
    sch = _scheduler(plan, tok, backend, max_batch=4, chunk=4)
    try:
        alone = []
        for t in TEXTS:
            r = _req(tok, t)
            sch.submit(r)
            alone.append(r.text())
        rs = [_req(tok, t) for t in TEXTS]      # 8 requests, 4 slots: half wait, then take freed slots
        for r in rs:
            sch.submit(r)
        assert [r.text() for r in rs] == alone and all(alone)
        assert all(r.got[-1][0] == "done" for r in rs)
        st = sch.stats
        # on xla the steps ran on the device, each launched before the last one's tokens were read
        assert (sch.stepper is not None) == (backend == "xla")
        assert st["requests"] == 16 and st["rows_stepped"] > st["steps"]     # some steps ran several rows
        # prompts of more than one 4-token chunk were prefilled in several
        assert st["prefill_chunks"] > st["requests"]
    finally:
        sch.shutdown()


@pytest.mark.parametrize("backend", ["llvm", "xla"])
def test_seeded_sampling_does_not_depend_on_neighbours(plan, tok, backend):
    sch = _scheduler(plan, tok, backend, max_batch=4)
    try:
        kw = dict(temperature=0.9, top_p=0.95, seed=5)
        r = _req(tok, TEXTS[0], 16, **kw)
        sch.submit(r)
        alone = r.text()
        g = _req(tok, TEXTS[4], 24)
        sch.submit(g)
        greedy = g.text()
        # sampled and greedy sequences side by side (on xla: steps read one at a time while a
        # sampled one runs, launched ahead once only greedy ones are left)
        rs = [_req(tok, TEXTS[0], 16, **kw), _req(tok, TEXTS[4], 24)] + \
            [_req(tok, t, 16, temperature=1.0, seed=i) for i, t in enumerate(TEXTS[1:3])]
        for x in rs:
            sch.submit(x)
        assert rs[0].text() == alone and rs[1].text() == greedy
    finally:
        sch.shutdown()


def test_device_sampling_gives_the_host_samplers_tokens(plan, tok, monkeypatch):
    """xla: sequences sampled with top-k (and a repetition penalty) choose their tokens on the
    device, steps launched ahead; their texts are those the host's sampler gives the same seeds,
    alone and beside greedy and other sampled sequences."""
    from strata_compiler.backends.xla.executor import XLAExecutor

    settings = [dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1, seed=5),
                dict(temperature=1.2, top_k=7, seed=1), dict(temperature=0.0, repetition_penalty=1.3, seed=0), {}]

    def texts(on_device: bool) -> list[str]:
        if not on_device:
            monkeypatch.setattr(XLAExecutor, "samples", lambda self, s: False)
        sch = _scheduler(plan, tok, "xla", max_batch=4)
        syncs = []
        real = sch._finish
        monkeypatch.setattr(sch, "_finish", lambda step, sync: syncs.append(sync) or real(step, sync))
        try:
            rs = [_req(tok, TEXTS[i], 16, **kw) for i, kw in enumerate(settings)]
            for r in rs:
                sch.submit(r)
            together = [r.text() for r in rs]
            r = _req(tok, TEXTS[0], 16, **settings[0])
            sch.submit(r)
            assert r.text() == together[0]
            assert any(syncs) != on_device        # the device's: every step launched ahead
            return together
        finally:
            sch.shutdown()
            monkeypatch.undo()

    assert texts(True) == texts(False)


@pytest.mark.parametrize("backend", ["llvm", "xla"])
def test_cancelled_sequence_frees_its_slot(plan, tok, backend):
    sch = _scheduler(plan, tok, backend, max_batch=1)
    try:
        long = _req(tok, TEXTS[0], 200)
        sch.submit(long)
        deadline = time.time() + 30
        while not any(e[0] == "text" for e in long.got):
            assert time.time() < deadline
            time.sleep(0.001)
        nxt = _req(tok, TEXTS[1], 4)
        sch.submit(nxt)
        long.cancel()
        assert nxt.fin.wait(30) and nxt.got[-1][0] == "done"
        assert long.got[-1][0] == "error" and long.got[-1][2] == 503
        assert sch.stats["cancelled"] == 1 and sch.stats["completion_tokens"] < 200
    finally:
        sch.shutdown()


@pytest.mark.parametrize("backend", ["llvm", "xla"])
def test_prompt_cache_serves_a_shared_start(plan, tok, backend):
    m = plan.meta["model"]
    pc = PromptCache(64 << 20, plan.digest(), shape=(m["n_layers"], m["n_kv_heads"], m["head_dim"]))
    sch = _scheduler(plan, tok, backend, max_batch=2, prompt_cache=pc)
    try:
        system = "You are a helpful assistant who answers questions about Python programs. "
        first = _req(tok, system + "What is a list?")
        sch.submit(first)
        first.text()
        before = sch.stats["prompt_cache_tokens"]
        r = _req(tok, system + "What is a dict?")
        sch.submit(r)
        got = r.text()
        assert sch.stats["prompt_cache_tokens"] - before >= len(tok.encode(system).ids) - 2
        plain = _scheduler(plan, tok, backend, max_batch=2)
        try:
            again = _req(tok, system + "What is a dict?")
            plain.submit(again)
            assert again.text() == got
        finally:
            plain.shutdown()
    finally:
        sch.shutdown()


@pytest.mark.parametrize("backend", ["xla", "mixed", "mixed-streamed"])
def test_serving_after_warm_up_compiles_nothing(plan, mixed_plan, tok, backend, monkeypatch):
    """xla, and a plan split between xla and llvm: every program serving needs is built before the
    scheduler says ready (one compiled while serving stalls every stream): prompts of many
    lengths, one longer than a chunk, greedy and sampled sequences, prompt-cache hits and stores."""
    import jax

    if backend.startswith("mixed"):
        plan = mixed_plan
    monkeypatch.setenv("STRATA_STREAM_PREFILL_TOKENS", "16")
    m = plan.meta["model"]
    pc = PromptCache(64 << 20, plan.digest(), shape=(m["n_layers"], m["n_kv_heads"], m["head_dim"]))
    sch = _scheduler(plan, tok, backend, max_batch=4, chunk=16, prompt_cache=pc)
    assert (sch.stepper is not None) == (backend == "xla")
    seen, on = [], [True]

    def listen(event, _secs, **_kw):
        if on[0] and event in ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration"):
            seen.append(event)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        long = " ".join(TEXTS)          # more than one 16-token chunk
        rs = [_req(tok, t, 6 + i) for i, t in enumerate([*TEXTS, long])]
        rs[2] = _req(tok, TEXTS[2], 9, temperature=0.8, seed=3)
        for r in rs:
            sch.submit(r)
        assert all(r.text() is not None for r in rs) and all(r.got[-1][0] == "done" for r in rs)
        again = [_req(tok, long + " again", 5), _req(tok, long, 7)]     # prompt-cache hits
        for r in again:
            sch.submit(r)
        assert all(r.text() is not None for r in again)
        assert sch.stats["prompt_cache_tokens"] > 0
        assert not seen, f"{len(seen)} JAX programs traced or compiled while serving"
        assert (getattr(sch.session.executor, "streamed_steps", 0) > 0) == (backend == "mixed-streamed")
    finally:
        on[0] = False
        sch.shutdown()
