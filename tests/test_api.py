"""The Python API (runtime/api.py, `import strata`): generate with temperature 0 gives the greedy
text of a plain Session run, and without sampling arguments the text of a Session run sampled with
the plan's defaults; stream's pieces join to it; token-id prompts, stop strings, chat under the
template; calls from several threads at once each get their own text; bad arguments (a negative
max_tokens, a top_p of 0) are UsageErrors that do not echo a negative count as a need, and the model
keeps working; close() ends the generation thread; the default context is strata-run's."""

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


def _plain(model, ids: list[int], n: int, sampler=None) -> str:
    from strata_compiler.runtime.chat import stop_ids
    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.runtime.session import Session

    s = Session(model.plan, "llvm")
    _, new = s.generate(np.array([ids], np.int64), n, sampler or Sampler(), stop_ids(model.plan), keep_logits=False)
    return model.tokenizer.decode(new[0].tolist())


def test_generate_is_the_plain_greedy_run(model):
    ids = model.tokenizer.encode(PROMPT).ids
    want = _plain(model, ids, 12)
    assert model.generate(PROMPT, max_tokens=12, temperature=0) == want
    assert "".join(model.stream(PROMPT, max_tokens=12, temperature=0)) == want
    assert model.generate(ids, max_tokens=12, temperature=0) == want              # token ids in


def test_default_sampling_is_the_plans(model):
    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.sampling import DEFAULTS

    assert model.sampling == DEFAULTS       # tiny-moe's generation_config.json recommends nothing
    ids = model.tokenizer.encode(PROMPT).ids
    want = _plain(model, ids, 12, Sampler.of(DEFAULTS, seed=3))
    assert model.generate(PROMPT, max_tokens=12, seed=3) == want
    assert want != _plain(model, ids, 12)   # it samples, with the repeat penalty: not the greedy text


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
                 lambda: model.generate(PROMPT, max_tokens=10 ** 7), lambda: model.generate(PROMPT, max_tokens=0),
                 lambda: model.generate(PROMPT, top_p=0), lambda: model.generate(PROMPT, temperature=-1),
                 lambda: model.generate(PROMPT, seed=-1)):
        with pytest.raises(UsageError):
            call()
    with pytest.raises(UsageError) as e:
        model.generate(PROMPT, max_tokens=-5)
    assert str(e.value) == "max_tokens -5: expected a whole number 1 to 2147483647"
    with pytest.raises(UsageError) as e:
        model.generate(PROMPT, max_tokens=10 ** 7)
    assert f"give max_tokens {model.engine.ctx - len(model.tokenizer.encode(PROMPT).ids)} or less" in str(e.value)
    assert model.generate(PROMPT, max_tokens=3)            # still serving


def test_default_context_is_strata_runs(model):
    from strata_compiler.runtime.session import default_ctx

    assert model.engine.ctx == default_ctx(model.plan, 4 + 1) == model.plan.meta["model"]["max_position"]


def test_an_abandoned_stream_frees_its_slot(model):
    it = model.stream(PROMPT, max_tokens=200, ignore_eos=True)
    next(it)
    it.close()                  # the caller stops reading: the request is cancelled
    assert model.generate(PROMPT, max_tokens=4)


def test_default_context_fits_the_gpu_that_holds_the_cache(model):
    """A GPU's free bytes bound the default context as the host's memory does (16 streams of a
    model's whole context once asked for 59 GiB of an 80 GiB card and failed mid-run)."""
    from strata_compiler.runtime.session import KV_SHARE, default_ctx

    m = model.plan.meta["model"]
    per_token = 8 * m["n_layers"] * m["n_kv_heads"] * m["head_dim"] * 17
    room = 1000 * per_token
    assert default_ctx(model.plan, 17, room) == int(room * KV_SHARE) // per_token // 64 * 64 == 448
    assert default_ctx(model.plan, 17, 0) == 64             # at least 64
    assert model.session.executor.kv_room() is None         # this model's cache is in host memory
