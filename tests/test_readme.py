"""README.md's Python example runs as written (on the demo plan `make run` leaves in demo/plan,
compiled here into a temporary folder), also from a folder that holds a folder named `strata` when
the checkout is installed as `make` installs it; every local link in README points at a file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return next(b for b in blocks if "import strata" in b)


def test_python_api_example_runs_as_written(tiny_int8_plan, tmp_path):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "plan").symlink_to(tiny_int8_plan, target_is_directory=True)
    r = subprocess.run([sys.executable, "-c", _example()], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(r.stdout.strip().splitlines()) >= 2


def test_a_folder_named_strata_does_not_shadow_the_api(tiny_int8_plan, tmp_path):
    """`make` installs the checkout as a path entry (editable_mode=compat): there `import strata`
    finds strata.py before a namespace package made of ./strata (a plan folder, the clone seen from
    its parent). The default editable finder runs after that namespace package is made."""
    assert "editable_mode=compat" in (ROOT / "Makefile").read_text()
    (tmp_path / "strata").mkdir()               # a plan compiled into ./strata, say
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "plan").symlink_to(tiny_int8_plan, target_is_directory=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))         # the checkout as a path entry, as compat's .pth
    r = subprocess.run([sys.executable, "-c", "import strata; print(strata.__file__)\n" + _example()],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[0] == str(ROOT / "strata.py")


def test_readme_links_exist():
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#:]+)\)", text):
        assert (ROOT / target).exists(), target
