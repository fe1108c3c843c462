"""`stratac eval`: KL divergence / top-1 / perplexity of a plan against a reference.

The demo Qwen3-MoE model (examples/make_demo_model.py, with its BPE tokenizer) is built once
per module and compiled at f32 and int4 on the reference backend; the text is the demo corpus.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from strata_compiler.cli import open_reference, stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.driver import compile_model
from strata_compiler.errors import UsageError
from strata_compiler.formats import get_format
from strata_compiler.pass_manager import CompileOptions
from strata_compiler.runtime.evaluate import REQUIRED_KEYS, evaluate, make_chunks, plan_tokenizer, weight_stats
from strata_compiler.runtime.plan import load_plan
from strata_compiler.runtime.session import Session

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "examples" / "demo_corpus.txt"
BIN = Path(sys.executable).parent
CTX = 32


def _demo_module():
    spec = importlib.util.spec_from_file_location("make_demo_model", ROOT / "examples" / "make_demo_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_demo_model", mod)
    spec.loader.exec_module(mod)
    return mod


def _compile(model: Path, out: Path, quant: str) -> Path:
    compile_model(model, out, CompileOptions(quant=quant, backend="reference"))
    return out


@dataclass(frozen=True)
class Built:
    model: Path        # demo model folder (bf16 safetensors, tokenizer.json)
    f32: Path          # its plan at f32
    int4: Path         # its plan at int4
    ids: np.ndarray    # the demo corpus tokenized with the plan's tokenizer


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    base = tmp_path_factory.mktemp("eval")
    model = Path(_demo_module().make_demo_model(base / "model", seed=0, quiet=True))
    f32 = _compile(model, base / "f32", "f32")
    int4 = _compile(model, base / "int4", "int4")
    tok = plan_tokenizer(load_plan(f32))
    ids = np.asarray(tok.encode(CORPUS.read_text(encoding="utf-8"), add_special_tokens=False).ids, np.int64)
    assert len(ids) >= 4 * CTX
    return Built(model, f32, int4, ids)


def cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = run_cli(stratac, ["eval", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------------------
# the numbers


def test_plan_against_itself(built):
    plan = load_plan(built.int4)
    r = evaluate(plan, load_plan(built.int4), built.ids, CTX, 3, "reference")
    assert abs(r["mean_kl"]) < 1e-9 and abs(r["p99_kl"]) < 1e-9 and abs(r["max_kl"]) < 1e-9
    assert r["top1"] == 1.0
    assert r["ppl"] == pytest.approx(r["ref_ppl"], rel=1e-12)
    assert np.isfinite(r["ppl"]) and r["ppl"] > 1.0
    assert r["tokens"] == 3 * (CTX - 1 - CTX // 2) and r["chunks"] == 3
    assert list(r)[:len(REQUIRED_KEYS)] == list(REQUIRED_KEYS)


def test_llvm_backend(built):
    from strata_compiler.backends import llvm_available

    if not llvm_available()[0]:
        pytest.skip(llvm_available()[1])
    plan = load_plan(built.int4)
    same = evaluate(plan, load_plan(built.int4), built.ids, CTX, 2, "llvm", batch=2)
    assert same["backend"] == "llvm"
    assert abs(same["mean_kl"]) < 1e-9 and same["top1"] == 1.0
    assert same["ppl"] == pytest.approx(same["ref_ppl"], rel=1e-9)
    r = evaluate(plan, load_plan(built.f32), built.ids, CTX, 2, "llvm", batch=2)
    assert r["mean_kl"] > 0 and np.isfinite(r["ppl"]) and r["top1"] > 0.5


def _independent(plan, ref, ids: np.ndarray, ctx: int, n_chunks: int) -> dict:
    """KL(ref || plan), top-1 and perplexities from one Session step per chunk, computed from
    scratch with softmax probabilities (not log-softmax) in float64."""
    s, rs = Session(plan, "reference"), Session(ref, "reference")
    kls, same, nll, rnll = [], [], [], []
    for c in range(n_chunks):
        chunk = ids[c * ctx:(c + 1) * ctx][None]
        out = []
        for sess in (s, rs):
            sess.reset(1, ctx)
            out.append(sess.step(chunk)[0].astype(np.float64))
        q_logits, p_logits = out
        for i in range(ctx // 2, ctx - 1):
            p = np.exp(p_logits[i] - p_logits[i].max())
            p /= p.sum()
            q = np.exp(q_logits[i] - q_logits[i].max())
            q /= q.sum()
            kls.append(float(np.sum(p * np.log(p / q))))
            same.append(np.argmax(p) == np.argmax(q))
            nll.append(-np.log(q[chunk[0, i + 1]]))
            rnll.append(-np.log(p[chunk[0, i + 1]]))
    return {"kl": np.array(kls), "top1": float(np.mean(same)), "ppl": float(np.exp(np.mean(nll))),
            "ref_ppl": float(np.exp(np.mean(rnll)))}


def test_int4_against_f32_model_folder(built, tmp_path, monkeypatch):
    # The model folder is compiled at f32 into a temporary directory that is gone afterwards.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    plan = load_plan(built.int4)
    with open_reference(built.model, "hf", "reference") as ref:
        assert ref.meta["options"]["quant"] == "f32"
        assert list(tmp_path.iterdir()), "the reference is compiled under the temporary directory"
        r = evaluate(plan, ref, built.ids, CTX, 3, "reference", batch=1)
        want = _independent(plan, ref, built.ids, CTX, 3)
    assert list(tmp_path.iterdir()) == []

    assert r["mean_kl"] > 0 and r["p99_kl"] >= r["mean_kl"]
    assert r["mean_kl"] == pytest.approx(want["kl"].mean(), rel=1e-6, abs=1e-12)
    assert r["p99_kl"] == pytest.approx(np.percentile(want["kl"], 99), rel=1e-6)
    assert r["tokens"] == len(want["kl"])
    assert 0.6 <= r["top1"] <= 1.0 and r["top1"] == pytest.approx(want["top1"])
    assert np.isfinite(r["ppl"]) and np.isfinite(r["ref_ppl"])
    assert r["ppl"] == pytest.approx(want["ppl"], rel=1e-6)
    assert r["ref_ppl"] == pytest.approx(want["ref_ppl"], rel=1e-6)
    # The reference is the model the plan quantizes: the distributions are close.
    assert r["mean_kl"] < 0.1 and abs(np.log(r["ppl"] / r["ref_ppl"])) < 0.1

    # Bits per weight: int4 linear layers (4.5 bits with f16 scales per 32) plus f32 embeddings,
    # norms and routers; the f32 reference is exactly 32.
    assert 4.5 < r["bits_per_weight"] < 32 and r["ref_bits_per_weight"] == 32.0
    nbytes = sum(get_format(w.fmt).nbytes(w.shape, w.group_size or 32) for w in plan.graph.weights)
    assert r["weight_bytes"] == nbytes
    assert r["weight_bytes"] < r["ref_weight_bytes"]


def test_weight_stats_count_stored_arrays(built):
    plan = load_plan(built.int4)
    nbytes, params = weight_stats(plan)
    stored = sum(a.nbytes for w in plan.graph.weights for a in plan.weights.arrays(w.name).values())
    assert nbytes == stored
    assert params == sum(int(np.prod(w.shape)) for w in plan.graph.weights)


def test_make_chunks():
    ids = np.arange(23)
    c = make_chunks(ids, 5)
    assert c.shape == (4, 5) and c[1].tolist() == [5, 6, 7, 8, 9]     # tail of 3 dropped
    assert make_chunks(ids, 5, chunks=2).shape == (2, 5)
    assert make_chunks(ids, 5, bos_id=99)[:, 0].tolist() == [99] * 4
    assert make_chunks(ids, 24).shape == (0, 24)


def test_batching_does_not_change_the_result(built):
    plan, ref = load_plan(built.int4), load_plan(built.f32)
    a = evaluate(plan, ref, built.ids, CTX, 3, "reference", batch=1)
    b = evaluate(plan, ref, built.ids, CTX, 3, "reference", batch=3)
    # One batch of 3 chunks runs other BLAS blockings than 3 batches of 1: equal to rounding.
    for k in ("mean_kl", "p99_kl", "ppl", "ref_ppl"):
        assert a[k] == pytest.approx(b[k], rel=1e-4), k
    assert a["tokens"] == b["tokens"] and a["top1"] == b["top1"]


# ------------------------------------------------------------------------------------------------
# the command


def test_cli_json(capsys, built):
    code, out, err = cli(capsys, built.int4, "--reference", built.f32, "--text", CORPUS, "--ctx", 32,
                         "--chunks", 2, "--backend", "reference", "--json")
    assert code == 0, err
    assert out.count("\n") == 1
    r = json.loads(out)
    assert list(r)[:8] == ["mean_kl", "p99_kl", "top1", "ppl", "ref_ppl", "tokens", "bits_per_weight", "weight_bytes"]
    assert r["tokens"] == 2 * (32 - 1 - 16) and r["ctx"] == 32 and r["chunks"] == 2
    direct = evaluate(load_plan(built.int4), load_plan(built.f32), built.ids, 32, 2, "reference")
    assert r["mean_kl"] == pytest.approx(direct["mean_kl"], rel=1e-9)
    assert r["ppl"] == pytest.approx(direct["ppl"], rel=1e-9)
    assert r["mean_kl"] > 0


def test_cli_table_against_model_folder(capsys, built):
    code, out, err = cli(capsys, built.int4, "--reference", built.model, "--text", CORPUS, "--ctx", 16,
                         "--chunks", 2, "--backend", "reference")
    assert code == 0, err
    for label in ("mean KL", "99% KL", "top-1", "PPL", "bits/weight", "compiled at f32"):
        assert label in out, out


def assert_one_line_error(result, *names: str) -> None:
    code, out, err = result
    assert code != 0, f"exit 0: {out!r}"
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in names:
        assert n in lines[0], (n, lines[0])
    assert out == ""


@pytest.fixture(scope="module")
def no_tokenizer_plan(built, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("eval_notok")
    model = Path(shutil.copytree(built.model, base / "model"))
    (model / "tokenizer.json").unlink()
    return _compile(model, base / "plan", "int8")


@pytest.fixture(scope="module")
def other_vocab(tmp_path_factory) -> tuple[Path, Path]:
    """A demo model whose tokenizer has 512 tokens (the demo's has ~1024), and its plan."""
    mod = _demo_module()
    train = mod.train_tokenizer
    mod.train_tokenizer = lambda: train(vocab_size=512)
    try:
        base = tmp_path_factory.mktemp("eval_vocab")
        model = Path(mod.make_demo_model(base / "model", seed=1, quiet=True))
    finally:
        mod.train_tokenizer = train
    return model, _compile(model, base / "plan", "f32")


def test_error_missing_text(capsys, built, tmp_path):
    missing = tmp_path / "nope.txt"
    assert_one_line_error(cli(capsys, built.int4, "--reference", built.f32, "--text", missing), "--text", str(missing))


def test_error_text_is_a_directory(capsys, built, tmp_path):
    assert_one_line_error(cli(capsys, built.int4, "--reference", built.f32, "--text", tmp_path), "--text", str(tmp_path))


@pytest.mark.parametrize("content", [b"", b"  \n\n"])
def test_error_empty_text(capsys, built, tmp_path, content):
    f = tmp_path / "empty.txt"
    f.write_bytes(content)
    assert_one_line_error(cli(capsys, built.int4, "--reference", built.f32, "--text", f), "--text", str(f), "empty")


def test_error_text_not_utf8(capsys, built, tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("café au lait ".encode("latin-1") * 100)
    assert_one_line_error(cli(capsys, built.int4, "--reference", built.f32, "--text", f), "--text", "UTF-8")


def test_error_text_shorter_than_one_chunk(capsys, built, tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("The keeper climbed the tower.", encoding="utf-8")
    assert_one_line_error(cli(capsys, built.int4, "--reference", built.f32, "--text", f, "--ctx", 64),
                          "--text", str(f), "--ctx 64")


@pytest.mark.parametrize("ctx", ["3", "0", "-8"])
def test_error_ctx_too_small(capsys, built, ctx):
    assert_one_line_error(cli(capsys, built.int4, "--reference", built.f32, "--text", CORPUS, "--ctx", ctx),
                          f"--ctx {ctx}")


def test_error_ctx_beyond_max_positions(capsys, built):
    assert_one_line_error(cli(capsys, built.int4, "--reference", built.f32, "--text", CORPUS, "--ctx", 4096),
                          "--ctx 4096", "2048")


def test_error_plan_without_tokenizer(capsys, built, no_tokenizer_plan):
    assert_one_line_error(cli(capsys, no_tokenizer_plan, "--reference", built.f32, "--text", CORPUS),
                          str(no_tokenizer_plan), "tokenizer")


def test_error_reference_missing(capsys, built, tmp_path):
    ref = tmp_path / "nothing"
    assert_one_line_error(cli(capsys, built.int4, "--reference", ref, "--text", CORPUS), "--reference", str(ref))


def test_error_reference_neither_model_nor_plan(capsys, built, tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    assert_one_line_error(cli(capsys, built.int4, "--reference", tmp_path, "--text", CORPUS),
                          "--reference", str(tmp_path), "config.json", "plan.bin")


def test_error_reference_file_not_a_plan(capsys, built):
    assert_one_line_error(cli(capsys, built.int4, "--reference", CORPUS, "--text", CORPUS), str(CORPUS))


def test_error_vocab_mismatch_plan(capsys, built, other_vocab):
    _, plan = other_vocab
    assert_one_line_error(cli(capsys, built.int4, "--reference", plan, "--text", CORPUS, "--ctx", 16,
                              "--backend", "reference"), "--reference", str(plan), "vocabulary")


def test_error_vocab_mismatch_model_folder(capsys, built, other_vocab, tmp_path, monkeypatch):
    model, _ = other_vocab
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert_one_line_error(cli(capsys, built.int4, "--reference", model, "--text", CORPUS, "--ctx", 16,
                              "--backend", "reference"), "--reference", str(model), "vocabulary")
    assert list(tmp_path.iterdir()) == []    # failed before compiling anything


def test_evaluate_vocab_mismatch(built, other_vocab):
    with pytest.raises(UsageError, match="vocabulary"):
        evaluate(load_plan(built.int4), load_plan(other_vocab[1]), built.ids, CTX, 1, "reference")


def test_error_subprocess(built, tmp_path):
    """The installed console script: one line, exit code 2, no traceback."""
    import subprocess

    f = tmp_path / "missing.txt"
    p = subprocess.run([str(BIN / "stratac"), "eval", str(built.int4), "--reference", str(built.f32),
                        "--text", str(f)], capture_output=True, text=True, timeout=120)
    assert_one_line_error((p.returncode, p.stdout, p.stderr), "--text", str(f))
    assert p.returncode == 2
