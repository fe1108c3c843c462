"""The sampling defaults (strata_compiler/sampling.py, docs/sampling.md): the caller's values over the
model's recommendation over llama.cpp's defaults, field by field; greedy stays the exact argmax;
generation_config.json and a GGUF's general.sampling.* keys are read and checked at compile time
into the plan, which `stratac compile` / `inspect`, `strata-run` (its help, its rates line) and the
run itself then use; a plain strata-run samples as the Python API and the server do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from strata_compiler.cli_common import run_cli
from strata_compiler.errors import ModelError, UsageError
from strata_compiler.frontend.generation import gguf_sampling, hf_sampling
from strata_compiler.sampling import DEFAULTS, Sampling, from_meta, resolve

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "models" / "tiny-moe"


def test_resolution_order_and_exact_greedy():
    assert resolve({}) == DEFAULTS == Sampling(0.8, 40, 0.95, 0.05, 1.1, 64)
    model = {"temperature": 0.6, "top_p": 0.9}
    assert resolve(model) == Sampling(0.6, 40, 0.9, 0.05, 1.1, 64)                   # the rest stays Strata's
    assert resolve(model, temperature=1.0, top_p=None) == Sampling(1.0, 40, 0.9, 0.05, 1.1, 64)
    assert resolve(model, top_k=-1).top_k == 0                                       # vLLM's "off"
    # greedy asked for: no penalty unless the caller names one
    assert resolve(model, temperature=0).repetition_penalty == 1.0
    assert resolve(model, temperature=0, repetition_penalty=1.3).repetition_penalty == 1.3
    # a model that recommends greedy gets its own penalty, not Strata's
    assert resolve({"temperature": 0.0}).repetition_penalty == 1.0
    assert resolve({"temperature": 0.0, "repetition_penalty": 1.2}).repetition_penalty == 1.2
    for bad in (dict(top_p=0), dict(temperature=-1), dict(min_p=2), dict(top_k=1.5), dict(repeat_last_n=-2),
                dict(temperature=float("nan")), dict(repetition_penalty=True)):
        with pytest.raises(UsageError):
            resolve({}, **bad)
    assert DEFAULTS.describe() == ("temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat penalty 1.1 over "
                                   "the last 64 tokens")
    assert resolve({}, temperature=0).describe() == "greedy"


def test_from_meta_checks_every_field():
    assert from_meta(None) == {}
    assert from_meta({"source": "GGUF general.sampling", "top_k": 20, "temperature": 1}) == \
        {"top_k": 20, "temperature": 1.0}
    for bad in ([1], {"top_p": 1.5}, {"top_k": "40"}, {"x": 1}, {"source": 3}, {"temperature": None},
                {"repeat_last_n": 2 ** 40}):
        with pytest.raises(ValueError):
            from_meta(bad)


def test_generation_config_is_read_and_checked(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": 2}))
    assert hf_sampling(tmp_path) == {"source": "generation_config.json", "temperature": 0.6, "top_p": 0.9,
                                     "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 2}))
    assert hf_sampling(tmp_path) is None        # transformers' own default written out: no recommendation
    for bad, field in (({"top_p": 0}, "top_p"), ({"temperature": "0.7"}, "temperature"),
                       ({"repetition_penalty": -1}, "repetition_penalty")):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ModelError, match=f"generation_config.json: field '{field}'"):
            hf_sampling(tmp_path)


def _gguf(path: Path, **keys) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for name, value in keys.items():
        getattr(w, f"add_sampling_{name}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_sampling_keys_are_read_in_llama_cpps_sense(tmp_path):
    from gguf import GGUFReader

    p = _gguf(tmp_path / "a.gguf", temp=0.7, top_k=-1, top_p=0.95, min_p=0.1, penalty_repeat=1.05,
              penalty_last_n=-1)
    assert gguf_sampling(p, GGUFReader(p)) == {"source": "GGUF general.sampling", "temperature": 0.7, "top_k": 0,
                                               "top_p": 0.95, "min_p": 0.1, "repetition_penalty": 1.05,
                                               "repeat_last_n": -1}
    p = _gguf(tmp_path / "b.gguf", temp=-1.0)
    assert gguf_sampling(p, GGUFReader(p)) == {"source": "GGUF general.sampling", "temperature": 0.0}
    assert gguf_sampling(p, GGUFReader(_gguf(tmp_path / "c.gguf"))) is None
    p = _gguf(tmp_path / "d.gguf", top_p=1.5)
    with pytest.raises(ModelError, match="general.sampling.top_p"):
        gguf_sampling(p, GGUFReader(p))


@pytest.fixture(scope="module")
def recommended_plan(tmp_path_factory) -> Path:
    """tiny-moe with a generation_config.json that recommends a temperature and a top-p, compiled."""
    from strata_compiler.cli import stratac

    src = tmp_path_factory.mktemp("model") / "tiny"
    shutil.copytree(TINY, src)
    gc = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps({**gc, "temperature": 0.6, "top_p": 0.9}))
    out = tmp_path_factory.mktemp("plan")
    assert run_cli(stratac, ["compile", str(src), "-o", str(out), "--quant", "int8"]) == 0
    return out


def test_compile_and_inspect_show_the_models_defaults(recommended_plan, capsys):
    from strata_compiler.cli import stratac
    from strata_compiler.runtime.plan import load_plan

    assert load_plan(recommended_plan).meta["sampling"] == {"source": "generation_config.json", "temperature": 0.6,
                                                           "top_p": 0.9}
    capsys.readouterr()
    assert run_cli(stratac, ["inspect", str(recommended_plan), "--no-weights"]) == 0
    out = capsys.readouterr().out
    assert ("default sampling: temperature 0.6, top-k 40, top-p 0.9, min-p 0.05, repeat penalty 1.1 over the last "
            "64 tokens, from the model's (generation_config.json: temperature, top_p); the rest Strata's "
            "defaults") in out


def test_strata_run_samples_with_the_plans_defaults(recommended_plan, tiny_int8_plan, tmp_path, capsys):
    from strata_compiler.runtime.cli import strata_run
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.sampler import Sampler
    from strata_compiler.runtime.session import Session

    ids = np.array([[5, 17, 240, 33]], np.int64)
    np.save(tmp_path / "ids.npy", ids)
    base = ["--input-ids", str(tmp_path / "ids.npy"), "-n", "12", "--ignore-eos", "--backend", "llvm",
            "--tokens-out", str(tmp_path / "t.npy")]
    for plan, want in ((recommended_plan, Sampling(temperature=0.6, top_p=0.9)), (tiny_int8_plan, DEFAULTS)):
        capsys.readouterr()
        assert run_cli(strata_run, [str(plan), *base, "--seed", "4"]) == 0
        assert capsys.readouterr().err.rstrip().endswith("; " + want.describe())
        _, new = Session(load_plan(plan), "llvm").generate(ids, 12, Sampler.of(want, 4))
        np.testing.assert_array_equal(np.load(tmp_path / "t.npy"), new)
    greedy = Session(load_plan(recommended_plan), "llvm").generate(ids, 12, Sampler())[1]
    for flag in (["--greedy"], ["--temperature", "0"]):
        assert run_cli(strata_run, [str(recommended_plan), *base, *flag]) == 0
        np.testing.assert_array_equal(np.load(tmp_path / "t.npy"), greedy)
        assert capsys.readouterr().err.rstrip().endswith("; greedy")
    assert run_cli(strata_run, [str(recommended_plan), *base, "--greedy", "--temperature", "0.5"]) == 2


def test_help_names_the_defaults(capsys):
    from strata_compiler.runtime.cli import strata_run

    assert run_cli(strata_run, ["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("the model's, else 0.8", "else 0.95", "else 40", "else 0.05", "else 1.1", "else 64",
                   "docs/sampling.md"):
        assert phrase in text, phrase
