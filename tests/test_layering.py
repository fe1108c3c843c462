"""The layers of ARCHITECTURE.md, enforced: every import in product code points down.

core (strata_compiler/) <- frontend <- passes;  core <- backends <- runtime.  The test reads
every product file's syntax tree, so an import inside a function counts as much as one at the
top, and relative imports are resolved. It fails on a forbidden import (printed as
`file:line module -> module`) and on a cycle between packages.
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
}

# The exemptions: the entry points above every layer, the `stratac` CLI and the pipeline assembly
# (the pass list and the compile driver: frontend in, hardware probe and --calib plan for the
# passes). `strata-run`'s CLI (runtime/cli.py) keeps to the runtime's rules and needs none.
ENTRY_POINTS = {f"{NS}.cli", f"{NS}.pipelines"}

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
    """(module, line, imported internal module) over product code, entry points left out; one per
    line and target."""
    for mod in sorted(MODULES):
        if mod in ENTRY_POINTS:
            continue
        for line, dst in sorted(set(imports(mod))):
            if layer(dst) is not None:
                yield mod, line, dst


def _where(mod: str, line: int) -> str:
    return f"{MODULES[mod].relative_to(ROOT)}:{line}"


def test_every_product_module_is_found():
    assert f"{NS}.ir" in MODULES and f"{NS}.passes.emit" in MODULES
    assert f"{NS}.backends.reference.executor" in MODULES and f"{NS}.runtime.session" in MODULES
    assert layer(f"{NS}.frontend.hf") == "frontend" and layer(f"{NS}.plan_format") == "core"
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
          ("backends.probe", "backends.xla.device"), ("runtime.session", "backends.xla.executor")]
    bad = [("ir", "passes.emit"), ("frontend.hf", "passes.emit"), ("passes.laq", "backends.reference.executor"),
           ("passes.emit", "runtime.plan"), ("backends.xla.executor", "runtime.session"),
           ("backends.llvm_cpu.executor", "backends.xla.cuda_rt"), ("backends.reference.executor", "passes.emit"),
           ("runtime.session", "passes.emit"), ("runtime.session", "frontend.hf")]
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
