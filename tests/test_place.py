"""passes/place.py: the cost model's placements, and that every placement gives the single-device
plan's results (JAX on the CPU stands in for the GPU partitions)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hf_models import build_model, clear_prompts, hf_greedy, hf_logits, load_model
from strata_compiler import hwprofile as hwp
from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.passes import place
from strata_compiler.runtime.plan import load_plan
from test_e2e_transformers import run_plan

N_NEW = 6


def fake_profile(path, gpu_mem: int = 1 << 30):
    """A host like this one beside an H200-like GPU (rates from BENCHMARKS.md's probe-hw run)."""
    fmts = ("f32", "bf16", "int8", "int4", "int4a", "int3", "int2", "fp8")
    isa = hwp.CpuIsa(avx2=True, fma=True, avx512f=False, avx512bw=False, avx512_vnni=False, avx512_bf16=False,
                     amx=False)
    host = hwp.HostProfile(cpu="test cpu", llvm_cpu="znver3", cores=2, threads=2, isa=isa,
                           ram_bytes=24 << 30, ram_available_bytes=20 << 30, read_bandwidth=20e9,
                           gemv={f: 15e9 for f in fmts}, matmul_flops={f: 50e9 for f in fmts}, matmul_tokens=64)
    gpu = hwp.GpuProfile(name="test gpu", memory_bytes=gpu_mem, copy_bandwidth=4e12,
                         gemv={f: 2e12 for f in fmts}, matmul_flops=8e14, h2d_pageable=6e9, h2d_pinned=50e9,
                         d2h=1.5e9)
    disk = hwp.DiskProfile(path="/tmp", filesystem="ext4", read_bandwidth=1.5e9, test_bytes=1 << 20,
                           cache_dropped=True)
    hw = hwp.HardwareProfile(version=hwp.PROFILE_VERSION, measured_at="2026-11-29T00:00:00+00:00", quick=True,
                             software={}, host=host, gpu=gpu, disk=disk, notes=())
    hw.save(path)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = build_model("qwen3_moe", tmp_path_factory.mktemp("place") / "model")
    m = load_model(d)
    ids = clear_prompts(m, m.config.vocab_size, n_prompts=1, length=6, n_new=N_NEW, seed=5)[0]
    return d, m, ids, hf_logits(m, ids), hf_greedy(m, ids, N_NEW)[0]


def _compile(d, out, hw, gpu_mem, *extra):
    assert run_cli(stratac, ["compile", str(d), "-o", str(out), "--target", str(hw), "--gpu-mem", str(gpu_mem),
                             "--dump-dir", str(out / "dump"), "--dump-after", "place", *extra]) == 0
    return json.loads((out / "dump" / "placement.json").read_text())


def budget_decides(monkeypatch) -> None:
    """Free device switches and GPU launches: the GPU always wins and the greedy's per-expert
    choices survive, so the GPU budget alone decides (and layers get split shares)."""
    monkeypatch.setattr(place, "PARTITION_S", 0.0)
    monkeypatch.setattr(place, "GPU_KERNEL_S", 0.0)


def probe_placement(d, tmp_path, hw, *extra) -> dict:
    """placement.json of `d` with room for everything (its bytes and KV reserve)."""
    return _compile(d, tmp_path / "probe", hw, "1GiB", *extra)


def gpu_mem_for(probe: dict, weight_bytes: float) -> int:
    """--gpu-mem under which the placement has `weight_bytes` for weights: the KV reserve and
    GPU_RESERVE come on top."""
    return int((weight_bytes + probe["kv_bytes"]) / (1 - place.GPU_RESERVE))


def test_placements_from_nothing_to_everything_give_identical_results(model, tmp_path, monkeypatch):
    d, _, ids, ref, ref_tokens = model
    budget_decides(monkeypatch)
    hw = fake_profile(tmp_path / "hw.json")
    probe = probe_placement(d, tmp_path, hw)
    total = probe["gpu_bytes"] + probe["host_bytes"]
    seen = []
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        mem = gpu_mem_for(probe, total * frac) + 4096
        out = tmp_path / f"p{int(frac * 100)}"
        s = _compile(d, out, hw, mem)
        seen.append(s["gpu_bytes"])
        g = load_plan(out).graph
        devices = {n.device for n in g.nodes}
        assert devices == ({"cpu"} if frac == 0 else ({"gpu"} if frac == 1 else {"cpu", "gpu"}))
        logits, tokens = run_plan(out, ids, tmp_path, n_new=N_NEW, backend="auto", device="cpu")
        assert np.abs(logits - ref).max() / ref.std() <= 1e-4, f"{frac:.0%} of the weights on the gpu"
        np.testing.assert_array_equal(tokens, ref_tokens)
    assert seen == sorted(seen) and len(set(seen)) == 5
    assert seen[0] == 0 and seen[-1] == total


def test_split_layers_put_hot_experts_on_the_gpu(model, tmp_path, monkeypatch):
    d, _, _, _, _ = model
    budget_decides(monkeypatch)
    hw = fake_profile(tmp_path / "hw.json")
    probe = probe_placement(d, tmp_path, hw)
    mem = gpu_mem_for(probe, probe["gpu_bytes"] * 0.5)
    out = tmp_path / "half"
    s = _compile(d, out, hw, mem)
    g = load_plan(out).graph
    shares = [n for n in g.nodes if n.op.value == "moe_ffn" and n.attr("experts", ())]
    assert {n.device for n in shares} == {"gpu", "cpu"}
    assert s["gpu_bytes"] <= s["gpu_budget_bytes"]
    assert s["predicted_tok_s"] >= max(v for k, v in s["candidates"].items()) - 1e-6
    assert s["predicted_prefill_tok_s"] > 0 and s["prefill_tokens"] == 512
    for lay in s["per_layer"].values():      # device and tier per expert, for inspect --json
        assert len(lay["gpu_expert_ids"]) == lay["gpu_experts"] and not lay["disk_expert_ids"]
        assert lay["seconds_all_cpu"] > 0 and lay["seconds_all_gpu"] > 0     # the dump: time per layer per device
    on_gpu = {e for n in g.nodes if n.op.value == "moe_ffn" and n.device == "gpu" for e in n.attr("experts", ())}
    assert on_gpu and on_gpu <= {e for lay in s["per_layer"].values() for e in lay["gpu_expert_ids"]}


def test_predicted_time_prefers_fewer_device_switches():
    """With a switch cost, an alternating placement costs more than a contiguous one of equal bytes;
    a step starts and ends on the host, so the GPU's first and last ops pay for a switch too."""
    from strata_compiler.passes.place import _Timeline

    class T(_Timeline):
        def __init__(self):
            self.steps = [(f"u{i}", (10e-6, 1e-6), 50e-6, i) for i in range(4)]
            self.end_switch = 50e-6

    t = T()
    assert t.predict({"u0", "u1"})["seconds"] < t.predict({"u0", "u2"})["seconds"]
    assert t.predict({"u0", "u2"})["switches"] == 4            # host -> u0 -> u1 -> u2 -> u3
    everything = t.predict({"u0", "u1", "u2", "u3"})
    assert everything["switches"] == 2 and everything["seconds"] == pytest.approx(4e-6 + 100e-6)
    assert t.predict(set())["switches"] == 0


def test_cpu_work_beside_the_gpu_is_priced_at_the_mixed_efficiency():
    """An all-CPU plan runs at the profile's rates; in a plan that also uses the GPU, each CPU op
    takes 1 / CPU_MIXED_EFFICIENCY as long (switches and GPU ops unscaled)."""
    from strata_compiler.passes import place

    class T(place._Timeline):
        def __init__(self):
            self.steps = [(f"u{i}", (10e-6, 1e-6), 50e-6, i) for i in range(3)]
            self.end_switch = 50e-6

    t = T()
    assert t.predict(set())["seconds"] == pytest.approx(30e-6)
    mixed = t.predict({"u2"})        # u0, u1 on the CPU; one switch to the GPU and one back
    eff = place.CPU_MIXED_EFFICIENCY
    assert 0 < eff <= 1
    assert mixed["seconds"] == pytest.approx(20e-6 / eff + 1e-6 + 100e-6)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_split_layer_after_gpu_work_costs_the_longer_share_with_overlap(overlap):
    """Fused decode steps run a split layer's CPU experts beside its GPU experts when the layer
    reaches its MoE on the GPU: the layer costs max(GPU share, CPU share), not their sum; a layer
    whose attention ran on the CPU still pays both in turn."""
    from strata_compiler.passes import place

    class T(place._Timeline):
        def __init__(self):
            self.cpu_op = 0.0
            self.overlap = overlap
            # attention, then the MoE with experts e0 (GPU 4 us / CPU 40 us) and e1 (5 / 50)
            self.steps = [("att", (30e-6, 3e-6), 50e-6, 0),
                          (None, [("e0", 40e-6, 4e-6), ("e1", 50e-6, 5e-6)], 50e-6, 0)]
            self.end_switch = 50e-6

    t = T()
    eff, kern = place.CPU_MIXED_EFFICIENCY, place.KERNELS[place.Op.MOE_FFN] * place.GPU_KERNEL_S
    g_t, c_t = 4e-6 + kern, 50e-6 / eff
    split = t.predict({"att", "e0"})     # host -> att, e0 on the GPU -> e1 on the CPU: two switches
    assert split["switches"] == 2
    moe = max(g_t, c_t) if overlap else g_t + c_t
    assert split["seconds"] == pytest.approx(3e-6 + 100e-6 + moe)
    cpu_att = t.predict({"e0"})          # attention on the CPU: the GPU share waits for it
    assert cpu_att["seconds"] == pytest.approx(30e-6 / eff + g_t + c_t + 100e-6)


def test_gpu_mem_needs_a_target(model, tmp_path, capsys):
    d = model[0]
    assert run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "x"), "--gpu-mem", "1GiB"]) != 0
    assert "--target" in capsys.readouterr().err


def test_target_profile_without_gpu_places_everything_on_the_cpu(model, tmp_path):
    d = model[0]
    hw = fake_profile(tmp_path / "hw.json")
    data = json.loads(hw.read_text())
    data["gpu"] = None
    hw.write_text(json.dumps(data))
    assert run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "p"), "--target", str(hw),
                             "--dump-dir", str(tmp_path / "dump"), "--dump-after", "place"]) == 0
    assert {n.device for n in load_plan(tmp_path / "p").graph.nodes} == {"cpu"}


def test_target_auto_measures_this_machine_once(model, tmp_path, monkeypatch):
    """--target auto: the compile driver (driver.hardware) measures the machine with the full
    probe (backends/probe.py) and caches the profile per host in Strata's cache dir; the next
    compile reads it back, and a quick profile found there is measured again."""
    import dataclasses
    import socket

    from strata_compiler.backends import probe as hwprobe

    d = model[0]
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "cache"))
    cached = tmp_path / "cache" / f"hw-full-{socket.gethostname()}.json"
    cached.parent.mkdir()
    quick = fake_profile(cached)                     # a quick profile: not good enough to plan with
    full = dataclasses.replace(hwp.HardwareProfile.from_json(quick), quick=False)
    calls = []
    monkeypatch.setattr(hwprobe, "probe", lambda **kw: calls.append(kw) or full)
    for out in ("a", "b"):
        assert run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / out), "--target", "auto",
                                 "--dump-dir", str(tmp_path / out / "dump"), "--dump-after", "place"]) == 0
        placement = json.loads((tmp_path / out / "dump" / "placement.json").read_text())
        assert placement["profile"]["gpu"] == "test gpu"
    assert len(calls) == 1 and not calls[0].get("quick", False)
    assert hwp.HardwareProfile.from_json(cached) == full


def test_plan_placed_on_the_cpu_runs_there_beside_a_gpu(model, tmp_path, monkeypatch):
    """--backend auto on a GPU host: a plan the cost model put wholly on the CPU (planned for a
    machine without a GPU) runs on the CPU as placed; an unplaced plan takes the host's best backend."""
    from strata_compiler.runtime import session as sess

    d = model[0]
    hw = fake_profile(tmp_path / "hw.json")
    data = json.loads(hw.read_text())
    data["gpu"] = None
    hw.write_text(json.dumps(data))
    assert run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "p"), "--target", str(hw)]) == 0
    assert run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "u"), "--quant", "int4"]) == 0
    picked = []
    monkeypatch.setattr(sess, "resolve_backend", lambda name: picked.append(name) or "llvm")
    placed = load_plan(tmp_path / "p")
    assert placed.meta["model"]["placed_by"] == "cost model"
    assert sess.Session(placed, "auto").backend == "llvm" and "auto" not in picked
    sess.Session(load_plan(tmp_path / "u"), "auto")
    assert picked[-1] == "auto"        # unplaced: the host decides (xla where a GPU is)


def test_place_strategy_forces_a_candidate(model, tmp_path, monkeypatch, capsys):
    """--place-strategy hot-experts: the dense parts and each layer's most used experts on the GPU,
    whatever the cost model prefers; with --expert-cache those shares become caches. Without
    --target, or when the layout does not fit, one line says so."""
    d, m, ids, ref_logits, ref_tokens = model
    hw = fake_profile(tmp_path / "hw.json")
    p = probe_placement(d, tmp_path, hw)
    mem = str(gpu_mem_for(p, p["gpu_bytes"] * 0.6))
    pl = _compile(d, tmp_path / "hot", hw, mem, "--place-strategy", "hot-experts")
    assert pl["choice"] == "dense on gpu, hottest experts on gpu"
    assert all(v["core"] == "gpu" for k, v in pl["per_layer"].items() if k not in ("-1",))
    assert 0 < sum(v["gpu_experts"] for v in pl["per_layer"].values()) < sum(v["experts"] for v in pl["per_layer"].values())
    _compile(d, tmp_path / "hotc", hw, mem, "--place-strategy", "hot-experts", "--expert-cache")
    g = load_plan(tmp_path / "hotc").graph
    assert any(n.attr("cache", "") for n in g.nodes)
    logits, tokens = run_plan(tmp_path / "hotc", ids, tmp_path, n_new=N_NEW, backend="auto", device="cpu")
    assert np.abs(logits - ref_logits).max() / ref_logits.std() <= 1e-4
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "x"), "--place-strategy", "ngl"]) != 0
    assert "--place-strategy ngl: a layout of the place pass; it needs --target" in capsys.readouterr().err
    assert run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "y"), "--target", str(hw), "--gpu-mem", "1KiB",
                             "--place-strategy", "hot-experts"]) != 0
    err = capsys.readouterr().err
    assert "--place-strategy hot-experts: that placement does not fit" in err and len(err.strip().splitlines()) == 1


def test_cpu_share_runs_before_the_gpu_share_is_waited_for(model, tmp_path):
    """A layer split between the devices: the CPU segment fetches the GPU share's result only where
    it first reads it (after its own share of the experts), so the CPU's experts run while the
    GPU computes its own — the overlap the runtime trace shows."""
    from strata_compiler.backends.llvm_cpu import executor as llvm_exe
    from strata_compiler.ir import Op
    from strata_compiler.kv_cache import KVCache
    from strata_compiler.runtime.partitions import MixedExecutor

    d, m, ids, ref_logits, ref_tokens = model
    hw = fake_profile(tmp_path / "hw.json")
    p = probe_placement(d, tmp_path, hw)
    _compile(d, tmp_path / "hot", hw, str(gpu_mem_for(p, p["gpu_bytes"] * 0.6)), "--place-strategy", "hot-experts")
    plan = load_plan(tmp_path / "hot")
    g = plan.graph
    mx = MixedExecutor(g, plan.weights, device="cpu")
    cpu = [exe for kind, exe, _ in mx.parts if kind == "llvm"]
    xla_made = {i for kind, _, part in mx.parts if kind == "xla" for i in part}
    late = [(exe, j, i) for exe in cpu for j, fetch in enumerate(exe.fetch_at) for i in fetch
            if i in xla_made and any(n.op is Op.MOE_FFN for n in exe.nodes[:j])]
    assert late, "no CPU segment reads a GPU result after running its own experts"
    log = []
    real = llvm_exe.LLVMExecutor._fetch

    def fetch(self, env, frame, inputs, M):
        log.append(("fetch", tuple(inputs)))
        return real(self, env, frame, inputs, M)

    llvm_exe.LLVMExecutor._fetch = fetch
    try:
        mm = plan.meta["model"]
        cache = KVCache(mm["n_layers"], 1, mm["n_kv_heads"], mm["head_dim"], 32)
        mx.run(ids[:, :4], cache)
        mx.run(ids[:, 4:5], cache)      # builds the decode step's frames
        for exe in cpu:      # log each op as it runs
            for M, (frame, ops) in exe.frames.items():
                exe.frames[M] = (frame, [(lambda step, op=op, n=n: (log.append(("op", n.id)), op(step)))
                                         for op, n in zip(ops, exe.nodes)])
        log.clear()
        mx.run(ids[:, 5:6], cache)
    finally:
        llvm_exe.LLVMExecutor._fetch = real
    for exe, j, i in late:
        at = next(k for k, e in enumerate(log) if e[0] == "fetch" and i in e[1])
        moe = next(n.id for n in exe.nodes[:j] if n.op is Op.MOE_FFN)
        assert log.index(("op", moe)) < at        # the CPU share ran before the GPU share was waited for
