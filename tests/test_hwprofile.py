"""The hardware profile (`strata_compiler/hwprofile.py`), its probes (`backends/probe.py`) and `stratac probe-hw`.

One quick probe per module (a few seconds) backs the checks on measured figures; the JSON,
override, time-estimate and CLI-error tests use a hand-made profile with round numbers. The GPU
measurements run on JAX's CPU device at tiny sizes (the code path, not the figures); on a machine
with a GPU, a real quick probe of it is checked too.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from pathlib import Path

import pytest

from strata_compiler import hwprofile
from strata_compiler.backends import probe as hwprobe
from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.errors import UsageError
from strata_compiler.formats import FORMATS
from strata_compiler.backends.probe import probe
from strata_compiler.hwprofile import CpuIsa, DiskProfile, GpuProfile, HardwareProfile, HostProfile, override

GiB = 2**30


def _has_gpu() -> bool:
    from strata_compiler.backends.xla.device import gpu_available

    return gpu_available()


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> HardwareProfile:
    lines: list[str] = []
    p = probe(quick=True, disk_dir=tmp_path_factory.mktemp("disk"), disk_bytes=4 << 20, progress=lines.append)
    assert lines and all(isinstance(s, str) for s in lines)
    return p


def synthetic(gpu: bool = True, pinned: float | None = 20e9) -> HardwareProfile:
    """A profile with round numbers, for the arithmetic."""
    host = HostProfile(cpu="Test CPU", llvm_cpu="znver4", cores=8, threads=16,
                       isa=CpuIsa(True, True, True, True, True, False, False),
                       ram_bytes=64 * GiB, ram_available_bytes=60 * GiB, read_bandwidth=50e9,
                       gemv={"f32": 40e9, "int4": 25e9}, matmul_flops={"f32": 1e12, "int4": 2e12}, matmul_tokens=64)
    g = GpuProfile(name="Test GPU", memory_bytes=24 * GiB, copy_bandwidth=1000e9, gemv={"bf16": 400e9, "int4": 300e9},
                   matmul_flops=100e12, h2d_pageable=10e9, h2d_pinned=pinned, d2h=12e9) if gpu else None
    disk = DiskProfile(path="/data", filesystem="ext4", read_bandwidth=2e9, test_bytes=256 << 20, cache_dropped=True)
    return HardwareProfile(hwprofile.PROFILE_VERSION, "2026-01-01T00:00:00+00:00", False, {"strata": "0.1.0"},
                           host, g, disk, ())


def cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = run_cli(stratac, [str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(result: tuple[int, str, str], *names: str) -> str:
    code, out, err = result
    assert code != 0, (out, err)
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in names:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------------------------
# measured figures


def test_quick_probe_figures_are_sane(measured, tmp_path):
    p = measured
    assert p.version == hwprofile.PROFILE_VERSION and p.quick
    datetime.fromisoformat(p.measured_at)
    assert {"strata", "numpy", "llvmlite", "python"} <= set(p.software)
    h = p.host
    assert h.cpu and h.llvm_cpu and h.cores >= 1 and h.threads >= 1
    assert 0 < h.ram_available_bytes <= h.ram_bytes
    assert 1e8 < h.read_bandwidth < 1e13
    if h.isa.avx2 and h.isa.fma:
        assert set(h.gemv) == set(FORMATS) == set(h.matmul_flops)
        assert all(1e7 < r < 1e13 for r in h.gemv.values()), h.gemv
        assert all(1e7 < r < 1e15 for r in h.matmul_flops.values()), h.matmul_flops
    assert (p.gpu is not None) == _has_gpu()
    assert p.disk.test_bytes == 4 << 20 and 1e6 < p.disk.read_bandwidth
    assert Path(p.disk.path).is_dir()


def test_disk_test_file_is_removed(tmp_path):
    notes: list[str] = []
    d = hwprobe.measure_disk(tmp_path, 1 << 20, notes)
    assert d.read_bandwidth > 0 and d.test_bytes == 1 << 20
    assert list(tmp_path.iterdir()) == []


def test_gpu_measurements_on_jax_cpu_device():
    """measure_gpu's code path (every format through the xla matvec, copies, transfers) on JAX's CPU."""
    import jax

    tiny = dataclasses.replace(hwprobe.QUICK, reps=1, gemv_bytes=256 << 10, gemv_k=256, gpu_bytes=1 << 20,
                               gpu_matmul=64)
    notes: list[str] = []
    g = hwprobe.measure_gpu(jax.devices("cpu")[0], tiny, lambda msg: None, notes)
    assert set(g.gemv) == set(FORMATS) and all(r > 0 for r in g.gemv.values())
    assert g.copy_bandwidth > 0 and g.matmul_flops > 0 and g.h2d_pageable > 0 and g.d2h > 0
    assert g.h2d_pinned is None or g.h2d_pinned > 0
    assert (g.h2d_pinned is None) == any("pinned" in n for n in notes)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="no GPU visible to JAX")
def test_quick_probe_gpu(measured):
    g = measured.gpu
    assert g is not None and g.name and g.memory_bytes > GiB
    assert set(g.gemv) == set(FORMATS)
    assert g.copy_bandwidth > 1e10 and g.h2d_pageable > 1e8 and g.d2h > 1e8


# ------------------------------------------------------------------------------------------------
# JSON


def test_json_roundtrip(measured, tmp_path):
    for p in (measured, synthetic(), synthetic(gpu=False), synthetic(pinned=None)):
        path = tmp_path / "hw.json"
        p.save(path)
        assert HardwareProfile.from_json(path) == p
        assert hash(HardwareProfile.from_json(path)) == hash(p)     # frozen and hashable
        assert json.loads(path.read_text()) == json.loads(p.to_json())
    assert [f.name for f in tmp_path.iterdir()] == ["hw.json"]      # no temp files left


@pytest.mark.parametrize("edit, names", [
    (lambda d: d["host"].pop("read_bandwidth"), ("host.read_bandwidth", "missing")),
    (lambda d: d["host"]["gemv"].update(int4="fast"), ("host.gemv.int4", "positive number")),
    (lambda d: d["disk"].update(read_bandwidth=-1), ("disk.read_bandwidth",)),
    (lambda d: d["gpu"].update(h2d_pinned=0), ("gpu.h2d_pinned",)),
    (lambda d: d["host"].update(cores=2.5), ("host.cores",)),
    (lambda d: d["host"].update(isa="avx2"), ("host.isa", "object")),
    (lambda d: d.pop("disk"), ("disk", "missing")),
    (lambda d: d.update(version=99), ("version", "probe-hw")),
    (lambda d: d.pop("version"), ("version",)),
])
def test_bad_field_names_file_and_field(tmp_path, edit, names):
    d = json.loads(synthetic().to_json())
    edit(d)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(d))
    with pytest.raises(UsageError) as e:
        HardwareProfile.from_json(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    for n in names:
        assert n in msg, msg


def test_missing_gpu_is_null(tmp_path):
    d = json.loads(synthetic().to_json())
    d["gpu"] = None
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(d))
    assert HardwareProfile.from_json(path).gpu is None


# ------------------------------------------------------------------------------------------------
# override and time estimates


def test_override():
    p = synthetic()
    q = override(p, gpu_mem="16GiB", host_mem=128 * GiB)
    assert q.gpu.memory_bytes == 16 * GiB and q.host.ram_bytes == q.host.ram_available_bytes == 128 * GiB
    assert q.gpu.gemv == p.gpu.gemv and q.host.read_bandwidth == p.host.read_bandwidth and q.disk == p.disk
    assert p.gpu.memory_bytes == 24 * GiB and p.host.ram_bytes == 64 * GiB      # the original is untouched
    assert override(p) == p
    assert override(p, host_mem="800MB").host.ram_bytes == 800 * 10**6
    with pytest.raises(UsageError, match="--gpu-mem 'lots'"):
        override(p, gpu_mem="lots")
    with pytest.raises(UsageError, match="--host-mem"):
        override(p, host_mem=0)
    with pytest.raises(UsageError, match="--gpu-mem.*no GPU"):
        override(synthetic(gpu=False), gpu_mem="24GiB")


def test_time_estimates():
    p = synthetic()
    assert p.cpu_gemv_seconds("int4", 25e9) == pytest.approx(1.0)
    assert p.cpu_gemv_seconds("int8", 50e9) == pytest.approx(1.0)         # unmeasured: read bandwidth
    assert p.cpu_matmul_seconds("int4", 4e12) == pytest.approx(2.0)
    assert p.cpu_matmul_seconds("int8", 1e12) == pytest.approx(1.0)       # unmeasured: slowest rate
    assert p.gpu_gemv_seconds("int4", 3e11) == pytest.approx(1.0)
    assert p.gpu_gemv_seconds("int2", 5e11) == pytest.approx(1.0)         # unmeasured: half the copy bw
    assert p.gpu_matmul_seconds(1e14) == pytest.approx(1.0)
    assert p.h2d_seconds(20e9) == pytest.approx(1.0)
    assert p.h2d_seconds(10e9, pinned=False) == pytest.approx(1.0)
    assert synthetic(pinned=None).h2d_seconds(10e9) == pytest.approx(1.0)  # no pinned figure: pageable
    assert p.d2h_seconds(12e9) == pytest.approx(1.0)
    assert p.disk_seconds(2e9) == pytest.approx(1.0)
    with pytest.raises(UsageError, match="int5"):
        p.cpu_gemv_seconds("int5", 1)
    cpu_only = synthetic(gpu=False)
    for call in (lambda: cpu_only.gpu_gemv_seconds("int4", 1), lambda: cpu_only.h2d_seconds(1),
                 lambda: cpu_only.d2h_seconds(1), lambda: cpu_only.gpu_matmul_seconds(1)):
        with pytest.raises(UsageError, match="no GPU"):
            call()


# ------------------------------------------------------------------------------------------------
# CLI


def test_cli_writes_profile_and_table(capsys, tmp_path, monkeypatch, measured):
    seen = {}

    def fake_probe(**kw):
        seen.update(kw)
        kw["progress"]("measuring")
        return measured

    monkeypatch.setattr(hwprobe, "probe", fake_probe)
    out = tmp_path / "hw.json"
    code, stdout, stderr = cli(capsys, "probe-hw", "-o", out, "--quick", "--disk-size", "8MiB")
    assert code == 0, stderr
    assert HardwareProfile.from_json(out) == measured
    assert seen["quick"] and seen["disk_bytes"] == 8 << 20 and Path(seen["disk_dir"]) == tmp_path
    assert "probe-hw: measuring" in stderr
    assert "read bandwidth" in stdout and "cpu GEMV GB/s" in stdout and str(out) in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hw.json"]
    code, stdout2, _ = cli(capsys, "probe-hw", "--show", out)
    assert code == 0 and "cpu GEMV GB/s" in stdout2


@pytest.mark.parametrize("content, names", [
    (None, ("no such hardware profile",)),
    ("{not json", ("not a JSON hardware profile", "line 1")),
    ("[1, 2]", ("expected a JSON object",)),
    ('{"version": 1}', ("field measured_at is missing",)),
])
def test_cli_show_bad_file_is_one_line(capsys, tmp_path, content, names):
    path = tmp_path / "hw.json"
    if content is not None:
        path.write_text(content)
    assert_one_line_error(cli(capsys, "probe-hw", "--show", path), str(path), *names)


def test_cli_show_bad_field_is_one_line(capsys, tmp_path):
    d = json.loads(synthetic().to_json())
    d["gpu"]["d2h"] = "n/a"
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(d))
    assert_one_line_error(cli(capsys, "probe-hw", "--show", path), str(path), "gpu.d2h")


def test_cli_bad_arguments_are_one_line(capsys, tmp_path):
    missing = tmp_path / "nope" / "hw.json"
    assert_one_line_error(cli(capsys, "probe-hw", "-o", missing), "-o", str(missing.parent))
    assert_one_line_error(cli(capsys, "probe-hw", "-o", tmp_path), "-o", "directory")
    assert_one_line_error(cli(capsys, "probe-hw"), "-o", "--show")
    assert_one_line_error(cli(capsys, "probe-hw", "-o", tmp_path / "a.json", "--show", tmp_path / "b.json"),
                          "--show", "-o")
    assert_one_line_error(cli(capsys, "probe-hw", "-o", tmp_path / "a.json", "--disk-dir", tmp_path / "x"),
                          "--disk-dir")
    assert_one_line_error(cli(capsys, "probe-hw", "-o", tmp_path / "a.json", "--disk-size", "big"), "--disk-size")
    assert list(tmp_path.iterdir()) == []
