"""Several hosts (`strata-run --coordinator HOST:PORT --num-processes N --process-id I`).

JAX's multi-controller model: the same `strata-run` starts on every host with the same plan and
prompt; `jax.distributed.initialize` joins them, after which JAX sees every host's GPUs as one
list of global devices. A plan striped over all of them (`stratac compile --gpus N --gpu-mode
stripe`, N the GPUs of all hosts together) runs as one sharded computation over that mesh
(backends/xla/mesh.py): each process feeds the same inputs, computes the CPU partitions itself,
and the all-reduces that join the expert shares cross hosts. Process 0 prints and writes the
outputs. On JAX's CPU platform (the tests) the collectives go through gloo.
"""

from __future__ import annotations

from strata_compiler.errors import UsageError


def initialize(coordinator: str, num_processes: int, process_id: int) -> int:
    """Join the other processes; returns this process's index."""
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--coordinator {coordinator!r}: expected HOST:PORT, e.g. 10.0.0.1:1234")
    if not 0 <= process_id < num_processes:
        raise UsageError(f"--process-id {process_id}: expected 0 .. {num_processes - 1} (--num-processes "
                         f"{num_processes})")
    import jax

    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU devices' collectives
    except Exception:   # noqa: BLE001 - an older/newer JAX without the option: GPUs use NCCL anyway
        pass
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    return jax.process_index()
