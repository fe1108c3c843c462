"""Hostile files (issue 29): plans, weights, checkpoints and their JSON crafted to hang, crash or leak.

Each case ends in one `error: ...` line naming the file and a nonzero exit, promptly, or behaves
correctly: the IR text parser is linear (one 128 KB line took 13 s) and bounded (line length,
nesting, line count, rank, digits); JSON is depth-limited and `1e400` refused (plan meta, config.json,
tokenizer_config.json, safetensors headers and index, the imatrix index); only regular files are read
(a FIFO as plan, weights, shard, config or GGUF would block open() forever), a plan's files never
through a symlink out of its folder, and no message echoes a file's bytes; a weights file shorter
than its table is refused at open; safetensors offsets must be integers; GGUF tensors must sit on
the file's alignment. Cases that could hang run as subprocesses under a timeout (some with -O).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.errors import IRError, ModelError, PlanError
from strata_compiler.ir_text import MAX_LINE, MAX_LINES, MAX_NESTING, parse_graph
from strata_compiler.plan_format import PLAN_MAGIC, WEIGHTS_MAGIC, Container, is_plan_file, write_container
from strata_compiler.runtime.cli import strata_run
from strata_compiler.untrusted import load_json, open_regular

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "models" / "tiny-moe"
SECRET = b"s3cr3t:*:19000:0:99999:7:::\nmore-s3cr3t\n"   # an /etc/shadow line
TIMEOUT = 90   # seconds for one subprocess: start-up and a tiny model; a blocked open() never returns
STRATAC_MAIN = "import sys; from strata_compiler.cli import main; sys.argv[0] = 'stratac'; main()"
RUN_MAIN = "import sys; from strata_compiler.runtime.cli import main; sys.argv[0] = 'strata-run'; main()"


# ------------------------------------------------------------------------------------------------
# fixtures and helpers


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """tiny-moe compiled once (f32): plan.bin (meta, ir, tokenizer) + weights.bin; and ids.npy."""
    base = tmp_path_factory.mktemp("hostile_files")
    assert run_cli(stratac, ["compile", str(TINY), "-o", str(base / "plan")]) == 0
    np.save(base / "ids.npy", np.array([[1, 2, 3]], np.int64))
    return base


@pytest.fixture()
def plan_dir(built, tmp_path) -> Path:
    return Path(shutil.copytree(built / "plan", tmp_path / "plan"))


@pytest.fixture()
def ids(built) -> Path:
    return built / "ids.npy"


@pytest.fixture()
def model_dir(tmp_path) -> Path:
    """tiny-moe's folder: its JSON files copied, its weights linked (compile reads them through the link)."""
    d = tmp_path / "model"
    d.mkdir()
    for f in TINY.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, d / f.name)
    (d / "model.safetensors").symlink_to(TINY / "model.safetensors")
    return d


def one_line_error(code: int, out: str, err: str, *names: str) -> str:
    """Nonzero exit, stderr exactly one `error: ` line naming each of `names`, no traceback."""
    assert code != 0, f"exit 0: {out!r} {err!r}"
    assert "Traceback" not in out + err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"expected one error line, got {err!r}"
    for n in names:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    return lines[0]


def cli_fails(capsys, cmd, *args, names: tuple[str, ...] = ()) -> str:
    capsys.readouterr()
    code = run_cli(cmd, [str(a) for a in args])
    out, err = capsys.readouterr()
    return one_line_error(code, out, err, *names)


def script_fails(main: str, *args, names: tuple[str, ...] = (), optimize: bool = False) -> str:
    """The CLI in a fresh interpreter (-O when `optimize`); a hang fails on the timeout."""
    argv = [sys.executable, *(["-O"] if optimize else []), "-c", main, *map(str, args)]
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    line = one_line_error(p.returncode, p.stdout, p.stderr, *names)
    assert time.monotonic() - t0 < TIMEOUT
    return line


def reseal(plan: Path, **sections: bytes) -> None:
    """Rewrite plan.bin with some sections replaced: a well-formed container, every checksum valid."""
    with Container.open(plan, PLAN_MAGIC) as c:
        secs = {n: bytes(c.section(n)) for n in c.names()}
    secs.update(sections)
    write_container(plan, PLAN_MAGIC, list(secs.items()))


def meta_of(plan: Path) -> dict:
    with Container.open(plan, PLAN_MAGIC) as c:
        return json.loads(bytes(c.section("meta")))


def ir_of(plan: Path) -> str:
    with Container.open(plan, PLAN_MAGIC) as c:
        return bytes(c.section("ir")).decode()


# ------------------------------------------------------------------------------------------------
# IR text: linear time, limits

KERNEL_HEAD = "strata.ir level=kernel\n"
QUADRATIC = "%1 = add(%0) {" + "} : f32[" * 16000 + "\nreturn %1\n"   # 128 KB; 13 s before the fix


@pytest.mark.parametrize("line", [
    QUADRATIC,
    "%1 = add(%0) {a=\"" + "\\\"" * 64000 + "\nreturn %1\n",                  # an unterminated string of escapes
    "weight @a f32[1] fmt=f32 g=0 = (" + ")" * 128000 + "x\nreturn %1\n",
    "%1 = add(%0) : f32[1] @" + "a" * 128000 + "!\nreturn %1\n",
    "%1 = add(" + "%0, " * 32000 + ") : f32[\nreturn %1\n",
], ids=["attrs-type", "unterminated-string", "weight-sources", "device", "operands"])
def test_ir_hostile_long_line_parses_in_linear_time(line):
    t0 = time.monotonic()
    with pytest.raises(IRError):
        parse_graph(KERNEL_HEAD + line)
    assert time.monotonic() - t0 < 1.0


def test_ir_hostile_long_line_in_a_plan_is_one_line(plan_dir, ids):
    reseal(plan_dir / "plan.bin", ir=(KERNEL_HEAD + QUADRATIC).encode())
    t0 = time.monotonic()
    script_fails(RUN_MAIN, plan_dir, "--input-ids", ids, "-n", "1", names=("plan.bin", "IR"), optimize=True)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("text,fragment", [
    (KERNEL_HEAD + "%0 = input_ids() : i64[1]" + " " * MAX_LINE + "\nreturn %0\n", "characters long"),
    (KERNEL_HEAD + "\n" * MAX_LINES + "return\n", "lines"),
    (KERNEL_HEAD + "%0 = input_ids() {a=" + "[" * (MAX_NESTING + 1) + "]" * (MAX_NESTING + 1)
     + "} : i64[1]\nreturn %0\n", "nested"),
    (KERNEL_HEAD + "meta {a=" + "[" * 100000 + "}\nreturn\n", "nested"),
    (KERNEL_HEAD + "%0 = input_ids() : i64[" + ",".join(["1"] * 100) + "]\nreturn %0\n", "rank"),
    (KERNEL_HEAD + "%0 = input_ids() : i64[" + "9" * 5000 + "]\nreturn %0\n", "bad dimension"),
    (KERNEL_HEAD + "%0 = input_ids() : i64[\u00b2]\nreturn %0\n", "bad dimension"),
    (KERNEL_HEAD + "%" + "9" * 5000 + " = input_ids() : i64[1]\nreturn %0\n", "malformed node"),
    (KERNEL_HEAD + "%0 = input_ids() : i64[1] -> %b" + "9" * 5000 + "\nreturn %0\n", "malformed node"),
    (KERNEL_HEAD + "return %" + "9" * 5000 + "\n", "malformed return"),
    (KERNEL_HEAD + 'weight @a f32[1] fmt=f32 g=0 = experts[1]{' + "9" * 5000 + '}("x")\nreturn\n', "weight"),
    (KERNEL_HEAD + 'weight @a f32[1] fmt=f32 g=' + "9" * 5000 + ' = ("x")\nreturn\n', "weight"),
    (KERNEL_HEAD + "%0 = input_ids() {a=1e400} : i64[1]\nreturn %0\n", "out of range"),
    (KERNEL_HEAD + "%0 = \x1b[2J\nreturn %0\n", "\\x1b"),
    (KERNEL_HEAD + "%1 = add(" + "%0, " * 2000 + "%0) : f32[1]\nreturn %1\n", "operands or attributes"),
    (KERNEL_HEAD + "%1 = add(%0) {a=[" + "[]," * 40000 + "[]]} : f32[1]\nreturn %1\n", "brackets and commas"),
], ids=["line-length", "line-count", "attr-nesting", "meta-nesting", "rank", "dim-digits", "dim-unicode",
        "id-digits", "buffer-digits", "return-digits", "expert-id-digits", "group-digits", "attr-1e400",
        "control-chars", "operand-count", "symbol-count"])
def test_ir_limits(text, fragment):
    with pytest.raises(IRError) as ei:
        parse_graph(text, source="x.ir")
    msg = str(ei.value)
    assert msg.startswith("x.ir: ") and fragment in msg and "\n" not in msg and len(msg) < 600, msg


@settings(max_examples=int(os.environ.get("STRATA_FUZZ_EXAMPLES", "200")), deadline=None, database=None)
@given(st.data())
def test_ir_parser_fuzz_raises_only_irerror(built, data):
    """Random edits of a real kernel IR (characters the grammar gives meaning to, digits, long runs):
    parse_graph returns a Graph or raises IRError, never anything else, and stays fast."""
    text = ir_of(built / "plan" / "plan.bin")
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(text)))
        piece = data.draw(st.text(alphabet='%@{}[](),=:"\\ -#>\n0123456789eBTxf\x00\u00b2', max_size=12))
        piece *= data.draw(st.sampled_from([1, 1, 1, 100, 5000]))
        cut = data.draw(st.integers(0, 8))
        text = text[:at] + piece + text[at + cut:]
    t0 = time.monotonic()
    try:
        parse_graph(text)
    except IRError as e:
        assert "\n" not in str(e)
    assert time.monotonic() - t0 < 2.0


def test_ir_real_plan_still_round_trips(plan_dir):
    from strata_compiler.ir_text import print_graph

    text = ir_of(plan_dir / "plan.bin")
    assert print_graph(parse_graph(text)) == text


# ------------------------------------------------------------------------------------------------
# JSON: depth and range


def test_load_json_limits():
    with pytest.raises(ValueError, match="nested deeper"):
        load_json("[" * 100000 + "]" * 100000)              # RecursionError inside json, before the fix
    with pytest.raises(ValueError, match="nested deeper"):
        load_json('{"a":' * 70 + "1" + "}" * 70)            # parses, but deeper than the limit
    with pytest.raises(ValueError, match="out of range"):
        load_json('{"size": 1e400}')
    with pytest.raises(ValueError):
        load_json('{"size": Infinity}')
    assert load_json('{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}


@pytest.mark.parametrize("meta", [b"[" * 200000 + b"]" * 200000, b'{"a":' * 100 + b"1" + b"}" * 100],
                         ids=["recursion", "deep"])
def test_nested_meta_json_is_one_line(capsys, plan_dir, ids, meta):
    reseal(plan_dir / "plan.bin", meta=meta)
    cli_fails(capsys, strata_run, plan_dir, "--input-ids", ids, names=("plan.bin", "metadata"))


@pytest.mark.parametrize("value", ["1e400", "-1e400", "Infinity", "NaN"])
def test_meta_size_out_of_range_is_one_line(capsys, plan_dir, ids, value):
    meta = json.dumps(meta_of(plan_dir / "plan.bin"))
    size = meta_of(plan_dir / "plan.bin")["weights"]["size"]
    edited = meta.replace(f'"size": {size}', f'"size": {value}')
    assert edited != meta
    reseal(plan_dir / "plan.bin", meta=edited.encode())
    cli_fails(capsys, strata_run, plan_dir, "--input-ids", ids, names=("plan.bin", "metadata"))


@pytest.mark.parametrize("index", [b"[" * 100000 + b"\n", b'{"w": {"offset": 1e400, "shape": [4]}}\n',
                                   b'{"w": {"offset": 0, "shape": [99999999]}}\n', b'{"w": {"offset": "0", "shape": [1]}}\n',
                                   b'{"w": {"offset": 0, "shape": [-1]}}\n', b"no newline"],
                         ids=["nested", "1e400", "outside", "string-offset", "negative", "no-index"])
def test_malformed_imatrix_section_is_one_line(capsys, plan_dir, ids, index):
    reseal(plan_dir / "plan.bin", imatrix=index + bytes(16))
    cli_fails(capsys, strata_run, plan_dir, "--input-ids", ids, names=("plan.bin", "imatrix"))


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_nested_model_json_is_one_line(capsys, tmp_path, model_dir, name):
    (model_dir / name).write_text('{"a":' * 50000 + "1" + "}" * 50000)
    cli_fails(capsys, stratac, "compile", model_dir, "-o", tmp_path / "out", names=(name, "nested"))
    assert not (tmp_path / "out" / "plan.bin").exists()


# ------------------------------------------------------------------------------------------------
# regular files only, no symlinks out of a plan's folder, no file bytes in messages


def test_weights_fifo_does_not_block(plan_dir, ids):
    os.unlink(plan_dir / "weights.bin")
    os.mkfifo(plan_dir / "weights.bin")
    line = script_fails(RUN_MAIN, plan_dir, "--input-ids", ids, "-n", "1", names=("weights.bin", "FIFO"),
                        optimize=True)
    assert "regular file" in line


def test_plan_fifo_does_not_block(tmp_path):
    os.mkfifo(tmp_path / "plan.bin")
    script_fails(STRATAC_MAIN, "inspect", tmp_path / "plan.bin", names=("plan.bin", "FIFO"))
    t0 = time.monotonic()
    assert is_plan_file(tmp_path / "plan.bin") is False and is_plan_file(tmp_path) is False
    assert time.monotonic() - t0 < 5


def test_plan_files_that_are_not_regular_files(capsys, plan_dir, ids):
    (plan_dir / "weights.bin").unlink()
    (plan_dir / "weights.bin").mkdir()
    cli_fails(capsys, strata_run, plan_dir, "--input-ids", ids, names=("weights.bin", "directory"))
    with pytest.raises(OSError):
        open_regular("/dev/null")


@pytest.mark.parametrize("target", ["secret", "/dev/zero"])
def test_weights_symlink_out_of_the_folder_is_refused(capsys, plan_dir, ids, tmp_path, target):
    if target == "secret":
        (tmp_path / "secret").write_bytes(SECRET)
        target = str(tmp_path / "secret")
    (plan_dir / "weights.bin").unlink()
    (plan_dir / "weights.bin").symlink_to(target)
    line = cli_fails(capsys, strata_run, plan_dir, "--input-ids", ids, names=("weights.bin", "symbolic link"))
    assert "s3cr3t" not in line


def test_plan_symlink_out_of_the_folder_is_refused(capsys, tmp_path, ids):
    (tmp_path / "secret").write_bytes(SECRET * 4)
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "plan.bin").symlink_to(tmp_path / "secret")
    line = cli_fails(capsys, strata_run, tmp_path / "p", "--input-ids", ids, names=("plan.bin", "symbolic link"))
    assert "s3cr3t" not in line


def test_symlink_inside_the_folder_is_followed(capsys, plan_dir, ids):
    (plan_dir / "weights.bin").rename(plan_dir / "weights-v1.bin")
    (plan_dir / "weights.bin").symlink_to("weights-v1.bin")
    capsys.readouterr()
    assert run_cli(strata_run, [str(plan_dir), "--input-ids", str(ids), "-n", "2", "--greedy"]) == 0


@pytest.mark.parametrize("which", ["weights.bin", "plan.bin"])
def test_wrong_file_kind_never_echoes_its_bytes(capsys, plan_dir, ids, which):
    (plan_dir / which).write_bytes(SECRET * 8)
    line = cli_fails(capsys, strata_run, plan_dir, "--input-ids", ids, names=(which, "wrong file kind"))
    assert "s3cr3t" not in line and "STRATA" in line


@pytest.mark.parametrize("name", ["weights\x00.bin", "weights\n.bin", "weights\x1b[2J.bin"], ids=["nul", "newline", "escape"])
def test_odd_weights_name_is_one_line(capsys, plan_dir, ids, name):
    meta = meta_of(plan_dir / "plan.bin")
    meta["weights"]["file"] = name
    reseal(plan_dir / "plan.bin", meta=json.dumps(meta).encode())
    line = cli_fails(capsys, strata_run, plan_dir, "--input-ids", ids, names=("weights",))
    assert "\x00" not in line and "\x1b" not in line


@pytest.mark.parametrize("cut", [1, 4096, "toc"])
def test_weights_shorter_than_its_table_refused_at_open(capsys, plan_dir, ids, cut):
    w = plan_dir / "weights.bin"
    data = w.read_bytes()
    with Container.open(w, WEIGHTS_MAGIC, verify="none") as c:
        last = c.info(c.names()[-1])
    keep = last.offset + 8 if cut == "toc" else len(data) - cut
    w.write_bytes(data[:keep])
    with pytest.raises(PlanError, match="truncated"):
        Container.open(w, WEIGHTS_MAGIC, verify="none")
    cli_fails(capsys, strata_run, plan_dir, "--input-ids", ids, names=("weights.bin", "truncated"))


def test_config_json_fifo_does_not_block(tmp_path, model_dir):
    (model_dir / "config.json").unlink()
    os.mkfifo(model_dir / "config.json")
    script_fails(STRATAC_MAIN, "compile", model_dir, "-o", tmp_path / "out", names=("config.json", "FIFO"))


def test_tokenizer_config_fifo_does_not_block(tmp_path, model_dir):
    (model_dir / "tokenizer_config.json").unlink()
    os.mkfifo(model_dir / "tokenizer_config.json")
    script_fails(STRATAC_MAIN, "compile", model_dir, "-o", tmp_path / "out", names=("tokenizer_config.json", "FIFO"),
                 optimize=True)


def test_tokenizer_json_fifo_does_not_block(tmp_path, model_dir):
    (model_dir / "tokenizer.json").unlink()
    os.mkfifo(model_dir / "tokenizer.json")
    script_fails(STRATAC_MAIN, "compile", model_dir, "-o", tmp_path / "out", names=("tokenizer.json", "FIFO"))


def test_safetensors_shard_fifo_does_not_block(tmp_path, model_dir):
    (model_dir / "model.safetensors").unlink()
    os.mkfifo(model_dir / "model-00001-of-00001.safetensors")
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}))
    script_fails(STRATAC_MAIN, "compile", model_dir, "-o", tmp_path / "out",
                 names=("model-00001-of-00001.safetensors", "FIFO"))


def test_safetensors_index_fifo_and_nesting(capsys, tmp_path, model_dir):
    index = model_dir / "model.safetensors.index.json"
    index.write_text('{"weight_map": ' + "[" * 100000 + "}")
    cli_fails(capsys, stratac, "compile", model_dir, "-o", tmp_path / "o1", names=("model.safetensors.index.json",))
    index.unlink()
    os.mkfifo(index)
    script_fails(STRATAC_MAIN, "compile", model_dir, "-o", tmp_path / "o2", names=("model.safetensors.index.json", "FIFO"))


# ------------------------------------------------------------------------------------------------
# safetensors headers


def write_safetensors(path: Path, header: str, data: bytes = b"") -> None:
    """A safetensors file of this header text (padded to 8 bytes, as the format writes it) and data."""
    raw = header.encode() + b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [2, 2], "data_offsets": ["0", "16"]},
    {"dtype": "F32", "shape": [2, 2], "data_offsets": [0.0, 16.0]},
    {"dtype": "F32", "shape": [2, 2], "data_offsets": [False, 16]},
    {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8, 16]},
    {"dtype": "F32", "shape": [2, 2], "data_offsets": [-16, 0]},
    {"dtype": "F32", "shape": ["2", "2"], "data_offsets": [0, 16]},
    {"dtype": "F32", "shape": [2, float("inf")], "data_offsets": [0, 16]},   # written as 1e400
    {"dtype": "F32", "shape": [2, 2], "data_offsets": {"0": 16}},
    {"dtype": ["F32"], "shape": [2, 2], "data_offsets": [0, 16]},
    "not an object",
], ids=["string-offsets", "float-offsets", "bool-offset", "three-offsets", "negative-offset", "string-shape",
        "1e400-shape", "object-offsets", "list-dtype", "string-entry"])
def test_malformed_safetensors_entry_is_one_line(capsys, tmp_path, entry):
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(TINY / "config.json", d / "config.json")
    write_safetensors(d / "model.safetensors",
                      json.dumps({"model.embed_tokens.weight": entry}).replace("Infinity", "1e400"), bytes(16))
    line = cli_fails(capsys, stratac, "compile", d, "-o", tmp_path / "out", names=("model.safetensors",))
    assert "corrupt" in line or "dtype" in line or "JSON" in line, line


def test_nested_safetensors_header_is_one_line(capsys, tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    write_safetensors(d / "model.safetensors", "[" * 100000 + "]" * 100000)
    cli_fails(capsys, stratac, "compile", d, "-o", tmp_path / "out", names=("model.safetensors", "nested"))


# ------------------------------------------------------------------------------------------------
# GGUF: tensors on the file's alignment


def write_gguf(path: Path, alignment: int | None = None) -> None:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def shift_first_tensor(path: Path, by: int) -> None:
    """Move the first tensor's offset in the tensor directory (the bytes stay where they are)."""
    from gguf import GGUFReader

    r = GGUFReader(path, "r+")
    r.tensors[0].field.parts[-1][0] += by
    r.data.flush()
    del r


@pytest.mark.parametrize("alignment", [None, 64])
def test_gguf_tensor_off_its_alignment_is_refused(capsys, tmp_path, alignment):
    from strata_compiler.frontend.gguf_reader import open_gguf

    path = tmp_path / "shifted.gguf"
    write_gguf(path, alignment)
    shift_first_tensor(path, 3)
    with pytest.raises(ModelError, match="alignment"):
        open_gguf(path)
    cli_fails(capsys, stratac, "compile", path, "-o", tmp_path / "out", names=("shifted.gguf", "token_embd.weight",
                                                                             "alignment"))


def test_gguf_aligned_shift_past_the_end_is_refused(tmp_path):
    from strata_compiler.frontend.gguf_reader import open_gguf

    path = tmp_path / "past.gguf"
    write_gguf(path)
    shift_first_tensor(path, 1 << 20)
    with pytest.raises(ModelError, match="outside the file|not a readable GGUF"):
        open_gguf(path)


def test_gguf_magic_and_fifo(capsys, tmp_path):
    path = tmp_path / "secret.gguf"
    path.write_bytes(SECRET)
    line = cli_fails(capsys, stratac, "compile", path, "-o", tmp_path / "o1", names=("secret.gguf", "GGUF"))
    assert "s3cr3t" not in line
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    script_fails(STRATAC_MAIN, "compile", fifo, "-o", tmp_path / "o2", names=("fifo.gguf",))
