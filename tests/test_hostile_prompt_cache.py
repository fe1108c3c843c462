"""Hostile prompt-cache folders and files (issue 40): --kv-cache-dir is read at start and written at
shutdown, and what it holds becomes the server's answers.

The folder must be ours and writable by no one else (else one `error:` line saying `chmod 700`);
entries are bound to the plan's full hash and authenticated by an HMAC under a key kept in the
folder (0600, ours, never a symlink), so a forged entry is refused; saving writes to a fresh temp
file and renames it, so a planted symlink is replaced, never followed; reading takes regular files
only (no symlinks, dangling or not; a FIFO does not block) with every size bounded; each bad file
is one warning and the server starts anyway. Cases that could hang or blow up run in a child under
tests/limits.py (10 s, 1 GiB); hypothesis mutates a valid entry file field by field and bit by bit.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import os
import stat
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_compiler.errors import UsageError
from strata_compiler.runtime import prompt_cache
from strata_compiler.runtime.prompt_cache import KEY_FILE, MAGIC, VERSION, PromptCache

from limits import run_limited, run_python

PLAN = hashlib.sha256(b"a plan.bin").hexdigest()
SHAPE = (2, 2, 4)           # layers, kv heads, head dim
MAX_BYTES = 1 << 20
WARNING = "strata-server: warning: prompt cache file "
SERVER_MAIN = "import sys; from strata_compiler.runtime.server_cli import main; sys.argv[0] = 'strata-server'; main()"


class _Cache:
    """A host KV cache of one row (what PromptCache.store reads): k, v per layer [1, KV, S, hd], lengths."""

    def __init__(self, n: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        L, KV, hd = SHAPE
        self.k = [rng.standard_normal((1, KV, n, hd)).astype(np.float32) for _ in range(L)]
        self.v = [rng.standard_normal((1, KV, n, hd)).astype(np.float32) for _ in range(L)]
        self.lengths = np.array([n])


def _load(folder: Path, max_bytes: int = MAX_BYTES, plan: str = PLAN) -> tuple[PromptCache, list[str]]:
    """A PromptCache reading `folder`, and the lines it wrote to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        pc = PromptCache(max_bytes, plan, folder, shape=SHAPE)
    return pc, err.getvalue().splitlines()


def _save(folder: Path, n: int = 16, seed: int = 0) -> tuple[Path, np.ndarray]:
    """One entry of n tokens saved in `folder`: its file and tokens."""
    pc, lines = _load(folder)
    tokens = np.random.default_rng(seed).integers(0, 1000, n)
    pc.store(tokens, _Cache(n, seed), 0)
    assert pc.save() == 1
    return folder / prompt_cache._file_name(PromptCache._key(tokens)), tokens


def _only_warnings(lines: list[str], *reasons: str) -> None:
    """One warning per reason, in any order, each naming why."""
    assert len(lines) == len(reasons) and all(line.startswith(WARNING) for line in lines), lines
    for why in reasons:
        assert sum(why in line for line in lines) >= 1, (why, lines)


@pytest.fixture()
def folder(tmp_path) -> Path:
    return tmp_path / "kv"


# ------------------------------------------------------------------------------------------------
# the folder and its key


def test_a_new_folder_and_key_are_ours_alone(folder):
    old = os.umask(0o022)
    try:
        path, tokens = _save(folder)
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    key = folder / KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in folder.iterdir()) == sorted([KEY_FILE, path.name])   # no temp file left
    pc, lines = _load(folder)
    assert not lines and [list(e.tokens) for e in pc.entries.values()] == [list(tokens)]


@pytest.mark.parametrize("mode, who", [(0o777, "its group and others"), (0o770, "its group"), (0o702, "others")])
def test_a_folder_others_can_write_is_refused(folder, mode, who):
    _save(folder)
    folder.chmod(mode)
    with pytest.raises(UsageError) as e:
        _load(folder)
    msg = str(e.value)
    assert "\n" not in msg and str(folder) in msg and who in msg and f"chmod 700 {folder}" in msg


def test_a_folder_of_another_user_is_refused(folder, monkeypatch):
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: folder.stat().st_uid + 1)
    with pytest.raises(UsageError, match="owned by uid .* give a folder of your own"):
        _load(folder)


def test_the_server_refuses_the_folder_with_one_error_line(tiny_f32_plan, folder):
    folder.mkdir()
    folder.chmod(0o777)
    r = run_limited([sys.executable, "-c", SERVER_MAIN, tiny_f32_plan, "--backend", "reference", "--port", "0",
                     "--kv-cache-dir", folder]).check()
    assert r.rc == 2 and r.stderr.strip().splitlines() == [
        f"error: prompt cache folder {folder}: it is writable by its group and others (mode 777), who could "
        f"change the server's answers; run `chmod 700 {folder}`"]


def _symlink_to_a_copy(key: Path, elsewhere: Path) -> None:
    elsewhere.write_bytes(key.read_bytes())
    elsewhere.chmod(0o600)
    key.unlink()
    key.symlink_to(elsewhere)


@pytest.mark.parametrize("why, spoil", [
    pytest.param("others may read it (mode 644)", lambda key, elsewhere: key.chmod(0o644), id="readable"),
    pytest.param("not a key of 32 bytes", lambda key, elsewhere: key.write_bytes(key.read_bytes()[:16]), id="short"),
    pytest.param("is a symbolic link", _symlink_to_a_copy, id="symlink"),
    pytest.param("is a symbolic link", lambda key, elsewhere: (key.unlink(), key.symlink_to(elsewhere)), id="dangling"),
    pytest.param("not a regular file", lambda key, elsewhere: (key.unlink(), key.mkdir()), id="folder")])
def test_a_spoiled_key_file_is_refused(folder, tmp_path, why, spoil):
    _save(folder)
    key = folder / KEY_FILE
    spoil(key, tmp_path / "elsewhere")
    with pytest.raises(UsageError) as e:
        _load(folder)
    msg = str(e.value)
    assert msg.startswith(f"prompt cache key {key}: ") and why in msg and "delete it" in msg


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_key_file_of_another_user_is_refused(folder):
    _save(folder)
    os.chown(folder / KEY_FILE, 12345, -1)
    with pytest.raises(UsageError, match="owned by uid 12345"):
        _load(folder)


def test_a_lost_key_makes_a_new_one_and_old_entries_are_refused(folder):
    path, _ = _save(folder)
    (folder / KEY_FILE).unlink()
    pc, lines = _load(folder)
    assert not pc.entries and (folder / KEY_FILE).is_file()
    _only_warnings(lines, "MAC does not verify")


def test_saving_into_a_folder_made_writable_meanwhile_is_refused(folder):
    pc, _ = _load(folder)
    tokens = np.arange(16)
    pc.store(tokens, _Cache(16, 0), 0)
    folder.chmod(0o777)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert pc.save() == 0
    assert err.getvalue().count("\n") == 1 and "prompt cache not saved" in err.getvalue()
    assert not list(folder.glob("*.kv"))


# ------------------------------------------------------------------------------------------------
# symlinks, FIFOs, forged and damaged entries


def test_save_replaces_a_planted_symlink_and_never_writes_through_it(folder, tmp_path):
    _load(folder)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    tokens = np.random.default_rng(0).integers(0, 1000, 16)
    name = prompt_cache._file_name(PromptCache._key(tokens))
    (folder / name).symlink_to(victim)                          # where the entry goes
    (folder / name).with_suffix(".tmp").symlink_to(victim)      # the temp name save() used to use
    pc, _ = _load(folder)           # the .kv symlink is refused at start (one warning), then saved over
    pc.store(tokens, _Cache(16, 0), 0)
    assert pc.save() == 1
    assert victim.read_bytes() == b"precious"
    assert (folder / name).is_file() and not (folder / name).is_symlink()
    again, lines = _load(folder)
    assert not lines and len(again.entries) == 1


def test_symlinks_are_refused_dangling_or_not(folder, tmp_path):
    path, _ = _save(folder)
    outside = tmp_path / "outside.kv"
    path.rename(outside)                            # a valid entry, MAC and all, but outside the folder
    (folder / "out.kv").symlink_to(outside)
    (folder / "passwd.kv").symlink_to("/etc/passwd")
    (folder / "dangling.kv").symlink_to(tmp_path / "nothing")
    pc, lines = _load(folder)
    assert not pc.entries
    _only_warnings(lines, "out.kv ignored: it is a symbolic link", "passwd.kv ignored: it is a symbolic link",
                   "dangling.kv ignored: it is a symbolic link")


def test_a_fifo_or_a_folder_named_kv_does_not_block(folder):
    _save(folder)
    os.mkfifo(folder / "fifo.kv")
    (folder / "dir.kv").mkdir()
    code = (f"from strata_compiler.runtime.prompt_cache import PromptCache; "
            f"pc = PromptCache({MAX_BYTES}, {PLAN!r}, {str(folder)!r}, shape={SHAPE}); print(len(pc.entries))")
    r = run_python(code).check()
    assert r.rc == 0 and r.stdout.strip() == "1"
    _only_warnings(r.stderr.splitlines(), "fifo.kv ignored: it is not a regular file",
                   "dir.kv ignored: it is not a regular file")


def _forge(path: Path, key: bytes, version: int = VERSION) -> None:
    """Rewrite an entry as one who can read plan.bin but not the folder's key would: same header,
    different KV, its MAC under `key`."""
    raw = path.read_bytes()
    (hl,) = struct.unpack("<I", raw[8:12])
    head = json.loads(raw[12:12 + hl])
    head["version"] = version
    payload = bytearray(raw[12 + hl:-32])
    payload[-64:] = bytes(64)                       # the last values of the last layer: zeros
    h = json.dumps(head).encode()
    body = MAGIC + struct.pack("<I", len(h)) + h + bytes(payload)
    path.write_bytes(body + hmac.new(key, body, hashlib.sha256).digest())


def test_a_forged_entry_is_refused(folder):
    path, _ = _save(folder, seed=1)
    _forge(path, bytes(32))
    other, _ = _save(folder, seed=2)
    raw = other.read_bytes()                        # as format 1 wrote it: a bare SHA-256 of the payload, no MAC
    (hl,) = struct.unpack("<I", raw[8:12])
    payload = raw[12 + hl:-32]
    head = {**json.loads(raw[12:12 + hl]), "version": 1, "sha256": hashlib.sha256(payload).hexdigest()}
    h = json.dumps(head).encode()
    (folder / "v1.kv").write_bytes(MAGIC + struct.pack("<I", len(h)) + h + payload)
    pc, lines = _load(folder)
    assert len(pc.entries) == 1
    _only_warnings(lines, f"{path.name} ignored: its MAC does not verify", "v1.kv ignored: format version 1")


def test_another_plans_entries_are_skipped_quietly(folder):
    _save(folder)
    pc, lines = _load(folder, plan=hashlib.sha256(b"another plan.bin").hexdigest())
    assert not pc.entries and not lines


@pytest.mark.parametrize("header", [b"[" * 60_000, b"[" * 4000, b'{"version": 1e400}', b"\xff\xfe{}", b"null",
                                    b'{"version": 2.0}', b'{"version": true}'])
def test_a_hostile_header_is_one_warning(folder, header):
    _save(folder)
    (folder / "bad.kv").write_bytes(MAGIC + struct.pack("<I", len(header)) + header)
    code = (f"import sys; sys.setrecursionlimit(100_000); "      # deeper than the default: no luck from it
            f"from strata_compiler.runtime.prompt_cache import PromptCache; "
            f"pc = PromptCache({MAX_BYTES}, {PLAN!r}, {str(folder)!r}, shape={SHAPE}); print(len(pc.entries))")
    r = run_python(code).check()
    assert r.rc == 0 and r.stdout.strip() == "1", r.stderr
    _only_warnings(r.stderr.splitlines(), "bad.kv ignored: ")


def test_a_huge_claimed_entry_is_not_read(folder):
    _save(folder)
    n = (1 << 24) - 1                               # ~2.3 GB claimed, the file sparse and of that size
    head = json.dumps({"version": VERSION, "plan": PLAN, "n": n, "layers": 2, "kv_heads": 2, "head_dim": 4}).encode()
    big = folder / "big.kv"
    big.write_bytes(MAGIC + struct.pack("<I", len(head)) + head)
    os.truncate(big, 12 + len(head) + 8 * n + 2 * 2 * 2 * n * 4 * 4 + 32)
    code = (f"from strata_compiler.runtime.prompt_cache import PromptCache; "
            f"pc = PromptCache({MAX_BYTES}, {PLAN!r}, {str(folder)!r}, shape={SHAPE}); print(len(pc.entries))")
    r = run_python(code).check()
    assert r.rc == 0 and r.stdout.strip() == "1" and not r.stderr
    assert not big.exists()         # larger than the whole cache: evicted, as an entry read would be


def test_files_and_bytes_read_at_start_are_bounded(folder, monkeypatch):
    files = [_save(folder, seed=i)[0] for i in range(3)]
    for i, f in enumerate(files):                   # oldest first
        os.utime(f, (1000 + i, 1000 + i))
    per = files[0].stat().st_size
    pc, lines = _load(folder, max_bytes=2 * per)    # room for two payloads: the newest two
    assert not lines and len(pc.entries) == 2 and not files[0].exists() and files[1].exists()
    assert pc.bytes <= pc.max_bytes
    monkeypatch.setattr(prompt_cache, "MAX_FILES", 4)
    for i in range(5):
        (folder / f"junk{i}.kv").write_bytes(b"junk")
    pc, lines = _load(folder)
    assert sum("holds more than 4 *.kv files" in line for line in lines) == 1 and len(lines) <= 5
    assert sum("bad magic" in line for line in lines) == len(lines) - 1


# ------------------------------------------------------------------------------------------------
# fuzzing: structure-aware mutations of one valid entry


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> tuple[Path, bytes]:
    folder = tmp_path_factory.mktemp("fuzz") / "kv"
    path, _ = _save(folder)
    raw = path.read_bytes()
    path.unlink()
    return folder, raw


_JUNK = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(), st.text(max_size=8),
                  st.lists(st.integers(0, 9), max_size=3),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
                  st.sampled_from([0, 1, 2, 4, 16, 15, 17, (1 << 24) - 1, 1 << 24, 1 << 40, 2.0, "16",
                                   PLAN, PLAN[:-1]]))


@st.composite
def _mutated(draw, raw: bytes) -> bytes:
    (hl,) = struct.unpack("<I", raw[8:12])
    head, rest = json.loads(raw[12:12 + hl]), raw[12 + hl:]
    kind = draw(st.sampled_from(["field", "drop", "truncate", "flip", "length", "append", "payload"]))
    if kind in ("field", "drop"):
        name = draw(st.sampled_from(sorted(head) + ["extra"]))
        if kind == "drop":
            head.pop(name, None)
        else:
            head[name] = draw(_JUNK)
        h = json.dumps(head).encode()
        return MAGIC + struct.pack("<I", len(h)) + h + rest
    if kind == "truncate":
        return raw[:draw(st.integers(0, len(raw) - 1))]
    if kind == "flip":
        out = bytearray(raw)
        flips = st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 7)), min_size=1, max_size=8)
        for pos, bit in draw(flips):
            out[pos] ^= 1 << bit
        return bytes(out)
    if kind == "length":
        return raw[:8] + struct.pack("<I", draw(st.integers(0, (1 << 32) - 1))) + raw[12:]
    if kind == "append":
        return raw + draw(st.binary(min_size=1, max_size=64))
    start = draw(st.integers(12 + hl, len(raw) - 1))        # payload or MAC bytes replaced, the header kept
    junk = draw(st.binary(min_size=1, max_size=len(raw) - start))
    return raw[:start] + junk + raw[start + len(junk):]


def _another_plans(raw: bytes) -> bool:
    """Whether `raw` reads as an entry of another plan (skipped without a word)."""
    try:
        (hl,) = struct.unpack("<I", raw[8:12])
        head = json.loads(raw[12:12 + hl].decode())
    except (ValueError, struct.error, RecursionError):
        return False
    return (isinstance(head, dict) and type(head.get("version")) is int and head["version"] == VERSION
            and head.get("plan") != PLAN)


@settings(max_examples=int(os.environ.get("STRATA_FUZZ_EXAMPLES", "400")), deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mutated_entry_is_one_warning_never_accepted(valid, data):
    folder, raw = valid
    bad = data.draw(_mutated(raw))
    path = folder / "entry.kv"
    path.write_bytes(bad)
    pc, lines = _load(folder)
    if bad == raw:
        assert not lines and len(pc.entries) == 1
        return
    assert not pc.entries, "a mutated entry was accepted"
    assert all(line.startswith(WARNING + str(path)) for line in lines), lines
    assert len(lines) == 1 or (not lines and _another_plans(bad)), lines
