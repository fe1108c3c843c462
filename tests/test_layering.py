"""The layers of ARCHITECTURE.md, enforced: every import in product code points down.

core (strata_compiler/) <- frontend <- passes;  core <- backends <- runtime;  every layer <- entry
(the `stratac` CLI and the compile driver).  The test reads every product file's syntax tree, so
an import inside a function (or under `if TYPE_CHECKING:`) counts as much as one at the top, and
relative imports are resolved (`from . import x` to the module x), and a string that is exactly a
product module's name (`"strata_compiler.cli"`, or `"module:attr"`) counts as an import of it: that
is how importlib.import_module and console-script launchers import. It fails on a forbidden import
(printed as `file:line module -> module`), on a cycle between packages, on a cycle between modules
(file level, every import above counted, those only for annotations included) and on a private
member (`_name`) used across packages.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
NS = "strata_compiler"
# where each installed package lives in the repository (pyproject's package-dir)
SOURCES = {NS: ROOT / NS, f"{NS}.passes": ROOT / "passes", f"{NS}.backends": ROOT / "backends",
           f"{NS}.runtime": ROOT / "runtime"}

# The layers each package may import (besides itself).
ALLOWED = {
    "core": {"core"},
    "frontend": {"core"},
    "passes": {"core", "frontend"},
    "backends": {"core"},
    "runtime": {"core", "backends"},
    "entry": {"core", "frontend", "passes", "backends", "runtime"},
}

# The entry layer, above every other and imported by none: the `stratac` CLI and the compile driver
# it runs (the pass list; the frontend in, the hardware probe and the --calib plan for the passes).
# Their files sit in strata_compiler/, so they are named here. `strata-run`'s and `strata-server`'s
# CLIs (runtime/cli.py, runtime/server_cli.py) keep to the runtime's rules. runtime/entry.py is the
# console scripts' launcher (pyproject's [project.scripts] names it for stratac, strata-run and
# strata-server): it imports each command's module by name, the `stratac` CLI included, so it is an
# entry point too, whatever folder it sits in.
ENTRY_POINTS = {f"{NS}.cli", f"{NS}.driver", f"{NS}.runtime.entry"}

# The one import across the rules: the calibration probe runs the model on the reference backend.
EXCEPTIONS = {(f"{NS}.passes.calibrate", f"{NS}.backends.reference")}

# Inside backends/: each backend (a subpackage) imports its own modules and the ground. The
# package level (backends/__init__.py naming and choosing the backends, backends/probe.py
# measuring a host with them) may import every backend. One backend may use another only where
# its work is that backend's: the xla backend's host calls run the llvm backend's JIT-compiled
# kernels (and its host-call handler is LLVM IR the llvm backend compiles). Never both ways.
CROSS_BACKEND = {("xla", "llvm_cpu")}


def _modules() -> dict[str, Path]:
    """Every product module by its import name."""
    out = {}
    for pkg, src in SOURCES.items():
        for path in sorted(src.rglob("*.py")):
            rel = path.relative_to(src).with_suffix("")
            parts = list(rel.parts)
            if pkg == NS and parts[0] in ("passes", "backends", "runtime"):
                continue      # not product code there (no such folders under strata_compiler/)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = path
    return out


MODULES = _modules()


def layer(mod: str) -> str | None:
    """The layer of an internal module name; None for anything outside the product."""
    if mod != NS and not mod.startswith(NS + "."):
        return None
    if mod in ENTRY_POINTS:
        return "entry"
    for sub in ("frontend", "passes", "backends", "runtime"):
        if mod == f"{NS}.{sub}" or mod.startswith(f"{NS}.{sub}."):
            return sub
    return "core"


def backend_of(mod: str) -> str | None:
    """`reference`, `llvm_cpu`, `xla` for a module inside one backend (a subpackage of backends/);
    None for the package level (backends/__init__.py and the modules beside it) and elsewhere."""
    parts = mod.split(".")
    if len(parts) < 3 or parts[1] != "backends":
        return None
    return parts[2] if (SOURCES[f"{NS}.backends"] / parts[2]).is_dir() else None


def _is_package(mod: str) -> bool:
    return MODULES.get(mod, Path()).name == "__init__.py"


def _pkg_of(mod: str) -> str:
    """The package a module's relative imports start from."""
    return mod if _is_package(mod) else mod.rpartition(".")[0]


@functools.cache
def tree(mod: str) -> ast.Module:
    """A product module's syntax tree (parsed once for every check)."""
    return ast.parse(MODULES[mod].read_text(), str(MODULES[mod]))


def imports(mod: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in `mod`, anywhere in the file."""
    return imports_in(tree(mod), _pkg_of(mod))


def _from_target(node: ast.ImportFrom, pkg: str) -> str:
    """The module a `from ... import` reads from, relative imports resolved against `pkg`."""
    if not node.level:
        return node.module
    base = pkg.split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_in(source: str | ast.Module, pkg: str) -> list[tuple[int, str]]:
    """imports() of a module's source (or tree); `pkg`: the package it is in (relative imports
    start there)."""
    out = []
    for node in ast.walk(ast.parse(source) if isinstance(source, str) else source):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, pkg)
            for a in node.names:        # `from pkg import submodule` imports the submodule
                sub = f"{target}.{a.name}"
                out.append((node.lineno, sub if sub in MODULES else target))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
            name = node.value.partition(":")[0]      # importlib.import_module("m"), "m:attr"
            if name in MODULES:
                out.append((node.lineno, name))
    return out


def _allowed(src: str, dst: str) -> bool:
    a, b = layer(src), layer(dst)
    if b is None or (a == b and a != "backends"):
        return True
    if any(src == s and (dst == d or dst.startswith(d + ".")) for s, d in EXCEPTIONS):
        return True
    if a == b == "backends":
        sa, sb = backend_of(src), backend_of(dst)
        return sa is None or sb is None or sa == sb or (sa, sb) in CROSS_BACKEND
    return b in ALLOWED[a]


def _edges():
    """(module, line, imported internal module) over product code; one per line and target."""
    for mod in sorted(MODULES):
        for line, dst in sorted(set(imports(mod))):
            if layer(dst) is not None:
                yield mod, line, dst


def _where(mod: str, line: int) -> str:
    return f"{MODULES[mod].relative_to(ROOT)}:{line}"


def test_every_product_module_is_found():
    assert f"{NS}.ir" in MODULES and f"{NS}.passes.emit" in MODULES
    assert f"{NS}.backends.reference.executor" in MODULES and f"{NS}.runtime.session" in MODULES
    assert layer(f"{NS}.frontend.hf") == "frontend" and layer(f"{NS}.plan_format") == "core"
    assert layer(f"{NS}.driver") == "entry" and layer(f"{NS}.runtime.entry") == "entry"
    assert all(m in MODULES for m in ENTRY_POINTS)


def test_finds_every_kind_of_import():
    source = ("import numpy\nfrom .session import Session\n\n\ndef f():\n"
              "    from ..passes import emit\n    import strata_compiler.frontend.hf\n"
              "    from strata_compiler import plan_format\n"
              "    importlib.import_module('strata_compiler.driver')\n"
              "    run('strata_compiler.cli:main', 'strata_compiler', 'a.b')\n")
    got = imports_in(source, f"{NS}.runtime")          # as if in runtime/x.py
    assert got == [(1, "numpy"), (2, f"{NS}.runtime.session"), (6, f"{NS}.passes.emit"),
                   (7, f"{NS}.frontend.hf"), (8, f"{NS}.plan_format"), (9, f"{NS}.driver"),
                   (10, f"{NS}.cli")]
    assert [_allowed(f"{NS}.runtime.x", dst) for _, dst in got] == [True, True, False, False, True, False,
                                                                     False]


def test_the_rules():
    ok = [("ir", "errors"), ("frontend.hf", "ir"), ("passes.place", "frontend.hf"), ("passes.emit", "plan_format"),
          ("passes.calibrate", "backends.reference.executor"), ("backends.xla.host_call", "backends.llvm_cpu.jit"),
          ("backends.probe", "backends.xla.device"), ("runtime.session", "backends.xla.executor"),
          ("cli", "driver"), ("driver", "passes.emit"), ("driver", "frontend.hf"), ("cli", "runtime.plan")]
    bad = [("ir", "passes.emit"), ("frontend.hf", "passes.emit"), ("passes.laq", "backends.reference.executor"),
           ("passes.emit", "runtime.plan"), ("backends.xla.executor", "runtime.session"),
           ("backends.llvm_cpu.executor", "backends.xla.cuda_rt"), ("backends.reference.executor", "passes.emit"),
           ("runtime.session", "passes.emit"), ("runtime.session", "frontend.hf"),
           ("ir", "driver"), ("pass_manager", "cli"), ("passes.emit", "driver"), ("runtime.session", "driver"),
           ("backends.probe", "cli")]
    assert all(_allowed(f"{NS}.{a}", f"{NS}.{b}") for a, b in ok)
    assert not any(_allowed(f"{NS}.{a}", f"{NS}.{b}") for a, b in bad)


def test_imports_point_down():
    bad = [f"{_where(src, line)} {src} -> {dst}" for src, line, dst in _edges() if not _allowed(src, dst)]
    if bad:
        pytest.fail(f"{len(bad)} imports break the layers (ARCHITECTURE.md):\n" + "\n".join(bad), pytrace=False)


def _unit(mod: str) -> str:
    """The node of the package graph: a layer; inside backends/, each backend and each
    package-level module on its own (their imports among each other must not loop either)."""
    if layer(mod) != "backends" or mod == f"{NS}.backends":
        return layer(mod)
    return "backends." + (backend_of(mod) or mod.split(".")[2])


def test_no_cycle_between_packages():
    g = nx.DiGraph()
    where = {}
    for src, line, dst in _edges():
        a, b = _unit(src), _unit(dst)
        if a != b:
            g.add_edge(a, b)
            where.setdefault((a, b), f"{_where(src, line)} {src} -> {dst}")
    msg = []
    for scc in nx.strongly_connected_components(g):
        if len(scc) > 1:
            msg.append("cycle among " + ", ".join(sorted(scc)) + ":")
            msg += [f"    {where[e]}" for e in sorted(g.subgraph(scc).edges)]
    if msg:
        pytest.fail("import cycles between packages:\n" + "\n".join(msg), pytrace=False)


def module_cycles(edges) -> list[str]:
    """The cycles of the module graph of `edges` ((module, where, imported module)): per strongly
    connected component of more than one module, a line naming them and one per import inside it.
    An import counts towards the module it names (a package: its __init__.py); the parent packages
    Python initialises first do not count (a package's __init__.py may name its own modules)."""
    g = nx.DiGraph()
    where = {}
    for src, at, dst in edges:
        if src != dst:
            g.add_edge(src, dst)
            where.setdefault((src, dst), f"{at} {src} -> {dst}")
    msg = []
    for scc in sorted(nx.strongly_connected_components(g), key=min):
        if len(scc) > 1:
            msg.append("cycle among " + ", ".join(sorted(scc)) + ":")
            msg += [f"    {where[e]}" for e in sorted(g.subgraph(scc).edges)]
    return msg


def test_finds_a_module_cycle():
    edges = [("a.x", "x.py:3", "a.y"), ("a.y", "y.py:9", "a.z"), ("a.z", "z.py:2", "a.x"), ("a.z", "z.py:4", "a.w"),
             ("a.w", "w.py:1", "a.w")]
    assert module_cycles(edges) == ["cycle among a.x, a.y, a.z:", "    x.py:3 a.x -> a.y",
                                    "    y.py:9 a.y -> a.z", "    z.py:2 a.z -> a.x"]
    assert module_cycles(edges[1:]) == []


def test_no_cycle_between_modules():
    """No product module imports itself through others, an import only for annotations included:
    a cycle ties its modules into one and makes their import order matter. To break one, move what
    both need into a module below them, or declare there (a Protocol) what the lower module uses of
    the upper one and let the upper one pass itself in."""
    msg = module_cycles((src, _where(src, line), dst) for src, line, dst in _edges() if dst in MODULES)
    if msg:
        pytest.fail("import cycles between modules:\n" + "\n".join(msg), pytrace=False)


# ------------------------------------------------------------------------------------------------
# private members stay in their package


def _package(mod: str) -> str:
    """The unit that owns a private name: a backend, the backends' package level, or a layer."""
    return f"backends.{backend_of(mod)}" if backend_of(mod) else (layer(mod) or mod)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _defined(body: list) -> set[str]:
    """The names a module's or a class's body defines (def, class, assignment, import as), through
    its if / try / with / for blocks and nested classes; not the locals of its functions."""
    names = set()
    for n in body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                names |= {e.id for e in ast.walk(t) if isinstance(e, ast.Name)}
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).partition(".")[0] for a in n.names}
        if not isinstance(n, _SCOPES):
            names |= _defined([c for c in ast.iter_child_nodes(n) if isinstance(c, (ast.stmt, ast.excepthandler))])
    return names


def _owners(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Private name -> the packages defining it: at module level, in a class (one inside a function
    too), or as `self.` / `cls.` attributes."""
    owners: dict[str, set[str]] = {}
    for m, t in trees.items():
        names = _defined(t.body)
        for n in ast.walk(t):
            if isinstance(n, ast.ClassDef):
                names |= _defined(n.body)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _on_self(n.value):
                names.add(n.attr)
        for name in filter(_private, names):
            owners.setdefault(name, set()).add(_package(m))
    return owners


def _on_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _attribute_uses(tree: ast.Module):
    """(line, name) of every private attribute read or written on something other than self / cls:
    `obj._name`, and getattr / hasattr / setattr / delattr(obj, "_name")."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and _private(n.attr) and not _on_self(n.value):
            yield n.lineno, n.attr
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and len(n.args) >= 2 and \
                n.func.id in ("getattr", "hasattr", "setattr", "delattr") and not _on_self(n.args[0]) and \
                isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str) and _private(n.args[1].value):
            yield n.lineno, n.args[1].value


def _private_imports(mod: str, tree: ast.Module):
    """(line, what) for every import of a private name or module from another package."""
    mine = _package(mod)
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            target = _from_target(n, _pkg_of(mod))
            for a in n.names:
                sub = f"{target}.{a.name}"
                owner = sub if sub in MODULES else target
                if layer(owner) is not None and _package(owner) != mine and \
                        (_private(a.name) or any(map(_private, target.split(".")))):
                    yield n.lineno, f"imports {a.name} from {target}"
        elif isinstance(n, ast.Import):
            for a in n.names:
                if layer(a.name) is not None and _package(a.name) != mine and any(map(_private, a.name.split("."))):
                    yield n.lineno, f"imports {a.name}"


def private_crossings(trees: dict[str, ast.Module]) -> list[tuple[str, int, str]]:
    """(module, line, what) for every private member one package uses of another: `from m import
    _name` (or a private module) where m is in another package; `obj._name` (obj not self/cls; and
    getattr(obj, "_name") and the like) where `_name` is defined (at module or class level, or as
    a self. / cls. attribute) only in other packages than the one using it. An approximation of
    the objects' types: a name private in the user's own package too is not flagged."""
    owners = _owners(trees)
    out = []
    for m, t in trees.items():
        mine = _package(m)
        out += [(m, line, what) for line, what in _private_imports(m, t)]
        out += [(m, line, f"uses {name} of {', '.join(sorted(owners[name]))}") for line, name in _attribute_uses(t)
                if owners.get(name) and mine not in owners[name]]
    return sorted(out)


def test_finds_a_private_crossing():
    xla, fused, session = f"{NS}.backends.xla.executor", f"{NS}.runtime.fused_step", f"{NS}.runtime.session"
    sources = {xla: "_CACHE = {}\nclass X:\n    _slots = 2\n    def _flat(self):\n        self._n = 1\n",
               fused: ("from ..backends.xla.executor import _CACHE\nfrom strata_compiler.backends.xla import _aot\n"
                       "def f(exe):\n    _n = exe._flat()\n    return getattr(exe, '_slots'), exe._n\n"),
               session: ("from .fused_step import _g\nclass S:\n    def _slots(self):\n"
                         "        return self._flat, cls._flat, other._slots, getattr(self, '_flat')\n")}
    found = private_crossings({m: ast.parse(s) for m, s in sources.items()})
    assert found == [(fused, 1, f"imports _CACHE from {NS}.backends.xla.executor"),
                     (fused, 2, f"imports _aot from {NS}.backends.xla"),
                     (fused, 4, "uses _flat of backends.xla"),
                     (fused, 5, "uses _n of backends.xla")]      # a function's local `_n` shields nothing
    # _slots is the runtime's own name too (S._slots): not flagged, the approximation's blind spot


def test_no_private_member_crosses_a_package():
    """The runtime drives backends through their public surface (strata_compiler/execution.py and
    each backend's public methods), never their private members; nor does one backend or layer
    reach into another's. To fix one, give the thing a public name in its owner (or move the code
    that needs it to the owner's package)."""
    found = [f"{_where(m, line)} {m} {what}" for m, line, what in private_crossings({m: tree(m) for m in MODULES})]
    if found:
        pytest.fail(f"{len(found)} private members used across packages:\n" + "\n".join(found), pytrace=False)


def test_a_traced_mixed_run_keeps_the_layers(tmp_path):
    """What the static checks above cannot see, watched while it runs: a mixed plan (experts on the
    llvm CPU backend, the rest on xla) prefills and decodes under sys.setprofile, and no backend
    function calls a runtime function, and no private function (`_name`) is called from another
    package."""
    import sys

    import numpy as np

    from strata_compiler.cli import stratac
    from strata_compiler.cli_common import run_cli
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.runtime.session import Session

    plan_dir = tmp_path / "plan"
    assert run_cli(stratac, ["compile", str(ROOT / "examples" / "models" / "tiny-moe"), "-o", str(plan_dir),
                             "--quant", "int4", "--place", "experts=cpu,all=gpu"]) == 0
    session = Session(load_plan(plan_dir), "auto", device="cpu")
    assert {kind for kind, _, _ in session.executor.parts} == {"llvm", "xla"}
    roots = {str(ROOT / d) + "/": d for d in ("strata_compiler", "passes", "backends", "runtime")}

    def package(code) -> str | None:
        return next((d for r, d in roots.items() if code.co_filename.startswith(r)), None)

    upward, private, seen = set(), set(), set()

    def watch(frame, event, _arg) -> None:
        if event != "call" or frame.f_back is None:
            return
        callee, caller = frame.f_code, frame.f_back.f_code
        a, b = package(caller), package(callee)
        if a is None or b is None:
            return
        seen.add((a, b))
        where = f"{caller.co_filename}:{caller.co_name} -> {callee.co_filename}:{callee.co_name}"
        if a == "backends" and b == "runtime":
            upward.add(where)
        if a != b and callee.co_name.startswith("_") and not callee.co_name.startswith("__"):
            private.add(where)

    sys.setprofile(watch)
    try:
        session.generate(np.array([[3, 5, 7, 11]], np.int64), 8, Sampler())
    finally:
        sys.setprofile(None)
    assert ("runtime", "backends") in seen          # the watch saw the runtime drive the backends
    assert not upward, sorted(upward)
    assert not private, sorted(private)
