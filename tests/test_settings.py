"""The settings registry: parsing, overrides, and that the product reads no setting it does not
declare and no environment variable except through the registry."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from strata_compiler import settings
from strata_compiler.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("strata_compiler", "passes", "backends", "runtime")


def _product_files() -> list[Path]:
    return [p for d in PRODUCT for p in sorted((ROOT / d).rglob("*.py"))]


def test_defaults_and_parsing(monkeypatch):
    assert settings.get("pallas_tune") == (32, 4, 4, 4)
    monkeypatch.setenv("STRATA_PALLAS_TUNE", "16,8,2,2")
    assert settings.get("pallas_tune") == (16, 8, 2, 2)
    monkeypatch.setenv("STRATA_HAND_OFF_SPIN_US", "250")
    assert settings.get("hand_off_spin_us") == (250.0, 250.0)
    monkeypatch.setenv("STRATA_HAND_OFF_SPIN_US", "0,1000")
    assert settings.get("hand_off_spin_us") == (0.0, 1000.0)
    monkeypatch.setenv("STRATA_XLA_EXECUTABLES", "off")
    assert settings.get("xla_executables") is False
    monkeypatch.setenv("STRATA_CPU_ACT", "F32")
    assert settings.get("cpu_act") == "f32"


def test_every_default_parses_from_its_own_text():
    """A default a user could not set back (e.g. a kernel's 3 pipeline stages) is a declaration bug."""
    for name in settings.names():
        s = settings.declared(name)
        if s.default is None or s.default == "":
            continue
        assert s.parse(s.shown_default()) == s.default, name


@pytest.mark.parametrize("name,raw", [
    ("pallas_tune", "3,4,4,4"), ("pallas_tune", "32,4"), ("num_threads", "0"), ("num_threads", "x"),
    ("hand_off_spin_us", "-1"), ("hand_off_spin_us", "1,2,3"), ("swap_margin", "nan"),
    ("xla_executables", "maybe"), ("cpu_act", "f16"), ("pallas_gemm_tune", "64,128,4,3,3"),
    ("pallas_flash_tune", "128,64,8,0"),
])
def test_bad_values_are_one_line_naming_the_variable(monkeypatch, name, raw):
    s = settings.declared(name)
    monkeypatch.setenv(s.env, raw)
    with pytest.raises(UsageError) as e:
        settings.get(name)
    msg = str(e.value)
    assert msg.startswith(s.env + "=") and "\n" not in msg and "default" in msg


def test_nul_in_a_path_is_refused():
    with pytest.raises(UsageError, match="STRATA_CACHE_DIR"):
        settings.declared("cache_dir").parse("a\0b")


def test_override_beats_environment_and_is_undone(monkeypatch):
    monkeypatch.setenv("STRATA_CACHE_SWAPS", "3")
    with settings.override(cache_swaps=0):
        assert settings.get("cache_swaps") == 0
        with settings.override(cache_swaps="2"):
            assert settings.get("cache_swaps") == 2
        assert settings.get("cache_swaps") == 0
    assert settings.get("cache_swaps") == 3


def test_unknown_setting_is_a_programming_error():
    with pytest.raises(KeyError):
        settings.get("no_such_setting")
    with pytest.raises(KeyError):
        settings.environ("STRATA_NUM_THREADS")


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "c"))
    assert settings.cache_root() == tmp_path / "c"
    monkeypatch.delenv("STRATA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert settings.cache_root() == tmp_path / "strata"


def test_product_names_only_declared_variables():
    declared = {s.env for s in settings.SETTINGS}
    found: dict[str, list[str]] = {}
    for p in _product_files():
        for name in re.findall(r"\bSTRATA_[A-Z0-9_]*[A-Z0-9]\b", p.read_text()):
            if name not in declared:
                found.setdefault(name, []).append(str(p.relative_to(ROOT)))
    assert not found, f"undeclared STRATA_* names in product code: {found}"


def test_environment_is_read_only_through_the_registry():
    readers = [str(p.relative_to(ROOT)) for p in _product_files()
               if p.name != "settings.py" and re.search(r"\bos\.environ\b|\bos\.getenv\b|\bgetenv\(", p.read_text())]
    assert not readers, f"product code reading the environment outside strata_compiler/settings.py: {readers}"


def test_readme_documents_at_most_eight_variables():
    names = set(re.findall(r"\bSTRATA_[A-Z0-9_]*[A-Z0-9]\b", (ROOT / "README.md").read_text()))
    user = {s.env for s in settings.SETTINGS if s.user}
    assert names <= user and len(user) <= 8, sorted(names - user)


def test_reference_document_is_generated():
    out = subprocess.run([sys.executable, "-m", "strata_compiler.settings"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert (ROOT / "docs" / "settings.md").read_text() == out, "regenerate: python -m strata_compiler.settings > docs/settings.md"
