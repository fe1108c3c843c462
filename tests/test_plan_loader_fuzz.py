"""Fuzzing the plan loader (hypothesis): corrupt plan.bin / weights.bin never escape as anything but StrataError.

A real plan (tiny Mixtral, int4 so weights have several arrays each, with a tokenizer section) is
compiled once per module. Every example writes a mutated copy into a fresh temp directory, then
calls `load_plan` and dequantizes every weight of the graph. Properties:

* the only exception allowed is `StrataError` (PlanError, ...);
* plan.bin is verified whole, so any change to its bytes (flip, truncation, insertion, junk)
  must be rejected at load;
* weights.bin is verified per section on first access: a change inside a section must be
  rejected by the time every weight has been read; if a mutated weights.bin is accepted, every
  weight must still equal the original bit for bit (no silent corruption).

A separate family re-seals the container after mutating its sections (valid checksums, garbage
contents), which drives the metadata/IR parsing behind the checksums.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from strata_compiler.errors import StrataError
from strata_compiler.plan_format import (HEADER_SIZE, PLAN_MAGIC, WEIGHTS_MAGIC, Container, SectionInfo,
                                         write_container)
from strata_compiler.runtime.plan import load_plan

# STRATA_FUZZ_EXAMPLES: more examples per test for a longer hunt (CI: 200)
FUZZ = settings(max_examples=int(os.environ.get("STRATA_FUZZ_EXAMPLES", "200")), deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

TOC_OFF_AT, TOC_SIZE_AT, BODY_CRC_AT, TOC_CRC_AT, HEADER_CRC_AT = 16, 24, 40, 44, 60


@dataclass(frozen=True)
class Compiled:
    dir: Path
    plan: bytes
    weights: bytes
    plan_sections: tuple[SectionInfo, ...]
    weight_sections: tuple[SectionInfo, ...]
    reference: dict[str, np.ndarray]  # every weight, dequantized, from the untouched files


def _sections(path: Path, magic: bytes) -> tuple[SectionInfo, ...]:
    with Container.open(path, magic, verify="none") as c:
        return tuple(c.info(n) for n in c.names())


def _read_all(plan) -> dict[str, np.ndarray]:
    out = {}
    for spec in plan.graph.weights:
        out[spec.name] = plan.weights.get(spec.name).copy()
    return out


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Compiled:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hf_models import build_model
    from strata_compiler.cli import stratac
    from strata_compiler.cli_common import run_cli

    base = tmp_path_factory.mktemp("fuzz")
    model = build_model("mixtral", base / "model", num_hidden_layers=1)
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model / "tokenizer.json"))
    out = base / "plan"
    assert run_cli(stratac, ["compile", str(model), "-o", str(out), "--quant", "int4"]) == 0
    plan = load_plan(out / "plan.bin")
    ref = _read_all(plan)
    plan.weights.c.close()
    psec = _sections(out / "plan.bin", PLAN_MAGIC)
    wsec = _sections(out / "weights.bin", WEIGHTS_MAGIC)
    assert [s.name for s in psec] == ["meta", "ir", "tokenizer"]
    assert len(wsec) > len(ref)  # int4: quantized values and scales per weight
    return Compiled(out, (out / "plan.bin").read_bytes(), (out / "weights.bin").read_bytes(), psec, wsec, ref)


def _attempt(c: Compiled, plan: bytes, weights: bytes) -> dict[str, np.ndarray] | StrataError:
    """Write the two files into a fresh directory, load the plan, read every weight."""
    with tempfile.TemporaryDirectory(prefix="strata-fuzz-") as d:
        (Path(d) / "plan.bin").write_bytes(plan)
        (Path(d) / "weights.bin").write_bytes(weights)
        loaded = None
        try:
            loaded = load_plan(Path(d) / "plan.bin")
            return _read_all(loaded)
        except StrataError as e:  # anything else propagates and fails the test
            msg = str(e)
            assert msg and "\n" not in msg, f"error message is not one line: {msg!r}"
            return e
        finally:
            if loaded is not None:
                loaded.weights.c.close()


def _assert_same_weights(c: Compiled, got: dict[str, np.ndarray]) -> None:
    assert got.keys() == c.reference.keys()
    for name, ref in c.reference.items():
        np.testing.assert_array_equal(got[name], ref, err_msg=name)


# ------------------------------------------------------------------------------------------------
# baseline


def test_unmutated_copy_loads(compiled):
    got = _attempt(compiled, compiled.plan, compiled.weights)
    assert not isinstance(got, StrataError), got
    _assert_same_weights(compiled, got)
    # and through the directory form of the path
    with tempfile.TemporaryDirectory() as d:
        shutil.copytree(compiled.dir, Path(d) / "p")
        plan = load_plan(Path(d) / "p")
        _assert_same_weights(compiled, _read_all(plan))
        plan.weights.c.close()


# ------------------------------------------------------------------------------------------------
# plan.bin: raw mutations, every one of which must be rejected


@st.composite
def plan_mutation(draw, data: bytes) -> tuple[str, bytes]:
    n = len(data)
    kind = draw(st.sampled_from(["flip", "flips", "truncate", "insert", "splice", "append", "overwrite"]))
    buf = bytearray(data)
    if kind == "flip":
        buf[draw(st.integers(0, n - 1))] ^= draw(st.integers(1, 255))
    elif kind == "flips":
        for off, x in draw(st.dictionaries(st.integers(0, n - 1), st.integers(1, 255), min_size=2, max_size=8)).items():
            buf[off] ^= x
    elif kind == "truncate":
        del buf[draw(st.integers(0, n - 1)):]
    elif kind == "insert":
        at = draw(st.integers(0, n))
        buf[at:at] = draw(st.binary(min_size=1, max_size=64))
    elif kind == "splice":  # move a chunk of the file somewhere else (the length may change)
        a = draw(st.integers(0, n - 1))
        chunk = data[a : a + draw(st.integers(1, 256))]
        at = draw(st.integers(0, n - 1))
        end = at + draw(st.integers(0, 256))
        buf[at:end] = chunk
    elif kind == "append":
        buf += draw(st.binary(min_size=1, max_size=4096))
    else:  # overwrite a run of bytes in place with random ones
        at = draw(st.integers(0, n - 1))
        junk = draw(st.binary(min_size=1, max_size=128))
        buf[at : at + len(junk)] = junk
        del buf[n:]
    return kind, bytes(buf)


@given(data=st.data())
@FUZZ
def test_fuzz_plan_bytes(compiled, data):
    kind, plan = data.draw(plan_mutation(compiled.plan), label="mutation")
    assume(plan != compiled.plan)
    got = _attempt(compiled, plan, compiled.weights)
    # plan.bin is checked whole (header, TOC, body and section checksums): any change is caught
    assert isinstance(got, StrataError), f"{kind}: a changed plan.bin was accepted"


@pytest.mark.parametrize("section", ["meta", "ir", "tokenizer"])
def test_every_byte_of_a_plan_section_is_checked(compiled, section):
    """Exhaustive over a sample of offsets in each section: one flipped byte is always rejected."""
    s = next(s for s in compiled.plan_sections if s.name == section)
    for off in sorted({s.offset, s.offset + s.length - 1, *range(s.offset, s.offset + s.length, 97)}):
        buf = bytearray(compiled.plan)
        buf[off] ^= 0x01
        got = _attempt(compiled, bytes(buf), compiled.weights)
        assert isinstance(got, StrataError) and "plan.bin" in str(got), off


# ------------------------------------------------------------------------------------------------
# weights.bin


@st.composite
def weights_mutation(draw, c: Compiled) -> tuple[str, bytes, bool]:
    """(kind, mutated bytes, whether reading every weight must fail)."""
    data = c.weights
    n = len(data)
    buf = bytearray(data)
    kind = draw(st.sampled_from(["flip-in-section", "flip-anywhere", "flips", "truncate", "append", "insert"]))
    if kind == "flip-in-section":
        s = draw(st.sampled_from([s for s in c.weight_sections if s.length]))
        buf[s.offset + draw(st.integers(0, s.length - 1))] ^= draw(st.integers(1, 255))
        must_fail = True
    elif kind == "flip-anywhere":
        off = draw(st.integers(0, n - 1))
        buf[off] ^= draw(st.integers(1, 255))
        # section bytes are checked on first read; header and TOC at open; the zero padding
        # between sections is only covered by the (not recomputed) body checksum
        in_section = any(s.offset <= off < s.offset + s.length for s in c.weight_sections)
        toc_off = struct.unpack_from("<Q", data, TOC_OFF_AT)[0]
        must_fail = in_section or off < HEADER_SIZE or off >= toc_off
    elif kind == "flips":
        for off, x in draw(st.dictionaries(st.integers(0, n - 1), st.integers(1, 255), min_size=2, max_size=8)).items():
            buf[off] ^= x
        must_fail = False
    elif kind == "truncate":
        del buf[draw(st.integers(0, n - 1)):]
        must_fail = True
    elif kind == "append":
        buf += draw(st.binary(min_size=1, max_size=64))
        must_fail = True
    else:
        at = draw(st.integers(0, n))
        buf[at:at] = draw(st.binary(min_size=1, max_size=64))
        must_fail = True
    return kind, bytes(buf), must_fail


@given(data=st.data())
@FUZZ
def test_fuzz_weights_bytes(compiled, data):
    kind, weights, must_fail = data.draw(weights_mutation(compiled), label="mutation")
    got = _attempt(compiled, compiled.plan, weights)
    if isinstance(got, StrataError):
        assert "weights.bin" in str(got), str(got)
        return
    assert not must_fail, f"{kind}: a corrupt weights.bin was read without an error"
    _assert_same_weights(compiled, got)  # accepted => the data the model sees is untouched


def test_weights_from_another_plan_rejected(compiled):
    """Same size, different bytes in one section: rejected at load via the body checksum, or on read."""
    s = compiled.weight_sections[0]
    buf = bytearray(compiled.weights)
    buf[s.offset] ^= 0x80
    # re-seal weights.bin fully so it is a self-consistent file from "another compile"
    _reseal(buf, {s.name: s})
    got = _attempt(compiled, compiled.plan, bytes(buf))
    assert isinstance(got, StrataError) and "does not match" in str(got), got


# ------------------------------------------------------------------------------------------------
# re-sealed containers: valid checksums around garbage contents


def _toc_entries(data: bytes) -> dict[str, int]:
    """Section name -> byte offset of its TOC entry's crc field."""
    toc_off = struct.unpack_from("<Q", data, TOC_OFF_AT)[0]
    (count,) = struct.unpack_from("<I", data, toc_off)
    pos, out = toc_off + 8, {}
    for _ in range(count):
        _, _, _, _, name_len = struct.unpack_from("<QQIIH", data, pos)
        name = data[pos + 26 : pos + 26 + name_len].decode()
        out[name] = pos + 20  # u64 offset, u64 length, u32 align, then the u32 crc
        pos += 26 + name_len
    return out


def _reseal(buf: bytearray, changed: dict[str, SectionInfo]) -> None:
    """Recompute the crc of each changed section, then the TOC, body and header checksums."""
    entries = _toc_entries(bytes(buf))
    for name, s in changed.items():
        struct.pack_into("<I", buf, entries[name], zlib.crc32(buf[s.offset : s.offset + s.length]))
    toc_off, toc_size = struct.unpack_from("<QQ", buf, TOC_OFF_AT)
    struct.pack_into("<I", buf, TOC_CRC_AT, zlib.crc32(buf[toc_off : toc_off + toc_size]))
    struct.pack_into("<I", buf, BODY_CRC_AT, zlib.crc32(buf[HEADER_SIZE:]))
    struct.pack_into("<I", buf, HEADER_CRC_AT, zlib.crc32(buf[:HEADER_CRC_AT]))


@given(data=st.data())
@FUZZ
def test_fuzz_resealed_plan_sections(compiled, data):
    """Bytes inside meta/ir/tokenizer change but every checksum is recomputed: still only StrataError."""
    buf = bytearray(compiled.plan)
    s = data.draw(st.sampled_from(compiled.plan_sections), label="section")
    for off, x in data.draw(st.dictionaries(st.integers(0, s.length - 1), st.integers(1, 255),
                                            min_size=1, max_size=6), label="flips").items():
        buf[s.offset + off] ^= x
    _reseal(buf, {s.name: s})
    got = _attempt(compiled, bytes(buf), compiled.weights)
    if not isinstance(got, StrataError) and s.name == "tokenizer":
        _assert_same_weights(compiled, got)


def _json_values():
    scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8)
    return st.recursive(scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids,
                                                                                              max_size=3), max_leaves=6)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))


@given(data=st.data())
@FUZZ
def test_fuzz_rebuilt_plan_meta(compiled, data):
    """A well-formed container whose metadata JSON has one value replaced, removed, or is not JSON."""
    with Container.open(compiled.dir / "plan.bin", PLAN_MAGIC) as c:
        sections = {n: bytes(c.section(n)) for n in c.names()}
    meta = json.loads(sections["meta"])
    how = data.draw(st.sampled_from(["replace", "delete", "raw"]), label="how")
    if how == "raw":
        sections["meta"] = data.draw(st.binary(max_size=64) | st.text(max_size=64).map(str.encode), label="raw")
    else:
        path = data.draw(st.sampled_from([p for p in _paths(meta) if p or how == "replace"]), label="path")
        if not path:
            meta = data.draw(_json_values(), label="value")
        else:
            parent = meta
            for k in path[:-1]:
                parent = parent[k]
            if how == "delete":
                del parent[path[-1]]
            else:
                parent[path[-1]] = data.draw(_json_values(), label="value")
        sections["meta"] = json.dumps(meta).encode()
    with tempfile.TemporaryDirectory() as d:
        write_container(Path(d) / "plan.bin", PLAN_MAGIC, list(sections.items()))
        plan = (Path(d) / "plan.bin").read_bytes()
    _attempt(compiled, plan, compiled.weights)


@given(data=st.data())
@FUZZ
def test_fuzz_rebuilt_plan_ir(compiled, data):
    """A well-formed container whose IR text has lines dropped, duplicated, swapped or edited."""
    with Container.open(compiled.dir / "plan.bin", PLAN_MAGIC) as c:
        sections = {n: bytes(c.section(n)) for n in c.names()}
    lines = sections["ir"].decode().splitlines()
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        i = data.draw(st.integers(0, len(lines) - 1), label="line")
        how = data.draw(st.sampled_from(["drop", "dup", "swap", "edit", "truncate"]), label="how")
        if how == "drop" and len(lines) > 1:
            del lines[i]
        elif how == "dup":
            lines.insert(i, lines[i])
        elif how == "swap":
            j = data.draw(st.integers(0, len(lines) - 1), label="other")
            lines[i], lines[j] = lines[j], lines[i]
        elif how == "edit" and lines[i]:
            k = data.draw(st.integers(0, len(lines[i]) - 1), label="col")
            lines[i] = lines[i][:k] + data.draw(st.text(max_size=4), label="text") + lines[i][k + 1 :]
        elif how == "truncate":
            lines[i] = lines[i][: data.draw(st.integers(0, len(lines[i])), label="keep")]
    sections["ir"] = ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")
    with tempfile.TemporaryDirectory() as d:
        write_container(Path(d) / "plan.bin", PLAN_MAGIC, list(sections.items()))
        plan = (Path(d) / "plan.bin").read_bytes()
    _attempt(compiled, plan, compiled.weights)


@pytest.mark.parametrize("old,new", [
    ("weight @embed f32[112,64]", "weight @embed f32[112]"),                 # found by the fuzzer (2026-12-01)
    ("weight @L0.moe.down f32[4,64,40]", "weight @L0.moe.down f32[4,64]"),
])
def test_weights_of_the_wrong_rank_are_one_clear_error(compiled, old, new):
    """IR whose embedding table or stacked experts have the wrong rank: one line, no IndexError."""
    with Container.open(compiled.dir / "plan.bin", PLAN_MAGIC) as c:
        sections = {n: bytes(c.section(n)) for n in c.names()}
    ir = sections["ir"].decode()
    assert old in ir
    sections["ir"] = ir.replace(old, new).encode()
    with tempfile.TemporaryDirectory() as d:
        write_container(Path(d) / "plan.bin", PLAN_MAGIC, list(sections.items()))
        plan = (Path(d) / "plan.bin").read_bytes()
    err = _attempt(compiled, plan, compiled.weights)
    assert isinstance(err, StrataError) and ("expected [vocab, width]" in str(err) or "expected stacked" in str(err))
