"""One rank of the autograd GPU check: a small MoE layer (dispatch -> per-expert matmul weighted by the gate ->
combine) trained one step through epjit.autograd on the real Buffer, normal mode (exact and worst-token outputs) and
low latency (bf16), eager and through the custom ops under torch.compile(fullgraph=True) with each backend asked for:
"aot_eager" (cases ops_low_latency, ops_normal: the traced graphs run eagerly) and "inductor", torch.compile's default
(cases inductor_low_latency, inductor_normal: the graphs around the ops compiled to kernels). Every rank builds every
rank's inputs from one seed, computes the same layer densely on its own GPU (no communication), and compares its
outputs and the gradients of its tokens, its gate weights and its local experts. Prints ``RESULT {json}``.

Any rank count that divides the 16 experts runs it (the tests run 2 and 4):

    python -m epjit.launch -n 2 tests/ranks/autograd.py [--backends aot_eager,inductor]
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch

import epjit
import epjit.autograd as ag

HIDDEN, TOPK, EXPERTS, MAX_TOKENS = 256, 4, 16, 64
BF16 = torch.bfloat16
# torch.compile's backends, and the prefix of their cases' names (inductor is torch.compile's default backend).
BACKENDS = {"aot_eager": "ops", "inductor": "inductor"}


def inputs(num_ranks: int, device: torch.device, seed: int) -> tuple[list, list, list, torch.Tensor, list]:
    """Every rank's x, topk_idx (distinct experts, some -1), weights and loss coefficients, and every expert's
    matrix; values on coarse grids so that bf16 holds them exactly."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws, coefs = [], [], [], []
    for r in range(num_ranks):
        n = 24 + 9 * r
        xs.append((torch.randint(-8, 8, (n, HIDDEN), generator=g) / 8).to(BF16).to(device))
        idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(n)])
        idx[torch.rand((n, TOPK), generator=g) < 0.2] = -1
        idxs.append(idx.to(device))
        ws.append((torch.randint(1, 8, (n, TOPK), generator=g) / 8).float().to(device))
        coefs.append((torch.randint(-8, 8, (n, HIDDEN), generator=g) / 8).float().to(device))
    mats = (torch.randint(-4, 5, (EXPERTS, HIDDEN, HIDDEN), generator=g) / 64).float().to(device)
    return xs, idxs, ws, mats, coefs


def dense(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, mats: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * (x[t] @ W[idx[t, k]]), with no communication."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(idx.shape[1]):
        y = torch.einsum("th,thg->tg", x.float(), mats[idx[:, j].clamp(min=0)])
        out = out + torch.where((idx[:, j] >= 0)[:, None], w[:, j, None] * y, 0.0)
    return out


def experts_on_rows(recv_x: torch.Tensor, recv_idx: torch.Tensor, recv_w: torch.Tensor,
                    local: torch.Tensor) -> torch.Tensor:
    """Each received row through its local experts, weighted; rows naming none (padding too) give 0."""
    y = torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device)
    for j in range(recv_idx.shape[1]):
        valid = recv_idx[:, j] >= 0
        ys = torch.einsum("rh,rhg->rg", torch.where(valid[:, None], recv_x.float(), 0.0),
                          local[recv_idx[:, j].clamp(min=0)])
        y = y + torch.where(valid[:, None], recv_w[:, j, None] * ys, 0.0)
    return y.to(BF16)


def normal_step(buf, x, idx, w, local, num_worst_tokens: int) -> torch.Tensor:
    d = ag.dispatch(buf, x, idx, w, num_experts=EXPERTS, num_worst_tokens=num_worst_tokens)
    return ag.combine(buf, experts_on_rows(d.x, d.topk_idx, d.topk_weights, local), d.handle).x.float()


def low_latency_step(buf, x, idx, w, local) -> torch.Tensor:
    r = ag.low_latency_dispatch(buf, x, idx, MAX_TOKENS, EXPERTS, use_fp8=False)
    valid = torch.arange(r.x.shape[1], device=x.device)[None, :] < r.recv_count[:, None]
    y = torch.einsum("erh,ehg->erg", torch.where(valid[..., None], r.x.float(), 0.0), local).to(BF16)
    return ag.low_latency_combine(buf, y, idx, w, r.handle).x.float()


def op_steps(bid: int, prefix: str) -> dict:
    """The same layers on the custom ops (compiled below), named ``{prefix}_low_latency`` and ``{prefix}_normal``."""
    def ll(x, idx, w, local):
        recv, _scales, count, meta = torch.ops.epjit.ll_dispatch(bid, x, idx, False, False, False)
        valid = torch.arange(recv.shape[1], device=x.device)[None, :] < count[:, None]
        y = torch.einsum("erh,ehg->erg", torch.where(valid[..., None], recv.float(), 0.0), local).to(BF16)
        return torch.ops.epjit.ll_combine(bid, y, idx, w, meta).float()

    def normal(x, idx, w, local):
        recv, recv_idx, recv_w, handle_id = torch.ops.epjit.dispatch(bid, x, idx, w, EXPERTS, 8 * x.shape[0] + 64)
        y = experts_on_rows(recv, recv_idx, recv_w, local)
        return torch.ops.epjit.combine(bid, y, handle_id, x.shape[0]).float()

    return {f"{prefix}_low_latency": ll, f"{prefix}_normal": normal}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))


def check(name: str, step, group, data) -> dict:
    """One case: this rank's layer through ``step`` against the dense layer of every rank's tokens."""
    xs, idxs, ws, mats, coefs = data
    me, num_local = group.rank, EXPERTS // group.size
    x, w = (t.detach().clone().requires_grad_(True) for t in (xs[me], ws[me]))
    local = mats[me * num_local:(me + 1) * num_local].clone().requires_grad_(True)
    out = step(x, idxs[me], w, local)
    got = torch.autograd.grad((out * coefs[me]).sum(), [x, w, local])
    # Dense: every rank's tokens, so the gradient of this rank's experts sums every rank's contributions.
    dx, dw = (t.detach().clone().requires_grad_(True) for t in (xs[me], ws[me]))
    dmats = mats.clone().requires_grad_(True)
    loss = sum((dense(xs[s], idxs[s], ws[s], dmats) * coefs[s]).sum() for s in range(group.size) if s != me)
    ref = dense(dx, idxs[me], dw, dmats)
    want = torch.autograd.grad(loss + (ref * coefs[me]).sum(), [dx, dw, dmats])
    errors = {"out": rel_err(out, ref), "grad_x": rel_err(got[0], want[0]), "grad_w": rel_err(got[1], want[1]),
              "grad_experts": rel_err(got[2], want[2][me * num_local:(me + 1) * num_local])}
    finite = all(bool(torch.isfinite(g).all()) for g in got)
    return {"case": name, "ok": finite and max(errors.values()) < 2e-2, "finite": finite, **errors}


def compiled_steps(bid: int, backends: list[str]) -> dict:
    """op_steps compiled with each backend; inductor is the default, so it is asked for as users ask for it. The
    backends' closures share their code objects: dynamo guards on the backend, so each compiles its own graphs."""
    steps = {}
    for backend in backends:
        options = {} if backend == "inductor" else {"backend": backend}
        steps.update({name: torch.compile(fn, fullgraph=True, **options)
                      for name, fn in op_steps(bid, BACKENDS[backend]).items()})
    return steps


def parse_backends() -> list[str]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"torch.compile backends of the custom-op cases, comma-separated, of {list(BACKENDS)}")
    backends = [b for b in parser.parse_args().backends.split(",") if b]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        parser.error(f"unknown backend(s) {unknown}: choose from {list(BACKENDS)}")
    return backends


def main() -> int:
    backends = parse_backends()
    group = epjit.init()
    torch.cuda.set_device(group.device)
    device = torch.device("cuda", group.device)
    buf = epjit.Buffer(group, num_nvl_bytes=epjit.Buffer.get_normal_size_hint(group.size, HIDDEN, TOPK, EXPERTS),
                       low_latency_mode=True, num_max_dispatch_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                       num_experts=EXPERTS)
    bid = ag.register(buf)
    cases = {"normal": lambda *a: normal_step(buf, *a, 0),
             "normal_worst_tokens": lambda *a: normal_step(buf, *a, 8 * a[0].shape[0] + 64),
             "low_latency": lambda *a: low_latency_step(buf, *a)}
    cases.update(compiled_steps(bid, backends))
    result: dict = {"rank": group.rank, "size": group.size, "backends": backends, "cases": []}
    name = ""
    try:
        for i, (name, step) in enumerate(cases.items()):
            result["cases"].append(check(name, step, group, inputs(group.size, device, 500 + i)))
        name = "synchronize"
        buf.synchronize()
    except Exception as e:  # noqa: BLE001 (reported in the RESULT, then the rank fails)
        traceback.print_exc()  # to the log, whole: the RESULT keeps 600 characters of the message
        result["error"] = f"{name}: {type(e).__name__}: {e}"[:600]
    finally:
        ag.unregister(buf)
        buf.close()
    group.close()
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if "error" not in result and all(c["ok"] for c in result["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
