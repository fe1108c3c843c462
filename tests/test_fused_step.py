"""backends/xla/host_call.py and runtime/fused_step.py: host calls inside a jitted program (on JAX's
CPU platform here: the same handler with memcpy for the CUDA copies), and a mixed plan's decode
step as one program giving the partition runtime's logits exactly."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from hf_models import build_model, clear_prompts, load_model
from strata_compiler.runtime.plan import load_plan
from test_expert_cache import cached_plan

jax = pytest.importorskip("jax")
jnp = jax.numpy


def _host_call(ins, outs, fn, after=False, staging=False):
    from strata_compiler.backends.xla.host_call import HostCall, python_work

    addr, _ = python_work(fn)
    return HostCall(ins, outs, addr, platform="cpu", after=after, staging=staging)


@pytest.mark.parametrize("staging", [False, True])
def test_host_call_copies_in_runs_and_copies_out(staging):
    """Straight into the host buffers and through staging buffers of their own (page-locked on
    a GPU: STRATA_HOST_CALL_STAGING=1)."""
    hin, hout = np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32)
    seen = []

    def work(stream):
        assert stream is None           # the CPU platform has no stream
        seen.append(hin.copy())
        np.multiply(hin, -2.0, out=hout)

    hc = _host_call([hin], [hout], work, staging=staging)
    f = jax.jit(lambda x: hc(x * 3.0)[0] + 1.0)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(np.asarray(f(x)), x * 3.0 * -2.0 + 1.0)
    np.testing.assert_array_equal(seen[-1], x * 3.0)       # the operand reached the host buffer
    np.testing.assert_array_equal(np.asarray(f(x + 1)), (x + 1) * -6.0 + 1.0)   # and again, fresh


def test_host_calls_chained_by_tokens_run_in_order_and_are_not_dropped():
    log = []
    a = _host_call([], [], lambda _s: log.append("a"))
    hb = np.zeros(1, np.float32)
    b = _host_call([hb], [], lambda _s: log.append(("b", float(hb[0]))), after=True)

    @jax.jit
    def f(x):
        (t,) = a()
        (t,) = b(x, after=t)
        return x + 1, t             # b's result is only its token: returned, so it is kept

    out, _ = f(jnp.full((1,), 5.0, jnp.float32))
    jax.block_until_ready(out)
    assert log == ["a", ("b", 5.0)]


@pytest.mark.parametrize("staging", [False, True])
def test_the_cuda_handler_ir_verifies(staging):
    """The handler as built for a GPU (cudaMemcpyAsync / cudaStreamSynchronize at fixed addresses,
    the stream from XLA's API): CI cannot run it, but LLVM can verify and compile it."""
    import llvmlite.binding as llvm

    from strata_compiler.backends.llvm_cpu.jit import optimize
    from strata_compiler.backends.llvm_cpu.target import Target
    from strata_compiler.backends.xla.host_call import _handler_ir

    ir = _handler_ir("h", [(0x1000, 64, 0x9000 if staging else 0), (0x2000, 8, 0xa000 if staging else 0)],
                     [(0x3000, 64, 0xb000 if staging else 0)], 0x4000, 7, memcpy=0x5000, sync=0x6000, skip_in=1,
                     wake=0x7000 if staging else 0)
    assert ("call void @llvm.memcpy" in ir) == staging        # the host side of the staging
    # the pool's wake comes first in the execute stage, before the copies and the sync
    assert (f"call void inttoptr (i64 {0x7000} to ptr)()" in ir) == staging
    if staging:
        assert ir.index(f"i64 {0x7000}") < ir.index(f"i64 {0x5000}")
    mod, tm = optimize(ir, Target.host())       # parses and verifies, else BackendError
    assert tm.emit_object(mod)
    llvm.parse_assembly(ir).verify()


def test_host_call_checks_its_operands():
    hc = _host_call([np.zeros(4, np.float32)], [], lambda _s: None)
    with pytest.raises(TypeError, match="does not match"):
        jax.jit(lambda x: hc(x)[0])(jnp.zeros(5, jnp.float32))
    with pytest.raises(TypeError, match="operands expected"):
        jax.jit(lambda x: hc(x, x)[0])(jnp.zeros(4, jnp.float32))
    with pytest.raises(TypeError, match="after"):
        jax.jit(lambda x: hc(x, after=x)[0])(jnp.zeros(4, jnp.float32))


def test_handler_answers_the_metadata_query_and_skips_other_stages():
    """Called by hand with a fake call frame: a metadata extension gets the API's version and no
    traits; a frame at a stage other than execute runs nothing."""
    from strata_compiler.backends.xla import host_call as H

    ran = []
    hc = _host_call([], [], lambda _s: ran.append(1))
    fn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(hc.address)
    api = (ctypes.c_uint8 * 128)()
    ctypes.c_int32.from_buffer(api, H._API_VERSION_MAJOR).value = 7
    ctypes.c_int32.from_buffer(api, H._API_VERSION_MINOR).value = 3
    meta = (ctypes.c_uint8 * 40)()
    ctypes.c_int32.from_buffer(meta, H._META_TRAITS).value = 99
    ext = (ctypes.c_uint8 * 32)()
    ctypes.c_int32.from_buffer(ext, H._EXT_TYPE).value = H._EXT_TYPE_METADATA
    ctypes.c_void_p.from_buffer(ext, H._EXT_METADATA).value = ctypes.addressof(meta)
    frame = (ctypes.c_uint8 * 176)()
    ctypes.c_void_p.from_buffer(frame, H._FRAME_EXT).value = ctypes.addressof(ext)
    ctypes.c_void_p.from_buffer(frame, H._FRAME_API).value = ctypes.addressof(api)
    assert fn(ctypes.addressof(frame)) is None
    assert ctypes.c_int32.from_buffer(meta, H._META_MAJOR).value == 7
    assert ctypes.c_int32.from_buffer(meta, H._META_MINOR).value == 3
    assert ctypes.c_int32.from_buffer(meta, H._META_TRAITS).value == 0
    ctypes.c_void_p.from_buffer(frame, H._FRAME_EXT).value = None
    ctypes.c_int32.from_buffer(frame, H._FRAME_STAGE).value = 0        # instantiate
    assert fn(ctypes.addressof(frame)) is None and not ran


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = build_model("qwen3_moe", tmp_path_factory.mktemp("fused") / "model")
    m = load_model(d)
    ids = clear_prompts(m, m.config.vocab_size, n_prompts=1, length=6, n_new=6, seed=6)[0]
    return d, m, ids


@pytest.mark.parametrize("batch,settings", [(1, "stream"), (2, "stream"), (1, "overlap"), (2, "overlap")])
def test_fused_decode_steps_equal_the_partition_runtime(model, tmp_path, monkeypatch, batch, settings):
    """A split plan with live expert caches (slot maps change between steps and, by the prefetch,
    inside them): every decode step
    of the fused program gives the partition runtime's logits (to float rounding: XLA may fuse
    across what were partition boundaries) and the same greedy tokens."""
    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.3))
    prompt = np.concatenate([ids, ids[:, ::-1]])[:batch]
    runs = {}
    monkeypatch.setenv("STRATA_SWAP_MARGIN", "0")     # swaps at the first edge: prefetches get admitted
    if settings == "stream":     # the cached layer split around its GPU share, copies on their own stream
        monkeypatch.setenv("STRATA_PREFETCH_STREAM", "1")
        monkeypatch.setenv("STRATA_HOST_CALL_STAGING", "1")
    else:                        # the split's CPU side on a worker thread while the GPU share runs
        monkeypatch.setenv("STRATA_FUSED_OVERLAP", "1")
    for fused in ("1", "0"):
        monkeypatch.setenv("STRATA_FUSED_STEP", fused)
        s = Session(plan, "auto", device="cpu", prefetch=True)
        assert (s.executor.fused is not None) == (fused == "1")
        s.executor.copy_share = 1e9       # no copy budget: the same copies in both runs, whatever the timing
        s.reset(batch, 64)
        out = [s.step(prompt)[:, -1]]
        rng = np.random.default_rng(1)
        for t in range(8):
            out.append(s.step(rng.integers(0, m.config.vocab_size, (batch, 1)))[:, -1])
            if t == 0:
                before = sum(c.prefetches for c, *_ in s.executor.caches)
        runs[fused] = (np.concatenate(out), s, before)
    a, b = runs["1"][0], runs["0"][0]
    assert np.abs(a - b).max() / b.std() <= 1e-5
    np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
    s = runs["1"][1]
    assert s.executor.fused.steps == 7          # the first decode step runs partition by partition
    assert sum(c.swaps for c, *_ in s.executor.caches) > 0     # experts moved between fused steps
    # the prefetch runs inside the host calls (here: the embedding's), as often as partition by
    # partition, and the GPU shares read the slot maps it changed
    pf = {k: sum(c.prefetches for c, *_ in r[1].executor.caches) for k, r in runs.items()}
    assert pf["1"] == pf["0"] and pf["1"] > runs["1"][2]
    # the cached layer's CPU partition ran as two host calls around its GPU share
    fused = s.executor.fused
    assert fused._splits and {part for _, _, part in fused._calls} >= {"start", "finish"}
    assert s.executor._copy_plans         # in-step copies took the raw path (addresses worked out once)


def test_a_failing_cpu_partition_raises_after_the_step(model, tmp_path, monkeypatch):
    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.3))
    s = Session(plan, "auto", device="cpu")
    s.reset(1, 64)
    s.step(ids)
    s.step(ids[:, :1])
    exe = next(e for k, e, _ in s.executor.parts if k == "llvm")

    def boom(*a, **k):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(exe, "run_segment", boom)
    with pytest.raises(RuntimeError, match="kernel exploded"):
        s.step(ids[:, :1])


def test_a_full_cache_is_a_clear_error_in_fused_steps(model, tmp_path, monkeypatch):
    from strata_compiler.errors import UsageError
    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.3))
    s = Session(plan, "auto", device="cpu")
    s.reset(1, ids.shape[1] + 2)
    s.step(ids)
    s.step(ids[:, :1])
    s.step(ids[:, :1])          # a fused step fills the cache
    assert s.executor.fused.steps == 1
    with pytest.raises(UsageError, match="exceeds the KV cache capacity"):
        s.step(ids[:, :1])


def test_a_fused_program_that_fails_to_build_falls_back_with_one_warning(model, tmp_path, monkeypatch, capsys):
    from strata_compiler.runtime.fused_step import FusedStep
    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.3))
    monkeypatch.setenv("STRATA_FUSED_STEP", "0")
    ref = Session(plan, "auto", device="cpu")
    monkeypatch.delenv("STRATA_FUSED_STEP")
    s = Session(plan, "auto", device="cpu")

    def broken(self, *a, **k):
        raise NotImplementedError("no FFI here")

    monkeypatch.setattr(FusedStep, "_step", broken)
    out = {}
    for name, sess in (("ref", ref), ("fb", s)):
        sess.executor.copy_share = 1e9
        sess.reset(1, 64)
        steps = [sess.step(ids)[:, -1]] + [sess.step(ids[:, i:i + 1])[:, -1] for i in range(4)]
        out[name] = np.concatenate(steps)
    assert s.executor.fused is None
    err = capsys.readouterr().err
    assert err.count("decode steps as one program failed (NotImplementedError: no FFI here)") == 1
    assert np.abs(out["fb"] - out["ref"]).max() / out["ref"].std() <= 1e-5


def test_overlap_on_a_static_hot_split(model, tmp_path, monkeypatch):
    """Every layer split with its hot experts on the GPU (no cache): with STRATA_FUSED_OVERLAP=1 each
    layer's CPU side runs on the pool's runner thread beside its GPU share (the start call's inputs
    come from the share's own partition), and the logits stay the partition runtime's."""
    from strata_compiler.runtime.session import Session
    from test_place import _compile, budget_decides, fake_profile, gpu_mem_for, probe_placement

    d, m, ids = model
    budget_decides(monkeypatch)
    hw = fake_profile(tmp_path / "hw.json")
    probe = probe_placement(d, tmp_path, hw)
    _compile(d, tmp_path / "half", hw, gpu_mem_for(probe, probe["gpu_bytes"] * 0.5))
    plan = load_plan(tmp_path / "half")
    out = {}
    for overlap in ("1", "", "0"):      # "": unset, the default (auto: the native splits overlap)
        monkeypatch.setenv("STRATA_FUSED_OVERLAP", overlap)
        s = Session(plan, "auto", device="cpu")
        s.reset(1, 64)
        out[overlap] = np.concatenate([s.step(ids)[:, -1]] + [s.step(ids[:, i:i + 1])[:, -1] for i in range(5)])
        f = s.executor.fused
        if overlap != "0":
            assert f.steps == 4 and f._splits and not any(n.attr("cache", "") for n, *_ in f._splits.values())
            # both halves of every split partition run natively: the first on the pool's runner
            # thread (strata_async_start), the second after waiting for it
            assert set(f._splits) == f.overlap and set(f._splits) <= f.native_calls
        else:
            assert not f._splits and not f.overlap
    for overlap in ("1", ""):
        assert np.abs(out[overlap] - out["0"]).max() / out["0"].std() <= 1e-6


def test_overlap_switch_rejects_other_values(monkeypatch):
    from strata_compiler.errors import UsageError
    from strata_compiler.runtime.fused_step import overlap_mode

    monkeypatch.setenv("STRATA_FUSED_OVERLAP", "yes")
    with pytest.raises(UsageError, match="STRATA_FUSED_OVERLAP='yes'"):
        overlap_mode()
    monkeypatch.delenv("STRATA_FUSED_OVERLAP")
    assert overlap_mode() == "auto"


def test_cpu_partitions_run_as_native_programs_with_the_same_logits(model, tmp_path, monkeypatch):
    """A static split (no cache): with STRATA_NATIVE_SEGMENTS=1 (the default) each fused step's host
    calls run their partition as one native program (pool.py strata_run_program), giving exactly
    the logits of the op-by-op Python path; the all-CPU plan's steps (attention included) too.
    The mixed plan's kernels split 4 chunks per thread, the all-CPU plan's 1."""
    from strata_compiler.backends.llvm_cpu import pool as poolmod
    from strata_compiler.runtime.session import Session
    from test_place import _compile, budget_decides, fake_profile, gpu_mem_for, probe_placement

    d, m, ids = model
    budget_decides(monkeypatch)
    hw = fake_profile(tmp_path / "hw.json")
    probe = probe_placement(d, tmp_path, hw)
    _compile(d, tmp_path / "half", hw, gpu_mem_for(probe, probe["gpu_bytes"] * 0.5))
    calls = []
    real = poolmod.ThreadPool.run_program
    monkeypatch.setattr(poolmod.ThreadPool, "run_program", lambda self, a, n: (calls.append(n), real(self, a, n)))
    from strata_compiler.runtime import trace

    for plan_dir, backend in ((tmp_path / "half", "auto"), (tmp_path / "half", "llvm")):
        plan = load_plan(plan_dir)
        out, ran, native_calls = {}, {}, {}
        # op by op in Python; segment programs called from Python; programs called by the host calls
        for name, seg, hc in (("python", "0", "0"), ("segments", "1", "0"), ("host calls", "1", "1"), ("traced", "1", "1")):
            monkeypatch.setenv("STRATA_NATIVE_SEGMENTS", seg)
            monkeypatch.setenv("STRATA_NATIVE_HOST_CALLS", hc)
            calls.clear()
            s = Session(plan, backend, device="cpu")
            s.reset(1, 64)
            tr = trace.Tracer() if name == "traced" else None
            if tr is not None:
                trace.ACTIVE = tr
            try:
                out[name] = np.concatenate([s.step(ids)[:, -1]] + [s.step(ids[:, i:i + 1])[:, -1] for i in range(5)])
            finally:
                trace.ACTIVE = None
            ran[name] = len(calls)
            fused = getattr(s.executor, "fused", None)
            native_calls[name] = len(fused.native_calls) if fused is not None else 0
            if fused is not None and name == "host calls":
                # the benchmarks' timeline gets the native calls' entry and exit too (TSC records)
                fused.timeline = []
                s.step(ids[:, :1])
                tl, fused.timeline = fused.timeline, None
                entered = {p for ev, p, _ in tl if ev == "enter"}
                assert fused.native_calls <= entered and [ev for ev, *_ in tl][0] == "dispatch"
                assert [ev for ev, *_ in tl][-1] == "done" and all(a[2] <= b[2] for a, b in zip(tl, tl[1:]))
            # CPU kernels beside the GPU runtime cut 4 chunks per thread (partitions.MIXED_POOL_SPLIT)
            assert poolmod.get_pool().split == (4 if backend == "auto" else 1)
        assert ran["python"] == 0 and ran["segments"] > 0, (plan_dir, ran)
        if backend == "auto":
            # every split layer's CPU partition runs from its host call: no Python call of a program
            # in the fused steps (only in prefill and the first decode step, partition by partition)
            assert native_calls["host calls"] > 0 and native_calls["segments"] == 0
            assert ran["host calls"] < ran["segments"]
            # while tracing, the same host calls run the program with time stamps between its ops:
            # their spans (native=True) join the trace beside the GPU's stretches
            assert ran["traced"] == 0 and any(e["name"] == "fused step: gpu segment 1" for e in tr.events), ran
            assert any(e["name"] == "moe_ffn" and e.get("args", {}).get("native") for e in tr.events)
        for name in out:
            np.testing.assert_array_equal(out[name], out["python"], err_msg=name)


@pytest.mark.parametrize("batch", [1, 2])
def test_cached_layers_without_prefetch_run_natively_and_overlap(model, tmp_path, monkeypatch, batch):
    """With the prefetch off, a cached layer's CPU side needs no per-step Python: its program masks
    the routing weights by the live cache (pool.py MASK) and counts the routings per expert, so its
    host calls run natively, split around the GPU share and overlapped (STRATA_FUSED_OVERLAP
    auto). Logits, swaps, hits and misses equal the Python host calls'."""
    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.3))
    runs = {}
    for native in ("1", "0"):
        monkeypatch.setenv("STRATA_NATIVE_HOST_CALLS", native)
        s = Session(plan, "auto", device="cpu", prefetch=False)
        s.executor.copy_share = 1e9       # no copy budget: the same swaps in both runs, whatever the timing
        s.reset(batch, 64)
        rng = np.random.default_rng(1)
        prompt = np.concatenate([ids, ids[:, ::-1]])[:batch]
        out = [s.step(prompt)[:, -1]] + [s.step(rng.integers(0, m.config.vocab_size, (batch, 1)))[:, -1]
                                         for _ in range(8)]
        caches = [c for c, *_ in s.executor.caches]
        runs[native] = (np.concatenate(out), [(c.hits, c.misses, c.swaps) for c in caches], s.executor.fused)
    (a, stats_a, f), (b, stats_b, _) = runs["1"], runs["0"]
    assert np.abs(a - b).max() / b.std() <= 1e-5
    assert stats_a == stats_b and sum(sw for *_, sw in stats_a) > 0 and all(h + mi > 0 for h, mi, _ in stats_a)
    cached_splits = {i for i, sp in f._splits.items() if sp[0].attr("cache", "")}
    assert cached_splits and cached_splits <= f.native_calls and cached_splits <= f.overlap


@pytest.mark.parametrize("batch,stream", [(1, "0"), (2, "0"), (1, "1")])
def test_native_prefetch_equals_the_python_one(tmp_path, monkeypatch, batch, stream):
    """STRATA_NATIVE_PREFETCH=1: a cached layer's prefetch (router, choice of copies, copies, slot
    maps) runs as native code after its host call's program, so every CPU partition's call is
    native and the cached splits overlap. The logits, and the prefetches, swaps, hits, misses,
    prediction counts, bytes copied and the idle back-off's pauses (where a paused native
    prefetch still hands back the slot maps), equal the Python prefetch's."""
    from benchmarks.placement_bench import TINY
    from benchmarks.placement_bench import build_model as synthetic
    from strata_compiler.runtime.session import Session
    from test_place import _compile, budget_decides, fake_profile, gpu_mem_for, probe_placement

    # the benchmarks' tiny 4-layer model, every layer split with its hottest experts a cache on
    # the GPU: each later layer's prefetch is triggered by the layer before's result, in a CPU
    # partition that needs no other Python
    d = synthetic(tmp_path, TINY, 0.5)
    budget_decides(monkeypatch)
    hw = fake_profile(tmp_path / "hw.json")
    probe = probe_placement(d, tmp_path, hw)
    calib = Path(__file__).resolve().parents[1] / "examples" / "models" / "tiny-moe" / "calib.txt"
    _compile(d, tmp_path / "hot", hw, gpu_mem_for(probe, probe["gpu_bytes"] * 0.5), "--place-strategy", "hot-experts",
             "--expert-cache", "--calib", str(calib), "--calib-tokens", "64", "--no-imatrix")
    plan = load_plan(tmp_path / "hot")
    ids = np.arange(1, 7)[None] * 37 % TINY["vocab"]
    # STRATA_PREFETCH_STREAM=1: the cached layers split around their GPU shares for the copy
    # stream (on a GPU the start call waits for the copies' event); natively too
    monkeypatch.setenv("STRATA_PREFETCH_STREAM", stream)
    runs = {}
    for native in ("1", "0"):
        monkeypatch.setenv("STRATA_NATIVE_PREFETCH", native)
        s = Session(plan, "auto", device="cpu", prefetch=True)
        s.executor.copy_share = 1e9
        s.reset(batch, 64)
        rng = np.random.default_rng(1)
        prompt = np.concatenate([ids, ids[:, ::-1]])[:batch]
        out = [s.step(prompt)[:, -1]] + [s.step(rng.integers(0, TINY["vocab"], (batch, 1)))[:, -1]
                                         for _ in range(8)]
        caches = [c for c, *_ in s.executor.caches]
        if native == "1":       # a traced step takes the Python path (its copies go into the trace)
            from strata_compiler.runtime import trace

            trace.ACTIVE = trace.Tracer()
            try:
                out.append(s.step(rng.integers(0, TINY["vocab"], (batch, 1)))[:, -1])
            finally:
                trace.ACTIVE = None
            assert s.executor.fused._cells[0] == 1
        else:
            out.append(s.step(rng.integers(0, TINY["vocab"], (batch, 1)))[:, -1])
        for c in caches:
            c.fold()
        if native == "1":       # its bookkeeping ran as whole arrays (expert_cache.CacheGroup), the
            assert s.executor.cache_group.steps >= 6        # Python prefetch's cache by cache
        runs[native] = (np.concatenate(out), [(c.prefetches, c.swaps, c.hits, c.misses, c.pf_predicted, c.pf_correct,
                                               c.bytes_moved, c.pf_paused, c.slots.tolist()) for c in caches],
                        s.executor.fused)
    (a, stats_a, f), (b, stats_b, fp) = runs["1"], runs["0"]
    assert np.abs(a - b).max() / b.std() <= 1e-5
    assert stats_a == stats_b and sum(st[0] for st in stats_a) > 0
    assert sum(st[7] for st in stats_a) > 0      # the idle back-off paused predictions, in both alike
    assert f._prefetch and {i for i, _ in f._prefetch} <= f.native_calls
    assert not fp._prefetch          # (the Python prefetch: no native one built)
    cached_splits = {i for i, sp in f._splits.items() if sp[0].attr("cache", "")}
    assert cached_splits and cached_splits <= f.native_calls and cached_splits <= f.overlap


@pytest.mark.parametrize("overlap", ["auto", "1"])
def test_a_dropped_session_is_freed(model, tmp_path, monkeypatch, overlap):
    """Host call handlers and native prefetches live as long as XLA keeps their targets, the
    process; they hold the fused step's work weakly, so a session dropped after decoding through
    an expert cache with prefetch frees its executor (and the weights it holds), and the overlap
    thread of STRATA_FUSED_OVERLAP=1 ends."""
    import gc
    import threading
    import weakref

    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.3))
    monkeypatch.setenv("STRATA_FUSED_OVERLAP", overlap)
    if overlap == "1":
        monkeypatch.setenv("STRATA_NATIVE_HOST_CALLS", "0")    # Python host calls: the overlap thread
    s = Session(plan, "auto", device="cpu")
    s.reset(1, 32)
    tok = int(s.step(ids)[0, -1].argmax())
    for _ in range(3):
        tok = int(s.step(np.array([[tok]], np.int64))[0, -1].argmax())
    f = s.executor.fused
    assert f is not None and f.steps > 0 and s.executor.caches
    if overlap == "1":
        assert f.overlap and any(t.name == "strata-fused-overlap" for t in threading.enumerate())
    ref = weakref.ref(s.executor)
    del s, f
    gc.collect()
    assert ref() is None
    for _ in range(100):
        if not any(t.name == "strata-fused-overlap" for t in threading.enumerate()):
            break
        threading.Event().wait(0.01)
    assert not any(t.name == "strata-fused-overlap" for t in threading.enumerate())
