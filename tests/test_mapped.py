"""Expert-cache misses read by the GPU in place (runtime/mapped.py, `--miss-path gpu`): the DLPack
view of host memory, the graph rebinding, and decode logits and cache statistics against the
static split and the CPU miss path (JAX's CPU platform stands in for the GPU; the kernels' two
sources are tested in tests/test_pallas_moe.py)."""

from __future__ import annotations

import numpy as np
import pytest

from strata_compiler.cli_common import run_cli
from strata_compiler.ir import Op
from strata_compiler.backends.xla import mapped as xla_mapped
from strata_compiler.experts import in_place_weights
from strata_compiler.runtime import mapped
from strata_compiler.runtime.cli import strata_run
from strata_compiler.runtime.plan import load_plan
from test_expert_cache import N_NEW, cached_plan, model  # noqa: F401 (the module's model fixture)

jax = pytest.importorskip("jax")


def test_dlpack_view_aliases_the_host_array():
    """The capsule's struct layout: JAX reads it as a view of the host array itself (here as a CPU
    tensor; on a GPU the same struct carries the pages' device address)."""
    a = xla_mapped.aligned_copy(np.arange(24, dtype=np.uint16).reshape(4, 6))
    assert a.ctypes.data % 4096 == 0
    cap = xla_mapped._Capsule(a.ctypes.data, a.shape, a.dtype, 0, device_type=1)
    x = jax.dlpack.from_dlpack(cap, copy=False)
    assert x.unsafe_buffer_pointer() == a.ctypes.data
    np.testing.assert_array_equal(np.asarray(x), a)
    with pytest.raises(TypeError, match="not supported"):
        xla_mapped._Capsule(a.ctypes.data, a.shape, np.dtype(bool), 0)


def test_rebind_moves_each_cached_layers_cpu_side(model, tmp_path, monkeypatch):
    d, m, ids = model
    g = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.3)).graph
    r = mapped.rebind_misses(g)
    pairs = mapped.in_place_pairs(r)
    assert pairs and mapped.in_place_pairs(g) == {}          # the plan's own graph is left as it was
    for gid, hid in pairs.items():
        gpu, host = r.node(gid), r.node(hid)
        assert gpu.attr("cache") == host.attr("cache") and host.backend == "xla" and host.device == gpu.device
        add = next(r.node(u) for u in r.users()[hid])
        assert add.op is Op.ADD and add.backend == "xla"
        assert all(r.node(a).backend == "xla" for a in (*host.args, *add.args))
        assert g.node(hid).backend == "llvm"
    # the embedding the plan left on the CPU goes too, its table read in place, so no host call
    # opens the step
    emb = next(n for n in r.nodes if n.op is Op.EMBED)
    assert g.node(emb.id).backend == "llvm" and emb.backend == "xla"
    assert in_place_weights(r) == ({w for h in pairs.values() for _, w in r.node(h).weights}
                                   | {emb.weight("table")})
    assert in_place_weights(g) == set()
    from strata_compiler.runtime.partitions import partitions

    # each cached layer's nodes now fall into GPU partitions only
    part = {nid: kind for kind, ids_ in partitions(r, cache_cuts=False) for nid in ids_}
    assert all(part[h] == "xla" for h in pairs.values())


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_steps_match_the_static_split_and_the_cpu_misses(model, tmp_path, monkeypatch, batch):
    """Step by step while experts move: the logits of misses read in place equal the static run's
    and the CPU miss path's, with the same hits, misses and swaps as the CPU miss path (the same
    routing, the same policy), counted on the device and folded into the caches."""
    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.3))
    prompt = np.concatenate([ids, ids[:, ::-1]])[:batch]
    runs = {}
    for mode in ("static", "cpu", "gpu"):
        s = Session(plan, "auto", device="cpu", expert_cache=mode != "static", miss_path="cpu" if mode == "static" else mode)
        assert s.miss_path == ("gpu" if mode == "gpu" else "cpu")
        s.reset(batch, 64)
        out = [s.step(prompt)[:, -1]]
        rng = np.random.default_rng(0)
        for _ in range(10):
            out.append(s.step(rng.integers(0, m.config.vocab_size, (batch, 1)))[:, -1])
        runs[mode] = (np.concatenate(out), s)
    base = runs["static"][0]
    for mode in ("cpu", "gpu"):
        assert np.abs(runs[mode][0] - base).max() / base.std() <= 1e-5, mode
    gpu, cpu = runs["gpu"][1], runs["cpu"][1]
    assert gpu.executor.mapped and not cpu.executor.mapped
    # no CPU partition is left inside a cached layer: the GPU share computes it whole
    hosts = set(gpu.executor.mapped.values())
    assert all(kind == "xla" for kind, _, ids_ in gpu.executor.parts if hosts & set(ids_))
    stats = lambda s: [(c.hits, c.misses, c.swaps) for c, *_ in s.executor.swaps.caches]   # noqa: E731
    assert stats(gpu) == stats(cpu) and sum(sw for *_, sw in stats(gpu)) > 0
    assert all(c.miss_path == "gpu" and c.expert_bytes > 0 for c, *_ in gpu.executor.swaps.caches)
    # the device's counts went into the CacheGroup's rows as one operation
    assert gpu.executor.swaps._count_rows and all(r is not False for r in gpu.executor.swaps._count_rows.values())


def test_cli_miss_path_gpu_matches_transformers_and_reports_the_reads(model, tmp_path, monkeypatch, capsys):
    from hf_models import hf_greedy, hf_logits

    d, m, ids = model
    plan = cached_plan(d, tmp_path, monkeypatch, 0.5)
    np.save(tmp_path / "ids.npy", ids)
    assert run_cli(strata_run, [str(plan / "plan.bin"), "--input-ids", str(tmp_path / "ids.npy"), "-n", str(N_NEW),
                                "--greedy", "--ignore-eos", "--device", "cpu", "--miss-path", "gpu", "--stats",
                                "--logits-out", str(tmp_path / "l.npy"), "--tokens-out", str(tmp_path / "t.npy")]) == 0
    ref = hf_logits(m, ids)
    assert np.abs(np.load(tmp_path / "l.npy") - ref).max() / ref.std() <= 1e-4
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy"), hf_greedy(m, ids, N_NEW)[0])
    err = capsys.readouterr().err
    assert "hit rate" in err and "read by the GPU from host memory in place" in err
    # auto (the default) on a host without a GPU: the CPU miss path, no line about reads in place
    assert run_cli(strata_run, [str(plan / "plan.bin"), "--input-ids", str(tmp_path / "ids.npy"), "-n", "2",
                                "--device", "cpu", "--stats"]) == 0
    err = capsys.readouterr().err
    assert "hit rate" in err and "in place" not in err
    assert run_cli(strata_run, [str(plan / "plan.bin"), "--input-ids", str(tmp_path / "ids.npy"), "-n", "2",
                                "--device", "cpu", "--miss-path", "sometimes"]) == 2
    assert "--miss-path" in capsys.readouterr().err


@pytest.mark.parametrize("share", [0.9, 0.3])
def test_a_step_without_host_calls_runs_as_one_program(model, tmp_path, monkeypatch, share):
    """Where rebinding leaves no CPU partition before the GPU's work (a plan whose only CPU ops
    were a cached layer's share; or the embedding moved too), decode steps still run as one fused
    program — one packed input with the slot maps, swaps queued — and give the static split's
    logits."""
    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, share))
    runs = {}
    for mode in ("static", "gpu"):
        s = Session(plan, "auto", device="cpu", expert_cache=mode == "gpu", miss_path="cpu" if mode == "static" else "gpu")
        s.reset(1, 64)
        out = [s.step(ids)[:, -1]]
        rng = np.random.default_rng(0)
        for _ in range(8):
            out.append(s.step(rng.integers(0, m.config.vocab_size, (1, 1)))[:, -1])
        runs[mode] = (np.concatenate(out), s)
    a, b = runs["gpu"][0], runs["static"][0]
    assert np.abs(a - b).max() / b.std() <= 1e-5
    ex = runs["gpu"][1].executor
    assert ex.parts[0][0] == "xla" and ex.fused is not None and ex.fused.steps == 7 and ex.swaps.async_swaps
    if share == 0.9:
        assert [k for k, _, _ in ex.parts] == ["xla"]        # nothing left on the CPU: no host call at all


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe"])
def test_other_architectures(arch, tmp_path, monkeypatch):
    """Qwen2-MoE (a shared expert beside the routed ones) and OLMoE (every op then on the GPU, a
    fused step without host calls): misses read in place give transformers' prompt logits and the
    CPU miss path's decode logits."""
    from hf_models import build_model, hf_logits, load_model

    from strata_compiler.runtime.session import Session

    d = build_model(arch, tmp_path / "model")
    m = load_model(d)
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.7))
    ids = np.array([[3, 7, 1, 9, 4, 2]])
    ref = hf_logits(m, ids)
    out = {}
    for mode in ("cpu", "gpu"):
        s = Session(plan, "auto", device="cpu", miss_path=mode)
        assert bool(s.executor.mapped) == (mode == "gpu")
        s.reset(1, 64)
        prompt = s.step(ids)
        assert np.abs(prompt - ref).max() / ref.std() <= 1e-4, mode
        rng = np.random.default_rng(0)
        out[mode] = np.concatenate([s.step(rng.integers(0, m.config.vocab_size, (1, 1)))[:, -1] for _ in range(6)])
    assert np.abs(out["gpu"] - out["cpu"]).max() / out["cpu"].std() <= 1e-5


def test_the_gpu_kernels_read_slots_and_host_arrays_in_a_model(model, tmp_path, monkeypatch):
    """The path a GPU runs: an int4 cached plan whose GPU share goes through the Pallas MoE kernels
    (interpret mode here) with the slot map, the routing inside the kernels and the chosen experts
    counted from theirs, step by step while experts move; against the same plan through XLA's
    multiply-reduce with the same slots."""
    from test_place import budget_decides, fake_profile, gpu_mem_for, probe_placement

    from strata_compiler.cli import stratac
    from strata_compiler.runtime.session import Session

    d, m, ids = model
    budget_decides(monkeypatch)
    hw = fake_profile(tmp_path / "hw.json")
    probe = probe_placement(d, tmp_path, hw, "--quant", "int4")
    assert run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "plan"), "--target", str(hw), "--quant", "int4",
                             "--gpu-mem", str(gpu_mem_for(probe, probe["gpu_bytes"] * 0.3)), "--expert-cache"]) == 0
    plan = load_plan(tmp_path / "plan")
    monkeypatch.setenv("STRATA_PALLAS_ATTN", "off")
    from strata_compiler.backends.xla import pallas_moe

    calls = []
    real = pallas_moe.moe_decode
    monkeypatch.setattr(pallas_moe, "moe_decode", lambda *a, **kw: calls.append(kw.get("slots") is not None)
                        or real(*a, **kw))
    runs = {}
    for kernels in ("interpret", "off"):
        monkeypatch.setenv("STRATA_PALLAS", kernels)
        s = Session(plan, "auto", device="cpu", miss_path="gpu")
        s.reset(1, 64)
        out = [s.step(ids)[:, -1]]
        rng = np.random.default_rng(3)
        for _ in range(6):
            out.append(s.step(rng.integers(0, m.config.vocab_size, (1, 1)))[:, -1])
        runs[kernels] = (np.concatenate(out), [(c.hits, c.misses, c.swaps) for c, *_ in s.executor.swaps.caches])
    assert any(calls)                                       # the kernels ran with the slot map
    a, b = runs["interpret"][0], runs["off"][0]
    assert np.abs(a - b).max() / b.std() <= 0.05        # the kernels' q8 activations (dp4a) against f32
    assert runs["interpret"][1] == runs["off"][1] and sum(sw for *_, sw in runs["off"][1]) > 0


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_ahead_gives_the_greedy_tokens_while_experts_move(model, tmp_path, monkeypatch, batch):
    """A plan without host calls decodes ahead (each step dispatched before the one before has
    finished, its ids that step's token on the device; swaps masked, then copied a step later):
    the same greedy tokens as step-by-step decoding and transformers, swaps made along the way,
    every routing counted once as a hit or a miss."""
    from hf_models import hf_greedy

    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.runtime.session import Session

    monkeypatch.setenv("STRATA_SWAP_MARGIN", "0")      # swaps nearly every step
    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.9))       # (a cached layer, no CPU op left)
    prompt = np.concatenate([ids, ids[:, ::-1]])[:batch]
    runs = {}
    for ahead in ("1", "0"):
        s = Session(plan, "auto", device="cpu", miss_path="gpu")
        if ahead == "1":
            _, new = s.generate(prompt, N_NEW, Sampler())
        else:       # step by step: greedy tokens from each step's logits, as under a trace
            s.reset(batch, s.capacity_for(prompt.shape[1], N_NEW))
            tok = s.step(prompt)[:, -1].argmax(-1)
            new = [tok]
            for _ in range(N_NEW - 1):
                tok = s.step(tok[:, None])[:, -1].argmax(-1)
                new.append(tok)
            new = np.stack(new, 1)
        runs[ahead] = (new, s)
    new, s = runs["1"]
    np.testing.assert_array_equal(new, runs["0"][0])
    # (the module's prompt is clear of near-ties; the reversed one need not be)
    np.testing.assert_array_equal(new[0], hf_greedy(m, ids, N_NEW)[0][0])
    ex = s.executor
    # the first decode step runs partition by partition, the rest ahead (none: step by step)
    assert ex.fused.steps == N_NEW - 2 and ex.fused._ahead_fn and not ex.fused._fn
    assert runs["0"][1].executor.fused._fn and not runs["0"][1].executor.fused._ahead_fn
    caches = [c for c, *_ in ex.swaps.caches]
    assert sum(c.swaps for c in caches) > 0
    routed = lambda s: sum(c.hits + c.misses for c, *_ in s.executor.swaps.caches)    # noqa: E731
    assert routed(s) == routed(runs["0"][1]) > 0
    # no swap is left decided and uncopied: each cache's slots hold what its map says
    for c, xla, n, host in ex.swaps.caches:
        gu = np.asarray(xla.params[n.weight("gate_up")][next(iter(xla.params[n.weight("gate_up")]))])
        src = ex.swaps.host_arrays(host.weight("gate_up"))
        np.testing.assert_array_equal(gu, np.asarray(src[next(iter(src))])[c.slots])


def test_sampled_decode_ahead_gives_the_host_samplers_tokens(model, tmp_path, monkeypatch):
    """The chat defaults (top-k 40, a repetition penalty) on a plan without host calls: decoded
    ahead, tokens chosen on the device (backends/xla/sampling.py), the same tokens as the host's
    sampler gives the same seed step by step."""
    from strata_compiler.runtime import partitions
    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.runtime.session import Session
    from strata_compiler.sampling import Sampling

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.9))
    runs = []
    for ahead in (True, False):
        if not ahead:
            monkeypatch.setattr(partitions.MixedExecutor, "can_decode_ahead", lambda self, *a, **k: False)
        s = Session(plan, "auto", device="cpu", miss_path="gpu")
        _, new = s.generate(ids, N_NEW, Sampler.of(Sampling(temperature=1.5), seed=4), keep_logits=False)
        runs.append((new, s.executor.fused.steps, bool(s.executor.fused._ahead_fn)))
    assert runs[0][0].tolist() == runs[1][0].tolist()
    assert runs[0][2] and not runs[1][2]        # ahead on the device, then step by step


def test_decode_ahead_stops_at_a_stop_id(model, tmp_path, monkeypatch):
    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.9))
    s = Session(plan, "auto", device="cpu", miss_path="gpu")
    _, full = s.generate(ids, N_NEW, Sampler())
    stop = int(full[0, 5])
    first = int(np.flatnonzero(full[0] == stop)[0])
    _, new = s.generate(ids, N_NEW, Sampler(), stop_ids=(stop,))
    np.testing.assert_array_equal(new[0], full[0, :first + 1])


def test_cli_stats_while_decoding_ahead(model, tmp_path, monkeypatch, capsys):
    """`--stats` alone does not stop decoding ahead: a span per step on the steps' and the GPU's
    tracks, the caches' lines; `--trace` decodes step by step (every step's spans and the caches'
    hit/miss instants in the file), with the same tokens."""
    import json

    from hf_models import hf_greedy

    from strata_compiler.runtime import partitions

    d, m, ids = model
    plan = cached_plan(d, tmp_path, monkeypatch, 0.9)
    np.save(tmp_path / "ids.npy", ids)
    calls = []
    real = partitions.MixedExecutor.decode_ahead
    monkeypatch.setattr(partitions.MixedExecutor, "decode_ahead", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    args = [str(plan / "plan.bin"), "--input-ids", str(tmp_path / "ids.npy"), "-n", str(N_NEW), "--ignore-eos",
            "--greedy", "--device", "cpu", "--miss-path", "gpu"]
    assert run_cli(strata_run, args + ["--stats", "--tokens-out", str(tmp_path / "a.npy")]) == 0
    err = capsys.readouterr().err
    assert calls and "hit rate" in err and "gpu partitions (xla)" in err and "steps (host)" in err
    assert run_cli(strata_run, args + ["--trace", str(tmp_path / "t.json"), "--tokens-out", str(tmp_path / "b.npy")]) == 0
    assert len(calls) == 1
    want = hf_greedy(m, ids, N_NEW)[0]
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), want)
    np.testing.assert_array_equal(np.load(tmp_path / "b.npy"), want)
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert any(e.get("ph") == "i" and "expert cache" in e["name"] for e in events)
