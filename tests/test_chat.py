"""Chat templates travel in the plan (meta["chat"]) and render in a jinja2 sandbox like transformers'.

The tiny trained MoE (examples/models/tiny-moe, ChatML) is compiled once; its stored template must
render exactly what transformers' `apply_chat_template` renders from the same folder. A hostile
template, bad messages, and a plan without a template are each one UsageError line. Compile-time
validation of tokenizer_config.json / generation_config.json is one `error:` line naming file and field.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.driver import compile_model
from strata_compiler.errors import ModelError, UsageError
from strata_compiler.frontend.chat import MAX_TEMPLATE_BYTES, hf_chat
from strata_compiler.pass_manager import CompileOptions
from strata_compiler.runtime.chat import render_chat, stop_ids
from strata_compiler.runtime.plan import load_plan

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "models" / "tiny-moe"

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "The keeper climbed"},
     {"role": "assistant", "content": "the tower."}, {"role": "user", "content": "naïve café — ok? {{ x }} {% if %}"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "  spaced\n\nlines  "}],
]

# A template in the style of Llama 3 / Qwen 2.5: whitespace control, loop state, bos_token, tojson,
# raise_exception, a {% generation %} block. Same text from transformers iff the environments agree.
RICH_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system = 'default system' %}
    {%- set loop_messages = messages %}
{%- endif %}
<<SYS {{ system | tojson }}>>
{% for message in loop_messages %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('Conversation roles must be user or assistant') }}
    {% endif %}
    {% if loop.first %}[first]{% endif %}
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}
    {% else %}
[{{ loop.index0 }}] {{ message['content'] | trim }}
    {% endif %}
    {% if loop.index > 50 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}ASSISTANT:{% endif %}"""


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("chat_plan")
    compile_model(TINY, out, CompileOptions(quant="f32"))
    return load_plan(out)


def model_copy(dst: Path, **tokenizer_config) -> Path:
    """The tiny MoE's folder (weights linked, not copied) with tokenizer_config.json fields replaced."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in TINY.iterdir():
        if f.name == "model.safetensors":
            (dst / f.name).symlink_to(f)
        elif f.suffix == ".json":
            shutil.copy(f, dst / f.name)
    tc = json.loads((TINY / "tokenizer_config.json").read_text())
    tc.update(tokenizer_config)
    (dst / "tokenizer_config.json").write_text(json.dumps(tc))
    return dst


def transformers_render(folder: Path, messages, add_generation_prompt: bool) -> str:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


# ------------------------------------------------------------------------------------------------
# compile time: meta["chat"]


def test_plan_stores_template_and_special_tokens(plan):
    tc = json.loads((TINY / "tokenizer_config.json").read_text())
    assert plan.meta["chat"] == {"template": tc["chat_template"], "bos_token": None, "eos_token": "<|endoftext|>",
                                 "eos_token_ids": [0, 2]}   # config.json's 0, generation_config.json's [0, 2]
    assert stop_ids(plan) == (0, 2)


def test_renders_chatml(plan):
    msgs = CONVERSATIONS[1][:2]
    assert render_chat(plan, msgs) == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                                       "<|im_start|>user\nThe keeper climbed<|im_end|>\n<|im_start|>assistant\n")
    assert render_chat(plan.meta, msgs, add_generation_prompt=False).endswith("climbed<|im_end|>\n")
    from tokenizers import Tokenizer

    ids = Tokenizer.from_str(plan.tokenizer_json.decode()).encode(render_chat(plan, msgs)).ids
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2   # <|im_start|>, <|im_end|>: one id each


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(plan, add_generation_prompt):
    for msgs in CONVERSATIONS:
        assert render_chat(plan, msgs, add_generation_prompt) == \
            transformers_render(TINY, msgs, add_generation_prompt)


def test_rich_template_matches_transformers(tmp_path):
    folder = model_copy(tmp_path / "m", chat_template=RICH_TEMPLATE, bos_token="<|im_start|>")
    meta = {"chat": hf_chat(folder, (0,), 4096)}
    assert meta["chat"]["bos_token"] == "<|im_start|>"
    for msgs in CONVERSATIONS:
        for agp in (True, False):
            assert render_chat(meta, msgs, agp) == transformers_render(folder, msgs, agp)
    with pytest.raises(UsageError, match="roles must be user or assistant"):
        render_chat(meta, [{"role": "tool", "content": "x"}])


def test_template_sources(tmp_path):
    t = "{{ messages[0]['content'] }}"
    listed = model_copy(tmp_path / "a", chat_template=[{"name": "tool_use", "template": "T"},
                                                       {"name": "default", "template": t}])
    assert hf_chat(listed, (0,), 4096)["template"] == t
    only_tools = model_copy(tmp_path / "b", chat_template=[{"name": "tool_use", "template": "T"}])
    assert hf_chat(only_tools, (0,), 4096)["template"] is None
    jinja = model_copy(tmp_path / "c", chat_template=None)
    (jinja / "chat_template.jinja").write_text(t)          # where transformers 5 saves it
    assert hf_chat(jinja, (0,), 4096)["template"] == t


@pytest.mark.parametrize("value, why", [
    (5, "should be a string"),
    ({"default": "x"}, "should be a string"),
    ([{"name": "default", "template": 3}], "should be a string"),
    (["x"], "list of"),
    ("x" * (MAX_TEMPLATE_BYTES + 1), "larger than 256 KiB"),
    ("{% for m in messages %}", "does not parse"),          # checked by a render (tests/test_hostile_templates.py)
    ("{% if false %}x{% endif %}", "renders an empty prompt"),
])
def test_bad_template_is_one_error(tmp_path, value, why):
    folder = model_copy(tmp_path / "m", chat_template=value)
    with pytest.raises(ModelError, match=why) as e:
        hf_chat(folder, (0,), 4096)
    assert "tokenizer_config.json" in str(e.value) and "chat_template" in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_special_tokens(tmp_path):
    folder = model_copy(tmp_path / "m", eos_token=7)
    with pytest.raises(ModelError, match="'eos_token'"):
        hf_chat(folder, (0,), 4096)
    folder = model_copy(tmp_path / "n", eos_token={"content": "<|im_end|>", "special": True})
    assert hf_chat(folder, (0,), 4096)["eos_token"] == "<|im_end|>"
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9999]}))
    with pytest.raises(ModelError, match="generation_config.json: field 'eos_token_id'"):
        hf_chat(folder, (0,), 4096)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert hf_chat(folder, (0,), 4096)["eos_token_ids"] == [0, 3]


def test_stratac_error_line(tmp_path, capsys):
    folder = model_copy(tmp_path / "m", chat_template=["not", "objects"])
    capsys.readouterr()
    code = run_cli(stratac, ["compile", str(folder), "-o", str(tmp_path / "out")])
    o, err = capsys.readouterr()
    lines = err.splitlines()
    assert code != 0 and "Traceback" not in o + err and len(lines) == 1, err
    assert lines[0].startswith("error: ") and "tokenizer_config.json" in lines[0] and "chat_template" in lines[0]
    assert not (tmp_path / "out" / "plan.bin").exists()


# ------------------------------------------------------------------------------------------------
# run time: the sandbox, messages, plans without a template


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ().__class__.__bases__[0].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'].system('echo pwned') }}",
    "{% set _ = messages.append({'role': 'x'}) %}",
    "{% set _ = messages[0].update({'role': 'x'}) %}",
    "{{ 'x' * 1000000000 }}",
    "{{ [0] * 10**9 }}",
    "{{ 2 ** (10 ** 9) }}",
    "{{ 'x'.ljust(1000000000) }}",
    "{{ 'x' | center(1000000000) }}",
    "{{ range(10 ** 6) | list }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endfor %}",
    "{{ raise_exception('no such role') }}",
    "{% for m in messages %}",
    "{{ undefined_thing.field }}",
    "{{ 1 / 0 }}",
])
def test_hostile_or_broken_template_is_one_usage_error(template):
    meta = {"chat": {"template": template, "bos_token": None, "eos_token": "<e>", "eos_token_ids": [0]}}
    with pytest.raises(UsageError) as e:
        render_chat(meta, [{"role": "user", "content": "hi"}])
    assert "\n" not in str(e.value) and "chat template" in str(e.value)


def test_sandbox_keeps_input_and_hides_internals():
    msgs = [{"role": "user", "content": "hi"}]
    meta = {"chat": {"template": "{{ messages | tojson }}|{{ eos_token }}", "eos_token": "<e>"}}
    assert render_chat(meta, msgs) == '[{"role": "user", "content": "hi"}]|<e>'
    assert msgs == [{"role": "user", "content": "hi"}]
    # an internal attribute is refused outright (jinja2's sandbox would render it as empty)
    meta["chat"]["template"] = "{{ ''.__class__ }}|{{ eos_token }}"
    with pytest.raises(UsageError, match="forbids.*__class__") as e:
        render_chat(meta, msgs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("messages, why", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([["user", "hi"]], r"messages\[0\] should be an object"),
    ([{"role": "user"}], r"messages\[0\].content should be a string"),
    ([{"role": "user", "content": None}], "content should be a string"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "content should be a string"),
    ([{"role": 3, "content": "hi"}], r"messages\[0\].role"),
    ([{"role": "", "content": "hi"}], "role"),
    ([{"role": "x" * 65, "content": "hi"}], "role"),
    ([{"role": "user", "content": "hi", "tool_calls": []}], "unsupported field 'tool_calls'"),
    ([{"role": "user", "content": "x" * (4 * 1024 * 1024 + 1)}], "longer than"),
    ([{"role": "user", "content": "x"}] * 4097, "at most 4096"),
])
def test_bad_messages(plan, messages, why):
    with pytest.raises(UsageError, match=why) as e:
        render_chat(plan, messages)
    assert "\n" not in str(e.value)


def test_plan_without_template():
    for meta in ({"model": {"eos_token_ids": [5]}},   # compiled before meta["chat"] existed
                 {"model": {"eos_token_ids": [5]}, "chat": {"template": None, "eos_token_ids": [5, 6]}}):
        with pytest.raises(UsageError, match="this plan has no chat template.*--chat-template FILE.*plain completions"):
            render_chat(meta, [{"role": "user", "content": "hi"}])
    assert stop_ids({"model": {"eos_token_ids": [5]}}) == (5,)
    assert stop_ids({"model": {"eos_token_ids": [5]}, "chat": {"eos_token_ids": [6, 5]}}) == (6, 5)
    with pytest.raises(UsageError, match="malformed"):
        render_chat({"chat": {"template": 3}}, [{"role": "user", "content": "hi"}])
