"""runtime/sampler.py: top-k, min-p and top-p keep the tokens they should (no other token is ever
drawn); the repetition penalty divides seen positive logits and multiplies seen negative ones, and
changes greedy choices; strata-run's flags and the server's fields reach the sampler."""

from __future__ import annotations

import numpy as np
import pytest

from strata_compiler.runtime.sampler import Sampler

LOGITS = np.log(np.array([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04]], np.float64)).astype(np.float32)


def _drawn(sampler: Sampler, n: int = 400) -> set[int]:
    return {int(sampler(LOGITS)[0]) for _ in range(n)}


@pytest.mark.parametrize("kw,allowed", [
    (dict(top_k=2), {0, 1}),
    (dict(top_k=1), {0}),
    (dict(min_p=0.3), {0, 1, 2}),            # p >= 0.3 x 0.40 = 0.12
    (dict(min_p=0.9), {0}),
    (dict(top_p=0.6), {0, 1}),               # 0.40 + 0.25 reaches 0.6
    (dict(top_k=5, min_p=0.2, top_p=0.99), {0, 1, 2, 3}),
    (dict(), {0, 1, 2, 3, 4, 5}),
])
def test_filters_keep_exactly_their_tokens(kw, allowed):
    assert _drawn(Sampler(temperature=1.0, seed=3, **kw)) == allowed


def test_repetition_penalty():
    logits = np.array([[2.0, 1.9, -1.0, -1.2]], np.float32)
    s = Sampler(repetition_penalty=2.0)
    assert not s.plain_greedy and s.needs_history
    assert s(logits, [[0]])[0] == 1                 # 2.0 / 2 = 1.0 < 1.9
    assert s(logits, [[0, 1, 2]])[0] == 0           # 1.0 vs 0.95 vs -2.0
    assert s(logits, None)[0] == 0                  # no history: no penalty
    assert Sampler()(logits, [[0]])[0] == 0 and Sampler().plain_greedy
    # a seen negative logit is pushed further down: -1.0 * 2 = -2.0 falls below -1.2
    low = np.array([[-3.0, -3.0, -1.0, -1.2]], np.float32)
    assert s(low, [[2]])[0] == 3


def test_strata_run_sampling_flags(tiny_int8_plan):
    from strata_compiler.cli_common import run_cli
    from strata_compiler.runtime.cli import strata_run

    args = [str(tiny_int8_plan), "--prompt", "Once upon a time", "-n", "8", "--backend", "llvm"]
    assert run_cli(strata_run, args + ["--temperature", "0.8", "--top-k", "5", "--min-p", "0.05",
                                       "--repeat-penalty", "1.3", "--seed", "2"]) == 0
    assert run_cli(strata_run, args + ["--repeat-penalty", "0"]) != 0       # out of range: a usage error
    assert run_cli(strata_run, ["--version"]) == 0
