"""The layers of ARCHITECTURE.md, enforced: every import in product code points down.

core (strata_compiler/) <- frontend <- passes;  core <- backends <- runtime;  every layer <- entry
(the `stratac` CLI and the compile driver).  The test reads every product file's syntax tree, so
an import inside a function (or under `if TYPE_CHECKING:`) counts as much as one at the top, and
relative imports are resolved (`from . import x` to the module x). It fails on a forbidden import
(printed as `file:line module -> module`), on a cycle between packages and on a cycle between
modules.
"""

from __future__ import annotations

import ast
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
# CLIs (runtime/cli.py, runtime/server_cli.py) keep to the runtime's rules.
ENTRY_POINTS = {f"{NS}.cli", f"{NS}.driver"}

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


def imports(mod: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in `mod`, anywhere in the file."""
    path = MODULES[mod]
    return imports_in(path.read_text(), mod if _is_package(mod) else mod.rpartition(".")[0], str(path))


def imports_in(source: str, pkg: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """imports() of a module's source; `pkg`: the package it is in (relative imports start there)."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for a in node.names:        # `from pkg import submodule` imports the submodule
                sub = f"{target}.{a.name}"
                out.append((node.lineno, sub if sub in MODULES else target))
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
    assert layer(f"{NS}.driver") == "entry"
    assert all(m in MODULES for m in ENTRY_POINTS)


def test_finds_every_kind_of_import():
    source = ("import numpy\nfrom .session import Session\n\n\ndef f():\n"
              "    from ..passes import emit\n    import strata_compiler.frontend.hf\n"
              "    from strata_compiler import plan_format\n")
    got = imports_in(source, f"{NS}.runtime")          # as if in runtime/x.py
    assert got == [(1, "numpy"), (2, f"{NS}.runtime.session"), (6, f"{NS}.passes.emit"),
                   (7, f"{NS}.frontend.hf"), (8, f"{NS}.plan_format")]
    assert [_allowed(f"{NS}.runtime.x", dst) for _, dst in got] == [True, True, False, False, True]


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


def private_crossings(sources: dict[str, str]) -> list[str]:
    """`obj._name` (obj not self/cls) and `from m import _name` where `_name` is defined (a def,
    a class, a module-level or `self.` assignment) only in other packages than the one using it.
    sources: module name -> its text."""
    trees = {m: ast.parse(s) for m, s in sources.items()}
    owners: dict[str, set] = {}
    for m, tree in trees.items():
        for n in ast.walk(tree):
            names = []
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [n.name]
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and \
                    isinstance(n.value, ast.Name) and n.value.id == "self":
                names = [n.attr]
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                names = [t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)]
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    owners.setdefault(name, set()).add(_package(m))
    out = []
    for m, tree in trees.items():
        mine = _package(m)
        for n in ast.walk(tree):
            used = []
            if isinstance(n, ast.Attribute) and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                used = [n.attr]
            elif isinstance(n, ast.ImportFrom):
                used = [a.name for a in n.names]
            for name in used:
                if name.startswith("_") and not name.startswith("__") and owners.get(name) \
                        and mine not in owners[name]:
                    out.append(f"{m}:{n.lineno} uses {name} of {sorted(owners[name])}")
    return out


def test_finds_a_private_crossing():
    found = private_crossings({f"{NS}.backends.xla.executor": "class X:\n    def _flat(self):\n        pass\n",
                               f"{NS}.runtime.fused_step": "def f(exe):\n    return exe._flat()\n",
                               f"{NS}.runtime.session": "class S:\n    def g(self):\n        return self._flat\n"})
    assert found == [f"{NS}.runtime.fused_step:2 uses _flat of ['backends.xla']"]


def test_no_private_member_crosses_a_package():
    """The runtime drives backends through their public surface (strata_compiler/execution.py and
    each backend's public methods), never their private members; nor does one backend or layer
    reach into another's."""
    found = private_crossings({m: p.read_text() for m, p in MODULES.items()})
    assert not found, "\n".join(found)
