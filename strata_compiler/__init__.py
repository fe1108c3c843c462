"""Strata: a compiler and runtime for Mixture-of-Experts language models."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"

# passes/, backends/ and runtime/ sit beside this package in the source tree and install as its
# subpackages (pyproject's package-dir). An install maps them; this finder does the same when
# the code runs straight from a checkout, or when an editable install's own finder loses to the
# checkout on sys.path (as with some setuptools versions). It is consulted only after the
# regular import machinery found nothing, and only for these three names.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SIBLINGS = ("passes", "backends", "runtime")


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        head, _, sub = fullname.partition(".")
        if head != __name__ or sub not in _SIBLINGS:
            return None
        init = os.path.join(_ROOT, sub, "__init__.py")
        if not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(fullname, init,
                                                      submodule_search_locations=[os.path.dirname(init)])


if not any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
    sys.meta_path.append(_SourceTreeFinder())
