"""passes/place_phases.py: a placement's prefill priced as placed and with its CPU-placed experts
streamed to the GPU; the break-even prompt length in the placement record and in `stratac inspect`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from strata_compiler import hwprofile as hwp
from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.driver import compile_model
from strata_compiler.ir import Op
from strata_compiler.pass_manager import CompileOptions, PassContext
from strata_compiler.passes import place, place_phases
from strata_compiler.prefill_streaming import plan_stream_tokens
from strata_compiler.runtime.plan import load_plan
from test_place import fake_profile

TINY = Path(__file__).resolve().parent.parent / "examples" / "models" / "tiny-moe"


def profile(path: Path, h2d: float = 1e9, cpu_flops: float = 1e12, gpu: bool = True) -> hwp.HardwareProfile:
    """test_place's profile with a faster CPU matmul (the break-even lands inside the search range)
    and `h2d` B/s host->device (pageable and pinned memory alike)."""
    hw = hwp.HardwareProfile.from_json(fake_profile(path))
    host = dataclasses.replace(hw.host, matmul_flops={f: cpu_flops for f in hw.host.matmul_flops})
    hw = dataclasses.replace(hw, host=host, gpu=dataclasses.replace(hw.gpu, h2d_pageable=h2d, h2d_pinned=h2d) if gpu else None)
    hw.save(path)
    return hw


@pytest.fixture(scope="module")
def tensor_graph():
    """tiny-moe at the tensor level, quantized, ready for `place`."""
    return compile_model(TINY, None, CompileOptions(quant="int4"), stop_after="quantize")


def placed(g, hw, strategy: str = "ktransformers", **opts):
    """The place pass on `g` for profile `hw` (a GPU of 40 MiB unless `opts` say otherwise): the
    placed graph and its record's `phases`."""
    opts = {"gpu_mem": "40MiB", **opts}
    ctx = PassContext(CompileOptions(quant="int4", target="given", place_strategy=strategy, **opts))
    ctx.hardware = hw
    out = place.place_pass(g, ctx)
    return out, ctx.analyses.placement["phases"]


def test_break_even_falls_as_the_host_to_device_rate_grows(tensor_graph, tmp_path):
    seen = []
    for rate in (0.01e9, 0.05e9, 0.2e9, 1e9, 6e9):
        _, ph = placed(tensor_graph, profile(tmp_path / "hw.json", h2d=rate))
        pre = ph["prefill"]
        assert pre["streamed_experts"] == 48 and pre["streamed_bytes"] > 0     # 6 layers x 8 experts on the CPU
        n = pre["stream_from_tokens"]
        seen.append(float("inf") if n is None else n)
        for T, p in pre["predicted"].items():       # the reported lengths agree with the break-even
            faster = p["streamed_tok_s"] > p["as_placed_tok_s"]
            assert faster if n is not None and int(T) >= n else \
                not faster or int(T) >= n * (1 - 1 / place_phases.PRECISION) - 1     # (n: to within 1/PRECISION)
    assert seen == sorted(seen, reverse=True) and len(set(seen)) == len(seen)
    assert seen[-1] == place_phases.SEARCH[0]
    assert ph["decode"]["host_bytes"] == pre["streamed_bytes"] and ph["decode"]["predicted_tok_s"] > 0


@pytest.mark.parametrize("case", ["no gpu", "all on the gpu", "cores on the cpu"])
def test_nothing_streams_without_a_gpu_or_cpu_experts_beside_it(tensor_graph, tmp_path, case):
    """No GPU, no CPU-placed experts, or experts only beside the CPU's attention (-ngl: a CPU
    partition with attention is not streamed): nothing streams, the break-even is None."""
    hw = profile(tmp_path / "hw.json", gpu=case != "no gpu")
    strategy, opts = {"no gpu": ("auto", {"gpu_mem": ""}), "all on the gpu": ("hot-experts", {}),
                      "cores on the cpu": ("ngl", {"gpu_mem": "16MiB"})}[case]
    out, ph = placed(tensor_graph, hw, strategy, **opts)
    pre = ph["prefill"]
    assert pre["stream_from_tokens"] is None and pre["streamed_bytes"] == 0 and pre["streamed_experts"] == 0
    assert all(p["streamed_tok_s"] is None and p["as_placed_tok_s"] > 0 for p in pre["predicted"].values())
    assert ph["decode"]["host_bytes"] == 0 if case == "all on the gpu" else \
        any(n.device == "cpu" and n.op is Op.MOE_FFN for n in out.nodes)


def test_expert_cache_layers_are_not_streamed(tensor_graph, tmp_path):
    """A layer whose CPU share is an expert cache's host share runs on the CPU as placed (the
    runtime streams no cache); whole CPU layers beside it still stream."""
    out, ph = placed(tensor_graph, profile(tmp_path / "hw.json"), "hot-experts", gpu_mem="13MiB", expert_cache=True)
    layer, cached = -1, set()
    for n in out.nodes:
        layer = int(n.attr("layer")) if n.op is Op.FUSED_ATTENTION else layer
        if n.attr("cache", ""):
            cached.add(layer)
    streamed = place_phases.streamed_layers(out)
    assert cached and streamed and not cached & streamed
    assert ph["prefill"]["streamed_experts"] == 8 * len(streamed)


def test_streamed_time_waits_only_where_an_upload_outlasts_the_work_before_it():
    """streamed = the timeline with the streamed experts on the GPU + the first upload beyond the
    work before its layer + each later upload beyond the work since the previous streamed layer."""

    class Timeline:
        def predict(self, gpu):
            if "e" not in gpu:
                return {"seconds": 30.0, "per_layer": {0: 10.0, 1: 10.0, 2: 10.0}}
            return {"seconds": 7.0, "per_layer": {-1: 1.0, 0: 2.0, 1: 2.0, 2: 2.0}}

    tl = Timeline()
    assert place_phases.prefill_seconds(tl, {"core"}, {"e"}, {0: 5.0, 2: 1.0}) == (30.0, 7.0 + 4.0)
    assert place_phases.prefill_seconds(tl, {"core"}, {"e"}, {0: 0.5, 1: 3.0, 2: 3.0}) == (30.0, 7.0 + 1.0 + 1.0)
    assert place_phases.prefill_seconds(tl, {"core"}, set(), {}) == (30.0, None)


def test_break_even_search():
    """Powers of two, then bisection to within 1/PRECISION; SEARCH's ends bound it."""
    lo, hi = place_phases.SEARCH
    assert place_phases.break_even(lambda T: (T, 100 + T / 2)) in range(201, 201 + 201 // place_phases.PRECISION + 1)
    assert place_phases.break_even(lambda T: (T, T / 2)) == lo
    assert place_phases.break_even(lambda T: (T, 2 * T)) is None
    assert place_phases.break_even(lambda T: (T, None)) is None
    assert place_phases.break_even(lambda T: (T, T + 0.5 - (T >= hi))) == hi


def test_target_plan_records_both_phases_and_inspect_prints_them(tmp_path, capsys):
    profile(tmp_path / "hw.json")
    out = tmp_path / "plan"
    assert run_cli(stratac, ["compile", str(TINY), "-o", str(out), "--quant", "int4", "--target", str(tmp_path / "hw.json"),
                             "--gpu-mem", "40MiB", "--place-strategy", "ktransformers"]) == 0
    plan = load_plan(out)
    pl = json.loads(plan.meta["model"]["placement"])
    n = pl["phases"]["prefill"]["stream_from_tokens"]
    assert place_phases.SEARCH[0] < n < place_phases.SEARCH[1]
    assert plan_stream_tokens(plan.graph) == n      # what the runtime takes with the setting at auto
    capsys.readouterr()
    assert run_cli(stratac, ["inspect", str(out), "--no-weights"]) == 0
    text = capsys.readouterr().out
    mib = pl["phases"]["prefill"]["streamed_bytes"] / 2**20
    line = next(x for x in text.splitlines() if x.strip().startswith("prefill:"))
    assert f"streams {mib:.1f} MiB of CPU-placed experts to the GPU from {n} tokens" in line
    assert "512 tokens:" in line and "4096 tokens:" in line and "as placed" in line and "streamed" in line
    assert "predicted decode:" in text
    assert run_cli(stratac, ["inspect", str(out), "--json", "--no-weights"]) == 0
    assert json.loads(capsys.readouterr().out)["placement"]["phases"] == pl["phases"]
