"""The XLA executor: a kernel-level graph (or a partition of one) as one jitted JAX function.

Each step shape (B, T, cache capacity) compiles once into a single XLA computation — not one
dispatch per op — which XLA fuses (the op lowerings: lowering.py, moe.py). Weights are placed on
the device once in their stored (packed) form and dequantized inside the computation, so device
memory traffic is the packed bytes. The KV cache lives on the device and is updated in place
(donated buffers). Prefill lengths are padded to a few buckets to bound recompiles.

Legend: B batch, T tokens per sequence, E experts, S = cache capacity.
"""

from __future__ import annotations

import numpy as np

from strata_compiler import settings
from strata_compiler.errors import BackendError, UsageError
from strata_compiler.execution import WHOLE, Caps, Executor, Segment
from strata_compiler.ir import Graph, Node, Op

from strata_compiler import trace
from strata_compiler.experts import Residency, in_place_weights
from strata_compiler.verify import check_token_ids

from . import aot, cuda_rt, pallas_flash
from .decoding import DecodeSteps, attention_span
from .dequant import _jnp
from .device import load_jax, device as pick_device, on_device, zeros_all  # noqa: F401 - on_device: also imported from here
from .context import _Ctx
from .lowering import OPS, routers_after
from .rows import HostSlice, PaddedRows, _pad_rows, fetch_last

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
RAW_MAX_TOKENS = 16   # steps of at most this many tokens stage their host inputs by raw copies (cuda_rt)
PACKED = -(1 << 40)   # the key of a partition's packed host-bound results in its outputs
COUNTS = -(1 << 41)   # ... and of its expert caches' routings per expert (--miss-path gpu), int32 [layers, E]


def _copy_row(dst, src, slot, row):
    """Row `row` of src [Bs, KV, Ss, hd] into row `slot` of dst [B, KV, S, hd], its first min(S, Ss)
    positions (load_row: traced, once per shape)."""
    import jax

    m = min(dst.shape[2], src.shape[2])
    r = jax.lax.dynamic_index_in_dim(src, row, 0, keepdims=True)[:, :, :m].astype(dst.dtype)
    return jax.lax.dynamic_update_slice(dst, r, (slot, 0, 0, 0))


def _check_lowered(nodes: list[Node]) -> None:
    """A BackendError for the first node whose op the xla backend has no lowering for."""
    for n in nodes:
        if n.op not in OPS and n.op is not Op.INPUT_IDS:
            raise BackendError(f"the xla backend has no lowering for op {n.op.value} (%{n.id}); "
                               f"recompile the plan (the fuse pass removes it) or use --backend reference")


def _route_ks(graph: Graph, nodes: list[Node]) -> dict[int, int]:
    """{moe_ffn node id: k} from the route op each MoE's routing comes from (through transfers)."""
    ks = {}
    for n in nodes:
        if n.op is Op.MOE_FFN:
            r = graph.node(n.args[1])
            while r.op is Op.TRANSFER:      # routing computed on the other device
                r = graph.node(r.args[0])
            if r.op is not Op.ROUTE:
                raise BackendError(f"moe_ffn %{n.id}: the xla backend needs its routing from a route op")
            ks[n.id] = r.attr("k")
    return ks


class GPUOutOfMemory(BackendError):
    """The device could not hold a partition's weights."""


def _traced_settings() -> list:
    """The xla settings' values (those that decide what a program traces; not where its cache
    lives or how memory is allocated)."""
    skip = ("cache_dir", "gpu_preallocate", "xla_executables")
    return [(n, settings.get(n)) for n in settings.names() if settings.declared(n).where == "xla" and n not in skip]


class XLAExecutor(DecodeSteps, Executor):
    """Runs the nodes of `graph` (all, or the ids in `nodes`) as one jitted JAX function."""

    def __init__(self, graph: Graph, weights, nodes: list[int] | None = None, device_kind: str = "auto",
                 slot_limit: dict[int, int] | None = None, device_index: int = 0,
                 mapped: dict[int, int] | None = None, residency: Residency | None = None,
                 stream: bool = False) -> None:
        """stream: the weights stay on the host until `upload` (a prefill's copy of CPU-placed
        experts: MixedExecutor), and leave the device at `release`.
        slot_limit: expert-cache GPU shares (node id) loaded with only their first N slots (a
        device out of memory raises GPUOutOfMemory). mapped: {GPU share: host share} of expert
        caches whose misses the GPU reads from host memory (runtime/mapped.py `rebind_misses`):
        the host share's weights stay in host memory, mapped, and its value is zero; so do the
        other weights the graph's meta names in place (an embedding table). residency: the live
        expert caches of a mixed run (else the plan's slots)."""
        jnp = _jnp()
        self.g = graph
        self.residency = residency if residency is not None else Residency()
        self.device = pick_device(device_kind, device_index)
        self.on_gpu = self.device.platform != "cpu"
        self.transfers = cuda_rt.Transfers.of("gpu" if self.on_gpu else "cpu")    # raw hand-off copies where they apply
        ids = set(nodes) if nodes is not None else {n.id for n in graph.nodes}
        self.nodes = [n for n in graph.nodes if n.id in ids]
        _check_lowered(self.nodes)
        users = graph.users()
        self.inputs = sorted({a for n in self.nodes for a in n.args if a not in ids})
        self.outputs = [n.id for n in self.nodes if any(u == -1 or u not in ids for u in users[n.id])]
        self.layers = sorted({n.attr("layer") for n in self.nodes if n.op is Op.FUSED_ATTENTION})
        self._reads_ids = any(n.op is Op.INPUT_IDS for n in self.nodes)   # else the ids argument is unused
        # the embedding tables' real row counts: a gather on the device clamps an id past the table
        # to its last row, silently
        self.tables = [(next(iter(weights.arrays(n.weight("table")).values())).shape[0], n.weight("table"))
                       for n in self.nodes if n.op is Op.EMBED]
        self._bulk_pending = False      # set_slot(wait=False) copies not yet waited for
        self.step_counts = None         # the last call's COUNTS result (run_partition)
        self.params_version = 0         # bumped where an array of `params` is replaced (the fused step's flat copy)
        self.route_k = _route_ks(graph, self.nodes)
        self.router_after = routers_after(graph, users, ids)
        self.packed: list[int] = []       # pack_for_host: results that leave as one buffer
        self._packed_T = 0
        self.cached = [n for n in self.nodes if n.op is Op.MOE_FFN and n.attr("cache", "") and n.attr("experts", ())]
        self.slots_of = {n.id: (slot_limit or {}).get(n.id, len(n.attr("experts"))) for n in self.cached}
        # --miss-path gpu: cached GPU share -> the host share whose whole arrays its misses read
        self.miss_source = {gid: graph.node(hid) for gid, hid in (mapped or {}).items() if gid in ids and hid in ids}
        self.silent = {h.id for h in self.miss_source.values()}
        self.count_order = [n.id for n in self.nodes if n.id in self.miss_source]   # rows of the COUNTS result
        in_place = {w for h in self.miss_source.values() for _, w in h.weights}
        in_place |= in_place_weights(graph) & {w for n in self.nodes for _, w in n.weights}
        # host arrays the GPU reads in place (by weight, then array name)
        self.mapped_host = {name: {a: np.asarray(v) for a, v in weights.arrays(name).items()} for name in sorted(in_place)}
        cut = {w: self.slots_of[n.id] for n in self.cached for _, w in n.weights}
        names = sorted({w for n in self.nodes for _, w in n.weights} - in_place)
        if hasattr(weights, "verify"):      # the checksums on all cores first (each is read once)
            weights.verify(names + sorted(in_place))
        host = {name: {a: np.asarray(v)[:cut[name]] if name in cut else np.asarray(v)
                       for a, v in weights.arrays(name).items()} for name in names}
        self.param_bytes = sum(v.nbytes for arrs in host.values() for v in arrs.values())
        self.host_params = host if stream else None
        self.kv_dtype = jnp.float32
        self.out_keys: dict[tuple[int, int], tuple] = {}     # (B, T) -> the result keys of traced_body's first tuple
        self._fn = self._program("forward", self.traced_body, static_argnums=(5, 6, 9), donate_argnums=(1, 2),
                                 meta_of=lambda st: list(self.out_keys[st[:2]]), restore=self._restore_keys)
        self._ahead_fn = self._program("ahead", self._ahead_step, donate_argnums=(1, 2))
        if nodes is None:       # a whole plan's executor: its stored programs load while its weights go up
            for prog in (self._fn, self._ahead_fn):
                if hasattr(prog, "prefetch"):
                    prog.prefetch()
        self._place_all(host, stream)

    def _place_all(self, host: dict[str, dict[str, np.ndarray]], stream: bool) -> None:
        """self.params: the weights on the device (none yet when streamed) and views of the host
        arrays read in place; a device out of memory raises GPUOutOfMemory."""
        try:
            self.params = {} if stream else self._place_params(host)
            if self.mapped_host:
                from . import mapped as mp

                self.params.update({name: {a: mp.device_view(v, self.device) for a, v in arrs.items()}
                                    for name, arrs in self.mapped_host.items()})
        except Exception as e:    # XLA reports an out-of-memory as RESOURCE_EXHAUSTED
            if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
                raise GPUOutOfMemory(str(e).splitlines()[0][:200]) from None
            raise

    # XLA's CPU client has served executables that failed to run once loaded ("Function ... not
    # found"): serialized executables on a GPU only (tests turn this on, with fresh caches)
    executables_on_cpu = False

    def _program(self, name: str, fn, **kw):
        """A jitted function of this partition: its executables kept across processes (aot.py) on
        a single-device executor whose weights stay on the device, else a plain jax.jit."""
        if (type(self) is not XLAExecutor or self.host_params is not None or self.mapped_host
                or not (self.on_gpu or self.executables_on_cpu)):
            kw.pop("meta_of", None), kw.pop("restore", None)
            return load_jax().jit(fn, **kw)
        return aot.Program(name, fn, self._scope, **kw)

    def _scope(self) -> str:
        """What shapes this partition's programs besides their arguments: the graph, the
        executor's own choices and the xla settings that change what is traced (kernels, their
        tuning; aot.Program's key)."""
        if not hasattr(self, "_scope_text"):
            import hashlib

            from strata_compiler.ir_text import print_graph

            g = hashlib.sha256(print_graph(self.g).encode()).hexdigest()
            self._scope_text = repr((g, [n.id for n in self.nodes], self.outputs, self.packed, self._packed_T,
                                     sorted(self.slots_of.items()), self.count_order, str(self.kv_dtype),
                                     self.device.platform, getattr(self.device, "device_kind", ""), self.device.id,
                                     _traced_settings()))
        return self._scope_text

    def _restore_keys(self, static: tuple, meta) -> None:
        """The result keys of a forward program loaded rather than traced (aot.Program)."""
        if not isinstance(meta, list) or not all(isinstance(k, int) and not isinstance(k, bool) for k in meta):
            raise ValueError("bad result keys")
        self.out_keys[static[:2]] = tuple(meta)        # (B, T) of the statics (B, T, span)

    pool = None         # a streamed partition's WeightPool (streaming.py), where raw copies run
    _pool_set = None    # the pool set its weights are in, until its call has been launched

    def upload(self) -> None:
        """A streamed partition's weights to the device (copies queued, not waited for: the step
        before runs meanwhile)."""
        if self.params:
            return
        if self.pool is not None:
            self.params, self._pool_set = self.pool.fill(self.host_params)
        else:
            self.params = self._place_params(self.host_params)

    def release(self) -> None:
        """Drop a streamed partition's device weights (freed once the calls that read them end;
        a pool's set is reused once they have)."""
        if self.host_params is not None:
            self.params = {}

    def _home(self):
        """Where this partition's own arrays go (device_put target): its device."""
        return self.device

    def _place_params(self, host: dict[str, dict[str, np.ndarray]]) -> dict:
        """The weights' stored arrays (by weight, then array name) on the device: on a CUDA GPU by
        raw copies from several threads into arrays allocated there (JAX's device_put of a
        mapped file goes one array at a time through one thread's staging copy)."""
        jax = load_jax()
        if self.transfers.cuda and type(self) is XLAExecutor and self.host_params is None:
            flat = [(name, a, np.ascontiguousarray(v)) for name, arrs in host.items() for a, v in arrs.items()]
            dst = zeros_all([(v.shape, v.dtype) for _, _, v in flat], self.device)
            jax.block_until_ready(dst)
            cuda_rt.upload([(v, d) for (_, _, v), d in zip(flat, dst)])
            out: dict = {name: {} for name in host}
            for (name, a, _), d in zip(flat, dst):
                out[name][a] = d
            return out
        return {name: {a: jax.device_put(v, self._home()) for a, v in arrs.items()} for name, arrs in host.items()}

    def _value(self, c: _Ctx, n: Node, args: list):
        """Node n's value inside the traced forward function."""
        return OPS[n.op](c, n, args)

    def compute_dtype(self, spec):
        """f32 for f32 weights; on a GPU the others compute in bf16 (f32 accumulation) unless the
        `xla_compute` setting says f32."""
        jnp = _jnp()
        if spec.fmt == "f32" or not self.on_gpu or settings.get("xla_compute") == "f32":
            return jnp.float32
        return jnp.bfloat16

    def _forward(self, params, ks, vs, ext, ids, B, T, pos, hooks: dict | None = None, span: int | None = None):
        """hooks: node id -> f(env, args) -> args, called while tracing, before that node (the fused
        step puts a host call there and ties the node's operands to it). span: every row's position
        is below it (a decode step's attention then reads only the cache's first `span` rows)."""
        ks, vs = dict(ks), dict(vs)
        c = _Ctx(self, params, ks, vs, ids, pos, B, T)
        c.ext, c.span = ext, span
        env = {k: v for k, v in ext.items() if k >= 0}
        for n in self.nodes:
            if n.op is Op.INPUT_IDS:
                env[n.id] = ids.reshape(-1)
            else:
                args = [env[a] for a in n.args]
                if hooks and n.id in hooks:
                    args = hooks[n.id](env, args)
                env[n.id] = self._value(c, n, args)
        outs = {o: env[o] for o in self.outputs}
        if c.counts:        # the expert caches' routings per expert, for their bookkeeping on the host
            outs[COUNTS] = c.jnp.stack([c.counts[i] for i in self.count_order])
        if self.packed and T == self._packed_T:    # the host-bound results as one f32 buffer: one copy
            outs[PACKED] = c.jnp.concatenate([outs[o].reshape(-1).astype(c.jnp.float32) for o in self.packed])
        return outs, ks, vs

    def traced_body(self, params, ks, vs, ext, ids, B, T, pos, hooks: dict | None = None, span: int | None = None):
        """_forward with its results as tuples (in out_keys[B, T] and self.layers order), not dicts
        keyed by node ids and layers: result keys are written into the lowered module, so
        structurally equal partitions (one per layer in a split plan) lower to the same module and
        compile once, through the persistent cache."""
        outs, ks, vs = self._forward(params, ks, vs, ext, ids, B, T, pos, hooks, span)
        self.out_keys[B, T] = tuple(outs)
        return tuple(outs.values()), tuple(ks[l] for l in self.layers), tuple(vs[l] for l in self.layers)

    def pack_for_host(self, node_ids, tokens: int = 1) -> None:
        """Results `node_ids` (f32, read only by the CPU) leave the device as one buffer, at steps
        of `tokens` tokens (decode): one device->host copy per partition instead of one each."""
        from strata_compiler.ir import DType

        ids = [i for i in node_ids if self.g.node(i).type.dtype is DType.F32]
        self.packed, self._packed_T = (ids, tokens) if len(ids) > 1 else ([], 0)
        self.__dict__.pop("_scope_text", None)      # the programs' key names the packing

    def set_slot(self, node_id: int, slot: int, rows: dict[str, dict[str, np.ndarray]], wait: bool = True) -> int:
        """An expert cache swap: the stored arrays of one expert (by role, then array) into slot
        `slot` of node `node_id`'s weights, in place on the device. Returns the bytes copied.
        wait=False: raw copies return once queued (cuda_rt bulk stream); this partition's next
        call waits for them. (A running fused step's copies: MixedExecutor._copy_rows.)"""
        jax = load_jax()
        if not hasattr(self, "_put_row"):
            self._put_row = jax.jit(lambda a, r, i: a.at[i].set(r), donate_argnums=0)
        n = self.g.node(node_id)
        moved = 0
        # on a CUDA GPU, a raw copy straight into the slot's rows (no jitted update, no donation)
        # once this partition's last call has finished reading the weights
        raw = self.transfers.cuda
        if raw and getattr(self, "_last_outs", None) is not None:
            jax.block_until_ready(self._last_outs)
            self._last_outs = None
        for role, name in n.weights:
            for arr, host in rows[role].items():
                cur = self.params[name][arr]
                host = np.ascontiguousarray(host, dtype=cur.dtype)
                if raw and host.nbytes * cur.shape[0] == cur.nbytes:
                    cuda_rt.to_device(host, cur, offset=slot * host.nbytes, wait=wait)
                    self._bulk_pending |= not wait
                else:
                    dev = jax.device_put(host, self.device)
                    self.params[name][arr] = self._put_row(cur, dev, np.int32(slot))
                    self.params_version += 1
                moved += host.nbytes
        return moved

    def slot_copies_queued(self) -> None:
        """Raw copies into this partition's expert slots were queued on the bulk stream (by the
        runtime's expert cache): land_slot_copies waits for them."""
        self._bulk_pending = True

    def land_slot_copies(self) -> None:
        """Wait for the expert-slot copies set_slot(wait=False) queued: before anything reads the
        weights (this partition's next call, or a fused step's program)."""
        if self._bulk_pending:
            cuda_rt.wait_bulk()
            self._bulk_pending = False

    def new_cache(self, cache) -> None:
        """Put this partition's layers of the cache on the device: zeros for an empty cache, else
        the host arrays (rows loaded on the host: KVCache.load_row)."""
        jax, jnp = load_jax(), _jnp()
        home = self._home()
        if cache.length:
            for layer in self.layers:
                cache.k[layer] = jax.device_put(np.asarray(cache.k[layer], self.kv_dtype), home)
                cache.v[layer] = jax.device_put(np.asarray(cache.v[layer], self.kv_dtype), home)
            return
        shapes = tuple(tuple(c[layer].shape) for layer in self.layers for c in (cache.k, cache.v))
        fn = getattr(self, "_zeros_fn", None)
        if fn is None:      # every layer's K and V zeros from one program (not a dispatch each)
            fn = self._zeros_fn = jax.jit(lambda shapes: tuple(jnp.zeros(s, self.kv_dtype) for s in shapes),
                                          static_argnums=0, out_shardings=self._zeros_sharding())
        out = fn(shapes)
        for i, layer in enumerate(self.layers):
            cache.k[layer], cache.v[layer] = out[2 * i], out[2 * i + 1]

    def _zeros_sharding(self):
        """Where new_cache's zeros live: this partition's device (or a mesh's sharding)."""
        jax = load_jax()
        home = self._home()
        return home if isinstance(home, jax.sharding.Sharding) else jax.sharding.SingleDeviceSharding(home)

    def load_row(self, cache, slot: int, src, row: int = 0) -> None:
        """Row `row` of cache `src` (a sequence prefilled on its own; its arrays on this device or
        the host) into row `slot` of `cache`, for this partition's layers, on the device (one
        jitted copy per shape, the destination donated); the slot's length becomes the row's.
        Layers of other partitions are left to them (MixedExecutor.load_row)."""
        jax = load_jax()
        n = int(src.lengths[row])
        if n > cache.capacity:
            raise UsageError(f"a sequence of {n} tokens does not fit a KV cache of {cache.capacity}")
        if not 0 <= slot < len(cache.lengths) or not 0 <= row < len(src.lengths):
            raise UsageError(f"row {row} into slot {slot}: the caches have {len(src.lengths)} and "
                             f"{len(cache.lengths)} rows")
        if self.layers and not on_device(cache.k[self.layers[0]]):
            self.new_cache(cache)
        fn = getattr(self, "_load_row_fn", None)
        if fn is None:      # every layer's K and V in one program (one dispatch per row moved)
            fn = self._load_row_fn = jax.jit(
                lambda dst, src, slot, row: tuple(_copy_row(d, s, slot, row) for d, s in zip(dst, src)),
                donate_argnums=0)
        home = self._home()
        dst = [c[layer] for layer in self.layers for c in (cache.k, cache.v)]
        srcs = []
        for a, d in zip((s[layer] for layer in self.layers for s in (src.k, src.v)), dst):
            if on_device(a) and a.sharding != d.sharding:
                a = jax.device_put(a, home)
            srcs.append(a)
        out = fn(tuple(dst), tuple(srcs), np.int32(slot), np.int32(row))
        for i, layer in enumerate(self.layers):
            cache.k[layer], cache.v[layer] = out[2 * i], out[2 * i + 1]
        cache.lengths[slot] = n

    def bucket(self, T: int, room: int) -> int:
        """The padded prefill length: the smallest bucket >= T that fits the cache (else T)."""
        if T == 1:
            return 1
        for b in PREFILL_BUCKETS:
            if b >= T:
                return b if b <= room else T
        return T

    def run_partition(self, ext: dict, input_ids: np.ndarray, cache, T_pad: int) -> dict:
        """One step of this partition: ids i64[B, T] (padded to T_pad) at the cache's positions (each
        row's; a step of T > 1 tokens needs uniform rows: KVCache.positions)."""
        B, T = input_ids.shape
        for rows, name in self.tables:
            check_token_ids(input_ids, rows, name)
        pos = np.asarray(cache.positions(T), np.int32)
        if cache.length + T_pad > cache.capacity:
            raise UsageError(f"sequence of {cache.length + T} tokens exceeds the KV cache capacity {cache.capacity}")
        ids = input_ids
        if T_pad != T:
            ids = np.zeros((B, T_pad), np.int64)
            ids[:, :T] = input_ids
        ks = {l: cache.k[l] for l in self.layers}
        vs = {l: cache.v[l] for l in self.layers}
        self.land_slot_copies()
        if self._pool_set is not None:      # a streamed partition: its weights' copies have landed
            self.pool.wait()
        staging = self._staging() if B * T_pad <= RAW_MAX_TOKENS else None
        if staging is not None:    # raw copies into this partition's device arrays (cuda_rt)
            # only what the partition reads is rewritten (ids: the embedding; pos: the attention),
            # the other is any array of the right shape: a copy less per call
            ids_arg = staging.stage("ids", np.asarray(ids, np.int32), self._reads_ids)
            pos_arg = staging.stage("pos", pos, bool(self.layers))
        else:
            ids_arg, pos_arg = self._host_args(np.asarray(ids, np.int32), pos)
        if staging is not None:
            ext = {i: staging.stage(i, v) if isinstance(v, np.ndarray) else v for i, v in ext.items()}
        elif any(isinstance(v, np.ndarray) for v in ext.values()):
            # host values on the device first: an input is then a device array whichever partition
            # made it (a CPU one, or one streamed to the GPU), and a program compiled for one serves both
            home = self._home()
            ext = {i: load_jax().device_put(v, home) if isinstance(v, np.ndarray) else v for i, v in ext.items()}
        # a decode step over a long cache (a chat's whole context) reads only the rows it reaches
        span = attention_span(int(pos.max(initial=0)) + 1, cache.capacity) if T_pad == 1 else None
        flat, kt, vt = self._fn(self.params, ks, vs, ext, ids_arg, B, T_pad, pos_arg, None, span)
        outs = dict(zip(self.out_keys[B, T_pad], flat))
        # the expert caches' routings of this call (--miss-path gpu), for MixedExecutor to fold
        self.step_counts = outs.pop(COUNTS, None)
        if self._pool_set is not None:      # the set is refilled once this call has finished reading it
            self.pool.guard(self._pool_set, flat[0] if flat else kt)
            self._pool_set = None
        if staging is not None and outs:
            staging.guard = next(iter(outs.values()))   # the next rewrite waits for this call
        if self.cached:
            self._last_outs = outs      # an expert-slot rewrite (set_slot) waits for this call
        for l, k, v in zip(self.layers, kt, vt):
            cache.k[l], cache.v[l] = k, v
        return outs

    def _host_args(self, ids: np.ndarray, pos: np.ndarray) -> tuple:
        """The step's token ids and positions (int32 [B]) as arguments of the jitted call: NumPy,
        which goes to the device inside jit's C++ dispatch (jnp.asarray here would take JAX's
        slower Python path)."""
        return ids, pos

    def _staging(self):
        """This partition's staging arrays when raw copies are on for its platform (cuda_rt), else None."""
        if not self.transfers.raw:
            return None
        if not hasattr(self, "_stage"):
            self._stage = cuda_rt.Staging(self._home())
        return self._stage

    pads_prefill = True     # run_segment takes T_pad (MeshXLAExecutor does not)

    def run_segment(self, env: dict, input_ids: np.ndarray, cache, seg: Segment = WHOLE) -> None:
        """Run this partition in a step that other devices share: at the step's length, or with
        seg.T_pad at that padded length (a prefill's bucket: one program per bucket, not per prompt
        length), host inputs padded here and the results PaddedRows. Whole partitions only."""
        if seg.lo or seg.hi is not None:
            raise BackendError("an xla partition runs whole (no [lo, hi) segment)")
        B, T = input_ids.shape
        T_pad = seg.T_pad or T
        if self.layers and not on_device(cache.k[self.layers[0]]):
            self.new_cache(cache)
        ext = {i: env[i] for i in self.inputs if self.g.node(i).op is not Op.INPUT_IDS}
        if T_pad != T:
            ext = {i: _pad_rows(v, B, T, T_pad) for i, v in ext.items()}
        jax = load_jax()
        for i, v in ext.items():     # results of another GPU's partition: a device-to-device copy
            if not isinstance(v, np.ndarray) and self.device not in v.devices():
                ext[i] = jax.device_put(v, self.device)

        for n in self.cached:   # the live slot -> expert maps of the expert caches here
            live = self.residency.get(n.attr("cache"))
            if live is not None:
                ext[-(n.id + 1)] = live.slots.copy()

        tr = trace.ACTIVE
        if tr is None:
            # results stay on the device: a consumer on the CPU waits for them when it reads them,
            # so CPU work in between (another share of the same layer) overlaps the GPU's
            outs = self.run_partition(ext, input_ids, cache, T_pad)
            packed = outs.pop(PACKED, None)
            if packed is not None:
                if not self.transfers.raw:
                    packed.copy_to_host_async()
                off, holder = 0, {"buf": packed}
                for o in self.packed:
                    outs[o] = HostSlice(holder, off, outs[o].shape)
                    off += outs[o].n
            env.update(self._padded(outs, B, T, T_pad))
            return
        import threading
        import time

        # with raw copies on, host values go in by those inside the call, as untraced (their time is
        # the h2d span); else they are put on the device first and timed
        staging = self._staging() if input_ids.size <= RAW_MAX_TOKENS else None
        if staging is None:
            t0 = time.perf_counter()
            host_in = {i: v for i, v in ext.items() if isinstance(v, np.ndarray)}
            ext = {i: jax.device_put(v, self.device) if i in host_in else v for i, v in ext.items()}
            jax.block_until_ready(ext)
            tr.transfer("h2d", sum(int(v.nbytes) for v in host_in.values()), time.perf_counter() - t0)
        else:
            b0, s0 = staging.bytes, staging.seconds
        start = time.perf_counter_ns()
        outs = self.run_partition(ext, input_ids, cache, T_pad)
        if staging is not None and staging.bytes > b0:
            tr.transfer("h2d", staging.bytes - b0, staging.seconds - s0, end_ns=staging.last_end_ns)

        def watch(outs=outs, start=start, n=len(self.nodes), tokens=int(input_ids.size)):
            jax.block_until_ready(outs)
            tr.add_span(f"xla partition ({n} ops)", "gpu", start, time.perf_counter_ns(), tokens=tokens)

        w = threading.Thread(target=watch, daemon=True)
        w.start()
        tr.watchers.append(w)
        env.update(self._padded(outs, B, T, T_pad))

    @staticmethod
    def _padded(outs: dict, B: int, T: int, T_pad: int) -> dict:
        if T_pad == T:
            return outs
        return {o: PaddedRows(v, B, T, T_pad) if o >= 0 else v for o, v in outs.items()}

    def caps(self) -> Caps:
        """Only the last token's outputs cross to the host; on a GPU a prefill step runs there,
        its attention the flash kernel where every layer's shape has one (no [step, cache] scores
        in memory: Session need not shorten long prompts' steps for them)."""
        flash = self.on_gpu and all(pallas_flash.supported(True, n.attr("n_heads"), n.attr("n_kv_heads"),
                                                           n.attr("head_dim"))
                                    for n in self.nodes if n.has_attr("n_heads"))
        return Caps(fetches_last=True, prefills_on_gpu=self.on_gpu, flash_prefill=flash)

    def run(self, input_ids: np.ndarray, cache, last_only: bool = False) -> dict[int, np.ndarray]:
        """Whole-plan execution (every node on this executor); with `last_only` the outputs of the
        last token only, [B, 1, ...] (the rest never leave the device)."""
        B, T = input_ids.shape
        if self.layers and not on_device(cache.k[self.layers[0]]):
            self.new_cache(cache)
        T_pad = self.bucket(T, cache.capacity - cache.length)
        outs = self.run_partition({}, input_ids, cache, T_pad)
        cache.advance(T)
        # the logits to the host by a raw copy when on (cuda_rt: much faster than JAX's own copy)
        if last_only:
            return {o: fetch_last(outs[o], B, T_pad, T) for o in self.g.outputs}
        return {o: cuda_rt.fetch(outs[o]).reshape(B, T_pad, -1)[:, :T] for o in self.g.outputs}
