"""Chat prompts: the plan's stored chat template rendered in a jinja2 sandbox, and the ids to stop on.

The template is model-supplied input (meta["chat"]["template"], written by `stratac compile` from
tokenizer_config.json or a GGUF's tokenizer.chat_template), so it runs in jinja2's
ImmutableSandboxedEnvironment: no attribute access to internals (`__class__`, `__globals__`, ...),
no mutation of the objects handed in, `range` capped by jinja2 at 100,000 items. The output is
capped at MAX_OUTPUT_CHARS while it renders. The environment matches transformers'
`apply_chat_template` (trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`, `strftime_now`,
a `tojson` that keeps non-ASCII, `{% generation %}` blocks), so a prompt renders to the same text.

Every failure is one UsageError line: a bad message list, a plan without a template, a template
that fails to parse, raises, or touches what the sandbox forbids.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from strata_compiler.errors import UsageError

MAX_TEMPLATE_CHARS = 256 * 1024
MAX_MESSAGES = 4096
MAX_ROLE_CHARS = 64
MAX_CONTENT_CHARS = 4 * 1024 * 1024          # one message
MAX_TOTAL_CHARS = 16 * 1024 * 1024           # all messages together
MAX_OUTPUT_CHARS = 2 * MAX_TOTAL_CHARS       # the rendered prompt
MESSAGE_KEYS = ("role", "content", "name")
MAX_SIZE_ARG = 1 << 20                       # an int argument to a call or a sizing filter (ljust, center, ...)

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


def _raise_exception(message: Any) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _bounded_filter(f):
    def bounded(*args, **kwargs):
        from jinja2.exceptions import SecurityError

        for a in (*args[1:], *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_SIZE_ARG:
                raise SecurityError(f"an argument of {a} is too large")
        return f(*args, **kwargs)

    for attr in ("jinja_pass_arg",):   # keep @pass_environment / @pass_context markers
        if hasattr(f, attr):
            setattr(bounded, attr, getattr(f, attr))
    return bounded


_ENV = None


def _environment():
    """One ImmutableSandboxedEnvironment per process (templates compile per call; the env is stateless)."""
    global _ENV
    if _ENV is None:
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.exceptions import SecurityError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class _Generation(Extension):
            """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): the body as is."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.Scope(body, lineno=lineno)

        class _Bounded(ImmutableSandboxedEnvironment):
            """The sandbox, plus bounds on what allocates: `'x' * n`, `a ** b`, and int arguments
            (str.ljust, zfill, center, ...) beyond MAX_SIZE_ARG."""

            intercepted_binops = frozenset(["*", "**"])   # also stops compile-time constant folding

            def call_binop(self, context, operator, left, right):
                if operator == "**":
                    if isinstance(right, (int, float)) and abs(right) > 64 and abs(left) not in (0, 1):
                        raise SecurityError("the exponent of ** is too large")
                    return left ** right
                if operator == "*":
                    for a, b in ((left, right), (right, left)):
                        if isinstance(a, (str, list, tuple)) and isinstance(b, int) and len(a) * b > MAX_OUTPUT_CHARS:
                            raise SecurityError("a repeated string or list would be too large")
                    return left * right
                return super().call_binop(context, operator, left, right)

            def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
                for a in (*args, *kwargs.values()):
                    if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_SIZE_ARG:
                        raise SecurityError(f"an argument of {a} is too large")
                return super().call(__context, __obj, *args, **kwargs)

        env = _Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
        for name in ("center", "indent", "wordwrap", "truncate"):   # filters are called directly, not via call()
            env.filters[name] = _bounded_filter(env.filters[name])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _ENV = env
    return _ENV


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or e.__class__.__name__
    return text[:300]


def render_chat(plan_or_meta: Any, messages: Any, add_generation_prompt: bool = True) -> str:
    """The prompt text of `messages` under the plan's chat template (special tokens as text; the
    tokenizer turns them into their ids). Raises UsageError, one line, on anything wrong."""
    from jinja2.exceptions import SecurityError, TemplateError

    msgs = check_messages(messages)
    chat = _chat(_meta(plan_or_meta))
    template = chat.get("template")
    if template is None:
        raise UsageError(NO_TEMPLATE)
    if not isinstance(template, str) or len(template) > MAX_TEMPLATE_CHARS:
        raise UsageError("the plan's chat template is malformed (not a string, or larger than "
                         f"{MAX_TEMPLATE_CHARS // 1024} KiB); recompile it with `stratac compile`")
    env = _environment()
    try:
        compiled = env.from_string(template)
        parts, size = [], 0
        for chunk in compiled.generate(messages=msgs, add_generation_prompt=bool(add_generation_prompt),
                                       bos_token=_token(chat, "bos_token"), eos_token=_token(chat, "eos_token")):
            size += len(chunk)
            if size > MAX_OUTPUT_CHARS:
                raise UsageError(f"the chat template produced more than {MAX_OUTPUT_CHARS} characters; refusing it")
            parts.append(chunk)
    except SecurityError as e:
        raise UsageError(f"the plan's chat template did something the sandbox forbids ({_one_line(e)})") from None
    except TemplateError as e:
        raise UsageError(f"the plan's chat template failed: {_one_line(e)}") from None
    except UsageError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError, RecursionError,
            MemoryError, OverflowError) as e:
        raise UsageError(f"the plan's chat template failed: {e.__class__.__name__}: {_one_line(e)}") from None
    return "".join(parts)
