"""A mixed plan's decode step as one jitted program: CPU partitions run as host calls inside it.

Partition by partition (runtime/partitions.py), a step dispatches one jitted call per GPU
partition and moves every value that crosses devices through Python. Here the whole decode step
is traced into one program for the GPU:

* each xla partition's traced body (`XLAExecutor.traced_body`) is inlined, in plan order;
* each llvm partition becomes a host call (runtime/fused_calls.py), which runs the partition's
  kernels on the host between the GPU's kernels, natively where it can;
* the step's token ids, each row's cache position and the expert caches' slot maps go in as
  one int32 array; the xla partitions' KV caches are donated and come back updated; the llvm
  partitions keep theirs on the host.

A step is then one dispatch and one wait, whatever the number of switches. It applies to decode
steps of plans whose xla partitions share one device, with no reference partition (and with no
CPU partition at all where expert caches read their misses in place, `--miss-path gpu`: a
program without host calls, which `launch` / `finish` may also run ahead of the host). Prefill
and the first decode step (which sets up the frames and caches) run partition by partition.
Expert caches swap between steps.
"""

from __future__ import annotations

import time

import numpy as np

from strata_compiler import trace
from strata_compiler.backends.xla import cuda_rt
from strata_compiler.backends.xla import sampling as device_sampling
from strata_compiler.backends.xla.executor import on_device
from strata_compiler.ir import Op

from .fused_calls import FusedCalls


class Ahead:
    """A decode step in flight (FusedStep.launch): its token and expert counts (device values),
    the slot maps it runs with (cached GPU share id -> int32 [slots], -1 masked) and, sampled, the
    sampling's state after it (each row's window of ids seen, the step's index: device values)."""

    __slots__ = ("token", "counts", "maps", "state")

    def __init__(self, token, counts, maps, state=()) -> None:
        self.token, self.counts, self.maps, self.state = token, counts, maps, state


class FusedStep:
    def __init__(self, mixed) -> None:
        self.m = mixed
        self.g = mixed.g
        parts = mixed.parts
        part_of = {nid: i for i, (_, _, ids) in enumerate(parts) for nid in ids}
        self.part_of = part_of
        xla = [exe for kind, exe, _ in parts if kind == "xla"]
        self.device = xla[0].device
        # per llvm partition: its inputs made by xla partitions (host call operands), and its
        # results that later xla partitions read (host call results)
        self.dev_in: dict[int, list[int]] = {}
        self.dev_out: dict[int, list[int]] = {}
        users = self.g.users()
        for i, (kind, exe, ids) in enumerate(parts):
            if kind != "llvm":
                continue
            self.dev_in[i] = [a for a in exe.inputs if self.g.node(a).op is not Op.INPUT_IDS
                              and parts[part_of[a]][0] == "xla"]
            self.dev_out[i] = [o for o in exe.outputs
                               if any(u != -1 and parts[part_of[u]][0] == "xla" for u in users[o])]
        xla_parts = [(i, exe) for i, (kind, exe, _) in enumerate(parts) if kind == "xla"]
        self._params = {i: exe.params for i, exe in xla_parts}    # (the dicts themselves: swaps show)
        self._layers = [l for _, exe in xla_parts for l in exe.layers]
        self._xla_outs = [o for o in self.g.outputs if parts[part_of[o]][0] == "xla"]
        self.cached = [n for _, exe in xla_parts for n in exe.cached]
        # slots each cached GPU share holds (fewer than its experts when the GPU ran short)
        self.n_slots = {n.id: exe.slots_of[n.id] for _, exe in xla_parts for n in exe.cached}
        self.calls = FusedCalls(self)
        self._fn = {}               # B -> jitted step
        self._flat_params = None    # (the executors' params_version, their params' leaves, the tree)
        self._ahead_fn = {}         # B -> jitted step that also returns its token (launch)
        self._samp_args: dict = {}  # launch's sampling arguments on the device (_sampling_args)
        self._ahead_stage = [None, None]    # launch's staging, one per step in flight
        self._ahead_parity = 0
        self._stage = None
        self._counted: dict = {}    # B -> the xla partitions whose COUNTS results the step returns, in order
        self.steps = 0
        self.timeline: list | None = None   # benchmarks: (event, partition, perf_counter_ns) when a list

    @staticmethod
    def applies(mixed) -> bool:
        """Decode steps of plans with xla and llvm partitions on one GPU; or with xla partitions
        alone where expert caches read their misses in place (--miss-path gpu): a program with no
        host call, whose one packed input carries the slot maps and whose swaps are queued."""
        kinds = {k for k, _, _ in mixed.parts}
        if "reference" in kinds or "xla" not in kinds or mixed.mesh or ("llvm" not in kinds and not mixed.mapped):
            return False
        devs = {exe.device for k, exe, _ in mixed.parts if k == "xla"}
        if len(devs) != 1:
            return False
        from strata_compiler.backends.xla.host_call import available

        return available("cpu" if next(iter(devs)).platform == "cpu" else "gpu")

    def ready(self, B: int, cache) -> bool:
        """Whether a fused step of batch B can run now: the partition runtime has run a decode step
        of that batch (frames, caches and result keys exist)."""
        for kind, exe, _ in self.m.parts:
            if kind == "llvm" and B not in exe.frames:
                return False
            if kind == "xla" and ((B, 1) not in exe.out_keys
                                  or (exe.layers and not on_device(cache.k[exe.layers[0]]))):
                return False
        return True

    def ahead_ok(self) -> bool:
        """Whether this plan's decode steps can run ahead (`launch` / `finish`): a program with no
        host call (every CPU partition gone: expert caches read their misses in place), so that
        two steps in flight share no host state."""
        return not self.dev_in and all(kind == "xla" for kind, _, _ in self.m.parts)

    def _params_now(self):
        """The weights as one flat tuple, rebuilt only when an executor replaced an array: the
        jitted call then flattens no nested dicts (a few hundred arguments)."""
        import jax

        ver = tuple(exe.params_version for kind, exe, _ in self.m.parts if kind == "xla")
        if self._flat_params is None or self._flat_params[0] != ver:
            leaves, tree = jax.tree_util.tree_flatten(self._params)
            self._flat_params = (ver, tuple(leaves), tree)
        return self._flat_params

    def _maps(self) -> list[np.ndarray]:
        """The expert caches' slot -> expert maps, in the program's order (the live caches', else
        the plan's slots)."""
        out = []
        for n in self.cached:
            live = self.m.residency.get(n.attr("cache"))
            out.append(live.slots if live is not None else np.asarray(n.attr("experts")[:self.n_slots[n.id]], np.int32))
        return out

    # -- the traced step -----------------------------------------------------------------------

    def _step(self, params, ks, vs, packed, B: int, ids=None):
        """The decode step of batch B; `packed`: int32 [ids (B) | positions (B) | slot maps...];
        `ids` (int32 [B], a device value: the step before's greedy token) in place of packed's."""
        import jax

        from strata_compiler.backends.xla.executor import COUNTS

        parts = self.m.parts
        splits = self.calls.splits()
        ids = packed[:B].reshape(B, 1) if ids is None else ids.reshape(B, 1)
        pos = packed[B:2 * B]       # each row's position (ragged rows decode at their own)
        off = 2 * B
        slots = {}
        for n in self.cached:
            k = self.n_slots[n.id]
            slots[n.id] = packed[off:off + k]
            off += k
        env: dict = {}
        counts: list = []
        ks, vs = dict(ks), dict(vs)
        # the host calls share the host state (values, KV caches of the CPU partitions): each runs
        # after the one before (an ordering token), and the program returns the last token, so
        # that its results are ready only once every host call has run
        tok = [None]

        def call(i, part, sources):
            hc = self.calls.call(i, B, after=tok[0] is not None, part=part)
            args = [sources(a).astype(h.dtype).reshape(h.shape) for a, h in zip(hc.dev_in, hc.ins)]
            *res, tok[0] = hc(*args, after=tok[0])
            return res

        for i, (kind, exe, _) in enumerate(parts):
            if kind == "xla":
                ext = {a: env[a] for a in exe.inputs if self.g.node(a).op is not Op.INPUT_IDS}
                for n in exe.cached:
                    ext[-(n.id + 1)] = slots[n.id]
                pk = {l: ks[l] for l in exe.layers}
                pv = {l: vs[l] for l in exe.layers}
                hooks = None
                if i + 1 in splits:      # the next CPU partition's first half runs before the share
                    def before_share(envj, args, cpu=i + 1):
                        call(cpu, "start", lambda a: envj[a] if a in envj else env[a])
                        args, tok[0] = jax.lax.optimization_barrier((args, tok[0]))     # the share after it
                        return args
                    hooks = {splits[i + 1][0].id: before_share}
                flat, kt, vt = exe.traced_body(params[i], pk, pv, ext, ids, B, 1, pos, hooks)
                for key, v in zip(exe.out_keys[B, 1], flat):
                    if key == COUNTS:       # the expert caches' routings (--miss-path gpu): results of the step
                        counts.append((i, v))
                    else:
                        env[key] = v
                for l, k_, v_ in zip(exe.layers, kt, vt):
                    ks[l], vs[l] = k_, v_
            else:
                res = call(i, "finish" if i in splits else None, env.__getitem__)
                for o, r in zip(self.dev_out[i], res):
                    env[o] = r
        token = tok[0]
        self._counted[B] = [i for i, _ in counts]
        return tuple(env[o] for o in self._xla_outs) + tuple(v for _, v in counts) + (token,), ks, vs

    # -- one step ------------------------------------------------------------------------------

    def run(self, input_ids: np.ndarray, cache) -> dict[int, np.ndarray]:
        import jax

        B = input_ids.shape[0]
        m = self.m
        pos = np.asarray(cache.positions(1), np.int32)     # (a full cache: a clear error)
        tree = self._params_now()[2]
        fn = self._fn.get(B)
        if fn is None:
            def fused_step(p, k, v, s):     # (named: the persistent cache's entry says what it is)
                return self._step(jax.tree_util.tree_unflatten(tree, p), k, v, s, B)

            fn = self._fn[B] = jax.jit(fused_step, donate_argnums=(1, 2))
        packed = np.concatenate([np.asarray(input_ids, np.int32).reshape(-1), pos,
                                 *[np.asarray(s, np.int32) for s in self._maps()]]).astype(np.int32)
        if self.m.transfers.raw:
            if self._stage is None:
                self._stage = cuda_rt.Staging(self.device)
            packed = self._stage.stage("step", packed)
        for kind, exe, _ in m.parts:
            if kind == "xla":
                exe.land_slot_copies()
        layers = self._layers
        ks = {l: cache.k[l] for l in layers}
        vs = {l: cache.v[l] for l in layers}
        self.calls.begin(input_ids, cache)
        traced = trace.ACTIVE is not None and self.timeline is None
        if traced:
            self.timeline = []          # this step's, for the trace's GPU spans
        tl = self.timeline
        if tl is not None:
            clock = self.calls.clock()
            tl.append(("dispatch", -1, time.perf_counter_ns()))
        outs, ks, vs = fn(self._flat_params[1], ks, vs, packed)
        if tl is not None:
            tl.append(("dispatched", -1, time.perf_counter_ns()))
        for l in layers:
            cache.k[l], cache.v[l] = ks[l], vs[l]
        outs = jax.block_until_ready(outs)[:-1]
        n_out = len(self._xla_outs)
        for i, v in zip(self._counted.get(B, ()), outs[n_out:]):
            m.swaps.fold_counts(m.parts[i][1], v)
        outs = outs[:n_out]
        if tl is not None:
            tl.append(("done", -1, time.perf_counter_ns()))
            self.calls.merge_records(tl, clock)
        if traced:
            self.calls.trace(trace.ACTIVE, tl, B, clock)
            self.timeline = None
        if self._stage is not None:
            self._stage.guard = None        # the program has finished: the staging may be rewritten
        host_env = self.calls.env
        self.calls.end(B)
        self.steps += 1
        res = dict(zip(self._xla_outs, outs))
        return {o: (cuda_rt.fetch(res[o]) if o in res else host_env[o]).reshape(B, 1, -1) for o in self.g.outputs}

    # -- decode ahead: the next step dispatched before this one finishes ---------------------

    def launch(self, ids, cache, masked: dict | None = None, sampling=None, state=None):
        """Dispatch a decode step of the tokens `ids` (NumPy int64 [B], or the device token of the
        step before: `Ahead.token`) at the cache's positions (each row's) and return at once, the
        step in flight (`finish` waits for it). `masked`: {cache key: slots} whose experts are
        being swapped (their copies wait until no step in flight reads the slot): -1 in this
        step's maps, so their experts are read in place like any miss. The program also returns
        its token (greedy, or chosen by `sampling`, an AheadSampling, from the sampling's `state`:
        the step before's, None for the first), which the next launch takes as its ids without a
        round trip through the host."""
        import jax
        import jax.numpy as jnp

        B = int(ids.shape[0])
        pos = np.asarray(cache.positions(1), np.int32)     # (a full cache: a clear error)
        ver, flat, tree = self._params_now()
        fn = self._ahead_fn.get(B)
        if fn is None:
            n_out = len(self._xla_outs)

            def fused_ahead(p, k, v, s, t, hist, i, U, kn, top_k, all_greedy):     # (named: the persistent cache's entry says what it is)
                outs, k, v = self._step(jax.tree_util.tree_unflatten(tree, p), k, v, s, B, ids=t)
                logits = outs[0].reshape(B, -1)
                if top_k is None:
                    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
                else:
                    token = device_sampling.choose(logits, hist, U[i], kn, top_k, all_greedy)
                    hist, i = device_sampling.remember(hist, token), i + 1
                return (token,) + tuple(outs[n_out:-1]), k, v, hist, i

            fn = self._ahead_fn[B] = jax.jit(fused_ahead, static_argnums=(9, 10), donate_argnums=(1, 2))
        maps = []
        for n, s in zip(self.cached, self._maps()):
            drop = (masked or {}).get(n.attr("cache"))
            if drop:
                s = s.copy()
                s[sorted(drop)] = -1
            maps.append(np.asarray(s, np.int32))
        packed = np.concatenate([np.zeros(B, np.int32), pos, *maps]).astype(np.int32)
        if self.m.transfers.raw:
            # two staging buffers, one per step in flight: the step two back has finished with its own
            k = self._ahead_parity = 1 - self._ahead_parity
            st = self._ahead_stage[k]
            if st is None:
                st = self._ahead_stage[k] = cuda_rt.Staging(self.device)
            packed = st.stage("step", packed)
        if isinstance(ids, np.ndarray):
            ids = np.asarray(ids, np.int32).reshape(B)
        for kind, exe, _ in self.m.parts:
            exe.land_slot_copies()
        layers = self._layers
        ks = {l: cache.k[l] for l in layers}
        vs = {l: cache.v[l] for l in layers}
        args = self._sampling_args(B, sampling, state)
        outs, ks, vs, hist, i = fn(flat, ks, vs, packed, ids, *args)
        for l in layers:
            cache.k[l], cache.v[l] = ks[l], vs[l]
        self.steps += 1
        return Ahead(outs[0], outs[1:], dict(zip([n.id for n in self.cached], maps)), (hist, i))

    def _sampling_args(self, B: int, sampling, state) -> tuple:
        """launch's sampling arguments: (window, step, uniforms, knobs, top-k, all greedy), the
        constants put on the device once per generation (greedy's once per batch size); greedy
        (sampling None): empty ones and top-k None."""
        import jax

        key = ("greedy", B) if sampling is None else ("sampled", id(sampling))
        kept = self._samp_args.get(key)
        if kept is None or kept[0] is not sampling:
            if sampling is None:
                arrays = (np.zeros((B, 0), np.int32), np.int32(0), np.zeros((1, B), np.float32), np.zeros((B, 5), np.float32))
                statics = (None, True)
            else:
                arrays = (np.asarray(sampling.history, np.int32), np.int32(0),
                          *device_sampling.generation_constants(sampling.uniforms, sampling.settings))
                statics = device_sampling.static(sampling.settings)
                self._samp_args = {k: v for k, v in self._samp_args.items() if k[0] == "greedy"}
            kept = self._samp_args[key] = (sampling, tuple(jax.device_put(a, self.device) for a in arrays), statics)
        _, (hist, i, U, kn), statics = kept
        if state:
            hist, i = state
        return (hist, i, U, kn, *statics)

    def finish(self, step: Ahead, fold: bool = True) -> np.ndarray:
        """Wait for a launched step; fold its expert routings into the caches (`fold_counts`;
        not with fold=False); its greedy tokens, NumPy int64 [B]."""
        import jax

        outs = jax.block_until_ready((step.token,) + tuple(step.counts))
        for i, v in zip(self._counted.get(int(step.token.shape[0]), ()) if fold else (), outs[1:]):
            self.m.swaps.fold_counts(self.m.parts[i][1], v)
        return np.asarray(cuda_rt.fetch(outs[0])).astype(np.int64)
