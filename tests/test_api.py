"""The Python API (runtime/api.py, `import strata`): generate gives the greedy text of a plain
Session run; stream's pieces join to it; token-id prompts, stop strings, chat under the template;
calls from several threads at once each get their own text; bad arguments are UsageErrors and the
model keeps working; close() ends the generation thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import strata
from strata_compiler.errors import UsageError

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model(tiny_int8_plan):
    with strata.load(tiny_int8_plan, backend="llvm", max_batch=4) as m:
        yield m


def _plain(model, ids: list[int], n: int) -> str:
    from strata_compiler.runtime.chat import stop_ids
    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.runtime.session import Session

    s = Session(model.plan, "llvm")
    _, new = s.generate(np.array([ids], np.int64), n, Sampler(), stop_ids(model.plan), keep_logits=False)
    return model.tokenizer.decode(new[0].tolist())


def test_generate_is_the_plain_greedy_run(model):
    ids = model.tokenizer.encode(PROMPT).ids
    want = _plain(model, ids, 12)
    assert model.generate(PROMPT, max_tokens=12) == want
    assert "".join(model.stream(PROMPT, max_tokens=12)) == want
    assert model.generate(ids, max_tokens=12) == want              # token ids in


def test_stop_string_and_chat(model):
    full = model.generate(PROMPT, max_tokens=12)
    word = full.split()[1]
    assert model.generate(PROMPT, max_tokens=12, stop=[word]) == full[:full.index(word)]
    answer = model.chat([{"role": "user", "content": "Hello there"}], max_tokens=8)
    assert isinstance(answer, str) and answer


def test_threads_are_batched_and_each_gets_its_text(model):
    prompts = [PROMPT, "The keeper climbed", "In the morning", "A small boat"]
    want = {p: model.generate(p, max_tokens=10) for p in prompts}
    got: dict = {}
    threads = [threading.Thread(target=lambda p=p: got.__setitem__(p, model.generate(p, max_tokens=10)))
               for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want


def test_bad_arguments_are_usage_errors(model):
    for call in (lambda: model.generate("", max_tokens=4), lambda: model.generate([10 ** 9], max_tokens=4),
                 lambda: model.generate(PROMPT, max_tokens=10 ** 7), lambda: model.generate(PROMPT, max_tokens=0)):
        with pytest.raises(UsageError):
            call()
    assert model.generate(PROMPT, max_tokens=3)            # still serving


def test_an_abandoned_stream_frees_its_slot(model):
    it = model.stream(PROMPT, max_tokens=200, ignore_eos=True)
    next(it)
    it.close()                  # the caller stops reading: the request is cancelled
    assert model.generate(PROMPT, max_tokens=4)
