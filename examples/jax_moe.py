"""A MoE decode step in JAX, expert-parallel through epjit inside jax.jit and jax.shard_map (docs/jax.md):

    router -> top-k experts (int32 ids) -> epjit.jax.low_latency_dispatch (FP8) -> each local expert's matmul
    -> epjit.jax.low_latency_combine (gate weights applied there)

jitted as one XLA program, then checked against epjit.reference over every rank's tokens. One process a GPU
(epjit's launcher, mpirun or torchrun; add ``jax.distributed.initialize`` where JAX itself must see the other
processes). Without GPUs this says so and runs the same step on the reference backend over simulated ranks.

    python examples/jax_moe.py                            # CPU: simulated ranks
    python -m epjit.launch -n 4 examples/jax_moe.py       # GPUs: one rank a GPU
"""

from __future__ import annotations

import argparse
import os
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave the GPU to epjit's buffers as well

import numpy as np

from epjit import reference

HIDDEN, EXPERTS_PER_RANK, TOPK, MAX_TOKENS = 1024, 4, 4, 64


def layer(rank: int, num_ranks: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The router (every rank the same) and this rank's experts, from one seed."""
    rng = np.random.default_rng(seed)
    e = EXPERTS_PER_RANK * num_ranks
    router = rng.standard_normal((HIDDEN, e), dtype=np.float32) / np.sqrt(HIDDEN)
    experts = rng.standard_normal((e, HIDDEN, HIDDEN), dtype=np.float32) / np.sqrt(HIDDEN)
    return router, experts[rank * EXPERTS_PER_RANK:(rank + 1) * EXPERTS_PER_RANK].astype(reference.BF16)


def tokens(rank: int, n: int) -> np.ndarray:
    return np.random.default_rng(100 + rank).standard_normal((n, HIDDEN), dtype=np.float32).astype(reference.BF16)


def route(x: np.ndarray, router: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    logits = x.astype(np.float32) @ router
    idx = np.argsort(-logits, axis=1, kind="stable")[:, :TOPK].astype(np.int32)
    chosen = np.take_along_axis(logits, idx, axis=1)
    w = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    return idx, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def reference_step(xs: list[np.ndarray], router: np.ndarray, experts: list[np.ndarray]) -> list[np.ndarray]:
    """The step over every rank at once: epjit.reference's dispatch and combine around the same expert matmuls."""
    routed = [route(x, router) for x in xs]
    d = reference.low_latency_dispatch(xs, [i for i, _ in routed], MAX_TOKENS, EXPERTS_PER_RANK * len(xs))
    ys = [np.einsum("erh,eho->ero", reference.fp8_to_float(r.x, r.x_scales), ex.astype(np.float32)).astype(
        reference.BF16) for r, ex in zip(d, experts, strict=True)]
    out = reference.low_latency_combine(ys, [i for i, _ in routed], [w for _, w in routed], [r.handle for r in d])
    return [o.x for o in out]


def gpu_step(group: Any, n: int) -> None:
    import jax

    jax.config.update("jax_platforms", "cuda")
    # XLA sees every GPU and runs on this rank's (jax_cuda_visible_devices of a GPU other than 0 breaks XLA's device
    # ids in one process)
    jax.config.update("jax_default_device", jax.devices()[group.device])
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec

    import epjit
    import epjit.jax as ej

    r = group.size
    router, mine = layer(group.rank, r)
    buf = epjit.Buffer(group, low_latency_mode=True, num_max_dispatch_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                       num_experts=EXPERTS_PER_RANK * r)
    # The expert axis: this process's one device (each rank is its own process and its own SPMD program; epjit
    # moves the tokens between them).
    mesh = Mesh(np.array([jax.devices()[group.device]]), ("expert",))
    w_experts, w_router = jnp.asarray(mine), jnp.asarray(router)

    def step(x: Any) -> Any:
        logits = x.astype(jnp.float32) @ w_router
        chosen, idx = jax.lax.top_k(logits, TOPK)  # int32 ids: no 64-bit mode needed
        weights = jax.nn.softmax(chosen, axis=1)
        d = ej.low_latency_dispatch(buf, x, idx.astype(jnp.int32))
        rows = d.x.astype(jnp.float32) * jnp.repeat(d.x_scales, 128, axis=-1)
        y = jnp.einsum("erh,eho->ero", rows, w_experts.astype(jnp.float32)).astype(jnp.bfloat16)
        return ej.low_latency_combine(buf, y, idx.astype(jnp.int32), weights, d.handle)

    spec = PartitionSpec()
    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    try:
        x = tokens(group.rank, n)
        out = np.asarray(run(jnp.asarray(x)))
        buf.synchronize()  # raises what the kernels found on the device, if anything
        xs = group.allgather_object(x)
        experts = group.allgather_object(mine)
        want = reference_step(xs, router, experts)[group.rank]
        diff = reference.calc_diff(out.astype(np.float32), want.astype(np.float32))
        print(f"rank {group.rank}: jitted decode step of {n} tokens, calc_diff vs epjit.reference {diff:.2e}",
              flush=True)
        assert diff < 1e-4, diff  # the experts' matmuls sum in another order than the reference's
    finally:
        buf.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--ranks", type=int, default=4, help="simulated ranks without GPUs")
    p.add_argument("--cpu", action="store_true", help="the reference backend even where there are GPUs")
    args = p.parse_args()
    import epjit

    group = epjit.init(bind_device=False if args.cpu else None)
    if group.device is None:
        print(f"no GPU: epjit.jax needs one a rank; running the step on epjit.reference over {args.ranks} simulated "
              "ranks instead", flush=True)
        router, _ = layer(0, args.ranks)
        experts = [layer(r, args.ranks)[1] for r in range(args.ranks)]
        out = reference_step([tokens(r, args.tokens) for r in range(args.ranks)], router, experts)
        print(f"reference step: {len(out)} ranks x {out[0].shape} bf16 out, finite: "
              f"{all(np.isfinite(o.astype(np.float32)).all() for o in out)}", flush=True)
        return
    gpu_step(group, args.tokens)


if __name__ == "__main__":
    main()
