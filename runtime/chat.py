"""Chat prompts: the plan's stored chat template rendered in a sandbox, and the ids to stop on.

The template is model-supplied input (meta["chat"]["template"], written by `stratac compile` from
tokenizer_config.json or a GGUF's tokenizer.chat_template), so it renders in
strata_compiler/template_sandbox.py: jinja2's ImmutableSandboxedEnvironment set up as transformers'
`apply_chat_template` sets it up (so a prompt renders to the same text), inside a worker process
with a time and a memory budget (settings template_timeout, template_memory) and a cap on the
output. This module checks the messages and says what a failure means for the plan.

Every failure is one UsageError line: a bad message list, a plan without a template, a template
that fails to parse, raises, touches what the sandbox forbids, runs out of time or memory, or
renders nothing.
"""

from __future__ import annotations

from typing import Any

from strata_compiler.errors import UsageError
from strata_compiler.template_sandbox import MAX_TEMPLATE_CHARS, render

MAX_MESSAGES = 4096
MAX_ROLE_CHARS = 64
MAX_CONTENT_CHARS = 4 * 1024 * 1024          # one message
MAX_TOTAL_CHARS = 16 * 1024 * 1024           # all messages together (the output may be twice this)
MESSAGE_KEYS = ("role", "content", "name")

NO_TEMPLATE = ("this plan has no chat template (the model had none: tokenizer_config.json's chat_template, or a "
               "GGUF's tokenizer.chat_template); recompile it with `stratac compile ... --chat-template FILE`, "
               "or send plain completions of a prompt you format yourself")


def _meta(plan_or_meta: Any) -> dict:
    meta = getattr(plan_or_meta, "meta", plan_or_meta)
    if not isinstance(meta, dict):
        raise TypeError("render_chat takes a Plan or its meta dict")
    return meta


def _chat(meta: dict) -> dict:
    chat = meta.get("chat")
    return chat if isinstance(chat, dict) else {}


def has_template(plan_or_meta: Any) -> bool:
    return isinstance(_chat(_meta(plan_or_meta)).get("template"), str)


def _token(chat: dict, key: str) -> str:
    v = chat.get(key)
    return v if isinstance(v, str) else ""


def stop_ids(plan_or_meta: Any) -> tuple[int, ...]:
    """The EOS ids to stop on: meta["chat"]["eos_token_ids"] (config.json and generation_config.json
    merged at compile time), else the model's eos_token_ids (plans compiled before chat meta)."""
    meta = _meta(plan_or_meta)
    model = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    ids: list[int] = []
    for src in (_chat(meta).get("eos_token_ids"), model.get("eos_token_ids")):
        if isinstance(src, list):
            ids += [i for i in src if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
    return tuple(dict.fromkeys(ids))


def check_messages(messages: Any) -> list[dict]:
    """The messages as plain dicts of str, or one UsageError line saying what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise UsageError("'messages' should be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    if len(messages) > MAX_MESSAGES:
        raise UsageError(f"'messages' has {len(messages)} entries; at most {MAX_MESSAGES} are accepted")
    out, total = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UsageError(f"messages[{i}] should be an object with 'role' and 'content', got {type(m).__name__}")
        extra = [k for k in m if k not in MESSAGE_KEYS]
        if extra:
            raise UsageError(f"messages[{i}] has unsupported field {str(extra[0])[:40]!r} "
                             f"(supported: {', '.join(MESSAGE_KEYS)})")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role or len(role) > MAX_ROLE_CHARS:
            raise UsageError(f"messages[{i}].role should be a non-empty string of at most {MAX_ROLE_CHARS} characters")
        if not isinstance(content, str):
            raise UsageError(f"messages[{i}].content should be a string, got {type(content).__name__}")
        if len(content) > MAX_CONTENT_CHARS:
            raise UsageError(f"messages[{i}].content is longer than {MAX_CONTENT_CHARS} characters")
        if "name" in m and (not isinstance(m["name"], str) or len(m["name"]) > MAX_ROLE_CHARS):
            raise UsageError(f"messages[{i}].name should be a string of at most {MAX_ROLE_CHARS} characters")
        total += len(content)
        if total > MAX_TOTAL_CHARS:
            raise UsageError(f"the messages together are longer than {MAX_TOTAL_CHARS} characters")
        out.append({k: m[k] for k in MESSAGE_KEYS if k in m})
    return out


def render_chat(plan_or_meta: Any, messages: Any, add_generation_prompt: bool = True) -> str:
    """The prompt text of `messages` under the plan's chat template (special tokens as text; the
    tokenizer turns them into their ids). Rendered in the template sandbox's worker process within
    the `template_timeout` and `template_memory` budget, so it is bounded in time and may be called
    from any thread (the server calls it through asyncio.to_thread). Raises UsageError, one line,
    on anything wrong, including a template that renders nothing."""
    msgs = check_messages(messages)
    chat = _chat(_meta(plan_or_meta))
    template = chat.get("template")
    if template is None:
        raise UsageError(NO_TEMPLATE)
    if not isinstance(template, str) or len(template) > MAX_TEMPLATE_CHARS:
        raise UsageError("the plan's chat template is malformed (not a string, or larger than "
                         f"{MAX_TEMPLATE_CHARS // 1024} KiB); recompile it with `stratac compile`")
    context = {"messages": msgs, "add_generation_prompt": bool(add_generation_prompt),
               "bos_token": _token(chat, "bos_token"), "eos_token": _token(chat, "eos_token")}
    text = render(template, context, name="the plan's chat template")
    if not text:
        raise UsageError("the plan's chat template rendered an empty prompt for these messages (does it write "
                         "nothing for their roles?); fix it and recompile with `stratac compile ... "
                         "--chat-template FILE`")
    return text
