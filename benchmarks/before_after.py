"""Two Strata source trees side by side in one run on one machine: decode tokens/s and greedy
tokens of the same variants, each tree measured by its own code, in alternating order.

    python benchmarks/before_after.py --tree before=/tmp/before_tree --tree after=. \\
        [--work-dir /tmp/before_after] [--variants gpu-all,strata-25,cache-25] [--rounds 3]
        [--layers 16] [--router-skew 0.5] [--topics 4] [--topic-strength 1.0,0.2,0.03] [--quant int4]
        [--hw benchmarks/profiles/h200-2026-11-29-raw.json] [--n-new 48] [--repeats 2]
        [--tiny] [--device cpu] [--cpu-decode] [--deadline SECONDS] [--json OUT.json]

What a refactor must not change: its speed and its tokens. Each tree is copied and installed
(non-editable, `pip install --target`) into a folder of its own, and every command for it runs
with that install first on the import path (checked: a `strata_compiler` module loaded from
elsewhere, such as an editable install of the current checkout, fails the command), using the
tree's own benchmarks/placement_bench.py: `--build-only` compiles the tree's plans from one
shared model folder (written once, by the first tree), `--rate-only` measures one plan in a
fresh process (decode tokens/s, median of --repeats after a warm-up pass, and the greedy
tokens). Each round runs every variant once per tree; the trees' order alternates between
rounds, so drift of a noisy machine hits them alike. A figure is the median of its rounds.

Variants: gpu-all (the whole model on the GPU), strata-B (the cost model's split at B % of the
expert bytes), cache-B (that budget as expert caches), cpu-only (the whole model on the llvm
backend), tiny-moe (examples/models/tiny-moe, compiled by each tree, on the llvm backend).
--cpu-decode: the CPU decode benchmark (tiny-moe and cpu-only; longer passes, 5 rounds).

The prompt: up to --prompt-seconds of the first tree's placement_bench prompt search (a prompt
whose greedy steps all clear a top-1/top-2 gap), one per model; 0: a fixed seeded random prompt.
Prints a table (variant, each tree's median, ratio to the first tree, tokens identical, each
round's figures) and writes it to --json (and the work dir's state.json) after every
measurement. With --deadline, a variant's round starts only if its last round would still fit;
--reuse continues the work dir's last run (same settings and code: its plans, prompt, rounds).
Exit status 2 when a variant's tokens differ between trees or rounds, or a measurement failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Runs inside each tree's processes: that tree's install and root first on sys.path (not the
# working directory, not the script's folder), strata_compiler imported from the install before
# anything else can import it, and at exit every loaded strata_compiler module checked to come
# from the install. argv: SITE ROOT MODE ARG [ARGS...]; MODE "script" runs the file ARG as
# __main__ with ARGS, "exec" runs the code ARG with sys.argv = ["-", *ARGS].
SHIM = r'''
import atexit, os, sys
site, root, mode, arg, *rest = sys.argv[1:]
cwd = os.getcwd()
sys.path[:] = [site, root] + [p for p in sys.path if p not in ("", cwd, site, root)]
import strata_compiler
def _check():
    pre = os.path.realpath(site) + os.sep
    bad = sorted(n for n, m in list(sys.modules.items()) if n.split(".")[0] == "strata_compiler"
                 and getattr(m, "__file__", None) and not os.path.realpath(m.__file__).startswith(pre))
    if bad:
        sys.stderr.write("before_after: strata_compiler modules from outside %s: %s\n" % (site, bad[:5]))
        sys.stderr.flush()
        os._exit(3)
_check()
atexit.register(_check)
if mode == "script":
    import runpy
    sys.argv = [arg] + rest
    runpy.run_path(arg, run_name="__main__")
else:
    sys.argv = ["-"] + rest
    exec(compile(arg, "<before_after>", "exec"))
'''

PROBE = r'''
import json, sys, strata_compiler, strata_compiler.passes, strata_compiler.backends, strata_compiler.runtime
print(json.dumps({m.__name__: m.__file__ for m in (strata_compiler, strata_compiler.passes,
                  strata_compiler.backends, strata_compiler.runtime)} | {"python": sys.version.split()[0]}))
'''

# The shared model, written with the first tree's placement_bench (the dims it would use).
MODEL = r'''
import sys
from pathlib import Path
from benchmarks.placement_bench import TINY, build_model
from benchmarks.gpu_decode import FULL
work, tiny, layers, skew, topics, strength = sys.argv[1:]
dims = dict(TINY if tiny == "1" else FULL)
if int(layers):
    dims["layers"] = int(layers)
st = tuple(float(x) for x in strength.split(",")) if int(topics) else None
print(build_model(Path(work), dims, float(skew), int(topics), st))
'''

# A prompt clear under the given plan (placement_bench.pick_prompt), searched at most SECONDS.
PROMPT = r'''
import json, sys
from pathlib import Path
import benchmarks.placement_bench as pb
plan, backend, device, n_new, gap, seconds = sys.argv[1:]
pb.PROMPT_SECONDS = float(seconds)
[(prompt, got, _)], tried = pb.pick_prompt(Path(plan), int(n_new), backend, device, float(gap))
print(json.dumps({"prompt": prompt[0].tolist(), "gap": got, "tried": tried}))
'''

COMPILE = r'''
import runpy, sys
sys.argv = ["stratac"] + sys.argv[1:]
runpy.run_module("strata_compiler.cli", run_name="__main__", alter_sys=True)
'''


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def seeded_prompt() -> list[int]:
    """The first of placement_bench's random prompts (seed 0), without a model: 32 ids < 4096."""
    import numpy as np

    return np.random.default_rng(0).integers(0, 4096, (1, 32)).astype(np.int64)[0].tolist()


class Tree:
    """One source tree: its copy, its install, its work folder, and how to run code under it."""

    def __init__(self, name: str, root: Path, work: Path, python: str):
        self.name, self.root, self.python = name, root.resolve(), python
        self.dir = work / name
        self.site = self.dir / "site"
        self.plans: dict[str, Path] = {}
        self.cache = self.dir / "cache"
        self.how = ""               # "pip", or "copy" where pip could not build a wheel

    def env(self, extra: dict | None = None) -> dict:
        old = os.environ.get("PYTHONPATH")
        return dict(os.environ, PYTHONPATH=os.pathsep.join([str(self.site), str(self.root)] + ([old] if old else [])),
                    STRATA_CACHE_DIR=str(self.cache), **(extra or {}))

    def argv(self, mode: str, arg: str, *args: str) -> list[str]:
        return [self.python, "-c", SHIM, str(self.site), str(self.root), mode, arg, *map(str, args)]

    def run(self, mode: str, arg: str, *args: str, what: str) -> str:
        """Run under this tree; its stdout, or exit with the stderr's tail on failure."""
        r = subprocess.run(self.argv(mode, arg, *args), capture_output=True, text=True, cwd=self.dir,
                           env=self.env())
        if r.returncode != 0:
            raise SystemExit(f"{self.name}: {what} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
        return r.stdout

    def install(self) -> str:
        """Copy the tree's sources (no VCS, caches, tests or examples) and pip-install the copy into
        site/: a build writes its build/ folder into the copy, not into the tree. Returns a digest
        of the installed package's files, to tell identical trees apart from different ones."""
        src = self.dir / "src"
        for p in (src, self.site):
            shutil.rmtree(p, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        skip = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis", "tests",
                "benchmarks", "examples", "docs", "demo", "out", ".whl", ".gl"}
        work = self.dir.parent.resolve()

        def ignore(d: str, names: list[str]) -> list[str]:
            return [n for n in names if n in skip or n.endswith(".egg-info") or Path(d, n).resolve() == work]
        shutil.copytree(self.root, src, ignore=ignore, symlinks=True)
        r = subprocess.run([self.python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                            "--target", str(self.site), str(src)], capture_output=True, text=True, cwd=self.dir)
        self.how = "pip"
        if r.returncode != 0:       # no wheel support without build isolation, say: copy what pip would
            log(f"{self.name}: pip install failed, copying the packages pyproject.toml names instead:\n"
                f"{(r.stdout + r.stderr)[-1500:]}")
            copy_packages(src, self.site)
            self.how = "copy"
        h = hashlib.sha256()
        pkg = self.site / "strata_compiler"
        for f in sorted(p for p in pkg.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes())
        return h.hexdigest()[:12]

    def probe(self) -> dict:
        """Where strata_compiler comes from: under the shim, and as a plain `python -m` child
        (stratac) sees it with this tree's PYTHONPATH. Both must be the install."""
        got = json.loads(self.run("exec", PROBE, what="import probe").strip().splitlines()[-1])
        r = subprocess.run([self.python, "-c", PROBE], capture_output=True, text=True, cwd=self.dir, env=self.env())
        plain = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-500:]}
        pre = str(self.site.resolve()) + os.sep
        for how, d in (("shim", got), ("plain", plain)):
            bad = [k for k, v in d.items() if k != "python" and not os.path.realpath(str(v)).startswith(pre)]
            if bad:
                raise SystemExit(f"{self.name}: {how} import of {bad} not from {self.site}: {d}")
        return got


def copy_packages(src: Path, site: Path) -> None:
    """A pure-Python install by hand: each package of pyproject.toml's [tool.setuptools] packages
    copied from its package-dir folder (its files, not its subfolders: those are packages too)."""
    import tomllib

    cfg = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg.get("package-dir", {})
    shutil.rmtree(site, ignore_errors=True)
    for pkg in cfg["packages"]:
        parts = pkg.split(".")
        head = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in dirs), None)
        folder = src.joinpath(dirs[head], *parts[len(head.split(".")):]) if head else src.joinpath(*parts)
        out = site.joinpath(*parts)
        out.mkdir(parents=True, exist_ok=True)
        for f in folder.iterdir():
            if f.is_file():
                shutil.copy2(f, out / f.name)


def build_plans(tree: Tree, a, model: Path, pb_variants: list[str], tiny_moe: bool) -> subprocess.Popen:
    """Start the tree's plan builds (placement_bench --build-only, then tiny-moe) as one child."""
    pb = tree.dir / "pb"
    shutil.rmtree(pb, ignore_errors=True)
    if pb_variants:
        pb.mkdir(parents=True)
        (pb / "model").symlink_to(model)
    cmds = []
    if pb_variants == ["cpu-only"]:      # placement_bench's unplaced plan, as it compiles it
        calib = tree.root / "examples" / "models" / "tiny-moe" / "calib.txt"
        cmds.append(tree.argv("exec", COMPILE, "compile", model, "-o", pb / "base", "--quant", a.quant,
                              *(["--calib", calib, "--calib-tokens", a.calib_tokens, "--no-imatrix"]
                                if a.calib_tokens else [])))
        cmds.append(["echo", "cpu-only", pb / "base"])
    elif pb_variants:
        budgets = sorted({int(v.split("-")[1]) for v in pb_variants if v.startswith(("strata-", "cache-"))} or {25})
        cmds.append(tree.argv("script", str(tree.root / "benchmarks" / "placement_bench.py"), "--build-only",
                              "--work-dir", pb, "--router-skew", a.router_skew, "--budgets",
                              ",".join(map(str, budgets)), "--quant", a.quant, "--calib-tokens", a.calib_tokens,
                              "--hw", a.hw, "--device", a.device, "--only", ",".join(pb_variants),
                              *(["--tiny"] if a.tiny else []), *(["--layers", a.layers] if a.layers else []),
                              *(["--topics", a.topics, "--topic-strength", a.topic_strength] if a.topics else [])))
    if tiny_moe:
        out = tree.dir / "tiny-moe"
        shutil.rmtree(out, ignore_errors=True)
        cmds.append(tree.argv("exec", COMPILE, "compile", a.tiny_moe, "-o", out, "--quant", a.quant))
    script = " && ".join(" ".join(_sh(x) for x in c) for c in cmds) or "true"
    logf = open(tree.dir / "build.log", "w")
    # plans only: no device memory taken up front, in case a compile step touches JAX
    return subprocess.Popen(["bash", "-c", script], stdout=logf, stderr=subprocess.STDOUT, cwd=tree.dir,
                            env=tree.env({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}))


def _sh(x) -> str:
    return shlex.quote(str(x))


def finish_build(tree: Tree, proc: subprocess.Popen, pb_variants: list[str], tiny_moe: bool) -> None:
    """Wait for the tree's builds; its plan folders from placement_bench's NAME DIR listing."""
    rc = proc.wait()
    text = (tree.dir / "build.log").read_text()
    if rc != 0:
        raise SystemExit(f"{tree.name}: building plans failed (exit {rc}):\n{text[-3000:]}")
    listed = dict(line.split()[:2] for line in text.splitlines() if len(line.split()) == 2 and "/" in line)
    for v in pb_variants:
        if v == "cpu-only":
            v_dir = listed.get("cpu-only") or listed.get("gpu-all")
        else:
            v_dir = listed.get(v)
        if not v_dir or not (Path(v_dir) / "plan.bin").exists():
            raise SystemExit(f"{tree.name}: no plan for {v} in its --build-only listing:\n{text[-2000:]}")
        tree.plans[v] = Path(v_dir)
    if tiny_moe:
        tree.plans["tiny-moe"] = tree.dir / "tiny-moe"


def measure(t: Tree, v: str, rnd: int, a, prompt: list[int], cell: dict, left: float | None,
            key: str = "tok_s_rounds") -> bool:
    """One --rate-only process of tree t's placement_bench on variant v's plan: its tok/s (into
    cell[key]) and greedy tokens into cell. False when it failed."""
    t0 = time.time()
    tag = f"round {rnd + 1 - a.warmup_rounds}" if key == "tok_s_rounds" else "warm-up"
    try:
        r = subprocess.run(t.argv("script", str(t.root / "benchmarks" / "placement_bench.py"), "--rate-only",
                                  t.plans[v], "--n-new", a.n_new, "--repeats", a.repeats,
                                  "--prompt", ",".join(map(str, prompt)), "--device", a.device,
                                  "--variant", json.dumps(variant_spec(v)[1])),
                           capture_output=True, text=True, cwd=t.dir, env=t.env(),
                           timeout=max(30.0, left) if left is not None else None)
        ok, err = r.returncode == 0, r.stderr
    except subprocess.TimeoutExpired as e:
        ok, err = False, f"timed out at the deadline\n{e.stderr or ''}"
    if not ok:
        log(f"{tag}: {v} / {t.name} failed:\n{str(err)[-3000:]}")
        cell.setdefault(key, []).append(None)
        return False
    got = json.loads(r.stdout.strip().splitlines()[-1])
    cell.setdefault(key, []).append(got["tok_s"])
    info = got.get("info", {})
    cell["info"].append({k: info.get(k) for k in ("hit_rate", "cache_bytes", "peak_rss")}
                        | {"wall_s": round(time.time() - t0, 1), "load1": round(os.getloadavg()[0], 2)})
    if cell["tokens"] is None:
        cell["tokens"] = got["tokens"]
    elif got["tokens"] != cell["tokens"]:
        cell["tokens_stable"] = False
    log(f"{tag}: {v} / {t.name}: {got['tok_s']:.1f} tok/s ({time.time() - t0:.0f} s)")
    return True


def variant_spec(name: str) -> tuple[str, dict]:
    """(which model's prompt, the --rate-only runtime options) of a variant."""
    if name == "gpu-all":
        return "synthetic", {"backend": "xla"}
    if name in ("cpu-only", "tiny-moe"):
        return ("tiny-moe" if name == "tiny-moe" else "synthetic"), {"backend": "llvm"}
    return "synthetic", {}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=DIR",
                    help="a source tree, by name (twice or more; the first is the baseline and writes the model)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/before_after"))
    ap.add_argument("--variants", help="comma-separated: gpu-all, strata-B, cache-B, cpu-only, tiny-moe "
                    "(default gpu-all,strata-25,cache-25; with --cpu-decode tiny-moe,cpu-only)")
    ap.add_argument("--cpu-decode", action="store_true",
                    help="the CPU decode benchmark: tiny-moe and cpu-only on the llvm backend, --device cpu")
    ap.add_argument("--rounds", type=int, help="default 3; with --cpu-decode 5")
    ap.add_argument("--warmup-rounds", type=int, default=0,
                    help="rounds run first and not counted (their tokens are compared too)")
    ap.add_argument("--n-new", type=int, help="greedy tokens a pass (default 48; with --cpu-decode 256)")
    ap.add_argument("--repeats", type=int, help="timed passes a measurement (default 2; with --cpu-decode 5)")
    ap.add_argument("--layers", type=int, default=0, help="the synthetic model's layers (0: placement_bench's)")
    ap.add_argument("--tiny", action="store_true", help="placement_bench's tiny model (a smoke test anywhere)")
    ap.add_argument("--router-skew", type=float, default=0.5)
    ap.add_argument("--topics", type=int, default=4, help="topic-following routing (0: none)")
    ap.add_argument("--topic-strength", default="1.0,0.2,0.03", help="EMBED,HEAD,ROUTER (make_synthetic_model.py)")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--calib-tokens", type=int, default=256)
    ap.add_argument("--hw", type=Path, default=HERE / "profiles" / "h200-2026-11-29-raw.json")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu"])
    ap.add_argument("--tiny-moe", type=Path, default=HERE.parent / "examples" / "models" / "tiny-moe")
    ap.add_argument("--prompt-seconds", type=float, default=20.0,
                    help="search the first tree's clear prompt this long (0: a fixed seeded random prompt)")
    ap.add_argument("--clear-gap", type=float, default=0.03)
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="seconds from start: a variant's round starts only if its last round would still fit")
    ap.add_argument("--max-loss", type=float, default=0.05, help="a ratio below 1 - this is marked SLOWER")
    ap.add_argument("--parallel-build", choices=["auto", "yes", "no"], default="auto",
                    help="build the trees' plans at the same time (auto: with 8 or more cores)")
    ap.add_argument("--cache", choices=["shared", "per-tree"], default="shared",
                    help="STRATA_CACHE_DIR of the trees' processes: one folder (compiled kernels and XLA "
                         "programs are keyed by their content, so a tree that compiles the same code reuses the "
                         "other's and its first round starts sooner) or one each")
    ap.add_argument("--reuse", action="store_true",
                    help="continue the work dir's last run (its plans, prompts and rounds; more rounds added) "
                         "when its settings and every tree's installed package are the same")
    ap.add_argument("--python", default=sys.executable, help="the interpreter for the trees' processes")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.cpu_decode and a.device == "auto":
        a.device = "cpu"
    # the CPU decode of a small model takes milliseconds a pass: longer passes, more of them
    a.rounds = a.rounds or (5 if a.cpu_decode else 3)
    a.n_new = a.n_new or (256 if a.cpu_decode else 48)
    a.repeats = a.repeats or (5 if a.cpu_decode else 2)
    a.variants = (a.variants or ("tiny-moe,cpu-only" if a.cpu_decode else "gpu-all,strata-25,cache-25")).split(",")
    for v in a.variants:
        head, _, b = v.partition("-")
        if v not in ("gpu-all", "cpu-only", "tiny-moe") and not (head in ("strata", "cache") and b.isdigit()):
            ap.error(f"--variants: {v!r} is none of gpu-all, strata-B, cache-B, cpu-only, tiny-moe")
    if len(a.tree) < 2 or a.rounds < 1:
        ap.error("give two or more --tree NAME=DIR and --rounds >= 1")
    a.work_dir, a.hw, a.tiny_moe = a.work_dir.resolve(), a.hw.resolve(), a.tiny_moe.resolve()
    a.trees = []
    for spec in a.tree:
        name, _, d = spec.partition("=")
        if not name or not d or not Path(d).is_dir() or name in [t.name for t in a.trees]:
            ap.error(f"--tree {spec!r}: give NAME=DIR, a folder, each name once")
        a.trees.append(Tree(name, Path(d), a.work_dir, a.python))
        if a.cache == "shared":
            a.trees[-1].cache = a.work_dir / "cache"
    return a


def build_all(a, report: dict) -> None:
    """The model (the first tree's generator) and each tree's plans from it; meanwhile, once the
    first tree's plans exist, the prompts (its prompt search, one per model)."""
    trees, variants = a.trees, a.variants
    pb_variants = [v for v in variants if v != "tiny-moe"]
    tiny_moe = "tiny-moe" in variants
    model = None
    if pb_variants:
        key = hashlib.sha256(json.dumps([a.tiny, a.layers, a.router_skew, a.topics, a.topic_strength]).encode())
        mwork = a.work_dir / "models" / key.hexdigest()[:10]
        mwork.mkdir(parents=True, exist_ok=True)
        model = Path(trees[0].run("exec", MODEL, mwork, int(a.tiny), a.layers, a.router_skew, a.topics,
                                  a.topic_strength, what="writing the model").strip().splitlines()[-1])
        report["model"] = str(model)
    parallel = a.parallel_build == "yes" or (a.parallel_build == "auto" and (os.cpu_count() or 1) >= 8)
    procs = {}
    for t in trees:
        procs[t.name] = build_plans(t, a, model, pb_variants, tiny_moe)
        if not parallel:
            finish_build(t, procs[t.name], pb_variants, tiny_moe)
    if parallel:
        log(f"building the plans of {len(trees)} trees at once")
        finish_build(trees[0], procs[trees[0].name], pb_variants, tiny_moe)
    prompts = report["prompts"] = {}
    for mname in sorted({variant_spec(v)[0] for v in variants}):
        ref = next(v for v in (["gpu-all"] if "gpu-all" in variants else []) + variants
                   if variant_spec(v)[0] == mname)
        if a.prompt_seconds <= 0:
            prompts[mname] = seeded_prompt()
            continue
        out = trees[0].run("exec", PROMPT, trees[0].plans[ref], variant_spec(ref)[1].get("backend", "auto"),
                           a.device, a.n_new, a.clear_gap, a.prompt_seconds, what=f"the prompt search on {ref}")
        got = json.loads(out.strip().splitlines()[-1])
        prompts[mname] = got["prompt"]
        report.setdefault("prompt_gap", {})[mname] = got["gap"]
        log(f"prompt for {mname} ({ref}, {trees[0].name}): smallest gap {got['gap']:.3f} x std over "
            f"{a.n_new} steps after {got['tried']} tried ({'clear' if got['gap'] >= a.clear_gap else 'not clear'})")
    if parallel:
        for t in trees[1:]:
            finish_build(t, procs[t.name], pb_variants, tiny_moe)
    for t in trees:
        report["trees"][t.name]["plans"] = {v: str(p) for v, p in t.plans.items()}


def run_rounds(a, report: dict, save, t_start: float) -> bool:
    """--warmup-rounds + --rounds rounds, each variant once per tree, the trees' order alternating
    (continuing a reused run's alternation); False when a measurement failed."""
    res, failed = report["variants"], False
    wall: dict[str, float] = {}         # a variant's last round, both trees: what its next one costs
    done = report.get("rounds_done", 0)
    for rnd in range(a.warmup_rounds + a.rounds):
        order = a.trees if (done + rnd) % 2 == 0 else a.trees[::-1]
        for v in a.variants:
            left = a.deadline - (time.time() - t_start) if a.deadline else None
            if left is not None and v in wall and left < wall[v]:
                log(f"stopping before {v}'s round: --deadline is {left:.0f} s away, its last round took "
                    f"{wall[v]:.0f} s")
                return not failed
            t_v = time.time()
            for t in order:
                failed |= not measure(t, v, done + rnd, a, report["prompts"][variant_spec(v)[0]], res[v][t.name],
                                      a.deadline - (time.time() - t_start) if a.deadline else None,
                                      "tok_s_rounds" if rnd >= a.warmup_rounds else "tok_s_warmup")
                save()
            wall[v] = time.time() - t_v
        if rnd >= a.warmup_rounds:
            report["rounds_done"] = done + rnd + 1 - a.warmup_rounds
    return not failed


def print_table(a, report: dict) -> bool:
    """The side-by-side table; whether every variant's tokens agree between trees and rounds."""
    trees, res, base = a.trees, report["variants"], a.trees[0].name
    print(f"\n{'variant':12} " + " ".join(f"{t.name + ' tok/s':>14}" for t in trees)
          + " " + " ".join(f"{t.name + '/' + base:>14}" for t in trees[1:]) + f" {'same tokens':>11}  rounds")
    all_same = True
    for v in a.variants:
        row = res[v]
        for t in trees:
            vals = [x for x in row[t.name]["tok_s_rounds"] if x is not None]
            row[t.name]["median"] = statistics.median(vals) if vals else None
        ref = row[base]
        same = ref["tokens"] is not None and all(row[t.name]["tokens"] == ref["tokens"] and row[t.name]["tokens_stable"]
                                                 for t in trees)
        row["same_tokens"] = same
        all_same &= same
        cells, verdict = [], []
        for t in trees[1:]:
            m, b = row[t.name]["median"], ref["median"]
            ratio = row[t.name]["ratio"] = m / b if m and b else None
            cells.append(f"{ratio:14.3f}" if ratio else f"{'-':>14}")
            if ratio and ratio < 1 - a.max_loss:
                verdict.append(f"{t.name} SLOWER")
        rounds = "; ".join(f"{t.name} " + "/".join("-" if x is None else f"{x:.1f}"
                                                   for x in row[t.name]["tok_s_rounds"]) for t in trees)
        med = " ".join(f"{row[t.name]['median']:14.1f}" if row[t.name]["median"] else f"{'-':>14}" for t in trees)
        hit = ", ".join(f"{t.name} hits {statistics.median(h):.1%}" for t in trees
                        if (h := [i["hit_rate"] for i in row[t.name]["info"] if i.get("hit_rate") is not None]))
        print(f"{v:12} {med} {' '.join(cells)} {'yes' if same else 'NO':>11}  {rounds}"
              + (f"  ({hit})" if hit else "") + ("  " + ", ".join(verdict) if verdict else ""))
    return all_same


def main() -> int:
    a = parse_args()
    t_start = time.time()
    a.work_dir.mkdir(parents=True, exist_ok=True)
    state = a.work_dir / "state.json"
    key = [[t.name for t in a.trees], a.variants, a.tiny, a.layers, a.router_skew, a.topics, a.topic_strength,
           a.quant, a.calib_tokens, str(a.hw), a.device, str(a.tiny_moe), a.n_new, a.repeats, a.prompt_seconds,
           a.clear_gap, a.cache]
    old = json.loads(state.read_text()) if a.reuse and state.exists() else None
    phases: dict[str, float] = {}
    report: dict = {"key": key, "trees": {}, "variants": {}, "phases_s": phases,
                    "settings": {k: str(v) for k, v in vars(a).items() if k != "trees"}}

    def save() -> None:     # after every measurement: a run cut short still leaves its figures
        for path in [state] + ([a.json] if a.json else []):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(report, indent=1))
            tmp.replace(path)

    def phase(name: str, t0: float) -> None:
        phases[name] = round(time.time() - t0, 1)
        log(f"{name}: {phases[name]:.0f} s")

    t0 = time.time()            # each tree installed into its own folder; where its code imports from
    for t in a.trees:
        digest = t.install()
        info = t.probe()
        report["trees"][t.name] = {"root": str(t.root), "site": str(t.site), "digest": digest, "imports": info,
                                   "installed_by": t.how}
        log(f"{t.name}: {t.root} installed (package digest {digest}); strata_compiler from "
            f"{info['strata_compiler']}, runtime from {info['strata_compiler.runtime']} (python {info['python']})")
    if len({report["trees"][t.name]["digest"] for t in a.trees}) < len(a.trees):
        log("note: two trees install identical packages (a run of one tree against itself measures the noise)")
    phase("install", t0)
    if old is not None and (old.get("key") != key or any(
            old["trees"].get(t.name, {}).get("digest") != report["trees"][t.name]["digest"]
            or not old["trees"][t.name].get("plans") or "prompts" not in old
            or not all((Path(p) / "plan.bin").exists() for p in old["trees"][t.name]["plans"].values())
            for t in a.trees)):
        log("--reuse: the last run had other settings, other code or lost plans; starting afresh")
        old = None
    t0 = time.time()
    if old is None:
        build_all(a, report)
        report["variants"] = {v: {t.name: {"tok_s_rounds": [], "tokens": None, "tokens_stable": True, "info": []}
                                  for t in a.trees} for v in a.variants}
    else:
        log(f"--reuse: the plans, prompts and {old.get('rounds_done', 0)} rounds of the last run")
        for k in ("model", "prompts", "prompt_gap", "variants", "rounds_done"):
            if k in old:
                report[k] = old[k]
        for t in a.trees:
            t.plans = {v: Path(p) for v, p in old["trees"][t.name]["plans"].items()}
            report["trees"][t.name]["plans"] = old["trees"][t.name]["plans"]
    phase("model, plans and prompts", t0)
    save()
    t0 = time.time()
    ok = run_rounds(a, report, save, t_start)
    phase("rounds", t0)
    same = print_table(a, report)
    loads = [i["load1"] for v in report["variants"].values() for c in v.values() if isinstance(c, dict)
             for i in c.get("info", []) if "load1" in i]
    if loads:       # another job on the machine shows here: figures of a busy machine are noise
        print(f"machine load (1 min) at the measurements: median {statistics.median(loads):.1f}, "
              f"max {max(loads):.1f}, on {os.cpu_count()} cores")
    print(f"rounds: {report.get('rounds_done', 0)} (asked {a.rounds}{' more' if old else ''}); phases (s): "
          + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()) + f"; total {time.time() - t_start:.0f}")
    report["total_s"] = round(time.time() - t_start, 1)
    save()
    if not same:
        log("greedy tokens differ between trees or between rounds")
    return 0 if same and ok else 2


if __name__ == "__main__":
    sys.exit(main())
