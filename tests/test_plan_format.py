"""Tests for the plan/weights container format (strata_compiler.plan_format)."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_compiler.errors import PlanError, StrataError
from strata_compiler.plan_format import (
    FORMAT_MAJOR,
    HEADER_SIZE,
    Container,
    ContainerWriter,
    SectionInfo,
    write_container,
)

PLAN = b"STRATAPL"
WEIGHTS = b"STRATAWT"

# header field offsets, as documented in the module docstring
MAJOR_AT, TOC_OFF_AT, TOC_SIZE_AT, TOTAL_AT, BODY_CRC_AT, TOC_CRC_AT, HEADER_CRC_AT = (
    8, 16, 24, 32, 40, 44, 60
)

SMALL_SECTIONS = [("meta", b'{"model": "tiny"}'), ("ir", b"%0 = add %a, %b\n"), ("empty", b""),
                  ("tok", bytes(range(40)))]


def _reseal_header(data: bytearray) -> None:
    """Recompute header_checksum so only deliberately patched fields are wrong."""
    struct.pack_into("<I", data, HEADER_CRC_AT, zlib.crc32(data[:HEADER_CRC_AT]))


def _reseal_all(data: bytearray, fix_size: bool = False) -> None:
    """Recompute every checksum the header claims (and total_size if asked), where it can."""
    if len(data) < HEADER_SIZE:
        return
    toc_off, toc_size = struct.unpack_from("<QQ", data, TOC_OFF_AT)
    if fix_size and toc_off <= len(data):  # so spliced TOCs get past the size checks
        toc_size = len(data) - toc_off
        struct.pack_into("<QQ", data, TOC_SIZE_AT, toc_size, len(data))
    if toc_off + toc_size <= len(data):
        struct.pack_into("<I", data, TOC_CRC_AT, zlib.crc32(data[toc_off : toc_off + toc_size]))
    struct.pack_into("<I", data, BODY_CRC_AT, zlib.crc32(data[HEADER_SIZE:]))
    _reseal_header(data)


def _one_line(err: BaseException, path: Path) -> str:
    msg = str(err)
    assert "\n" not in msg
    assert msg.startswith(str(path) + ": ")
    return msg


@pytest.fixture()
def small(tmp_path: Path) -> Path:
    path = tmp_path / "plan.bin"
    write_container(path, PLAN, SMALL_SECTIONS)
    return path


def _read_all(c: Container) -> None:
    for name in c.names():
        bytes(c.section(name))
        c.array(name, np.uint8, (c.info(name).length,))


# -- round trips ---------------------------------------------------------------------------------


def test_round_trip_sections_alignments_and_arrays(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    w1 = np.arange(3 * 5, dtype=np.float32).reshape(3, 5)
    w2 = np.arange(7, dtype=np.int8)
    strided = np.arange(24, dtype=np.int16).reshape(4, 6)[:, ::2]  # not contiguous
    big_endian = np.arange(4, dtype=">u4")
    with ContainerWriter(path, WEIGHTS, flags=0xA5) as w:
        infos = [
            w.add("meta", b"hello", align=1),
            w.add("w1", w1, align=4096),
            w.add("w2", w2),
            w.add("bytearray", bytearray(b"xyz"), align=16),
            w.add("memview", memoryview(b"abcdef")[::2], align=8),
            w.add("strided", strided, align=4096),
            w.add("be", big_endian),
            w.add("zero", np.zeros((0, 4), np.float32), align=4096),
            w.add("ünïcode/名前", b"\x00\x01"),
        ]
    assert all(isinstance(i, SectionInfo) for i in infos)
    with Container.open(path, WEIGHTS) as c:
        assert (c.major, c.minor, c.flags, c.magic) == (FORMAT_MAJOR, 0, 0xA5, WEIGHTS)
        assert c.names() == [i.name for i in infos]
        assert [c.info(n) for n in c.names()] == infos
        assert "w1" in c and "nope" not in c
        assert bytes(c.section("meta")) == b"hello"
        assert bytes(c.section("bytearray")) == b"xyz"
        assert bytes(c.section("memview")) == b"ace"
        assert bytes(c.section("ünïcode/名前")) == b"\x00\x01"
        a1 = c.array("w1", np.float32, (3, 5))
        np.testing.assert_array_equal(a1, w1)
        assert not a1.flags.writeable and c.section("w1").readonly
        np.testing.assert_array_equal(c.array("w2", "i1", [7]), w2)
        np.testing.assert_array_equal(c.array("strided", np.int16, (4, 3)), strided)
        np.testing.assert_array_equal(c.array("be", "<u4", (4,)), big_endian)
        assert c.array("zero", np.float32, (0, 4)).shape == (0, 4)
        assert len(c.section("zero")) == 0
        with pytest.raises(ValueError):
            a1[0, 0] = 1.0
        # zero-copy: the array's memory is inside the mapping, at the aligned offset
        assert a1.ctypes.data % 4096 == 0


def test_offsets_are_aligned_and_padding_is_zero(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    aligns = [1, 2, 8, 64, 4096, 128, 4096, 1]
    with ContainerWriter(path, WEIGHTS) as w:
        infos = [w.add(f"s{i}", bytes([i + 1]) * (i * 37 + 1), align=a) for i, a in enumerate(aligns)]
    data = path.read_bytes()
    end = HEADER_SIZE
    for info, align in zip(infos, aligns):
        assert info.align == align and info.offset % align == 0
        assert info.offset >= end and set(data[end : info.offset]) <= {0}
        assert info.checksum == zlib.crc32(data[info.offset : info.offset + info.length])
        end = info.offset + info.length
    toc_off, _, total = struct.unpack_from("<QQQ", data, TOC_OFF_AT)
    assert end <= toc_off and total == len(data)


def test_add_stream(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    consumed: list[int] = []

    def chunks():  # a generator, so the section is never materialized by the caller
        for i in range(10):
            consumed.append(i)
            yield np.full(1000, i, dtype=np.uint16)
        yield b""
        yield memoryview(b"tail")

    with ContainerWriter(path, WEIGHTS) as w:
        head = w.add("head", b"x")
        info = w.add_stream("stream", chunks(), align=4096)
        empty = w.add_stream("nothing", iter(()))
    assert consumed == list(range(10))
    expected = b"".join(np.full(1000, i, np.uint16).tobytes() for i in range(10)) + b"tail"
    assert info.offset % 4096 == 0 and info.length == len(expected)
    assert info.checksum == zlib.crc32(expected)
    with Container.open(path, WEIGHTS) as c:
        assert bytes(c.section("stream")) == expected
        assert c.info("head") == head and c.info("nothing") == empty and empty.length == 0


def test_deterministic(tmp_path: Path) -> None:
    arr = np.linspace(0, 1, 1000, dtype=np.float32)

    def write(path: Path) -> bytes:
        with ContainerWriter(path, WEIGHTS, flags=3) as w:
            w.add("a", arr, align=4096)
            w.add_stream("b", [b"12", arr[:10]])
            w.add("c", b"")
        return path.read_bytes()

    assert write(tmp_path / "one.bin") == write(tmp_path / "two.bin")


def test_empty_container(tmp_path: Path) -> None:
    path = tmp_path / "e.bin"
    write_container(path, PLAN, [])
    with Container.open(path, PLAN) as c:
        assert c.names() == []


def test_write_container_and_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "p.bin"
    write_container(path, PLAN, [("a", b"1")])
    write_container(path, PLAN, [("b", b"22")], align=4096)
    with Container.open(path, PLAN) as c:
        assert c.names() == ["b"] and c.info("b").offset == 4096
    assert os.listdir(tmp_path) == ["p.bin"]


# -- atomicity and writer misuse -------------------------------------------------------------------


def test_exception_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.bin"
    with pytest.raises(RuntimeError):
        with ContainerWriter(path, PLAN) as w:
            w.add("a", b"x" * 10000)
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_exception_leaves_existing_file_untouched(small: Path) -> None:
    before = small.read_bytes()

    def failing():
        yield b"partial"
        raise RuntimeError("source went away")

    with pytest.raises(RuntimeError):
        with ContainerWriter(small, PLAN) as w:
            w.add("a", b"x")
            w.add_stream("b", failing())
    assert small.read_bytes() == before
    assert os.listdir(small.parent) == [small.name]


def test_writer_misuse(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ContainerWriter(tmp_path / "x", b"short")
    with ContainerWriter(tmp_path / "x.bin", PLAN) as w:
        w.add("a", b"1")
        for bad in (0, 3, 48, -64, 1 << 32):
            with pytest.raises(ValueError):
                w.add("b", b"", align=bad)
        with pytest.raises(ValueError):
            w.add("a", b"dup")
        with pytest.raises(ValueError):
            w.add("", b"no name")
        with pytest.raises(TypeError):
            w.add("obj", np.array([object()]))
        w.add("b", b"2")  # rejected calls wrote nothing; the writer is still usable
    with Container.open(tmp_path / "x.bin", PLAN) as c:
        assert c.names() == ["a", "b"] and bytes(c.section("b")) == b"2"


def test_writer_io_error_is_plan_error(tmp_path: Path) -> None:
    target = tmp_path / "missing-dir" / "plan.bin"
    with pytest.raises(PlanError) as e:
        ContainerWriter(target, PLAN)
    _one_line(e.value, target)


# -- reader: structural errors ---------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.bin"
    with pytest.raises(PlanError, match="no such file") as e:
        Container.open(path, PLAN)
    _one_line(e.value, path)
    with pytest.raises(PlanError, match="directory"):
        Container.open(tmp_path, PLAN)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    with pytest.raises(PlanError, match="empty") as e:
        Container.open(path, PLAN)
    _one_line(e.value, path)


def test_wrong_magic(small: Path) -> None:
    with pytest.raises(PlanError, match="wrong file kind") as e:
        Container.open(small, WEIGHTS)
    assert "STRATAPL" in _one_line(e.value, small)


@pytest.mark.parametrize("major", [FORMAT_MAJOR + 1, FORMAT_MAJOR - 1, 0xFFFF])
def test_other_major_version(small: Path, major: int) -> None:
    data = bytearray(small.read_bytes())
    struct.pack_into("<H", data, MAJOR_AT, major)
    _reseal_header(data)
    small.write_bytes(bytes(data))
    with pytest.raises(PlanError) as e:
        Container.open(small, PLAN)
    msg = _one_line(e.value, small)
    assert f"plan format {major}.x" in msg and f"reads {FORMAT_MAJOR}.x" in msg
    assert ("newer" in msg and "upgrade Strata" in msg) if major > FORMAT_MAJOR else "older" in msg


def test_newer_minor_version_is_accepted(small: Path) -> None:
    data = bytearray(small.read_bytes())
    struct.pack_into("<H", data, MAJOR_AT + 2, 7)
    data[50] = 0xEE  # a future minor may use reserved header bytes
    _reseal_header(data)
    small.write_bytes(bytes(data))
    with Container.open(small, PLAN) as c:
        assert (c.major, c.minor) == (FORMAT_MAJOR, 7)
        assert bytes(c.section("meta")) == SMALL_SECTIONS[0][1]


def test_truncated_at_every_length(small: Path, tmp_path: Path) -> None:
    data = small.read_bytes()
    cut = tmp_path / "cut.bin"
    for n in range(len(data)):
        cut.write_bytes(data[:n])
        for verify in ("full", "none"):
            with pytest.raises(PlanError) as e:
                Container.open(cut, PLAN, verify=verify)
            _one_line(e.value, cut)
    cut.write_bytes(data[:200])
    with pytest.raises(PlanError, match=rf"truncated \(header says {len(data)} bytes, file has 200\)"):
        Container.open(cut, PLAN)


def test_appended_garbage(small: Path) -> None:
    with open(small, "ab") as f:
        f.write(b"\0")
    with pytest.raises(PlanError, match="1 unexpected byte after the end"):
        Container.open(small, PLAN, verify="none")


def test_flipped_byte_at_every_offset(small: Path, tmp_path: Path) -> None:
    data = small.read_bytes()
    bad = tmp_path / "bad.bin"
    for i in range(len(data)):
        mutated = bytearray(data)
        mutated[i] ^= 0x40
        bad.write_bytes(bytes(mutated))
        with pytest.raises(PlanError) as e:
            Container.open(bad, PLAN, verify="full")
        _one_line(e.value, bad)


def test_flipped_byte_in_padding_needs_full(small: Path) -> None:
    data = bytearray(small.read_bytes())
    with Container.open(small, PLAN) as c:
        meta = c.info("meta")
    data[meta.offset + meta.length] ^= 1  # the zero padding right after "meta"
    small.write_bytes(bytes(data))
    with Container.open(small, PLAN, verify="lazy") as c:
        _read_all(c)
    with pytest.raises(PlanError, match="body checksum"):
        Container.open(small, PLAN, verify="full")


def test_lazy_verification_names_the_section(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    good, bad = np.arange(1024, dtype=np.float32), np.ones(2048, dtype=np.float32)
    with ContainerWriter(path, WEIGHTS) as w:
        w.add("good", good, align=4096)
        info = w.add("layers.3.w", bad, align=4096)
    data = bytearray(path.read_bytes())
    data[info.offset + 4321] ^= 0xFF
    path.write_bytes(bytes(data))

    with pytest.raises(PlanError, match="'layers.3.w' is corrupt"):
        Container.open(path, WEIGHTS, verify="full")
    with Container.open(path, WEIGHTS, verify="lazy") as c:  # opening reads no section
        np.testing.assert_array_equal(c.array("good", np.float32, (1024,)), good)
        for access in (lambda: c.section("layers.3.w"), lambda: c.array("layers.3.w", "f4", [2048])):
            with pytest.raises(PlanError, match="section 'layers.3.w' is corrupt") as e:
                access()
            _one_line(e.value, path)
    with Container.open(path, WEIGHTS, verify="none") as c:
        assert c.array("layers.3.w", np.float32, (2048,))[1080] != 1.0


def test_missing_section_and_wrong_shape(small: Path) -> None:
    with Container.open(small, PLAN) as c:
        with pytest.raises(PlanError, match="no section 'weights'") as e:
            c.section("weights")
        _one_line(e.value, small)
        with pytest.raises(PlanError, match="no section"):
            c.info("weights")
        with pytest.raises(PlanError, match=r"holds 40 bytes but float32\[3, 4\] needs 48") as e:
            c.array("tok", np.float32, (3, 4))
        _one_line(e.value, small)
        np.testing.assert_array_equal(c.array("tok", np.uint32, (2, 5)).ravel(),
                                      np.frombuffer(bytes(range(40)), np.uint32))


def test_forged_toc_with_valid_checksums(small: Path) -> None:
    """A TOC that passes its checksums but lies must still give PlanError, not IndexError etc."""
    pristine = small.read_bytes()
    toc_off = struct.unpack_from("<Q", pristine, TOC_OFF_AT)[0]
    first = toc_off + 8  # first TOC entry: u64 offset, u64 length, u32 align, u32 crc, u16 len
    patches = {
        "count": (toc_off, struct.pack("<I", 0xFFFFFFFF)),
        "misaligned": (first, struct.pack("<Q", HEADER_SIZE + 1)),
        "past end": (first + 8, struct.pack("<Q", 1 << 62)),
        "align 0": (first + 16, struct.pack("<I", 0)),
        "align 3": (first + 16, struct.pack("<I", 3)),
        "name len": (first + 24, struct.pack("<H", 0xFFFF)),
        "name utf8": (first + 26, b"\xff"),
        "overlap": (first, struct.pack("<Q", 0)),
    }
    for what, (at, raw) in patches.items():
        data = bytearray(pristine)
        data[at : at + len(raw)] = raw
        _reseal_all(data)
        small.write_bytes(bytes(data))
        with pytest.raises(PlanError, match="table of contents") as e:
            Container.open(small, PLAN, verify="none")
        _one_line(e.value, small)
        assert what


def test_close_with_live_views(small: Path) -> None:
    c = Container.open(small, PLAN)
    arr = c.array("tok", np.uint8, (40,))
    view = c.section("meta")
    c.close()
    c.close()  # idempotent
    assert arr[39] == 39 and bytes(view) == SMALL_SECTIONS[0][1]  # the mapping outlives close()
    with pytest.raises(ValueError):
        c.section("meta")


# -- fuzzing: only PlanError may escape ---------------------------------------------------------------


def _valid_file() -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "p.bin"
        with ContainerWriter(path, PLAN) as w:
            w.add("meta", b'{"a": 1}', align=8)
            w.add("arr", np.arange(6, dtype=np.int32), align=64)
            w.add("empty", b"", align=16)
            w.add("ir", b"x" * 33, align=128)
        return path.read_bytes()


VALID = _valid_file()


@pytest.fixture(scope="module")
def fuzz_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "f.bin"


def _open_and_read(path: Path, data: bytes, verify: str = "full") -> None:
    path.write_bytes(data)
    try:
        with Container.open(path, PLAN, verify=verify) as c:
            _read_all(c)
    except PlanError as e:
        _one_line(e, path)


VALID_TOC = struct.unpack_from("<Q", VALID, TOC_OFF_AT)[0]

_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, len(VALID) - 1), st.integers(1, 255)),
    st.tuples(st.just("flip"), st.integers(VALID_TOC, len(VALID) - 1), st.integers(1, 255)),
    st.tuples(st.just("splice"), st.integers(0, len(VALID)), st.integers(0, 64), st.binary(max_size=64)),
    st.tuples(st.just("splice"), st.integers(VALID_TOC, len(VALID)), st.integers(0, 8), st.binary(max_size=8)),
    st.tuples(st.just("truncate"), st.integers(0, len(VALID))),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=64)),
)


def _mutate(data: bytes, ops: list[tuple]) -> bytes:
    buf = bytearray(data)
    for op in ops:
        if op[0] == "flip" and op[1] < len(buf):
            buf[op[1]] ^= op[2]
        elif op[0] == "splice":
            at = min(op[1], len(buf))
            buf[at : at + op[2]] = op[3]
        elif op[0] == "truncate":
            del buf[op[1] :]
        elif op[0] == "extend":
            buf += op[1]
    return bytes(buf)


_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(data=st.binary(max_size=512), magic_prefix=st.booleans())
def test_fuzz_arbitrary_bytes(fuzz_path: Path, data: bytes, magic_prefix: bool) -> None:
    _open_and_read(fuzz_path, (PLAN + data) if magic_prefix else data)


@_FUZZ
@given(ops=st.lists(_mutation, min_size=1, max_size=4))
def test_fuzz_mutations_are_detected(fuzz_path: Path, ops: list[tuple]) -> None:
    mutated = _mutate(VALID, ops)
    fuzz_path.write_bytes(mutated)
    if mutated == VALID:
        return
    with pytest.raises(PlanError) as e:  # checksums and sizes catch every change
        with Container.open(fuzz_path, PLAN, verify="full") as c:
            _read_all(c)
    _one_line(e.value, fuzz_path)


@_FUZZ
@given(
    ops=st.lists(_mutation, min_size=1, max_size=4),
    verify=st.sampled_from(["full", "lazy", "none"]),
    fix_size=st.booleans(),
)
def test_fuzz_mutations_resealed(
    fuzz_path: Path, ops: list[tuple], verify: str, fix_size: bool
) -> None:
    """Mutations with all checksums recomputed reach the TOC parser and layout checks."""
    data = bytearray(_mutate(VALID, ops))
    _reseal_all(data, fix_size)
    _open_and_read(fuzz_path, bytes(data), verify)


def test_plan_error_is_strata_error() -> None:
    assert issubclass(PlanError, StrataError)
