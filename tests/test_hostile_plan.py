"""Hostile plans (issue 29): checksum-valid plans whose metadata or IR lie about the model.

Each case edits the metadata or the kernel IR of the tiny trained MoE's plan (int8 or f32), reseals
plan.bin (every checksum valid, weights.bin untouched) and runs `strata-run` on it in a subprocess:
the load-time validation (runtime/validate.py, the IR verifier's attribute checks) must end it
with one `error:` line and a nonzero exit — never a signal (SIGSEGV, SIGABRT from `free(): invalid
size`), a traceback, a hang or an allocation until memory runs out. Plus: token ids checked
against the embedding table's real rows in every backend, the llvm kernel generators' explicit
checks (also under python -O), and the quant label of layer-adaptive plans.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_compiler.cli_common import run_cli
from strata_compiler.errors import BackendError, PlanError, StrataError, UsageError
from strata_compiler.kv_cache import KVCache
from strata_compiler.plan_format import PLAN_MAGIC, Container, write_container
from strata_compiler.runtime.plan import load_plan

STRATA_RUN = Path(sys.executable).parent / "strata-run"
ROOT = Path(__file__).resolve().parent.parent
# STRATA_FUZZ_EXAMPLES: more examples for a longer hunt (as tests/test_plan_loader_fuzz.py)
FUZZ = settings(max_examples=int(os.environ.get("STRATA_FUZZ_EXAMPLES", "200")), deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ------------------------------------------------------------------------------------------------
# helpers


def edited(plan_dir: Path, out: Path, meta=None, ir=None) -> Path:
    """A copy of `plan_dir` whose plan.bin has its metadata edited by `meta(dict)` and/or its IR
    text replaced by `ir(text)`, resealed; weights.bin is the original (a hard link)."""
    with Container.open(plan_dir / "plan.bin", PLAN_MAGIC) as c:
        secs = {n: bytes(c.section(n)) for n in c.names()}
    if meta is not None:
        m = json.loads(secs["meta"])
        meta(m)
        secs["meta"] = json.dumps(m).encode()
    if ir is not None:
        text = secs["ir"].decode()
        new = ir(text)
        assert new != text, "the edit changed nothing"
        secs["ir"] = new.encode()
    out.mkdir(parents=True)
    write_container(out / "plan.bin", PLAN_MAGIC, list(secs.items()))
    try:
        os.link(plan_dir / "weights.bin", out / "weights.bin")
    except OSError:
        (out / "weights.bin").write_bytes((plan_dir / "weights.bin").read_bytes())
    return out


def sub(old: str, new: str, count: int = 1):
    """An IR edit: the first `count` occurrences of `old` become `new`."""
    def edit(text: str) -> str:
        assert old in text, old
        return text.replace(old, new, count)
    return edit


def node_sub(op: str, old: str, new: str, nth: int = 0):
    """An IR edit inside the `nth` node line of op `op` only."""
    def edit(text: str) -> str:
        lines = text.split("\n")
        hits = [i for i, ln in enumerate(lines) if ln.startswith("%") and f" = {op}(" in ln]
        i = hits[nth]
        assert old in lines[i], (old, lines[i])
        lines[i] = lines[i].replace(old, new, 1)
        return "\n".join(lines)
    return edit


def run(plan: Path, ids: Path, *, backend: str = "llvm", optimize: bool = False, timeout: int = 120):
    env = {**os.environ, **({"PYTHONOPTIMIZE": "1"} if optimize else {})}
    return subprocess.run([str(STRATA_RUN), str(plan), "--input-ids", str(ids), "-n", "2", "--backend", backend],
                          capture_output=True, text=True, timeout=timeout, env=env)


def one_error(p: subprocess.CompletedProcess, *names: str) -> str:
    """Nonzero exit by a status (not a signal), stderr exactly one `error: ` line naming `names`."""
    assert p.returncode > 0, f"rc={p.returncode} (negative: killed by a signal); stderr={p.stderr!r}"
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"expected one error line, got {p.stderr!r}"
    for n in names:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture(scope="module")
def ids(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ids") / "ids.npy"
    np.save(path, np.array([[5, 17, 240, 33]], np.int64))
    return path


# ------------------------------------------------------------------------------------------------
# the untouched plans run


@pytest.mark.parametrize("backend", ["llvm", "reference"])
def test_untouched_plan_runs(tiny_int8_plan, ids, backend):
    p = run(tiny_int8_plan, ids, backend=backend)
    assert p.returncode == 0, p.stderr
    assert "error" not in p.stderr


# ------------------------------------------------------------------------------------------------
# metadata that disagrees with the weights: the KV cache and the token check read it


META_EDITS = {
    "n_kv_heads=1": (lambda m: m["model"].update(n_kv_heads=1), "n_kv_heads"),
    "n_kv_heads=4": (lambda m: m["model"].update(n_kv_heads=4), "n_kv_heads"),
    "head_dim=32": (lambda m: m["model"].update(head_dim=32), "head_dim"),
    "vocab_size=8192": (lambda m: m["model"].update(vocab_size=8192), "vocab_size"),
    "vocab_size=100": (lambda m: m["model"].update(vocab_size=100), "vocab_size"),
    "n_layers=5": (lambda m: m["model"].update(n_layers=5), "n_layers"),
    "eos_token_ids=5": (lambda m: m["model"].update(eos_token_ids=5), "eos_token_ids"),
    "bos_token_id=-1": (lambda m: m["model"].update(bos_token_id=-1), "bos_token_id"),
    "placement=junk": (lambda m: m["model"].update(placement="[1, 2"), "placement"),
    # the sampling defaults every request starts from (strata_compiler/sampling.py)
    "sampling=list": (lambda m: m.update(sampling=[0.8]), "meta.sampling"),
    "sampling.top_p=2": (lambda m: m.update(sampling={"top_p": 2}), "top_p"),
    "sampling.temperature=str": (lambda m: m.update(sampling={"temperature": "hot"}), "temperature"),
    "sampling.top_k=1e12": (lambda m: m.update(sampling={"top_k": 10**12}), "top_k"),
    "sampling.top_k=1.5": (lambda m: m.update(sampling={"top_k": 1.5}), "top_k"),
    "sampling.repeat_last_n=-7": (lambda m: m.update(sampling={"repeat_last_n": -7}), "repeat_last_n"),
    "sampling.bogus": (lambda m: m.update(sampling={"bogus": 1}), "bogus"),
    "sampling.source=long": (lambda m: m.update(sampling={"source": "x" * 10_000}), "source"),
}


@pytest.mark.parametrize("case", sorted(META_EDITS))
def test_meta_lies(tiny_int8_plan, tmp_path, ids, case):
    edit, field = META_EDITS[case]
    plan = edited(tiny_int8_plan, tmp_path / "p", meta=edit)
    one_error(run(plan, ids), "plan.bin", field)


def test_valid_sampling_meta_is_the_default(tiny_int8_plan, tmp_path, ids):
    plan = edited(tiny_int8_plan, tmp_path / "p", meta=lambda m: m.update(
        sampling={"source": "generation_config.json", "temperature": 0.5, "top_k": 7}))
    p = run(plan, ids)
    assert p.returncode == 0, p.stderr
    assert p.stderr.rstrip().endswith("; temperature 0.5, top-k 7, top-p 0.95, min-p 0.05, repeat penalty 1.1 over "
                                      "the last 64 tokens")


@pytest.mark.parametrize("backend", ["reference", "llvm"])
def test_meta_n_kv_heads_on_both_backends(tiny_f32_plan, tmp_path, ids, backend):
    """The issue's `free(): invalid size`: n_kv_heads 2 -> 1 on the f32 plan too, on both backends."""
    plan = edited(tiny_f32_plan, tmp_path / "p", meta=lambda m: m["model"].update(n_kv_heads=1))
    one_error(run(plan, ids, backend=backend), "n_kv_heads")


def test_a_billion_layers_refused_before_any_allocation(tiny_int8_plan, tmp_path, ids):
    """n_layers = 1e9 would allocate KV for a billion layers: bounded by the graph's layers at load."""
    plan = edited(tiny_int8_plan, tmp_path / "p", meta=lambda m: m["model"].update(n_layers=10**9))
    t0 = time.monotonic()
    line = one_error(run(plan, ids, timeout=60), "n_layers")
    assert time.monotonic() - t0 < 60 and "1000000000" in line


# ------------------------------------------------------------------------------------------------
# IR attributes and shapes that disagree with the weights or with each other


IR_EDITS = {
    # attention: heads and head size the kernels index the KV cache and qkv rows with
    "n_heads 4->8": (node_sub("fused_attention", "n_heads=4", "n_heads=8"), "n_heads"),
    "n_heads 4->3": (node_sub("fused_attention", "n_heads=4", "n_heads=3"), "n_heads"),
    "n_kv_heads 2->1": (node_sub("fused_attention", "n_kv_heads=2", "n_kv_heads=1"), "fused_attention"),
    "head_dim 64->32": (node_sub("fused_attention", "head_dim=64", "head_dim=32"), "fused_attention"),
    "head_dim 64->63": (node_sub("fused_attention", "head_dim=64", "head_dim=63"), "head_dim"),
    "head_dim string": (node_sub("fused_attention", "head_dim=64", 'head_dim="64"'), "head_dim"),
    "qk_norm head->full": (node_sub("fused_attention", 'qk_norm="head"', 'qk_norm="full"'), "q/k norm"),
    "rope_theta 0": (node_sub("fused_attention", "rope_theta=10000.0", "rope_theta=0"), "rope_theta"),
    "rope_type bogus": (node_sub("fused_attention", 'rope_type="default"', 'rope_type="yarn"'), "rope_type"),
    "eps huge": (node_sub("rms_norm", "eps=1e-06", "eps=1e300"), "eps"),
    # layer indices: the KV cache's list index
    "layer=99": (node_sub("fused_attention", "layer=0", "layer=99"), "layer"),
    "layer=-6": (node_sub("fused_attention", "layer=0", "layer=-6"), "layer"),
    "two layers share layer=0": (node_sub("fused_attention", "layer=1", "layer=0", nth=1), "n_layers"),
    # routing: top-k (num_experts_per_tok) 0 / 9 / -2, and a string aimed at the LLVM IR text
    "top-k 0": (node_sub("route", "k=2", "k=0"), "k=0"),
    "top-k 9": (node_sub("route", "k=2", "k=9"), "top-k 9"),
    "top-k -2": (node_sub("route", "k=2", "k=-2"), "k=-2"),
    "top-k string": (node_sub("route", "k=2", 'k="2 ; junk"'), "route"),
    # weights: shapes against the sections' real sizes and against each other
    "embed rows 4096->8192": (sub("weight @embed f32[4096,256]", "weight @embed f32[8192,256]"), "@embed"),
    "embed reshaped": (sub("weight @embed f32[4096,256]", "weight @embed f32[8192,128]"), "plan.bin"),
    "group size 3": (sub("weight @L0.attn.o f32[256,256] fmt=int8 g=32", "weight @L0.attn.o f32[256,256] fmt=int8 g=3"),
                     "group size"),
    "unknown format": (sub("fmt=int8 g=32", "fmt=int9 g=32"), "int9"),
    # activations and placement
    "activation width": (node_sub("rms_norm", "f32[B,T,256]", "f32[B,T,512]"), "width 512"),
    "buffer aliasing": (node_sub("linear", "-> %b4", "-> %b1", nth=1), "buffer %b1"),
    "unknown backend": (node_sub("route", "@cpu llvm", "@cpu numpy"), "backend"),
}


@pytest.mark.parametrize("case", sorted(IR_EDITS))
def test_ir_lies(tiny_int8_plan, tmp_path, ids, case):
    edit, name = IR_EDITS[case]
    plan = edited(tiny_int8_plan, tmp_path / "p", ir=edit)
    one_error(run(plan, ids), "plan.bin", name)


@pytest.mark.parametrize("case", ["n_heads 4->8", "top-k string", "layer=-6"])
def test_ir_lies_optimized_reference(tiny_f32_plan, tmp_path, ids, case):
    """Under PYTHONOPTIMIZE=1 (asserts gone), on the reference backend and the f32 plan too."""
    edit, name = IR_EDITS[case]
    plan = edited(tiny_f32_plan, tmp_path / "p", ir=edit)
    one_error(run(plan, ids, backend="reference", optimize=True), name)
    one_error(run(plan, ids, backend="llvm", optimize=True), name)


def test_inspect_refuses_a_hostile_plan(tiny_int8_plan, tmp_path, capsys):
    from strata_compiler.cli import stratac

    plan = edited(tiny_int8_plan, tmp_path / "p", ir=IR_EDITS["layer=99"][0])
    capsys.readouterr()
    assert run_cli(stratac, ["inspect", str(plan)]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "layer" in err


# ------------------------------------------------------------------------------------------------
# a structure-aware hunt: one number of the IR or one metadata field replaced, run on llvm in-process

_NUMBERS = re.compile(r"(?<=[=\[,(])-?\d+(\.\d+)?(e-?\d+)?")      # attribute values, dims, buffer ids
_VALUES = st.sampled_from([0, 1, 2, 3, 7, 8, 9, 63, 64, 65, 128, 256, 384, 512, 768, 4095, 4096, 4097, -1, -6,
                           2**31, 2**63, 1.5, "1e400", '"x"', "true", "[1,2]"]) | st.integers(-2**40, 2**40)


@given(data=st.data())
@FUZZ
def test_fuzz_one_number_or_field(tiny_int8_plan, tmp_path_factory, data):
    """Load and run one llvm step of a plan with one IR number or one meta.model field replaced:
    only a one-line StrataError, or logits of the model's shape — never another exception or a crash."""
    with Container.open(tiny_int8_plan / "plan.bin", PLAN_MAGIC) as c:
        ir = bytes(c.section("ir")).decode()
    if data.draw(st.booleans(), label="ir?"):
        m = data.draw(st.sampled_from(list(_NUMBERS.finditer(ir))), label="site")
        value = str(data.draw(_VALUES, label="value"))
        plan = edited(tiny_int8_plan, tmp_path_factory.mktemp("fz") / "p",
                      ir=lambda t: t[:m.start()] + value + t[m.end():] if value != m.group() else t + "\n")
    else:
        key = data.draw(st.sampled_from(["n_layers", "n_kv_heads", "head_dim", "vocab_size", "max_position",
                                         "bos_token_id", "eos_token_ids", "hidden_size"]), label="field")
        value = data.draw(_VALUES | st.none() | st.lists(st.integers(-5, 5000), max_size=3), label="value")
        plan = edited(tiny_int8_plan, tmp_path_factory.mktemp("fz") / "p", meta=lambda m: m["model"].update({key: value}))
    from strata_compiler.backends import make_executor

    try:
        loaded = load_plan(plan)
        m = loaded.meta["model"]
        exe = make_executor("llvm", loaded.graph, loaded.weights)
        out = exe.run(np.array([[5, 17, 240]], np.int64), KVCache(m["n_layers"], 1, m["n_kv_heads"], m["head_dim"], 8))
    except StrataError as e:
        assert "\n" not in str(e), str(e)
        return
    assert out[loaded.graph.outputs[0]].shape == (1, 3, 4096)


# ------------------------------------------------------------------------------------------------
# token ids against the embedding table's real rows, in every backend


def _executor(backend: str, plan):
    if backend == "xla":
        pytest.importorskip("jax")
        from strata_compiler.backends.xla.executor import XLAExecutor

        return XLAExecutor(plan.graph, plan.weights, device_kind="cpu")
    from strata_compiler.backends import make_executor

    return make_executor(backend, plan.graph, plan.weights)


@pytest.mark.parametrize("backend", ["reference", "llvm", "xla"])
@pytest.mark.parametrize("bad", [4096, 10**9, -1])
def test_token_ids_checked_by_every_backend(tiny_int8_plan, backend, bad):
    """The executors themselves (not only Session.step's check of the metadata's vocab) refuse an
    id outside the table: the llvm gather reads memory past it, xla's clamps to the last row."""
    plan = load_plan(tiny_int8_plan)
    exe = _executor(backend, plan)
    m = plan.meta["model"]
    cache = KVCache(m["n_layers"], 1, m["n_kv_heads"], m["head_dim"], 64)
    with pytest.raises(UsageError, match=f"token id {bad} is outside the vocabulary \\[0, 4096\\) .*@embed"):
        exe.run(np.array([[1, bad, 2]], np.int64), cache)
    ok = exe.run(np.array([[1, 4095, 2]], np.int64), cache)   # the last real row is fine
    assert np.isfinite(next(iter(ok.values()))).all()


def test_token_id_past_the_table_from_the_cli(tiny_int8_plan, tmp_path):
    path = tmp_path / "ids.npy"
    np.save(path, np.array([[1, 4096]], np.int64))
    one_error(run(tiny_int8_plan, path), "4096")


# ------------------------------------------------------------------------------------------------
# the llvm kernel generators take only checked integers (explicit checks, not asserts)


_GENERATORS = """
import sys
from strata_compiler.errors import BackendError
from strata_compiler.backends.llvm_cpu.target import Target
from strata_compiler.backends.llvm_cpu.codegen import attention as at, elementwise as ew, linear, moe
t = Target.host()
cases = [
    lambda: ew.route(8, "2 ; junk", True, t), lambda: ew.route(8, 0, True, t), lambda: ew.route(8, 9, True, t),
    lambda: ew.route(8, -2, True, t), lambda: ew.rms_norm("256", 0, t), lambda: ew.rms_norm(256, 3, t),
    lambda: ew.slice_copy(5, 5, t), lambda: ew.slice_copy(-1, 5, t), lambda: ew.embed(2.5, t),
    lambda: ew.binary("add", 8, 3, t), lambda: ew.unary("exp", 8, t), lambda: ew.quantize_q8(True, t),
    lambda: at.attn_prep(4, 2, 63, "head", False, t), lambda: at.attn_prep(4, 3, 64, "head", False, t),
    lambda: at.attn_prep(4, 2, 64, "head; junk", False, t), lambda: at.attn_core(4, 2, "64}", t),
    lambda: linear.generate(linear.LinearSpec("int8", 256, 256, 3), t),
    lambda: linear.generate(linear.LinearSpec("int9", 256, 256, 32), t),
    lambda: moe.pairs("8 ; junk", t), lambda: moe.gate_up(moe.MoESpec("int3", 256, 384, 12), t),
]
for i, case in enumerate(cases):
    try:
        case()
    except BackendError as e:
        assert "recompile" in str(e) and "\\n" not in str(e), str(e)
    else:
        sys.exit(f"case {i}: generated IR")
print("ok", len(cases))
"""


@pytest.mark.parametrize("optimize", [False, True], ids=["plain", "python -O"])
def test_generators_refuse_what_is_not_a_checked_integer(optimize):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **({"PYTHONOPTIMIZE": "1"} if optimize else {})}
    p = subprocess.run([sys.executable, "-c", _GENERATORS], capture_output=True, text=True, timeout=120, env=env,
                       cwd=ROOT)
    assert p.returncode == 0 and p.stdout.startswith("ok"), p.stdout + p.stderr


def test_generator_check_names_the_value():
    from strata_compiler.backends.llvm_cpu.codegen import elementwise as ew
    from strata_compiler.backends.llvm_cpu.target import Target

    with pytest.raises(BackendError, match=r"llvm kernel route: k='2 ; junk' is not an integer"):
        ew.route(8, "2 ; junk", True, Target.host())


# ------------------------------------------------------------------------------------------------
# what the validation derives is what the compiler wrote, and loads stay fast


def test_validation_accepts_both_fixture_plans(tiny_int8_plan, tiny_f32_plan):
    for d in (tiny_int8_plan, tiny_f32_plan):
        t0 = time.perf_counter()
        plan = load_plan(d)
        assert time.perf_counter() - t0 < 5
        assert plan.meta["model"]["n_layers"] == 6


def test_validation_error_is_a_plan_error(tiny_int8_plan, tmp_path):
    plan = edited(tiny_int8_plan, tmp_path / "p", meta=lambda m: m["model"].update(head_dim=32))
    with pytest.raises(PlanError, match="head_dim=32.*recompile"):
        load_plan(plan)


# ------------------------------------------------------------------------------------------------
# the quant label: what the weights are, not what the options say


def test_quant_label_of_layer_adaptive_and_mixed_plans(tiny_int8_plan, tiny_f32_plan, tmp_path, capsys):
    from strata_compiler.cli import stratac
    from strata_compiler.runtime.evaluate import quant_label

    assert quant_label(load_plan(tiny_int8_plan)) == "int8"
    assert quant_label(load_plan(tiny_int8_plan), groups=True) == "int8 (group 32)"
    assert quant_label(load_plan(tiny_f32_plan)) == "f32"
    model = ROOT / "examples" / "models" / "tiny-moe"
    laq, mixed = tmp_path / "laq", tmp_path / "mixed"
    assert run_cli(stratac, ["compile", str(model), "-o", str(laq), "--bits", "5"]) == 0
    assert run_cli(stratac, ["compile", str(model), "-o", str(mixed), "--quant", "int8",
                             "--tensor-format", r"moe\.down=int4"]) == 0
    label = quant_label(load_plan(laq))
    assert label.startswith("laq: ") and "f32" not in label, label
    assert load_plan(laq).meta["options"]["quant"] == "f32"     # what the options say, and inspect used to show
    assert quant_label(load_plan(mixed)) == "mixed: int8+int4"
    capsys.readouterr()
    assert run_cli(stratac, ["inspect", str(laq), "--no-weights"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert f"quant {label}" in first and "quant f32" not in first, first
