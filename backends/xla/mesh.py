"""Several GPUs as one sharded computation: a striped plan's xla partitions over a device mesh.

A plan compiled with `--gpus N --gpu-mode stripe` deals each layer's GPU experts over gpu:0 ..
gpu:N-1 as expert shares (passes/expert_split.py: moe_ffn nodes side by side, joined by adds),
the dense parts on gpu:0. Run by partition per device, every layer would cross between the GPUs
through the host twice. Here the whole run of xla nodes is one jitted function over a 1-D mesh
("g") of the N devices, SPMD:

  * the dense weights and the KV cache are replicated (NamedSharding P()): every device computes
    the attention and the routing itself, which costs dense bytes x N of memory and nothing in
    time at decode (it runs in parallel);
  * a layer's shares become one stack per weight array, [N, Emax, ...] sharded over "g" (share
    k on device k, padded with zero experts to the largest share), with the model expert ids of
    each slot (-1 for padding);
  * in a shard_map, each device computes its own experts' contribution from its routing columns,
    and a psum over "g" (an all-reduce over NVLink on GPUs) adds them: the first share's node
    gets the sum plus the residual, the other shares' nodes zeros, so the plan's adds that join
    the shares pass the sum through unchanged.

Token routing between GPUs is thus a collective inside one XLA computation, not host round trips.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from strata_compiler.execution import WHOLE, Segment
from strata_compiler.ir import Graph, Node
from strata_compiler.experts import Residency, share_groups

from .context import _Ctx
from .device import load_jax, device as pick_device
from .executor import XLAExecutor
from .moe import moe_core


class MeshXLAExecutor(XLAExecutor):
    """The xla nodes of a striped plan as one jitted function over a mesh of `n_devices`."""

    def __init__(self, graph: Graph, weights, nodes: list[int], n_devices: int, device_kind: str = "auto",
                 residency: Residency | None = None) -> None:
        jax = load_jax()
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        self.n_devices = n_devices
        self.processes = jax.process_count()
        self.mesh = Mesh(np.array([pick_device(device_kind, i) for i in range(n_devices)]), ("g",))
        self.replicated = NamedSharding(self.mesh, P())
        self.split = NamedSharding(self.mesh, P("g"))
        self.groups = share_groups(graph, [graph.node(i) for i in nodes])
        self.leader = {grp[0].id: gi for gi, grp in enumerate(self.groups)}
        self.follower = {m.id for grp in self.groups for m in grp[1:]}
        super().__init__(graph, weights, nodes=nodes, device_kind=device_kind, device_index=0, residency=residency)

    def _staging(self):
        """No raw-copy staging: a mesh's host inputs are replicated over its devices by JAX."""
        return None

    def _home(self):
        return self.replicated      # dense weights, KV cache, ids and position: on every device

    def _place_params(self, host: dict[str, dict[str, np.ndarray]]) -> dict:
        """The dense weights replicated; each group's shares stacked [N, Emax, ...] (share k on
        device k, padded with zero experts) and sharded, with each slot's model expert id (-1: pad)."""
        jax = load_jax()
        grouped = {w for grp in self.groups for m in grp for _, w in m.weights}
        params = super()._place_params({name: arrs for name, arrs in host.items() if name not in grouped})
        for gi, grp in enumerate(self.groups):
            emax = max(len(m.attr("experts")) for m in grp)
            ids = np.full((self.n_devices, emax), -1, np.int32)
            stacks: dict[str, dict[str, np.ndarray]] = {}
            for m in grp:
                d = int(m.device.split(":")[1])
                ids[d, :len(m.attr("experts"))] = m.attr("experts")
                for role in ("gate_up", "down"):
                    for a, v in host[m.weight(role)].items():
                        st = stacks.setdefault(role, {}).get(a)
                        if st is None:
                            st = stacks[role][a] = np.zeros((self.n_devices, emax) + v.shape[1:], v.dtype)
                        st[d, :v.shape[0]] = v
            params[f"mesh{gi}"] = {"ids": jax.device_put(ids, self.split),
                                   **{role: {a: jax.device_put(v, self.split) for a, v in arrs.items()}
                                      for role, arrs in stacks.items()}}
        return params

    pads_prefill = False

    def run_segment(self, env: dict, input_ids: np.ndarray, cache, seg: Segment = WHOLE) -> None:
        """With several processes (hosts), every input must be a global array: host values go to
        the mesh replicated (each process holds the same ones), and so do ids and position
        (`_host_args`). A mesh pads no prefill (pads_prefill): seg.T_pad is not used."""
        if self.processes == 1:
            return super().run_segment(env, input_ids, cache)
        jax = load_jax()
        local = dict(env)
        for i in self.inputs:
            v = local.get(i)
            if v is not None and not hasattr(v, "sharding"):       # NumPy (a CPU partition's result)
                local[i] = jax.device_put(np.asarray(v), self.replicated)
        super().run_segment(local, input_ids, cache)
        env.update({o: local[o] for o in self.outputs})

    def _host_args(self, ids: np.ndarray, pos: np.ndarray) -> tuple:
        if self.processes == 1:
            return ids, pos
        return tuple(load_jax().device_put((ids, pos), self.replicated))

    def _value(self, c: _Ctx, n: Node, args: list):
        """A share group's first node computes the whole group over the mesh; the others give 0
        (the plan's adds that join the shares then pass the sum through)."""
        if n.id in self.leader:
            return self._group(c, n, args)
        if n.id in self.follower:
            return c.jnp.zeros_like(args[0], dtype=c.jnp.float32)
        return super()._value(c, n, args)

    def _group(self, c: _Ctx, n: Node, a: list):
        """A layer's shares over the mesh: each device its own experts, then a psum."""
        jax, jnp = c.jax, c.jnp
        from jax.sharding import PartitionSpec as P

        p = c.params[f"mesh{self.leader[n.id]}"]
        gu_spec = self.g.weight(n.weight("gate_up"))
        dn_spec = self.g.weight(n.weight("down"))
        emax = p["ids"].shape[1]
        gu_spec = replace(gu_spec, shape=(emax,) + gu_spec.shape[1:], experts=emax, expert_ids=())
        dn_spec = replace(dn_spec, shape=(emax,) + dn_spec.shape[1:], experts=emax, expert_ids=())
        dt = self.compute_dtype(gu_spec)
        k = min(self.route_k[n.id], emax)
        x, comb = a[0], a[1]

        def local(x, comb, ids, gu_p, dn_p):
            ids, gu_p, dn_p = ids[0], {r: v[0] for r, v in gu_p.items()}, {r: v[0] for r, v in dn_p.items()}
            cl = jnp.where(ids[None, :] >= 0, comb[:, jnp.maximum(ids, 0)], 0.0)
            topw, topi = jax.lax.top_k(cl, k)
            out = moe_core(c, x, topw, topi, gu_spec, gu_p, dn_spec, dn_p, dt, pallas_ok=False)
            return jax.lax.psum(out, "g")

        out = jax.shard_map(local, mesh=self.mesh, in_specs=(P(), P(), P("g"), P("g"), P("g")), out_specs=P(),
                            check_vma=False)(x, comb, p["ids"], p["gate_up"], p["down"])
        return out + a[2] if len(a) == 3 else out
