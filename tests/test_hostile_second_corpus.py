"""Findings of the second, independently written hostile corpus (issue 29), each now a test: a
weights file missing a section, a FIFO as --input-ids, a denormal temperature, a prompt that is not
UTF-8, a broken plan's NumPy warnings, plan.bin as a folder in the output folder, a 20 MiB prompt
to the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata_compiler.plan_format import PLAN_MAGIC, WEIGHTS_MAGIC, Container, ContainerWriter

ROOT = Path(__file__).resolve().parents[1]


def _cli(module: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", f"from strata_compiler.{module} import main; main()", *args],
                          capture_output=True, text=True, timeout=timeout)


def _one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode > 0 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert all(n in lines[0] for n in needles), lines[0]


def _sections(path: Path, magic: bytes):
    with Container.open(path, magic) as c:
        return [(n, bytes(c.section(n)), c.info(n).align) for n in c.names()]


def _reseal(path: Path, magic: bytes, secs) -> None:
    with ContainerWriter(path, magic) as w:
        for n, d, a in secs:
            w.add(n, d, align=a)


def test_weights_without_a_section_is_one_line(tiny_int8_plan, tmp_path):
    secs = [s for s in _sections(tiny_int8_plan / "weights.bin", WEIGHTS_MAGIC) if s[0] != "L0.attn.o:scales"]
    _reseal(tmp_path / "weights.bin", WEIGHTS_MAGIC, secs)
    with Container.open(tmp_path / "weights.bin", WEIGHTS_MAGIC) as wc:
        size, checksum = wc.total_size, wc.body_checksum
    plan = []
    for n, d, a in _sections(tiny_int8_plan / "plan.bin", PLAN_MAGIC):
        if n == "meta":         # a hostile author reseals the weights' size and checksum too
            m = json.loads(d)
            m["weights"].update(size=size, checksum=checksum)
            d = json.dumps(m).encode()
        plan.append((n, d, a))
    _reseal(tmp_path / "plan.bin", PLAN_MAGIC, plan)
    _one_line_error(_cli("runtime.cli", str(tmp_path), "--prompt", "hello", "-n", "2", "--backend", "llvm"),
                    "L0.attn.o:scales")


def test_input_ids_fifo_does_not_block(tiny_int8_plan, tmp_path):
    fifo = tmp_path / "ids.npy"
    os.mkfifo(fifo)
    _one_line_error(_cli("runtime.cli", str(tiny_int8_plan), "--input-ids", str(fifo), timeout=30), "FIFO")


def test_denormal_temperature_samples(tiny_int8_plan):
    r = _cli("runtime.cli", str(tiny_int8_plan), "--prompt", "hi", "--temperature", "1e-320", "-n", "3",
             "--backend", "llvm")
    assert r.returncode == 0 and "Traceback" not in r.stderr and "Warning" not in r.stderr, r.stderr


def test_sampler_tiny_temperature_is_greedy():
    from strata_compiler.runtime.sampler import Sampler

    logits = np.array([[0.5, 3.0, -1.0, 2.999]], np.float32)
    assert Sampler(temperature=1e-320, seed=1)(logits).tolist() == [1]


def test_prompt_not_utf8_is_one_line(tiny_int8_plan):
    r = subprocess.run([sys.executable, "-c", "from strata_compiler.runtime.cli import main; main()",
                        str(tiny_int8_plan), "--prompt", "\udced\udca0\udc80x", "-n", "2"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONUTF8": "1"})
    _one_line_error(r, "UTF-8")


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_overflowing_router_is_reported_as_nan(tiny_f32_plan, tmp_path, backend):
    secs = []
    for n, d, a in _sections(tiny_f32_plan / "weights.bin", WEIGHTS_MAGIC):
        if n == "L0.moe.router:w":
            d = np.full(len(d) // 4, 3e38, np.float32).tobytes()
        secs.append((n, d, a))
    _reseal(tmp_path / "weights.bin", WEIGHTS_MAGIC, secs)
    with Container.open(tmp_path / "weights.bin", WEIGHTS_MAGIC) as wc:
        size, checksum = wc.total_size, wc.body_checksum
    plan = []
    for n, d, a in _sections(tiny_f32_plan / "plan.bin", PLAN_MAGIC):
        if n == "meta":
            m = json.loads(d)
            m["weights"].update(size=size, checksum=checksum)
            d = json.dumps(m).encode()
        plan.append((n, d, a))
    _reseal(tmp_path / "plan.bin", PLAN_MAGIC, plan)
    _one_line_error(_cli("runtime.cli", str(tmp_path), "--prompt", "hello world", "-n", "3",
                         "--backend", backend), "NaN")


def test_plan_bin_folder_in_the_output_is_refused_first(tmp_path):
    (tmp_path / "plan.bin").mkdir()
    r = _cli("cli", "compile", str(ROOT / "examples" / "models" / "tiny-moe"), "-o", str(tmp_path), timeout=300)
    _one_line_error(r, "plan.bin", "not a regular file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.bin"]


def test_server_refuses_a_huge_prompt_at_once(tiny_int8_plan):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.server import make_app

    plan = load_plan(tiny_int8_plan)

    class Engine:
        ctx, warm_error, stats, max_batch = 1024, None, {}, 1
        ready = __import__("threading").Event()
        tokenizer = Tokenizer.from_str(plan.tokenizer_json.decode())

        def __init__(self):
            self.plan = plan

        def submit(self, req):
            raise AssertionError("a refused prompt must not reach the scheduler")

    c = TestClient(make_app(Engine()))
    r = c.post("/v1/completions", json={"prompt": "a" * (1 << 20), "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = c.post("/v1/completions", content=b"{" + b" " * (17 << 20) + b"}", headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    for body, param in (({"prompt": "a", "max_tokens": True}, "max_tokens"), ({"prompt": "a", "stream": "yes"}, "stream")):
        r = c.post("/v1/completions", json=body)        # JSON types as written, not coerced
        assert r.status_code == 400 and r.json()["error"]["param"] == param
