"""strata-run --trace / --stats (strata_compiler/trace.py): valid trace-event JSON with a track per device
and per copy direction, spans for every kernel and partition, and the stats lines."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hf_models import build_model
from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.runtime.cli import strata_run
from strata_compiler.trace import TRACKS, Tracer, validate


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model("qwen3_moe", tmp_path_factory.mktemp("trace") / "model")


def _run(plan, tmp_path, *extra):
    np.save(tmp_path / "ids.npy", np.array([[1, 2, 3, 4]], np.int64))
    return run_cli(strata_run, [str(plan / "plan.bin"), "--input-ids", str(tmp_path / "ids.npy"), "-n", "4",
                                "--ignore-eos", "--greedy", "--device", "cpu", *extra])


def test_mixed_plan_trace_has_every_track_and_validates(model, tmp_path, capsys):
    plan = tmp_path / "plan"
    assert run_cli(stratac, ["compile", str(model), "-o", str(plan), "--place", "experts=cpu,all=gpu"]) == 0
    assert _run(plan, tmp_path, "--trace", str(tmp_path / "t.json"), "--stats") == 0
    doc = json.loads((tmp_path / "t.json").read_text())
    validate(doc)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    tracks = {e["tid"] for e in spans}
    assert tracks == {TRACKS["step"], TRACKS["cpu"], TRACKS["gpu"], TRACKS["h2d"], TRACKS["d2h"]}
    steps = [e for e in spans if e["tid"] == TRACKS["step"]]
    assert [e["name"] for e in steps] == ["prefill", "decode", "decode", "decode"]
    # every kernel and copy lies inside its step; a GPU partition starts inside it (its end is
    # seen by a watcher thread, which may wake a little after the step has its results)
    for e in spans:
        if e["tid"] == TRACKS["gpu"]:
            assert any(s["ts"] <= e["ts"] + 1e-3 <= s["ts"] + s["dur"] + 1e-3 for s in steps)
        elif e["tid"] != TRACKS["step"]:
            assert any(s["ts"] <= e["ts"] + 1e-3 and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1e-3 for s in steps)
    moe = [e for e in spans if e["tid"] == TRACKS["cpu"] and e["name"] == "moe_ffn"]
    assert len(moe) == 4 * 2          # two MoE layers on the CPU, four steps
    # decode steps after the first run as one program (runtime/fused_step.py): the stretches
    # between its host calls are the GPU's spans, one more than the CPU partitions
    fused = [e for e in spans if e["name"].startswith("fused step: gpu segment")]
    assert fused and {e["tid"] for e in fused} == {TRACKS["gpu"]}
    last = steps[-1]
    inside = [e for e in fused if last["ts"] <= e["ts"] <= last["ts"] + last["dur"]]
    assert len(inside) == 3           # before, between and after the 2 MoE layers' CPU partitions
    err = capsys.readouterr().err
    assert "busy time per track" in err and "bytes moved h2d" in err
    assert "cpu kernels and gpu partitions at once:" in err


def test_overlap_of_two_tracks():
    """Each track's spans are merged first (nested spans count once), then intersected."""
    from strata_compiler.trace import overlap_seconds

    def x(tid, ts, dur):
        return {"name": "k", "ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    cpu, gpu = TRACKS["cpu"], TRACKS["gpu"]
    ev = [x(cpu, 0, 100), x(cpu, 10, 20), x(cpu, 150, 50),       # cpu busy [0,100) and [150,200)
          x(gpu, 90, 70), x(gpu, 190, 30), x(TRACKS["h2d"], 0, 1000)]
    assert overlap_seconds(ev, cpu, gpu) == pytest.approx((10 + 10 + 10) / 1e6)
    assert overlap_seconds(ev, gpu, cpu) == pytest.approx(30 / 1e6)
    assert overlap_seconds(ev, cpu, TRACKS["d2h"]) == 0.0
    t = Tracer()
    t.events = ev
    assert t.overlap() == pytest.approx(30 / 1e6)
    # busy time per track is the union of its spans (GPU partitions in flight at once, nested
    # spans), never more than the span of the run
    t.counts.update({"cpu": 3, "gpu": 2, "h2d": 1})
    assert t.busy_seconds() == pytest.approx({"cpu": 150 / 1e6, "gpu": 100 / 1e6, "h2d": 1000 / 1e6})


def test_validate_rejects_malformed_events():
    t = Tracer()
    with t.span("k", "cpu"):
        pass
    doc = t.document()
    validate(doc)
    bad = json.loads(json.dumps(doc))
    bad["traceEvents"][-1]["dur"] = -1
    with pytest.raises(ValueError, match="dur"):
        validate(bad)
    with pytest.raises(ValueError, match="traceEvents"):
        validate({"events": []})
    bad = json.loads(json.dumps(doc))
    del bad["traceEvents"][-1]["tid"]
    with pytest.raises(ValueError, match="tid"):
        validate(bad)


def test_gpu_plan_without_a_gpu_falls_back_to_the_cpu_with_one_warning(model, tmp_path, capsys):
    from strata_compiler.backends.xla.device import gpu_available

    if gpu_available():
        pytest.skip("this host has a GPU: no fallback")
    plan = tmp_path / "plan"
    assert run_cli(stratac, ["compile", str(model), "-o", str(plan), "--place", "experts=cpu,all=gpu"]) == 0
    np.save(tmp_path / "ids.npy", np.array([[1, 2, 3, 4]], np.int64))
    args = [str(plan / "plan.bin"), "--input-ids", str(tmp_path / "ids.npy"), "-n", "6", "--ignore-eos", "--greedy",
            "--tokens-out"]
    assert run_cli(strata_run, [*args, str(tmp_path / "a.npy")]) == 0
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "has none" in err and "[llvm]" in err
    assert run_cli(strata_run, [*args, str(tmp_path / "b.npy"), "--device", "cpu", "--backend", "auto"]) == 0
    assert "[llvm+xla]" in capsys.readouterr().err
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))


def test_the_committed_h200_trace_validates_and_shows_overlap():
    """The decode trace of the split plan at 25 % on the H200 (2026-11-30 16:04, placement_bench.py
    with native overlap, BENCHMARKS.md): valid trace-event JSON whose CPU-kernel and GPU tracks
    are busy at the same time (0.59 ms per token measured there)."""
    import gzip
    from pathlib import Path

    from strata_compiler.trace import overlap_seconds

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "traces" / "h200-2026-11-30-strata-25-overlap.json.gz"
    doc = json.loads(gzip.decompress(path.read_bytes()))
    validate(doc)
    ev = doc["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    cpu, gpu = tracks["cpu kernels (llvm / reference)"], tracks["gpu partitions (xla)"]
    steps = [e for e in ev if e["ph"] == "X" and e["tid"] == tracks["steps (host)"]]
    assert len(steps) == 47
    both = overlap_seconds(ev, cpu, gpu)
    assert 0.4e-3 < both / len(steps) < 0.8e-3


def test_the_committed_h200_cache_trace_has_hits_misses_prefetches_and_overlap():
    """The decode trace of the expert cache with prefetch at 25 % on the H200 (2026-11-30 19:34,
    `benchmarks/h200_runtime.sh`, BENCHMARKS.md): valid trace-event JSON; per decode step an
    instant per cached layer (16) naming its hits and misses, the prefetch copies on the
    host->device track, and the CPU-kernel and GPU tracks busy at once (2.6 ms per token there;
    a traced step takes the Python prefetch, the timed ones the native one)."""
    import gzip
    from pathlib import Path

    from strata_compiler.trace import overlap_seconds

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "traces" / "h200-2026-11-30-cache-25-prefetch.json.gz"
    doc = json.loads(gzip.decompress(path.read_bytes()))
    validate(doc)
    ev = doc["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    steps = [e for e in ev if e["ph"] == "X" and e["tid"] == tracks["steps (host)"]]
    assert len(steps) == 47
    marks = [e for e in ev if e["ph"] == "i" and e["tid"] == tracks["expert cache (hits, misses)"]]
    assert len(marks) == 16 * 47
    # top 8 of 64 experts per layer and token: every instant names 8 experts, hits and misses
    assert all(len(e["args"]["hit"]) + len(e["args"]["miss"]) == 8 for e in marks)
    hits = sum(len(e["args"]["hit"]) for e in marks)
    assert 0.6 < hits / (8 * len(marks)) < 0.9
    copies = [e for e in ev if e["ph"] == "X" and e["tid"] == tracks["copy host->device"]]
    assert copies and all(e["name"].startswith(("prefetch expert", "expert ")) for e in copies)
    both = overlap_seconds(ev, tracks["cpu kernels (llvm / reference)"], tracks["gpu partitions (xla)"])
    assert both / len(steps) > 1e-3
