"""The model's chat template and special tokens, read for the plan's meta["chat"].

A template is model-supplied text. Before it is stored it is parsed and rendered once for a
system + user conversation in the template sandbox (strata_compiler/template_sandbox.py, the
worker process with a time and memory budget the runtime renders every prompt in), so a template
that does not parse, hangs, blows up memory or writes nothing fails the compile instead of every
chat. Everything read is validated as untrusted input; a wrong type or a failing template is one
ModelError naming the file and the field.

meta["chat"] = {"template": str | None, "bos_token": str | None, "eos_token": str | None,
                "eos_token_ids": [int, ...]}   # the ids to stop on, config and generation_config merged

Sources, Hugging Face folder: tokenizer_config.json's `chat_template` (a string, or a list of
{"name", "template"} of which "default" is taken), else chat_template.jinja (where transformers 5
saves it), else chat_template.json's `chat_template`; `bos_token`/`eos_token` from
tokenizer_config.json (a string or an AddedToken object); EOS ids from config.json and
generation_config.json's `eos_token_id` (an int or a list). GGUF: `tokenizer.chat_template` and the
token strings of the bos/eos ids.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .. import settings
from ..errors import ModelError
from ..template_sandbox import TemplateFailure, render
from ..untrusted import read_regular
from .hf import MAX_TOKEN_IDS, read_json_object

MAX_TEMPLATE_BYTES = 256 * 1024     # real templates are a few KiB; the largest known are ~20 KiB
MAX_TOKEN_CHARS = 256
# Failures that no conversation avoids; a template's raise_exception or a type error may depend on
# the messages (some refuse a system role), so those send the check on to the next conversation.
REFUSED = ("syntax", "forbidden", "recursion", "output", "time", "memory")
CHECK_CONVERSATIONS = (
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "Hello!"}],
)


def check_template(value: object, where: str) -> str | None:
    """A stored template: a str within MAX_TEMPLATE_BYTES, or None; `where` names file and field."""
    if value is None:
        return None
    if isinstance(value, list):   # [{"name": ..., "template": ...}]: the "default" one
        named = {}
        for item in value:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str) and "template" in item):
                raise ModelError(f"{where}: should be a string or a list of {{\"name\", \"template\"}} objects")
            named[item["name"]] = item["template"]
        if "default" not in named:
            return None           # only named tool/rag templates: no chat template to use
        value = named["default"]
        where += "[default]"
    if not isinstance(value, str):
        raise ModelError(f"{where}: should be a string, got {type(value).__name__}")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_TEMPLATE_BYTES:
        raise ModelError(f"{where}: the chat template is larger than {MAX_TEMPLATE_BYTES // 1024} KiB; "
                         "refusing it")
    check_renders(value, where)
    return value


def check_renders(template: str, where: str) -> None:
    """ModelError unless `template` parses and renders CHECK_CONVERSATIONS within the sandbox's
    budget: the first that renders must give a non-empty prompt; a conversation the template
    itself refuses (raise_exception, an error of its own) moves on to the next. The conversations
    share one budget of template_timeout seconds: a template that spends nearly all of it on one
    conversation, then refuses it, does not get the whole budget again for the next."""
    budget = float(settings.get("template_timeout"))
    deadline = time.monotonic() + budget
    for messages in CHECK_CONVERSATIONS:
        try:
            text = render(template, {"messages": messages, "add_generation_prompt": True, "bos_token": "",
                                     "eos_token": ""}, timeout=deadline - time.monotonic())
        except TemplateFailure as e:
            if e.kind == "time":
                raise ModelError(f"{where}: the chat template took longer than {budget:g} s in all to render the "
                                 f"check conversations (the budget: setting template_timeout, "
                                 f"STRATA_TEMPLATE_TIMEOUT); refusing it") from None
            if e.kind in REFUSED:
                raise ModelError(f"{where}: {e}") from None
            continue
        if text:
            return
        raise ModelError(f"{where}: the chat template renders an empty prompt for "
                         f"{' + '.join(m['role'] for m in messages)} messages; refusing it")


def _token_str(value: object, where: str) -> str | None:
    if isinstance(value, dict):   # an AddedToken as transformers serialises it
        value = value.get("content")
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_TOKEN_CHARS:
        raise ModelError(f"{where}: should be a token string (at most {MAX_TOKEN_CHARS} characters)")
    return value


def _ids(value: object, where: str, vocab: int) -> list[int]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if len(items) > MAX_TOKEN_IDS:
        raise ModelError(f"{where}: lists {len(items)} token ids; at most {MAX_TOKEN_IDS} are accepted")
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab:
            raise ModelError(f"{where}: should be a token id or a list of token ids in [0, {vocab}), got {v!r}"[:300])
    return list(items)


def hf_chat(model_dir: Path, config_eos: tuple[int, ...], vocab: int) -> dict:
    """meta["chat"] of a Hugging Face folder (its template None when the folder has none)."""
    tc_path = model_dir / "tokenizer_config.json"
    tc = read_json_object(tc_path) or {}
    template = check_template(tc.get("chat_template"), f"{tc_path}: field 'chat_template'")
    jinja = model_dir / "chat_template.jinja"
    if template is None and os.path.lexists(jinja):
        try:   # a FIFO would block, /proc/self/pagemap (st_size 0) read for ever
            text = read_regular(jinja, MAX_TEMPLATE_BYTES).decode("utf-8")
        except OSError as e:
            raise ModelError(f"{jinja}: cannot read as a chat template of at most {MAX_TEMPLATE_BYTES // 1024} KiB "
                             f"({e.strerror or e})") from None
        except UnicodeDecodeError:
            raise ModelError(f"{jinja}: not UTF-8 text") from None
        template = check_template(text, str(jinja))
    cj_path = model_dir / "chat_template.json"
    if template is None:
        template = check_template((read_json_object(cj_path) or {}).get("chat_template"), f"{cj_path}: field 'chat_template'")
    gc_path = model_dir / "generation_config.json"
    gen_eos = _ids((read_json_object(gc_path) or {}).get("eos_token_id"), f"{gc_path}: field 'eos_token_id'", vocab)
    cfg_eos = _ids(list(config_eos), f"{model_dir / 'config.json'}: field 'eos_token_id'", vocab)
    return {
        "template": template,
        "bos_token": _token_str(tc.get("bos_token"), f"{tc_path}: field 'bos_token'"),
        "eos_token": _token_str(tc.get("eos_token"), f"{tc_path}: field 'eos_token'"),
        "eos_token_ids": list(dict.fromkeys(cfg_eos + gen_eos)),
    }


def gguf_chat(path: Path, template: object, tokens: list | None, bos_id: int, eos_ids: tuple[int, ...]) -> dict:
    """meta["chat"] of a GGUF file, from `tokenizer.chat_template` and the vocabulary's strings."""
    def tok(i: int, field: str) -> str | None:
        if tokens is None or not 0 <= i < len(tokens):
            return None
        return _token_str(tokens[i], f"{path}: GGUF metadata tokenizer.ggml.tokens[{i}] ({field})")

    return {
        "template": check_template(template, f"{path}: GGUF metadata 'tokenizer.chat_template'"),
        "bos_token": tok(bos_id, "bos"),
        "eos_token": tok(eos_ids[0], "eos") if eos_ids else None,
        "eos_token_ids": list(eos_ids),
    }
