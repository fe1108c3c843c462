"""A generation session: a plan bound to a backend, a KV cache, prefill and decode steps."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from strata_compiler import settings
from strata_compiler.backends import make_executor, resolve_backend
from strata_compiler.errors import PlanError, UsageError
from strata_compiler.execution import AheadSampling
from strata_compiler.hwprofile import host_memory

from strata_compiler import trace
from strata_compiler.runtime.process_clock import process_seconds
from strata_compiler.kv_cache import KVCache
from .plan import Plan
from .sampler import Sampler

PREFILL_CHUNK = 512     # prompt tokens a prefill step: a long prompt's activation memory is bounded by it
# Where the prefill runs on a GPU, steps of up to 4096 tokens: its MoE tiles and weight passes
# (a dequantization, or a CPU layer's upload) are paid per step, and a 4096-token prompt in one
# step ran 2.1x faster than in eight (BENCHMARKS.md); without the flash-attention kernel, halved
# while one step's attention scores (f32 [B, heads, chunk, cache]) would pass GPU_SCORES_BYTES.
GPU_PREFILL_CHUNK = 4096
GPU_SCORES_BYTES = 2 << 30

# JAX's compile events (tracing, lowering, XLA's compile or its persistent cache's load): their
# seconds are summed by a listener that `compile_seconds` registers once
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_COMPILED = [0.0, False]     # seconds so far, listening


def _on_event(event: str, seconds: float, **_kw) -> None:
    if event in _COMPILE_EVENTS:
        _COMPILED[0] += seconds


def compile_seconds() -> float:
    """Seconds JAX has spent compiling in this process since the first call (0 without JAX)."""
    if not _COMPILED[1] and "jax" in sys.modules:
        import jax

        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _COMPILED[1] = True
    return _COMPILED[0]


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during `Session.generate`: the prompt's logits (None before the prefill ended) and
    the ids made before it, int64 [B, i], survive it."""

    def __init__(self, logits: np.ndarray | None, new: np.ndarray) -> None:
        super().__init__()
        self.logits, self.new = logits, new


class NonFiniteLogits(PlanError):
    """A step's logits hold NaN or Inf (weights that are not finite, activations that overflow):
    one line naming the step, not greedy id 0; `logits` and `new` as in Interrupted."""

    def __init__(self, message: str, logits: np.ndarray, new: np.ndarray) -> None:
        super().__init__(message)
        self.logits, self.new = logits, new


@dataclass
class Timings:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    # of those seconds, JAX compiling the programs (the first run of a plan, or a new shape)
    prefill_compile_seconds: float = 0.0
    decode_compile_seconds: float = 0.0
    first_token_at: float | None = None     # seconds after the process started (entry.process_seconds)

    def warm_rates(self) -> tuple[float, float]:
        """Tokens/s without the seconds spent compiling."""
        pre = self.prefill_seconds - self.prefill_compile_seconds
        dec = self.decode_seconds - self.decode_compile_seconds
        return (self.prefill_tokens / pre if pre > 0 else 0.0, self.decode_tokens / dec if dec > 0 else 0.0)

    def rates(self) -> tuple[float, float]:
        return (self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0,
                self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0)


@dataclass
class Session:
    plan: Plan
    backend: str = "auto"
    device: str = "auto"        # where xla partitions run: auto | gpu | cpu
    timings: Timings = field(default_factory=Timings)
    # strata-run's settings of the same names (strata_compiler/settings.py) where not given
    expert_cache: bool = field(default_factory=lambda: settings.get("expert_cache"))   # live GPU expert caches
    cache_policy: str = field(default_factory=lambda: settings.get("cache_policy"))    # hybrid | lru
    multi_gpu: str = field(default_factory=lambda: settings.get("multi_gpu"))   # a striped plan: mesh | host-driven
    miss_path: str = field(default_factory=lambda: settings.get("miss_path"))   # expert caches' misses: cpu | gpu | auto

    def __post_init__(self) -> None:
        bound = {n.backend for n in self.plan.graph.nodes}
        gpus = {n.device for n in self.plan.graph.nodes if n.backend == "xla"}
        # several backends, or xla on several GPUs (gpu:0, gpu:1, ...): a partition per device
        mixed = self.backend == "auto" and (len(bound) > 1 or len(gpus) > 1)
        if self.backend == "auto" and len(bound) == 1 and self.plan.meta["model"].get("placed_by") \
                and bound <= {"llvm", "reference"}:
            # placed on the CPU alone (--place rules or the cost model under its --gpu-mem): as placed,
            # not on a GPU that `auto` would otherwise pick
            self.backend = bound.pop()
        if mixed and "xla" in bound and self.device == "auto":
            from strata_compiler.backends.xla.device import gpu_available

            if not gpu_available():   # the CPU fallback: every op on the CPU backend, one warning
                n_gpu = sum(1 for n in self.plan.graph.nodes if n.backend == "xla" and n.op.value != "transfer")
                cpu = resolve_backend("auto")
                print(f"strata-run: warning: the plan puts {n_gpu} ops on a GPU and this host has none; running "
                      f"everything on the CPU ({cpu}); --device cpu runs those ops on JAX's CPU platform instead",
                      file=sys.stderr)
                mixed, self.backend = False, cpu
        if mixed:   # a mixed plan runs as placed (xla parts on JAX, CPU parts on llvm or reference)
            if "llvm" in bound:
                resolve_backend("llvm")
            self.backend = "+".join(sorted(bound))
        else:
            self.backend = resolve_backend(self.backend)
        from .disk_tier import DiskTier

        self.disk = DiskTier(self.plan)     # first: it checks its sections and lets their pages go
        if not self.disk.ranges:
            self.disk = None
        self.miss_path = self._miss_path(mixed)
        self.graph = self.plan.graph    # the graph this session runs
        if self.miss_path == "gpu":     # the caches' host shares on the GPU (read in place): a graph of its own
            from .mapped import rebind_misses

            self.graph = rebind_misses(self.plan.graph)
        if mixed:
            from .partitions import MixedExecutor

            self.executor = MixedExecutor(self.graph, self.plan.weights, self.device, shrink_caches=self.expert_cache,
                                          multi_gpu=self.multi_gpu, miss_path=self.miss_path)
        else:
            self.executor = make_executor(self.backend, self.graph, self.plan.weights, device=self.device)
        if mixed and self.expert_cache:
            self.executor.enable_expert_cache(policy=self.cache_policy)
        self.cache: KVCache | None = None

    def _miss_path(self, mixed: bool) -> str:
        """Where the expert caches' misses compute in this run (`miss_path`: auto picks gpu where
        the plan has expert caches, their GPU shares run on a CUDA GPU, and no expert streams from
        disk; gpu pins the host shares' pages, which a disk tier must be free to drop)."""
        if self.miss_path not in ("auto", "cpu", "gpu"):
            raise UsageError(f"miss path {self.miss_path!r} (--miss-path): expected auto, cpu or gpu")
        cached = [n for n in self.plan.graph.nodes if n.op.value == "moe_ffn" and n.attr("cache", "")]
        if not (mixed and self.expert_cache and cached) or self.miss_path == "cpu":
            return "cpu"
        if self.disk is not None:
            if self.miss_path == "gpu":
                raise UsageError("--miss-path gpu reads the experts in host memory in place and this plan streams "
                                 "experts from disk (compiled with --host-mem); use --miss-path cpu")
            return "cpu"
        if self.miss_path == "gpu":
            return "gpu"
        if self.device == "cpu":
            return "cpu"
        from strata_compiler.backends.xla import cuda_rt
        from strata_compiler.backends.xla.device import gpu_available

        return "gpu" if gpu_available() and cuda_rt.available() else "cpu"

    def reset(self, batch: int, capacity: int) -> None:
        m = self.plan.meta["model"]
        self.cache = KVCache(m["n_layers"], batch, m["n_kv_heads"], m["head_dim"], capacity)

    def load_row(self, cache: KVCache, slot: int, src: KVCache, row: int = 0) -> None:
        """Row `row` of `src` (a sequence prefilled in a cache of its own) into row `slot` of `cache`,
        wherever this session's executor keeps their layers (host arrays, a device)."""
        self.executor.load_row(cache, slot, src, row)

    def batch_stepper(self):
        """The executor whose `batch_step` runs the server's decode steps (a whole plan on one xla
        device, no disk tier: steps launched before the last one's tokens are on the host), else None."""
        return self.executor if self.disk is None and self.executor.can_batch_step() else None

    @staticmethod
    def capacity_for(T: int, max_new_tokens: int, chunk: int | None = None) -> int:
        """The KV cache length `generate` gives a prompt of T tokens prefilled `chunk` at a time:
        room for the xla backend's padding of the last chunk (a power-of-two bucket) and the new
        tokens, in steps of 64 so that device caches of nearby lengths share one compiled step."""
        last = T - (T - 1) // chunk * chunk if chunk and T > 0 else T
        bucket = 1 << max(4, (last - 1).bit_length())
        return -(-(T - last + max(last, bucket) + max_new_tokens) // 64) * 64

    def default_chunk(self, B: int, T: int, max_new_tokens: int) -> int:
        """Prompt tokens per prefill step: PREFILL_CHUNK, or where the executor prefills on a GPU
        GPU_PREFILL_CHUNK (its attention the flash kernel), else up to that while a step's attention
        scores fit GPU_SCORES_BYTES."""
        caps = self.executor.caps()
        if not caps.prefills_on_gpu:
            return PREFILL_CHUNK
        if caps.flash_prefill:
            return GPU_PREFILL_CHUNK            # its attention keeps no scores in memory
        heads = max((int(n.attr("n_heads")) for n in self.plan.graph.nodes if n.has_attr("n_heads")), default=1)
        chunk = GPU_PREFILL_CHUNK
        while chunk > PREFILL_CHUNK and (
                4 * B * heads * min(chunk, T) * self.capacity_for(T, max_new_tokens, chunk) > GPU_SCORES_BYTES):
            chunk //= 2
        return chunk

    def step(self, ids: np.ndarray, last_only: bool = False) -> np.ndarray:
        """Run ids i64[B, T] through the model at the cache's position; logits f32[B, T, V], or with
        `last_only` the last token's f32[B, 1, V] (a GPU then copies only those to the host)."""
        assert self.cache is not None, "call reset() first"
        vocab = self.plan.meta["model"]["vocab_size"]
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise UsageError(f"token id {int(ids.max() if ids.max() >= vocab else ids.min())} is outside the vocabulary [0, {vocab})")
        if trace.ACTIVE is None:
            out = self.executor.run(ids, self.cache, last_only=last_only)
        else:
            with trace.ACTIVE.span("prefill" if ids.shape[1] > 1 else "decode", "step", cat="step",
                                   batch=int(ids.shape[0]), tokens=int(ids.shape[1])):
                out = self.executor.run(ids, self.cache, last_only=last_only)
        if self.disk is not None:       # the disk tier's pages leave the process after each step
            self.disk.release()
        out = out[self.plan.graph.outputs[0]]
        return out[:, -1:] if last_only else out

    def _ahead(self, sampler: Sampler, B: int) -> bool:
        """Whether the rest of a generation decodes ahead (decode_ahead): no disk tier, a plan whose
        decode step is one program without host calls, and plain greedy or a sampling the executor
        chooses tokens by where it computes them."""
        settings = None if sampler.plain_greedy else sampler.settings
        return self.disk is None and self.executor.can_decode_ahead(B, self.cache, settings)

    @staticmethod
    def _ahead_sampling(sampler: Sampler, seen: np.ndarray, n: int) -> AheadSampling | None:
        """What decode_ahead needs to sample n steps as `sampler` would after the tokens `seen`
        i64[B, T] (None: plain greedy): its uniforms, drawn from its generator, and each row's
        window of the tokens seen last."""
        if sampler.plain_greedy:
            return None
        B = seen.shape[0]
        w = sampler.settings.window     # (-1, every token, samples on the host: never here)
        hist = np.full((B, w), -1, np.int64)
        if w:
            last = seen[:, -w:]
            hist[:, w - last.shape[1]:] = last
        u = np.zeros((n, B)) if sampler.greedy else sampler.rng.random((n, B))     # as n calls of B draws
        return AheadSampling(sampler.settings, u, hist)

    def generate(self, prompt: np.ndarray, max_new_tokens: int, sampler: Sampler, stop_ids: tuple[int, ...] = (),
                 prefill_chunk: int | None = None, keep_logits: bool = True,
                 on_token: Callable[[int, np.ndarray], bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Prefill the prompt i64[B, T] `prefill_chunk` tokens a step (its activations bounded by
        the chunk; default: `default_chunk`) into a new KV cache, then decode. Returns (the prompt's
        logits f32[B, T, V], or its last token's [B, 1, V] without `keep_logits`; the new ids
        i64[B, N]).

        on_token(i, tokens) runs once token i is chosen (tokens: its ids i64[B]) while more may
        follow (not for the last one; for those decoded ahead, once each is read); True stops there. Ctrl-C, or
        that stop, raises Interrupted and non-finite logits NonFiniteLogits, each holding what was
        made before."""
        B, T = prompt.shape
        check_room(self.plan, B, T, max_new_tokens, keep_logits)
        if prefill_chunk is None:
            prefill_chunk = self.default_chunk(B, T, max_new_tokens)
        if prefill_chunk < 1:
            raise UsageError(f"prefill chunk {prefill_chunk}: expected at least 1 token")
        self.reset(B, self.capacity_for(T, max_new_tokens, prefill_chunk))
        logits = self._prefill(prompt, prefill_chunk, keep_logits)
        return logits, self._decode(prompt, logits, max_new_tokens, sampler, stop_ids, on_token)

    def extend(self, ids: np.ndarray, max_new_tokens: int, sampler: Sampler, stop_ids: tuple[int, ...] = (),
               history: np.ndarray | None = None,
               on_token: Callable[[int, np.ndarray], bool] | None = None) -> np.ndarray:
        """`generate` on the cache as earlier steps left it (a chat's conversation so far): ids
        i64[B, T] prefilled at its position, then the same decoding. history i64[B, H]: the tokens
        before the new ones that the repetition penalty sees (default: ids). Returns the new ids;
        the last one is not stepped (the cache then holds the ids and all new tokens but the last)."""
        if self.cache is None:
            raise UsageError("Session.extend: no KV cache yet (call reset() or generate() first)")
        B, T = ids.shape
        if self.cache.length + T + max_new_tokens > self.cache.capacity:
            raise UsageError(f"{self.cache.length} tokens in the cache, {T} new and -n {max_new_tokens} pass its "
                             f"{self.cache.capacity} positions")
        logits = self._prefill(ids, self.default_chunk(B, T, max_new_tokens), keep_logits=False)
        return self._decode(ids if history is None else history, logits, max_new_tokens, sampler, stop_ids, on_token)

    def _prefill(self, prompt: np.ndarray, chunk: int, keep_logits: bool) -> np.ndarray:
        """The prompt's steps, `chunk` tokens each, at the cache's position: its logits (all, or the
        last token's)."""
        B, T = prompt.shape
        c0 = compile_seconds()
        t0 = time.perf_counter()
        parts = []
        try:
            for at in range(0, T, chunk):
                out = self.step(prompt[:, at:at + chunk], last_only=not keep_logits)
                parts = [*parts, out] if keep_logits else [out[:, -1:]]
        except KeyboardInterrupt:
            raise Interrupted(None, np.zeros((B, 0), np.int64)) from None
        self.timings.prefill_seconds += time.perf_counter() - t0
        self.timings.prefill_compile_seconds += compile_seconds() - c0
        self.timings.prefill_tokens += B * T
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)

    def _decode(self, history: np.ndarray, logits: np.ndarray, max_new_tokens: int, sampler: Sampler,
                stop_ids: tuple[int, ...], on_token) -> np.ndarray:
        """The one decode loop of a Session (strata-run, --chat; the server's batches have theirs):
        sample from the last logits, step the token, until -n, every row stopped or `on_token` says
        so; the rest decoded ahead where the executor can (`_ahead`). history: the tokens the
        penalty window sees before the new ones."""
        B = history.shape[0]
        new = np.zeros((B, max_new_tokens), np.int64)
        done = np.zeros(B, bool)
        last = logits[:, -1]
        c1 = compile_seconds()
        t0 = time.perf_counter()
        i = 0           # tokens made
        try:
            while i < max_new_tokens:
                _check_finite(last, i, logits, new[:, :i])
                seen = (np.concatenate([history, new[:, :i]], axis=1) if sampler.needs_history else None)
                tok = sampler(last, seen)
                if i == 0 and self.timings.first_token_at is None:
                    self.timings.first_token_at = process_seconds()
                new[:, i] = tok
                i += 1
                done |= np.isin(tok, stop_ids)
                if done.all() or i == max_new_tokens:
                    break
                if on_token is not None and on_token(i - 1, tok):
                    raise KeyboardInterrupt
                if self._ahead(sampler, B):     # the rest with each step dispatched before the last one ends
                    try:
                        i += self._decode_ahead(history, new, i, tok, done, sampler, stop_ids, on_token)
                    except KeyboardInterrupt as e:
                        i += getattr(e, "made", 0)
                        raise
                    break
                last = self.step(tok[:, None])[:, -1]
        except KeyboardInterrupt:
            raise Interrupted(logits, new[:, :i]) from None
        finally:
            self.timings.decode_seconds += time.perf_counter() - t0
            self.timings.decode_compile_seconds += compile_seconds() - c1
            self.timings.decode_tokens += B * max(i - 1, 0)
        return new[:, :i]

    def _decode_ahead(self, history, new, i: int, tok, done, sampler: Sampler, stop_ids, on_token) -> int:
        """The rest of a generation after token i - 1 (`tok`) through the executor's decode_ahead,
        written into new[:, i:]: how many it made (those made before an interrupt stay too)."""
        rest = new[:, :0]
        try:
            n = new.shape[1] - i
            how = self._ahead_sampling(sampler, np.concatenate([history, new[:, :i]], axis=1), n)
            rest = self.executor.decode_ahead(
                tok, self.cache, n, stop_ids, done, sampling=how,
                on_token=None if on_token is None else (lambda j, t: on_token(i + j, t)))
        except KeyboardInterrupt as e:      # the steps that finished stay (backends/ahead.py)
            rest = getattr(e, "tokens", rest)
            new[:, i:i + rest.shape[1]] = rest
            e.made = rest.shape[1]
            raise
        new[:, i:i + rest.shape[1]] = rest
        return rest.shape[1]


def non_finite(logits: np.ndarray) -> str | None:
    """"NaN" or "Inf" where logits hold such a value (NaN named first), None where all are finite."""
    if np.isfinite(logits).all():
        return None
    return "NaN" if np.isnan(logits).any() else "Inf"


def non_finite_error(what: str, where: str) -> str:
    """NonFiniteLogits' message (every entry point's: strata-run, the server, the API)."""
    return (f"the model's logits are {what} at {where}: the plan's weights hold NaN/Inf or its activations "
            f"overflow; recompile from a checkpoint with finite weights")


def _check_finite(last: np.ndarray, i: int, logits: np.ndarray, new: np.ndarray) -> None:
    """NonFiniteLogits where the logits f32[B, V] that choose token i hold NaN or Inf."""
    if non_finite(last) is None:
        return
    b = int(np.flatnonzero(~np.isfinite(last).all(axis=-1))[0])
    what = non_finite(last[b])
    where = "the prompt's last token (prefill)" if i == 0 else f"decode step {i}"
    raise NonFiniteLogits(non_finite_error(what, f"{where}, row {b}"), logits, new)


FALLBACK_CTX = 4096     # the context of a plan that does not say its model's (meta model.max_position)
KV_SHARE = 0.5          # the share of the host's available memory a default context's KV cache may take


def default_ctx(plan: Plan, rows: int, room: int | None = None) -> int:
    """Tokens per sequence when none is asked for (strata-run --chat, strata-server, the Python API
    alike): the model's own context, bounded so that the f32 KV cache of `rows` such sequences takes
    at most KV_SHARE of the memory available now — the host's, and `room` (bytes free on the GPU
    that holds the cache: Executor.kv_room); a multiple of 64, at least 64 (or the model's)."""
    m = plan.meta["model"]
    limit = int(m.get("max_position") or 0) or FALLBACK_CTX
    per_token = 8 * m["n_layers"] * m["n_kv_heads"] * m["head_dim"] * max(rows, 1)
    free = host_memory()[1] if room is None else min(host_memory()[1], room)
    fits = int(free * KV_SHARE) // max(per_token, 1) // 64 * 64
    return min(limit, max(fits, 64))


def check_room(plan: Plan, B: int, T: int, max_new_tokens: int, keep_logits: bool = True) -> None:
    """Refuse, before anything is allocated, a generation past the model's positions (meta
    model.max_position) or one whose KV cache, ids and kept logits exceed this host's memory."""
    m = plan.meta["model"]
    limit = m.get("max_position")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 and T + max_new_tokens > limit:
        if T >= limit:
            raise UsageError(f"the prompt's {T} tokens leave no room for new ones in the model's {limit} positions "
                             f"(max_position_embeddings); shorten it to {limit - 1} tokens or fewer")
        raise UsageError(f"-n {max_new_tokens}: the prompt's {T} tokens and {max_new_tokens} new ones pass the "
                         f"model's {limit} positions (max_position_embeddings); give -n {limit - T} or less")
    cap = Session.capacity_for(T, max_new_tokens)
    need = 8 * m["n_layers"] * B * m["n_kv_heads"] * m["head_dim"] * cap + 8 * B * max_new_tokens
    if keep_logits:
        need += 4 * B * T * m["vocab_size"]
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > have:
        raise UsageError(f"-n {max_new_tokens}: {B} sequence(s) of {T} + {max_new_tokens} tokens need "
                         f"{need / 2**30:.1f} GiB (KV cache, ids, logits) and this host has {have / 2**30:.1f} GiB; "
                         f"give a smaller -n or a shorter prompt")
