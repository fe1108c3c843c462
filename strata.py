"""The Python API of Strata (runtime/api.py):

    import strata
    m = strata.load("plan/")
    print(m.generate("Explain MoE", max_tokens=64))
"""

from strata_compiler.runtime.api import Model, load

__all__ = ["Model", "load"]
