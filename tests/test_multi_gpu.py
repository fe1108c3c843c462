"""Several GPUs (issue 8, first slice): plans spread over gpu:0..N-1 by layer or by striping each
layer's experts give the one-device plan's results. JAX's CPU platform stands in with four
devices (XLA_FLAGS must be set before JAX starts, so the runs happen in a child process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_models import build_model, clear_prompts, hf_greedy, hf_logits, load_model
from test_place import fake_profile

CHILD = r"""
import json, sys
import numpy as np
from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.passes import place
from strata_compiler.runtime.plan import load_plan
from strata_compiler.runtime.session import Session
import jax
place.PARTITION_S = 0.0
place.GPU_KERNEL_S = 0.0
model, hw, out, ids_path = sys.argv[1:5]
ids = np.load(ids_path)
res = {"devices": len(jax.devices("cpu"))}
for name, extra, multi in (("one", [], "mesh"), ("layer", ["--gpus", "2", "--gpu-mode", "layer"], "mesh"),
                           ("layer-swapped", None, "mesh"),
                           ("stripe", ["--gpus", "4", "--gpu-mode", "stripe"], "mesh"),
                           ("stripe-host", ["--gpus", "4", "--gpu-mode", "stripe"], "host")):
    p = f"{out}/{name}"
    if extra is None:
        p = f"{out}/layer"
    elif not multi == "host":
        assert run_cli(stratac, ["compile", model, "-o", p, "--target", hw, "--gpu-mem", "1GiB", *extra]) == 0
    else:
        p = f"{out}/stripe"
    plan = load_plan(p)
    if name == "layer-swapped":     # the same partitions, each on the other GPU
        from dataclasses import replace
        swap = {"gpu:0": "gpu:1", "gpu:1": "gpu:0"}
        plan = replace(plan, graph=plan.graph.with_(nodes=[replace(n, device=swap.get(n.device, n.device))
                                                           for n in plan.graph.nodes]))
    s = Session(plan, "auto", device="cpu", multi_gpu=multi)
    s.reset(1, 64)
    logits = s.step(ids)
    toks, last = [], logits[:, -1]
    for _ in range(8):
        t = int(last[0].argmax())
        toks.append(t)
        last = s.step(np.array([[t]], np.int64))[:, -1]
    np.save(f"{out}/{name}.npy", logits)
    res[name] = {"tokens": toks, "devices": sorted({n.device for n in plan.graph.nodes}),
                 "mesh": getattr(s.executor, "mesh", 0),
                 "executors": [type(e).__name__ for _, e, _ in getattr(s.executor, "parts", [])],
                 "first_gpu": next((str(e.device) for k, e, _ in getattr(s.executor, "parts", []) if k == "xla"), "")}
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multi_gpu")
    d = build_model("qwen3_moe", tmp / "model")
    m = load_model(d)
    ids = clear_prompts(m, m.config.vocab_size, n_prompts=1, length=6, n_new=8, seed=7)[0]
    np.save(tmp / "ids.npy", ids)
    hw = fake_profile(tmp / "hw.json")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", CHILD, str(d), str(hw), str(tmp), str(tmp / "ids.npy")],
                       capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), tmp, m, ids


@pytest.mark.parametrize("mode", ["layer", "stripe", "stripe-host"])
def test_spread_over_gpus_matches_one_gpu(runs, mode):
    res, tmp, m, ids = runs
    assert res["devices"] == 4
    gpus = [d for d in res[mode]["devices"] if d.startswith("gpu:")]
    assert len(gpus) >= 2, res[mode]["devices"]                 # really spread
    assert res["one"]["devices"] == ["gpu"] or "gpu" in res["one"]["devices"]
    assert res[mode]["tokens"] == res["one"]["tokens"] == [int(t) for t in hf_greedy(m, ids, 8)[0][0]]
    a, b = np.load(tmp / f"{mode}.npy"), np.load(tmp / "one.npy")
    assert np.abs(a - b).max() / b.std() <= 1e-5
    ref = hf_logits(m, ids)
    assert np.abs(a - ref).max() / ref.std() <= 1e-4


def test_same_kernels_on_the_other_gpu_give_bit_identical_logits(runs):
    """The layer plan with its two GPUs' partitions exchanged: the same computations on the other
    device, so the logits are bit-identical (and so are the tokens)."""
    res, tmp, m, ids = runs
    assert res["layer-swapped"]["devices"] == res["layer"]["devices"]
    assert res["layer-swapped"]["first_gpu"] != res["layer"]["first_gpu"]      # really on the other device
    np.testing.assert_array_equal(np.load(tmp / "layer-swapped.npy"), np.load(tmp / "layer.npy"))
    assert res["layer-swapped"]["tokens"] == res["layer"]["tokens"]


def test_gpu_mode_auto_prices_the_hops_between_gpus(tmp_path, monkeypatch):
    """--gpu-mode auto (the default) prices both modes: a layer split pays a host-driven switch
    per hop between GPUs; a stripe runs as one mesh, each GPU reading its share of the experts,
    and pays one all-reduce per layer. Which wins follows the all-reduce's price."""
    from strata_compiler.cli import stratac
    from strata_compiler.cli_common import run_cli
    from strata_compiler.passes import place
    from strata_compiler.runtime.plan import load_plan

    d = build_model("qwen3_moe", tmp_path / "model")
    hw = fake_profile(tmp_path / "hw.json")
    picks = {}
    for price in (1e-3, 0.0):
        monkeypatch.setattr(place, "ALLREDUCE_S", price)
        out = tmp_path / f"p{price}"
        assert run_cli(stratac, ["compile", str(d), "-o", str(out), "--target", str(hw), "--gpu-mem", "1GiB",
                                 "--gpus", "4"]) == 0
        plan = load_plan(out)
        pl = json.loads(plan.meta["model"]["placement"])
        modes = pl["gpu_modes"]
        assert set(modes) == {"layer", "stripe"} and pl["gpus"] == 4
        assert modes["layer"]["hops_per_token"] >= 1 and modes["stripe"]["hops_per_token"] >= 1
        assert len({n.device for n in plan.graph.nodes if n.device.startswith("gpu:")}) >= 2
        picks[price] = pl["gpu_mode"]
        best = max(modes, key=lambda m: modes[m]["predicted_tok_s"])
        assert pl["gpu_mode"] == best
    assert picks == {1e-3: "layer", 0.0: "stripe"}


def test_striped_plan_runs_as_one_sharded_computation(runs):
    """Stripe mode: the GPU partitions are one jitted function over a 4-device mesh (each layer's
    expert shares sharded, a psum joins them), not one partition per device driven from the host;
    its logits match the host-driven run's and the one-device plan's."""
    res, tmp, m, ids = runs
    assert res["stripe"]["mesh"] == 4 and res["stripe"]["executors"].count("MeshXLAExecutor") == 1
    assert res["stripe-host"]["mesh"] == 0 and "MeshXLAExecutor" not in res["stripe-host"]["executors"]
    assert res["stripe-host"]["executors"].count("XLAExecutor") > 4
    assert res["layer"]["mesh"] == 0                      # layer blocks stay a pipeline over the GPUs
    a, b = np.load(tmp / "stripe.npy"), np.load(tmp / "stripe-host.npy")
    assert np.abs(a - b).max() / b.std() <= 1e-5
