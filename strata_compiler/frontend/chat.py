"""The model's chat template and special tokens, read for the plan's meta["chat"].

A template is model-supplied text: it is stored here, never rendered (the runtime renders it in a
jinja2 sandbox, runtime/chat.py). Everything read is validated as untrusted input; a wrong type is
one ModelError naming the file and the field.

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

from pathlib import Path

from ..errors import ModelError
from .hf import read_json_object

MAX_TEMPLATE_BYTES = 256 * 1024     # real templates are a few KiB; the largest known are ~20 KiB
MAX_TOKEN_CHARS = 256


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
    return value


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
    if template is None and jinja.is_file():
        if jinja.stat().st_size > MAX_TEMPLATE_BYTES:
            raise ModelError(f"{jinja}: the chat template is larger than {MAX_TEMPLATE_BYTES // 1024} KiB; refusing it")
        try:
            template = jinja.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ModelError(f"{jinja}: not UTF-8 text") from None
    cj_path = model_dir / "chat_template.json"
    if template is None and cj_path.is_file():
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
