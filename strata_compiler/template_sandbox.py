"""Chat templates rendered with a time and a memory budget, in a worker process.

A chat template is model-supplied Jinja. jinja2's ImmutableSandboxedEnvironment keeps it away from
Python's internals and from mutating what it is given, but not from looping for minutes or doubling
a string until the machine swaps. So a render runs in a long-lived worker process (`python -I -c`,
importing only jinja2 and this module) whose address space is capped (RLIMIT_AS =
`template_memory` MiB) and whose CPU time is capped per job (RLIMIT_CPU, a backstop); the caller
waits at most `template_timeout` s for the answer, then kills the worker, and the next render
starts a fresh one. The compiler checks a template with it (frontend/chat.py), the runtime renders
every chat prompt with it (runtime/chat.py); both sit above this module.

The sandbox is stricter than jinja2's in three ways that no real template notices: an unsafe
attribute (`''.__class__`, `cycler.__init__`, `self._TemplateReference__context`, through `|attr`,
`|map(attribute=...)` or `str.format` too) raises instead of rendering as an empty Undefined; a
template that loads another file (`{% include %}`, `{% import %}`, `{% from %}`, `{% extends %}`:
there is no loader) or assigns a private attribute of a namespace is refused before it renders;
`range` beyond jinja2's MAX_RANGE is a SecurityError, like every other over-large argument.

Every failure is one TemplateFailure line (a UsageError) whose `kind` says what went wrong.
`render` may be called from any thread: one lock serializes the worker, and every wait on it has a
deadline. The worker lives while this process does (it exits when its pipe closes).

Protocol, one frame each way per render (8-byte big-endian length, then the payload):
request  JSON {"template": str, "context": {...}, "cpu_s": float}
reply    JSON header, b"\\n", the rendered text in UTF-8 (surrogatepass) when header["ok"]
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from typing import Any

from . import settings
from .errors import UsageError
from .untrusted import printable

MAX_TEMPLATE_CHARS = 256 * 1024
MAX_OUTPUT_CHARS = 32 * 1024 * 1024          # the rendered text
MAX_SIZE_ARG = 1 << 20                       # an int argument to a call or a sizing filter (ljust, center, ...)
MAX_RANGE = 100_000                          # jinja2.sandbox.MAX_RANGE: items of one range()
MAX_REPLY_BYTES = 4 * MAX_OUTPUT_CHARS + (1 << 16)
START_TIMEOUT_S = 30.0                       # the worker's start (imports) is not charged to a render
TEMPLATE_CACHE = 8                           # compiled templates the worker keeps (one per plan in use)


class TemplateFailure(UsageError):
    """A template that did not render. kind: syntax (does not parse), raised (its raise_exception),
    forbidden (the sandbox refused an operation), recursion (deeper than Python's stack allows),
    error (any other failure while rendering), output (too long), time, memory (over the budget)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class TemplateRaised(Exception):
    """What a template's `raise_exception(msg)` raises (transformers raises a TemplateError)."""


# ------------------------------------------------------------------------------------------------
# the sandboxed environment (built in the worker only)


def _raise_exception(message: Any) -> None:
    raise TemplateRaised(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _range(*args: int) -> range:
    from jinja2.exceptions import SecurityError

    r = range(*args)
    if len(r) > MAX_RANGE:
        raise SecurityError(f"a range of {len(r)} items is too large (at most {MAX_RANGE})")
    return r


# nodes that load another template: there is no loader, and a chat template must stand alone
_LOADS = {"Include": "{% include %}", "Import": "{% import %}", "FromImport": "{% from ... import %}",
          "Extends": "{% extends %}"}


def _refuse_statically(ast) -> None:
    """SecurityError for what `ast` (a parsed template) does that no render may: load another file,
    or set a private attribute of a namespace (`{% set ns.__class__ = ... %}`)."""
    from jinja2 import nodes
    from jinja2.exceptions import SecurityError

    for node in ast.find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends, nodes.NSRef)):
        if isinstance(node, nodes.NSRef):
            if node.attr.startswith("_"):
                raise SecurityError(f"setting the private attribute {node.attr[:40]!r} of a namespace (line "
                                    f"{node.lineno})")
            continue
        raise SecurityError(f"{_LOADS[type(node).__name__]} loads another file, which a chat template may not "
                            f"(line {node.lineno})")


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


def environment():
    """jinja2's ImmutableSandboxedEnvironment as transformers' `apply_chat_template` sets it up
    (trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`, `strftime_now`, a `tojson` that
    keeps non-ASCII, `{% generation %}` blocks), so a prompt renders to the same text; plus bounds
    on what allocates in one step: `'x' * n`, `a ** b`, int arguments beyond MAX_SIZE_ARG."""
    from jinja2 import nodes
    from jinja2.exceptions import SecurityError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): the body as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class _Bounded(ImmutableSandboxedEnvironment):
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

        def unsafe_undefined(self, obj, attribute):
            raise SecurityError(f"access to attribute {str(attribute)[:40]!r} of {type(obj).__name__!r} object "
                                "is unsafe")

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
    env.globals["range"] = _range
    env.globals["strftime_now"] = _strftime_now
    return env


def _one_line(e: BaseException) -> str:
    """The error as one line of printable text (a template's own message may hold anything)."""
    return printable(" ".join(str(e).split()) or e.__class__.__name__)


# ------------------------------------------------------------------------------------------------
# the worker process


def _render_job(env, cache: dict, job: dict) -> tuple[dict, list[bytes]]:
    """(reply header, the text's UTF-8 pieces) of one request; every failure is a header."""
    from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError

    text = job["template"]
    try:
        compiled = cache.get(text)
        if compiled is None:
            ast = env.parse(text)
            _refuse_statically(ast)
            compiled = env.from_string(ast)
            cache[text] = compiled
            while len(cache) > TEMPLATE_CACHE:
                del cache[next(iter(cache))]
    except MemoryError:
        return {"ok": False, "kind": "memory"}, []
    except SecurityError as e:
        return {"ok": False, "kind": "forbidden", "message": _one_line(e)}, []
    except TemplateSyntaxError as e:
        return {"ok": False, "kind": "syntax", "message": f"{_one_line(e.message or e)} (line {e.lineno})"}, []
    except Exception as e:     # RecursionError on deep nesting, Python's compiler refusing the code, ...
        return {"ok": False, "kind": "syntax", "message": f"{e.__class__.__name__}: {_one_line(e)}"}, []
    parts: list[bytes] = []
    size = 0
    try:
        for chunk in compiled.generate(**job["context"]):
            size += len(chunk)
            if size > MAX_OUTPUT_CHARS:
                return {"ok": False, "kind": "output"}, []
            parts.append(chunk.encode("utf-8", "surrogatepass"))
    except MemoryError:
        parts.clear()
        return {"ok": False, "kind": "memory"}, []
    except TemplateRaised as e:
        return {"ok": False, "kind": "raised", "message": _one_line(e)}, []
    except SecurityError as e:
        return {"ok": False, "kind": "forbidden", "message": _one_line(e)}, []
    except TemplateError as e:
        return {"ok": False, "kind": "error", "message": _one_line(e)}, []
    except RecursionError as e:
        return {"ok": False, "kind": "recursion", "message": f"RecursionError: {_one_line(e)}"}, []
    except Exception as e:     # the template's own fault: TypeError, ZeroDivisionError, RecursionError, ...
        return {"ok": False, "kind": "error", "message": f"{e.__class__.__name__}: {_one_line(e)}"}, []
    return {"ok": True}, parts


def _write_frame(out, header: dict, parts: list[bytes]) -> None:
    head = json.dumps(header).encode() + b"\n"
    out.write((len(head) + sum(map(len, parts))).to_bytes(8, "big"))
    out.write(head)
    for p in parts:
        out.write(p)
    out.flush()


def _serve(memory_mib: int) -> None:
    """The worker's loop: read a request, render it, reply; return at end of input."""
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)      # a Ctrl-C is the parent's to handle
    inp, out = os.fdopen(0, "rb"), os.fdopen(1, "wb")
    sys.stdout = sys.stderr                           # nothing else may write into the replies
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]        # only ever lowered
        cap = memory_mib << 20 if hard == resource.RLIM_INFINITY else min(memory_mib << 20, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        env = environment()
        env.from_string("{{ x }}").render(x=1)          # the lazy imports of a first render, inside the cap
    except BaseException as e:   # noqa: B036 - told to the parent, which says what failed
        _write_frame(out, {"ok": False, "kind": "start", "message": f"{e.__class__.__name__}: {_one_line(e)}"}, [])
        return
    _write_frame(out, {"ok": True}, [])
    cache: dict = {}
    while True:
        n = inp.read(8)
        if len(n) < 8:
            return
        job = json.loads(inp.read(int.from_bytes(n, "big")).decode("utf-8", "surrogatepass"))
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        resource.setrlimit(resource.RLIMIT_CPU, (int(used + job["cpu_s"]) + 1, resource.RLIM_INFINITY))
        header, parts = _render_job(env, cache, job)
        _write_frame(out, header, parts)
        del parts       # not held while waiting for the next request


# The worker imports the package from where this process found it, whatever the install.
_BOOT = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
         "from strata_compiler.template_sandbox import _serve; _serve(int(sys.argv[2]))")
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Gone(Exception):
    """The worker closed its pipes (it died) before the reply was complete."""


class _Late(Exception):
    """The deadline passed before the reply was complete."""


class _Worker:
    """One worker process and its pipes (both non-blocking; every wait is a poll with a deadline)."""

    def __init__(self, memory_mib: int):
        self.memory_mib = memory_mib
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOT, json.dumps([_PACKAGE_PARENT, *map(str, sys.path)]), str(memory_mib)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        os.set_blocking(self.proc.stdin.fileno(), False)
        os.set_blocking(self.proc.stdout.fileno(), False)
        try:
            header, _ = self.exchange(b"", time.monotonic() + START_TIMEOUT_S)
        except (_Gone, _Late):
            header = {"ok": False, "message": f"it {self.close()}"}
        if not header["ok"]:
            self.close()
            raise UsageError(f"the chat template renderer could not start with template_memory={memory_mib} MiB "
                             f"({header['message']}); check STRATA_TEMPLATE_MEMORY")

    def exchange(self, request: bytes, deadline: float) -> tuple[dict, memoryview]:
        """Send `request` (b"": nothing) and read one reply frame by `deadline`."""
        wfd, rfd = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        data = memoryview(request)
        poll = select.poll()
        poll.register(rfd, select.POLLIN)
        if data:
            poll.register(wfd, select.POLLOUT)
        buf, want = bytearray(), 8
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Late
            for fd, _ in poll.poll(left * 1000):
                if fd == wfd:
                    try:
                        data = data[os.write(wfd, data[:1 << 20]):]
                    except BlockingIOError:
                        continue
                    except OSError:
                        raise _Gone from None
                    if not data:
                        poll.unregister(wfd)
                    continue
                try:
                    chunk = os.read(rfd, min(want - len(buf), 1 << 22))
                except BlockingIOError:
                    continue
                if not chunk:
                    raise _Gone
                buf += chunk
                if want == 8 and len(buf) == 8:
                    want = 8 + int.from_bytes(buf, "big")
                    if not 8 < want <= 8 + MAX_REPLY_BYTES:
                        raise _Gone
                if len(buf) == want:
                    cut = buf.index(b"\n", 8)
                    return json.loads(bytes(buf[8:cut])), memoryview(buf)[cut + 1:]

    def close(self) -> str:
        """Kill and reap the worker; how it ended, in words."""
        if self.proc.poll() is None:
            self.proc.kill()
        rc = self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        if rc >= 0:
            return f"exited with status {rc}"
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"


_LOCK = threading.Lock()
_WORKER: _Worker | None = None


def _after_fork() -> None:
    """A forked child starts without a worker (the pipes are the parent's)."""
    global _LOCK, _WORKER
    _LOCK, _WORKER = threading.Lock(), None


def _at_exit() -> None:
    """Let the worker go with this process: its input closes, it returns, it is reaped."""
    if _WORKER is not None:
        _WORKER.proc.stdin.close()
        try:
            _WORKER.proc.wait(1)
        except subprocess.TimeoutExpired:
            pass
        _WORKER.close()


os.register_at_fork(after_in_child=_after_fork)
atexit.register(_at_exit)


def render(template: str, context: dict, name: str = "the chat template", timeout: float | None = None) -> str:
    """`template` rendered with `context` (JSON-able values) in the worker, within the budget of
    the settings `template_timeout` and `template_memory` (`timeout`: seconds, less than the
    setting, where the caller has spent part of its budget on earlier renders). Raises
    TemplateFailure, one line that begins with `name`, on anything wrong; the worker is replaced
    after a timeout or a crash."""
    global _WORKER
    if not isinstance(template, str) or len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateFailure("syntax", f"{name} is not a string of at most {MAX_TEMPLATE_CHARS // 1024} KiB")
    budget, memory = float(settings.get("template_timeout")), int(settings.get("template_memory"))
    timeout = budget if timeout is None else min(budget, timeout)
    if timeout <= 0:
        raise TemplateFailure("time", f"{name} took longer than {budget:g} s to render (the budget: setting "
                                      f"template_timeout, STRATA_TEMPLATE_TIMEOUT); refusing it")
    request = json.dumps({"template": template, "context": context, "cpu_s": timeout},
                         ensure_ascii=False).encode("utf-8", "surrogatepass")
    with _LOCK:
        if _WORKER is not None and (_WORKER.memory_mib != memory or _WORKER.proc.poll() is not None):
            _WORKER.close()
            _WORKER = None
        if _WORKER is None:
            _WORKER = _Worker(memory)
        worker = _WORKER
        try:
            header, body = worker.exchange(len(request).to_bytes(8, "big") + request, time.monotonic() + timeout)
        except _Late:
            _WORKER = None
            worker.close()
            raise TemplateFailure("time", f"{name} took longer than {timeout:g} s to render (the budget: setting "
                                          f"template_timeout, STRATA_TEMPLATE_TIMEOUT); refusing it") from None
        except _Gone:
            _WORKER = None
            ended = worker.close()
            if ended.endswith("SIGXCPU"):
                raise TemplateFailure("time", f"{name} used more than {timeout:g} s of CPU time to render; "
                                              f"refusing it") from None
            header = {"ok": False, "kind": "memory", "ended": ended}
        except BaseException:     # a KeyboardInterrupt mid-exchange: the pipes' state is unknown
            _WORKER = None
            worker.close()
            raise
        if header["ok"]:
            return str(body, "utf-8", "surrogatepass")
        if header["kind"] == "memory":
            if _WORKER is worker:     # a worker past a MemoryError is not reused
                _WORKER = None
                worker.close()
    kind, detail = header["kind"], header.get("message", "")
    message = {
        "syntax": f"{name} does not parse: {detail}",
        "raised": f"{name} failed: {detail}",
        "forbidden": f"{name} did something the sandbox forbids ({detail})",
        "error": f"{name} failed: {detail}",
        "recursion": f"{name} recursed deeper than the renderer allows ({detail}); refusing it",
        "output": f"{name} produced more than {MAX_OUTPUT_CHARS} characters; refusing it",
        "memory": (f"{name} stopped its renderer, which {header['ended']}: most likely" if "ended" in header
                   else f"{name}") + f" used more than its memory budget of {memory} MiB (setting "
                                     f"template_memory, STRATA_TEMPLATE_MEMORY); refusing it",
    }[kind]
    raise TemplateFailure(kind, message)
