"""Measure the compiler's peak memory (RSS) and wall time on a model folder.

    python benchmarks/compile_rss.py MODEL_DIR -o PLAN_DIR [--quant bf16] [--compiler CMD]
        [--json] [--dry-run] [-- EXTRA_STRATAC_ARGS...]

Runs `CMD compile MODEL_DIR -o PLAN_DIR --quant QUANT EXTRA...` as a subprocess, where CMD is
--compiler, else $STRATAC, else `stratac` if it is on PATH, else `python -m strata_compiler.cli`.
The child's peak RSS comes from wait4()'s rusage (ru_maxrss: KiB on Linux, bytes on macOS; it
covers the child and any descendants it waited for). The largest tensor is read from the
safetensors headers in MODEL_DIR (parsed directly, no tensor data is read).

The budget is  limit = 1.5 x largest tensor + 500 MiB : a streaming compiler holds about one
tensor plus its converted copy, plus a fixed overhead, never the whole model.

Exit status: 0 on PASS, 1 on FAIL (over the limit, or the compiler failed), 2 on usage errors.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import struct
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MiB = 1 << 20
OVERHEAD_BYTES = 500 * MiB
LARGEST_FACTOR = 1.5
SAFETENSORS_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}


# ----------------------------------------------------------------------------- headers


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file (tensor entries plus optional __metadata__)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * MiB:
            raise ValueError(f"{path}: implausible header length {n}")
        blob = f.read(n)
        if len(blob) != n:
            raise ValueError(f"{path}: truncated header")
    return json.loads(blob)


@dataclass
class ModelStats:
    files: int
    tensors: int
    file_bytes: int  # sum of .safetensors file sizes
    tensor_bytes: int  # sum of tensor data sizes
    largest_tensor: str
    largest_bytes: int


def model_stats(model_dir: Path) -> ModelStats:
    """Tensor count/sizes over every *.safetensors file in `model_dir` (headers only)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    tensors = tensor_bytes = file_bytes = 0
    largest = ("", 0)
    for path in files:
        file_bytes += path.stat().st_size
        for name, info in read_safetensors_header(path).items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            nbytes = end - begin
            numel = 1
            for s in info["shape"]:
                numel *= s
            item = SAFETENSORS_ITEMSIZE.get(info["dtype"])
            if item is not None and numel * item != nbytes:
                raise ValueError(f"{path}: {name}: shape {info['shape']} x {info['dtype']} "
                                 f"!= {nbytes} bytes")
            tensors += 1
            tensor_bytes += nbytes
            if nbytes > largest[1]:
                largest = (name, nbytes)
    return ModelStats(len(files), tensors, file_bytes, tensor_bytes, largest[0], largest[1])


def rss_limit_bytes(largest_bytes: int) -> int:
    return int(LARGEST_FACTOR * largest_bytes) + OVERHEAD_BYTES


def maxrss_to_bytes(ru_maxrss: int, platform: str = sys.platform) -> int:
    return ru_maxrss if platform == "darwin" else ru_maxrss * 1024


# ----------------------------------------------------------------------------- run


def default_compiler() -> list[str]:
    env = os.environ.get("STRATAC")
    if env:
        return shlex.split(env)
    exe = shutil.which("stratac")
    if exe:
        return [exe]
    return [sys.executable, "-m", "strata_compiler.cli"]


def compile_command(compiler: list[str], model_dir: Path, plan_dir: Path, quant: str,
                    extra: list[str]) -> list[str]:
    return [*compiler, "compile", str(model_dir), "-o", str(plan_dir), "--quant", quant, *extra]


def run_measured(cmd: list[str]) -> tuple[int, int, float]:
    """Run `cmd`; return (exit code, peak RSS bytes of the child tree, wall seconds)."""
    t0 = time.perf_counter()
    pid = os.posix_spawnp(cmd[0], cmd, os.environ)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    return os.waitstatus_to_exitcode(status), maxrss_to_bytes(usage.ru_maxrss), wall


@dataclass
class Result:
    model_bytes: int
    largest_tensor: str
    largest_bytes: int
    peak_rss_bytes: int
    limit_bytes: int
    exit_code: int
    wall_s: float
    verdict: str


def judge(stats: ModelStats, exit_code: int, peak_rss: int, wall: float) -> Result:
    limit = rss_limit_bytes(stats.largest_bytes)
    ok = exit_code == 0 and peak_rss <= limit
    return Result(stats.file_bytes, stats.largest_tensor, stats.largest_bytes, peak_rss, limit,
                  exit_code, round(wall, 3), "PASS" if ok else "FAIL")


def _mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB"


def format_table(r: Result) -> str:
    rows = [
        ("model bytes", f"{r.model_bytes:,} ({_mib(r.model_bytes)})"),
        ("largest tensor", f"{r.largest_bytes:,} ({_mib(r.largest_bytes)}) {r.largest_tensor}"),
        ("peak RSS", f"{r.peak_rss_bytes:,} ({_mib(r.peak_rss_bytes)})"),
        ("limit", f"{r.limit_bytes:,} ({_mib(r.limit_bytes)}) = "
                  f"{LARGEST_FACTOR} x largest + {_mib(OVERHEAD_BYTES)}"),
        ("compiler exit", str(r.exit_code)),
        ("wall", f"{r.wall_s:.2f} s"),
        ("result", r.verdict + ("" if r.exit_code == 0 else " (compiler failed)")),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(
        description="Peak RSS and wall time of `stratac compile` against the streaming budget.",
        epilog="Arguments after `--` are passed to the compiler.")
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("-o", "--output", type=Path, required=True, help="plan directory")
    ap.add_argument("--quant", default="bf16")
    ap.add_argument("--compiler", default=None,
                    help="compiler command (default: $STRATAC, `stratac`, or "
                         "`python -m strata_compiler.cli`)")
    ap.add_argument("--json", action="store_true", help="also print the result as JSON")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the command and the model's header stats; run nothing")
    a = ap.parse_args(argv)

    stats = model_stats(a.model_dir)
    compiler = shlex.split(a.compiler) if a.compiler else default_compiler()
    cmd = compile_command(compiler, a.model_dir, a.output, a.quant, extra)
    print("$ " + shlex.join(cmd), flush=True)
    if a.dry_run:
        print(json.dumps({**asdict(stats), "limit_bytes": rss_limit_bytes(stats.largest_bytes)},
                         indent=2))
        return 0
    try:
        code, peak, wall = run_measured(cmd)
    except FileNotFoundError as e:
        print(f"cannot start the compiler: {e}", file=sys.stderr)
        code, peak, wall = 127, 0, 0.0
    r = judge(stats, code, peak, wall)
    print(format_table(r))
    if a.json:
        print(json.dumps(asdict(r)))
    return 0 if r.verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
