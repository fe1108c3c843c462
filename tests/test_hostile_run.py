"""strata-run against careless operators and hostile inputs (issue 29): Ctrl-C, full disks, absurd
flags, broken plans. Each case ends in one `error:` line and a nonzero exit, or runs correctly; none
prints a traceback or hangs. Plus Session.generate's chunked prefill (issue 28): a long prompt
prefilled in chunks gives the logits of one step.

Ctrl-C is a real SIGINT sent to a strata-run process (`_interrupt`); where it must land at a given
moment (in a finalizer that swallows it, in the middle of decoding) the process runs a few lines
that slow that moment down and touch a marker file when it has come.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from strata_compiler.cli_common import run_cli
from strata_compiler.errors import UsageError
from strata_compiler.plan_format import PLAN_MAGIC, WEIGHTS_MAGIC, Container, ContainerWriter, write_container
from strata_compiler.runtime.cli import strata_run
from strata_compiler.runtime.plan import load_plan
from strata_compiler.runtime.sampler import Sampler
from strata_compiler.runtime.session import NonFiniteLogits, Session, check_room

tokenizers = pytest.importorskip("tokenizers")

IDS = [[5, 17, 240, 33, 1000]]


# ------------------------------------------------------------------------------------------------
# helpers


def cli(capsys, *args) -> tuple[int, str, str]:
    """strata-run in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = run_cli(strata_run, [str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def one_error(code: int, out: str, err: str, *names: str) -> str:
    """Nonzero exit, no traceback, and stderr's only `error:` line (its last) naming every one of `names`."""
    assert code != 0, f"exit 0; stdout={out!r} stderr={err!r}"
    assert "Traceback" not in out + err and "Exception ignored" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0] and err.endswith("\n"), err
    for n in names:
        assert n in errors[0], f"{n!r} not in {errors[0]!r}"
    return errors[0]


def only_line(code: int, out: str, err: str, *names: str) -> str:
    """As one_error, and nothing else on stderr."""
    line = one_error(code, out, err, *names)
    assert err == line + "\n", err
    return line


@pytest.fixture()
def ids_file(tmp_path) -> Path:
    p = tmp_path / "ids.npy"
    np.save(p, np.array(IDS, np.int64))
    return p


def _greedy(plan_dir: Path, n: int, ids=IDS, backend: str = "llvm") -> np.ndarray:
    """The new ids of an uninterrupted greedy run, in-process, no stop ids."""
    return Session(load_plan(plan_dir), backend).generate(np.array(ids, np.int64), n, Sampler())[1]


def _interrupt(code: str, marker: Path, *args, python_flags: tuple[str, ...] = (), env: dict | None = None,
               after: float = 0.0) -> tuple[int, str, str, float]:
    """Run strata-run as `python -c code MARKER ARGS...`; `after` seconds after MARKER exists send
    SIGINT. (exit code, stdout, stderr, seconds from the signal to the exit)."""
    p = subprocess.Popen([sys.executable, *python_flags, "-c", code, str(marker), *map(str, args)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})})
    start = time.monotonic()
    while not marker.exists():
        assert p.poll() is None, f"ended before the signal: {p.communicate()}"
        assert time.monotonic() - start < 120, "the marker never came"
        time.sleep(0.01)
    time.sleep(after)
    p.send_signal(signal.SIGINT)
    t = time.monotonic()
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"still running 60 s after Ctrl-C: {err[-2000:]}")
    return p.returncode, out, err, time.monotonic() - t


_MAIN = "\nfrom strata_compiler.runtime.cli import main\nmain()\n"
# strata-run itself, the marker touched once its modules are imported (a Ctrl-C while the
# interpreter imports them, before any of strata-run runs, is Python's traceback)
_PLAIN = """
import pathlib, sys
marker = pathlib.Path(sys.argv.pop(1))
from strata_compiler.runtime.cli import main
marker.touch()
main()
"""

# start-up spent in finalizers (as llvmlite's ObjectRef.__del__ while kernels compile): Python
# ignores a KeyboardInterrupt raised in one
_SWALLOWING_START = """
import pathlib, sys, time
import strata_compiler.runtime.plan as P
marker, real = pathlib.Path(sys.argv.pop(1)), P.load_plan
class Finalizer:
    def __del__(self):
        time.sleep(0.05)
def load_plan(path):
    marker.touch()
    end = time.monotonic() + 30
    while time.monotonic() < end:
        Finalizer()
    return real(path)
P.load_plan = load_plan
""" + _MAIN

# decode steps of 20 ms; the marker after the 5th
_SLOW_DECODE = """
import pathlib, sys, time
import strata_compiler.runtime.session as S
marker, real, steps = pathlib.Path(sys.argv.pop(1)), S.Session.step, []
def step(self, ids, last_only=False):
    if ids.shape[1] == 1:
        steps.append(1)
        if len(steps) == 5:
            marker.touch()
        time.sleep(0.02)
    return real(self, ids, last_only)
S.Session.step = step
""" + _MAIN


def _resealed(src: Path, dst: Path, tokenizer: bytes | None = None, weights: dict | None = None) -> Path:
    """A copy of plan folder `src` with its tokenizer section and/or some weight sections replaced,
    every checksum (and the plan's record of the weights file) valid."""
    dst.mkdir()
    with Container.open(src / "weights.bin", WEIGHTS_MAGIC) as c, \
            ContainerWriter(dst / "weights.bin", WEIGHTS_MAGIC, flags=c.flags) as w:
        for n in c.names():
            w.add(n, (weights or {}).get(n, c.section(n)), align=c.info(n).align)
    with Container.open(dst / "weights.bin", WEIGHTS_MAGIC) as c:
        size, checksum = c.total_size, c.body_checksum
    with Container.open(src / "plan.bin", PLAN_MAGIC) as c:
        secs = {n: bytes(c.section(n)) for n in c.names()}
    meta = json.loads(secs["meta"])
    meta["weights"].update(size=size, checksum=checksum)
    secs["meta"] = json.dumps(meta).encode()
    if tokenizer is not None:
        secs["tokenizer"] = tokenizer
    write_container(dst / "plan.bin", PLAN_MAGIC, list(secs.items()))
    return dst


# ------------------------------------------------------------------------------------------------
# Ctrl-C


def test_ctrl_c_swallowed_at_start_up_still_stops_at_once(tiny_int8_plan, ids_file, tmp_path):
    """Before: the KeyboardInterrupt died in a finalizer ("Exception ignored"), the run went on and
    a second Ctrl-C was needed. Now: one line, exit 130, within a second."""
    code, out, err, sec = _interrupt(_SWALLOWING_START, tmp_path / "m", tiny_int8_plan, "--input-ids", ids_file,
                                     "--backend", "llvm", "--tokens-out", tmp_path / "t.npy")
    assert code == 130 and out == "", (code, out, err)
    only_line(code, out, err, "interrupted", "Ctrl-C")
    assert sec < 5, sec
    assert not (tmp_path / "t.npy").exists() and sorted(os.listdir(tmp_path)) == ["ids.npy", "m"]


def test_ctrl_c_during_a_real_start_up(tiny_int8_plan, ids_file, tmp_path):
    """No stand-ins: kernels compiling into an empty cache, SIGINT 0.2 s into strata-run. Wherever
    it lands (loading, compiling, prefill or the first tokens) the run stops with one line and 130."""
    code, out, err, sec = _interrupt(_PLAIN, tmp_path / "m", tiny_int8_plan, "--input-ids", ids_file,
                                     "-n", "1000", "--ignore-eos", "--backend", "llvm",
                                     env={"STRATA_CACHE_DIR": str(tmp_path / "cache")}, after=0.2)
    assert code == 130, (code, err)
    one_error(code, out, err, "interrupted")
    assert sec < 5, sec


@pytest.mark.parametrize("optimize", [False, True], ids=["plain", "PYTHONOPTIMIZE"])
def test_ctrl_c_mid_decode_keeps_the_text_and_tokens_out(tiny_int8_plan, ids_file, tmp_path, optimize):
    tokens = tmp_path / "t.npy"
    code, out, err, sec = _interrupt(_SLOW_DECODE, tmp_path / "m", tiny_int8_plan, "--input-ids", ids_file,
                                     "-n", "1000", "--ignore-eos", "--backend", "llvm", "--greedy", "--tokens-out", tokens,
                                     python_flags=("-O",) if optimize else ())
    assert code == 130
    line = one_error(code, out, err, "interrupted", "--tokens-out")
    got = np.load(tokens)
    n = got.shape[1]
    assert got.shape[0] == 1 and 5 <= n < 999 and f"after {n} new tokens" in line
    assert sec < 5
    np.testing.assert_array_equal(got, _greedy(tiny_int8_plan, n))     # the tokens a whole run makes first
    tok = tokenizers.Tokenizer.from_str(load_plan(tiny_int8_plan).tokenizer_json.decode())
    assert out == tok.decode(IDS[0] + got[0].tolist())[len(tok.decode(IDS[0])):] + "\n"     # no --echo


def test_ctrl_c_in_decode_ahead_keeps_the_finished_steps(tiny_f32_plan, monkeypatch):
    """Greedy steps dispatched ahead (backends/ahead.py, GPU plans): those that finished before the
    Ctrl-C come back with it; Session.generate keeps them."""
    from strata_compiler.backends import ahead

    s = Session(load_plan(tiny_f32_plan), "llvm")

    def decode_ahead(tok, cache, n, stop_ids=(), done=None, sampling=None, on_token=None):
        def finish(step, use):
            if step == 3 and use:       # the signal, once (the step left in flight is then dropped)
                raise KeyboardInterrupt
            return np.full(1, 100 + step, np.int64)
        return ahead.run(lambda prev: 0 if prev is None else prev + 1, finish, n, 1, stop_ids, done)

    monkeypatch.setattr(s, "_ahead", lambda sampler, B: True)
    monkeypatch.setattr(s.executor, "decode_ahead", decode_ahead, raising=False)
    with pytest.raises(KeyboardInterrupt) as e:
        s.generate(np.array(IDS, np.int64), 20, Sampler())
    assert e.value.new.tolist() == [[int(_greedy(tiny_f32_plan, 1)[0, 0]), 100, 101, 102]]
    assert e.value.logits.shape == (1, 5, 4096)


# ------------------------------------------------------------------------------------------------
# output files


def test_output_on_a_device_refused_before_the_run(capsys, tiny_int8_plan, ids_file):
    """/dev/full as --tokens-out: the rename would replace the device; one line, nothing run."""
    only_line(*cli(capsys, tiny_int8_plan, "--input-ids", ids_file, "--tokens-out", "/dev/full"),
              "--tokens-out", "/dev/full", "not a regular file")


@pytest.mark.parametrize("flag", ["--tokens-out", "--logits-out"])
def test_full_disk_keeps_the_text_and_the_old_file(capsys, tiny_int8_plan, ids_file, tmp_path, monkeypatch, flag):
    old = tmp_path / "out.npy"
    old.write_bytes(b"the file before the run")

    def save(f, arr, *a, **kw):     # half the bytes, then the disk is full
        f.write(b"\x93NUMPY partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np, "save", save)
    code, out, err = cli(capsys, tiny_int8_plan, "--input-ids", ids_file, "-n", "4", "--backend", "llvm", "--greedy",
                         flag, old)
    assert code == 1
    one_error(code, out, err, flag, str(old), "No space left on device")
    monkeypatch.undo()
    tok = tokenizers.Tokenizer.from_str(load_plan(tiny_int8_plan).tokenizer_json.decode())
    assert out == tok.decode(IDS[0] + _greedy(tiny_int8_plan, 4)[0].tolist())[len(tok.decode(IDS[0])):] + "\n"
    assert old.read_bytes() == b"the file before the run"
    assert sorted(os.listdir(tmp_path)) == ["ids.npy", "out.npy"]


def test_outputs_written_whole(capsys, tiny_int8_plan, ids_file, tmp_path):
    code, out, err = cli(capsys, tiny_int8_plan, "--input-ids", ids_file, "-n", "3", "--backend", "llvm", "--greedy",
                         "--tokens-out", tmp_path / "t", "--logits-out", tmp_path / "l.npy")
    assert code == 0, err
    np.testing.assert_array_equal(np.load(tmp_path / "t"), _greedy(tiny_int8_plan, 3))
    assert np.load(tmp_path / "l.npy").shape == (1, 5, 4096)
    assert sorted(os.listdir(tmp_path)) == ["ids.npy", "l.npy", "t"]


# ------------------------------------------------------------------------------------------------
# flags and inputs


@pytest.mark.parametrize("n", ["1000000000", "1020"])
def test_n_past_the_models_positions(capsys, tiny_int8_plan, ids_file, n):
    """-n 1e9 was a 477 GiB allocation traceback; 5 + 1020 > 1024 ran on silently."""
    t = time.monotonic()
    line = only_line(*cli(capsys, tiny_int8_plan, "--input-ids", ids_file, "-n", n), f"-n {n}", "1024", "-n 1019")
    assert "max_position" in line and time.monotonic() - t < 10


def test_n_up_to_the_models_positions_runs(capsys, tiny_int8_plan, ids_file, tmp_path):
    code, out, err = cli(capsys, tiny_int8_plan, "--input-ids", ids_file, "-n", "1019", "--ignore-eos",
                         "--backend", "llvm", "--tokens-out", tmp_path / "t.npy")
    assert code == 0, err
    assert np.load(tmp_path / "t.npy").shape == (1, 1019)


def test_a_prompt_filling_the_positions(capsys, tiny_int8_plan, tmp_path):
    p = tmp_path / "long.npy"
    np.save(p, np.ones((1, 1024), np.int64))
    only_line(*cli(capsys, tiny_int8_plan, "--input-ids", p, "-n", "1"), "1024 tokens", "positions")


def test_kv_cache_past_the_hosts_memory(tiny_int8_plan):
    """A plan without max_position: the KV cache, ids and logits are bounded by the host's memory."""
    plan = load_plan(tiny_int8_plan)
    plan.meta["model"].pop("max_position")
    with pytest.raises(UsageError, match=r"-n 1000000000: .* GiB .*this host has"):
        check_room(plan, 1, 5, 10**9)
    check_room(plan, 1, 5, 2000)


@pytest.mark.parametrize("flags,names", [
    (("--temperature", "nan"), ("--temperature", "nan")),
    (("--temperature", "inf"), ("--temperature", "inf")),
    (("--top-p", "nan"), ("--top-p", "nan")),
    (("--seed", "-1"), ("--seed", "-1")),
    (("--prefill-chunk", "0"), ("--prefill-chunk",)),
])
def test_bad_numbers(capsys, tiny_int8_plan, ids_file, flags, names):
    only_line(*cli(capsys, tiny_int8_plan, "--input-ids", ids_file, *flags), *names)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0,)])
def test_input_ids_with_no_tokens(capsys, tiny_int8_plan, tmp_path, shape):
    p = tmp_path / "ids.npy"
    np.save(p, np.zeros(shape, np.int64))
    only_line(*cli(capsys, tiny_int8_plan, "--input-ids", p), "--input-ids", "ids.npy")


@pytest.mark.parametrize("bad", [4096, -1, 2**64 - 1])
def test_input_ids_outside_the_vocabulary_before_start_up(capsys, tiny_int8_plan, tmp_path, bad):
    p = tmp_path / "ids.npy"
    np.save(p, np.array([[1, bad]], np.uint64 if bad > 2**62 else np.int64))
    only_line(*cli(capsys, tiny_int8_plan, "--input-ids", p), "--input-ids", "vocabulary")


def test_non_utf8_tokenizer(capsys, tiny_int8_plan, ids_file, tmp_path):
    """--input-ids needs no tokenizer: one warning, ids printed; --prompt needs it: one line."""
    plan = _resealed(tiny_int8_plan, tmp_path / "plan", tokenizer=b"\xff\xfe{\"model\": \xc3\x28}")
    code, out, err = cli(capsys, plan, "--input-ids", ids_file, "-n", "3", "--backend", "llvm", "--greedy")
    assert code == 0 and "Traceback" not in err, err
    assert "warning" in err and "tokenizer" in err and "UTF-8" in err
    assert out == " ".join(map(str, _greedy(tiny_int8_plan, 3)[0])) + "\n"
    only_line(*cli(capsys, plan, "--prompt", "hello"), "tokenizer", "UTF-8", "--prompt")


# ------------------------------------------------------------------------------------------------
# non-finite logits


def test_nan_weights_reported_not_greedy_zero(capsys, tiny_f32_plan, ids_file, tmp_path):
    """Before: all-NaN logits, greedy id 0, exit 0. Now: one line naming the step."""
    with Container.open(tiny_f32_plan / "weights.bin", WEIGHTS_MAGIC) as c:
        norm = np.frombuffer(c.section("L5.ln2:w"), np.float32).copy()
    norm[7] = np.nan
    plan = _resealed(tiny_f32_plan, tmp_path / "plan", weights={"L5.ln2:w": norm.tobytes()})
    code, out, err = cli(capsys, plan, "--input-ids", ids_file, "-n", "4", "--backend", "llvm",
                         "--tokens-out", tmp_path / "t.npy")
    assert code == 1 and out == ""
    only_line(code, out, err, "NaN", "prefill", "row 0")
    assert not (tmp_path / "t.npy").exists()


def test_inf_logits_mid_decode_keep_what_was_made(capsys, tiny_int8_plan, ids_file, tmp_path, monkeypatch):
    real, steps = Session.step, []

    def step(self, ids, last_only=False):
        out = real(self, ids, last_only)
        if ids.shape[1] == 1:
            steps.append(1)
            if len(steps) == 3:
                out = out.copy()
                out[0, 0, 9] = np.inf
        return out

    monkeypatch.setattr(Session, "step", step)
    code, out, err = cli(capsys, tiny_int8_plan, "--input-ids", ids_file, "-n", "10", "--ignore-eos",
                         "--backend", "llvm", "--greedy", "--tokens-out", tmp_path / "t.npy")
    assert code == 1
    one_error(code, out, err, "Inf", "decode step 3", "row 0")
    monkeypatch.undo()
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy"), _greedy(tiny_int8_plan, 3))
    with pytest.raises(NonFiniteLogits):
        monkeypatch.setattr(Session, "step", step)
        steps.clear()
        Session(load_plan(tiny_int8_plan), "llvm").generate(np.array(IDS, np.int64), 10, Sampler(0.7, 0.9, 1))


# ------------------------------------------------------------------------------------------------
# chunked prefill (issue 28)


@pytest.mark.parametrize("backend", ["llvm", "reference", "xla"])
def test_chunked_prefill_matches_one_step(tiny_f32_plan, backend):
    """A 1000-token prompt in chunks of 256 (the last one padded to its bucket on xla): the last
    token's logits within 1e-5 x std of one 1000-token step, the same tokens after it."""
    if backend == "xla":
        pytest.importorskip("jax")
    ids = np.random.default_rng(0).integers(0, 4096, (1, 1000), dtype=np.int64)
    plan = load_plan(tiny_f32_plan)
    whole, new_whole = Session(plan, backend, device="cpu").generate(ids, 4, Sampler(), prefill_chunk=1000)
    s = Session(plan, backend, device="cpu")
    steps = []
    real = s.step
    s.step = lambda x, last_only=False: steps.append(x.shape[1]) or real(x, last_only)
    last, new = s.generate(ids, 4, Sampler(), prefill_chunk=256, keep_logits=False)
    assert steps[:4] == [256, 256, 256, 232] and s.cache.capacity == Session.capacity_for(1000, 4, 256) == 1088
    assert last.shape == (1, 1, 4096)
    tol = 1e-5 * float(whole[0, -1].std())
    assert np.abs(last[0, -1] - whole[0, -1]).max() <= tol
    np.testing.assert_array_equal(new, new_whole)
    if backend != "xla":        # every position's logits kept, chunk by chunk
        chunked, _ = Session(plan, backend).generate(ids, 0, Sampler(), prefill_chunk=256)
        assert chunked.shape == whole.shape and np.abs(chunked - whole).max() <= 10 * tol


@pytest.mark.parametrize("delay", [0.1, 0.2])
def test_ctrl_c_while_python_imports_the_program(tiny_int8_plan, delay):
    """The console script installs its Ctrl-C handling before the heavy imports (runtime/entry.py)."""
    import shutil
    import signal as _signal
    import time as _time

    exe = shutil.which("strata-run", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("strata-run is not installed beside this Python")
    p = subprocess.Popen([exe, str(tiny_int8_plan), "-n", "2", "--prompt", "Hi"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    _time.sleep(delay)
    p.send_signal(_signal.SIGINT)
    _, err = p.communicate(timeout=60)
    if p.returncode == 0:
        pytest.skip("the run finished before the signal")
    lines = err.strip().splitlines()
    assert p.returncode == 130 and len(lines) == 1 and lines[0].startswith("error: interrupted"), err


# the weights file truncated to its first page just before the first step (after load_plan checked it)
_TRUNCATE_FIRST_STEP = """
import os, sys
import strata_compiler.runtime.session as S
real, done = S.Session.step, []
def step(self, ids, last_only=False):
    if not done:
        done.append(1)
        os.truncate(self.plan.weights_path, 4096)
    return real(self, ids, last_only)
S.Session.step = step
""" + _MAIN


@pytest.mark.parametrize("backend,optimize", [("reference", False), ("llvm", False), ("reference", True)])
def test_weights_truncated_under_a_running_process(tiny_int8_plan, tmp_path, backend, optimize):
    """weights.bin cut short while strata-run uses it (reading a page past the new end is SIGBUS):
    one error line naming the file, exit 1, no 'Bus error' and no traceback (or, where the llvm
    backend copied its weights into huge pages at start, a run that does not notice)."""
    import shutil

    plan = tmp_path / "plan"
    shutil.copytree(tiny_int8_plan, plan)
    env = dict(os.environ)
    env.pop("PYTHONFAULTHANDLER", None)
    p = subprocess.run([sys.executable, *(["-O"] if optimize else []), "-c", _TRUNCATE_FIRST_STEP, str(plan), "-n", "4",
                        "--prompt", "Hello",
                        "--backend", backend], capture_output=True, text=True, timeout=120, env=env)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in p.stderr and "Bus error" not in p.stderr
    if backend == "llvm" and p.returncode == 0:     # its weights were copied into huge pages at start
        assert p.stdout.strip()
        return
    assert p.returncode == 1, p.stderr[-2000:]
    assert lines[-1].startswith("error: ") and "weights.bin changed while this process was reading it" in lines[-1]
