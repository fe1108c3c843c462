"""The xla executor's decode steps beyond one call per step (XLAExecutor inherits them): greedy
tokens chosen on the device and steps launched before the last one's tokens are read (one
sequence: decode_ahead, backends/ahead.py), a whole greedy loop as one program (greedy_decode),
and the server's continuous-batching step (batch_step; several steps a program). Whole plans on
one device only.
"""

from __future__ import annotations

import numpy as np

from strata_compiler.errors import BackendError, UsageError

from . import cuda_rt
from . import sampling as device_sampling
from .dequant import _jnp
from .device import load_jax, on_device


MIN_SPAN = 512      # the shortest attention span of a decode step (each longer one: another program)


def attention_span(need: int, capacity: int) -> int | None:
    """The cache rows a decode step's attention reads for positions below `need`: the next power
    of two from MIN_SPAN (a program each), None for the whole cache once that is no shorter. A
    server's or a chat's cache holds its whole context; its steps then cost what its sequences'
    lengths do, not that."""
    span = max(MIN_SPAN, 1 << max(0, need - 1).bit_length())
    return None if span >= capacity else span


class DecodeSteps:
    def greedy_decode(self, first: np.ndarray, cache, n: int) -> np.ndarray:
        """n greedy tokens after `first` (i64[B], the token the prefill chose), all on the device,
        each row from its own position.

        Returns i64[B, n]. Whole-plan executors only."""
        jax, jnp = load_jax(), _jnp()
        if len(self.nodes) != len(self.g.nodes):
            raise BackendError("greedy_decode runs whole plans on one device")
        if cache.length + n > cache.capacity:
            raise UsageError(f"sequence of {cache.length + n} tokens exceeds the KV cache capacity {cache.capacity}")
        if not hasattr(self, "_loop"):     # the n steps as one scan
            self._loop = jax.jit(self._ahead_chunk, static_argnums=(5,), donate_argnums=(1, 2))
        ks = {l: cache.k[l] for l in self.layers}
        vs = {l: cache.v[l] for l in self.layers}
        *_, ks, vs, out = self._loop(self.params, ks, vs, jnp.asarray(first, jnp.int32),
                                     jnp.asarray(cache.positions(1), jnp.int32), n)
        for l in self.layers:
            cache.k[l], cache.v[l] = ks[l], vs[l]
        cache.advance(n)
        return np.asarray(out).T.astype(np.int64)

    def can_decode_ahead(self, B: int, cache, sampling=None) -> bool:
        """Whether a whole plan's next decode steps can run ahead (backends/ahead.py): on this
        executor alone, its cache on the device, no trace file; a sampling its tokens are chosen
        by on the device (sampling.supported)."""
        from strata_compiler.backends import ahead

        return (len(self.nodes) == len(self.g.nodes) and not self.cached
                and not ahead.traced_fully() and (not self.layers or on_device(cache.k[self.layers[0]]))
                and (sampling is None or self.samples(sampling)))

    def kv_room(self) -> int | None:
        """Bytes free on the GPU holding this executor's KV cache (None on the host's CPU)."""
        stats = (self.device.memory_stats() or {}) if self.on_gpu else {}
        if not stats.get("bytes_limit"):
            return None
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))

    def _vocab(self) -> int:
        """The logits' width (the plan's first output's last dimension)."""
        return int(self.g.node(self.g.outputs[0]).type.shape[-1])

    def _ahead_step(self, params, ks, vs, tok, pos):
        """A decode step that also chooses its greedy token and the next positions (each row's
        + 1) on the device."""
        jnp = _jnp()
        B = tok.shape[0]
        res, ks, vs = self._forward(params, ks, vs, {}, tok[:, None], B, 1, pos)
        nxt = jnp.argmax(res[self.g.outputs[0]].reshape(B, -1), axis=-1).astype(jnp.int32)
        return nxt, pos + 1, ks, vs

    def _sampled_step(self, params, ks, vs, tok, pos, hist, i, U, kn, k, all_greedy):
        """_ahead_step choosing its token by the sampling of `kn` (backends/xla/sampling.py) with
        uniforms U[i] and the window hist, which it returns with the token added; i + 1."""
        B = tok.shape[0]
        res, ks, vs = self._forward(params, ks, vs, {}, tok[:, None], B, 1, pos)
        nxt = device_sampling.choose(res[self.g.outputs[0]].reshape(B, -1), hist, U[i], kn, k, all_greedy)
        return nxt, pos + 1, device_sampling.remember(hist, nxt), i + 1, ks, vs

    def _ahead_chunk(self, params, ks, vs, tok, pos, steps):
        """`steps` _ahead_steps in one program (a scan; greedy_decode's): the last one's outputs,
        then every step's tokens int32 [steps, B]."""
        def body(c, _):
            nxt, pos, ks, vs = self._ahead_step(params, c[2], c[3], c[0], c[1])
            return (nxt, pos, ks, vs), nxt
        (tok, pos, ks, vs), toks = load_jax().lax.scan(body, (tok, pos, ks, vs), None, length=steps)
        return tok, pos, ks, vs, toks

    def _ahead_program(self, sampling):
        """The jitted step decode_ahead launches, and the device values its first launch takes
        after (ids, positions) — its state, which each step returns — and the constants every
        launch takes: none for greedy, else state (window, step) and constants (uniforms, knobs)."""
        if sampling is None:
            return self._ahead_fn, (), ()
        jnp = _jnp()
        key = device_sampling.static(sampling.settings)
        fn = self.__dict__.get("_sampled_fn")
        if fn is None:      # a stored executable per (top-k, greedy), as the greedy step's
            fn = self._sampled_fn = self._program("ahead_sampled", self._sampled_step, static_argnums=(9, 10),
                                                  donate_argnums=(1, 2))
        state = (np.asarray(sampling.history, np.int32), np.int32(0))
        const = device_sampling.generation_constants(sampling.uniforms, sampling.settings)
        return (lambda *a: fn(*a, *key)), tuple(map(jnp.asarray, state)), tuple(map(jnp.asarray, const))

    def decode_ahead(self, tok: np.ndarray, cache, n: int, stop_ids=(), done: np.ndarray | None = None,
                     sampling=None, on_token=None) -> np.ndarray:
        """n decode steps from the tokens `tok` (int64 [B]) of a whole plan, each step dispatched
        before the one before has finished, its ids and position that step's results on the device
        (backends/ahead.py); greedy, or chosen on the device by `sampling` (AheadSampling);
        on_token as ahead.run's. The tokens, int64 [B, <= n]."""
        from strata_compiler.backends import ahead

        jax = load_jax()
        if cache.length + n > cache.capacity:
            raise UsageError(f"sequence of {cache.length + n} tokens exceeds the KV cache capacity {cache.capacity}")
        fn, state0, const = self._ahead_program(sampling)
        first = (np.asarray(tok, np.int32).reshape(-1), np.asarray(cache.positions(1), np.int32), *state0)

        def launch(prev):
            ks = {l: cache.k[l] for l in self.layers}
            vs = {l: cache.v[l] for l in self.layers}
            t, pos, *rest = fn(self.params, ks, vs, *(first if prev is None else prev), *const)
            ks, vs = rest[-2], rest[-1]
            for l in self.layers:
                cache.k[l], cache.v[l] = ks[l], vs[l]
            cache.advance(1)
            return (t, pos, *rest[:-2])

        def finish(step, use: bool) -> np.ndarray:
            return np.asarray(cuda_rt.fetch(jax.block_until_ready(step[0]))).astype(np.int64)

        return ahead.run(launch, finish, n, int(first[0].shape[0]), stop_ids, done, on_token=on_token)

    @staticmethod
    def fetch(v) -> np.ndarray:
        """A device result (batch_step's) on the host: by a raw copy where cuda_rt is on."""
        return cuda_rt.fetch(v)

    def can_batch_step(self) -> bool:
        """Whether batch_step applies: a whole plan on this executor, no expert caches, no trace file."""
        from strata_compiler.backends import ahead

        return len(self.nodes) == len(self.g.nodes) and not self.cached and not ahead.traced_fully()

    def samples(self, settings) -> bool:
        """Whether tokens sampled by `settings` (a Sampling) are chosen on the device."""
        return device_sampling.supported(settings, self._vocab())

    def _batch_step(self, params, ks, vs, prev, host_tok, use_host, pos, hist, u, kn, k, all_greedy, span,
                    steps=1):
        """A decode step of the first B = len(pos) rows whose ids are the host's where use_host,
        else the device tokens of the step before (prev); its tokens (int32 [Bc], zero past B:
        each row's greedy or sampled by its knobs kn, uniform u and window hist, to which a row
        whose id is the device's adds that id), the same with -1 where a row's logits hold NaN or
        Inf (what the host reads), the logits (f32 [B, V]) and the next positions stay on the device.
        steps > 1: that many steps in one program, each taking the token the one before chose (u
        [steps, Bc]: a uniform per step); the checked tokens of each, [steps, Bc], the last one's
        tokens and logits."""
        jax, jnp = load_jax(), _jnp()
        B = pos.shape[0]
        tok = jnp.where(use_host, host_tok, prev)[:B]
        if hist.shape[1]:
            hist = jnp.where(use_host[:, None], hist, device_sampling.remember(hist, prev))
        hist = hist[:B]

        def one(tok, pos, hist, u, ks, vs):
            res, ks, vs = self._forward(params, ks, vs, {}, tok[:, None], B, 1, pos, span=span)
            logits = res[self.g.outputs[0]].reshape(B, -1)
            chosen = device_sampling.choose(logits, hist, u[:B], kn[:B], k, all_greedy)
            checked = jnp.where(jnp.isfinite(logits).all(axis=-1), chosen, -1)
            return chosen, checked, logits, ks, vs

        def pad(t):         # [..., B] -> [..., Bc]: zero past B
            return jnp.zeros(t.shape[:-1] + prev.shape, prev.dtype).at[..., :B].set(t.astype(prev.dtype))
        if steps == 1:
            chosen, checked, logits, ks, vs = one(tok, pos, hist, u, ks, vs)
            return pad(chosen), pad(checked), logits, pos + 1, ks, vs

        def body(carry, u_j):
            tok, pos, hist, ks, vs, _ = carry
            chosen, checked, logits, ks, vs = one(tok, pos, hist, u_j, ks, vs)
            return (chosen, pos + 1, device_sampling.remember(hist, chosen), ks, vs, logits), checked
        logits0 = jnp.zeros((B, self._vocab()), jnp.float32)
        (chosen, pos, _, ks, vs, logits), checked = jax.lax.scan(body, (tok, pos, hist, ks, vs, logits0), u)
        return pad(chosen), pad(checked), logits, pos, ks, vs

    def _batch_sampling(self, rows: int, sampling, steps: int = 1) -> tuple:
        """batch_step's sampling arguments for `rows` cache rows: (window, uniforms, knobs) and the
        static (k, all greedy); greedy's kept on the device across steps, as are knobs while they
        do not change; a window and uniforms (new each step) go as NumPy, which jit's dispatch
        copies faster than jnp.asarray would. Uniforms: [rows], or [steps, rows] for several steps."""
        jnp = _jnp()
        if sampling is None:
            if getattr(self, "_greedy_rows", (None,))[:2] != (rows, steps):
                kn = np.tile(device_sampling.knobs(device_sampling.GREEDY), (rows, 1))
                u = jnp.zeros(rows if steps == 1 else (steps, rows), jnp.float32)
                self._greedy_rows = (rows, steps, (jnp.zeros((rows, 0), jnp.int32), u, jnp.asarray(kn)), (0, True))
            return self._greedy_rows[2:]
        rows_settings = [s or device_sampling.GREEDY for s in sampling.settings]
        kn = np.stack([device_sampling.knobs(s) for s in rows_settings])
        u = sampling.uniforms[0] if steps == 1 else sampling.uniforms[:steps]
        arrays = (np.asarray(sampling.history, np.int32), np.asarray(u, np.float32), self._resident("knobs", kn))
        return arrays, device_sampling.static(rows_settings)

    def batch_step(self, cache, rows: int, host_tok: np.ndarray, use_host: np.ndarray, prev=None, sampling=None,
                   steps: int = 1):
        """Dispatch one decode step of the cache's first `rows` rows (continuous batching) without
        waiting for it: row b's id is host_tok[b] where use_host[b], else the token the step before
        chose for it on the device (`prev`, the tokens this returned then), so the host can launch
        a step before it knows the last one's tokens. host_tok int32 and use_host bool [cache rows].
        `sampling` (AheadSampling, None: every row greedy): settings per cache row (None: greedy),
        uniforms [1, cache rows] and each row's window [cache rows, W] of the ids it has seen, a
        row whose id is the device's one id short of it. Returns device values: (tokens int32
        [cache rows], the same with -1 for a row whose logits are not finite, logits f32 [rows, V]).
        steps > 1: that many steps in one dispatch (uniforms [steps, cache rows]): the tokens are
        the last step's, the checked ones [steps, cache rows], the logits the last step's."""
        jax = load_jax()
        if cache.length + steps > cache.capacity:
            raise UsageError(f"sequence of {cache.length + steps} tokens exceeds the KV cache capacity {cache.capacity}")
        if self.layers and not on_device(cache.k[self.layers[0]]):
            self.new_cache(cache)
        fn = getattr(self, "_batch_fn", None)
        if fn is None:
            fn = self._batch_fn = jax.jit(self._batch_step, static_argnums=(10, 11, 12, 13), donate_argnums=(1, 2))
        if prev is None:    # a device array like the tokens of a step (a NumPy one would be another program)
            prev = getattr(self, "_no_prev", None)
            if prev is None or prev.shape != host_tok.shape:
                prev = self._no_prev = jax.device_put(np.zeros(host_tok.shape, np.int32), self._home())
        samp, static = self._batch_sampling(int(host_tok.shape[0]), sampling, steps)
        ks = {l: cache.k[l] for l in self.layers}
        vs = {l: cache.v[l] for l in self.layers}
        pos = np.asarray(cache.lengths[:rows], np.int32)
        args = tuple(self._resident(name, a) for name, a in (("ids", host_tok), ("use", use_host), ("pos", pos)))
        span = attention_span(int(pos.max(initial=0)) + steps, cache.capacity)
        tok, checked, logits, pos_next, ks, vs = fn(self.params, ks, vs, prev, *args, *samp, *static, span, steps)
        for l in self.layers:
            cache.k[l], cache.v[l] = ks[l], vs[l]
        cache.lengths[:rows] += steps
        self._batch_args["pos"] = (pos + steps, pos_next)      # the next step's, if no row has moved
        return tok, checked, logits

    def _resident(self, name: str, a: np.ndarray):
        """batch_step's argument `name` as the device copy of the last equal one (a step's ids,
        flags and positions rarely change between steps: no copy to the device then), else `a`."""
        kept = self.__dict__.setdefault("_batch_args", {}).get(name)
        if kept is not None and kept[0].shape == a.shape and np.array_equal(kept[0], a):
            return kept[1]
        dev = load_jax().device_put(a, self._home())
        self._batch_args[name] = (a.copy(), dev)
        return dev
