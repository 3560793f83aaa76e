"""epjit inside ``jax.jit`` and ``jax.shard_map``: low-latency dispatch and combine, and normal-mode dispatch and
combine with ``num_worst_tokens``, as operations of the XLA program, differentiable (``jax.custom_vjp``). One process
a GPU, as every epjit job: ``epjit.init()`` and ``epjit.Buffer`` as usual, beside ``jax.distributed.initialize``
where the job has several processes (docs/jax.md).

Only JAX users import it (``import epjit.jax``); ``import epjit`` never loads JAX.

    import epjit.jax as ej

    d = ej.low_latency_dispatch(buf, x, topk_idx, use_fp8=False)       # LowLatencyDispatch
    out = ej.low_latency_combine(buf, y, topk_idx, topk_weights, d.handle)
    d = ej.dispatch(buf, x, topk_idx, topk_weights, num_worst_tokens=W)  # Dispatch
    out = ej.combine(buf, y, d.handle)

Each call builds its call site (epjit.ops.xla) while JAX traces, checked as the eager call is; the route
(epjit.jax.route) makes it an XLA operation.
"""

from __future__ import annotations

from .calls import (
    Dispatch,
    Handle,
    LowLatencyDispatch,
    LowLatencyHandle,
    combine,
    dispatch,
    low_latency_combine,
    low_latency_dispatch,
)

__all__ = ["Dispatch", "Handle", "LowLatencyDispatch", "LowLatencyHandle", "combine", "dispatch",
           "low_latency_combine", "low_latency_dispatch"]
