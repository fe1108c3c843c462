"""A structure-aware fuzzer of plans that RUNS them (issue 29): one structural fact of a valid plan
(a meta.model field, an IR attribute the kernels size memory by, a dimension of a weight or a
result type) is replaced by a drawn value and the container resealed; `strata-run` on the llvm
backend (in process: a crash would take the test run down with it) must either give the original
tokens and logits or end in one `error:` line with a nonzero exit; never a traceback.

Only facts whose every change is either inert or invalid are drawn: numeric attributes such as
eps or rope_theta change a valid model's output and are left alone. STRATA_FUZZ_EXAMPLES sets the
examples per property (CI: 200; ≥ 2000 for a hunt)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_compiler.cli_common import run_cli
from strata_compiler.plan_format import PLAN_MAGIC, Container, write_container
from strata_compiler.runtime.cli import strata_run

FUZZ = settings(max_examples=int(os.environ.get("STRATA_FUZZ_EXAMPLES", "200")), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
META_KEYS = ("n_layers", "n_kv_heads", "head_dim", "vocab_size", "hidden_size", "max_position", "eos_token_ids",
             "bos_token_id")
ATTRS = ("head_dim", "layer", "n_heads", "n_kv_heads", "experts", "k", "qk_norm", "norm")
# attributes that choose among valid models (top-k, the q/k norm, the routing's renormalisation):
# drawn only outside their valid values
VALID = {"k": set(range(1, 9)), "qk_norm": {"none", "head", "full"}, "norm": {True, False, 0, 1}}


class Base:
    def __init__(self, root: Path) -> None:
        self.dir = root
        with Container.open(root / "plan.bin", PLAN_MAGIC) as c:
            self.sections = {n: bytes(c.section(n)) for n in c.names()}
        self.weights = (root / "weights.bin").read_bytes()
        self.ids = root / "ids.npy"
        np.save(self.ids, np.array([[3, 17, 250, 9, 1100, 42]], np.int64))
        rc, err, out = self.run(root)
        assert rc == 0, err
        self.tokens, self.logits = out

    def run(self, plan_dir: Path):
        """(exit code, stderr, (tokens, logits) or None)."""
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = run_cli(strata_run, [str(plan_dir), "--input-ids", str(self.ids), "-n", "3", "--backend", "llvm",
                                      "--greedy", "--ignore-eos", "--tokens-out", str(plan_dir / "t.npy"),
                                      "--logits-out", str(plan_dir / "l.npy")])
        out = (np.load(plan_dir / "t.npy"), np.load(plan_dir / "l.npy")) if rc == 0 else None
        return rc, err.getvalue(), out

    def check(self, sections: dict) -> None:
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            write_container(d / "plan.bin", PLAN_MAGIC, list(sections.items()))
            (d / "weights.bin").write_bytes(self.weights)
            rc, err, out = self.run(d)
        if rc == 0:
            assert np.array_equal(out[0], self.tokens) and np.array_equal(out[1], self.logits), \
                "a changed plan ran to different results without an error"
        else:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), err
            assert "internal error" not in err and "Traceback" not in err, err


@pytest.fixture(scope="module")
def base(tiny_int8_plan, tmp_path_factory) -> Base:
    root = tmp_path_factory.mktemp("fuzz_base")
    for name in ("plan.bin", "weights.bin"):
        (root / name).write_bytes((tiny_int8_plan / name).read_bytes())
    return Base(root)


def _values():
    return (st.integers(-3, 10) | st.integers(-2**63, 2**63) | st.sampled_from([0, 1, 2**31, 2**40, 10**9])
            | st.floats(allow_nan=True) | st.text(max_size=6) | st.none() | st.booleans()
            | st.lists(st.integers(-2, 5), max_size=3))


@given(data=st.data())
@FUZZ
def test_fuzz_meta_model_fields(base, data):
    meta = json.loads(base.sections["meta"])
    key = data.draw(st.sampled_from([k for k in META_KEYS if k in meta["model"]]), label="key")
    meta["model"][key] = data.draw(_values(), label="value")
    base.check({**base.sections, "meta": json.dumps(meta).encode()})


def _ir_value(v) -> str:
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, bool) or v is None:
        return str(v).lower()
    if isinstance(v, list):
        return "[" + ", ".join(str(x) for x in v) + "]"
    return repr(v)


@given(data=st.data())
@FUZZ
def test_fuzz_ir_structure(base, data):
    ir = base.sections["ir"].decode()
    attr = [m for m in re.finditer(r"\b(" + "|".join(ATTRS) + r")=(-?\d+|\"[^\"]*\"|\[[^\]]*\])", ir)]
    dims = [m for m in re.finditer(r"(?:f32|i64|i32)\[([^\]]*)\]", ir)]
    how = data.draw(st.sampled_from(["attr", "dim"]), label="how")
    if how == "attr":
        m = data.draw(st.sampled_from(attr), label="site")
        ok = VALID.get(m.group(1), set())
        value = data.draw(_values().filter(lambda v: not (isinstance(v, (int, str)) and v in ok)), label="value")
        new = ir[:m.start(2)] + _ir_value(value) + ir[m.end(2):]
    else:
        m = data.draw(st.sampled_from(dims), label="site")
        parts = m.group(1).split(",")
        i = data.draw(st.integers(0, len(parts) - 1), label="dim")
        parts[i] = str(data.draw(st.integers(-2, 2**40) | st.sampled_from([0, 1, 3, 7, 65, 4097]), label="size"))
        new = ir[:m.start(1)] + ",".join(parts) + ir[m.end(1):]
    base.check({**base.sections, "ir": new.encode()})
