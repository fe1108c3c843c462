"""Several decode steps in one dispatch of the server's batch step (BatchScheduler.decode_steps, the
`decode_steps` setting) on the xla backend (JAX's CPU here): the same tokens as one step a dispatch,
greedy and sampled (a seed, top-k, a repetition penalty's window: the host's uniforms drawn in
order, the window carried on the device), fewer dispatches, and requests that end inside a
dispatch (max_tokens, a stop string) end where they would have."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("jax")

import strata  # noqa: E402

N = 21      # not a multiple of the steps: the last dispatches take one step each


@pytest.fixture(scope="module")
def model(tiny_int8_plan):
    with strata.load(tiny_int8_plan, backend="xla", device="cpu", max_batch=4, ctx=256) as m:
        yield m


def _run(model, steps: int, **kw) -> tuple[str, int, int]:
    e = model.engine
    e.decode_steps = steps
    l0, s0 = e.launches, e.stats["steps"]
    text = model.generate("The keeper climbed the tower", max_tokens=N, ignore_eos=True, **kw)
    return text, e.launches - l0, e.stats["steps"] - s0


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(temperature=0.8, top_k=40, seed=3),
                                dict(temperature=0.9, top_k=20, repetition_penalty=1.3, repeat_last_n=16, seed=5)],
                         ids=["greedy", "sampled", "penalty"])
def test_steps_per_dispatch_change_no_token(model, kw):
    one, launches1, steps1 = _run(model, 1, **kw)
    four, launches4, steps4 = _run(model, 4, **kw)
    assert four == one and one
    assert launches4 < launches1 and abs(steps4 - steps1) <= 4      # about the same steps (the one past the end
    #                                                                 varies), in fewer dispatches


def test_requests_ending_inside_a_dispatch(model):
    """A stop string and max_tokens met inside a dispatch of 4, beside a request that goes on."""
    model.engine.decode_steps = 1
    ref = model.generate("The keeper climbed the tower", max_tokens=N, ignore_eos=True, temperature=0)
    stop = ref.split()[2]
    want_stopped = model.generate("The keeper climbed the tower", max_tokens=N, ignore_eos=True, temperature=0,
                                  stop=[stop])
    want_short = model.generate("The keeper climbed the tower", max_tokens=6, ignore_eos=True, temperature=0)
    model.engine.decode_steps = 4
    got = {}
    jobs = {"long": dict(max_tokens=N), "stopped": dict(max_tokens=N, stop=[stop]), "short": dict(max_tokens=6)}
    threads = [threading.Thread(target=lambda k=k, a=a: got.__setitem__(k, model.generate(
        "The keeper climbed the tower", ignore_eos=True, temperature=0, **a))) for k, a in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got["stopped"] == want_stopped and stop not in got["stopped"]
    assert got["short"] == want_short and got["long"] == ref

