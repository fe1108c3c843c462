"""runtime/disk_tier.py: experts the placement puts beyond --host-mem are released from the
process after use and read back from the file; results do not change."""

from __future__ import annotations

import json

import numpy as np

from hf_models import build_model
from strata_compiler.cli import stratac
from strata_compiler.cli_common import run_cli
from strata_compiler.runtime.plan import load_plan
from strata_compiler.runtime.session import Session
from test_place import fake_profile


def test_disk_tier_experts_give_identical_results(tmp_path):
    d = build_model("qwen3_moe", tmp_path / "model")
    hw = fake_profile(tmp_path / "hw.json")
    data = json.loads(hw.read_text())
    data["gpu"] = None                                   # a CPU-only machine with little RAM
    hw.write_text(json.dumps(data))
    assert run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "disk"), "--target", str(hw),
                             "--host-mem", "64KiB", "--dump-dir", str(tmp_path / "dump"), "--dump-after", "place"]) == 0
    assert run_cli(stratac, ["compile", str(d), "-o", str(tmp_path / "ram")]) == 0
    placement = json.loads((tmp_path / "dump" / "placement.json").read_text())
    assert placement["disk_units"] and placement["disk_bytes"] > 0
    ids = np.array([[3, 1, 4, 1, 5, 9]], np.int64)
    outs = []
    for p in ("disk", "ram"):
        s = Session(load_plan(tmp_path / p), "llvm")
        s.reset(1, 32)
        steps = [s.step(ids)[:, -1]] + [s.step(np.array([[t]], np.int64))[:, -1] for t in (2, 7, 1, 8)]
        outs.append(np.concatenate(steps))
        if p == "disk":
            assert s.disk is not None and s.disk.bytes > 0 and s.disk.ranges
    np.testing.assert_array_equal(outs[0], outs[1])
