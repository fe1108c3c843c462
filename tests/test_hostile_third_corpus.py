"""Hostile input, third corpus (issue 40's hidden-corpus classes): JSON documents that cost more
memory than their bytes or name a key twice, safetensors headers whose tensors overlap, chat
templates that load files / set private attributes / ask for huge ranges, GGUF sampling values out
of range, GGUF tensor names that alias a layer. Each gives one clear error, never a traceback."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from strata_compiler.errors import ModelError, UsageError
from strata_compiler.frontend.gguf_reader import _BLOCK_RE
from strata_compiler.frontend.safetensors_reader import _read_header
from strata_compiler.sampling import check
from strata_compiler.template_sandbox import TemplateFailure, render
from strata_compiler.untrusted import MAX_JSON_ITEMS, load_json

CTX = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}


# ------------------------------------------------------------------------------------------------
# JSON


def test_json_many_values_refused_before_parsing():
    with pytest.raises(ValueError, match="more than"):
        load_json("[" + "[]," * MAX_JSON_ITEMS + "[]]")
    assert load_json("[" + "1," * 1000 + "1]") == [1] * 1001


def test_json_duplicate_key_refused():
    with pytest.raises(ValueError, match="'a' appears twice"):
        load_json('{"a": 1, "b": 2, "a": 3}')
    with pytest.raises(ValueError, match="appears twice"):
        load_json('[{"x": {"k": 1, "k": 1}}]')
    assert load_json('{"a": {"a": 1}}') == {"a": {"a": 1}}     # same key in different objects is fine


# ------------------------------------------------------------------------------------------------
# safetensors


def _safetensors(path: Path, header: dict, data: bytes) -> Path:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


def test_safetensors_overlapping_tensors_refused(tmp_path):
    data = np.arange(8, dtype=np.float32).tobytes()
    ok = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
          "b": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}
    assert set(_read_header(_safetensors(tmp_path / "ok.safetensors", ok, data))) == {"a", "b"}
    bad = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
           "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
    with pytest.raises(ModelError, match="share bytes 8..16"):
        _read_header(_safetensors(tmp_path / "bad.safetensors", bad, data))


def test_safetensors_unprintable_key_is_escaped(tmp_path):
    bad = {"w\x1b[2J\n": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}
    with pytest.raises(ModelError) as e:
        _read_header(_safetensors(tmp_path / "esc.safetensors", bad, bytes(8)))
    assert "\x1b" not in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------
# chat templates


@pytest.mark.parametrize("template, kind", [
    ("{% include 'x' %}", "forbidden"),
    ("{% import 'x' as y %}", "forbidden"),
    ("{% from 'x' import y %}", "forbidden"),
    ("{% extends 'x' %}", "forbidden"),
    ("{% set ns = namespace(a=1) %}{% set ns._priv = 2 %}{{ ns.a }}", "forbidden"),
    ("{{ cycler.__init__ }}", "forbidden"),
    ("{{ ''|attr('__class__') }}", "forbidden"),
    ("{% for i in range(200000) %}{% endfor %}", "forbidden"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
])
def test_template_refused(template, kind):
    with pytest.raises(TemplateFailure) as e:
        render(template, CTX)
    assert e.value.kind == kind, str(e.value)
    assert "\n" not in str(e.value)


def test_template_ordinary_range_and_namespace_still_work():
    t = "{% set ns = namespace(n=0) %}{% for i in range(5) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"
    assert render(t, CTX) == "10"


# ------------------------------------------------------------------------------------------------
# sampling values and GGUF names


@pytest.mark.parametrize("value", [10 ** 400, -(10 ** 400)])
def test_sampling_huge_int_is_a_short_error(value):
    with pytest.raises(ValueError) as e:
        check("top_k", value)
    assert "digits" in str(e.value) and len(str(e.value)) < 200


@pytest.mark.parametrize("name, layer", [("blk.0.attn_q.weight", "0"), ("blk.17.ffn_up.weight", "17")])
def test_gguf_block_names(name, layer):
    m = _BLOCK_RE.fullmatch(name)
    assert m and m.group(1) == layer


@pytest.mark.parametrize("name", ["blk.00.attn_q.weight", "blk.\u0660.attn_q.weight", "blk.\uff10.attn_q.weight",
                                  "blk.01.attn_q.weight", "blk.-1.attn_q.weight"])
def test_gguf_block_alias_names_not_layers(name):
    assert _BLOCK_RE.fullmatch(name) is None


def test_usage_error_is_what_templates_raise():
    assert issubclass(TemplateFailure, UsageError)
