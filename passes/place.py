"""`place`: a cost model decides which ops and which experts run on the GPU (with `--target`).

Inputs: the tensor-level graph with its weight formats, a hardware profile (ctx.hardware: read
from `--target HW.json` or measured for `--target auto` by the compile driver; `--gpu-mem` /
`--host-mem` resize it) and, with `--calib`, each expert's routing frequency (else k/E each).

Cost model, per decode token at batch 1 (a roofline in the spirit of Fiddler and MoE-Lightning,
with the per-kernel latencies that dominate small decode steps):

    t(op on cpu) = weight bytes / CPU GEMV rate of its format + the op dispatch cost
    t(op on gpu) = weight bytes / GPU GEMV rate of its format + kernels(op) * GPU_KERNEL_S
    an expert's weight bytes count with its probability of being chosen, p_e (sum_e p_e = k)
    each switch between devices along the op order (a step starts and ends on the host): a
                   partition's round trip (at least PARTITION_S) + activation bytes / link rate

Placement units: the embedding, the head, each layer's core (attention, norms, router, shared or
dense MLP) and each routed expert. A bounded greedy over the multiple-choice knapsack (GPU bytes:
its memory less the KV cache and a reserve) takes units by time saved per GPU byte; the result
competes with structured candidates (all on the CPU; KTransformers' cores-on-GPU; llama.cpp's
-ngl) and the fastest predicted wins. A layer whose experts land on both devices becomes expert
shares (passes/expert_split.py); nodes get `device`, which select-kernels honours (`--place` rules
still override). Weights beyond `--host-mem` go to the disk tier, coldest experts first. Several
GPUs (--gpus N): spread by layer blocks or striped over a mesh; --gpu-mode auto keeps the faster.

The prediction (decode, a 512-token prefill and from what prompt length streaming the CPU-placed
experts to the GPU pays, passes/place_phases.py; bytes per tier, per-layer device and time) goes
into the graph meta `placement` for `stratac inspect`, and into placement.json with --dump-dir.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from strata_compiler.errors import PassError, UsageError
from strata_compiler.experts import mesh_devices, moe_key, share_groups
from strata_compiler.formats import get_format
from strata_compiler.hwprofile import HardwareProfile, override
from strata_compiler.ir import Graph, Level, Node, Op, make_attrs
from strata_compiler.pass_manager import PassContext, register
from strata_compiler.passes.expert_split import Share, split_experts
from strata_compiler.passes.place_phases import phases

# Latencies the byte rates do not capture (seconds), fitted to measured plans (BENCHMARKS.md).
# GPU: one kernel launch at decode. CPU: the llvm executor's dispatch of one op. PARTITION_S:
# entering another device's partition (a jitted call, the activation's trip through host memory).
GPU_KERNEL_S = 3.3e-6
CPU_OP_S = 12e-6
# Kernel calls the llvm executor makes per op at decode (q8 activation quantization, routing
# pairs, the two MoE halves, ...): the dispatch cost counts per call.
CPU_CALLS = {Op.LINEAR: 2, Op.FUSED_ATTENTION: 3, Op.ROUTE: 1, Op.MOE_FFN: 5, Op.EMBED: 1, Op.RMS_NORM: 1}
PARTITION_S = 60e-6
# A real partition switch costs more than the probe's tiny jitted call: it launches a layer's
# kernels, passes its weight arrays and the donated KV cache from the host, and wakes the CPU
# pool's workers. Plans with few switches barely depend on it.
SWITCH_FACTOR = 2.4
# Decode steps of a single-GPU plan run as one jitted program in which CPU partitions are host
# calls (runtime/fused_step.py): no jitted call per switch, a switch costs PARTITION_S's floor.
FUSED_SWITCH_FACTOR = 0.35
# The CPU's share of a mixed plan runs at this fraction of the probe's rates: beside the GPU
# runtime's threads, on a layer's few cold experts, inside host calls (a plan without GPU work
# keeps them). Fitted with FUSED_SWITCH_FACTOR (benchmarks/refit_cost_model.py).
CPU_MIXED_EFFICIENCY = 0.9
# Fused decode steps overlap a split layer's CPU and GPU experts (runtime/fused_step.py): the
# layer's MoE costs the longer of its two shares.
OVERLAP = True
# One all-reduce of a token's activation among the GPUs of a mesh, inside the XLA computation,
# with what sharding adds around it (benchmarks/multi_gpu.py).
ALLREDUCE_S = 51e-6
GPU_RESERVE = 0.10              # of the GPU budget: XLA's workspace, fragmentation


def cpu_op_s(hw) -> float:
    """One CPU kernel call's fixed cost: CPU_OP_S, or the profile's measured bare dispatch when
    that is larger (the bare figure leaves out the executor's own work per call)."""
    return max(getattr(hw.host, "op_seconds", None) or 0.0, CPU_OP_S)


def partition_s(hw, fused: bool = False) -> float:
    """One partition switch (a jitted call, activations in and out through the host): the
    profile's measured tiny round trip times SWITCH_FACTOR when it has one, else PARTITION_S;
    `fused`: a switch inside a decode step run as one program (FUSED_SWITCH_FACTOR)."""
    gpu = hw.gpu
    measured = getattr(gpu, "partition_seconds", None) if gpu is not None else None
    factor = FUSED_SWITCH_FACTOR if fused else SWITCH_FACTOR
    return max(measured * factor, PARTITION_S) if measured else PARTITION_S
KERNELS = {Op.LINEAR: 1, Op.FUSED_ATTENTION: 8, Op.ROUTE: 2, Op.MOE_FFN: 5, Op.EMBED: 1, Op.RMS_NORM: 1}


@dataclass
class Unit:
    """What moves to the GPU as one: nodes (a core, embed, head) or one expert of a layer."""

    name: str
    nodes: tuple[int, ...] = ()
    expert: tuple[int, int] | None = None     # (moe node id, expert)
    gpu_bytes: int = 0
    cpu_s: float = 0.0
    gpu_s: float = 0.0
    layer: int = -1
    prob: float = 1.0
    cpu_pf: float = 0.0                       # prefill of `prefill_tokens` tokens, seconds
    gpu_pf: float = 0.0

    @property
    def gain(self) -> float:
        return self.cpu_s - self.gpu_s


@dataclass
class Placement:
    gpu_units: set[str] = field(default_factory=set)
    label: str = ""


def _bytes(g: Graph, name: str, experts: int | None = None) -> tuple[str, int]:
    w = g.weight(name)
    n = get_format(w.fmt).nbytes(w.shape, w.group_size or 32)
    return w.fmt, (n // w.shape[0] if experts is not None else n)


def _layer_of(g: Graph) -> dict[int, int]:
    """Node id -> transformer layer: -1 before the first (embedding), n_layers for the graph's
    outputs (final norm + lm_head, fused into one linear), else the layer of the attention it
    follows — or feeds, for a layer's qkv projection."""
    users = g.users()
    attn_layer = {n.id: int(n.attr("layer")) for n in g.nodes if n.op is Op.FUSED_ATTENTION}
    n_layers = max(attn_layer.values(), default=-1) + 1
    out, layer = {}, -1
    for n in g.nodes:
        feeds = [attn_layer[u] for u in users.get(n.id, []) if u in attn_layer]
        if n.id in attn_layer:
            layer = attn_layer[n.id]
        elif feeds:
            layer = feeds[0]
        out[n.id] = n_layers if n.id in g.outputs else layer
    return out


def expert_probabilities(g: Graph, calib) -> dict[int, np.ndarray]:
    """moe_ffn node id -> p_e, the chance each expert is chosen for a token (sum = k)."""
    stats = calib.expert_stats() if calib is not None else {}
    out, i = {}, 0
    for n in g.nodes:
        if n.op is not Op.MOE_FFN:
            continue
        E = g.weight(n.weight("down")).shape[0]
        route = g.node(n.args[1])
        k = int(route.attr("k", 0)) if route.has_attr("k") else max(1, E // 4)
        if i in stats:
            p = np.asarray(stats[i]["freq"], np.float64)
            p = p if p.sum() > 0 else np.full(E, k / E)
        else:
            p = np.full(E, k / E)
        out[n.id] = p
        i += 1
    return out


def _matmul_s(hw, dev: str, fmt: str, nbytes: int, flops: float) -> float:
    """A prefill matrix product: bound by its weight bytes or by its flops, whichever is slower."""
    if dev == "cpu":
        return max(hw.cpu_gemv_seconds(fmt, nbytes), hw.cpu_matmul_seconds(fmt, flops) if flops else 0.0)
    return max(hw.gpu_gemv_seconds(fmt, nbytes), hw.gpu_matmul_seconds(flops) if flops else 0.0)


def build_units(g: Graph, hw, probs: dict[int, np.ndarray],
                prefill_tokens: int = 512) -> tuple[list[Unit], dict[int, str]]:
    """The placement units with their times on each device (per decode token, and for a prefill
    of `prefill_tokens`); node id -> unit name (expert nodes map to '': their experts are units
    of their own)."""
    layers = _layer_of(g)
    n_layers = max(layers.values(), default=0)
    unit_of: dict[int, str] = {}
    units: dict[str, Unit] = {}
    for n in g.nodes:
        lay = layers[n.id]
        if n.op is Op.MOE_FFN:
            unit_of[n.id] = ""
            p = probs[n.id]
            # (format, bytes of one expert, its elements) per weight: the same for every expert
            roles = [(*_bytes(g, w, experts=0), float(np.prod(g.weight(w).shape[1:]))) for _, w in n.weights]
            T = prefill_tokens
            for e in range(len(p)):
                cpu = gpu = cpu_pf = gpu_pf = 0.0
                nb = 0
                touched = 1.0 - (1.0 - min(float(p[e]), 1.0)) ** T    # some prompt token chose it
                for fmt, b, size in roles:
                    flops = 2.0 * T * float(p[e]) * size
                    cpu += hw.cpu_gemv_seconds(fmt, b)
                    cpu_pf += touched * _matmul_s(hw, "cpu", fmt, b, flops)
                    if hw.gpu is not None:
                        gpu += hw.gpu_gemv_seconds(fmt, b)
                        gpu_pf += touched * _matmul_s(hw, "gpu", fmt, b, flops)
                    nb += b
                units[f"L{lay}.e{e}"] = Unit(f"L{lay}.e{e}", expert=(n.id, e), gpu_bytes=nb, cpu_s=p[e] * cpu,
                                             gpu_s=p[e] * gpu, layer=lay, prob=float(p[e]), cpu_pf=cpu_pf,
                                             gpu_pf=gpu_pf)
            continue
        name = "embed" if lay < 0 else ("head" if lay >= n_layers else f"L{lay}.core")
        u = units.setdefault(name, Unit(name, layer=lay))
        u.nodes += (n.id,)
        unit_of[n.id] = name
        for role, w in n.weights:
            fmt, b = _bytes(g, w)
            u.gpu_bytes += b
            gather = n.op is Op.EMBED
            read = b // g.weight(w).shape[0] if gather else b   # a gather reads one row
            matrix = n.op is Op.LINEAR and role == "w"
            flops = 2.0 * prefill_tokens * float(np.prod(g.weight(w).shape)) if matrix else 0.0
            u.cpu_s += hw.cpu_gemv_seconds(fmt, read)
            u.cpu_pf += hw.cpu_gemv_seconds(fmt, min(b, read * prefill_tokens) if gather else b) if not matrix \
                else _matmul_s(hw, "cpu", fmt, b, flops)
            if hw.gpu is not None:
                u.gpu_s += hw.gpu_gemv_seconds(fmt, read)
                u.gpu_pf += hw.gpu_gemv_seconds(fmt, min(b, read * prefill_tokens) if gather else b) if not matrix \
                    else _matmul_s(hw, "gpu", fmt, b, flops)
        if n.weights or n.op in KERNELS:
            u.cpu_s += CPU_CALLS.get(n.op, 1) * cpu_op_s(hw)
            u.gpu_s += KERNELS.get(n.op, 1) * GPU_KERNEL_S
            u.cpu_pf += CPU_CALLS.get(n.op, 1) * cpu_op_s(hw)
            u.gpu_pf += KERNELS.get(n.op, 1) * GPU_KERNEL_S
    return list(units.values()), unit_of


class _Timeline:
    """The op order with each op's times precomputed, so a placement is priced in one pass: op
    times on their devices, plus a partition switch (and the activation's copy) wherever
    consecutive ops run on different devices."""

    def __init__(self, g: Graph, units: list[Unit], unit_of: dict[int, str], hw, prefill_tokens: int = 0) -> None:
        """prefill_tokens > 0: the times of a prefill of that many tokens (Unit.cpu_pf/gpu_pf),
        activations of that many rows at each switch; else one decode token."""
        by_name = {u.name: u for u in units}
        pf = prefill_tokens > 0
        self.cpu_op = cpu_op_s(hw)
        experts: dict[int, list[Unit]] = {}
        for u in units:
            if u.expert:
                experts.setdefault(u.expert[0], []).append(u)
        self.steps = []
        # a step begins and ends on the host (token ids in, logits out): a plan ending on the GPU
        # pays a switch for its logits, one starting there for its ids (each GPU partition is a
        # jitted call whose results the host waits for)
        out = g.node(g.outputs[0])
        # decode on one GPU runs as one program (runtime/fused_step.py); prefill and meshes do not
        fused = not pf and mesh_devices(g) <= 1
        # fused decode steps run a layer's CPU experts beside its GPU experts (fused_step.py
        # overlap_mode) when the layer reaches its GPU share on the GPU: max, not sum
        self.overlap = fused and OVERLAP
        self.end_switch = _switch_s(hw, g, out, max(1, prefill_tokens), nbytes=out.type.bytes_per_token(),
                                    fused=fused)
        for n in g.nodes:
            if n.op is Op.INPUT_IDS:
                continue
            switch = _switch_s(hw, g, n, max(1, prefill_tokens), fused=fused)
            if n.op is Op.MOE_FFN:
                exp = experts[n.id]
                self.steps.append((None, [(u.name, u.cpu_pf if pf else u.cpu_s, u.gpu_pf if pf else u.gpu_s)
                                          for u in exp], switch, exp[0].layer))
            else:
                u = by_name[unit_of[n.id]]
                share = 1.0 / max(1, len(u.nodes))
                c, gg = (u.cpu_pf, u.gpu_pf) if pf else (u.cpu_s, u.gpu_s)
                self.steps.append((u.name, (c * share, gg * share), switch, u.layer))

    def predict(self, gpu: set[str]) -> dict:
        t, per_layer, prev, switches = 0.0, {}, "cpu", 0
        slow = 1.0 / CPU_MIXED_EFFICIENCY if gpu else 1.0      # CPU time beside GPU work
        for name, times, switch, lay in self.steps:
            if name is None:                        # a MoE layer: its GPU share, then its CPU share
                g_s = [gs for nm, _, gs in times if nm in gpu]
                c_s = [cs for nm, cs, _ in times if nm not in gpu]
                g_t = sum(g_s) + KERNELS[Op.MOE_FFN] * GPU_KERNEL_S if g_s else 0.0
                c_t = slow * (sum(c_s) + CPU_CALLS[Op.MOE_FFN] * self.cpu_op) if c_s else 0.0
                dt = max(g_t, c_t) if g_s and c_s and prev == "gpu" and self.overlap else g_t + c_t
                devs = (["gpu"] if g_s else []) + (["cpu"] if c_s else [])
            else:
                d = "gpu" if name in gpu else "cpu"
                dt = times[1] if d == "gpu" else slow * times[0]
                devs = [d]
            for d in devs:
                if prev is not None and d != prev:
                    switches += 1
                    dt += switch
                prev = d
            t += dt
            per_layer[lay] = per_layer.get(lay, 0.0) + dt
        if prev == "gpu":
            switches += 1
            t += self.end_switch
            per_layer[lay] = per_layer.get(lay, 0.0) + self.end_switch
        return {"seconds": t, "tok_s": 1.0 / t if t > 0 else 0.0, "switches": switches, "per_layer": per_layer}


def _switch_s(hw, g: Graph, n: Node, tokens: int = 1, nbytes: int | None = None, fused: bool = False) -> float:
    """A partition switch before node n: the round trip plus its input's (or nbytes per token's)
    copy, half each way on average."""
    if nbytes is None:
        nbytes = g.node(n.args[0]).type.bytes_per_token() if n.args else 0
    nbytes *= tokens
    link = hw.h2d_seconds(nbytes) + hw.d2h_seconds(nbytes) if hw.gpu is not None else 0.0
    return partition_s(hw, fused) + link / 2


def kv_bytes(g: Graph, ctx_tokens: int) -> int:
    """f32 K and V for every attention layer at `ctx_tokens` tokens (batch 1)."""
    n = 0
    for node in g.nodes:
        if node.op is Op.FUSED_ATTENTION:
            n += 2 * ctx_tokens * int(node.attr("n_kv_heads")) * int(node.attr("head_dim")) * 4
    return n


# --place-strategy NAME -> the candidate it forces (auto: the fastest predicted, then the local search)
STRATEGIES = {"cpu": "all on cpu", "greedy": "cost model (greedy by time saved per byte)",
              "ktransformers": "dense on gpu, experts on cpu", "hot-experts": "dense on gpu, hottest experts on gpu",
              "ngl": "first layers on gpu (-ngl)"}


def solve(g: Graph, units: list[Unit], unit_of: dict[int, str], hw, budget: int,
          strategy: str = "auto") -> tuple[Placement, dict, list]:
    """The bounded greedy and the structured candidates; the fastest predicted that fits (or the
    one `strategy` names, as it is)."""
    candidates: list[Placement] = [Placement(set(), "all on cpu")]
    if hw.gpu is not None and budget > 0:
        order = sorted((u for u in units if u.gain > 0), key=lambda u: u.gain / max(u.gpu_bytes, 1), reverse=True)
        used, pick = 0, set()
        for u in order:
            if used + u.gpu_bytes <= budget:
                pick.add(u.name)
                used += u.gpu_bytes
        candidates.append(Placement(pick, "cost model (greedy by time saved per byte)"))
        cores = [u for u in units if not u.expert]
        cb = sum(u.gpu_bytes for u in cores)
        if cb <= budget:
            candidates.append(Placement({u.name for u in cores}, "dense on gpu, experts on cpu"))
            # greedy over experts only, on top of the cores
            used, pick = cb, {u.name for u in cores}
            for u in sorted((u for u in units if u.expert and u.gain > 0), key=lambda u: u.gain / max(u.gpu_bytes, 1),
                            reverse=True):
                if used + u.gpu_bytes <= budget:
                    pick.add(u.name)
                    used += u.gpu_bytes
            candidates.append(Placement(pick, "dense on gpu, hottest experts on gpu"))
        # whole layers from the first (llama.cpp's -ngl), embedding on the cpu, head on the gpu if it fits
        by_layer: dict[int, list[Unit]] = {}
        for u in units:
            by_layer.setdefault(u.layer, []).append(u)
        used, pick = 0, set()
        head = [u for u in units if u.name == "head"]
        if head and head[0].gpu_bytes <= budget:
            pick.add("head")
            used += head[0].gpu_bytes
        for lay in sorted(k for k in by_layer if 0 <= k and k < 10**9):
            us = [u for u in by_layer[lay] if u.name not in ("embed", "head")]
            b = sum(u.gpu_bytes for u in us)
            if used + b > budget:
                break
            pick.update(u.name for u in us)
            used += b
        candidates.append(Placement(pick, "first layers on gpu (-ngl)"))
    tl = _Timeline(g, units, unit_of, hw)
    size = {u.name: u.gpu_bytes for u in units}
    scored = []
    for c in candidates:
        if sum(size[n] for n in c.gpu_units) > budget and c.gpu_units:
            continue
        scored.append((tl.predict(c.gpu_units), c))
    if strategy != "auto":
        forced = [x for x in scored if x[1].label == STRATEGIES[strategy]]
        if not forced:
            raise UsageError(f"--place-strategy {strategy}: that placement does not fit the GPU budget "
                             f"({budget / 2**20:.0f} MiB after the KV cache and reserve) or there is no GPU; "
                             f"give more --gpu-mem or use auto")
        return forced[0][1], forced[0][0], [(c.label, p["tok_s"]) for p, c in scored]
    best = min(scored, key=lambda x: x[0]["seconds"])
    if hw.gpu is not None and budget > 0:
        ref = improve(tl, units, size, best[1].gpu_units, budget)
        p = tl.predict(ref)
        scored.append((p, Placement(ref, f"local search from '{best[1].label}'")))
        best = min(scored, key=lambda x: x[0]["seconds"])
    return best[1], best[0], [(c.label, p["tok_s"]) for p, c in scored]


def improve(tl: "_Timeline", units: list[Unit], size: dict[str, int], start: set[str], budget: int,
            rounds: int = 64) -> set[str]:
    """Hill climbing over coarse moves — a layer's core, all its experts, its hottest / coldest
    half of experts, the embedding, the head — each taken on or off the GPU; the best improving
    move that fits is applied until none improves (device switches make the greedy's per-unit
    view miss whole-layer effects)."""
    groups: dict[str, list[str]] = {}
    for u in units:
        if u.expert:
            groups.setdefault(f"L{u.layer}.experts", []).append(u.name)
        else:
            groups[u.name] = [u.name]
    for key in [k for k in groups if k.endswith(".experts")]:
        hot = sorted(groups[key], key=lambda n: -next(u.prob for u in units if u.name == n))
        half = max(1, len(hot) // 2)
        groups[key + ".hot"], groups[key + ".cold"] = hot[:half], hot[half:]
        lay = key.split(".")[0]
        if lay + ".core" in groups:
            groups[lay + ".all"] = groups[lay + ".core"] + groups[key]
    cur = set(start)
    cur_t = tl.predict(cur)["seconds"]
    used = sum(size[n] for n in cur)
    for _ in range(rounds):
        best = None
        for members in groups.values():
            for on in (True, False):
                new = cur | set(members) if on else cur - set(members)
                if new == cur:
                    continue
                b = used + sum(size[n] for n in set(members) - cur) if on else used - sum(size[n] for n in cur & set(members))
                if b > budget:
                    continue
                t = tl.predict(new)["seconds"]
                if t < cur_t * (1 - 1e-9) and (best is None or t < best[0]):
                    best = (t, new, b)
        if best is None:
            break
        cur_t, cur, used = best
    return cur


def apply(g: Graph, units: list[Unit], unit_of: dict[int, str], gpu: set[str], calib=None,
          cache: bool = False, gpus: int = 1, mode: str = "layer") -> Graph:
    """Set each node's device; split layers whose experts are on both devices into two shares —
    or, with `cache`, into a GPU expert cache: the GPU share's slots (first the placed experts)
    and the whole layer on the CPU for the rest (runtime/expert_cache.py swaps experts in)."""
    shares = {}
    experts_of: dict[int, list[Unit]] = {}
    for u in units:
        if u.expert:
            experts_of.setdefault(u.expert[0], []).append(u)
    dev_of: dict[int, str] = {}
    for n in g.nodes:
        if n.op is Op.MOE_FFN:
            exp = experts_of[n.id]
            ids = tuple(n.attr("experts", ())) or tuple(range(len(exp)))
            on = [ids[u.expert[1]] for u in exp if u.name in gpu]
            off = [ids[u.expert[1]] for u in exp if u.name not in gpu]
            if gpus > 1 and mode == "stripe" and on:
                # stripe: the layer's GPU experts dealt over the GPUs, hottest first
                hot = sorted(on, key=lambda e: -next(u.prob for u in exp if ids[u.expert[1]] == e))
                parts = [Share(tuple(sorted(hot[k::gpus])), device=f"gpu:{k}") for k in range(gpus) if hot[k::gpus]]
                shares[moe_key(n)] = parts + ([Share(tuple(off), device="cpu")] if off else [])
            elif on and off and cache and not n.attr("experts", ()):
                # the calibrated probabilities seed the cache's scores (runtime/expert_cache.py)
                prob = {ids[u.expert[1]]: u.prob for u in exp}
                prior = tuple(round(float(prob[e]), 6) for e in ids) if calib is not None else ()
                shares[moe_key(n)] = [Share(tuple(on), device="gpu"), Share(ids, device="cpu", whole=True, prior=prior)]
            elif on and off:
                shares[moe_key(n)] = [Share(tuple(on), device="gpu"), Share(tuple(off), device="cpu")]
            dev_of[n.id] = "gpu" if on and not off else "cpu"
        elif n.op is Op.INPUT_IDS:
            continue
        else:
            dev_of[n.id] = "gpu" if unit_of[n.id] in gpu else "cpu"
    first = next((n for n in g.nodes if n.op is Op.EMBED), None)
    nodes = tuple(replace(n, device=dev_of.get(n.id, dev_of.get(first.id, "cpu") if first else "cpu"))
                  for n in g.nodes)
    g = g.with_(nodes=nodes)
    g = split_experts(g, shares, calib) if shares else g
    if gpus > 1:
        g = _number_gpus(g, gpus, mode)
    return g


def stripe_mesh_seconds(g: Graph, units: list[Unit], gpu: set[str], gpus: int) -> tuple[int, float]:
    """(all-reduces, seconds) a striped plan adds to the one-GPU timeline when it runs as one
    mesh (backends/xla/mesh.py): each GPU reads only its share of a layer's experts, so the
    experts' GPU time shrinks to 1/gpus, and each split layer pays one all-reduce (ALLREDUCE_S);
    the dense parts run replicated, in parallel, at the one-GPU time."""
    layers = len(share_groups(g, [n for n in g.nodes if n.device.startswith("gpu")]))
    expert_s = sum(u.gpu_s for u in units if u.expert and u.name in gpu)
    return layers, layers * ALLREDUCE_S - (1 - 1 / gpus) * expert_s


def gpu_hops(g: Graph, hw) -> tuple[int, float]:
    """(hops, seconds) per decode token between different GPUs along the op order of a placed
    graph: each hop is another device's jitted call (a partition switch) plus the activation's
    trip between the GPUs (through host memory: device->host, then host->device)."""
    hops, t, prev = 0, 0.0, None
    for n in g.nodes:
        if not n.device.startswith("gpu"):
            prev = None if n.device == "cpu" else prev
            continue
        if prev is not None and n.device != prev:
            nbytes = g.node(n.args[0]).type.bytes_per_token() if n.args else 0
            hops += 1
            t += partition_s(hw) + hw.d2h_seconds(nbytes) + hw.h2d_seconds(nbytes)
        prev = n.device
    return hops, t


def _number_gpus(g: Graph, gpus: int, mode: str) -> Graph:
    """Several GPUs: `layer` gives each GPU a contiguous block of layers (llama.cpp's split by
    layer); `stripe` keeps the dense parts on GPU 0 and the experts already dealt per GPU."""
    layers = _layer_of(g)
    n_layers = max(max(layers.values(), default=0), 1)

    def index(n: Node) -> str:
        if n.device != "gpu":
            return n.device
        if mode == "stripe":
            return "gpu:0"
        lay = min(max(layers[n.id], 0), n_layers - 1)
        return f"gpu:{lay * gpus // n_layers}"

    return g.with_(nodes=tuple(replace(n, device=index(n)) for n in g.nodes))


def _disk_units(units: list[Unit], gpu: set[str], host_bytes: int, host_cap: int) -> list[str]:
    """The CPU experts, coldest first, that go to the disk tier so that the rest fits `--host-mem`."""
    disk = []
    if host_bytes > host_cap:
        over = host_bytes - host_cap
        for u in sorted((u for u in units if u.expert and u.name not in gpu), key=lambda u: u.prob):
            if over <= 0:
                break
            disk.append(u.name)
            over -= u.gpu_bytes
    return disk


def _per_layer_summary(units: list[Unit], seconds: dict[int, float], gpu: set[str], disk: list[str],
                       hw: HardwareProfile) -> dict:
    """The placement summary's `per_layer` (-1: the embedding, last: the head), what `stratac inspect` shows."""
    n_layers = max((u.layer for u in units), default=0)
    return {str(k): {"seconds": v,
                     "gpu_expert_ids": sorted(u.expert[1] for u in units if u.expert and u.layer == k
                                              and u.name in gpu),
                     "disk_expert_ids": sorted(u.expert[1] for u in units if u.expert and u.layer == k
                                               and u.name in disk),
                     "seconds_all_cpu": sum(u.cpu_s for u in units if u.layer == k),
                     "seconds_all_gpu": (sum(u.gpu_s for u in units if u.layer == k)
                                         if hw.gpu is not None else None),
                     "gpu_experts": sum(1 for u in units if u.expert and u.layer == k and u.name in gpu),
                     "experts": sum(1 for u in units if u.expert and u.layer == k),
                     "core": "gpu" if ({-1: "embed", n_layers: "head"}.get(k, f"L{k}.core")
                                        in gpu) else "cpu"}
            for k, v in sorted(seconds.items())}


@register("place", Level.TENSOR)
def place_pass(g: Graph, ctx: PassContext) -> Graph:
    """With --target: a device per op and per expert from the cost model (GPU budget, profile)."""
    opts = ctx.options
    if not opts.target:
        return g
    hw = ctx.hardware
    if hw is None:      # the compile driver reads the profile (and measures `--target auto`)
        if opts.target == "auto":
            raise PassError("place: --target auto needs the profile the compile driver measures "
                            "(driver.compile_model) in the pass context's `hardware`")
        hw = HardwareProfile.from_json(Path(opts.target))
    hw = override(hw, gpu_mem=opts.gpu_mem or None, host_mem=opts.host_mem or None)
    calib = ctx.analyses.calibration
    probs = expert_probabilities(g, calib)
    units, unit_of = build_units(g, hw, probs, opts.plan_prompt)
    kv = kv_bytes(g, min(opts.plan_ctx, int(g.meta_value("max_position", opts.plan_ctx))))
    gpu_mem = hw.gpu.memory_bytes if hw.gpu is not None else 0
    budget = max(0, int(gpu_mem * opts.gpus * (1 - GPU_RESERVE)) - kv) if hw.gpu is not None else 0
    choice, pred, tried = solve(g, units, unit_of, hw, budget, opts.place_strategy)
    if opts.gpus > 1 and opts.expert_cache:
        raise UsageError("--gpus > 1 and --expert-cache conflict: the expert cache works on one GPU for now")
    first_mode = "layer" if opts.gpu_mode == "auto" else opts.gpu_mode
    out = apply(g, units, unit_of, choice.gpu_units, calib, cache=opts.expert_cache, gpus=opts.gpus, mode=first_mode)
    modes = {}
    if opts.gpus > 1:       # each mode's GPU-to-GPU hops priced on top of the one-GPU timeline
        for mode in (("layer", "stripe") if opts.gpu_mode == "auto" else (opts.gpu_mode,)):
            cand = out if mode == first_mode else \
                apply(g, units, unit_of, choice.gpu_units, calib, gpus=opts.gpus, mode=mode)
            if mode == "stripe" and mesh_devices(cand):
                hops, dt = stripe_mesh_seconds(cand, units, choice.gpu_units, opts.gpus)
            else:
                hops, dt = gpu_hops(cand, hw)
            modes[mode] = {"graph": cand, "hops": hops, "seconds": max(pred["seconds"] + dt, 1e-9)}
        best = min(modes, key=lambda m: modes[m]["seconds"])
        out = modes[best]["graph"]
        pred = dict(pred, seconds=modes[best]["seconds"], tok_s=1.0 / modes[best]["seconds"])
    gpu_bytes = sum(u.gpu_bytes for u in units if u.name in choice.gpu_units)
    host_bytes = sum(u.gpu_bytes for u in units if u.name not in choice.gpu_units)
    host_cap = hw.host.ram_available_bytes
    disk = _disk_units(units, choice.gpu_units, host_bytes, host_cap)
    pf = _Timeline(g, units, unit_of, hw, prefill_tokens=opts.plan_prompt).predict(choice.gpu_units)
    summary = {
        "predicted_tok_s": round(pred["tok_s"], 2), "choice": choice.label,
        "predicted_prefill_tok_s": round(opts.plan_prompt * pf["tok_s"], 1), "prefill_tokens": opts.plan_prompt,
        "candidates": {label: round(t, 2) for label, t in tried},
        "gpu_budget_bytes": budget, "kv_bytes": kv, "gpu_bytes": gpu_bytes,
        "host_bytes": host_bytes - sum(u.gpu_bytes for u in units if u.name in disk),
        "disk_bytes": sum(u.gpu_bytes for u in units if u.name in disk), "disk_units": disk,
        "per_layer": _per_layer_summary(units, pred["per_layer"], choice.gpu_units, disk, hw),
        "profile": {"cpu": hw.host.cpu, "gpu": hw.gpu and hw.gpu.name, "gpu_mem": gpu_mem, "host_mem": host_cap},
    }
    if modes:
        summary.update(gpus=opts.gpus, gpu_mode=best, gpu_modes={m: {
            "hops_per_token": v["hops"], "predicted_tok_s": round(1.0 / v["seconds"], 2)} for m, v in modes.items()})
    summary["phases"] = phases(summary, out, units, lambda T: _Timeline(g, *build_units(g, hw, probs, T), hw,
                                                                        prefill_tokens=T), choice.gpu_units, hw)
    ctx.analyses.placement = summary
    if ctx.dump_dir is not None:
        ctx.dump_dir.mkdir(parents=True, exist_ok=True)
        (ctx.dump_dir / "placement.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    meta = dict(out.meta, placement=json.dumps(summary, sort_keys=True, separators=(",", ":")))
    return out.with_(meta=make_attrs(**meta))
