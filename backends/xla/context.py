"""What the xla backend's op lowerings (lowering.py, moe.py) see while the forward function is
traced: the executor that traces them, as far as they read it (ExecutorView: executor.py's
XLAExecutor), and one step's parameters, cache and positions (_Ctx). Below both, so that the
lowerings need not import the executor, which imports them.

Legend: B batch, T tokens per sequence, M = B*T, E experts, k experts per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from strata_compiler.ir import Graph, Node

from .dequant import _jnp, dequantize

if TYPE_CHECKING:
    from strata_compiler.experts import Residency


class ExecutorView(Protocol):
    """What the lowerings read of the executor tracing them."""

    g: Graph
    on_gpu: bool
    residency: Residency                        # a mixed run's live expert caches
    route_k: dict[int, int]                     # moe_ffn id -> k of the route that feeds it
    router_after: dict[int, tuple[int, int]]    # projection id -> (router linear, rms_norm): routers_after()
    slots_of: dict[int, int]                    # expert cache's GPU share -> slots loaded
    miss_source: dict[int, Node]                # expert cache's GPU share -> the host share its misses read
    silent: set[int]                            # host shares whose misses the GPU share reads (value zero)

    def compute_dtype(self, spec):
        """The dtype the ops on weight `spec` compute in."""


class _Ctx:
    """What the traced ops see: parameters, each row's position (int32 [B]), cache, compute dtype."""

    def __init__(self, exe: ExecutorView, params, ks, vs, ids, pos, B, T):
        self.exe, self.params, self.ks, self.vs = exe, params, ks, vs
        self.ids, self.pos, self.B, self.T = ids, pos, B, T
        self.topk: dict[int, tuple] = {}      # route node id -> (weights, expert ids), [M, k] each
        self.logits: dict[int, tuple] = {}    # route node id -> (router logits [M, E], k, renormalise, partials)
        self.norms: dict[int, tuple] = {}     # rms_norm node id -> (weight, eps, its input): for fusing
        self.partials: dict[int, object] = {}  # router node id -> its logits as an o projection's epilogue left them
        self.counts: dict[int, object] = {}    # cached GPU share id -> routings per expert this step (int32 [E])
        self.span: int | None = None    # a decode step's attention reads only the cache's first `span` rows
        self.jnp = _jnp()
        import jax

        self.jax = jax

    def w(self, n: Node, role: str, dtype=None):
        name = n.weight(role)
        if name is None:
            return None
        spec = self.exe.g.weight(name)
        return dequantize(self.jnp, spec, self.params[name], dtype or self.exe.compute_dtype(spec))

    def matmul(self, x, w):
        """x [..., K] @ w[N, K]^T with f32 accumulation."""
        jnp = self.jnp
        prec = self.jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
        return jnp.einsum("...k,nk->...n", x.astype(w.dtype), w, precision=prec, preferred_element_type=jnp.float32)
