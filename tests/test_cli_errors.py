"""User mistakes at the command line: one line `error: ...` naming the fault, nonzero exit, no traceback.

Covers the acceptance "a plan truncated anywhere, with a flipped byte in any section, a wrong magic or
a newer major version; a missing or garbled config.json, a missing tensor, a tensor of the wrong
shape, an unsupported architecture, a bad flag value: each exits nonzero with one line naming the
problem and no traceback".

Most cases call `run_cli` in-process (fast); a handful run the installed console scripts
(`stratac`, `strata-run` next to sys.executable) as subprocesses, so the real entry points,
exit codes and stderr are covered too. One tiny Mixtral model (with a word-level tokenizer) and a
second one (another seed, no tokenizer) are built and compiled once per module.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.plan_format import HEADER_SIZE, PLAN_MAGIC, WEIGHTS_MAGIC, Container, write_container
from strata_compiler.runtime.cli import strata_run

BIN = Path(sys.executable).parent
STRATAC = BIN / "stratac"
STRATA_RUN = BIN / "strata-run"

MAJOR_AT, HEADER_CRC_AT = 8, 60
VOCAB = 112  # build_model("mixtral") vocab_size


# ------------------------------------------------------------------------------------------------
# fixtures


@dataclass(frozen=True)
class Built:
    model: Path      # mixtral, seed 0, with tokenizer.json
    model_b: Path    # mixtral, seed 1, no tokenizer
    plan: Path       # compile of `model` (plan.bin has meta, ir, tokenizer)
    plan_b: Path     # compile of `model_b` (plan.bin has meta, ir)
    ids: Path        # valid input ids [1, 4]


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(100)}
    vocab["[UNK]"] = 100
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    from hf_models import build_model

    base = tmp_path_factory.mktemp("cli_errors")
    model = build_model("mixtral", base / "model", seed=0)
    _write_tokenizer(model / "tokenizer.json")
    model_b = build_model("mixtral", base / "model_b", seed=1)
    for src, dst in ((model, base / "plan"), (model_b, base / "plan_b")):
        assert run_cli(stratac, ["compile", str(src), "-o", str(dst)]) == 0
    ids = base / "ids.npy"
    np.save(ids, np.array([[1, 2, 3, 4]], np.int64))
    return Built(model, model_b, base / "plan", base / "plan_b", ids)


@pytest.fixture()
def plan_dir(built, tmp_path) -> Path:
    """A private copy of the compiled plan directory (plan.bin + weights.bin)."""
    return Path(shutil.copytree(built.plan, tmp_path / "plan"))


@pytest.fixture()
def model_dir(built, tmp_path) -> Path:
    """A private copy of the model folder."""
    return Path(shutil.copytree(built.model, tmp_path / "model"))


# ------------------------------------------------------------------------------------------------
# helpers


def cli(capsys, cmd, *args) -> tuple[int, str, str]:
    """run_cli in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = run_cli(cmd, [str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def script(exe: Path, *args, env: dict | None = None) -> tuple[int, str, str]:
    """The installed console script as a subprocess: (exit code, stdout, stderr)."""
    p = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **(env or {})})
    return p.returncode, p.stdout, p.stderr


def assert_one_line_error(result: tuple[int, str, str], *names: str) -> str:
    """Nonzero exit, stderr exactly one non-empty `error: ` line naming every one of `names`."""
    code, out, err = result
    assert code != 0, f"exit code 0; stdout={out!r} stderr={err!r}"
    assert "Traceback" not in out + err, err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), f"expected one line on stderr, got {err!r}"
    line = lines[0]
    assert line.startswith("error: ") and line[len("error: "):].strip(), line
    for n in names:
        assert n in line, f"{n!r} not named in {line!r}"
    return line


def assert_nothing_written(out_dir: Path) -> None:
    """A failed compile leaves no plan and no temp files behind."""
    if not out_dir.exists():
        return
    files = [p.name for p in out_dir.rglob("*")]
    assert "plan.bin" not in files, files
    assert not [f for f in files if ".tmp" in f], files


def compile_fails(capsys, tmp_path, model: Path, *flags, names: tuple[str, ...] = ()) -> str:
    out = tmp_path / "out"
    line = assert_one_line_error(cli(capsys, stratac, "compile", model, "-o", out, *flags), *names)
    assert_nothing_written(out)
    return line


def run_fails(capsys, plan: Path, *args, names: tuple[str, ...] = ()) -> str:
    return assert_one_line_error(cli(capsys, strata_run, plan, *args), *names)


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def sections(path: Path, magic: bytes) -> list:
    with Container.open(path, magic, verify="none") as c:
        return [c.info(n) for n in c.names()]


# ------------------------------------------------------------------------------------------------
# sanity: the fixtures work, so every failure below is the one we caused


def test_fixture_plans_run(built, capsys):
    code, out, err = cli(capsys, strata_run, built.plan, "--input-ids", built.ids, "-n", "2")
    assert code == 0, err
    code, out, err = cli(capsys, strata_run, built.plan, "--prompt", "w1 w2 w3", "-n", "2")
    assert code == 0, err
    code, out, err = cli(capsys, strata_run, built.plan_b / "plan.bin", "--input-ids", built.ids, "-n", "2")
    assert code == 0, err
    assert [s.name for s in sections(built.plan / "plan.bin", PLAN_MAGIC)] == ["meta", "ir", "tokenizer"]
    assert [s.name for s in sections(built.plan_b / "plan.bin", PLAN_MAGIC)] == ["meta", "ir"]


# ------------------------------------------------------------------------------------------------
# plan.bin: truncation, flipped bytes, magic, version


def _truncation_points(plan: Path) -> dict[str, int]:
    secs = {s.name: s for s in sections(plan, PLAN_MAGIC)}
    size = plan.stat().st_size
    return {
        "empty": 0,
        "inside-magic": 5,
        "inside-header": 40,
        "header-only": HEADER_SIZE,
        "inside-meta": secs["meta"].offset + secs["meta"].length // 2,
        "inside-ir": secs["ir"].offset + secs["ir"].length // 2,
        "inside-tokenizer": secs["tokenizer"].offset + secs["tokenizer"].length // 2,
        "inside-toc": size - 20,
        "one-byte-short": size - 1,
    }


@pytest.mark.parametrize("flag", ["--trace", "--logits-out", "--tokens-out"])
def test_output_into_a_missing_folder(capsys, built, tmp_path, flag):
    """Checked before the run: one line naming the flag and the folder, nothing run or written."""
    target = tmp_path / "no-such-dir" / "out.file"
    run_fails(capsys, built.plan, "--input-ids", built.ids, "-n", "2", flag, target,
              names=(flag, str(target.parent)))
    assert not target.parent.exists()


@pytest.mark.parametrize("where", ["empty", "inside-magic", "inside-header", "header-only", "inside-meta",
                                   "inside-ir", "inside-tokenizer", "inside-toc", "one-byte-short"])
def test_truncated_plan(capsys, built, plan_dir, where):
    plan = plan_dir / "plan.bin"
    n = _truncation_points(plan)[where]
    plan.write_bytes(plan.read_bytes()[:n])
    line = run_fails(capsys, plan_dir, "--input-ids", built.ids, names=("plan.bin",))
    assert "truncated" in line or "empty" in line, line


def test_truncated_plan_subprocess(built, plan_dir):
    plan = plan_dir / "plan.bin"
    plan.write_bytes(plan.read_bytes()[:-7])
    line = assert_one_line_error(script(STRATA_RUN, plan, "--input-ids", built.ids, "-n", "2"), "plan.bin")
    assert "truncated" in line


def test_plan_with_junk_appended(capsys, built, plan_dir):
    plan = plan_dir / "plan.bin"
    plan.write_bytes(plan.read_bytes() + b"\0junk")
    line = run_fails(capsys, plan, "--input-ids", built.ids, names=("plan.bin",))
    assert "after the end" in line


@pytest.mark.parametrize("section", ["meta", "ir", "tokenizer"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_byte_in_plan_section(capsys, built, plan_dir, section, where):
    plan = plan_dir / "plan.bin"
    s = {s.name: s for s in sections(plan, PLAN_MAGIC)}[section]
    flip(plan, s.offset + {"first": 0, "middle": s.length // 2, "last": s.length - 1}[where])
    line = run_fails(capsys, plan, "--input-ids", built.ids, names=("plan.bin", f"'{section}'"))
    assert "corrupt" in line


@pytest.mark.parametrize("where", ["header-field", "header-checksum", "padding", "toc"])
def test_flipped_byte_outside_sections(capsys, built, plan_dir, where):
    plan = plan_dir / "plan.bin"
    secs = sections(plan, PLAN_MAGIC)
    gap = secs[0].offset + secs[0].length  # zero padding up to the next 64-byte boundary
    assert gap < secs[1].offset
    offset = {"header-field": 20, "header-checksum": HEADER_CRC_AT, "padding": gap,
              "toc": plan.stat().st_size - 3}[where]
    flip(plan, offset)
    line = run_fails(capsys, plan, "--input-ids", built.ids, names=("plan.bin",))
    assert "corrupt" in line


def test_flipped_byte_in_plan_section_inspect(capsys, plan_dir):
    plan = plan_dir / "plan.bin"
    s = sections(plan, PLAN_MAGIC)[1]
    flip(plan, s.offset + 3)
    assert_one_line_error(cli(capsys, stratac, "inspect", plan), "plan.bin", f"'{s.name}'")


def test_flipped_byte_in_plan_subprocess(built, plan_dir):
    plan = plan_dir / "plan.bin"
    s = sections(plan, PLAN_MAGIC)[0]
    flip(plan, s.offset + 10)
    assert_one_line_error(script(STRATA_RUN, plan, "--input-ids", built.ids), "plan.bin", "'meta'")


def test_wrong_magic(capsys, built, plan_dir):
    plan = plan_dir / "plan.bin"
    data = bytearray(plan.read_bytes())
    data[:8] = b"NOTAPLAN"
    plan.write_bytes(bytes(data))
    line = run_fails(capsys, plan, "--input-ids", built.ids, names=("plan.bin", "magic"))
    assert "wrong file kind" in line


def test_weights_file_passed_as_plan(capsys, built, plan_dir):
    line = run_fails(capsys, plan_dir / "weights.bin", "--input-ids", built.ids, names=("weights.bin",))
    assert "wrong file kind" in line and "STRATAPL" in line


def test_not_a_plan_at_all(capsys, built, tmp_path):
    bogus = tmp_path / "plan.bin"
    bogus.write_text('{"this": "is json, not a plan"}\n' * 4)
    run_fails(capsys, bogus, "--input-ids", built.ids, names=("plan.bin",))


@pytest.mark.parametrize("major", [2, 0xFFFF])
def test_newer_major_version(capsys, built, plan_dir, major):
    plan = plan_dir / "plan.bin"
    data = bytearray(plan.read_bytes())
    struct.pack_into("<H", data, MAJOR_AT, major)
    struct.pack_into("<I", data, HEADER_CRC_AT, zlib.crc32(bytes(data[:HEADER_CRC_AT])))
    plan.write_bytes(bytes(data))
    line = run_fails(capsys, plan, "--input-ids", built.ids, names=("plan.bin", f"{major}.x"))
    assert "newer" in line


def test_newer_major_version_subprocess(plan_dir):
    plan = plan_dir / "plan.bin"
    data = bytearray(plan.read_bytes())
    struct.pack_into("<H", data, MAJOR_AT, 2)
    struct.pack_into("<I", data, HEADER_CRC_AT, zlib.crc32(bytes(data[:HEADER_CRC_AT])))
    plan.write_bytes(bytes(data))
    line = assert_one_line_error(script(STRATAC, "inspect", plan), "plan.bin", "2.x")
    assert "newer" in line


def _rewrite_meta(plan_dir: Path, edit) -> None:
    """Rewrite plan.bin with its metadata JSON edited: a well-formed container, all checksums valid."""
    plan = plan_dir / "plan.bin"
    with Container.open(plan, PLAN_MAGIC) as c:
        secs = {n: bytes(c.section(n)) for n in c.names()}
    meta = json.loads(secs["meta"])
    edit(meta)
    secs["meta"] = json.dumps(meta).encode()
    write_container(plan, PLAN_MAGIC, list(secs.items()))


@pytest.mark.parametrize("edit", ["drop-weights-ref", "weights-file-path", "meta-not-json"])
def test_plan_meta_malformed(capsys, built, plan_dir, edit):
    if edit == "meta-not-json":
        plan = plan_dir / "plan.bin"
        with Container.open(plan, PLAN_MAGIC) as c:
            secs = {n: bytes(c.section(n)) for n in c.names()}
        secs["meta"] = b"\x00not json"
        write_container(plan, PLAN_MAGIC, list(secs.items()))
    elif edit == "drop-weights-ref":
        _rewrite_meta(plan_dir, lambda m: m.pop("weights"))
    else:
        _rewrite_meta(plan_dir, lambda m: m["weights"].__setitem__("file", "../../etc/passwd"))
    run_fails(capsys, plan_dir, "--input-ids", built.ids, names=("plan.bin",))


@pytest.mark.parametrize("drop", ["model", "n_layers"])
def test_plan_meta_missing_model_fields(capsys, built, plan_dir, drop):
    _rewrite_meta(plan_dir, lambda m: m.pop("model") if drop == "model" else m["model"].pop(drop))
    run_fails(capsys, plan_dir, "--input-ids", built.ids, names=("plan.bin",))


def test_missing_plan_file(capsys, built, tmp_path):
    run_fails(capsys, tmp_path / "nowhere" / "plan.bin", "--input-ids", built.ids,
              names=("plan.bin", "no such file"))


def test_plan_dir_without_plan(capsys, built, tmp_path):
    (tmp_path / "emptydir").mkdir()
    run_fails(capsys, tmp_path / "emptydir", "--input-ids", built.ids, names=("plan.bin",))


def test_missing_plan_file_subprocess(tmp_path):
    assert_one_line_error(script(STRATAC, "inspect", tmp_path / "missing.bin"), "missing.bin")


# ------------------------------------------------------------------------------------------------
# weights.bin


def test_weights_missing(capsys, built, plan_dir):
    (plan_dir / "weights.bin").unlink()
    run_fails(capsys, plan_dir, "--input-ids", built.ids, names=("weights.bin", "no such file"))


def test_weights_from_another_compile(capsys, built, plan_dir):
    shutil.copy(built.plan_b / "weights.bin", plan_dir / "weights.bin")
    line = run_fails(capsys, plan_dir, "--input-ids", built.ids, names=("weights.bin", "plan.bin"))
    assert "does not match" in line


def test_weights_truncated(capsys, built, plan_dir):
    w = plan_dir / "weights.bin"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    line = run_fails(capsys, plan_dir, "--input-ids", built.ids, names=("weights.bin",))
    assert "truncated" in line


def _flip_in_weight(plan_dir: Path, pick: int) -> str:
    w = plan_dir / "weights.bin"
    s = sections(w, WEIGHTS_MAGIC)[pick]
    flip(w, s.offset + s.length // 2)
    return s.name


@pytest.mark.parametrize("pick", [0, -1])
def test_weights_flipped_byte_in_section(capsys, built, plan_dir, pick):
    """Weights are checked lazily: the run fails when it reads the corrupt section."""
    name = _flip_in_weight(plan_dir, pick)
    line = run_fails(capsys, plan_dir, "--input-ids", built.ids, "-n", "2",
                     names=("weights.bin", f"'{name}'"))
    assert "corrupt" in line


def test_weights_flipped_byte_subprocess(built, plan_dir):
    name = _flip_in_weight(plan_dir, 3)
    assert_one_line_error(script(STRATA_RUN, plan_dir / "plan.bin", "--input-ids", built.ids, "-n", "2"),
                          "weights.bin", f"'{name}'")


# ------------------------------------------------------------------------------------------------
# the model folder


def test_compile_ok_baseline(capsys, tmp_path, model_dir):
    code, out, err = cli(capsys, stratac, "compile", model_dir, "-o", tmp_path / "out")
    assert code == 0, err
    assert (tmp_path / "out" / "plan.bin").exists()


def test_missing_model_dir(capsys, tmp_path):
    line = compile_fails(capsys, tmp_path, tmp_path / "no_such_model", names=("no_such_model",))
    assert "no such file or directory" in line and "not a directory" not in line
    line = compile_fails(capsys, tmp_path, tmp_path / "no_such.gguf", names=("no_such.gguf",))
    assert "no such file or directory" in line


def test_model_dir_is_a_file(capsys, tmp_path):
    f = tmp_path / "model.txt"
    f.write_text("hello")
    compile_fails(capsys, tmp_path, f, names=("model.txt", "neither a model folder nor a GGUF file"))


def test_a_model_given_where_a_plan_is_expected(capsys, tmp_path, model_dir):
    """strata-run, strata-server and stratac inspect given a GGUF file or a model folder: one line
    that says how to compile it, not `wrong file kind`."""
    from strata_compiler.runtime.server_cli import strata_server

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    want = f"error: {gguf} is a GGUF model, not a plan: compile it first: stratac compile {gguf} -o DIR"
    assert run_fails(capsys, gguf, "--prompt", "hi") == want
    assert assert_one_line_error(cli(capsys, strata_server, gguf)) == want
    assert assert_one_line_error(cli(capsys, stratac, "inspect", gguf)) == want
    line = run_fails(capsys, model_dir, "--prompt", "hi")
    assert line == f"error: {model_dir} is a Hugging Face model folder, not a plan: compile it first: stratac " \
                   f"compile {model_dir} -o DIR"
    line = run_fails(capsys, tmp_path / "nowhere", "--prompt", "hi", names=("nowhere",))
    assert "no such file or directory" in line


def test_missing_config(capsys, tmp_path, model_dir):
    (model_dir / "config.json").unlink()
    compile_fails(capsys, tmp_path, model_dir, names=("config.json", "missing"))


def test_missing_config_subprocess(tmp_path, model_dir):
    (model_dir / "config.json").unlink()
    out = tmp_path / "out"
    assert_one_line_error(script(STRATAC, "compile", model_dir, "-o", out), "config.json")
    assert_nothing_written(out)


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is _DELETE:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


_DELETE = object()


@pytest.mark.parametrize("text", ["{not json", "", "\xff\xfe garbage", '{"hidden_size": 64,'],
                         ids=["broken", "empty", "binary", "cut"])
def test_config_not_json(capsys, tmp_path, model_dir, text):
    (model_dir / "config.json").write_bytes(text.encode("latin-1"))
    compile_fails(capsys, tmp_path, model_dir, names=("config.json",))


@pytest.mark.parametrize("text", ["[1, 2, 3]", '"a string"', "42", "null"])
def test_config_not_an_object(capsys, tmp_path, model_dir, text):
    (model_dir / "config.json").write_text(text)
    compile_fails(capsys, tmp_path, model_dir, names=("config.json", "object"))


def test_config_not_json_subprocess(tmp_path, model_dir):
    (model_dir / "config.json").write_text("{ this is : not json")
    out = tmp_path / "out"
    assert_one_line_error(script(STRATAC, "compile", model_dir, "-o", out), "config.json", "JSON")
    assert_nothing_written(out)


@pytest.mark.parametrize("field,value", [
    ("hidden_size", "big"),
    ("hidden_size", 64.5),
    ("hidden_size", True),
    ("num_hidden_layers", [2]),
    ("num_attention_heads", {"n": 4}),
    ("vocab_size", "112"),
    ("rms_norm_eps", "tiny"),
    ("tie_word_embeddings", "yes"),
    ("num_local_experts", "four"),
])
def test_config_field_wrong_type(capsys, tmp_path, model_dir, field, value):
    _edit_config(model_dir, **{field: value})
    compile_fails(capsys, tmp_path, model_dir, names=("config.json", f"'{field}'"))


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"])
def test_config_field_missing(capsys, tmp_path, model_dir, field):
    _edit_config(model_dir, **{field: _DELETE})
    compile_fails(capsys, tmp_path, model_dir, names=("config.json", f"'{field}'", "missing"))


def test_config_inconsistent_heads(capsys, tmp_path, model_dir):
    _edit_config(model_dir, num_key_value_heads=3)
    compile_fails(capsys, tmp_path, model_dir, names=("config.json", "heads"))


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 10000.0},
    "not-an-object",
])
def test_config_bad_rope(capsys, tmp_path, model_dir, rope):
    _edit_config(model_dir, rope_parameters=rope, rope_scaling=_DELETE)
    compile_fails(capsys, tmp_path, model_dir, names=("config.json", "rope"))


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": "fast"},
    {"rope_type": "linear", "rope_theta": 10000.0},
], ids=["theta-not-a-number", "linear-without-factor"])
def test_config_garbled_rope_values(capsys, tmp_path, model_dir, rope):
    _edit_config(model_dir, rope_parameters=rope, rope_scaling=_DELETE)
    compile_fails(capsys, tmp_path, model_dir, names=("config.json", "rope"))


def test_config_clip_qkv_wrong_type(capsys, tmp_path, model_dir):
    _edit_config(model_dir, clip_qkv="high")
    compile_fails(capsys, tmp_path, model_dir, names=("config.json", "clip_qkv"))


@pytest.mark.parametrize("archs", [["GPT2LMHeadModel"], [], "MixtralForCausalLM", None])
def test_unsupported_architecture(capsys, tmp_path, model_dir, archs):
    _edit_config(model_dir, architectures=archs)
    line = compile_fails(capsys, tmp_path, model_dir, names=("config.json", "architecture"))
    assert "not supported" in line
    if archs == ["GPT2LMHeadModel"]:
        assert "GPT2LMHeadModel" in line


def test_unsupported_architecture_subprocess(tmp_path, model_dir):
    _edit_config(model_dir, architectures=["GPT2LMHeadModel"])
    out = tmp_path / "out"
    assert_one_line_error(script(STRATAC, "compile", model_dir, "-o", out), "config.json", "GPT2LMHeadModel")
    assert_nothing_written(out)


def _edit_tensors(model_dir: Path, drop: tuple[str, ...] = (), replace: dict | None = None) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    for k in drop:
        del tensors[k]
    tensors.update(replace or {})
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("key", [
    "model.embed_tokens.weight",
    "model.layers.1.self_attn.k_proj.weight",
    "model.layers.0.block_sparse_moe.experts.3.w2.weight",
    "model.layers.0.block_sparse_moe.experts.0.w1.weight",
    "model.norm.weight",
    "lm_head.weight",
])
def test_missing_tensor(capsys, tmp_path, model_dir, key):
    _edit_tensors(model_dir, drop=(key,))
    line = compile_fails(capsys, tmp_path, model_dir, names=(key,))
    assert "missing" in line


def test_missing_tensor_subprocess(tmp_path, model_dir):
    key = "model.layers.0.self_attn.q_proj.weight"
    _edit_tensors(model_dir, drop=(key,))
    out = tmp_path / "out"
    assert_one_line_error(script(STRATAC, "compile", model_dir, "-o", out), key, "missing")
    assert_nothing_written(out)


@pytest.mark.parametrize("key,shape", [
    ("model.layers.0.self_attn.q_proj.weight", (64, 32)),
    ("model.layers.1.self_attn.o_proj.weight", (64,)),
    ("model.embed_tokens.weight", (VOCAB + 1, 64)),
    ("model.layers.0.block_sparse_moe.experts.2.w3.weight", (41, 64)),
    ("model.layers.1.block_sparse_moe.experts.0.w1.weight", (40, 63)),
    ("model.layers.0.block_sparse_moe.gate.weight", (3, 64)),
    ("model.norm.weight", (64, 1)),
])
def test_tensor_wrong_shape(capsys, tmp_path, model_dir, key, shape):
    _edit_tensors(model_dir, replace={key: np.zeros(shape, np.float32)})
    line = compile_fails(capsys, tmp_path, model_dir, names=(key, "model.safetensors"))
    assert "shape" in line


@pytest.mark.parametrize("dtype", [np.float64, np.int32])
def test_tensor_unsupported_dtype(capsys, tmp_path, model_dir, dtype):
    key = "model.norm.weight"
    _edit_tensors(model_dir, replace={key: np.ones(64, dtype)})
    line = compile_fails(capsys, tmp_path, model_dir, names=(key, "model.safetensors"))
    assert "dtype" in line


def test_no_safetensors(capsys, tmp_path, model_dir):
    (model_dir / "model.safetensors").unlink()
    compile_fails(capsys, tmp_path, model_dir, names=("safetensors",))


@pytest.mark.parametrize("how", ["json-garbled", "length-too-big", "tiny-file", "not-an-object",
                                 "entry-malformed", "data-truncated"])
def test_corrupt_safetensors(capsys, tmp_path, model_dir, how):
    path = model_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", data)
    if how == "json-garbled":
        data[8 + n // 2 : 8 + n // 2 + 6] = b"\x00}{]\xff\""
    elif how == "length-too-big":
        struct.pack_into("<Q", data, 0, len(data) * 4)
    elif how == "tiny-file":
        data = data[:5]
    elif how in ("not-an-object", "entry-malformed"):
        header = b"[1, 2]" if how == "not-an-object" else b'{"model.norm.weight": {"dtype": "F32"}}'
        data = bytearray(struct.pack("<Q", len(header)) + header)
    elif how == "data-truncated":
        data = data[: len(data) - 1000]
    path.write_bytes(bytes(data))
    compile_fails(capsys, tmp_path, model_dir, names=("model.safetensors",))


def test_sharded_index_names_missing_shard(capsys, tmp_path, model_dir):
    keys = list(load_file(str(model_dir / "model.safetensors")))
    weight_map = {k: "model.safetensors" for k in keys}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    line = compile_fails(capsys, tmp_path, model_dir, names=("model-00002-of-00002.safetensors",))
    assert "missing" in line


@pytest.mark.parametrize("text", ["{broken", '{"metadata": {}}', '{"weight_map": [1, 2]}'])
def test_sharded_index_garbled(capsys, tmp_path, model_dir, text):
    (model_dir / "model.safetensors.index.json").write_text(text)
    compile_fails(capsys, tmp_path, model_dir, names=("model.safetensors.index.json",))


def test_sharded_index_non_string_shard(capsys, tmp_path, model_dir):
    (model_dir / "model.safetensors.index.json").write_text('{"weight_map": {"model.norm.weight": 5}}')
    compile_fails(capsys, tmp_path, model_dir, names=("model.safetensors.index.json",))


# ------------------------------------------------------------------------------------------------
# stratac flags


@pytest.mark.parametrize("flags,names", [
    (("--quant", "int5"), ("--quant", "int5")),
    (("--quant", "int4", "--group-size", "3"), ("--group-size", "3")),
    (("--quant", "int8", "--group-size", "0"), ("--group-size", "0")),
    (("--quant", "int4", "--group-size", "-32"), ("--group-size", "-32")),
    (("--quant", "int4", "--group-size", "8192"), ("--group-size", "8192")),
    (("--group-size", "many"), ("--group-size", "many")),
    (("--stop-after", "nosuchpass"), ("--stop-after", "nosuchpass")),
    (("--backend", "cuda"), ("--backend", "cuda")),
    (("--no-such-flag",), ("--no-such-flag",)),
])
def test_compile_bad_flag(capsys, tmp_path, built, flags, names):
    compile_fails(capsys, tmp_path, built.model, *flags, names=names)


def test_compile_dump_after_unknown_pass(capsys, built, tmp_path):
    line = compile_fails(capsys, tmp_path, built.model, "--dump-dir", tmp_path / "dump",
                         "--dump-after", "lower,nosuchpass", names=("--dump-after", "nosuchpass"))
    assert "lower" in line  # lists the passes there are


def test_compile_dump_after_unknown_pass_without_dump_dir(capsys, built, tmp_path):
    compile_fails(capsys, tmp_path, built.model, "--dump-after", "nosuchpass", names=("--dump-after", "nosuchpass"))


def test_compile_group_size_zero_default_quant(capsys, built, tmp_path):
    compile_fails(capsys, tmp_path, built.model, "--group-size", "0", names=("--group-size", "0"))


def test_compile_bad_flag_subprocess(tmp_path, built):
    out = tmp_path / "out"
    assert_one_line_error(script(STRATAC, "compile", built.model, "-o", out, "--quant", "int5"), "--quant", "int5")
    assert_nothing_written(out)


def test_compile_missing_output_flag(capsys, built):
    assert_one_line_error(cli(capsys, stratac, "compile", built.model), "-o")


def test_unknown_subcommand(capsys):
    assert_one_line_error(cli(capsys, stratac, "compiel"), "compiel")


# ------------------------------------------------------------------------------------------------
# strata-run flags and inputs


def test_run_xla_on_a_gpu_without_one(capsys, built):
    """--device gpu where JAX sees no GPU: one line, not JAX's bare error."""
    from strata_compiler.backends.xla.device import gpu_available

    if gpu_available():
        pytest.skip("this host has a GPU")
    line = run_fails(capsys, built.plan, "--input-ids", built.ids, "--backend", "xla", "--device", "gpu",
                     names=("--backend xla", "GPU"))
    assert "no CUDA GPU" in line


def test_run_xla_on_a_gpu_without_one_subprocess(built):
    from strata_compiler.backends.xla.device import gpu_available

    if gpu_available():
        pytest.skip("this host has a GPU")
    assert_one_line_error(script(STRATA_RUN, built.plan, "--input-ids", built.ids, "--backend", "xla", "--device", "gpu"),
                          "--backend xla", "GPU")


@pytest.mark.parametrize("flags,names", [
    (("--backend", "bogus"), ("--backend", "bogus")),
    (("--temperature", "-1"), ("--temperature", "-1")),
    (("--temperature", "hot"), ("--temperature", "hot")),
    (("--top-p", "0"), ("--top-p",)),
    (("--top-p", "1.5"), ("--top-p",)),
    (("-n", "-1"), ("-1",)),
    (("--seed", "x"), ("--seed", "x")),
    (("--greedy", "--temperature", "0.7"), ("--greedy", "--temperature")),
])
def test_run_bad_flag(capsys, built, flags, names):
    run_fails(capsys, built.plan, "--input-ids", built.ids, *flags, names=names)


def test_run_prompt_and_input_ids(capsys, built):
    run_fails(capsys, built.plan, "--prompt", "w1 w2", "--input-ids", built.ids, names=("--prompt", "--input-ids"))


def test_run_neither_prompt_nor_input_ids(capsys, built):
    run_fails(capsys, built.plan, "-n", "2", names=("--prompt", "--input-ids"))


def test_run_prompt_without_tokenizer(capsys, built):
    line = run_fails(capsys, built.plan_b, "--prompt", "w1 w2", names=("plan.bin", "tokenizer", "--input-ids"))
    assert str(built.plan_b) in line


def test_run_missing_plan_argument(capsys, built):
    assert_one_line_error(cli(capsys, strata_run, "--input-ids", built.ids), "PLAN_PATH")


def _ids_file(tmp_path: Path, how: str) -> Path:
    p = tmp_path / f"ids_{how}.npy"
    if how == "float":
        np.save(p, np.array([[1.0, 2.0, 3.0]], np.float32))
    elif how == "3d":
        np.save(p, np.ones((1, 2, 3), np.int64))
    elif how == "0d":
        np.save(p, np.int64(3))
    elif how == "empty":
        np.save(p, np.zeros((1, 0), np.int64))
    elif how == "bool":
        np.save(p, np.array([[True, False]]))
    elif how == "text":
        p.write_text("1 2 3 4\n")
    elif how == "empty-file":
        p.write_bytes(b"")
    elif how == "truncated-npy":
        np.save(p, np.arange(64, dtype=np.int64)[None])
        p.write_bytes(p.read_bytes()[:-40])
    elif how == "missing":
        pass
    elif how == "directory":
        p.mkdir()
    return p


@pytest.mark.parametrize("how", ["float", "3d", "0d", "empty", "bool", "text", "truncated-npy", "missing",
                                 "directory"])
def test_run_bad_input_ids(capsys, built, tmp_path, how):
    p = _ids_file(tmp_path, how)
    run_fails(capsys, built.plan, "--input-ids", p, names=("--input-ids", p.name))


def test_run_input_ids_empty_file(capsys, built, tmp_path):
    p = _ids_file(tmp_path, "empty-file")
    run_fails(capsys, built.plan, "--input-ids", p, names=("--input-ids", p.name))


def test_run_input_ids_npz(capsys, built, tmp_path):
    p = tmp_path / "ids.npz"
    np.savez(p, ids=np.array([[1, 2, 3]], np.int64))
    run_fails(capsys, built.plan, "--input-ids", p, names=("--input-ids", "ids.npz"))


class _Evil:
    """Unpickling this creates a directory: proof that a pickle was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("kind", ["object-npy", "raw-pickle"])
def test_run_pickled_input_ids_not_unpickled(capsys, built, tmp_path, kind):
    marker = tmp_path / "UNPICKLED"
    p = tmp_path / "ids.npy"
    if kind == "object-npy":
        np.save(p, np.array([_Evil(marker), 1], dtype=object), allow_pickle=True)
    else:
        p.write_bytes(pickle.dumps(_Evil(marker)))
    run_fails(capsys, built.plan, "--input-ids", p, names=("--input-ids", "ids.npy"))
    assert not marker.exists(), "the pickle was executed"


def test_run_pickled_input_ids_subprocess(built, tmp_path):
    marker = tmp_path / "UNPICKLED"
    p = tmp_path / "ids.npy"
    np.save(p, np.array([_Evil(marker)], dtype=object), allow_pickle=True)
    assert_one_line_error(script(STRATA_RUN, built.plan, "--input-ids", p), "--input-ids", "ids.npy")
    assert not marker.exists(), "the pickle was executed"


@pytest.mark.parametrize("ids", [[[1, 2, VOCAB]], [[5, -1, 3]], [[10 ** 12]]], ids=["vocab", "negative", "huge"])
def test_run_token_id_out_of_range(capsys, built, tmp_path, ids):
    p = tmp_path / "ids.npy"
    np.save(p, np.array(ids, np.int64))
    line = run_fails(capsys, built.plan, "--input-ids", p, names=("token id", str(VOCAB)))
    assert "vocabulary" in line


def test_run_token_id_out_of_range_uint64(capsys, built, tmp_path):
    p = tmp_path / "ids.npy"
    np.save(p, np.array([[1, 2**63 + 5]], np.uint64))
    run_fails(capsys, built.plan, "--input-ids", p, names=("token id",))


# ------------------------------------------------------------------------------------------------
# --debug: the documented escape hatch shows the traceback


def test_debug_shows_traceback(tmp_path):
    code, out, err = script(STRATAC, "compile", tmp_path / "no_such_model", "-o", tmp_path / "out", "--debug")
    assert code != 0
    assert "Traceback" in err and "ModelError" in err and "no_such_model" in err


def test_strata_debug_env_shows_traceback(built, tmp_path):
    plan = Path(shutil.copytree(built.plan, tmp_path / "plan")) / "plan.bin"
    plan.write_bytes(plan.read_bytes()[:100])
    code, out, err = script(STRATA_RUN, plan, "--input-ids", built.ids, env={"STRATA_DEBUG": "1"})
    assert code != 0
    assert "Traceback" in err and "PlanError" in err


@pytest.mark.parametrize("rules,named", [("experts=tpu", "experts=tpu"), ("everything=gpu", "everything"),
                                         ("re:([=gpu", "re:([")])
def test_compile_bad_place_rules(capsys, tmp_path, built, rules, named):
    compile_fails(capsys, tmp_path, built.model, "--place", rules, names=("--place", named))


def test_run_bad_setting_value_is_one_line(built):
    """A setting (strata_compiler/settings.py) with a value it does not take is one line naming
    its variable and what it takes."""
    assert_one_line_error(script(STRATA_RUN, built.plan, "--input-ids", built.ids, "-n", "2",
                                 env={"STRATA_NUM_THREADS": "many"}), "STRATA_NUM_THREADS", "whole number")
