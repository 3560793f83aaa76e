"""One rank of the epjit.jax GPU test (tests/test_gpu_jax.py), one rank a GPU: a MoE step of toy experts under
jax.jit through epjit.jax, against the same step through the eager Buffer, over many steps with inputs that move
between steps, eager and jitted calls interleaved (low latency bf16 and FP8, normal mode with num_worst_tokens); the
first step against epjit.reference; the normal-mode layer's gradients against the dense layer; the per-call time of
jitted low-latency dispatch and combine at 1 and 128 tokens beside the CUDA-graph replay of the eager call. Prints
``RESULT {json}``."""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # epjit's buffers and CuPy's pool beside XLA's

import numpy as np

import epjit
from epjit import reference

M, H, K, L = 128, 2048, 4, 4  # tokens a rank at most, hidden, top-k, local experts


def setup(group):  # noqa: ANN001, ANN201
    import jax

    jax.config.update("jax_platforms", "cuda")
    # XLA sees every GPU and runs on this rank's (jax_cuda_visible_devices of another GPU than 0 breaks XLA's device
    # ids in one process: every op then fails with "Device id 1 is out of range [0, 1)").
    jax.config.update("jax_default_device", jax.devices()[group.device])
    return jax


def routing(jnp, jax, step, rank, n, e):  # noqa: ANN001, ANN201
    """Moving inputs: x, distinct top-k experts (one slot -1 now and then) and weights, new every step."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(7), step), rank)
    kx, ki, kw = jax.random.split(key, 3)
    x = jax.random.normal(kx, (n, H), jnp.float32).astype(jnp.bfloat16)
    idx = jnp.argsort(jax.random.uniform(ki, (n, e)), axis=1)[:, :K].astype(jnp.int32)
    idx = idx.at[0, K - 1].set(-1)
    w = jax.random.uniform(kw, (n, K), jnp.float32)
    return x, idx, w


def cp(a):  # noqa: ANN001, ANN201
    import cupy

    return cupy.from_dlpack(a)


def run(args) -> dict:  # noqa: ANN001
    group = epjit.init()
    jax = setup(group)
    import cupy
    import jax.numpy as jnp

    # JAX's client makes a context on every GPU and may leave another GPU current than the one epjit.init() bound;
    # the Buffer binds its own again (reported, to see it happen)
    current_after_jax = cupy.cuda.runtime.getDevice()

    import epjit.jax as ej

    r, rank = group.size, group.rank
    e = L * r
    buf = epjit.Buffer(group, num_nvl_bytes=epjit.Buffer.get_normal_size_hint(r, H, K, e), low_latency_mode=True,
                       num_max_dispatch_tokens_per_rank=M, hidden=H, num_experts=e)
    cases, timing = [], {}
    try:
        coef = (1.0 + (rank * L + jnp.arange(L, dtype=jnp.float32)) / e)[:, None, None]

        @jax.jit
        def ll_experts(recv_x, scales):  # [L, R*M, H] -> bf16; FP8 rows dequantised first
            if scales is not None:
                v = jax.lax.bitcast_convert_type(recv_x, jnp.float8_e4m3fn).astype(jnp.float32)
                v = (v.reshape(L, r * M, H // 128, 128) * scales[..., None]).reshape(L, r * M, H)
            else:
                v = recv_x.astype(jnp.float32)
            return (v * coef).astype(jnp.bfloat16)

        @jax.jit
        def normal_experts(rows, idx, w):  # each row: sum over its local experts of w * (1 + e/E) * row
            acc = jnp.zeros(rows.shape, jnp.float32)
            for k in range(K):
                c = jnp.where(idx[:, k] >= 0, w[:, k] * (1.0 + (rank * L + idx[:, k]) / e), 0.0)
                acc = acc + c[:, None] * rows.astype(jnp.float32)
            return acc.astype(jnp.bfloat16)

        def ll_step(x, idx, w, fp8):  # noqa: ANN001, ANN202
            d = ej.low_latency_dispatch(buf, x, idx, use_fp8=fp8)
            raw = jax.lax.bitcast_convert_type(d.x, jnp.uint8) if fp8 else d.x
            return ej.low_latency_combine(buf, ll_experts(raw, d.x_scales), idx, w, d.handle), d.recv_count

        jit_ll = {fp8: jax.jit(lambda x, idx, w, fp8=fp8: ll_step(x, idx, w, fp8)) for fp8 in (False, True)}
        worst = r * M

        @jax.jit
        def jit_normal(x, idx, w):  # noqa: ANN001, ANN202
            d = ej.dispatch(buf, x, idx, w, num_worst_tokens=worst)
            return ej.combine(buf, normal_experts(d.x, d.topk_idx, d.topk_weights), d.handle), d.handle.status

        def eager_ll(x, idx, w, fp8):  # noqa: ANN001, ANN202
            cidx = cp(idx).astype(cupy.int64)
            d = buf.low_latency_dispatch(cp(x), cidx, M, e, use_fp8=fp8)
            y = ll_experts(jax.dlpack.from_dlpack(d.x), jax.dlpack.from_dlpack(d.x_scales) if fp8 else None)
            out = buf.low_latency_combine(cp(y), cidx, cp(w), d.handle).x
            return out, d.recv_count

        def eager_normal(x, idx, w):  # noqa: ANN001, ANN202
            cidx = cp(idx).astype(cupy.int64)
            d = buf.dispatch(cp(x), topk_idx=cidx, topk_weights=cp(w), num_experts=e, num_worst_tokens=worst)
            y = normal_experts(jax.dlpack.from_dlpack(d.x), jax.dlpack.from_dlpack(d.topk_idx.astype(cupy.int32)),
                               jax.dlpack.from_dlpack(d.topk_weights))
            return buf.combine(cp(y), d.handle).x

        n = M // 2
        mismatches = {"ll_bf16": 0, "ll_fp8": 0, "normal": 0}
        first = {}
        t0 = time.perf_counter()
        for step in range(args.steps):
            x, idx, w = routing(jnp, jax, step, rank, n, e)
            for fp8 in (False, True):
                name = "ll_fp8" if fp8 else "ll_bf16"
                got, count = jit_ll[fp8](x, idx, w)
                jax.block_until_ready(got)  # XLA's stream and the Buffer's are ordered by the host here
                want, want_count = eager_ll(x, idx, w, fp8)
                cupy.cuda.get_current_stream().synchronize()
                same = bool(cupy.array_equal(cp(got), want)) and bool(cupy.array_equal(cp(count), want_count))
                mismatches[name] += not same
                if step == 0:
                    first[name] = (np.asarray(got), x, idx, w)
            got, status = jit_normal(x, idx, w)
            jax.block_until_ready(got)
            want = eager_normal(x, idx, w)
            cupy.cuda.get_current_stream().synchronize()
            mismatches["normal"] += not (bool(cupy.array_equal(cp(got), want)) and int(status) == 0)
            if step == 0:
                first["normal"] = (np.asarray(got), x, idx, w)
        buf.synchronize()  # raises what a jitted call's kernels found on the device
        loop_s = time.perf_counter() - t0
        for name, bad in mismatches.items():
            cases.append({"case": f"{name}_jit_eq_eager", "ok": bad == 0, "mismatched_steps": bad,
                          "steps": args.steps})
        cases += check_reference(group, first, e, worst)
        cases.append(check_gradients(jax, jnp, ej, buf, group, e, worst))
        timing = time_calls(jax, jnp, ej, buf, group, e, args.repeat)
        return {"cases": cases, "timing": timing, "loop_s": round(loop_s, 2), "device": group.device,
                "current_after_jax": current_after_jax}
    finally:
        buf.close()


def check_reference(group, first, e, worst) -> list[dict]:  # noqa: ANN001
    """Step 0 of each case against epjit.reference over every rank's inputs (calc_diff: the experts' bf16 rounding
    lands where the reference's does, so this is near 0)."""
    out = []
    gathered = {k: group.allgather_object(tuple(np.asarray(a) for a in v[1:])) for k, v in first.items()}
    for name, per_rank in gathered.items():
        xs, idxs, ws = ([p[i] for p in per_rank] for i in range(3))
        coef = lambda rr, loc: 1.0 + (rr * L + loc) / e  # noqa: E731
        if name == "normal":
            d = reference.dispatch(xs, idxs, ws, e, num_worst_tokens=worst)
            ys = []
            for rr, res in enumerate(d):
                acc = np.zeros(res.x.shape, np.float32)
                for k in range(K):
                    c = np.where(res.topk_idx[:, k] >= 0, res.topk_weights[:, k] * coef(rr, res.topk_idx[:, k]), 0)
                    acc += c[:, None].astype(np.float32) * res.x.astype(np.float32)
                ys.append(acc.astype(reference.BF16))
            want = reference.combine(ys, [res.handle for res in d])[group.rank].x
        else:
            fp8 = name == "ll_fp8"
            d = reference.low_latency_dispatch(xs, idxs, M, e, use_fp8=fp8)
            ys = []
            for rr, res in enumerate(d):
                v = reference.fp8_to_float(res.x, res.x_scales) if fp8 else res.x.astype(np.float32)
                ys.append((v * coef(rr, np.arange(L, dtype=np.float32))[:, None, None]).astype(reference.BF16))
            want = reference.low_latency_combine(ys, idxs, ws, [res.handle for res in d])[group.rank].x
        diff = reference.calc_diff(first[name][0].astype(np.float32), want.astype(np.float32))
        out.append({"case": f"{name}_vs_reference", "ok": bool(diff < 1e-5), "calc_diff": float(diff)})
    return out


def check_gradients(jax, jnp, ej, buf, group, e, worst) -> dict:  # noqa: ANN001
    """The normal-mode layer's gradients in x, the gate weights and an expert scale, jitted, against the dense layer
    (every expert applied where the token is). x and the weights are the rank's own tokens': their gradients
    compare rank by rank. The scale is the experts' parameter: each rank's scales its own experts and gets the
    gradient of every rank's loss through them, while the dense layer's on each rank scales every expert for that
    rank's tokens; so the scale's gradients compare summed over the ranks (the whole loss's)."""
    rank = group.rank
    x, idx, w = routing(jnp, jax, 12345, rank, M // 2, e)
    proj = jnp.linspace(-1.0, 1.0, H, dtype=jnp.float32)

    def layer(x, w, s):  # noqa: ANN001, ANN202
        d = ej.dispatch(buf, x, idx, w, num_worst_tokens=worst)
        acc = jnp.zeros(d.x.shape, jnp.float32)
        for k in range(K):
            loc = d.topk_idx[:, k]
            c = jnp.where(loc >= 0, d.topk_weights[:, k] * s * (1.0 + (rank * L + loc) / e), 0.0)
            acc = acc + c[:, None] * d.x.astype(jnp.float32)
        return (ej.combine(buf, acc.astype(jnp.bfloat16), d.handle).astype(jnp.float32) * proj).sum()

    def dense(x, w, s):  # noqa: ANN001, ANN202
        acc = jnp.zeros(x.shape, jnp.float32)
        for k in range(K):
            c = jnp.where(idx[:, k] >= 0, w[:, k] * s * (1.0 + idx[:, k] / e), 0.0)
            acc = acc + c[:, None] * x.astype(jnp.float32)
        return (acc.astype(jnp.bfloat16).astype(jnp.float32) * proj).sum()

    got = jax.jit(jax.grad(layer, argnums=(0, 1, 2)))(x, w, 1.0)
    want = jax.grad(dense, argnums=(0, 1, 2))(x, w, 1.0)
    got, want = [np.asarray(g, np.float32) for g in got], [np.asarray(v, np.float32) for v in want]
    got[2], want[2] = (np.sum(group.allgather_object(v), axis=0) for v in (got[2], want[2]))
    diffs = [float(reference.calc_diff(g, v)) for g, v in zip(got, want, strict=True)]
    # the low-latency dispatch's backward (a combine with unit weights): each token gets its slots' count
    g = jax.jit(jax.grad(lambda x: ej.low_latency_dispatch(buf, x, idx, use_fp8=False).x.astype(jnp.float32)
                         .sum()))(x)
    named = (np.asarray(idx) >= 0).sum(axis=1).astype(np.float32)
    ll_ok = bool(np.array_equal(np.asarray(g, np.float32), np.broadcast_to(named[:, None], g.shape)))
    return {"case": "gradients_vs_dense", "ok": max(diffs) < 1e-4 and ll_ok, "calc_diff": diffs, "ll_dispatch": ll_ok}


def time_calls(jax, jnp, ej, buf, group, e, repeat) -> dict:  # noqa: ANN001
    """Microseconds a call (wall time of ``repeat`` back-to-back calls, then one wait; the slowest rank's) of the
    jitted FP8 dispatch and bf16 combine at 1 and 128 tokens, beside CUDA-graph replays of the eager calls."""

    out = {}
    for n in (1, M):
        x, idx, w = routing(jnp, jax, 99, group.rank, n, e)
        disp = jax.jit(lambda x, idx: ej.low_latency_dispatch(buf, x, idx, use_fp8=True))
        d = disp(x, idx)
        y = jnp.ones((L, group.size * M, H), jnp.bfloat16)
        comb = jax.jit(lambda y, idx, w, h: ej.low_latency_combine(buf, y, idx, w, h))
        for name, fn, a in (("dispatch", disp, (x, idx)), ("combine", comb, (y, idx, w, d.handle))):
            jax.block_until_ready(fn(*a))
            group.barrier()
            t = time.perf_counter()
            for _ in range(repeat):
                res = fn(*a)
            jax.block_until_ready(res)
            out[f"jit_{name}_{n}"] = max(group.allgather_object((time.perf_counter() - t) / repeat * 1e6))
        for name, call in eager_calls(buf, x, idx, w, y, e):
            out[f"graph_{name}_{n}"] = max(group.allgather_object(graph_us(call, group, repeat)))
    return {k: round(v, 1) for k, v in out.items()}


def eager_calls(buf, x, idx, w, y, e) -> list:  # noqa: ANN001
    """The eager FP8 dispatch and bf16 combine of these arrays, as callables (CuPy arrays: no int64 in JAX)."""
    import cupy

    cx, cidx, cw, cy = cp(x), cp(idx).astype(cupy.int64), cp(w), cp(y)
    handle = buf.low_latency_dispatch(cx, cidx, M, e, use_fp8=True).handle
    return [("dispatch", lambda: buf.low_latency_dispatch(cx, cidx, M, e, use_fp8=True)),
            ("combine", lambda: buf.low_latency_combine(cy, cidx, cw, handle))]


def graph_us(call, group, repeat) -> float:  # noqa: ANN001
    """Microseconds a replay of ``call`` captured in a CUDA graph on a CuPy stream (-1: the capture failed)."""
    import cupy

    s = cupy.cuda.Stream(non_blocking=True)
    try:
        with s:
            call()
            call()
            s.synchronize()
            s.begin_capture()
            call()
            g = s.end_capture()
            g.launch(s)
            s.synchronize()
            group.barrier()
            t = time.perf_counter()
            for _ in range(repeat):
                g.launch(s)
            s.synchronize()
            return (time.perf_counter() - t) / repeat * 1e6
    except Exception:  # noqa: BLE001 - reported as -1 beside the jitted figures
        traceback.print_exc()
        return -1.0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=200)
    args = p.parse_args()
    rank = int(os.environ.get("EPJIT_RANK", os.environ.get("RANK", "0")))
    try:
        result = {"rank": rank, **run(args)}
    except Exception as e:  # noqa: BLE001 (reported in the RESULT, then the rank fails)
        traceback.print_exc()
        result = {"rank": rank, "error": f"{type(e).__name__}: {e}"[:600]}
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if "error" not in result and all(c["ok"] for c in result["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
