"""A generation session: a plan bound to a backend, a KV cache, prefill and decode steps."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np

from strata_compiler.backends import make_executor, resolve_backend
from strata_compiler.errors import UsageError

from strata_compiler import trace
from strata_compiler.kv_cache import KVCache
from .plan import Plan
from .sampler import Sampler


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


@dataclass
class Timings:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    # of those seconds, JAX compiling the programs (the first run of a plan, or a new shape)
    prefill_compile_seconds: float = 0.0
    decode_compile_seconds: float = 0.0

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
    expert_cache: bool = True   # live GPU expert caches for the plan's cached layers (mixed runs)
    cache_policy: str = "hybrid"
    prefetch: bool = False      # start expert copies from the next layer's router on this layer's state
                                # (off by default: it has cost more than it saved when measured)
    multi_gpu: str = "mesh"     # a striped plan on several GPUs: one sharded computation, or "host"-driven
    miss_path: str = "auto"     # expert caches' misses: "cpu" (the plan's host share), "gpu" (read in place), auto

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
            self.executor.enable_expert_cache(policy=self.cache_policy, prefetch=self.prefetch)
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
        fn = getattr(self.executor, "load_row", None)
        if fn is not None:
            fn(cache, slot, src, row)
        else:
            cache.load_row(slot, src, row)

    @staticmethod
    def capacity_for(T: int, max_new_tokens: int) -> int:
        """The KV cache length `generate` gives a prompt of T tokens: room for the xla backend's
        padded prefill (a power-of-two bucket) and the new tokens, in steps of 64 so that device
        caches of nearby lengths share one compiled step."""
        bucket = 1 << max(4, (T - 1).bit_length())
        return -(-(max(T, bucket) + max_new_tokens) // 64) * 64

    def step(self, ids: np.ndarray) -> np.ndarray:
        """Run ids i64[B, T] through the model at the cache's position; logits f32[B, T, V]."""
        assert self.cache is not None, "call reset() first"
        vocab = self.plan.meta["model"]["vocab_size"]
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise UsageError(f"token id {int(ids.max() if ids.max() >= vocab else ids.min())} is outside the vocabulary [0, {vocab})")
        if trace.ACTIVE is None:
            out = self.executor.run(ids, self.cache)
        else:
            with trace.ACTIVE.span("prefill" if ids.shape[1] > 1 else "decode", "step", cat="step",
                                   batch=int(ids.shape[0]), tokens=int(ids.shape[1])):
                out = self.executor.run(ids, self.cache)
        if self.disk is not None:       # the disk tier's pages leave the process after each step
            self.disk.release()
        return out[self.plan.graph.outputs[0]]

    def _ahead(self, sampler: Sampler, B: int) -> bool:
        """Whether the rest of a generation decodes ahead (MixedExecutor.decode_ahead): greedy, no
        disk tier, and a plan whose decode step is one program without host calls."""
        can = getattr(self.executor, "can_decode_ahead", None)
        return sampler.temperature <= 0 and self.disk is None and can is not None and can(B, self.cache)

    def generate(self, prompt: np.ndarray, max_new_tokens: int, sampler: Sampler,
                 stop_ids: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
        """Prefill the prompt i64[B, T], then decode. Returns (prompt logits [B,T,V], new ids [B,N])."""
        B, T = prompt.shape
        self.reset(B, self.capacity_for(T, max_new_tokens))
        c0 = compile_seconds()
        t0 = time.perf_counter()
        logits = self.step(prompt)
        self.timings.prefill_seconds += time.perf_counter() - t0
        c1 = compile_seconds()
        self.timings.prefill_compile_seconds += c1 - c0
        self.timings.prefill_tokens += B * T
        new = np.zeros((B, max_new_tokens), np.int64)
        done = np.zeros(B, bool)
        last = logits[:, -1]
        t0 = time.perf_counter()
        for i in range(max_new_tokens):
            tok = sampler(last)
            new[:, i] = tok
            done |= np.isin(tok, stop_ids)
            if done.all() or i == max_new_tokens - 1:
                new = new[:, : i + 1]
                break
            if self._ahead(sampler, B):     # the rest with each step dispatched before the last one ends
                rest = self.executor.decode_ahead(tok, self.cache, max_new_tokens - 1 - i, stop_ids, done)
                new = np.concatenate([new[:, : i + 1], rest], axis=1)
                break
            last = self.step(tok[:, None])[:, -1]
        self.timings.decode_seconds += time.perf_counter() - t0
        self.timings.decode_compile_seconds += compile_seconds() - c1
        self.timings.decode_tokens += B * max(new.shape[1] - 1, 0)
        return logits, new
