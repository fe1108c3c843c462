"""Several GPUs (issue 8): the OLMoE-shaped model on 1 and N GPUs, layer and stripe modes.

    python benchmarks/multi_gpu.py [--work-dir /tmp/multi_gpu] [--layers 16] [--gpus 1,2]
        [--n-new 48] [--prefill 512] [--repeats 2] [--json OUT.json]

The model of benchmarks/placement_bench.py (hidden 2048, 64 experts top-8, expert FFN 1024,
router skew 0.5). Plans, int4, compiled with `--target` (this machine's profile, every weight
fits on one GPU): `--gpus 1`, and for each N > 1 `--gpus N --gpu-mode layer` (contiguous layer
blocks per GPU) and `--gpu-mode stripe` (each layer's experts dealt over the GPUs by popularity,
the dense parts on GPU 0), the latter run as one sharded computation over a device mesh
(`strata-run --multi-gpu mesh`, the default) and partition by partition from the host (`-host`). Reports decode tokens/s (batch 1, 32-token prompt, --n-new greedy
tokens, median of --repeats), prefill tokens/s of a --prefill-token prompt, the device memory
each plan holds per GPU, and whether the greedy tokens equal the 1-GPU plan's.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.common import log, stratac  # noqa: E402
from benchmarks.gpu_decode import FULL  # noqa: E402
from benchmarks.placement_bench import TINY, build_model, decode_rate  # noqa: E402


def in_use() -> list[int]:
    import jax

    return [int((d.memory_stats() or {}).get("bytes_in_use", 0)) for d in jax.devices()]


def prefill_rate(plan_dir: Path, n: int, repeats: int, device: str = "auto", multi_gpu: str = "mesh") -> float:
    from strata_compiler.runtime.plan import load_plan
    from strata_compiler.runtime.session import Session

    s = Session(load_plan(plan_dir, verify_weights="none"), "auto", device=device, multi_gpu=multi_gpu)
    ids = np.random.default_rng(1).integers(0, 4096, (1, n)).astype(np.int64)
    times = []
    for r in range(repeats + 1):
        s.reset(1, n + 8)
        t0 = time.perf_counter()
        s.step(ids)
        if r:
            times.append(time.perf_counter() - t0)
    return n / statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/multi_gpu"))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--gpus", default="1,2")
    ap.add_argument("--n-new", type=int, default=48)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--hw", type=Path, help="a stratac probe-hw profile (default: measured now, --quick)")
    ap.add_argument("--tiny", action="store_true", help="a small model (smoke test)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu"],
                    help="cpu: JAX's CPU devices stand in for GPUs (XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    a = ap.parse_args()
    import jax

    n_dev = len(jax.devices())
    dims = dict(TINY if a.tiny else FULL)
    if a.layers:
        dims["layers"] = a.layers
    a.work_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(a.work_dir, dims, 0.5)
    base = a.work_dir / "base"
    calib_text = HERE.parent / "examples" / "models" / "tiny-moe" / "calib.txt"
    if not (base / "plan.bin").exists():
        stratac("compile", str(model), "-o", str(base), "--quant", "int4", "--calib", str(calib_text),
                "--calib-tokens", "256", "--no-imatrix")
    hw = a.hw or a.work_dir / "hw.json"
    if not hw.exists():
        stratac("probe-hw", "-o", str(hw), "--quick", "--disk-dir", str(a.work_dir))
    common = ["--quant", "int4", "--calib", str(base / "plan.bin"), "--no-imatrix", "--target", str(hw)]
    variants = {}
    for n in (int(x) for x in a.gpus.split(",")):
        if n > n_dev:
            log(f"skipping {n} GPUs: JAX sees {n_dev}")
            continue
        for mode in (("layer",) if n == 1 else ("layer", "stripe")):
            name = f"{n}gpu" + (f"-{mode}" if n > 1 else "")
            out = a.work_dir / name
            if not (out / "plan.bin").exists():
                stratac("compile", str(model), "-o", str(out), *common, "--gpus", str(n), "--gpu-mode", mode)
            variants[name] = {"dir": out, "gpus": n, "mode": mode, "multi_gpu": "mesh"}
            if mode == "stripe":     # the same plan driven partition by partition from the host
                variants[name + "-host"] = {"dir": out, "gpus": n, "mode": mode, "multi_gpu": "host"}
    prompt = np.random.default_rng(0).integers(0, 4096, (1, 32)).astype(np.int64)
    ref = None
    rows = []
    for name, v in variants.items():
        gc.collect()
        before = in_use()
        info: dict = {}
        tps, toks = decode_rate(v["dir"], prompt, a.n_new, a.repeats, info=info, device=a.device,
                                multi_gpu=v["multi_gpu"])
        held = [max(0, x - y) for x, y in zip(in_use(), before)]
        pf = prefill_rate(v["dir"], a.prefill, a.repeats, a.device, v["multi_gpu"])
        ref = ref or toks
        rows.append({"variant": name, "decode_tok_s": tps, "prefill_tok_s": pf, "same_tokens": toks == ref,
                     "tokens": list(toks), "device_bytes": held})
        log(f"{name}: decode {tps:.1f} tok/s, prefill {pf:.0f} tok/s, device GiB "
            + " ".join(f"{b / 2**30:.2f}" for b in held))
    print(f"\nmodel {dims}, int4; {n_dev} device(s): {jax.devices()[0].device_kind}")
    print(f"{'plan':14} {'decode tok/s':>12} {'prefill tok/s':>13} {'same tokens':>11}  device GiB (held after decode)")
    for r in rows:
        print(f"{r['variant']:14} {r['decode_tok_s']:12.1f} {r['prefill_tok_s']:13.0f} {str(r['same_tokens']):>11}  "
              + " ".join(f"{b / 2**30:.2f}" for b in r["device_bytes"]))
    if a.json:
        a.json.write_text(json.dumps({"dims": dims, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
