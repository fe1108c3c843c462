"""passes/calibrate.py: the calibration probe (--calib) and importance-weighted quantization."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.runtime.plan import load_plan

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "examples" / "demo_corpus.txt").read_text()[:6000]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_demo_model", ROOT / "examples" / "make_demo_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_demo_model", mod)
    spec.loader.exec_module(mod)
    d = Path(mod.make_demo_model(tmp_path_factory.mktemp("demo"), seed=0, quiet=True))
    calib = d.parent / "calib.txt"
    calib.write_text(TEXT)
    return d, calib


def _compile(src, out, *extra):
    assert run_cli(stratac, ["compile", str(src), "-o", str(out), *extra]) == 0
    return load_plan(out)


def test_calibration_recorded_in_plan(demo, tmp_path):
    d, calib = demo
    plan = _compile(d, tmp_path / "p", "--quant", "int4", "--calib", str(calib), "--calib-tokens", "300")
    cfg = json.loads((d / "config.json").read_text())
    c = plan.meta["calibration"]
    assert c["tokens"] == 300 and c["file"] == "calib.txt"
    experts = c["experts"]
    assert len(experts) == cfg["num_hidden_layers"]
    for layer in experts.values():
        # every token picks top_k experts: frequencies sum to top_k; weights are in (0, 1]
        assert sum(layer["freq"]) == pytest.approx(cfg["num_experts_per_tok"])
        assert all(0 <= w <= 1 for w in layer["mean_weight"])
    # every quantized weight has an importance vector of its input width ([E, K] for experts)
    quantized = [w for w in plan.graph.weights if w.fmt == "int4"]
    assert quantized and all(w.name in plan.imatrix for w in quantized)
    for w in quantized:
        imp = plan.imatrix[w.name]
        assert imp.shape == ((w.shape[0], w.shape[-1]) if w.experts else (w.shape[-1],))
        assert np.isfinite(imp).all() and (imp >= 0).all() and imp.max() > 0


def test_first_layer_importance_is_mean_square_of_its_input(demo, tmp_path):
    """Independent check: layer 0's q/k/v input is rms_norm(embedding rows) * ln1."""
    d, calib = demo
    plan = _compile(d, tmp_path / "p", "--quant", "int8", "--calib", str(calib), "--calib-tokens", "200")
    cfg = json.loads((d / "config.json").read_text())
    t = load_file(str(d / "model.safetensors"))
    import ml_dtypes  # noqa: F401
    emb = t["model.embed_tokens.weight"].astype(np.float32)
    ln1 = t["model.layers.0.input_layernorm.weight"].astype(np.float32)
    ids = Tokenizer.from_file(str(d / "tokenizer.json")).encode(TEXT).ids[:200]
    x = emb[ids]
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg["rms_norm_eps"]) * ln1
    want = (x.astype(np.float64) ** 2).mean(0)
    name = next(w.name for w in plan.graph.weights if w.name.startswith("L0.") and "q_k_v" in w.name)
    np.testing.assert_allclose(plan.imatrix[name], want, rtol=1e-4)


def test_calibration_changes_quantized_weights_only(demo, tmp_path):
    d, calib = demo
    a = _compile(d, tmp_path / "a", "--quant", "int4")
    b = _compile(d, tmp_path / "b", "--quant", "int4", "--calib", str(calib), "--calib-tokens", "200")
    assert "calibration" not in a.meta and not a.imatrix
    changed = [w.name for w in a.graph.weights
               if not all(np.array_equal(a.weights.arrays(w.name)[k], b.weights.arrays(w.name)[k])
                          for k in a.weights.arrays(w.name))]
    assert changed and all(a.graph.weight(n).fmt == "int4" for n in changed)


def test_calibration_jsonl(demo, tmp_path):
    d, _ = demo
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps({"text": TEXT[i:i + 500]}) for i in range(0, 2000, 500)) + "\n")
    plan = _compile(d, tmp_path / "p", "--quant", "int4", "--calib", str(f), "--calib-tokens", "100")
    assert plan.meta["calibration"]["tokens"] == 100


@pytest.mark.parametrize("content,name,msg", [
    (None, "missing.txt", "no such file"),
    ("   \n", "empty.txt", "holds no text"),
    ('{"text": "ok"}\nnot json\n', "bad.jsonl", "bad.jsonl:2: not a JSON object"),
    ('{"txt": "x"}\n', "nofield.jsonl", 'needs a string "text" field'),
])
def test_bad_calibration_files(demo, tmp_path, capsys, content, name, msg):
    d, _ = demo
    f = tmp_path / name
    if content is not None:
        f.write_text(content)
    rc = run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "p"), "--quant", "int4", "--calib", str(f)])
    err = capsys.readouterr().err
    assert rc != 0 and msg in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p" / "plan.bin").exists()


def test_calibration_reused_from_a_plan(demo, tmp_path, capsys):
    """--calib PLAN.bin: the same importance and routing statistics, the same weights, no model run."""
    d, calib = demo
    first = _compile(d, tmp_path / "a", "--quant", "int4", "--calib", str(calib), "--calib-tokens", "200")
    again = _compile(d, tmp_path / "b", "--quant", "int4", "--calib", str(tmp_path / "a" / "plan.bin"))
    assert again.meta["calibration"]["tokens"] == 200
    for layer, st in first.meta["calibration"]["experts"].items():
        np.testing.assert_allclose(again.meta["calibration"]["experts"][layer]["freq"], st["freq"])
        np.testing.assert_allclose(again.meta["calibration"]["experts"][layer]["mean_weight"], st["mean_weight"])
    assert set(again.imatrix) == set(first.imatrix)
    for name, imp in first.imatrix.items():
        np.testing.assert_allclose(again.imatrix[name], imp, rtol=1e-6)
    assert (tmp_path / "a" / "weights.bin").read_bytes() == (tmp_path / "b" / "weights.bin").read_bytes()
    _compile(d, tmp_path / "plain", "--quant", "int4")
    assert run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "c"), "--calib",
                             str(tmp_path / "plain" / "plan.bin")]) != 0
    assert "without --calib" in capsys.readouterr().err


def test_reused_plan_donates_its_quantized_weights(demo, tmp_path, capsys, monkeypatch):
    """--calib PLAN.bin of the same checkpoint: emit copies the plan's arrays (whole weights, and
    a share's experts out of a whole layer) and the result is the bytes a fresh compile writes."""
    from test_place import budget_decides, fake_profile, gpu_mem_for, probe_placement

    budget_decides(monkeypatch)
    d, calib = demo
    hw = fake_profile(tmp_path / "hw.json")
    src = _compile(d, tmp_path / "a", "--quant", "int4", "--calib", str(calib), "--calib-tokens", "200")
    assert src.meta["source_hashes"]
    p = probe_placement(d, tmp_path, hw, "--quant", "int4")
    place = ["--target", str(hw), "--gpu-mem", str(gpu_mem_for(p, p["gpu_bytes"] * 0.5))]
    fresh = _compile(d, tmp_path / "fresh", "--quant", "int4", "--calib", str(calib), "--calib-tokens", "200", *place)
    assert any(w.expert_ids for w in fresh.graph.weights)          # the placement split a layer
    reuse = _compile(d, tmp_path / "reuse", "--quant", "int4", "--calib", str(tmp_path / "a" / "plan.bin"), *place)
    # the same placement and formats (the meta differs: no routing trace, so no expert clusters)
    assert reuse.graph.nodes == fresh.graph.nodes and reuse.graph.weights == fresh.graph.weights
    assert (tmp_path / "reuse" / "weights.bin").read_bytes() == (tmp_path / "fresh" / "weights.bin").read_bytes()
    # a plan of other weights is refused in one line
    other = tmp_path / "other"
    import shutil

    shutil.copytree(d, other)
    from safetensors.numpy import load_file, save_file

    t = load_file(str(other / "model.safetensors"))
    k = next(k for k in sorted(t) if k.endswith("down_proj.weight"))
    t[k] = t[k] * 2
    save_file(t, str(other / "model.safetensors"))
    assert run_cli(stratac, ["compile", str(other), "-o", str(tmp_path / "x"), "--calib",
                             str(tmp_path / "a" / "plan.bin")]) != 0
    assert "other weights" in capsys.readouterr().err


def test_no_imatrix_keeps_routing_but_plain_scales(demo, tmp_path, capsys):
    """--no-imatrix: the calibration (routing statistics) is recorded, the weights are the plain
    rule's bytes (as without --calib), and a plan reusing it quantizes the same way; with --bits
    it is refused in one line."""
    d, calib = demo
    plain = _compile(d, tmp_path / "plain", "--quant", "int4")
    p = _compile(d, tmp_path / "p", "--quant", "int4", "--calib", str(calib), "--calib-tokens", "200", "--no-imatrix")
    assert p.meta["calibration"]["tokens"] == 200 and p.meta["calibration"]["experts"]
    assert p.meta["options"]["imatrix"] is False and plain.meta["options"]["imatrix"] is True
    assert (tmp_path / "p" / "weights.bin").read_bytes() == (tmp_path / "plain" / "weights.bin").read_bytes()
    imat = _compile(d, tmp_path / "i", "--quant", "int4", "--calib", str(tmp_path / "p" / "plan.bin"))
    assert (tmp_path / "i" / "weights.bin").read_bytes() != (tmp_path / "p" / "weights.bin").read_bytes()
    assert run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "x"), "--bits", "4.5", "--calib", str(calib),
                             "--no-imatrix"]) != 0
    err = capsys.readouterr().err
    assert "--no-imatrix and --bits conflict" in err and len(err.strip().splitlines()) == 1
