"""`cluster-experts`: group each MoE layer's experts into clusters that tokens use together.

The calibrate pass (--calib) records which experts every calibration token chose at every MoE
layer (`Calibration.trace`). From that trace this pass builds, per MoE layer,

  * the co-activation matrix C[e, f]: tokens that chose both e and f (C[e, e]: tokens that
    chose e), and between consecutive MoE layers the transition matrix T[e, f]: tokens that
    chose e at one layer and f at the next;
  * a partition of the layer's experts into clusters of about `cluster_size` experts (default
    E/8, at least 2): networkx's Louvain communities of the co-activation graph, packed into
    balanced sizes (clusters are the unit an expert cache moves), then improved by swapping
    experts between clusters while that puts more co-activation weight inside clusters.

Result: ctx.analyses.expert_clusters = {moe layer: [[expert ids], ...]} (MoE layers counted
in graph order, as in the calibration summary), and the graph meta `expert_clusters`, a tuple
over MoE layers of tuples of clusters. With --dump-dir, expert_clusters.json there holds the
clusters, the matrices and the metrics of `layer_metrics`: the share of co-activated expert
pairs that fall inside a cluster (against random partitions of the same sizes) and the bytes an
LRU expert cache would move fetching single experts or whole clusters.

Without --calib, or for a model without MoE layers, the pass does nothing. It changes no op or
weight: clustering never changes what the plan computes.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict

import numpy as np

from strata_compiler.formats import get_format
from strata_compiler.ir import Graph, Level, Op, make_attrs
from strata_compiler.pass_manager import PassContext, register

WEIGHTINGS = ("count", "lift")
CAPACITIES = (0.25, 0.5)   # cache sizes of the prefetch simulation, as shares of a layer's experts


# --- matrices ---------------------------------------------------------------------------------

def _onehot(trace: np.ndarray, E: int) -> np.ndarray:
    """f64[tokens, E]: 1 where the token chose the expert (-1 entries, padding, are ignored)."""
    m = np.zeros((trace.shape[0], E))
    rows, cols = np.nonzero(trace >= 0)
    m[rows, trace[rows, cols]] = 1.0
    return m


def coactivation(trace: np.ndarray, E: int) -> np.ndarray:
    """i64[E, E], symmetric: C[e, f] = tokens that chose both e and f; C[e, e] = tokens that chose e."""
    m = _onehot(trace, E)
    return np.rint(m.T @ m).astype(np.int64)


def transitions(trace: np.ndarray, trace_next: np.ndarray, E: int, E_next: int) -> np.ndarray:
    """i64[E, E_next]: T[e, f] = tokens that chose e at this layer and f at the next."""
    return np.rint(_onehot(trace, E).T @ _onehot(trace_next, E_next)).astype(np.int64)


def edge_weights(C: np.ndarray, tokens: int, weighting: str = "count") -> np.ndarray:
    """f64[E, E], zero diagonal: the co-activation graph's edge weights. "count": C itself;
    "lift": C over its expectation if experts were chosen independently (C[e,e] C[f,f] / tokens)."""
    W = C.astype(np.float64).copy()
    np.fill_diagonal(W, 0.0)
    if weighting == "lift":
        n = np.diag(C).astype(np.float64)
        expect = np.outer(n, n) / max(tokens, 1)
        W = np.divide(W, expect, out=np.zeros_like(W), where=expect > 0)
    elif weighting != "count":
        raise ValueError(f"unknown weighting {weighting!r}; use one of {WEIGHTINGS}")
    return W


# --- clustering -------------------------------------------------------------------------------

def default_cluster_size(E: int) -> int:
    return max(2, round(E / 8))


def balanced_sizes(E: int, size: int) -> list[int]:
    """Cluster sizes for E experts at about `size` each, differing by at most one, none below 2
    (unless E is 1)."""
    m = max(1, min(round(E / max(size, 1)), E // 2))
    return [E // m + (i < E % m) for i in range(m)]


def _communities(W: np.ndarray, method: str, seed: int) -> list[list[int]]:
    import networkx as nx

    E = W.shape[0]
    G = nx.Graph()
    G.add_nodes_from(range(E))
    ii, jj = np.nonzero(np.triu(W, 1) > 0)
    G.add_weighted_edges_from((int(i), int(j), float(W[i, j])) for i, j in zip(ii, jj))
    if G.number_of_edges() == 0:
        return [[e] for e in range(E)]
    if method == "louvain":
        comms = nx.community.louvain_communities(G, weight="weight", seed=seed)
    elif method == "greedy":
        comms = nx.community.greedy_modularity_communities(G, weight="weight")
    else:
        raise ValueError(f"unknown community method {method!r}; use louvain or greedy")
    return [sorted(c) for c in comms]


def _pack(comms: list[list[int]], W: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Labels that keep each community's members together as far as the sizes allow: the
    communities, largest first, each member listed by its weight into its community, are laid
    end to end and cut into clusters of `sizes`."""
    order = []
    for c in sorted(comms, key=lambda c: (-len(c), c[0])):
        strength = W[np.ix_(c, c)].sum(axis=1)
        order += [c[i] for i in np.argsort(-strength, kind="stable")]
    labels = np.empty(W.shape[0], np.int64)
    start = 0
    for label, s in enumerate(sizes):
        labels[order[start:start + s]] = label
        start += s
    return labels


def _refine(W: np.ndarray, labels: np.ndarray, max_swaps: int | None = None) -> np.ndarray:
    """Swap pairs of experts between clusters, best swap first, while one raises the weight
    inside clusters (sizes stay as they are)."""
    labels = labels.copy()
    E = W.shape[0]
    m = int(labels.max()) + 1
    tol = 1e-12 * max(float(W.sum()), 1.0)
    for _ in range(max_swaps if max_swaps is not None else 4 * E * E):
        S = W @ np.eye(m)[labels]                   # [E, m]: each expert's weight into each cluster
        own = S[np.arange(E), labels]
        G = S[:, labels] - own[:, None]              # G[a, b]: a's gain from joining b's cluster
        gain = G + G.T - 2 * W
        gain[labels[:, None] == labels[None, :]] = -np.inf
        a, b = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if not gain[a, b] > tol:
            break
        labels[a], labels[b] = labels[b], labels[a]
    return labels


def cluster_layer(C: np.ndarray, tokens: int, size: int | None = None, *, weighting: str = "count",
                  method: str = "louvain", refine: bool = True, seed: int = 0) -> list[list[int]]:
    """Partition the E experts of one layer (co-activation matrix C over `tokens` tokens) into
    balanced clusters of about `size` experts. Every expert is in exactly one cluster; clusters
    are sorted lists, ordered by their smallest expert."""
    E = C.shape[0]
    sizes = balanced_sizes(E, size or default_cluster_size(E))
    W = edge_weights(C, tokens, weighting)
    labels = _pack(_communities(W, method, seed), W, sizes)
    if refine:
        labels = _refine(W, labels)
    clusters = [sorted(int(e) for e in np.nonzero(labels == c)[0]) for c in range(len(sizes))]
    return sorted(clusters)


# --- metrics ----------------------------------------------------------------------------------

def _labels(clusters: list[list[int]], E: int) -> np.ndarray:
    labels = np.full(E, -1, np.int64)
    for c, members in enumerate(clusters):
        labels[list(members)] = c
    if (labels < 0).any():
        raise ValueError("the clusters do not cover every expert")
    return labels


def in_cluster_share(C: np.ndarray, clusters: list[list[int]]) -> float:
    """Share of the co-activated pairs (two experts chosen by one token) inside one cluster."""
    labels = _labels(clusters, C.shape[0])
    off = np.triu(C, 1)
    total = off.sum()
    return float(off[labels[:, None] == labels[None, :]].sum() / total) if total else 0.0


def random_share(C: np.ndarray, sizes: list[int], n: int = 100, seed: int = 0) -> float:
    """Mean in-cluster share of `n` random partitions with the given cluster sizes."""
    rng = np.random.default_rng(seed)
    base = np.repeat(np.arange(len(sizes)), sizes)
    off = np.triu(C, 1)
    total = off.sum()
    if not total:
        return 0.0
    out = []
    for _ in range(n):
        labels = rng.permutation(base)
        out.append(off[labels[:, None] == labels[None, :]].sum() / total)
    return float(np.mean(out))


def simulate_fetch(trace: np.ndarray, unit_of: np.ndarray, unit_size: np.ndarray, capacity: int) -> tuple[int, int]:
    """Decode over the trace with an LRU cache of `capacity` experts that holds whole units
    (unit_of: expert -> unit; unit_size: experts per unit). Each token needs its experts
    resident, one after another; a miss fetches the expert's whole unit, evicting least recently
    used units to make room. Returns (experts moved, transfers)."""
    cache: OrderedDict[int, int] = OrderedDict()
    used = moved = transfers = 0
    for row in trace.tolist():
        for e in row:
            if e < 0:
                continue
            u = int(unit_of[e])
            if u in cache:
                cache.move_to_end(u)
                continue
            s = int(unit_size[u])
            moved += s
            transfers += 1
            while cache and used + s > capacity:
                used -= cache.popitem(last=False)[1]
            cache[u] = s
            used += s
    return moved, transfers


def prefetch_bytes(trace: np.ndarray, clusters: list[list[int]], E: int, expert_bytes: int,
                   capacities: tuple[float, ...] = CAPACITIES) -> list[dict]:
    """Per cache capacity (a share of the E experts): bytes and transfers per token when the
    fetch unit is one expert and when it is the cluster holding it, and which moves fewer bytes."""
    labels = _labels(clusters, E)
    sizes = np.bincount(labels, minlength=len(clusters))
    T = max(trace.shape[0], 1)
    out = []
    for frac in capacities:
        cap = max(1, round(frac * E))
        ex_moved, ex_tr = simulate_fetch(trace, np.arange(E), np.ones(E, np.int64), cap)
        cl_moved, cl_tr = simulate_fetch(trace, labels, sizes, cap)
        a, b = ex_moved * expert_bytes, cl_moved * expert_bytes
        out.append({"capacity": frac, "capacity_experts": cap,
                    "expert_fetch": {"bytes": a, "bytes_per_token": a / T, "transfers": ex_tr},
                    "cluster_fetch": {"bytes": b, "bytes_per_token": b / T, "transfers": cl_tr},
                    "cheaper": "cluster" if b < a else "expert" if a < b else "equal"})
    return out


def layer_metrics(trace: np.ndarray, clusters: list[list[int]], E: int, expert_bytes: int,
                  C: np.ndarray | None = None, *, capacities: tuple[float, ...] = CAPACITIES,
                  random_partitions: int = 100, seed: int = 0) -> dict:
    """In-cluster share of co-activated pairs (and its mean over random partitions of the same
    sizes) and the prefetch simulation of `prefetch_bytes`, for one layer."""
    if C is None:
        C = coactivation(trace, E)
    sizes = [len(c) for c in clusters]
    return {"in_cluster_share": in_cluster_share(C, clusters),
            "random_share": random_share(C, sizes, random_partitions, seed),
            "prefetch": prefetch_bytes(trace, clusters, E, expert_bytes, capacities)}


# --- the pass ---------------------------------------------------------------------------------

def moe_layers(g: Graph) -> list:
    """The moe_ffn nodes in graph order (the calibration's MoE layer numbering)."""
    return [n for n in g.nodes if n.op is Op.MOE_FFN]


def expert_bytes(g: Graph, moe, fmt: str, group_size: int) -> int:
    """Bytes of one expert's weights stored in `fmt`."""
    def f(w):       # --quant auto: the weight's own
        return get_format(g.weight(w).fmt if fmt == "auto" else fmt)
    return sum(f(w).nbytes(g.weight(w).shape[1:], group_size) for r, w in moe.weights
               if r in ("gate_up", "gate", "up", "down"))


def _block(moe) -> int | None:
    m = re.match(r"L(\d+)\.", moe.weight("down") or "")
    return int(m.group(1)) if m else None


@register("cluster-experts", Level.TENSOR)
def cluster_experts(g: Graph, ctx: PassContext) -> Graph:
    """Cluster each MoE layer's experts by co-activation on the calibration text (--calib)."""
    calib = ctx.analyses.calibration
    moes = moe_layers(g)
    if calib is None or not moes or not calib.routes:
        return g
    size = int(getattr(ctx.options, "cluster_size", 0) or 0) or None
    clusters: dict[int, list[list[int]]] = {}
    for layer, n in enumerate(moes):
        E = g.weight(n.weight("down")).shape[0]
        clusters[layer] = cluster_layer(coactivation(calib.trace(layer), E), calib.tokens, size)
    ctx.analyses.expert_clusters = clusters
    if ctx.dump_dir is not None:
        ctx.dump_dir.mkdir(parents=True, exist_ok=True)
        (ctx.dump_dir / "expert_clusters.json").write_text(
            json.dumps(clusters_report(g, calib, clusters, ctx.options.quant, ctx.options.group_size)))
    meta = dict(g.meta, expert_clusters=tuple(tuple(tuple(c) for c in clusters[i]) for i in range(len(moes))))
    return g.with_(meta=make_attrs(**meta))


def clusters_report(g: Graph, calib, clusters: dict[int, list[list[int]]], fmt: str, group_size: int) -> dict:
    """What expert_clusters.json holds: per MoE layer the clusters, the co-activation matrix, the
    transition matrix to the next MoE layer and the metrics (bytes at `fmt`)."""
    moes = moe_layers(g)
    layers = {}
    for layer, n in enumerate(moes):
        E = g.weight(n.weight("down")).shape[0]
        t = calib.trace(layer)
        C = coactivation(t, E)
        ent = {"block": _block(n), "experts": E, "k": int(t.shape[1]), "clusters": clusters[layer],
               "expert_bytes": expert_bytes(g, n, fmt, group_size), "coactivation": C.tolist()}
        ent.update(layer_metrics(t, clusters[layer], E, ent["expert_bytes"], C))
        if layer + 1 < len(moes):
            E2 = g.weight(moes[layer + 1].weight("down")).shape[0]
            ent["transitions"] = transitions(t, calib.trace(layer + 1), E, E2).tolist()
        layers[str(layer)] = ent
    return {"tokens": calib.tokens, "bytes_format": fmt, "capacities": list(CAPACITIES), "layers": layers}
