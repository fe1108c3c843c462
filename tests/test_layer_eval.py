"""`stratac eval --per-layer` (runtime/layer_eval.py): a plan against itself is exact at every
layer; int4 against f32 errs from the first layer on, its per-layer KL shares add up to the plan's
own KL (the last row), the last layer's cumulative KL is that KL up to the final norm and head;
the CLI prints a table or JSON rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from test_evaluate import CORPUS, built, cli  # noqa: F401  (fixture)

from strata_compiler.runtime.layer_eval import layer_outputs, per_layer
from strata_compiler.runtime.plan import load_plan


def test_layer_outputs_one_per_layer(built):
    g = load_plan(built.int4).graph
    outs = layer_outputs(g)
    assert len(outs) == load_plan(built.int4).meta["model"]["n_layers"] and len(set(outs)) == len(outs)


def test_against_itself_and_against_f32(built):
    ids = built.ids[None, :24]
    same = per_layer(load_plan(built.int4), load_plan(built.int4), ids)
    assert all(r["max_err"] == 0 and abs(r["kl_upto"]) < 1e-12 for r in same)
    rows = per_layer(load_plan(built.int4), load_plan(built.f32), ids)
    layers, last = rows[:-1], rows[-1]
    assert last["layer"] == "logits" and last["kl_upto"] > 0
    assert all(r["max_err"] > 0 for r in layers)
    assert sum(r["kl_layer"] for r in rows) == pytest.approx(last["kl_upto"], rel=1e-9)


def test_cli(capsys, built):
    code, out, err = cli(capsys, built.int4, "--reference", built.f32, "--text", CORPUS, "--ctx", 16,
                         "--per-layer", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [r["layer"] for r in rows][-1] == "logits" and np.isfinite([r["kl_upto"] for r in rows]).all()
    code, out, err = cli(capsys, built.int4, "--reference", built.f32, "--text", CORPUS, "--ctx", 16, "--per-layer")
    assert code == 0 and out.splitlines()[0].startswith("layer") and len(out.splitlines()) == len(rows) + 1
