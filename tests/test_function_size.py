"""Product functions stay small enough to read: none over MAX_LINES lines (a nested function counts
on its own, inside its parent's count too), except kernel templates — the llvm backend's IR
generators (backends/llvm_cpu/codegen/) and the Pallas kernel bodies (backends/xla/pallas_*.py,
functions named *_kernel), whose length is the kernel's."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("strata_compiler", "passes", "backends", "runtime")
MAX_LINES = 80


def _template(path: Path, name: str) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    return rel.startswith("backends/llvm_cpu/codegen/") or (
        rel.startswith("backends/xla/pallas_") and name.endswith("_kernel"))


def test_no_product_function_is_longer_than_80_lines():
    long = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _template(path, node.name):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "functions over 80 lines (split them):\n" + "\n".join(long)
