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


def _host_call(ins, outs, fn, after=False):
    from strata_compiler.backends.xla.host_call import HostCall, python_work

    addr, _ = python_work(fn)
    return HostCall(ins, outs, addr, platform="cpu", after=after)


def partition_by_partition(s):
    """Session s's decode steps partition by partition, as when a fused program fails to build
    (the reference the fused steps are checked against)."""
    s.executor.fused = None
    return s


def test_host_call_copies_in_runs_and_copies_out():
    hin, hout = np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32)
    seen = []

    def work(stream):
        assert stream is None           # the CPU platform has no stream
        seen.append(hin.copy())
        np.multiply(hin, -2.0, out=hout)

    hc = _host_call([hin], [hout], work)
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


@pytest.mark.parametrize("wake", [0, 0x7000])
def test_the_cuda_handler_ir_verifies(wake):
    """The handler as built for a GPU (cudaMemcpyAsync / cudaStreamSynchronize at fixed addresses,
    the stream from XLA's API): CI cannot run it, but LLVM can verify and compile it."""
    import llvmlite.binding as llvm

    from strata_compiler.backends.llvm_cpu.jit import optimize
    from strata_compiler.backends.llvm_cpu.target import Target
    from strata_compiler.backends.xla.host_call import _handler_ir

    ir = _handler_ir("h", [(0x1000, 64), (0x2000, 8)], [(0x3000, 64)], 0x4000, 7, memcpy=0x5000, sync=0x6000,
                     skip_in=1, wake=wake)
    mod, tm = optimize(ir, Target.host())       # parses and verifies, else BackendError
    assert tm.emit_object(mod)
    llvm.parse_assembly(ir).verify()
    body = str(mod)
    # the pool's wake comes first in the execute stage, before the copies and the sync
    assert (f"call void inttoptr (i64 {0x7000} to ptr)()" in body) == bool(wake)
    if wake:
        assert body.index(f"i64 {0x7000}") < body.index(f"i64 {0x5000}")
    assert body.index(f"i64 {0x5000}") < body.index(f"i64 {0x6000}") < body.index(f"i64 {0x4000}")


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
    traits; a frame at a stage other than execute runs nothing. (Byte offsets of XLA's C API, as
    backends/xla/host_call.ll reads them.)"""
    FRAME_EXT, FRAME_API, FRAME_STAGE = 8, 16, 32
    API_MAJOR, API_MINOR = 32, 36
    EXT_TYPE, EXT_METADATA, EXT_TYPE_METADATA = 8, 24, 1
    META_MAJOR, META_MINOR, META_TRAITS = 24, 28, 32
    ran = []
    hc = _host_call([], [], lambda _s: ran.append(1))
    fn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(hc.address)
    api = (ctypes.c_uint8 * 128)()
    ctypes.c_int32.from_buffer(api, API_MAJOR).value = 7
    ctypes.c_int32.from_buffer(api, API_MINOR).value = 3
    meta = (ctypes.c_uint8 * 40)()
    ctypes.c_int32.from_buffer(meta, META_TRAITS).value = 99
    ext = (ctypes.c_uint8 * 32)()
    ctypes.c_int32.from_buffer(ext, EXT_TYPE).value = EXT_TYPE_METADATA
    ctypes.c_void_p.from_buffer(ext, EXT_METADATA).value = ctypes.addressof(meta)
    frame = (ctypes.c_uint8 * 176)()
    ctypes.c_void_p.from_buffer(frame, FRAME_EXT).value = ctypes.addressof(ext)
    ctypes.c_void_p.from_buffer(frame, FRAME_API).value = ctypes.addressof(api)
    assert fn(ctypes.addressof(frame)) is None
    assert ctypes.c_int32.from_buffer(meta, META_MAJOR).value == 7
    assert ctypes.c_int32.from_buffer(meta, META_MINOR).value == 3
    assert ctypes.c_int32.from_buffer(meta, META_TRAITS).value == 0
    ctypes.c_void_p.from_buffer(frame, FRAME_EXT).value = None
    ctypes.c_int32.from_buffer(frame, FRAME_STAGE).value = 0        # instantiate
    assert fn(ctypes.addressof(frame)) is None and not ran


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = build_model("qwen3_moe", tmp_path_factory.mktemp("fused") / "model")
    m = load_model(d)
    ids = clear_prompts(m, m.config.vocab_size, n_prompts=1, length=6, n_new=6, seed=6)[0]
    return d, m, ids


@pytest.mark.parametrize("batch", [1, 2])
def test_fused_decode_steps_equal_the_partition_runtime(model, tmp_path, monkeypatch, batch):
    """A split plan with live expert caches (slot maps change between steps): every decode step
    of the fused program gives the partition runtime's logits (to float rounding: XLA may fuse
    across what were partition boundaries) and the same greedy tokens."""
    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.3))
    prompt = np.concatenate([ids, ids[:, ::-1]])[:batch]
    runs = {}
    monkeypatch.setenv("STRATA_SWAP_MARGIN", "0")     # swaps at the first edge
    for fused in ("1", "0"):
        s = Session(plan, "auto", device="cpu")
        assert s.executor.fused is not None
        if fused == "0":
            partition_by_partition(s)
        s.executor.swaps.copy_share = 1e9       # no copy budget: the same copies in both runs, whatever the timing
        s.reset(batch, 64)
        out = [s.step(prompt)[:, -1]]
        rng = np.random.default_rng(1)
        for t in range(8):
            out.append(s.step(rng.integers(0, m.config.vocab_size, (batch, 1)))[:, -1])
        runs[fused] = (np.concatenate(out), s)
    a, b = runs["1"][0], runs["0"][0]
    assert np.abs(a - b).max() / b.std() <= 1e-5
    np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
    s = runs["1"][1]
    assert s.executor.fused.steps == 7          # the first decode step runs partition by partition
    assert sum(c.swaps for c, *_ in s.executor.swaps.caches) > 0     # experts moved between fused steps
    sw = {k: [(c.swaps, c.hits, c.misses) for c, *_ in r[1].executor.swaps.caches] for k, r in runs.items()}
    assert sw["1"] == sw["0"]                   # the same swaps, hits and misses either way


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
    ref = partition_by_partition(Session(plan, "auto", device="cpu"))
    s = Session(plan, "auto", device="cpu")

    def broken(self, *a, **k):
        raise NotImplementedError("no FFI here")

    monkeypatch.setattr(FusedStep, "_step", broken)
    out = {}
    for name, sess in (("ref", ref), ("fb", s)):
        sess.executor.swaps.copy_share = 1e9
        sess.reset(1, 64)
        steps = [sess.step(ids)[:, -1]] + [sess.step(ids[:, i:i + 1])[:, -1] for i in range(4)]
        out[name] = np.concatenate(steps)
    assert s.executor.fused is None
    err = capsys.readouterr().err
    assert err.count("decode steps as one program failed (NotImplementedError: no FFI here)") == 1
    assert np.abs(out["fb"] - out["ref"]).max() / out["ref"].std() <= 1e-5


def test_overlap_on_a_static_hot_split(model, tmp_path, monkeypatch):
    """Every layer split with its hot experts on the GPU (no cache): each layer's CPU side runs on
    the pool's runner thread beside its GPU share (the start call's inputs come from the share's
    own partition), and the logits stay the partition runtime's."""
    from strata_compiler.runtime.session import Session
    from test_place import _compile, budget_decides, fake_profile, gpu_mem_for, probe_placement

    d, m, ids = model
    budget_decides(monkeypatch)
    hw = fake_profile(tmp_path / "hw.json")
    probe = probe_placement(d, tmp_path, hw)
    _compile(d, tmp_path / "half", hw, gpu_mem_for(probe, probe["gpu_bytes"] * 0.5))
    plan = load_plan(tmp_path / "half")
    out = {}
    for fused in (True, False):
        s = Session(plan, "auto", device="cpu")
        if not fused:
            partition_by_partition(s)
        s.reset(1, 64)
        out[fused] = np.concatenate([s.step(ids)[:, -1]] + [s.step(ids[:, i:i + 1])[:, -1] for i in range(5)])
        if fused:
            f = s.executor.fused
            splits = f.calls.splits()
            assert f.steps == 4 and splits and not any(n.attr("cache", "") for n, *_ in splits.values())
            # both halves of every split partition run natively: the first on the pool's runner
            # thread (strata_async_start), the second after waiting for it
            assert set(splits) <= f.calls.native
            assert {part for _, _, part in f.calls.calls} >= {"start", "finish"}
    assert np.abs(out[True] - out[False]).max() / out[False].std() <= 1e-6


def test_cpu_partitions_run_as_native_programs_with_the_same_logits(model, tmp_path, monkeypatch):
    """A static split (no cache): each fused step's host calls run their partition as one native
    program (pool.py strata_run_program) straight from the handler, giving exactly the logits of
    the same fused program whose host calls run the partitions op by op in Python (as while the
    MoE phases are timed); traced, the same programs with time stamps. The mixed plan's kernels
    split 4 chunks per thread, the all-CPU plan's 1."""
    from strata_compiler import trace
    from strata_compiler.backends.llvm_cpu import executor as lx
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
    monkeypatch.setattr(poolmod.ThreadPool, "run_program", lambda self, a, n, *r: (calls.append(n), real(self, a, n, *r)))
    plan = load_plan(tmp_path / "half")
    out, ran, native_calls = {}, {}, {}
    # op by op in Python; partition by partition (programs called from Python); programs called
    # by the host calls; the same, traced
    for name in ("python", "partitions", "host calls", "traced"):
        monkeypatch.setattr(lx.LLVMExecutor, "phase_ns", {} if name == "python" else None)
        calls.clear()
        s = Session(plan, "auto", device="cpu")
        if name == "partitions":
            partition_by_partition(s)
        s.reset(1, 64)
        tr = trace.Tracer() if name == "traced" else None
        if tr is not None:
            trace.ACTIVE = tr
        try:
            out[name] = np.concatenate([s.step(ids)[:, -1]] + [s.step(ids[:, i:i + 1])[:, -1] for i in range(5)])
        finally:
            trace.ACTIVE = None
        ran[name] = len(calls)
        fused = s.executor.fused
        native_calls[name] = len(fused.calls.native) if fused is not None else 0
        if name == "host calls":
            # the benchmarks' timeline gets the native calls' entry and exit too (TSC records)
            fused.timeline = []
            s.step(ids[:, :1])
            tl, fused.timeline = fused.timeline, None
            entered = {p for ev, p, _ in tl if ev == "enter"}
            assert fused.calls.native <= entered and [ev for ev, *_ in tl][0] == "dispatch"
            assert [ev for ev, *_ in tl][-1] == "done" and all(a[2] <= b[2] for a, b in zip(tl, tl[1:]))
        # CPU kernels beside the GPU runtime cut 4 chunks per thread (partitions.MIXED_POOL_SPLIT),
        # their executors' own choice: the process's pool keeps its default for everyone else
        assert {exe.pool.split for kind, exe, _ in s.executor.parts if kind == "llvm"} == {4}
        assert poolmod.get_pool().split == poolmod.pool_split()
    # every split layer's CPU partition runs its program from its host call, none from Python
    assert native_calls["host calls"] > 0 and ran["host calls"] == 0, ran
    # while tracing, the same host calls run the program with time stamps between its ops: their
    # spans (native=True) join the trace beside the GPU's stretches
    assert ran["traced"] == 0 and any(e["name"] == "fused step: gpu segment 1" for e in tr.events), ran
    assert any(e["name"] == "moe_ffn" and e.get("args", {}).get("native") for e in tr.events)
    for name in ("host calls", "traced"):
        np.testing.assert_array_equal(out[name], out["python"], err_msg=name)
    assert np.abs(out["partitions"] - out["python"]).max() / out["python"].std() <= 1e-6
    s = Session(plan, "llvm", device="cpu")       # all on the CPU: one chunk per thread
    s.reset(1, 64)
    calls.clear()
    s.step(ids)
    assert poolmod.get_pool().split == 1 and calls        # (its program called from Python: counted)


@pytest.mark.parametrize("batch", [1, 2])
def test_cached_layers_run_natively_and_overlap(model, tmp_path, monkeypatch, batch):
    """A cached layer's CPU side needs no per-step Python: its program masks
    the routing weights by the live cache (pool.py MASK) and counts the routings per expert, so its
    host calls run natively, split around the GPU share and overlapped. Logits, swaps, hits and
    misses equal those of Python host calls (op by op, as while the MoE phases are timed)."""
    from strata_compiler.backends.llvm_cpu import executor as lx
    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.3))
    runs = {}
    for native in (True, False):
        monkeypatch.setattr(lx.LLVMExecutor, "phase_ns", None if native else {})
        s = Session(plan, "auto", device="cpu")
        s.executor.swaps.copy_share = 1e9       # no copy budget: the same swaps in both runs, whatever the timing
        s.reset(batch, 64)
        rng = np.random.default_rng(1)
        prompt = np.concatenate([ids, ids[:, ::-1]])[:batch]
        out = [s.step(prompt)[:, -1]] + [s.step(rng.integers(0, m.config.vocab_size, (batch, 1)))[:, -1]
                                         for _ in range(8)]
        caches = [c for c, *_ in s.executor.swaps.caches]
        runs[native] = (np.concatenate(out), [(c.hits, c.misses, c.swaps) for c in caches], s.executor.fused)
    (a, stats_a, f), (b, stats_b, _) = runs[True], runs[False]
    assert np.abs(a - b).max() / b.std() <= 1e-5
    assert stats_a == stats_b and sum(sw for *_, sw in stats_a) > 0 and all(h + mi > 0 for h, mi, _ in stats_a)
    cached_splits = {i for i, sp in f.calls.splits().items() if sp[0].attr("cache", "")}
    assert cached_splits and cached_splits <= f.calls.native


def test_a_dropped_session_is_freed(model, tmp_path, monkeypatch):
    """Host call handlers live as long as XLA keeps their targets, the process; they hold the
    fused step's work weakly, so a session dropped after decoding through an expert cache frees
    its executor (and the weights it holds)."""
    import gc
    import weakref

    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.3))
    s = Session(plan, "auto", device="cpu")
    s.reset(1, 32)
    tok = int(s.step(ids)[0, -1].argmax())
    for _ in range(3):
        tok = int(s.step(np.array([[tok]], np.int64))[0, -1].argmax())
    f = s.executor.fused
    assert f is not None and f.steps > 0 and s.executor.swaps.caches
    ref = weakref.ref(s.executor)
    del s, f
    gc.collect()
    assert ref() is None


def test_last_only_steps_give_the_last_tokens_logits(model, tmp_path, monkeypatch):
    """Session.step(last_only=True) on a mixed plan and on the xla executor: the last token's
    logits of a full step, [B, 1, V], and the cache where the full step leaves it."""
    from strata_compiler.runtime.session import Session

    d, m, ids = model
    plan = load_plan(cached_plan(d, tmp_path, monkeypatch, 0.3))
    for backend in ("auto", "xla"):
        full, last = Session(plan, backend, device="cpu"), Session(plan, backend, device="cpu")
        assert full.executor.caps().fetches_last
        for s in (full, last):
            s.reset(ids.shape[0], 64)
        a, b = full.step(ids), last.step(ids, last_only=True)
        assert b.shape == (ids.shape[0], 1, a.shape[-1])
        np.testing.assert_array_equal(b, a[:, -1:])
        nxt = a[:, -1].argmax(-1)[:, None]
        np.testing.assert_allclose(last.step(nxt), full.step(nxt), rtol=0, atol=1e-6 * a.std())
