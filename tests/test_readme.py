"""README.md's Python example runs as written (on the demo plan `make run` leaves in demo/plan,
compiled here into a temporary folder), and every local link in README points at a file."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_python_api_example_runs_as_written(tiny_int8_plan, tmp_path):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    example = next(b for b in blocks if "import strata" in b)
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "plan").symlink_to(tiny_int8_plan, target_is_directory=True)
    r = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(r.stdout.strip().splitlines()) >= 2


def test_readme_links_exist():
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#:]+)\)", text):
        assert (ROOT / target).exists(), target
