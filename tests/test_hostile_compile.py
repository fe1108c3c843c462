"""Hostile model folders and careless operators at `stratac compile` (issue 29): one `error:` line
naming the field, tensor, file or flag, a nonzero exit and nothing left behind; or the right result.

Covers config values range-checked before any work (layers against the tensors present, theta,
eps, top-k, positions, token ids, values that overflow), NaN/Inf weights refused naming the tensor,
tokenizer.json parsed at compile time, `--calib PLAN.bin` reuse keyed on a hash of every value of
every source tensor, `--group-size` checked per format, and the output folder: an existing file as
`-o`, a lock against a second compile, stale temporary files of dead compiles removed, nothing left
by a failed compile, and a progress line whose ETA follows the bytes converted.

Small Hugging Face folders are built once per module (tests/hf_models.py) and copied per test.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from strata_compiler.cli import CompileProgress, stratac
from strata_compiler.driver import compile_model
from strata_compiler.errors import UsageError
from strata_compiler.formats import FORMATS
from strata_compiler.pass_manager import CompileOptions
from strata_compiler.runtime.plan import load_plan
from test_cli_errors import _rewrite_meta, _write_tokenizer, assert_one_line_error, cli

EXPERT_W1 = "model.layers.1.block_sparse_moe.experts.2.w1.weight"   # [40, 64] in build_model("mixtral")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """mixtral (with a word-level tokenizer and calibration text) and qwen3_moe folders."""
    from hf_models import build_model

    base = tmp_path_factory.mktemp("hostile_compile")
    mixtral = build_model("mixtral", base / "mixtral", seed=0)
    _write_tokenizer(mixtral / "tokenizer.json")
    rng = np.random.default_rng(0)
    (base / "calib.txt").write_text(" ".join(f"w{i}" for i in rng.integers(0, 100, 400)))
    return {"mixtral": mixtral, "qwen3_moe": build_model("qwen3_moe", base / "qwen3_moe", seed=0),
            "calib": base / "calib.txt"}


@pytest.fixture()
def model(models, tmp_path) -> Path:
    """A private copy of the mixtral folder."""
    return Path(shutil.copytree(models["mixtral"], tmp_path / "model"))


def compile_fails(capsys, out: Path, model: Path, *flags, names=()) -> str:
    """One error line naming `names`; `out` (missing before) is not left behind."""
    assert not out.exists()
    line = assert_one_line_error(cli(capsys, stratac, "compile", model, "-o", out, *flags), *names)
    assert not out.exists(), list(out.rglob("*"))
    return line


def edit_config(folder: Path, text: str | None = None, **changes) -> None:
    """Set config.json fields (a key "rope.x" sets rope_parameters["x"]), or replace its text."""
    path = folder / "config.json"
    if text is not None:
        path.write_text(text)
        return
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if k.startswith("rope."):
            cfg["rope_parameters"][k[5:]] = v
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


def edit_tensor(folder: Path, key: str, edit) -> None:
    path = folder / "model.safetensors"
    t = load_file(str(path))
    t[key] = np.ascontiguousarray(edit(t[key].copy()))
    save_file(t, str(path), metadata={"format": "pt"})


def stratac_subprocess(*args, optimize: bool = False) -> tuple[int, str, str]:
    """`stratac` in a fresh interpreter (with -O: asserts stripped, as under PYTHONOPTIMIZE=1)."""
    cmd = [sys.executable, *(["-O"] if optimize else []), "-c", "from strata_compiler.cli import main; main()",
           *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


# ------------------------------------------------------------------------------------------------
# config.json: values range-checked before any work, one line naming the field


@pytest.mark.parametrize("field,value", [
    ("rope.rope_theta", 0), ("rope.rope_theta", -10000.0),
    ("rms_norm_eps", 0), ("rms_norm_eps", -1e-5), ("rms_norm_eps", 2.0),
    ("num_experts_per_tok", 0), ("num_experts_per_tok", 9), ("num_experts_per_tok", -2),
    ("max_position_embeddings", 0), ("max_position_embeddings", -5), ("max_position_embeddings", 2**40),
    ("num_local_experts", 0), ("num_hidden_layers", 10**9), ("hidden_size", 10**400), ("vocab_size", -1),
    ("num_attention_heads", 10**6), ("clip_qkv", -1.0),
    ("eos_token_id", "5"), ("eos_token_id", [2, "x"]), ("eos_token_id", True), ("eos_token_id", 112),
    ("eos_token_id", list(range(100))), ("bos_token_id", 10**30), ("bos_token_id", [1]), ("bos_token_id", -3),
])
def test_config_value_out_of_range(capsys, tmp_path, model, field, value):
    edit_config(model, **{field: value})
    line = compile_fails(capsys, tmp_path / "out", model, names=("config.json", f"'{field.removeprefix('rope.')}'"))
    assert len(line) < 400


@pytest.mark.parametrize("fields,needle", [
    ({"use_sliding_window": True, "sliding_window": -5}, "'sliding_window'"),
    ({"use_sliding_window": True, "sliding_window": 16, "max_position_embeddings": 64}, "sliding-window"),
    ({"sliding_window": 16, "max_position_embeddings": 64}, "sliding-window"),      # Mistral's convention
    ({"use_sliding_window": "yes"}, "'use_sliding_window'"),
], ids=["negative", "shorter-than-positions", "set-without-use", "use-not-bool"])
def test_config_sliding_window_refused(capsys, tmp_path, model, fields, needle):
    edit_config(model, **fields)
    compile_fails(capsys, tmp_path / "out", model, names=("config.json", needle))


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 0.0},
    {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 4.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 0},
    {"rope_type": 7, "rope_theta": 10000.0},
    {"rope_type": ["default"], "rope_theta": 10000.0},
    {"rope_type": "x" * 100000, "rope_theta": 10000.0},
], ids=["linear-factor-0", "llama3-high-equals-low", "llama3-original-max-0", "type-int", "type-list", "type-huge"])
def test_config_bad_rope(capsys, tmp_path, model, rope):
    edit_config(model, rope_parameters=rope)
    line = compile_fails(capsys, tmp_path / "out", model, names=("config.json",))
    assert len(line) < 400


@pytest.mark.parametrize("text,names", [
    ('{"architectures": ["MixtralForCausalLM"], "hidden_size": 1e400}', ("config.json",)),
    ('{"architectures": ["MixtralForCausalLM"], "vocab_size": -1e400}', ("config.json",)),
], ids=["1e400", "-1e400"])
def test_config_number_overflows(capsys, tmp_path, model, text, names):
    edit_config(model, text=text)
    compile_fails(capsys, tmp_path / "out", model, names=names)


def test_config_layers_beyond_the_checkpoint(capsys, tmp_path, model):
    """num_hidden_layers within the bound but above the layers whose tensors are present: the
    count is compared with the tensors before any per-layer work."""
    edit_config(model, num_hidden_layers=4096)
    t0 = time.perf_counter()
    line = compile_fails(capsys, tmp_path / "out", model, names=("num_hidden_layers", "layer 2"))
    assert time.perf_counter() - t0 < 10, line


def test_config_billion_layers_fails_at_once_subprocess(tmp_path, model):
    """num_hidden_layers: 1e9 (it grew the compiler ~30 MB/s) ends in one line, in seconds and
    without growing: the run is capped at 8 GiB of address space (the 1e9-entry tuple alone took 8 GB)."""
    edit_config(model, text=(model / "config.json").read_text().replace('"num_hidden_layers": 2',
                                                                           '"num_hidden_layers": 1e9'))
    out = tmp_path / "out"
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30)); "
            "from strata_compiler.cli import main; main()")
    p = subprocess.run([sys.executable, "-c", code, "compile", str(model), "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert_one_line_error((p.returncode, p.stdout, p.stderr), "num_hidden_layers", "1000000000")
    assert not out.exists()


@pytest.mark.parametrize("field,value", [("decoder_sparse_step", 0), ("mlp_only_layers", "1"),
                                         ("mlp_only_layers", [True]), ("num_local_experts", -1),
                                         ("head_dim", 25)])
def test_qwen_config_fields(capsys, tmp_path, models, field, value):
    m = Path(shutil.copytree(models["qwen3_moe"], tmp_path / "model"))
    edit_config(m, **{field: value})
    compile_fails(capsys, tmp_path / "out", m, names=("config.json", "head_dim" if field == "head_dim" else field))


def test_config_error_without_asserts_subprocess(tmp_path, model):
    """num_experts_per_tok 0 was an empty AssertionError from cpu-codegen; under -O it now ends
    in the config's line, as without."""
    edit_config(model, num_experts_per_tok=0)
    out = tmp_path / "out"
    assert_one_line_error(stratac_subprocess("compile", model, "-o", out, optimize=True),
                          "config.json", "num_experts_per_tok")
    assert not out.exists()


def write_gguf(path: Path, *, block_count: int = 1, eps: float = 1e-5, freq_base: float = 10000.0,
               context: int = 64, bos: int = 1, nan_in: str = "") -> Path:
    """A tiny one-layer llama GGUF (D 8, 2 heads, FF 16, vocab 10, F32) with these metadata values."""
    import gguf

    D, F, V = 8, 16, 10
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(block_count)
    w.add_context_length(context)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(freq_base)
    w.add_layer_norm_rms_eps(eps)
    w.add_vocab_size(V)
    w.add_bos_token_id(bos)
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,), "output.weight": (V, D),
              "blk.0.attn_norm.weight": (D,), "blk.0.ffn_norm.weight": (D,), "blk.0.attn_q.weight": (D, D),
              "blk.0.attn_k.weight": (D, D), "blk.0.attn_v.weight": (D, D), "blk.0.attn_output.weight": (D, D),
              "blk.0.ffn_gate.weight": (F, D), "blk.0.ffn_up.weight": (F, D), "blk.0.ffn_down.weight": (D, F)}
    for name, shape in shapes.items():
        a = rng.standard_normal(shape).astype(np.float32)
        if name == nan_in:
            a.flat[-1] = np.nan
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_baseline_compiles(tmp_path):
    compile_model(write_gguf(tmp_path / "m.gguf"), tmp_path / "out", CompileOptions())
    assert load_plan(tmp_path / "out").meta["model"]["n_layers"] == 1


@pytest.mark.parametrize("values,field", [
    ({"block_count": 10**9}, "llama.block_count"), ({"block_count": 3}, "num_hidden_layers"),
    ({"eps": 0.0}, "layer_norm_rms_epsilon"), ({"eps": -1e-5}, "layer_norm_rms_epsilon"),
    ({"freq_base": 0.0}, "llama.rope.freq_base"), ({"context": 0}, "llama.context_length"),
    ({"bos": 999}, "bos_token_id"), ({"nan_in": "blk.0.ffn_down.weight"}, "model.layers.0.mlp.down_proj.weight"),
])
def test_gguf_metadata_out_of_range(capsys, tmp_path, values, field):
    path = write_gguf(tmp_path / "m.gguf", **values)
    compile_fails(capsys, tmp_path / "out", path, names=("m.gguf", field))


# ------------------------------------------------------------------------------------------------
# weights: NaN / Inf refused naming the tensor


@pytest.mark.parametrize("key,where,value", [
    (EXPERT_W1, (17, 5), np.nan),
    ("model.layers.0.input_layernorm.weight", (3,), np.inf),
    ("model.embed_tokens.weight", (111, 0), -np.inf),
    ("lm_head.weight", (0, 63), np.nan),
])
@pytest.mark.parametrize("quant", ["f32", "int4"])
def test_non_finite_weight_refused(capsys, tmp_path, model, key, where, value, quant):
    def poison(a):
        a[where] = value
        return a

    edit_tensor(model, key, poison)
    line = compile_fails(capsys, tmp_path / "out", model, "--quant", quant, names=(key, "NaN or infinite"))
    if len(where) == 2:
        assert f"row {where[0]}" in line


def test_non_finite_weight_refused_while_calibrating(capsys, tmp_path, models, model):
    edit_tensor(model, EXPERT_W1, lambda a: a * np.float32(np.inf))
    compile_fails(capsys, tmp_path / "out", model, "--quant", "int4", "--calib", models["calib"],
                  names=(EXPERT_W1, "NaN or infinite"))


def test_non_finite_weight_refused_subprocess_optimized(tmp_path, model):
    edit_tensor(model, EXPERT_W1, lambda a: np.where(np.arange(a.shape[0])[:, None] == 30, np.nan, a))
    out = tmp_path / "out"
    line = assert_one_line_error(stratac_subprocess("compile", model, "-o", out, optimize=True), EXPERT_W1)
    assert "row 30" in line
    assert not out.exists()


# ------------------------------------------------------------------------------------------------
# tokenizer.json: parsed at compile time


@pytest.mark.parametrize("content", [
    b'{"model": {"type": "NoSuchModel"}}', b"[1, 2, 3]", b"{not json", b"\xff\xfe\x00garbage", b"",
    b'{"version": "1.0", "model": {"type": "WordLevel", "vocab": 5}}',
], ids=["unknown-model", "a-list", "not-json", "not-utf8", "empty", "vocab-not-a-map"])
def test_garbage_tokenizer_refused(capsys, tmp_path, model, content):
    (model / "tokenizer.json").write_bytes(content)
    compile_fails(capsys, tmp_path / "out", model, names=("tokenizer.json",))


def test_tokenizer_fifo_refused(capsys, tmp_path, model):
    (model / "tokenizer.json").unlink()
    os.mkfifo(model / "tokenizer.json")
    compile_fails(capsys, tmp_path / "out", model, names=("tokenizer.json", "FIFO"))


def test_valid_tokenizer_compiles_and_loads(tmp_path, models):
    from tokenizers import Tokenizer

    compile_model(models["mixtral"], tmp_path / "out", CompileOptions())
    plan = load_plan(tmp_path / "out")
    assert Tokenizer.from_str(plan.tokenizer_json.decode()).encode("w1 w2").ids == [1, 2]


# ------------------------------------------------------------------------------------------------
# --calib PLAN.bin: reuse keyed on a hash of every source tensor's values


@pytest.fixture(scope="module")
def calibrated(models, tmp_path_factory) -> Path:
    """The mixtral folder compiled --quant int4 --calib TEXT (the donor plan)."""
    out = tmp_path_factory.mktemp("calibrated") / "plan"
    compile_model(models["mixtral"], out, CompileOptions(quant="int4", calib=str(models["calib"])))
    return out


def test_plan_records_a_hash_of_every_source_tensor(calibrated, models):
    hashes = load_plan(calibrated).meta["source_hashes"]
    keys = set(load_file(str(models["mixtral"] / "model.safetensors")))
    assert set(hashes) == keys
    assert all(isinstance(h, str) and len(h) == 32 and int(h, 16) >= 0 for h in hashes.values())


def test_calib_plan_of_the_same_checkpoint_reuses_its_weights(tmp_path, calibrated, models):
    ctx_out = tmp_path / "again"
    compile_model(models["mixtral"], ctx_out, CompileOptions(quant="int4", calib=str(calibrated / "plan.bin")))
    assert (ctx_out / "weights.bin").read_bytes() == (calibrated / "weights.bin").read_bytes()


def test_calib_plan_of_edited_rows_refused(capsys, tmp_path, calibrated, model):
    """Rows edited away from the first, middle and last (those the old fingerprint hashed): the
    old plan's weights were kept silently, rc 0; now one line naming the changed tensor."""
    def nudge(a):
        a[3:19] += np.float32(1e-3)
        a[21:39] -= np.float32(1e-3)
        return a

    edit_tensor(model, EXPERT_W1, nudge)
    line = compile_fails(capsys, tmp_path / "out", model, "--quant", "int4", "--calib", calibrated / "plan.bin",
                         names=(EXPERT_W1, "--calib", "differs"))
    assert "other weights" in line


def test_calib_plan_of_edited_rows_refused_with_other_scales(capsys, tmp_path, calibrated, model):
    """--no-imatrix copies nothing from the donor, but its calibration still belongs to the
    weights it was compiled from: a changed tensor is refused all the same."""
    edit_tensor(model, "model.norm.weight", lambda a: a * np.float32(1.01))
    compile_fails(capsys, tmp_path / "out", model, "--quant", "int4", "--no-imatrix", "--calib",
                  calibrated / "plan.bin", names=("model.norm.weight", "differs"))


def test_calib_plan_with_other_tensor_names_refused_before_work(capsys, tmp_path, calibrated, models):
    donor = Path(shutil.copytree(calibrated, tmp_path / "donor"))
    _rewrite_meta(donor, lambda m: m["source_hashes"].update({"model.extra.weight": "0" * 32}))
    compile_fails(capsys, tmp_path / "out", models["mixtral"], "--quant", "int4", "--calib", donor / "plan.bin",
                  names=("model.extra.weight", "other weights"))


def test_calib_plan_without_hashes_quantizes_afresh(tmp_path, calibrated, models):
    """A plan from before the hashes: its calibration is reused, every weight quantized again
    (nothing vouches for its arrays), which gives the same bytes for the same checkpoint."""
    donor = Path(shutil.copytree(calibrated, tmp_path / "donor"))
    _rewrite_meta(donor, lambda m: m.pop("source_hashes"))
    out = tmp_path / "out"
    compile_model(models["mixtral"], out, CompileOptions(quant="int4", calib=str(donor / "plan.bin")))
    assert (out / "weights.bin").read_bytes() == (calibrated / "weights.bin").read_bytes()


# ------------------------------------------------------------------------------------------------
# --group-size checked per format, before any work


@pytest.mark.parametrize("flags,names", [
    (("--quant", "fp8", "--group-size", "12"), ("--group-size 12", "fp8", "multiple of 8")),
    (("--quant", "int3", "--group-size", "12"), ("--group-size 12", "int3")),
    (("--quant", "int2", "--group-size", "6"), ("--group-size 6", "int2", "multiple of 4")),
    (("--tensor-format", "L0=fp8", "--group-size", "20"), ("--group-size 20", "fp8")),
    (("--bits", "4", "--group-size", "12"), ("--group-size 12", "--bits")),
    (("--memory-budget", "1MiB", "--group-size", "4"), ("--group-size 4", "--memory-budget")),
])
def test_group_size_checked_per_format(capsys, tmp_path, models, flags, names):
    compile_fails(capsys, tmp_path / "out", models["mixtral"], *flags, names=names)


@pytest.mark.parametrize("fmt,gs", [("fp8", 16), ("int4", 6), ("int2", 4), ("int8", 2)])
def test_group_sizes_each_format_takes(tmp_path, models, fmt, gs):
    compile_model(models["mixtral"], tmp_path / "out", CompileOptions(quant=fmt, group_size=gs))
    assert {w.group_size for w in load_plan(tmp_path / "out").graph.weights if w.fmt == fmt} == {gs}


def test_fp8_quantize_refuses_a_group_of_12():
    with pytest.raises(UsageError, match="multiple of 8"):
        FORMATS["fp8"].quantize(np.ones((2, 24), np.float32), 12)


# ------------------------------------------------------------------------------------------------
# the output folder


def test_existing_file_as_output(capsys, tmp_path, models):
    f = tmp_path / "plan.out"
    f.write_text("keep me")
    line = assert_one_line_error(cli(capsys, stratac, "compile", models["mixtral"], "-o", f), "-o", "plan.out")
    assert "internal error" not in line and f.read_text() == "keep me"


def test_second_compile_into_a_locked_folder_refused(capsys, tmp_path, models):
    """Another compile holds the folder (its lock is a flock on the folder): one line, at once;
    nothing written there."""
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        t0 = time.perf_counter()
        assert_one_line_error(cli(capsys, stratac, "compile", models["mixtral"], "-o", out), "-o", "another")
        assert time.perf_counter() - t0 < 10
        assert list(out.iterdir()) == []
    finally:
        os.close(fd)
    assert cli(capsys, stratac, "compile", models["mixtral"], "-o", out)[0] == 0   # released: it works


def test_two_compiles_at_once_one_refused(tmp_path, models):
    """Two real compiles into one folder, the second started while the first is in emit (held
    there until the second has finished): the second is refused, the first writes its plan."""
    out, started, go = tmp_path / "out", tmp_path / "started", tmp_path / "go"
    hold = (f"import pathlib, time; import strata_compiler.driver; from strata_compiler.passes import emit; "
            f"w = emit._write_weights\n"
            f"def slow(*a):\n"
            f"    pathlib.Path({str(started)!r}).touch()\n"
            f"    while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.05)\n"
            f"    return w(*a)\n"
            f"emit._write_weights = slow\n"
            f"from strata_compiler.cli import main; main()")
    first = subprocess.Popen([sys.executable, "-c", hold, "compile", str(models["mixtral"]), "-o", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        second = stratac_subprocess("compile", models["mixtral"], "-o", out, "--quant", "int4")
    finally:
        go.touch()
        code, stdout, stderr = first.wait(timeout=120), *first.communicate()
    assert_one_line_error(second, "-o", "another stratac compile")
    assert code == 0, stderr
    assert load_plan(out).meta["options"]["quant"] == "auto"     # the first compile's (no --quant)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temp_files_of_dead_compiles_removed(capsys, tmp_path, models):
    out = tmp_path / "out"
    out.mkdir()
    dead, live = _dead_pid(), os.getppid()
    stale = [f"weights.bin.tmp-{dead}", f"plan.bin.tmp-{dead}", f"weights.bin.tmp-{dead}.tmp-{dead}"]
    kept = [f"weights.bin.tmp-{live}", f"notes.tmp-{dead}", "weights.bin.tmp-x"]
    for name in stale + kept:
        (out / name).write_bytes(b"\0" * 100)
    assert cli(capsys, stratac, "compile", models["mixtral"], "-o", out)[0] == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(kept + ["plan.bin", "weights.bin"])


@pytest.mark.parametrize("nested", [False, True])
def test_failed_compile_leaves_no_folder(capsys, tmp_path, model, nested):
    """A compile that fails in emit (NaN in the last weight) removes the folder (and the parents)
    it created; only what was there before stays."""
    edit_tensor(model, "lm_head.weight", lambda a: np.where(a > 0.2, np.nan, a))
    out = tmp_path / "a" / "b" / "out" if nested else tmp_path / "out"
    compile_fails(capsys, out, model, names=("lm_head.weight",))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_failed_compile_keeps_the_previous_plan(capsys, tmp_path, models, model):
    out = tmp_path / "out"
    compile_model(models["mixtral"], out, CompileOptions(quant="int4"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (out / "notes.txt").write_text("mine")
    edit_tensor(model, "lm_head.weight", lambda a: np.where(a > 0.2, np.inf, a))
    assert_one_line_error(cli(capsys, stratac, "compile", model, "-o", out), "lm_head.weight")
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert after == dict(before, **{"notes.txt": b"mine"})
    load_plan(out)


def _replace_then(action):
    """os.replace (the module's: every caller's) that runs `action()` once weights.bin is renamed
    in, the plan not yet."""
    real = os.replace

    def replace(a, b):
        real(a, b)
        if Path(b).name == "weights.bin":
            action()
    return replace


def test_recompile_failing_between_the_renames_keeps_the_old_plan(capsys, tmp_path, models, monkeypatch):
    """An exception after the new weights are in (the plan rename fails) puts the old weights back."""
    import strata_compiler.passes.emit as emit_mod

    out = tmp_path / "out"
    compile_model(models["mixtral"], out, CompileOptions(quant="int4"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = os.replace

    def replace(a, b):
        if Path(b).name == "plan.bin":
            raise KeyboardInterrupt
        real(a, b)
    monkeypatch.setattr(emit_mod.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        compile_model(models["mixtral"], out, CompileOptions(quant="int8"))
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    load_plan(out)


def test_recompile_ctrl_c_during_the_renames_waits_for_both(capsys, tmp_path, models, monkeypatch):
    """SIGINT between the renames takes effect after both: the folder holds the new pair."""
    import signal

    import strata_compiler.passes.emit as emit_mod

    out = tmp_path / "out"
    compile_model(models["mixtral"], out, CompileOptions(quant="int4"))
    monkeypatch.setattr(emit_mod.os, "replace", _replace_then(lambda: signal.raise_signal(signal.SIGINT)))
    with pytest.raises(KeyboardInterrupt):
        compile_model(models["mixtral"], out, CompileOptions(quant="int8"))
    monkeypatch.undo()
    assert load_plan(out).meta["options"]["quant"] == "int8"
    assert sorted(p.name for p in out.iterdir()) == ["plan.bin", "weights.bin"]


def test_compile_killed_between_the_renames_is_repaired_by_the_next(capsys, tmp_path, models, model):
    """A compile killed (SIGKILL) after weights.bin was replaced leaves the old weights as
    weights.bin.old-PID; the next compile into the folder puts them back, so even a failing one
    leaves the old plan loadable."""
    out, other = tmp_path / "out", tmp_path / "other"
    compile_model(models["mixtral"], out, CompileOptions(quant="int4"))
    compile_model(models["mixtral"], other, CompileOptions(quant="int8"))
    old = (out / "weights.bin").read_bytes()
    os.replace(out / "weights.bin", out / f"weights.bin.old-{_dead_pid()}")
    shutil.copy(other / "weights.bin", out / "weights.bin")
    with pytest.raises(Exception):
        load_plan(out)
    edit_tensor(model, "lm_head.weight", lambda a: np.where(a > 0.2, np.inf, a))
    assert_one_line_error(cli(capsys, stratac, "compile", model, "-o", out), "lm_head.weight")
    assert (out / "weights.bin").read_bytes() == old
    assert sorted(p.name for p in out.iterdir()) == ["plan.bin", "weights.bin"]
    load_plan(out)


# ------------------------------------------------------------------------------------------------
# progress: bytes of the checkpoint, ETA from the converting phase


def test_progress_counts_checkpoint_bytes(tmp_path, models):
    seen: list[tuple[int, int]] = []
    passes: list[str] = []
    compile_model(models["mixtral"], tmp_path / "out", CompileOptions(quant="int4"),
                  progress=passes.append, progress_bytes=lambda n, total: seen.append((n, total)))
    total = sum(a.nbytes for a in load_file(str(models["mixtral"] / "model.safetensors")).values())
    assert {t for _, t in seen} == {total}
    assert sum(n for n, _ in seen) == total and all(n >= 0 for n, _ in seen)
    assert passes[-1] == "emit"


def test_progress_eta_follows_the_converting_phase():
    """52 s of passes before emit, then half the bytes in 1.5 s: about 2 s left, not 13 minutes."""
    now = [0.0]
    out = io.StringIO()
    bar = CompileProgress(stream=out, clock=lambda: now[0])
    with bar:
        bar.on_pass("calibrate")
        now[0] = 52.0
        bar.on_pass("emit")
        now[0] = 53.5
        bar.on_bytes(500, 1000)
        last = out.getvalue().rsplit("\r", 1)[1]
        assert "50%" in last and "0:02 left" in last, last
        now[0] = 55.0
        bar.on_bytes(500, 1000)
    last = out.getvalue().rsplit("\r", 1)[1]
    assert "100%" in last and "left" not in last and out.getvalue().endswith("\n")
