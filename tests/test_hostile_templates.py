"""Hostile chat templates (issue 40): each is one UsageError line within 10 s and 1 GiB, never a hang.

A template renders in the sandbox's worker process (strata_compiler/template_sandbox.py) under the
settings template_timeout and template_memory. Each class of hostile template runs end to end in a
child (tests/limits.py) under the issue's bar, the worker's peak memory included. The rest runs in
this process, which the worker shields: the worker comes back after a kill, callers on several
threads share it, the compile-time check refuses what hangs or does not parse and keeps real
templates that refuse a system role, and a few hundred generated templates each render or fail
within the budget.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st
from limits import MAX_RSS, run_limited

from strata_compiler import settings, template_sandbox
from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.errors import ModelError, UsageError
from strata_compiler.frontend.chat import check_template
from strata_compiler.runtime.chat import render_chat

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "models" / "tiny-moe"
CHATML = json.loads((TINY / "tokenizer_config.json").read_text())["chat_template"]
HI = [{"role": "user", "content": "hi"}]
FAST = {"template_timeout": 1.0, "template_memory": 256}

DOUBLE = "{% set ns = namespace(s='x', l=['x']) %}{% for i in range(40) %}"
HOSTILE = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "doubling ~": DOUBLE + "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
    "doubling join": DOUBLE + "{% set ns.s = [ns.s, ns.s] | join %}{% endfor %}{{ ns.s | length }}",
    "doubling replace": DOUBLE + "{% set ns.s = ns.s | replace('x', 'xx') %}{% endfor %}{{ ns.s | length }}",
    "doubling str.replace": DOUBLE + "{% set ns.s = ns.s.replace('x', 'xx') %}{% endfor %}{{ ns.s | length }}",
    "doubling format": DOUBLE + "{% set ns.s = '%s%s' | format(ns.s, ns.s) %}{% endfor %}{{ ns.s | length }}",
    "list growth": DOUBLE + "{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l | length }}",
    "macro recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "macro fan-out": "{% macro f(n) %}{% if n < 60 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}{{ f(0) }}",
    "empty render": "{% if false %}{{ messages }}{% endif %}",
}

# Renders in a child; prints the error line, exits 2, and prints the peak RSS of the worker it reaped.
CHILD = """
import resource, sys
from strata_compiler.errors import UsageError
from strata_compiler.runtime.chat import render_chat
try:
    render_chat({"chat": {"template": sys.argv[1]}}, [{"role": "user", "content": "hi"}])
except UsageError as e:
    print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
    print("error:", e, file=sys.stderr)
    sys.exit(2)
"""


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_is_one_usage_error_within_the_bar(name):
    env = {**os.environ, "STRATA_TEMPLATE_TIMEOUT": "3", "STRATA_TEMPLATE_MEMORY": "1024"}
    r = run_limited([sys.executable, "-c", CHILD, HOSTILE[name]], env=env, cwd=ROOT).check()
    lines = r.stderr.splitlines()
    assert r.rc == 2 and len(lines) == 1 and lines[0].startswith("error: the plan's chat template"), r.stderr
    assert int(r.stdout) <= MAX_RSS, f"the worker peaked at {int(r.stdout) >> 20} MiB"


def test_what_each_failure_says():
    with settings.override(**FAST):
        for name, why in [("nested loops", "took longer than 1 s"), ("doubling ~", "memory budget of 256 MiB"),
                          ("macro recursion", "RecursionError"), ("empty render", "rendered an empty prompt")]:
            with pytest.raises(UsageError, match=why):
                render_chat({"chat": {"template": HOSTILE[name]}}, HI)
        with pytest.raises(UsageError, match="more than 33554432 characters"):
            render_chat({"chat": {"template": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"}}, HI)
        assert render_chat({"chat": {"template": CHATML}}, HI) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_killed_worker_is_an_error_and_replaced():
    with settings.override(template_timeout=30.0):
        render_chat({"chat": {"template": CHATML}}, HI)
        victim = template_sandbox._WORKER.proc
        threading.Timer(0.3, victim.kill).start()
        t0 = time.monotonic()
        with pytest.raises(UsageError, match="its renderer, which was killed by SIGKILL"):
            render_chat({"chat": {"template": HOSTILE["nested loops"]}}, HI)
        assert time.monotonic() - t0 < 5
        assert render_chat({"chat": {"template": CHATML}}, HI).startswith("<|im_start|>user")
        assert template_sandbox._WORKER.proc is not victim


def test_threads_share_the_worker_and_a_hang_only_delays_them():
    results: dict = {}

    def call(i: int) -> None:
        template = HOSTILE["nested loops"] if i == 0 else CHATML
        try:
            results[i] = render_chat({"chat": {"template": template}}, [{"role": "user", "content": f"m{i}"}])
        except UsageError as e:
            results[i] = e

    with settings.override(**FAST):
        threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    assert isinstance(results.pop(0), UsageError)
    assert results == {i: f"<|im_start|>user\nm{i}<|im_end|>\n<|im_start|>assistant\n" for i in range(1, 8)}


def test_text_round_trips_exactly():
    msgs = [{"role": "user", "content": "naïve café — 🎉 \ud800 \x00 {{ x }}"}]
    want = "<|im_start|>user\n" + msgs[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat({"chat": {"template": CHATML}}, msgs) == want


# ------------------------------------------------------------------------------------------------
# compile time: the template is parsed and rendered once before it is stored

GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")
REFUSES_EVERYTHING = "{{ raise_exception('use the tool template') }}"


def test_compile_check_keeps_real_templates():
    for t in (CHATML, GEMMA, REFUSES_EVERYTHING, "{{ messages[0].content.missing.field }}x"):
        assert check_template(t, "t.jinja") == t


@pytest.mark.parametrize("template, why", [
    (HOSTILE["nested loops"], "took longer than 1 s"),
    (HOSTILE["list growth"], "memory budget"),
    ("{% for m in messages %}", "does not parse: Unexpected end of template"),
    ("{{ x | no_such_filter }}", "does not parse: .*no_such_filter"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}x", "sandbox forbids"),
    (HOSTILE["empty render"], "renders an empty prompt for system \\+ user messages"),
])
def test_compile_check_refuses(template, why):
    with settings.override(**FAST), pytest.raises(ModelError, match="^t.jinja: .*" + why) as e:
        check_template(template, "t.jinja")
    assert "\n" not in str(e.value)


def test_stratac_chat_template_option_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "hang.jinja"
    bad.write_text(HOSTILE["nested loops"])
    capsys.readouterr()
    with settings.override(**FAST):
        code = run_cli(stratac, ["compile", str(TINY), "-o", str(tmp_path / "out"), "--chat-template", str(bad)])
    out, err = capsys.readouterr()
    assert code != 0 and "Traceback" not in out + err and err.count("\n") == 1, err
    assert err.startswith(f"error: --chat-template {bad}: the chat template took longer than 1 s")
    assert not (tmp_path / "out" / "plan.bin").exists()


# ------------------------------------------------------------------------------------------------
# generated templates: random compositions of for/set/if/macro/filters over a small grammar

EXPRS = st.sampled_from([
    "ns.s", "ns.s ~ ns.s", "ns.s | replace('a', 'aa')", "ns.s.replace('b', 'bb')", "ns.s * 3", "ns.s | upper",
    "'%s-%s' | format(ns.s, ns.s)", "ns.l | join(ns.s)", "ns.s | length", "ns.s | reverse | join", "ns.s[:7]",
    "messages[0].content", "messages | tojson", "ns.l | tojson", "ns.s | center(80)", "ns.l | length",
    "range(9) | list", "ns.s.split('a')", "ns.l | sum", "ns.s ~ i", "loop.index", "ns.nope",
])
RANGES = st.sampled_from(["0", "2", "5", "30", "1000", "100000", "ns.s | length", "ns.l | length"])


def _statements(depth: int):
    leaf = st.one_of(
        EXPRS.map(lambda e: f"{{{{ {e} }}}}"),
        EXPRS.map(lambda e: f"{{% set ns.s = {e} %}}"),
        st.sampled_from(["{% set ns.l = ns.l + ns.l %}", "{% set ns.l = ns.l + [ns.s] %}", "{% set ns.n = ns.n + 1 %}",
                         "x", "{% break %}", "{{ m(3) }}", "{{ m(ns.n) }}"]),
    )
    if depth == 0:
        return leaf
    body = st.lists(_statements(depth - 1), min_size=1, max_size=3).map("".join)
    return st.one_of(
        leaf,
        st.tuples(RANGES, body).map(lambda t: f"{{% for i in range({t[0]}) %}}{t[1]}{{% endfor %}}"),
        st.tuples(EXPRS, body, body).map(lambda t: f"{{% if {t[0]} %}}{t[1]}{{% else %}}{t[2]}{{% endif %}}"),
    )


TEMPLATES = st.tuples(st.lists(_statements(3), min_size=1, max_size=3).map("".join),
                      st.lists(_statements(1), max_size=2).map("".join)).map(
    lambda t: ("{% set ns = namespace(s='ab', l=['a', 'b'], n=0) %}"
               "{% macro m(n) %}{% if n > 0 %}" + t[1] + "{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}"
               + t[0]))


@hsettings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(TEMPLATES)
def test_generated_templates_render_or_fail_within_the_budget(template):
    with settings.override(template_timeout=0.5, template_memory=256):
        t0 = time.monotonic()
        try:
            assert isinstance(render_chat({"chat": {"template": template}}, HI), str)
        except UsageError as e:
            assert "\n" not in str(e) and str(e).startswith("the plan's chat template")
        assert time.monotonic() - t0 < 0.5 + 5   # the deadline, and a fresh worker's start
