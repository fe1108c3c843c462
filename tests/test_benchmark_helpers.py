"""benchmarks/make_synthetic_model.py and the header/limit arithmetic of benchmarks/compile_rss.py."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy for safetensors)
import numpy as np
import pytest
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


msm = _load("make_synthetic_model")
crss = _load("compile_rss")

EXPERT_KEYS = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}


def _check_folder(d: Path, arch: str) -> dict:
    cfg = json.loads((d / "config.json").read_text())
    index = json.loads((d / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    shards = sorted(d.glob("*.safetensors"))
    n = len(shards)
    assert [p.name for p in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors"
                                        for i in range(1, n + 1)]
    assert set(weight_map.values()) == {p.name for p in shards}

    shapes: dict[str, tuple] = {}
    total = 0
    for p in shards:
        raw = p.read_bytes()[:8]
        (hlen,) = struct.unpack("<Q", raw)
        assert hlen % 8 == 0
        with safe_open(str(p), framework="numpy") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():
                assert weight_map[k] == p.name
                t = f.get_tensor(k)
                assert t.dtype == np.dtype(ml_dtypes.bfloat16)
                x = t.astype(np.float32)
                assert np.isfinite(x).all(), k
                if k.endswith("norm.weight"):
                    assert 1.0 <= x.min() and x.max() < 1.2, k
                else:
                    assert 0 < x.std() < 0.2 and abs(x.mean()) < 0.01, k
                shapes[k] = t.shape
                total += t.nbytes
    assert set(shapes) == set(weight_map)
    assert index["metadata"]["total_size"] == total

    D, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", D // H)
    E = cfg["num_local_experts"] if arch == "mixtral" else cfg["num_experts"]
    I = cfg["moe_intermediate_size"] if arch == "qwen3_moe" else cfg["intermediate_size"]
    assert cfg["model_type"] == arch
    assert shapes["model.embed_tokens.weight"] == (V, D)
    assert shapes["lm_head.weight"] == (V, D)
    assert shapes["model.norm.weight"] == (D,)
    block, (g, u, dn) = EXPERT_KEYS[arch]
    for i in range(L):
        p = f"model.layers.{i}."
        assert shapes[p + "self_attn.q_proj.weight"] == (H * hd, D)
        assert shapes[p + "self_attn.k_proj.weight"] == (KV * hd, D)
        assert shapes[p + "self_attn.v_proj.weight"] == (KV * hd, D)
        assert shapes[p + "self_attn.o_proj.weight"] == (D, H * hd)
        assert shapes[f"{p}{block}.gate.weight"] == (E, D)
        for e in range(E):
            q = f"{p}{block}.experts.{e}."
            assert shapes[q + g + ".weight"] == (I, D)
            assert shapes[q + u + ".weight"] == (I, D)
            assert shapes[q + dn + ".weight"] == (D, I)
    assert f"model.layers.{L}.input_layernorm.weight" not in shapes
    if arch == "qwen3_moe":
        assert shapes["model.layers.0.self_attn.q_norm.weight"] == (hd,)
    elif arch == "olmoe":
        assert shapes["model.layers.0.self_attn.k_norm.weight"] == (KV * hd,)
    else:
        assert "model.layers.0.self_attn.q_norm.weight" not in shapes
    return {"shapes": shapes, "total": total, "cfg": cfg}


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe"])
def test_synthetic_model_parses_back(tmp_path, arch):
    s = msm.make_synthetic_model(tmp_path / arch, arch=arch, size_gb=0.01)
    info = _check_folder(tmp_path / arch, arch)
    assert s["total_bytes"] == info["total"]
    assert 0.005e9 < s["total_bytes"] < 0.02e9
    largest = max(info["shapes"].items(), key=lambda kv: int(np.prod(kv[1])))
    assert s["largest_tensor_bytes"] == int(np.prod(largest[1])) * 2

    stats = crss.model_stats(tmp_path / arch)
    assert stats.tensors == len(info["shapes"])
    assert stats.tensor_bytes == info["total"]
    assert stats.largest_bytes == s["largest_tensor_bytes"]
    assert stats.largest_tensor == s["largest_tensor"]
    assert stats.file_bytes == sum(p.stat().st_size for p in (tmp_path / arch).glob("*.safetensors"))


def test_sharding_overrides_and_determinism(tmp_path):
    kw = dict(arch="qwen3_moe", size_gb=0.01, shard_gb=0.0005, layers=2,
              hidden=128, experts=4, vocab=3000, heads=4, kv_heads=2)
    a = msm.make_synthetic_model(tmp_path / "a", **kw)
    b = msm.make_synthetic_model(tmp_path / "b", **kw)
    assert len(a["files"]) > 1
    info = _check_folder(tmp_path / "a", "qwen3_moe")
    cfg = info["cfg"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_experts"], cfg["vocab_size"]) \
        == (2, 128, 4, 3000)
    for name in a["files"]:
        pa, pb = tmp_path / "a" / name, tmp_path / "b" / name
        assert pa.read_bytes() == pb.read_bytes()
        header = crss.read_safetensors_header(pa)
        data = sum(v["data_offsets"][1] - v["data_offsets"][0]
                   for k, v in header.items() if k != "__metadata__")
        assert data <= 0.0005e9 or len(header) == 2  # over the limit only when alone
    c = msm.make_synthetic_model(tmp_path / "c", seed=1, **kw)
    assert (tmp_path / "c" / c["files"][0]).read_bytes() != (tmp_path / "a" / a["files"][0]).read_bytes()


def test_topics_tilt_embeddings_head_and_routers(tmp_path):
    """--topics 4: token t's embedding and LM-head rows lean towards topic t mod 4's direction,
    and in each layer a quarter of the router rows lean towards each topic's (a fresh assignment
    per layer), by the given fractions of a row's norm; without topics nothing leans."""
    from safetensors.numpy import load_file

    kw = dict(arch="olmoe", size_gb=0.01, layers=2, hidden=256, experts=16, vocab=512, heads=4, kv_heads=4,
              embed_scale=1.0)
    strength = (1.0, 0.5, 0.4)
    msm.make_synthetic_model(tmp_path / "t", topics=4, topic_strength=strength, **kw)
    msm.make_synthetic_model(tmp_path / "p", **kw)
    u = msm.Topics(4, 256, 0).u

    def tensors(d):
        out = {}
        for f in sorted((tmp_path / d).glob("*.safetensors")):
            out.update({k: v.astype(np.float32) for k, v in load_file(f).items()})
        return out

    t, p = tensors("t"), tensors("p")
    for name, frac in (("model.embed_tokens.weight", strength[0]), ("lm_head.weight", strength[1])):
        for w, lean in ((t[name], frac), (p[name], 0.0)):
            cos = (w @ u.T) / np.linalg.norm(w, axis=1, keepdims=True)        # [vocab, topics]
            own = cos[np.arange(len(w)), np.arange(len(w)) % 4]
            # a row r + f |r| u has cosine f / sqrt(1 + f^2) with u (r nearly orthogonal to u)
            assert abs(own.mean() - lean / np.sqrt(1 + lean ** 2)) < 0.03, name
            assert np.abs(np.delete(cos, np.arange(len(w)) % 4 + 4 * np.arange(len(w)), None)).mean() < 0.1
    groups = []
    for layer in range(2):
        w = t[f"model.layers.{layer}.mlp.gate.weight"]
        cos = (w @ u.T) / np.linalg.norm(w, axis=1, keepdims=True)            # [experts, topics]
        topic = cos.argmax(1)
        assert np.bincount(topic, minlength=4).tolist() == [4, 4, 4, 4]
        want = strength[2] / np.sqrt(1 + strength[2] ** 2)     # (noise: a random row's cosine ~ 1/16)
        assert abs(cos.max(1).mean() - want) < 0.05 and cos.max(1).min() > want / 2
        groups.append(topic)
        assert np.abs(p[f"model.layers.{layer}.mlp.gate.weight"] @ u.T).max() < \
            np.abs(w @ u.T).max() / 2
    assert (groups[0] != groups[1]).any()          # each layer assigns its experts afresh


def test_size_fitting_without_writing():
    d = msm.choose_dims("qwen3_moe", 2.2, 2)
    assert (d.hidden, d.vocab, d.experts) == (2048, 32000, 64)
    total = sum(int(np.prod(s)) for _, s, _ in msm.all_tensors("qwen3_moe", d)) * 2
    per_layer = sum(int(np.prod(s)) for _, s, _ in msm.layer_tensors("qwen3_moe", d, 0)) * 2
    assert abs(total - 2.2e9) <= per_layer / 2 + 1
    assert max(int(np.prod(s)) for _, s, _ in msm.all_tensors("qwen3_moe", d)) * 2 == 32000 * 2048 * 2


def test_limit_arithmetic():
    MiB = 1 << 20
    assert crss.rss_limit_bytes(0) == 500 * MiB
    assert crss.rss_limit_bytes(131_072_000) == 196_608_000 + 500 * MiB
    assert crss.maxrss_to_bytes(1000, "linux") == 1_024_000
    assert crss.maxrss_to_bytes(1000, "darwin") == 1000
    stats = crss.ModelStats(files=1, tensors=2, file_bytes=10 * MiB, tensor_bytes=10 * MiB,
                            largest_tensor="x", largest_bytes=100 * MiB)
    limit = 650 * MiB
    assert crss.judge(stats, 0, limit, 1.0).verdict == "PASS"
    assert crss.judge(stats, 0, limit + 1, 1.0).verdict == "FAIL"
    assert crss.judge(stats, 3, 1, 1.0).verdict == "FAIL"
    table = crss.format_table(crss.judge(stats, 0, 10 * MiB, 1.0))
    assert "PASS" in table and "limit" in table and "peak RSS" in table


def test_header_reader_and_measured_run(tmp_path):
    # A hand-built header with __metadata__ and two tensors.
    hdr = {"__metadata__": {"format": "pt"},
           "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
           "b": {"dtype": "BF16", "shape": [5], "data_offsets": [24, 34]}}
    js = json.dumps(hdr).encode()
    js += b" " * (-len(js) % 8)
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(js)) + js + bytes(34))
    assert crss.read_safetensors_header(tmp_path / "m.safetensors") == hdr
    st = crss.model_stats(tmp_path)
    assert (st.tensors, st.tensor_bytes, st.largest_tensor, st.largest_bytes) == (2, 34, "a", 24)

    child = [sys.executable, "-c", "b = bytearray(64 << 20)"]  # zero-filled: RSS >= 64 MiB
    cmd = crss.compile_command(child, tmp_path, tmp_path / "plan", "bf16", ["--extra"])
    assert cmd[-7:] == ["compile", str(tmp_path), "-o", str(tmp_path / "plan"),
                        "--quant", "bf16", "--extra"]
    code, peak, wall = crss.run_measured(cmd)
    assert code == 0 and peak >= 64 << 20 and wall > 0
    code, _, _ = crss.run_measured([sys.executable, "-c", "raise SystemExit(3)"])
    assert code == 3
    assert crss.main([str(tmp_path), "-o", str(tmp_path / "plan"), "--dry-run"]) == 0


def test_device_benchmarks_smoke(tmp_path):
    """The benchmarks that only pay off on the GPU machines (whose time is scarce) run end to end
    here on small models: JAX's CPU devices stand in for the GPUs, a fake profile for the probe."""
    import os
    import subprocess

    sys.path.insert(0, str(ROOT / "tests"))
    from test_place import fake_profile

    hw = fake_profile(tmp_path / "hw.json")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "placement_bench.py"), "--tiny", "--work-dir",
                        str(tmp_path / "pb"), "--hw", str(hw), "--device", "cpu", "--n-new", "6", "--repeats", "1",
                        "--rounds", "2", "--in-process", "--check-prompts", "2", "--check-new", "4",
                        "--only", "strata-25,ngl-25,cache-25/no-cache,cache-25/cpu-misses,disk-half,"
                        "hot-cache-25,ngl-25@STRATA_POOL_SPLIT=2",
                        "--json", str(tmp_path / "pb.json"), "--disk"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "pb.json").read_text())["variants"]
    assert set(res) == {"gpu-all", "strata-25", "ngl-25", "cache-25/no-cache", "cache-25/cpu-misses",
                        "disk-half", "hot-cache-25", "ngl-25@STRATA_POOL_SPLIT=2"}
    assert res["ngl-25@STRATA_POOL_SPLIT=2"]["env"] == {"STRATA_POOL_SPLIT": "2"}     # its own process, that env
    # --rounds 2: every variant measured twice in turn, its figure the median of the two
    assert all(len(v["tok_s_rounds"]) == 2 and v["tok_s"] == pytest.approx(sum(v["tok_s_rounds"]) / 2)
               for v in res.values())
    assert "ngl-25@STRATA_POOL_SPLIT=2" in r.stdout      # its row in the table
    # the place pass's runtime constants refitted to the run (replayed up to the place pass)
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "refit_cost_model.py"), "--json",
                        str(tmp_path / "pb.json"), "--work-dir", str(tmp_path / "pb"), "--hw", str(hw),
                        "--switch", "0.5,1", "--eff", "0.75"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    best = r.stdout.split("best:")[1].splitlines()
    assert {ln.split()[0] for ln in best[1:] if ln.strip()} == {"ngl-25", "strata-25"}
    assert 0 < res["hot-cache-25"]["hit_rate"] <= 1 and res["cache-25/no-cache"]["hit_rate"] is None
    assert all(v["tok_s"] > 0 and v["same_tokens"] for v in res.values())
    # the tokens check (2 more prompts, in-process and own-process variants alike) and the logit
    # deviation from gpu-all along its tokens
    assert all(v["check_same"] == 2 for v in res.values())
    assert all(0 <= max(v["logit_dev"]) < 0.5 for k, v in res.items() if k != "gpu-all")
    assert 0 < res["disk-half"]["peak_rss"] < 4 << 30 and res["strata-25"]["predicted"] > 0
    # a calibrated cached plan's host side carries each expert's calibrated chance (k a token in
    # all), which seeds the cache's scores
    from strata_compiler.runtime.plan import load_plan

    g = load_plan(tmp_path / "pb" / "hot-cache-25").graph
    whole = [n for n in g.nodes if n.op.value == "moe_ffn" and n.attr("cache", "") and not n.attr("experts", ())]
    k = round(sum(whole[0].attr("prior"))) if whole else 0     # top-k: the model's k experts a token
    assert whole and all(len(n.attr("prior")) == g.weight(n.weight("down")).shape[0]
                         and k >= 1 and abs(sum(n.attr("prior")) - k) < 1e-3 for n in whole)
    # the cache policies replayed on a routing trace recorded from the all-CPU plan
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cache_sim.py"), str(tmp_path / "pb" / "base"),
                        "--tokens", "40", "--calib", "12", "--prefetch", "0,1", "--json", str(tmp_path / "cs.json")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    cs = json.loads((tmp_path / "cs.json").read_text())
    assert len(cs["rows"]) == 2 + 2 * 4 and all(0 <= x["hit_rate"] <= 1 for x in cs["rows"])
    assert cs["rows"][0]["copies"] == 0 and any(x["copies"] > 0 for x in cs["rows"])
    # the static split and the prior from the plan's own calibration, two generations in a row
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cache_sim.py"), str(tmp_path / "pb" / "base"),
                        "--tokens", "20", "--sequences", "2", "--calib-plan", "--topics", "4", "--prefetch", "0",
                        "--json", str(tmp_path / "cs2.json")], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "on their generation's first topic" in r.stdout and "replayed in 2 generation(s)" in r.stdout
    cs = json.loads((tmp_path / "cs2.json").read_text())
    assert len(cs["rows"]) == 2 + 4 and cs["rows"][0]["hit_rate"] <= cs["rows"][1]["hit_rate"]
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cache_sim.py"), str(tmp_path / "pb" / "hot-cache-25")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode != 0 and "whole layers" in r.stderr
    # a CPU partition alone, its MoE op's phases timed (LLVMExecutor.phase_ns), k random experts a call
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_share.py"), str(tmp_path / "pb" / "hot-cache-25"),
                        "--device", "cpu", "--reps", "3", "--experts", "1,2"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.split() and ln.split()[0].isdigit()]
    # (the cached plan's segment runs as a native program too: the MASK instruction, "native us")
    assert rows and {x[1] for x in rows} == {"1", "2"} and all(float(v) > 0 for x in rows for v in x[2:])
    from strata_compiler.backends.llvm_cpu import executor as lx
    assert lx.LLVMExecutor.phase_ns is None          # off unless a benchmark turns it on
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_dispatch.py"), str(tmp_path / "pb" / "hot-cache-25"),
                        "--device", "cpu", "--reps", "3"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [ln.split()[0] for ln in r.stdout.splitlines()[-6:]] == ["runtime", "no-donation", "compiled",
                                                                     "trivial-body", "tiny", "after-host-work"]
    # the host-time breakdown, with raw copies (memmove on the CPU) and an A/B of the idle workers'
    # spin at hand-offs: it moves no value (the fused line carries its timeline)
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "switch_breakdown.py"), str(tmp_path / "pb" / "strata-25"),
                        "--device", "cpu", "--n-new", "5", "--ab", "STRATA_HAND_OFF_SPIN_US=30,100"], capture_output=True,
                       text=True, env=dict(env, STRATA_RAW_COPY="host"), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    last = r.stdout.splitlines()[-2:]
    assert last[0].startswith("strata-25 STRATA_HAND_OFF_SPIN_US=30") and "logits max |diff| 0, argmax equal 4/4" in last[1]
    assert "fused step: dispatch" in r.stdout
    # a cached plan: its swaps' copies timed
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "switch_breakdown.py"),
                        str(tmp_path / "pb" / "hot-cache-25"), "--device", "cpu", "--n-new", "5"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[-1].split()[0] == "hot-cache-25"
    for script, args in (("host_call_bench.py", ["--layers", "2", "--hidden", "64", "--reps", "3"]),
                         ("dispatch_args.py", ["--counts", "1,3", "--reps", "3"])):
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                           env=env, timeout=600)
        assert r.returncode == 0, (script, r.stderr[-3000:])
    assert r.stdout.splitlines()[-1].split()[1] == "donated"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi_gpu.py"), "--tiny", "--work-dir",
                        str(tmp_path / "mg"), "--hw", str(hw), "--device", "cpu", "--n-new", "6", "--prefill", "16",
                        "--repeats", "1", "--json", str(tmp_path / "mg.json")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "mg.json").read_text())["rows"]
    assert [x["variant"] for x in rows] == ["1gpu", "2gpu-layer", "2gpu-stripe", "2gpu-stripe-host"]
    assert all(x["decode_tok_s"] > 0 and x["prefill_tok_s"] > 0 for x in rows)
    # the 2-device plans agree among themselves; the 1-device plan keeps cold experts on the CPU
    # (q8 activations, AMX tiles where present), whose rounding may flip a near-tied top-4 route
    # of this random model, so its greedy tokens are not compared with theirs
    assert len({tuple(x["tokens"]) for x in rows[1:]}) == 1


def test_kernel_benchmarks_smoke(tmp_path):
    """The GPU kernel benchmarks run end to end on small shapes here (JAX on the CPU; the Pallas
    sweep in interpret mode): the variant table with outputs compared, the in-process A/B of a
    kernel switch, and the kernel-table and kernels-vs-XLA check options."""
    import os
    import subprocess

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = lambda *a: subprocess.run([sys.executable, *map(str, a)], capture_output=True, text=True,  # noqa: E731
                                    env=env, timeout=600)
    r = run(ROOT / "benchmarks" / "pallas_moe_sweep.py", "--tiny", "--layers", "2", "--reps", "1", "--variants",
            "xla;pallas:4,8,4,8;pallas:32,4,4,4")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines()[-3:]}
    assert set(rows) == {"xla", "pallas:4,8,4,8", "pallas:32,4,4,4"}
    for v in ("pallas:4,8,4,8", "pallas:32,4,4,4"):
        assert 0 < float(rows[v][4]) < 0.05                         # q8 activations: close, not equal
    r = run(ROOT / "benchmarks" / "gpu_decode.py", "--tiny", "--work-dir", tmp_path / "gd", "--formats", "int4",
            "--batches", "1", "--prefill", "16", "--n-new", "4", "--repeats", "1", "--ab",
            "STRATA_PALLAS_ATTN=on,off")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "decode STRATA_PALLAS_ATTN=on" in r.stdout and "decode STRATA_PALLAS_ATTN=off" in r.stdout
    r = run(ROOT / "benchmarks" / "gpu_profile.py", "--tiny", "--work-dir", tmp_path / "gp", "--layers", "2",
            "--steps", "4", "--kernels", "--check", "--check-batch", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "check: batch 3," in r.stdout and "greedy tokens equal 96/96" in r.stdout and "kernels:" in r.stdout
    assert "check (teacher-forced, 33 steps)" in r.stdout and "top-1 equal 99/99" in r.stdout


def test_gpu_decode_ab_settings():
    """--ab ENV / ENV=A,B,... / ENV=A|B|... (values holding commas, e.g. kernel tunings)."""
    ab = _load("gpu_decode").ab_settings
    assert ab("X") == ("X", ("1", "0"))
    assert ab("X=dp4a,bytes") == ("X", ("dp4a", "bytes"))
    assert ab("T=8,4|32,4") == ("T", ("8,4", "32,4"))
    assert ab("T=1|2|3") == ("T", ("1", "2", "3"))
    for bad in ("T=1,1", "=1,0", "T=a", "T=8,4|", "T=1,2,1"):
        with pytest.raises(ValueError):
            ab(bad)
