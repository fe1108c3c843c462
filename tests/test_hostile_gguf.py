"""Hostile GGUF files (issue 40): Strata's own GGUF parser (frontend/gguf_file.py) checks every count
and length against the file and its caps before allocating, the tokenizer rebuild is bounded, and
every `<arch>.*` size is checked against the tensors it sizes. Each finding is a case here, run as
`stratac compile FILE -o OUT` (or the reader) in a child under tests/limits.py's bar (10 s, 1 GiB
resident) where it was about time or memory: exit 1 and one last `error:` line naming the file and
the field. Then the qwen2moe shared-expert gate as llama.cpp writes it (1-D) against transformers,
and a structure-aware fuzz target: a small valid GGUF with counts, lengths, types, offsets, dims and
values changed or the file cut short is read, or refused with one ModelError, within 10 s.
"""

from __future__ import annotations

import os
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

from limits import run_limited, run_python  # noqa: E402
from strata_compiler.errors import ModelError  # noqa: E402
from strata_compiler.frontend.gguf_file import MAX_ARRAY, read_gguf  # noqa: E402
from strata_compiler.frontend.gguf_reader import open_gguf  # noqa: E402
from strata_compiler.frontend.gguf_tokenizer import MAX_TOKEN_BYTES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
D, F, H, E = 32, 64, 2, 4          # hidden (a Q8_0 block), FF, heads, experts
SPM_TOKENS = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "ab", "\u2581ab", "<0x41>"]
SPM_TYPES = [2, 3, 3, 1, 1, 1, 1, 1, 1, 6]
BPE_TOKENS = ["a", "b", "c", "\u0120", "ab", "\u0120a", "abc", "<|im_end|>"]
BPE_MERGES = ["a b", "\u0120 a", "ab c"]
U32, U64 = struct.Struct("<I"), struct.Struct("<Q")


# ------------------------------------------------------------------------------------------------
# tiny GGUF files: a llama with a SentencePiece vocabulary, a qwen2moe with a BPE one


def _put(w, key: str, v) -> None:
    if isinstance(v, bool):
        w.add_bool(key, v)
    elif isinstance(v, int):
        w.add_uint32(key, v)
    elif isinstance(v, float):
        w.add_float32(key, v)
    elif isinstance(v, str):
        w.add_string(key, v)
    else:
        w.add_array(key, v)


def tiny_gguf(path: Path, arch: str = "llama", *, layers: int = 1, meta: dict | None = None,
              drop: tuple[str, ...] = (), tokens: list | None = None, seed: int = 0, q8: bool = False,
              shexp_1d: bool = True) -> Path:
    """A small random model as llama.cpp lays it out; `meta` overrides or adds metadata (None values
    are left out), `drop` leaves tensors out."""
    rng = np.random.default_rng(seed)
    spm = arch == "llama"
    tokens = tokens if tokens is not None else list(SPM_TOKENS if spm else BPE_TOKENS)
    V = len(tokens)
    m = {f"{arch}.block_count": layers, f"{arch}.context_length": 64, f"{arch}.embedding_length": D,
         f"{arch}.feed_forward_length": F, f"{arch}.attention.head_count": H, f"{arch}.attention.head_count_kv": H,
         f"{arch}.rope.freq_base": 10000.0, f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
         f"{arch}.vocab_size": V, "tokenizer.ggml.tokens": tokens}
    if spm:
        m.update({"tokenizer.ggml.model": "llama", "tokenizer.ggml.scores": [-float(i) for i in range(V)],
                  "tokenizer.ggml.token_type": (SPM_TYPES + [1] * V)[:V], "tokenizer.ggml.bos_token_id": 1,
                  "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
                  "tokenizer.chat_template": "{{ messages[0]['content'] }}", "general.sampling.temp": 0.7})
    else:
        m.update({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.merges": BPE_MERGES,
                  "tokenizer.ggml.eos_token_id": V - 1, f"{arch}.expert_count": E, f"{arch}.expert_used_count": 2,
                  f"{arch}.expert_feed_forward_length": F // 2, f"{arch}.expert_shared_feed_forward_length": F})
    m.update(meta or {})
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,), "output.weight": (V, D)}
    for i in range(layers):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": (D,), b + "ffn_norm.weight": (D,), b + "attn_q.weight": (D, D),
                       b + "attn_k.weight": (D, D), b + "attn_v.weight": (D, D), b + "attn_output.weight": (D, D)})
        if spm:
            shapes.update({b + "ffn_gate.weight": (F, D), b + "ffn_up.weight": (F, D), b + "ffn_down.weight": (D, F)})
        else:
            fe = F // 2
            shapes.update({b + "ffn_gate_exps.weight": (E, fe, D), b + "ffn_up_exps.weight": (E, fe, D),
                           b + "ffn_down_exps.weight": (E, D, fe), b + "ffn_gate_inp.weight": (E, D),
                           b + "ffn_gate_inp_shexp.weight": (D,) if shexp_1d else (1, D),
                           b + "ffn_gate_shexp.weight": (F, D), b + "ffn_up_shexp.weight": (F, D),
                           b + "ffn_down_shexp.weight": (D, F)})
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in m.items():
        if v is not None:
            _put(w, k, v)
    for name, shape in shapes.items():
        if name in drop:
            continue
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if q8 and name.endswith("attn_v.weight"):
            w.add_tensor(name, gguf.quants.quantize(a, QT.Q8_0), raw_dtype=QT.Q8_0)
        elif not spm and "_exps" in name:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def raw_gguf(path: Path, *kvs: bytes, n_kv: int | None = None, n_tensors: int = 0, version: int = 3) -> Path:
    """A GGUF of these raw metadata entries (and nothing else), its counts as given."""
    path.write_bytes(b"GGUF" + U32.pack(version) + U64.pack(n_tensors) + U64.pack(len(kvs) if n_kv is None else n_kv)
                     + b"".join(kvs))
    return path


def s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return U64.pack(len(b)) + b


def kv_array(key: str, item_type: int, count: int, items: bytes) -> bytes:
    return s(key) + U32.pack(9) + U32.pack(item_type) + U64.pack(count) + items


def compile_child(path: Path, tmp: Path, **kw):
    return run_limited([sys.executable, "-m", "strata_compiler.cli", "compile", path, "-o", tmp / "out"], **kw)


def assert_refused(r, path: Path, *names: str) -> str:
    r.check()
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    assert r.rc == 1 and last.startswith("error:") and "Traceback" not in r.stderr, r.stderr[-800:]
    assert str(path) in last and all(n in last for n in names), last
    return last


# ------------------------------------------------------------------------------------------------
# the findings: memory and time bounded before anything is allocated


@pytest.mark.parametrize("count,items", [(1 << 40, b"\0" * 64), (MAX_ARRAY, b"\0" * 64)], ids=["2^40", "2^20"])
def test_int_array_claiming_more_than_the_file_is_refused_at_once(tmp_path, count, items):
    path = raw_gguf(tmp_path / "ints.gguf", kv_array("tokenizer.ggml.token_type", 5, count, items))
    assert_refused(compile_child(path, tmp_path), path, "tokenizer.ggml.token_type")


def test_three_million_strings_are_refused_by_the_cap(tmp_path):
    # 3M strings of 1 byte: 27 MB on disk, ~3.9 GB in gguf's reader
    items = (U64.pack(1) + b"x") * 3_000_000
    path = raw_gguf(tmp_path / "strings.gguf", kv_array("tokenizer.ggml.tokens", 8, 3_000_000, items))
    line = assert_refused(compile_child(path, tmp_path), path, "tokenizer.ggml.tokens", str(MAX_ARRAY))
    assert "3000000" in line
    short = raw_gguf(tmp_path / "claims.gguf", kv_array("tokenizer.ggml.tokens", 8, 3_000_000, items[:900]))
    assert_refused(compile_child(short, tmp_path), short, "tokenizer.ggml.tokens", "3000000")


def test_a_million_token_vocabulary_reads_in_little_memory(tmp_path):
    """A vocabulary at the cap (2^20 tokens of a few characters, like real ones) with its types and
    scores: read within the bar, in ~180 bytes a token for all three (CPython's str alone is ~90 for
    "\u2581t123456"; gguf's reader took 1.4 KB and 16 s for the tokens alone)."""
    n = MAX_ARRAY
    toks = [f"\u2581t{i}".encode() for i in range(n)]
    path = raw_gguf(tmp_path / "vocab.gguf", kv_array("tokenizer.ggml.tokens", 8, n, b"".join(map(s, toks))),
                    kv_array("tokenizer.ggml.token_type", 5, n, np.ones(n, "<i4").tobytes()),
                    kv_array("tokenizer.ggml.scores", 6, n, np.zeros(n, "<f4").tobytes()))
    # /proc's VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's (pytest's) peak
    code = ("from pathlib import Path; import gguf.constants\n"
            "from strata_compiler.frontend.gguf_file import read_gguf\n"
            "def vm(k): return int(next(l.split()[1] for l in open('/proc/self/status') if l.startswith(k))) * 1024\n"
            f"base = vm('VmRSS:'); m = read_gguf(Path({str(path)!r})).metadata\n"
            f"assert len(m['tokenizer.ggml.tokens']) == len(m['tokenizer.ggml.scores']) == {n}\n"
            "print(vm('VmHWM:') - base)")
    r = run_python(code, cwd=ROOT).check()
    assert r.rc == 0, r.stderr[-800:]
    per_token = int(r.stdout.split()[-1]) / n
    print(f"1M-token vocabulary: {per_token:.0f} bytes per token (tokens, types and scores), {r.seconds:.1f} s")
    assert per_token < 256


def test_a_megabyte_sentencepiece_token_is_refused_at_once(tmp_path):
    tokens = SPM_TOKENS + ["\u2581" + "a" * 999_999]     # 1M characters: the merge search ran for minutes
    path = tiny_gguf(tmp_path / "long.gguf", tokens=tokens)
    assert_refused(compile_child(path, tmp_path), path, "tokenizer.ggml.tokens", f"item {len(SPM_TOKENS)}",
                   str(MAX_TOKEN_BYTES))


def test_quadratic_sentencepiece_merges_are_bounded(tmp_path):
    """Pieces a, aa, ..., a^1000: every split of each is a merge (~500k merges, ~330M characters)."""
    tokens = SPM_TOKENS + ["a" * k for k in range(2, 1001)]
    path = tiny_gguf(tmp_path / "merges.gguf", tokens=tokens)
    assert_refused(compile_child(path, tmp_path), path, "tokenizer.ggml.tokens", "merges")


@pytest.mark.parametrize("key", ["tokenizer.ggml.token_type", "tokenizer.ggml.scores"])
def test_a_short_token_type_or_scores_array_is_one_line(tmp_path, key):
    short = {"tokenizer.ggml.token_type": SPM_TYPES[:5], "tokenizer.ggml.scores": [0.0] * 5}[key]
    path = tiny_gguf(tmp_path / "short.gguf", meta={key: short})
    assert_refused(compile_child(path, tmp_path), path, key, "5 items", f"{len(SPM_TOKENS)} tokens")


def test_block_count_below_the_layers_present_is_refused(tmp_path):
    path = tiny_gguf(tmp_path / "layers.gguf", layers=2, meta={"llama.block_count": 1})
    assert_refused(compile_child(path, tmp_path), path, "llama.block_count", "blk.1.")


# ------------------------------------------------------------------------------------------------
# every architecture key against the tensors it sizes


@pytest.mark.parametrize("arch,meta,drop,names", [
    ("llama", {"llama.block_count": 2}, (), ("llama.block_count", "layer 1")),
    ("llama", {"llama.embedding_length": 64}, (), ("llama.embedding_length is 64", "token_embd.weight")),
    ("llama", {"llama.attention.head_count": 4, "llama.attention.key_length": 16, "llama.attention.value_length": 16,
               "llama.rope.dimension_count": 16}, (), ("llama.attention.head_count 4", "blk.0.attn_q.weight")),
    ("llama", {"llama.attention.head_count_kv": 1}, (), ("llama.attention.head_count_kv 1", "blk.0.attn_k.weight")),
    ("llama", {"llama.feed_forward_length": 48}, (), ("llama.feed_forward_length is 48", "blk.0.ffn_gate.weight")),
    ("llama", {"llama.vocab_size": 11}, (), ("llama.vocab_size is 11", "token_embd.weight")),
    ("llama", {"llama.vocab_size": None, "tokenizer.ggml.tokens": SPM_TOKENS + ["x"],
               "tokenizer.ggml.scores": [0.0] * 11, "tokenizer.ggml.token_type": [1] * 11},
     (), ("tokenizer.ggml.tokens holds 11", "token_embd.weight")),
    ("llama", {}, ("blk.0.attn_v.weight",), ("blk.0.attn_v.weight is missing",)),
    ("qwen2moe", {"qwen2moe.expert_count": 3}, (), ("qwen2moe.expert_count is 3", "blk.0.ffn_gate_exps.weight")),
    ("qwen2moe", {"qwen2moe.expert_feed_forward_length": 16}, (),
     ("qwen2moe.expert_feed_forward_length is 16", "blk.0.ffn_gate_exps.weight")),
    ("qwen2moe", {"qwen2moe.expert_shared_feed_forward_length": 16}, (),
     ("qwen2moe.expert_shared_feed_forward_length is 16", "blk.0.ffn_gate_shexp.weight")),
    ("qwen2moe", {}, ("blk.0.ffn_up_shexp.weight",), ("blk.0.ffn_up_shexp.weight is missing",)),
])
def test_metadata_disagreeing_with_the_tensors_is_one_error(tmp_path, arch, meta, drop, names):
    path = tiny_gguf(tmp_path / "m.gguf", arch, meta=meta, drop=drop)
    with pytest.raises(ModelError) as e:
        open_gguf(path)
    assert str(path) in str(e.value) and all(n in str(e.value) for n in names), str(e.value)


def test_the_tiny_files_read(tmp_path):
    for arch in ("llama", "qwen2moe"):
        store, cfg, tok = open_gguf(tiny_gguf(tmp_path / f"{arch}.gguf", arch, layers=2, q8=True))
        assert cfg.n_layers == 2 and tok is not None
        for key in store.infos:
            assert all(np.isfinite(b).all() for b in store.iter_row_blocks(key))


@pytest.mark.parametrize("data,what", [
    (b"GGUF" + U32.pack(1) + bytes(16), "version 1"),
    (b"GGUF" + struct.pack(">I", 3) + bytes(16), "big-endian"),
    (b"GGUF" + U32.pack(3) + U64.pack(1 << 40) + U64.pack(0), "tensor count"),
    (b"GGUF" + U32.pack(3) + U64.pack(0) + U64.pack(1 << 40), "metadata count"),
    (b"GGUF" + U32.pack(3) + U64.pack(0) + U64.pack(1) + s("k") + U32.pack(13) + bytes(8), "value type 13"),
    (b"GGUF" + U32.pack(3) + U64.pack(0) + U64.pack(1) + kv_array("k", 9, 1, bytes(16)), "array of arrays"),
    (b"GGUF" + U32.pack(3) + U64.pack(0) + U64.pack(1) + s("k") + U32.pack(8) + U64.pack(1 << 62), "'k'"),
    (b"GGUF" + U32.pack(3) + U64.pack(0) + U64.pack(1) + s("x" * 300) + U32.pack(4) + bytes(4), "300 bytes"),
    (b"GGUF" + U32.pack(3) + U64.pack(0) + U64.pack(1) + s("general.alignment") + U32.pack(4) + U32.pack(48),
     "general.alignment"),
    (b"GGUF" + U32.pack(3) + U64.pack(1) + U64.pack(0) + s("t") + U32.pack(2) + U64.pack(1 << 32) * 2
     + U32.pack(0) + U64.pack(0), "tensor t"),
])
def test_header_level_corruption_is_one_model_error(tmp_path, data, what):
    path = tmp_path / "h.gguf"
    path.write_bytes(data + bytes(64))
    with pytest.raises(ModelError, match="h.gguf") as e:
        read_gguf(path)
    assert what in str(e.value) and "\n" not in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------------------
# qwen2moe's shared-expert gate as llama.cpp writes it: [n_embd], HF's [1, hidden]


def test_qwen2moe_1d_shared_expert_gate_matches_transformers(tmp_path):
    pytest.importorskip("torch")
    from safetensors.numpy import load_file, save_file

    from hf_models import build_model, clear_prompts, hf_greedy, hf_logits, load_model
    from test_gguf_frontend import N_NEW, compile_ok, run_logits, train_tokenizer
    from test_gguf_moe import write_moe_gguf

    _, tokens, merges = train_tokenizer()
    hf = build_model("qwen2_moe", tmp_path / "hf", vocab_size=len(tokens), seed=7)
    flat = tmp_path / "hf_1d"       # the same checkpoint with each gate [hidden], as the GGUF will hold it
    flat.mkdir()
    (flat / "config.json").write_text((hf / "config.json").read_text())
    sd = load_file(str(hf / "model.safetensors"))
    gates = [k for k in sd if k.endswith("shared_expert_gate.weight")]
    assert gates and all(sd[k].shape[0] == 1 for k in gates)
    save_file({k: np.ascontiguousarray(v.reshape(-1) if k in gates else v) for k, v in sd.items()},
              str(flat / "model.safetensors"))
    path = tmp_path / "q.gguf"
    write_moe_gguf(path, flat, "qwen2_moe", tokens, merges)
    shapes = [t.shape for n, t in read_gguf(path).tensors.items() if n.endswith("ffn_gate_inp_shexp.weight")]
    assert len(shapes) == len(gates) and all(len(sh) == 1 for sh in shapes), shapes
    m = load_model(hf)
    ids = clear_prompts(m, m.config.vocab_size, n_prompts=1, length=7, n_new=N_NEW, batch=2)[0]
    logits, out = run_logits(compile_ok(path, tmp_path / "plan", "--quant", "f32"), ids, tmp_path, "reference")
    ref = hf_logits(m, ids)
    assert np.abs(logits - ref).max() / ref.std() <= 1e-4
    np.testing.assert_array_equal(out, hf_greedy(m, ids, N_NEW)[0])


# ------------------------------------------------------------------------------------------------
# fuzz: structure-aware mutations of small valid files

_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def structure(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of every count, length, type, dimension, offset and integer value of a valid GGUF."""
    out, pos = [(4, 4), (8, 8), (16, 8)], 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def field(width: int) -> int:
        nonlocal pos
        out.append((pos, width))
        v = int.from_bytes(data[pos:pos + width], "little")
        pos += width
        return v

    def skip_string() -> None:
        nonlocal pos
        n = field(8)
        pos += n

    def value(t: int) -> None:
        nonlocal pos
        if t == 8:
            skip_string()
        elif t == 9:
            item, count = field(4), field(8)
            for _ in range(min(count, 4)):
                value(item)
            for _ in range(count - min(count, 4)):       # the rest skipped, not listed
                pos += 8 + U64.unpack_from(data, pos)[0] if item == 8 else _SCALAR_SIZE[item]
        elif t in (4, 5, 10, 11):
            field(_SCALAR_SIZE[t])
        else:
            pos += _SCALAR_SIZE[t]

    for _ in range(n_kv):
        skip_string()
        value(field(4))
    for _ in range(n_tensors):
        skip_string()
        for _ in range(field(4)):
            field(8)
        field(4)
        field(8)
    return out


def _interesting(width: int, current: int) -> list[int]:
    top = (1 << (8 * width)) - 1
    near = [current + d for d in (-32, -8, -1, 1, 8, 32) if 0 <= current + d <= top]
    return near + [0, 1, 2, 3, 4, 9, 31, 32, 33, 255, 1 << 16, 1 << 20, (1 << 20) + 1, (1 << 31) - 1, top, top >> 1,
                   min(top, 1 << 40)]


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> list[tuple[bytes, list]]:
    d = tmp_path_factory.mktemp("fuzz_bases")
    files = [tiny_gguf(d / "llama.gguf", layers=2, q8=True), tiny_gguf(d / "qwen2moe.gguf", "qwen2moe")]
    return [(p.read_bytes(), structure(p.read_bytes())) for p in files]


def mutate(data: bytes, fields: list, draw) -> bytes:
    """1-3 of: a structural field set to an interesting or random value, a byte changed, the file cut."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3), label="mutations")):
        how = draw(st.sampled_from(["field", "field", "field", "byte", "cut"]), label="how")
        if how == "field":
            at, width = fields[draw(st.integers(0, len(fields) - 1), label="field")]
            current = int.from_bytes(data[at:at + width], "little")
            data[at:at + width] = draw(st.one_of(st.sampled_from(_interesting(width, current)),
                                                 st.integers(0, (1 << (8 * width)) - 1)), label="value"
                                       ).to_bytes(width, "little")
        elif how == "byte":
            data[draw(st.integers(0, len(data) - 1), label="at")] = draw(st.integers(0, 255), label="byte")
        else:
            del data[draw(st.integers(4, len(data) - 1), label="cut at"):]
            break       # fields past the cut are gone
    return bytes(data)


def test_fuzz_reader_reads_or_refuses_in_one_line(bases, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "f.gguf"

    @settings(max_examples=int(os.environ.get("STRATA_FUZZ_EXAMPLES", "300")), deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def read_or_refuse(data):
        path.write_bytes(mutate(*bases[data.draw(st.integers(0, len(bases) - 1), label="base")], data.draw))
        t0 = time.monotonic()
        try:
            store = open_gguf(path, with_chat=True)[0]
            for key in store.infos:
                for _ in store.iter_row_blocks(key):
                    pass
        except ModelError as e:
            assert "\n" not in str(e) and str(path) in str(e), str(e)
        assert time.monotonic() - t0 < 10

    read_or_refuse()
